"""The option schema, shared by ``disagg serve`` (``server/cli.py``) and the cluster YAML of
the router (``contracts/cluster.py``): ``Opt`` (an option's type, help, choices, default and
bounds), the worker's options (``ENGINE_OPTIONS``, ``SERVER_OPTIONS``: every ``disagg serve``
flag and worker YAML key comes from them), the roles, and ``coerce``, which checks one YAML
value against its ``Opt`` and names the key and the file on error. The cluster YAML's own keys
are ``Opt`` tables in ``contracts/cluster.py``, checked by the same ``coerce``.
Torch-free and server-free: importing it imports only ``disagg.config`` and
``disagg.contracts.roles``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg.config import CapacityPolicy, ConfigError, read_yaml
from disagg.contracts.roles import ROLES, Role


class StrList(list):
    """Option type marker: a list of strings (comma-separated on the command line)."""


@dataclass(frozen=True)
class Opt:
    """One option. ``default`` is what an absent or null key means where the schema decides it
    (the cluster YAML; a worker's defaults live in ``SERVER_DEFAULTS`` and the engine config).
    ``gt`` / ``ge``: bounds ``coerce`` checks for a number."""

    # int, float, bool, str, list (of ints: "3,1" on the command line) or StrList
    type: type
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default: Any = None
    gt: float | None = None
    ge: float | None = None


# Engine options: exactly config.ENGINE_OPTION_NAMES (a test keeps them in step).
ENGINE_OPTIONS: dict[str, Opt] = {
    "tokens_per_block": Opt(int, "tokens per KV cache block (default 32)", metavar="N"),
    "kv_cache_tokens": Opt(int, "KV cache capacity in tokens", metavar="N"),
    "kv_cache_fraction": Opt(float, "share of free device memory for the KV cache, in (0, 1]",
                              metavar="F"),
    "gpu_memory_fraction": Opt(float, "CUDA: share of the GPU's total memory this worker may "
                                "use (weights + activations + KV cache), in (0, 1]; workers "
                                "sharing a GPU split it (default 0.9)", metavar="F"),
    "enforce_eager": Opt(bool, "CUDA: run decode steps eagerly, without CUDA graphs "
                          "(default off)"),
    "cuda_graph_max_batch_size": Opt(int, "CUDA: largest decode batch captured as a CUDA "
                                      "graph (default 256)", metavar="N"),
    "enable_prefix_caching": Opt(bool, "reuse cached KV blocks of shared prompt prefixes "
                                  "(default on)"),
    "max_batch_size": Opt(int, "requests per iteration (default 2048)", metavar="N"),
    "max_num_tokens": Opt(int, "tokens per iteration (default 8192)", metavar="N"),
    "enable_chunked_context": Opt(bool, "split long prompts over iterations (default on)"),
    "capacity_policy": Opt(str, "KV admission policy (default guaranteed_no_evict)",
                            choices=tuple(p.value for p in CapacityPolicy)),
    "max_model_len": Opt(int, "prompt + output token limit (default: the model's)",
                          metavar="N"),
    "max_queue": Opt(int, "waiting requests beyond which new ones get 503 + Retry-After",
                      metavar="N"),
    "tensor_parallel_size": Opt(int, "tensor parallel ranks (default 1)", metavar="N"),
    "pipeline_parallel_size": Opt(int, "pipeline parallel stages (default 1)", metavar="N"),
    "pp_partition": Opt(list, "layers per pipeline stage, e.g. 3,1 (default: even split)",
                         metavar="N,N,..."),
    "dtype": Opt(str, "compute dtype (default: the checkpoint's)",
                  choices=("float32", "bfloat16", "float16")),
    "device": Opt(str, "cpu or cuda[:N] (default: cuda when available)"),
    "seed": Opt(int, "engine seed for unseeded sampling (default 0)"),
}

# The worker roles (roles.py's wire values); DISAGG_ROLES move KV and need a cluster token.
DISAGG_ROLES = tuple(r.value for r in Role if r.disaggregated)


def check_role(role: str, world_size: int = 1) -> None:
    """A role this worker can take (any role works with any tp * pp = ``world_size``)."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size * pipeline_parallel_size: must be >= 1, got "
                         f"{world_size}")


# /v1/responses kept for previous_response_id (a worker's own, or the router's: the workers
# behind a router see chat requests only).
RESPONSES_STORE_SIZE = 1024
RESPONSES_STORE_TTL_S = 3600.0

