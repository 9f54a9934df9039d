"""``disagg serve``: one worker process serving one model over HTTP (FastAPI + uvicorn).

Options come from three layers, later ones winning: built-in defaults, a worker YAML
(``--config``; the same snake_case keys as a server section of the disagg YAML, i.e. the
engine option names of ``build_engine_config`` plus the server's own), and command-line flags.

Shutdown: SIGTERM or SIGINT stops accepting connections, gives in-flight requests
``drain_timeout`` seconds to finish, aborts the rest, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from disagg.cluster_auth import cluster_token_or_none
from disagg.config import ConfigError, read_yaml
from disagg.server.http_guard import SERVER_KEEP_ALIVE_S, uvicorn_options  # noqa: F401
from disagg.server.options import (
    DISAGG_ROLES,
    ENGINE_OPTIONS,
    ROLES,
    SERVER_DEFAULTS,
    SERVER_OPTIONS,
    Opt,
    StrList,
    check_role,
    coerce,
)

logger = logging.getLogger("disagg.server")

AVAILABLE_ROLES = ROLES

# Keys of a disagg YAML server section that describe the cluster, not one worker.
_SECTION_ONLY_KEYS = ("num_instances", "urls", "router")


def load_worker_yaml(path: str) -> dict[str, Any]:
    """Options from a worker YAML; unknown keys and wrong types are errors naming both."""
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    known = {**SERVER_OPTIONS, **ENGINE_OPTIONS}
    out: dict[str, Any] = {}
    data = dict(data)
    if "cache_transceiver_config" in data:  # trtllm-serve's shape: {backend: UCX | TCP}
        from disagg.transfer.base import CacheTransceiverConfig

        raw = data.pop("cache_transceiver_config")
        try:
            ctc = CacheTransceiverConfig.from_dict(raw if raw is not None else {})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: cache_transceiver_config: {e}") from None
        out["kv_transfer_backend"] = ctc.backend
        out["ucx_profile"] = ctc.ucx_profile
    if "kv_lease_ttl_s" in data:
        data["kv_lease_ttl"] = data.pop("kv_lease_ttl_s")
    for key, value in data.items():
        if key not in known:
            hint = (" (a cluster key of the disagg YAML; a worker file holds only worker "
                    "options)" if key in _SECTION_ONLY_KEYS else "")
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known keys: "
                              f"{', '.join(sorted(known))}")
        out[key] = coerce(key, known[key], value, path)
    return out


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve one model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (one worker process).")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                   help="Hugging Face checkpoint folder")
    p.add_argument("--config", metavar="worker.yaml",
                   help="worker YAML (keys: these options in snake_case); flags override it")
    # Every option defaults to None so that only flags actually given override the YAML.
    for name, opt in SERVER_OPTIONS.items():
        if name != "model":
            _add_option(p, name, opt)
    group = p.add_mutually_exclusive_group()
    for name, opt in ENGINE_OPTIONS.items():
        target = group if name in ("kv_cache_tokens", "kv_cache_fraction") else p
        _add_option(target, name, opt)
    p.set_defaults(func=_cmd_serve)


def _add_option(p: Any, name: str, opt: Opt) -> None:
    flag = "--" + name.replace("_", "-")
    if opt.type is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                       help=opt.help)
    elif opt.type is list:
        p.add_argument(flag, dest=name, type=_int_list, default=None, metavar=opt.metavar,
                       help=opt.help)
    elif opt.type is StrList:
        p.add_argument(flag, dest=name, type=_str_list, default=None, metavar=opt.metavar,
                       help=opt.help)
    else:
        p.add_argument(flag, dest=name, type=opt.type, choices=opt.choices, default=None,
                       metavar=opt.metavar, help=opt.help)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < YAML < flags; returns one flat dict of server and engine options."""
    options: dict[str, Any] = dict(SERVER_DEFAULTS)
    if getattr(args, "config", None):
        options.update({k: v for k, v in load_worker_yaml(args.config).items() if v is not None})
    # Not a flag: the UCX profile only comes from the YAML's cache_transceiver_config.
    ucx_profile = options.pop("ucx_profile", None)
    for name in (*SERVER_OPTIONS, *ENGINE_OPTIONS):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    if getattr(args, "model_dir", None):
        options["model"] = args.model_dir
    if not options.get("model"):
        raise ConfigError("MODEL_DIR: required (as an argument or as 'model' in --config)")
    if ucx_profile is not None:
        options["ucx_profile"] = ucx_profile
    return options


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        options = resolve_options(args)
    except ConfigError as e:
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return 2
    server = {k: options.pop(k) for k in list(options)
              if k in SERVER_OPTIONS or k == "ucx_profile"}
    return run_server(server.pop("model"), engine_options=options, **server)


