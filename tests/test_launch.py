"""`disagg launch` end to end: real worker and router processes on ephemeral ports.

Each test runs the launcher as a subprocess, reads the child pids it prints ("started NAME
... pid N") and checks that none is left when the launcher has exited.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0
PID_RE = re.compile(r"started (\S+) .* pid (\d+)")
READY_RE = re.compile(r"cluster ready in [\d.]+ s: (http://\S+)")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


class Launcher:
    """``disagg launch ...`` with its stdout/stderr read by threads (no blocking reads)."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        env = {**os.environ, "DISAGG_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli", "launch", "--log-dir", str(tmp / "logs"),
             "--timeout", str(START_TIMEOUT), "--stop-timeout", "20", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(s, buf), daemon=True)
                         for s, buf in ((self.proc.stdout, self.out),
                                        (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)
            if buf is self.out:
                self._lines.put(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_line(self, pattern: re.Pattern[str], timeout: float = START_TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern.pattern!r} (exit "
                                         f"{self.proc.poll()}):\n{self.stdout}\n{self.stderr}"
                                         ) from None
                continue
            m = pattern.search(line)
            if m:
                return m

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(10)
        return code

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in PID_RE.finditer(self.stdout)}

    def kill(self) -> None:
        """Test clean-up: the launcher (its children get SIGTERM through PDEATHSIG) and, as a
        backstop, every child pid it printed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in self.pids().values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _assert_all_gone(launcher: Launcher, expected: int) -> None:
    pids = launcher.pids()
    assert len(pids) == expected, launcher.stdout
    left = [f"{name} (pid {pid})" for name, pid in pids.items() if _alive(pid)]
    assert not left, f"left running: {left}\n{launcher.stdout}"


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        launcher = Launcher(list(args), tmp_path)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def _config(tmp_path: Path, name: str, instances: dict[str, int] | None = None,
            **section_options: dict) -> tuple[str, int]:
    """configs/NAME on free local ports (the router's too), optionally with fewer workers
    (``instances``: section -> count); ``section_options`` are merged into the named
    sections. Returns the file and the router port."""
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    sections = [s for s in ("context_servers", "generation_servers") if s in data]
    counts = {s: (instances or {}).get(s, len(data[s]["urls"])) for s in sections}
    ports = iter(_free_ports(sum(counts.values()) + 1))
    data["hostname"], data["port"] = "127.0.0.1", next(ports)
    for sec in sections:
        data[sec]["urls"] = [f"127.0.0.1:{next(ports)}" for _ in range(counts[sec])]
        data[sec]["num_instances"] = counts[sec]
        data[sec].update(section_options.get(sec, {}))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path), data["port"]


def test_demo_answers_through_the_router_and_stops_on_ctrl_c(launch, tmp_path: Path):
    """No -c: the tiny model is created in the cache, 1 ctx + 1 gen + router come up, one chat
    request goes context -> generation (KV moved), then Ctrl-C stops everything."""
    launcher = launch("--max-tokens", "8", "--keep-running")
    launcher.wait_line(re.compile(r"Ctrl-C stops the cluster"))
    out = launcher.stdout
    assert "assistant (length)" in out and '"completion_tokens": 8' in out, out
    blocks = re.search(r"KV blocks moved context -> generation: (\d+)", out)
    assert blocks and int(blocks.group(1)) > 0, out
    assert re.search(r"timings: model ready [\d.]+ s \| workers healthy [\d.]+ s \| router "
                     r"healthy [\d.]+ s \| chat request \d+ ms", out), out
    assert (tmp_path / "cache" / "tiny-llama-v1" / "model.safetensors").is_file()
    for name in ("ctx0", "gen0", "router"):
        assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    _assert_all_gone(launcher, 3)


def test_config_launch_serves_then_sigterm_stops_all(launch, tmp_path: Path, tiny_llama: str):
    path, port = _config(tmp_path, "disagg_1ctx_1gen.yaml")
    launcher = launch("-c", path, "--model", tiny_llama)
    endpoint = launcher.wait_line(READY_RE).group(1)
    assert endpoint == f"http://127.0.0.1:{port}"
    r = httpx.post(endpoint + "/v1/completions", timeout=60, json={
        "model": tiny_llama, "prompt": "The harbour was quiet", "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    out = launcher.stdout
    for name in ("ctx0", "gen0"):  # drained, not killed
        assert re.search(rf"stopped {name} +\(pid \d+, exit 0\)", out), out
    assert "SIGTERM: cluster stopped" in out
    _assert_all_gone(launcher, 3)


def test_child_failing_at_start_up_prints_its_log_tail(launch, tmp_path: Path,
                                                       tiny_llama: str):
    path, _ = _config(tmp_path, "disagg_1ctx_1gen.yaml",
                      context_servers={"max_batch_size": 0})
    launcher = launch("-c", path, "--model", tiny_llama)
    code = launcher.wait(START_TIMEOUT)
    assert code == 1, launcher.stdout + launcher.stderr
    err = launcher.stderr
    assert "ctx0 exited with code 2 during start-up" in err, err
    assert f"last 30 lines of {tmp_path / 'logs' / 'ctx0.log'}" in err
    assert "max_batch_size: must be > 0" in err  # the worker's own message, from its log
    assert "Traceback" not in err
    _assert_all_gone(launcher, 2)  # the router was never started


def test_child_dying_after_start_up_stops_the_cluster(launch, tmp_path: Path,
                                                      tiny_llama: str):
    path, _ = _config(tmp_path, "aggregated.yaml", {"generation_servers": 1})
    launcher = launch("-c", path, "--model", tiny_llama)
    launcher.wait_line(READY_RE)
    victim = launcher.pids()["gen0"]
    os.kill(victim, signal.SIGKILL)
    assert launcher.wait(60) == 1, launcher.stdout + launcher.stderr
    assert f"gen0 (pid {victim}) exited with code -9 after start-up" in launcher.stderr
    _assert_all_gone(launcher, 2)
