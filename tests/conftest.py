"""Shared fixtures: tiny checkpoints written once per test session.

Writing a checkpoint trains its BPE tokenizer (about 1.5 s); the tests only read the folders,
so one folder per distinct set of arguments serves the whole session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import pytest

# Hosts as network namespaces (tests/netns.py): the `netlab` / `module_netlab` fixtures.
from netns import module_netlab, netlab  # noqa: F401

# Two cores: keep torch from oversubscribing when several test processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Parallel-worker tests: a hung collective fails in a minute, not in the default five.
os.environ.setdefault("DISAGG_DIST_TIMEOUT_S", "60")


def pytest_sessionstart(session: pytest.Session) -> None:
    """disagg's bytecode written once, before the tests start hundreds of worker and rank
    processes: where ``PYTHONDONTWRITEBYTECODE`` is set (this machine, CI) no process writes it,
    so each compiled every module it imported again (0.12 s of the 1.7 s of CPU a tiny
    worker's start took). Python checks each file's timestamp: a stale one is compiled as
    before."""
    import compileall

    import disagg

    compileall.compile_dir(os.path.dirname(disagg.__file__), quiet=2)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """A native crash (SIGSEGV) prints the crashing thread's Python stack alone, not every
    thread's (pytest's faulthandler plugin dumps all of them: a CI log that keeps the head
    and the tail of the output lost the one that mattered). Same file as the plugin's."""
    import faulthandler

    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key
    except ImportError:  # another pytest: leave the plugin's setting
        return
    fd = config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is not None:
        faulthandler.enable(file=fd, all_threads=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``tiny_checkpoint(name="tiny", **kwargs)``: a folder ``.../name`` holding
    ``write_tiny_checkpoint(folder, **kwargs)``, written on first use and shared by every later
    call with the same arguments (read only: a test that changes a checkpoint copies it
    first). The folder's name is the served model name when a test sets none."""
    from disagg.model.tiny import write_tiny_checkpoint

    written: dict[str, str] = {}

    def make(name: str = "tiny", **kwargs: object) -> str:
        key = json.dumps([name, kwargs], sort_keys=True)
        if key not in written:
            out = tmp_path_factory.mktemp("ckpt") / name
            written[key] = write_tiny_checkpoint(str(out), **kwargs)  # type: ignore[arg-type]
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_dirs(tiny_checkpoint: Callable[..., str]) -> dict[str, str]:
    """Tiny random checkpoints: llama (GQA, llama3 rope scaling), qwen2 (q/k/v bias, tied
    embeddings), mistral (MQA-ish GQA), qwen3 (q/k norms, head_dim != hidden / heads)."""
    specs = {
        "llama": dict(
            arch="llama", num_key_value_heads=2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "qwen2": dict(arch="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
        "mistral": dict(arch="mistral", num_key_value_heads=1),
        # per-head q/k norms, head_dim 32 != hidden / heads = 16
        "qwen3": dict(arch="qwen3", num_key_value_heads=2),
    }
    return {name: tiny_checkpoint(name, seed=1, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs: dict[str, str]) -> str:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    """The default tiny llama with seed 1: what the server, router and disaggregated tests
    serve (a module that needs other weights overrides this with its own seed)."""
    return tiny_checkpoint(seed=1)


@pytest.fixture(scope="module")
def loop() -> Iterator[object]:
    """A ``router_fixtures.LoopThread`` per module: serves in-process aiohttp apps."""
    from router_fixtures import LoopThread

    lt = LoopThread()
    yield lt
    lt.close()
