"""Where one decode step's time goes (issue 44, item 1): the Llama-3-8B shape, random bf16
weights on the device, pure-decode steps at batch 1 and 64 with ~1k context.

    python3 -m bench.gpu.profile_decode --out $OUT/profile.md          # on a GPU (~60 s)
    python3 -m bench.gpu.profile_decode --quick --out /tmp/p.md        # CPU: code paths only

For each batch, in one engine:

- **step**: wall time of ``engine.step()`` (median of ``--steps`` pure-decode steps) split into
  its host phases, timed by wrapping the engine's own methods (schedule, the graph's input
  load, the forward's launch, sampling, the scheduler's update, detokenize + outputs). The
  step ends with the sampler reading the tokens back, so the phase holding that read waits for
  the device: it is reported apart as *waiting for the device*.
- **device**: the forward of the same bucket replayed back to back (CUDA graph replays, or
  eager forwards without graphs) timed with CUDA events: the device's time for one step when
  no host work sits between steps, against the HBM roofline (weights + KV read once, at the
  device-to-device copy bandwidth measured in this run).
- **kernels**: ``torch.profiler`` over a few real steps: every GPU kernel and copy classified
  (GEMM, attention, norm, RoPE, activation, sampling, copies, other), its time per step, the
  GPU's busy time (the union of kernel intervals) against the steps' wall time (the rest is the
  device idling on the host), and the largest kernels by name.

Written by the script, machine described; ratios against references measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench.gpu.bench import (
    _build_llama8b_engine,
    copy_seconds,
    free_device,
    gb,
    kv_bytes_per_token,
    machine,
    make_plan,
    model_config,
    param_bytes,
    runner_features,
)
from bench.probes import ScheduleLog
from disagg import SamplingParams

# Kernel classes, first match wins (lower-case substrings of the kernel's name).
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("paged", "attn", "attention", "flash", "sdpa", "fmha", "_decode_split",
                   "_decode_reduce", "_prefill")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk",
              "wgmma", "sm90")),
    ("RoPE + KV write", ("rope", "rotary", "index_put", "neg_kernel", "catarraybatchedcopy")),
    ("norm", ("rms", "norm")),
    ("activation", ("silu", "gelu", "act_and_mul", "swiglu")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "exponential",
                  "nan_to_num", "cumsum")),
    ("copies", ("memcpy", "memset", "copy", "index", "scatter", "gather", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "mul", "add")),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


class PhaseTimer:
    """Wall time spent inside wrapped methods, per step (nested wrappers are timed on their own,
    so a phase is reported both alone and inside its caller)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        if obj is None or not hasattr(obj, attr):
            return
        orig = getattr(obj, attr)
        acc = self.step

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[phase] += time.perf_counter() - t0

        setattr(obj, attr, timed)
        self._undo.append(lambda: setattr(obj, attr, orig) if attr not in vars(type(obj))
                          else delattr(obj, attr))

    def end_step(self) -> None:
        self.steps.append(dict(self.step))
        self.step.clear()

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def medians(self) -> dict[str, float]:
        names = {k for s in self.steps for k in s}
        return {k: statistics.median(s.get(k, 0.0) for s in self.steps) for k in names}


def dev_is_cuda() -> bool:
    return torch.cuda.is_available()


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def start_decodes(eng: Any, batch: int, ctx: int, max_tokens: int, vocab: int, seed: int) -> None:
    """Add ``batch`` requests of ``ctx`` random tokens and step until every one decodes."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"prof-{seed}-{i}", torch.randint(3, vocab, (ctx,), generator=g).tolist(),
                        params)
    with ScheduleLog(eng) as log:
        for _ in range(10_000):
            eng.step()
            s = log.last
            if s is not None and len(s.scheduled) == batch and s.num_decodes == batch:
                return
    raise RuntimeError(f"batch {batch} never reached pure decode")


@contextlib.contextmanager
def phases(eng: Any) -> Iterator[PhaseTimer]:
    pt = PhaseTimer()
    runner = eng.runner
    graphs = getattr(runner, "graphs", None)
    pt.wrap(eng.scheduler, "schedule", "schedule")
    pt.wrap(runner, "execute", "forward launch (execute)")
    pt.wrap(graphs, "load", "graph input load")
    pt.wrap(runner, "prepare_inputs", "eager input build")
    pt.wrap(eng, "_run_step", "execute + sample")
    pt.wrap(eng.sampler, "sample", "sample (incl. waiting for the device)")
    pt.wrap(eng.scheduler, "update_from_output", "scheduler update")
    pt.wrap(eng, "_outputs_of_step", "detokenize + outputs")
    # async scheduling: the launch of the next plan, and the wait for a plan's tokens
    pt.wrap(eng, "_launch_next", "schedule + launch the next plan (async)")
    pt.wrap(eng.sampler, "sample_deferred", "sampling launch (async)")
    if dev_is_cuda():
        pt.wrap(torch.cuda.Event, "synchronize", "waiting for the device (async: event)")
    try:
        yield pt
    finally:
        pt.restore()


def timed_steps(eng: Any, n: int, dev: str, pt: PhaseTimer | None = None) -> list[float]:
    """Wall time of each of ``n`` calls of ``engine.step()``, back to back: the device is
    synchronised before the first only, so under async scheduling a call's time is the
    pipeline's period (each call waits for the plan the call before launched)."""
    out = []
    sync(dev)
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t0)
        if pt is not None:
            pt.end_step()
    sync(dev)
    return out


