"""KV offload tiers on a multi-turn chat workload (issue 41): prefix hit rate, tokens
recomputed and TTFT through the router over two workers; tiers off / host / host + disk, and
the tiers' checksum on / off.

The cluster, for each configuration afresh: ``disagg launch -c`` of an aggregated cluster YAML,
``disagg router`` (``--policy``, default ``kv_cache_aware``) over two workers (``disagg serve``,
``OMP_NUM_THREADS=1``; the section's tier keys: the two workers share the disk folder, each
in a ``worker-N`` folder of its own). Each worker's KV cache is deliberately small
(``--kv-cache-tokens``): the conversations' history does not fit one pool, so a conversation's
earlier turns are evicted before its next turn comes. Configurations: ``off`` (no tier, the
reference), ``host`` (a host tier of ``--host-gib``), ``host+disk`` (a smaller host tier,
``--disk-host-gib``, over a disk tier of ``--disk-gib``: what the host tier cannot hold is
served from disk) and ``integrity-off`` (host+disk's tiers with ``kv_integrity: false``);
``peer`` (no tier, peer prefix reuse: both workers ``kv_peer_reuse: true``, the router's
``peer_reuse: true``: a turn routed to the worker that does not hold its history pulls it from
the one that does, when that one's KV cache still holds it) and ``host+disk+peer`` (both).

The workload: ``--conversations`` conversations of ``--turns`` turns, all sharing one system
prompt (``--system-words`` words); each turn's messages are the previous turn's, the
assistant's real answer and a new user message (``--user-words`` words), sent as a streamed
``/v1/chat/completions`` (greedy, ``--max-tokens``, the usage in the last chunk).
``--clients`` client tasks take conversations from one queue, a conversation going back to
the end of the queue after each turn: its next turn comes after every other conversation's
turn, which is what evicts it from the pool. The same workload in every configuration; the
answers are compared with tiers off (greedy: they must be identical).

Measured per configuration: the workers' prefix-cache hit tokens / query tokens (their
``/metrics`` before and after the workload), blocks loaded from and stored into each tier,
tokens recomputed (usage: prompt tokens - cached tokens; tier hits count as cached), the turns
that found their conversation's history, TTFT (client side: request sent -> first content
chunk) p50 / p99, the workload's wall time, the workers' RSS at the end and the CPU time of
other processes on the machine meanwhile.

    python -m bench.kv_tiers [--model smollm2|tiny|DIR] [--conversations 40] [--turns 6]
                             [--configs off,host,host+disk,integrity-off,peer,...]
                             [--out bench/results/kv_tiers.md]

Writes the report (``--out``) and the raw numbers beside it (``.json``: every request). Exits 1
when a request failed, an answer differs from tiers off, a tier block failed its check or a
process of a cluster was left behind.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import soak
from bench.baseline import machine_busy_s, proc_cpu_s
from bench.soak import machine_lines

ROOT = Path(__file__).resolve().parent.parent
NAME = "m"  # the served model name
TOKEN = "bench-kv-tiers"  # the cluster token (the router polls the workers' /kv_events)
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
GIB = 1 << 30
CONFIG_NAMES = ("off", "host", "host+disk", "integrity-off", "peer", "host+disk+peer")
DEFAULT_CONFIGS = ",".join(CONFIG_NAMES)
POLICIES = ("kv_cache_aware", "round_robin", "load_balancing")
# Offload series of a worker's /metrics (counters with their _total suffix).
QUERIES = "disagg_prefix_cache_queries_tokens_total"
HITS = "disagg_prefix_cache_hit_tokens_total"
LOADED = "disagg_kv_offload_loaded_blocks_total"
STORED = "disagg_kv_offload_stored_blocks_total"
FAILED = "disagg_kv_offload_failed_blocks_total"
PEER_PULLS = "disagg_kv_peer_prefix_pulls_total"
PEER_FAILED = "disagg_kv_peer_prefix_failed_total"
PEER_TOKENS = "disagg_kv_peer_prefix_tokens_total"
PEER_LEASES = "disagg_kv_peer_prefix_leases_total"
HELD = "disagg_kv_offload_blocks"
CAPACITY = "disagg_kv_offload_capacity_blocks"
PREEMPTIONS = "disagg_num_preemptions_total"
ROUTER_MATCHED = "disagg_router_kv_matched_tokens_total"
ROUTER_PROMPT = "disagg_router_kv_prompt_tokens_total"
WORDS = ("the", "a", "cluster", "router", "worker", "token", "cache", "block", "model", "fast",
         "slow", "river", "mountain", "green", "blue", "seven", "twelve", "write", "read",
         "story", "about", "why", "how", "when", "people", "city", "music", "light", "night",
         "morning", "code", "list", "name", "three", "numbers", "explain", "short", "long",
         "question", "answer", "garden", "winter", "summer", "bridge", "train", "letter",
         "history", "planet", "ocean", "forest", "market", "recipe", "bread", "coffee")
METRIC_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$')


# -- the configurations --------------------------------------------------------------------------


@dataclass(frozen=True)
class TierConfig:
    """One configuration: the tiers of each worker (GiB; None: no such tier)."""

    name: str
    host_gib: float | None = None
    disk_gib: float | None = None
    integrity: bool = True
    peer: bool = False  # peer prefix reuse (workers' kv_peer_reuse, the router's peer_reuse)

    def worker_options(self, disk_dir: Path) -> dict[str, Any]:
        """The section's tier keys (the workers of a section share ``disk_dir``: each takes
        a ``worker-N`` folder in it)."""
        out: dict[str, Any] = {}
        if self.host_gib is not None:
            out["kv_offload_host_gib"] = self.host_gib
        if self.disk_gib is not None:
            out["kv_offload_disk_dir"] = str(disk_dir)
            out["kv_offload_disk_gib"] = self.disk_gib
        if not self.integrity:
            out["kv_integrity"] = False  # (also the KV transfers' check: none here)
        if self.peer:
            out["kv_peer_reuse"] = True
        return out

    def describe(self) -> str:
        peer = ", peer prefix reuse" if self.peer else ""
        if self.host_gib is None and self.disk_gib is None:
            return "no tier" + peer
        parts = []
        if self.host_gib is not None:
            parts.append(f"host {self.host_gib:g} GiB")
        if self.disk_gib is not None:
            parts.append(f"disk {self.disk_gib:g} GiB")
        return " + ".join(parts) + " per worker" + ("" if self.integrity
                                                    else ", `kv_integrity: false`") + peer


def build_configs(names: list[str], host_gib: float, disk_host_gib: float,
                  disk_gib: float) -> list[TierConfig]:
    """``host``: a host tier alone; ``host+disk`` (and ``integrity-off``): a host tier of
    ``disk_host_gib`` (smaller, so that the disk tier serves what it cannot hold) over a disk
    tier."""
    table = {"off": TierConfig("off"), "host": TierConfig("host", host_gib),
             "host+disk": TierConfig("host+disk", disk_host_gib, disk_gib),
             "integrity-off": TierConfig("integrity-off", disk_host_gib, disk_gib,
                                         integrity=False),
             "peer": TierConfig("peer", peer=True),
             "host+disk+peer": TierConfig("host+disk+peer", disk_host_gib, disk_gib,
                                          peer=True)}
    return [table[n] for n in names]


# -- the workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    system: str
    users: list[list[str]]  # conversation -> its user messages, one per turn


def make_workload(conversations: int, turns: int, system_words: int, user_words: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    system = ("You are a helpful assistant for a small city library. "
              + " ".join(rng.choice(WORDS) for _ in range(system_words)) + ".")
    users = [[f"Question {t + 1} of conversation {c + 1}: "
              + " ".join(rng.choice(WORDS) for _ in range(user_words)) + "?"
              for t in range(turns)] for c in range(conversations)]
    return Workload(system, users)


@dataclass
class Turn:
    conversation: int
    turn: int
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str = ""


async def chat_turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                    max_tokens: int, c: int, t: int) -> Turn:
    """One streamed chat request; its TTFT is the first chunk with content."""
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = Turn(c, t, False)
    parts: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {json.dumps(event['error'])[:300]}"
                    return out
                for ch in event.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - t0
                    parts.append(piece)
                    out.finish_reason = ch.get("finish_reason") or out.finish_reason
                if event.get("usage"):
                    u = event["usage"]
                    out.prompt_tokens = u["prompt_tokens"]
                    out.completion_tokens = u["completion_tokens"]
                    out.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency_s = time.perf_counter() - t0
    out.text = "".join(parts)
    if not done:
        out.error = "the stream ended without [DONE]"
    elif out.finish_reason is None:
        out.error = "no finish_reason"
    elif not out.prompt_tokens:
        out.error = "no usage in the stream"
    else:
        out.ok = True
    return out


async def run_workload(url: str, wl: Workload, clients: int, max_tokens: int) -> list[Turn]:
    """Every conversation's turns in order; a conversation goes back to the end of the queue
    after each turn (module docstring). A failed turn ends its conversation."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(len(wl.users)):
        queue.put_nowait(c)
    history: dict[int, list[dict[str, str]]] = {
        c: [{"role": "system", "content": wl.system}] for c in range(len(wl.users))}
    next_turn = dict.fromkeys(range(len(wl.users)), 0)
    live = len(wl.users)
    results: list[Turn] = []
    finished = asyncio.Event()
    if not live:
        return results

    async def client_task(client: httpx.AsyncClient) -> None:
        nonlocal live
        while not finished.is_set():
            c = await queue.get()
            if c < 0:
                return
            t = next_turn[c]
            messages = [*history[c], {"role": "user", "content": wl.users[c][t]}]
            res = await chat_turn(client, url, messages, max_tokens, c, t)
            results.append(res)
            if res.ok and t + 1 < len(wl.users[c]):
                history[c] = [*messages, {"role": "assistant", "content": res.text}]
                next_turn[c] = t + 1
                queue.put_nowait(c)
            else:
                live -= 1
                if live == 0:
                    finished.set()
                    for _ in range(clients):  # wake the tasks waiting on an empty queue
                        queue.put_nowait(-1)

    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(_guard(client_task(client), finished))
                 for _ in range(clients)]
        await asyncio.gather(*tasks)
    return results


