"""What one rate-match run needs (``RateMatchConfig``) and the result's kind and version."""

from __future__ import annotations

from dataclasses import dataclass

RESULT_KIND = "disagg-bench-rate-match"
RESULT_VERSION = 1


@dataclass
class RateMatchConfig:
    """Everything a rate-match run needs besides the tokenizer."""

    context_url: str
    generation_url: str
    ttft_slo_ms: float
    isl: int = 1024
    osl: int = 128
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    aggregated_url: str | None = None
    agg_concurrencies: tuple[int, ...] | None = None  # None: the same as ``concurrencies``
    model: str = ""  # served model name; empty: the first of the context worker's /v1/models
    ttft_percentile: float = 90.0
    ctx_devices: float = 1.0  # devices one context worker uses (tp * pp)
    gen_devices: float = 1.0
    agg_devices: float = 1.0
    ctx_rate_start: float | None = None  # None: half the rate one warm request's TTFT allows
    ctx_max_probes: int = 8
    ctx_tolerance: float = 0.1  # bisection stops at hi / lo <= 1 + tolerance
    ctx_probe_seconds: float = 15.0
    ctx_min_prompts: int = 16
    gen_rounds: int = 4  # requests per concurrency = rounds * concurrency
    num_warmups: int = 2
    # Measure every generation point a second time beside the context worker serving its
    # SLO rate (package docstring, 2b): for workers that share one machine's memory system.
    colocated: bool = False
    seed: int = 0
    api_key: str | None = None
    http_client: str = "auto"
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        checks = [
            (self.isl >= 1, f"isl: must be >= 1, got {self.isl}"),
            (self.osl >= 2, f"osl: must be >= 2 (TPOT needs two tokens), got {self.osl}"),
            (self.ttft_slo_ms > 0, f"ttft_slo_ms: must be > 0, got {self.ttft_slo_ms}"),
            (0 < self.ttft_percentile <= 100,
             f"ttft_percentile: must be in (0, 100], got {self.ttft_percentile}"),
            (bool(self.concurrencies) and min(self.concurrencies) >= 1,
             f"concurrencies: need at least one, each >= 1, got {self.concurrencies}"),
            (self.agg_concurrencies is None or (bool(self.agg_concurrencies)
                                                and min(self.agg_concurrencies) >= 1),
             f"agg_concurrencies: each >= 1, got {self.agg_concurrencies}"),
            (min(self.ctx_devices, self.gen_devices, self.agg_devices) > 0,
             "devices: must be > 0"),
            (self.ctx_rate_start is None or self.ctx_rate_start > 0,
             f"ctx_rate_start: must be > 0, got {self.ctx_rate_start}"),
            (self.ctx_max_probes >= 1, f"ctx_max_probes: must be >= 1, got {self.ctx_max_probes}"),
            (self.ctx_tolerance > 0, f"ctx_tolerance: must be > 0, got {self.ctx_tolerance}"),
            (self.ctx_probe_seconds > 0, "ctx_probe_seconds: must be > 0"),
            (self.ctx_min_prompts >= 1, "ctx_min_prompts: must be >= 1"),
            (self.gen_rounds >= 1, f"gen_rounds: must be >= 1, got {self.gen_rounds}"),
            (self.num_warmups >= 0, "num_warmups: must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        self.concurrencies = tuple(sorted(set(self.concurrencies)))
        if self.agg_concurrencies is not None:
            self.agg_concurrencies = tuple(sorted(set(self.agg_concurrencies)))
