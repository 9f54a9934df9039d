"""``speculative_config`` on every surface: ``SpeculativeConfig.parse`` (JSON text, a mapping;
every error names its key), ``disagg serve --speculative-config JSON`` and the worker YAML, the
cluster YAML (a mapping or its JSON text) through ``disagg launch`` and ``disagg deploy`` (the
draft model's path treated as ``model``'s), the ``disagg_spec_decode_*`` metrics and
``/server_info``. No model runs: the engine is a stand-in (``StoppedEngine``)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import StoppedEngine, free_port, serve_in_thread

from disagg.config import ConfigError, SpeculativeConfig, build_engine_config
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.contracts.options import (
    ENGINE_OPTIONS,
    WorkerOptions,
    load_worker_yaml,
    option_help,
    worker_yaml,
)
from disagg.deploy.plan import DeployError
from disagg.deploy.plan import build_plan as deploy_plan
from disagg.engine.outputs import EngineStats
from disagg.launch import LaunchError, build_plan
from disagg.server.cli import add_cli, resolve_options
from disagg.server.metrics import ServerMetrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 3}


# ---- SpeculativeConfig.parse ------------------------------------------------------------------


def test_parse_valid_json_and_mappings() -> None:
    for value in (NGRAM, json.dumps(NGRAM)):
        spec = SpeculativeConfig.parse(value)
        assert spec == SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)
    for value in (DRAFT, json.dumps(DRAFT)):
        spec = SpeculativeConfig.parse(value)
        assert (spec.method, spec.model, spec.num_speculative_tokens) == (
            "draft_model", "/path/to/draft", 3)
        assert spec.prompt_lookup_min is None and spec.prompt_lookup_max is None
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(spec) is spec


@pytest.mark.parametrize("given, bounds", [
    ({}, (1, 4)),  # n-grams of 1 to 4 tokens
    ({"prompt_lookup_min": 2}, (2, 2)),  # one bound given: the other equals it
    ({"prompt_lookup_max": 5}, (5, 5)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6)),
])
def test_ngram_lookup_bounds_default(given: dict[str, int], bounds: tuple[int, int]) -> None:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == bounds


@pytest.mark.parametrize("value, key", [
    ({**NGRAM, "draft_tokens": 3}, "speculative_config.draft_tokens: unknown key"),
    ({"num_speculative_tokens": 3}, "speculative_config.method: required"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: required"),
    ({**NGRAM, "method": "eagle"}, "speculative_config.method: one of"),
    ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens: must"),
    ({**NGRAM, "num_speculative_tokens": 33}, "speculative_config.num_speculative_tokens: must"),
    ({**NGRAM, "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens: m"),
    ({**NGRAM, "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({**NGRAM, "model": "/d"}, "speculative_config.model: is for method draft_model only"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model: "),
    ({**DRAFT, "model": ""}, "speculative_config.model: method draft_model needs"),
    ({**DRAFT, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max: is for method "
                                        "ngram only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min: must be <= "),
    ({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 0},
     "speculative_config.prompt_lookup_max: must be an "),
    ('{"method": "ngram",', "speculative_config: not valid JSON"),
    ("[1, 2]", "speculative_config: must be a JSON object"),
    (7, "speculative_config: must be a JSON object"),
])
def test_parse_errors_name_the_key(value: Any, key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        SpeculativeConfig.parse(value)
    assert str(ei.value).startswith(key), str(ei.value)


def test_build_engine_config_takes_it(tiny_llama: str) -> None:
    assert "speculative_config" in ENGINE_OPTIONS
    assert build_engine_config(tiny_llama).speculative is None
    cfg = build_engine_config(tiny_llama, speculative_config=json.dumps(NGRAM))
    assert cfg.speculative == SpeculativeConfig.parse(NGRAM)


# ---- disagg serve: the flag and the worker YAML ------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers())
    return p


def test_serve_flag(tmp_path: Path) -> None:
    args = _parser().parse_args(["serve", "/m", "--speculative-config", json.dumps(NGRAM)])
    opts = resolve_options(args)
    assert opts.speculative_config == SpeculativeConfig.parse(NGRAM)
    assert opts.engine_options() == {"speculative_config": opts.speculative_config}
    hash(opts)  # still a frozen, hashable value
    assert resolve_options(_parser().parse_args(["serve", "/m"])).speculative_config is None
    # the worker YAML: a mapping or its JSON text; the flag beats it
    cfg = tmp_path / "w.yaml"
    for value in (DRAFT, json.dumps(DRAFT)):
        cfg.write_text(yaml.safe_dump({"model": "/m", "speculative_config": value}))
        opts = resolve_options(_parser().parse_args(["serve", "--config", str(cfg)]))
        assert opts.speculative_config == SpeculativeConfig.parse(DRAFT)
    args = _parser().parse_args(["serve", "--config", str(cfg), "--speculative-config",
                                 json.dumps(NGRAM)])
    assert resolve_options(args).speculative_config.method == "ngram"
    assert "--speculative-config JSON" in _parser()._subparsers._group_actions[0].choices[
        "serve"].format_help()
    assert '"method": "ngram"' in option_help("speculative_config")


@pytest.mark.parametrize("value, words", [
    ('{"method": "ngram"', "speculative_config: not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method: one of"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative_config.model: "),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}',
     "speculative_config.k: unknown key"),
])
def test_serve_flag_errors_name_the_field(value: str, words: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from disagg.cli import main

    with pytest.raises(SystemExit) as ei:
        main(["serve", "/nonexistent", "--speculative-config", value])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"disagg serve: error: argument --speculative-config: {words}" in err, err
    assert "Traceback" not in err


def test_worker_yaml_errors_name_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "w.yaml"
    for value, words in ((["ngram"], "speculative_config: must be a JSON object"),
                         ({"method": "ngram", "num_speculative_tokens": 99},
                          "speculative_config.num_speculative_tokens: must be")):
        cfg.write_text(yaml.safe_dump({"speculative_config": value}))
        with pytest.raises(ConfigError, match=re.escape(f"{cfg}: {words}")):
            load_worker_yaml(str(cfg))
    with pytest.raises(ConfigError, match=r"worker options: speculative_config\.method"):
        WorkerOptions(speculative_config={"method": "x", "num_speculative_tokens": 1})


def test_worker_yaml_round_trip(tmp_path: Path) -> None:
    """Options -> the cluster YAML's spelling (a mapping) -> the same options."""
    keys = worker_yaml({"speculative_config": WorkerOptions(
        speculative_config=NGRAM).speculative_config})
    assert keys == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_min": 3, "prompt_lookup_max": 3}}
    cfg = parse_cluster_config({**keys, "generation_servers": {"urls": ["h:1"]}}, "c.yaml")
    assert cfg.generation_servers.options().speculative_config == SpeculativeConfig.parse(NGRAM)


