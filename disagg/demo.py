"""`disagg demo`: start a worker on the built-in tiny model, send it one chat request, stop it.

The tiny model has random weights, so the answer is gibberish; the point is that a real
OpenAI-compatible server answers a real request end to end on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="start a worker on the built-in tiny model and send it one chat request",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--message", default="Tell me a story about a fox.", help="user message")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=180.0, help="start-up limit in seconds")
    p.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run(args: argparse.Namespace) -> int:
    import httpx

    from disagg.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.gettempdir(), f"disagg-demo-{port}.log")
    cmd = [sys.executable, "-m", "disagg.cli", "serve", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny-llama", "--kv-cache-tokens", "8192"]
    print(f"model: {model_dir}\nstarting worker: {' '.join(cmd[2:])}\nlog: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + args.timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    print(f"worker exited with code {proc.returncode} during start-up; log tail:"
                          f"\n{_tail(log_path)}", file=sys.stderr)
                    return 1
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    print(f"worker not healthy after {args.timeout:.0f} s; log tail:\n"
                          f"{_tail(log_path)}", file=sys.stderr)
                    return 1
                time.sleep(0.2)  # polling the health endpoint, bounded by the deadline
            print(f"worker healthy at {url}\n")
            body = {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": args.message}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
            }
            print(f"POST {url}/v1/chat/completions\n{json.dumps(body)}\n")
            t0 = time.perf_counter()
            resp = client.post(f"{url}/v1/chat/completions", json=body, timeout=120.0)
            elapsed = time.perf_counter() - t0
            data = resp.json()
            if resp.status_code != 200:
                print(f"request failed: HTTP {resp.status_code}: {data}", file=sys.stderr)
                return 1
            choice = data["choices"][0]
            print(f"assistant ({choice['finish_reason']}, {elapsed * 1e3:.0f} ms): "
                  f"{choice['message']['content']!r}")
            print(f"usage: {data['usage']}")
            print("\n(the built-in tiny model has random weights: the text is not meant to make "
                  "sense)")
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
