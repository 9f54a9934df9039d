"""``disagg deploy k8s``: the manifests rendered from every file in configs/ validate against the
Kubernetes OpenAPI schemas (``kubernetes-validate``, strict: no unknown fields; its schemas ship
in the wheel, no network), and they keep the invariants a deployment depends on: ports from the
YAML, replicas = num_instances, GPUs = tp * pp, every member's cluster token from the Secret (no
literal token anywhere), a grace period covering the drain, worker commands that disagg's own
parser accepts, config files that disagg's own loaders accept. The checked-in example rendering
in deploy/k8s/ is what the command writes today."""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.cli import build_parser
from disagg.cli import main as disagg_main
from disagg.contracts.cluster import load_cluster_config
from disagg.contracts.options import load_worker_yaml
from disagg.router.cli import configured

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# The oldest Kubernetes minor still widely run and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
VARIANTS = {
    "gpu": (),
    "cpu": ("--cpu", "--namespace", "llm", "--name", "chat", "--service-type", "LoadBalancer"),
    "pvc": ("--model", "/models/llama", "--model-pvc", "llama-weights", "--secret",
            "--drain-timeout", "90", "--image", "registry.example/disagg:1"),
    "hostpath": ("--model", "/data/m.gguf", "--model-host-path", "/srv/models", "--cpu"),
}


def render(out: Path, config: Path | str, *extra: str) -> dict[str, list[dict[str, Any]]]:
    assert disagg_main(["deploy", "k8s", "-c", str(config), "-o", str(out), *extra]) == 0
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted(out.glob("*.yaml"))}


def by_kind(files: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for docs in files.values() for d in docs
            if d["kind"] == kind}


@pytest.fixture(scope="module", params=[(c, v) for c in CONFIGS for v in VARIANTS],
                ids=[f"{c.stem}-{v}" for c in CONFIGS for v in VARIANTS])
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[dict[str, Any], tuple[str, ...], dict[str, list[dict[str, Any]]]]:
    config, variant = request.param
    files = render(tmp_path_factory.mktemp("k8s"), config, *VARIANTS[variant])
    return yaml.safe_load(config.read_text()), VARIANTS[variant], files


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_openapi_schemas(rendered: Any,
                                                             version: str) -> None:
    _, _, files = rendered
    for name, docs in files.items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {e.message} "
                            f"at {'/'.join(map(str, e.path))}")


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_invariants(rendered: Any, tmp_path: Path) -> None:
    raw, extra, files = rendered
    name = _flag(list(extra), "--name") if "--name" in extra else "disagg"
    deployments = by_kind(files, "Deployment")
    config_map = by_kind(files, "ConfigMap")[f"{name}-config"]["data"]
    # the router: its port everywhere, one replica, the YAML of a registering cluster
    port = raw["port"]
    service = by_kind(files, "Service")[f"{name}-router"]
    assert service["spec"]["ports"][0]["port"] == port
    router = deployments[f"{name}-router"]
    assert router["spec"]["replicas"] == 1
    rc = router["spec"]["template"]["spec"]["containers"][0]
    assert rc["ports"][0]["containerPort"] == port and _flag(rc["args"], "--port") == str(port)
    (tmp_path / "router.yaml").write_text(config_map["router.yaml"])
    cfg = load_cluster_config(tmp_path / "router.yaml")
    assert cfg.disagg_cluster is not None and cfg.port == port
    groups = [(s, raw[s]) for s in ("context_servers", "generation_servers") if s in raw]
    roles = {"context_servers": "context", "generation_servers": "generation"}
    for section, sec in groups:
        role = roles[section] if "context_servers" in raw else "aggregated"
        assert not getattr(cfg, section).urls  # workers register instead
        d = deployments[f"{name}-{role}"]
        assert d["spec"]["replicas"] == sec["num_instances"]
        pod = d["spec"]["template"]
        c = pod["spec"]["containers"][0]
        wport = int(sec["urls"][0].rsplit(":", 1)[1])
        assert c["ports"][0]["containerPort"] == wport
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(wport)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": wport}
        world = sec.get("tensor_parallel_size", 1) * sec.get("pipeline_parallel_size", 1)
        if "--cpu" in extra:
            assert c["resources"] == {"requests": {"cpu": str(world)}}
        else:
            assert c["resources"] == {"limits": {"nvidia.com/gpu": world}}
        # the command parses with disagg's own CLI and joins the router by its Service
        args = build_parser().parse_args(c["args"])
        assert args.role == role and args.port == wport and args.host == "0.0.0.0"
        assert args.router_url == f"http://{name}-router:{port}"
        assert args.advertise_host == "$(POD_IP)"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}
                } in c["env"]
        worker_yaml = tmp_path / f"{role}.yaml"
        worker_yaml.write_text(config_map[Path(args.config).name])
        options = load_worker_yaml(str(worker_yaml))
        drain = float(_flag(list(extra), "--drain-timeout")) if "--drain-timeout" in extra \
            else 30.0
        assert options["drain_timeout"] == drain
        assert pod["spec"]["terminationGracePeriodSeconds"] == math.ceil(drain) + 15
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        model = options["model"]
        assert model.startswith("/models/") or any(
            model == m or model.startswith(m + "/") for m in mounts), (model, mounts)
        assert ("/dev/shm" in mounts) == (world > 1)
    # the cluster token: from the Secret in every container, never a literal
    for d in deployments.values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["DISAGG_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": f"{name}-cluster-token", "key": "token"}
    text = "".join(yaml.safe_dump(d) for docs in files.values() for d in docs
                   if d["kind"] != "Secret")
    assert "cluster_token" not in text


