"""`disagg launch`: a child is healthy only as itself (the launch id its /health names), and
`--restart on-failure` (YAML `restart: on-failure`) starts a dead worker again with backoff.

The end-to-end tests run the launcher as a subprocess over real tiny workers (the helpers of
test_launch.py); the others drive `Cluster` in a subprocess over stand-in children (a few lines
of http.server that answer /health as the real ones do) or call the pieces directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from test_launch import READY_RE, ROOT, START_TIMEOUT, Launcher, _alive, _assert_all_gone, _config

from disagg import procs
from disagg.cli import build_parser
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.launch import build_plan, restart_delay


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


class _HealthSquatter:
    """Another process's server on a port: answers GET /health with 200 and ``body`` (no
    launch id, or ``body``'s own), in a thread of this process."""

    def __init__(self, port: int, body: dict | None = None, status: int = 200) -> None:
        answer = json.dumps(body if body is not None else {"status": "ok"}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _HealthSquatter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


# -- the pieces -----------------------------------------------------------------------------------


def test_restart_policy_from_the_yaml_and_the_flag(tmp_path: Path, tiny_llama: str):
    base = {"model": tiny_llama, "generation_servers": {
        "num_instances": 1, "urls": [f"127.0.0.1:{procs.free_port()}"]}}
    assert parse_cluster_config(base).restart == "no"  # the default: as before
    assert parse_cluster_config({**base, "restart": "on-failure"}).restart == "on-failure"
    # A bare `restart: no` is YAML's false.
    assert parse_cluster_config({**base, **yaml.safe_load("restart: no")}).restart == "no"
    with pytest.raises(RouterConfigError, match=r"restart: 'always' is not one of "
                                                r"\['no', 'on-failure'\]"):
        parse_cluster_config({**base, "restart": "always"})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base, "restart": "on-failure"}))
    assert build_plan(str(path), tmp_path / "logs").restart == "on-failure"
    # --restart replaces the YAML's (None: not given); `disagg demo` takes it too.
    parse = build_parser().parse_args
    assert parse(["launch", "-c", str(path)]).restart is None
    assert parse(["launch", "-c", str(path), "--restart", "no"]).restart == "no"
    assert parse(["demo", "--restart", "on-failure"]).restart == "on-failure"
    with pytest.raises(SystemExit):
        parse(["launch", "--restart", "always"])