SERVER_OPTIONS: dict[str, Opt] = {
    "model": Opt(str, "checkpoint folder (instead of the MODEL_DIR argument)"),
    "host": Opt(str, "address to bind (default 127.0.0.1)"),
    "port": Opt(int, "port to bind; 0 picks a free one (default 8000)"),
    "role": Opt(str, "worker role (default aggregated); context / generation serve "
                 "disaggregated requests", choices=ROLES),
    "kv_transfer_backend": Opt(str, "KV transfer backend of a context/generation worker "
                                "(default: UCX when ucxx imports, else TCP; YAML: "
                                "cache_transceiver_config.backend)",
                                choices=("UCX", "TCP", "ucx", "tcp")),
    "kv_transfer_host": Opt(str, "address the context worker's KV transfer server binds and "
                             "advertises (default: --host)", metavar="HOST"),
    "advertise_host": Opt(str, "address or name peers on other hosts use for this worker: the "
                           "HTTP url it registers with --router-url and its KV transfer "
                           "address (default: the bound address; for a wildcard bind, this "
                           "host's address on the route to the router, else its first "
                           "non-loopback one)", metavar="HOST"),
    "cluster_token": Opt(str, "shared secret of the cluster's members: the router signs its "
                          "calls with it, KV transfer peers prove they hold it (default: "
                          "$DISAGG_CLUSTER_TOKEN)", metavar="TOKEN"),
    "kv_peer_allowlist": Opt(StrList, "context workers a generation worker may pull KV from "
                              "when a request is not signed by the cluster: IPs, CIDRs or host "
                              "names (YAML: a list)", metavar="NET,..."),
    "kv_lease_ttl": Opt(float, "seconds a context worker keeps a request's KV for the "
                         "generation worker (default 30; YAML: kv_lease_ttl_s)", metavar="S"),
    "served_model_name": Opt(str, "model name clients send (default: MODEL_DIR as given)",
                              metavar="NAME"),
    "api_key": Opt(str, "require 'Authorization: Bearer KEY' on /v1/* (and, unless "
                    "--public-metrics, on /metrics) (default: $DISAGG_API_KEY)",
                    metavar="KEY"),
    "public_metrics": Opt(bool, "serve /metrics to anyone even when --api-key is set"),
    "drain_timeout": Opt(float, "seconds in-flight requests get to finish on SIGTERM "
                          "(default 30)", metavar="S"),
    "router_url": Opt(str, "register with this router (a disagg YAML with disagg_cluster) and "
                       "heartbeat; unregister on drain", metavar="URL"),
    "log_level": Opt(str, "log level (default info)",
                      choices=("critical", "error", "warning", "info", "debug")),
    "tool_call_parser": Opt(str, "how tool calls are read from the model's text for "
                             "tool_choice auto (the model family's format); without it such "
                             "requests get 400", choices=("hermes", "llama3_json", "mistral")),
    "chat_template": Opt(str, "chat template replacing the checkpoint's: a file, or the "
                          "template itself (Jinja text); checked at start-up",
                          metavar="FILE|TEMPLATE"),
    "allowed_origins": Opt(StrList, "CORS: browser origins (scheme://host[:port]) that may "
                            "call this worker, or * for any; default none (no CORS headers; "
                            "YAML: a list)", metavar="ORIGIN,..."),
    "responses_store_size": Opt(int, "responses kept for previous_response_id and GET "
                                 f"/v1/responses/{{id}} (the oldest dropped first; 0: none; "
                                 f"default {RESPONSES_STORE_SIZE})", metavar="N", ge=0),
    "responses_store_ttl": Opt(float, "seconds a stored response is kept (default "
                                f"{RESPONSES_STORE_TTL_S:g})", metavar="S", gt=0),
    "benchmark_gen_only": Opt(bool, "benchmarking aid of a generation worker: accept "
                               "generation_only requests without context params and decode as "
                               "if their prompt KV were in place (output text is meaningless)"),
}

# Worker YAML keys spelled otherwise than their option: YAML key -> option name.
YAML_RENAMES = {"kv_lease_ttl_s": "kv_lease_ttl"}
# trtllm-serve's mapping {backend: UCX | TCP, ucx_profile: same_host | cross_host} in a worker
# YAML: it sets kv_transfer_backend and the UCX profile (which has no flag).
TRANSCEIVER_KEY = "cache_transceiver_config"


def worker_yaml_keys() -> dict[str, Opt | None]:
    """The keys of a worker's YAML as the cluster YAML takes them -> their ``Opt`` (None for
    ``cache_transceiver_config``, a mapping: ``check_transceiver``)."""
    keys: dict[str, Opt | None] = {**SERVER_OPTIONS, **ENGINE_OPTIONS}
    for yaml_key, name in YAML_RENAMES.items():
        keys[yaml_key] = keys.pop(name)
    keys[TRANSCEIVER_KEY] = None
    return keys


BACKEND_NAMES = ("ucx", "tcp")
# auto: cross_host when the worker's advertised KV address is not loopback, else same_host
# (``ucx.resolve_ucx_profile``); without an address (a bare ``make_backend``): same_host.
UCX_PROFILE_NAMES = ("auto", "same_host", "cross_host")


