"""One options schema, ``WorkerOptions`` (contracts/options.py): each default written once, on
its field, and read from there by every surface (``--help``, the worker YAML, the cluster YAML,
``ServerSettings`` / ``DisaggSettings``, the lease table, the transceiver config, deploy); the
lease TTL's user-facing spellings; the YAML round trip ``disagg bench`` relies on."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from disagg.config import ConfigError, SchedulerConfig
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.contracts.options import (
    ENGINE_OPTIONS,
    WORKER_DEFAULTS,
    WORKER_OPTIONS,
    CacheTransceiverConfig,
    WorkerOptions,
    load_worker_yaml,
    option_help,
    worker_yaml,
    worker_yaml_keys,
)
from disagg.contracts.roles import Role
from disagg.kv_connector.settings import DisaggSettings
from disagg.server.cli import add_cli
from disagg.server.state import ServerSettings
from disagg.transfer.lease import LeaseTable


def test_every_field_is_an_option_with_its_default() -> None:
    for f in fields(WorkerOptions):
        opt = f.metadata["opt"]
        assert opt.default == f.default, f.name
        # An engine option's default is the engine's (None: unset), never a second copy.
        assert not opt.engine or f.default is None, f.name
    assert set(ENGINE_OPTIONS) <= set(WORKER_OPTIONS)


def test_help_shows_the_defaults_where_they_are_written() -> None:
    assert option_help("drain_timeout").endswith(f"(default {WORKER_DEFAULTS.drain_timeout:g})")
    assert option_help("max_num_tokens").endswith(
        f"(default {SchedulerConfig().max_num_tokens})")  # the engine's own
    # the lease TTL: the flag's help names the YAML spelling
    assert option_help("kv_lease_ttl_s").endswith("(default 30; YAML: kv_lease_ttl_s)")


def test_the_settings_take_their_defaults_from_the_options() -> None:
    server = ServerSettings(model_dir="m")
    for name in ("role", "public_metrics", "benchmark_gen_only", "responses_store_size",
                 "responses_store_ttl"):
        assert getattr(server, name) == getattr(WORKER_DEFAULTS, name), name
    disagg = DisaggSettings(Role.CONTEXT, "t", backend="TCP")
    assert disagg.kv_lease_ttl_s == WORKER_DEFAULTS.kv_lease_ttl_s
    assert disagg.host == WORKER_DEFAULTS.host
    assert LeaseTable().default_ttl_s == WORKER_DEFAULTS.kv_lease_ttl_s
    assert CacheTransceiverConfig().ucx_profile == WORKER_DEFAULTS.ucx_profile == "auto"


def test_disagg_settings_from_options_resolve_the_ucx_profile() -> None:
    def settings(advertise: str | None, **values: object) -> DisaggSettings:
        opts = WorkerOptions(model="m", role="generation", kv_lease_ttl_s=5,
                             kv_peer_allowlist=["10.0.0.0/24"], **values)
        return DisaggSettings.from_options(opts, cluster_token="t", backend="UCX",
                                           advertise_host=advertise)

    s = settings(None)
    # auto, judged by the address peers use: loopback -> same_host, else cross_host
    assert s.ucx_profile == "same_host" and s.host == "127.0.0.1"
    assert s.kv_lease_ttl_s == 5.0 and s.role == Role.GENERATION
    assert s.kv_peer_allowlist.allows_host("10.0.0.7")
    assert settings("10.213.0.11").ucx_profile == "cross_host"
    assert settings("10.213.0.11", ucx_profile="same_host").ucx_profile == "same_host"
    assert settings(None, kv_transfer_host="0.0.0.0").host == "0.0.0.0"


@pytest.mark.parametrize("values, words", [
    ({"port": "80"}, "port: expected int"),
    ({"role": "boss"}, "role: 'boss' is not one of"),
    ({"responses_store_size": -1}, "responses_store_size: must be >= 0"),
    ({"pp_partition": [1, "x"]}, "pp_partition: expected a list of integers"),
])
def test_bad_options_name_the_field(values: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        WorkerOptions(**values)


def test_options_are_frozen_and_normalized() -> None:
    opts = WorkerOptions(model="m", role="context", pp_partition=[3, 1], kv_lease_ttl_s=5,
                         allowed_origins=["http://a:1"])
    assert opts.role is Role.CONTEXT and opts.pp_partition == (3, 1)
    assert opts.kv_lease_ttl_s == 5.0 and isinstance(opts.kv_lease_ttl_s, float)
    assert hash(opts) == hash(WorkerOptions(**{f.name: getattr(opts, f.name)
                                               for f in fields(opts)}))
    assert opts.engine_options() == {"pp_partition": (3, 1)}
    assert WorkerOptions(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_lease_ttl_spellings(tmp_path: Path) -> None:
    """One name inside (kv_lease_ttl_s); --kv-lease-ttl, the YAMLs' kv_lease_ttl_s and a
    worker file's kv_lease_ttl keep working; the cluster YAML takes kv_lease_ttl_s only."""
    p = tmp_path / "w.yaml"
    for key in ("kv_lease_ttl_s", "kv_lease_ttl"):
        p.write_text(f"{key}: 4\n")
        assert load_worker_yaml(str(p)) == {"kv_lease_ttl_s": 4.0}
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    assert parser.parse_args(["serve", "m", "--kv-lease-ttl", "3"]).kv_lease_ttl_s == 3.0
    cfg = parse_cluster_config({"kv_lease_ttl_s": 4, "generation_servers": {
        "urls": ["h:1"]}}, "c.yaml")
    assert cfg.generation_servers.options().kv_lease_ttl_s == 4.0
    with pytest.raises(RouterConfigError, match="kv_lease_ttl: unknown key"):
        parse_cluster_config({"kv_lease_ttl": 4, "generation_servers": {"urls": ["h:1"]}},
                             "c.yaml")
    # the UCX profile has no key of its own: cache_transceiver_config.ucx_profile
    assert "ucx_profile" not in worker_yaml_keys(aliases=True)


