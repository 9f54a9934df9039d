"""``disagg router -c FILE``: run the router of a cluster YAML (see ``disagg.contracts.cluster``).

Once listening it prints ``disagg router listening on http://HOST:PORT`` (flushed) to stdout,
so a supervisor that asked for port 0 learns the port. SIGTERM / SIGINT stop it (exit 0).
The cluster token comes from ``$DISAGG_CLUSTER_TOKEN``; without one a router with context
servers, or with ``disagg_cluster`` (unless ``--insecure-membership``), exits 2 at once.

``--processes N`` (YAML ``processes``) runs N router processes on the port (SO_REUSEPORT,
one a core: ``disagg.router.processes``); this process then only supervises them, and prints
the listening line once all of them serve.

The event loop is uvloop's when it is installed (a dependency except on Windows; in
``bench/router_overhead.py``'s side by side, four runs, it gave x1.12 to x1.28 the
non-streaming requests per CPU-second of asyncio's loop, x0.96 to x1.24 streaming);
``DISAGG_ROUTER_UVLOOP=0`` runs asyncio's loop, ``=1`` insists on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from disagg import env, tracing
from disagg.cluster_auth import api_key_or_none
from disagg.contracts.cluster import (
    MAX_PROCESSES,
    ClusterConfig,
    RouterConfigError,
    load_cluster_config,
)
from disagg.contracts.options import check_origins
from disagg.router.processes import ProcessInfo, own_path, supervise


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="route OpenAI requests over context / generation workers",
        description="Route OpenAI requests over the context and generation workers of a "
                    "cluster YAML (disaggregated), or over aggregated workers.")
    p.add_argument("-c", "--config", required=True, metavar="FILE", help="cluster YAML")
    p.add_argument("--host", default=None, help="address to bind (default: the YAML's "
                   "hostname)")
    p.add_argument("--port", type=int, default=None, help="port to bind; 0 picks a free one "
                   "(default: the YAML's port)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics to anyone even when api_key is set (YAML: "
                   "public_metrics: true)")
    p.add_argument("--insecure-membership", action="store_true",
                   help="with disagg_cluster but no cluster token ($DISAGG_CLUSTER_TOKEN): "
                   "accept worker registrations from anyone (trusted networks only)")
    p.add_argument("--planner", action="store_true",
                   help="run the planner: move workers between the context and generation "
                   "pools as the load shifts (settings: the YAML's planner: section)")
    p.add_argument("--kv-streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="send a disaggregated request's context and generation calls at once "
                   "and stream the prompt's KV layer by layer (default: the YAML's "
                   "kv_streaming, false)")
    p.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGIN,...",
                   help="CORS: browser origins (scheme://host[:port], or *) the router answers "
                   "with CORS headers, replacing the YAML's allowed_origins (default: none, no "
                   "CORS headers)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces of the requests to this OTLP/HTTP receiver "
                   "(e.g. http://localhost:4318/v1/traces; needs pip install "
                   "'disagg[tracing]'), replacing the YAML's otlp_traces_endpoint (default: "
                   "the OTEL_EXPORTER_OTLP_* variables, else off)")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="router processes sharing the port (SO_REUSEPORT; one a core; "
                   "default: the YAML's processes, 1)")
    # Set by the supervising parent for each of its router processes (not for users).
    p.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-dir", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = configured(args)
        host = args.host or config.hostname
        port = config.port if args.port is None else args.port
        count = config.processes if args.processes is None else args.processes
        if not 1 <= count <= MAX_PROCESSES:
            raise RouterConfigError(f"--processes: {count} (1..{MAX_PROCESSES})")
        if count > 1 and args.process_index is None:
            return supervise(_child_argv(args, host), count, host, port)
        process = ProcessInfo(args.process_index or 0, count, args.process_dir)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve(config, host, port,
                                    insecure_membership=args.insecure_membership,
                                    process=process))
    except RouterConfigError as e:
        print(f"disagg router: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad --process-index / --process-dir (from the parent)
        print(f"disagg router: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the address is taken, etc.
        print(f"disagg router: error: cannot listen: {e}", file=sys.stderr)
        return 1


def configured(args: argparse.Namespace) -> ClusterConfig:
    """The cluster YAML with the command line's overrides (RouterConfigError naming the
    option when one cannot apply)."""
    config = load_cluster_config(args.config)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise RouterConfigError(f"--port: {args.port} is not a port number")
    if config.api_key is None and (key := api_key_or_none()):
        config = dataclasses.replace(config, api_key=key)  # $DISAGG_API_KEY
    if args.public_metrics:
        config = dataclasses.replace(config, public_metrics=True)
    if args.allowed_origins is not None:
        try:
            origins = check_origins(args.allowed_origins, "--allowed-origins")
        except ValueError as e:
            raise RouterConfigError(str(e)) from None
        config = dataclasses.replace(config, allowed_origins=origins)
    if args.otlp_traces_endpoint is not None:
        try:  # (the URL and the tracing extra, named by the flag)
            tracing.configured(args.otlp_traces_endpoint, tracing.FLAG)
        except tracing.TracingError as e:
            raise RouterConfigError(str(e)) from None
        config = dataclasses.replace(config, otlp_traces_endpoint=args.otlp_traces_endpoint)
    if args.planner:
        if config.planner is None:
            raise RouterConfigError(f"{config.source}: planner: missing: --planner needs a "
                                    "planner: section with ttft_slo_ms and tpot_slo_ms")
        config = dataclasses.replace(
            config, planner=dataclasses.replace(config.planner, enabled=True))
    if args.kv_streaming is not None:
        if args.kv_streaming and config.aggregated and config.disagg_cluster is None:
            raise RouterConfigError(f"--kv-streaming: {config.source} has no context_servers "
                                    "(nor disagg_cluster): nothing to stream KV from")
        config = dataclasses.replace(config, kv_streaming=args.kv_streaming)
    return config


def _child_argv(args: argparse.Namespace, host: str) -> list[str]:
    """The command line of one of the router processes (the parent adds the port and which
    process it is)."""
    argv = [sys.executable, "-m", "disagg.cli", "router", "-c", os.path.abspath(args.config),
            "--host", host, "--log-level", args.log_level]
    if args.public_metrics:
        argv.append("--public-metrics")
    if args.allowed_origins is not None:
        argv += ["--allowed-origins", ",".join(args.allowed_origins)]
    if args.insecure_membership:
        argv.append("--insecure-membership")
    if args.kv_streaming is not None:
        argv.append("--kv-streaming" if args.kv_streaming else "--no-kv-streaming")
    if args.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.planner:  # (only process 0 runs it)
        argv.append("--planner")
    return argv


def _origins(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed, None (asyncio's) with ``DISAGG_ROUTER_UVLOOP=0`` or
    without uvloop. RouterConfigError when ``DISAGG_ROUTER_UVLOOP=1`` and it is missing."""
    wanted = env.ROUTER_UVLOOP.get()
    if wanted is False:
        return None
    try:
        import uvloop
    except ImportError:
        if wanted:
            raise RouterConfigError("DISAGG_ROUTER_UVLOOP=1 but uvloop is not installed "
                                    "(pip install uvloop)") from None
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def event_loop_name() -> str:
    """The running loop's implementation (logged at start)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"


def tune_gc() -> None:
    """Once the router is up: its start-up objects (modules, schemas, config) out of the
    collector's way (``gc.freeze``), and the young generation collected every 50,000
    allocations instead of 700. Each request allocates tasks, futures and frames; with the
    defaults the collector ran every few requests and walked the whole heap often: ~10% of
    the router's CPU under load (``bench/router_overhead.py``). Garbage without cycles is
    freed at once either way; cyclic garbage waits a little longer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def serve(config: ClusterConfig, host: str, port: int,
                insecure_membership: bool = False, process: ProcessInfo | None = None) -> int:
    """Run until SIGTERM / SIGINT. ``process``: one of several router processes (it binds
    with SO_REUSEPORT, serves its private socket too, and leaves the listening line to the
    parent)."""
    from disagg.router.app import build_router_app, start_router

    process = process or ProcessInfo()
    app = build_router_app(config, insecure_membership=insecure_membership, process=process)
    runner, bound = await start_router(app, host, port, reuse_port=process.count > 1,
                                       private_socket=own_path(process))
    tune_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    shown = f"[{host}]" if ":" in host else host
    logging.getLogger("disagg.router").info("event loop: %s", event_loop_name())
    if process.count == 1:
        print(f"disagg router listening on http://{shown}:{bound}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
