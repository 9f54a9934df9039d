"""Optional compiled CPU kernels, built on first use with the local C++ compiler.

- ``paged_decode_kernel()``: the decode attention of ``csrc/paged_attention.cpp`` (reads the
  paged KV cache in place instead of gathering it);
- ``small_linear_kernel()``: ``csrc/small_gemm.cpp``, ``x @ w.T (+ bias)`` for a few rows
  (decode batches), where BLAS is slow; ``small_linear_applies`` says when to use it.

Each returns None when it cannot be had: not on a CPU, no compiler / ninja, a failed build, or
switched off by ``DISAGG_CPU_KERNELS``: ``0`` (or false/no/off) disables both, a comma list
such as ``attention`` or ``linear`` enables only those named, unset / ``1`` enables all.
Callers then use the pure-PyTorch path, which gives the same results (tests compare the two).

Each kernel is built to ``$DISAGG_CACHE_DIR`` (default ``~/.cache/disagg``)
``/kernels/<source stem>-<key>``, the key hashing its source, the torch version and this
CPU's model and flags (``-march=native``), so a cache shared between different machines never
loads a foreign build and an edited source is rebuilt. Concurrent builds (several workers
starting at once) are serialised by ``build_lock``: an ``flock`` that the OS drops when its
holder dies. torch's own build lock is a plain file that a builder killed mid-build leaves
behind, after which every later build waits for it forever; under our lock no other builder
can be running, so such a file is stale and is removed. A build already there is imported
directly, without any lock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from disagg.env import CPU_KERNELS, kernel_cache_root

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_ATTENTION_SOURCE = _CSRC / "paged_attention.cpp"
_LINEAR_SOURCE = _CSRC / "small_gemm.cpp"
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        torch.Tensor]
# (x [M, K], w [N, K], bias [N] | None) -> x @ w.T (+ bias), float32, [M, N]
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# Up to this many rows the small-M kernel beats torch's GEMM (one Zen 3 core: 1.1-2.4x for
# 1..32 rows with K = 512..4096; at 48 rows from +4% to -4% by shape, even at 64; see
# docs/DESIGN.md section 5); more rows (prefill) go to F.linear.
SMALL_LINEAR_MAX_ROWS = 32


def kernels_enabled(name: str | None = None) -> bool:
    """Whether ``DISAGG_CPU_KERNELS`` allows kernel ``name`` (None: any kernel at all)."""
    names = CPU_KERNELS.get()
    return bool(names) if name is None else name in names


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build_dir(source: Path) -> Path:
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), torch.__version__.encode(), _cpu_signature().encode()])).hexdigest()
    root = Path(kernel_cache_root())
    path = root / "kernels" / f"{source.stem}-{key[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory's lock; clear torch's lock file left by a killed builder."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock alone
        yield
        return
    with open(build_dir / "disagg-build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another live process builds
        try:
            stale = build_dir / TORCH_LOCK_NAME
            if stale.exists():
                logger.warning("removing the stale kernel build lock %s (its builder died)",
                               stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_built(name: str, build_dir: Path) -> Any | None:
    """The module already built in ``build_dir`` (its key pins the source), or None.

    Imported directly rather than through ``load``, which takes torch's build lock even to find
    the build up to date: a process killed while holding that lock (a worker SIGKILLed during
    startup) leaves a lock file behind that makes every later start wait forever."""
    import importlib.util

    path = build_dir / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:  # half-written by a concurrent build: build (or wait) as usual
        return None


def _build(name: str, source: Path, what: str, fallback: str) -> Any | None:
    """The extension module built from ``source``, or None (with a warning) on failure."""
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir(source)
        module = _import_built(name, build_dir)
        if module is not None:
            return module
        with build_lock(build_dir):
            return load(
                name=name, sources=[str(source)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path serves
        logger.warning("CPU %s kernel unavailable (%s); using %s", what,
                       str(e).splitlines()[0] if str(e) else repr(e), fallback)
        return None


@functools.lru_cache(maxsize=1)
def paged_decode_kernel() -> DecodeKernel | None:
    """The compiled decode attention (built once per process, cached on disk), or None."""
    if not kernels_enabled("attention"):
        return None
    module = _build("disagg_paged_attention", _ATTENTION_SOURCE, "paged attention",
                    "the PyTorch gather path")
    return None if module is None else module.paged_decode_attention


@functools.lru_cache(maxsize=1)
def small_linear_kernel() -> LinearKernel | None:
    """The compiled small-M linear (built once per process, cached on disk), or None.

    Only for the inputs ``small_linear_applies`` accepts; it raises on others.
    """
    if not kernels_enabled("linear"):
        return None
    module = _build("disagg_small_gemm", _LINEAR_SOURCE, "small-M linear", "torch's GEMM")
    return None if module is None else module.small_linear


def small_linear_applies(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> bool:
    """Whether ``small_linear_kernel()(x, weight, bias)`` serves ``F.linear(x, weight, bias)``:
    float32 CPU tensors, ``x`` 2-D with 1..SMALL_LINEAR_MAX_ROWS rows and a dense last dim, a
    contiguous weight (and bias), and no autograd to record."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SMALL_LINEAR_MAX_ROWS
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.stride(1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                  and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))
