"""`disagg demo`: the same as `disagg launch` without ``-c`` (kept for old instructions).

SmolLM2-135M-Instruct when it can be fetched (else the built-in tiny model, whose random
weights answer gibberish), one context and one generation worker and the router on free local
ports, one chat request through the router.
"""

from __future__ import annotations

import argparse


def add_cli(sub: argparse._SubParsersAction) -> None:
    from disagg.launch import add_demo_arguments, run

    p = sub.add_parser(
        "demo", help="the built-in demo (same as `disagg launch` without -c)",
        description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="DIR|FILE.gguf|tiny|smollm2",
                   help="the demo's model instead of SmolLM2 (or the tiny one)")
    add_demo_arguments(p)
    p.set_defaults(func=run, config=None)
