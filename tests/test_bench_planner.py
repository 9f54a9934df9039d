"""The pure parts of ``bench.planner``: the shifting trace, goodput, windows, flips."""

from __future__ import annotations

from bench import planner as pb
from disagg.bench.metrics import RequestRecord


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [7] * len(text.split())

    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        return ""

    all_special_ids: list[int] = []
    vocab_size = 64


def test_trace_phases_are_consecutive_with_their_shapes() -> None:
    phases = [pb.Phase("a", 10.0, 2.0, 20, 3), pb.Phase("b", 5.0, 4.0, 4, 9)]
    trace = pb.make_trace(_Tok(), phases, seed=3)
    assert [k for k, _ in trace] == [0] * 20 + [1] * 20
    a = [r for k, r in trace if k == 0]
    b = [r for k, r in trace if k == 1]
    assert all(r.prompt_len == 20 and r.expected_output_len == 3 for r in a)
    assert all(r.prompt_len == 4 and r.expected_output_len == 9 for r in b)
    assert a[0].timestamp == 0.0 and max(r.timestamp for r in a) <= 10.0
    assert b[0].timestamp == 10.0 and max(r.timestamp for r in b) <= 15.0
    again = pb.make_trace(_Tok(), phases, seed=3)
    assert [r.prompt for _, r in again] == [r.prompt for _, r in trace]  # fixed seed
    rb = pb.rebase(trace, 1)
    assert rb[0][1].timestamp == 0.0 and len(rb) == 20


def _rec(start: float, ttft: float, e2el: float, n: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=0, success=ok, start=start, ttft=ttft, e2el=e2el,
                         output_tokens=n)


def test_goodput_windows_and_flips() -> None:
    recs = [_rec(0.5, 0.1, 0.5, 5), _rec(1.0, 2.0, 2.5, 5), _rec(3.0, 0.1, 0.2, 5, ok=False),
            _rec(4.0, 0.2, 1.0, 5)]
    # TTFT <= 1 s and TPOT <= 150 ms: the first (TPOT 100 ms) and the last (200 ms: no)
    assert pb.goodput(recs, 2.0, {"ttft": 1000, "tpot": 150}) == 0.5
    w = pb.windows(recs, 4.0, 2.0, 2.0)
    assert [x["n"] for x in w] == [2, 1]  # sent in [0, 2) and [2, 4)
    assert w[1]["failed"] == 1 and w[1]["ttft_p90"] is None
    tl = [{"t": 0.0, "pools": {"context": 2}}, {"t": 1.0, "error": "x"},
          {"t": 2.0, "pools": {"context": 2}}, {"t": 3.0, "pools": {"context": 3}},
          {"t": 4.0, "pools": {"context": 2}}]
    assert pb.flips(tl) == [(0.0, 2), (3.0, 3), (4.0, 2)]
