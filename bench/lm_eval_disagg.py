"""An external evaluation client against this project's OpenAI API: lm-evaluation-harness
(``lm_eval``, ``local-completions``) run against one aggregated worker and against the router of
a disaggregated cluster (1 context + 1 generation worker), on the same model, greedy; the
scores and every per-item result must be the same, with 0 failed requests.

    python -m bench.lm_eval_disagg [--model DIR] [--out bench/results/lm_eval.md]

- lm_eval lives in its own virtualenv (``$DISAGG_CACHE/lm_eval-<version>-venv``, created on
  first use, reused after): a clean venv, not ``--system-site-packages``, so its pins
  (datasets, numpy, scikit-learn, ...) neither see nor change this project's. lm_eval's
  ``local-completions`` needs no torch; it needs a tokenizer for loglikelihood requests (the
  context's token count), so ``transformers`` + ``tokenizers`` are installed beside it and
  ``tokenizer=<model folder>`` loads the model's own ``tokenizer.json`` offline.
- The tasks are local (``bench.lm_eval_items``): a JSONL dataset and a task YAML each,
  written into a temporary folder passed as ``--include_path``; ``HF_HUB_OFFLINE`` and
  ``HF_DATASETS_OFFLINE`` are set, so nothing reaches a hub.
- Each target is evaluated twice: ``tokenized_requests=True`` (lm_eval's default: prompts go
  as token-id lists) and ``False`` (prompts as text, the server tokenizes).
- Errors: lm_eval's exit status (``max_retries=1``: a failed request fails the run), the
  router's ``disagg_router_requests_total`` by outcome, and the workers' rejected / aborted /
  errored requests from their ``/metrics``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lm_eval_items import GEN_TASK, MC_ITEMS, MC_TASK, write_tasks
from disagg import __version__
from disagg.env import cache_root
from disagg.procs import NotHealthy, free_ports, log_tail, spawn, stop_all
from disagg.procs import wait_healthy as wait_child_healthy

ROOT = Path(__file__).resolve().parents[1]

LM_EVAL_VERSION = "0.4.13"
# transformers + tokenizers: the client-side tokenizer (no torch: only tokenizers load).
VENV_PINS = (f"lm_eval[api]=={LM_EVAL_VERSION}", "transformers==5.23.0", "tokenizers==0.23.3")
NAME = "smollm2"
TOKEN = "bench-lm-eval"
LL_TOL = 1e-3  # |loglikelihood| difference allowed between the two targets
RUN_TIMEOUT_S = 1200.0
MODES = {"token ids": True, "text": False}  # label -> tokenized_requests


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path


@dataclass
class Run:
    target: str
    mode: str
    rc: int
    wall_s: float
    scores: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # counter deltas over the run
    samples: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)


# -- the virtualenv ---------------------------------------------------------------------------


def ensure_venv(path: Path) -> Path:
    """``path``/bin/lm_eval, installing the pins into a new venv unless one with exactly
    these pins is there (a marker file written after a successful install)."""
    marker = path / "disagg-pins.txt"
    want = "\n".join(VENV_PINS) + "\n"
    if marker.exists() and marker.read_text() == want:
        return path / "bin" / "lm_eval"
    print(f"creating {path} ({', '.join(VENV_PINS)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", *VENV_PINS], check=True)
    marker.write_text(want)
    return path / "bin" / "lm_eval"


def venv_versions(venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('lm_eval', 'transformers', 'tokenizers', 'datasets')}))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


# -- the servers ------------------------------------------------------------------------------


def start_worker(model: str, name: str, role: str, port: int, logs: Path) -> Proc:
    log = logs / f"{name.replace(' ', '_')}.log"
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    p = spawn([sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port),
               "--role", role, "--served-model-name", NAME, "--log-level", "warning",
               "--max-model-len", "2048", "--kv-transfer-backend", "TCP"],
              log, env=env, cwd=ROOT)
    return Proc(name, p, f"http://127.0.0.1:{port}", log)


def start_router(ctx: Proc, gen: Proc, port: int, logs: Path) -> Proc:
    import yaml

    cfg = {"hostname": "127.0.0.1", "port": port, "max_retries": 1,
           "context_servers": {"num_instances": 1, "urls": [ctx.url[len("http://"):]],
                               "router": {"type": "round_robin"}},
           "generation_servers": {"num_instances": 1, "urls": [gen.url[len("http://"):]],
                                  "router": {"type": "round_robin"}}}
    path = logs / "router.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = logs / "router.log"
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    p = spawn([sys.executable, "-m", "disagg.cli", "router", "-c", str(path), "--log-level",
               "warning"], log, env=env, cwd=ROOT)
    return Proc("router", p, f"http://127.0.0.1:{port}", log)


def wait_healthy(procs: list[Proc], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            wait_child_healthy(p.url, max(0.0, deadline - time.monotonic()), proc=p.popen,
                               interval=0.2, what=p.name)
        except NotHealthy as e:
            raise RuntimeError(f"{e}:\n{log_tail(p.log)}") from None


def metric_samples(url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (counters only matter here)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def worker_counts(url: str) -> dict[str, float]:
    """A worker's finished requests (all reasons) and its failures: rejected HTTP requests,
    engine requests finished by abort or error."""
    m = metric_samples(url)
    finished = sum(v for k, v in m.items() if k.startswith("disagg_requests_finished_total"))
    failed = sum(v for k, v in m.items()
                 if k.startswith("disagg_requests_rejected_total")
                 or (k.startswith("disagg_requests_finished_total")
                     and ('finish_reason="abort"' in k or 'finish_reason="error"' in k)))
    return {"finished": finished, "failed": failed}


def router_counts(url: str) -> dict[str, float]:
    """The router's requests by outcome (``success`` or a failure)."""
    m = metric_samples(url)
    out: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("disagg_router_requests_total{"):
            outcome = k.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + v
    return out


