"""Rate matching over parallel layouts: ``disagg bench rate-match --ctx-layouts tp1,tp2
--gen-layouts tp1,tp2,tp2+ep --serve-model DIR``.

A disaggregated cluster picks a layout per side: the context side's (tensor, pipeline, expert
parallelism) and the generation side's need not be the same (peers' results name clusters
such as ``CTX=1xTEP-4 | GEN=2xDEP-8``). For every layout of the context list this starts one
context worker (``disagg serve --role context`` on a free local port) and measures it as the
endpoint mode measures ``--context-url`` (package docstring, 1); for every layout of the
generation list one generation worker with ``--benchmark-gen-only`` (2); each worker alone on
this machine, stopped before the next starts. Then every (context layout, generation layout)
pair is rate-matched with its own devices (``tp * pp`` per worker: expert parallelism reuses
the tensor-parallel ranks) and one Pareto frontier is drawn over the points of all pairs: at
each speed per user, the layouts that give the most tokens/s per device.

A layout is ``tpN``, ``ppN`` or both joined by ``+`` (``tp2+pp2``), with ``+ep`` for expert
parallelism (MoE models: the experts partitioned over the tensor-parallel ranks, so ``tp`` must
be at least 2). Co-located measurement and ``--verify`` are the endpoint mode's (a layout sweep
measures every worker alone and verifies nothing).

Speculative decoding (``--gen-spec off,ngram:4``): every generation layout is measured once per
speculation setting, each a worker of its own started with ``--speculative-config`` (the
generation worker is the one that speculates; the context side is unchanged). A setting is
``off``, ``ngram[:K[:N]]`` (K draft tokens, n-grams of N tokens), ``draft:K:DIR`` (a draft
checkpoint) or a JSON object of ``--speculative-config``'s shape; a JSON list holds any of
them. Each (context layout, generation layout, setting) is a pair of its own, so the frontier
and the table ``spec_effect`` show how the matched ctx:gen ratio moves when the generation
side emits more tokens per forward. The worker's acceptance counters (its ``/metrics``) are
kept beside each generation measurement. Caveat: a ``--benchmark-gen-only`` worker decodes as
if the prompt's KV were in place without computing it, so what the target proposes to accept
follows from that KV, not from a real prefill: acceptance rates here show the cost side
(draft and verification work at the measured acceptance), not a workload's acceptance;
``bench/spec_decode.py`` measures acceptance on real prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from disagg import procs
from disagg.bench.client import Transport, make_transport
from disagg.bench.datasets import TokenizerLike
from disagg.bench.ratematch.config import RateMatchConfig
from disagg.bench.ratematch.model import pareto_frontier
from disagg.bench.ratematch.report import _config_json, build_result
from disagg.bench.ratematch.sweep import RateMatcher, note
from disagg.bench.runner import BenchmarkConfig, resolve_model
from disagg.config import ConfigError
from disagg.contracts.options import speculative_mapping

RESULT_KIND = "disagg-bench-rate-match-layouts"
RESULT_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """One worker's parallel layout."""

    tp: int = 1
    pp: int = 1
    ep: bool = False  # experts partitioned over the tp ranks (MoE models)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"layout {self.name}: tp and pp must be >= 1")
        if self.ep and self.tp < 2:
            raise ValueError(f"layout {self.name}: ep partitions the experts over the "
                             f"tensor-parallel ranks, so it needs tp >= 2")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp2``, ``pp2``, ``tp2+pp2``, ``tp2+ep`` (``tp1`` alone: one rank);
        ValueError naming the part that is not one of these."""
        tp = pp = None
        ep = False
        parts = text.strip().lower().split("+")
        for part in parts:
            if part == "ep" and not ep:
                ep = True
            elif part.startswith("tp") and part[2:].isdigit() and tp is None:
                tp = int(part[2:])
            elif part.startswith("pp") and part[2:].isdigit() and pp is None:
                pp = int(part[2:])
            else:
                raise ValueError(f"layout {text!r}: {part!r} is not tpN, ppN or ep (each at "
                                 f"most once, joined by '+', e.g. tp2+ep)")
        return cls(1 if tp is None else tp, 1 if pp is None else pp, ep)

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"] + ([f"pp{self.pp}"] if self.pp > 1 else [])
        return "+".join(parts + (["ep"] if self.ep else []))

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def serve_flags(self) -> list[str]:
        """``disagg serve`` flags (they override a ``--config`` file's values)."""
        return ["--tensor-parallel-size", str(self.tp), "--pipeline-parallel-size", str(self.pp),
                "--enable-expert-parallel" if self.ep else "--no-enable-expert-parallel"]


def parse_layouts(text: str, what: str) -> tuple[Layout, ...]:
    """A comma-separated list of layouts; ValueError naming ``what`` (the option)."""
    items = [s for s in (x.strip() for x in text.split(",")) if s]
    if not items:
        raise ValueError(f"{what}: give at least one layout (e.g. tp1,tp2,tp2+ep)")
    try:
        layouts = tuple(Layout.parse(s) for s in items)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    names = [lay.name for lay in layouts]
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: a layout is listed twice ({', '.join(names)})")
    return layouts


@dataclass(frozen=True)
class GenSpec:
    """One speculation setting of the generation workers: ``label`` names it in the results,
    ``config`` is ``--speculative-config``'s JSON object (None: speculation off)."""

    label: str
    config: dict[str, Any] | None = None

    def serve_flags(self) -> list[str]:
        return [] if self.config is None else ["--speculative-config",
                                               json.dumps(self.config, sort_keys=True)]


def _spec_label(cfg: dict[str, Any]) -> str:
    k = cfg["num_speculative_tokens"]
    if cfg["method"] == "ngram":
        lo, hi = cfg["prompt_lookup_min"], cfg["prompt_lookup_max"]
        return f"ngram:{k}" + ("" if (lo, hi) == (1, 4) else f":{lo}-{hi}" if lo != hi
                               else f":{hi}")
    return f"draft:{k}:{os.path.basename(os.path.normpath(cfg['model']))}"


def _gen_spec(item: Any) -> GenSpec:
    """One setting: ``off`` / null, a short form or a JSON object (module docstring)."""
    if item is None or (isinstance(item, str) and item.strip().lower() == "off"):
        return GenSpec("off")
    if isinstance(item, dict):
        cfg = speculative_mapping(item)
        return GenSpec(_spec_label(cfg), cfg)
    if not isinstance(item, str):
        raise ValueError(f"{item!r} is not off, a short form or a JSON object")
    parts = item.strip().split(":", 2)
    head = parts[0].lower()
    nums = parts[1:]
    if head == "ngram" and len(nums) <= 2 and all(n.isdigit() for n in nums):
        obj: dict[str, Any] = {"method": "ngram",
                               "num_speculative_tokens": int(nums[0]) if nums else 4}
        if len(nums) == 2:
            obj["prompt_lookup_max"] = int(nums[1])
    elif head in ("draft", "draft_model") and len(nums) == 2 and nums[0].isdigit() and nums[1]:
        obj = {"method": "draft_model", "num_speculative_tokens": int(nums[0]),
               "model": os.path.abspath(nums[1])}
        if not os.path.exists(obj["model"]):
            raise ValueError(f"{item!r}: no draft checkpoint at {obj['model']!r}")
    else:
        raise ValueError(f"{item!r} is not off, ngram[:K[:N]], draft:K:DIR or a JSON object")
    cfg = speculative_mapping(obj)
    return GenSpec(_spec_label(cfg), cfg)


def parse_gen_specs(text: str, what: str = "--gen-spec") -> tuple[GenSpec, ...]:
    """``off,ngram:4,draft:3:DIR`` or JSON (an object, or a list of objects / short forms /
    null); ValueError naming ``what``."""
    text = text.strip()
    try:
        if text.startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            items = value if isinstance(value, list) else [value]
        else:
            items = [s for s in (x.strip() for x in text.split(",")) if s]
        if not items:
            raise ValueError("give at least one setting (e.g. off,ngram:4)")
        specs = tuple(_gen_spec(x) for x in items)
    except (ValueError, ConfigError) as e:  # ConfigError names speculative_config's field
        raise ValueError(f"{what}: {e}") from None
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{what}: a setting is listed twice ({', '.join(labels)})")
    return specs


@dataclass(frozen=True)
class ServeSpec:
    """How the sweep starts its workers."""

    model_dir: str  # the checkpoint folder every worker serves
    log_dir: str  # one log per worker
    worker_config: str | None = None  # a `disagg serve --config` YAML: options of every worker
    timeout_s: float = 300.0  # start-up limit of each worker
    stop_timeout_s: float = 60.0


class ServedWorker:
    """``disagg serve`` with one layout and role on a free local port, as a context manager:
    the base URL on enter (once ``/health`` answers), stopped (SIGTERM, SIGKILL after
    ``stop_timeout_s``) on exit. RuntimeError with the log's tail when it does not start."""

    def __init__(self, spec: ServeSpec, layout: Layout, role: str, served_name: str,
                 gen_spec: GenSpec | None = None) -> None:
        self.spec, self.layout, self.role, self.served_name = spec, layout, role, served_name
        self.gen_spec = gen_spec  # a speculation setting (None: the worker's own config)
        self.proc: Any = None
        self.cluster_token = secrets.token_hex(16)
        tail = "" if gen_spec is None else "-spec-" + re.sub(r"[^A-Za-z0-9._-]+", "_",
                                                             gen_spec.label)
        self.log_path = os.path.join(spec.log_dir, f"{role}-{layout.name}{tail}.log")

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "disagg.cli", "serve", self.spec.model_dir,
               "--port", str(port), "--role", self.role,
               "--served-model-name", self.served_name, *self.layout.serve_flags()]
        if self.spec.worker_config:
            cmd += ["--config", self.spec.worker_config]
        if self.role == "generation":
            cmd.append("--benchmark-gen-only")
        if self.gen_spec is not None:
            cmd += self.gen_spec.serve_flags()
        return cmd

    def _spawn(self) -> str:
        os.makedirs(self.spec.log_dir, exist_ok=True)
        port = procs.free_port()
        # Workers of a role refuse to start without a cluster token; these serve only this
        # sweep's plain requests, so any fresh one will do.
        env = {**os.environ, "DISAGG_CLUSTER_TOKEN": self.cluster_token}
        # Its own process group (stop() ends its rank processes with it), and SIGTERM when
        # the thread that spawned it (this process's main thread) ends first: a sweep never
        # leaves a worker behind.
        self.proc = procs.spawn(self.command(port), self.log_path, env=env, header=True,
                                die_with_parent=True)
        return f"http://127.0.0.1:{port}"

    def _wait(self, url: str) -> None:
        try:
            procs.wait_healthy(url, self.spec.timeout_s, proc=self.proc, interval=0.2,
                               what=f"the {self.role} worker ({self.layout.name})")
        except procs.NotHealthy as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{procs.log_tail(self.log_path)}") from None

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, self.spec.stop_timeout_s, kill_wait_s=10)
            self.proc = None

    async def __aenter__(self) -> str:
        url = self._spawn()  # on the loop's thread: see _spawn
        await asyncio.to_thread(self._wait, url)
        return url

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


