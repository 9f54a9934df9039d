"""Structured outputs: the grammar engine's cost per decode step, against the unconstrained step.

Two measurements, for the tiny model's tokenizer (512 tokens) and SmolLM2's (49152):

1. Grammar engines side by side (``llguidance``, the one disagg uses, and ``xgrammar`` when it
   imports): install footprint (the package and the runtime dependencies it pulls), tokenizer
   set-up, compile time of a JSON schema (no cache), and the per-step cost of constraining a
   batch of B rows: fill every row's bitmask, apply it to [B, V] logits, advance every row's
   matcher by one token (median over the tokens of a schema-valid JSON document).
2. The engine's decode step at batch B (``LLMEngine.step()``: forward, sampling, outputs; one
   torch thread, CPU), with every request unconstrained, then with every request under a JSON
   schema (a string field that cannot close within the run), alternated ``--rounds`` times;
   the overhead is the difference of the medians.

    python -m bench.structured_outputs [--smollm2 DIR] [--batches 1 16 64] [--steps 24]
                                       [--rounds 3] [--out FILE.md]

xgrammar need not be installed beside disagg: install it into a folder of its own (e.g. ``pip
install --no-deps --target DIR xgrammar apache-tvm-ffi``) and put that folder on the path for
the run, ``PYTHONPATH=DIR python -m bench.structured_outputs ...`` (the report's command line
shows it).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string",
                                                             "pattern": "^[0-9]{5}$"}}},
        "ok": {"type": "boolean"}}}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue", "green", "red"],
       "ok": True}
# The engine run's grammar: a string that cannot close within the run (the mask is that of
# free text inside a JSON string on every step).
LONG_STRING = {"type": "object", "required": ["text"],
               "properties": {"text": {"type": "string", "minLength": 100000}}}


# ---- install footprint ---------------------------------------------------------------------


def _dist_bytes(name: str) -> int | None:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    total = 0
    for f in dist.files or []:
        p = dist.locate_file(f)
        if os.path.isfile(p):
            total += os.path.getsize(p)
    return total


def _requires(name: str) -> list[str]:
    from packaging.requirements import Requirement

    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        return []
    out = []
    for r in map(Requirement, reqs):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            out.append(r.name)
    return out


def footprint(name: str, already: set[str]) -> tuple[int | None, list[tuple[str, int | None]]]:
    """Installed bytes of ``name``, and its runtime dependency closure outside ``already``
    (what disagg's own dependencies bring anyway) with their installed bytes."""
    seen, todo, deps = {name.lower()}, list(_requires(name)), []
    while todo:
        d = todo.pop()
        key = d.lower().replace("_", "-")
        if key in seen or key in already:
            continue
        seen.add(key)
        deps.append((d, _dist_bytes(d)))
        todo += _requires(d)
    return _dist_bytes(name), sorted(deps)


# ---- the two grammar engines ---------------------------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, schema: dict) -> Any:
        from disagg.structured.grammar import grammar_text
        from disagg.structured.spec import GrammarSpec

        # the grammar disagg compiles: compact, default bounds (strings: a 4096-token budget's)
        spec = GrammarSpec.json_schema(schema, "bench").with_budget(4096)
        m = self.llg.LLMatcher(self.tok, grammar_text(spec), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def step(self, matchers: list[Any], logits: Any, token: int) -> None:
        from disagg.structured.grammar import Matcher
        from disagg.structured.mask import MaskFiller

        if not hasattr(self, "filler"):
            self.filler = MaskFiller(self.vocab)  # what the engine runs
        forbidden = self.filler.forbidden([Matcher(m) for m in matchers], logits.device)
        logits.masked_fill_(forbidden, float("-inf"))
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]) -> None:
        import transformers
        import xgrammar
        from tokenizers import Tokenizer

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tokenizer_json))
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                            stop_token_ids=eos)
        self.vocab = vocab

    def compile(self, schema: dict) -> Any:
        comp = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        # Whitespace bounded as disagg bounds it for llguidance (a run of at most 17).
        return self.xgr.GrammarMatcher(comp.compile_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=17))

    def step(self, matchers: list[Any], logits: Any, token: int) -> None:
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.accept_token(token)


