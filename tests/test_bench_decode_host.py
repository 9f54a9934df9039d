"""``bench/decode_host.py`` end to end on a small case: this tree against ``git archive HEAD``
in child processes, every phase row in the report, the outputs of both trees compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import decode_host

ROOT = Path(__file__).resolve().parent.parent


def test_decode_host_reports_both_trees(tmp_path: Path) -> None:
    out = tmp_path / "decode_host.md"
    cp = subprocess.run([sys.executable, "-m", "bench.decode_host", "--batches", "1", "3",
                         "--ctx", "40", "--steps", "4", "--rounds", "1", "--baseline", "HEAD",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    text = out.read_text()
    assert "command: `python -m bench.decode_host --batches 1 3" in text
    assert "- identical" in text  # the same final outputs from both trees
    for b in (1, 3):
        assert f"## Batch {b}" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln
            and not ln.startswith("| phase")]
    assert [ln.split(" | ")[0][2:] for ln in rows] == 2 * [*decode_host.ROWS,
                                                           "whole step, no wrappers"]
    for ln in rows:  # phase | before | after | ratio, numbers measured
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == 4 and cells[3].endswith("x"), ln
        float(cells[1]), float(cells[2])