def test_backoff_doubles_from_one_second_to_thirty():
    assert [restart_delay(n) for n in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert restart_delay(10_000) == 30  # no overflow after a long crash loop


def test_child_health_tells_the_child_from_another_process():
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    assert procs.child_health(url, "abc") is procs.ChildHealth.DOWN
    with _HealthSquatter(port):  # 200 without an id: not the child
        assert procs.child_health(url, "abc") is procs.ChildHealth.OTHER
        assert procs.child_health(url, None) is procs.ChildHealth.OK  # no id asked for
        with pytest.raises(procs.NotHealthy, match=rf"not healthy in 0.3 s \({url} answers "
                                                   rf"/health as another process\)"):
            procs.wait_healthy(url, 0.3, launch_id="abc", interval=0.05)
    with _HealthSquatter(port, {"status": "ok", "launch_id": "xyz"}):  # another child's id
        assert procs.child_health(url, "abc") is procs.ChildHealth.OTHER
        assert procs.child_health(url, "xyz") is procs.ChildHealth.OK
        procs.wait_healthy(url, 5, launch_id="xyz")
    with _HealthSquatter(port, {"status": "loading", "launch_id": "xyz"}, status=503):
        assert procs.child_health(url, "xyz") is procs.ChildHealth.STARTING


def test_worker_health_names_its_launch_id(monkeypatch: pytest.MonkeyPatch):
    """`disagg serve`'s /health carries $DISAGG_LAUNCH_ID when it is set, draining too, and
    nothing new when it is not (a worker started by hand). (The router's: end to end below,
    where the launcher waits for it.)"""
    from disagg.server.cluster_routes import ClusterRoutes

    def health(launch_id: str | None, draining: bool) -> tuple[int, dict]:
        if launch_id is None:
            monkeypatch.delenv(procs.LAUNCH_ID_ENV, raising=False)
        else:
            monkeypatch.setenv(procs.LAUNCH_ID_ENV, launch_id)
        srv = SimpleNamespace(access=SimpleNamespace(verifier=None), draining=draining,
                              engine=SimpleNamespace(is_healthy=lambda: True))
        answer = asyncio.run(ClusterRoutes(srv).health())  # type: ignore[arg-type]
        return answer.status_code, json.loads(answer.body)

    assert health("a1b2", False) == (200, {"status": "ok", "launch_id": "a1b2"})
    assert health("a1b2", True) == (503, {"status": "draining", "launch_id": "a1b2"})
    assert health(None, False) == (200, {"status": "ok"})


# -- Cluster over stand-in children -----------------------------------------------------------

# A worker stand-in: /health answers 200 naming $DISAGG_LAUNCH_ID, as `disagg serve` does;
# SIGTERM: exit 0 (a worker drains and exits 0).
_STAND_IN = r'''
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
body = json.dumps({"status": "ok", "launch_id": os.environ["DISAGG_LAUNCH_ID"]}).encode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("listening", flush=True)
server.serve_forever()
'''

_WATCH_SCRIPT = r'''
import sys, time
from pathlib import Path
from disagg.launch import ChildFailed, ChildSpec, Cluster, Stop

restart, tmp, port, stand_in = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = ChildSpec("w0", "generation", f"127.0.0.1:{port}", (sys.executable, "-c", stand_in, port),
                 tmp / "w0.log")
code = 0
try:
    with Cluster(None, stop_grace_s=5, restart=restart, start_timeout_s=30) as cluster:
        cluster.wait_healthy([cluster.start(spec)], time.monotonic() + 30)
        cluster.say("ready")
        cluster.watch()
except ChildFailed:
    code = 1
except Stop:
    code = 0
print(f"done {code}", flush=True)
'''


class _Watched:
    """``Cluster.watch`` over one stand-in worker, in its own process (a hang fails the test
    rather than hanging it); its output read line by line."""

    def __init__(self, tmp: Path, restart: str) -> None:
        self.port = procs.free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WATCH_SCRIPT, restart, str(tmp), str(self.port),
             _STAND_IN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []

    def until(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """Read lines until one matches ``pattern`` (bounded: the reader is a thread)."""
        found: list[re.Match] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(pattern, line)
                if m:
                    found.append(m)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        assert found, f"no line matching {pattern!r}:\n{''.join(self.lines)}"
        return found[0]

    def pid(self) -> int:
        return int(re.findall(r"started w0 .* pid (\d+)", "".join(self.lines))[-1])

    def finish(self, timeout: float = 30.0) -> str:
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest = self.proc.communicate()[0] + f"\n(killed: not done in {timeout:g} s)"
        return "".join(self.lines) + rest

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in (int(p) for p in re.findall(r"started w0 .* pid (\d+)", "".join(self.lines))):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _watched(tmp: Path, restart: str) -> Iterator[_Watched]:
    w = _Watched(tmp, restart)
    try:
        yield w
    finally:
        w.close()


def test_without_restart_a_killed_worker_still_stops_the_cluster(tmp_path: Path):
    with _watched(tmp_path, "no") as w:
        w.until("^ready")
        first = w.pid()
        os.kill(first, signal.SIGKILL)
        out = w.finish()
    assert f"w0 (pid {first}) exited with code -9 after start-up" in out, out
    assert "starting it again" not in out and "done 1" in out, out


def test_on_failure_restarts_with_backoff_and_waits_for_a_taken_port(tmp_path: Path):
    """kill -9: started again after 1 s with a new launch id (its log appended to); killed
    again while another process holds its port: not started over it (2 s, then 4 s); once the
    port is free it comes back; a SIGTERMed worker (exit 0) is not restarted."""
    with _watched(tmp_path, "on-failure") as w:
        w.until("^ready")
        first = w.pid()
        os.kill(first, signal.SIGKILL)
        w.until(r"healthy w0 +after [\d.]+ s \(restart 1\)")
        second = w.pid()
        assert second != first and not _alive(first)
        out = "".join(w.lines)
        assert (f"w0 (pid {first}) exited with code -9 (SIGKILL); starting it again in 1 s "
                f"(restart 1; log {tmp_path / 'w0.log'}):") in out, out
        os.kill(second, signal.SIGKILL)
        w.until(r"w0 \(pid \d+\) exited with code -9 \(SIGKILL\); starting it again in 2 s")
        with socket.socket() as squatter:  # takes the port while w0 is down
            # (SO_REUSEADDR: the port has connections in TIME_WAIT, as uvicorn's would.)
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", w.port))
            squatter.listen()
            w.until(rf"w0 not started: 127.0.0.1:{w.port} is held by another process; "
                    rf"starting it again in 4 s \(restart 2;")
        w.until(r"healthy w0 +after [\d.]+ s \(restart 2\)")
        third = w.pid()
        assert len({first, second, third}) == 3
        log = (tmp_path / "w0.log").read_text()
        assert log.count("$ ") == 3, log  # every run's output is kept
        os.kill(third, signal.SIGTERM)
        out = w.finish()
    assert (f"w0 (pid {third}) exited with code 0 after start-up (a worker that exits 0 was "
            f"stopped on purpose: not restarted)") in out, out
    assert "done 1" in out, out


# -- end to end: disagg launch over tiny workers ------------------------------------------------


@pytest.mark.slow
def test_port_taken_after_the_check_by_a_health_answering_process(launch, tmp_path: Path,
                                                                   tiny_llama: str):
    """The port is free at the launcher's check, then another process takes it and answers
    /health 200 before the worker binds: the worker dies of "address in use", and the
    launcher says so and exits 1 instead of taking the other process for the worker."""
    path, _ = _config(tmp_path, "aggregated.yaml", {"generation_servers": 1})
    port = int(yaml.safe_load(Path(path).read_text())["generation_servers"]["urls"][0]
               .rsplit(":", 1)[1])
    launcher = launch("-c", path, "--model", tiny_llama)
    # Printed after the port check, before the worker starts (it binds seconds later, once
    # torch is imported and the model loaded).
    launcher.wait_line(re.compile(r"^starting 1 worker"))
    with _HealthSquatter(port):
        code = launcher.wait(START_TIMEOUT)
    assert code == 1, launcher.stdout + launcher.stderr
    assert re.search(rf"gen0 exited with code \d+ during start-up; 127.0.0.1:{port} answers "
                     rf"/health as another process: the port is already in use",
                     launcher.stderr), launcher.stderr
    assert "started router" not in launcher.stdout
    _assert_all_gone(launcher, 1)


@pytest.mark.slow
def test_killed_generation_worker_comes_back_and_the_cluster_answers(launch, tmp_path: Path,
                                                                     tiny_llama: str):
    path, _ = _config(tmp_path, "disagg_1ctx_1gen.yaml")
    launcher = launch("-c", path, "--model", tiny_llama, "--restart", "on-failure")
    endpoint = launcher.wait_line(READY_RE).group(1)
    body = {"model": tiny_llama, "prompt": "The harbour was quiet", "max_tokens": 4,
            "temperature": 0}
    before = httpx.post(endpoint + "/v1/completions", timeout=60, json=body)
    assert before.status_code == 200, before.text
    first = launcher.pids()["gen0"]
    os.kill(first, signal.SIGKILL)
    launcher.wait_line(re.compile(r"healthy gen0 +after [\d.]+ s \(restart 1\)"))
    second = launcher.pids()["gen0"]
    assert second != first and _alive(second) and not _alive(first)
    assert (f"gen0 (pid {first}) exited with code -9 (SIGKILL); starting it again in 1 s"
            in launcher.stdout), launcher.stdout
    # The router takes it back at its next health check (a worker out of rotation is
    # probed every 0.5 s): poll until a request goes through context -> generation again.
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(endpoint + "/v1/completions", timeout=60, json=body)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code in (502, 503), r.text  # gen0 not (yet) back in rotation
        time.sleep(0.2)  # polling, bounded by the deadline
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert launcher.proc.poll() is None  # the launcher kept the cluster up
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    _assert_all_gone(launcher, 3)
