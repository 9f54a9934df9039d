"""The Grafana dashboard (issue 42, item 3; ``disagg/deploy/grafana.py``, ``deploy/grafana/``):
every query of every panel and variable names series that a live router and live workers
export, as the query uses them.

A live router in front of one context and one generation worker (TCP KV), all in this process,
serves one disaggregated request (and a worker one refused request), so that the series made
on first use exist; then each query is read (a small PromQL reader below: selectors with their
label matchers, the functions around them, grouping labels) and checked against the three
``/metrics`` expositions:
- each metric name is a sample name one of them exports (a counter as ``_total``, a histogram
  as ``_bucket`` / ``_sum`` / ``_count``), also for a family with no sample yet;
- ``rate`` / ``increase`` take counters and histograms only, gauges are read bare, a
  ``_bucket`` series goes into ``histogram_quantile``;
- each matcher names a label of the series (or a scrape target's ``instance`` / ``job``, or
  asks for the label's absence), and with the variables at "All" the selector matches a live
  sample; each grouping label is a label of a series in the query.
The checked-in ``deploy/grafana/`` is what ``python -m disagg.deploy.grafana`` writes today.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from router_fixtures import LoopThread, running_router, worker_app
from server_fixtures import serve_in_thread, wait_for

from disagg.deploy import grafana

REPO = Path(__file__).resolve().parent.parent
NAME = "tiny"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
# The variables at "All" (their allValue), to see that a selector matches live samples.
ALL = {"$model": ".+", "$instance": ".*", "$role": ".*"}

# ---- a small PromQL reader -------------------------------------------------------------------

FUNCTIONS = {"rate", "increase", "irate", "histogram_quantile", "clamp_min", "clamp_max", "abs"}
AGGREGATIONS = {"sum", "avg", "max", "min", "count"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
RATES = {"rate", "increase", "irate"}
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:\\.|[^"\\])*")
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}])
""", re.X)


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)
    functions: tuple[str, ...]  # the functions around it, outermost first


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(expr):
        m = _TOKEN.match(expr, at)
        if m is None:
            raise ValueError(f"{expr!r}: cannot read at {expr[at:at + 20]!r}")
        at = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup or "", m.group()))
    return out


def read_promql(expr: str) -> Query:
    """The selectors of ``expr`` (each with the functions around it) and its grouping
    labels; an unknown function is an error."""
    toks = tokens(expr)
    q = Query()
    stack: list[str] = []
    pending: str | None = None
    i = 0

    def label_list(at: int) -> int:
        assert toks[at] == ("op", "("), expr
        at += 1
        while toks[at] != ("op", ")"):
            kind, text = toks[at]
            if kind == "ident":
                q.grouping.add(text)
            elif text != ",":
                raise ValueError(f"{expr!r}: {text!r} in a label list")
            at += 1
        return at + 1

    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and text in LABEL_LISTS:
            i = label_list(i + 1)
            continue
        if kind == "ident" and (text in FUNCTIONS or text in AGGREGATIONS):
            pending = text
        elif kind == "ident" and nxt == ("op", "("):
            raise ValueError(f"{expr!r}: unknown function {text}()")
        elif kind == "ident":
            matchers = []
            if nxt == ("op", "{"):
                i += 2
                while toks[i] != ("op", "}"):
                    (lk, label), (_, op), (vk, value) = toks[i:i + 3]
                    assert lk == "ident" and vk == "string", (expr, toks[i:i + 3])
                    matchers.append((label, op, json.loads(value)))
                    i += 3
                    if toks[i] == ("op", ","):
                        i += 1
            q.selectors.append(Selector(text, tuple(matchers), tuple(stack)))
        elif text == "(":
            stack.append(pending or "")
            pending = None
        elif text == ")":
            stack.pop()
        i += 1
    assert not stack, expr
    return q


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (``label_values(S,
    L)``: the selector ``S``, its label ``L`` as a grouping label)."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", v["query"]["query"])
            assert m is not None, v
            out.append((f"variable ${v['name']}", f"sum by ({m[2]}) ({m[1]})"))
    return out


