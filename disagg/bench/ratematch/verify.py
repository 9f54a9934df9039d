"""Verify: check frontier points end to end on clusters started with ``disagg launch``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from disagg import procs
from disagg.bench.ratematch.model import best_integer_cluster, gen_points_beside, predict_cluster
from disagg.bench.ratematch.sweep import note

if TYPE_CHECKING:
    from disagg.bench.ratematch.sweep import RateMatcher


def verify_choices(result: dict[str, Any], max_devices: float, num_points: int,
                   ctx_devices: float = 1.0, gen_devices: float = 1.0) -> list[dict[str, Any]]:
    """Frontier points to verify (spread evenly along it) with their best integer cluster and
    its prediction."""
    ctx_rate = result["context"]["ctx_rate"]
    osl = result["config"]["osl"]
    # The rate-matched points' own (co-located: beside a context worker at its rate).
    gen_points = gen_points_beside(result["generation"], ctx_rate)
    frontier = result["frontier"]
    if not frontier or num_points < 1:
        return []
    if len(frontier) <= num_points:
        picked = list(frontier)
    else:  # evenly spaced indices, both ends included
        idx = sorted({round(i * (len(frontier) - 1) / max(1, num_points - 1))
                      for i in range(num_points)})
        picked = [frontier[i] for i in idx]
    out = []
    by_conc = {p["concurrency"]: p for p in gen_points}
    for fp in picked:
        gp = by_conc[fp["concurrency"]]
        cluster = best_integer_cluster(ctx_rate, gp, osl, max_devices, ctx_devices, gen_devices)
        if cluster is None:
            continue
        n_ctx, n_gen = cluster
        pred = predict_cluster(ctx_rate, gp, gen_points, osl, n_ctx, n_gen, ctx_devices,
                               gen_devices, generation=result["generation"])
        out.append({"concurrency_per_gen": fp["concurrency"], "num_ctx": n_ctx,
                    "num_gen": n_gen, "devices": pred.pop("devices"),
                    "concurrency": n_gen * fp["concurrency"], "predicted": pred})
    return out


def gap(measured: float, predicted: float) -> float | None:
    """(measured - predicted) / predicted; None without a prediction."""
    return None if not predicted else (measured - predicted) / predicted


def finish_verify_point(choice: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Merge a verify choice with its end-to-end measurement and the gaps."""
    devices = choice["devices"]
    m = {"tokens_per_s_per_user": measured["tokens_per_s_per_user"],
         "tput_per_device": measured["output_throughput"] / devices,
         **{k: measured[k] for k in ("output_throughput", "completed", "failed", "p99_tpot_ms",
                                     "p99_ttft_ms", "mean_ttft_ms", "mean_tpot_ms")},
         **{k: measured.get(k) for k in ("run_output_throughput", "in_flight",
                                         "in_flight_runs", "runs",
                                         "unloaded_ttft_ms", "arrivals", "request_rate",
                                         "served_rate", "ttft_ms", "meets_ttft_slo")}}
    pred = choice["predicted"]
    return {**choice, "measured": m,
            "gap_tput_per_device": gap(m["tput_per_device"], pred["tput_per_device"]),
            "gap_tokens_per_s_per_user": gap(m["tokens_per_s_per_user"],
                                             pred["tokens_per_s_per_user"])}


