"""Tensor / pipeline parallel workers through the offline API: real rank processes (spawn,
gloo, CPU, float32) give exactly the tokens of tp=1, pp=1; a failing or killed rank is
reported and nothing is left running."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from parallel_fixtures import GREEDY, OPTS, PREFIXED, PROMPTS, SEEDED, pid_alive, write_models
from safetensors.torch import load_file, save_file
from server_fixtures import wait_for

from disagg import LLM
from disagg.parallel.executor import DistributedExecutor, WorkerDiedError, WorkerStartupError

pytestmark = pytest.mark.slow

CASES = [  # (model, tp, pp, pp_partition)
    ("llama3", 2, 1, None),
    ("llama3", 1, 2, None),
    ("llama3", 2, 2, [1, 2]),
    ("mqa", 2, 1, None),
    ("mqa", 2, 2, None),
    ("qwen2", 1, 2, None),
    ("qwen3", 2, 1, None),
    ("qwen3", 1, 2, None),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_models(str(tmp_path_factory.mktemp("parallel")))


def run_all(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS + PROMPTS[:1], [GREEDY] * len(PROMPTS) + [SEEDED])
    outs += llm.generate(PREFIXED, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(models: dict[str, str]) -> dict[str, list[list[int]]]:
    """tp=1, pp=1 outputs of every model (in this process)."""
    ref = {}
    for name, path in models.items():
        with LLM(path, **OPTS) as llm:
            ref[name] = run_all(llm)
    return ref


def child_pids(llm: LLM) -> list[int]:
    return llm.engine.runner.rank_pids[1:]


@pytest.fixture
def cleanup() -> Iterator[list[LLM]]:
    """LLMs to shut down even when the test fails (one process group per process)."""
    llms: list[LLM] = []
    yield llms
    for llm in llms:
        llm.shutdown()


@pytest.mark.parametrize("name,tp,pp,partition", CASES,
                         ids=[f"{m}-tp{t}-pp{p}" for m, t, p, _ in CASES])
def test_outputs_match_single_rank(models, reference, cleanup, name: str, tp: int, pp: int,
                                   partition: list[int] | None) -> None:
    llm = LLM(models[name], tensor_parallel_size=tp, pipeline_parallel_size=pp,
              pp_partition=partition, **OPTS)
    cleanup.append(llm)
    ex = llm.engine.runner
    assert isinstance(ex, DistributedExecutor)
    lay = ex.layout
    assert (lay.tp_size, lay.pp_size, lay.rank) == (tp, pp, 0)
    # Rank 0's cache holds only its layers and kv heads; all ranks agreed on the blocks.
    assert tuple(ex.runner.kv_cache.shape[:4]) == (ex.num_blocks, lay.num_local_layers, 2,
                                                    lay.num_local_kv_heads)
    assert ex.num_blocks == OPTS["kv_cache_tokens"] // OPTS["tokens_per_block"]
    if partition:
        assert [x.layer_range for x in ex.layouts[::tp]] == [(0, 1), (1, 3)]

    assert run_all(llm) == reference[name]

    stats = ex.comm_stats()
    assert [s["rank"] for s in stats] == list(range(tp * pp))
    assert all(s["steps"] == stats[0]["steps"] > 0 for s in stats)
    if tp > 1:
        assert all(s["all_reduce_calls"] > 0 for s in stats)
    probe = ex.probe_comm(4, iters=3)
    assert [p["rank"] for p in probe] == list(range(tp * pp))
    assert all(("all_reduce_ms" in p) == (tp > 1) and ("send_recv_ms" in p) == (pp > 1)
               for p in probe)
    assert run_all(llm)[:1] == reference[name][:1]  # still in step after the probe
    pids = child_pids(llm)
    llm.shutdown()
    assert not any(pid_alive(p) for p in pids) and not spawned_children()


def test_killed_rank_fails_the_engine_and_leaves_nothing(models, cleanup) -> None:
    llm = LLM(models["llama3"], pipeline_parallel_size=2, tensor_parallel_size=2, **OPTS)
    cleanup.append(llm)
    pids = child_pids(llm)
    assert len(pids) == 3
    assert llm.generate("Hi", GREEDY)[0].outputs[0].token_ids
    os.kill(pids[-1], signal.SIGKILL)
    wait_for(lambda: llm.engine.fatal_error is not None, 10, what="rank death noticed")
    assert f"pid {pids[-1]}" in llm.engine.fatal_error
    with pytest.raises(WorkerDiedError):
        llm.generate("Hi", GREEDY)
    # The other ranks were stopped at once (they could never be used again).
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, what="ranks gone")
    llm.shutdown()
    assert not spawned_children()


def test_rank_startup_failure_is_reported(models, tmp_path: Path) -> None:
    """Stage 1 cannot load its shard: rank 0 raises with that rank's error; no rank stays."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(models["llama3"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]  # only stage 1 ([2, 3)) needs it
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WorkerStartupError, match="model.layers.2.mlp.up_proj.weight"):
        LLM(str(bad), pipeline_parallel_size=2, **OPTS)
    import torch.distributed as dist

    assert not dist.is_initialized()
    # No rank process of ours is left (multiprocessing's resource tracker may stay: it is
    # not a rank and exits with this process).
    wait_for(lambda: not spawned_children(), 10, what="no rank processes left")


def spawned_children() -> list[int]:
    """Live children of this process started by multiprocessing's spawn (i.e. ranks)."""
    me, kids = os.getpid(), []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"spawn_main" in cmd:
            kids.append(int(p))
    return kids


LIFECYCLE_SCRIPT = '''
import gc
import os
import sys

import torch.distributed as dist

from disagg import LLM, SamplingParams


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main(model):
    opts = dict(tensor_parallel_size=2, tokens_per_block=8, kv_cache_tokens=512,
                max_num_tokens=48, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model, **opts)
    first = llm.generate("The harbour was quiet", greedy)[0].outputs[0].token_ids
    ranks = llm.engine.runner.rank_pids[1:]
    # As in a notebook: drop the last reference; the ranks and the process group go with it.
    del llm
    gc.collect()
    assert not dist.is_initialized(), "process group left behind by del"
    assert not any(alive(p) for p in ranks), f"ranks {ranks} left running by del"
    llm = LLM(model, **opts)
    assert llm.generate("The harbour was quiet", greedy)[0].outputs[0].token_ids == first
    ranks = llm.engine.runner.rank_pids[1:]
    llm.shutdown()
    assert not dist.is_initialized(), "process group left behind by shutdown"
    assert not any(alive(p) for p in ranks), f"ranks {ranks} left running by shutdown"
    with LLM(model, **opts) as llm:
        assert llm.generate("The harbour was quiet", greedy)[0].outputs[0].token_ids == first
    assert not dist.is_initialized(), "process group left behind by with"
    print("LIFECYCLE OK", flush=True)


if __name__ == "__main__":  # spawn re-imports this module in the ranks
    main(sys.argv[1])
'''


def test_parallel_llm_can_be_dropped_and_created_again(models, tmp_path: Path) -> None:
    """Notebook use: ``del llm`` (or ``shutdown()`` / ``with``) frees the ranks and the process
    group, so a second tensor-parallel LLM starts in the same process with the same tokens."""
    import subprocess
    import sys

    script = tmp_path / "lifecycle.py"
    script.write_text(LIFECYCLE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), models["llama3"]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LIFECYCLE OK" in proc.stdout, proc.stderr[-4000:]