# ---- the expositions -------------------------------------------------------------------------


@dataclass
class Family:
    kind: str  # counter | gauge | histogram | ...
    samples: list[tuple[str, dict[str, str]]]
    declared: frozenset[str] | None = None  # its label names, when known without a sample

    def labels(self) -> set[str] | None:
        """The family's label names: of its samples, else as declared, else unknown."""
        if self.samples:
            return {k for _, sample in self.samples for k in sample}
        return None if self.declared is None else set(self.declared)


SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported(texts: list[str], declared: dict[str, frozenset[str]] | None = None
             ) -> dict[str, Family]:
    """Sample name -> its family (the names a family of that type has, also without
    samples yet: a counter ``x`` is ``x_total``, a histogram ``x_bucket`` / ``_sum`` /
    ``_count``); ``declared``: family name -> its label names, for families with no sample
    yet."""
    out: dict[str, Family] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            labels = (declared or {}).get(fam.name)
            for suffix in SUFFIXES.get(fam.type, ("",)):
                extra = {"le"} if suffix == "_bucket" else set()
                out.setdefault(fam.name + suffix, Family(
                    fam.type, [], None if labels is None else labels | extra))
            for s in fam.samples:
                out.setdefault(s.name, Family(fam.type, [])).samples.append(
                    (s.name, dict(s.labels)))
    return out


def router_declared_labels() -> dict[str, frozenset[str]]:
    """Family name -> label names of the router's labelled counters and histograms, read from
    the objects (a labelled series appears in /metrics only once used: retries, migrations,
    planner decisions, ...)."""
    from disagg.router.metrics import RouterMetrics

    out = {}
    for obj in vars(RouterMetrics(SimpleNamespace(pools={}))).values():  # type: ignore[arg-type]
        name = getattr(obj, "_name", None) or getattr(obj, "name", None)
        labels = getattr(obj, "_labelnames", None) or getattr(obj, "label_names", None)
        if isinstance(name, str) and labels is not None:
            out[name] = frozenset(labels)
    return out


def _matches(labels: dict[str, str], matchers: tuple[tuple[str, str, str], ...]) -> bool:
    for label, op, value in matchers:
        for var, all_value in ALL.items():
            value = value.replace(var, all_value)
        have = labels.get(label, "")  # PromQL: a missing label is the empty value
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def problems(where: str, expr: str, families: dict[str, Family]) -> list[str]:
    """What is wrong with ``expr`` against the expositions (empty: nothing)."""
    try:
        q = read_promql(expr)
    except ValueError as e:
        return [f"{where}: {e}"]
    errors = []
    labels_seen = set(TARGET_LABELS)
    unknown = False  # a series whose labels are unknown: the grouping labels are not checked
    for s in q.selectors:
        fam = families.get(s.name)
        if fam is None:
            errors.append(f"{where}: {s.name} is not exported")
            continue
        inner = next((f for f in reversed(s.functions) if f), "")
        counting = fam.kind in ("counter", "histogram") and not s.name.endswith("_created")
        if inner in RATES and not counting:
            errors.append(f"{where}: {inner}() of {s.name}, a {fam.kind}")
        if inner not in RATES and counting:
            errors.append(f"{where}: {s.name} ({fam.kind}) read without rate()/increase()")
        if s.name.endswith("_bucket") and "histogram_quantile" not in s.functions:
            errors.append(f"{where}: {s.name} outside histogram_quantile()")
        labels = fam.labels()
        if labels is None:  # no sample yet and nothing declared: its labels are unknown
            unknown = True
            continue
        labels_seen |= labels
        for label, _, _ in s.matchers:  # (even one matching its absence: a typo)
            if label not in labels | TARGET_LABELS:
                errors.append(f"{where}: {s.name} has no label {label!r}")
        if fam.samples and not any(_matches(sample, s.matchers) for _, sample in fam.samples):
            errors.append(f"{where}: {s.name}{{{s.matchers}}} matches no live sample")
    for label in q.grouping - labels_seen if not unknown else ():
        errors.append(f"{where}: grouping label {label!r} is on none of its series")
    return errors