async def _model_name(config: RateMatchConfig, url: str, tr: Transport) -> str:
    bc = BenchmarkConfig(base_url=url, model=config.model, api_key=config.api_key,
                         http_client=config.http_client)
    return await resolve_model(bc, tr)


SPEC_METRICS = ("disagg_spec_decode_num_drafts_total", "disagg_spec_decode_num_draft_tokens_total",
                "disagg_spec_decode_num_accepted_tokens_total")


def spec_decode_counters(values: dict[str, float]) -> dict[str, Any] | None:
    """A worker's speculation counters (``metric_values`` of ``SPEC_METRICS``) and the
    acceptance rate and tokens per target forward derived from them; None when it exports
    none (speculation off)."""
    if not all(name in values for name in SPEC_METRICS):
        return None
    drafts, proposed, accepted = (int(values[name]) for name in SPEC_METRICS)
    return {"num_drafts": drafts, "num_draft_tokens": proposed,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_target_forward": (accepted + drafts) / drafts if drafts else None}


async def _spec_counters(url: str, worker: ServedWorker) -> dict[str, Any] | None:
    from disagg.launch import metric_values

    values = await asyncio.to_thread(metric_values, url, SPEC_METRICS, worker.cluster_token)
    return spec_decode_counters(values)


async def run_layout_sweep(
    config: RateMatchConfig, tok: TokenizerLike, spec: ServeSpec,
    ctx_layouts: Sequence[Layout], gen_layouts: Sequence[Layout], *,
    progress: TextIO | None = sys.stderr, gen_specs: Sequence[GenSpec] | None = None,
) -> dict[str, Any]:
    """Measure one worker per layout, rate-match every pair; the JSON result
    (``layouts_result``'s shape). ``config``'s URLs and devices are replaced per worker;
    the workers serve the checkpoint under ``config.model`` (default: its folder's name);
    ``config.aggregated_url``, when given, is measured once as the baseline. ``gen_specs``:
    every generation layout once per speculation setting (module docstring)."""
    if config.colocated:
        raise ValueError("colocated: a layout sweep measures each worker alone")
    agg_config = config
    served = config.model or os.path.basename(os.path.normpath(spec.model_dir))
    config = dataclasses.replace(config, model=served)
    tr = make_transport(config.http_client, config.request_timeout_s)
    contexts: list[dict[str, Any]] = []
    generations: list[dict[str, Any]] = []
    try:
        for lay in ctx_layouts:
            note(progress, f"layouts: context worker {lay.name}")
            async with ServedWorker(spec, lay, "context", served) as url:
                cfg = dataclasses.replace(config, context_url=url, ctx_devices=lay.devices)
                ctx = await RateMatcher(cfg, tok, tr, progress).sweep_context()
            contexts.append({"layout": lay.name, **ctx})
        for lay in gen_layouts:
            for gs in gen_specs or (None,):
                note(progress, f"layouts: generation worker {lay.name}"
                     + ("" if gs is None else f", speculation {gs.label}"))
                worker = ServedWorker(spec, lay, "generation", served, gs)
                async with worker as url:
                    cfg = dataclasses.replace(config, generation_url=url,
                                              gen_devices=lay.devices)
                    gen = await RateMatcher(cfg, tok, tr, progress).sweep_generation(None)
                    if gs is not None:  # counted over the worker's whole run (warm-ups too)
                        gen = {"spec": gs.label, "speculative_config": gs.config,
                               "spec_decode": await _spec_counters(url, worker), **gen}
                generations.append({"layout": lay.name, **gen})
        agg = None
        if agg_config.aggregated_url:
            # The baseline serves its own model name (--model, else its first listed).
            agg_config = dataclasses.replace(agg_config, model=await _model_name(
                agg_config, agg_config.aggregated_url, tr))
            agg = await RateMatcher(agg_config, tok, tr, progress).sweep_aggregated()
    finally:
        await tr.aclose()
    return layouts_result(config, spec, contexts, generations, agg)


def layouts_result(config: RateMatchConfig, spec: ServeSpec, contexts: list[dict[str, Any]],
                   generations: list[dict[str, Any]], agg: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """The JSON result from the measured workers::

        {"kind": "disagg-bench-rate-match-layouts", "version": 1, "date", "config",
         "model", "model_dir",
         "contexts": [{"layout", "devices", "ctx_rate", ... rate-match's "context"}],
         "generations": [{"layout", "devices", "points", ... rate-match's "generation"}],
         "pairs": [{"context_layout", "generation_layout", "ctx_devices", "gen_devices",
                    "ctx_rate", "rate_matched": [rate-match's points], "frontier": [...]}],
         "frontier": [the points of all pairs no other pair's point beats, each with its
                      "context_layout" and "generation_layout", by tokens_per_s_per_user],
         "aggregated": null | rate-match's "aggregated"}

    A context layout whose worker met the SLO at no rate is in ``contexts`` (``ctx_rate``
    null) and in no pair.

    With speculation settings (``--gen-spec``) every generation entry also has ``spec`` (its
    label), ``speculative_config`` (null: off) and ``spec_decode`` (the worker's counters:
    ``spec_decode_counters``, null when off); pairs and frontier points have
    ``generation_spec``; and ``spec_effect`` lists, per context layout, generation layout and
    concurrency, each setting's ``ctx_per_gen``, ``tokens_per_s_per_user`` and
    ``tput_per_device`` side by side (``spec_effect``)."""
    pairs = []
    for ctx in contexts:
        if ctx["ctx_rate"] is None:
            continue
        for gen in generations:
            cfg = dataclasses.replace(config, ctx_devices=ctx["devices"],
                                      gen_devices=gen["devices"])
            one = build_result(cfg, config.model, ctx, gen)
            pairs.append({"context_layout": ctx["layout"], "generation_layout": gen["layout"],
                          **({"generation_spec": gen["spec"]} if "spec" in gen else {}),
                          "ctx_devices": ctx["devices"], "gen_devices": gen["devices"],
                          "ctx_rate": ctx["ctx_rate"], "rate_matched": one["rate_matched"],
                          "frontier": one["frontier"]})
    tagged = [{**p, "context_layout": pair["context_layout"],
               "generation_layout": pair["generation_layout"],
               **({"generation_spec": pair["generation_spec"]}
                  if "generation_spec" in pair else {})}
              for pair in pairs for p in pair["rate_matched"]]
    keep = pareto_frontier([(p["tokens_per_s_per_user"], p["tput_per_device"])
                            for p in tagged])
    frontier = [{**tagged[i], "on_frontier": True} for i in keep]
    cfg_json = _config_json(config)
    for k in ("context_url", "generation_url", "ctx_devices", "gen_devices"):
        cfg_json.pop(k, None)  # per worker: in contexts / generations
    out = {"kind": RESULT_KIND, "version": RESULT_VERSION,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "config": cfg_json, "model": config.model, "model_dir": spec.model_dir,
           "contexts": contexts, "generations": generations, "pairs": pairs,
           "frontier": frontier, "aggregated": agg}
    if any("spec" in g for g in generations):
        out["gen_specs"] = list(dict.fromkeys(g["spec"] for g in generations if "spec" in g))
        out["spec_effect"] = spec_effect(pairs)
    return out


def spec_effect(pairs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """How speculation moves the rate match: per (context layout, generation layout,
    concurrency), each setting's matched ``ctx_per_gen`` (context workers per generation
    worker), ``tokens_per_s_per_user`` and ``tput_per_device``, in the settings' order, with
    each ratio against ``off`` when it was measured."""
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for pair in pairs:
        for p in pair["rate_matched"]:
            key = (pair["context_layout"], pair["generation_layout"], p["concurrency"])
            row = rows.setdefault(key, {"context_layout": key[0], "generation_layout": key[1],
                                        "concurrency": key[2], "by_spec": {}})
            row["by_spec"][pair.get("generation_spec", "off")] = {
                k: p[k] for k in ("ctx_per_gen", "tokens_per_s_per_user", "tput_per_device")}
    for row in rows.values():
        off = row["by_spec"].get("off")
        if off is None:
            continue
        for v in row["by_spec"].values():
            v["ctx_per_gen_vs_off"] = (v["ctx_per_gen"] / off["ctx_per_gen"]
                                       if off["ctx_per_gen"] else None)
    return list(rows.values())


def format_layouts(result: dict[str, Any]) -> str:
    """The end-of-run tables: every worker's measurement, the frontier over all pairs."""
    cfg = result["config"]
    lines = [f"{' Rate matching over layouts ':=^78}",
             f"model {result['model']!r}, isl {cfg['isl']}, osl {cfg['osl']}, TTFT SLO "
             f"{cfg['ttft_slo_ms']:g} ms at p{cfg['ttft_percentile']:g}"]
    for ctx in result["contexts"]:
        rate = ctx["ctx_rate"]
        lines.append(f"context {ctx['layout']:>10} ({ctx['devices']:g} dev): "
                     + ("no rate met the SLO" if rate is None else f"{rate:.3f} req/s"))
    for gen in result["generations"]:
        best = max(gen["points"], key=lambda p: p["output_throughput"])
        sd = gen.get("spec_decode")
        spec = "" if "spec" not in gen else f" spec {gen['spec']}" + (
            "" if not sd or sd["acceptance_rate"] is None else
            f" (acceptance {sd['acceptance_rate']:.2f}, "
            f"{sd['tokens_per_target_forward']:.2f} tok/fwd)")
        lines.append(f"generation {gen['layout']:>7}{spec} ({gen['devices']:g} dev): up to "
                     f"{best['output_throughput']:.1f} tok/s (concurrency "
                     f"{best['concurrency']}), "
                     f"{max(p['tokens_per_s_per_user'] for p in gen['points']):.2f} tok/s/user "
                     f"at best")
    specs = "gen_specs" in result
    lines.append(f"{' frontier over all pairs ':-^78}")
    lines.append(f"{'ctx':>10} {'gen':>10} " + (f"{'spec':>12} " if specs else "")
                 + f"{'conc':>5} {'tok/s/user':>11} {'ctx:gen':>9} {'tok/s/dev':>10}")
    for p in result["frontier"]:
        lines.append(f"{p['context_layout']:>10} {p['generation_layout']:>10} "
                     + (f"{p.get('generation_spec', 'off'):>12} " if specs else "")
                     + f"{p['concurrency']:>5} {p['tokens_per_s_per_user']:>11.2f} "
                     f"{p['ctx_per_gen']:>7.2f}:1 {p['tput_per_device']:>10.1f}")
    if not result["frontier"]:
        lines.append("(none: no context layout met the TTFT SLO)")
    if specs and result.get("spec_effect"):
        labels = result["gen_specs"]
        lines.append(f"{' matched ctx:gen by speculation (tok/s/user) ':-^78}")
        lines.append(f"{'ctx':>6} {'gen':>6} {'conc':>4} "
                     + " ".join(f"{lbl[:18]:>18}" for lbl in labels))
        for row in result["spec_effect"]:
            cells = []
            for lbl in labels:
                v = row["by_spec"].get(lbl)
                cells.append(f"{'-':>18}" if v is None else
                             f"{v['ctx_per_gen']:>6.2f}:1 ({v['tokens_per_s_per_user']:>6.2f})")
            lines.append(f"{row['context_layout']:>6} {row['generation_layout']:>6} "
                         f"{row['concurrency']:>4} " + " ".join(cells))
    lines.append("=" * 78)
    return "\n".join(lines)
