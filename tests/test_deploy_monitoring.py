"""``disagg deploy k8s --monitoring`` (issue 42, item 3): a prometheus-operator PodMonitor per
component, selecting exactly the pods of that component's Deployment on their ``http`` port at
``/metrics`` (with the API key as a bearer token from a rendered Secret when that component's
``/metrics`` needs it), and the Grafana dashboard (``disagg.deploy.grafana``, the same JSON as
``deploy/grafana/``) in a ConfigMap labelled ``grafana_dashboard: "1"``. Without the flag the
output is byte for byte what it was. kubernetes-validate checks what it knows (the ConfigMap,
the Secret); the PodMonitor (a CRD it does not know) is checked field by field here."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.cli import main as disagg_main
from disagg.contracts.cluster import load_cluster_config
from disagg.deploy import grafana

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs/disagg_1ctx_1gen.yaml"
POD_MONITOR_KEYS = {"jobLabel", "selector", "podMetricsEndpoints"}
ENDPOINT_KEYS = {"port", "path", "authorization"}


def render(out: Path, config: Path, *extra: str) -> dict[str, list[dict[str, Any]]]:
    assert disagg_main(["deploy", "k8s", "-c", str(config), "-o", str(out), *extra]) == 0
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted(out.glob("*.yaml"))}


def by_kind(files: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for docs in files.values() for d in docs
            if d["kind"] == kind}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def check_monitors(files: dict[str, list[dict[str, Any]]], name: str,
                   keys: dict[str, str]) -> None:
    """Every Deployment's pods are selected by exactly one PodMonitor, of the same component,
    on a port the pod names, at /metrics; ``keys``: component -> the API key its scrape
    sends."""
    monitors = by_kind(files, "PodMonitor")
    deployments = by_kind(files, "Deployment")
    assert len(monitors) == len(deployments)
    secrets = by_kind(files, "Secret")
    for d in deployments.values():
        pod = d["spec"]["template"]
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        chosen = [m for m in monitors.values()
                  if _selects(m["spec"]["selector"], pod["metadata"]["labels"])]
        assert [m["metadata"]["name"] for m in chosen] == [f"{name}-{component}"]
        [m] = chosen
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"].get("namespace") == d["metadata"].get("namespace")
        spec = m["spec"]
        assert set(spec) == POD_MONITOR_KEYS
        assert spec["jobLabel"] in pod["metadata"]["labels"]
        assert spec["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        [endpoint] = spec["podMetricsEndpoints"]
        assert set(endpoint) <= ENDPOINT_KEYS and endpoint["path"] == "/metrics"
        [container] = pod["spec"]["containers"]
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
        if component in keys:
            auth = endpoint["authorization"]
            assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}
            secret = secrets[auth["credentials"]["name"]]
            assert secret["stringData"][auth["credentials"]["key"]] == keys[component]
        else:
            assert "authorization" not in endpoint
    for m in monitors.values():  # and no monitor without pods
        assert any(_selects(m["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
                   for d in deployments.values())


def check_dashboard_map(files: dict[str, list[dict[str, Any]]], name: str) -> None:
    cm = by_kind(files, "ConfigMap")[f"{name}-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {grafana.FILE: (REPO / "deploy/grafana" / grafana.FILE).read_text()}
    assert json.loads(cm["data"][grafana.FILE])["uid"] == grafana.UID
    for version in ("1.29.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(cm, version, strict=True)


def test_monitoring_objects(tmp_path: Path) -> None:
    files = render(tmp_path / "m", CONFIG, "--monitoring", "--namespace", "llm", "--name",
                   "chat")
    assert [d["kind"] for d in files["monitoring.yaml"]] == ["PodMonitor"] * 3 + ["ConfigMap"]
    check_monitors(files, "chat", {})
    check_dashboard_map(files, "chat")
    assert {d["metadata"]["namespace"] for docs in files.values() for d in docs} == {"llm"}
    readme = (tmp_path / "m" / "README.md").read_text()
    assert "## 5. Monitoring" in readme and "kubectl -n llm label podmonitor" in readme
    assert "--monitoring" in (tmp_path / "m" / "monitoring.yaml").read_text().splitlines()[0]


def test_without_the_flag_nothing_changes(tmp_path: Path) -> None:
    """The flag adds monitoring.yaml and the README's section, and changes nothing else."""
    plain = tmp_path / "plain"
    render(plain, CONFIG)
    render(tmp_path / "mon", CONFIG, "--monitoring")
    names = sorted(p.name for p in plain.iterdir())
    assert "monitoring.yaml" not in names
    assert sorted(p.name for p in (tmp_path / "mon").iterdir()) == sorted(
        [*names, "monitoring.yaml"])
    for n in names:
        before = (plain / n).read_text().replace(str(plain), "OUT")
        after = (tmp_path / "mon" / n).read_text().replace(str(tmp_path / "mon"), "OUT")
        after = after.replace(" --monitoring", "")  # the command line in the headers
        if n == "README.md":
            head, section = after.split("\n## 5. Monitoring\n")
            assert head == before and "PodMonitor" in section
        else:
            assert after == before, n


def test_keyed_metrics_are_scraped_with_the_key(tmp_path: Path) -> None:
    """A component whose /metrics needs its API key gets it as a bearer token from the
    Secret NAME-metrics-auth, rendered beside the keys it repeats (config-secret.yaml, mode
    0600); a public_metrics one is scraped without."""
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny\napi_key: key-k\ngeneration_servers: {urls: ['h:8001'], "
                      "api_key: key-w}\ncontext_servers: {urls: ['h:8002'], api_key: key-x, "
                      "public_metrics: true}\n")
    out = tmp_path / "o"
    files = render(out, config, "--monitoring")
    check_monitors(files, "disagg", {"router": "key-k", "generation": "key-w"})
    check_dashboard_map(files, "disagg")
    secret, auth = files["config-secret.yaml"]
    assert secret["metadata"]["name"] == "disagg-config"
    assert auth["metadata"]["name"] == "disagg-metrics-auth"
    assert auth["stringData"] == {"router": "key-k", "generation": "key-w"}
    kubernetes_validate.validate(auth, kubernetes_validate.latest_version(), strict=True)
    assert stat.S_IMODE((out / "config-secret.yaml").stat().st_mode) == 0o600
    leaks = [n for n in files if n != "config-secret.yaml" if "key-" in (out / n).read_text()]
    assert leaks == [] and "key-" not in (out / "README.md").read_text()
    readme = (out / "README.md").read_text()
    assert "`disagg-router` and `disagg-generation` needs its API key" in readme
    # the router loads its YAML from the Secret as before
    (tmp_path / "router.yaml").write_text(secret["stringData"]["router.yaml"])
    assert load_cluster_config(tmp_path / "router.yaml").api_key == "key-k"
    # public_metrics on the router too: no key for it
    config.write_text(config.read_text() + "public_metrics: true\n")
    files = render(tmp_path / "p", config, "--monitoring")
    check_monitors(files, "disagg", {"generation": "key-w"})
    assert files["config-secret.yaml"][1]["stringData"] == {"generation": "key-w"}


def test_an_aggregated_cluster(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny\ngeneration_servers: {urls: ['h:8001', 'h2:8001'], "
                      "num_instances: 2}\n")
    files = render(tmp_path / "o", config, "--monitoring")
    assert sorted(by_kind(files, "PodMonitor")) == ["disagg-aggregated", "disagg-router"]
    check_monitors(files, "disagg", {})
    assert not by_kind(files, "Secret")
