"""``disagg serve`` as a real process: YAML + flags, readiness, and a SIGTERM drain that lets a
short stream finish, aborts one that outlives the drain period, refuses new work, exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_fixtures import free_port, health_ok, wait_for

pytestmark = pytest.mark.slow


def _stream_lines(url: str, body: dict, out: list[str], started: threading.Event) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    started.set()
    except httpx.HTTPError as e:  # recorded: the test then fails on the missing [DONE]
        out.append(f"error {type(e).__name__}")
    finally:
        started.set()


def test_sigterm_drains_and_exits_zero(tmp_path: Path, model_dir: str) -> None:
    model = model_dir
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("served_model_name: tiny\ntokens_per_block: 16\nkv_cache_tokens: 8192\n"
                   "max_batch_size: 8\ndevice: cpu\nport: 1\n")  # the --port flag wins
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")  # a file, not a pipe: never blocks the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--config", str(cfg),
         "--port", str(port), "--drain-timeout", "0.5", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT)
    threads: list[threading.Thread] = []
    try:
        wait_for(lambda: proc.poll() is not None or health_ok(url), 90, 0.1, "server ready")
        assert proc.poll() is None, "server exited early"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"

        short: list[str] = []
        long: list[str] = []
        short_started, long_started = threading.Event(), threading.Event()
        # 2000 tokens cannot be decoded within the 0.5 s grace period, 24 easily can.
        for out, ev, max_tokens in ((short, short_started, 24), (long, long_started, 2000)):
            body = {"model": "tiny", "prompt": "Once", "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}
            t = threading.Thread(target=_stream_lines, args=(url, body, out, ev), daemon=True)
            t.start()
            threads.append(t)
        assert short_started.wait(30) and long_started.wait(30)

        proc.send_signal(signal.SIGTERM)
        # Draining: new connections are refused (or told 503) ...
        def refused() -> bool:
            try:
                return httpx.post(url + "/v1/completions", json={"prompt": "x"},
                                  timeout=5).status_code == 503
            except httpx.HTTPError:
                return True

        wait_for(refused, 10, 0.05, "new requests to be refused")
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.seek(0)
        server_log = log.read()
        log.close()
    # ... the short stream finished normally within the grace period ...
    assert short[0] == "status 200" and short[-1] == "data: [DONE]", server_log
    assert '"finish_reason":"length"' in short[-2]
    # ... and the long one, still running when the period ran out, was aborted in the engine:
    # its stream still ends properly, saying so.
    assert long[0] == "status 200" and long[-1] == "data: [DONE]", server_log
    assert '"finish_reason":"abort"' in long[-2]
    assert "Traceback" not in server_log, server_log


def test_bad_yaml_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("max_batch_sise: 4\n")
    r = subprocess.run([sys.executable, "-m", "disagg.cli", "serve", str(tmp_path),
                        "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "max_batch_sise" in r.stderr and str(cfg) in r.stderr
