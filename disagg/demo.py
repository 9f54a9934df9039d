"""`disagg demo`: the same as `disagg launch` without ``-c`` (kept for old instructions).

The built-in tiny model (random weights: the answer is gibberish), one context and one
generation worker and the router on free local ports, one chat request through the router.
"""

from __future__ import annotations

import argparse


def add_cli(sub: argparse._SubParsersAction) -> None:
    from disagg.launch import add_demo_arguments, run

    p = sub.add_parser(
        "demo", help="the built-in demo (same as `disagg launch` without -c)",
        description=__doc__.splitlines()[0])
    add_demo_arguments(p)
    p.set_defaults(func=run, config=None, model=None)
