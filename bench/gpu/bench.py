"""Every speed target of issue 25, side by side in one run, each beside its reference measured in
the same run on the same device; writes ``bench/results/gpu.md`` (``--out``).

Sections (each guarded: a failure is recorded with its traceback and the next one runs; the
report is rewritten after every section, so a run cut short keeps what it measured):

- ``refs``: device-to-device copy bandwidth (the HBM roofline's bandwidth) and the bf16 matmul
  rate of this GPU;
- ``llama8b``: Llama-3-8B shape, random bf16 weights made on the device (disagg's own
  ``LlamaForCausalLM`` from a ``ModelConfig``, no checkpoint on disk): engine decode step at
  batch 1 and 64 with 1k context against the roofline of the bytes it reads (weights + KV),
  and an 8k-token prefill against the matmul rate;
- ``smol``: SmolLM2-135M shape (random weights written as a safetensors checkpoint with the
  tiny tokenizer), engine decode tokens/s at batch 1 and 64 against ``transformers`` with a
  static cache and ``torch.compile`` (its generate auto-compiles the decode forward), same
  weights;
- ``agreement``: bf16 engine against bf16 ``transformers``, greedy, 64 tokens: share of prompts
  with identical tokens and the median first divergence (tiny model and SmolLM2 shape);
- ``kv``: KV transfer of 2k / 8k tokens of the 8B shape between two processes (TCP and UCX)
  against a device-to-device copy of the same bytes;
- ``serve``: 1 context + 1 generation worker process against 2 aggregated worker processes,
  all on the one GPU behind the router, at a few request rates (TTFT, TPOT, goodput).

    python -m bench.gpu.bench --out bench/results/gpu.md            # on a GPU (~5 min on H100)
    python -m bench.gpu.bench --device cpu --quick --out /tmp/g.md   # tiny shapes: code paths

Engine options other work adds (CUDA graphs, a GPU memory fraction, Triton attention) are
looked up at run time; the report says which were present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.probes import ScheduleLog
from disagg import LLM, SamplingParams
from disagg.config import ModelConfig
from disagg.model.llama import LlamaForCausalLM
from disagg.procs import (
    NotHealthy,
    free_ports,
    log_tail,
    spawn,
    stop_all,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "bench-gpu-secret"
NAME = "m"

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json) and SmolLM2-135M shapes.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 rope_theta=500000.0, tie_word_embeddings=False)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, tie_word_embeddings=True)
# --quick (CPU): the same code paths on shapes a 2-core machine runs in seconds.
QUICK_BIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                 tie_word_embeddings=False)
QUICK_SMOL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0,
                  tie_word_embeddings=True)


@dataclass
class Plan:
    """Sizes of one run (full on a GPU, tiny with --quick)."""

    big: dict[str, Any]
    smol: dict[str, Any]
    copy_bytes: int
    mm: tuple[int, int, int]
    decode_ctx: int
    decode_batches: tuple[int, ...]
    decode_steps: int
    prefill_tokens: int
    hf_prompt: int
    hf_new: tuple[int, int]
    agree_prompts: int
    agree_tokens: int
    kv_tokens: tuple[int, ...]
    kv_layers: int
    kv_reps: int
    serve_isl: int
    serve_osl: int
    serve_rates: tuple[float, ...]
    serve_seconds: float
    slo_ms: dict[str, float] = field(default_factory=dict)


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan(big=QUICK_BIG, smol=QUICK_SMOL, copy_bytes=16 << 20, mm=(256, 256, 512),
                    decode_ctx=64, decode_batches=(1, 4), decode_steps=6, prefill_tokens=256,
                    hf_prompt=16, hf_new=(4, 12), agree_prompts=4, agree_tokens=16,
                    kv_tokens=(64, 256), kv_layers=2, kv_reps=3, serve_isl=32, serve_osl=8,
                    serve_rates=(2.0,), serve_seconds=3.0,
                    slo_ms={"ttft": 5000.0, "tpot": 500.0})
    return Plan(big=LLAMA3_8B, smol=SMOLLM2_135M, copy_bytes=1 << 30, mm=(8192, 4096, 14336),
                decode_ctx=1024, decode_batches=(1, 64), decode_steps=24, prefill_tokens=8192,
                hf_prompt=128, hf_new=(16, 80), agree_prompts=12, agree_tokens=64,
                kv_tokens=(2048, 8192), kv_layers=32, kv_reps=5, serve_isl=1024, serve_osl=128,
                serve_rates=(4.0, 16.0, 48.0), serve_seconds=8.0,
                slo_ms={"ttft": 500.0, "tpot": 30.0})


# ---------------------------------------------------------------------------------- helpers


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of ``reps`` calls of ``fn`` (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def free_device(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def model_config(shape: dict[str, Any], max_pos: int = 32768) -> ModelConfig:
    return ModelConfig(architecture="llama", head_dim=shape["hidden_size"]
                       // shape["num_attention_heads"], rms_norm_eps=1e-5,
                       max_position_embeddings=max_pos, torch_dtype="bfloat16", **shape)


def hf_config(shape: dict[str, Any], max_pos: int = 32768) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
            "hidden_act": "silu", "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
            "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 0, "eos_token_id": [1], "torch_dtype": "bfloat16",
            "use_cache": True, **shape}


def random_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 seed: int = 0) -> LlamaForCausalLM:
    """disagg's ``LlamaForCausalLM`` with random weights made on ``device`` (std 1/sqrt(fan_in),
    norms 1): built on the meta device, cast, materialised empty, filled in place."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    model.tie_weights()
    model.fuse_projections()  # as load_model does
    model.eval()
    return model


@contextlib.contextmanager
def random_weights(seed: int = 0) -> Iterator[None]:
    """While active, the engine's runner builds its model with random weights on its device
    instead of reading the checkpoint (same signature as ``disagg.model.loader.load_model``)."""
    import disagg.runner as runner_mod

    original = runner_mod.load_model

    def load(model_dir: str, config: ModelConfig | None = None, dtype: Any = torch.float32,
             device: Any = "cpu", layer_range: Any = None, tp_rank: int = 0,
             tp_size: int = 1, expert_parallel: bool = False) -> LlamaForCausalLM:
        from disagg.model.loader import as_torch_dtype

        if layer_range not in (None, (0, config.num_hidden_layers)) or tp_size != 1:
            raise NotImplementedError("random weights: a single rank only")
        return random_model(config, as_torch_dtype(dtype), device, seed)

    runner_mod.load_model = load
    try:
        yield
    finally:
        runner_mod.load_model = original


