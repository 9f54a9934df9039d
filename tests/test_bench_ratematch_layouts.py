"""`disagg bench rate-match --ctx-layouts ... --gen-layouts ...`: layouts parsed and refused by
name, the pairs and the frontier over them on hand-worked values, and a short live sweep that
starts one worker per layout on a tiny mixture of experts (tp1, tp2 and tp2 with expert
parallelism)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.bench.ratematch import RateMatchConfig, tput_per_device
from disagg.bench.ratematch.layouts import Layout, ServeSpec, layouts_result, parse_layouts
from disagg.cli import main as cli_main


def test_layouts_parse_and_name() -> None:
    assert Layout.parse("tp2") == Layout(2, 1, False)
    assert Layout.parse("pp2") == Layout(1, 2, False)
    assert Layout.parse("TP2+pp2") == Layout(2, 2, False)
    assert Layout.parse("tp4+ep") == Layout(4, 1, True)
    assert Layout.parse("ep+tp2").name == "tp2+ep"
    assert Layout(2, 2, True).name == "tp2+pp2+ep" and Layout(2, 2, True).devices == 4
    assert Layout.parse("tp2+ep").serve_flags() == [
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--enable-expert-parallel"]
    assert Layout().serve_flags()[-1] == "--no-enable-expert-parallel"
    assert [x.name for x in parse_layouts("tp1, tp2,tp2+ep", "--gen-layouts")] == [
        "tp1", "tp2", "tp2+ep"]


@pytest.mark.parametrize("text, says", [
    ("tp2+tp2", "'tp2' is not tpN, ppN or ep"),
    ("dp2", "'dp2' is not tpN"),
    ("tp", "'tp' is not tpN"),
    ("ep", "ep partitions the experts over the tensor-parallel ranks, so it needs tp >= 2"),
    ("tp0", "tp and pp must be >= 1"),
    ("tp1,tp1", "a layout is listed twice"),
    (" , ", "give at least one layout"),
])
def test_bad_layouts_are_named(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--ctx-layouts: ") as e:
        parse_layouts(text, "--ctx-layouts")
    assert says in str(e.value)


def _gen(layout: str, devices: int, points: list[tuple[int, float, float]]) -> dict[str, Any]:
    return {"layout": layout, "devices": devices, "colocated": None,
            "points": [{"concurrency": c, "output_throughput": tps, "tokens_per_s_per_user": s,
                        "request_rate": tps / 10} for c, tps, s in points]}


def test_pairs_and_the_frontier_over_them() -> None:
    cfg = RateMatchConfig(context_url="", generation_url="", ttft_slo_ms=100.0, osl=10)
    contexts = [{"layout": "tp1", "devices": 1, "ctx_rate": 2.0},
                {"layout": "tp2", "devices": 2, "ctx_rate": 5.0},
                {"layout": "pp2", "devices": 2, "ctx_rate": None}]  # met the SLO at no rate
    generations = [_gen("tp1", 1, [(1, 50.0, 50.0), (4, 120.0, 30.0)]),
                   _gen("tp2+ep", 2, [(1, 90.0, 90.0), (4, 200.0, 50.0)])]
    res = layouts_result(cfg, ServeSpec("/m", "/logs"), contexts, generations, None)
    assert res["kind"] == "disagg-bench-rate-match-layouts"
    assert "context_url" not in res["config"] and "gen_devices" not in res["config"]
    pairs = {(p["context_layout"], p["generation_layout"]): p for p in res["pairs"]}
    assert sorted(pairs) == [("tp1", "tp1"), ("tp1", "tp2+ep"), ("tp2", "tp1"),
                             ("tp2", "tp2+ep")]  # pp2 met no rate: in no pair
    for (cl, gl), pair in pairs.items():
        ctx = next(c for c in contexts if c["layout"] == cl)
        gen = next(g for g in generations if g["layout"] == gl)
        for p, g in zip(pair["rate_matched"], gen["points"], strict=True):
            assert p["tput_per_device"] == pytest.approx(tput_per_device(
                g["output_throughput"], 10, ctx["ctx_rate"], ctx["devices"], gen["devices"]))
    # By hand: tp1|tp1 c1: 50 / (1 * 5 / 2 + 1) = 14.29; c4: 120 / (12 / 2 + 1) = 17.14.
    # tp2|tp1 c1: 50 / (2 * 5 / 5 + 1) = 16.67; c4: 120 / (2 * 12 / 5 + 1) = 20.69.
    # tp1|tp2+ep c1: 90 / (9 / 2 + 2) = 13.85; c4: 200 / (20 / 2 + 2) = 16.67.
    # tp2|tp2+ep c1: 90 / (2 * 9 / 5 + 2) = 16.07; c4: 200 / (2 * 20 / 5 + 2) = 20.0.
    # Frontier (x = tok/s/user): tp2|tp2+ep at 90, tp2|tp2+ep at 50 (20.0 beats the 16.67
    # of tp2|tp1 at 50 and nothing faster), tp2|tp1 at 30 (20.69, the most per device).
    got = [(p["context_layout"], p["generation_layout"], p["concurrency"],
            round(p["tput_per_device"], 2)) for p in res["frontier"]]
    assert got == [("tp2", "tp1", 4, 20.69), ("tp2", "tp2+ep", 4, 20.0),
                   ("tp2", "tp2+ep", 1, 16.07)]


@pytest.mark.parametrize("argv, says", [
    (["--ctx-layouts", "tp1", "--context-url", "http://x"], "--context-url: not with"),
    (["--ctx-layouts", "tp1", "--serve-model", "/nonexistent"], "--serve-model: a checkpoint"),
    (["--ctx-layouts", "tp3+ep+ep"], "--ctx-layouts: layout 'tp3+ep+ep'"),
    (["--gen-layouts", "tp1"], "--ctx-layouts: needed with --gen-layouts"),
    (["--ctx-layouts", "tp1", "--colocated"], "--colocated: not with"),
    ([], "--context-url: required (or measure layouts"),
])
def test_cli_refuses_by_name(argv: list[str], says: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "rate-match", "--ttft-slo", "100", *argv])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
def test_layout_sweep_live_tiny_moe(tiny_checkpoint: Callable[..., str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny Qwen3-MoE: one context worker (tp1) and two generation workers (tp2, tp2 with
    expert parallelism) started, measured and stopped in turn; both pairs rate-matched with
    their devices; JSON, PNG, worker logs."""
    model = tiny_checkpoint("tiny-moe", arch="qwen3_moe", seed=1)
    worker_yaml = tmp_path / "worker.yaml"
    worker_yaml.write_text("kv_cache_tokens: 4096\nmax_model_len: 512\ntokens_per_block: 16\n"
                           "kv_transfer_backend: TCP\nlog_level: warning\n")
    out = tmp_path / "layouts.json"
    rc = cli_main(["bench", "rate-match", "--ctx-layouts", "tp1", "--gen-layouts", "tp2,tp2+ep",
                   "--serve-model", model, "--serve-worker-config", str(worker_yaml),
                   "--serve-timeout", "120", "--isl", "32", "--osl", "5",
                   "--ttft-slo", "2000", "--concurrency", "1,2", "--ctx-probe-seconds", "0.5",
                   "--ctx-min-prompts", "4", "--ctx-max-probes", "2", "--ctx-rate-start", "4",
                   "--gen-rounds", "2", "--num-warmups", "1", "--request-timeout", "60",
                   "--save-result", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "Rate matching over layouts" in printed.out
    res = json.loads(out.read_text())
    (ctx,) = res["contexts"]
    assert (ctx["layout"], ctx["devices"]) == ("tp1", 1.0) and ctx["ctx_rate"] is not None
    gens = {g["layout"]: g for g in res["generations"]}
    assert sorted(gens) == ["tp2", "tp2+ep"] and gens["tp2+ep"]["devices"] == 2.0
    for g in gens.values():
        assert [p["concurrency"] for p in g["points"]] == [1, 2]
        assert all(p["failed"] == 0 and p["completed"] == 2 * p["concurrency"]
                   for p in g["points"])
    assert [(p["context_layout"], p["generation_layout"]) for p in res["pairs"]] == [
        ("tp1", "tp2"), ("tp1", "tp2+ep")]
    for pair in res["pairs"]:
        g = gens[pair["generation_layout"]]
        for p, gp in zip(pair["rate_matched"], g["points"], strict=True):
            assert p["tput_per_device"] == pytest.approx(tput_per_device(
                gp["output_throughput"], 5, ctx["ctx_rate"], 1.0, g["devices"]))
    assert res["frontier"]
    logs = tmp_path / "layouts-workers"
    assert {p.name for p in logs.iterdir()} == {
        "context-tp1.log", "generation-tp2.log", "generation-tp2+ep.log"}
    assert "--tensor-parallel-size 2" in (logs / "generation-tp2.log").read_text()
    assert "--enable-expert-parallel" in (logs / "generation-tp2+ep.log").read_text()
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "layouts.png")).shape[0] >= 400