async def _guard(coro: Any, finished: asyncio.Event) -> None:
    """A client task that raised still lets the others stop."""
    try:
        await coro
    finally:
        finished.set()


# -- the cluster ---------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError, StopIteration, ValueError, IndexError):
        with open(f"/proc/{pid}/status") as f:
            return int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1]) / 1024
    return None


def scrape(url: str) -> dict[str, float]:
    """A /metrics page: ``name`` or ``name|tier`` -> value, summed over the other labels."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        tier = re.search(r'tier="([^"]*)"', labels)
        key = name + (f"|{tier.group(1)}" if tier else "")
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def fs_of(path: Path) -> str:
    """The file system type and mount point holding ``path`` (/proc/mounts)."""
    best = ("?", "")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mnt, kind = parts[1], parts[2]
            if str(path).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (kind, mnt)
    return f"{best[0]} at {best[1] or '?'}"


class Cluster(soak.Cluster):
    """``disagg launch -c`` of an aggregated cluster: the router (``--policy``) over two
    workers with this configuration's tiers (soak's launcher handling: started, stopped,
    every process of it reaped or recorded as left behind)."""

    def __init__(self, work: Path, cfg: TierConfig, args: argparse.Namespace,
                 model: str) -> None:
        import yaml

        work.mkdir(parents=True, exist_ok=True)
        super().__init__(work, "auto")
        self.tier_config = cfg
        self.config = {
            "hostname": "127.0.0.1", "port": 0, "max_retries": 1, "model": model,
            "served_model_name": NAME, "log_level": "warning",
            "kv_cache_tokens": args.kv_cache_tokens, "tokens_per_block": args.tokens_per_block,
            "max_model_len": args.max_model_len,
            "generation_servers": {
                "num_instances": 2, "urls": [f"127.0.0.1:{p}" for p in self.ports],
                "router": {"type": args.policy,
                           **({"peer_reuse": True} if cfg.peer else {}),
                           **({} if args.load_weight is None
                              else {"load_weight": args.load_weight})},
                **cfg.worker_options(work / "tier")}}
        self.yaml_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def worker_pids(self) -> dict[str, int]:
        return {name: pid for pid, name in self.names.items() if name in self.workers}


# -- one configuration ---------------------------------------------------------------------------


def warm_up(cluster: Cluster) -> None:
    """One short chat on each worker directly (first-call costs out of the measurement)."""
    for name, url in cluster.workers.items():
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4, "temperature": 0}, timeout=REQUEST_TIMEOUT_S, trust_env=False)
        if r.status_code != 200:
            raise RuntimeError(f"warm-up on {name}: HTTP {r.status_code}: {r.text[:300]}")


def run_config(cfg: TierConfig, args: argparse.Namespace, model: str, wl: Workload,
               work: Path) -> dict[str, Any]:
    cluster = Cluster(work / cfg.name.replace("+", "_"), cfg, args, model)
    print(f"[{cfg.name}] disagg launch: the router and 2 workers ({cfg.describe()})",
          flush=True)
    try:
        t_start = time.monotonic()
        cluster.start()
        start_s = time.monotonic() - t_start
        warm_up(cluster)
        before = {name: scrape(url) for name, url in cluster.workers.items()}
        r_before = scrape(cluster.router_url)
        ours = [p.pid for p in cluster.processes()]
        cpu0 = {pid: proc_cpu_s(pid) for pid in ours}
        self0, busy0 = sum(os.times()[:2]), machine_busy_s()
        load0 = os.getloadavg()
        t0 = time.monotonic()
        turns = asyncio.run(run_workload(cluster.router_url, wl, args.clients, args.max_tokens))
        wall = time.monotonic() - t0
        own = sum(proc_cpu_s(pid) - cpu0[pid] for pid in ours) + sum(os.times()[:2]) - self0
        other = max(0.0, machine_busy_s() - busy0 - own)
        after = {name: scrape(url) for name, url in cluster.workers.items()}
        r_after = scrape(cluster.router_url)
        rss = {name: rss_mib(pid) for name, pid in cluster.worker_pids().items()}
    finally:
        cluster.stop()
        # The workers empty their disk tier when they start, not when they stop: its files
        # (up to --disk-gib per worker) would stay behind.
        shutil.rmtree(cluster.work / "tier", ignore_errors=True)
    print(f"[{cfg.name}] {len(turns)} turns in {wall:.1f} s", flush=True)
    return {"config": asdict(cfg), "describe": cfg.describe(), "start_s": start_s,
            "wall_s": wall, "own_cpu_s": own, "other_cpu_s": other,
            "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "metrics_before": before, "metrics_after": after,
            "router_before": r_before, "router_after": r_after, "rss_mib": rss,
            "launcher_exit": cluster.launcher_exit, "left_behind": cluster.left_behind,
            "exited_early": cluster.exited_early, "cluster_yaml": cluster.config,
            "logs": str(cluster.work), "turns": [asdict(t) for t in turns]}


# -- summaries -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None: no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.999999) - 1))]


def delta(run: dict[str, Any], key: str) -> float:
    return sum(run["metrics_after"][w].get(key, 0.0) - run["metrics_before"][w].get(key, 0.0)
               for w in run["metrics_after"])


def summarize(run: dict[str, Any], reference: dict[str, Any] | None,
              tokens_per_block: int) -> dict[str, Any]:
    turns = run["turns"]
    ok = [t for t in turns if t["ok"]]
    ttft = [t["ttft_s"] for t in ok if t["ttft_s"] is not None]
    later = [t["ttft_s"] for t in ok if t["ttft_s"] is not None and t["turn"] > 0]
    prompt = sum(t["prompt_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] for t in ok)
    queries, hits = delta(run, QUERIES), delta(run, HITS)
    after = run["metrics_after"]
    s: dict[str, Any] = {
        "turns": len(turns), "ok": len(ok), "errors": len(turns) - len(ok),
        "error_examples": [f"conversation {t['conversation']} turn {t['turn'] + 1}: "
                           f"{t['error']}" for t in turns if not t["ok"]][:5],
        "prompt_tokens": prompt, "cached_tokens": cached, "recomputed_tokens": prompt - cached,
        "completion_tokens": sum(t["completion_tokens"] for t in ok),
        "query_tokens": queries, "hit_tokens": hits,
        "hit_rate": hits / queries if queries else None,
        "usage_hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_later_p50_s": percentile(later, 0.5), "ttft_later_p99_s": percentile(later, 0.99),
        "latency_p50_s": percentile([t["latency_s"] for t in ok], 0.5),
        "wall_s": run["wall_s"], "other_cpu_s": run["other_cpu_s"],
        "preemptions": delta(run, PREEMPTIONS), "failed_blocks": delta(run, FAILED),
        "peer_pulls": delta(run, PEER_PULLS), "peer_failed": delta(run, PEER_FAILED),
        "peer_tokens": delta(run, PEER_TOKENS), "peer_leases": delta(run, PEER_LEASES),
        "rss_mib": sum(v for v in run["rss_mib"].values() if v is not None),
        "router_matched": _router_delta(run, ROUTER_MATCHED),
        "router_prompt": _router_delta(run, ROUTER_PROMPT),
        "left_behind": run["left_behind"],
    }
    # Turns 2+ that found their previous turn's prompt (its full blocks) cached: the
    # conversation's history was kept (pool or tier) on the worker the turn landed on.
    prev = {(t["conversation"], t["turn"]): t["prompt_tokens"] for t in ok}
    later_ok = [t for t in ok if t["turn"] > 0 and (t["conversation"], t["turn"] - 1) in prev]
    s["history_found"] = sum(
        1 for t in later_ok if t["cached_tokens"] >= prev[(t["conversation"], t["turn"] - 1)]
        // tokens_per_block * tokens_per_block)
    s["history_turns"] = len(later_ok)
    for tier in ("host", "disk"):
        s[f"loaded_{tier}"] = delta(run, f"{LOADED}|{tier}")
        s[f"stored_{tier}"] = delta(run, f"{STORED}|{tier}")
        s[f"held_{tier}"] = sum(after[w].get(f"{HELD}|{tier}", 0.0) for w in after)
        s[f"capacity_{tier}"] = sum(after[w].get(f"{CAPACITY}|{tier}", 0.0) for w in after)
    s["tier_tokens"] = (s["loaded_host"] + s["loaded_disk"]) * tokens_per_block
    if reference is not None:
        ref = {(t["conversation"], t["turn"]): t["text"] for t in reference["turns"] if t["ok"]}
        mine = {(t["conversation"], t["turn"]): t["text"] for t in ok}
        s["compared"] = len(ref)
        s["identical"] = sum(1 for k, v in ref.items() if mine.get(k) == v)
        s["first_differences"] = [
            {"conversation": k[0], "turn": k[1] + 1, "off": v[:120],
             "this": (mine.get(k) or "(missing)")[:120]}
            for k, v in sorted(ref.items()) if mine.get(k) != v][:3]
    return s


def _router_delta(run: dict[str, Any], key: str) -> float:
    return run["router_after"].get(key, 0.0) - run["router_before"].get(key, 0.0)


# -- the report ----------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.0f} ms"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def headline(cfg: dict[str, Any], s: dict[str, Any], off: dict[str, Any] | None,
             block_mib: float) -> str:
    """One sentence: what the configuration changed against tiers off, and at what cost."""
    cost = []
    if cfg["host_gib"] is not None:
        cost.append(f"{2 * cfg['host_gib']:g} GiB of host memory (2 workers x "
                    f"{cfg['host_gib']:g} GiB: {s['capacity_host']:.0f} blocks, "
                    f"{s['held_host']:.0f} held at the end)")
    if cfg["disk_gib"] is not None:
        cost.append(f"{2 * cfg['disk_gib']:g} GiB of disk (2 x {cfg['disk_gib']:g} GiB: "
                    f"{s['capacity_disk']:.0f} blocks, {s['held_disk']:.0f} = "
                    f"~{s['held_disk'] * block_mib / 1024:.2f} GiB held at the end)")
    if off is None:
        return (f"**{cfg['name']}**: prefix hit rate {pct(s['hit_rate'])} (turns 2+ that found "
                f"their history {s['history_found']}/{s['history_turns']}), "
                f"{s['recomputed_tokens']:,} prompt tokens recomputed, TTFT p50 "
                f"{ms(s['ttft_p50_s'])} (p99 {ms(s['ttft_p99_s'])}), wall {s['wall_s']:.1f} s")
    return (f"**{cfg['name']}**: prefix hit rate {pct(off['hit_rate'])} -> "
            f"**{pct(s['hit_rate'])}** (turns 2+ that found their history "
            f"{off['history_found']}/{off['history_turns']} -> {s['history_found']}/"
            f"{s['history_turns']}), prompt tokens recomputed {off['recomputed_tokens']:,}"
            f" -> **{s['recomputed_tokens']:,}**, TTFT p50 {ms(off['ttft_p50_s'])} -> "
            f"**{ms(s['ttft_p50_s'])}** (p99 {ms(off['ttft_p99_s'])} -> "
            f"{ms(s['ttft_p99_s'])}), wall {off['wall_s']:.1f} s -> {s['wall_s']:.1f} s, at "
            + (" and ".join(cost) or "no extra memory")
            + f"; worker RSS at the end {off['rss_mib']:.0f} -> {s['rss_mib']:.0f} MiB (both)")


def peer_line(runs: list[dict[str, Any]], sums: list[dict[str, Any]]) -> str:
    """What peer prefix reuse did in the configurations that had it (the workers' metrics)."""
    parts = [f"{r['config']['name']}: {s['peer_pulls']:,.0f} turns pulled "
             f"{s['peer_tokens']:,.0f} prompt tokens from the other worker "
             f"({s['peer_leases']:,.0f} leases made, {s['peer_failed']:,.0f} pulls failed and "
             f"computed instead)" for r, s in zip(runs, sums, strict=True)
             if r["config"].get("peer")]
    if not parts:
        return "- peer prefix reuse: not in this run's configurations"
    return ("- peer prefix reuse (a turn routed to a worker without its history pulls the "
            "other worker's cached prefix, from its KV cache or copied back from its tiers "
            "first): " + "; ".join(parts) + ". The pulled tokens count as cached tokens in "
            "the tables (usage), not in the prefix hit rate (the workers' own cache)")


def report(data: dict[str, Any]) -> str:
    import yaml

    a = data["args"]
    runs, sums = data["runs"], data["summaries"]
    names = [r["config"]["name"] for r in runs]
    off = sums[names.index("off")] if "off" in names else None
    block_mib = data["block_bytes"] / 2**20
    scaled = (a["conversations"], a["turns"]) != (64, 6)
    L = [f"# KV offload tiers: a multi-turn chat through the router over 2 workers "
         f"({data['started']} UTC)", ""]
    if scaled:
        L.append(f"Scaled down from the issue's 64 conversations x 6 turns to "
                 f"**{a['conversations']} conversations x {a['turns']} turns** so that every "
                 f"configuration runs in about {data['budget_note']} on this machine.")
    if data["model_note"]:
        L.append(data["model_note"])
    L += ["", f"Written by `{data['command']}`.", ""]
    L += [f"- {line}" for line in data["machine"]]
    L += [f"- model: {data['model_desc']}; KV {data['kv_bytes_per_token']:,} bytes a token, "
          f"{a['tokens_per_block']}-token blocks of {data['block_bytes'] / 2**20:.2f} MiB",
          f"- cluster: `disagg launch -c` of an aggregated cluster YAML (below): `disagg router`"
          f" (policy **{a['policy']}**"
          + ("" if a.get("load_weight") is None else f", load_weight {a['load_weight']:g}")
          + ") over 2 workers on loopback, not pinned, "
          f"OMP_NUM_THREADS={data['omp_threads']}, started afresh for each configuration; each "
          f"worker's KV cache: **{a['kv_cache_tokens']:,} tokens** "
          f"({a['kv_cache_tokens'] // a['tokens_per_block']} blocks), max_model_len "
          f"{a['max_model_len']:,}; the client shares the two cores with the cluster",
          f"- workload: {a['conversations']} conversations x {a['turns']} turns, one shared "
          f"system prompt ({data['system_tokens']} tokens; first turns' prompts "
          f"{data['first_prompt_tokens'][0]}-{data['first_prompt_tokens'][1]} tokens), "
          f"user messages of {a['user_words']} words, up to {a['max_tokens']} tokens answered "
          f"(greedy, EOS honoured), streamed `/v1/chat/completions` with the real answers "
          f"appended; {a['clients']} client tasks, a conversation back at the end of the queue "
          f"after each turn (its next turn comes after every other conversation's)",
          f"- history vs pool: the last turns' prompts total {data['history_tokens']:,} "
          f"tokens ({data['history_tokens'] - data['system_tokens'] * (a['conversations'] - 1):,}"
          f" without the repeated system prompt) against 2 x {a['kv_cache_tokens']:,} tokens "
          f"of KV cache",
          f"- tiers: **host**: a host tier of {a['host_gib']:g} GiB per worker; **host+disk**:"
          f" a host tier of {a['disk_host_gib']:g} GiB (smaller: what it cannot hold is "
          f"demoted to disk and served from there) over a disk tier of {a['disk_gib']:g} GiB per "
          f"worker; {a['host_gib'] * GIB / data['block_bytes']:,.0f} / "
          f"{a['disk_host_gib'] * GIB / data['block_bytes']:,.0f} blocks of host tier against "
          f"~{data['history_blocks'] / 2:,.0f} blocks of history per worker (half of the "
          f"conversations' full blocks at their last turn, the system prompt's once)",
          f"- disk tier folders: under `{data['work']}` ({data['disk_fs']}; removed after each "
          f"configuration, the logs kept)",
          f"- order: {', '.join(names)}, one after the other in this run", ""]
    L += ["## Headlines", ""]
    for r, s in zip(runs, sums, strict=True):
        L.append("- " + headline(r["config"], s, None if r["config"]["name"] == "off" else off,
                                 block_mib))
    L.append(peer_line(runs, sums))
    L.append(data["integrity_line"])
    if off is not None:
        L.append("- answers identical to tiers off (greedy), per configuration: " + "; ".join(
            f"{r['config']['name']} {s['identical']}/{s['compared']}"
            for r, s in zip(runs, sums, strict=True) if r["config"]["name"] != "off"))
    L.append(f"- result: **{'PASS' if not data['failures'] else 'FAIL'}**"
             + ("" if not data["failures"] else ": " + "; ".join(data["failures"])))
    L += ["", "## Per configuration", "",
          "| configuration | tiers per worker | requests ok / errors | prefix hit rate "
          "(metrics) | cached / prompt tokens (usage) | tokens recomputed | from tiers "
          "(tokens) | turns 2+ that found their history | TTFT p50 | TTFT p99 | TTFT p50 "
          "turns 2+ | latency p50 | wall | identical to off |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, s in zip(runs, sums, strict=True):
        ident = (f"{s['identical']}/{s['compared']}" if "identical" in s else "(reference)")
        L.append(f"| {r['config']['name']} | {r['describe']} | {s['ok']} / {s['errors']} | "
                 f"{pct(s['hit_rate'])} | {s['cached_tokens']:,} / {s['prompt_tokens']:,} | "
                 f"{s['recomputed_tokens']:,} | {s['tier_tokens']:,.0f} | "
                 f"{s['history_found']}/{s['history_turns']} | "
                 f"{ms(s['ttft_p50_s'])} | {ms(s['ttft_p99_s'])} | "
                 f"{ms(s['ttft_later_p50_s'])} | {ms(s['latency_p50_s'])} | "
                 f"{s['wall_s']:.1f} s | {ident} |")
    L += ["", "## Tier traffic (both workers)", "",
          "| configuration | blocks stored host / disk | blocks loaded host / disk | held at "
          "the end host / disk | capacity host / disk | failed checks | preemptions | "
          "router: matched / routed prompt tokens | worker RSS at the end | other processes' "
          "CPU |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, s in zip(runs, sums, strict=True):
        router = (f"{s['router_matched']:,.0f} / {s['router_prompt']:,.0f}"
                  if s["router_prompt"] else "-")
        L.append(f"| {r['config']['name']} | {s['stored_host']:,.0f} / {s['stored_disk']:,.0f} | "
                 f"{s['loaded_host']:,.0f} / {s['loaded_disk']:,.0f} | {s['held_host']:,.0f} / "
                 f"{s['held_disk']:,.0f} | {s['capacity_host']:,.0f} / "
                 f"{s['capacity_disk']:,.0f} | {s['failed_blocks']:,.0f} | "
                 f"{s['preemptions']:,.0f} | {router} | {s['rss_mib']:,.0f} MiB | "
                 f"{s['other_cpu_s']:.1f} core-s |")
    L += ["", "How to read it:", "",
          "- prefix hit rate: the workers' `disagg_prefix_cache_hit_tokens_total` / "
          "`disagg_prefix_cache_queries_tokens_total` over the workload (a tier hit counts "
          "once its blocks are back in the pool); cached / prompt tokens: the same from the "
          "answers' usage; tokens recomputed: prompt tokens - cached tokens (the tail of a "
          "prompt after its last full block is always computed); from tiers: blocks loaded "
          "back x block size; turns 2+ that found their history: cached tokens >= the previous "
          "turn's prompt (its full blocks), i.e. the conversation's history was still on the "
          "worker the turn landed on, in its pool or a tier",
          "- TTFT: client side, request sent -> the first chunk with content, through the "
          "router, with the other client tasks' requests queued on the same workers",
          "- router matched / routed: the prompt tokens the kv_cache_aware policy found in "
          "the chosen worker's index when it routed; a worker's KV events count a block as "
          "cached while its pool or one of its tiers holds it, so a conversation's next turn "
          "follows its history into a worker's tiers too",
          "- other processes' CPU: core-seconds used on the machine during the workload by "
          "processes that are not this cluster or this client (0 on a quiet machine)"]
    diffs = [(r["config"]["name"], s["first_differences"]) for r, s in zip(runs, sums,
                                                                          strict=True)
             if s.get("first_differences")]
    if diffs:
        L += ["", "## Answers that differ from tiers off", ""]
        for name, ds in diffs:
            L += [f"- {name}: conversation {d['conversation'] + 1} turn {d['turn']}: off "
                  f"`{d['off']!r}` vs `{d['this']!r}`" for d in ds]
    errs = [(r["config"]["name"], s["error_examples"]) for r, s in zip(runs, sums, strict=True)
            if s["error_examples"]]
    if errs:
        L += ["", "## Errors", ""]
        for name, es in errs:
            L += [f"- {name}: `{e}`" for e in es]
    L += ["", "## The cluster's YAML (the last configuration's; the tier keys of each are in "
          "the table above)", "", "```yaml",
          yaml.safe_dump(runs[-1]["cluster_yaml"], sort_keys=False).rstrip(), "```"]
    L += ["", f"Raw numbers: `{Path(data['json_out']).name}` (every request: TTFT, usage, "
          f"answer; each worker's and the router's metrics before and after).", ""]
    return "\n".join(L)


# -- main ----------------------------------------------------------------------------------------


def resolve_model(arg: str) -> tuple[str, str, str, str]:
    """(the cluster YAML's ``model``, its checkpoint folder, its description, a note for the
    report's first lines)."""
    from disagg.model.tiny import ensure_tiny_model

    tiny_note = ("**Model: the built-in tiny random model** ({why}): prefill costs little, so "
                 "the TTFT effects are not those of a real model.")
    if arg == "tiny":
        return "tiny", ensure_tiny_model(), "the built-in tiny random model (`model: tiny`)", (
            tiny_note.format(why="asked for with `--model tiny`"))
    if arg == "smollm2":
        from disagg.model.gguf import FetchError, GGUFError, fetch_model

        try:
            path = fetch_model("smollm2")
        except (FetchError, GGUFError, OSError) as e:
            return "tiny", ensure_tiny_model(), "the built-in tiny random model", (
                tiny_note.format(why=f"SmolLM2-135M-Instruct could not be fetched: {e}"))
        return "smollm2", path, describe_model(
            path, "SmolLM2-135M-Instruct (`model: smollm2`, `disagg model fetch smollm2`)"), ""
    path = os.path.abspath(arg)
    if not os.path.isdir(path):
        raise SystemExit(f"--model: {arg} is not smollm2, tiny or a checkpoint folder")
    return path, path, describe_model(path, f"`{path}`"), ""


def describe_model(path: str, name: str) -> str:
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "num_key_value_heads", "torch_dtype")
    return f"{name}: " + ", ".join(f"{k} {cfg[k]}" for k in keys if k in cfg)


def kv_bytes_per_token(path: str) -> int:
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(cfg.get("torch_dtype"), 4)
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize


def checksum_s(block_bytes: int, reps: int = 9) -> float:
    """Median seconds of one ``payload_checksum`` over a block of ``block_bytes`` on one torch
    thread here (the workers run one): what the tiers pay per block stored or loaded."""
    import torch

    from disagg.transfer.integrity import payload_checksum

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = torch.rand(max(1, block_bytes // 4))
        payload_checksum([block])  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            payload_checksum([block])
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def integrity_line(runs: list[dict[str, Any]], sums: list[dict[str, Any]],
                   block_check_s: float | None) -> str:
    """The tiers' checksum on vs off: host+disk against integrity-off (the same tiers), and
    what the checksums cost by their count x the time of one."""
    by = {r["config"]["name"]: (r, s) for r, s in zip(runs, sums, strict=True)}
    if "host+disk" not in by or "integrity-off" not in by or block_check_s is None:
        return ("- tier checksum on vs off (`kv_integrity`): not measured in this run (it needs "
                "the host+disk and integrity-off configurations)")
    (run_on, on), (run_off, off) = by["host+disk"], by["integrity-off"]
    # a checksum for each block stored into the host tier and each block loaded back (a
    # block demoted to disk keeps the host tier's)
    checks = on["stored_host"] + on["loaded_host"] + on["loaded_disk"]
    cost = checks * block_check_s
    return (f"- tier checksum on vs off: the checksums' own cost, measured: {checks:,.0f} "
            f"blocks checksummed in the host+disk run (stored into the host tier + loaded "
            f"back) x {block_check_s * 1e3:.2f} ms a block (one `payload_checksum` here, one "
            f"thread) = **{cost:.1f} s of CPU, {cost / run_on['own_cpu_s']:.1%} of the CPU the "
            f"cluster and client used in that run**. Whole runs, host+disk on vs `kv_integrity: "
            f"false` (no checksum taken or checked; it also turns off the KV transfers' check, "
            f"which an aggregated cluster does not use): TTFT p50 "
            f"{ms(on['ttft_p50_s'])} -> {ms(off['ttft_p50_s'])} (p99 {ms(on['ttft_p99_s'])} -> "
            f"{ms(off['ttft_p99_s'])}), wall {on['wall_s']:.1f} s -> {off['wall_s']:.1f} s, "
            f"{on['loaded_host'] + on['loaded_disk']:,.0f} -> "
            f"{off['loaded_host'] + off['loaded_disk']:,.0f} blocks loaded; other processes "
            f"used {run_on['other_cpu_s']:.1f} and {run_off['other_cpu_s']:.1f} core-s of this "
            f"machine during these two runs: one run each on a shared machine, so the "
            f"whole-run difference is mostly noise, the measured cost above the better "
            f"estimate (it leaves out the loads' wait: a checksum of a block loaded back is on "
            f"its request's path to the first token)")


def failures_of(runs: list[dict[str, Any]], sums: list[dict[str, Any]]) -> list[str]:
    out = []
    for r, s in zip(runs, sums, strict=True):
        name = r["config"]["name"]
        if s["errors"]:
            out.append(f"{name}: {s['errors']} requests failed")
        if "identical" in s and s["identical"] != s["compared"]:
            out.append(f"{name}: {s['compared'] - s['identical']} answers differ from tiers off")
        if s["failed_blocks"]:
            out.append(f"{name}: {s['failed_blocks']:.0f} tier blocks failed their check")
        if r["left_behind"]:
            out.append(f"{name}: processes left behind: {r['left_behind']}")
        if r["exited_early"] is not None:
            out.append(f"{name}: disagg launch exited during the run (code "
                       f"{r['exited_early']})")
    return out


def _sigterm(sig: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(sig).name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_tiers",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default; the tiny model when it cannot be fetched), tiny, or "
                        "a checkpoint folder")
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--clients", type=int, default=4, help="concurrent client tasks")
    p.add_argument("--system-words", type=int, default=160,
                   help="words of the shared system prompt")
    p.add_argument("--user-words", type=int, default=24, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer at most")
    p.add_argument("--kv-cache-tokens", type=int, default=2048,
                   help="each worker's KV cache, in tokens")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: --kv-cache-tokens")
    p.add_argument("--host-gib", type=float, default=0.25,
                   help="host tier per worker of the host configuration")
    p.add_argument("--disk-host-gib", type=float, default=0.0625,
                   help="host tier per worker of the host+disk configuration")
    p.add_argument("--disk-gib", type=float, default=1.0, help="disk tier per worker")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated, from {', '.join(CONFIG_NAMES)} (integrity-off: "
                        f"host+disk's tiers with kv_integrity false); 'off' is the reference "
                        f"(default: all)")
    p.add_argument("--policy", choices=POLICIES, default="kv_cache_aware",
                   help="the router's policy")
    p.add_argument("--load-weight", type=float, default=None,
                   help="the kv_cache_aware policy's load_weight (default: the router's, "
                        "0.25): higher moves more turns away from the worker holding their "
                        "history, which is where peer reuse pays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None,
                   help="folder for the YAMLs, logs and disk tiers (default: a new temp folder)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_tiers.md"),
                   help="the report; the raw numbers go beside it as .json")
    args = p.parse_args(argv)
    for name in ("conversations", "turns", "clients", "max_tokens", "kv_cache_tokens",
                 "tokens_per_block"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("system_words", "user_words"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')}: must be >= 0")
    for name in ("host_gib", "disk_host_gib", "disk_gib"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0")
    args.max_model_len = args.max_model_len or args.kv_cache_tokens
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIG_NAMES]
    if bad or not names or len(set(names)) != len(names):
        p.error(f"--configs: {args.configs!r}: each of {', '.join(CONFIG_NAMES)} at most once")
    if args.load_weight is not None and (args.policy != "kv_cache_aware"
                                         or args.load_weight < 0):
        p.error("--load-weight: a kv_cache_aware policy's option, >= 0")
    if args.policy != "kv_cache_aware" and any(n.endswith("peer") for n in names):
        p.error("--configs: the peer configurations need --policy kv_cache_aware (the router "
                "names the peer from its KV indexes)")
    # 'off' first: the others are compared with it
    args.config_names = sorted(names, key=lambda n: n != "off")
    args.json_out = str(Path(args.out).with_suffix(".json"))
    args.command = shlex.join(["python", "-m", "bench.kv_tiers",
                               *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="disagg-kv-tiers-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    yaml_model, model, model_desc, model_note = resolve_model(args.model)
    from disagg.tokenizer import load_tokenizer
    # The workers inherit it through disagg launch: one thread each on this machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    wl = make_workload(args.conversations, args.turns, args.system_words, args.user_words,
                       args.seed)
    configs = build_configs(args.config_names, args.host_gib, args.disk_host_gib,
                            args.disk_gib)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    loadavg = os.getloadavg()
    t_all = time.monotonic()
    runs: list[dict[str, Any]] = []
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        for cfg in configs:
            runs.append(run_config(cfg, args, yaml_model, wl, work))
    except KeyboardInterrupt:
        print("bench.kv_tiers: interrupted: no report", file=sys.stderr)
        return 130
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"bench.kv_tiers: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    total_s = time.monotonic() - t_all
    ref = runs[0] if runs[0]["config"]["name"] == "off" else None
    sums = [summarize(r, None if r is ref else ref, args.tokens_per_block) for r in runs]
    first = [t for t in runs[0]["turns"] if t["ok"] and t["turn"] == 0]
    last = {}
    for t in runs[0]["turns"]:
        if t["ok"]:
            last[t["conversation"]] = max(last.get(t["conversation"], (0, 0)),
                                          (t["turn"], t["prompt_tokens"] + t["completion_tokens"]))
    system_tokens = len(load_tokenizer(model).encode(wl.system, add_special_tokens=False))
    per_token = kv_bytes_per_token(model)
    data: dict[str, Any] = {
        "command": args.command, "started": started, "args": vars(args),
        "machine": machine_lines(), "loadavg_start": loadavg, "total_s": total_s,
        "budget_note": f"{total_s / max(1, len(runs)) / 60:.1f} minutes ({total_s / 60:.1f} "
                       f"minutes for all {len(runs)})",
        "model": model, "model_desc": model_desc, "model_note": model_note,
        "kv_bytes_per_token": per_token, "block_bytes": per_token * args.tokens_per_block,
        "system_tokens": system_tokens, "integrity_line": integrity_line(
            runs, sums, checksum_s(per_token * args.tokens_per_block)
            if {"host+disk", "integrity-off"} <= set(args.config_names) else None),
        "first_prompt_tokens": [min((t["prompt_tokens"] for t in first), default=0),
                                max((t["prompt_tokens"] for t in first), default=0)],
        "history_tokens": sum(v[1] for v in last.values()),
        # every conversation's full blocks at its last turn, the shared system prompt once
        "history_blocks": sum(v[1] // args.tokens_per_block for v in last.values())
        - max(0, len(last) - 1) * (system_tokens // args.tokens_per_block),
        "work": str(work), "disk_fs": fs_of(work),
        "omp_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "json_out": args.json_out, "runs": runs, "summaries": sums,
    }
    data["failures"] = failures_of(runs, sums)
    text = report(data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.json_out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(text)
    print(f"wrote {args.out} and {args.json_out}; logs under {work}")
    if data["failures"]:
        print("bench.kv_tiers: FAIL: " + "; ".join(data["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
