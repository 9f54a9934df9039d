"""``disagg doctor`` and the worker's ``--kv-link-check`` (``disagg/transfer/linkcheck.py``).

- bad flags and bad YAML values are usage errors (exit 2) naming the flag or key; the YAML
  (worker or cluster) gives the backend, token and expected link rate, flags win;
- the verdict rules (``judge``) on measured results: memcpy for this host (not below 128 MiB),
  the expected link rate for another host, none without one;
- ``--local`` runs end to end (a server here, a second process pulling) and reports numbers,
  exit 0 with a lenient threshold;
- a slowed link is reported SLOW with exit 1, the same path unslowed OK: a userspace relay
  that throttles a loopback TCP connection (runs everywhere), and a veth between network
  namespaces slowed by ``tc`` (netem rate + delay, or tbf where the kernel has no netem;
  skipped where namespaces are not permitted);
- the start-up check serves test blocks of a cache's layout through a backend and a child
  pulls them (UCX where ucxx imports: its selected lanes are named).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from disagg import cli
from disagg.contracts.options import WorkerOptions, load_worker_yaml
from disagg.kv_connector.settings import DisaggSettings
from disagg.transfer.linkcheck import (
    MEMCPY_MIN_BYTES,
    ProbeBlocks,
    judge,
    serve_probe_blocks,
    startup_link_check,
)
from disagg.transfer.tcp import TcpBackend
from disagg.transfer.ucx import ucx_available

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "doctor-test-secret"
# 1 MiB test blocks: 16 blocks of 4 layers x 2 x 2 kv heads x 16 tokens x 64, float32.
SMALL = ["--tokens", "256", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
         "--dtype", "float32"]
SMALL_BLOCKS = ProbeBlocks(tokens=256, layers=4, kv_heads=2, head_dim=64, dtype="float32")
QUICK = ["--reps", "2", "--latency-reads", "5", "--timeout", "30"]
SLOW_RATE = 50e6 / 8  # bytes/s: 50 Mbit/s, 6.25 MB/s
EXPECTED_GBPS = "0.05"  # 50 MB/s: 8x the slowed rate, far below loopback / veth


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["doctor", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- usage --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--serve-kv", "nohost"], "argument --serve-kv: expected HOST:PORT, got 'nohost'"),
    (["--peer", "h:1", "--local"], "not allowed with argument --peer"),
    (["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    (["--min-share", "1.5"], "argument --min-share: must be in (0, 1]"),
    (["--expected-link-gbps", "0"], "argument --expected-link-gbps: must be a number > 0"),
    (["--backend", "rdma"], "argument --backend: invalid choice: 'rdma'"),
    (["--dtype", "int4"], "argument --dtype: invalid choice"),
    (["--serve-kv", "127.0.0.1:0", "--expected-link-gbps", "3"],
     "the --serve-kv end only serves"),
])
def test_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                    words: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", *args])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_missing_token_and_bad_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_CLUSTER_TOKEN", raising=False)
    rc, _, err = _doctor(capsys, "--peer", "127.0.0.1:9", "--backend", "tcp")
    assert rc == 2 and "--peer needs the cluster token" in err
    rc, _, err = _doctor(capsys, "--serve-kv", "127.0.0.1:0", "--backend", "tcp")
    assert rc == 2 and "--serve-kv needs the cluster token" in err
    bad = tmp_path / "w.yaml"
    bad.write_text("expected_link_gbps: -1\n")
    rc, _, err = _doctor(capsys, "-c", str(bad))
    assert rc == 2 and "expected_link_gbps: must be > 0" in err


def test_yaml_settings_and_worker_options(tmp_path: Path) -> None:
    """A cluster YAML's generation section (top-level keys inherited) and a worker YAML give
    the doctor's backend, token and expected rate; flags win. ``kv_link_check`` is a worker
    option (flag and key) that reaches the connector's settings; ``expected_link_gbps`` a key
    without a ``disagg serve`` flag."""
    from disagg.doctor import _settings

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("model: /m\ncluster_token: from-yaml\nexpected_link_gbps: 3.1\n"
                       "cache_transceiver_config: {backend: TCP, ucx_profile: cross_host}\n"
                       "generation_servers: {urls: ['h:1']}\n")
    parse = cli.build_parser().parse_args
    s = _settings(parse(["doctor", "-c", str(cluster)]))
    assert (s["backend"], s["ucx_profile"], s["token"], s["expected"]) == (
        "TCP", "cross_host", "from-yaml", 3.1)
    s = _settings(parse(["doctor", "-c", str(cluster), "--backend", "ucx",
                         "--cluster-token", "t2", "--expected-link-gbps", "12.5"]))
    assert (s["backend"], s["token"], s["expected"]) == ("UCX", "t2", 12.5)
    worker = tmp_path / "w.yaml"
    worker.write_text("kv_link_check: true\nexpected_link_gbps: 25\n")
    opts = WorkerOptions(**load_worker_yaml(str(worker)))
    assert opts.kv_link_check and opts.expected_link_gbps == 25.0
    assert _settings(parse(["doctor", "-c", str(worker)]))["expected"] == 25.0
    serve = parse(["serve", "m", "--kv-link-check"])
    assert serve.kv_link_check is True and not hasattr(serve, "expected_link_gbps")
    assert DisaggSettings.from_options(WorkerOptions(model="m", role="context",
                                                     kv_link_check=True),
                                       cluster_token="t", backend="TCP").kv_link_check
    assert not WorkerOptions().kv_link_check


def test_judge_rules() -> None:
    big = MEMCPY_MIN_BYTES
    measured = {"gbps": 2.0, "bytes": big, "memcpy_gbps": 8.0}
    assert judge(measured)["verdict"] == "ok"  # 25% of memcpy >= 20%
    assert judge(measured, min_share=0.5)["verdict"] == "slow"
    assert judge({**measured, "gbps": 1.0})["verdict"] == "slow"  # 12.5%
    small = judge({**measured, "bytes": big - 1})
    assert small["verdict"] == "unjudged" and "too small" in small["reference"]["why"]
    # another host: the expected link rate, or no verdict at all
    far = {"gbps": 2.0, "bytes": 1 << 20, "memcpy_gbps": None}
    assert judge(far)["verdict"] == "unjudged"
    assert judge(far, expected_gbps=3.0)["verdict"] == "ok"  # 67% >= 50%
    r = judge(far, expected_gbps=5.0)
    assert r["verdict"] == "slow" and r["reference"]["share"] == pytest.approx(0.4)


# ---- live ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_mode_reports_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """Test blocks served here over TCP, pulled by a second process: bandwidth, latency and
    memcpy reported, judged against memcpy (128 MiB: big enough to be judged), OK at a
    lenient share."""
    rc, out, err = _doctor(capsys, "--local", "--backend", "tcp", "--tokens", "1024",
                           "--min-share", "0.01", *QUICK)
    assert rc == 0, out + err
    assert "tcp socket from 127.0.0.1" in out and "128.0 MiB per read" in out
    for word in ("bandwidth", "latency", "memcpy", "verdict    OK: "):
        assert word in out, out


class ThrottleRelay:
    """A TCP relay on loopback in front of ``target`` that forwards each chunk (<= 64 KiB)
    ``delay_s + len / rate`` seconds after reading it, both ways: a slow link in userspace."""

    def __init__(self, target: str, rate: float, delay_s: float) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.rate, self.delay_s = rate, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            up.settimeout(None)
            self._socks += [down, up]
            for src, dst in ((down, up), (up, down)):
                t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                time.sleep(self.delay_s + len(data) / self.rate)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close does not)
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv (close does not)
            s.close()
        for t in self._threads:
            t.join(10)
        assert not any(t.is_alive() for t in self._threads), "a relay thread is stuck"


def test_throttled_relay_is_reported_slow(capsys: pytest.CaptureFixture[str]) -> None:
    """The same test blocks, judged against the same expected rate: straight to the server
    OK (exit 0), through a relay at 50 Mbit/s SLOW (exit 1, said on stderr)."""
    server = serve_probe_blocks(SMALL_BLOCKS, "tcp", TOKEN)
    relay = ThrottleRelay(server.address, SLOW_RATE, delay_s=0.0)
    try:
        flags = [*SMALL, *QUICK, "--backend", "tcp", "--cluster-token", TOKEN,
                 "--expected-link-gbps", EXPECTED_GBPS]
        rc, out, err = _doctor(capsys, "--peer", server.address, *flags)
        assert rc == 0 and "verdict    OK: " in out, out + err
        rc, out, err = _doctor(capsys, "--peer", relay.address, *flags, "--json")
        result = json.loads(out)
        assert rc == 1 and result["verdict"] == "slow", out + err
        assert result["gbps"] < SLOW_RATE / 1e9 and result["data_checked"]
        assert "SLOW KV LINK" in err and relay.address in err
    finally:
        relay.close()
        server.stop()


@pytest.mark.slow
def test_netns_link_slowed_by_tc_is_reported_slow(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--serve-kv`` on host A (a network namespace), ``--peer`` from this process over the
    veth: OK against the expected rate; then A's eth0 sends at 50 Mbit/s (netem, with 20 ms of
    delay; tbf where the kernel has no netem): SLOW, exit 1."""
    from netns import NetLab, require_netns

    require_netns()
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with NetLab() as lab:
        a = lab.add_host("doctor-a")
        log = tmp_path / "serve.log"
        proc = lab.spawn(a, [sys.executable, "-m", "disagg.cli", "doctor", "--serve-kv",
                             f"{a.addr}:0", "--backend", "tcp", *SMALL], log, env=env)
        deadline = time.monotonic() + 60
        while "listening on " not in (text := log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.05)
        address = text.split("listening on ", 1)[1].split()[0]
        assert address.startswith(a.addr + ":")
        flags = [*SMALL, *QUICK, "--backend", "tcp", "--cluster-token", TOKEN,
                 "--expected-link-gbps", EXPECTED_GBPS]
        rc, out, err = _doctor(capsys, "--peer", address, *flags)
        assert rc == 0 and "(another host)" in out and "verdict    OK: " in out, out + err
        tc = ["ip", "netns", "exec", a.ns, "tc", "qdisc", "add", "dev", "eth0", "root"]
        shaped = subprocess.run([*tc, "netem", "rate", "50mbit", "delay", "20ms"],
                                capture_output=True, text=True, timeout=20)
        if shaped.returncode != 0:  # no sch_netem in this kernel: rate alone, by tbf
            shaped = subprocess.run([*tc, "tbf", "rate", "50mbit", "burst", "32kbit",
                                     "latency", "400ms"], capture_output=True, text=True,
                                    timeout=20)
        if shaped.returncode != 0:
            pytest.skip(f"tc cannot shape the veth here: {shaped.stderr.strip()}")
        rc, out, err = _doctor(capsys, "--peer", address, *flags)
        assert rc == 1 and "verdict    SLOW: " in out, out + err
        assert "SLOW KV LINK" in err


@pytest.mark.slow
def test_startup_check_of_a_cache_layout() -> None:
    """The worker's start-up check: test blocks of the cache's layout (grown to 128 MiB, a
    small model's), served through the backend, pulled by a child: numbers and the transport
    (UCX: the lanes its endpoint selected), judged against memcpy."""
    ok, _ = ucx_available()
    from disagg.transfer.ucx import UcxBackend

    backend = UcxBackend("same_host") if ok else TcpBackend()
    cache = torch.empty(8, 2, 2, 2, 16, 64, dtype=torch.float16)
    result = startup_link_check(backend, cache, TOKEN, "127.0.0.1", reps=1, latency_reads=5)
    assert result["verdict"] in ("ok", "slow") and result["reference"] == "memcpy"
    assert result["mib"] == 128.0 and result["gbps"] > 0 and result["p99_ms"] > 0
    if ok:
        assert result["transport"].startswith("UCX lanes ")
        assert "not reported" not in result["transport"], result["transport"]
    else:
        assert result["transport"].startswith("tcp socket")
