"""MoE models served disaggregated (real worker processes). A tiny Mixtral: every context
layout in {tp1, tp2, pp2, tp2 + expert parallel} pulls into every generation layout of the
same set (different block sizes on the two sides); a tiny Qwen3-MoE (with a dense layer
among its sparse ones) likewise. Each answer (greedy completion, SSE-streamed chat,
json_schema, seeded json_object) equals the aggregated tp1 worker's; no KV block stays in
use. Expert parallelism changes only where the experts run: the KV cache layout is the
tensor-parallel one, so the pull plans are those of tp2."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_fixtures import device_for_ranks
from test_disagg_e2e import Worker, _start, _stop, _wait_healthy, disagg_text, ref_text
from test_disagg_parallel import _bodies

from disagg.layout import WorkerLayout

pytestmark = pytest.mark.slow

# name -> serve flags (tp, pp, expert parallel)
LAYOUTS = {
    "tp1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "pp2": ["--pipeline-parallel-size", "2"],
    "tp2ep": ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
}
GEN_BLOCK = {"tp1": "8", "tp2": "16", "pp2": "8", "tp2ep": "8"}
DEVICE = device_for_ranks(2)


# Qwen3-MoE: every pair too (its attention's q/k norms and head_dim, its dense layer).
QWEN3_MOE_LAYOUTS = list(LAYOUTS)


class MoeClusters:
    """One model's workers at a time (the 2-core machine runs one set): ``get`` stops the
    other model's workers before starting its own."""

    def __init__(self, tmp: Path, models: dict[str, Callable[[], str]]) -> None:
        self._tmp, self._models = tmp, models
        self._name: str | None = None
        self._workers: dict[str, Worker] = {}

    def get(self, name: str, layouts: list[str]) -> dict[str, Worker]:
        if name == self._name:
            return self._workers
        self.close()
        model, tmp = self._models[name](), self._tmp / name
        tmp.mkdir()
        ws = self._workers
        self._name = name
        dev = ["--device", DEVICE, "--kv-transfer-backend", "TCP"]
        for lay in layouts:
            ws[f"ctx-{lay}"] = _start(tmp, model, f"ctx-{lay}", "context", *LAYOUTS[lay], *dev,
                                      "--tokens-per-block", "16")
            ws[f"gen-{lay}"] = _start(tmp, model, f"gen-{lay}", "generation", *LAYOUTS[lay],
                                      *dev, "--tokens-per-block", GEN_BLOCK[lay])
        ws["agg"] = _start(tmp, model, "agg", "aggregated", "--tokens-per-block", "16",
                           "--device", DEVICE)
        _wait_healthy(list(ws.values()))
        return ws

    def close(self) -> None:
        workers, self._workers, self._name = list(self._workers.values()), {}, None
        _stop(workers)


@pytest.fixture(scope="module")
def clusters(tiny_checkpoint: Callable[..., str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoeClusters]:
    cs = MoeClusters(tmp_path_factory.mktemp("moe-logs"), {
        "mixtral": lambda: tiny_checkpoint("tiny", arch="mixtral", seed=1),
        "qwen3_moe": lambda: tiny_checkpoint("tiny", arch="qwen3_moe", seed=1,
                                             num_hidden_layers=3, mlp_only_layers=(1,))})
    try:
        yield cs
    finally:
        cs.close()


def _check_pair(ws: dict[str, Worker], ctx_layout: str, gen_layout: str) -> None:
    ctx, gen = ws[f"ctx-{ctx_layout}"], ws[f"gen-{gen_layout}"]
    layout = WorkerLayout.from_dict(gen.info()["kv_transfer"]["layout"])
    assert layout.tp_size == (2 if gen_layout.startswith("tp2") else 1)
    for path, body in _bodies():
        assert disagg_text(ctx, gen, path, body) == ref_text(ws["agg"].url, path, body), (
            path, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


@pytest.mark.parametrize("gen_layout", list(LAYOUTS), ids=lambda x: f"gen-{x}")
@pytest.mark.parametrize("ctx_layout", list(LAYOUTS), ids=lambda x: f"ctx-{x}")
def test_every_mixtral_layout_pair_matches_aggregated(clusters: MoeClusters, ctx_layout: str,
                                                      gen_layout: str) -> None:
    _check_pair(clusters.get("mixtral", list(LAYOUTS)), ctx_layout, gen_layout)


# Defined last: the Mixtral workers stop before these start.
@pytest.mark.parametrize("gen_layout", QWEN3_MOE_LAYOUTS, ids=lambda x: f"gen-{x}")
@pytest.mark.parametrize("ctx_layout", QWEN3_MOE_LAYOUTS, ids=lambda x: f"ctx-{x}")
def test_qwen3_moe_layout_pairs_match_aggregated(clusters: MoeClusters, ctx_layout: str,
                                                 gen_layout: str) -> None:
    _check_pair(clusters.get("qwen3_moe", QWEN3_MOE_LAYOUTS), ctx_layout, gen_layout)
