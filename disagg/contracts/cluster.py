"""The disagg cluster YAML, validated on load (torch-free). Its shape follows trtllm-serve's
disaggregated YAML, so a file written for one serves the other (``disagg_cluster`` is the newer
form for workers that register themselves and heartbeat instead of being listed in ``urls``).

Shape::

    hostname: localhost           # where the router listens
    port: 8000
    max_retries: 1                # per side: another context / generation server after a failure
    max_migrations: 3             # a request whose generation worker failed mid-answer goes on
                                  # on another one (router.flow: migration), at most this often
    api_key: KEY                  # optional: clients send "Authorization: Bearer KEY" (or env
                                  # DISAGG_API_KEY)
    public_metrics: false         # true: the router's /metrics is open even with api_key
    health_check_interval_sec: 2  # router's /health polling of every worker
    upstream_timeout_sec: 300     # longest wait for the next byte from a worker
    processes: 1                  # router processes sharing the port (one a core; SO_REUSEPORT)
    restart: no                   # disagg launch: on-failure starts a dead worker again
    kv_streaming: false           # true: context and generation calls at once, KV streamed by layer
    allowed_origins: [http://localhost:3000]  # CORS: browser origins ("*": any); default none
    otlp_traces_endpoint: http://localhost:4318/v1/traces  # the router's traces (disagg.tracing;
                                  # a section's key: its workers'); default off (or OTEL_*)
    model: /path/to/checkpoint    # any worker key at the top level is inherited by both sections
    context_servers:              # optional: without it the cluster is aggregated
      num_instances: 2            # must equal len(urls)
      urls: ["localhost:8001", "localhost:8002"]
      router: {type: round_robin} # round_robin | load_balancing | kv_cache_aware (+ options)
      tensor_parallel_size: 2     # any worker key (the `disagg serve` YAML keys)
    generation_servers: {...}     # required unless disagg_cluster is set
    conditional_disagg_config: {max_local_prefill_length: 256}
    disagg_cluster: {cluster_uri, minimal_instances: {context_servers, generation_servers},
                     heartbeat_interval_sec: 5, inactive_timeout_sec: 10}
    planner: {ttft_slo_ms: 500, tpot_slo_ms: 50, enabled: false, ...}  # see router.planner

Worker keys are the keys of a ``disagg serve --config`` worker YAML (``WorkerOptions``' fields,
with ``cache_transceiver_config`` for the KV transfer backend and UCX profile; the lease TTL is
``kv_lease_ttl_s``), except ``host``, ``port`` and ``role``, which the cluster decides (from
``urls`` and the section). ``model`` is the
checkpoint folder: the worker's ``MODEL_DIR`` argument (and the router's tokenizer for the
policies that need token ids). A top-level worker key is inherited by both sections; a section
that sets the same key to another value is an error (say it in the sections instead).

Every error is a ``RouterConfigError`` whose message starts with ``FILE: dotted.key:``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from disagg.config import ConfigError, read_yaml
from disagg.contracts.options import (
    RESPONSES_STORE_SIZE,
    RESPONSES_STORE_TTL_S,
    TRANSCEIVER_KEY,
    Opt,
    StrList,
    WorkerOptions,
    check_origins,
    check_otlp_endpoint,
    check_transceiver,
    coerce,
    options_from_yaml,
    worker_yaml_keys,
)
from disagg.contracts.planner_config import PlannerConfig, PlannerConfigError, RateMatchPrior
from disagg.contracts.roles import Role

MAX_PROCESSES = 256  # router processes (``processes``)
POLICY_TYPES = ("round_robin", "load_balancing", "kv_cache_aware")
RESTART_POLICIES = ("no", "on-failure")  # ``restart`` (disagg launch)
SECTIONS = ("context_servers", "generation_servers")
ROLE_OF_SECTION = {"context_servers": Role.CONTEXT, "generation_servers": Role.GENERATION}

# The cluster's own keys, in the option schema of contracts/options.py (the worker keys of the
# sections are WorkerOptions' fields: ``worker_yaml_keys``). The sections and the two nested
# mappings are checked by hand below: their shape is not one value.
CLUSTER_OPTIONS: dict[str, Opt] = {
    "hostname": Opt(str, "where the router listens", default="localhost"),
    "port": Opt(int, "the router's port; 0 picks a free one", default=8000),
    "max_retries": Opt(int, "per side: another context / generation server after a failure",
                       default=1, ge=0),
    "max_migrations": Opt(int, "per request: times a request whose generation worker failed "
                          "after taking it goes on on another worker (0: never)",
                          default=3, ge=0),
    "api_key": Opt(str, "clients of the router send 'Authorization: Bearer KEY'"),
    "public_metrics": Opt(bool, "the router's /metrics is open even with api_key",
                          default=False),
    "health_check_interval_sec": Opt(float, "the router's /health polling of every worker",
                                     default=2.0, gt=0),
    "upstream_timeout_sec": Opt(float, "longest wait for the next byte from a worker",
                                default=300.0, gt=0),
    "processes": Opt(int, "router processes sharing its port (SO_REUSEPORT); one a core",
                     default=1, ge=1),
    # Read by disagg launch only (Kubernetes restarts pods itself; the router ignores it).
    "restart": Opt(str, "disagg launch: a worker that dies after start-up stops the cluster "
                   "(no) or is started again with backoff (on-failure)",
                   choices=RESTART_POLICIES, default="no"),
    "kv_streaming": Opt(bool, "send a disaggregated request's context and generation calls at "
                        "once; the generation worker streams the prompt's KV layer by layer "
                        "(router.stream_flow)", default=False),
    "allowed_origins": Opt(StrList, "CORS: browser origins (scheme://host[:port], or *) the "
                           "router answers with CORS headers; default none (disagg.cors)"),
    # /v1/responses kept by the router for previous_response_id (the workers keep none: they
    # serve the router's chat requests).
    "responses_store_size": Opt(int, "responses kept for previous_response_id and GET "
                                "/v1/responses/{id} (the oldest dropped first; 0: none)",
                                default=RESPONSES_STORE_SIZE, ge=0),
    "responses_store_ttl": Opt(float, "seconds a stored response is kept",
                               default=RESPONSES_STORE_TTL_S, gt=0),
    # The router's traces; a section's otlp_traces_endpoint is its workers' (a worker key).
    "otlp_traces_endpoint": Opt(str, "OTLP/HTTP receiver of the router's request traces "
                                "(disagg.tracing; default: the OTEL_* variables, else off)"),
}
SECTION_OPTIONS: dict[str, Opt] = {
    "num_instances": Opt(int, "workers in the section; must equal len(urls)", ge=0),
}
CONDITIONAL_OPTIONS: dict[str, Opt] = {
    "max_local_prefill_length": Opt(
        int, "prefill on the generation worker (no context server) when it holds the "
        "prompt's prefix and at most this many prompt tokens are not cached there", ge=0),
}
DISAGG_CLUSTER_OPTIONS: dict[str, Opt] = {
    "cluster_uri": Opt(str, "the router's http:// address workers register with"),
    "heartbeat_interval_sec": Opt(float, "seconds between a worker's heartbeats", default=5.0,
                                  gt=0),
    "inactive_timeout_sec": Opt(float, "seconds without a heartbeat before a worker is "
                                       "dropped", default=10.0, gt=0),
}
# disagg_cluster.minimal_instances: {context_servers: N, generation_servers: N}
MINIMAL_INSTANCES = Opt(int, "workers of the section the router waits for", default=0, ge=0)

# Options each policy takes (besides ``type``).
_COMMON_POLICY_OPTIONS: dict[str, Opt] = {
    "kv_events_poll_interval_sec": Opt(
        float, "how often the router polls each worker's GET /kv_events (when it keeps a KV "
        "index)", default=0.1, gt=0),
    "tokenizer": Opt(str, "checkpoint folder whose tokenizer the router uses (default: the "
                          "section's model)"),
}
_USE_TOKENS = Opt(bool, "count load in active prompt tokens instead of requests",
                  default=False)
POLICY_OPTIONS: dict[str, dict[str, Opt]] = {
    "round_robin": dict(_COMMON_POLICY_OPTIONS),
    "load_balancing": {"use_tokens": _USE_TOKENS, **_COMMON_POLICY_OPTIONS},
    "kv_cache_aware": {
        "use_tokens": _USE_TOKENS,
        "match_weight": Opt(float, "score per matched block", default=1.0, ge=0),
        "load_weight": Opt(float, "score per active request (or per block of active tokens)",
                           default=0.25, ge=0),
        # KV prefix reuse across workers (router.policies, router.flow: kv_prefix).
        "peer_reuse": Opt(bool, "credit a candidate with a longer prefix cached on a peer "
                          "that advertises kv_peer_reuse; the chosen worker pulls it",
                          default=False),
        "peer_weight": Opt(float, "what a block a peer holds counts, of a block the candidate "
                           "holds itself (0..1: the transfer's cost)", default=0.5, ge=0),
        "peer_min_tokens": Opt(int, "the smallest advantage, in prompt tokens, of a peer's "
                               "prefix worth a pull", default=64, ge=1),
        "peer_tier_weight": Opt(float, "what a block a peer holds only in an offload tier "
                                "counts (0..1: copied back into its KV cache, then "
                                "transferred)", default=0.25, ge=0),
        **_COMMON_POLICY_OPTIONS,
    },
}
# Upper bounds of policy options (``Opt`` has lower ones only).
_POLICY_MAX: dict[str, float] = {"peer_weight": 1.0, "peer_tier_weight": 1.0}

# planner: (``disagg.router.planner.PlannerConfig`` checks the values' ranges)
PLANNER_OPTIONS: dict[str, Opt] = {
    "enabled": Opt(bool, "run the planner (also: disagg router --planner)", default=False),
    "ttft_slo_ms": Opt(float, "the context side's SLO: p<percentile> context-call latency"),
    "tpot_slo_ms": Opt(float, "the generation side's SLO: p<percentile> time per output token"),
    "interval_s": Opt(float, "seconds between decisions", default=10.0),
    "min_per_role": Opt(int, "never fewer workers on a side", default=1),
    "hysteresis_s": Opt(float, "no flip within this long of the previous flip", default=60.0),
    "window_s": Opt(float, "seconds of samples a decision reads", default=60.0),
    "min_samples": Opt(int, "samples per side in the window before deciding", default=20),
    "percentile": Opt(float, "latency percentile compared with the SLOs", default=90.0),
    "headroom": Opt(float, "spare capacity the side losing a worker must keep", default=0.2),
    "switch_timeout_s": Opt(float, "a role switch not done by then is abandoned",
                            default=120.0),
    "rate_match_json": Opt(str, "a saved `disagg bench rate-match` JSON: the capacity prior"),
}

# Keys of the cluster file that are not worker options.
_TOP_KEYS = (*CLUSTER_OPTIONS, *SECTIONS, "conditional_disagg_config", "disagg_cluster",
             "planner")
_SECTION_KEYS = (*SECTION_OPTIONS, "urls", "router")
# Worker options the cluster sets itself: a worker's address comes from urls, its role from
# the section it is in.
_CLUSTER_SET = {"host": "urls", "port": "urls", "role": "the section"}


class RouterConfigError(ConfigError):
    """An invalid cluster YAML; the message names the file and the (dotted) key."""


@dataclass(frozen=True)
class PolicyConfig:
    type: str  # round_robin | load_balancing | kv_cache_aware
    use_tokens: bool = False
    # Every other key of the `router:` mapping as given; option() fills in the defaults.
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        # A config built in code is checked as a YAML one is (the YAML's already was, with
        # its file and section in the message).
        if self.type in POLICY_OPTIONS:
            for name, value in self.options.items():
                policy_option(self.type, name, value, f"router.{name}", "router config")

    def option(self, name: str) -> Any:
        if name in self.options:
            return self.options[name]
        opt = POLICY_OPTIONS.get(self.type, {}).get(name)
        return None if opt is None else opt.default


@dataclass(frozen=True)
class ServerGroupConfig:
    role: Role  # context | generation
    num_instances: int
    urls: tuple[str, ...]  # "host:port", normalized (no scheme)
    router: PolicyConfig
    # Inherited top-level worker keys merged with the section's own (e.g. model, tp size), as
    # the YAML spells them (a worker YAML of the section's workers).
    worker_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def options(self, **values: Any) -> WorkerOptions:
        """``worker_options`` as the workers' ``WorkerOptions`` (every default filled in),
        ``values`` (e.g. the role) set on top."""
        return WorkerOptions(**{**options_from_yaml(self.worker_options, "worker_options",
                                                    RouterConfigError), **values})


@dataclass(frozen=True)
class ConditionalDisaggConfig:
    # Prefill on the generation worker (no context server) when it holds the prompt's prefix
    # and at most this many prompt tokens are not cached there.
    max_local_prefill_length: int


@dataclass(frozen=True)
class DisaggClusterConfig:
    cluster_uri: str | None
    minimal_instances: Mapping[str, int]  # context_servers / generation_servers -> count
    heartbeat_interval_sec: float = 5.0
    inactive_timeout_sec: float = 10.0


@dataclass(frozen=True)
class ClusterConfig:
    hostname: str
    port: int
    max_retries: int
    context_servers: ServerGroupConfig | None
    generation_servers: ServerGroupConfig | None  # None only with disagg_cluster
    conditional_disagg: ConditionalDisaggConfig | None
    disagg_cluster: DisaggClusterConfig | None
    api_key: str | None
    source: str  # the file it came from (for messages)
    health_check_interval_sec: float = 2.0
    upstream_timeout_sec: float = 300.0
    # The router's /metrics without the API key (the workers' is a section key, like api_key).
    public_metrics: bool = False
    planner: PlannerConfig | None = None  # the planner: section (run when enabled)
    processes: int = 1  # router processes sharing the port (router/processes.py)
    restart: str = "no"  # disagg launch: no | on-failure (a dead worker is started again)
    kv_streaming: bool = False  # both calls at once, KV streamed by layer (stream_flow)
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); () no CORS (disagg.cors)
    responses_store_size: int = RESPONSES_STORE_SIZE  # /v1/responses kept (router/responses)
    responses_store_ttl: float = RESPONSES_STORE_TTL_S
    max_migrations: int = 3  # per request: generation worker failures survived (router.flow)
    otlp_traces_endpoint: str | None = None  # the router's traces (disagg.tracing); None: OTEL_*

    @property
    def aggregated(self) -> bool:
        """No context servers: requests go whole to the generation servers (aggregated
        workers). With ``disagg_cluster``, context workers may still register later."""
        return self.context_servers is None

    def group(self, role: Role | str) -> ServerGroupConfig | None:
        return self.context_servers if role == Role.CONTEXT else self.generation_servers


# ---- loading --------------------------------------------------------------------------------


def load_cluster_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate a cluster YAML; ``RouterConfigError`` names the file and key."""
    source = os.fspath(path)
    return parse_cluster_config(read_yaml(source, RouterConfigError), source)


