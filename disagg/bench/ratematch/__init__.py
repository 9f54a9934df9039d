"""``disagg bench rate-match``: size a disaggregated cluster from one context and one generation
worker. Rate matching picks how many context workers feed each generation worker so that both
sides serve the same request rate, then scores every such cluster by output tokens/s per device
against the speed one user sees (tokens/s/user).

What is measured
----------------
Every request uses token-id prompts of exactly ``isl`` tokens (random ids, fresh for every run
so that prefix caching never helps) on ``/v1/completions``, streamed.

1. **Context side** (``--context-url``, one context worker, or any worker: the requests are
   ordinary ones). Requests with ``max_tokens: 1`` arrive as a Poisson process (seeded, its
   gaps scaled so the probe's realized rate is exactly ``r``: ``arrival_offsets(exact_rate)``).
   A probe at rate ``r`` passes when no request failed and the TTFT at ``--ttft-percentile``
   (default p90) is at most ``--ttft-slo``. The search doubles (or halves) the rate from a start
   until it brackets the limit, then bisects geometrically until ``hi / lo <= 1 + tolerance``
   or the probe budget is spent. A probe also records the rate the worker *served*: completed
   requests over the span from the first to the last completion. A short probe above the
   worker's capacity can still pass the SLO (its queue grows, but not yet past the SLO); its
   served rate is then the capacity, below the offered rate. ``ctx_rate`` = the highest
   ``min(offered, served)`` of the passing probes (requests/s per context worker). A probe sends
   ``max(min_prompts, rate * probe_seconds)`` requests. These are ordinary requests, so the
   context worker's cost of serving KV to generation workers (the transfer's sends) is not in
   this number; the end-to-end check (5) includes it.
2. **Generation side** (``--generation-url``, one generation worker started with
   ``--benchmark-gen-only``). For each concurrency ``c``: ``c * rounds`` generation-only requests
   (``disaggregated_params: {request_type: generation_only}``, ``ignore_eos``, ``max_tokens =
   osl``), at most ``c`` in flight. The worker takes the prompt's KV as already in place and only
   decodes. ``gen_output_tps`` = output tokens/s over the run; ``tokens_per_s_per_user`` =
   1000 / mean TPOT (ms), i.e. one over the mean time per output token;
   ``gen_request_rate`` = ``gen_output_tps / osl``.

   2b. **Co-located** (``--colocated``): context and generation workers on one machine (CPU
   cores of one host, a laptop) share its caches and memory bandwidth, so a decode step is
   slower while the neighbouring context worker prefills (10-16% on this project's 2-core
   machine with it prefilling 2 requests/s: ``bench/results/disagg-vs-aggregated.md``).
   Step 2 runs each side alone and leaves that out. With ``--colocated`` every concurrency is
   measured a second time while the context worker serves ordinary ``max_tokens: 1``
   requests as Poisson arrivals at ``ctx_rate`` (its own rate under the SLO, from 1), the load
   a context worker carries in a rate-matched cluster. A cluster whose context workers serve
   less (``load`` req/s each) gets points linear between the two measurements,
   ``isolated + (load / ctx_rate) * (colocated - isolated)`` for TPOT and output tokens/s
   (``gen_points_beside``): a context worker is busy a share of its time proportional to its
   request rate, and interferes only while busy. Every prediction below then uses the points
   at the context load of the cluster it predicts (the rate-matched curve: ``ctx_rate``;
   ``predict_cluster`` and ``predict_at_rate``: the cluster's rate per context worker, by
   fixed point, since that rate depends on the generation speed). Assumes one context worker
   beside each generation worker, as measured.
3. **Rate matching**, per concurrency: ``ctx_per_gen = gen_request_rate / ctx_rate`` context
   workers per generation worker make both sides' request rates equal, and

       tput_per_device = gen_output_tps / (ctx_devices * gen_request_rate / ctx_rate + gen_devices)

   The Pareto frontier keeps the points no other point beats on both tokens/s/user and
   tokens/s per device.
4. ``--aggregated-url``: the same workload (full requests: ``isl`` in, ``osl`` out) against one
   aggregated worker at each concurrency: the baseline. Its frontier uses only the points whose
   TTFT percentile meets the SLO (the disaggregated points meet it by construction).
5. ``--verify``: for frontier points, the integer cluster (``n_ctx`` context + ``n_gen``
   generation workers, within ``--verify-max-devices``) with the best predicted throughput per
   device is started with ``disagg launch`` on this machine and measured end to end with full
   requests through its router; the result gives the gap to the prediction for that same
   cluster (``predict_cluster``). Each prediction is checked under the arrivals its binding
   side was measured with:

   - *generation bound* (``arrivals: closed``): a closed loop that keeps ``n_gen * c``
     requests on the generation workers plus, by Little's law, ``predicted rate * unloaded
     TTFT`` more for the ones at the context side (queue, prefill, KV transfer): with only
     ``n_gen * c`` in flight the generation workers would hold fewer than ``c`` each. That
     count is fractional and a loop holds whole requests; at small counts rounding alone
     moves the load by tens of percent (1.5 -> 2 is +33%), so unless the count lies within
     0.1 of a whole number, two loops run, at the whole counts below and above it, and the
     result is linear between them (``interpolate_runs``; both runs are in the JSON).
     ``rounds * count`` requests per loop, at least 6 rounds.
   - *context bound* (``arrivals: poisson``): the cluster's rate is the context workers' rate
     under the TTFT SLO, which is a rate of Poisson arrivals; a closed loop would instead push
     the context workers to whatever TTFT its in-flight count forces (past the SLO, serving
     more than the prediction's rate, or, rounded down, less). So: Poisson arrivals at the
     predicted rate (exact-rate gaps), ``2 * probe_seconds`` of them, and the measured TTFT
     percentile against the SLO (``meets_ttft_slo``); the predicted speed is
     ``open_loop_tpot`` at each generation worker's share of the rate.

   Throughput is the steady-state one (``metrics.steady_state_output_throughput``: from the
   first completion to the last send), not diluted by ramp-up and drain.

Modules
-------
- ``config``: ``RateMatchConfig`` (what a run needs) and the result's kind and version.
- ``model``: the arithmetic, pure functions of measured points: the rate-matched points and
  their Pareto frontier, predictions of one integer cluster (closed loop or Poisson arrivals,
  co-located interference), the best integer cluster within a device budget.
- ``sweep``: ``RateMatcher``, the measurements (context probes, generation and aggregated
  concurrency points, the end-to-end runs of verify) and the reductions of a run's records.
- ``verify``: which frontier points to check, ``LaunchedCluster`` (``disagg launch`` on free
  local ports) and the gaps between measurement and prediction.
- ``report``: the JSON result (its schema is that module's docstring), the end-of-run tables,
  saving.
- ``run``: ``run_rate_match``, the whole sequence.
"""

