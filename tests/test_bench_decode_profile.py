"""``bench/decode_profile.py`` on the tiny model: a short live run (one tree) writes the report
and JSON with every category measured, the categories adding up to the wrapped step, the
compiled kernels' time split out, and the memory children; the two-tree report (ratio column)
from that run's records."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import decode_profile as dp

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dp") / "r.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cp = subprocess.run([sys.executable, "-m", "bench.decode_profile", "--model",
                         tiny_checkpoint(seed=1), "--ctx", "8", "20", "--steps", "6",
                         "--rounds", "1", "--threads", "1", "--rss", "--rss-tokens", "4",
                         "--rss-kv", "256", "--quiet-wait", "0", "--max-others", "100",
                         "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    return {"md": out.read_text(), "json": json.loads(out.with_suffix(".json").read_text())}


def test_every_category_is_measured_and_adds_up(live: dict[str, Any]) -> None:
    (tree,) = live["json"]["runs"]
    for ctx in ("8", "20"):
        (run,) = live["json"]["runs"][tree][ctx]
        ms = run["ms"]
        parts = sum(ms[c + dp.TOTAL] for c, _ in dp.CATEGORIES)
        # medians of per-step values: their sum is close to, not exactly, the median step
        assert parts == pytest.approx(ms[dp.STEP], rel=0.25)
        assert ms[dp.IN_KERNELS] + ms[dp.OUTSIDE] == pytest.approx(ms[dp.STEP], rel=0.25)
        for c in ("linears of the layers (q/k/v, o, gate/up, down)", "sampler", "schedule",
                  "model: other (decoder Python, views, embedding)"):
            assert ms[c + dp.TOTAL] > 0, c
        assert ms[dp.TOK_S] > 0 and ms[dp.BARE] > 0
        if "elementwise" in run["kernels"]:  # the runner's CPU kernels were in the step
            assert ms["RoPE + K/V write, fused" + dp.TOTAL] > 0
            assert ms["RMSNorm (+ residual add)" + dp.KERNEL_PART] > 0
            assert ms["K/V write" + dp.TOTAL] == 0
    assert "## Decode after a 8-token prompt" in live["md"]
    assert "## Decode after a 20-token prompt" in live["md"]


def test_memory_children_report_both_setups(live: dict[str, Any]) -> None:
    rss = live["json"]["rss"]
    assert len(rss) == 2
    default, fixed = rss.values()
    assert fixed["kv_tokens"] == 256 and default["kv_tokens"] > 0
    for r in rss.values():
        assert r["end"]["VmHWM"] >= r["loaded"]["VmRSS"] > r["start"]["VmRSS"]
        assert r["weights_mib"] > 0
    assert "**peak RSS (VmHWM) at the end**" in live["md"]


def test_two_tree_report_has_the_ratio_column(live: dict[str, Any]) -> None:
    (tree,) = live["json"]["runs"]
    runs = {"before (x)": live["json"]["runs"][tree], "after (y)": live["json"]["runs"][tree]}
    runs = {t: {int(k): v for k, v in by.items()} for t, by in runs.items()}
    a = argparse.Namespace(ctx=[8, 20], threads=1, model="tiny", rounds=1, steps=6,
                           quiet_wait=0.0, rss_tokens=4, rss_kv=256)
    text = dp.report(a, runs, {}, live["json"]["facts"])
    assert "| all: after / before |" in text and "1.00x" in text and "identical" in text
