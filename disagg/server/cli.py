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
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from disagg import tracing
from disagg.cluster_auth import api_key_or_none, cluster_token_or_none
from disagg.config import ConfigError, SpeculativeConfig
from disagg.contracts.options import (
    DISAGG_ROLES,
    WORKER_OPTIONS,
    Opt,
    StrList,
    WorkerOptions,
    check_role,
    load_worker_yaml,
    option_help,
    speculative_mapping,
)
from disagg.contracts.roles import Role
from disagg.server.http_guard import SERVER_KEEP_ALIVE_S, uvicorn_options  # noqa: F401

if TYPE_CHECKING:
    from disagg.config import EngineConfig
    from disagg.engine.client import EngineClient

logger = logging.getLogger("disagg.server")


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve one model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (one worker process).")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                   help="Hugging Face checkpoint folder")
    p.add_argument("--config", metavar="worker.yaml",
                   help="worker YAML (keys: these options in snake_case); flags override it")
    # One flag per WorkerOptions field that has one (its help shows the field's default);
    # each defaults to None so that only flags actually given override the YAML.
    group = p.add_mutually_exclusive_group()
    for name, opt in WORKER_OPTIONS.items():
        flag = opt.flag_name(name)
        if flag is not None:
            target = group if name in ("kv_cache_tokens", "kv_cache_fraction") else p
            _add_option(target, flag, name, opt)
    p.set_defaults(func=_cmd_serve)


def _add_option(p: Any, flag: str, name: str, opt: Opt) -> None:
    help = option_help(name)
    if opt.type is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                       help=help)
    elif opt.type is list:
        p.add_argument(flag, dest=name, type=_int_list, default=None, metavar=opt.metavar,
                       help=help)
    elif opt.type is StrList:
        p.add_argument(flag, dest=name, type=_str_list, default=None, metavar=opt.metavar,
                       help=help)
    elif opt.type is SpeculativeConfig:
        p.add_argument(flag, dest=name, type=_speculative, default=None, metavar=opt.metavar,
                       help=help)
    else:
        p.add_argument(flag, dest=name, type=opt.type, choices=opt.choices, default=None,
                       metavar=opt.metavar, help=help)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _speculative(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object, checked now (the message names the key)."""
    try:
        return speculative_mapping(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_options(args: argparse.Namespace) -> WorkerOptions:
    """The worker's options: the defaults (``WorkerOptions``' fields) < the worker YAML
    (``--config``) < the flags given < ``MODEL_DIR``; ``ConfigError`` naming what is wrong."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update({k: v for k, v in load_worker_yaml(args.config).items() if v is not None})
    for name in WORKER_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if getattr(args, "model_dir", None):
        values["model"] = args.model_dir
    if not values.get("model"):
        raise ConfigError("MODEL_DIR: required (as an argument or as 'model' in --config)")
    return WorkerOptions(**values)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        options = resolve_options(args)
    except ConfigError as e:
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return 2
    return run_server(options)


def run_server(options: WorkerOptions) -> int:
    """Load ``options.model``, serve until SIGTERM/SIGINT, drain, return the exit code."""
    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir, host, port, role = options.model, options.host, options.port, options.role
    if not model_dir:
        print("disagg serve: error: MODEL_DIR: required", file=sys.stderr)
        return 2
    # Any role: requests signed with it are the cluster's (the disaggregated roles need it).
    cluster_token = cluster_token_or_none(options.cluster_token)
    api_key = api_key_or_none(options.api_key)  # else $DISAGG_API_KEY
    try:
        # Before loading anything: fail fast on a role or options we cannot serve.
        http_host, kv_advertise = _advertised_hosts(host, options.kv_transfer_host,
                                                    options.advertise_host, options.router_url,
                                                    role, options.kv_peer_reuse)
        template, origins = _api_settings(options.chat_template, options.allowed_origins)
        traces = _traces_endpoint(options.otlp_traces_endpoint)
        disagg_settings = _disagg_settings(options, kv_advertise, traces)
        config, engine = _start_engine(model_dir, options.engine_options(), disagg_settings)
    except _StartError as e:
        print(f"disagg serve: error: {e}", file=sys.stderr)
        return e.exit_code

    from disagg.server.app import ServerSettings, build_app

    settings = ServerSettings.from_options(options, api_key=api_key, cluster_token=cluster_token,
                                           chat_template=template, allowed_origins=origins,
                                           otlp_traces_endpoint=traces)
    app = build_app(engine, settings)
    server = _uvicorn_server(app, engine, host=host, port=port, log_level=options.log_level,
                             drain_timeout=options.drain_timeout)
    logger.info("serving %s as %r (role %s) on %s:%d", model_dir, settings.model_name, role,
                host, port)
    if options.chat_template is not None:
        logger.info("chat template: %s", "the --chat-template text"
                    if template == options.chat_template else options.chat_template)
    if origins:
        logger.info("CORS: allowed origins %s", ", ".join(origins))
    if traces is not None:
        logger.info("tracing: OTLP/HTTP spans to %s", traces)
    if engine.transfer is not None:
        logger.info("kv transfer: %s", engine.transfer.info())
    if config.parallel.world_size > 1:
        logger.info("rank pids: %s", engine.rank_pids)
    registration = None
    if options.router_url:  # dynamic membership: register once listening, heartbeat
        from disagg.server.registration import RouterRegistration

        registration = RouterRegistration(options.router_url, engine, settings,
                                          http_host or host, cluster_token)
        srv = app.state.server
        registration.role_of = lambda: srv.serving_role
        app.state.role_routes.on_switched.append(registration.register_now)
    return _serve(server, engine, registration)


