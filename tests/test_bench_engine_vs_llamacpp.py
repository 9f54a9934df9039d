"""``bench/engine_vs_llamacpp.py`` without llama.cpp: a short live run on the tiny model (its
disagg-only part: offline child, ``disagg serve`` under a small load) must write the report
and JSON with every disagg row measured and say why the llama.cpp rows are missing; the report
writer's ratio columns on that run's records (a second column made from them); the build's
refusals (no build and ``--no-build``, a marker for other pins)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import engine_vs_llamacpp as evl

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model", "tiny", "--repeats", "2", "--decode-tokens", "6", "--short-prompt", "8",
        "--long-prompt", "24", "--prefill-tokens", "48", "--serve-requests", "4",
        "--serve-prompt", "8-24", "--serve-output", "5", "--concurrency", "2",
        "--quiet-wait", "0", "--reruns", "0"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("evl")
    out = tmp / "r.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cp = subprocess.run([sys.executable, "-m", "bench.engine_vs_llamacpp", *ARGS, "--threads",
                         "1", "--out", str(out), "--work-dir", str(tmp / "work")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    return {"md": out.read_text(), "json": json.loads(out.with_suffix(".json").read_text())}


def _table(md: str, section: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table under the heading ``section``."""
    lines = md.splitlines()
    at = lines.index(section)
    start = next(i for i in range(at, len(lines)) if lines[i].startswith("|"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_disagg_only_run_writes_every_disagg_row(live: dict[str, Any]) -> None:
    md, data = live["md"], live["json"]
    assert "**llama.cpp rows missing: the tiny model has no GGUF" in md
    offline = _table(md, "## Single stream (offline)")
    serving = _table(md, "## Serving: concurrent streams")
    assert [r[0] for r in offline + serving] == [
        "decode tokens/s, 6 tokens after a 8-token prompt",
        "decode tokens/s, 6 tokens after a 24-token prompt",
        "prefill of 48 tokens (s to the first token)",
        "peak RSS, offline single-stream process (MiB)",
        "of it: RSS once the runtime is imported, before the model (MiB)",
        "of it: peak RSS above that (model, KV cache, work; MiB)",
        "output tokens/s", "peak RSS after the runs (MiB)"]
    for row in offline + serving:  # median (min-max) of the 2 repeats, all positive
        m = re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", row[1])
        assert m, row
        med, lo, hi = map(float, m.groups())
        assert 0 < lo <= med <= hi, row
    runs = data["offline_runs"]
    assert [(r["system"], r["repeat"]) for r in runs] == [("disagg", 0), ("disagg", 1)]
    for r in runs:
        assert r["error"] == "" and r["superseded"] is False
        res = r["result"]
        assert res["decode_short"]["tokens"] == 6 and res["decode_long"]["tokens"] == 6
        assert res["decode_long"]["first_token_s"] > 0 and res["prefill_s"] > 0
        assert res["peak_rss_mib"] > res["import_rss_mib"] > 50  # torch alone is more
    serve = data["serve_runs"]
    assert len(serve) == 2
    for r in serve:
        assert r["errors"] == [] and r["requests_ok"] == 4
        assert r["output_tokens"] == 4 * 5 and r["output_tok_s"] > 0
        assert r["peak_rss_mib"] >= r["rss_mib"] > 50
    st = data["summary"]["serve"]["disagg"]["output_tok_s"]
    assert st["n"] == 2 and st["min"] <= st["median"] <= st["max"]


@pytest.mark.slow
def test_ratio_columns_from_the_run(live: dict[str, Any]) -> None:
    """A second column made from the run's own records, twice as fast and half the size:
    every ratio cell must say 0.50x (speeds and prefill as speeds; sizes as sizes)."""
    data = live["json"]
    ns = evl._parser().parse_args(ARGS)
    ns.offline_ctx = data["config"]["offline_ctx"]
    runs = [evl.Run(**r) for r in data["offline_runs"]]
    faster = []
    for r in runs:
        res = json.loads(json.dumps(r.result))
        for k in ("decode_short", "decode_long"):
            res[k]["decode_tok_s"] *= 2
        res["prefill_s"] /= 2
        res["peak_rss_mib"] *= 2
        res["import_rss_mib"] *= 2  # and so the peak above it too
        faster.append(dataclasses.replace(r, system="llama.cpp F32", result=res))
    serve = [evl.ServeRun(**r) for r in data["serve_runs"]]
    serve += [dataclasses.replace(r, system="llama.cpp F32", output_tok_s=r.output_tok_s * 2,
                                  peak_rss_mib=r.peak_rss_mib * 2) for r in serve]
    systems = [evl.System("disagg", "disagg", "m"), evl.System("llama.cpp F32", "llamacpp", "f")]
    all_runs = [x for pair in zip(runs, faster, strict=True) for x in pair]
    summary = evl.summarize(systems, all_runs, serve)
    md = evl.report(ns, systems, all_runs, serve, summary, {**data["info"],
                                                             "llamacpp_missing": ""})
    rows = _table(md, "## Single stream (offline)") + _table(md, "## Serving: concurrent streams")
    assert len(rows) == 8
    for row in rows:
        assert row[-1].startswith("**0.50x** (0.50-0.50)"), row
    assert "llama.cpp rows missing" not in md


def test_ratio_columns_pair_quantized_disagg_with_the_same_file() -> None:
    """disagg's float32 import against every llama.cpp file; ``disagg Q8_0`` (the GGUF served
    with --gguf-weights quantized) against llama.cpp on that file only; none without it."""
    names = ["disagg", "llama.cpp F32", "disagg Q8_0", "llama.cpp Q8_0", "disagg Q4_1"]
    assert evl.ratio_pairs(names) == [("disagg", "llama.cpp F32"), ("disagg", "llama.cpp Q8_0"),
                                      ("disagg Q8_0", "llama.cpp Q8_0")]
    assert evl.ratio_pairs(["disagg", "disagg Q4_1"]) == []


def test_no_build_refuses_clearly(tmp_path: Path) -> None:
    with pytest.raises(evl.BuildError, match="no llama.cpp build in .* --no-build"):
        evl.ensure_llamacpp(tmp_path / "none", 10.0, allow_build=False)


def test_a_marker_for_other_pins_is_not_reused(tmp_path: Path) -> None:
    for f in ("python", "lib", "server"):
        (tmp_path / f).write_text("")
    rec = {**evl._want(), "python": str(tmp_path / "python"), "lib_dir": str(tmp_path / "lib"),
           "server": str(tmp_path / "server"), "server_version": "v", "build_s": 1.0,
           "built_at": "t"}
    evl._marker(tmp_path).write_text(json.dumps(rec))
    found = evl._found(tmp_path)
    assert found is not None and found.reused and found.server == str(tmp_path / "server")
    evl._marker(tmp_path).write_text(json.dumps({**rec, "llama_cpp_python": "0.0.1"}))
    assert evl._found(tmp_path) is None
    os.unlink(tmp_path / "server")
    evl._marker(tmp_path).write_text(json.dumps(rec))
    assert evl._found(tmp_path) is None  # a marker whose files are gone