def check_dashboard(dash: dict[str, Any], families: dict[str, Family]) -> list[str]:
    return [e for where, expr in dashboard_queries(dash)
            for e in problems(where, expr, families)]


# ---- the reader and the checks, on their own -------------------------------------------------


def test_the_promql_reader() -> None:
    q = read_promql('histogram_quantile(0.9, sum by (le, phase) (rate(x_bucket{a=~"$m",'
                    'b=""}[$__rate_interval]))) / sum(y_total) by (k)')
    assert q.selectors == [Selector("x_bucket", (("a", "=~", "$m"), ("b", "=", "")),
                                    ("histogram_quantile", "sum", "rate")),
                           Selector("y_total", (), ("sum",))]
    assert q.grouping == {"le", "phase", "k"}
    with pytest.raises(ValueError, match="unknown function ratee"):
        read_promql("ratee(x_total[5m])")
    with pytest.raises(ValueError, match="cannot read"):
        read_promql("x_total @ 5")


def test_the_checks_find_what_is_wrong() -> None:
    text = ("# TYPE c counter\nc_total{model_name=\"m\",role=\"context\"} 1\n"
            "# TYPE g gauge\ng{model_name=\"m\"} 2\ng 3\n"
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"
            "# TYPE lazy counter\n")
    fams = exported([text])
    assert "lazy_total" in fams and "h_count" in fams and "c_total" in fams
    good = ['sum by (role) (rate(c_total{model_name=~"$model",instance=~"$instance"}[1m]))',
            "histogram_quantile(0.5, sum by (le) (rate(h_bucket[1m])))",
            'max by (instance) (g{model_name=~"$model"})', "sum(rate(lazy_total[1m]))",
            'sum(g{model_name=""})']  # (the series without the label)
    assert [e for x in good for e in problems("ok", x, fams)] == []
    bad = {"sum(rate(c_totl[1m]))": "c_totl is not exported",
           "rate(g[1m])": "rate() of g, a gauge",
           "sum(c_total)": "read without rate()",
           "sum(rate(h_bucket[1m]))": "outside histogram_quantile",
           'sum(g{phase="x"})': "has no label 'phase'",
           'sum(g{phse=~".*"})': "has no label 'phse'",  # (matches an absent label)
           'sum(g{model_name="other"})': "matches no live sample",
           "sum by (worker) (g)": "grouping label 'worker'",
           "sum(foo(g))": "unknown function foo"}
    for expr, message in bad.items():
        found = problems("bad", expr, fams)
        assert any(message in e for e in found), (expr, found)


def test_layout_and_variables() -> None:
    dash = grafana.dashboard()
    panels = dash["panels"]
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    cells: set[tuple[int, int]] = set()
    variables = {"$" + v["name"] for v in dash["templating"]["list"]} | {"$__rate_interval"}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= grafana.WIDTH, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']!r} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["legendFormat"]
            used = set(re.findall(r"\$[A-Za-z_]+", t["expr"]))
            assert used <= variables, (p["title"], used - variables)
    assert dash["templating"]["list"][0] == {
        "name": "datasource", "label": "Data source", "type": "datasource",
        "query": "prometheus", "current": {}, "hide": 0, "options": [], "refresh": 1}
    # what the issue asks the dashboard to show, by the series it reads
    names = {s.name for _, expr in dashboard_queries(dash) for s in read_promql(expr).selectors}
    wanted = {
        "disagg_router_requests_total", "disagg_requests_finished_total",
        "disagg_time_to_first_token_seconds_bucket", "disagg_inter_token_latency_seconds_bucket",
        "disagg_e2e_request_latency_seconds_bucket",
        "disagg_router_request_latency_seconds_bucket",
        "disagg_router_time_to_first_token_seconds_bucket", "disagg_request_phase_seconds_sum",
        "disagg_request_phase_seconds_count", "disagg_request_phase_seconds_bucket",
        "disagg_kv_transfer_bytes_total", "disagg_kv_transfer_seconds_bucket",
        "disagg_kv_transfer_failures_total", "disagg_kv_leases_active",
        "disagg_num_requests_running", "disagg_num_requests_waiting", "disagg_kv_blocks_used",
        "disagg_kv_blocks_total", "disagg_prefix_cache_hit_tokens_total",
        "disagg_prefix_cache_queries_tokens_total", "disagg_router_planner_decisions_total",
        "disagg_router_role_switches_total", "disagg_router_retries_total",
        "disagg_router_migrations_total"}
    assert wanted <= names, wanted - names