def snapshot(procs: dict[str, Proc]) -> dict[str, float]:
    """Every counter the report uses, flat: ``'<worker> finished'``, ``'<worker> failed'``,
    ``'router <outcome>'``."""
    out = {f"{k} {what}": v for k, p in procs.items() if k != "router"
           for what, v in worker_counts(p.url).items()}
    out.update({f"router {k}": v for k, v in router_counts(procs["router"].url).items()})
    return out


# -- lm_eval ----------------------------------------------------------------------------------


def run_lm_eval(lm_eval: Path, url: str, model_dir: str, tasks: Path, out: Path,
                target: str, mode: str) -> Run:
    """One lm_eval run of both tasks against ``url``; its scores and per-item samples."""
    args = {"base_url": url + "/v1/completions", "model": NAME, "num_concurrent": 1,
            "max_retries": 1, "tokenized_requests": MODES[mode],
            "tokenizer_backend": "huggingface", "tokenizer": model_dir}
    cmd = [str(lm_eval), "run", "--model", "local-completions", "--model_args",
           ",".join(f"{k}={v}" for k, v in args.items()), "--tasks", f"{MC_TASK},{GEN_TASK}",
           "--include_path", str(tasks), "--gen_kwargs", "temperature=0", "--log_samples",
           "--output_path", str(out), "--seed", "1234"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out / "hf-home"),
           "NO_PROXY": "127.0.0.1,localhost", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the venv's own packages only
    log = out / "lm_eval.log"
    print(f"lm_eval: {target}, {mode} ...", flush=True)
    t0 = time.monotonic()
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out,
                            timeout=RUN_TIMEOUT_S).returncode
    run = Run(target, mode, rc, time.monotonic() - t0)
    if rc != 0:
        print(f"lm_eval failed ({rc}):\n{log_tail(log, 40)}", flush=True)
        return run
    results = json.loads(Path(_one(out, "results_*.json")).read_text())["results"]
    run.scores = {f"{task} {k.split(',')[0]}": float(v) for task, r in results.items()
                  for k, v in r.items() if "," in k and "stderr" not in k}
    for task in (MC_TASK, GEN_TASK):
        lines = Path(_one(out, f"samples_{task}_*.jsonl")).read_text().splitlines()
        run.samples[task] = {d["doc_id"]: d for d in map(json.loads, lines)}
    return run


def _one(folder: Path, pattern: str) -> str:
    found = glob.glob(str(folder / "**" / pattern), recursive=True)
    if len(found) != 1:
        raise RuntimeError(f"expected one {pattern} under {folder}, found {found}")
    return found[0]


# -- comparing --------------------------------------------------------------------------------


def compare(a: Run, b: Run) -> dict[str, Any]:
    """Per item: loglikelihoods (multiple choice, each choice) within ``LL_TOL``, generated
    strings identical, per-item metrics identical."""
    max_ll, ll_n, gen_diff, metric_diff = 0.0, 0, [], []
    for doc_id, sa in a.samples[MC_TASK].items():
        sb = b.samples[MC_TASK][doc_id]
        for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
            max_ll = max(max_ll, abs(float(ra[0][0]) - float(rb[0][0])))
            ll_n += 1
        if (sa["acc"], sa["acc_norm"]) != (sb["acc"], sb["acc_norm"]):
            metric_diff.append(f"{MC_TASK}#{doc_id}")
    for doc_id, sa in a.samples[GEN_TASK].items():
        sb = b.samples[GEN_TASK][doc_id]
        if sa["resps"] != sb["resps"]:
            gen_diff.append((doc_id, sa["resps"][0][0], sb["resps"][0][0]))
        if sa["exact_match"] != sb["exact_match"]:
            metric_diff.append(f"{GEN_TASK}#{doc_id}")
    same_docs = (a.samples[MC_TASK].keys() == b.samples[MC_TASK].keys()
                 and a.samples[GEN_TASK].keys() == b.samples[GEN_TASK].keys())
    return {"max_ll_diff": max_ll, "loglikelihoods": ll_n, "gen_diff": gen_diff,
            "generations": len(a.samples[GEN_TASK]), "metric_diff": metric_diff,
            "same_docs": same_docs, "scores_equal": a.scores == b.scores,
            "ok": (same_docs and max_ll <= LL_TOL and not gen_diff and not metric_diff
                   and a.scores == b.scores)}


