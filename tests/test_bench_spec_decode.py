"""Speculative decoding's benchmarks: ``disagg bench rate-match --gen-spec`` (settings parsed
and refused by name, worker flags, pairs and the ctx:gen table per setting on hand-worked
values, a short live sweep marked slow) and ``bench/spec_decode.py``'s pieces on the tiny
model (the layer-truncated draft, the prompt sets, a measured run, the report)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import spec_decode as sd
from disagg.bench.ratematch import RateMatchConfig
from disagg.bench.ratematch.layouts import (
    Layout,
    ServedWorker,
    ServeSpec,
    format_layouts,
    layouts_result,
    parse_gen_specs,
    spec_decode_counters,
)
from disagg.cli import main as cli_main

# ------------------------------------------------------------------ rate-match --gen-spec


def test_gen_specs_parse_short_forms_and_json(tmp_path: Path) -> None:
    specs = parse_gen_specs("off, ngram:4,ngram:3:2", "--gen-spec")
    assert [s.label for s in specs] == ["off", "ngram:4", "ngram:3:2"]
    assert parse_gen_specs("ngram")[0].config == specs[1].config  # K defaults to 4
    assert specs[0].config is None and specs[0].serve_flags() == []
    assert specs[1].config == {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert specs[2].config is not None and specs[2].config["prompt_lookup_max"] == 2
    flags = specs[1].serve_flags()
    assert flags[0] == "--speculative-config" and json.loads(flags[1]) == specs[1].config
    draft = tmp_path / "my-draft"
    draft.mkdir()
    (d,) = parse_gen_specs(f"draft:3:{draft}")
    assert d.label == "draft:3:my-draft"
    assert d.config == {"method": "draft_model", "num_speculative_tokens": 3,
                        "model": str(draft)}
    js = parse_gen_specs('[null, {"method": "ngram", "num_speculative_tokens": 2, '
                         '"prompt_lookup_min": 2, "prompt_lookup_max": 3}, "ngram:5"]')
    assert [s.label for s in js] == ["off", "ngram:2:2-3", "ngram:5"]
    (one,) = parse_gen_specs('{"method": "ngram", "num_speculative_tokens": 3}')
    assert one.label == "ngram:3"


@pytest.mark.parametrize("text, says", [
    ("ngram:x", "'ngram:x' is not off, ngram[:K[:N]]"),
    ("eagle:3", "'eagle:3' is not off"),
    ("ngram:0", "num_speculative_tokens: must be an integer in [1, 32], got 0"),
    ("draft:3:/nonexistent/draft", "no draft checkpoint at '/nonexistent/draft'"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
    ("[1", "not valid JSON"),
    ("[]", "give at least one setting"),
    ("off,ngram:4,ngram:4", "a setting is listed twice"),
])
def test_bad_gen_specs_are_named(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--gen-spec: ") as e:
        parse_gen_specs(text, "--gen-spec")
    assert says in str(e.value)


def test_worker_command_carries_the_setting(tmp_path: Path) -> None:
    spec = ServeSpec("/m", str(tmp_path))
    (ng,) = parse_gen_specs("ngram:4")
    w = ServedWorker(spec, Layout(), "generation", "m", ng)
    cmd = w.command(1234)
    i = cmd.index("--speculative-config")
    assert json.loads(cmd[i + 1])["num_speculative_tokens"] == 4
    assert "--benchmark-gen-only" in cmd
    assert w.log_path == os.path.join(str(tmp_path), "generation-tp1-spec-ngram_4.log")
    plain = ServedWorker(spec, Layout(), "generation", "m")  # no --gen-spec: as before
    assert "--speculative-config" not in plain.command(1)
    assert plain.log_path.endswith("generation-tp1.log")


def test_spec_decode_counters() -> None:
    assert spec_decode_counters({}) is None
    got = spec_decode_counters({"disagg_spec_decode_num_drafts_total": 10.0,
                                "disagg_spec_decode_num_draft_tokens_total": 40.0,
                                "disagg_spec_decode_num_accepted_tokens_total": 15.0})
    assert got == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 15,
                   "acceptance_rate": 0.375, "tokens_per_target_forward": 2.5}


def _gen(layout: str, spec: str, points: list[tuple[int, float, float]]) -> dict[str, Any]:
    return {"layout": layout, "spec": spec, "speculative_config": None, "spec_decode": None,
            "devices": 1, "colocated": None,
            "points": [{"concurrency": c, "output_throughput": tps, "tokens_per_s_per_user": s,
                        "request_rate": tps / 10} for c, tps, s in points]}


def test_pairs_per_setting_and_the_ratio_table() -> None:
    cfg = RateMatchConfig(context_url="", generation_url="", ttft_slo_ms=100.0, osl=10)
    contexts = [{"layout": "tp1", "devices": 1, "ctx_rate": 2.0}]
    generations = [_gen("tp1", "off", [(1, 50.0, 50.0), (4, 120.0, 30.0)]),
                   _gen("tp1", "ngram:4", [(1, 80.0, 80.0), (4, 150.0, 37.5)])]
    res = layouts_result(cfg, ServeSpec("/m", "/logs"), contexts, generations, None)
    assert res["gen_specs"] == ["off", "ngram:4"]
    assert [(p["generation_layout"], p["generation_spec"]) for p in res["pairs"]] == [
        ("tp1", "off"), ("tp1", "ngram:4")]
    # ctx_per_gen = (output tok/s / osl) / ctx_rate: off c1 5 / 2 = 2.5, c4 12 / 2 = 6;
    # ngram c1 8 / 2 = 4 (x1.6 of off), c4 15 / 2 = 7.5 (x1.25).
    by = {r["concurrency"]: r["by_spec"] for r in res["spec_effect"]}
    assert by[1]["off"]["ctx_per_gen"] == pytest.approx(2.5)
    assert by[1]["ngram:4"]["ctx_per_gen"] == pytest.approx(4.0)
    assert by[1]["ngram:4"]["ctx_per_gen_vs_off"] == pytest.approx(1.6)
    assert by[4]["ngram:4"]["ctx_per_gen_vs_off"] == pytest.approx(1.25)
    # tput/device: off c1 50 / 3.5 = 14.29, c4 120 / 7 = 17.14; ngram c1 80 / 5 = 16,
    # c4 150 / 8.5 = 17.65: ngram c1 and c4 are the frontier.
    assert [(p["generation_spec"], p["concurrency"]) for p in res["frontier"]] == [
        ("ngram:4", 4), ("ngram:4", 1)]
    text = format_layouts(res)
    assert "matched ctx:gen by speculation" in text
    assert "spec ngram:4" in text and "7.50:1" in text and "6.00:1" in text
    # Without --gen-spec: no speculation keys at all (the result as before).
    plain = layouts_result(cfg, ServeSpec("/m", "/logs"), contexts,
                           [{k: v for k, v in generations[0].items()
                             if k not in ("spec", "speculative_config", "spec_decode")}], None)
    assert "gen_specs" not in plain and "spec_effect" not in plain
    assert "generation_spec" not in plain["pairs"][0]
    assert "matched ctx:gen by speculation" not in format_layouts(plain)


@pytest.mark.parametrize("argv, says", [
    (["--ctx-layouts", "tp1", "--gen-spec", "ngram:x"], "--gen-spec: 'ngram:x'"),
    (["--gen-spec", "off,ngram:4"], "--ctx-layouts: needed with --gen-layouts / --gen-spec"),
    (["--ctx-layouts", "tp1", "--gen-spec", "off,off"], "--gen-spec: a setting is listed"),
])
def test_cli_refuses_gen_spec_by_name(argv: list[str], says: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "rate-match", "--ttft-slo", "100", *argv])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
def test_gen_spec_sweep_live_tiny(tiny_checkpoint: Callable[..., str], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One context worker and two generation workers (speculation off, ngram) on a tiny
    llama, measured and stopped in turn; both pairs rate-matched, the ngram worker's
    counters read from its /metrics, the ratio table printed."""
    model = tiny_checkpoint("tiny-spec", seed=3)
    worker_yaml = tmp_path / "worker.yaml"
    worker_yaml.write_text("kv_cache_tokens: 4096\nmax_model_len: 512\ntokens_per_block: 16\n"
                           "kv_transfer_backend: TCP\nlog_level: warning\n")
    out = tmp_path / "spec.json"
    rc = cli_main(["bench", "rate-match", "--ctx-layouts", "tp1", "--gen-spec", "off,ngram:3",
                   "--serve-model", model, "--serve-worker-config", str(worker_yaml),
                   "--serve-timeout", "120", "--isl", "32", "--osl", "8",
                   "--ttft-slo", "2000", "--concurrency", "1,2", "--ctx-probe-seconds", "0.5",
                   "--ctx-min-prompts", "4", "--ctx-max-probes", "2", "--ctx-rate-start", "4",
                   "--gen-rounds", "2", "--num-warmups", "1", "--request-timeout", "60",
                   "--save-result", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "matched ctx:gen by speculation" in printed.out
    res = json.loads(out.read_text())
    gens = {g["spec"]: g for g in res["generations"]}
    assert sorted(gens) == ["ngram:3", "off"] and res["gen_specs"] == ["off", "ngram:3"]
    assert gens["off"]["spec_decode"] is None and gens["off"]["speculative_config"] is None
    sd_counts = gens["ngram:3"]["spec_decode"]
    assert sd_counts is not None and sd_counts["num_draft_tokens"] >= sd_counts[
        "num_accepted_tokens"] >= 0
    for g in gens.values():
        assert all(p["failed"] == 0 and p["completed"] == 2 * p["concurrency"]
                   for p in g["points"])
    assert [r["concurrency"] for r in res["spec_effect"]] == [1, 2]
    assert all(set(r["by_spec"]) == {"off", "ngram:3"} for r in res["spec_effect"])
    logs = tmp_path / "spec-workers"
    assert {p.name for p in logs.iterdir()} == {
        "context-tp1.log", "generation-tp1-spec-off.log", "generation-tp1-spec-ngram_3.log"}
    assert "--speculative-config" in (logs / "generation-tp1-spec-ngram_3.log").read_text()


# --------------------------------------------------------------------- bench/spec_decode.py


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> str:
    from disagg.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("sd") / "t4"),
                                 num_hidden_layers=4, seed=5)


