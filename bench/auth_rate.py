"""How many signed requests per second one member's replay store accepts without refusing any.

Issue 40: the old store (131,072 nonces, each kept 240 s) refused valid requests past ~546/s.
The store now keeps a nonce only while its ``ts`` is inside the window, one set per ``ts``
second, sized for ``DEFAULT_MAX_RATE`` per second (``disagg.cluster_auth``). Measured here:

- *sustained*: an ``HttpVerifier`` with the default window and size is fed ``--rate`` signed
  requests per second (each with a fresh nonce, signed for it) on a simulated clock for
  ``--windows`` windows of simulated time; every refusal is counted (the claim: none), and
  the nonces held are sampled each simulated second (the claim: flat, ~ rate x window);
- *memory*: bytes per nonce held, from a verifier filled by real checks under
  ``tracemalloc`` (at 2,000/s: tracemalloc is slow), times the nonces held above;
- *verify*: wall-clock checks per second of one thread on this host (signing excluded, no
  HTTP): the cost of a check, beside the rate the store is sized for.

Writes ``bench/results/auth_rate.md`` (``--out``) with the machine described.

    python -m bench.auth_rate [--rate 10000] [--windows 2.5]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

from disagg.cluster_auth import (
    AUTH_HEADER,
    DEFAULT_MAX_RATE,
    DEFAULT_WINDOW_S,
    AuthError,
    HttpSigner,
    HttpVerifier,
)

TOKEN = "auth-rate-bench"
PATH = "/v1/completions"
BODY = b'{"model": "m", "prompt": "hello", "max_tokens": 8}'


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sustained(rate: int, windows: float) -> dict[str, float]:
    clock = Clock(1_800_000_000.0)
    v = HttpVerifier(TOKEN, clock=clock)
    signer = HttpSigner(TOKEN)
    seconds = int(windows * v.window_s)
    accepted = refused = 0
    held: list[int] = []
    why: dict[str, int] = {}
    t0 = time.perf_counter()
    for _ in range(seconds):
        for _ in range(rate):
            clock.t += 1.0 / rate
            h = signer.headers("POST", PATH, BODY, audience=v.member_id, now=clock.t)
            try:
                v.check(h[AUTH_HEADER], "POST", PATH, BODY)
                accepted += 1
            except AuthError as e:
                refused += 1
                why[str(e)] = why.get(str(e), 0) + 1
        held.append(v.remembered)
    steady = held[int(v.window_s) + 2:]
    return {"rate": rate, "seconds": seconds, "accepted": accepted, "refused": refused,
            "held_min": min(steady), "held_max": max(steady), "max_nonces": v.max_nonces,
            "window_s": v.window_s, "wall_s": time.perf_counter() - t0, "why": why}


def bytes_per_nonce(rate: int = 2000) -> float:
    """What the store holds per remembered nonce: a verifier filled to its steady state by
    real checks (``rate``/s for a window and 2 s) under ``tracemalloc`` (slow, hence the lower
    rate); the memory still allocated afterwards, over the nonces it holds."""
    clock = Clock(1_800_000_000.0)
    signer = HttpSigner(TOKEN)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    v = HttpVerifier(TOKEN, clock=clock)
    for _ in range(int(v.window_s) + 2):
        for _ in range(rate):
            clock.t += 1.0 / rate
            h = signer.headers("POST", PATH, BODY, audience=v.member_id, now=clock.t)
            v.check(h[AUTH_HEADER], "POST", PATH, BODY)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / v.remembered


def verify_rate(seconds: float = 3.0) -> float:
    v = HttpVerifier(TOKEN)
    signer = HttpSigner(TOKEN)
    headers = [signer.headers("POST", PATH, BODY, audience=v.member_id)[AUTH_HEADER]
               for _ in range(200_000)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and n < len(headers):
        v.check(headers[n], "POST", PATH, BODY)
        n += 1
    return n / (time.perf_counter() - t0)


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=int, default=DEFAULT_MAX_RATE)
    p.add_argument("--windows", type=float, default=2.5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "auth_rate.md"))
    args = p.parse_args(argv)
    s = sustained(args.rate, args.windows)
    vr = verify_rate()
    per_nonce = bytes_per_nonce()
    lines = [
        "# Signed-request replay store: sustained rate (bench/auth_rate.py)",
        "",
        f"Machine: {machine()}. Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- window {s['window_s']:.0f} s (`DEFAULT_WINDOW_S` = {DEFAULT_WINDOW_S:.0f}), store "
        f"capacity {s['max_nonces']:,} nonces (`DEFAULT_MAX_RATE` = {DEFAULT_MAX_RATE:,}/s "
        f"over the accepted ts span)",
        f"- sustained: {s['rate']:,} signed requests/s for {s['seconds']} s of simulated time: "
        f"{s['accepted']:,} accepted, **{s['refused']:,} refused**"
        + (f" ({s['why']})" if s["refused"] else ""),
        f"- nonces held at steady state: {s['held_min']:,} - {s['held_max']:,} (flat: "
        f"~ rate x window), {100 * s['held_max'] / s['max_nonces']:.0f}% of capacity",
        f"- store memory: {per_nonce:.0f} bytes per nonce held (measured at 2,000/s), so "
        f"~{per_nonce * s['held_max'] / 2**20:.0f} MiB at that steady state and "
        f"~{per_nonce * s['max_nonces'] / 2**20:.0f} MiB if ever full",
        f"- one thread verifies {vr:,.0f} signed requests/s on this host (check only: parse, "
        f"HMAC, replay store; no HTTP)",
        "",
    ]
    text = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0 if s["refused"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