def run_server(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    role: str = "aggregated",
    served_model_name: str | None = None,
    api_key: str | None = None,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    engine_options: dict[str, Any] | None = None,
    kv_transfer_backend: str = "UCX",
    kv_transfer_host: str | None = None,
    cluster_token: str | None = None,
    kv_lease_ttl: float = 30.0,
    kv_peer_allowlist: list[str] | None = None,
    ucx_profile: str = "same_host",
    benchmark_gen_only: bool = False,
    router_url: str | None = None,
    public_metrics: bool = False,
) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return the exit code."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    eo = engine_options or {}
    world = int(eo.get("tensor_parallel_size") or 1) * int(eo.get("pipeline_parallel_size") or 1)
    disagg_settings = None
    # Any role: requests signed with it are the cluster's (the disaggregated roles need it).
    cluster_token = cluster_token_or_none(cluster_token)
    try:
        check_role(role, world)  # before loading anything: fail fast on a role we cannot serve
        if benchmark_gen_only and role != "generation":
            raise ValueError(f"benchmark_gen_only: needs role 'generation', not {role!r}")
        if role in DISAGG_ROLES:
            from disagg.cluster_auth import PeerAllowlist, resolve_cluster_token
            from disagg.kv_connector.settings import DisaggSettings

            if kv_lease_ttl is None or kv_lease_ttl <= 0:
                raise ValueError("kv_lease_ttl: must be > 0")
            disagg_settings = DisaggSettings(
                role=role, cluster_token=resolve_cluster_token(cluster_token),
                backend=(kv_transfer_backend or "UCX").upper(),
                host=kv_transfer_host or host, lease_ttl_s=float(kv_lease_ttl),
                ucx_profile=ucx_profile or "same_host",
                kv_peer_allowlist=PeerAllowlist.parse(kv_peer_allowlist))
    except ValueError as e:  # bad role, no cluster token, bad ttl
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from disagg.config import build_engine_config
    from disagg.engine import AsyncLLM
    from disagg.parallel.executor import WorkerStartupError
    from disagg.server.app import ServerSettings, begin_drain, build_app

    try:
        config = build_engine_config(model_dir, **(engine_options or {}))
    except ConfigError as e:
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return 2
    try:
        engine = AsyncLLM(config, disagg=disagg_settings)
    except (ValueError, OSError) as e:  # unreadable checkpoint, bad tensor, KV does not fit
        print(f"disagg serve: error: cannot load {model_dir}: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the KV transfer backend cannot start (e.g. no ucxx)
        print(f"disagg serve: error: KV transfer: {e}", file=sys.stderr)
        return 1
    except WorkerStartupError as e:  # a rank of a parallel worker failed to start
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return 1
    settings = ServerSettings(model_dir=model_dir, served_model_name=served_model_name,
                              role=role, api_key=api_key, cluster_token=cluster_token,
                              public_metrics=bool(public_metrics),
                              benchmark_gen_only=bool(benchmark_gen_only))
    app = build_app(engine, settings)

    def on_exit() -> None:
        # /health turns 503 and new requests get 503 at once; late requests are aborted
        # (cleanly, through the engine) when the drain period ends.
        begin_drain(app, drain_timeout)

    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        # h11 with explicit limits and a header timeout; keep-alive SERVER_KEEP_ALIVE_S
        **uvicorn_options(),
        # A backstop only: by then our own drain has aborted every request.
        timeout_graceful_shutdown=int(drain_timeout) + 5,
    )
    def fatal() -> str | None:
        return engine.fatal_error

    server = make_draining_server(uv_config, on_exit, fatal)
    logger.info("serving %s as %r (role %s) on %s:%d", model_dir, settings.model_name, role,
                host, port)
    if engine.transfer is not None:
        logger.info("kv transfer: %s", engine.transfer.info())
    if config.parallel.world_size > 1:
        logger.info("rank pids: %s", engine.rank_pids)
    try:
        if router_url:  # dynamic membership: register once listening, heartbeat
            from disagg.server.registration import RouterRegistration, serve_registered

            reg = RouterRegistration(router_url, engine, settings, host, cluster_token)
            asyncio.run(serve_registered(server, reg))
        else:
            asyncio.run(server.serve())
    finally:
        engine.engine.shutdown()  # idempotent; also when serve() itself failed
    if engine.fatal_error is not None:
        logger.error("exiting: %s", engine.fatal_error)
        return 1
    return 0 if server.started else 1


def make_draining_server(config: Any, on_exit: Callable[[], None],
                         fatal: Callable[[], str | None] | None = None) -> Any:
    """A ``uvicorn.Server`` whose SIGTERM/SIGINT drain and then let the process exit 0.

    uvicorn re-raises the captured signal once it has shut down, so a SIGTERM-ed worker would
    die "killed by signal"; a drained shutdown is a success, so it is not re-raised here.
    ``fatal()`` returning a reason (a rank of the worker died) stops the server at once: it
    has already reported unhealthy, and a supervisor should restart it.
    (Defined lazily: uvicorn is an optional dependency of the package.)
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            if fatal is not None and not self.should_exit and fatal() is not None:
                logger.error("engine failed (%s): shutting down", fatal())
                self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals belong to the main thread (e.g. servers in test threads)
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return DrainingServer(config)
