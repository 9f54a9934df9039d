"""``run_rate_match``: measure both sides (and the baseline), rate-match, optionally verify."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TextIO

from disagg.bench.client import make_transport
from disagg.bench.datasets import TokenizerLike
from disagg.bench.ratematch.config import RateMatchConfig
from disagg.bench.ratematch.report import build_result
from disagg.bench.ratematch.sweep import RateMatcher, note
from disagg.bench.ratematch.verify import finish_verify_point, verify_choices
from disagg.bench.runner import BenchmarkConfig, resolve_model


async def run_rate_match(
    config: RateMatchConfig, tok: TokenizerLike, *, progress: TextIO | None = sys.stderr,
    verify: Callable[[RateMatcher, list[dict[str, Any]]], Any] | None = None,
    verify_max_devices: float = 2.0, verify_points: int = 2,
) -> dict[str, Any]:
    """Measure both sides (and the baseline), rate-match, optionally verify; the JSON result.

    ``verify(matcher, choices)`` is awaited with the chosen clusters (``verify_choices``) and
    returns one measured summary per choice (``concurrency_point``'s shape); ``cli`` passes one
    that starts each cluster with ``disagg launch``.
    """
    tr = make_transport(config.http_client, config.request_timeout_s)
    try:
        bc = BenchmarkConfig(base_url=config.context_url, model=config.model,
                             api_key=config.api_key, http_client=config.http_client)
        model = await resolve_model(bc, tr)
        config = dataclasses.replace(config, model=model)
        m = RateMatcher(config, tok, tr, progress)
        ctx = await m.sweep_context()
        gen = await m.sweep_generation(ctx["ctx_rate"])
        agg = await m.sweep_aggregated() if config.aggregated_url else None
        result = build_result(config, model, ctx, gen, agg)
        if ctx["ctx_rate"] is None:
            note(progress, "no context probe met the TTFT SLO: nothing to rate-match (lower "
                           "--isl, raise --ttft-slo, or start lower with --ctx-rate-start)")
            return result
        if verify is not None:
            choices = verify_choices(result, verify_max_devices, verify_points,
                                     config.ctx_devices, config.gen_devices)
            measured = await verify(m, choices)
            result["verify"] = [finish_verify_point(ch, ms)
                                for ch, ms in zip(choices, measured, strict=True)]
        return result
    finally:
        await tr.aclose()