def write_config_dir(path: Path, shape: dict[str, Any], max_pos: int = 32768) -> str:
    """A model folder the engine can start from (config + the tiny tokenizer), no weights:
    used under ``random_weights``."""
    from disagg.model.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(str(path), vocab_size=512)
    (path / "model.safetensors").unlink()
    (path / "config.json").write_text(json.dumps(hf_config(shape, max_pos), indent=2))
    return str(path)


def write_checkpoint(path: Path, shape: dict[str, Any], seed: int = 0) -> str:
    """A complete bf16 safetensors checkpoint of ``shape`` with the tiny tokenizer (the weights
    ``transformers`` and the engine both load)."""
    from disagg.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        str(path), vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], max_position_embeddings=8192,
        tie_word_embeddings=shape["tie_word_embeddings"], rope_theta=shape["rope_theta"],
        seed=seed, dtype="bfloat16")


def engine_option_names() -> set[str]:
    from disagg import config as cfg

    return set(getattr(cfg, "ENGINE_OPTION_NAMES", ()))


def features() -> list[str]:
    """Which of the GPU work's features this tree has (looked up, not assumed)."""
    out = []
    try:
        import disagg.model.triton_attention  # noqa: F401

        out.append("Triton paged attention module: present")
    except Exception as e:  # noqa: BLE001
        out.append(f"Triton paged attention module: absent ({type(e).__name__}: {e})")
    names = engine_option_names()
    gpu_opts = sorted(n for n in names if re.search(r"graph|eager|gpu|memory", n))
    out.append("GPU engine options: " + (", ".join(gpu_opts) or "none"))
    return out


def runner_features(llm: LLM) -> str:
    """How the runner runs decode steps: CUDA graph buckets captured, or eager."""
    runner = getattr(llm.engine, "runner", None)
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return "no CUDA graphs (eager steps)"
    buckets = getattr(graphs, "sizes", None)
    captured = getattr(graphs, "captured", None)  # the batch sizes with a captured graph
    desc = f"CUDA graphs for decode, buckets {list(buckets) if buckets else '?'}"
    if isinstance(captured, (dict, list, tuple, set)):
        desc += f", {len(captured)} captured"
    return desc


def param_bytes(model: torch.nn.Module, exclude_embedding: bool) -> int:
    """Bytes of the parameters one decode step reads (the embedding table is read by row only,
    unless tied to the LM head)."""
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight if model.model.embed_tokens is not None else None
    tied = model.lm_head is not None and embed is not None and model.lm_head.weight is embed
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and p is embed and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize


def engine_decode(llm: LLM, batch: int, ctx: int, steps: int, vocab: int,
                  seed: int) -> dict[str, float]:
    """Median wall time of the engine's pure-decode steps at ``batch`` requests whose prompts
    are ``ctx`` random tokens (``engine.step()``: schedule, forward, sample, outputs)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"dec-{seed}-{i}",
                        torch.randint(3, vocab, (ctx,), generator=g).tolist(), params)
    times, ctx_seen = [], []
    graphs = getattr(getattr(eng, "runner", None), "graphs", None)
    replays0 = getattr(graphs, "replays", 0)
    with ScheduleLog(eng) as log:
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            sched = log.last
            if (sched is not None and len(sched.scheduled) == batch
                    and sched.num_decodes == batch):
                times.append(dt)
                ctx_seen.append(statistics.mean(r.start_pos + 1 for r in sched.scheduled))
                if len(times) == 6 and os.environ.get("BENCH_PROFILE") and dev_is_cuda():
                    profile_steps(eng, batch)
    if len(times) < 3:
        raise RuntimeError(f"only {len(times)} pure decode steps at batch {batch}")
    keep = times[2:]  # first decode steps after a prefill include lazy set-up
    return {"step_s": statistics.median(keep), "best_s": min(keep), "steps": len(keep),
            "mean_ctx": statistics.mean(ctx_seen[2:]),
            "graph_replays": getattr(graphs, "replays", 0) - replays0}


def dev_is_cuda() -> bool:
    return torch.cuda.is_available()


def profile_steps(eng: Any, batch: int, steps: int = 3) -> None:
    """Print (bench.log only) where the GPU time of a few decode steps goes: the kernels by
    total time, and GPU busy time against the steps' wall time (the gap is host work)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                if eng.has_unfinished():
                    eng.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        busy = sum(e.self_device_time_total for e in evs) / 1e6
        print(f"profile, batch {batch}, {steps} decode steps: wall {wall * 1e3:.2f} ms, GPU "
              f"kernels {busy * 1e3:.2f} ms ({sum(e.count for e in evs)} launches)", flush=True)
        for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:15]:
            print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms/step  {e.count // steps:5d}x"
                  f"  {e.key[:90]}", flush=True)
    except Exception as e:  # noqa: BLE001 (a diagnostic only)
        print(f"profile failed: {e!r}", flush=True)


# ---------------------------------------------------------------------------------- report


class Report:
    def __init__(self, path: str | None, args: argparse.Namespace) -> None:
        self.path, self.args = path, args
        self.head: list[str] = []
        self.sections: list[tuple[str, list[str]]] = []
        self.results: dict[str, Any] = {}
        self.t0 = time.monotonic()

    def add(self, title: str, lines: list[str]) -> None:
        self.sections.append((title, lines))
        print(f"\n## {title}\n" + "\n".join(lines), flush=True)
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        out = [*self.head, ""]
        sections = self.sections
        carry = getattr(self.args, "carry_from", None)
        if carry:  # at every write: a run cut short still carries what it did not measure
            sections = carried_sections(sections, Path(carry))
        for title, lines in sections:
            out += [f"## {title}", "", *lines, ""]
        out.append(f"Run time: {time.monotonic() - self.t0:.0f} s.")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        Path(self.path).write_text("\n".join(out) + "\n")


