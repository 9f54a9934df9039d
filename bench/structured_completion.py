"""Structured outputs a small model completes: the README's two examples, run as the README
writes them (``client.chat.completions.parse(model=..., response_format=City, max_tokens=200,
messages=[{"role": "user", "content": "Largest city?"}])`` and ``tool_choice="required"`` with
its ``get_weather`` tool, "Oslo?", max_tokens=200), through a live ``disagg serve`` worker
with the ``openai`` SDK, on SmolLM2 and on the tiny random model.

For each: the share of answers that match the schema within max_tokens (the ``City`` parsed;
every tool call's arguments parse against the tool's schema and finish_reason is
"tool_calls") over ``--seeds`` seeds at the default temperature (sampled, seed = 0..N-1) and
at temperature 0, and the completion tokens they used (mean / max, failures included).

Side by side, in this process through the offline engine (``disagg.LLM``: the same chat
prompt and the same ``SamplingParams`` the server builds), the grammar as it is now and as it
was before the default bounds (commit aa0fc05: the schema's keys sorted, llguidance's JSON with
``whitespace_pattern`` one space or a newline and up to 16 blanks, no default bounds), by
swapping ``disagg.structured.grammar.grammar_text`` for that one. How many offline "now"
answers equal the live worker's is reported, so the offline path is shown to be the server's.

    python -m bench.structured_completion [--smollm2 DIR] [--tiny DIR] [--seeds 20]
                                          [--out bench/results/structured_completion.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pydantic

from disagg import __version__
from disagg.procs import NotHealthy, free_ports, log_tail, spawn, stop_all
from disagg.procs import wait_healthy as wait_child_healthy

ROOT = Path(__file__).resolve().parents[1]

NAME = "model"
MAX_TOKENS = 200
MAX_MODEL_LEN = 2048
CONCURRENCY = 8  # requests in flight against the live worker (it batches them)
CITY_MESSAGES = [{"role": "user", "content": "Largest city?"}]
TOOL_MESSAGES = [{"role": "user", "content": "Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TEMPERATURES: dict[str, float | None] = {"default (1, seeded)": None, "0": 0.0}
# The grammar before the default bounds (commit aa0fc05's disagg/structured/grammar.py).
BEFORE_WHITESPACE = r"(?:\x20|\n[\x20\x09]{0,16})?"


class City(pydantic.BaseModel):  # the README's
    name: str
    population: int


class WeatherArgs(pydantic.BaseModel):  # get_weather's parameters: city required, others free
    city: str


@dataclass(frozen=True)
class Outcome:
    ok: bool
    tokens: int | None  # completion tokens (None: the reply did not say)
    finish: str
    text: str  # the answer's content, or its tool calls as "name arguments"
    calls: tuple[tuple[str, Any], ...] = ()  # (name, parsed arguments or their text)


# -- checks -----------------------------------------------------------------------------------


def tool_calls_ok(calls: list[tuple[str, str]]) -> bool:
    """Every (name, arguments) call is get_weather with arguments matching its schema."""
    if not calls:
        return False
    try:
        for name, args in calls:
            parsed = json.loads(args)
            if name != "get_weather" or not isinstance(parsed, dict):
                return False
            WeatherArgs.model_validate(parsed)
    except (ValueError, pydantic.ValidationError):
        return False
    return True


def city_ok(text: str, finish: str) -> bool:
    if finish == "length":
        return False
    try:
        City.model_validate_json(text)
    except pydantic.ValidationError:
        return False
    return True


# -- the live worker --------------------------------------------------------------------------


@contextmanager
def live_worker(model: str, logs: Path) -> Iterator[str]:
    port = free_ports(1)[0]
    log = logs / f"serve-{Path(model).name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = spawn([sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port),
               "--served-model-name", NAME, "--log-level", "warning",
               "--max-model-len", str(MAX_MODEL_LEN)], log, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_child_healthy(url, 600.0, proc=p, interval=0.2, what="disagg serve")
        except NotHealthy as e:
            raise RuntimeError(f"{e}:\n{log_tail(log)}") from None
        yield url
    finally:
        stop_all([p], grace_s=30.0)


def live_city(client: openai.OpenAI, seed: int, temperature: float | None) -> Outcome:
    kw: dict[str, Any] = {"seed": seed}
    if temperature is not None:
        kw["temperature"] = temperature
    try:
        r = client.chat.completions.parse(model=NAME, response_format=City,
                                          max_tokens=MAX_TOKENS, messages=CITY_MESSAGES, **kw)
    except openai.LengthFinishReasonError as e:
        c = e.completion
        return Outcome(False, c.usage.completion_tokens if c.usage else None, "length",
                       c.choices[0].message.content or "")
    except pydantic.ValidationError as e:  # JSON the SDK could not parse into a City
        return Outcome(False, None, "invalid", str(e).splitlines()[0])
    ch = r.choices[0]
    return Outcome(isinstance(ch.message.parsed, City), r.usage.completion_tokens,
                   ch.finish_reason, ch.message.content or "")


def live_tool(client: openai.OpenAI, seed: int, temperature: float | None) -> Outcome:
    kw: dict[str, Any] = {"seed": seed}
    if temperature is not None:
        kw["temperature"] = temperature
    r = client.chat.completions.create(model=NAME, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX_TOKENS, messages=TOOL_MESSAGES, **kw)
    ch = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    ok = ch.finish_reason == "tool_calls" and tool_calls_ok(calls)
    return Outcome(ok, r.usage.completion_tokens, ch.finish_reason,
                   "; ".join(f"{n} {a}" for n, a in calls), _parsed(calls))


def _parsed(calls: list[tuple[str, str]]) -> tuple[tuple[str, Any], ...]:
    out = []
    for name, args in calls:
        try:
            out.append((name, json.dumps(json.loads(args), sort_keys=True)))
        except ValueError:
            out.append((name, args))
    return tuple(out)


def run_live(url: str, seeds: int) -> dict[tuple[str, str], list[Outcome]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    out: dict[tuple[str, str], list[Outcome]] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for example, fn in (("City", live_city), ("tool required", live_tool)):
            for label, temperature in TEMPERATURES.items():
                out[example, label] = list(pool.map(
                    lambda s, fn=fn, t=temperature: fn(client, s, t), range(seeds)))
    return out


# -- the offline engine, now and before -------------------------------------------------------


def before_grammar_text(now: Callable[..., str]) -> Callable[..., str]:
    """``grammar_text`` as it was before the default bounds (JSON only; others as now)."""
    import llguidance

    def grammar_text(spec: Any, bounded: bool = True) -> str:
        if spec.kind != "json":
            return now(spec, bounded)
        text = json.dumps(json.loads(spec.text), sort_keys=True, separators=(",", ":"))
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_pattern": BEFORE_WHITESPACE})
    return grammar_text


def run_offline(model: str, seeds: int) -> dict[str, dict[tuple[str, str], list[Outcome]]]:
    from openai.lib._parsing._completions import type_to_response_format_param

    import disagg.structured.grammar as G
    from disagg import LLM, SamplingParams
    from disagg.contracts import tools as T
    from disagg.structured.spec import from_response_format

    llm = LLM(model, max_model_len=MAX_MODEL_LEN)
    tok = llm.tokenizer
    choice = T.resolve(TOOLS, "required", None)
    examples = {
        # what the SDK sends for response_format=City, read as the server reads it
        "City": (tok.apply_chat_template(CITY_MESSAGES, add_generation_prompt=True),
                 from_response_format(dict(type_to_response_format_param(City)))),
        "tool required": (tok.apply_chat_template(TOOL_MESSAGES, add_generation_prompt=True,
                                                  tools=TOOLS), T.forced_spec(choice)),
    }
    now = G.grammar_text
    results: dict[str, dict[tuple[str, str], list[Outcome]]] = {}
    try:
        for variant, fn in (("now", now), ("before", before_grammar_text(now))):
            G.grammar_text = fn
            # a fresh cache (as the engine builds it): nothing compiled by the other variant
            llm.engine.grammars = G.GrammarCache(llm.engine.tokenizer.backend,
                                                 llm.engine.config.model.vocab_size,
                                                 llm.engine.tokenizer.eos_token_ids)
            results[variant] = {}
            for example, (prompt, spec) in examples.items():
                for label, temperature in TEMPERATURES.items():
                    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=s, structured=spec,
                                             temperature=1.0 if temperature is None
                                             else temperature) for s in range(seeds)]
                    outs = llm.generate([prompt] * seeds, params)
                    results[variant][example, label] = [
                        _offline_outcome(example, o.outputs[0], choice) for o in outs]
    finally:
        G.grammar_text = now
        llm.shutdown()
    return results


def _offline_outcome(example: str, c: Any, choice: Any) -> Outcome:
    from disagg.server.tool_calls import ToolCalls

    if example == "City":
        return Outcome(city_ok(c.text, c.finish_reason), len(c.token_ids), c.finish_reason,
                       c.text)
    msg, finish = ToolCalls(choice, None).message(c.text, c.finish_reason)
    calls = [(t["function"]["name"], t["function"]["arguments"])
             for t in msg.get("tool_calls") or []]
    ok = finish == "tool_calls" and tool_calls_ok(calls)
    return Outcome(ok, len(c.token_ids), finish, c.text, _parsed(calls))


# -- the report -------------------------------------------------------------------------------


def machine() -> str:
    import importlib.metadata as md

    import torch

    return (f"- Machine: {platform.platform()}, {os.cpu_count()} CPU cores (shared with other "
            f"jobs: load average {os.getloadavg()[0]:.2f} at the end), no GPU; Python "
            f"{platform.python_version()}, torch {torch.__version__}, llguidance "
            f"{md.version('llguidance')}, openai {md.version('openai')}, disagg "
            f"{__version__}.")


def model_line(label: str, model: str, where: str) -> str:
    cfg = json.loads((Path(model) / "config.json").read_text())
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("num_hidden_layers", "hidden_size",
                                                "vocab_size") if k in cfg)
    return f"- {label}: {where} ({cfg.get('model_type', '?')}: {shape}), float32 on CPU."


def _row(grammar: str, example: str, label: str, outs: list[Outcome]) -> str:
    ok = sum(o.ok for o in outs)
    tokens = [o.tokens for o in outs if o.tokens is not None]
    mean = f"{statistics.fmean(tokens):.1f}" if tokens else "-"
    most = str(max(tokens)) if tokens else "-"
    length = sum(o.finish == "length" for o in outs)
    sample = outs[0].text.replace("|", "\\|").replace("\n", "\\n")
    if len(sample) > 90:
        sample = sample[:90] + "…"
    return (f"| {grammar} | {example} | {label} | **{ok}/{len(outs)}** | {length} | {mean} | "
            f"{most} | `{sample}` |")


def report(runs: dict[str, dict[str, Any]], models: dict[str, tuple[str, str]], seeds: int,
           wall_s: float) -> tuple[str, bool]:
    """``models``: label -> (folder, how it was made)."""
    need = seeds - seeds // 20  # >= 19/20
    lines = [
        "# Structured outputs a small model completes",
        "",
        "Written by `python -m bench.structured_completion` (one run). The README's two "
        "examples as it writes them, `max_tokens=200`: `client.chat.completions.parse("
        "response_format=City)` (a pydantic `City(name: str, population: int)`, \"Largest "
        "city?\") and `tool_choice=\"required\"` with its `get_weather` tool (\"Oslo?\"). "
        "**valid**: the "
        "`City` parsed, or every tool call's arguments parse against `get_weather`'s schema "
        "with finish_reason `tool_calls`, within max_tokens. Sampled: the server's default "
        f"temperature (1) with `seed` 0..{seeds - 1}; temperature 0: the same seeds (greedy, "
        "so one answer repeated). Tokens: completion tokens per answer, failures included.",
        "",
        "- **live**: a `disagg serve` worker (one process per model, `--max-model-len "
        f"{MAX_MODEL_LEN}`) and the `openai` SDK, {CONCURRENCY} requests in flight.",
        "- **offline now / before**: this process's offline engine (`disagg.LLM`) with the "
        "same chat prompt and `SamplingParams` the server builds, the grammar as it is now "
        "and as it was before the default bounds (commit aa0fc05: the schema's keys sorted, "
        "llguidance JSON with `whitespace_pattern` `(?:\\x20|\\n[\\x20\\x09]{0,16})?`, no "
        "default bounds), swapped in for `disagg.structured.grammar.grammar_text`. \"Offline "
        "now vs live\" below counts the answers (or tool calls) the two paths share.",
        "",
        machine(),
        *(model_line(k, *v) for k, v in models.items()),
        f"- Wall time of the run: {wall_s:.0f} s.",
        "",
    ]
    met = True
    for model_name, r in runs.items():
        lines += [f"## {model_name}", "",
                  "| grammar | example | temperature | valid | cut by max_tokens | tokens "
                  "mean | tokens max | first answer (seed 0) |",
                  "|---|---|---|---|---|---|---|---|"]
        for grammar, res in (("live", r["live"]), ("offline now", r["offline"]["now"]),
                             ("offline before", r["offline"]["before"])):
            for (example, label), outs in res.items():
                lines.append(_row(grammar, example, label, outs))
                if grammar == "live" and sum(o.ok for o in outs) < need:
                    met = False
        same = {k: sum((a.calls == b.calls) if a.calls or b.calls else a.text == b.text
                       for a, b in zip(v, r["offline"]["now"][k], strict=True))
                for k, v in r["live"].items()}
        lines += ["", "Offline now vs live, the same answer: " + ", ".join(
            f"{e} at {t}: {n}/{seeds}" for (e, t), n in same.items()) + ".", ""]
    lines += [f"**Target (>= {need}/{seeds} valid, live, each row): "
              f"{'met' if met else 'NOT met'}.**", ""]
    return "\n".join(lines), met


# -- main -------------------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.structured_completion",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", default=None, help="SmolLM2 folder (default: `disagg model "
                    "fetch smollm2`'s, fetched on first use)")
    ap.add_argument("--tiny", default=None, help="tiny model folder (default: written by "
                    "`disagg model tiny` into a temporary folder)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                         "structured_completion.md"))
    return ap.parse_args()


def main() -> int:
    args = _parse_args()
    t0 = time.monotonic()
    if args.smollm2 is None:
        from disagg.model.gguf import fetch_model

        args.smollm2 = fetch_model("smollm2")
    with tempfile.TemporaryDirectory(prefix="structured-completion-") as tmp:
        logs = Path(tmp)
        if args.tiny is None:
            args.tiny = str(logs / "tiny")
            subprocess.run([sys.executable, "-m", "disagg.cli", "model", "tiny", args.tiny],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            tiny_where = "`disagg model tiny` (default seed) into a temporary folder"
        else:
            tiny_where = f"`{Path(args.tiny).resolve()}`"
        models = {"SmolLM2": (str(Path(args.smollm2).resolve()),
                              f"`{Path(args.smollm2).resolve()}`"),
                  "tiny (random weights)": (str(Path(args.tiny).resolve()), tiny_where)}
        runs: dict[str, dict[str, Any]] = {}
        for label, (model, _) in models.items():
            with live_worker(model, logs) as url:
                live = run_live(url, args.seeds)
            runs[label] = {"live": live, "offline": run_offline(model, args.seeds)}
            print(f"{label}: done", flush=True)
        text, met = report(runs, models, args.seeds, time.monotonic() - t0)
    Path(args.out).write_text(text)
    print(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
