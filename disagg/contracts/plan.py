"""One plan from a cluster YAML, for ``disagg launch`` (this machine) and ``disagg deploy``
(Kubernetes, Slurm): which workers run, in which role, with which options and which model.

``plan_cluster`` validates the YAML (``parse_cluster_config``: errors ``FILE: key: ...``),
applies a ``--model`` override (the model of every group: the top level's, the sections'
dropped) and decides, per server section, a ``GroupPlan``: the workers' role (``aggregated``
for the generation section of a cluster without context servers), their urls, their typed
``WorkerOptions``, their model and the router's tokenizer (``ModelRef``), and the worker keys
the plan adds: ``served_model_name`` = the model as written when the YAML names none (clients
send ``tiny``, not the folder it becomes), and a packaged model's chat template and tool call
parser when the YAML sets neither.

A ``ModelRef`` is a model as the YAML writes it: the built-in ``tiny``, a packaged name
(``smollm2``), or a path (a checkpoint folder or a ``.gguf`` file). The targets materialise it:
``disagg launch`` writes, fetches, imports or checks it on this machine
(``launch.local_model``); ``disagg deploy`` names where it is on the target
(``deploy.plan.target_model``). The targets add only their own checks (local hosts and ports;
deployable keys and ports) and their rendering.

What the plan knows of models it is told (``ModelCatalog``: ``launch.model_catalog()``), so the
contracts import nothing of the model package. Torch-free.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from disagg.config import read_yaml
from disagg.contracts.cluster import (
    SECTIONS,
    ClusterConfig,
    RouterConfigError,
    ServerGroupConfig,
    parse_cluster_config,
)
from disagg.contracts.options import WorkerOptions
from disagg.contracts.roles import Role

TINY_MODEL = "tiny"  # the model name that means the built-in tiny model
# The built-in tiny models a YAML may name, and their architecture (``disagg model tiny
# --arch``): random weights, written on first use; ``tiny-moe`` is a mixture of experts.
TINY_MODELS = {TINY_MODEL: "llama", "tiny-moe": "qwen3_moe"}
MODEL_KINDS = ("tiny", "packaged", "path")


@dataclass(frozen=True)
class ModelCatalog:
    """The models a YAML may name besides paths: the packaged ones (fetched by name), and the
    worker options a packaged model's chats need (its chat template, its tool call parser)."""

    packaged: frozenset[str]
    defaults: Mapping[str, Mapping[str, Any]]

    @property
    def expected(self) -> str:
        """What a model value may be, for messages."""
        *names, last = [repr(n) for n in (*TINY_MODELS, *sorted(self.packaged))]
        return f"a checkpoint folder, a .gguf file, {', '.join(names)} or {last}"


@dataclass(frozen=True)
class ModelRef:
    """A model as the YAML writes it, and where (for messages: ``{where}: {key}: ...``)."""

    written: str  # "tiny", "tiny-moe", "smollm2", or a path as written
    kind: str  # one of MODEL_KINDS
    where: str  # the file, or "FILE: section" / "FILE: section: router"
    key: str = "model"  # or "tokenizer"

    @classmethod
    def parse(cls, value: Any, where: str, catalog: ModelCatalog,
              key: str = "model") -> ModelRef:
        """``value`` as a model reference; ``RouterConfigError`` when it is not one."""
        if not isinstance(value, str) or not value.strip():
            raise RouterConfigError(f"{where}: {key}: expected {catalog.expected}, got "
                                    f"{value!r}")
        kind = ("tiny" if value in TINY_MODELS
                else "packaged" if value in catalog.packaged else "path")
        return cls(value, kind, where, key)

    @property
    def said(self) -> str:
        """The start of a message about it: ``FILE: key: 'value'``."""
        return f"{self.where}: {self.key}: {self.written!r}"

    @property
    def generated(self) -> bool:
        """Made by disagg (written or fetched), not brought by the user."""
        return self.kind != "path"

    @property
    def is_gguf(self) -> bool:
        return self.kind == "path" and self.written.lower().endswith(".gguf")

    @property
    def served_name(self) -> str:
        """The name clients send for it: as written (a path without its trailing slash)."""
        return self.written.rstrip("/") or self.written