def gb(nbytes: float) -> str:
    """Bytes as GB (1e9) with three significant digits (tiny quick-mode sizes stay readable)."""
    return f"{nbytes / 1e9:.3g} GB"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def machine(device: str) -> list[str]:
    lines = []
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(device)
        lines.append(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, "
                     f"{p.multi_processor_count} SMs, compute capability {p.major}.{p.minor}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,"
                                  "clocks.max.mem,power.limit", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            lines.append(f"nvidia-smi (driver, max SM clock, max memory clock, power limit): "
                         f"{smi}")
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"nvidia-smi: {e}")
    else:
        lines.append(f"No GPU: device {device} ({platform.processor() or 'cpu'}, "
                     f"{os.cpu_count()} cores) — code paths only, numbers mean nothing")
    versions = [f"torch {torch.__version__} (CUDA {torch.version.cuda})",
                f"Python {platform.python_version()}"]
    for mod in ("triton", "transformers"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001
            versions.append(f"{mod} absent")
    from disagg.transfer.ucx import ucx_available

    ok, why = ucx_available()
    if ok:
        import ucxx

        versions.append(f"ucxx {ucxx.__version__} (UCX "
                        f"{'.'.join(map(str, ucxx.get_ucx_version()))})")
    else:
        versions.append(f"UCX unavailable: {why}")
    lines.append(", ".join(versions))
    # The device gets a copy of the working tree whose git metadata may be stale: the caller
    # passes the commit it sent in DISAGG_COMMIT; git is only asked without it.
    rev = os.environ.get("DISAGG_COMMIT", "")
    if not rev:
        try:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            rev = f"{rev} (from git on this machine)" if rev else ""
        except (OSError, subprocess.SubprocessError):
            pass
    lines.append(f"disagg commit {rev or '?'}")
    return lines + features()


# ---------------------------------------------------------------------------------- sections


def copy_seconds(nbytes: int, dev: str, reps: int) -> float:
    """Median seconds of a ``copy_`` of ``nbytes`` between two buffers on ``dev``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return statistics.median(timed(lambda: dst.copy_(src), dev, reps=reps, warmup=2))


def matmul_seconds(m: int, k: int, n: int, dev: str) -> float:
    """Median seconds of a bf16 ``[m, k] @ [k, n]``."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    return statistics.median(timed(lambda: x @ w, dev, reps=10, warmup=3))


def sec_refs(plan: Plan, dev: str, rep: Report) -> None:
    n = plan.copy_bytes
    t = copy_seconds(n, dev, reps=10)
    bw = 2 * n / t  # read n + write n
    m, k, nn = plan.mm
    tm = matmul_seconds(m, k, nn, dev)
    rate = 2 * m * k * nn / tm
    free_device(dev)
    rep.results["bw"], rep.results["mm"] = bw, rate
    rep.add("References measured in this run", [
        f"- Device-to-device copy of {n / 2**30:.2f} GiB: {t * 1e3:.2f} ms -> **{bw / 1e12:.3g} "
        f"TB/s** (bytes read + bytes written; the roofline bandwidth below)",
        f"- bf16 matmul [{m}x{k}] @ [{k}x{nn}]: {tm * 1e3:.2f} ms -> **{rate / 1e12:.3g} "
        f"TFLOP/s** (the prefill reference below)",
    ])


def _build_llama8b_engine(plan: Plan, dev: str, tmp: Path) -> tuple[LLM, float]:
    """The engine on the Llama-3-8B shape with random bf16 weights; (llm, build seconds)."""
    batches = plan.decode_batches
    max_new = plan.decode_steps + 2
    kv_tokens = max(max(batches) * (plan.decode_ctx + max_new + 64), plan.prefill_tokens + 256)
    model_dir = write_config_dir(tmp / "big", plan.big)
    t0 = time.perf_counter()
    with random_weights(seed=0):
        llm = LLM(model_dir, device=dev, dtype="bfloat16", kv_cache_tokens=kv_tokens,
                  max_num_tokens=max(plan.prefill_tokens, 256), max_batch_size=max(batches),
                  max_model_len=plan.prefill_tokens + 64, enable_prefix_caching=False,
                  tokens_per_block=32)
    return llm, time.perf_counter() - t0


def _llama8b_decode_rows(plan: Plan, llm: LLM, cfg: ModelConfig, wbytes: float, bw: float,
                         dev: str, rep: Report, lines: list[str], heads: list[str]) -> None:
    """One table row and one headline part per decode batch, against the HBM roofline."""
    per_tok = kv_bytes_per_token(cfg, 2)
    targets = {1: 0.75, 64: 0.60}
    for b in plan.decode_batches:
        d = engine_decode(llm, b, plan.decode_ctx, plan.decode_steps, cfg.vocab_size,
                          seed=100 + b)
        nbytes = wbytes + b * d["mean_ctx"] * per_tok
        roof = nbytes / bw
        share = roof / d["step_s"]
        tgt = targets.get(b, 0.60)
        rep.results[f"decode_b{b}"] = {**d, "bytes": nbytes, "roofline_s": roof}
        lines.append(f"| decode step, batch {b}, ~{d['mean_ctx']:.0f} context (median of "
                     f"{d['steps']}; {d['graph_replays']} graph replays) "
                     f"| {d['step_s'] * 1e3:.2f} ms | {gb(nbytes)} "
                     f"(weights {gb(wbytes)} + KV {gb(nbytes - wbytes)}) "
                     f"| roofline {roof * 1e3:.2f} ms | {pct(share)} "
                     f"| >= {pct(tgt)}: {verdict(share >= tgt)} |")
        heads.append(f"decode at batch {b} takes {d['step_s'] * 1e3:.2f} ms per step, "
                     f"{share * 100:.0f}% of the HBM roofline ({roof * 1e3:.2f} ms to read "
                     f"{gb(nbytes)}; target {pct(tgt)}: {verdict(share >= tgt)})")
        free_device(dev)


def _llama8b_prefill_row(plan: Plan, llm: LLM, cfg: ModelConfig, mm_rate: float, dev: str,
                         rep: Report, lines: list[str], heads: list[str]) -> None:
    """One request of prefill_tokens random tokens, one sampled token, against the matmul
    rate: its table row and headline part."""
    model = llm.engine.runner.model
    T = plan.prefill_tokens
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(4):  # first: warm-up
        prompt = torch.randint(3, cfg.vocab_size, (T,), generator=g).tolist()
        sync(dev)
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    lin = sum(p.numel() for n, p in model.named_parameters()
              if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n)
    flops = (2 * lin * T + 2 * cfg.hidden_size * cfg.vocab_size
             + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
             * T * (T + 1) / 2)
    rate = flops / t
    share = rate / mm_rate
    rep.results["prefill"] = {"s": t, "flops": flops}
    lines.append(f"| prefill of {T} tokens (median of {len(times)}) | {t * 1e3:.1f} ms "
                 f"| {flops / 1e12:.3g} TFLOP -> {rate / 1e12:.3g} TFLOP/s "
                 f"| matmul {mm_rate / 1e12:.3g} TFLOP/s | {pct(share)} "
                 f"| >= 50%: {verdict(share >= 0.5)} |")
    heads.append(f"a {T}-token prefill takes {t * 1e3:.0f} ms, {share * 100:.0f}% of the "
                 f"measured bf16 matmul rate (target 50%: {verdict(share >= 0.5)})")


def sec_llama8b(plan: Plan, dev: str, rep: Report, tmp: Path) -> None:
    bw, mm_rate = rep.results.get("bw"), rep.results.get("mm")
    if bw is None or mm_rate is None:
        raise RuntimeError("the references section did not run")
    cfg = model_config(plan.big)
    llm, build_s = _build_llama8b_engine(plan, dev, tmp)
    lines: list[str] = []
    try:
        model = llm.engine.runner.model
        wbytes = param_bytes(model, exclude_embedding=True)
        lines.append(f"Engine built with random bf16 weights on the device in {build_s:.1f} s "
                     f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters; "
                     f"runner: {runner_features(llm)}).")
        lines.append("")
        lines.append("| measurement | time | bytes or FLOPs | reference | share of reference "
                     "| target |")
        lines.append("|---|---|---|---|---|---|")
        heads: list[str] = []
        _llama8b_decode_rows(plan, llm, cfg, wbytes, bw, dev, rep, lines, heads)
        _llama8b_prefill_row(plan, llm, cfg, mm_rate, dev, rep, lines, heads)
        lines.insert(0, "**Headline:** on the Llama-3-8B shape " + "; ".join(heads) + ".")
        lines.insert(1, "")
        lines.append("")
        lines.append("Decode step = wall time of `engine.step()` (schedule, forward, sample, "
                     "outputs) when all requests decode; bytes = every weight but the embedding "
                     "table (read by row) + the KV of every sequence's context; roofline = "
                     "bytes / copy bandwidth above. Prefill FLOPs = 2 x linear parameters x "
                     "tokens + causal attention (4 x layers x heads x head_dim x T(T+1)/2) + "
                     "one LM-head row; wall time of `generate(max_tokens=1)`.")
    finally:
        llm.shutdown()
        del llm
        free_device(dev)
        rep.add("Llama-3-8B shape (random bf16 weights made on the device)", lines)


def hf_model(model_dir: str, dev: str, dtype: torch.dtype) -> Any:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def hf_decode(model: Any, batch: int, prompt: int, new: tuple[int, int], vocab: int,
              dev: str, compile_ok: bool) -> dict[str, Any]:
    """Per-token decode time of ``generate`` with a static cache (auto-compiled forward with
    CUDA graphs on a GPU): (t(n2) - t(n1)) / (n2 - n1), same prompts, one cache size."""
    from transformers import StaticCache

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(dev)
    cache = StaticCache(config=model.config, max_cache_len=prompt + new[1] + 8)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        cache.reset()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, past_key_values=cache,
                           disable_compile=not compile_ok)

    t0 = time.perf_counter()
    for n in new:  # compile + capture happen here
        run(n)
    sync(dev)
    warm = time.perf_counter() - t0
    t = {n: min(timed(lambda n=n: run(n), dev, reps=2, warmup=0)) for n in new}
    step = (t[new[1]] - t[new[0]]) / (new[1] - new[0])
    return {"step_s": step, "warmup_s": warm}