def test_truncated_draft_keeps_the_first_layers(tiny4: str, tmp_path: Path) -> None:
    from safetensors import safe_open

    d = sd.truncate_checkpoint(tiny4, str(tmp_path / "d2"), 2)
    assert sd.num_layers(d) == 2
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(tiny4, "model.safetensors"), "pt") as g:
        keys = set(f.keys())
        assert {k for k in g.keys() if ".layers.2." not in k and ".layers.3." not in k} == keys
        assert (f.get_tensor("model.layers.1.mlp.up_proj.weight")
                == g.get_tensor("model.layers.1.mlp.up_proj.weight")).all()
    assert os.path.isfile(os.path.join(d, "tokenizer.json"))
    mtime = os.path.getmtime(os.path.join(d, "model.safetensors"))
    assert sd.truncate_checkpoint(tiny4, d, 2) == d  # kept: the same truncation
    assert os.path.getmtime(os.path.join(d, "model.safetensors")) == mtime
    with pytest.raises(ValueError, match=r"layers: 5 is not in \[1, 4\]"):
        sd.truncate_checkpoint(tiny4, str(tmp_path / "d5"), 5)


def test_measure_greedy_on_and_off(tiny4: str, tmp_path: Path) -> None:
    """Draft (the truncated checkpoint) and ngram runs emit exactly off's tokens; the
    counters and timings come out of the engine."""
    from disagg.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny4)
    prompts = {w: sd.build_prompts(tok, w) for w in sd.WORKLOADS}
    assert len(prompts["extractive"]) == len(prompts["plain"]) == 6
    # the extractive prompts hold their passage: prompt lookup has something to find
    assert "running_sum" in sd.prompt_texts("extractive")[0]
    assert sd.prompt_texts("extractive")[3].endswith(sd._PROSE[0])
    work = sd.batch_prompts(prompts["extractive"], 3, 2)
    assert len(work) == 3 and work[0] == prompts["extractive"][0]
    assert len(sd.batch_prompts(prompts["plain"], 1, 2)) == 2
    draft = sd.truncate_checkpoint(tiny4, str(tmp_path / "d1"), 1)
    max_len = max(len(p) for p in work) + 32
    runs = {}
    for name, spec in (("off", None),
                       ("ngram", {"method": "ngram", "num_speculative_tokens": 3}),
                       ("draft", {"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": 2})):
        eng = sd.make_engine(tiny4, spec, 3, max_len)
        runs[name] = sd.measure(eng, work, 3, 8)
        eng.shutdown()
    off = runs["off"]
    assert off.output_tokens == 24 and len(off.tpot_s) == 3 and off.drafts == 0
    assert off.catch_up_tokens is None and all(t > 0 for t in off.tpot_s)
    for name in ("ngram", "draft"):
        assert runs[name].outputs == off.outputs
    dr = runs["draft"]
    assert dr.drafts > 0 and 0 <= dr.accepted <= dr.draft_tokens <= 2 * dr.drafts
    assert dr.catch_up_tokens is not None and dr.catch_up_tokens >= sum(
        len(p) - 1 for p in work)  # every prompt computed by the draft at least once
    row = sd.summarize([dr], [off])
    assert row["identical_to_off"] and row["draft_tokens"] == dr.draft_tokens
    assert row["tokens_per_target_forward"] == pytest.approx(
        (dr.accepted + dr.drafts) / dr.drafts)
    assert row["ratio_vs_off"] == pytest.approx(dr.tokens_per_s / off.tokens_per_s)


def test_report_of_a_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.md"
    res = sd.main(["--models", "tiny", "--tiny-reps", "2", "--batches", "1,2",
                   "--batch1-requests", "1", "--max-tokens", "4", "--methods", "ngram,draft",
                   "--out", str(out)])
    capsys.readouterr()
    (m,) = res["models"]
    assert m["draft_layers"] == 1 and m["draft_pick"] == []  # 2-layer target: L = 1
    assert [(r["workload"], r["batch"], r["method"]) for r in m["rows"]] == [
        (w, b, x) for w in sd.WORKLOADS for b in (1, 2) for x in ("off", "ngram", "draft")]
    assert all(r["identical_to_off"] and r["reps"] == 2 for r in m["rows"])
    text = out.read_text()
    assert text.startswith("# Speculative decoding on CPU")
    assert "python -m bench.spec_decode --models tiny" in text and "- machine: " in text
    assert m["headline"] in text and "on the extractive set" in m["headline"]
    saved = json.loads((tmp_path / "spec.json").read_text())
    assert saved["models"][0]["rows"] == json.loads(json.dumps(m["rows"]))