@dataclass(frozen=True)
class GroupPlan:
    """The workers of one server section."""

    section: str  # context_servers | generation_servers
    where: str  # "FILE: section", for messages
    role: Role  # context | generation | aggregated
    config: ServerGroupConfig  # the validated section (urls, num_instances, router policy)
    model: ModelRef | None  # None: the YAML names none
    own_model: bool  # the section names its model (else it inherits the top level's)
    tokenizer: ModelRef | None  # the router's (router.tokenizer), when the section sets one
    # Worker keys the plan adds to the section's: a packaged model's (chat_template,
    # tool_call_parser), then served_model_name (the model as written) when the YAML names
    # none; what clients send and what the router renders prompts with follow from them.
    model_defaults: Mapping[str, Any]
    served_model_name: str | None
    options: WorkerOptions  # every option of the group's workers, typed (defaults filled in)

    @property
    def urls(self) -> tuple[str, ...]:
        return self.config.urls

    @property
    def world(self) -> int:
        """Ranks a worker runs: tensor_parallel_size * pipeline_parallel_size."""
        return self.options.world_size

    def worker_keys(self) -> dict[str, Any]:
        """The worker YAML of the group, as the cluster YAML spells it: the section's merged
        keys, the model's defaults, the served name."""
        keys = {k: v for k, v in self.config.worker_options.items() if v is not None}
        keys.update(self.model_defaults)
        if self.served_model_name is not None:
            keys["served_model_name"] = self.served_model_name
        return keys


@dataclass(frozen=True)
class ClusterPlan:
    source: str  # the YAML file (or "built-in demo")
    written: Mapping[str, Any]  # the YAML as written
    raw: Mapping[str, Any]  # the YAML as the plan reads it: the --model override applied
    config: ClusterConfig  # ``raw`` validated
    model: ModelRef | None  # the top level's
    groups: tuple[GroupPlan, ...]  # in SECTIONS order

    def group(self, section: str) -> GroupPlan | None:
        return next((g for g in self.groups if g.section == section), None)


def with_model(raw: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A copy of the YAML whose every group runs ``model`` (the top level's; the sections'
    own dropped)."""
    data = copy.deepcopy(dict(raw))
    data["model"] = model
    for section in SECTIONS:
        if isinstance(data.get(section), dict):
            data[section].pop("model", None)
    return data


def plan_cluster(raw: Any, source: str, *, catalog: ModelCatalog,
                 model_override: str | None = None) -> ClusterPlan:
    """Validate the cluster YAML ``raw`` (parsed; ``source`` names it) and plan its workers;
    ``RouterConfigError`` naming the file and the key."""
    config = parse_cluster_config(raw, source)  # as written: errors name the user's keys
    written = copy.deepcopy(dict(raw))
    data = written
    if model_override is not None:
        data = with_model(written, model_override)
        config = parse_cluster_config(data, source)
    top = (ModelRef.parse(data["model"], source, catalog)
           if data.get("model") is not None else None)
    groups = []
    for section in SECTIONS:
        group: ServerGroupConfig | None = getattr(config, section)
        if group is None:
            continue
        where = f"{source}: {section}"
        own = data[section].get("model")
        model = ModelRef.parse(own, where, catalog) if own is not None else top
        tokenizer = group.router.option("tokenizer")
        tokenizer_ref = (None if tokenizer is None else
                         ModelRef.parse(tokenizer, f"{where}: router", catalog, "tokenizer"))
        merged = group.worker_options
        defaults: Mapping[str, Any] = {}
        if model is not None and not any(merged.get(k) is not None
                                         for k in ("chat_template", "tool_call_parser")):
            defaults = dict(catalog.defaults.get(model.written, {}))
        served = (model.served_name if model is not None
                  and merged.get("served_model_name") is None else None)
        role = Role.AGGREGATED if config.context_servers is None else Role(group.role)
        added = {**defaults, **({"served_model_name": served} if served else {})}
        groups.append(GroupPlan(section, where, role, group, model, own is not None,
                                tokenizer_ref,
                                MappingProxyType(defaults), served,
                                group.options(role=role, **added)))
    return ClusterPlan(source, MappingProxyType(written), MappingProxyType(data), config, top,
                       tuple(groups))


def load_plan(path: str, *, catalog: ModelCatalog,
              model_override: str | None = None) -> ClusterPlan:
    """``plan_cluster`` of a cluster YAML file."""
    return plan_cluster(read_yaml(path, RouterConfigError), path, catalog=catalog,
                        model_override=model_override)