def _serve(server: Any, engine: EngineClient, registration: Any) -> int:
    """Serve until stopped (registered with the router when ``registration`` is given), stop
    the engine; the exit code: 1 when the engine failed or the server never started."""
    try:
        if registration is not None:
            from disagg.server.registration import serve_registered

            asyncio.run(serve_registered(server, registration))
        else:
            asyncio.run(server.serve())
    finally:
        engine.close()  # idempotent; also when serve() itself failed
    if engine.fatal_error is not None:
        logger.error("exiting: %s", engine.fatal_error)
        return 1
    return 0 if server.started else 1


class _StartError(Exception):
    """The worker cannot start: ``disagg serve: error: <message>``, exit ``exit_code`` (2: a
    usage or configuration error, 1: loading failed)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _advertised_hosts(host: str, kv_transfer_host: str | None, advertise_host: str | None,
                      router_url: str | None, role: str, kv_peer_reuse: bool = False
                      ) -> tuple[str | None, str | None]:
    """``(HTTP host registered with the router, KV transfer host handed to peers)``; None where
    the worker has no such peer (no router / an aggregated worker). Each choice is logged;
    ``_StartError`` (exit 2) when no address a peer could reach exists."""
    from disagg.addresses import AddressError, advertise_address, is_wildcard

    try:
        http = kv = None
        if router_url:
            http = advertise_address(host, advertise_host=advertise_host, router_url=router_url)
            logger.info("advertising HTTP address %s to the router (%s)", http.host, http.why)
        if role in DISAGG_ROLES or kv_peer_reuse:
            # A specific --kv-transfer-host is the KV address itself (a separate network).
            own = kv_transfer_host is not None and not is_wildcard(kv_transfer_host)
            kv = advertise_address(kv_transfer_host or host, router_url=router_url,
                                   advertise_host=None if own else advertise_host)
            logger.info("advertising KV transfer address %s (%s)", kv.host, kv.why)
    except (AddressError, ValueError) as e:
        raise _StartError(2, str(e)) from None
    return (http.host if http else None), (kv.host if kv else None)


def _api_settings(chat_template: str | None, allowed_origins: list[str] | None
                  ) -> tuple[str | None, tuple[str, ...]]:
    """The chat template's text (read and compiled now: a broken one is a start-up error
    naming the option, not a 500 per request) and the CORS origins; ``_StartError`` (exit 2)
    saying what is wrong."""
    from disagg.contracts.options import check_origins
    from disagg.tokenizer import read_chat_template

    try:
        template = None if chat_template is None else read_chat_template(chat_template)
        return template, check_origins(allowed_origins)
    except ValueError as e:
        raise _StartError(2, str(e)) from None


def kv_transfer_backend_or_default(backend: str | None) -> str:
    """An explicit backend as given (an explicit UCX without ucxx fails when the worker
    starts, saying so); none: the default, UCX when ucxx imports, else TCP, logged."""
    if backend:
        return backend.upper()
    from disagg.transfer.backends import default_backend

    name, why = default_backend()
    logger.info("KV transfer backend: %s (%s)", name, why)
    return name


def _traces_endpoint(value: str | None) -> str | None:
    """Where the worker's traces go (``disagg/tracing.py``: the flag, else the OTEL_*
    variables; None: off); ``_StartError`` (exit 2) for a bad URL, or the flag without the
    tracing extra installed."""
    try:
        return tracing.configured(value, tracing.FLAG)
    except tracing.TracingError as e:
        raise _StartError(2, str(e)) from None


def _disagg_settings(options: WorkerOptions, kv_advertise_host: str | None = None,
                     traces: str | None = None) -> Any:
    """Check the role and the KV transfer options; the ``DisaggSettings`` of a context or
    generation worker (None for an aggregated one), with what is decided at start resolved:
    the cluster token, the backend's default, the UCX profile (logged), the traces' endpoint
    (``traces``). ``_StartError`` (exit 2) on a bad role, a missing cluster token or a bad
    lease ttl."""
    role = options.role
    try:
        check_role(role, options.world_size)
        if options.benchmark_gen_only and role != Role.GENERATION:
            raise ValueError(f"benchmark_gen_only: needs role 'generation', not "
                             f"{role.value!r}")
        if role not in DISAGG_ROLES and not options.kv_peer_reuse:
            return None
        from disagg.cluster_auth import resolve_cluster_token
        from disagg.kv_connector.settings import DisaggSettings
        from disagg.transfer.ucx import resolve_ucx_profile

        if not options.kv_lease_ttl_s > 0:
            raise ValueError("kv_lease_ttl_s (--kv-lease-ttl): must be > 0")
        backend = kv_transfer_backend_or_default(options.kv_transfer_backend)
        settings = DisaggSettings.from_options(
            options, cluster_token=resolve_cluster_token(options.cluster_token),
            backend=backend, advertise_host=kv_advertise_host, otlp_traces_endpoint=traces)
        if backend == "UCX":
            _, why = resolve_ucx_profile(options.ucx_profile,
                                         settings.advertise_host or settings.host)
            logger.info("UCX profile %s (%s)", settings.ucx_profile, why)
        return settings
    except ValueError as e:
        raise _StartError(2, str(e)) from None


def _start_engine(model_dir: str, engine_options: dict[str, Any], disagg_settings: Any
                  ) -> tuple[EngineConfig, EngineClient]:
    """``(EngineConfig, AsyncLLM)`` with the model loaded; ``_StartError`` saying why not."""
    from disagg.config import build_engine_config
    from disagg.engine import AsyncLLM
    from disagg.parallel.executor import WorkerStartupError

    try:
        config = build_engine_config(model_dir, **engine_options)
    except ConfigError as e:
        raise _StartError(2, str(e)) from None
    # Seconds on a small model, minutes on a big one: say what the worker is doing.
    logger.info("loading %s (%s on %s) and allocating the KV cache ...", config.model_dir,
                config.dtype, config.device)
    t0 = time.monotonic()
    try:
        engine = AsyncLLM(config, disagg=disagg_settings)
        logger.info("model loaded in %.1f s", time.monotonic() - t0)
        return config, engine
    except (ValueError, OSError) as e:  # unreadable checkpoint, bad tensor, KV does not fit
        raise _StartError(1, f"cannot load {model_dir}: {e}") from None
    except RuntimeError as e:  # the KV transfer backend cannot start (e.g. no ucxx)
        raise _StartError(1, f"KV transfer: {e}") from None
    except WorkerStartupError as e:  # a rank of a parallel worker failed to start
        raise _StartError(1, str(e)) from None


def _uvicorn_server(app: Any, engine: EngineClient, *, host: str, port: int, log_level: str,
                    drain_timeout: float) -> Any:
    """The draining uvicorn server of ``app``: SIGTERM/SIGINT drain the engine's requests;
    the engine's fatal error (a dead rank) stops it."""
    import uvicorn

    from disagg.server.app import begin_drain

    def on_exit() -> None:
        # /health turns 503 and new requests get 503 at once; late requests are aborted
        # (cleanly, through the engine) when the drain period ends.
        begin_drain(app, drain_timeout)

    def fatal() -> str | None:
        return engine.fatal_error

    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        # h11 with explicit limits and a header timeout; keep-alive SERVER_KEEP_ALIVE_S
        **uvicorn_options(),
        # A backstop only: by then our own drain has aborted every request.
        timeout_graceful_shutdown=int(drain_timeout) + 5,
    )
    return make_draining_server(uv_config, on_exit, fatal)


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
