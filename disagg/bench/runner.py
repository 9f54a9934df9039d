"""Drive a workload against an endpoint: ``run_benchmark(config, samples) -> BenchmarkResult``.

Reusable by other benchmark modes (rate matching sweeps rates and concurrencies over the same
samples): it takes prepared samples, never parses flags, never prints the summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from disagg.bench.arrivals import arrival_offsets, trace_offsets
from disagg.bench.client import (
    ENDPOINT_PATHS,
    RequestSpec,
    Transport,
    list_models,
    make_transport,
    normalize_base_url,
    send_request,
)
from disagg.bench.datasets import SampleRequest
from disagg.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, summarize

RESULT_KIND = "disagg-bench-serve"
RESULT_VERSION = 1
# disaggregated_params.request_type of a generation-only benchmark request (no context fields).
GEN_ONLY_REQUEST_TYPE = "generation_only"


class BenchmarkError(RuntimeError):
    """The benchmark could not run (e.g. every warmup failed); the message says why."""


@dataclass
class BenchmarkConfig:
    """How to send a workload. Samples come separately (``run_benchmark``)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # "completions" | "chat"
    model: str = ""  # empty: the first model /v1/models lists
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    # Scale the sampled gaps so the run's realized rate is exactly request_rate
    # (arrivals.arrival_offsets); rate matching's probes use it.
    exact_rate: bool = False
    max_concurrency: int | None = None
    use_trace_timestamps: bool = True  # replay SampleRequest.timestamp when all have one
    ignore_eos: bool = False
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    seed: int = 0
    num_warmups: int = 0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Generation-only requests (a worker started with --benchmark-gen-only): the worker takes
    # the prompt's KV as already computed and only decodes. A benchmarking aid for sizing the
    # generation side alone; implies ignore_eos so every request decodes exactly max_tokens.
    gen_only: bool = False
    http_client: str = "auto"  # "auto" | "aiohttp" | "httpx"
    request_timeout_s: float = 6 * 3600
    # Free-form description of the workload, copied into the result (dataset, lengths...).
    workload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint: one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups: must be >= 0, got {self.num_warmups}")
        if self.gen_only:
            self.ignore_eos = True

    def request_extra_body(self) -> dict[str, Any]:
        """``extra_body``, plus the generation-only marker when ``gen_only`` is set."""
        body = dict(self.extra_body)
        if self.gen_only:
            dp = body.get("disaggregated_params")
            body["disaggregated_params"] = {**(dp if isinstance(dp, dict) else {}),
                                            "request_type": GEN_ONLY_REQUEST_TYPE}
        return body