# -- the report -------------------------------------------------------------------------------


def machine(model_dir: str) -> list[str]:
    import torch

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("num_hidden_layers", "hidden_size",
                                                "vocab_size") if k in cfg)
    return [f"- Machine: {platform.platform()}, {os.cpu_count()} CPU cores (shared with other "
            f"jobs: load average {os.getloadavg()[0]:.2f} at the end), no GPU; Python "
            f"{platform.python_version()}, torch {torch.__version__}, disagg {__version__}.",
            f"- Model: `{model_dir}` ({cfg.get('model_type', '?')}: {shape}), served as "
            f"`{NAME}`, float32 on CPU, `--max-model-len 2048`; KV over TCP."]


def _score_table(runs: list[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.scores})
    lines = ["| target | prompts sent as | " + " | ".join(keys) + " | lm_eval exit | wall s | "
             "engine requests: aggregated / context / generation worker | failed |",
             "|---" * (len(keys) + 6) + "|"]
    for r in runs:
        cells = [f"{r.scores[k]:.4f}" if k in r.scores else "-" for k in keys]
        served = " / ".join(str(int(r.served.get(f"{w} finished", 0)))
                            for w in ("aggregated", "context", "generation"))
        failed = sum(v for k, v in r.served.items()
                     if k.endswith(" failed") or (k.startswith("router ")
                                                  and k != "router success"))
        lines.append(f"| {r.target} | {r.mode} | " + " | ".join(cells)
                     + f" | {r.rc} | {r.wall_s:.1f} | {served} | {int(failed)} |")
    return lines


def _compare_lines(mode: str, c: dict[str, Any]) -> list[str]:
    lines = [f"- **{mode}**: {'SAME' if c['ok'] else 'DIFFERENT'}: max |loglikelihood "
             f"difference| {c['max_ll_diff']:.2e} over {c['loglikelihoods']} loglikelihoods "
             f"(tolerance {LL_TOL:g}); {c['generations'] - len(c['gen_diff'])} of "
             f"{c['generations']} generated strings identical; per-item metrics differing: "
             f"{len(c['metric_diff'])}; aggregate scores equal: {c['scores_equal']}."]
    for doc_id, ga, gb in c["gen_diff"][:5]:
        lines.append(f"  - {GEN_TASK}#{doc_id}: aggregated {ga!r}, disaggregated {gb!r}")
    return lines


