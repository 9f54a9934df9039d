"""``bench.kv_transfer``'s target line: met / not met per backend at the largest prompt, and
for a UCX miss the bound a gather copy sets, computed from the run's own figures."""

from __future__ import annotations

from bench import kv_transfer


def _row(backend: str, tokens: int, cons_ms: float, frag_ms: float, cons_gbps: float,
         memcpy_gbps: float) -> dict:
    return {"backend": backend, "tokens": tokens, "path": "runs",
            "ms": {"consecutive": cons_ms, "fragmented": frag_ms},
            "gbps": {"consecutive": cons_gbps}, "memcpy_gbps": memcpy_gbps}


def test_target_line_gives_the_copy_bound_for_a_ucx_miss() -> None:
    rows = [_row("UCX", 512, 4.0, 6.0, 2.0, 6.0), _row("UCX", 8192, 30.0, 75.0, 4.0, 4.0),
            _row("TCP", 8192, 50.0, 60.0, 2.5, 5.0)]
    line = kv_transfer.target_line(rows)
    assert line.startswith("This run at 8192 tokens: UCX fragmented / consecutive 40% (not met)"
                           ", UCX consecutive 4.00 GB/s (not met), TCP fragmented / "
                           "consecutive 83% (met).")
    # 1 / (1 + 4.0 / 4.0) = 50%: the gather copy alone takes as long as the transfer
    assert line.endswith("= 50% at 8192 tokens in this run (measured: 40%).")
    staged = dict(_row("UCX", 8192, 30.0, 60.0, 4.0, 4.0), path="staged")
    assert kv_transfer.target_line([*rows, staged]).endswith(
        "(measured: 40%; the staged path, one gather: 50%).")


def test_target_line_has_no_reason_when_met() -> None:
    line = kv_transfer.target_line([_row("UCX", 8192, 30.0, 33.0, 5.5, 6.0)])
    assert line == ("This run at 8192 tokens: UCX fragmented / consecutive 91% (met), UCX "
                    "consecutive 5.50 GB/s (met).")
