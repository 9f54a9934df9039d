"""Building the compiled CPU kernels of ``model/kernels.py``, without torch.

Torch-free so that ``disagg launch`` can build them (``prebuild``) while it imports the model,
before any worker starts: on a first start the workers then find them in the cache instead of
compiling them on their critical path (``bench/first_start.py`` measures the difference).

Each kernel is built to ``$DISAGG_CACHE_DIR`` (default ``~/.cache/disagg``)
``/kernels/<source stem>-<key>/``, the key hashing its sources, the compiler and its flags and
this CPU's model and flags (``-march=native``), so a cache shared between different machines
never loads a foreign build and an edited source is rebuilt. A build already there is loaded
directly, without any lock: it only ever appears whole, compiled into a temporary file and
renamed into place. Concurrent builds (several workers starting at once) are serialised by
``build_lock``, an ``flock`` that the OS drops when its holder dies; a process that waits for it
finds the library built and loads it. A build that is not cached logs a warning first (the
first start of a worker is never silent) and its time after.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from disagg.env import CPU_KERNELS, kernel_cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class KernelSource:
    """One kernel: its library name, source, what the logs call it, and the PyTorch path a
    failed build falls back to."""

    lib_name: str
    source: Path
    what: str
    fallback: str


# By DISAGG_CPU_KERNELS name (disagg.env.CPU_KERNEL_NAMES).
KERNEL_SOURCES = {
    "attention": KernelSource("disagg_paged_attention", CSRC / "paged_attention.cpp",
                              "paged attention", "the PyTorch gather path"),
    "linear": KernelSource("disagg_small_gemm", CSRC / "small_gemm.cpp", "small-M linear",
                           "torch's GEMM"),
    "elementwise": KernelSource("disagg_elementwise", CSRC / "elementwise.cpp",
                                "elementwise (RMSNorm, RoPE + K/V write)", "PyTorch ops"),
    "decoder": KernelSource("disagg_decoder", CSRC / "decoder.cpp", "decode stack",
                            "the layer-by-layer decode"),
}

# The compiler (first found on PATH) and its flags: those of the former torch extension build
# (-O3 -march=native -fopenmp), for a shared library.
COMPILERS = ("c++", "g++", "clang++")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300.0
LOCK_NAME = "disagg-build.lock"


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


def _compiler() -> str | None:
    """The C++ compiler's path, or None when there is none."""
    for name in COMPILERS:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _sources(source: Path) -> list[Path]:
    """What a build of ``source`` reads: it, the shared headers of csrc/ and the sources it
    includes (``decoder.cpp`` includes other kernels' ``.cpp``)."""
    included = re.findall(r'^#include "([^"]+\.cpp)"', source.read_text(), re.MULTILINE)
    return [source, *sorted(CSRC.glob("*.h")), *(CSRC / name for name in included)]


def _build_dir(source: Path, compiler: str) -> Path:
    """``<cache>/kernels/<stem>-<key>`` (created), the key hashing the sources, the compiler
    and its flags, and this CPU."""
    parts = [p.read_bytes() for p in _sources(source)]
    parts += [compiler.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    path = Path(kernel_cache_root()) / "kernels" / f"{source.stem}-{key[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str = "CPU kernels") -> Iterator[None]:
    """Hold the build directory's lock (an flock, released by the OS if its holder dies);
    says so when another process holds it, rather than waiting silently."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds race, each into its own temporary file
        yield
        return
    with open(build_dir / LOCK_NAME, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process building the %s (%s) ...", what,
                           build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another live process builds
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(path: Path) -> ctypes.PyDLL | None:
    """The library at ``path``, or None when there is none (or it does not load)."""
    if not path.is_file():
        return None
    try:
        return ctypes.PyDLL(str(path))  # PyDLL: the GIL stays held, as in an extension
    except OSError as e:
        logger.warning("cannot load %s (%s); rebuilding it", path, e)
        return None


def _compile(compiler: str, source: Path, target: Path) -> None:
    """Compile ``source`` into ``target`` atomically: a temporary file, renamed."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *COMPILE_FLAGS, str(source), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _build(name: str, source: Path, what: str, fallback: str) -> ctypes.PyDLL | None:
    """The library built from ``source`` (cached), or None (with a warning) on failure."""
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError(f"no C++ compiler ({', '.join(COMPILERS)}) on PATH")
        build_dir = _build_dir(source, compiler)
        target = build_dir / f"{name}.so"
        lib = _load(target)
        if lib is not None:
            return lib
        with build_lock(build_dir, f"CPU {what} kernel"):
            lib = _load(target)  # built by the process that held the lock
            if lib is not None:
                return lib
            for stale in build_dir.glob(f".{name}-*.so"):  # a killed builder's temporary file
                stale.unlink(missing_ok=True)
            logger.warning("building CPU kernels (first start): the %s kernel, %s ...", what,
                           source.name)
            t0 = time.monotonic()
            _compile(compiler, source, target)
            logger.info("built the CPU %s kernel in %.1f s (cached in %s)", what,
                        time.monotonic() - t0, build_dir)
            lib = _load(target)
            if lib is None:
                raise RuntimeError(f"{target} does not load")
            return lib
    except Exception as e:  # no compiler, a failed build: the PyTorch path serves
        logger.warning("CPU %s kernel unavailable (%s); using %s", what,
                       str(e).splitlines()[0] if str(e) else repr(e), fallback)
        return None


def build_kernel(name: str) -> ctypes.PyDLL | None:
    """Kernel ``name`` (a ``KERNEL_SOURCES`` key) built (or taken from the cache) and loaded;
    None, with a warning, when it cannot be."""
    k = KERNEL_SOURCES[name]
    return _build(k.lib_name, k.source, k.what, k.fallback)


def missing() -> list[str]:
    """The kernels ``DISAGG_CPU_KERNELS`` enables that are not in the cache yet (none when
    there is no compiler: nothing would be built)."""
    compiler = _compiler()
    if compiler is None:
        return []
    return [name for name, k in KERNEL_SOURCES.items() if kernels_enabled(name)
            and not (_build_dir(k.source, compiler) / f"{k.lib_name}.so").is_file()]


def prebuild() -> dict[str, bool]:
    """Build every kernel ``DISAGG_CPU_KERNELS`` enables into the cache (each says so when it
    is not cached yet); by name, whether it is there. Never raises: a kernel that cannot be
    built is the workers' fallback, they say so again."""
    return {name: build_kernel(name) is not None for name in KERNEL_SOURCES
            if kernels_enabled(name)}
