"""A/B against an earlier revision, for the benchmarks that put a ``--baseline REV`` column
beside this working tree: the revision's ``disagg`` extracted with ``git archive``, a child
run of a bench module in either tree, this repository's git facts, the CPU line of a report,
and the machine's CPU accounting that a run judges its noise by (``machine_busy_s``,
``proc_cpu_s``, ``wait_quiet``). Standard library only: bench modules whose children run in
other virtualenvs import it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def checkout(rev: str, into: str) -> str:
    """The ``disagg`` package as of git revision ``rev`` of this repository, extracted under
    ``into`` (the folder to put first on ``sys.path``: a child started there with ``-m`` runs
    that revision)."""
    out = os.path.join(into, f"rev-{rev}")
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "disagg"],
                             capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True, timeout=120)
    return out


def git(*args: str) -> str:
    """``git args`` in this repository: its stdout, stripped ("" when it fails)."""
    res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                         check=False, timeout=60)
    return res.stdout.strip()


def run_child(cwd: str, module: str, argv: list[str]) -> dict[str, Any]:
    """``python -m module argv`` started in ``cwd`` (``-m`` puts ``cwd`` first on
    ``sys.path``, so the ``disagg`` found there is the one measured; the bench modules come
    from this checkout), one torch thread; the JSON of its ``RESULT `` line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", module, *argv], env=env, cwd=cwd,
                         capture_output=True, text=True, check=False, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"child in {cwd} failed:\n{res.stderr[-4000:]}")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def cpu_line() -> str:
    """The report's machine line: CPU model, count, kernel, load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; "
            f"load average (1/5/15 min) at the start: {load}")


def machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process (all its threads), seconds; OSError once it is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of stat(5)


def wait_quiet(max_wait_s: float, cores: float = 0.5, window_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) for a ``window_s`` window in which the whole machine
    used at most ``cores`` cores (other people's runs come and go); the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        b0 = machine_busy_s()
        time.sleep(window_s)  # a measurement window, not a wait for an event
        if (machine_busy_s() - b0) / window_s <= cores:
            break
    return time.monotonic() - t0
