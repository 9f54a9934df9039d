"""The rate-match arithmetic (``disagg.ratematch_model``, shared with the router's planner),
re-exported under the benchmark's name."""

from disagg.ratematch_model import (  # noqa: F401
    _beside_own_load,
    _gen_curve,
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
