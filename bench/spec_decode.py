"""Speculative decoding on CPU: TPOT and output tokens/s with speculation off and on.

For each model (``tiny``: ``disagg.model.tiny``'s default random checkpoint; ``smollm2``:
SmolLM2-135M-Instruct as ``disagg model fetch smollm2`` imports it) and each method:

- ``off``: no speculation (the baseline every ratio is taken against);
- ``ngram``: prompt lookup (``--ngram-k`` tokens, n-grams of ``--ngram-max`` tokens);
- ``draft``: a draft model that is a smaller checkpoint of the same family, built here from
  the target's own weights by keeping its first L layers (embeddings, final norm and lm_head
  kept): a layer-truncated self-draft. L is picked per model by a short measurement of
  acceptance against cost over ``--pick-layers`` (or fixed with ``--draft-layers``);
- ``self`` (the tiny model only, by default): the target as its own draft, an upper bound of
  what a draft can do (every draft is accepted) at the price of a second full model.

Two prompt sets, greedy (temperature 0), fixed output length (``ignore_eos``):
``extractive`` (copy or lightly edit a given passage of code or prose: prompt lookup finds the
continuation in the prompt) and ``plain`` (open questions: nothing to look up). Batch 1 runs
the set's requests one after another; batch 16 runs 16 requests at once (the set cycled).

The machines are shared and their speed drifts, so every repetition runs every method back to
back on the same (set, batch) before moving on, and each ratio is the median of per-repetition
ratios against the ``off`` run of the same repetition. Per row: TPOT (median over requests of
(last token - first token) / (tokens - 1)), output tokens/s (all output tokens over the run's
wall time, prefill included), acceptance rate (accepted / proposed draft tokens) and tokens
per target forward ((accepted + drafts) / drafts, a draft = one request's speculative step),
both from ``LLMEngine.stats()``; the gap from the first to the second token (the first decode
step: where a draft model computes the prompt's KV of its own, its "catch-up", counted by
``DraftModelProposer.num_catch_up_tokens`` / ``num_forwards``); whether the output equals
``off``'s (greedy speculation must not change it).

    python -m bench.spec_decode [--models tiny,smollm2] [--batches 1,16] [--reps 3]
        [--max-tokens 32] [--draft-layers L | --pick-layers 2,4,8]
        [--out bench/results/spec_decode.md]
"""

from __future__ import annotations

import argparse
import json
import os

# As bench/engine_throughput.py: passive OpenMP waits keep runs on a shared 2-core box steady.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.engine_throughput import describe_model, machine_lines
from disagg.engine import LLMEngine
from disagg.model.tiny import ensure_tiny_model
from disagg.request import SamplingParams
from disagg.tokenizer import Tokenizer, load_tokenizer

SMOLLM2_DIR = os.path.expanduser("~/.cache/disagg/models/smollm2")
CACHE_DIR = os.path.expanduser("~/.cache/disagg/spec-bench")
METHODS = ("off", "ngram", "draft", "self")
WORKLOADS = ("extractive", "plain")

# Passages the extractive prompts ask the model to copy or edit: code and prose of the kind
# such requests carry (written for this benchmark).
_CODE = [
    '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
''',
    '''class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]
''',
    '''def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings
