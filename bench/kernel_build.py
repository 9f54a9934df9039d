"""How long a worker's first start waits for the CPU kernels: the former build (a
``torch.utils.cpp_extension`` module, torch headers and pybind11, as ``disagg/model/kernels.py``
was at commit ``BASE``) against the current one (plain C++ shared libraries loaded with ctypes),
each from a clean cache directory; then whether the two builds compute bit-identical results,
how long a call of each takes and what that makes of the engine's decode step.

    python -m bench.kernel_build [--out bench/results/kernel_build.md]

Each build runs in a fresh Python process (torch imported first, not timed): the time is that of
the first ``paged_decode_kernel()`` plus ``small_linear_kernel()`` call, what a worker's first
start waits for (``--new-runs`` / ``--old-runs`` clean builds, the median reported); then a
second process times the same calls with the cache filled. The former
module and its sources are read from git (``git show BASE:...``) into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "8490cd0539869997511e36b06571493e09bb3329"  # the last commit with the torch-extension build
OLD_FILES = ("disagg/model/kernels.py", "disagg/model/csrc/paged_attention.cpp",
             "disagg/model/csrc/small_gemm.cpp")

# Child: import the kernels module (old: from a file; new: disagg.model.kernels), time the
# first calls, print JSON.
TIME_BUILD = """
import importlib.util, json, sys, time
import torch
path = sys.argv[1]
if path == "new":
    from disagg.model import kernels
