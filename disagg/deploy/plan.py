"""What a deployed cluster runs, from the disagg YAML (shared by the k8s and Slurm renderers).

The YAML is planned as for ``disagg launch`` (``contracts.plan``: validated by the router's
own parser, a group per server section with its role, typed options, model reference, served
name and packaged-model defaults); this module adds deploy's checks and turns it into:

- the router's YAML: the user's file with the ``urls`` dropped and ``disagg_cluster`` added, so
  that workers join by registering (``disagg serve --router-url``) instead of being listed: a
  replica count is then all that says how many there are (``kubectl scale`` needs no config
  change). ``minimal_instances`` is what the router's ``/health`` waits for.
- one ``WorkerGroup`` per server section: its worker YAML (the merged section options, the model
  path as the workers see it, ``drain_timeout``; the UCX profile is left to the workers'
  ``auto``, cross_host for a KV address that is not loopback), its role, replica count
  (``num_instances``), ports (from ``urls``: the hosts of the urls are ignored, the deploy
  target places the workers), and GPUs per worker (``tp * pp``; none for ``device: cpu`` or
  ``--cpu``). A ``chat_template`` file is read here and its text goes into the worker YAML
  (and the router's): the file is on this machine, not in the pods or on the nodes. The
  packaged ``smollm2`` gets its tool-aware template and the hermes parser, as with
  ``disagg launch``, unless the YAML sets ``chat_template`` or ``tool_call_parser``.
- the model (``target_model``, deploy's materialiser of the plan's ``ModelRef``): ``tiny``
  (the built-in tiny model) is written on the target by ``disagg model tiny`` into
  ``models_dir``, a packaged name (``smollm2``) as its GGUF file by ``disagg model fetch NAME
  DIR --gguf`` (served as a ``.gguf``: ``gguf_weights`` applies, quantized by default, as with
  ``disagg launch``); anything else is a checkpoint folder or ``.gguf`` file path that must
  exist where the workers run.

Every error is a ``DeployError`` naming the file and the key.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from disagg.contracts.cluster import (
    SECTIONS,
    ClusterConfig,
    RouterConfigError,
    parse_cluster_config,
)
from disagg.contracts.plan import TINY_MODELS, ClusterPlan, GroupPlan, ModelRef, load_plan
from disagg.launch import model_catalog, split_url

# Worker keys the deployment sets per worker (or keeps out of config files) -> why.
_REFUSED_KEYS = {
    "cluster_token": "a token in a config file travels in the clear; the deployment gives "
                     "every member $DISAGG_CLUSTER_TOKEN (a Kubernetes Secret, a Slurm job's "
                     "environment)",
    "router_url": "the deployment points every worker at its router",
    "advertise_host": "set per worker by the deployment (the pod's IP, the node's name)",
    "kv_transfer_host": "the deployment binds every interface and advertises the pod's or "
                        "node's address",
}
GRACE_MARGIN_S = 15  # after the drain: unregistering, the engine's and the ranks' shutdown
_TEMPLATE_KEYS = ("chat_template", "tool_call_parser")
BIND_ALL = "0.0.0.0"


class DeployError(Exception):
    """A cluster YAML that cannot be deployed (the message names the file and the key)."""


@dataclass(frozen=True)
class ModelSource:
    """One group's model: the plan's reference, and where the workers read it."""

    ref: ModelRef
    path: str  # the folder (or .gguf file) the workers load

    @property
    def written(self) -> str:
        """As in the YAML: "tiny", "tiny-moe", "smollm2", or a path as written."""
        return self.ref.written

    @property
    def kind(self) -> str:
        """tiny | packaged | path"""
        return self.ref.kind

    @property
    def generated(self) -> bool:
        """Written on the target before the workers start (not brought by the user)."""
        return self.ref.generated

    def prepare_args(self) -> tuple[str, ...]:
        """The ``disagg`` arguments that write a generated model to ``path``."""
        if self.kind == "tiny":
            arch = TINY_MODELS[self.written]
            return ("model", "tiny", self.path) + (() if arch == "llama" else ("--arch", arch))
        if self.kind == "packaged":  # the GGUF file itself (path: DIR/FILE.gguf)
            return ("model", "fetch", self.written, os.path.dirname(self.path), "--gguf")
        raise ValueError(f"{self.written!r} is not generated")

    @property
    def mount_dir(self) -> str:
        """The folder a volume with the model is mounted at (a .gguf file's folder)."""
        return os.path.dirname(self.path) if self.path.lower().endswith(".gguf") else self.path


@dataclass(frozen=True)
class WorkerGroup:
    section: str  # context_servers | generation_servers
    role: str  # context | generation | aggregated
    replicas: int
    ports: tuple[int, ...]  # from the section's urls, in order (one per instance)
    world: int  # ranks per worker: tensor_parallel_size * pipeline_parallel_size
    gpus: int  # GPUs per worker: world, or 0 on CPU
    drain_timeout: float
    model: ModelSource
    options: Mapping[str, Any]  # the worker YAML (`disagg serve --config`)

    @property
    def port(self) -> int:
        """The port of every worker of the group where all listen on one (a pod each)."""
        return self.ports[0]

    @property
    def grace_period_s(self) -> int:
        """Seconds a stopping worker gets: its drain, then the margin to exit."""
        return math.ceil(self.drain_timeout) + GRACE_MARGIN_S


@dataclass(frozen=True)
class DeployPlan:
    source: str  # the YAML file
    router_port: int
    router_options: Mapping[str, Any]  # the router's YAML
    groups: tuple[WorkerGroup, ...]
    router_model: ModelSource | None  # the router tokenizes prompts with it (kv-aware)
    api_key: str | None  # clients of the router send it
    public_metrics: bool  # the router's /metrics without the API key

    @property
    def models(self) -> tuple[ModelSource, ...]:
        """Every distinct model of the cluster, in order."""
        seen: dict[str, ModelSource] = {}
        for m in (*(g.model for g in self.groups), self.router_model):
            if m is not None:
                seen.setdefault(m.path, m)
        return tuple(seen.values())

    @property
    def holds_api_keys(self) -> bool:
        """The YAML has API keys (the router's, a group's): its rendered files are secrets."""
        return bool(self.api_key or any(g.options.get("api_key") for g in self.groups))


def target_model(ref: ModelRef, models_dir: str, absolute_only: bool) -> ModelSource:
    """``disagg deploy``'s materialiser of a model reference: where it is on the target.
    ``tiny`` / a packaged name: generated in ``models_dir``; a path: as given. With
    ``absolute_only`` a relative path is an error (a container has no meaningful current
    folder); else it is made absolute against the current folder, as ``disagg launch`` does."""
    if ref.kind == "packaged":
        # The GGUF file, served as a .gguf is (gguf_weights: quantized by default, as
        # ``disagg launch`` and ``disagg serve FILE.gguf`` do), not a float32 import.
        from disagg.model.gguf import PACKAGED_MODELS  # (numpy, no torch)

        file_name = PACKAGED_MODELS[ref.written].file_name
        return ModelSource(ref, f"{models_dir}/{ref.written}/{file_name}")
    if ref.generated:
        return ModelSource(ref, f"{models_dir}/{ref.written}")
    path = os.path.expanduser(ref.written)
    if not os.path.isabs(path):
        if absolute_only:
            raise DeployError(f"{ref.said}: give an absolute path (where the model volume is "
                              f"mounted in the containers)")
        path = os.path.abspath(path)
    return ModelSource(ref, os.path.normpath(path))


def build_plan(config_path: str, *, models_dir: str, absolute_only: bool,
               minimal_instances: str, model_override: str | None = None,
               drain_timeout: float | None = None, cpu: bool = False) -> DeployPlan:
    """Validate ``config_path`` and plan its deployment.

    ``models_dir``: where generated models (``tiny``) are written on the target.
    ``minimal_instances``: ``one`` (the router is healthy with one worker of each section:
    replicas may be scaled down) or ``all`` (with every one: a fixed-size job).
    ``drain_timeout`` (seconds) replaces the YAML's; ``cpu`` requests no GPUs.
    """
    catalog = model_catalog()
    try:
        plan = load_plan(config_path, catalog=catalog, model_override=model_override)
    except RouterConfigError as e:
        raise DeployError(str(e)) from None
    cfg = plan.config
    if drain_timeout is not None and not drain_timeout > 0:
        raise DeployError(f"--drain-timeout: must be > 0, got {drain_timeout}")
    if cfg.port == 0:
        raise DeployError(f"{config_path}: port: 0 (a free port) cannot be deployed: the "
                          f"workers and clients need the router's port; pick one")
    raw = plan.written
    for level, where in [(raw, ""), *((raw[s], f"{s}.") for s in SECTIONS
                                      if isinstance(raw.get(s), dict))]:
        for key, why in _REFUSED_KEYS.items():
            if level.get(key) is not None:
                raise DeployError(f"{config_path}: {where}{key}: not deployable: {why}")
    if not plan.groups:
        raise DeployError(f"{config_path}: no context_servers or generation_servers: nothing "
                          f"to deploy")
    models: dict[str, ModelSource] = {}  # section -> its model
    groups = []
    for g in plan.groups:
        if g.model is None:
            raise DeployError(f"{g.where}: model: missing: {catalog.expected}")
        models[g.section] = target_model(g.model, models_dir, absolute_only)
        groups.append(_plan_group(plan, g, models[g.section], drain_timeout, cpu,
                                  absolute_only))
    router_model = _router_model(plan, models)
    router_options = _router_options(raw, cfg, models, minimal_instances, model_override,
                                     groups)
    try:
        parse_cluster_config(router_options, f"{config_path} (as deployed)")
    except RouterConfigError as e:  # a bug here, not the user's: say so
        raise DeployError(f"the router's YAML made from {e}") from None
    return DeployPlan(config_path, cfg.port, MappingProxyType(router_options), tuple(groups),
                      router_model, cfg.api_key, cfg.public_metrics)


def _plan_group(plan: ClusterPlan, g: GroupPlan, model: ModelSource,
                drain_timeout: float | None, cpu: bool, absolute_only: bool) -> WorkerGroup:
    cfg = plan.config
    if not g.urls:
        raise DeployError(f"{g.where}.urls: missing: their ports are the workers' ports (the "
                          f"hosts are ignored: the deployment places the workers)")
    ports = tuple(split_url(url)[1] for url in g.urls)
    if cfg.port in ports:
        raise DeployError(f"{g.where}.urls: port {cfg.port} is the router's port")
    # The plan's worker YAML (a packaged model's template and parser, the model as written
    # for the name clients send, as disagg launch gives them), with the model where the
    # target has it and the template's text.
    opts = g.worker_keys()
    opts["model"] = model.path
    if opts.get("chat_template") is not None:
        opts["chat_template"] = _template_text(opts["chat_template"], g.where)
    if opts.get("speculative_config") is not None:
        opts["speculative_config"] = _target_speculative(opts["speculative_config"], g.where,
                                                         absolute_only)
    drain = float(drain_timeout if drain_timeout is not None else g.options.drain_timeout)
    opts["drain_timeout"] = drain
    device = g.options.device or "cuda"
    gpus = 0 if cpu or not device.startswith("cuda") else g.world
    return WorkerGroup(g.section, g.role.value, g.config.num_instances, ports, g.world, gpus,
                       drain, model, MappingProxyType(opts))


def _target_speculative(value: Mapping[str, Any], where: str, absolute_only: bool
                        ) -> dict[str, Any]:
    """The group's ``speculative_config`` (the plan's checked mapping) with its draft
    ``model`` where the workers read it, by ``target_model``'s rule for a model path: kept
    when absolute, else an error (``absolute_only``) or made absolute here."""
    spec = dict(value)
    draft = spec.get("model")
    if draft is None:
        return spec
    path = os.path.expanduser(draft)
    if not os.path.isabs(path):
        if absolute_only:
            raise DeployError(f"{where}.speculative_config.model: {draft!r}: give an absolute "
                              f"path (where the draft checkpoint is in the containers)")
        path = os.path.abspath(path)
    spec["model"] = os.path.normpath(path)
    return spec


def _template_text(value: Any, where: str) -> str:
    """A ``chat_template`` (a file here, or the template) as the text the deployed members
    read: a file of this machine is not in their pods or on their nodes, so its text goes
    into their YAML (DeployError when it is neither, or does not compile)."""
    from disagg.tokenizer import read_chat_template

    try:
        return read_chat_template(value, "chat_template")
    except ValueError as e:
        raise DeployError(f"{where}.{e}") from None


def _router_model(plan: ClusterPlan, models: Mapping[str, ModelSource]
                  ) -> ModelSource | None:
    """The model whose tokenizer the router loads, when its policies need prompt tokens."""
    from disagg.router.policies import make_policy

    need = plan.config.conditional_disagg is not None
    for g in plan.groups:
        if g.tokenizer is not None:
            raise DeployError(f"{g.where}.router.tokenizer: not deployable: the router reads "
                              f"the tokenizer of the workers' model")
        need = need or make_policy(g.config.router).needs_tokens
    if not need:
        return None
    return models.get("generation_servers") or models.get("context_servers")


def _router_options(raw: Mapping[str, Any], cfg: ClusterConfig,
                    models: Mapping[str, ModelSource], minimal_instances: str,
                    model_override: str | None, groups: list[WorkerGroup]) -> dict[str, Any]:
    """The user's YAML as the deployed router reads it: no urls (workers register), models
    where the router finds them, each section's chat template and tool call parser as its
    workers get them (the router renders the same prompts for its token-aware policies),
    ``disagg_cluster`` with ``minimal_instances``."""
    if minimal_instances not in ("one", "all"):
        raise ValueError(f"minimal_instances: {minimal_instances!r}")
    out = copy.deepcopy(dict(raw))
    out["hostname"] = BIND_ALL
    if "model" in out or model_override is not None:
        first = next(iter(models.values()))
        out["model"] = first.path
    planned = {g.section: g for g in groups}
    for key in _TEMPLATE_KEYS:  # per section below, as the workers got them
        out.pop(key, None)
    for section in SECTIONS:
        sec = out.get(section)
        if not isinstance(sec, dict):
            continue
        sec.pop("urls", None)
        for key in _TEMPLATE_KEYS:
            sec.pop(key, None)
            if section in planned and planned[section].options.get(key) is not None:
                sec[key] = planned[section].options[key]
        if model_override is not None:
            sec.pop("model", None)
        elif "model" in sec:
            sec["model"] = models[section].path
    cluster = dict(out.get("disagg_cluster") or {})
    if "minimal_instances" not in cluster:
        groups = {s: getattr(cfg, s) for s in SECTIONS if getattr(cfg, s) is not None}
        cluster["minimal_instances"] = {
            s: (g.num_instances if minimal_instances == "all" else min(1, g.num_instances))
            for s, g in groups.items()}
    out["disagg_cluster"] = cluster
    return out


def dump_yaml(data: Mapping[str, Any]) -> str:
    """A mapping as YAML (keys in order; multi-line strings as literal blocks)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> Any:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    def mapping(dumper: yaml.SafeDumper, value: Mapping[str, Any]) -> Any:
        return dumper.represent_dict(dict(value))

    _Dumper.add_representer(str, text)
    _Dumper.add_representer(MappingProxyType, mapping)
    return yaml.dump(_to_plain(data), Dumper=_Dumper, sort_keys=False, width=100)


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value
