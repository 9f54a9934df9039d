"""Chat templates shipped with disagg (package data, read with ``--chat-template FILE``).

``smollm2_tools.jinja``: SmolLM2-Instruct's ChatML turns with tool calls in the hermes style
(the tools listed in the system turn inside ``<tools></tools>``, calls as ``<tool_call>``
blocks, results as ``<tool_response>`` blocks), read back by ``--tool-call-parser hermes``.
A chat without tools renders exactly as SmolLM2's own template (which renders no tools).
``disagg launch`` gives it to the packaged ``smollm2`` model's workers (``MODEL_DEFAULTS``)
unless the YAML sets ``chat_template`` or ``tool_call_parser``.
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))
SMOLLM2_TOOLS = os.path.join(DIR, "smollm2_tools.jinja")

# A packaged model (disagg.model.gguf.PACKAGED_MODELS) -> the worker options its template
# needs: the template file and the parser that reads the calls it asks for.
MODEL_DEFAULTS: dict[str, dict[str, str]] = {
    "smollm2": {"chat_template": SMOLLM2_TOOLS, "tool_call_parser": "hermes"},
}