else:
    spec = importlib.util.spec_from_file_location("old_kernels", path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
t0 = time.perf_counter()
ok = [kernels.paged_decode_kernel() is not None, kernels.small_linear_kernel() is not None]
print(json.dumps({"s": time.perf_counter() - t0, "ok": ok}))
"""

# Child: both builds (cached by now) on the same random inputs; counts of outputs that differ.
COMPARE = """
import importlib.util, json, os, sys
import torch
from disagg.model import kernels as new
na, nl = new.paged_decode_kernel(), new.small_linear_kernel()
spec = importlib.util.spec_from_file_location("old_kernels", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
os.environ["DISAGG_CACHE_DIR"] = sys.argv[2]  # the old build's cache
oa, ol = old.paged_decode_kernel(), old.small_linear_kernel()
g = torch.Generator().manual_seed(0)
cases = differ = 0
for threads in (1, torch.get_num_threads()):
    torch.set_num_threads(threads)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for s, hq, hkv, d, b in [(7, 8, 2, 64, 16), (3, 9, 3, 64, 32), (5, 4, 4, 33, 8)]:
            lens = torch.randint(1, 6 * b, (s,), generator=g)
            nb = int((lens.max() + b - 1) // b)
            kv = torch.randn(s * nb + 2, 3, 2, hkv, b, d, generator=g).to(dtype)[:, 1]
            tables = torch.randperm(s * nb + 2, generator=g)[: s * nb].view(s, nb)
            q = torch.randn(s, hq, d, generator=g).to(dtype)
            cases += 1
            differ += not torch.equal(oa(q, kv, tables, lens, 0.125),
                                      na(q, kv, tables, lens, 0.125))
    for n, k in [(576, 576), (192, 576), (1536, 576), (576, 1536), (33, 129), (7, 5)]:
        w = torch.randn(n, k, generator=g)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 8, 13, 32):
            x = torch.randn(m, k, generator=g)
            for b in (None, bias):
                cases += 1
                differ += not torch.equal(ol(x, w, b), nl(x, w, b))
# Time per call on one thread (min over 5 alternated rounds of 2000 calls): the Python side
# (checks, output allocation, the call) against the extension's C++ one.
import timeit
torch.set_num_threads(1)
w, x = torch.randn(8, 8, generator=g), torch.randn(1, 8, generator=g)
kv = torch.randn(3, 2, 3, 32, 64, generator=g)
q, tables, lens = torch.randn(1, 9, 64, generator=g), torch.tensor([[0]]), torch.tensor([1])
calls = {"linear 1 x 8 @ 8 x 8": (ol, nl, (x, w, None)),
         "attention 1 token, 9 heads": (oa, na, (q, kv, tables, lens, 0.125))}
us = {}
for name, (o, n, args) in calls.items():
    rounds = [[timeit.timeit(lambda f=f: f(*args), number=2000) / 2000 * 1e6 for f in (o, n)]
              for _ in range(5)]
    us[name] = [min(r[0] for r in rounds), min(r[1] for r in rounds)]

# The engine's decode step (tiny 8-layer model, prompt 256, one torch thread), its kernels
# switched between the two builds at every step: median step time of each.
import random, statistics, tempfile, time
from disagg import SamplingParams
from disagg.engine import LLMEngine
from disagg.model.tiny import write_tiny_checkpoint
SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048)
step_ms = {}
with tempfile.TemporaryDirectory() as tmp:
    model_dir = write_tiny_checkpoint(os.path.join(tmp, "m"), seed=0, **SIZES)
    for batch in (1, 8):
        eng = LLMEngine.from_options(model_dir, kv_cache_tokens=32768, max_model_len=1024)
        model, rng = eng.runner.model, random.Random(batch)
        for i in range(batch):
            eng.add_request(f"r{i}", [rng.randrange(2048) for _ in range(256)],
                            SamplingParams(max_tokens=220, ignore_eos=True))
        for _ in range(6):
            eng.step()
        times = ([], [])
        for i in range(200):
            side = i % 2
            model.workspace.decode_kernel = (oa, na)[side]
            model.use_linear_kernel((ol, nl)[side])
            t0 = time.perf_counter()
            eng.step()
            times[side].append(time.perf_counter() - t0)
        eng.shutdown()
        step_ms[batch] = [statistics.median(t) * 1e3 for t in times]
print(json.dumps({"cases": cases, "differ": differ, "call_us": us, "step_ms": step_ms}))
"""


def _child(code: str, args: list[str], cache: str) -> dict:
    env = dict(os.environ, DISAGG_CACHE_DIR=cache,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, check=True,
                         capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _old_module(tmp: Path) -> Path:
    """The former kernels.py and its sources, as at BASE, under ``tmp``."""
    for rel in OLD_FILES:
        dest = tmp / "old" / Path(rel).relative_to("disagg/model")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(subprocess.run(["git", "show", f"{BASE}:{rel}"], cwd=ROOT, check=True,
                                        capture_output=True).stdout)
    return tmp / "old" / "kernels.py"


def measure(runs: dict[str, int]) -> dict:
    """Clean builds (``runs[label]`` each, a fresh cache directory each), a cached load, and the
    comparison of the two builds."""
    with tempfile.TemporaryDirectory(prefix="kernel-build-") as tmp:
        old = _old_module(Path(tmp))
        res: dict = {"load_before": os.getloadavg()[0]}
        for label, arg in (("new", "new"), ("old", str(old))):
            caches = [str(Path(tmp) / f"cache-{label}-{i}") for i in range(runs[label])]
            res[label] = {"clean": [_child(TIME_BUILD, [arg], c) for c in caches]}
            res[label]["cached"] = _child(TIME_BUILD, [arg], caches[0])
            shutil.move(caches[0], str(Path(tmp) / f"cache-{label}"))
        res["compare"] = _child(COMPARE, [str(old), str(Path(tmp) / "cache-old")],
                                str(Path(tmp) / "cache-new"))
        res["load_after"] = os.getloadavg()[0]
    return res


def report(res: dict, argv: list[str]) -> str:
    import torch

    def clean_s(label: str) -> float:
        return statistics.median(c["s"] for c in res[label]["clean"])

    def row(label: str, what: str) -> str:
        r = res[label]
        assert all(all(c["ok"]) for c in [*r["clean"], r["cached"]]), f"{label}: {r}"
        each = ", ".join(f"{c['s']:.1f}" for c in r["clean"])
        return f"| {what} | {clean_s(label):.1f} ({each}) | {r['cached']['s']:.3f} |"

    cmp = res["compare"]
    speedup = clean_s("old") / clean_s("new")
    return "\n".join([
        "# CPU kernel build time (first start)", "",
        "Produced by `python -m bench.kernel_build`; the section below is the script's own "
        "output.", "",
        f"## kernel_build ({time.strftime('%Y-%m-%d')})", "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
        f"torch {torch.__version__}, compiler `{_compiler_version()}`; load average before "
        f"{res['load_before']:.2f}, after {res['load_after']:.2f}",
        f"- command: `python {' '.join(argv)}`",
        "- time of the first `paged_decode_kernel()` + `small_linear_kernel()` call in a fresh "
        "process (torch already imported): from a clean cache directory (median of the runs, "
        "each run), then with the cache filled",
        "",
        "| build | clean cache s (runs) | cached s |", "|---|---|---|",
        row("old", f"torch extension (`torch.utils.cpp_extension.load`, commit {BASE[:7]})"),
        row("new", "plain C++ shared libraries, ctypes (this tree)"),
        "",
        f"First start {speedup:.0f}x faster. Same inputs through both builds "
        f"(attention: float32/float64/bfloat16/float16, 3 layouts; linear: 6 shapes x 8 row "
        f"counts x with/without bias; 1 and {torch.get_num_threads()} threads): "
        f"{cmp['cases'] - cmp['differ']} of {cmp['cases']} outputs bit-identical.", "",
        "Time per call of tiny inputs on one thread, what the Python side costs (checks, output "
        "allocation, the ctypes call) against the extension's C++ side (min of 5 rounds of 2000 "
        "calls):", "",
        "| call | torch extension us | ctypes us |", "|---|---|---|",
        *[f"| {name} | {o:.1f} | {n:.1f} |" for name, (o, n) in cmp["call_us"].items()], "",
        "What that costs a decode step of the engine (tiny model: 8 layers, hidden 512; prompt "
        "256; one torch thread; kernels switched between the builds at every step, median of "
        "100 steps each):", "",
        "| batch | torch extension ms | ctypes ms | change |", "|---|---|---|---|",
        *[f"| {b} | {o:.2f} | {n:.2f} | {(n / o - 1) * 100:+.1f}% |"
          for b, (o, n) in cmp["step_ms"].items()], ""])


def _compiler_version() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_build",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_build.md"))
    ap.add_argument("--new-runs", type=int, default=3, help="clean builds of the current kernels")
    ap.add_argument("--old-runs", type=int, default=1,
                    help="clean builds of the former extension (slow: torch headers)")
    args = ap.parse_args()
    text = report(measure({"new": args.new_runs, "old": args.old_runs}), sys.argv)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
