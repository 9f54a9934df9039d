"""The `disagg` command line.

Each subcommand lives with the module it drives and registers itself through an
``add_cli(subparsers)`` function that adds its parser and sets ``func`` (called with the parsed
arguments; its return value is the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide add_cli(subparsers), in the order shown by --help.
SUBCOMMAND_MODULES = (
    "disagg.demo",  # demo: alias of `launch` without -c
    "disagg.launch",  # launch: workers + router from one disagg YAML (no -c: the demo)
    "disagg.generate",  # generate: offline generation
    "disagg.model.tiny",  # model tiny: write a tiny checkpoint
    "disagg.server.cli",  # serve
    "disagg.router.cli",  # router
    "disagg.bench.cli",  # bench
    "disagg.deploy.cli",  # deploy k8s|slurm: render a many-machine deployment
    "disagg.doctor",  # doctor: check a KV transfer link (bandwidth, latency, transports)
)


def build_parser() -> argparse.ArgumentParser:
    from disagg import __version__

    parser = argparse.ArgumentParser(prog="disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
