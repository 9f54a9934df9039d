"""The Grafana dashboard of a disagg cluster and the files that provision it.

``dashboard()`` builds the dashboard (Grafana's JSON model, a plain dict) from the metrics the
router (``disagg/router/metrics.py``) and the workers (``disagg/server/metrics.py``) export;
``disagg deploy k8s --monitoring`` puts it in a ConfigMap for Grafana's dashboard sidecar, and
``deploy/grafana/`` holds it with Grafana's provisioning files for a plain Grafana::

    python -m disagg.deploy.grafana deploy/grafana     # re-render the checked-in copy

The data source is a dashboard variable (``$datasource``, any Prometheus), so the same JSON
loads by file provisioning, by the sidecar and by hand (Dashboards > Import). The other
variables filter the workers' series: ``$model`` (``model_name``), ``$instance`` (the scrape
target) and ``$role`` (the KV transfer series and the router's pools: context / generation).
The router's series carry no ``model_name``: ``model_name=""`` picks its phase histograms out
of the workers' (both are ``disagg_request_phase_seconds``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UID = "disagg-overview"
TITLE = "disagg: disaggregated serving"
FILE = "disagg-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
# Selectors of the workers' series (the variables' "All" values: any model, instance, role).
W = 'model_name=~"$model",instance=~"$instance"'
KV = W + ',role=~"$role"'
ROUTER_PHASES = 'model_name=""'  # the router's phase histograms (no model_name)
QUANTILES = (0.5, 0.9, 0.99)
WIDTH = 24  # Grafana's grid
HEIGHT = 8


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel; ``legend``: Grafana's legend format."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A panel of the dashboard: a time series (or a stat), ``width`` grid columns wide."""

    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str
    width: int = 12
    kind: str = "timeseries"  # or "stat"
    stacked: bool = False
    bars: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def rate(selector: str) -> str:
    return f"rate({selector}{RATE})"


def quantiles(bucket: str, by: str = "", legend: str = "p{q}") -> tuple[Query, ...]:
    """p50 / p90 / p99 of the histogram whose ``_bucket`` series ``bucket`` selects, summed over
    every series but ``by``'s labels."""
    labels = "le" + (f", {by}" if by else "")
    return tuple(Query(f"histogram_quantile({q}, sum by ({labels}) ({rate(bucket)}))",
                       legend.format(q=round(q * 100))) for q in QUANTILES)


def mean(total: str, count: str, by: str, legend: str) -> Query:
    """rate(sum) / rate(count) by ``by``: the mean of a histogram (or of a pair of counters)
    over the interval."""
    return Query(f"sum by ({by}) ({rate(total)}) / sum by ({by}) ({rate(count)})", legend)


