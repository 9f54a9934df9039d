"""The worker's options, one schema for every surface: ``WorkerOptions``.

``WorkerOptions`` is a frozen dataclass; each field carries the option's default and, in its
metadata, its ``Opt`` (type, help, choices, bounds, and where the flag or the YAML key is
spelled otherwise than the name). Every surface reads it: ``disagg serve``'s flags and
``resolve_options`` (``server/cli.py``), the worker YAML (``load_worker_yaml``), the worker
keys of the cluster YAML (``worker_yaml_keys``, ``contracts/cluster.py``), ``run_server``
(which takes one), ``ServerSettings`` / ``DisaggSettings`` (built from one), the plan of
``disagg launch`` / ``disagg deploy`` (``contracts/plan.py``) and ``disagg bench``
(``worker_yaml``). Each default is written once, on its field; an engine option's field
defaults to None, "the engine's own default", which lives in ``disagg.config``'s dataclasses
(``engine_default`` reads it for ``--help``).

``speculative_config`` is a JSON object (``SpeculativeConfig``, vLLM's shape): JSON text on the
command line, a mapping or its JSON text in a YAML; ``coerce`` gives the YAMLs its mapping
(checked, the lookup bounds filled in), ``WorkerOptions`` holds the ``SpeculativeConfig``.

The lease TTL is ``kv_lease_ttl_s`` in the code and the cluster YAML; the flag is
``--kv-lease-ttl`` and a worker YAML also takes ``kv_lease_ttl`` (spellings users have).
``ucx_profile`` has no flag or key of its own: ``cache_transceiver_config.ucx_profile``.
``expected_link_gbps`` is a YAML key without a ``disagg serve`` flag: a worker does not use it,
``disagg doctor -c`` reads it (the link rate between hosts it judges against).

``coerce`` checks one YAML value against its ``Opt`` and names the key and the file on error;
the cluster YAML's own keys are ``Opt`` tables in ``contracts/cluster.py``, checked by the same
``coerce``. Torch-free and server-free: importing it imports only ``disagg.config`` and
``disagg.contracts.roles``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from disagg.config import (
    DEFAULT_GPU_MEMORY_FRACTION,
    GGUF_WEIGHT_MODES,
    KV_CACHE_DTYPES,
    CacheConfig,
    CapacityPolicy,
    ConfigError,
    CudaGraphConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    read_yaml,
)
from disagg.contracts.roles import ROLES, Role


class StrList(list):
    """Option type marker: a list of strings (comma-separated on the command line)."""


@dataclass(frozen=True)
class Opt:
    """One option. ``default`` is what an absent or null key means (a worker option: its
    ``WorkerOptions`` field's default, None for an engine option: the engine decides).
    ``gt`` / ``ge``: bounds ``coerce`` checks for a number.

    A worker option is spelled by its name (``--kebab-case`` flag, snake_case YAML key) unless
    ``flag`` / ``yaml`` say otherwise ("": none); ``yaml_aliases`` are further keys a worker
    YAML takes for it (not the cluster YAML)."""

    # int, float, bool, str, list (of ints: "3,1" on the command line), StrList or
    # SpeculativeConfig (a JSON object: its text on the command line, a mapping in a YAML)
    type: type
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default: Any = None
    gt: float | None = None
    ge: float | None = None
    flag: str | None = None
    yaml: str | None = None
    yaml_aliases: tuple[str, ...] = ()
    engine: bool = False  # an engine option (``build_engine_config`` takes it)

    def flag_name(self, name: str) -> str | None:
        """The ``disagg serve`` flag (None: none)."""
        if self.flag is None:
            return "--" + name.replace("_", "-")
        return self.flag or None

    def yaml_key(self, name: str) -> str | None:
        """The key of both YAMLs (None: none of its own)."""
        if self.yaml is None:
            return name
        return self.yaml or None


def _option(default: Any, type_: type, help: str, **kw: Any) -> Any:
    """A ``WorkerOptions`` field: its default, and its ``Opt`` in the metadata."""
    return field(default=default, metadata={"opt": Opt(type_, help, default=default, **kw)})


def _engine(type_: type, help: str, **kw: Any) -> Any:
    """An engine option's field: None (unset) leaves it to the engine's own default."""
    return _option(None, type_, help, engine=True, **kw)


def coerce(name: str, opt: Opt, value: Any, where: str,
           error: type[ConfigError] = ConfigError) -> Any:
    """Check a YAML value's type, choices and bounds (YAML already parsed it); ``error``
    (a ``ConfigError``) names the file and the key. None stays None."""
    if value is None:
        return None
    if opt.type is SpeculativeConfig:
        return speculative_mapping(value, name, where, error)
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


def speculative_mapping(value: Any, name: str = "speculative_config", where: str = "",
                        error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A ``speculative_config`` value (JSON text, a mapping, a ``SpeculativeConfig``) as the
    mapping a YAML holds: checked, the ngram lookup bounds filled in, unset keys left out (so
    that a JSON string and the same mapping compare equal). ``error`` names ``where`` and the
    key path under ``name`` (``generation_servers.speculative_config.method: ...``)."""
    try:
        spec = SpeculativeConfig.parse(dict(value) if isinstance(value, Mapping) else value)
    except ConfigError as e:
        # SpeculativeConfig names "speculative_config[.key]"; say where it is written.
        text = str(e).removeprefix("speculative_config")
        raise error(f"{where}: {name}{text}" if where else f"{name}{text}") from None
    assert spec is not None
    return {f.name: getattr(spec, f.name) for f in fields(spec)
            if getattr(spec, f.name) is not None}


# /v1/responses kept for previous_response_id (a worker's own, or the router's: the workers
# behind a router see chat requests only). The router's cluster YAML keys share them.
RESPONSES_STORE_SIZE = 1024
RESPONSES_STORE_TTL_S = 3600.0
BACKEND_NAMES = ("ucx", "tcp")
# auto: cross_host when the worker's advertised KV address is not loopback, else same_host
# (``ucx.resolve_ucx_profile``); without an address (a bare ``make_backend``): same_host.
UCX_PROFILE_NAMES = ("auto", "same_host", "cross_host")


@dataclass(frozen=True)
class WorkerOptions:
    """Every option of one worker (``disagg serve``): the server's, then the engine's.

    Built with keywords (``WorkerOptions(model="m", role="context")``) or by
    ``server.cli.resolve_options`` (defaults < worker YAML < flags); checked on construction
    (``ConfigError`` naming the field). Lists become tuples and ``role`` a ``Role``."""

    # -- the server's ---------------------------------------------------------------------
    model: str | None = _option(None, str, "checkpoint folder (instead of the MODEL_DIR "
                                "argument)", flag="")
    host: str = _option("127.0.0.1", str, "address to bind")
    port: int = _option(8000, int, "port to bind; 0 picks a free one")
    role: Role = _option(Role.AGGREGATED, str, "worker role; context / generation serve "
                         "disaggregated requests", choices=ROLES)
    kv_transfer_backend: str | None = _option(
        None, str, "KV transfer backend of a context/generation worker (default: UCX when "
        "ucxx imports, else TCP; YAML: cache_transceiver_config.backend)",
        choices=("UCX", "TCP", "ucx", "tcp"))
    kv_transfer_host: str | None = _option(
        None, str, "address the context worker's KV transfer server binds and advertises "
        "(default: --host)", metavar="HOST")
    advertise_host: str | None = _option(
        None, str, "address or name peers on other hosts use for this worker: the HTTP url it "
        "registers with --router-url and its KV transfer address (default: the bound address; "
        "for a wildcard bind, this host's address on the route to the router, else its first "
        "non-loopback one)", metavar="HOST")
    cluster_token: str | None = _option(
        None, str, "shared secret of the cluster's members: the router signs its calls with "
        "it, KV transfer peers prove they hold it (default: $DISAGG_CLUSTER_TOKEN)",
        metavar="TOKEN")
    kv_peer_allowlist: tuple[str, ...] | None = _option(
        None, StrList, "context workers a generation worker may pull KV from when a request "
        "is not signed by the cluster: IPs, CIDRs or host names (YAML: a list)",
        metavar="NET,...")
    kv_lease_ttl_s: float = _option(
        30.0, float, "seconds a context worker keeps a request's KV for the generation worker",
        metavar="S", flag="--kv-lease-ttl", yaml_aliases=("kv_lease_ttl",))
    kv_peer_reuse: bool = _option(
        False, bool, "KV prefix reuse across workers: lease this worker's cached prefixes to "
        "peers (POST /kv_prefix) and pull a peer's when the router names one (a request's "
        "kv_prefix) instead of recomputing it; any role (an aggregated worker then runs a "
        "KV transfer server too)")
    kv_link_check: bool = _option(
        False, bool, "at start-up, serve test blocks of this worker's KV layout (2048 tokens, "
        "128-256 MiB) through its KV transfer backend on its KV address and pull them in a "
        "second process: log the bandwidth, small-read latency and UCX transports beside "
        "memcpy (an ERROR when below 0.2 of it); a transfer that fails stops the start "
        "(disagg doctor checks a link between hosts)")
    expected_link_gbps: float | None = _option(
        None, float, "the KV link rate between hosts, GB/s (e.g. 12.5 for 100 Gb/s): what "
        "`disagg doctor -c` judges a link to another host against (YAML only; the doctor's "
        "flag: --expected-link-gbps)", metavar="GB/S", gt=0, flag="")
    # No flag or key of its own: cache_transceiver_config.ucx_profile sets it.
    ucx_profile: str = _option(
        "auto", str, "UCX transports of the KV transfer: auto (cross_host when the advertised "
        "KV address is not loopback, else same_host), same_host or cross_host",
        choices=UCX_PROFILE_NAMES, flag="", yaml="")
    served_model_name: str | None = _option(
        None, str, "model name clients send (default: MODEL_DIR as given)", metavar="NAME")
    api_key: str | None = _option(
        None, str, "require 'Authorization: Bearer KEY' on /v1/* (and, unless "
        "--public-metrics, on /metrics) (default: $DISAGG_API_KEY)", metavar="KEY")
    public_metrics: bool = _option(False, bool, "serve /metrics to anyone even when "
                                   "--api-key is set")
    drain_timeout: float = _option(30.0, float, "seconds in-flight requests get to finish on "
                                   "SIGTERM", metavar="S")
    router_url: str | None = _option(
        None, str, "register with this router (a disagg YAML with disagg_cluster) and "
        "heartbeat; unregister on drain", metavar="URL")
    otlp_traces_endpoint: str | None = _option(
        None, str, "send OpenTelemetry traces of the requests to this OTLP/HTTP receiver (e.g. "
        "http://localhost:4318/v1/traces; a URL without a path gets /v1/traces; needs pip "
        "install 'disagg[tracing]') (default: the OTEL_EXPORTER_OTLP_* variables, else off)",
        metavar="URL")
    log_level: str = _option("info", str, "log level",
                             choices=("critical", "error", "warning", "info", "debug"))
    tool_call_parser: str | None = _option(
        None, str, "how tool calls are read from the model's text for tool_choice auto (the "
        "model family's format); without it such requests get 400",
        choices=("hermes", "llama3_json", "mistral"))
    chat_template: str | None = _option(
        None, str, "chat template replacing the checkpoint's: a file, or the template itself "
        "(Jinja text); checked at start-up", metavar="FILE|TEMPLATE")
    allowed_origins: tuple[str, ...] | None = _option(
        None, StrList, "CORS: browser origins (scheme://host[:port]) that may call this "
        "worker, or * for any; default none (no CORS headers; YAML: a list)",
        metavar="ORIGIN,...")
    responses_store_size: int = _option(
        RESPONSES_STORE_SIZE, int, "responses kept for previous_response_id and GET "
        "/v1/responses/{id} (the oldest dropped first; 0: none)", metavar="N", ge=0)
    responses_store_ttl: float = _option(
        RESPONSES_STORE_TTL_S, float, "seconds a stored response is kept", metavar="S", gt=0)
    benchmark_gen_only: bool = _option(
        False, bool, "benchmarking aid of a generation worker: accept generation_only "
        "requests without context params and decode as if their prompt KV were in place "
        "(output text is meaningless)")

    # -- the engine's: exactly config.ENGINE_OPTION_NAMES (a test keeps them in step) -------
    tokens_per_block: int | None = _engine(int, "tokens per KV cache block", metavar="N")
    kv_cache_tokens: int | None = _engine(int, "KV cache capacity in tokens", metavar="N")
    kv_cache_fraction: float | None = _engine(
        float, "share of free device memory for the KV cache, in (0, 1]", metavar="F")
    gpu_memory_fraction: float | None = _engine(
        float, "CUDA: share of the GPU's total memory this worker may use (weights + "
        "activations + KV cache), in (0, 1]; workers sharing a GPU split it", metavar="F")
    enforce_eager: bool | None = _engine(bool, "CUDA: run decode steps eagerly, without CUDA "
                                         "graphs")
    async_scheduling: bool | None = _engine(
        bool, "launch the next step of plain decodes before this step's outputs are built, so "
        "the device computes while the host detokenizes (default: on for CUDA)")
    cuda_graph_max_batch_size: int | None = _engine(
        int, "CUDA: largest decode batch captured as a CUDA graph", metavar="N")
    enable_prefix_caching: bool | None = _engine(bool, "reuse cached KV blocks of shared "
                                                 "prompt prefixes")
    kv_cache_dtype: str | None = _engine(
        str, "the KV cache's element type: auto (the compute dtype; float16 for a GGUF served "
        "with its weights quantized on CPU, as llama.cpp's cache) or float32, bfloat16, "
        "float16 (another dtype than the compute dtype: CPU only; a 16-bit cache holds half "
        "the tokens' bytes of float32, each K/V value rounded to nearest even)",
        choices=KV_CACHE_DTYPES)
    kv_integrity: bool | None = _engine(
        bool, "check KV bytes that come from elsewhere against the checksum taken where they "
        "were written: each payload a generation worker pulls (the context worker sends it "
        "after the payload; a mismatch fails that request) and each block read back from an "
        "offload tier (a mismatch: the block is computed again); corrupted KV is never used; "
        "--no-kv-integrity skips both")
    kv_offload_host_gib: float | None = _engine(
        float, "host-memory tier for prefix-cached KV blocks evicted from the KV cache, in GiB "
        "for the whole worker, all its ranks together (pinned on CUDA; default: none)",
        metavar="GIB")
    kv_offload_disk_dir: str | None = _engine(
        str, "disk tier for evicted prefix-cached KV blocks: a folder this worker owns (emptied "
        "when the worker starts; needs --kv-offload-disk-gib)", metavar="DIR")
    kv_offload_disk_gib: float | None = _engine(
        float, "size of the disk tier in GiB (the whole worker, all its ranks together)",
        metavar="GIB")
    max_batch_size: int | None = _engine(int, "requests per iteration", metavar="N")
    max_num_tokens: int | None = _engine(int, "tokens per iteration", metavar="N")
    enable_chunked_context: bool | None = _engine(bool, "split long prompts over iterations")
    capacity_policy: str | None = _engine(str, "KV admission policy",
                                          choices=tuple(p.value for p in CapacityPolicy))
    max_model_len: int | None = _engine(int, "prompt + output token limit (default: the "
                                        "model's)", metavar="N")
    max_queue: int | None = _engine(int, "waiting requests beyond which new ones get 503 + "
                                    "Retry-After", metavar="N")
    tensor_parallel_size: int | None = _engine(int, "tensor parallel ranks", metavar="N")
    pipeline_parallel_size: int | None = _engine(int, "pipeline parallel stages", metavar="N")
    pp_partition: tuple[int, ...] | None = _engine(
        list, "layers per pipeline stage, e.g. 3,1 (default: even split)", metavar="N,N,...")
    enable_expert_parallel: bool | None = _engine(
        bool, "MoE models: partition the experts over the tensor-parallel ranks (whole "
        "experts per rank, one all-reduce per layer) instead of splitting every expert; "
        "attention stays tensor-parallel")
    dtype: str | None = _engine(str, "compute dtype (default: the checkpoint's)",
                                choices=("float32", "bfloat16", "float16"))
    device: str | None = _engine(str, "cpu or cuda[:N] (default: cuda when available)")
    seed: int | None = _engine(int, "engine seed for unseeded sampling")
    speculative_config: SpeculativeConfig | None = _engine(
        SpeculativeConfig, "speculative decoding, a JSON object: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": N, \"prompt_lookup_max\": N} "
        "(draft tokens looked up in the prompt and output so far) or {\"method\": "
        "\"draft_model\", \"model\": DIR, \"num_speculative_tokens\": K} (a smaller checkpoint "
        "with the same vocabulary); the model verifies K draft tokens per step; "
        "\"disable_by_batch_size\": N: no drafts in a step of N or more decodes (YAML: a "
        "mapping or its JSON text)", metavar="JSON")

    gguf_weights: str | None = _engine(
        str, "a .gguf model's weights: quantized (read from the file; on CPU its Q8_0, Q4_0, "
        "Q4_1 and Q4_K linears stay quantized and run on quantized kernels, the rest is "
        "dequantized; elsewhere all is dequantized) or float32 (the float32 import of the "
        "file, as transformers loads it)", choices=GGUF_WEIGHT_MODES)

    def __post_init__(self) -> None:
        for name, opt in WORKER_OPTIONS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if opt.type in (list, StrList) and isinstance(value, tuple):
                value = list(value)  # coerce checks a YAML list
            value = coerce(name, opt, value, "worker options")
            if isinstance(value, list):
                value = tuple(value)  # frozen: hashable, never changed in place
            elif name == "role":
                value = Role(value)
            elif name == "speculative_config":
                value = SpeculativeConfig.parse(value)  # coerce checked it: frozen, hashable
            object.__setattr__(self, name, value)

    @property
    def world_size(self) -> int:
        """Ranks of the worker: tensor_parallel_size * pipeline_parallel_size."""
        return (self.tensor_parallel_size or 1) * (self.pipeline_parallel_size or 1)

    def engine_options(self) -> dict[str, Any]:
        """The engine options set (``build_engine_config``'s keywords); the rest are left to
        the engine's defaults."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS
                if getattr(self, name) is not None}


# name -> Opt, in field order (the flags' order in --help): every worker option, then the
# engine's and the server's (the rest).
WORKER_OPTIONS: dict[str, Opt] = {f.name: f.metadata["opt"] for f in fields(WorkerOptions)}
ENGINE_OPTIONS: dict[str, Opt] = {n: o for n, o in WORKER_OPTIONS.items() if o.engine}
SERVER_OPTIONS: dict[str, Opt] = {n: o for n, o in WORKER_OPTIONS.items() if not o.engine}
# The defaults, as one value (``WORKER_DEFAULTS.drain_timeout``): for the settings built from
# options and the components that take one of them as their own default.
WORKER_DEFAULTS = WorkerOptions()


def engine_default(name: str) -> Any:
    """The engine's own default of an engine option (its field in ``disagg.config``), None
    where the engine decides at run time (the checkpoint's dtype, the device found)."""
    if name == "gpu_memory_fraction":
        return DEFAULT_GPU_MEMORY_FRACTION  # the runner's, when no sizing option is set
    if name == "gguf_weights":
        return GGUF_WEIGHT_MODES[0]  # build_engine_config's
    for cls in (CacheConfig, SchedulerConfig, ParallelConfig, CudaGraphConfig):
        for f in fields(cls):
            if f.name == name and f.default is not MISSING:
                return f.default
    if name == "seed":
        return next(f.default for f in fields(EngineConfig) if f.name == "seed")
    return None


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def option_help(name: str) -> str:
    """An option's ``--help`` text: its help, its default (the field's, or the engine's) and
    its YAML key where that is not the flag's spelling."""
    opt = WORKER_OPTIONS[name]
    default = engine_default(name) if opt.engine else opt.default
    notes = [] if default is None else [f"default {_shown(default)}"]
    flag, key = opt.flag_name(name), opt.yaml_key(name)
    if flag is not None and key is not None and flag[2:].replace("-", "_") != key:
        notes.append(f"YAML: {key}")
    return f"{opt.help} ({'; '.join(notes)})" if notes else opt.help


# The worker roles (roles.py's wire values); DISAGG_ROLES move KV and need a cluster token.
DISAGG_ROLES = tuple(r.value for r in Role if r.disaggregated)


def check_role(role: str, world_size: int = 1) -> None:
    """A role this worker can take (any role works with any tp * pp = ``world_size``)."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size * pipeline_parallel_size: must be >= 1, got "
                         f"{world_size}")


# trtllm-serve's mapping {backend: UCX | TCP, ucx_profile: auto | same_host | cross_host} in a
# worker YAML: it sets kv_transfer_backend and ucx_profile.
TRANSCEIVER_KEY = "cache_transceiver_config"


def worker_yaml_keys(aliases: bool = False) -> dict[str, Opt | None]:
    """The worker keys of a YAML -> their ``Opt`` (None for ``cache_transceiver_config``, a
    mapping: ``check_transceiver``): the cluster YAML's, and with ``aliases`` a worker
    file's (which also takes ``kv_lease_ttl``)."""
    keys: dict[str, Opt | None] = {}
    for name, opt in WORKER_OPTIONS.items():
        key = opt.yaml_key(name)
        if key is not None:
            keys[key] = opt
        if aliases:
            keys.update(dict.fromkeys(opt.yaml_aliases, opt))
    keys[TRANSCEIVER_KEY] = None
    return keys


def _yaml_names(aliases: bool) -> dict[str, str]:
    """YAML key -> option name, for the keys spelled otherwise than their option."""
    out = {}
    for name, opt in WORKER_OPTIONS.items():
        for key in (opt.yaml_key(name), *(opt.yaml_aliases if aliases else ())):
            if key is not None and key != name:
                out[key] = name
    return out


def worker_yaml(values: Mapping[str, Any]) -> dict[str, Any]:
    """Option values (``WorkerOptions`` field names) -> the worker keys of a YAML, as the
    cluster YAML spells them (``kv_lease_ttl_s``; ``kv_transfer_backend`` and ``ucx_profile``
    as ``cache_transceiver_config``); the inverse of ``load_worker_yaml``. Lists stay lists."""
    out: dict[str, Any] = {}
    transceiver: dict[str, Any] = {}
    for name, value in values.items():
        if name not in WORKER_OPTIONS:
            raise ValueError(f"{name}: not a worker option")
        if name == "kv_transfer_backend":
            transceiver["backend"] = value
        elif name == "ucx_profile":
            transceiver["ucx_profile"] = value
        else:
            key = WORKER_OPTIONS[name].yaml_key(name)
            assert key is not None  # only the two above have none
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, enum.Enum):  # role: its wire value
                value = value.value
            elif name == "speculative_config" and value is not None:
                value = speculative_mapping(value)  # a mapping, as a YAML writes it
            out[key] = value
    if transceiver:
        out[TRANSCEIVER_KEY] = transceiver
    return out


@dataclass(frozen=True)
class CacheTransceiverConfig:
    """The ``cache_transceiver_config`` section of a worker config:
    ``{backend: UCX | TCP, ucx_profile: auto | same_host | cross_host}`` (the backend
    case-insensitive). The backend defaults to UCX here (``make_backend``'s spec); a worker
    that names none gets UCX when ucxx imports, else TCP (``kv_transfer_backend``)."""

    backend: str = "UCX"
    ucx_profile: str = WORKER_DEFAULTS.ucx_profile

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


_OTLP_URL = re.compile(r"(https?)://([^/\s?#]+)(/\S*)?", re.IGNORECASE)
OTLP_TRACES_PATH = "/v1/traces"


def check_otlp_endpoint(url: Any, name: str = "otlp_traces_endpoint") -> str:
    """An OTLP/HTTP traces URL as configured (``http(s)://host[:port][/path]``) -> the URL
    the spans go to (without a path: ``/v1/traces``); ValueError naming ``name`` otherwise
    (``disagg/tracing.py``)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{name}: expected an http(s):// URL, got {url!r}")
    m = _OTLP_URL.fullmatch(url.strip())
    if m is None:
        raise ValueError(f"{name}: {url!r} is not an http:// or https:// URL of an OTLP/HTTP "
                         f"receiver (e.g. http://localhost:4318/v1/traces)")
    if m.group(3) in (None, "", "/"):
        return f"{m.group(1)}://{m.group(2)}{OTLP_TRACES_PATH}"
    return url.strip()


# Keys of a disagg YAML server section that describe the cluster, not one worker.
_SECTION_ONLY_KEYS = ("num_instances", "urls", "router")


def options_from_yaml(data: Mapping[str, Any], where: str,
                      error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The worker keys of a YAML mapping (a worker file's: aliases taken) -> option values by
    ``WorkerOptions`` field name, each checked; ``error`` names ``where`` and the key.
    ``cache_transceiver_config`` sets ``ucx_profile``, and ``kv_transfer_backend`` when it
    names a backend (without one the worker picks its default when it starts)."""
    known = worker_yaml_keys(aliases=True)
    names = _yaml_names(aliases=True)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            hint = (" (a cluster key of the disagg YAML; a worker file holds only worker "
                    "options)" if key in _SECTION_ONLY_KEYS else "")
            raise error(f"{where}: unknown key {key!r}{hint}; known keys: "
                        f"{', '.join(sorted(known))}")
        if key == TRANSCEIVER_KEY:
            ctc = check_transceiver(key, value, where, error)
            if isinstance(value, Mapping) and value.get("backend") is not None:
                out["kv_transfer_backend"] = ctc.backend
            out["ucx_profile"] = ctc.ucx_profile
            continue
        opt = known[key]
        assert opt is not None
        out[names.get(key, key)] = coerce(key, opt, value, where, error)
    return out


def load_worker_yaml(path: str) -> dict[str, Any]:
    """Options from a worker YAML, by ``WorkerOptions`` field name (only the keys the file
    sets); unknown keys and wrong types are errors naming both."""
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    return options_from_yaml(data, path)