def parse_cluster_config(data: Mapping[str, Any] | Any, source: str = "<config>"
                         ) -> ClusterConfig:
    """Validate an already parsed cluster YAML (``source`` names it in messages)."""
    err = _Errors(source)
    if not isinstance(data, Mapping):
        raise err("", f"expected a mapping of cluster keys, got {type(data).__name__}")
    worker_keys = worker_yaml_keys()
    inherited: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise err("", f"keys must be strings, got {key!r}")
        if key in _TOP_KEYS:
            continue
        inherited[key] = _worker_value(err, key, key, value, worker_keys, top=True)

    if data.get("restart") is False:  # YAML reads a bare `restart: no` as false
        data = {**data, "restart": "no"}
    top = {key: _get(err, data, key, opt) for key, opt in CLUSTER_OPTIONS.items()}
    if top["processes"] > MAX_PROCESSES:
        raise err("processes", f"{top['processes']}: at most {MAX_PROCESSES}")
    if not 0 <= top["port"] <= 65535:
        raise err("port", f"{top['port']} is not a port number (0..65535; 0 picks a free one)")
    try:
        origins = check_origins(top["allowed_origins"])
    except ValueError as e:
        raise err("allowed_origins", str(e).partition(": ")[2]) from None
    if top["otlp_traces_endpoint"] is not None:
        try:
            check_otlp_endpoint(top["otlp_traces_endpoint"])
        except ValueError as e:
            raise err("otlp_traces_endpoint", str(e).partition(": ")[2]) from None

    cluster = None
    if data.get("disagg_cluster") is not None:
        cluster = _parse_cluster(err, data["disagg_cluster"])
    groups: dict[str, ServerGroupConfig | None] = {}
    for section in SECTIONS:
        raw = data.get(section)
        if raw is None:
            groups[section] = None
            continue
        groups[section] = _parse_group(err, section, raw, inherited, worker_keys,
                                       dynamic=cluster is not None)
    if groups["generation_servers"] is None and cluster is None:
        raise err("generation_servers", "missing: a cluster needs generation servers (or "
                  "aggregated workers listed there), unless disagg_cluster lets them register")
    seen: dict[str, str] = {}
    for section in SECTIONS:
        group = groups[section]
        for i, url in enumerate(group.urls if group else ()):
            if url in seen:
                raise err(f"{section}.urls[{i}]", f"{url} is also listed in {seen[url]}")
            seen[url] = section

    if top["kv_streaming"] and groups["context_servers"] is None and cluster is None:
        raise err("kv_streaming", "streams KV from context to generation workers: add "
                  "context_servers (or disagg_cluster)")

    conditional = None
    if data.get("conditional_disagg_config") is not None:
        conditional = _parse_conditional(err, data["conditional_disagg_config"])

    planner = None
    if data.get("planner") is not None:
        if groups["context_servers"] is None and cluster is None:
            raise err("planner", "plans the context and generation pools of a disaggregated "
                      "cluster: add context_servers (or disagg_cluster)")
        planner = parse_planner(err, data["planner"])

    return ClusterConfig(
        hostname=top["hostname"], port=top["port"], max_retries=top["max_retries"],
        allowed_origins=origins,
        context_servers=groups["context_servers"],
        generation_servers=groups["generation_servers"],
        conditional_disagg=conditional, disagg_cluster=cluster, api_key=top["api_key"],
        source=source, health_check_interval_sec=top["health_check_interval_sec"],
        upstream_timeout_sec=top["upstream_timeout_sec"], public_metrics=top["public_metrics"],
        planner=planner, processes=top["processes"], kv_streaming=top["kv_streaming"],
        restart=top["restart"],
        responses_store_size=top["responses_store_size"],
        responses_store_ttl=top["responses_store_ttl"], max_migrations=top["max_migrations"],
        otlp_traces_endpoint=top["otlp_traces_endpoint"])


