"""One plan from a cluster YAML (contracts/plan.py) for `disagg launch` and `disagg deploy`:
roles, typed options, one model reference (its kind, the served name, a packaged model's
defaults, the --model override), and the two materialisers built on it (launch: local paths;
deploy: paths on the target). Offline: nothing is fetched or started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg.contracts.cluster import RouterConfigError
from disagg.contracts.plan import ModelCatalog, ModelRef, plan_cluster
from disagg.contracts.roles import Role
from disagg.deploy.plan import DeployError, target_model
from disagg.launch import LaunchError, local_model, model_catalog

CATALOG = ModelCatalog(frozenset({"packed"}), {"packed": {"tool_call_parser": "hermes"}})


def _plan(data: dict[str, Any], **kw: Any) -> Any:
    return plan_cluster(data, "c.yaml", catalog=CATALOG, **kw)


def test_groups_roles_and_options() -> None:
    plan = _plan({"model": "tiny", "kv_lease_ttl_s": 5,
                  "context_servers": {"urls": ["h:1"], "tensor_parallel_size": 2},
                  "generation_servers": {"urls": ["h:2", "h:3"], "drain_timeout": 7}})
    ctx, gen = plan.groups
    assert (ctx.role, gen.role) == (Role.CONTEXT, Role.GENERATION)
    assert ctx.world == 2 and gen.world == 1 and gen.urls == ("h:2", "h:3")
    assert ctx.options.kv_lease_ttl_s == gen.options.kv_lease_ttl_s == 5.0
    assert gen.options.drain_timeout == 7.0 and ctx.options.drain_timeout == 30.0
    assert ctx.options.role is Role.CONTEXT and ctx.options.model == "tiny"
    (agg,) = _plan({"model": "tiny", "generation_servers": {"urls": ["h:2"]}}).groups
    assert agg.role is Role.AGGREGATED and agg.options.role is Role.AGGREGATED


def test_model_refs_served_names_and_packaged_defaults() -> None:
    plan = _plan({"context_servers": {"urls": ["h:1"], "model": "/ckpt/m/",
                                      "served_model_name": "mine"},
                  "generation_servers": {"urls": ["h:2"], "model": "/ckpt/m/"}})
    ctx, gen = plan.groups
    assert plan.model is None and ctx.own_model and gen.own_model
    assert ctx.model == ModelRef("/ckpt/m/", "path", "c.yaml: context_servers")
    assert ctx.served_model_name is None  # the YAML names it
    assert gen.served_model_name == "/ckpt/m" and gen.options.served_model_name == "/ckpt/m"
    # a packaged model at the top level, inherited: served as written, with its defaults
    plan = _plan({"model": "packed", "generation_servers": {"urls": ["h:2"]}})
    (gen,) = plan.groups
    assert plan.model == ModelRef("packed", "packaged", "c.yaml")
    assert gen.model is plan.model and not gen.own_model and gen.model.generated
    assert gen.model_defaults == {"tool_call_parser": "hermes"}
    assert gen.options.tool_call_parser == "hermes"
    assert gen.worker_keys() == {"model": "packed", "tool_call_parser": "hermes",
                                 "served_model_name": "packed"}
    assert ModelRef.parse("/x/m.GGUF", "w", CATALOG).is_gguf
    assert ModelRef.parse("/x/", "w", CATALOG).served_name == "/x"
    # the YAML's own parser or template: no defaults
    plan = _plan({"model": "packed", "tool_call_parser": "mistral",
                  "generation_servers": {"urls": ["h:2"]}})
    assert plan.groups[0].model_defaults == {}


def test_the_model_override_replaces_every_groups_model() -> None:
    data = {"model": "tiny", "context_servers": {"urls": ["h:1"]},
            "generation_servers": {"urls": ["h:2"], "model": "tiny"}}
    plan = _plan(data, model_override="/other")
    assert [g.model.written for g in plan.groups] == ["/other", "/other"]
    assert not any(g.own_model for g in plan.groups)
    assert plan.written["generation_servers"]["model"] == "tiny"  # as written, kept
    assert "model" not in plan.raw["generation_servers"]
    assert data["generation_servers"]["model"] == "tiny"  # the caller's data untouched


@pytest.mark.parametrize("data, words", [
    ({"model": "", "generation_servers": {"urls": ["h:2"]}},
     "c.yaml: model: expected a checkpoint folder, a .gguf file, 'tiny', 'tiny-moe' or "
     "'packed', got ''"),
    ({"generation_servers": {"urls": ["h:2"], "model": " "}},
     "c.yaml: generation_servers: model: expected"),
    ({"model": "tiny", "generation_servers": {"urls": ["h:2"], "router": {
        "type": "kv_cache_aware", "tokenizer": ""}}},
     "c.yaml: generation_servers: router: tokenizer: expected"),
    ({"model": "tiny", "generation_servers": {"urls": ["h:2"], "num_instances": 3}},
     "c.yaml: generation_servers.num_instances: 3 but 1 url(s)"),
])
def test_bad_yaml_is_a_config_error_naming_the_key(data: dict[str, Any], words: str) -> None:
    with pytest.raises(RouterConfigError) as err:
        _plan(data)
    assert words in str(err.value)


def test_the_two_materialisers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = model_catalog()
    assert "smollm2" in catalog.packaged and "smollm2" in catalog.defaults
    folder = tmp_path / "ckpt"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    ref = ModelRef.parse("ckpt", "c.yaml", catalog)
    # launch: here, checked; deploy: where the target has it (absolute, or refused)
    assert local_model(ref) == str(folder)
    assert target_model(ref, "/models", absolute_only=False).path == str(folder)
    with pytest.raises(DeployError, match="c.yaml: model: 'ckpt': give an absolute path"):
        target_model(ref, "/models", absolute_only=True)
    with pytest.raises(LaunchError, match="c.yaml: model: 'gone' is not a folder"):
        local_model(ModelRef.parse("gone", "c.yaml", catalog))
    packaged = ModelRef.parse("smollm2", "c.yaml", catalog)
    source = target_model(packaged, "/models", absolute_only=True)
    # the GGUF file itself, served as a .gguf (gguf_weights applies), not a float32 import
    assert source.path == "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and source.generated
    assert source.mount_dir == "/models/smollm2"
    assert source.prepare_args() == ("model", "fetch", "smollm2", "/models/smollm2", "--gguf")
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    tiny = ModelRef.parse("tiny", "c.yaml", catalog)
    assert Path(local_model(tiny), "config.json").is_file()
    assert target_model(tiny, "models", absolute_only=False).prepare_args() == (
        "model", "tiny", "models/tiny")