# ---- the cluster YAML -------------------------------------------------------------------------


def test_cluster_yaml_mapping_or_json_text() -> None:
    for value in (DRAFT, json.dumps(DRAFT)):
        for data in ({"speculative_config": value, "generation_servers": {"urls": ["h:1"]}},
                     {"generation_servers": {"urls": ["h:1"], "speculative_config": value}}):
            group = parse_cluster_config(data, "c.yaml").generation_servers
            assert group.worker_options["speculative_config"] == DRAFT  # the YAML's mapping
            assert group.options().speculative_config == SpeculativeConfig.parse(DRAFT)
    # the same config spelled both ways at both levels is no conflict; another one is
    data = {"speculative_config": json.dumps(DRAFT),
            "generation_servers": {"urls": ["h:1"], "speculative_config": DRAFT}}
    parse_cluster_config(data, "c.yaml")
    data["generation_servers"]["speculative_config"] = NGRAM
    with pytest.raises(RouterConfigError, match="generation_servers.speculative_config: .* "
                                                "conflicts with the top-level value"):
        parse_cluster_config(data, "c.yaml")


@pytest.mark.parametrize("value, words", [
    ({"method": "ngram", "num_speculative_tokens": 40},
     "c.yaml: generation_servers.speculative_config.num_speculative_tokens: must be"),
    ('{"method": "ngram", "model": "/d", "num_speculative_tokens": 2}',
     "c.yaml: generation_servers.speculative_config.model: is for method draft_model only"),
    ("{", "c.yaml: generation_servers.speculative_config: not valid JSON"),
    (3, "c.yaml: generation_servers.speculative_config: must be a JSON object"),
])
def test_cluster_yaml_errors_name_file_and_key(value: Any, words: str) -> None:
    with pytest.raises(RouterConfigError) as ei:
        parse_cluster_config({"generation_servers": {"urls": ["h:1"],
                                                     "speculative_config": value}}, "c.yaml")
    assert str(ei.value).startswith(words), str(ei.value)