def parse_planner(err: _Errors, raw: Any) -> PlannerConfig:
    """The ``planner:`` section; errors name ``planner.<field>``."""
    key = "planner"
    if not isinstance(raw, Mapping):
        raise err(key, "expected a mapping like {ttft_slo_ms: 500, tpot_slo_ms: 50}")
    _no_unknown(err, key, raw, tuple(PLANNER_OPTIONS))
    values = {name: _get(err, raw, name, opt, f"{key}.") for name, opt in
              PLANNER_OPTIONS.items()}
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        if values[name] is None:
            raise err(f"{key}.{name}", "missing (the planner needs both SLOs)")
    path = values["rate_match_json"]
    try:
        prior = None
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    result = json.load(f)
            except (OSError, ValueError) as e:
                raise PlannerConfigError(f"rate_match_json: cannot read {path}: {e}") from None
            if not isinstance(result, Mapping):
                raise PlannerConfigError(f"rate_match_json: {path} is not a JSON object")
            prior = RateMatchPrior.from_result(result)
        return PlannerConfig(**values, prior=prior)
    except PlannerConfigError as e:
        raise err(f"{key}.{str(e).partition(':')[0]}", str(e).partition(": ")[2]) from None


def _parse_conditional(err: _Errors, raw: Any) -> ConditionalDisaggConfig:
    key = "conditional_disagg_config"
    if not isinstance(raw, Mapping):
        raise err(key, "expected a mapping")
    _no_unknown(err, key, raw, tuple(CONDITIONAL_OPTIONS))
    if raw.get("max_local_prefill_length") is None:
        raise err(f"{key}.max_local_prefill_length", "missing")
    return ConditionalDisaggConfig(_get(err, raw, "max_local_prefill_length",
                                        CONDITIONAL_OPTIONS["max_local_prefill_length"],
                                        f"{key}."))