def _engines(tokenizer_json: str, vocab: int, eos: list[int]
             ) -> list[tuple[Any, float] | tuple[str, str]]:
    """(engine, set-up seconds), or (name, why not) for one that does not import."""
    out: list[Any] = []
    for cls in (LLGuidance, XGrammar):
        try:
            t0 = time.perf_counter()
            eng = cls(tokenizer_json, vocab, eos)
            out.append((eng, time.perf_counter() - t0))
        except ImportError as e:
            out.append((cls.name, f"not importable: {e}"))
    return out


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mask_step_s(eng: Any, batch: int, doc_tokens: list[int]) -> float:
    """Median seconds of one constrained step of ``batch`` rows (fill + apply + advance)."""
    import torch

    times = []
    template = eng.compile(SCHEMA)
    for _ in range(2):
        matchers = [eng.compile(SCHEMA) for _ in range(batch)] if eng.name == "xgrammar" else [
            template.deep_copy() for _ in range(batch)]
        logits = torch.randn(batch, eng.vocab)
        for tok in doc_tokens:
            t0 = time.perf_counter()
            eng.step(matchers, logits, tok)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- the engine's decode step --------------------------------------------------------------


def _timed(obj: Any, name: str, acc: list[float]) -> None:
    """Wrap ``obj.name`` to add its time of each call to ``acc[-1]``."""
    fn = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[-1] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def engine_step_s(model_dir: str, batch: int, steps: int, constrained: bool
                  ) -> dict[str, float]:
    """Medians over the decode ``LLMEngine.step()`` calls at ``batch`` requests, in seconds:
    the step, and within it the sampler, the mask fill + unpack (``forbidden``) and the
    matchers' advance."""
    import disagg.engine.llm_engine as engine_mod
    from disagg.config import build_engine_config
    from disagg.engine import LLMEngine
    from disagg.request import SamplingParams
    from disagg.structured.spec import GrammarSpec

    eng = LLMEngine(build_engine_config(
        model_dir, kv_cache_tokens=batch * (steps + 64) * 2, max_batch_size=batch,
        max_num_tokens=max(batch * 32, 256), device="cpu", tokens_per_block=16))
    spec = GrammarSpec.json_schema(LONG_STRING, "bench") if constrained else None
    # min_tokens = max_tokens: EOS never ends a request early, the batch stays whole.
    params = SamplingParams(max_tokens=steps + 2, min_tokens=steps + 2, temperature=0.0,
                            structured=spec)
    for i in range(batch):
        eng.add_request(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(16)], params)
    eng.step()  # prefill + first token
    parts: dict[str, list[float]] = {k: [] for k in ("step", "sample", "forbidden", "advance")}
    _timed(eng.sampler, "sample", parts["sample"])
    _timed(eng._masks, "forbidden", parts["forbidden"])
    real_advance = engine_mod.advance_grammars
    _timed(engine_mod, "advance_grammars", parts["advance"])
    try:
        for _ in range(steps):
            for v in parts.values():
                v.append(0.0)
            t0 = time.perf_counter()
            eng.step()
            parts["step"][-1] = time.perf_counter() - t0
            assert eng.scheduler.num_running == batch
    finally:
        engine_mod.advance_grammars = real_advance
        eng.shutdown()
    return {k: statistics.median(v) for k, v in parts.items()}


# ---- the report ----------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "not installed" if n is None else f"{n / 2**20:.1f} MB"


def machine() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} CPUs (shared), Python "
            f"{platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} thread), {platform.system()} {platform.release()}")


def tokenizers(smollm2: str | None, tmp: str) -> list[tuple[str, str]]:
    from disagg.model.tiny import write_tiny_checkpoint

    out = [("tiny", write_tiny_checkpoint(os.path.join(tmp, "tiny"), seed=1))]
    if smollm2 and os.path.isfile(os.path.join(smollm2, "tokenizer.json")):
        out.append(("SmolLM2-135M", smollm2))
    return out