def sec_smol(plan: Plan, dev: str, rep: Report, tmp: Path) -> None:
    shape = plan.smol
    model_dir = rep.results.get("smol_dir") or write_checkpoint(tmp / "smol", shape)
    rep.results["smol_dir"] = model_dir
    batches = plan.decode_batches
    lines, eng = [], {}
    llm = LLM(model_dir, device=dev, dtype="bfloat16", max_batch_size=max(batches),
              kv_cache_tokens=max(batches) * (plan.hf_prompt + plan.decode_steps + 64),
              max_num_tokens=2048, max_model_len=2048, enable_prefix_caching=False)
    try:
        feats = runner_features(llm)
        for b in batches:
            eng[b] = engine_decode(llm, b, plan.hf_prompt, plan.decode_steps, shape["vocab_size"],
                                   seed=200 + b)
    finally:
        llm.shutdown()
        del llm
        free_device(dev)
    hf, err = {}, {}
    compile_ok = dev.startswith("cuda")
    try:
        model = hf_model(model_dir, dev, torch.bfloat16)
        for b in batches:
            try:
                hf[b] = hf_decode(model, b, plan.hf_prompt, plan.hf_new, shape["vocab_size"],
                                  dev, compile_ok)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                err[b] = f"{type(e).__name__}: {e}"
        del model
    finally:
        free_device(dev)
    lines.append("| batch | engine step | engine tokens/s | transformers step | transformers "
                 "tokens/s | engine / transformers | target |")
    lines.append("|---|---|---|---|---|---|---|")
    heads = []
    for b in batches:
        e = eng[b]
        e_tps = b / e["step_s"]
        if b in hf:
            h_tps = b / hf[b]["step_s"]
            ratio = e_tps / h_tps
            lines.append(f"| {b} | {e['step_s'] * 1e3:.2f} ms | {e_tps:,.0f} | "
                         f"{hf[b]['step_s'] * 1e3:.2f} ms | {h_tps:,.0f} | {ratio:.2f}x "
                         f"| >= 1x: {verdict(ratio >= 1)} |")
            heads.append(f"batch {b}: {e_tps:,.0f} tokens/s against {h_tps:,.0f} for "
                         f"transformers ({ratio:.2f}x, target 1x: {verdict(ratio >= 1)})")
        else:
            lines.append(f"| {b} | {e['step_s'] * 1e3:.2f} ms | {e_tps:,.0f} | failed: "
                         f"{err.get(b, '?')} | | | |")
            heads.append(f"batch {b}: {e_tps:,.0f} tokens/s (transformers failed)")
    lines.insert(0, "**Headline:** SmolLM2-135M shape, decode " + "; ".join(heads) + ".")
    lines.insert(1, "")
    warm = ", ".join(f"batch {b} {hf[b]['warmup_s']:.0f} s" for b in hf)
    lines += ["", f"Engine: median `engine.step()` of pure decode steps after a {plan.hf_prompt}"
              f"-token prompt (runner: {feats}). transformers: `generate` with a `StaticCache` "
              f"({'auto-compiled decode forward, torch.compile mode reduce-overhead' if compile_ok else 'no torch.compile on CPU'}), "  # noqa: E501
              f"per token = (t({plan.hf_new[1]}) - t({plan.hf_new[0]})) / "
              f"{plan.hf_new[1] - plan.hf_new[0]} new tokens, best of 2; its compile and "
              f"warm-up cost ({warm}) is not in its numbers. Same bf16 checkpoint for both."]
    rep.add("SmolLM2-135M shape: engine against transformers (static cache + torch.compile)",
            lines)


