"""How a served ``.gguf`` file's weights are held: the ``gguf_weights`` option's values
(stdlib only: ``config`` and the GGUF import both read it, without an import cycle and without
loading numpy or torch)."""

# The first is the default: the quantized linears kept quantized on CPU
# (disagg/model/gguf_weights.py), or the float32 import (every tensor dequantized, as
# transformers loads the file).
GGUF_WEIGHT_MODES = ("quantized", "float32")
