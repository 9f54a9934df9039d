"""The KV transfer backend of a context / generation worker that names none: UCX when ucxx
imports, TCP otherwise, with a log line saying which and why; an explicit choice is kept."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from disagg.contracts.options import WorkerOptions, load_worker_yaml
from disagg.server.cli import _disagg_settings
from disagg.transfer.ucx import ucx_available


def _backend(backend: str | None) -> str:
    settings = _disagg_settings(WorkerOptions(model="m", role="generation",
                                              cluster_token="t" * 32,
                                              kv_transfer_backend=backend))
    return settings.backend


def test_default_is_tcp_when_ucxx_cannot_be_imported(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` raises ImportError
    with caplog.at_level(logging.INFO, logger="disagg.server"):
        assert _backend(None) == "TCP"
    line = [r.getMessage() for r in caplog.records if "KV transfer backend" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith("KV transfer backend: TCP (")
    assert "ucxx cannot be imported" in line[0] and "disagg[ucx]" in line[0]


def test_default_is_ucx_when_ucxx_imports(caplog):
    ok, why = ucx_available()
    if not ok:
        pytest.skip(f"needs ucxx (the `ucx` extra): {why}")
    with caplog.at_level(logging.INFO, logger="disagg.server"):
        assert _backend(None) == "UCX"
    assert any(r.getMessage().startswith("KV transfer backend: UCX (the default: ucxx")
               for r in caplog.records)


def test_explicit_backend_is_kept_as_given(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ucxx", None)
    with caplog.at_level(logging.INFO, logger="disagg.server"):
        # An explicit UCX without ucxx is not replaced: the worker then fails saying so.
        assert _backend("ucx") == "UCX"
        assert _backend("TCP") == "TCP"
    assert not any("KV transfer backend" in r.getMessage() for r in caplog.records)


def test_worker_yaml_without_backend_leaves_the_default(tmp_path: Path):
    path = tmp_path / "w.yaml"
    path.write_text("cache_transceiver_config: {ucx_profile: cross_host}\n")
    opts = load_worker_yaml(str(path))
    assert "kv_transfer_backend" not in opts and opts["ucx_profile"] == "cross_host"
    path.write_text("cache_transceiver_config: {backend: tcp}\n")
    assert load_worker_yaml(str(path))["kv_transfer_backend"] == "TCP"