def test_worker_yaml_round_trip(tmp_path: Path) -> None:
    """Options read from a worker file -> the cluster YAML's spelling (what `disagg bench
    rate-match --verify-worker-config` writes into its cluster) -> the same options."""
    p = tmp_path / "w.yaml"
    p.write_text("kv_lease_ttl: 5\nmax_batch_size: 8\npp_partition: [1, 1]\n"
                 "pipeline_parallel_size: 2\nkv_peer_allowlist: [ctx-0]\n"
                 "cache_transceiver_config: {backend: tcp, ucx_profile: cross_host}\n")
    opts = load_worker_yaml(str(p))
    keys = worker_yaml(opts)
    assert keys["kv_lease_ttl_s"] == 5.0 and keys["cache_transceiver_config"] == {
        "backend": "TCP", "ucx_profile": "cross_host"}
    cfg = parse_cluster_config({**keys, "generation_servers": {"urls": ["h:1"]}}, "c.yaml")
    assert cfg.generation_servers.options() == WorkerOptions(**opts)
    # a profile without a backend stays a profile (the worker picks the backend)
    p.write_text("cache_transceiver_config: {ucx_profile: same_host}\n")
    assert worker_yaml(load_worker_yaml(str(p))) == {
        "cache_transceiver_config": {"ucx_profile": "same_host"}}
    assert worker_yaml({"role": Role.CONTEXT}) == {"role": "context"}
    with pytest.raises(ValueError, match="nope: not a worker option"):
        worker_yaml({"nope": 1})


def test_bench_verify_cluster_keeps_every_worker_option(tmp_path: Path) -> None:
    """`disagg bench rate-match --verify`: the worker options of --verify-worker-config reach
    the launched cluster's YAML, the UCX profile and the lease TTL included."""
    from disagg.bench.ratematch.verify import LaunchedCluster

    p = tmp_path / "w.yaml"
    p.write_text("kv_lease_ttl: 5\ncache_transceiver_config: {ucx_profile: cross_host}\n")
    cluster = LaunchedCluster("/m", "tiny", 1, 1, worker_yaml(load_worker_yaml(str(p))),
                              str(tmp_path))
    cfg = parse_cluster_config(cluster.cluster_yaml([8000, 8001, 8002]), "verify.yaml")
    for group in (cfg.context_servers, cfg.generation_servers):
        assert group is not None
        opts = group.options()
        assert opts.kv_lease_ttl_s == 5.0 and opts.ucx_profile == "cross_host"
        assert opts.kv_transfer_backend == "TCP"  # the verifier's default backend
