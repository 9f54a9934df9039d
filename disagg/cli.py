"""The `disagg` command line.

Each subcommand lives with the module it drives and registers itself through an
``add_cli(subparsers)`` function that adds its parser and sets ``func`` (called with the parsed
arguments; its return value is the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each command and the module that provides its add_cli(subparsers), in the order shown by --help.
SUBCOMMANDS = (
    ("demo", "disagg.demo"),  # alias of `launch` without -c
    ("launch", "disagg.launch"),  # workers + router from one disagg YAML (no -c: the demo)
    ("generate", "disagg.generate"),  # offline generation
    ("model", "disagg.model.tiny"),  # model tiny / fetch: write a tiny checkpoint, a packaged one
    ("serve", "disagg.server.cli"),
    ("router", "disagg.router.cli"),
    ("bench", "disagg.bench.cli"),
    ("deploy", "disagg.deploy.cli"),  # k8s|slurm: render a many-machine deployment
    ("doctor", "disagg.doctor"),  # check a KV transfer link (bandwidth, latency, transports)
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone when it names one: a process that
    runs `disagg serve` then imports no other command's modules (0.3 s of CPU less at every
    worker's start; ``disagg --help`` and an unknown command still see them all)."""
    from disagg import __version__

    parser = argparse.ArgumentParser(prog="disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = [m for c, m in SUBCOMMANDS if c == command] or [m for _, m in SUBCOMMANDS]
    for name in chosen:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the command is the first word (the top-level parser's only option is --version)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `disagg` command (the console script, ``python -m disagg.cli``): ``main``, then the
    process ends (``procs.freeze_for_exit``: its final collections skipped)."""
    code = main()
    from disagg.procs import freeze_for_exit

    freeze_for_exit()
    sys.exit(code)


if __name__ == "__main__":
    run()