class _Errors:
    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, key: str, message: str) -> RouterConfigError:
        return RouterConfigError(f"{self.source}: {key}: {message}" if key
                                 else f"{self.source}: {message}")


def _get(err: _Errors, data: Mapping[str, Any], key: str, opt: Opt, prefix: str = "") -> Any:
    """``data[key]`` checked against ``opt`` (``prefix + key`` names it); its default when
    absent or null."""
    value = coerce(prefix + key, opt, data.get(key), err.source, RouterConfigError)
    return opt.default if value is None else value


def _no_unknown(err: _Errors, where: str, data: Mapping[str, Any], known: tuple[str, ...]
                ) -> None:
    for key in data:
        if key not in known:
            raise err(f"{where}.{key}", f"unknown key; known keys: {', '.join(known)}")


def _worker_value(err: _Errors, key: str, name: str, value: Any, worker_keys: dict[str, Any],
                  top: bool) -> Any:
    """Check one worker option (``name`` is its dotted path in messages)."""
    if key in _CLUSTER_SET:
        raise err(name, f"set by the cluster (from {_CLUSTER_SET[key]}), not a worker key here")
    if key not in worker_keys:
        extra = ", ".join(_TOP_KEYS if top else _SECTION_KEYS)
        raise err(name, f"unknown key (neither a cluster key: {extra}; nor a worker key: "
                        f"{', '.join(sorted(k for k in worker_keys if k not in _CLUSTER_SET))})")
    if value is None:
        return None
    if key == TRANSCEIVER_KEY:
        check_transceiver(name, value, err.source, RouterConfigError)
        return dict(value)
    value = coerce(name, worker_keys[key], value, err.source, RouterConfigError)
    if key == "allowed_origins":  # the worker's own, checked as the worker will
        try:
            check_origins(value)
        except ValueError as e:
            raise err(name, str(e).partition(": ")[2]) from None
    if key == "otlp_traces_endpoint":  # (the workers', checked as they will)
        try:
            check_otlp_endpoint(value)
        except ValueError as e:
            raise err(name, str(e).partition(": ")[2]) from None
    return value