def test_checked_in_files_are_up_to_date() -> None:
    for rel, text in grafana.files().items():
        path = REPO / "deploy/grafana" / rel
        assert path.read_text() == text, (
            f"deploy/grafana/{rel} is stale: re-render with `python -m disagg.deploy.grafana "
            f"deploy/grafana`")
    datasources = yaml.safe_load(grafana.DATASOURCE_YAML)["datasources"]
    assert [d["type"] for d in datasources] == ["prometheus"]
    [provider] = yaml.safe_load(grafana.DASHBOARDS_YAML)["providers"]
    assert provider["options"]["path"] == grafana.DASHBOARDS_DIR
    readme = (REPO / "deploy/grafana/README.md").read_text()
    assert f"{grafana.DASHBOARDS_DIR}/{grafana.FILE}" in readme and "grafana_dashboard" in readme


def test_the_module_writes_the_folder(tmp_path: Path) -> None:
    assert grafana.main([str(tmp_path)]) == 0
    for rel, text in grafana.files().items():
        assert (tmp_path / rel).read_text() == text
    assert json.loads((tmp_path / grafana.FILE).read_text())["uid"] == grafana.UID
    assert grafana.main([]) == 2


# ---- live: router + context + generation (TCP) -----------------------------------------------


@pytest.fixture(scope="module")
def cluster(model_dir: str, loop: LoopThread) -> Iterator[SimpleNamespace]:
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(serve_in_thread(worker_app(model_dir, "context")))
        gen = stack.enter_context(serve_in_thread(worker_app(model_dir, "generation")))
        config = {"model": model_dir, "health_check_interval_sec": 0.2,
                  "context_servers": {"urls": [ctx.removeprefix("http://")],
                                      "router": {"type": "kv_cache_aware"}},
                  "generation_servers": {"urls": [gen.removeprefix("http://")]}}
        router = stack.enter_context(running_router(config, loop))
        wait_for(lambda: httpx.get(router + "/health").status_code == 200, 30,
                 what="router health")
        yield SimpleNamespace(ctx=ctx, gen=gen, router=router)


def test_every_query_names_a_live_series(cluster: SimpleNamespace) -> None:
    with httpx.Client(timeout=60) as http:
        r = http.post(cluster.router + "/v1/completions", json={
            "model": NAME, "prompt": "The harbour was quiet and the boats rocked slowly",
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        bad = http.post(cluster.gen + "/v1/completions", json={"model": NAME, "prompt": 5})
        assert bad.status_code == 400, bad.text  # a refused request: requests_rejected
        texts = [http.get(url + "/metrics").text
                 for url in (cluster.router, cluster.ctx, cluster.gen)]
    families = exported(texts, router_declared_labels())
    dash = grafana.dashboard()
    used = {s.name for _, expr in dashboard_queries(dash) for s in read_promql(expr).selectors}
    # the series whose labels go unchecked: no sample without a failed KV read
    unchecked = sorted(n for n in used if n in families and families[n].labels() is None)
    assert unchecked == ["disagg_kv_transfer_failures_total"], unchecked
    # the request went through both workers and the router observed its phases
    assert any(labels.get("phase") == "kv_transfer"
               for _, labels in families["disagg_request_phase_seconds_count"].samples)
    problems_found = check_dashboard(dash, families)
    assert problems_found == [], "\n".join(problems_found)
    # the checked-in JSON is the same dashboard
    assert json.loads((REPO / "deploy/grafana" / grafana.FILE).read_text()) == (
        grafana.dashboard())