def _rows() -> tuple[Row, ...]:
    ttft = f"disagg_time_to_first_token_seconds_bucket{{{W}}}"
    itl = f"disagg_inter_token_latency_seconds_bucket{{{W}}}"
    e2e = f"disagg_e2e_request_latency_seconds_bucket{{{W}}}"
    decisions = 'disagg_router_routing_decisions_total{role=~"$role"}'
    return (
        Row("Overview", (
            Panel("Requests / s (router)", "Requests the router answered, all endpoints.",
                  (Query(f"sum({rate('disagg_router_requests_total')})", "requests/s"),),
                  "reqps", 6, kind="stat"),
            Panel("TTFT p90 (workers)", "90th percentile of the workers' time to first token "
                  "(a generation worker's includes its KV pull).",
                  quantiles(ttft)[1:2], "s", 6, kind="stat"),
            Panel("Workers in rotation", "Workers the router sends requests to, of all it "
                  "knows (disagg_router_pool_workers).",
                  (Query("sum(disagg_router_worker_healthy)", "in rotation"),
                   Query("sum(disagg_router_pool_workers)", "known")), "short", 6, kind="stat"),
            Panel("KV transfer failures / s", "Failed KV reads, all error codes.",
                  (Query(f"sum({rate(f'disagg_kv_transfer_failed_total{{{KV}}}')})",
                         "failures/s"),), "ops", 6, kind="stat"),
        )),
        Row("Requests", (
            Panel("Router requests / s by outcome", "success, client_error (4xx), "
                  "upstream_error (every try failed, or a worker's 5xx), no_worker, "
                  "stream_error, disconnected.",
                  (Query(f"sum by (endpoint, outcome) ({rate('disagg_router_requests_total')})",
                         "{{endpoint}} {{outcome}}"),), "reqps", 8, stacked=True),
            Panel("Worker requests / s", "Engine requests finished (by finish reason) and HTTP "
                  "requests refused before the engine (by reason).",
                  (Query(f"sum by (finish_reason) "
                         f"({rate(f'disagg_requests_finished_total{{{W}}}')})",
                         "finished: {{finish_reason}}"),
                   Query(f"sum by (reason) ({rate(f'disagg_requests_rejected_total{{{W}}}')})",
                         "rejected: {{reason}}")), "reqps", 8),
            Panel("Tokens / s", "Prompt tokens admitted and tokens generated by the workers "
                  "(a disaggregated prompt counts on both of its workers).",
                  (Query(f"sum({rate(f'disagg_prompt_tokens_total{{{W}}}')})", "prompt"),
                   Query(f"sum({rate(f'disagg_generation_tokens_total{{{W}}}')})",
                         "generated")), "short", 8),
        )),
        Row("Latency", (
            Panel("TTFT (clients, at the router)", "Streamed requests: from the request's "
                  "arrival at the router to its first token sent to the client (what a "
                  "client sees, less the network); the phases row splits it into route, "
                  "context_call, handover and generation_call.",
                  quantiles("disagg_router_time_to_first_token_seconds_bucket"), "s", 8),
            Panel("TTFT (workers)", "Time from a request's arrival at a worker to its first "
                  "token: a context worker's prefill, a generation worker's KV pull + first "
                  "step (or its local prefill).", quantiles(ttft), "s", 8),
            Panel("TPOT / inter-token latency (workers)", "Time between successive tokens of "
                  "a request.", quantiles(itl), "s", 8),
            Panel("E2E latency", "The whole request: at the router (what a client sees, less "
                  "the network) and at the workers.",
                  (*quantiles("disagg_router_request_latency_seconds_bucket", legend="router "
                              "p{q}"),
                   *quantiles(e2e, legend="workers p{q}")), "s", 12),
            Panel("Router calls p90", "The router's two calls: context (sent -> answer), "
                  "generation (sent -> first byte, and -> end).",
                  (*quantiles("disagg_router_ctx_latency_seconds_bucket",
                              legend="context call p{q}")[1:2],
                   *quantiles("disagg_router_gen_first_byte_seconds_bucket",
                              legend="generation first byte p{q}")[1:2],
                   *quantiles("disagg_router_gen_latency_seconds_bucket",
                              legend="generation call p{q}")[1:2]), "s", 12),
            Panel("Queue time (workers)", "Time from arrival in a worker's engine to first "
                  "being scheduled.",
                  quantiles(f"disagg_request_queue_time_seconds_bucket{{{W}}}"), "s", 24),
        )),
        Row("Where the time goes: phases (disagg_request_phase_seconds)", (
            Panel("Router phases: mean per request", "route -> context_call -> handover -> "
                  "generation_call (to the first byte of a stream) -> decode, stacked: their "
                  "sum is the router's mean request time (docs/DESIGN.md section 21).",
                  (mean(f"disagg_request_phase_seconds_sum{{{ROUTER_PHASES}}}",
                        f"disagg_request_phase_seconds_count{{{ROUTER_PHASES}}}", "phase",
                        "{{phase}}"),), "s", 12, stacked=True),
            Panel("Worker phases: mean per request", "admission, queue, prefill, "
                  "context_answer (context workers); admission, kv_wait, kv_transfer, "
                  "kv_install, first_token, decode, finish (generation workers), stacked.",
                  (mean(f"disagg_request_phase_seconds_sum{{{W}}}",
                        f"disagg_request_phase_seconds_count{{{W}}}", "phase", "{{phase}}"),),
                  "s", 12, stacked=True),
            Panel("Router phases p90", "90th percentile of each router phase.",
                  (Query(f"histogram_quantile(0.9, sum by (le, phase) "
                         f"({rate(f'disagg_request_phase_seconds_bucket{{{ROUTER_PHASES}}}')}))",
                         "{{phase}}"),), "s", 12),
            Panel("Worker phases p90", "90th percentile of each worker phase.",
                  (Query(f"histogram_quantile(0.9, sum by (le, phase) "
                         f"({rate(f'disagg_request_phase_seconds_bucket{{{W}}}')}))",
                         "{{phase}}"),), "s", 12),
        )),
        Row("KV transfer", (
            Panel("KV bytes / s", "KV bytes sent by context workers and received by "
                  "generation workers.",
                  (Query(f"sum by (role, instance) "
                         f"({rate(f'disagg_kv_transfer_bytes_total{{{KV}}}')})",
                         "{{role}} {{instance}}"),), "Bps", 8),
            Panel("KV transfer time", "One KV read (request sent -> last payload byte), and "
                  "the mean pull (reads submitted -> KV installed) and install (copy into the "
                  "cache) per rank.",
                  (*quantiles(f"disagg_kv_transfer_seconds_bucket{{{KV}}}",
                              legend="read p{q}"),
                   mean(f"disagg_kv_pull_seconds_total{{{KV}}}",
                        f"disagg_kv_installs_total{{{KV}}}", "role", "pull mean ({{role}})"),
                   mean(f"disagg_kv_install_seconds_total{{{KV}}}",
                        f"disagg_kv_installs_total{{{KV}}}", "role",
                        "install mean ({{role}})")), "s", 8),
            Panel("KV transfers / s and failures by code", "Successful KV reads, and failed "
                  "ones by error code (integrity_error: a payload whose checksum did not "
                  "match).",
                  (Query(f"sum by (role) ({rate(f'disagg_kv_transfers_total{{{KV}}}')})",
                         "ok ({{role}})"),
                   Query(f"sum by (role, code) "
                         f"({rate(f'disagg_kv_transfer_failures_total{{{KV}}}')})",
                         "failed: {{code}} ({{role}})")), "ops", 8),
            Panel("Leases held (context workers)", "Live context leases and the KV blocks "
                  "they hold for generation workers.",
                  (Query(f"sum by (instance) (disagg_kv_leases_active{{{KV}}})",
                         "leases {{instance}}"),
                   Query(f"sum by (instance) (disagg_kv_leased_blocks{{{KV}}})",
                         "blocks {{instance}}")), "short", 12),
            Panel("Leases expired and released / s", "Leases that expired before their "
                  "reader confirmed, and leases the router freed because no generation worker "
                  "took the request.",
                  (Query(f"sum({rate(f'disagg_kv_leases_expired_total{{{KV}}}')})",
                         "expired"),
                   Query(f"sum({rate('disagg_router_lease_releases_total')})",
                         "released by the router")), "ops", 12),
        )),
        Row("Engines", (
            Panel("Queue depths", "Requests running, waiting (for admission or for KV) and "
                  "waiting for their prompt KV from a context worker.",
                  (Query(f"sum(disagg_num_requests_running{{{W}}})", "running"),
                   Query(f"sum(disagg_num_requests_waiting{{{W}}})", "waiting"),
                   Query(f"sum(disagg_num_requests_waiting_for_kv{{{W}}})",
                         "waiting for KV")), "short", 8),
            Panel("Waiting by worker", "Requests waiting on each worker.",
                  (Query(f"sum by (instance) (disagg_num_requests_waiting{{{W}}})",
                         "{{instance}}"),), "short", 8),
            Panel("Batch", "Requests and tokens scheduled in each worker's last iteration.",
                  (Query(f"sum by (instance) (disagg_iteration_batch_size{{{W}}})",
                         "requests {{instance}}"),
                   Query(f"sum by (instance) (disagg_iteration_num_tokens{{{W}}})",
                         "tokens {{instance}}")), "short", 8),
            Panel("KV blocks", "KV cache blocks held by requests, free but holding reusable "
                  "prefix content, and in the pools.",
                  (Query(f"sum(disagg_kv_blocks_used{{{W}}})", "used"),
                   Query(f"sum(disagg_kv_blocks_cached{{{W}}})", "cached"),
                   Query(f"sum(disagg_kv_blocks_total{{{W}}})", "total")), "short", 8),
            Panel("KV cache usage by worker", "kv_blocks_used / kv_blocks_total.",
                  (Query(f"max by (instance) (disagg_kv_cache_usage_ratio{{{W}}})",
                         "{{instance}}"),), "percentunit", 8),
            Panel("Prefix cache hit rate", "Prompt tokens found in the workers' prefix cache "
                  "of those looked up, and of the prompt tokens the router routed by "
                  "kv_cache_aware, those found in the chosen worker's cache.",
                  (mean(f"disagg_prefix_cache_hit_tokens_total{{{W}}}",
                        f"disagg_prefix_cache_queries_tokens_total{{{W}}}", "instance",
                        "workers {{instance}}"),
                   mean("disagg_router_kv_matched_tokens_total", "disagg_router_kv_prompt_tokens"
                        "_total", "role", "router kv-aware ({{role}})")), "percentunit", 8),
            Panel("Preemptions / s", "Requests preempted (KV blocks taken back, to be "
                  "recomputed).",
                  (Query(f"sum by (instance) ({rate(f'disagg_num_preemptions_total{{{W}}}')})",
                         "{{instance}}"),), "ops", 12),
            Panel("Engines healthy", "1 while a worker's engine loop is alive.",
                  (Query(f"sum by (instance) (disagg_engine_healthy{{{W}}})",
                         "{{instance}}"),), "short", 12),
        )),
        Row("Router and planner", (
            Panel("Pools", "Workers the router knows and those in rotation, by pool.",
                  (Query('sum by (role) (disagg_router_pool_workers{role=~"$role"})',
                         "known: {{role}}"),
                   Query('sum by (role) (disagg_router_worker_healthy{role=~"$role"})',
                         "in rotation: {{role}}")), "short", 8),
            Panel("Router requests in flight by worker", "The router's requests on each "
                  "worker.",
                  (Query('sum by (role, worker) '
                         '(disagg_router_worker_active_requests{role=~"$role"})',
                         "{{role}} {{worker}}"),), "short", 8),
            Panel("Routing decisions / s", "Workers chosen, by pool and policy; and the "
                  "requests prefilled on their generation worker (conditional "
                  "disaggregation).",
                  (Query(f"sum by (role, policy) ({rate(decisions)})",
                         "{{role}} {{policy}}"),
                   Query(f"sum({rate('disagg_router_local_prefill_total')})",
                         "local prefill")), "ops", 8),
            Panel("Planner decisions and role switches", "The planner's flips (a worker "
                  "moved from one pool to the other) and holds, and the role switches run, by "
                  "outcome, per interval.",
                  (Query("sum by (action, from_role, to_role) (increase("
                         f"disagg_router_planner_decisions_total{RATE}))",
                         "{{action}} {{from_role}} -> {{to_role}}"),
                   Query(f"sum by (outcome) (increase(disagg_router_role_switches_total{RATE}))",
                         "switch {{outcome}}")), "short", 8, bars=True),
            Panel("Role switch time", "Start of a role switch -> the worker back in rotation "
                  "in its new pool.",
                  quantiles("disagg_router_role_switch_seconds_bucket"), "s", 8),
            Panel("Retries and migrations / s", "Tries on another worker (or new prefills) by "
                  "pool and reason; requests moved to another worker after their generation "
                  "worker failed (resume: the stream goes on; restart: nothing was sent); "
                  "kv_streaming outcomes.",
                  (Query(f"sum by (role, reason) ({rate('disagg_router_retries_total')})",
                         "retry {{role}} {{reason}}"),
                   Query(f"sum by (kind) ({rate('disagg_router_migrations_total')})",
                         "migration {{kind}}"),
                   Query(f"sum by (outcome) ({rate('disagg_router_kv_stream_requests_total')})",
                         "kv_streaming {{outcome}}")), "ops", 8),
        )),
    )


