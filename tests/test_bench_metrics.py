"""`disagg bench`: metric arithmetic, arrival processes, SSE parsing and request timing.

Hand-worked values on synthetic timestamps; no server, no network.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from disagg.bench.arrivals import arrival_offsets, inter_arrival_times, trace_offsets
from disagg.bench.client import RequestSpec, SSEDecoder, normalize_base_url, send_request
from disagg.bench.metrics import (
    RequestRecord,
    compute_itls,
    compute_tpot,
    format_summary,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    steady_state_output_throughput,
    summarize,
)

# ------------------------------------------------------------------------------- metrics


def test_tpot_and_itl_hand_worked() -> None:
    # Sent at 0; content chunks at 100, 150, 250, 300 ms; stream ends at 320 ms; 4 tokens.
    chunks = [0.100, 0.150, 0.250, 0.300]
    assert compute_itls(chunks) == pytest.approx([0.050, 0.100, 0.050])
    # TPOT = (E2EL - TTFT) / (n - 1) = (320 - 100) / 3 ms
    assert compute_tpot(0.320, 0.100, 4) == pytest.approx(0.220 / 3)
    assert compute_tpot(0.320, 0.100, 1) is None  # undefined for a single token
    assert compute_itls([0.1]) == []


def _rec(i: int, ttft_ms: float, e2el_ms: float, n_out: int, prompt: int = 10,
         ok: bool = True, error: str = "") -> RequestRecord:
    return RequestRecord(index=i, success=ok, error=error, ttft=ttft_ms / 1000,
                         e2el=e2el_ms / 1000, output_tokens=n_out if ok else 0,
                         prompt_len=prompt, expected_output_len=n_out,
                         itl=[(e2el_ms - ttft_ms) / 1000 / (n_out - 1)] * (n_out - 1)
                         if ok and n_out > 1 else [])


def test_summary_percentiles_throughput_goodput() -> None:
    # TTFT 10/20/30/40 ms; E2EL = TTFT + 100 ms; 11 tokens -> TPOT 10 ms each.
    recs = [_rec(i, t, t + 100, 11) for i, t in enumerate([10, 20, 30, 40])]
    recs.append(_rec(4, 0, 0, 5, ok=False, error="HTTP 503: overloaded"))
    s = summarize(recs, duration=2.0, slos_ms={"ttft": 25, "tpot": 10},
                  percentiles=(90, 99))
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == {"HTTP 503: overloaded": 1}
    # Linear interpolation over [10, 20, 30, 40]: p90 = 30 + 0.7*10, p99 = 30 + 0.97*10.
    assert s["mean_ttft_ms"] == pytest.approx(25)
    assert s["median_ttft_ms"] == pytest.approx(25)
    assert s["p90_ttft_ms"] == pytest.approx(37)
    assert s["p99_ttft_ms"] == pytest.approx(39.7)
    assert s["mean_tpot_ms"] == pytest.approx(10)
    assert s["p99_itl_ms"] == pytest.approx(10)
    assert s["median_e2el_ms"] == pytest.approx(125)
    # The failed request is in no statistic and no token total.
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 44
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(22.0)
    assert s["total_token_throughput"] == pytest.approx(42.0)
    # TTFT <= 25 ms: 2 requests (limits inclusive, TPOT 10 <= 10 for all) -> 1 req/s.
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)
    assert s["mean_tokens_per_s_per_user"] == pytest.approx(100.0)
    table = format_summary(s, (90, 99))
    assert "P99 TTFT (ms):" in table and "39.70" in table and "HTTP 503" in table


def test_goodput_all_slos_and_single_token() -> None:
    one = _rec(0, 50, 50, 1)  # one token: no TPOT, so any TPOT limit is met
    assert one.tpot is None and meets_slos(one, {"tpot": 1})
    slow = _rec(1, 50, 1050, 11)  # TPOT 100 ms
    assert meets_slos(slow, {"ttft": 60})
    assert not meets_slos(slow, {"ttft": 60, "tpot": 99})
    assert not meets_slos(slow, {"e2el": 1000})
    assert not meets_slos(_rec(2, 1, 1, 2, ok=False), {"ttft": 1e9})
    s = summarize([one, slow], 4.0, {"ttft": 60, "tpot": 50})
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.25)
    assert summarize([one], 1.0)["request_goodput"] is None  # no SLOs given


def test_summary_of_nothing_is_finite_json() -> None:
    s = summarize([_rec(0, 0, 0, 3, ok=False, error="x")], 1.0)
    assert s["completed"] == 0 and s["p99_ttft_ms"] == 0.0
    json.dumps(s, allow_nan=False)


def test_parse_goodput_and_percentiles() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in ("ttft", "itl:5", "ttft:x", "ttft:0"):
        with pytest.raises(ValueError):
            parse_goodput([bad])
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    for bad in ("", "0", "101", "a"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_record_json_round_trip() -> None:
    r = _rec(3, 12.5, 112.5, 5)
    d = r.to_json()
    assert d["tpot_ms"] == pytest.approx(25) and d["ttft_ms"] == pytest.approx(12.5)
    back = RequestRecord.from_json(d)
    assert back.tpot == pytest.approx(r.tpot) and back.itl == pytest.approx(r.itl)


# ------------------------------------------------------------------------------ arrivals


def test_poisson_arrivals_mean_and_cv() -> None:
    gaps = inter_arrival_times(20000, rate=5.0, burstiness=1.0, seed=1)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_cv(burstiness: float) -> None:
    gaps = inter_arrival_times(20000, rate=10.0, burstiness=burstiness, seed=2)
    assert gaps.mean() == pytest.approx(0.1, rel=0.04)  # the rate does not depend on it
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_offsets_shapes() -> None:
    assert arrival_offsets(4, math.inf) == [0.0, 0.0, 0.0, 0.0]
    offs = arrival_offsets(5, 2.0, seed=3)
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs, offs[1:], strict=False))
    assert arrival_offsets(5, 2.0, seed=3) == offs  # seeded
    assert arrival_offsets(0, 1.0) == []
    assert trace_offsets([5.0, 5.5, 7.0]) == [0.0, 0.5, 2.0]
    with pytest.raises(ValueError):
        inter_arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        inter_arrival_times(3, 1.0, burstiness=0)
    assert np.all(inter_arrival_times(3, 1.0, seed=0) > 0)


def test_arrival_offsets_exact_rate() -> None:
    plain = arrival_offsets(40, 2.0, seed=5)
    exact = arrival_offsets(40, 2.0, seed=5, exact_rate=True)
    assert exact[-1] == pytest.approx(39 / 2.0)  # realized rate (n - 1) / span == 2.0
    assert plain[-1] != pytest.approx(39 / 2.0, rel=1e-3)  # a plain sample is off
    # The same gaps, scaled: relative spacing unchanged.
    assert np.allclose(np.asarray(exact) / exact[-1], np.asarray(plain) / plain[-1])
    assert arrival_offsets(1, 2.0, exact_rate=True) == [0.0]
    assert arrival_offsets(3, math.inf, exact_rate=True) == [0.0, 0.0, 0.0]


def _timed(i: int, start: float, ttft: float, itl: list[float], tokens: int | None = None,
         ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, success=ok, start=start, ttft=ttft, itl=itl,
                         e2el=ttft + sum(itl),
                         output_tokens=len(itl) + 1 if tokens is None else tokens)


def test_steady_state_throughput_hand_worked() -> None:
    # Token arrival times: A at 1, 2, 3 (done at 3); B at 2.5, 3.5, 4.5, 5.5;
    # C (sent at 4, the last send) at 4.5 and 5.5 in 2-token chunks. Window [3, 4]:
    # A's token at 3 and B's at 3.5 -> 2 tokens over 1 s.
    recs = [_timed(0, 0.0, 1.0, [1.0, 1.0]), _timed(1, 1.0, 1.5, [1.0, 1.0, 1.0]),
            _timed(2, 4.0, 0.5, [1.0], tokens=4), _timed(3, 3.5, 0.0, [], ok=False)]
    tps, window = steady_state_output_throughput(recs)
    assert window == pytest.approx(1.0) and tps == pytest.approx(2.0)
    # Widen the window (a later send at 6): C's chunks count 2 tokens each.
    recs.append(_timed(4, 6.0, 0.5, [], tokens=1))
    tps, window = steady_state_output_throughput(recs)
    # [3, 6]: A 1 (at 3) + B 3 (3.5, 4.5, 5.5) + C 4 (4.5, 5.5) = 8 tokens over 3 s.
    assert window == pytest.approx(3.0) and tps == pytest.approx(8.0 / 3.0)
    # All sent before the first completion (rate inf): no steady window.
    assert steady_state_output_throughput([_timed(0, 0.0, 1.0, [1.0]),
                                           _timed(1, 0.0, 1.0, [0.5])]) is None
    assert steady_state_output_throughput([]) is None
    s = summarize(recs, duration=7.0)
    assert s["steady_output_throughput"] == pytest.approx(8.0 / 3.0)
    assert s["steady_window_s"] == pytest.approx(3.0)


# ----------------------------------------------------------------------------------- SSE


def test_sse_decoder_splits_and_joins() -> None:
    stream = (b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\ndata: {"b"'
              b': 2}\n\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]')
    for cut in range(1, len(stream)):  # every split point between two reads
        dec = SSEDecoder()
        got = dec.feed(stream[:cut]) + dec.feed(stream[cut:]) + dec.flush()
        assert got == ['{"a": 1}', '{"b": 2}', "line1\nline2", "[DONE]"], cut


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"


# ---------------------------------------------------------------- request timing (fake IO)


class _FakeTransport:
    """Yields canned byte reads; a fake clock makes every timestamp known."""

    def __init__(self, reads: list[bytes], status: int = 200) -> None:
        self.reads, self.status = reads, status
        self.payloads: list[dict[str, Any]] = []

    @asynccontextmanager
    async def stream(self, url: str, headers: dict[str, str],
                     payload: dict[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        from disagg.bench.client import HTTPStatusError

        self.payloads.append(payload)
        if self.status != 200:
            raise HTTPStatusError(self.status, '{"error": {"message": "nope"}}')

        async def gen() -> AsyncIterator[bytes]:
            for r in self.reads:
                yield r

        yield gen()

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        return {}

    async def aclose(self) -> None:
        pass


def _ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chat(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return _ev({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _clock(times: list[float]) -> Iterator[float]:
    return iter(times)


def _spec(endpoint: str = "chat") -> RequestSpec:
    return RequestSpec(index=0, url="http://x/v1/chat/completions", endpoint=endpoint,
                       model="m", prompt="hi", prompt_len=3, max_tokens=4, ignore_eos=True)


def test_send_request_timing_from_chunks() -> None:
    reads = [
        _chat(role=True, content=""),  # t=0.05: role only, not a token
        _chat("Hel"),  # t=0.10: first token
        _chat("lo") + _chat(" wor"),  # t=0.20: two events in one read share a timestamp
        _chat("ld", finish="length"),  # t=0.35
        _ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
        + b"data: [DONE]\n\n",  # t=0.36
    ]
    clock = _clock([1.0, 1.05, 1.10, 1.20, 1.35, 1.36, 1.40])  # send, 5 reads, end
    tr = _FakeTransport(reads)
    rec = asyncio.run(send_request(tr, _spec(), t_origin=0.5, clock=lambda: next(clock)))
    assert rec.success, rec.error
    assert rec.start == pytest.approx(0.5)
    assert rec.ttft == pytest.approx(0.10)
    assert rec.itl == pytest.approx([0.10, 0.0, 0.15])
    assert rec.e2el == pytest.approx(0.40)
    assert rec.output_tokens == 4 and rec.server_prompt_tokens == 7
    assert rec.tpot == pytest.approx((0.40 - 0.10) / 3)
    assert rec.finish_reason == "length" and rec.output_chars == len("Hello world")
    p = tr.payloads[0]
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["max_tokens"] == 4 and p["ignore_eos"] is True
    assert p["messages"] == [{"role": "user", "content": "hi"}]


def test_send_request_counts_chunks_without_usage() -> None:
    reads = [_ev({"choices": [{"text": t, "finish_reason": None}]}) for t in "abc"]
    reads.append(b"data: [DONE]\n\n")
    clock = _clock([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    rec = asyncio.run(send_request(_FakeTransport(reads), _spec("completions"), 0.0,
                                   clock=lambda: next(clock)))
    assert rec.success and rec.output_tokens == 3 and rec.server_prompt_tokens is None
    assert rec.input_tokens == 3  # falls back to the dataset's prompt length


@pytest.mark.parametrize("reads,status,msg", [
    ([], 503, "HTTP 503: nope"),
    ([_chat("a"), _ev({"error": {"message": "engine died"}})], 200, "engine died"),
    ([_chat("a")], 200, "stream ended before [DONE]"),
    ([b"data: [DONE]\n\n"], 200, "without any generated output"),
    ([b"data: {not json\n\n"], 200, "bad JSON"),
])
def test_send_request_failures_are_recorded(reads: list[bytes], status: int, msg: str) -> None:
    rec = asyncio.run(send_request(_FakeTransport(reads, status), _spec(), 0.0))
    assert not rec.success and msg in rec.error and rec.output_tokens == 0