def bench_tokenizer(label: str, model_dir: str, batches: list[int], steps: int, rounds: int
                    ) -> tuple[list[str], list[str]]:
    """(engine comparison rows, engine-step rows) of one model's tokenizer."""
    from disagg.config import build_engine_config
    from disagg.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    vocab = build_engine_config(model_dir).model.vocab_size
    text = tok.backend.to_str()
    doc = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    cmp_rows = []
    for eng, setup in _engines(text, vocab, list(tok.eos_token_ids)):
        if isinstance(eng, str):
            cmp_rows.append(f"| {label} | {eng} | {setup} | | |")
            continue
        compile_s = _median_time(lambda eng=eng: eng.compile(SCHEMA), 5)
        per_b = " / ".join(f"{mask_step_s(eng, b, doc) * 1e3:.3f}" for b in batches)
        cmp_rows.append(f"| {label} | {eng.name} | {setup * 1e3:.1f} | {compile_s * 1e3:.2f} | "
                        f"{per_b} |")
        print(cmp_rows[-1], flush=True)
    step_rows = []
    for b in batches:
        free: list[dict[str, float]] = []
        held: list[dict[str, float]] = []
        for _ in range(rounds):  # alternated: drift on a shared machine hits both alike
            free.append(engine_step_s(model_dir, b, steps, False))
            held.append(engine_step_s(model_dir, b, steps, True))

        def med(runs: list[dict[str, float]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        f, h = med(free, "step"), med(held, "step")
        # The grammar's own work, timed inside the constrained steps: mask fill + unpack,
        # matcher advance, and what the sampler spends more (the masked fill).
        own = (med(held, "forbidden") + med(held, "advance")
               + max(med(held, "sample") - med(free, "sample"), 0.0))
        step_rows.append(
            f"| {label} | {b} | {f * 1e3:.2f} | {h * 1e3:.2f} | {(h - f) * 1e3:+.2f} | "
            f"{med(held, 'forbidden') * 1e3:.3f} | {med(held, 'advance') * 1e3:.3f} | "
            f"{(med(held, 'sample') - med(free, 'sample')) * 1e3:+.3f} | {own * 1e3:.3f} | "
            f"{own / f * 100:.1f}% |")
        print(step_rows[-1], flush=True)
    return cmp_rows, step_rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.structured_outputs",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", default=os.path.expanduser("~/.cache/disagg/models/smollm2"),
                    help="SmolLM2 folder (disagg model fetch smollm2 DIR); skipped if absent")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    already = {"torch", "numpy", "tokenizers", "jinja2", "pyyaml", "safetensors",
               "transformers", "pydantic", "typing-extensions"}
    foot = []
    for name in ("llguidance", "xgrammar"):
        own, deps = footprint(name, already)
        dep_txt = ", ".join(f"{d} {_mb(s)}" for d, s in deps) or "none"
        foot.append(f"| {name} | {_mb(own)} | {dep_txt} |")
    with tempfile.TemporaryDirectory() as tmp:
        cmp_rows, step_rows = [], []
        for label, d in tokenizers(args.smollm2, tmp):
            c, s = bench_tokenizer(label, d, args.batches, args.steps, args.rounds)
            cmp_rows += c
            step_rows += s
    bs = "/".join(map(str, args.batches))
    path_env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    report = "\n".join([
        "# Structured outputs: grammar engines and the per-step mask overhead",
        "",
        f"- machine: {machine()}; load average (1 min) at start {load0:.1f}, at end "
        f"{os.getloadavg()[0]:.1f} (2 cores shared with other jobs: absolute times vary, the "
        "comparisons are within one run)",
        f"- command: `{path_env}python -m bench.structured_outputs {' '.join(sys.argv[1:])}`",
        "- JSON schema: an object with a bounded string, an integer range, an enum array, an "
        "optional nested object with a pattern, a boolean; the document stepped through is "
        "a valid instance of it (compact JSON), tokenized by the model's tokenizer",
        "",
        "## Install footprint (installed bytes; dependencies disagg does not already have)",
        "",
        "| engine | package | runtime dependencies it adds |",
        "|---|---|---|",
        *foot,
        "",
        f"## Engines side by side (ms; per-step = fill B bitmasks + apply to [B, V] logits + "
        f"advance B matchers, median over the document's tokens, B = {bs})",
        "",
        f"| tokenizer | engine | tokenizer set-up | compile schema (no cache) | per step at "
        f"B = {bs} |",
        "|---|---|---|---|---|",
        *cmp_rows,
        "",
        f"## The engine's decode step (ms, median of {args.steps} steps, median of "
        f"{args.rounds} alternated runs): unconstrained vs every request under a JSON schema "
        f"(llguidance, the masks of free text in a JSON string)",
        "",
        "`difference` is constrained - unconstrained step (two noisy medians on a shared "
        "machine); the next columns time the grammar's work inside the constrained steps: "
        "`fill+unpack` (llguidance writes each row's mask into one packed bitmask, one "
        "vectorized unpack), "
        "`advance` (each matcher consumes its token), `sample +` (the sampler's extra time: "
        "the masked fill); `grammar work` is their sum and `share` its share of the "
        "unconstrained step.",
        "",
        "| model | batch | unconstrained | constrained | difference | fill+unpack | advance | "
        "sample + | grammar work | share |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *step_rows,
        "",
    ])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