def report(runs: list[Run], comps: dict[str, dict[str, Any]], counts: dict[str, Any],
           items: dict[str, int], versions: dict[str, str], model_dir: str,
           expected: int) -> str:
    router = counts["router"]
    failed_router = sum(v for k, v in router.items() if k != "success")
    failed_workers = sum(c["failed"] for k, c in counts.items() if k != "router")
    errors = failed_router + failed_workers + sum(r.rc != 0 for r in runs)
    ok = all(c["ok"] for c in comps.values()) and errors == 0 and len(comps) == len(MODES)
    lines = [
        "# lm-evaluation-harness against the disaggregated cluster",
        "",
        "Written by `python -m bench.lm_eval_disagg`. "
        + ("**Verdict: the same scores and per-item results aggregated and disaggregated, "
           f"{int(errors)} errors.**" if ok else f"**Verdict: NOT the same, or errors "
           f"({int(errors)}).**"),
        "",
        *machine(model_dir),
        f"- Client: lm_eval {versions['lm_eval']} (`local-completions`, `num_concurrent=1`, "
        f"`max_retries=1`, greedy `--gen_kwargs temperature=0`, `--seed 1234`) in its own "
        f"venv (transformers {versions['transformers']}, tokenizers "
        f"{versions['tokenizers']}, datasets {versions['datasets']}; no torch); tokenizer: "
        "`tokenizer_backend=huggingface`, `tokenizer=<model folder>` (offline).",
        f"- Tasks (local JSONL + YAML, `bench.lm_eval_items`): `{MC_TASK}` multiple choice, "
        f"{items[MC_TASK]} items, {sum(len(c) for _, c, _ in MC_ITEMS)} choices: one "
        "loglikelihood request each "
        "(`echo: true, logprobs: 1, max_tokens: 1`); "
        f"`{GEN_TASK}` generate_until, {items[GEN_TASK]} items (`until: [\"\\n\"]`, "
        "`max_gen_toks: 16`, exact match after stripping whitespace, case- and "
        "punctuation-blind).",
        "- Targets: one aggregated worker; a router in front of 1 context + 1 generation "
        "worker: the context worker prefills every request and scores its prompt; one that "
        "ends at its first token (the loglikelihood requests, `max_tokens: 1`) is answered "
        "from the context worker's answer, the others are decoded by the generation worker "
        "after pulling the KV. The engine-request columns below show where each run went.",
        "- lm_eval's default `tokenizer_backend=auto` asks `GET /tokenizer_info` (vLLM's, "
        "off there by default too), which this project does not serve, then loads the "
        "tokenizer named by `model` from the hub: offline it needs `tokenizer=<folder>`.",
        "",
        *_score_table(runs),
        "",
        "Wall time is lm_eval's whole run (its start-up included, requests one at a time) on a "
        "shared machine: it says what the check costs, not which layout is faster.",
        "",
        "Per item, disaggregated vs aggregated:",
        *[line for mode, c in comps.items() for line in _compare_lines(mode, c)],
        "",
        f"Errors: lm_eval exits {[r.rc for r in runs]}; router requests by outcome "
        f"{ {k: int(v) for k, v in router.items()} } (expected {expected} successes); "
        "workers' finished engine requests / failed (rejected, aborted, errored): "
        + ", ".join(f"{k} {int(c['finished'])} / {int(c['failed'])}"
                    for k, c in counts.items() if k != "router") + ".",
        "",
    ]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.lm_eval_disagg",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: SmolLM2, "
                    "`disagg model fetch smollm2`'s folder, fetched on first use)")
    ap.add_argument("--venv", default=None, help="lm_eval's venv (default: "
                    f"$DISAGG_CACHE/lm_eval-{LM_EVAL_VERSION}-venv)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lm_eval.md"))
    return ap.parse_args()


def start_all(model: str, logs: Path) -> dict[str, Proc]:
    """The aggregated worker, the context and generation workers, then the router."""
    ports = free_ports(4)
    procs = {"aggregated": start_worker(model, "aggregated worker", "aggregated", ports[0],
                                        logs),
             "context": start_worker(model, "context worker", "context", ports[1], logs),
             "generation": start_worker(model, "generation worker", "generation", ports[2],
                                        logs)}
    try:
        wait_healthy(list(procs.values()))
        procs["router"] = start_router(procs["context"], procs["generation"], ports[3], logs)
        wait_healthy([procs["router"]])
    except BaseException:
        stop_all([p.popen for p in reversed(procs.values())], grace_s=30.0)
        raise
    return procs


def main() -> int:
    args = _parse_args()
    venv = Path(args.venv or os.path.join(cache_root(), f"lm_eval-{LM_EVAL_VERSION}-venv"))
    lm_eval = ensure_venv(venv)
    versions = venv_versions(venv)
    if args.model is None:
        from disagg.model.gguf import fetch_model

        args.model = fetch_model("smollm2")
    model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="lm-eval-disagg-") as tmp:
        tmpdir = Path(tmp)
        items = write_tasks(tmpdir / "tasks")
        procs = start_all(model, tmpdir)
        try:
            targets = {"aggregated": procs["aggregated"].url,
                       "disaggregated": procs["router"].url}
            runs = []
            before = snapshot(procs)
            for mode in MODES:  # both targets per mode, one after the other
                for target, url in targets.items():
                    out = tmpdir / f"{target}-{mode.replace(' ', '-')}"
                    out.mkdir()
                    runs.append(run_lm_eval(lm_eval, url, model, tmpdir / "tasks", out,
                                            target, mode))
                    after = snapshot(procs)
                    runs[-1].served = {k: v - before.get(k, 0.0) for k, v in after.items()}
                    before = after
            counts: dict[str, Any] = {k: worker_counts(p.url) for k, p in procs.items()
                                      if k != "router"}
            counts["router"] = router_counts(procs["router"].url)
        finally:
            stop_all([p.popen for p in reversed(procs.values())], grace_s=30.0)
    by = {(r.target, r.mode): r for r in runs}
    comps = {mode: compare(by["aggregated", mode], by["disaggregated", mode])
             for mode in MODES if by["aggregated", mode].rc == 0
             and by["disaggregated", mode].rc == 0}
    per_run = sum(len(c) for _, c, _ in MC_ITEMS) + items[GEN_TASK]
    text = report(runs, comps, counts, items, versions, model, per_run * len(MODES))
    Path(args.out).write_text(text)
    print(text)
    return 0 if "**Verdict: the same" in text else 1


if __name__ == "__main__":
    sys.exit(main())