''',
]
_PROSE = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night "
    "its keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that turned "
    "the great lens. Ships passing the rocks below saw the beam sweep across the water every "
    "ten seconds, and they knew exactly where they were.",
    "To make a simple loaf of bread, mix flour, water, salt and yeast into a soft dough. Knead "
    "it for about ten minutes until it is smooth, then let it rise in a warm place for an hour. "
    "Shape the dough, let it rise again, and bake it in a hot oven until the crust is golden "
    "and the loaf sounds hollow when tapped.",
    "Our quarterly meeting is moved from Tuesday to Thursday at ten in the morning. Please "
    "bring the updated budget figures, the list of open hiring positions and a short summary "
    "of each project's progress. The meeting will be held in the large conference room on the "
    "third floor, and lunch will be provided afterwards.",
]
_EXTRACTIVE = [
    ("Rename the variable `total` to `running_sum` in this code and output the whole code:\n"
     "```python\n{c0}```"),
    "Add a docstring to each method of this class and output the whole class:\n"
    "```python\n{c1}```",
    "Repeat the following code exactly, without any change:\n```python\n{c2}```",
    "Repeat the following text exactly:\n\n{p0}",
    "Fix any spelling mistakes in this paragraph and output the corrected paragraph in "
    "full:\n\n{p1}",
    "Rewrite this announcement with `Thursday` replaced by `Friday`, keeping everything "
    "else:\n\n{p2}",
]
_PLAIN = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe the water cycle to a ten-year-old.",
    "Give some advice to someone starting their first job.",
    "Why do leaves change colour in autumn?",
]


def prompt_texts(kind: str) -> list[str]:
    """The user messages of a prompt set (``extractive`` or ``plain``)."""
    if kind == "plain":
        return list(_PLAIN)
    if kind != "extractive":
        raise ValueError(f"workload: {kind!r} is not one of {WORKLOADS}")
    fill = {f"c{i}": c for i, c in enumerate(_CODE)} | {f"p{i}": p for i, p in enumerate(_PROSE)}
    return [t.format(**fill) for t in _EXTRACTIVE]


def build_prompts(tok: Tokenizer, kind: str) -> list[list[int]]:
    """Token ids of a prompt set, through the chat template when the tokenizer has one."""
    out = []
    for text in prompt_texts(kind):
        if tok.chat_template:
            chat = tok.apply_chat_template([{"role": "user", "content": text}])
            out.append(tok.encode(chat, add_special_tokens=False))
        else:
            out.append(tok.encode(text))
    return out


# ---------------------------------------------------------------------- the draft checkpoint


def truncate_checkpoint(src: str, dst: str, layers: int) -> str:
    """Write ``src``'s first ``layers`` decoder layers (and its embeddings, final norm and
    lm_head, tokenizer and generation config) as a checkpoint in ``dst``; kept when ``dst``
    already holds this truncation. Returns ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    n = int(cfg["num_hidden_layers"])
    if not 1 <= layers <= n:
        raise ValueError(f"layers: {layers} is not in [1, {n}] ({src} has {n} layers)")
    stamp = {"source": os.path.abspath(src), "layers": layers,
             "source_mtime": os.path.getmtime(os.path.join(src, "config.json"))}
    stamp_path = os.path.join(dst, "truncated_from.json")
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return dst
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{src}: no .safetensors weights to truncate")
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(src, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                parts = key.split(".")
                if "layers" in parts:
                    i = parts.index("layers")
                    if i + 1 < len(parts) and parts[i + 1].isdigit() and \
                            int(parts[i + 1]) >= layers:
                        continue
                weights[key] = f.get_tensor(key)
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if name.endswith((".json", ".jinja", ".model", ".txt")) and name != "config.json" \
                and not name.endswith(".index.json"):
            shutil.copy(os.path.join(src, name), os.path.join(tmp, name))
    cfg["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists, cut with the layers
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, "truncated_from.json"), "w") as f:
        json.dump(stamp, f)
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return dst


def num_layers(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["num_hidden_layers"])


# ------------------------------------------------------------------------------ measuring


@dataclass
class RunResult:
    """One method on one (prompt set, batch): the numbers of one repetition."""

    wall_s: float
    output_tokens: int
    tpot_s: list[float]  # per request
    second_token_s: list[float]  # first -> second token, per request
    outputs: list[list[int]]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    target_forwards: int = 0  # engine steps
    catch_up_tokens: int | None = None
    draft_forwards: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass
class Method:
    """A speculation setting and its engine (kept across repetitions)."""

    name: str
    label: str
    spec: dict[str, Any] | None
    engine: LLMEngine | None = field(default=None, repr=False)


def make_engine(model_dir: str, spec: dict[str, Any] | None, max_batch: int,
                max_len: int) -> LLMEngine:
    opts: dict[str, Any] = dict(
        max_batch_size=max_batch, max_num_tokens=2048, tokens_per_block=16,
        kv_cache_tokens=max_batch * (max_len + 64), enable_prefix_caching=False)
    if spec is not None:
        opts["speculative_config"] = spec
    return LLMEngine.from_options(model_dir, **opts)


def _counters(engine: LLMEngine) -> tuple[int, int, int, int, int | None, int | None]:
    s = engine.stats()
    p = engine.proposer
    return (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
            s.steps_total, getattr(p, "num_catch_up_tokens", None),
            getattr(p, "num_forwards", None))


def measure(engine: LLMEngine, prompts: Sequence[list[int]], batch: int,
            max_tokens: int) -> RunResult:
    """Run ``prompts`` in groups of ``batch`` (each group together, one after another),
    greedy, ``max_tokens`` each; timings from the engine's per-request metrics."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _counters(engine)
    outputs: list[list[int]] = []
    tpot: list[float] = []
    second: list[float] = []
    t0 = time.perf_counter()
    for g in range(0, len(prompts), batch):
        group = prompts[g:g + batch]
        rids = [f"r{g + i}-{time.monotonic_ns()}" for i in range(len(group))]
        for rid, p in zip(rids, group, strict=True):
            engine.add_request(rid, p, params)
        t2: dict[str, float] = {}
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
                n = len(out.outputs[0].token_ids)
                if n >= 2 and out.request_id not in t2:
                    assert out.metrics.last_token_time is not None
                    t2[out.request_id] = out.metrics.last_token_time
                if out.finished:
                    final[out.request_id] = out
        for rid in rids:
            out = final[rid]
            m = out.metrics
            toks = out.outputs[0].token_ids
            assert m.first_token_time is not None and m.last_token_time is not None
            outputs.append(list(toks))
            tpot.append((m.last_token_time - m.first_token_time) / max(len(toks) - 1, 1))
            second.append(t2[rid] - m.first_token_time)
    wall = time.perf_counter() - t0
    after = _counters(engine)
    d = [a - b for a, b in zip(after[:4], before[:4], strict=True)]
    res = RunResult(wall, sum(len(o) for o in outputs), tpot, second, outputs, *d)
    if after[4] is not None and before[4] is not None:
        res.catch_up_tokens = after[4] - before[4]
        assert after[5] is not None and before[5] is not None
        res.draft_forwards = after[5] - before[5]
    return res


def batch_prompts(prompts: Sequence[list[int]], batch: int, batch1_requests: int
                  ) -> list[list[int]]:
    """Batch 1: the set's first ``batch1_requests`` prompts, one after another; batch B:
    B requests (the set cycled)."""
    n = batch1_requests if batch == 1 else batch
    return [list(prompts[i % len(prompts)]) for i in range(n)]


# ------------------------------------------------------------------------------ summaries


def summarize(runs: Sequence[RunResult], offs: Sequence[RunResult]) -> dict[str, Any]:
    """A row over repetitions; ``offs``: the ``off`` runs of the same repetitions."""
    drafts = sum(r.drafts for r in runs)
    proposed = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted for r in runs)
    row: dict[str, Any] = {
        "reps": len(runs),
        "tpot_ms": 1e3 * statistics.median(t for r in runs for t in r.tpot_s),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "ratio_vs_off": statistics.median(r.tokens_per_s / o.tokens_per_s
                                          for r, o in zip(runs, offs, strict=True)),
        "ratio_range": [min(r.tokens_per_s / o.tokens_per_s for r, o in zip(runs, offs,
                                                                             strict=True)),
                        max(r.tokens_per_s / o.tokens_per_s for r, o in zip(runs, offs,
                                                                             strict=True))],
        "tpot_ratio_vs_off": statistics.median(
            statistics.median(r.tpot_s) / statistics.median(o.tpot_s)
            for r, o in zip(runs, offs, strict=True)),
        "second_token_ms": 1e3 * statistics.median(t for r in runs for t in r.second_token_s),
        "acceptance_rate": accepted / proposed if proposed else None,
        "tokens_per_target_forward": (accepted + drafts) / drafts if drafts else None,
        "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
        "engine_steps": sum(r.target_forwards for r in runs),
        "output_tokens": sum(r.output_tokens for r in runs),
        "identical_to_off": all(r.outputs == o.outputs for r, o in zip(runs, offs,
                                                                       strict=True)),
    }
    if runs[0].catch_up_tokens is not None:
        row["draft_catch_up_tokens"] = sum(r.catch_up_tokens or 0 for r in runs)
        row["draft_forwards"] = sum(r.draft_forwards or 0 for r in runs)
    return row


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def headline(model: str, rows: Sequence[dict[str, Any]], batches: Sequence[int]) -> str:
    """One sentence per method: its tokens/s ratio on each set at each batch."""
    parts = []
    for method in ("ngram", "draft", "self"):
        mine = {(r["workload"], r["batch"]): r for r in rows if r["method"] == method}
        if not mine:
            continue
        label = next(r["label"] for r in rows if r["method"] == method)
        per_batch = []
        for b in batches:
            ws = [f"x{mine[(w, b)]['ratio_vs_off']:.2f} on the {w} set"
                  for w in WORKLOADS if (w, b) in mine]
            if ws:
                per_batch.append(f"{', '.join(ws)} at batch {b}")
        parts.append(f"{label}: {'; '.join(per_batch)}")
    return f"**{model}** tokens/s vs off: " + ". ".join(parts) + "."


# --------------------------------------------------------------------------------- driver


def _models(names: Sequence[str], smollm2: str) -> list[tuple[str, str, str]]:
    """(name, label, checkpoint folder) per model asked for."""
    out = []
    for name in names:
        if name == "tiny":
            out.append(("tiny", "tiny (random weights)", ensure_tiny_model()))
        elif name == "smollm2":
            if not os.path.isfile(os.path.join(smollm2, "config.json")):
                raise SystemExit(f"--smollm2: no checkpoint at {smollm2!r} (`disagg model "
                                 f"fetch smollm2 DIR` imports one)")
            out.append(("smollm2", "SmolLM2-135M-Instruct", smollm2))
        else:
            raise SystemExit(f"--models: {name!r} is not tiny or smollm2")
    return out


def _spec(args: argparse.Namespace, method: str, draft: str | None) -> dict[str, Any] | None:
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                "prompt_lookup_max": args.ngram_max}
    assert draft is not None
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": args.draft_k}


def pick_draft_layers(args: argparse.Namespace, model_dir: str, name: str, prompts: dict[
        str, list[list[int]]], max_len: int, log: Any) -> tuple[int, list[dict[str, Any]]]:
    """The draft depth with the best batch-1 tokens/s over both sets (a short run: two
    prompts of each set, ``--pick-tokens`` each), and the table it was picked from."""
    n = num_layers(model_dir)
    cands = [L for L in args.pick_layers if L < n] or [max(1, n // 2)]
    if args.draft_layers is not None:
        return args.draft_layers, []
    if len(cands) == 1:
        return cands[0], []
    work = [p for w in WORKLOADS for p in prompts[w][:2]]
    off = make_engine(model_dir, None, 1, max_len)
    measure(off, work[:1], 1, 4)  # warm-up
    table = []
    for L in cands:
        d = truncate_checkpoint(model_dir, os.path.join(CACHE_DIR, f"{name}-L{L}"), L)
        eng = make_engine(model_dir, _spec(args, "draft", d), 1, max_len)
        measure(eng, work[:1], 1, 4)
        base = measure(off, work, 1, args.pick_tokens)
        r = measure(eng, work, 1, args.pick_tokens)
        eng.shutdown()
        table.append({"layers": L, "acceptance_rate": r.accepted / r.draft_tokens
                      if r.draft_tokens else None,
                      "tokens_per_target_forward": (r.accepted + r.drafts) / r.drafts
                      if r.drafts else None,
                      "ratio_vs_off": r.tokens_per_s / base.tokens_per_s,
                      "tokens_per_s": r.tokens_per_s, "off_tokens_per_s": base.tokens_per_s})
        print(f"  pick {name} L={L}: {table[-1]}", file=log, flush=True)
    off.shutdown()
    best = max(table, key=lambda t: t["ratio_vs_off"])
    return best["layers"], table


def run_model(args: argparse.Namespace, name: str, label: str, model_dir: str,
              log: Any) -> dict[str, Any]:
    tok = load_tokenizer(model_dir)
    prompts = {w: build_prompts(tok, w) for w in WORKLOADS}
    max_prompt = max(len(p) for ps in prompts.values() for p in ps)
    max_len = max_prompt + args.max_tokens + max(args.ngram_k, args.draft_k) + 8
    methods_wanted = [m for m in args.methods if m != "self" or name in args.self_draft]
    layers, pick_table = (0, [])
    draft_dir = None
    if "draft" in methods_wanted:
        layers, pick_table = pick_draft_layers(args, model_dir, name, prompts, max_len, log)
        draft_dir = truncate_checkpoint(model_dir, os.path.join(CACHE_DIR, f"{name}-L{layers}"),
                                        layers)
    labels = {"off": "off", "ngram": f"ngram k={args.ngram_k} n={args.ngram_max}",
              "draft": f"draft {layers}/{num_layers(model_dir)} layers k={args.draft_k}",
              "self": f"draft = target itself k={args.draft_k} (upper bound)"}
    methods = []
    for m in methods_wanted:
        d = model_dir if m == "self" else draft_dir
        spec = _spec(args, "draft" if m == "self" else m, d)
        methods.append(Method(m, labels[m], spec))
    max_batch = max(args.batches)
    for m in methods:
        m.engine = make_engine(model_dir, m.spec, max_batch, max_len)
        measure(m.engine, [prompts["plain"][0]], 1, 4)  # warm-up
    runs: dict[tuple[str, int, str], list[RunResult]] = {}
    # The tiny model's runs last milliseconds: more repetitions for the same steadiness.
    reps = args.tiny_reps if name == "tiny" else args.reps
    for rep in range(reps):
        for w in WORKLOADS:
            for b in args.batches:
                work = batch_prompts(prompts[w], b, args.batch1_requests)
                # Alternate the order between repetitions: neither side always goes first.
                order = methods if rep % 2 == 0 else methods[::-1]
                for m in order:
                    assert m.engine is not None
                    r = measure(m.engine, work, b, args.max_tokens)
                    runs.setdefault((w, b, m.name), []).append(r)
                    print(f"  {name} rep {rep + 1} {w} b{b} {m.name}: "
                          f"{r.tokens_per_s:.1f} tok/s, tpot "
                          f"{1e3 * statistics.median(r.tpot_s):.1f} ms, acc "
                          f"{r.accepted}/{r.draft_tokens}", file=log, flush=True)
    for m in methods:
        assert m.engine is not None
        m.engine.shutdown()
    rows = []
    for w in WORKLOADS:
        for b in args.batches:
            offs = runs[(w, b, "off")]
            for m in methods:
                rows.append({"workload": w, "batch": b, "method": m.name, "label": m.label,
                             **summarize(runs[(w, b, m.name)], offs)})
    return {"model": name, "label": label, "model_dir": model_dir,
            "describe": describe_model(model_dir),
            "prompt_tokens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
            "draft_layers": layers or None, "draft_dir": draft_dir,
            "draft_pick": pick_table,
            "methods": {m.name: {"label": m.label, "speculative_config": m.spec}
                        for m in methods},
            "rows": rows, "headline": headline(label, rows, args.batches)}


def render(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# Speculative decoding on CPU: TPOT and tokens/s, off vs on",
        "",
        f"Written by `{result['command']}` ({result['date']}); the numbers below are the "
        "script's own output (raw runs in the .json beside this file). Method: the "
        "`bench/spec_decode.py` docstring.",
        "",
        *result["machine"],
        f"- workload: greedy, {a['max_tokens']} output tokens per request (ignore_eos), "
        f"prefix caching off; batch 1 = {a['batch1_requests']} requests one after another, "
        f"batch B = B requests at once (the set cycled); {a['reps']} repetitions "
        f"({a['tiny_reps']} for the tiny model), methods "
        "interleaved (order reversed every other repetition); ratio = median over "
        "repetitions of tokens/s / off's tokens/s in the same repetition",
        "",
        "## Headline",
        "",
        *[m["headline"] + "\n" for m in result["models"]],
    ]
    for m in result["models"]:
        lines += [f"## {m['label']}", "", f"- model: {m['describe']}",
                  "- prompt tokens: " + "; ".join(
                      f"{w} {min(v)}-{max(v)}" for w, v in m["prompt_tokens"].items())]
        for meth in m["methods"].values():
            if meth["speculative_config"]:
                lines.append(f"- {meth['label']}: `{json.dumps(meth['speculative_config'])}`")
        if m["draft_layers"]:
            lines.append(f"- draft: the target's first {m['draft_layers']} layers (embeddings, "
                         "final norm, lm_head kept), written to `" + str(m["draft_dir"]) + "`")
        if m["draft_pick"]:
            lines += ["", "Draft depth, picked by batch-1 tokens/s over both sets (two prompts "
                      f"each, {a['pick_tokens']} tokens; one run each):", "",
                      "| layers | acceptance | tokens/target fwd | tok/s | off tok/s | ratio |",
                      "|---|---|---|---|---|---|"]
            for t in m["draft_pick"]:
                lines.append(f"| {t['layers']} | {_fmt(t['acceptance_rate'])} | "
                             f"{_fmt(t['tokens_per_target_forward'])} | "
                             f"{t['tokens_per_s']:.1f} | {t['off_tokens_per_s']:.1f} | "
                             f"x{t['ratio_vs_off']:.2f} |")
            lines.append(f"\n-> L = {m['draft_layers']}")
        lines += ["", "| set | batch | method | TPOT ms | TPOT vs off | tok/s | tok/s vs off "
                  "(range) | acceptance | tokens/target fwd | 1st->2nd token ms | draft "
                  "catch-up tokens / draft fwds | same output as off |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            lo, hi = r["ratio_range"]
            catch = (f"{r['draft_catch_up_tokens']} / {r['draft_forwards']}"
                     if "draft_catch_up_tokens" in r else "-")
            lines.append(
                f"| {r['workload']} | {r['batch']} | {r['label']} | {r['tpot_ms']:.1f} | "
                f"x{r['tpot_ratio_vs_off']:.2f} | {r['tokens_per_s']:.1f} | "
                f"x{r['ratio_vs_off']:.2f} ({lo:.2f}-{hi:.2f}) | "
                f"{_fmt(r['acceptance_rate'])} | {_fmt(r['tokens_per_target_forward'])} | "
                f"{r['second_token_ms']:.1f} | {catch} | "
                f"{'yes' if r['identical_to_off'] else 'NO'} |")
        lines.append("")
    lines += [
        "Notes: acceptance = accepted / proposed draft tokens; tokens/target fwd = (accepted + "
        "drafts) / drafts, a draft being one request's speculative step (from "
        "`LLMEngine.stats()`). TPOT is the median over requests of (last - first token time) "
        "/ (tokens - 1) (TPOT vs off: median over repetitions of the ratio of the runs' "
        "median TPOTs, below 1 is faster); tok/s counts all output tokens over the run's "
        "wall time (prefills included). 1st->2nd token: the first decode step, where a draft "
        "model first computes the prompt's KV itself (catch-up tokens: prompt positions the "
        "draft computed, summed over the rows' requests and repetitions).",
        ""]
    return "\n".join(lines)


def _csv(kind: type, choices: Sequence[str] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(s.strip()) for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {list(choices)}")
        return items
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_decode",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", type=_csv(str, ("tiny", "smollm2")),
                    default=["tiny", "smollm2"])
    ap.add_argument("--methods", type=_csv(str, METHODS), default=list(METHODS),
                    help="off is always measured (the baseline)")
    ap.add_argument("--self-draft", type=_csv(str, ("tiny", "smollm2")), default=["tiny"],
                    help="models that also get the 'self' row (target as its own draft)")
    ap.add_argument("--batches", type=_csv(int), default=[1, 16])
    ap.add_argument("--reps", type=int, default=3, help="repetitions (SmolLM2)")
    ap.add_argument("--tiny-reps", type=int, default=15,
                    help="repetitions of the tiny model (its runs last milliseconds)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch1-requests", type=int, default=4,
                    help="requests of a batch-1 run (one after another)")
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="draft depth (default: picked from --pick-layers)")
    ap.add_argument("--pick-layers", type=_csv(int), default=[2, 4, 8])
    ap.add_argument("--pick-tokens", type=int, default=32)
    ap.add_argument("--smollm2", default=SMOLLM2_DIR, help="SmolLM2 checkpoint folder")
    ap.add_argument("--out", default="bench/results/spec_decode.md",
                    help="markdown report (the JSON goes beside it); '-' prints only")
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    for flag in ("reps", "tiny_reps", "max_tokens", "batch1_requests", "ngram_k", "ngram_max",
                 "draft_k", "pick_tokens"):
        if getattr(args, flag) < 1 or (flag == "max_tokens" and args.max_tokens < 2):
            raise SystemExit(f"--{flag.replace('_', '-')}: too small "
                             f"({getattr(args, flag)})")
    if any(b < 1 for b in args.batches):
        raise SystemExit("--batches: every batch must be >= 1")
    if "off" not in args.methods:
        args.methods = ["off", *args.methods]
    load0 = os.getloadavg()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    log = sys.stderr
    models = [run_model(args, n, lbl, d, log) for n, lbl, d in _models(args.models,
                                                                         args.smollm2)]
    result = {"kind": "disagg-bench-spec-decode", "version": 1,
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python -m bench.spec_decode " + " ".join(argv_list),
              "args": vars(args), "machine": machine_lines(load0), "models": models}
    text = render(result)
    print(text)
    if args.out != "-":
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
