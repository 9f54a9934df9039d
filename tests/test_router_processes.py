"""``disagg router --processes 2``: two router processes on one port (SO_REUSEPORT) under a
supervising parent. A registration sent to the port reaches both processes; both serve;
``/metrics`` labels every sample with its ``process`` and ``/cluster_info`` shows every
process's view; SIGTERM to the parent, or the death of one child, stops and reaps them all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from router_fixtures import DYNAMIC, ROUTER_TOKEN, LoopThread
from server_fixtures import signed, wait_for
from test_router_http1 import BODY, Stub

from disagg import procs
from disagg.router.processes import ProcessInfo, merge_metrics


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by its parent) still answers kill(0)
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ", 1)[1].startswith("Z")


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": 0, **DYNAMIC,
                                   "disagg_cluster": {**DYNAMIC["disagg_cluster"],
                                                      "inactive_timeout_sec": 30.0}}))
    log = tmp_path / f"{name}.log"
    proc = procs.spawn([sys.executable, "-m", "disagg.cli", "router", "-c", str(cfg),
                        "--processes", "2"], log,
                       env={**os.environ, "DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN})

    def listening() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"router exited {proc.returncode}:\n{log.read_text()}")
        m = re.search(r"listening on (http://\S+) \(2 processes\)", log.read_text())
        return m.group(1) if m else None

    url = wait_for(listening, 60, what="the router's listening line")
    return proc, url, log


@pytest.fixture(scope="module")
def worker(loop: LoopThread) -> Any:
    stub = Stub()
    runner, url = loop.serve(stub.app)
    yield url.removeprefix("http://")
    loop.run(runner.cleanup())


def test_two_processes_share_registrations_serve_and_report(tmp_path: Path,
                                                            worker: str) -> None:
    proc, url, log = _start(tmp_path, "two")
    try:
        kids = _children(proc.pid)
        assert len(kids) == 2
        r = httpx.post(url + "/cluster/register", timeout=10, **signed(
            ROUTER_TOKEN, "POST", "/cluster/register", {"role": "generation", "url": worker},
            to=url))
        assert r.status_code == 200, r.text

        def both_see_it() -> bool:
            info = httpx.get(url + "/cluster_info", timeout=10).json()
            return [p["process"] for p in info["per_process"]] == [0, 1] and all(
                [w["url"] for w in p["workers"]["generation"] if w["healthy"]] == [worker]
                for p in info["per_process"])

        wait_for(both_see_it, 20, what="the registration in both processes")
        info = httpx.get(url + "/cluster_info", timeout=10).json()
        assert info["processes"] == 2 and info["process"] in (0, 1)
        for _ in range(40):  # new connections: the kernel spreads them over both
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                           timeout=10)
            assert r.status_code == 200 and r.content == BODY
        text = httpx.get(url + "/metrics", timeout=10).text
        served = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'disagg_router_requests_total\{endpoint="/v1/completions",outcome="success",'
            r'process="(\d)"\} (\S+)', text)}
        assert set(served) == {"0", "1"} and sum(served.values()) == 40, served
        assert all(v > 0 for v in served.values()), served
        assert text.count("# TYPE disagg_router_requests_total counter") == 1
    finally:
        code = procs.stop(proc, grace_s=20)
    assert code == 0, log.read_text()
    assert all(_gone(k) for k in kids), "router processes left behind"


def test_a_dead_process_stops_the_others(tmp_path: Path) -> None:
    proc, url, log = _start(tmp_path, "dies")
    try:
        kids = _children(proc.pid)
        assert len(kids) == 2
        os.kill(kids[1], signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        procs.stop(proc, grace_s=5)
    assert proc.returncode != 0
    assert "process 1 exited" in log.read_text()
    wait_for(lambda: all(_gone(k) for k in kids), 10, what="the other process reaped")


def test_merge_metrics_labels_each_sample_with_its_process() -> None:
    a = (b"# HELP x_total Things.\n# TYPE x_total counter\nx_total{k=\"v\"} 2.0\n"
         b"# HELP g A gauge.\n# TYPE g gauge\ng 1.0\n")
    b = b"# HELP x_total Things.\n# TYPE x_total counter\nx_total{k=\"v\"} 3.0\n"
    text = merge_metrics({1: b, 0: a}).decode()
    assert 'x_total{k="v",process="0"} 2.0' in text
    assert 'x_total{k="v",process="1"} 3.0' in text
    assert 'g{process="0"} 1.0' in text
    assert text.count("# TYPE x_total counter") == 1


def test_process_info_checks_and_primary() -> None:
    assert ProcessInfo().primary and ProcessInfo(0, 2, "/d").primary
    assert not ProcessInfo(1, 2, "/d").primary
    with pytest.raises(ValueError):
        ProcessInfo(2, 2, "/d")
    with pytest.raises(ValueError):
        ProcessInfo(0, 2)  # several processes need their private channel


def test_processes_key_and_flag_are_checked(tmp_path: Path) -> None:
    from disagg.contracts.cluster import RouterConfigError, parse_cluster_config

    base = {"generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:9"]}}
    assert parse_cluster_config(base).processes == 1
    assert parse_cluster_config({**base, "processes": 4}).processes == 4
    for bad in (0, 257, "two"):
        with pytest.raises(RouterConfigError, match="processes"):
            parse_cluster_config({**base, "processes": bad})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(base))
    r = subprocess.run([sys.executable, "-m", "disagg.cli", "router", "-c", str(cfg),
                        "--processes", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--processes" in r.stderr