from disagg.bench.ratematch.config import RESULT_KIND, RESULT_VERSION, RateMatchConfig
from disagg.bench.ratematch.model import (
    best_integer_cluster,
    gen_points_beside,
    gen_speed_at_rate,
    gen_tpot_at_concurrency,
    open_loop_tpot,
    pareto_frontier,
    predict_at_rate,
    predict_cluster,
    rate_match,
    tput_per_device,
)
from disagg.bench.ratematch.report import (
    build_result,
    describe_arrivals,
    format_rate_match,
    save_result,
)
from disagg.bench.ratematch.run import run_rate_match
from disagg.bench.ratematch.sweep import (
    RateMatcher,
    closed_loop_counts,
    context_rate,
    interpolate_runs,
    served_rate,
)
from disagg.bench.ratematch.verify import (
    LaunchedCluster,
    finish_verify_point,
    gap,
    launch_verifier,
    verify_choices,
)

__all__ = [
    "RESULT_KIND", "RESULT_VERSION", "LaunchedCluster", "RateMatchConfig", "RateMatcher",
    "best_integer_cluster", "build_result", "closed_loop_counts", "context_rate",
    "describe_arrivals", "finish_verify_point", "format_rate_match", "gap",
    "gen_points_beside", "gen_speed_at_rate", "gen_tpot_at_concurrency", "interpolate_runs",
    "launch_verifier", "open_loop_tpot", "pareto_frontier", "predict_at_rate",
    "predict_cluster", "rate_match", "run_rate_match", "save_result", "served_rate",
    "tput_per_device", "verify_choices",
]
