"""``bench/soak.py``: its flat rule and answer checks on made-up data, and a short live run (a
real ``disagg launch`` cluster under the mixed load for a few seconds): the report and raw
samples written, 0 errors, every process of the cluster with a numeric RSS slope, none of them
left once the script has exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import soak

ROOT = Path(__file__).resolve().parent.parent


def _samples(slope_mib_h: float, minutes: float, rss: float = 300.0, every_s: float = 10.0
             ) -> list[dict[str, Any]]:
    """Load samples of one process whose RSS rises at ``slope_mib_h``, then an idle one."""
    out = []
    t = 0.0
    while t <= minutes * 60:
        out.append({"t": t, "phase": "load", "procs": {"gen0 (pid 7)": {
            "rss_mib": rss + slope_mib_h * t / 3600, "fds": 20, "threads": 9}}})
        t += every_s
    out.append({"t": t + 5, "phase": "idle", "procs": out[-1]["procs"]})
    return out


def test_warmup_is_a_fifth_and_at_least_a_minute_for_long_runs() -> None:
    assert soak.warmup_s(1800) == 360
    assert soak.warmup_s(300) == 60
    assert soak.warmup_s(120) == pytest.approx(24)  # a short run: a fifth only


@pytest.mark.parametrize(("slope", "flat"), [(0.0, True), (10.0, True), (-10.0, True),
                                             (16.0, False), (100.0, False)])
def test_flat_rule_on_a_30_minute_run(slope: float, flat: bool) -> None:
    """~300 MiB: allowed drift max(2% = ~6 MiB, 4 MiB) over the 24 minutes after warm-up,
    so flat below ~15 MiB/h either way."""
    (row,) = soak.judge(_samples(slope, 30), 1800)
    assert row["slope_mib_h"] == pytest.approx(slope, abs=1e-6)
    assert row["rss_warm_mib"] == pytest.approx(300 + slope * 0.1)  # at t = 360 s
    assert row["tolerance_mib"] == pytest.approx(0.02 * row["rss_warm_mib"])
    assert row["drift_mib"] == pytest.approx(abs(slope) * 0.4)
    assert row["flat"] is flat and row["verdict"] == ("flat" if flat else "NOT FLAT")


def test_too_few_samples_is_not_flat() -> None:
    (row,) = soak.judge(_samples(0.0, 1, every_s=30), 60)
    assert row["flat"] is False and row["slope_mib_h"] is None
    assert "too few samples" in row["verdict"]


def test_answer_checks() -> None:
    spec = soak.Spec("chat_json", "/v1/chat/completions", {"n": 1}, False, True,
                     check="schema:0")
    assert soak.answer_problem(spec, ['{"id": 12, "ok": true}'], ["stop"]) is None
    assert soak.answer_problem(spec, ['{"id": 12, "ok'], ["length"]) is None  # cut: unchecked
    assert "boolean" in soak.answer_problem(spec, ['{"id": 1, "ok": 3}'], ["stop"])
    assert "not JSON" in soak.answer_problem(spec, ["{"], ["stop"])
    assert "finish_reason" in soak.answer_problem(spec, ["x"], [None])
    regex = soak.Spec("completion_regex", "/v1/completions", {}, False, False, check="regex:1")
    assert soak.answer_problem(regex, ["maybe"], ["stop"]) is None
    assert "does not match" in soak.answer_problem(regex, ["perhaps"], ["stop"])
    two = soak.Spec("completion", "/v1/completions", {"n": 2}, False, False)
    assert "1 choices" in soak.answer_problem(two, ["a"], ["stop"])


@pytest.mark.slow
def test_short_live_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cp = subprocess.run([sys.executable, "-m", "bench.soak", "--seconds", "8", "--clients",
                         "2", "--out", str(out), "--work-dir", str(tmp_path / "work")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.exists(), cp.stdout[-3000:] + cp.stderr[-3000:]
    raw = json.loads(out.with_suffix(".json").read_text())
    procs = [soak.Proc(**p) for p in raw["processes"]]
    # Whatever the verdicts, the script stopped the cluster: no process of it is alive.
    assert [p for p in procs if p.alive()] == [] and raw["left_behind"] == []
    assert {p.name for p in procs} >= {"launcher", "router", "ctx0", "gen0"}
    s = raw["summary"]
    assert s["errors"] == 0, s["error_examples"]
    assert s["ok"] > 0 and s["disconnects"] > 0
    assert set(s["by_kind"]) == set(soak.MIX)
    assert raw["busy_at_end"] == {}
    text = out.read_text()
    rows = {r["process"]: r for r in raw["rows"]}
    for p in procs:  # every process sampled, with a numeric slope, in the report
        row = rows[f"{p.name} (pid {p.pid})"]
        assert isinstance(row["slope_mib_h"], float), row
        assert f"| {row['process']} |" in text
    # 8 s is mostly warm-up: a worker's RSS may still be rising; nothing else may fail.
    assert all(f.startswith("RSS of ") for f in raw["failures"]), raw["failures"]
    assert cp.returncode == (1 if raw["failures"] else 0), cp.stderr[-3000:]
    assert "**0 errors**" in text
