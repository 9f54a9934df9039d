"""The peer routers of ``python -m bench.router_overhead --peers``: ``sglang-router`` and
``vllm-router`` (Rust routers on PyPI), installed at pinned versions into a virtualenv of their
own (never into this environment: their dependencies must not move ours), and the command
that runs each one in front of the bench's stub workers, round robin, aggregated.

A peer that cannot be installed (no network, no wheel for this platform) is skipped with the
reason, which the report prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

INSTALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Peer:
    """One peer router: its PyPI package, pinned version and how to run it."""

    name: str  # as the report shows it
    package: str
    version: str
    # (venv, worker URL, port, prometheus port) -> argv
    argv: Callable[[Path, str, int, int], list[str]]
    # (venv, prefill URL, decode URL, port, prometheus port) -> argv of its disaggregated
    # mode, when the bench's stub speaks its protocol
    pd_argv: Callable[[Path, str, str, int, int], list[str]] | None = None


def _sglang(venv: Path, worker: str, port: int, prom: int) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--worker-urls", worker, "--policy", "round_robin", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(prom), "--log-level", "warn"]


def _vllm(venv: Path, worker: str, port: int, prom: int) -> list[str]:
    return [str(venv / "bin" / "vllm-router"), "--worker-urls", worker, "--policy",
            "round_robin", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warning"]


def _vllm_pd(venv: Path, prefill: str, decode: str, port: int, prom: int) -> list[str]:
    """vllm-router --vllm-pd-disaggregation: a prefill call (``max_tokens`` 1, not streamed,
    ``kv_transfer_params.do_remote_decode``) whose answer's ``kv_transfer_params`` go into the
    decode call (vLLM's NixlConnector protocol, the default ``--kv-connector nixl``)."""
    return [str(venv / "bin" / "vllm-router"), "--vllm-pd-disaggregation", "--prefill",
            prefill, "--decode", decode, "--policy", "round_robin", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(prom), "--log-level", "warning"]


PEERS = (Peer("sglang-router", "sglang-router", "0.3.2", _sglang),
         Peer("vllm-router", "vllm-router", "0.1.17", _vllm, _vllm_pd))


def _installed_version(venv: Path, package: str) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m, sys; "
                        "print(m.version(sys.argv[1]))", package],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else None


def install(venv: Path, log: Callable[[str], None] = print
            ) -> tuple[list[Peer], dict[str, str]]:
    """Each peer at its pinned version in ``venv`` (created if missing; a peer already there at
    that version is not reinstalled). Returns (the installed peers, name -> why skipped)."""
    skipped: dict[str, str] = {}
    if not (venv / "bin" / "python").exists():
        log(f"creating the peers' virtualenv {venv}")
        r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                           text=True, timeout=INSTALL_TIMEOUT_S)
        if r.returncode != 0:
            why = f"cannot create a virtualenv in {venv}: {_last_line(r.stderr)}"
            return [], {p.name: why for p in PEERS}
    ready = []
    for peer in PEERS:
        if _installed_version(venv, peer.package) != peer.version:
            log(f"installing {peer.package}=={peer.version} into {venv}")
            try:
                r = subprocess.run(
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                     "--disable-pip-version-check", f"{peer.package}=={peer.version}"],
                    capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                    env={**os.environ, "PIP_REQUIRE_VIRTUALENV": "0"})
            except subprocess.TimeoutExpired:
                skipped[peer.name] = f"pip install timed out after {INSTALL_TIMEOUT_S:g} s"
                continue
            if r.returncode != 0 or _installed_version(venv, peer.package) != peer.version:
                skipped[peer.name] = (f"pip install {peer.package}=={peer.version} failed: "
                                      f"{_last_line(r.stderr)}")
                continue
        ready.append(peer)
    return ready, skipped


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith("WARNING")]
    return lines[-1] if lines else "(no message)"