def _cluster(spec: Any, model: str, top: bool = False) -> dict[str, Any]:
    gen: dict[str, Any] = {"urls": [f"127.0.0.1:{free_port()}"]}
    data: dict[str, Any] = {"hostname": "127.0.0.1", "port": 0, "model": model}
    (data if top else gen)["speculative_config"] = spec
    return {**data, "generation_servers": gen}


def _launch(tmp_path: Path, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = build_plan(str(path), tmp_path / "logs")
    return plan, yaml.safe_load((tmp_path / "logs" / "gen0.yaml").read_text())


def test_launch_passes_it_to_the_workers(tmp_path: Path, tiny_llama: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's YAML (``disagg serve --config``) holds the mapping, a relative draft
    folder made absolute as ``model`` is; the router's copy of the YAML reads it too."""
    draft = Path(tiny_llama)
    monkeypatch.chdir(draft.parent)  # a relative draft folder, as a YAML next to it names it
    spec = {**DRAFT, "model": draft.name}
    for value, top in ((spec, False), (json.dumps(spec), True), (NGRAM, False)):
        plan, worker = _launch(tmp_path, _cluster(value, tiny_llama, top))
        want = (SpeculativeConfig.parse(NGRAM) if value is NGRAM
                else SpeculativeConfig.parse({**DRAFT, "model": str(draft)}))
        (gen,) = plan.workers
        config = gen.cmd[gen.cmd.index("--config") + 1]
        assert yaml.safe_load(Path(config).read_text()) == worker
        opts = resolve_options(_parser().parse_args(["serve", "--config", config]))
        assert opts.speculative_config == want
        assert isinstance(worker["speculative_config"], dict)
        parse_cluster_config(yaml.safe_load(plan.cluster_yaml.read_text()), "router")
    with pytest.raises(LaunchError, match=r"generation_servers: speculative_config\.model: "
                                          r"'no-such-draft': the draft checkpoint is not a "
                                          r"folder"):
        _launch(tmp_path, _cluster({**DRAFT, "model": "no-such-draft"}, tiny_llama))
    with pytest.raises(LaunchError, match=r"generation_servers\.speculative_config\.method"):
        _launch(tmp_path, _cluster({**NGRAM, "method": "x"}, tiny_llama))


def _deploy(tmp_path: Path, data: dict[str, Any], absolute_only: bool = False) -> Any:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return deploy_plan(str(path), models_dir="/models", absolute_only=absolute_only,
                       minimal_instances="one")


def test_deploy_renders_it_into_the_worker_yamls(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.deploy import k8s, slurm
    from disagg.deploy.plan import dump_yaml

    monkeypatch.chdir(tmp_path)
    spec = {**DRAFT, "model": "/data/llama/draft"}
    data = {"port": 8000, "model": "/data/llama", "speculative_config": json.dumps(spec),
            "generation_servers": {"urls": ["h:8002"]}}
    plan = _deploy(tmp_path, data, absolute_only=True)
    (g,) = plan.groups
    assert g.options["speculative_config"] == spec
    assert yaml.safe_load(dump_yaml(g.options))["speculative_config"] == spec
    parse_cluster_config(dict(plan.router_options), "router.yaml")  # the router reads it
    out = k8s.write(plan, k8s.K8sOptions(model_pvc="models"), tmp_path / "k8s",
                    "disagg deploy k8s")
    configmap = next(yaml.safe_load(p.read_text()) for p in out if "config" in p.name)
    assert yaml.safe_load(configmap["data"]["aggregated.yaml"])["speculative_config"] == spec
    script = slurm.write(plan, slurm.SlurmOptions(), tmp_path / "job.sbatch",
                         "disagg deploy slurm").read_text()
    heredoc = re.search(r"cat > aggregated.yaml <<'DISAGG_EOF'\n(.*?)\nDISAGG_EOF", script,
                        re.S)
    assert heredoc and yaml.safe_load(heredoc.group(1))["speculative_config"] == spec
    # a relative draft: absolute here (Slurm), an error where a container reads it (k8s)
    data["speculative_config"] = {**DRAFT, "model": "drafts/small"}
    (g,) = _deploy(tmp_path, data).groups
    assert g.options["speculative_config"]["model"] == str(tmp_path / "drafts" / "small")
    with pytest.raises(DeployError, match=r"generation_servers\.speculative_config\.model: "
                                          r"'drafts/small': give an absolute path"):
        _deploy(tmp_path, data, absolute_only=True)
    # a pod mounts the model's volume only: a draft outside it would not be there
    data["speculative_config"] = {**DRAFT, "model": "/data/other-draft"}
    with pytest.raises(DeployError, match=r"speculative_config\.model: '/data/other-draft': "
                                          r"a pod sees only the model volume \(mounted at "
                                          r"/data/llama\)"):
        k8s.write(_deploy(tmp_path, data, absolute_only=True),
                  k8s.K8sOptions(model_pvc="models"), tmp_path / "k8s2", "disagg deploy k8s")


# ---- /metrics and /server_info ----------------------------------------------------------------


def _stats(**spec: Any) -> EngineStats:
    return EngineStats(num_running=1, num_waiting=0, num_preempted_total=0, kv_blocks_used=2,
                       kv_blocks_total=8, kv_blocks_cached=0, prefix_cache_queries_tokens=0,
                       prefix_cache_hit_tokens=0, last_step_batch_size=1,
                       last_step_num_tokens=4, steps_total=5, **spec)


class _SpecEngine(StoppedEngine):
    def __init__(self, stats: EngineStats, config: Any = None) -> None:
        super().__init__(config)
        self.stats_value = stats

    def stats(self) -> EngineStats:
        return self.stats_value

    def is_healthy(self) -> bool:
        return True


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render()[0].decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_spec_decode_metrics() -> None:
    # 10 verification rows of 4 draft tokens: 25 accepted, 9/7/5/4 at positions 0..3
    engine = _SpecEngine(_stats(spec_num_drafts=10, spec_num_draft_tokens=40,
                                spec_num_accepted_tokens=25, spec_accepted_per_pos=(9, 7, 5, 4)))
    s = _samples(ServerMetrics(engine, "tiny"))
    lbl = (("model_name", "tiny"),)
    assert s[("disagg_spec_decode_num_drafts_total", lbl)] == 10
    assert s[("disagg_spec_decode_num_draft_tokens_total", lbl)] == 40
    assert s[("disagg_spec_decode_num_accepted_tokens_total", lbl)] == 25
    for pos, n in enumerate((9, 7, 5, 4)):
        assert s[("disagg_spec_decode_num_accepted_tokens_per_pos_total",
                  (("model_name", "tiny"), ("position", str(pos))))] == n
    assert s[("disagg_spec_decode_acceptance_rate", lbl)] == 25 / 40
    assert s[("disagg_spec_decode_mean_tokens_per_forward", lbl)] == (25 + 10) / 10
    assert s[("disagg_engine_steps_total", lbl)] == 5  # the others are unchanged


def test_spec_decode_metrics_only_when_speculating(tiny_llama: str) -> None:
    def names(engine: StoppedEngine) -> set[str]:
        return {name for name, _ in _samples(ServerMetrics(engine, "tiny"))}

    assert not {n for n in names(_SpecEngine(_stats())) if "spec_decode" in n}
    # configured, nothing drafted yet: the counters at 0, the ratios 0 (no division by 0)
    cfg = build_engine_config(tiny_llama, speculative_config=NGRAM)
    s = _samples(ServerMetrics(_SpecEngine(_stats(), cfg), "tiny"))
    lbl = (("model_name", "tiny"),)
    assert s[("disagg_spec_decode_num_drafts_total", lbl)] == 0
    assert s[("disagg_spec_decode_acceptance_rate", lbl)] == 0
    assert s[("disagg_spec_decode_mean_tokens_per_forward", lbl)] == 0


def test_server_info_shows_the_speculative_config(tiny_llama: str) -> None:
    from disagg.server.app import ServerSettings, build_app

    for options, want in (({}, None),
                          ({"speculative_config": json.dumps(NGRAM)},
                           {"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 3, "prompt_lookup_max": 3}),
                          ({"speculative_config": DRAFT}, DRAFT)):
        engine = StoppedEngine(build_engine_config(tiny_llama, **options))
        app = build_app(engine, ServerSettings(model_dir=tiny_llama, owns_engine=False))
        with serve_in_thread(app) as url:
            info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["speculative_config"] == want


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_disable_by_batch_size_is_a_positive_integer(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^speculative_config\.disable_by_batch_size: "):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "disable_by_batch_size": value})
    ok = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                 '"disable_by_batch_size": 8}')
    assert ok is not None and ok.disable_by_batch_size == 8
