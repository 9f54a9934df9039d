"""The cluster YAML: every shipped config loads, and each invalid case names file and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from disagg.contracts.cluster import (
    ClusterConfig,
    RouterConfigError,
    load_cluster_config,
    parse_cluster_config,
)
from disagg.contracts.options import load_worker_yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CLUSTER_KEYS = ("context_servers", "generation_servers", "disagg_cluster")


def _config_files() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_loads(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and any(k in data for k in CLUSTER_KEYS):
        cfg = load_cluster_config(path)
        assert cfg.generation_servers is not None or cfg.disagg_cluster is not None
    else:  # a worker YAML (disagg serve --config)
        load_worker_yaml(str(path))


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# The shape of a trtllm-serve disaggregated YAML (plus our `model` and a policy option).
TRTLLM_SHAPE = """
hostname: localhost
port: 8000
max_retries: 1
model: /models/tiny
context_servers:
  num_instances: 2
  router: {type: round_robin}
  tensor_parallel_size: 2
  urls: ["localhost:8001", "http://localhost:8002/"]
generation_servers:
  num_instances: 1
  router: {type: kv_cache_aware, load_weight: 0.5}
  pipeline_parallel_size: 2
  urls: ["localhost:8003"]
  cache_transceiver_config: {backend: TCP}
