"""`disagg demo` (an alias of the README's first command, `disagg launch`) and the offline
`disagg generate`."""

from __future__ import annotations

import subprocess
import sys


def test_demo_is_the_launch_demo():
    """`disagg demo` (the old first command) runs `disagg launch` without -c, whose end to
    end test is in test_launch.py."""
    from disagg.cli import build_parser
    from disagg.launch import run

    args = build_parser().parse_args(["demo", "--max-tokens", "8", "--keep-running"])
    assert args.func is run and args.config is None and args.model is None
    assert args.max_tokens == 8 and args.keep_running and args.timeout > 0
    assert args.message == "What is the capital of France?"
    # The demo's model choice (SmolLM2, else tiny) can be overridden as with `launch`.
    assert build_parser().parse_args(["demo", "--model", "tiny"]).model == "tiny"


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
