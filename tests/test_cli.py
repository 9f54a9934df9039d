"""The README's first command (`disagg demo`) and the offline `disagg generate`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_answers_a_chat_request(tmp_path):
    env = dict(os.environ, DISAGG_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "demo", "--max-tokens", "8"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker healthy at http://127.0.0.1:" in proc.stdout
    assert "assistant (length" in proc.stdout
    assert "'completion_tokens': 8" in proc.stdout


def test_generate_cli(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "generate", tiny_llama, "-p",
                           "Hello", "--max-tokens", "5", "--kv-cache-tokens", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Hello'" in proc.stdout and "5 tokens" in proc.stdout


def test_cli_reports_bad_option(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "generate", tiny_llama,
                           "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "top_p" in proc.stderr