class LaunchedCluster:
    """``disagg launch -c`` on a cluster YAML this class writes: ``num_ctx`` context and
    ``num_gen`` generation workers on free local ports and the router in front.

    ``with LaunchedCluster(...) as url:`` waits until the router's /health answers 200 (or the
    launcher exits, or ``timeout_s`` passes: RuntimeError with the launcher's output tail),
    and on exit SIGTERMs the launcher, which stops its children; it is killed after
    ``stop_timeout_s`` if it has not exited by then.
    """

    def __init__(self, model_dir: str, served_model_name: str, num_ctx: int, num_gen: int,
                 worker_options: dict[str, Any], log_dir: str, timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0, policy: str = "load_balancing") -> None:
        self.model_dir, self.name = model_dir, served_model_name
        self.num_ctx, self.num_gen = num_ctx, num_gen
        self.worker_options = dict(worker_options)
        self.log_dir, self.timeout_s, self.stop_timeout_s = log_dir, timeout_s, stop_timeout_s
        self.policy = policy
        self.proc: Any = None
        self.url = ""  # the router's base URL
        self.ctx_urls: list[str] = []  # the workers' base URLs (their /metrics, /server_info)
        self.gen_urls: list[str] = []

    def cluster_yaml(self, ports: Sequence[int]) -> dict[str, Any]:
        router, *workers = ports
        opts = {"cache_transceiver_config": {}, **self.worker_options}
        # TCP unless the worker options name a backend (their UCX profile is kept either way).
        opts["cache_transceiver_config"] = {"backend": "TCP", **opts["cache_transceiver_config"]}
        ctx = [f"127.0.0.1:{p}" for p in workers[:self.num_ctx]]
        gen = [f"127.0.0.1:{p}" for p in workers[self.num_ctx:]]
        return {"hostname": "127.0.0.1", "port": router, "model": self.model_dir,
                "served_model_name": self.name, **opts,
                "context_servers": {"num_instances": len(ctx), "urls": ctx,
                                    "router": {"type": self.policy}},
                "generation_servers": {"num_instances": len(gen), "urls": gen,
                                       "router": {"type": self.policy}}}

    def __enter__(self) -> str:
        import yaml

        ports = procs.free_ports(1 + self.num_ctx + self.num_gen)
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "verify-cluster.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(self.cluster_yaml(ports), f, sort_keys=False)
        self._out_path = os.path.join(self.log_dir, "launch.out")
        # Not its own session: a Ctrl-C of this run reaches the launcher, which stops its
        # children (and they get SIGTERM through PR_SET_PDEATHSIG if it is killed).
        self.proc = procs.spawn(
            [sys.executable, "-m", "disagg.cli", "launch", "-c", path, "--log-dir",
             self.log_dir, "--timeout", str(self.timeout_s)], self._out_path, new_session=False)
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.ctx_urls = [f"http://127.0.0.1:{p}" for p in ports[1:1 + self.num_ctx]]
        self.gen_urls = [f"http://127.0.0.1:{p}" for p in ports[1 + self.num_ctx:]]
        try:
            # The launcher's own limit, and a margin for it to report and exit.
            procs.wait_healthy(self.url, self.timeout_s + 10, proc=self.proc, interval=0.2,
                               what="disagg launch")
        except procs.NotHealthy:
            why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                   else f"not healthy in {self.timeout_s:g} s")
            self.__exit__(None, None, None)
            raise RuntimeError(f"disagg launch {why}:\n{self.output_tail()}") from None
        return self.url

    def output_tail(self, chars: int = 3000) -> str:
        try:
            with open(self._out_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"(no launcher output: {e})"

    def __exit__(self, *exc: object) -> None:
        """SIGTERM the launcher (it stops its children), SIGKILL after ``stop_timeout_s``."""
        if self.proc is None:
            return
        procs.stop(self.proc, self.stop_timeout_s, kill_wait_s=10)
        self.proc = None


def launch_verifier(model_dir: str, worker_options: dict[str, Any], log_dir: str,
                    timeout_s: float = 300.0, progress: TextIO | None = sys.stderr,
                    ) -> Callable[[RateMatcher, list[dict[str, Any]]], Any]:
    """The ``verify`` callback of ``run_rate_match``: each choice's cluster with ``disagg
    launch``, measured end to end at the choice's concurrency, then stopped."""

    async def verify(m: RateMatcher, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, ch in enumerate(choices):
            note(progress, f"verify: launching {ch['num_ctx']} context + {ch['num_gen']} "
                           f"generation worker(s)")
            with LaunchedCluster(model_dir, m.cfg.model, ch["num_ctx"], ch["num_gen"],
                                 worker_options, os.path.join(log_dir, f"verify-{i}"),
                                 timeout_s) as url:
                out.append(await m.run_end_to_end(url, ch["concurrency"],
                                                  ch["predicted"]["request_rate"],
                                                  ch["predicted"]["arrivals"]))
        return out

    return verify