def _field_config(p: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit, "min": 0}
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if p.bars else "line", "lineWidth": 1,
            "fillOpacity": 60 if (p.stacked or p.bars) else 10, "showPoints": "never",
            "spanNulls": False, "stacking": {"mode": "normal" if p.stacked else "none",
                                              "group": "A"}}
    return {"defaults": defaults, "overrides": []}


def _options(p: Panel) -> dict[str, Any]:
    if p.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                "orientation": "auto", "textMode": "auto"}
    return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": DATASOURCE, "gridPos": {"h": HEIGHT, "w": p.width, "x": x, "y": y},
        "fieldConfig": _field_config(p), "options": _options(p),
        "targets": [{"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
                     "range": True, "refId": chr(ord("A") + i)}
                    for i, q in enumerate(p.queries)]}


def _variable(name: str, label: str, query: str, all_value: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": f"{name}-values"},
            "refresh": 2, "includeAll": True, "multi": True, "allValue": all_value,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1, "hide": 0, "options": []}


def _templating() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "options": [], "refresh": 1},
        # "All" of model is .+ (not .*): the router's series have no model_name
        _variable("model", "Model", "label_values(disagg_engine_healthy, model_name)", ".+"),
        _variable("instance", "Worker",
                  'label_values(disagg_engine_healthy{model_name=~"$model"}, instance)', ".*"),
        _variable("role", "Role", "label_values(disagg_router_pool_workers, role)", ".*"),
    ]