def test_secret_is_fresh_and_private(tmp_path: Path) -> None:
    config = REPO / "configs/disagg_1ctx_1gen.yaml"
    tokens = []
    for run in ("a", "b"):
        files = render(tmp_path / run, config, "--secret")
        secret = by_kind(files, "Secret")["disagg-cluster-token"]
        tokens.append(secret["stringData"]["token"])
        mode = stat.S_IMODE((tmp_path / run / "secret.yaml").stat().st_mode)
        assert mode == 0o600
    assert tokens[0] != tokens[1] and all(len(t) == 64 and int(t, 16) for t in tokens)
    assert not (tmp_path / "none").exists()
    render(tmp_path / "none", config)
    assert not (tmp_path / "none" / "secret.yaml").exists()  # default: kubectl creates it
    assert "kubectl create secret generic disagg-cluster-token" in (
        tmp_path / "none" / "README.md").read_text()


def test_checked_in_example_is_up_to_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "k8s"
    assert disagg_main(["deploy", "k8s", "-c", "configs/disagg_1ctx_1gen.yaml", "-o",
                        str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (REPO / "deploy/k8s").iterdir())
    for name in names:
        rendered = (out / name).read_text().replace(str(out), "deploy/k8s")
        assert rendered == (REPO / "deploy/k8s" / name).read_text(), (
            f"deploy/k8s/{name} is stale: re-render with `disagg deploy k8s -c "
            f"configs/disagg_1ctx_1gen.yaml -o deploy/k8s`")


@pytest.mark.parametrize("yaml_text, extra, message", [
    ("port: 0\ngeneration_servers: {urls: ['h:8001']}\nmodel: tiny\n", (),
     "port: 0 (a free port) cannot be deployed"),
    ("generation_servers: {urls: ['h:8001']}\nmodel: tiny\ncluster_token: s3cret\n", (),
     "cluster_token: not deployable"),
    ("generation_servers: {urls: ['h:8001'], advertise_host: x}\nmodel: tiny\n", (),
     "generation_servers.advertise_host: not deployable"),
    ("generation_servers: {urls: ['h:8001']}\nmodel: /m\n", (),
     "give --model-pvc NAME or --model-host-path DIR"),
    ("generation_servers: {urls: ['h:8001']}\nmodel: rel/m\n", ("--model-pvc", "p"),
     "give an absolute path"),
    ("generation_servers: {urls: ['h:8000']}\nmodel: tiny\n", (),
     "port 8000 is the router's port"),
    ("generation_servers: {urls: ['h:8001']}\nmodel: tiny\n", ("--name", "Bad_Name"),
     "--name: 'Bad_Name'"),
    ("generation_servers: {urls: ['h:8001'], nope: 1}\nmodel: tiny\n", (),
     "generation_servers.nope: unknown key"),
    ("model: tiny\ndisagg_cluster: {}\n", (), "nothing to deploy"),
    ("generation_servers: {urls: ['h:8001']}\n", (), "generation_servers: model: missing"),
])
def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    yaml_text: str, extra: tuple[str, ...],
                                    message: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    code = disagg_main(["deploy", "k8s", "-c", str(config), "-o", str(tmp_path / "o"),
                        *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_api_keys_make_the_config_a_secret(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A YAML with api_key values (the router's, the workers' which the router sends them)
    renders its config files as a Secret (mode 0600), mounted where the ConfigMap would be,
    and nothing else holds a key; the router loads it with every key. Pods whose /metrics
    needs the key carry no scrape annotations."""
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny\napi_key: key-k\ngeneration_servers: {urls: ['h:8001'], "
                      "api_key: key-w}\ncontext_servers: {urls: ['h:8002'], api_key: key-x, "
                      "public_metrics: true}\n")
    out = tmp_path / "o"
    files = render(out, config)
    assert "configmap.yaml" not in files and not by_kind(files, "ConfigMap")
    [secret] = files["config-secret.yaml"]
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "disagg-config"
    kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    assert stat.S_IMODE((out / "config-secret.yaml").stat().st_mode) == 0o600
    leaks = [n for n in files if n != "config-secret.yaml"
             if "key-" in (out / n).read_text()]
    assert leaks == [] and "key-" not in (out / "README.md").read_text()
    deployments = by_kind(files, "Deployment")
    for d in deployments.values():
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"] == {"name": "config", "secret": {"secretName": "disagg-config"}}
    (tmp_path / "router.yaml").write_text(secret["stringData"]["router.yaml"])
    cfg = load_cluster_config(tmp_path / "router.yaml")
    assert cfg.api_key == "key-k"
    assert {cfg.generation_servers.worker_options["api_key"],
            cfg.context_servers.worker_options["api_key"]} \
        == {"key-w", "key-x"}
    annotations = {n: d["spec"]["template"]["metadata"]["annotations"]
                   for n, d in deployments.items()}
    assert annotations["disagg-router"] == {} and annotations["disagg-generation"] == {}
    assert annotations["disagg-context"]["prometheus.io/scrape"] == "true"
    readme = (out / "README.md").read_text()
    assert "a Secret with the YAMLs" in readme and "`config-secret.yaml`" in readme
    # A key may also stay out of the YAML: $DISAGG_API_KEY (the router's own here).
    (tmp_path / "bare.yaml").write_text("generation_servers: {urls: ['h:8001']}\n")
    args = build_parser().parse_args(["router", "-c", str(tmp_path / "bare.yaml")])
    monkeypatch.setenv("DISAGG_API_KEY", "key-env")
    assert configured(args).api_key == "key-env"
    monkeypatch.delenv("DISAGG_API_KEY")
    assert configured(args).api_key is None


def test_a_packaged_model_is_brought_as_its_gguf_file(tmp_path: Path) -> None:
    # smollm2: the init container writes the GGUF file itself into the models volume and the
    # workers serve that .gguf (gguf_weights applies: quantized by default, as launch's).
    config = tmp_path / "c.yaml"
    config.write_text("model: smollm2\ngeneration_servers: {urls: ['h:8001']}\n")
    files = render(tmp_path / "o", config, "--cpu")
    worker = by_kind(files, "Deployment")["disagg-aggregated"]
    kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)
    spec = worker["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    assert init["args"] == ["model", "fetch", "smollm2", "/models/smollm2", "--gguf"]
    build_parser().parse_args(init["args"])  # disagg's own CLI takes it
    (tmp_path / "w.yaml").write_text(
        by_kind(files, "ConfigMap")["disagg-config"]["data"]["aggregated.yaml"])
    model = load_worker_yaml(str(tmp_path / "w.yaml"))["model"]
    assert model == "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_yaml_without_api_keys_renders_a_config_map(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny\ngeneration_servers: {urls: ['h:8001']}\n")
    files = render(tmp_path / "o", config)
    assert "config-secret.yaml" not in files and not by_kind(files, "Secret")
    assert by_kind(files, "ConfigMap")["disagg-config"]["data"]