@dataclass(frozen=True)
class CacheTransceiverConfig:
    """The ``cache_transceiver_config`` section of a worker config:
    ``{backend: UCX | TCP, ucx_profile: auto | same_host | cross_host}`` (the backend
    case-insensitive)."""

    backend: str = "UCX"
    ucx_profile: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or self.backend.lower() not in BACKEND_NAMES:
            raise ValueError(f"cache_transceiver_config.backend must be UCX or TCP, "
                             f"got {self.backend!r}")
        object.__setattr__(self, "backend", self.backend.upper())
        if self.ucx_profile not in UCX_PROFILE_NAMES:
            raise ValueError(f"cache_transceiver_config.ucx_profile must be one of "
                             f"{list(UCX_PROFILE_NAMES)}, got {self.ucx_profile!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> CacheTransceiverConfig:
        d = dict(d or {})
        unknown = set(d) - {"backend", "ucx_profile"}
        if unknown:
            raise ValueError(f"cache_transceiver_config: unknown keys {sorted(unknown)}")
        return cls(**d)


def check_transceiver(name: str, value: Any, where: str,
                      error: type[ConfigError] = ConfigError) -> Any:
    """``value`` as a ``CacheTransceiverConfig`` (None: the defaults); ``error`` names the file
    and the key."""
    if value is not None and not isinstance(value, Mapping):
        raise error(f"{where}: {name}: expected a mapping {{backend: UCX | TCP, ucx_profile: "
                    f"...}}")
    try:
        return CacheTransceiverConfig.from_dict(value)
    except (TypeError, ValueError) as e:
        raise error(f"{where}: {name}: {e}") from None


_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+")


def check_origins(values: Any, name: str = "allowed_origins") -> tuple[str, ...]:
    """CORS origins as configured (a list; ``*`` for any) -> the tuple the servers compare
    a request's ``Origin`` with; ValueError naming ``name`` for one that no browser sends
    (a path, a trailing slash, no scheme)."""
    if values is None:
        return ()
    if isinstance(values, str) or not isinstance(values, list | tuple):
        raise ValueError(f"{name}: expected a list of origins, got {values!r}")
    out = []
    for v in values:
        if not isinstance(v, str) or not (v == "*" or _ORIGIN.fullmatch(v)):
            raise ValueError(f"{name}: {v!r} is not an origin: scheme://host[:port] (no path, "
                             f"no trailing slash), or * for any")
        out.append(v)
    return tuple(dict.fromkeys(out))


SERVER_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1", "port": 8000, "role": "aggregated", "drain_timeout": 30.0,
    "log_level": "info",
}

def coerce(name: str, opt: Opt, value: Any, where: str,
           error: type[ConfigError] = ConfigError) -> Any:
    """Check a YAML value's type, choices and bounds (YAML already parsed it); ``error``
    (a ``ConfigError``) names the file and the key. None stays None."""
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
        raise error(f"{where}: {name}: expected a list of integers, got {value!r}")
    if opt.type is StrList and not ok:
        raise error(f"{where}: {name}: expected a list of strings, got {value!r}")
    if not ok:
        raise error(f"{where}: {name}: expected {opt.type.__name__}, got {value!r}")
    if opt.choices and value not in opt.choices:
        raise error(f"{where}: {name}: {value!r} is not one of {list(opt.choices)}")
    if opt.type is float:
        value = float(value)
    if opt.gt is not None and not value > opt.gt:
        raise error(f"{where}: {name}: must be > {opt.gt:g}, got {value}")
    if opt.ge is not None and not value >= opt.ge:
        raise error(f"{where}: {name}: must be >= {opt.ge:g}, got {value}")
    return value


# Keys of a disagg YAML server section that describe the cluster, not one worker.
_SECTION_ONLY_KEYS = ("num_instances", "urls", "router")


def load_worker_yaml(path: str) -> dict[str, Any]:
    """Options from a worker YAML; unknown keys and wrong types are errors naming both."""
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    # A worker file also takes each option under its own name (kv_lease_ttl as well as the
    # cluster YAML's kv_lease_ttl_s).
    known = {**SERVER_OPTIONS, **ENGINE_OPTIONS}
    out: dict[str, Any] = {}
    data = dict(data)
    if TRANSCEIVER_KEY in data:
        raw_ctc = data.pop(TRANSCEIVER_KEY)
        ctc = check_transceiver(TRANSCEIVER_KEY, raw_ctc, path)
        if isinstance(raw_ctc, dict) and raw_ctc.get("backend") is not None:
            # Only a backend written down is a choice; without one the worker picks the
            # default (UCX when ucxx imports, else TCP) when it starts.
            out["kv_transfer_backend"] = ctc.backend
        out["ucx_profile"] = ctc.ucx_profile
    for yaml_key, name in YAML_RENAMES.items():
        if yaml_key in data:
            data[name] = data.pop(yaml_key)
    for key, value in data.items():
        if key not in known:
            hint = (" (a cluster key of the disagg YAML; a worker file holds only worker "
                    "options)" if key in _SECTION_ONLY_KEYS else "")
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known keys: "
                              f"{', '.join(sorted(known))}")
        out[key] = coerce(key, known[key], value, path)
    return out