def dashboard(rows: Sequence[Row] | None = None) -> dict[str, Any]:
    """Grafana's JSON model of the dashboard: a row panel per ``Row``, its panels laid out
    left to right, wrapping at the grid's width."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in rows if rows is not None else _rows():
        panels.append({"id": len(panels) + 1, "type": "row", "title": row.title,
                       "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}})
        y += 1
        x = 0
        for p in row.panels:
            if x + p.width > WIDTH:
                x, y = 0, y + HEIGHT
            panels.append(_panel(p, len(panels) + 1, x, y))
            x += p.width
        y += HEIGHT
    return {
        "uid": UID, "title": TITLE, "tags": ["disagg"], "timezone": "browser",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
        "description": "Router and workers of a disagg cluster: requests, latency, the phases "
                       "of a request, KV transfer, engines, planner (disagg/deploy/grafana.py).",
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [], "templating": {"list": _templating()}, "panels": panels}


def dashboard_json() -> str:
    """The dashboard as the text of ``deploy/grafana/disagg-dashboard.json``."""
    return json.dumps(dashboard(), indent=2) + "\n"


# -- provisioning (a plain Grafana: deploy/grafana/provisioning) ------------------------------

DASHBOARDS_DIR = "/var/lib/grafana/dashboards/disagg"  # where the README mounts the JSON

DATASOURCE_YAML = """\
# Grafana data source provisioning (rendered by `python -m disagg.deploy.grafana`): the
# Prometheus that scrapes the router and the workers, at $PROMETHEUS_URL (Grafana expands
# environment variables in provisioning files; see deploy/grafana/README.md).
apiVersion: 1
datasources:
  - name: Prometheus
    uid: prometheus
    type: prometheus
    access: proxy
    url: $PROMETHEUS_URL
    isDefault: true
    editable: true
"""

DASHBOARDS_YAML = f"""\
# Grafana dashboard provisioning (rendered by `python -m disagg.deploy.grafana`): every JSON
# file in {DASHBOARDS_DIR} (mount deploy/grafana/{FILE} there).
apiVersion: 1
providers:
  - name: disagg
    folder: disagg
    type: file
    disableDeletion: false
    allowUiUpdates: true
    updateIntervalSeconds: 30
    options:
      path: {DASHBOARDS_DIR}
"""

PROVISIONING = {"provisioning/datasources/prometheus.yaml": DATASOURCE_YAML,
                "provisioning/dashboards/disagg.yaml": DASHBOARDS_YAML}


def files() -> dict[str, str]:
    """Relative path -> text of everything ``write`` renders (not the README)."""
    return {FILE: dashboard_json(), **PROVISIONING}


def write(out_dir: Path) -> list[Path]:
    """Render the dashboard and the provisioning files under ``out_dir``."""
    written = []
    for rel, text in files().items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m disagg.deploy.grafana DIR   (e.g. deploy/grafana)",
              file=sys.stderr)
        return 2
    paths = write(Path(args[0]))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