conditional_disagg_config: {max_local_prefill_length: 256}
"""


def test_trtllm_serve_shape(tmp_path: Path) -> None:
    path = tmp_path / "disagg.yaml"
    path.write_text(TRTLLM_SHAPE)
    cfg = load_cluster_config(path)
    assert isinstance(cfg, ClusterConfig) and not cfg.aggregated
    assert (cfg.hostname, cfg.port, cfg.max_retries, cfg.source) == (
        "localhost", 8000, 1, str(path))
    ctx, gen = cfg.context_servers, cfg.generation_servers
    assert ctx is not None and gen is not None
    assert ctx.role == "context" and gen.role == "generation"
    assert ctx.urls == ("localhost:8001", "localhost:8002")  # scheme and slash dropped
    assert ctx.num_instances == 2 and ctx.router.type == "round_robin"
    assert dict(ctx.worker_options) == {"model": "/models/tiny", "tensor_parallel_size": 2}
    assert dict(gen.worker_options) == {"model": "/models/tiny", "pipeline_parallel_size": 2,
                                        "cache_transceiver_config": {"backend": "TCP"}}
    assert gen.router.type == "kv_cache_aware"
    assert gen.router.option("load_weight") == 0.5 and gen.router.option("match_weight") == 1.0
    assert cfg.conditional_disagg is not None
    assert cfg.conditional_disagg.max_local_prefill_length == 256
    assert cfg.disagg_cluster is None and cfg.api_key is None


def test_public_metrics_is_the_routers_top_level_key_and_a_worker_key_in_sections() -> None:
    gen = {"urls": ["127.0.0.1:9001"], "api_key": "w", "public_metrics": True}
    cfg = parse_cluster_config({"api_key": "k", "generation_servers": gen})
    assert cfg.public_metrics is False  # the router's own: off unless said at the top level
    assert cfg.generation_servers is not None
    assert cfg.generation_servers.worker_options["public_metrics"] is True
    cfg = parse_cluster_config({"public_metrics": True, "generation_servers": GEN})
    assert cfg.public_metrics is True
    assert "public_metrics" not in cfg.generation_servers.worker_options  # not inherited
    with pytest.raises(RouterConfigError, match="public_metrics: expected bool"):
        parse_cluster_config({"public_metrics": "yes", "generation_servers": GEN})


def test_aggregated_cluster_is_valid(tmp_path: Path) -> None:
    cfg = load_cluster_config(_write(tmp_path, {
        "generation_servers": {"urls": ["127.0.0.1:9001", "127.0.0.1:9002"],
                               "router": {"type": "load_balancing", "use_tokens": True}}}))
    assert cfg.aggregated and cfg.context_servers is None
    gen = cfg.generation_servers
    assert gen is not None and gen.num_instances == 2  # defaults to len(urls)
    assert gen.router.type == "load_balancing" and gen.router.use_tokens
    assert cfg.port == 8000 and cfg.max_retries == 1


def test_same_inherited_value_in_a_section_is_fine() -> None:
    cfg = parse_cluster_config({"max_batch_size": 8, "generation_servers": {
        "urls": ["a:1"], "max_batch_size": 8}})
    assert cfg.generation_servers is not None
    assert cfg.generation_servers.worker_options["max_batch_size"] == 8


def test_dynamic_cluster_without_urls() -> None:
    cfg = parse_cluster_config({"disagg_cluster": {
        "cluster_uri": "http://localhost:8000",
        "minimal_instances": {"context_servers": 1, "generation_servers": 2},
        "heartbeat_interval_sec": 1, "inactive_timeout_sec": 3}}, "dyn.yaml")
    assert cfg.generation_servers is None and cfg.context_servers is None
    dc = cfg.disagg_cluster
    assert dc is not None and dict(dc.minimal_instances) == {"context_servers": 1,
                                                             "generation_servers": 2}
    assert (dc.heartbeat_interval_sec, dc.inactive_timeout_sec) == (1.0, 3.0)
    cfg = parse_cluster_config({"disagg_cluster": {}, "context_servers": {
        "num_instances": 2, "router": {"type": "load_balancing"}}})
    assert cfg.context_servers is not None and cfg.context_servers.urls == ()


GEN = {"urls": ["localhost:9001"]}
INVALID = [
    # (case, data, the message after "<file>: ")
    ("num_instances", {"context_servers": {"num_instances": 2, "urls": ["a:1"]},
                       "generation_servers": GEN},
     "context_servers.num_instances: 2 but 1 url(s)"),
    ("router type", {"generation_servers": {**GEN, "router": {"type": "random"}}},
     "generation_servers.router.type: unknown router type 'random'"),
    ("router option", {"generation_servers": {**GEN, "router": {"type": "round_robin",
                                                                "use_tokens": True}}},
     "generation_servers.router.use_tokens: unknown option of the round_robin router"),
    ("router weight type", {"generation_servers": {**GEN, "router": {
        "type": "kv_cache_aware", "load_weight": "high"}}},
     "generation_servers.router.load_weight: expected float, got 'high'"),
    ("conflict", {"tensor_parallel_size": 1, "context_servers": {
        "urls": ["a:1"], "tensor_parallel_size": 2}, "generation_servers": GEN},
     "context_servers.tensor_parallel_size: 2 conflicts with the top-level value 1"),
    ("bad url", {"generation_servers": {"urls": ["localhost"]}},
     "generation_servers.urls[0]: 'localhost' is not 'host:port'"),
    ("bad port", {"generation_servers": {"urls": ["localhost:99999"]}},
     "generation_servers.urls[0]: 'localhost:99999': port 99999 is out of range"),
    ("https", {"generation_servers": {"urls": ["https://a:1"]}},
     "generation_servers.urls[0]: 'https://a:1': only http:// workers are supported"),
    ("urls not a list", {"generation_servers": {"urls": "a:1"}},
     "generation_servers.urls: expected a list of 'host:port'"),
    ("duplicate url", {"generation_servers": {"urls": ["a:1", "http://a:1"]}},
     "generation_servers.urls[1]: a:1 is listed twice"),
    ("url in both", {"context_servers": {"urls": ["a:1"]}, "generation_servers": {
        "urls": ["a:1"]}}, "generation_servers.urls[0]: a:1 is also listed in context_servers"),
    ("no generation servers", {"context_servers": {"urls": ["a:1"]}},
     "generation_servers: missing"),
    ("missing urls", {"generation_servers": {"num_instances": 1}},
     "generation_servers.urls: missing"),
    ("empty urls", {"generation_servers": {"urls": []}}, "generation_servers.urls: empty"),
    ("unknown top key", {"generation_servers": GEN, "tensor_paralel_size": 2},
     "tensor_paralel_size: unknown key"),
    ("unknown section key", {"generation_servers": {**GEN, "max_batch": 2}},
     "generation_servers.max_batch: unknown key"),
    ("cluster-set key", {"generation_servers": {**GEN, "port": 9000}},
     "generation_servers.port: set by the cluster (from urls)"),
    ("role", {"generation_servers": {**GEN, "role": "context"}},
     "generation_servers.role: set by the cluster (from the section)"),
    ("worker value type", {"generation_servers": {**GEN, "max_batch_size": "8"}},
     "generation_servers.max_batch_size: expected int, got '8'"),
    ("worker choice", {"capacity_policy": "greedy", "generation_servers": GEN},
     "capacity_policy: 'greedy' is not one of"),
    ("transceiver", {"generation_servers": {**GEN, "cache_transceiver_config": {
        "backend": "NIXL"}}},
     "generation_servers.cache_transceiver_config: cache_transceiver_config.backend must be"),
    ("transceiver not a mapping", {"generation_servers": {**GEN,
                                                          "cache_transceiver_config": "TCP"}},
     "generation_servers.cache_transceiver_config: expected a mapping"),
    ("max_retries", {"generation_servers": GEN, "max_retries": -1},
     "max_retries: must be >= 0, got -1"),
    ("port", {"generation_servers": GEN, "port": "80"}, "port: expected int, got '80'"),
    ("port range", {"generation_servers": GEN, "port": 70000},
     "port: 70000 is not a port number"),
    ("health interval", {"generation_servers": GEN, "health_check_interval_sec": 0},
     "health_check_interval_sec: must be > 0, got 0.0"),
    ("negative weight", {"generation_servers": {**GEN, "router": {
        "type": "kv_cache_aware", "load_weight": -1}}},
     "generation_servers.router.load_weight: must be >= 0, got -1.0"),
    ("peer weight above 1", {"generation_servers": {**GEN, "router": {
        "type": "kv_cache_aware", "peer_reuse": True, "peer_weight": 1.5}}},
     "generation_servers.router.peer_weight: must be <= 1, got 1.5"),
    ("peer weight negative", {"generation_servers": {**GEN, "router": {
        "type": "kv_cache_aware", "peer_weight": -0.1}}},
     "generation_servers.router.peer_weight: must be >= 0, got -0.1"),
    ("peer min tokens", {"generation_servers": {**GEN, "router": {
        "type": "kv_cache_aware", "peer_min_tokens": 0}}},
     "generation_servers.router.peer_min_tokens: must be >= 1, got 0"),
    ("peer reuse type", {"context_servers": {"urls": ["a:1"], "router": {
        "type": "kv_cache_aware", "peer_reuse": "yes"}}, "generation_servers": GEN},
     "context_servers.router.peer_reuse: expected bool, got 'yes'"),
    ("peer reuse on round robin", {"generation_servers": {**GEN, "router": {
        "peer_reuse": True}}},
     "generation_servers.router.peer_reuse: unknown option of the round_robin router"),
    ("poll interval", {"generation_servers": {**GEN, "router": {
        "kv_events_poll_interval_sec": 0}}},
     "generation_servers.router.kv_events_poll_interval_sec: must be > 0, got 0.0"),
    ("negative instances", {"generation_servers": {**GEN, "num_instances": -1}},
     "generation_servers.num_instances: must be >= 0, got -1"),
    ("conditional missing", {"generation_servers": GEN, "conditional_disagg_config": {}},
     "conditional_disagg_config.max_local_prefill_length: missing"),
    ("minimal negative", {"disagg_cluster": {"minimal_instances": {"context_servers": -2}}},
     "disagg_cluster.minimal_instances.context_servers: must be >= 0, got -2"),
    ("conditional", {"generation_servers": GEN, "conditional_disagg_config": {
        "max_local_prefill_len": 3}},
     "conditional_disagg_config.max_local_prefill_len: unknown key"),
    ("cluster timeout", {"disagg_cluster": {"heartbeat_interval_sec": 5,
                                            "inactive_timeout_sec": 5}},
     "disagg_cluster.inactive_timeout_sec: 5.0 must exceed heartbeat_interval_sec"),
    ("minimal", {"disagg_cluster": {"minimal_instances": {"gen_servers": 1}}},
     "disagg_cluster.minimal_instances.gen_servers: unknown key"),
    ("cluster uri", {"disagg_cluster": {"cluster_uri": "etcd://x:2379"}},
     "disagg_cluster.cluster_uri: 'etcd://x:2379': workers register over http://"),
    ("not a mapping", ["a"], "expected a mapping of cluster keys, got list"),
]


@pytest.mark.parametrize("case,data,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_config_names_file_and_key(tmp_path: Path, case: str, data: dict,
                                           message: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(RouterConfigError) as info:
        load_cluster_config(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(RouterConfigError, match="missing.yaml: cannot read"):
        load_cluster_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation_servers: [\n")
    with pytest.raises(RouterConfigError, match="bad.yaml: invalid YAML"):
        load_cluster_config(bad)


def test_cli_reports_bad_config_and_serves_a_good_one(tmp_path: Path) -> None:
    import select
    import signal
    import subprocess
    import sys

    import httpx

    bad = _write(tmp_path, {"generation_servers": {"urls": ["a:1"], "num_instances": 3}})
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "router", "-c", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{bad}: generation_servers.num_instances: 3 but 1 url(s)" in proc.stderr
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"port": 8999, "generation_servers": {
        "urls": ["127.0.0.1:9"]}}))
    proc2 = subprocess.Popen([sys.executable, "-m", "disagg.cli", "router", "-c", str(good),
                              "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc2.stdout is not None
        ready, _, _ = select.select([proc2.stdout], [], [], 60)  # bounded wait for the line
        assert ready, "the router printed nothing in 60 s"
        line = proc2.stdout.readline()
        assert line.startswith("disagg router listening on http://127.0.0.1:"), (
            line, proc2.stderr.read() if proc2.poll() is not None else "")
        url = line.split()[-1]
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and "0/1 healthy generation" in r.json()["reason"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        proc2.send_signal(signal.SIGTERM)
        assert proc2.wait(30) == 0
    finally:
        if proc2.poll() is None:
            proc2.kill()
            proc2.wait(10)


def test_peer_reuse_options_and_defaults() -> None:
    """kv_cache_aware's peer_reuse options (KV prefix reuse across workers): defaults off, 0.5,
    64; set ones kept; a PolicyConfig built in code is checked as the YAML is."""
    from types import MappingProxyType

    from disagg.contracts.cluster import PolicyConfig

    cfg = parse_cluster_config({"context_servers": {"urls": ["a:1"], "router": {
        "type": "kv_cache_aware", "peer_reuse": True, "peer_weight": 1, "peer_min_tokens": 16}},
        "generation_servers": {**GEN, "router": {"type": "kv_cache_aware"}}}, "t.yaml")
    assert cfg.context_servers is not None and cfg.generation_servers is not None
    ctx, gen = cfg.context_servers.router, cfg.generation_servers.router
    assert (ctx.option("peer_reuse"), ctx.option("peer_weight"),
            ctx.option("peer_min_tokens")) == (True, 1.0, 16)
    assert (gen.option("peer_reuse"), gen.option("peer_weight"),
            gen.option("peer_min_tokens")) == (False, 0.5, 64)
    with pytest.raises(RouterConfigError, match=r"router\.peer_weight: must be <= 1, got 2"):
        PolicyConfig("kv_cache_aware", options=MappingProxyType({"peer_weight": 2}))
    with pytest.raises(RouterConfigError, match=r"router\.peer_min_tokens: expected int"):
        PolicyConfig("kv_cache_aware", options=MappingProxyType({"peer_min_tokens": 1.5}))