def device_forward_s(eng: Any, batch: int, dev: str, reps: int = 20) -> tuple[float, str]:
    """Device time of one forward of ``batch`` decode rows with no host work between them:
    the captured graph of the bucket replayed ``reps`` times (or, without graphs, eager
    forwards of the padded static batch), CUDA events around all of them."""
    graphs = getattr(eng.runner, "graphs", None)
    if graphs is None:
        return float("nan"), "no decode graphs in this runner"
    b = graphs.bucket_for(batch)
    captured = b in graphs.captured
    how = f"graph of bucket {b} replayed" if captured else f"eager bucket {b}"

    def fn() -> torch.Tensor:
        return graphs.rerun(b)
    # The static buffers still hold the last step's rows: replays rewrite the same KV slots.
    with torch.inference_mode():
        for _ in range(3):
            fn()
        sync(dev)
        if not dev.startswith("cuda"):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) / reps, how
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps, how


def kernel_profile(step: Callable[[], Any], steps: int, dev: str) -> dict[str, Any]:
    """Kernels of ``steps`` calls of ``step`` (an engine step) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if dev.startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    sync(dev)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(dev)
        wall = time.perf_counter() - t0
    kernels = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        tr = e.time_range
        kernels.append((e.name, tr.start, tr.end))
    by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, s, t in kernels:
        by_class[classify(name)][0] += (t - s) / 1e6
        by_class[classify(name)][1] += 1
        by_name[name][0] += (t - s) / 1e6
        by_name[name][1] += 1
    # GPU busy: union of the kernel intervals (microseconds)
    busy, cur_s, cur_e = 0.0, None, None
    for _, s, t in sorted((k for k in kernels), key=lambda k: k[1]):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    return {"wall_s": wall / steps, "busy_s": busy / 1e6 / steps, "launches": len(kernels) / steps,
            "by_class": {k: (v[0] / steps, v[1] / steps) for k, v in by_class.items()},
            "by_name": sorted(((v[0] / steps, v[1] / steps, k) for k, v in by_name.items()),
                              reverse=True)[:14]}


def profile_batch(eng: Any, batch: int, plan: Any, cfg: Any, wbytes: float, bw: float,
                  dev: str, steps: int) -> list[str]:
    mode = "async scheduling" if eng.async_scheduling else "synchronous"
    lines = [f"### Batch {batch}, {mode} engine loop", ""]
    total_steps = 6 + 2 * steps + 8
    start_decodes(eng, batch, plan.decode_ctx, total_steps + 4, cfg.vocab_size, seed=batch)
    timed_steps(eng, 3, dev)  # warm
    plain = timed_steps(eng, steps, dev)
    with phases(eng) as pt:
        wrapped = timed_steps(eng, steps, dev, pt)
    med = pt.medians()
    step_s = statistics.median(plain)
    dev_s, how = device_forward_s(eng, batch, dev)
    ctx_tokens = plan.decode_ctx + 3 + 2 * steps
    nbytes = wbytes + batch * ctx_tokens * kv_bytes_per_token(cfg, 2)
    roof = nbytes / bw
    extra = max(0.0, step_s - dev_s)
    lines.append(f"Step wall time (median of {steps}, no wrappers): **{step_s * 1e3:.2f} ms**; "
                 f"device time of the forward alone ({how}, back to back): "
                 f"**{dev_s * 1e3:.2f} ms**; HBM roofline of the bytes it reads ({gb(nbytes)}): "
                 f"{roof * 1e3:.2f} ms. Step at {roof / step_s:.0%} of the roofline, the forward "
                 f"alone at {roof / dev_s:.0%}; the step spends {extra * 1e3:.2f} ms "
                 f"({extra / step_s:.0%}) beyond the forward's device time.")
    lines += ["", "| host phase (median per step, wrapped methods; nested phases also inside "
              "their caller) | ms |", "|---|---|"]
    for k in sorted(med, key=lambda k: -med[k]):
        lines.append(f"| {k} | {med[k] * 1e3:.3f} |")
    lines.append(f"| whole step (the wrapped run) | {statistics.median(wrapped) * 1e3:.3f} |")
    with contextlib.suppress(Exception):
        timed_steps(eng, 2, dev)
    try:
        kp = kernel_profile(eng.step, 4, dev)
        lines += kernel_lines(kp, "torch.profiler over 4 engine steps")
        graphs = getattr(eng.runner, "graphs", None)
        if dev.startswith("cuda") and graphs is not None and kp["launches"] < 50:
            # kernels inside graph replays not traced: the same bucket's forward, eager
            b = graphs.bucket_for(batch)
            with torch.inference_mode():
                ke = kernel_profile(lambda: graphs.rerun(b, eager=True), 4, dev)
            lines += kernel_lines(ke, f"graph kernels not traced; torch.profiler over 4 eager "
                                      f"forwards of bucket {b} (no sampling)")
    except Exception as e:  # noqa: BLE001 (a diagnostic: keep the rest)
        lines += ["", f"torch.profiler failed: `{e!r}`"]
    # let the batch finish
    for _ in range(100_000):
        if not eng.has_unfinished():
            break
        eng.step()
    lines.append("")
    return lines


def kernel_lines(kp: dict[str, Any], what: str) -> list[str]:
    lines: list[str] = []
    if kp is not None:
        wall, busy = kp["wall_s"], kp["busy_s"]
        lines += ["", f"{what}: wall {wall * 1e3:.2f} ms per step (profiler "
                  f"on), GPU busy {busy * 1e3:.2f} ms ({busy / wall:.0%} of the wall time; the "
                  f"rest the device waits for the host), {kp['launches']:.0f} kernels and copies "
                  f"per step.", "",
                  "| kernel class | ms per step | share of GPU busy | kernels per step |",
                  "|---|---|---|---|"]
        for cls, (s, n) in sorted(kp["by_class"].items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {cls} | {s * 1e3:.3f} | {s / busy if busy else 0:.0%} | {n:.0f} |")
        lines += ["", "| largest kernels (ms per step, count per step) | ms | count |",
                  "|---|---|---|"]
        for s, n, name in kp["by_name"]:
            lines.append(f"| `{name[:110]}` | {s * 1e3:.3f} | {n:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.profile_decode",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU: code paths only)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="sync,async",
                    help="engine loops to profile, each batch in each: sync, async")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("sync", "async") for m in modes):
        ap.error(f"--modes: a comma list of sync, async; got {args.modes!r}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    plan = make_plan(args.quick or dev == "cpu")
    batches = tuple(int(b) for b in args.batches.split(","))
    plan.decode_batches = batches
    plan.decode_steps = 2 * args.steps + 20
    head = [f"# Where a decode step's time goes ({time.strftime('%Y-%m-%d')})", "",
            *[f"- {m}" for m in machine(dev)],
            f"- command: `python -m bench.gpu.profile_decode {' '.join(sys.argv[1:])}`",
            "- written by the script", ""]
    lines: list[str] = []
    cfg = model_config(plan.big)
    try:
        bw = 2 * plan.copy_bytes / copy_seconds(plan.copy_bytes, dev, reps=10)
        lines.append(f"Device-to-device copy bandwidth measured in this run: {bw / 1e12:.3g} TB/s "
                     f"(bytes read + written), the roofline's bandwidth.")
        lines.append("")
        with tempfile.TemporaryDirectory(prefix="disagg-prof-") as tmp:
            llm, build_s = _build_llama8b_engine(plan, dev, Path(tmp))
            try:
                eng = llm.engine
                wbytes = param_bytes(eng.runner.model, exclude_embedding=True)
                shape = "Llama-3-8B shape" if plan.big["hidden_size"] >= 4096 else "tiny shape"
                lines.append(f"Engine: {shape}, random bf16 weights, built in {build_s:.1f} s; "
                             f"runner: "
                             f"{runner_features(llm)}; weights read per step {gb(wbytes)}.")
                lines.append("")
                for b in batches:
                    for mode in modes:
                        # between batches nothing is in flight: the loop's mode may change
                        eng.set_async_scheduling(mode == "async")
                        try:
                            lines += profile_batch(eng, b, plan, cfg, wbytes, bw, dev,
                                                   args.steps)
                        except Exception:  # noqa: BLE001
                            tb = traceback.format_exc()
                            print(tb, flush=True)
                            lines += [f"### Batch {b} ({mode}): failed", "", "```", tb[-2500:],
                                      "```", ""]
                    free_device(dev)
                    Path(args.out).write_text("\n".join(head + lines) + "\n")
            finally:
                llm.shutdown()
    except Exception:  # noqa: BLE001
        tb = traceback.format_exc()
        print(tb, flush=True)
        lines += ["## failed", "", "```", tb[-3000:], "```"]
        Path(args.out).write_text("\n".join(head + lines) + "\n")
        return 1
    text = "\n".join(head + lines) + "\n"
    Path(args.out).write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
