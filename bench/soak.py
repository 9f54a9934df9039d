"""Soak: a cluster started by ``disagg launch`` under a steady mixed OpenAI load; 0 errors and
every process's memory flat after warm-up.

The cluster is what a user starts: ``disagg launch -c <yaml>`` of a router, one context and one
generation worker on loopback (the built-in tiny model, ``model: tiny``; the workers on free
ports, the router on port 0), the KV moved over TCP (``--kv-backend ucx``: over UCX; ``auto``:
the workers' default). ``--clients`` closed-loop clients (no think time) send, through the
router, chat and completions, streamed and not (some with ``n: 2``), structured outputs (a
``response_format`` JSON schema, a ``structured_outputs`` regex; their answers checked when
they finish with ``stop``) and, on purpose, streams the client closes after 0, 1 or 4 chunks
(counted as disconnects, not errors). Every other outcome that is not a 200 with a complete,
well-formed answer (an HTTP error, an error event or no ``[DONE]`` in a stream, a missing
finish_reason, an answer that breaks its schema or regex, an exception, a timeout) is an error,
its message kept.

Every ``--sample-s`` seconds (default: 10 s, less for runs under ~7 minutes) each process of
the cluster (the launcher and its descendants, found by walking /proc) is sampled: RSS
(``VmRSS``), open file descriptors, threads; and each worker's and the router's /metrics:
requests running / waiting, KV blocks held, context leases live and their blocks, the
router's in-flight requests per worker. After the load the script waits until the cluster is
idle (those gauges at 0; a lease left behind expires after the worker's lease TTL, 30 s) and
takes a last sample.

Per process: the RSS at the end of warm-up (the first 20% of the load, at least 60 s when the
load lasts 5 minutes or more), at the end of the load and when idle, and the slope of a
least-squares line over the samples under load after warm-up. The rule, stated in the report:
flat when |slope| x (load time after warm-up) < max(2% of the RSS at the end of warm-up,
4 MiB). The report (``--out``, default ``bench/results/soak.md``) and the raw samples (the same
path with ``.json``) are written by this script. It exits 1 when any request failed, a
process's RSS is not flat, the cluster did not come back to idle (leases, KV blocks, requests
in flight) or a process was left behind after the stop; every child is stopped and reaped on
any exit (Ctrl-C and SIGTERM included).

    python -m bench.soak --minutes 30 [--clients 4] [--kv-backend tcp|ucx|auto]
                         [--sample-s S] [--seed 0] [--out bench/results/soak.md]
    python -m bench.soak --seconds 20 --out /tmp/soak.md       # a short check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.baseline import cpu_line, git
from disagg import procs

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"  # the built-in tiny model (written on first use), served under this name
START_TIMEOUT_S = 300.0  # the launcher's start-up limit (first start: kernels, tiny model)
STOP_TIMEOUT_S = 20.0  # the launcher's grace period per child after SIGTERM
REQUEST_TIMEOUT_S = 120.0  # one request, whole answer
IDLE_TIMEOUT_S = 90.0  # after the load: gauges back to 0 (the lease TTL is 30 s)
METRICS_TIMEOUT_S = 10.0
WARMUP_SHARE = 0.2  # of the load time
WARMUP_MIN_S = 60.0  # ... at least, for loads of WARMUP_MIN_RUN_S or more
WARMUP_MIN_RUN_S = 300.0
FLAT_SHARE = 0.02  # the flat rule: drift < max(FLAT_SHARE * RSS, FLAT_MIN_MIB)
FLAT_MIN_MIB = 4.0
MIN_FIT_SAMPLES = 3
ERROR_EXAMPLES = 5
READY_RE = re.compile(r"cluster ready in [\d.]+ s: (http://\S+)")
STARTED_RE = re.compile(r"started (\S+)\s+(\S+)\s+(\S+)\s+pid (\d+)")
KV_BACKEND_RE = re.compile(r"kv transfer server \((\w+)\) listening")

# Worker gauges that say "busy" (all 0 when the cluster is idle) and counters reported.
WORKER_GAUGES = ("disagg_num_requests_running", "disagg_num_requests_waiting",
                 "disagg_kv_blocks_used", "disagg_kv_leases_active", "disagg_kv_leased_blocks")
WORKER_COUNTERS = ("disagg_kv_transfers_total", "disagg_kv_transfer_bytes_total",
                   "disagg_kv_transfer_failed_total", "disagg_kv_leases_expired_total")
ROUTER_GAUGES = ("disagg_router_worker_active_requests",)

# The load's mix: kind -> weight.
MIX = {"chat": 20, "chat_stream": 20, "completion": 15, "completion_stream": 15,
       "chat_json": 10, "completion_regex": 8, "disconnect": 12}
WORDS = ("the", "a", "cluster", "router", "worker", "token", "cache", "block", "model", "fast",
         "slow", "river", "mountain", "green", "blue", "seven", "twelve", "write", "read",
         "story", "about", "why", "how", "when", "people", "city", "music", "light", "night",
         "morning", "code", "list", "name", "three", "numbers", "explain", "short", "long",
         "question", "answer", "France", "Paris", "capital", "of", "is", "what", "and", "or")
# Prompt lengths: ~3 tiny-model tokens a word; the longest chat (system prompt, an earlier turn
# of 2 x MAX_TURN_WORDS, MAX_WORDS) plus 256 tokens out stays under max_model_len 2048.
MAX_WORDS = 300
MAX_TURN_WORDS = 80
SYSTEM = ("You are a helpful assistant. Answer briefly and precisely, and say when you do not "
          "know.")
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["name"],
     "properties": {"name": {"type": "string", "maxLength": 8}}},
]
REGEXES = (r"[A-Z]{2}[0-9]{3,5}", r"(yes|no|maybe)")


# -- the processes of the cluster (/proc) ----------------------------------------------------


def proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of a live process; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every process of this machine: pid -> ``proc_stat``."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
            table[int(entry)] = st
    return table


def status_fields(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass(frozen=True)
class Proc:
    """One process of the cluster: its name in the report, pid, start time (ticks: with the
    pid, its identity, so that a reused pid is not taken for it)."""

    name: str
    pid: int
    start_ticks: int

    def alive(self) -> bool:
        st = proc_stat(self.pid)
        return st is not None and st[1] == self.start_ticks and st[2] not in ("Z", "X")


def measure(p: Proc) -> dict[str, float] | None:
    """RSS (MiB), open fds and threads of ``p`` now; None when it is gone."""
    if not p.alive():
        return None
    st = status_fields(p.pid)
    try:
        rss_mib = int(st["VmRSS"].split()[0]) / 1024  # kB
        threads = int(st["Threads"])
    except (KeyError, ValueError, IndexError):
        return None
    fds = fd_count(p.pid)
    return {"rss_mib": rss_mib, "fds": -1 if fds is None else fds, "threads": threads}


# -- the cluster -------------------------------------------------------------------------------


def cluster_yaml(ports: list[int], backend: str) -> dict[str, Any]:
    """The disagg YAML: the router (port 0: it picks one) and 1 + 1 workers on ``ports``."""
    cfg: dict[str, Any] = {
        "hostname": "127.0.0.1", "port": 0, "max_retries": 1, "model": MODEL,
        "kv_cache_tokens": 8192, "max_model_len": 2048,
        "context_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                            "urls": [f"127.0.0.1:{ports[0]}"]},
        "generation_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                               "urls": [f"127.0.0.1:{ports[1]}"]}}
    if backend != "auto":
        cfg["cache_transceiver_config"] = {"backend": backend.upper()}
    return cfg


class Cluster:
    """``disagg launch -c`` in a child process (its own session; it gets SIGTERM if this
    process dies); ``stop()`` stops it (it stops its workers and router), then SIGKILLs any
    process of the cluster still alive and records it as left behind."""

    def __init__(self, work: Path, backend: str) -> None:
        import yaml

        self.work = work
        self.ports = procs.free_ports(2)
        self.config = cluster_yaml(self.ports, backend)
        self.yaml_path = work / "cluster.yaml"
        self.yaml_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log = work / "launch.log"
        self.log_dir = work / "logs"
        self.cmd = [sys.executable, "-m", "disagg.cli", "launch", "-c", str(self.yaml_path),
                    "--log-dir", str(self.log_dir), "--timeout", f"{START_TIMEOUT_S:g}",
                    "--stop-timeout", f"{STOP_TIMEOUT_S:g}"]
        self.proc: Any = None
        self.launcher: Proc | None = None
        self.router_url = ""
        self.workers: dict[str, str] = {}  # ctx0 / gen0 -> base URL
        self.names: dict[int, str] = {}  # pid -> name, from the launcher's "started" lines
        self.seen: dict[int, Proc] = {}  # every process of the cluster ever sampled
        self.left_behind: list[str] = []
        self.launcher_exit: int | None = None
        self.exited_early: int | None = None  # the launcher's code if it exited by itself
        self.kv_backend_seen = ""

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = procs.spawn(self.cmd, self.log, env=env, cwd=ROOT, die_with_parent=True)
        st = proc_stat(self.proc.pid)
        self.launcher = Proc("launcher", self.proc.pid, st[1] if st else 0)
        self.seen[self.proc.pid] = self.launcher
        deadline = time.monotonic() + START_TIMEOUT_S + 30
        while True:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            for m in STARTED_RE.finditer(text):
                self.names[int(m.group(4))] = m.group(1)
                if m.group(2) != "router":
                    self.workers[m.group(1)] = f"http://{m.group(3)}"
            ready = READY_RE.search(text)
            if ready:
                self.router_url = ready.group(1).rstrip("/")
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"disagg launch exited with code {self.proc.returncode} "
                                   f"before the cluster was ready:\n"
                                   f"{procs.log_tail(self.log, 40)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready in {START_TIMEOUT_S + 30:g} s:"
                                   f"\n{procs.log_tail(self.log, 40)}")
            time.sleep(0.2)
        self.processes()
        self.kv_backend()

    def processes(self) -> list[Proc]:
        """The launcher and its descendants now (a worker's own children as ``name/pid``)."""
        assert self.launcher is not None
        if not self.launcher.alive():
            return []
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = [self.launcher], [(self.launcher.pid, "")]
        while todo:
            parent, parent_name = todo.pop()
            for pid in sorted(children.get(parent, [])):
                name = self.names.get(pid) or f"{parent_name or 'launcher'}/{pid}"
                known = self.seen.get(pid)
                if known is None or known.start_ticks != table[pid][1]:
                    known = self.seen[pid] = Proc(name, pid, table[pid][1])
                out.append(known)
                todo.append((pid, name))
        return out

    def kv_backend(self) -> str:
        """The KV transfer backend the generation worker said it runs (near its log's start,
        read once it is ready)."""
        if not self.kv_backend_seen:
            with contextlib.suppress(OSError), open(self.log_dir / "gen0.log", "rb") as f:
                m = KV_BACKEND_RE.search(f.read(256 * 1024).decode(errors="replace"))
                self.kv_backend_seen = m.group(1).upper() if m else ""
        return self.kv_backend_seen or "?"

    def stop(self) -> None:
        """Stop the launcher (SIGTERM: it stops the router and workers; SIGKILL to its group
        after its grace period), then kill and record any process of the cluster still
        alive. Bounded."""
        if self.proc is None:
            return
        self.exited_early = self.proc.poll()
        with contextlib.suppress(Exception):
            self.processes()  # the last look at the tree before it goes
        grace = STOP_TIMEOUT_S * 3 + 15  # the launcher: its grace period, its SIGKILLs, slack
        self.launcher_exit = procs.stop(self.proc, grace_s=grace)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(p.alive() for p in self.seen.values()):
            time.sleep(0.1)  # a worker the launcher SIGKILLed may take a moment to go
        for p in self.seen.values():
            if p.alive():
                self.left_behind.append(f"{p.name} (pid {p.pid})")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
        self.proc = None


# -- the load ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    result: str  # ok | error | disconnect
    t: float  # when it ended, seconds since the load started
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    message: str = ""


@dataclass
class Spec:
    """One request: where, what, and how its answer is checked."""

    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    chat: bool
    check: str | None = None  # "schema:<i>" | "regex:<i>": the finished text must match
    disconnect_after: int | None = None  # close the stream after this many data events

    def __post_init__(self) -> None:
        self.body["stream"] = self.stream


def prompt_text(rng: random.Random, most: int = MAX_WORDS) -> str:
    """Words, 3 to ``most`` of them (log-uniform): prompts of one to many KV blocks."""
    n = int(math.exp(rng.uniform(math.log(3), math.log(most))))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def messages(rng: random.Random) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    if rng.random() < 0.3:  # an earlier turn
        out += [{"role": "user", "content": prompt_text(rng, MAX_TURN_WORDS)},
                {"role": "assistant", "content": prompt_text(rng, MAX_TURN_WORDS)}]
    return out + [{"role": "user", "content": prompt_text(rng)}]


def sampling(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    temperature = rng.choice([0.0, 0.7, 1.0])
    out: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": temperature}
    if temperature:
        out["seed"] = rng.randrange(1 << 30)
    return out


def make_spec(kind: str, rng: random.Random) -> Spec:
    """A request of ``kind`` (a key of MIX), its parameters drawn from ``rng``."""
    usage = {"stream_options": {"include_usage": True}}
    if kind in ("chat", "chat_stream"):
        stream = kind == "chat_stream"
        body = {**sampling(rng, rng.randint(4, 64)), "messages": messages(rng),
                **(usage if stream else {})}
        return Spec(kind, "/v1/chat/completions", body, stream, True)
    if kind in ("completion", "completion_stream"):
        stream = kind == "completion_stream"
        body = {**sampling(rng, rng.randint(4, 64)), "prompt": prompt_text(rng),
                **(usage if stream else {})}
        if not stream and rng.random() < 0.2:
            body["n"] = 2
        return Spec(kind, "/v1/completions", body, stream, False)
    if kind == "chat_json":
        i = rng.randrange(len(SCHEMAS))
        stream = rng.random() < 0.5
        body = {**sampling(rng, 80), "messages": messages(rng), **(usage if stream else {}),
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}}
        return Spec(kind, "/v1/chat/completions", body, stream, True, check=f"schema:{i}")
    if kind == "completion_regex":
        i = rng.randrange(len(REGEXES))
        body = {**sampling(rng, 24), "prompt": prompt_text(rng),
                "structured_outputs": {"regex": REGEXES[i]}}
        return Spec(kind, "/v1/completions", body, False, False, check=f"regex:{i}")
    if kind == "disconnect":  # a long answer the client leaves early
        chat = rng.random() < 0.5
        body = {**sampling(rng, 256), "ignore_eos": True}
        body.update({"messages": messages(rng)} if chat else {"prompt": prompt_text(rng)})
        return Spec(kind, "/v1/chat/completions" if chat else "/v1/completions", body, True,
                    chat, disconnect_after=rng.choice([0, 1, 4]))
    raise ValueError(f"kind: unknown {kind!r}")


def schema_problem(text: str, schema: dict[str, Any]) -> str | None:
    """Why ``text`` is not an object of ``schema`` (the two SCHEMAS' features), or None."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    if not isinstance(obj, dict):
        return "not a JSON object"
    props = schema["properties"]
    if set(obj) - set(props) or set(schema["required"]) - set(obj):
        return f"keys {sorted(obj)} (schema: {sorted(props)})"
    for key, value in obj.items():
        p = props[key]
        if p["type"] == "integer" and not (isinstance(value, int) and not isinstance(value, bool)
                                           and p["minimum"] <= value <= p["maximum"]):
            return f"{key}: {value!r} is not an integer in [{p['minimum']}, {p['maximum']}]"
        if p["type"] == "boolean" and not isinstance(value, bool):
            return f"{key}: {value!r} is not a boolean"
        if p["type"] == "string" and not (isinstance(value, str)
                                          and len(value) <= p["maxLength"]):
            return f"{key}: {value!r} is not a string of <= {p['maxLength']} characters"
    return None


def answer_problem(spec: Spec, texts: list[str], finishes: list[str | None]) -> str | None:
    """What is wrong with a complete answer (one text and finish_reason per choice)."""
    want = spec.body.get("n", 1)
    if len(finishes) != want:
        return f"{len(finishes)} choices, asked for {want}"
    if any(f not in ("stop", "length") for f in finishes):
        return f"finish_reason {finishes}"
    if spec.check is not None:
        what, i = spec.check.split(":")
        for text, finish in zip(texts, finishes, strict=True):
            if finish != "stop":  # cut by max_tokens: nothing to check
                continue
            if what == "schema" and (why := schema_problem(text, SCHEMAS[int(i)])):
                return f"response_format answer {text!r}: {why}"
            if what == "regex" and not re.fullmatch(REGEXES[int(i)], text):
                return f"structured_outputs answer {text!r} does not match {REGEXES[int(i)]!r}"
    return None


def whole_answer(spec: Spec, data: dict[str, Any]) -> tuple[list[str], list[str | None], int]:
    choices = sorted(data["choices"], key=lambda c: c["index"])
    texts = [(c["message"]["content"] or "") if spec.chat else c["text"] for c in choices]
    return texts, [c["finish_reason"] for c in choices], int(data["usage"]["completion_tokens"])


class Load:
    """``clients`` closed-loop clients until ``deadline`` (monotonic); the outcomes."""

    def __init__(self, url: str, clients: int, seed: int, t0: float) -> None:
        self.url = url
        self.clients = clients
        self.seed = seed
        self.t0 = t0
        self.outcomes: list[Outcome] = []
        self.limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        self.timeout = httpx.Timeout(REQUEST_TIMEOUT_S)

    async def run(self, deadline: float) -> None:
        await asyncio.gather(*(self.client(i, deadline) for i in range(self.clients)))

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = list(MIX), list(MIX.values())
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, trust_env=False,
                                     limits=self.limits) as http:
            while time.monotonic() < deadline:
                spec = make_spec(rng.choices(kinds, weights)[0], rng)
                if spec.disconnect_after is not None:
                    # Its own connection, closed when it leaves: the router sees the client go.
                    async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout,
                                                 trust_env=False) as own:
                        self.outcomes.append(await self.one(own, spec))
                else:
                    self.outcomes.append(await self.one(http, spec))

    async def one(self, http: httpx.AsyncClient, spec: Spec) -> Outcome:
        t = time.monotonic()

        def done(result: str, message: str = "", ttft: float | None = None,
                 tokens: int = 0) -> Outcome:
            now = time.monotonic()
            return Outcome(spec.kind, result, now - self.t0, now - t, ttft, tokens, message)

        try:
            if not spec.stream:
                r = await http.post(spec.path, json=spec.body)
                if r.status_code != 200:
                    return done("error", f"{spec.path}: HTTP {r.status_code}: {r.text[:300]}")
                texts, finishes, tokens = whole_answer(spec, r.json())
                why = answer_problem(spec, texts, finishes)
                return done("error", f"{spec.path}: {why}") if why else done("ok", tokens=tokens)
            return await self.streamed(http, spec, done)
        except Exception as e:  # anything else that went wrong is this request's error
            return done("error", f"{spec.path}{' stream' if spec.stream else ''}: "
                                 f"{type(e).__name__}: {e}"[:400])

    async def streamed(self, http: httpx.AsyncClient, spec: Spec, done: Any) -> Outcome:
        t = time.monotonic()
        texts: dict[int, str] = {}
        finishes: dict[int, str | None] = {}
        events, tokens, ttft, finished = 0, 0, None, False
        async with http.stream("POST", spec.path, json=spec.body) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")[:300]
                return done("error", f"{spec.path} stream: HTTP {r.status_code}: {body}")
            if spec.disconnect_after == 0:
                return done("disconnect")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    return done("error", f"{spec.path} stream: error event {ev['error']}")
                for c in ev.get("choices") or []:
                    piece = (c["delta"].get("content") or "") if spec.chat else c["text"]
                    if piece and ttft is None:
                        ttft = time.monotonic() - t
                    texts[c["index"]] = texts.get(c["index"], "") + piece
                    finishes[c["index"]] = c.get("finish_reason") or finishes.get(c["index"])
                if ev.get("usage"):
                    tokens = int(ev["usage"]["completion_tokens"])
                events += 1
                if spec.disconnect_after is not None and events >= spec.disconnect_after:
                    return done("disconnect", ttft=ttft)  # leaving the block closes it
        if not finished:
            return done("error", f"{spec.path} stream: ended without data: [DONE]")
        order = sorted(finishes)
        why = answer_problem(spec, [texts.get(i, "") for i in order],
                             [finishes[i] for i in order])
        if why:
            return done("error", f"{spec.path} stream: {why}")
        return done("ok", ttft=ttft, tokens=tokens)


# -- sampling ----------------------------------------------------------------------------------


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The series ``names`` of a /metrics body, each summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in names:
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                with contextlib.suppress(ValueError, IndexError):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def scrape(http: httpx.AsyncClient, cluster: Cluster) -> dict[str, dict[str, float]]:
    """Each worker's gauges and counters and the router's in-flight requests; a server that
    does not answer is missing from the result."""
    targets = [(name, url, WORKER_GAUGES + WORKER_COUNTERS)
               for name, url in cluster.workers.items()]
    targets.append(("router", cluster.router_url, ROUTER_GAUGES))
    out: dict[str, dict[str, float]] = {}
    for name, url, names in targets:
        with contextlib.suppress(httpx.HTTPError):
            r = await http.get(url + "/metrics", timeout=METRICS_TIMEOUT_S)
            if r.status_code == 200:
                out[name] = parse_metrics(r.text, names)
    return out


async def sample(http: httpx.AsyncClient, cluster: Cluster, t0: float, phase: str
                 ) -> dict[str, Any]:
    procs_now = {}
    for p in cluster.processes():
        m = measure(p)
        if m is not None:
            procs_now[f"{p.name} (pid {p.pid})"] = m
    return {"t": time.monotonic() - t0, "phase": phase, "procs": procs_now,
            "metrics": await scrape(http, cluster)}


def busy(metrics: dict[str, dict[str, float]], cluster: Cluster) -> dict[str, float]:
    """The gauges that are not 0 (the cluster is idle when this is empty; a server that did
    not answer counts as busy)."""
    out = {}
    for name in [*cluster.workers, "router"]:
        if name not in metrics:
            out[f"{name} /metrics"] = float("nan")
            continue
        for key in WORKER_GAUGES + ROUTER_GAUGES:
            if metrics[name].get(key, 0.0):
                out[f"{name} {key}"] = metrics[name][key]
    return out


async def drive(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    """The load for ``args.duration_s`` with a sample every ``args.sample_s``, then the wait
    for idle and the last sample."""
    t0 = time.monotonic()
    load = Load(cluster.router_url, args.clients, args.seed, t0)
    samples: list[dict[str, Any]] = []
    deadline = t0 + args.duration_s
    async with httpx.AsyncClient(trust_env=False) as http:
        samples.append(await sample(http, cluster, t0, "load"))
        task = asyncio.create_task(load.run(deadline))
        try:
            next_t = t0 + args.sample_s
            while not task.done():
                await asyncio.wait({task}, timeout=max(0.0, next_t - time.monotonic()))
                now = time.monotonic()
                if now >= next_t and now < deadline:
                    samples.append(await sample(http, cluster, t0, "load"))
                    while next_t <= time.monotonic():  # a late sample: keep the cadence
                        next_t += args.sample_s
            task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        load_s = time.monotonic() - t0
        samples.append(await sample(http, cluster, t0, "load"))  # the end of the load
        idle_deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            still = busy(await scrape(http, cluster), cluster)
            if not still or time.monotonic() > idle_deadline:
                break
            await asyncio.sleep(0.5)
        idle_wait_s = time.monotonic() - t0 - load_s
        samples.append(await sample(http, cluster, t0, "idle"))
    return {"samples": samples, "outcomes": load.outcomes, "load_s": load_s,
            "idle_wait_s": idle_wait_s, "busy_at_end": busy(samples[-1]["metrics"], cluster)}


# -- analysis ----------------------------------------------------------------------------------


def warmup_s(load_s: float) -> float:
    w = WARMUP_SHARE * load_s
    return max(w, WARMUP_MIN_S) if load_s >= WARMUP_MIN_RUN_S else w


def slope_per_s(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``(t, y)`` points."""
    mt = statistics.fmean(t for t, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def judge(samples: list[dict[str, Any]], load_s: float) -> list[dict[str, Any]]:
    """Per process: RSS at the end of warm-up / of the load / idle, slope (MiB/h) after
    warm-up, the flat verdict by the rule; fds and threads likewise (reported, not judged)."""
    w = warmup_s(load_s)
    names = sorted({n for s in samples for n in s["procs"]}, key=_proc_order)
    rows = []
    for name in names:
        load = [(s["t"], s["procs"][name]) for s in samples
                if s["phase"] == "load" and name in s["procs"]]
        post = [(t, m) for t, m in load if t >= w]
        idle = next((s["procs"].get(name) for s in samples if s["phase"] == "idle"), None)
        row: dict[str, Any] = {"process": name, "samples": len(post)}
        if len(post) < MIN_FIT_SAMPLES:
            row.update(verdict=f"too few samples after warm-up ({len(post)} < "
                               f"{MIN_FIT_SAMPLES})", flat=False, slope_mib_h=None)
            rows.append(row)
            continue
        slope = slope_per_s([(t, m["rss_mib"]) for t, m in post])
        window = load_s - w
        drift = abs(slope) * window
        start, end = post[0][1], post[-1][1]
        tol = max(FLAT_SHARE * start["rss_mib"], FLAT_MIN_MIB)
        row.update(
            rss_warm_mib=start["rss_mib"], rss_end_mib=end["rss_mib"],
            rss_idle_mib=idle["rss_mib"] if idle else None,
            rss_max_mib=max(m["rss_mib"] for _, m in post),
            slope_mib_h=slope * 3600, drift_mib=drift, tolerance_mib=tol, flat=drift < tol,
            fds_warm=start["fds"], fds_end=end["fds"], fds_idle=idle["fds"] if idle else None,
            fds_max=max(m["fds"] for _, m in post),
            fd_slope_h=slope_per_s([(t, m["fds"]) for t, m in post]) * 3600,
            threads_warm=start["threads"], threads_end=end["threads"],
            threads_idle=idle["threads"] if idle else None)
        row["verdict"] = "flat" if row["flat"] else "NOT FLAT"
        rows.append(row)
    return rows


def _proc_order(name: str) -> tuple[int, str]:
    order = ("launcher", "router", "ctx0", "gen0")
    head = name.split(" ", 1)[0].split("/", 1)[0]
    return (order.index(head) if head in order else len(order), name)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(run: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    outs: list[Outcome] = run["outcomes"]
    by_kind: dict[str, Counter[str]] = {}
    for o in outs:
        by_kind.setdefault(o.kind, Counter())[o.result] += 1
    ok = [o for o in outs if o.result == "ok"]
    errors = [o for o in outs if o.result == "error"]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    lat_by_kind = {k: (percentile([o.latency_s for o in ok if o.kind == k], 0.5),
                       percentile([o.latency_s for o in ok if o.kind == k], 0.99))
                   for k in MIX if k != "disconnect"}
    first = run["samples"][0]["metrics"]
    last = run["samples"][-1]["metrics"]
    counters = {name: {k: last.get(name, {}).get(k, 0.0) - first.get(name, {}).get(k, 0.0)
                       for k in WORKER_COUNTERS} for name in cluster.workers}
    return {
        "requests": len(outs), "ok": len(ok), "errors": len(errors),
        "disconnects": sum(o.result == "disconnect" for o in outs),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "error_examples": [f"{o.kind} at {o.t:.1f} s: {o.message}"
                           for o in errors[:ERROR_EXAMPLES]],
        "error_messages": dict(Counter(_shape(o.message) for o in errors).most_common(10)),
        "requests_per_s": len(outs) / run["load_s"] if run["load_s"] else 0.0,
        "ok_per_s": len(ok) / run["load_s"] if run["load_s"] else 0.0,
        "tokens_per_s": sum(o.tokens for o in ok) / run["load_s"] if run["load_s"] else 0.0,
        "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "latency_by_kind": lat_by_kind, "worker_counters": counters,
    }


def _shape(message: str) -> str:
    """An error message with its numbers blanked, cut short: messages of one cause counted
    together."""
    return re.sub(r"\d+", "N", message)[:160]


# -- the report --------------------------------------------------------------------------------


def machine_lines() -> list[str]:
    mem = "?"
    with contextlib.suppress(OSError, StopIteration, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1])
        mem = f"{kib / 2**20:.1f} GiB"

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return [cpu_line(), f"RAM {mem}; Python {platform.python_version()}, torch "
            f"{version('torch')}, httpx {version('httpx')}",
            f"git commit {commit}" + (" with uncommitted changes" if dirty else "")]


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def report(args: argparse.Namespace, cluster: Cluster, run: dict[str, Any],
           summary: dict[str, Any], rows: list[dict[str, Any]], failures: list[str],
           started: str) -> str:
    w = warmup_s(run["load_s"])
    n_samples = len(run["samples"])
    L = [f"# Soak: `disagg launch` 1 context + 1 generation worker under a mixed load "
         f"({started})", ""]
    L += [f"- {line}" for line in machine_lines()]
    L += [f"- command: `{args.command}`",
          f"- cluster: `disagg launch -c` of the YAML below: the router, one context and one "
          f"generation worker on loopback, the built-in tiny model (`model: tiny`); KV "
          f"transfer backend asked: {args.kv_backend}, run by the generation worker: "
          f"{cluster.kv_backend()}",
          f"- load: {args.clients} closed-loop clients for {run['load_s']:.0f} s "
          f"({run['load_s'] / 60:.1f} min); mix by weight {json.dumps(MIX)}; prompts of "
          f"3-{MAX_WORDS} words, 4-80 tokens out (disconnects: 256 with ignore_eos, the "
          f"client closes after 0, 1 or 4 stream events); the client runs on the same cores "
          f"as the cluster",
          f"- sampling: every {args.sample_s:g} s ({n_samples} samples, the last one when "
          f"idle, {run['idle_wait_s']:.1f} s after the load stopped); warm-up: the first "
          f"{w:.0f} s",
          f"- result: **{'PASS' if not failures else 'FAIL'}**"
          + ("" if not failures else ": " + "; ".join(failures)), ""]
    L += ["## Requests", "",
          f"- {summary['requests']} requests: {summary['ok']} ok, **{summary['errors']} "
          f"errors**, {summary['disconnects']} client disconnects (on purpose, not errors)",
          f"- throughput: {summary['ok_per_s']:.2f} completed requests/s, "
          f"{summary['tokens_per_s']:.0f} generated tokens/s (completed requests' usage)",
          f"- latency of completed requests (whole answer): p50 {ms(summary['latency_p50_s'])}"
          f", p99 {ms(summary['latency_p99_s'])}; streamed, to the first content: p50 "
          f"{ms(summary['ttft_p50_s'])}, p99 {ms(summary['ttft_p99_s'])}", "",
          "| kind | ok | errors | disconnects | p50 | p99 |", "|---|---:|---:|---:|---:|---:|"]
    for kind in MIX:
        c = summary["by_kind"].get(kind, {})
        p50, p99 = summary["latency_by_kind"].get(kind, (None, None))
        L.append(f"| {kind} | {c.get('ok', 0)} | {c.get('error', 0)} | "
                 f"{c.get('disconnect', 0)} | {ms(p50)} | {ms(p99)} |")
    if summary["error_examples"]:
        L += ["", "First errors:", ""] + [f"- `{e}`" for e in summary["error_examples"]]
        L += ["", "Errors by message:", ""] + [f"- {n} x `{m}`"
                                               for m, n in summary["error_messages"].items()]
    L += ["", "## Memory and file descriptors per process", "",
          f"Flat rule: a least-squares line through the RSS samples under load after warm-up "
          f"(t >= {w:.0f} s); **flat when |slope| x the load time after warm-up "
          f"({run['load_s'] - w:.0f} s) < max({FLAT_SHARE:.0%} of the RSS at the end of "
          f"warm-up, {FLAT_MIN_MIB:g} MiB)**, with at least {MIN_FIT_SAMPLES} samples. File "
          f"descriptors and threads are reported, not judged.", "",
          "| process | RSS end of warm-up (MiB) | RSS end of load | RSS idle | slope (MiB/h) "
          "| drift / allowed (MiB) | verdict | fds warm-up / end / idle (max) | fd slope (/h) "
          "| threads warm-up / end / idle |",
          "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r.get("slope_mib_h") is None:
            L.append(f"| {r['process']} | - | - | - | - | - | {r['verdict']} | - | - | - |")
            continue
        L.append(f"| {r['process']} | {r['rss_warm_mib']:.1f} | {r['rss_end_mib']:.1f} | "
                 f"{fmt(r['rss_idle_mib'])} | {r['slope_mib_h']:+.2f} | "
                 f"{r['drift_mib']:.2f} / {r['tolerance_mib']:.2f} | {r['verdict']} | "
                 f"{r['fds_warm']} / {r['fds_end']} / {fmt(r['fds_idle'], 'd')} "
                 f"({r['fds_max']}) | {r['fd_slope_h']:+.1f} | {r['threads_warm']} / "
                 f"{r['threads_end']} / {fmt(r['threads_idle'], 'd')} |")
    idle = run["samples"][-1]["metrics"]
    L += ["", "## When idle (the last sample)", ""]
    for name in cluster.workers:
        m = idle.get(name, {})
        c = summary["worker_counters"].get(name, {})
        L.append(f"- {name}: " + ", ".join(
            f"{k.removeprefix('disagg_')} {m[k]:g}" for k in WORKER_GAUGES if k in m)
            + "; during the run: " + ", ".join(
            f"{k.removeprefix('disagg_').removesuffix('_total')} {v:,.0f}"
            for k, v in c.items()))
    r_m = idle.get("router", {})
    L.append("- router: in-flight requests (sum over workers) "
             + fmt(r_m.get("disagg_router_worker_active_requests"), "g"))
    L.append(f"- not back to 0: {run['busy_at_end'] or 'none'}")
    L.append(f"- processes left behind after the stop: {cluster.left_behind or 'none'} "
             f"(launcher exit code {cluster.launcher_exit})")
    L += ["", "## The cluster's YAML", "", "```yaml",
          _yaml(cluster.config).rstrip(), "```", "",
          f"Raw samples: `{Path(args.json_out).name}` (every sample: RSS, fds, threads per "
          f"process; the workers' and router's gauges).", ""]
    return "\n".join(L)


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


# -- main --------------------------------------------------------------------------------------


def failures_of(summary: dict[str, Any], rows: list[dict[str, Any]], run: dict[str, Any],
                cluster: Cluster) -> list[str]:
    out = []
    if summary["errors"]:
        out.append(f"{summary['errors']} request errors")
    if summary["ok"] == 0:
        out.append("no request completed")
    out += [f"RSS of {r['process']} not flat ({r['verdict']}"
            + (f": {r['slope_mib_h']:+.2f} MiB/h, drift {r['drift_mib']:.2f} MiB > "
               f"{r['tolerance_mib']:.2f} MiB allowed" if r.get("slope_mib_h") is not None
               else "") + ")" for r in rows if not r["flat"]]
    if run["busy_at_end"]:
        out.append(f"not idle {IDLE_TIMEOUT_S:g} s after the load: {run['busy_at_end']}")
    if cluster.exited_early is not None:
        out.append(f"disagg launch exited during the run (code {cluster.exited_early}; "
                   f"{cluster.log})")
    if cluster.left_behind:
        out.append(f"processes left behind: {cluster.left_behind}")
    return out


def _sigterm_as_sigint(sig: int, frame: object) -> None:
    """SIGTERM as Ctrl-C (raised directly, not as SIGINT: that one may be ignored, as in a
    shell's background job): the load is abandoned, ``main`` stops the cluster."""
    raise KeyboardInterrupt(signal.Signals(sig).name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None, help="load time (default 30)")
    length.add_argument("--seconds", type=float, default=None, help="load time in seconds")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--kv-backend", choices=("tcp", "ucx", "auto"), default="tcp",
                   help="KV transfer backend of the workers (auto: their default, UCX when "
                        "ucxx imports)")
    p.add_argument("--sample-s", type=float, default=None,
                   help="seconds between samples (default: 10, or load time / 40 when less)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.md"),
                   help="the report; the raw samples go beside it as .json")
    p.add_argument("--work-dir", default=None,
                   help="folder for the cluster's YAML and logs (default: a new temp folder)")
    args = p.parse_args(argv)
    args.duration_s = (args.seconds if args.seconds is not None
                       else 60.0 * (30.0 if args.minutes is None else args.minutes))
    if not args.duration_s > 0:
        p.error("--minutes / --seconds: must be > 0")
    if args.clients < 1:
        p.error("--clients: must be >= 1")
    if args.sample_s is None:
        args.sample_s = min(10.0, max(0.5, args.duration_s / 40))
    if not args.sample_s > 0:
        p.error("--sample-s: must be > 0")
    if args.kv_backend == "ucx":
        from disagg.transfer.ucx import ucx_available

        ok, why = ucx_available()
        if not ok:
            p.error(f"--kv-backend ucx: UCX is not available here: {why}")
    args.json_out = str(Path(args.out).with_suffix(".json"))
    args.command = shlex.join(["python", "-m", "bench.soak", *(sys.argv[1:] if argv is None
                                                              else argv)])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="disagg-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    old = signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    cluster = Cluster(work, args.kv_backend)
    try:
        print(f"starting the cluster: {shlex.join(cluster.cmd)} (log {cluster.log})", flush=True)
        cluster.start()
        print(f"cluster ready: {cluster.router_url}; load for {args.duration_s:g} s with "
              f"{args.clients} clients, a sample every {args.sample_s:g} s", flush=True)
        run = asyncio.run(drive(cluster, args))
    except KeyboardInterrupt:
        print("bench.soak: interrupted: stopping the cluster, no report", file=sys.stderr,
              flush=True)
        return 130
    except RuntimeError as e:
        print(f"bench.soak: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # The stop is bounded (the launcher's grace, then SIGKILL): a second Ctrl-C or SIGTERM
        # does not cut it short and leave children behind.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            cluster.stop()
        finally:
            handlers[signal.SIGTERM] = old
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if cluster.left_behind:
            print(f"bench.soak: killed processes left behind: {cluster.left_behind}",
                  file=sys.stderr, flush=True)
    summary = summarize(run, cluster)
    rows = judge(run["samples"], run["load_s"])
    failures = failures_of(summary, rows, run, cluster)
    text = report(args, cluster, run, summary, rows, failures, started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    raw = {"command": args.command, "load_s": run["load_s"], "warmup_s": warmup_s(run["load_s"]),
           "sample_s": args.sample_s, "kv_backend": cluster.kv_backend(),
           "flat_rule": {"share": FLAT_SHARE, "min_mib": FLAT_MIN_MIB},
           "processes": [asdict(p) for p in cluster.seen.values()],
           "left_behind": cluster.left_behind, "busy_at_end": run["busy_at_end"],
           "summary": summary, "rows": rows, "failures": failures, "samples": run["samples"],
           "logs": str(work)}
    Path(args.json_out).write_text(json.dumps(raw, indent=1, default=str) + "\n")
    print(text)
    print(f"wrote {args.out} and {args.json_out}; the cluster's logs: {work}")
    if failures:
        print("bench.soak: FAIL: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
