"""The pure parts of ``bench.kv_streaming``: arguments, the target arithmetic, the per-phase
split from metric deltas, /metrics parsing and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import kv_streaming as ks


def test_defaults_and_reps_broadcast() -> None:
    s = ks.parse_args([])
    assert s.modes == ("agg", "off", "on") and s.tokens == (512, 2048, 8192)
    assert s.reps == (3, 3, 1) and s.backend == "TCP"
    assert s.max_len == 8208  # 8192 + 4 answer tokens, whole 16-token blocks
    assert s.step_tokens == 8192  # every prefill one forward
    s = ks.parse_args(["--modes", "agg,off", "--tokens", "64,256", "--reps", "2",
                       "--backend", "ucx"])
    assert s.modes == ("agg", "off") and s.reps == (2, 2) and s.backend == "UCX"
    assert s.command == "python -m bench.kv_streaming --modes agg,off --tokens 64,256 " \
                        "--reps 2 --backend ucx"


@pytest.mark.parametrize(("argv", "flag"), [
    (["--modes", "agg,offf"], "--modes"),
    (["--modes", "off,on"], "must include agg"),
    (["--modes", "agg"], "--modes"),
    (["--modes", "agg,off,off"], "--modes"),
    (["--tokens", "512,x"], "--tokens"),
    (["--tokens", "1"], "--tokens"),
    (["--reps", "1,2"], "--reps"),
    (["--reps", "0"], "--reps"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--backend", "RDMA"], "--backend"),
    (["--warmup", "-1"], "--warmup"),
])
def test_bad_arguments_exit_naming_the_flag(argv: list[str], flag: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ks.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def _sample(tokens: int, mode: str, ttft: float, itls: tuple[float, ...] = (0.1, 0.1, 0.1),
            rep: int = 0, text: str = "abc", phases: dict[str, float | None] | None = None
            ) -> ks.Sample:
    return ks.Sample(tokens, mode, rep, rep, ttft, list(itls), text, 0.1, phases or {})


def test_target_arithmetic_and_verdicts() -> None:
    assert ks.target_s(10.0, 0.2) == pytest.approx(0.7)
    s = ks.Settings(modes=("agg", "off", "on"), tokens=(512, 2048), reps=(3, 1))
    samples = [_sample(512, "agg", t, itls=(0.09, 0.1, 0.2), rep=i)
               for i, t in enumerate((2.0, 2.2, 2.1))]
    samples += [_sample(512, "off", t, rep=i) for i, t in enumerate((2.5, 2.4, 2.6))]
    samples += [_sample(512, "on", t, rep=i) for i, t in enumerate((2.2, 2.3, 2.25))]
    samples += [_sample(2048, "agg", 10.0, itls=(0.2, 0.2, 0.2)),
                _sample(2048, "on", 10.7)]
    assert ks.decode_step_s(samples, 512) == pytest.approx(0.1)
    vs = {(v.tokens, v.mode): v for v in ks.verdicts(samples, s)}
    off = vs[(512, "off")]
    # median 2.5 vs 2.1: gap 0.4 > 5% * 2.1 + 0.1 = 0.205
    assert off.gap_s == pytest.approx(0.4) and off.target_s == pytest.approx(0.205)
    assert not off.met and off.gap_share == pytest.approx(0.4 / 2.1)
    assert vs[(512, "on")].met  # gap 0.15 <= 0.205
    assert off.added_s is None and off.added_met is None  # no phases in these samples
    late = ks.Verdict(512, "on", 1, 2.2, 2.1, 0.1, added_s=0.3)
    assert late.met and late.added_met is False  # 0.3 > 0.205
    assert vs[(2048, "on")].met and vs[(2048, "on")].reps == 1  # 0.7 <= 0.5 + 0.2, at the edge
    assert (2048, "off") not in vs  # not measured there
    # within each rep: 0.5, 0.2, 0.5 -> 0.5 (the gap of the medians is 0.4)
    assert ks.paired_gap_s(samples, 512, "off") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no aggregated"):
        ks.decode_step_s(samples, 8192)


def _deltas(**kw: float) -> dict[str, float]:
    d = {name: 0.0 for name in ks.ROUTER_METRICS}
    d.update({f"gen.{n}": 0.0 for n in ks.GEN_METRICS})
    d.update({f"ctx.{n}": 0.0 for n in ks.CTX_METRICS})
    d.update({k.replace("__", "."): v for k, v in kw.items()})
    return d


def test_phases_of_the_two_flows() -> None:
    d = _deltas(disagg_router_ctx_latency_seconds_sum=2.0,
                disagg_router_ctx_latency_seconds_count=1,
                disagg_router_gen_first_byte_seconds_sum=2.3,
                disagg_router_gen_first_byte_seconds_count=1,
                gen__disagg_kv_transfer_seconds_sum=0.05,
                gen__disagg_kv_transfer_seconds_count=4,
                gen__disagg_kv_pull_seconds_total=0.06,
                gen__disagg_time_to_first_token_seconds_sum=0.1,
                ctx__disagg_time_to_first_token_seconds_sum=1.9,
                ctx__disagg_time_to_first_token_seconds_count=1)
    off = ks.phases_of("off", d)
    assert off["added"] == pytest.approx(2.3)  # G's call starts at the context answer
    on = ks.phases_of("on", d)
    assert on["added"] == pytest.approx(0.3)  # both calls start together
    assert on["reads"] == 4 and on["gen_after_pull"] == pytest.approx(0.04)
    assert on["ctx_ttft"] == pytest.approx(1.9)
    none = ks.phases_of("on", _deltas(disagg_router_gen_first_byte_seconds_sum=2.3,
                                      disagg_router_gen_first_byte_seconds_count=1))
    assert none["ctx_call"] is None and none["added"] is None and none["ctx_ttft"] is None


def test_scrape_sums_label_sets_and_streaming_counters() -> None:
    text = "\n".join([
        "# HELP disagg_kv_transfer_seconds x",
        'disagg_kv_transfer_seconds_sum{model_name="m",role="generation"} 1.5',
        'disagg_kv_transfer_seconds_sum{model_name="m",role="other"} 0.5',
        "disagg_kv_transfer_seconds_count 3.0",
        'disagg_kv_transfer_seconds_sum_extra{a="b"} 9',
        'disagg_router_requests_total{endpoint="c",outcome="stream_error"} 1.0',
        'disagg_router_kv_stream_requests_total{mode="streamed"} 2.0',
    ])
    got = ks.scrape(text, ["disagg_kv_transfer_seconds_sum", "disagg_kv_transfer_seconds_count",
                           "absent_total"])
    assert got == {"disagg_kv_transfer_seconds_sum": 2.0,
                   "disagg_kv_transfer_seconds_count": 3.0, "absent_total": 0.0}
    assert ks.streaming_counters(text) == {
        'disagg_router_kv_stream_requests_total{mode="streamed"}': 2.0}


def _info(s: ks.Settings) -> dict[str, object]:
    return {"date": "2026-01-01", "machine": ["CPU: test"], "model": "m", "kernels": "none",
            "cores": (0, 1), "backend": "TCP", "step_tokens": s.step_tokens,
            "max_len": s.max_len, "max_tokens": 4, "warmup": 1, "command": s.command,
            "load": ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)), "wall_s": 90.0,
            "streaming": "not started", "notes": ks.run_notes(ks.RunLog(replaced=1), s)}


def test_report_partial_run() -> None:
    s = ks.parse_args(["--modes", "agg,off", "--tokens", "512,2048", "--reps", "2,1"])
    ph = {"ctx_call": 2.0, "ctx_ttft": 1.9, "gen_first_byte": 0.03, "added": 0.03,
          "transfer": 0.01, "reads": 1.0, "install": 0.0, "pull": 0.012,
          "gen_after_pull": 0.004}
    samples = [_sample(512, "agg", 2.0, rep=0), _sample(512, "agg", 2.2, rep=1),
               _sample(512, "off", 2.05, rep=0, phases=ph),
               _sample(512, "off", 2.1, rep=1, text="other", phases=ph),
               _sample(2048, "agg", 10.0), _sample(2048, "off", 11.0, phases=ph)]
    text = ks.report(samples, s, _info(s))
    assert "**Headline:** disagg, streaming off: target missed at 2048 tokens " \
           "(gap vs aggregated TTFT 512: -1.2%, 2048: +10.0%); G's added latency within the " \
           "target at every length measured (512: 30 ms, 2048: 30 ms)." in text
    assert "**Partial run:** streaming on was not measured" in text
    assert "Cost of the host" not in text  # 0.1 cores of others: within --max-other
    assert "| 512 | disagg, streaming off | 2 | 2075 | 2050-2100 | -25 | -1.2% | -25 | 205 " \
           "| **met** | 30 | yes |" in text
    assert "| 2048 | disagg, streaming off | 1 | 11000 | 11000-11000 | +1000 | +10.0% | +1000 " \
           "| 600 | **missed** | 30 | yes |" in text
    assert "| 2048 | disagg, streaming off | 11000.0 | 2000.0 | 1900.0 | 30.0 | 30.0 " \
           "| 10.0 (1) | 0.0 | 12.0 | 4.0 | 100.0 |" in text
    assert "identical across the modes for 2 of 3 prompts" in text
    assert "1 prompt(s) replaced" in text and "a median of 1 is one request" in text
    assert "`python -m bench.kv_streaming --modes agg,off --tokens 512,2048 --reps 2,1`" \
        in text


def test_rewrite_renders_a_runs_json_with_its_own_settings(tmp_path: Path) -> None:
    import json
    from dataclasses import asdict

    s = ks.parse_args(["--modes", "agg,off", "--tokens", "512", "--reps", "1",
                       "--quiet-wait", "7"])
    info = {**_info(s), "settings": asdict(s)}
    samples = [_sample(512, "agg", 2.0), _sample(512, "off", 2.05)]
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"info": info, "samples": [asdict(x) for x in samples]}))
    out = tmp_path / "report.md"
    assert ks.main(["--rewrite", str(src), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(ks.report(samples, s, info).rstrip("\n"))
    assert f"Rendered again from `{src}`" in text
    assert ks.settings_from(json.loads(json.dumps(asdict(s)))) == s  # not today's defaults
    assert "| 512 | disagg, streaming off | 1 | 2050 | 2050-2050 | +50 | +2.5% | +50 | 200 " \
           "| **met** | n/a | n/a |" in text


def test_headline_and_notes_name_what_is_missing() -> None:
    s = ks.parse_args(["--tokens", "512,2048", "--reps", "1"])
    samples = [_sample(512, "agg", 2.0), _sample(512, "off", 2.05), _sample(512, "on", 2.5),
               _sample(2048, "agg", 10.0), _sample(2048, "off", 10.1)]
    head = ks.headline(ks.verdicts(samples, s), s)
    assert head == ("disagg, streaming off: target met at every length (gap vs aggregated TTFT "
                    "512: +2.5%, 2048: +1.0%); disagg, streaming on: target missed at 512 "
                    "tokens, **no result at 2048 tokens** (gap vs aggregated TTFT 512: "
                    "+25.0%).")
    log = ks.RunLog(counters={"on: x{mode=\"streamed\"}": 1.0},
                    failures=["2048 tokens, rep 0, on: HTTPStatusError: 502"],
                    waits=[(3.2, True), (60.5, False)])
    notes = "\n".join(ks.run_notes(log, s))
    assert "`on: x{mode=\"streamed\"}` 1" in notes
    assert "at most 20 s): 64 s in all; 1 of 2 waits gave up." in notes
    assert "**1 request(s) failed**" in notes and "- 2048 tokens, rep 0, on: HTTP" in notes


def test_report_states_the_hosts_load_when_others_were_busy() -> None:
    import dataclasses

    s = ks.parse_args(["--modes", "agg,off", "--tokens", "512", "--reps", "2"])
    samples = [dataclasses.replace(_sample(512, m, t, rep=r), other_cores=1.0)
               for m, r, t in (("agg", 0, 2.0), ("agg", 1, 3.0), ("off", 0, 2.1),
                               ("off", 1, 2.2))]
    text = ks.report(samples, s, _info(s))
    # agg: (3.0 - 2.0) / 2.5 = 40%, the widest cell
    assert "other processes used a median 1.00 of its" in text
    assert "the TTFT spread within a cell reached 40% of its median" in text


def test_on_vs_off_is_judged_by_the_paired_ttft() -> None:
    s = ks.parse_args(["--tokens", "512,2048", "--reps", "2"])
    ph = {"added": 0.0, "transfer": 0.0, "ctx_ttft": 0.0}
    samples = [_sample(512, "agg", 2.0), _sample(2048, "agg", 10.0),
               # 512: G adds less with streaming on, but C's prefill costs more than it saves
               *[_sample(512, "off", 2.0 + r, rep=r,
                         phases={**ph, "added": 0.02, "transfer": 0.01, "ctx_ttft": 1.9 + r})
                 for r in (0, 1)],
               *[_sample(512, "on", 2.05 + r, rep=r,
                         phases={**ph, "added": 0.001, "ctx_ttft": 1.99 + r}) for r in (0, 1)],
               # 2048: on is lower in both reps; rep 1 has no off sample (not paired)
               _sample(2048, "off", 10.0, phases={**ph, "added": 0.2, "transfer": 0.15}),
               _sample(2048, "on", 9.8, phases={**ph, "added": 0.01}),
               _sample(2048, "on", 20.0, rep=1, phases={**ph, "added": 0.01})]
    lines = ks.overlap_table(samples, s)
    assert "lower TTFT at 1 of 2 lengths measured (off is the better default" in lines[0]
    assert lines[-2] == "| 512 | 2 | +50 | +50..+50 | +90 | 1 / 20 | 10 | **no** |"
    assert lines[-1] == "| 2048 | 1 | -200 | -200..-200 | +0 | 10 / 200 | 150 | yes |"
    assert ks.overlap_table(samples, ks.parse_args(["--modes", "agg,off"])) == []