def _greedy_engine(model_dir: str, dev: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    llm = LLM(model_dir, device=dev, dtype="bfloat16", kv_cache_tokens=16384,
              max_model_len=2048, max_num_tokens=2048)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
        del llm
        free_device(dev)


def _greedy_hf(model_dir: str, dev: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(model_dir, dev, torch.bfloat16)
    out = []
    try:
        for p in prompts:  # one at a time: no padding in the reference
            with torch.no_grad():
                seq = model.generate(torch.tensor([p], device=dev), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, disable_compile=True)
            out.append(seq[0, len(p):].tolist())
    finally:
        del model
        free_device(dev)
    return out


def agreement(model_dir: str, dev: str, vocab: int, num: int, n: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 129))]
               for _ in range(num)]
    eng = _greedy_engine(model_dir, dev, prompts, n)
    ref = _greedy_hf(model_dir, dev, prompts, n)
    first = []
    for a, b in zip(eng, ref, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        first.append(diff)
    same = sum(d is None for d in first)
    diverged = [d for d in first if d is not None]
    return {"prompts": num, "identical": same, "first_divergence": first,
            "median_first_divergence": statistics.median(diverged) if diverged else None,
            "median_all": statistics.median([n if d is None else d for d in first])}


def sec_agreement(plan: Plan, dev: str, rep: Report, tmp: Path) -> None:
    from disagg.model.tiny import write_tiny_checkpoint

    tiny = write_tiny_checkpoint(str(tmp / "tiny"), seed=1)
    smol = rep.results.get("smol_dir") or write_checkpoint(tmp / "smol", plan.smol)
    rep.results["smol_dir"] = smol
    lines = ["| model | prompts | identical greedy tokens | median first divergence "
             "(diverging prompts) | first divergence of each prompt |", "|---|---|---|---|---|"]
    heads = []
    for name, path, vocab in (("tiny llama (float32 checkpoint, run in bf16)", tiny, 512),
                              ("SmolLM2-135M shape, random bf16", smol,
                               plan.smol["vocab_size"])):
        a = agreement(path, dev, vocab, plan.agree_prompts, plan.agree_tokens)
        med = a["median_first_divergence"]
        lines.append(f"| {name} | {a['prompts']} | {a['identical']} "
                     f"({pct(a['identical'] / a['prompts'])}) | "
                     f"{'none diverged' if med is None else f'token {med:g}'} | "
                     f"{', '.join('-' if d is None else str(d) for d in a['first_divergence'])} |")
        heads.append(f"{name.split(' (')[0].split(',')[0]}: {a['identical']}/{a['prompts']} "
                     f"prompts identical over {plan.agree_tokens} tokens")
    lines.insert(0, "**Headline:** bf16 engine against bf16 transformers, greedy: "
                 + "; ".join(heads) + ".")
    lines.insert(1, "")
    lines += ["", f"Random prompts of 8-128 tokens, {plan.agree_tokens} greedy tokens each, "
              "engine `LLM.generate` (batched) against transformers `generate` one prompt at a "
              "time (eager, no padding). '-' = identical. Random weights have flatter "
              "distributions than trained ones, so near-ties (where bf16 rounding flips the "
              "argmax) are likely more frequent than on a real checkpoint."]
    rep.add("bf16 agreement with transformers", lines)


# ---- KV transfer between two processes

def _kv_server_main(backend: str, shape: tuple[int, ...], dev: str, cmds: Any,
                    events: Any) -> None:
    try:
        from disagg.transfer import KVTransferServer, LeaseTable

        kv = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        kv.uniform_(-1, 1)
        leases = LeaseTable(default_ttl_s=3600.0)
        server = KVTransferServer(kv, leases, TOKEN, backend).start()
        events.put(("address", server.address))
    except Exception:  # noqa: BLE001
        events.put(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                cmd = cmds.get(timeout=300)
            except queue.Empty:
                break
            if cmd[0] != "lease":
                break
            leases.create(cmd[1], cmd[2], readers=1000)
            events.put(("ok",))
    finally:
        server.stop()


def kv_backend(plan: Plan, dev: str, backend: str, block: int) -> list[dict[str, Any]]:
    from disagg.transfer import KVTransferClient, ReadRequest
    from disagg.transfer.payload import payload_shape

    cfg = model_config(plan.big)
    max_blocks = -(-max(plan.kv_tokens) // block)
    shape = (2 * max_blocks + 8, plan.kv_layers, 2, cfg.num_key_value_heads, block,
             cfg.head_dim)
    ctx = mp.get_context("spawn")
    cmds, events = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_kv_server_main, args=(backend, shape, dev, cmds, events),
                       daemon=True)
    proc.start()
    rows, client = [], None
    try:
        msg = events.get(timeout=120)
        if msg[0] != "address":
            raise RuntimeError(f"context process failed:\n{msg[1]}")
        address = msg[1]
        client = KVTransferClient(backend, TOKEN, timeout_s=120.0)
        rng = random.Random(0)
        for tokens in plan.kv_tokens:
            n = -(-tokens // block)
            ids = rng.sample(range(shape[0]), n)  # scattered blocks, as an engine's table
            lease = f"kv-{tokens}"
            cmds.put(("lease", lease, ids))
            if events.get(timeout=60) != ("ok",):
                raise RuntimeError("lease not acknowledged")
            req = ReadRequest(lease, ids, (0, plan.kv_layers), (0, cfg.num_key_value_heads),
                              num_tokens=tokens, format="tokens")
            pshape = payload_shape(shape, req)
            outs = []
            if dev.startswith("cuda"):
                outs.append(("device", torch.empty(pshape, dtype=torch.bfloat16, device=dev)))
                outs.append(("pinned host", torch.empty(pshape, dtype=torch.bfloat16,
                                                        pin_memory=True)))
            else:
                outs.append(("host", torch.empty(pshape, dtype=torch.bfloat16)))
            nbytes = math.prod(pshape) * 2
            copy_s = copy_seconds(nbytes, dev, reps=5)
            for where, out in outs:
                try:
                    def read(out: torch.Tensor = out, req: ReadRequest = req) -> Any:
                        r = client.read(address, req, out).result(120)
                        sync(dev)
                        return r
                    read()
                    ts = timed(read, dev, reps=plan.kv_reps, warmup=1)
                    t = statistics.median(ts)
                    rows.append({"backend": backend.upper(), "tokens": tokens, "into": where,
                                 "mib": nbytes / 2**20, "s": t, "copy_s": copy_s,
                                 "share": copy_s / t})
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    rows.append({"backend": backend.upper(), "tokens": tokens, "into": where,
                                 "mib": nbytes / 2**20, "error": f"{type(e).__name__}: {e}"})
                del out
            free_device(dev)
    finally:
        if client is not None:
            client.close()
        cmds.put(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def sec_kv(plan: Plan, dev: str, rep: Report) -> None:
    from disagg.transfer.ucx import ucx_available

    ok, why = ucx_available()
    backends = ["tcp"] + (["ucx"] if ok else [])
    block = 32
    rows, errors = [], []
    for b in backends:
        try:
            rows += kv_backend(plan, dev, b, block)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errors.append(f"- {b.upper()}: failed: {type(e).__name__}: {e}")
    if not ok:
        errors.append(f"- UCX: not measured: {why}")
    cfg = model_config(plan.big)
    lines = ["| backend | tokens | MiB | received into | median | GB/s | D2D copy of the same "
             "bytes | share of the copy | target |", "|---|---|---|---|---|---|---|---|---|"]
    heads = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['tokens']} | {r['mib']:.3g} | {r['into']} | "
                         f"failed: {r['error']} | | | | |")
            continue
        gb = r["mib"] * 2**20 / r["s"] / 1e9
        lines.append(f"| {r['backend']} | {r['tokens']} | {r['mib']:.3g} | {r['into']} | "
                     f"{r['s'] * 1e3:.2f} ms | {gb:.1f} | {r['copy_s'] * 1e3:.2f} ms | "
                     f"{pct(r['share'])} | >= 50%: {verdict(r['share'] >= 0.5)} |")
    for b in backends:
        best = [r for r in rows if r["backend"] == b.upper() and "error" not in r
                and r["tokens"] == max(plan.kv_tokens)]
        if best:
            r = max(best, key=lambda r: r["share"])
            heads.append(f"{b.upper()} moves {max(plan.kv_tokens)} tokens "
                         f"({r['mib']:.3g} MiB) in {r['s'] * 1e3:.1f} ms into {r['into']} "
                         f"memory, {pct(r['share'])} of a D2D copy of the same bytes "
                         f"({r['copy_s'] * 1e3:.2f} ms; target 50%: {verdict(r['share'] >= 0.5)})")
    lines.insert(0, "**Headline:** " + ("; ".join(heads) or "nothing measured") + ".")
    lines.insert(1, "")
    lines += ["", *errors, "", f"A spawned context process holds a bf16 KV cache of the 8B "
              f"shape ({plan.kv_layers} layers x {cfg.num_key_value_heads} kv heads x head_dim "
              f"{cfg.head_dim}, {block} tokens per block) on the device behind a "
              f"`KVTransferServer`; this process reads a prompt's blocks (scattered block "
              f"table, token-major payload) with a `KVTransferClient`, timed from submit to "
              f"the last byte (synchronised), median of {plan.kv_reps} after a warm-up; the "
              f"receive buffer is device memory and pinned host memory in turn (whichever the "
              f"backend supports). D2D copy = `copy_` of the same number of bytes between two "
              f"device buffers in this process."]
    rep.add("KV transfer between two processes (8B shape)", lines)


# ---- disaggregated against aggregated through the router

def _serve_flags() -> str:
    out = subprocess.run([sys.executable, "-m", "disagg.cli", "serve", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    return out.stdout


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path


def _start(args: list[str], name: str, port: int, logs: Path) -> _Proc:
    log = logs / f"{name}.log"
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN}
    p = spawn([sys.executable, "-m", "disagg.cli", *args], log, env=env, cwd=ROOT)
    return _Proc(name, p, f"http://127.0.0.1:{port}", log)


def _wait(procs: list[_Proc], timeout: float) -> None:
    """All healthy within ``timeout`` (one deadline); RuntimeError with the log tail if not."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            wait_healthy(p.url, max(0.0, deadline - time.monotonic()), proc=p.popen,
                         interval=0.3, what=p.name)
        except NotHealthy as e:
            raise RuntimeError(f"{e}:\n{log_tail(p.log)}") from None


def _stop(procs: list[_Proc]) -> None:
    """SIGTERM all (the last started first), up to 30 s to drain, then SIGKILL the groups."""
    stop_all([p.popen for p in reversed(procs)], grace_s=30.0, kill_wait_s=10.0)


def _router(cluster: dict[str, Any], port: int, logs: Path, name: str) -> _Proc:
    import yaml

    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, **cluster},
                                   sort_keys=False))
    return _start(["router", "-c", str(path), "--log-level", "warning"], name, port, logs)


def _serve_model(plan: Plan, tmp: Path) -> tuple[int, str, Any]:
    """The SmolLM2-shape checkpoint the serve section runs: (vocabulary, path, tokenizer)."""
    from disagg.bench.datasets import load_bench_tokenizer
    from disagg.model.tiny import build_tokenizer

    # The checkpoint's trained tokenizer has far fewer tokens than SmolLM2's 49152: a model
    # of that vocabulary mostly samples ids that decode to no text, its stream then carries
    # almost no chunks and TTFT / TPOT measure nothing (the first run did exactly that). Here
    # the vocabulary is the tokenizer's, so every token is a text chunk.
    vocab = build_tokenizer(plan.smol["vocab_size"]).get_vocab_size()
    model = write_checkpoint(tmp / "serve-model", {**plan.smol, "vocab_size": vocab})
    return vocab, model, load_bench_tokenizer(model)


def _serve_memory(dev: str) -> tuple[int, list[str], str]:
    """Each worker's memory limits: (KV tokens, memory flag for `serve`, the report's words)."""
    helptext = _serve_flags()
    m = re.search(r"--gpu-memory-(fraction|utilization)\b", helptext)
    share = 0.35 if dev.startswith("cuda") else None
    per_worker_kv = 65536 if dev.startswith("cuda") else 4096
    mem_flag = []
    if m and share is not None:
        mem_flag = [m.group(0), str(share)]
        memory = (f"each worker process `{m.group(0)} {share}` (its share of the GPU's total "
                  f"memory: weights + activations + KV) and at most {per_worker_kv} KV tokens")
    else:
        why = ("on a CPU" if share is None else
               "no GPU memory share option in this tree: activations are not capped")
        memory = f"each worker at most {per_worker_kv} KV tokens ({why})"
    return per_worker_kv, mem_flag, memory


async def _serve_run_rates(url: str, plan: Plan, tok: Any) -> list[dict[str, Any]]:
    """A warm-up, then each of the plan's request rates against ``url``: one result a rate."""
    from disagg.bench.client import make_transport
    from disagg.bench.datasets import sample_random
    from disagg.bench.runner import BenchmarkConfig, run_benchmark

    tr = make_transport("auto", 600)
    out = []
    warm = sample_random(tok, 4, plan.serve_isl, plan.serve_osl, seed=999,
                         as_token_ids=True)
    await run_benchmark(BenchmarkConfig(base_url=url, model=NAME, ignore_eos=True,
                                        max_concurrency=2), warm, transport=tr)
    for i, rate in enumerate(plan.serve_rates):
        n = max(8, round(rate * plan.serve_seconds))
        samples = sample_random(tok, n, plan.serve_isl, plan.serve_osl, seed=i,
                                as_token_ids=True)
        cfg = BenchmarkConfig(base_url=url, model=NAME, request_rate=rate,
                              ignore_eos=True, goodput_slos_ms=plan.slo_ms,
                              percentiles=(50.0, 99.0), seed=i, exact_rate=True,
                              request_timeout_s=120)
        res = await run_benchmark(cfg, samples, transport=tr)
        s = res.summary
        # Streamed chunks per generated token: TTFT / TPOT mean something only when
        # tokens arrive one by one (about 1 chunk a token).
        toks = sum(r.output_tokens or 0 for r in res.records if r.success)
        chunks = sum(len(r.itl) + 1 for r in res.records if r.success and r.output_tokens)
        out.append({"rate": rate, "n": n, "s": s,
                    "chunks_per_token": chunks / toks if toks else 0.0})
        print(f"  {url} rate {rate}: TTFT p99 {s['p99_ttft_ms']:.0f} ms, TPOT p99 "
              f"{s['p99_tpot_ms']:.1f} ms, goodput {s['request_goodput']}", flush=True)
    await tr.aclose()
    return out


def _serve_cluster(label: str, workers: list[tuple[str, list[str]]], common: list[str],
                   logs: Path, plan: Plan, tok: Any) -> list[dict[str, Any]]:
    """Start one system's workers and its router, run the rates through the router, stop."""
    ports = free_ports(len(workers) + 1)
    procs: list[_Proc] = []
    try:
        for (name, extra), port in zip(workers, ports, strict=False):
            procs.append(_start([*common, "--port", str(port), *extra],
                                f"{label[:4]}-{name}", port, logs))
        _wait(procs, 240)
        urls = [p.url[7:] for p in procs]
        if label.startswith("disagg"):
            cluster = {"context_servers": {"num_instances": 1, "urls": urls[:1],
                                           "router": {"type": "load_balancing"}},
                       "generation_servers": {"num_instances": 1, "urls": urls[1:],
                                              "router": {"type": "load_balancing"}}}
        else:
            cluster = {"generation_servers": {"num_instances": 2, "urls": urls,
                                              "router": {"type": "load_balancing"}}}
        router = _router(cluster, ports[-1], logs, f"router-{label[:4]}")
        procs.append(router)
        _wait([router], 60)
        return asyncio.run(_serve_run_rates(router.url, plan, tok))
    except Exception:
        for p in procs:
            print(f"--- {p.name} log tail:\n{p.log.read_text()[-2000:]}", flush=True)
        raise
    finally:
        _stop(procs)
        time.sleep(1.0)


def _serve_lines(plan: Plan, dis: list[dict[str, Any]], agg: list[dict[str, Any]], vocab: int,
                 memory: str) -> list[str]:
    """The serve section: headline, one table row per rate and system, the workload."""
    slos = plan.slo_ms
    kv_mib = plan.serve_isl * kv_bytes_per_token(model_config(plan.smol), 2) / 2**20
    lines = ["| rate (req/s) | system | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output "
             "tok/s | goodput (req/s) | failed | stream chunks per token |",
             "|---|---|---|---|---|---|---|---|"]
    heads = []
    streamed = all(r["chunks_per_token"] >= 0.9 for r in (*dis, *agg))
    for d, a in zip(dis, agg, strict=True):
        for label, r in (("disaggregated", d), ("aggregated", a)):
            s = r["s"]
            lines.append(f"| {r['rate']:g} | {label} | {s['median_ttft_ms']:.0f} / "
                         f"{s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.1f} / "
                         f"{s['p99_tpot_ms']:.1f} | {s['output_throughput']:.0f} | "
                         f"{s['request_goodput'] or 0:.2f} | {s['failed']} "
                         f"| {r['chunks_per_token']:.2f} |")
        heads.append(_serve_sentence(d, a, kv_mib))
    if streamed:
        head = "; ".join(heads) + "."
    else:
        head = ("NOT VALID: tokens did not arrive one chunk each (see the last column), so "
                "TTFT, TPOT and goodput measure the stream's bursts, not the systems.")
    lines.insert(0, f"**Headline:** SmolLM2-135M shape (vocabulary {vocab}) on the one "
                 f"device: {head}")
    lines.insert(1, "")
    lines += ["", f"Workload: random prompts of {plan.serve_isl} tokens, {plan.serve_osl} output "
              f"tokens (ignore_eos), Poisson arrivals at the exact rate, "
              f"max(8, rate x {plan.serve_seconds:g} s) requests per rate, `disagg.bench` client "
              f"through `disagg router`; goodput SLOs TTFT <= {slos['ttft']:g} ms and TPOT <= "
              f"{slos['tpot']:g} ms. Both systems: two worker processes sharing the device, "
              f"{memory}; prefix caching off. Aggregated: router load balancing (least "
              f"active requests) over two aggregated workers."]
    return lines


def sec_serve(plan: Plan, dev: str, rep: Report, tmp: Path) -> None:
    from disagg.transfer.ucx import ucx_available

    vocab, model, tok = _serve_model(plan, tmp)
    logs = tmp / "serve-logs"
    logs.mkdir(exist_ok=True)
    per_worker_kv, mem_flag, memory = _serve_memory(dev)
    ok, _why = ucx_available()
    backend = "UCX" if ok else "TCP"
    common = ["serve", model, "--served-model-name", NAME, "--log-level", "warning",
              "--device", dev, "--dtype", "bfloat16", "--kv-cache-tokens", str(per_worker_kv),
              "--max-model-len", str(plan.serve_isl + plan.serve_osl + 64),
              "--max-num-tokens", str(max(2048, plan.serve_isl + 64)),
              "--no-enable-prefix-caching", *mem_flag]
    clusters = {
        f"disaggregated (1 context + 1 generation, KV over {backend})": [
            ("context", ["--role", "context", "--kv-transfer-backend", backend]),
            ("generation", ["--role", "generation", "--kv-transfer-backend", backend])],
        "aggregated (2 workers)": [("agg0", ["--role", "aggregated"]),
                                   ("agg1", ["--role", "aggregated"])],
    }
    results = {label: _serve_cluster(label, workers, common, logs, plan, tok)
               for label, workers in clusters.items()}
    dis, agg = list(results.values())
    rep.add("Disaggregated against aggregated on one device",
            _serve_lines(plan, dis, agg, vocab, memory))


def _serve_sentence(d: dict[str, Any], a: dict[str, Any], kv_mib: float) -> str:
    """One sentence per rate: what disaggregation wins and what it costs, side by side."""
    sd, sa = d["s"], a["s"]
    metrics = [("goodput", sd["request_goodput"] or 0.0, sa["request_goodput"] or 0.0, True,
                "{:.2f} req/s"),
               ("TTFT p99", sd["p99_ttft_ms"], sa["p99_ttft_ms"], False, "{:.0f} ms"),
               ("TPOT p99", sd["p99_tpot_ms"], sa["p99_tpot_ms"], False, "{:.1f} ms")]
    wins, costs = [], []
    for name, x, y, higher_better, f in metrics:
        if x == y:
            continue
        part = f"{name} {f.format(x)} vs {f.format(y)}"
        (wins if (x > y) == higher_better else costs).append(part)
    costs.append(f"{kv_mib:.3g} MiB of KV moved per request")
    return (f"at {d['rate']:g} req/s disaggregated "
            + (f"wins on {', '.join(wins)}" if wins else "wins on nothing measured")
            + f" and costs {', '.join(costs)} (disaggregated vs aggregated)")


# The heading each section's report starts with (to find it again in an earlier report).
SECTION_TITLES = {
    "refs": "References measured", "llama8b": "Llama-3-8B shape", "smol": "SmolLM2-135M shape",
    "kv": "KV transfer between", "serve": "Disaggregated against aggregated",
    "agreement": "bf16 agreement",
}


def section_of(title: str) -> str | None:
    """The section key of a report heading: "<key>: skipped|failed" or its own title."""
    key = title.split(":")[0].strip()
    if key in SECTION_TITLES:
        return key
    return next((k for k, t in SECTION_TITLES.items() if title.startswith(t)), None)


def carried_sections(sections: list[tuple[str, list[str]]], earlier: Path
                     ) -> list[tuple[str, list[str]]]:
    """``sections`` with the sections of an ``earlier`` report of this script that they hold
    no measurement of (skipped, failed or not run yet) appended verbatim, each marked as
    carried and preceded by the earlier run's header (device, versions, commit): their ratios
    are against references measured in that run, not this one."""
    head, _, body = earlier.read_text().partition("\n## ")
    head_lines = [ln for ln in head.splitlines() if ln.startswith("- ")]
    measured = {section_of(t) for t, _ in sections
                if not t.endswith((": skipped", ": failed"))}
    out = list(sections)
    for chunk in ("## " + body).split("\n## ") if body else []:
        title, _, rest = chunk.removeprefix("## ").partition("\n")
        key = section_of(title)
        if (key is None or key in measured or title.endswith((": skipped", ": failed"))
                or "(carried from an earlier run)" in title):
            continue
        out = [(t, ls) for t, ls in out if section_of(t) != key]
        lines = rest.split("\nRun time:")[0].strip("\n").splitlines()
        out.append((f"{title} (carried from an earlier run)", [
            f"_Not measured in this run: carried verbatim from `{earlier.name}` of an earlier "
            "run, whose ratios are against references measured in that run. That run:_", "",
            *head_lines, "", *lines]))
    return out


SECTIONS: dict[str, tuple[Callable[..., None], float]] = {
    # name -> (function, seconds it should need on an H100, to skip it when the budget is short)
    "refs": (sec_refs, 5),
    "llama8b": (sec_llama8b, 60),
    "smol": (sec_smol, 135),
    "kv": (sec_kv, 40),
    "serve": (sec_serve, 110),
    "agreement": (sec_agreement, 70),
}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu.md"))
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (code paths only)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--carry-from", default=None, metavar="REPORT.md",
                    help="an earlier report of this script: its sections that this run does not "
                         "measure are appended, marked as carried with that run's header")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="skip a section that would not finish within this many seconds")
    args = ap.parse_args()
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = make_plan(args.quick or not dev.startswith("cuda"))
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    # `timeout` sends SIGTERM: unwind through the `finally`s that stop worker processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rep = Report(args.out, args)
    rep.head = [f"# The GPU path against its targets ({time.strftime('%Y-%m-%d')})", "",
                *[f"- {line}" for line in machine(dev)],
                f"- command: `python -m bench.gpu.bench {' '.join(sys.argv[1:])}`"
                + (" (quick shapes: code paths only)" if args.quick else ""),
                "- written by the script; every ratio is against a reference measured in "
                "this run on this device"]
    print("\n".join(rep.head), flush=True)
    failed = []
    with tempfile.TemporaryDirectory(prefix="disagg-gpu-bench-") as tmpdir:
        tmp = Path(tmpdir)
        for name in wanted:
            fn, need = SECTIONS[name]
            left = args.budget_s - (time.monotonic() - rep.t0)
            if not args.quick and left < need:
                rep.add(f"{name}: skipped", [f"Skipped: {left:.0f} s of the {args.budget_s:g} s "
                                             f"budget left, the section needs ~{need:g} s."])
                continue
            t0 = time.monotonic()
            print(f"\n=== {name} ({left:.0f} s of budget left)", flush=True)
            try:
                kwargs = {"tmp": tmp} if "tmp" in fn.__code__.co_varnames else {}
                fn(plan, dev, rep, **kwargs)
            except Exception as e:  # noqa: BLE001
                tb = traceback.format_exc()
                print(tb, flush=True)
                failed.append(name)
                rep.add(f"{name}: failed", [f"`{type(e).__name__}: {str(e)[:300]}`", "",
                                            "```", tb[-3000:], "```"])
            finally:
                free_device(dev)
            print(f"=== {name}: {time.monotonic() - t0:.0f} s", flush=True)
    rep.write()
    print(f"\nwrote {args.out}; failed sections: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
