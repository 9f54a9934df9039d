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
from dataclasses import dataclass
from types import FrameType
from typing import Any

from disagg.cluster_auth import cluster_token_or_none
from disagg.config import CapacityPolicy, ConfigError, read_yaml

# Idle keep-alive connections stay open this long (uvicorn's default is 5 s). A client whose pool
# keeps idle connections longer than the server reuses one just as the server closes it and
# gets "connection reset" on a request the server never saw; common pools keep them 5-60 s
# (httpx 5, aiohttp 15, nginx 60), the router's and bench client's less (CLIENT_KEEP_ALIVE_S).
SERVER_KEEP_ALIVE_S = 75

logger = logging.getLogger("disagg.server")


class StrList(list):
    """Option type marker: a list of strings (comma-separated on the command line)."""


@dataclass(frozen=True)
class _Opt:
    # int, float, bool, str, list (of ints: "3,1" on the command line) or StrList
    type: type
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


# Engine options: exactly config.ENGINE_OPTION_NAMES (a test keeps them in step).
ENGINE_OPTIONS: dict[str, _Opt] = {
    "tokens_per_block": _Opt(int, "tokens per KV cache block (default 32)", metavar="N"),
    "kv_cache_tokens": _Opt(int, "KV cache capacity in tokens", metavar="N"),
    "kv_cache_fraction": _Opt(float, "share of free device memory for the KV cache, in (0, 1]",
                              metavar="F"),
    "gpu_memory_fraction": _Opt(float, "CUDA: share of the GPU's total memory this worker may "
                                "use (weights + activations + KV cache), in (0, 1]; workers "
                                "sharing a GPU split it (default 0.9)", metavar="F"),
    "enforce_eager": _Opt(bool, "CUDA: run decode steps eagerly, without CUDA graphs "
                          "(default off)"),
    "cuda_graph_max_batch_size": _Opt(int, "CUDA: largest decode batch captured as a CUDA "
                                      "graph (default 256)", metavar="N"),
    "enable_prefix_caching": _Opt(bool, "reuse cached KV blocks of shared prompt prefixes "
                                  "(default on)"),
    "max_batch_size": _Opt(int, "requests per iteration (default 2048)", metavar="N"),
    "max_num_tokens": _Opt(int, "tokens per iteration (default 8192)", metavar="N"),
    "enable_chunked_context": _Opt(bool, "split long prompts over iterations (default on)"),
    "capacity_policy": _Opt(str, "KV admission policy (default guaranteed_no_evict)",
                            choices=tuple(p.value for p in CapacityPolicy)),
    "max_model_len": _Opt(int, "prompt + output token limit (default: the model's)",
                          metavar="N"),
    "max_queue": _Opt(int, "waiting requests beyond which new ones get 503 + Retry-After",
                      metavar="N"),
    "tensor_parallel_size": _Opt(int, "tensor parallel ranks (default 1)", metavar="N"),
    "pipeline_parallel_size": _Opt(int, "pipeline parallel stages (default 1)", metavar="N"),
    "pp_partition": _Opt(list, "layers per pipeline stage, e.g. 3,1 (default: even split)",
                         metavar="N,N,..."),
    "dtype": _Opt(str, "compute dtype (default: the checkpoint's)",
                  choices=("float32", "bfloat16", "float16")),
    "device": _Opt(str, "cpu or cuda[:N] (default: cuda when available)"),
    "seed": _Opt(int, "engine seed for unseeded sampling (default 0)"),
}

ROLES = ("aggregated", "context", "generation")
AVAILABLE_ROLES = ROLES
DISAGG_ROLES = ("context", "generation")


def check_role(role: str, world_size: int = 1) -> None:
    """A role this worker can take (any role works with any tp * pp = ``world_size``)."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size * pipeline_parallel_size: must be >= 1, got "
                         f"{world_size}")


SERVER_OPTIONS: dict[str, _Opt] = {
    "model": _Opt(str, "checkpoint folder (instead of the MODEL_DIR argument)"),
    "host": _Opt(str, "address to bind (default 127.0.0.1)"),
    "port": _Opt(int, "port to bind; 0 picks a free one (default 8000)"),
    "role": _Opt(str, "worker role (default aggregated); context / generation serve "
                 "disaggregated requests", choices=ROLES),
    "kv_transfer_backend": _Opt(str, "KV transfer backend of a context/generation worker "
                                "(default UCX; YAML: cache_transceiver_config.backend)",
                                choices=("UCX", "TCP", "ucx", "tcp")),
    "kv_transfer_host": _Opt(str, "address the context worker's KV transfer server binds and "
                             "advertises (default: --host)", metavar="HOST"),
    "cluster_token": _Opt(str, "shared secret of the cluster's members: the router signs its "
                          "calls with it, KV transfer peers prove they hold it (default: "
                          "$DISAGG_CLUSTER_TOKEN)", metavar="TOKEN"),
    "kv_peer_allowlist": _Opt(StrList, "context workers a generation worker may pull KV from "
                              "when a request is not signed by the cluster: IPs, CIDRs or host "
                              "names (YAML: a list)", metavar="NET,..."),
    "kv_lease_ttl": _Opt(float, "seconds a context worker keeps a request's KV for the "
                         "generation worker (default 30; YAML: kv_lease_ttl_s)", metavar="S"),
    "served_model_name": _Opt(str, "model name clients send (default: MODEL_DIR as given)",
                              metavar="NAME"),
    "api_key": _Opt(str, "require 'Authorization: Bearer KEY' on /v1/* (and, unless "
                    "--public-metrics, on /metrics)", metavar="KEY"),
    "public_metrics": _Opt(bool, "serve /metrics to anyone even when --api-key is set"),
    "drain_timeout": _Opt(float, "seconds in-flight requests get to finish on SIGTERM "
                          "(default 30)", metavar="S"),
    "router_url": _Opt(str, "register with this router (a disagg YAML with disagg_cluster) and "
                       "heartbeat; unregister on drain", metavar="URL"),
    "log_level": _Opt(str, "log level (default info)",
                      choices=("critical", "error", "warning", "info", "debug")),
    "benchmark_gen_only": _Opt(bool, "benchmarking aid of a generation worker: accept "
                               "generation_only requests without context params and decode as "
                               "if their prompt KV were in place (output text is meaningless)"),
}

SERVER_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1", "port": 8000, "role": "aggregated", "drain_timeout": 30.0,
    "log_level": "info",
}

# Keys of a disagg YAML server section that describe the cluster, not one worker.
_SECTION_ONLY_KEYS = ("num_instances", "urls", "router")


def _coerce(name: str, opt: _Opt, value: Any, where: str) -> Any:
    """Check a YAML value's type (YAML already parsed it); name the key and file on error."""
    if value is None:
        return None
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v),
        StrList: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    }[opt.type](value)
    if opt.type is list and not ok:
        raise ConfigError(f"{where}: {name}: expected a list of integers, got {value!r}")
    if opt.type is StrList and not ok:
        raise ConfigError(f"{where}: {name}: expected a list of strings, got {value!r}")
    if not ok:
        raise ConfigError(f"{where}: {name}: expected {opt.type.__name__}, got {value!r}")
    if opt.choices and value not in opt.choices:
        raise ConfigError(f"{where}: {name}: {value!r} is not one of {list(opt.choices)}")
    return float(value) if opt.type is float else value


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
        out[key] = _coerce(key, known[key], value, path)
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


def _add_option(p: Any, name: str, opt: _Opt) -> None:
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
            from disagg.disaggregation import DisaggSettings

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

    from disagg.server.http_guard import uvicorn_options

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
