"""Optional compiled CPU kernels, built on first use with the local C++ compiler.

``paged_decode_kernel()`` returns the decode attention of ``csrc/paged_attention.cpp`` (reads
the paged KV cache in place instead of gathering it), or None when it cannot be had: not on a
CPU, no compiler / ninja, a failed build, or ``DISAGG_CPU_KERNELS=0``. Callers then use the
pure-PyTorch path, which gives the same results (tests compare the two).

The build goes to ``$DISAGG_CACHE_DIR`` (default ``~/.cache/disagg``) ``/kernels/<key>``, the
key hashing the source, the torch version and this CPU's model and flags (``-march=native``),
so a cache shared between different machines never loads a foreign build. Concurrent builds
(several workers starting at once) are serialised by torch's build lock.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        torch.Tensor]


def kernels_enabled() -> bool:
    return os.environ.get("DISAGG_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build_dir() -> Path:
    key = hashlib.sha256(b"\0".join([
        _SOURCE.read_bytes(), torch.__version__.encode(), _cpu_signature().encode()])).hexdigest()
    root = Path(os.environ.get("DISAGG_CACHE_DIR", Path.home() / ".cache" / "disagg"))
    path = root / "kernels" / key[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def paged_decode_kernel() -> DecodeKernel | None:
    """The compiled kernel (built once per process, cached on disk), or None."""
    if not kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="disagg_paged_attention", sources=[str(_SOURCE)],
            build_directory=str(_build_dir()),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path serves
        logger.warning("CPU paged attention kernel unavailable (%s); using the PyTorch "
                       "gather path", str(e).splitlines()[0] if str(e) else repr(e))
        return None
    return module.paged_decode_attention
