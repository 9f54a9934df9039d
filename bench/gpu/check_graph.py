"""Device check of the graph helper's work (#25): CUDA graphs for decode, the sampler's host
syncs, profiling-based KV sizing, out-of-memory isolation.

    python3 -m bench.gpu.check_graph --out $OUT/graph.txt

Sub-checks (each guarded: one failing does not stop the others; all failures are listed at the
end and the exit status is 1 if any failed):
  tokens     graphs on vs off (enforce_eager): identical greedy tokens, float32, a tiny model
             and a SmolLM2-135M-shaped random model (16 layers)
  timing     decode step (forward + greedy sampling) graphs on vs off at batch 1 / 8 / 64,
             512 tokens of context each (printed; no pass/fail)
  syncs      host syncs per pure-decode engine step (torch.cuda.set_sync_debug_mode), graphs on
             and off; fails if the graph path syncs more than once
  memory     the profiling-based KV sizing (printed) and two workers' shares of 0.45 fitting
             inside 0.9 of the GPU
  oom        an injected OutOfMemoryError and a real one: only the request that cannot fit
             fails, its batch-mate's tokens are those of a run without it
Needs < 90 s on an H100 (a time budget skips what is left, reported as a failure).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

import torch

BUDGET_S = 80.0
T0 = time.perf_counter()
LINES: list[str] = []
FAILURES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def check(name: str, fn: Callable[[], None]) -> None:
    left = BUDGET_S - (time.perf_counter() - T0)
    if left <= 0:
        FAILURES.append(f"{name}: skipped (time budget of {BUDGET_S:.0f} s spent)")
        log(f"== {name}: SKIPPED (time budget)")
        return
    log(f"== {name}")
    t = time.perf_counter()
    try:
        fn()
        log(f"-- {name}: ok ({time.perf_counter() - t:.1f} s)")
    except Exception:  # noqa: BLE001 - report and go on
        tb = traceback.format_exc()
        log(tb)
        FAILURES.append(f"{name}: {tb.strip().splitlines()[-1]}")
        log(f"-- {name}: FAILED ({time.perf_counter() - t:.1f} s)")
    finally:
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context shows in the next check
            log(traceback.format_exc())


# ---- models ----------------------------------------------------------------------------------

MODELS: dict[str, str] = {}


def make_models(root: str) -> None:
    from disagg.model.tiny import write_tiny_checkpoint

    MODELS["tiny"] = write_tiny_checkpoint(
        os.path.join(root, "tiny"), vocab_size=512, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096)
    # SmolLM2-135M's shape (GQA 9/3, head_dim 64, vocab 49152, tied), 16 of its 30 layers.
    MODELS["smol16"] = write_tiny_checkpoint(
        os.path.join(root, "smol16"), vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=16, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
        dtype="bfloat16")


def engine(model: str, **opts):  # type: ignore[no-untyped-def]
    from disagg.engine import LLMEngine

    base = dict(device="cuda", dtype="float32", kv_cache_tokens=65536, max_num_tokens=4096,
                max_model_len=2048, cuda_graph_max_batch_size=64)
    base.update(opts)
    return LLMEngine.from_options(MODELS[model], **base)


def run_all(eng, reqs: dict) -> dict:  # type: ignore[no-untyped-def]
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- sub-checks ------------------------------------------------------------------------------


def check_tokens() -> None:
    from disagg.request import SamplingParams

    for name in ("tiny", "smol16"):
        outs = {}
        for eager in (False, True):
            eng = engine(name, enforce_eager=eager)
            runner = eng.runner
            if not eager:
                assert runner.graphs is not None and runner.graphs.captured, \
                    "graphs on but nothing captured"
                log(f"{name}: captured buckets {runner.graphs.captured}")
            vocab = eng.config.model.vocab_size
            lengths = [5, 17, 33, 64, 100, 129, 250, 400, 7, 60, 3]  # 11 rows: bucket 16
            # different lengths: the decode batch shrinks 11 -> 1 through several buckets
            reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=12 + 4 * i,
                                                ignore_eos=True))
                    for i, p in enumerate(prompts(vocab, lengths))}
            outs[eager] = {k: v.outputs[0].token_ids for k, v in run_all(eng, reqs).items()}
            if not eager:
                g = runner.graphs
                log(f"{name}: graph replays {g.replays}, padded eager runs {g.eager_runs}")
                assert g.replays > 0, "no decode step replayed a graph"
            del eng, runner
            torch.cuda.empty_cache()
        same = sum(outs[False][k] == outs[True][k] for k in outs[True])
        log(f"{name}: graphs on vs off, identical greedy sequences: {same}/{len(outs[True])}")
        for k in outs[True]:
            if outs[False][k] != outs[True][k]:
                a, b = outs[False][k], outs[True][k]
                first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                log(f"  {k}: first divergence at token {first}")
        assert same == len(outs[True]), f"{name}: graph and eager tokens differ"


def decode_sched(runner, b: int, ctx: int):  # type: ignore[no-untyped-def]
    from disagg.scheduler import ScheduledRequest, SchedulerOutput

    bs = runner.block_size
    nb = math.ceil((ctx + 1) / bs)
    vocab = runner.config.model.vocab_size
    reqs = [ScheduledRequest(f"t{i}", [(i * 13) % vocab], ctx, list(range(i * nb, (i + 1) * nb)),
                             True) for i in range(b)]
    return SchedulerOutput(reqs, b, b, [], b, 0)


def check_timing() -> None:
    from disagg.config import build_engine_config
    from disagg.request import SamplingParams
    from disagg.runner import ModelRunner
    from disagg.sampler import Sampler

    for name in ("tiny", "smol16"):
        times: dict[tuple[bool, int], float] = {}
        for eager in (True, False):
            cfg = build_engine_config(MODELS[name], device="cuda", dtype="bfloat16",
                                      kv_cache_tokens=64 * 17 * 32, max_model_len=2048,
                                      max_num_tokens=4096, cuda_graph_max_batch_size=64,
                                      enforce_eager=eager)
            runner = ModelRunner(cfg)
            sampler = Sampler()
            for b in (1, 8, 64):
                sched = decode_sched(runner, b, 512)
                params = [SamplingParams(temperature=0)] * b
                for _ in range(3):
                    _, logits = runner.execute(sched)
                    sampler.sample(logits, params, [0] * b)
                n = 30
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(n):
                    _, logits = runner.execute(sched)
                    sampler.sample(logits, params, [0] * b)  # ends with the step's host sync
                times[(eager, b)] = (time.perf_counter() - t) / n
            del runner
            torch.cuda.empty_cache()
        for b in (1, 8, 64):
            e, g = times[(True, b)], times[(False, b)]
            log(f"{name} bf16 decode step (forward + greedy sample), batch {b:2d}, ctx 512: "
                f"eager {e * 1e3:.3f} ms, graphs {g * 1e3:.3f} ms, speed-up {e / g:.2f}x")


def count_syncs(eng, steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                eng.step()
            counts.append(sum("synchroniz" in str(x.message) for x in w))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


def check_syncs() -> None:
    from bench.probes import ScheduleLog
    from disagg.request import SamplingParams

    mixes = {
        "greedy": [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 8,
        "mixed": [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=40,
                                 ignore_eos=True, logprobs=5),
                  SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=4, max_tokens=40,
                                 ignore_eos=True)] * 2,
    }
    worst = {}
    for eager in (False, True):
        eng = engine("smol16", enforce_eager=eager)
        vocab = eng.config.model.vocab_size
        for mix, params in mixes.items():
            ps = prompts(vocab, [20 + 9 * i for i in range(len(params))], seed=1)
            for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
                eng.add_request(f"{mix}{i}", p, sp)
            with ScheduleLog(eng) as sched:
                for _ in range(3):  # prefill (one step: 8 prompts fit) + warm decode steps
                    eng.step()
            assert sched.last is not None and sched.last.num_decodes == len(params), \
                "not a pure-decode step yet"
            counts = count_syncs(eng, 5)
            worst[(eager, mix)] = max(counts)
            log(f"{'eager ' if eager else 'graphs'} {mix:6s}: host syncs per decode step "
                f"{counts}")
            while eng.has_unfinished():
                eng.step()
        del eng
        torch.cuda.empty_cache()
    for mix in mixes:
        assert worst[(False, mix)] <= 1, f"graph path, {mix}: {worst[(False, mix)]} syncs/step"


def check_memory() -> None:
    from disagg.config import build_engine_config
    from disagg.runner import ModelRunner

    total = torch.cuda.mem_get_info()[1]
    for frac in (None, 0.45):
        opts = {} if frac is None else {"gpu_memory_fraction": frac}
        cfg = build_engine_config(MODELS["smol16"], device="cuda", dtype="bfloat16",
                                  max_num_tokens=8192, max_batch_size=256,
                                  cuda_graph_max_batch_size=64, **opts)
        t = time.perf_counter()
        runner = ModelRunner(cfg)
        prof = runner.memory_profile
        assert prof is not None and prof.profiled_tokens == 8192
        log(f"gpu_memory_fraction={frac} (None: default 0.9): {prof.describe()}; start-up "
            f"{time.perf_counter() - t:.1f} s")
        used = torch.cuda.memory_allocated()
        log(f"  allocated after start-up (weights + KV + graph outputs): {used / 2**30:.2f} GiB "
            f"= {used / total:.3f} of total")
        if frac is not None:
            budget = frac * total
            assert prof.weights + prof.activation_peak + prof.kv_bytes <= budget + 1, \
                "weights + activations + KV exceed the fraction"
            assert prof.kv_bytes > 0.5 * (budget - prof.weights - prof.activation_peak), \
                "KV cache far below the fraction's room"
        del runner
        torch.cuda.empty_cache()


def check_oom() -> None:
    from disagg.request import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # injected: every batch holding "big" fails
    # no prefix cache: every run of a prompt computes it again (needs its memory again)
    eng = engine("smol16", max_model_len=8192, max_num_tokens=8192, enable_prefix_caching=False)
    vocab = eng.config.model.vocab_size
    small, big = prompts(vocab, [30, 8000], seed=2)
    want = run_all(eng, {"small": (small, greedy)})["small"].outputs[0].token_ids
    real_execute = eng.runner.execute

    def fake(sched):  # type: ignore[no-untyped-def]
        if any(r.request_id == "big" for r in sched.scheduled):
            raise torch.cuda.OutOfMemoryError("injected")
        return real_execute(sched)

    eng.runner.execute = fake
    got = run_all(eng, {"small": (small, greedy), "big": (big, greedy)})
    eng.runner.execute = real_execute
    log(f"injected OOM: big -> {got['big'].error!r}; small ok: "
        f"{got['small'].error is None and got['small'].outputs[0].token_ids == want}")
    assert got["big"].error and "out of device memory" in got["big"].error
    assert got["small"].error is None and got["small"].outputs[0].token_ids == want

    # real: leave free memory between what "small" and what "big" (3000-token prefill) need
    def peak_of(reqs: dict) -> int:  # type: ignore[type-arg]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_all(eng, reqs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p_small = peak_of({"s0": (small, greedy)})
    p_big = peak_of({"b0": (big, greedy)})
    log(f"activation peaks: small {p_small / 2**20:.1f} MiB, big {p_big / 2**20:.1f} MiB")
    # the allocator rounds small requests up to 2-20 MiB segments: leave room for a few (the
    # first device run measured small 0.7 MiB, big 199 MiB for this model)
    leave = 2 * p_small + (48 << 20)
    assert p_big > leave + (64 << 20), "cannot separate the two by memory"
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda")
    try:
        got = run_all(eng, {"small": (small, greedy), "big": (big, greedy)})
    finally:
        del filler
        torch.cuda.empty_cache()
    log(f"real OOM (left {leave / 2**20:.0f} MiB free): big -> {got['big'].error!r:.200}; "
        f"small error {got['small'].error!r}")
    assert got["big"].error and "out of device memory" in got["big"].error
    assert got["small"].error is None and got["small"].outputs[0].token_ids == want
    # and the engine still serves after it
    again = run_all(eng, {"after": (small, greedy)})["after"]
    assert again.error is None and again.outputs[0].token_ids == want


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check_graph")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 1
    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as root:
        try:
            make_models(root)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
            FAILURES.append("models: could not write the checkpoints")
        else:
            log(f"checkpoints written ({time.perf_counter() - T0:.1f} s)")
            for name, fn in (("tokens", check_tokens), ("syncs", check_syncs),
                             ("oom", check_oom), ("memory", check_memory),
                             ("timing", check_timing)):
                check(name, fn)
    log(f"total {time.perf_counter() - T0:.1f} s")
    log("FAILURES:" if FAILURES else "all checks passed")
    for f in FAILURES:
        log(f"  {f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(LINES) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