def _normalize_url(err: _Errors, key: str, url: Any) -> str:
    try:
        return normalize_worker_url(url)
    except ValueError as e:
        raise err(key, str(e)) from None


# A host name (RFC 1123 labels; "_" too, as container names have it) or an IPv4 address.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")


def normalize_worker_url(url: Any) -> str:
    """``http://host:port[/]`` or ``host:port`` -> ``host:port``; ValueError saying why not
    (a worker's address from the config or from a registration: it becomes the base of every
    call to the worker, so nothing but a host and a port)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"expected 'host:port', got {url!r}")
    text = url.strip()
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme.lower() != "http":
            raise ValueError(f"{url!r}: only http:// workers are supported")
    text = text.rstrip("/")
    if "/" in text:
        raise ValueError(f"{url!r}: expected 'host:port' (no path)")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"{url!r} is not 'host:port'")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{url!r}: write an IPv6 host in brackets, [::1]:8000")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{url!r}: {host} is not an IPv6 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{url!r}: {host!r} is not a host name or IP address")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{url!r}: port {port} is out of range 1..65535")
    return f"{host}:{int(port)}"


def _parse_policy(err: _Errors, key: str, raw: Any) -> PolicyConfig:
    if raw is None:
        return PolicyConfig("round_robin", options=MappingProxyType({}))
    if not isinstance(raw, Mapping):
        raise err(key, f"expected a mapping like {{type: round_robin}}, got {raw!r}")
    kind = raw.get("type", "round_robin")
    if kind not in POLICY_TYPES:
        raise err(f"{key}.type", f"unknown router type {kind!r}; one of {list(POLICY_TYPES)}")
    options: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "type":
            continue
        if value is not None or name not in POLICY_OPTIONS[kind]:
            options[name] = policy_option(kind, name, value, f"{key}.{name}", err.source)
    use_tokens = bool(options.pop("use_tokens", False))
    return PolicyConfig(kind, use_tokens, MappingProxyType(options))


def policy_option(kind: str, name: str, value: Any, key: str, source: str) -> Any:
    """A ``kind`` router's option ``name`` checked (known, type, bounds) and coerced;
    ``RouterConfigError`` ``"SOURCE: KEY: what"`` otherwise."""
    known = POLICY_OPTIONS[kind]
    if name not in known:
        raise RouterConfigError(f"{source}: {key}: unknown option of the {kind} router; "
                                f"known: {', '.join(['type', *known])}")
    value = coerce(key, known[name], value, source, RouterConfigError)
    top = _POLICY_MAX.get(name)
    if value is not None and top is not None and value > top:
        raise RouterConfigError(f"{source}: {key}: must be <= {top:g}, got {value}")
    return value


def _parse_group(err: _Errors, section: str, raw: Any, inherited: Mapping[str, Any],
                 worker_keys: dict[str, Any], dynamic: bool) -> ServerGroupConfig:
    if not isinstance(raw, Mapping):
        raise err(section, f"expected a mapping, got {type(raw).__name__}")
    own: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SECTION_KEYS:
            continue
        own[key] = _worker_value(err, key, f"{section}.{key}", value, worker_keys, top=False)
    for key, value in own.items():
        if key in inherited and inherited[key] != value:
            raise err(f"{section}.{key}", f"{value!r} conflicts with the top-level value "
                      f"{inherited[key]!r} (top-level keys are inherited by both sections; "
                      f"set it in each section instead)")
    urls_raw = raw.get("urls")
    if urls_raw is None:
        if not dynamic:
            raise err(f"{section}.urls", "missing (a list of 'host:port'; only a cluster with "
                      "disagg_cluster may leave it out and let workers register)")
        urls_raw = []
    if isinstance(urls_raw, str) or not isinstance(urls_raw, list):
        raise err(f"{section}.urls", f"expected a list of 'host:port', got {urls_raw!r}")
    urls = tuple(_normalize_url(err, f"{section}.urls[{i}]", u) for i, u in enumerate(urls_raw))
    for i, u in enumerate(urls):
        if u in urls[:i]:
            raise err(f"{section}.urls[{i}]", f"{u} is listed twice")
    num = _get(err, raw, "num_instances", SECTION_OPTIONS["num_instances"], f"{section}.")
    if num is None:
        num = len(urls)
    if urls or not dynamic:
        if num != len(urls):
            raise err(f"{section}.num_instances", f"{num} but {len(urls)} url(s)")
    if not urls and not dynamic:
        raise err(f"{section}.urls", "empty: list at least one 'host:port'")
    policy = _parse_policy(err, f"{section}.router", raw.get("router"))
    options = {k: v for k, v in {**inherited, **own}.items() if v is not None}
    return ServerGroupConfig(ROLE_OF_SECTION[section], num, urls, policy,
                             MappingProxyType(options))


def _parse_cluster(err: _Errors, raw: Any) -> DisaggClusterConfig:
    key = "disagg_cluster"
    if not isinstance(raw, Mapping):
        raise err(key, "expected a mapping")
    _no_unknown(err, key, raw, (*DISAGG_CLUSTER_OPTIONS, "minimal_instances"))
    uri = _get(err, raw, "cluster_uri", DISAGG_CLUSTER_OPTIONS["cluster_uri"], f"{key}.")
    if uri is not None and not uri.startswith("http://"):
        raise err(f"{key}.cluster_uri", f"{uri!r}: workers register over http:// with the "
                  "router (etcd and other stores are not supported)")
    minimal_raw = raw.get("minimal_instances") or {}
    if not isinstance(minimal_raw, Mapping):
        raise err(f"{key}.minimal_instances", "expected {context_servers: N, "
                  "generation_servers: N}")
    _no_unknown(err, f"{key}.minimal_instances", minimal_raw, SECTIONS)
    minimal = {section: _get(err, minimal_raw, section, MINIMAL_INSTANCES,
                             f"{key}.minimal_instances.") for section in SECTIONS}
    beat = _get(err, raw, "heartbeat_interval_sec",
                DISAGG_CLUSTER_OPTIONS["heartbeat_interval_sec"], f"{key}.")
    inactive = _get(err, raw, "inactive_timeout_sec",
                    DISAGG_CLUSTER_OPTIONS["inactive_timeout_sec"], f"{key}.")
    if inactive <= beat:
        raise err(f"{key}.inactive_timeout_sec", f"{inactive} must exceed "
                  f"heartbeat_interval_sec ({beat}), or every worker would time out")
    return DisaggClusterConfig(uri, MappingProxyType(minimal), beat, inactive)
