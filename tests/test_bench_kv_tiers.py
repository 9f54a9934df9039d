"""``bench/kv_tiers.py``: its smallest live run (the tiny model, 4 conversations x 2 turns, a
``disagg launch`` cluster of two workers and the router per configuration: tiers off / host /
host + disk / host + disk without the checksum) writes the report and its JSON: every section
and row, 0 errors, answers identical to tiers off, blocks served by a tier, the report's numbers
those of the JSON, no process left; and its option checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kv_tiers

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("off", "host", "host+disk", "integrity-off")  # the live run's (no peer reuse)


def test_percentile_and_config_checks() -> None:
    assert kv_tiers.percentile([], 0.5) is None
    assert kv_tiers.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert kv_tiers.percentile([float(i) for i in range(100)], 0.99) == 98.0
    args = kv_tiers.parse_args(["--configs", "host,off"])
    assert args.config_names == ["off", "host"]  # the reference first
    with pytest.raises(SystemExit):
        kv_tiers.parse_args(["--configs", "off,nope"])
    with pytest.raises(SystemExit):  # the router names the peer from its KV indexes
        kv_tiers.parse_args(["--configs", "off,peer", "--policy", "round_robin"])
    peer = kv_tiers.build_configs(["peer", "host+disk+peer"], 1, 0.5, 2)
    assert peer[0].worker_options(Path("/d")) == {"kv_peer_reuse": True}
    assert peer[1].worker_options(Path("/d"))["kv_offload_disk_gib"] == 2
    assert peer[0].describe() == "no tier, peer prefix reuse"
    with pytest.raises(SystemExit):
        kv_tiers.parse_args(["--host-gib", "0"])
    assert kv_tiers.parse_args([]).config_names == list(kv_tiers.CONFIG_NAMES)


@pytest.mark.slow
def test_smallest_live_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "kv_tiers.md"
    # One client and round robin: each conversation stays on one worker and the second
    # conversation on it evicts the first one's blocks (128 tokens of KV cache) before the
    # first one's next turn: the tiers serve it.
    cmd = [sys.executable, "-m", "bench.kv_tiers", "--model", "tiny", "--conversations", "4",
           "--turns", "2", "--clients", "1", "--policy", "round_robin", "--system-words", "0",
           "--user-words", "3", "--max-tokens", "8", "--kv-cache-tokens", "128",
           "--tokens-per-block", "8", "--host-gib", "0.001", "--disk-host-gib",
           "0.00001", "--disk-gib", "0.01", "--configs", ",".join(CONFIGS),
           "--out", str(out), "--work-dir", str(tmp_path / "work")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cp = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    for section in ("# KV offload tiers", "## Headlines", "## Per configuration",
                    "## Tier traffic (both workers)", "How to read it:"):
        assert section in text, section
    assert "4 conversations x 2 turns" in text.split("\n", 3)[2]  # scaled down, said first
    assert "built-in tiny random model" in text
    assert "- peer prefix reuse: not in this run's configurations" in text
    assert "- tier checksum on vs off: the checksums' own cost, measured: " in text
    assert "result: **PASS**" in text
    runs = {r["config"]["name"]: (r, s) for r, s in zip(data["runs"], data["summaries"],
                                                          strict=True)}
    assert list(runs) == list(CONFIGS)
    lines = text.splitlines()
    for name, (run, s) in runs.items():
        assert s["turns"] == s["ok"] == 8 and s["errors"] == 0, s["error_examples"]
        assert run["left_behind"] == [] and run["launcher_exit"] == 0, run["logs"]
        assert s["failed_blocks"] == 0
        # both tables have a row for it, with the JSON's numbers
        rows = [ln for ln in lines if ln.startswith(f"| {name} |")]
        assert len(rows) == 2, rows
        assert f"| {kv_tiers.pct(s['hit_rate'])} |" in rows[0]
        assert f"| {s['cached_tokens']:,} / {s['prompt_tokens']:,} |" in rows[0]
        assert f"| {kv_tiers.ms(s['ttft_p50_s'])} |" in rows[0]
        assert f"| {s['history_found']}/{s['history_turns']} |" in rows[0]
        assert s["history_turns"] == 4
        assert f"| {s['loaded_host']:,.0f} / {s['loaded_disk']:,.0f} |" in rows[1]
        assert any(ln.startswith(f"- **{name}**: ") for ln in lines)
        if name != "off":
            assert s["identical"] == s["compared"] == 8
            assert rows[0].endswith("| 8/8 |")
            assert s["capacity_host"] > 0
    off, host = runs["off"][1], runs["host"][1]
    assert off["loaded_host"] == off["capacity_host"] == 0
    assert host["loaded_host"] > 0 and host["tier_tokens"] > 0
    assert host["recomputed_tokens"] < off["recomputed_tokens"]
    assert host["hit_rate"] > off["hit_rate"]
    assert runs["host+disk"][1]["capacity_disk"] > 0
    assert runs["integrity-off"][0]["cluster_yaml"]["generation_servers"]["kv_integrity"] is False
    assert "kv_integrity" not in runs["host+disk"][0]["cluster_yaml"]["generation_servers"]
    assert "## The cluster's YAML" in text
    # the disk tiers' files are removed after each configuration, the logs kept
    for name in ("host_disk", "integrity-off"):
        assert not (tmp_path / "work" / name / "tier").exists()
        assert (tmp_path / "work" / name / "launch.log").exists()
