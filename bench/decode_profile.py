"""Where a single-stream decode step's time goes on CPU, by category (issue 43, item 2), and the
offline process's memory (item 3); this tree against a git revision, in one run.

A decode step of one request on a small model is mostly its linears (the weights are read once
a step); everything else in the step (norms, RoPE, the K/V write, attention, SwiGLU's
elementwise work, per-layer Python, the sampler, the scheduler, detokenization) is overhead
that the CPU kernels for quantized weights leave as the larger part. Each measurement:

- an ``LLMEngine`` on the model (default ``smollm2``: SmolLM2-135M, 30 layers), one request,
  greedy, ``ignore_eos``, ``--threads`` torch threads, KV room for the run only
  (``kv_cache_tokens``), prefix caching off: the engine of ``bench.engine_vs_llamacpp``'s
  disagg child;
- a ``--ctx``-token prompt of seeded random ids, its prefill, 8 warm-up decode steps, then
  ``--steps`` decode steps timed bare (``engine.step()`` wall time each: the tokens/s row),
  then ``--steps`` more with every category's functions wrapped (``CATEGORIES``): each wrapper
  times its call and the time is charged to the innermost wrapped call (exclusive time), so a
  step's categories add up to the wrapped step; what no wrapper covers is charged to the
  enclosing one ("model: other" is the decoder's own Python: per-layer calls, views, splits,
  the embedding; "engine: other" the step's bookkeeping and output objects). A wrapper costs
  about a microsecond a call (the wrapped step is slower than the bare one by that);
- the request's output tokens hashed: both trees must produce the same greedy tokens.

``--baseline REV``: the ``disagg`` package of git revision ``REV`` (``git archive``) is measured
the same way, by this checkout's script, in child processes alternating with this tree's
(``--rounds`` each; medians of the per-run medians). Categories a tree lacks functions for
(a fused kernel the other has not) are empty there.

Memory (``--rss``): per tree one child that builds ``LLM(model)`` with default options (the
default KV cache size), generates ``--rss-tokens`` tokens after a 32-token prompt and reports
``VmHWM`` (peak RSS), RSS after the load (anonymous / file-backed), the KV cache's bytes and
the weights' bytes.

    python -m bench.decode_profile [--model smollm2] [--ctx 32 512] [--steps 64]
                                   [--rounds 3] [--threads 2] [--baseline REV] [--rss]
                                   [--out bench/results/decode_profile.md]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.baseline import checkout, cpu_line, git, machine_busy_s, wait_quiet

ROOT = Path(__file__).resolve().parents[1]

LM_HEAD = "LM head (+ float32 logits)"
# Categories whose wrapped callees are charged to them (the LM head is a linear too).
ABSORBING = {LM_HEAD}
# (category, [(module, "Class.method" or "function"), ...]) in report order. A function
# missing from a tree is skipped there. Functions are patched where they are looked up:
# module globals for functions called by name, class attributes for methods.
CATEGORIES: list[tuple[str, list[tuple[str, str]]]] = [
    ("linears of the layers (q/k/v, o, gate/up, down)",
     [("disagg.model.llama", "linear"), ("disagg.model.llama", "Linear.forward"),
      ("disagg.model.llama", "FusedRows.matmul"),
      ("disagg.model.llama", "QuantizedRows.matmul")]),
    (LM_HEAD, [("disagg.model.llama", "LlamaForCausalLM.compute_logits")]),
    ("RMSNorm (+ residual add)",
     [("disagg.model.llama", "RMSNorm.add_norm"), ("disagg.model.llama", "rms_norm_reference"),
      ("disagg.model.cpu_ops", "ElementwiseKernel.add_rms_norm")]),
    ("RoPE (cos/sin, rotation)",
     [("disagg.model.llama", "RotaryEmbedding.forward"), ("disagg.model.llama", "apply_rope")]),
    ("RoPE + K/V write, fused", [("disagg.model.cpu_ops", "ElementwiseKernel.rope_store")]),
    ("K/V write", [("disagg.model.attention", "write_kv")]),
    ("attention (paged decode)", [("disagg.model.llama", "paged_attention")]),
    ("SwiGLU silu(gate) * up", [("disagg.model.llama", "GatedMLP.silu_mul")]),
    ("model: other (decoder Python, views, embedding)",
     [("disagg.model.llama", "LlamaForCausalLM.forward")]),
    ("step inputs (ModelRunner.prepare_inputs)", [("disagg.runner", "ModelRunner.prepare_inputs")]),
    ("runner: other (execute)", [("disagg.runner", "ModelRunner.execute")]),
    ("sampler",
     [("disagg.sampler", "Sampler.sample"), ("disagg.sampler", "Sampler.sample_deferred")]),
    ("schedule", [("disagg.scheduler", "Scheduler.schedule")]),
    ("scheduler update", [("disagg.scheduler", "Scheduler.update_from_output")]),
    ("detokenize", [("disagg.tokenizer", "IncrementalDetokenizer.update")]),
    ("engine: other (bookkeeping, outputs)", [("disagg.engine.llm_engine", "LLMEngine.step")]),
    ("compiled decode stack (every layer in one call)",
     [("disagg.model.cpu_decoder", "CpuDecoder.forward")]),
]
MODEL_CATS = {c for c, _ in CATEGORIES[:9]} | {CATEGORIES[-1][0]}
# The compiled kernels whose C entry points are timed apart (KERNEL_PART rows).
KERNEL_GETTERS = [("disagg.model.kernels", "small_linear_kernel"),
                  ("disagg.model.kernels", "paged_decode_kernel"),
                  ("disagg.model.kernels", "q8_0_kernel"),
                  ("disagg.model.kernels", "quant_kernel"),
                  ("disagg.model.cpu_decoder", "_library"),
                  ("disagg.model.cpu_ops", "elementwise_kernel")]
RSS_SETUPS = {False: "default options", True: "engine_vs_llamacpp's setup"}
KERNEL_PART = ": inside the compiled kernel"
TOTAL = ": total"
IN_KERNELS = "inside the compiled kernels (C++), all categories"
OUTSIDE = "outside the compiled kernels (Python, PyTorch ops, ctypes)"
STEP = "whole step (wrapped: the sum of the rows above)"
BARE = "whole step, bare (no wrappers)"
TOK_S = "decode tokens/s (bare steps)"


# -- the child: one tree, one measurement -------------------------------------------------------


class Clock:
    """Exclusive time per category of the calls of one step: a stack of open calls, each
    charged its own time less its wrapped callees'."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [category, start, time of wrapped callees]
        self._undo: list[Callable[[], None]] = []
        self.wrapped: dict[str, list[str]] = defaultdict(list)

    def wrap(self, module_name: str, path: str, category: str) -> None:
        try:
            mod = importlib.import_module(module_name)
        except ModuleNotFoundError:  # a module this tree does not have
            return
        owner: Any = mod
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
            if owner is None:
                return
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None or not callable(fn):
            return
        stack, acc, now = self._stack, self.acc, time.perf_counter

        def wrapper(*a: Any, **k: Any) -> Any:
            if stack and stack[-1][0] in ABSORBING:
                return fn(*a, **k)
            frame = [category, now(), 0.0]
            stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                stack.pop()
                dt = now() - frame[1]
                acc[category] += dt - frame[2]
                if stack:
                    stack[-1][2] += dt

        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, fn))
        self.wrapped[category].append(f"{module_name}.{path}")

    def wrap_kernels(self, module_name: str, getter: str) -> None:
        """The ctypes entry points of a compiled kernel object (``getter()``, the cached
        instance the model calls): their time is charged to the calling category's
        ``KERNEL_PART`` row, so each category shows its Python apart from its C++."""
        try:
            obj = getattr(importlib.import_module(module_name), getter)()
        except (ModuleNotFoundError, AttributeError):  # not in this tree
            return
        if obj is None:
            return
        stack, acc, now = self._stack, self.acc, time.perf_counter
        for name, fn in list(vars(obj).items()):
            if not (callable(fn) and hasattr(fn, "argtypes") and hasattr(fn, "restype")):
                continue  # not a ctypes function

            def wrapper(*a: Any, _fn: Any = fn) -> Any:
                t0 = now()
                try:
                    return _fn(*a)
                finally:
                    dt = now() - t0
                    acc[(stack[-1][0] if stack else "?") + KERNEL_PART] += dt
                    if stack:
                        stack[-1][2] += dt

            setattr(obj, name, wrapper)
            self._undo.append(lambda obj=obj, name=name, fn=fn: setattr(obj, name, fn))
            self.wrapped["compiled kernels (C ABI calls)"].append(
                f"{module_name}.{getter}().{name}")

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()  # (the wrappers hold this dict)
        return out

    def unwrap(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


@contextmanager
def wrapped() -> Iterator[Clock]:
    clock = Clock()
    try:
        for category, targets in CATEGORIES:
            for module_name, path in targets:
                clock.wrap(module_name, path, category)
        for module_name, getter in KERNEL_GETTERS:
            clock.wrap_kernels(module_name, getter)
        yield clock
    finally:
        clock.unwrap()


def _status_mib(*keys: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) / 1024
    return out


def child_profile(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a.threads)
    from disagg import SamplingParams
    from disagg.engine import LLMEngine
    from disagg.model import kernels

    warm, ctx = 8, a.ctx[0]
    max_tokens = 1 + warm + 2 * a.steps
    room = -(-(ctx + max_tokens + 1) // 32) * 32
    eng = LLMEngine.from_options(a.model, max_batch_size=1, kv_cache_tokens=room,
                                 max_model_len=room, enable_prefix_caching=False)
    vocab = eng.config.model.vocab_size
    rng = random.Random(ctx)
    prompt = [rng.randrange(100, vocab) for _ in range(ctx)]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    tokens: list[int] = []

    def step() -> None:
        for out in eng.step():
            tokens[:] = out.outputs[0].token_ids

    step()  # the prefill (and the first token)
    for _ in range(warm):
        step()
    bare = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        bare.append(time.perf_counter() - t0)
    steps: list[dict[str, float]] = []
    with wrapped() as clock:
        for _ in range(a.steps):
            clock.take()
            t0 = time.perf_counter()
            step()
            total = time.perf_counter() - t0
            s = clock.take()
            s[STEP] = total
            steps.append(s)
        names = dict(clock.wrapped)
    while eng.has_unfinished():
        step()
    if len(tokens) != max_tokens:
        raise RuntimeError(f"{len(tokens)} tokens, not {max_tokens}")
    for s in steps:
        for c, _ in CATEGORIES:
            s[c + TOTAL] = s.get(c, 0.0) + s.get(c + KERNEL_PART, 0.0)
        s[IN_KERNELS] = sum(s.get(c + KERNEL_PART, 0.0) for c, _ in CATEGORIES)
        s[OUTSIDE] = s[STEP] - s[IN_KERNELS]
    cats = [c + part for c, _ in CATEGORIES for part in ("", KERNEL_PART, TOTAL)]
    med = {c: statistics.median(s.get(c, 0.0) for s in steps) * 1e3
           for c in [*cats, STEP, IN_KERNELS, OUTSIDE]}
    med[BARE] = statistics.median(bare) * 1e3
    med[TOK_S] = len(bare) / sum(bare)
    return {"ms": med, "wrapped": names, "digest": hashlib.sha256(
        json.dumps(tokens).encode()).hexdigest()[:16],
            "kernels": [k for k, v in kernels.status().items() if v],
            "threads": torch.get_num_threads()}


def child_rss(a: argparse.Namespace) -> dict[str, Any]:
    """An offline process's memory: ``LLM(model)`` with default options (``--rss-kv 0``) or
    with ``bench.engine_vs_llamacpp``'s single-stream setup (one sequence, KV room and
    max_model_len ``--rss-kv`` tokens, no prefix cache), ``--rss-tokens`` greedy tokens after
    a 32-token prompt, then (when it fits) a 2048-token prefill."""
    import torch

    torch.set_num_threads(a.threads)
    from disagg import LLM, SamplingParams

    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    before = _status_mib(*keys)
    opts: dict[str, Any] = {}
    if a.rss_kv:
        opts = dict(max_batch_size=1, kv_cache_tokens=a.rss_kv, max_model_len=a.rss_kv,
                    enable_prefix_caching=False)
    t0 = time.perf_counter()
    llm = LLM(a.model, **opts)
    load_s = time.perf_counter() - t0
    loaded = _status_mib(*keys)
    runner = llm.engine.runner
    kv = runner.kv_cache
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in runner.model.parameters()}
    vocab = llm.engine.config.model.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(32)]
    greedy = SamplingParams(temperature=0, max_tokens=a.rss_tokens, ignore_eos=True)
    out = llm.generate([prompt], greedy)
    decoded = _status_mib(*keys)
    prefill = None
    if a.rss_kv and a.rss_kv > 2048:
        long = [rng.randrange(100, vocab) for _ in range(2048)]
        llm.generate([long], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prefill = _status_mib(*keys)
    return {"start": before, "loaded": loaded, "decoded": decoded, "prefill": prefill,
            "end": _status_mib(*keys), "load_s": load_s,
            "kv_mib": kv.numel() * kv.element_size() / 2**20,
            "kv_tokens": runner.num_blocks * runner.block_size,
            "weights_mib": sum(params.values()) / 2**20,
            "digest": hashlib.sha256(json.dumps(out[0].outputs[0].token_ids).encode())
            .hexdigest()[:16], "free_gib": _meminfo_gib("MemAvailable")}


def _meminfo_gib(key: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


# -- the parent ----------------------------------------------------------------------------------


def _run_child(tree: str, argv: list[str], threads: int) -> dict[str, Any]:
    """``python -m bench.decode_profile argv`` in a folder whose ``disagg`` is ``tree``'s
    package (``-m`` puts the working directory first on ``sys.path``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    res = subprocess.run([sys.executable, "-m", "bench.decode_profile", *argv], env=env,
                         cwd=tree, capture_output=True, text=True, check=False, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{res.stderr[-4000:]}")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _tree_dir(tmp: str, name: str, package: str) -> str:
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    os.symlink(package, os.path.join(d, "disagg"))
    return d


def _resolve_model(model: str) -> str:
    if os.path.isdir(model):
        return model
    from disagg.model.gguf import fetch_model  # the registry of `disagg model fetch`

    return str(fetch_model(model))


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def report(a: argparse.Namespace, runs: dict[str, dict[int, list[dict[str, Any]]]],
           rss: dict[str, dict[str, Any]], facts: dict[str, Any]) -> str:
    trees = list(runs)
    lines = ["# Where a single-stream decode step's time goes on CPU (before / after)", "",
             f"Written by `{facts['command']}` on {facts['when']} (method in its docstring).",
             "", f"- {facts['cpu']}",
             f"- RAM {facts['ram_gib']:.1f} GiB; Python {platform.python_version()}, torch "
             f"{facts['torch']}; {a.threads} torch threads; disagg CPU kernels: "
             f"{', '.join(facts['kernels']) or 'none'}",
             f"- shared machine: before each child the script waits (at most "
             f"{a.quiet_wait:.0f} s) for a 2 s spell with at most 0.5 core busy; "
             f"{facts['noise']}; the whole run took {facts['wall_s'] / 60:.1f} min",
             f"- model: `{a.model}` ({facts['model_desc']})",
             f"- trees: {facts['trees']}",
             f"- {a.rounds} run(s) per tree and prompt length, alternating; each run: prefill,"
             f" 8 warm-up steps, {a.steps} bare steps, {a.steps} wrapped steps; cells: median "
             "over the runs of each run's median ms per step"]
    digests = {t: {ctx: {r["digest"] for r in rs} for ctx, rs in by.items()}
               for t, by in runs.items()}
    same = all(len(set().union(*(digests[t][ctx] for t in trees))) == 1 for ctx in a.ctx)
    lines.append("- greedy output tokens (hash per tree and prompt length): "
                 + "; ".join(f"{t}: " + ", ".join(f"{ctx}: {'/'.join(sorted(digests[t][ctx]))}"
                                                   for ctx in a.ctx) for t in trees)
                 + (" - identical" if same else " - **DIFFERENT**"))
    for ctx in a.ctx:
        lines += ["", f"## Decode after a {ctx}-token prompt", "",
                  "Per category: its time per step in all, and of that the time inside the "
                  "compiled kernels' C entry points (C++; the rest is Python, PyTorch ops and "
                  "the ctypes calls around them). ms per step, median.", ""]
        head = "| category | " + " | ".join(f"{t}: all | {t}: in C++" for t in trees)
        if len(trees) == 2:
            head += " | all: after / before"
        lines += [head + " |", "|---" * (2 * len(trees) + 1 + (len(trees) == 2)) + "|"]

        def med(t: str, key: str, ctx: int = ctx) -> float:
            return statistics.median(r["ms"].get(key, 0.0) for r in runs[t][ctx])

        def ratio(before: float, after: float) -> str:
            return f"{after / before:.2f}x" if before > 0 else "-"

        for c, _ in CATEGORIES:
            cells, alls = [], []
            for t in trees:
                alls.append(med(t, c + TOTAL))
                k = med(t, c + KERNEL_PART)
                cells += [_fmt(alls[-1]), _fmt(k) if k > 0 else "-"]
            if len(trees) == 2:
                cells.append(ratio(*alls))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        for key in (STEP, IN_KERNELS, OUTSIDE, BARE, TOK_S):
            vals = [med(t, key) for t in trees]
            cells = [x for v in vals for x in (_fmt(v), "")]
            if len(trees) == 2:
                cells.append(ratio(*vals))
            lines.append(f"| **{key}** | " + " | ".join(cells) + " |")
        model_ms = {t: sum(med(t, c + TOTAL) for c in MODEL_CATS) for t in trees}
        lines += ["", "Forward of the model (the rows from the linears to 'model: other'): "
                  + ", ".join(f"{t} {model_ms[t]:.2f} ms" for t in trees) + "."]
    lines += ["", "## The wrapped functions, by category and tree", ""]
    for t in trees:
        w = runs[t][a.ctx[0]][0]["wrapped"]
        lines.append(f"- {t}: " + "; ".join(f"{c}: `{'`, `'.join(w[c])}`"
                                            for c, _ in CATEGORIES if c in w))
    if rss:
        lines += ["", "## Memory of an offline single-stream process", "",
                  f"Two setups per tree: `LLM(model)` with default options (the default KV "
                  f"cache size), and `bench.engine_vs_llamacpp`'s disagg setup (one sequence, "
                  f"KV room and max_model_len {a.rss_kv} tokens, no prefix cache); each "
                  f"generates {a.rss_tokens} greedy tokens after a 32-token prompt, the second "
                  "then prefills a 2048-token prompt. MiB from /proc/self/status (VmHWM: peak "
                  "RSS; RssAnon / RssFile: its anonymous and file-backed parts, the latter "
                  "including mapped checkpoint pages). One run each.", ""]
        cols = list(rss)
        lines += ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

        def at(r: dict[str, Any], phase: str, key: str) -> str:
            return "-" if r.get(phase) is None else f"{r[phase][key]:.0f}"

        spec: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
            ("**peak RSS (VmHWM) at the end**", lambda r: f"**{r['end']['VmHWM']:.0f}**"),
            ("peak RSS after the load", lambda r: at(r, "loaded", "VmHWM")),
            ("RSS after the load", lambda r: at(r, "loaded", "VmRSS")),
            ("&nbsp; anonymous", lambda r: at(r, "loaded", "RssAnon")),
            ("&nbsp; file-backed", lambda r: at(r, "loaded", "RssFile")),
            ("RSS after the decode", lambda r: at(r, "decoded", "VmRSS")),
            ("&nbsp; file-backed", lambda r: at(r, "decoded", "RssFile")),
            ("peak RSS after the 2048-token prefill", lambda r: at(r, "prefill", "VmHWM")),
            ("RSS before the load (Python, torch, disagg imported)",
             lambda r: at(r, "start", "VmRSS")),
            ("KV cache", lambda r: f"{r['kv_mib']:.0f}"),
            ("KV cache (tokens)", lambda r: f"{r['kv_tokens']}"),
            ("weights (parameter storages, each once)", lambda r: f"{r['weights_mib']:.0f}"),
            ("load time (s)", lambda r: f"{r['load_s']:.2f}"),
            ("MemAvailable at the end (GiB)", lambda r: f"{r['free_gib']:.1f}"),
            ("greedy tokens (hash)", lambda r: r["digest"])]
        for name, get in spec:
            lines.append(f"| {name} | " + " | ".join(get(rss[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="checkpoint folder, or a name `disagg model fetch` knows")
    ap.add_argument("--ctx", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", help="git revision measured as 'before'")
    ap.add_argument("--rss", action="store_true", help="also the offline memory children")
    ap.add_argument("--rss-tokens", type=int, default=128)
    ap.add_argument("--rss-kv", type=int, default=2304,
                    help="KV room of the second memory setup (engine_vs_llamacpp's)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait at most for a quiet machine before each child")
    ap.add_argument("--max-others", type=float, default=0.3,
                    help="cores other processes may use during a child before it runs again")
    ap.add_argument("--attempts", type=int, default=4, help="runs of a child at most")
    ap.add_argument("--out", help="the report (markdown); a .json with the raw runs beside it")
    ap.add_argument("--child", choices=("profile", "rss"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = child_profile(a) if a.child == "profile" else child_rss(a)
        print("RESULT " + json.dumps(res), flush=True)
        return
    a.model = _resolve_model(a.model)
    head = git("rev-parse", "--short", "HEAD")
    dirty = sorted({ln.split(maxsplit=1)[1] for ln in
                    git("status", "--porcelain", "disagg").splitlines() if ln.strip()})
    this = f"this tree ({head}" + (" + changes" if dirty else "") + ")"
    facts: dict[str, Any] = {
        "command": "python -m bench.decode_profile " + " ".join(argv or sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_line()}
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as tmp:
        trees = {}
        rev = ""
        if a.baseline:  # resolved now: HEAD may move while this runs (a shared tree)
            rev = git("rev-parse", "--short", a.baseline) or a.baseline
            trees[f"before ({rev})"] = _tree_dir(
                tmp, "before", os.path.join(checkout(rev, tmp), "disagg"))
        trees[this] = _tree_dir(tmp, "after", str(ROOT / "disagg"))
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {t: defaultdict(list) for t in trees}
        base = ["--model", a.model, "--threads", str(a.threads)]
        busy0, t0 = machine_busy_s(), time.monotonic()
        attempts: list[dict[str, Any]] = []

        def measured(name: str, d: str, argv: list[str]) -> dict[str, Any]:
            """The child's result, run again (up to --attempts in all) while other processes
            used more than --max-others cores during it."""
            for i in range(a.attempts):
                waited = wait_quiet(a.quiet_wait)
                b0, c0, w0 = machine_busy_s(), _children_cpu(), time.monotonic()
                res = _run_child(d, [*base, *argv], a.threads)
                own = _children_cpu() - c0
                others = max(0.0, (machine_busy_s() - b0 - own) / (time.monotonic() - w0))
                ok = others <= a.max_others or i == a.attempts - 1
                attempts.append({"tree": name, "argv": argv, "waited_s": round(waited, 1),
                                 "others_cores": round(others, 3), "child_cpu_s": own,
                                 "used": ok, "bare_ms": res.get("ms", {}).get(BARE)})
                print(f"{name} {' '.join(argv)}: others {others:.2f} cores"
                      + (f", bare step {res['ms'][BARE]:.2f} ms" if "ms" in res else "")
                      + ("" if ok else " (disturbed: again)"), file=sys.stderr, flush=True)
                if ok:
                    res["others_cores"] = others
                    return res
            raise AssertionError("unreachable")

        for _ in range(a.rounds):
            for ctx in a.ctx:
                for name, d in trees.items():
                    runs[name][ctx].append(measured(name, d, [
                        "--child", "profile", "--ctx", str(ctx), "--steps", str(a.steps)]))
        rss: dict[str, dict[str, Any]] = {}
        if a.rss:
            for kv in (0, a.rss_kv):
                for name, d in trees.items():
                    rss[f"{name}, {RSS_SETUPS[bool(kv)]}"] = measured(name, d, [
                        "--child", "rss", "--rss-tokens", str(a.rss_tokens),
                        "--rss-kv", str(kv)])
        facts["wall_s"] = time.monotonic() - t0
        facts["machine_cores_busy"] = (machine_busy_s() - busy0) / facts["wall_s"]
    used = [x for x in attempts if x["used"]]
    facts["attempts"] = attempts
    facts["noise"] = (f"{len(attempts)} child runs, {len(attempts) - len(used)} of them run "
                      f"again (other processes used more than {a.max_others} cores during "
                      f"them); in the runs used, others used at most "
                      f"{max(x['others_cores'] for x in used):.2f} cores (median "
                      f"{statistics.median(x['others_cores'] for x in used):.2f})"
                      + ("" if all(x["others_cores"] <= a.max_others for x in used)
                         else "; **some runs used were disturbed (attempts exhausted)**"))
    first = runs[this][a.ctx[0]][0]
    facts["kernels"] = first["kernels"]
    import torch

    facts["torch"] = torch.__version__
    facts["ram_gib"] = _meminfo_gib("MemTotal")
    cfg = json.loads(Path(a.model, "config.json").read_text())
    facts["model_desc"] = (f"{cfg.get('num_hidden_layers')} layers, hidden "
                           f"{cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}, "
                           f"{cfg.get('torch_dtype', '?')}")
    facts["trees"] = "; ".join(
        [f"before = `git archive {a.baseline}` ({rev}, when the run started)"]
        if a.baseline else []) + ("; " if a.baseline else "") + (
        f"after = this working tree, commit {head}" + (
            f" with uncommitted changes to {', '.join(dirty)}" if dirty else "") + (
        " (a working tree shared with other work in progress: every change listed is in the "
        "after column, whoever made it)"))
    text = report(a, runs, rss, facts)
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(
            {"facts": facts, "runs": runs, "rss": rss}, indent=1))
    print(text)


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (they are waited for)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