@dataclass
class BenchmarkResult:
    config: BenchmarkConfig
    summary: dict[str, Any]
    records: list[RequestRecord]
    warmup_records: list[RequestRecord] = field(default_factory=list)
    date: str = ""

    def to_json(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg.pop("api_key", None)  # never write secrets to result files
        cfg["request_rate"] = _json_float(cfg["request_rate"])
        return {
            "kind": RESULT_KIND,
            "version": RESULT_VERSION,
            "date": self.date,
            "config": cfg,
            "summary": self.summary,
            "warmup_failed": sum(not r.success for r in self.warmup_records),
            "requests": [r.to_json() for r in self.records],
        }

    def save(self, path: str) -> None:
        # Summary readable, one line per request record (files stay greppable and diffable).
        obj = self.to_json()
        requests = obj.pop("requests")
        head = json.dumps(obj, indent=2)
        body = ",\n".join("    " + json.dumps(r) for r in requests)
        with open(path, "w", encoding="utf-8") as f:
            f.write(head[:-2] + ',\n  "requests": [\n' + body + "\n  ]\n}\n")


def _json_float(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def load_result(path: str) -> dict[str, Any]:
    """Read a saved result, checking it is one."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict) or obj.get("kind") != RESULT_KIND:
        raise ValueError(f"{path}: not a `disagg bench serve` result (kind != {RESULT_KIND!r})")
    return obj


# ----------------------------------------------------------------------------- progress


class _Progress:
    """tqdm when installed, else a plain line rewritten at most twice a second."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self._stream = stream or sys.stderr
        self._bar = None
        self._enabled = enabled
        self._last = 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", file=self._stream, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if self.failed:
                self._bar.set_postfix(failed=self.failed, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done == self.total:
            self._last = now
            self._stream.write(f"\r{self.done}/{self.total} requests done, {self.failed} failed")
            self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            self._stream.write("\n")


# ------------------------------------------------------------------------------- running


def schedule_offsets(config: BenchmarkConfig, samples: Sequence[SampleRequest]) -> list[float]:
    """Send time of each sample (s): trace timestamps when present, else the arrival process."""
    if config.use_trace_timestamps and samples and all(s.timestamp is not None for s in samples):
        return trace_offsets([float(s.timestamp) for s in samples])  # type: ignore[arg-type]
    return arrival_offsets(len(samples), config.request_rate, config.burstiness, config.seed,
                           exact_rate=config.exact_rate)


async def resolve_model(config: BenchmarkConfig, transport: Transport) -> str:
    """``config.model``, or the first model the server lists."""
    if config.model:
        return config.model
    try:
        models = await list_models(transport, config.base_url, config.api_key)
    except Exception as e:
        raise BenchmarkError(f"no --model given and listing models at "
                             f"{normalize_base_url(config.base_url)}/v1/models failed: "
                             f"{type(e).__name__}: {e}") from e
    if not models:
        raise BenchmarkError("no --model given and /v1/models lists no model")
    return models[0]


async def run_benchmark(config: BenchmarkConfig, samples: Sequence[SampleRequest], *,
                        progress: bool = False,
                        transport: Transport | None = None) -> BenchmarkResult:
    """Warm up, then send ``samples`` on their schedule and measure every request."""
    if not samples:
        raise BenchmarkError("no requests to send")
    own = transport is None
    tr = transport or make_transport(config.http_client, config.request_timeout_s)
    try:
        model = await resolve_model(config, tr)
        config = dataclasses.replace(config, model=model)  # the result records the real model
        url = normalize_base_url(config.base_url) + ENDPOINT_PATHS[config.endpoint]
        extra_body = config.request_extra_body()

        def spec(i: int, s: SampleRequest) -> RequestSpec:
            return RequestSpec(index=i, url=url, endpoint=config.endpoint, model=model,
                               prompt=s.prompt, prompt_len=s.prompt_len,
                               max_tokens=s.expected_output_len, ignore_eos=config.ignore_eos,
                               api_key=config.api_key, extra_body=extra_body)

        sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def limited(sp: RequestSpec, origin: float) -> RequestRecord:
            if sem is None:
                return await send_request(tr, sp, origin)
            async with sem:  # the clock starts once a slot is free, as vLLM's benchmark does
                return await send_request(tr, sp, origin)

        # Warmups: excluded from every statistic; all failing means the server is not usable.
        warm: list[RequestRecord] = []
        if config.num_warmups:
            t = time.perf_counter()
            warm = list(await asyncio.gather(*(
                limited(spec(-1 - i, samples[i % len(samples)]), t)
                for i in range(config.num_warmups))))
            if all(not r.success for r in warm):
                raise BenchmarkError(f"all {len(warm)} warmup requests failed: {warm[0].error}")

        offsets = schedule_offsets(config, samples)
        bar = _Progress(len(samples), progress)
        origin = time.perf_counter()

        async def one(i: int, s: SampleRequest) -> RequestRecord:
            rec = await limited(spec(i, s), origin)
            bar.update(rec.success)
            return rec

        tasks: list[asyncio.Task[RequestRecord]] = []
        try:
            for i in sorted(range(len(samples)), key=lambda k: offsets[k]):
                delay = origin + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, samples[i])))
            records = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # on cancellation (Ctrl-C) leave no request behind
                t.cancel()
            bar.close()
        duration = time.perf_counter() - origin
        records.sort(key=lambda r: r.index)
        summary = summarize(records, duration, config.goodput_slos_ms, config.percentiles)
        return BenchmarkResult(config=config, summary=summary, records=records,
                               warmup_records=warm,
                               date=datetime.datetime.now().astimezone().isoformat(
                                   timespec="seconds"))
    finally:
        if own:
            await tr.aclose()
