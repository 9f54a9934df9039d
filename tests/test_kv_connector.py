"""The engine's side of the KV connector contract (disagg/kv_connector/base.py), with a
recording connector: which hook is called when, and that blocks are always freed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from disagg.contracts.kv_mode import ContextOnly, KVMode, Pull
from disagg.contracts.roles import Role
from disagg.engine import LLMEngine
from disagg.kv_connector.base import FinishedTransfers, KVConnector
from disagg.kv_connector.errors import KVTransferError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import KVFetch, SchedulerOutput
from disagg.transfer.stats import TransferStatsSnapshot


class _Params:
    """Stands in for the ContextParams a real connector's lease returns."""

    def to_dict(self) -> dict[str, Any]:
        return {"ctx_request_id": "leased"}


class Recorder(KVConnector):
    role = Role.CONTEXT
    worker_id = "w"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.lease: Any = _Params()  # what request_finished answers for held blocks
        self.finished = FinishedTransfers()
        # Cancelled loads: reported in loads_stopped by get_finished once the test says so.
        self.stopping: list[str] = []

    def add_request(self, request_id: str, mode: KVMode, lease: bool) -> bool:
        self.calls.append(("add_request", request_id))
        return lease

    def add_prefix(self, request_id: str, params: Any) -> None:
        self.calls.append(("add_prefix", request_id))

    def lease_prefix(self, lease_id: str, token_ids: list[int], block_ids: list[int]) -> Any:
        self.calls.append(("lease_prefix", (lease_id, len(block_ids))))
        return self.lease

    def request_finished(self, request: Request, held_blocks: list[int] | None,
                         logprobs: list[dict[int, float]] | None) -> Any:
        self.calls.append(("request_finished", (request.request_id, request.status,
                                                held_blocks is not None)))
        if ("start_load", request.request_id) in self.calls:  # a load it may still write
            self.stopping.append(request.request_id)
        if held_blocks is None:
            return None
        if isinstance(self.lease, Exception):
            raise self.lease
        return self.lease

    def start_step(self, sched: SchedulerOutput) -> None:
        self.calls.append(("start_step", [r.request_id for r in sched.scheduled]))

    def start_load(self, fetch: KVFetch) -> None:
        self.calls.append(("start_load", fetch.request_id))

    def get_finished(self) -> FinishedTransfers:
        out, self.finished = self.finished, FinishedTransfers()
        return out

    def release_lease(self, lease_id: str) -> bool:
        return False

    def lease_is_live(self, lease_id: str) -> bool:
        return False

    def release_remote(self, params: Any) -> None:
        self.calls.append(("release_remote", params))

    def busy(self) -> bool:
        return False

    def set_role(self, role: Role) -> None:
        self.role = role

    def drain_pending(self) -> tuple[int, int]:
        return 0, 0

    def info(self) -> dict[str, object]:
        return {}

    def stats_snapshot(self) -> TransferStatsSnapshot:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


@pytest.fixture
def engine(tiny_dirs: dict[str, str]) -> tuple[LLMEngine, Recorder]:
    eng = LLMEngine.from_options(tiny_dirs["llama"], tokens_per_block=8, kv_cache_tokens=512)
    rec = Recorder()
    eng.connector = rec
    return eng, rec


def _run(eng: LLMEngine) -> list[Any]:
    outs = []
    for _ in range(50):
        outs += eng.service_transfers()
        if not eng.has_schedulable():
            break
        outs += eng.step()
    return outs


def _ends(rec: Recorder) -> list[Any]:
    return [c[1] for c in rec.calls if c[0] == "request_finished"]


def test_context_only_lease_holds_blocks_until_the_lease_ends(engine) -> None:
    eng, rec = engine
    eng.add_request("c", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True), mode=ContextOnly())
    [out] = _run(eng)
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.disaggregated_params == {"ctx_request_id": "leased"}
    assert len(out.outputs[0].token_ids) == 1  # context-only: one token
    assert ("start_step", ["c"]) in rec.calls
    assert _ends(rec) == [("c", RequestStatus.FINISHED_LENGTH, True)]  # once, with the blocks
    assert eng.stats().kv_blocks_used == 3  # held under the lease
    rec.finished = FinishedTransfers(leases_ended=["c"])
    assert eng.service_transfers() == []
    assert eng.stats().kv_blocks_used == 0


def test_not_leased_or_failed_lease_frees_the_blocks_at_once(engine) -> None:
    eng, rec = engine
    rec.lease = None
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", list(range(3, 20)), p, mode=ContextOnly())
    [out] = _run(eng)
    assert out.disaggregated_params is None and eng.stats().kv_blocks_used == 0
    rec.lease = RuntimeError("no table")
    eng.add_request("b", list(range(3, 20)), p, mode=ContextOnly())
    [out] = _run(eng)
    assert out.outputs[0].finish_reason == "error" and out.error.startswith("kv lease failed")
    assert out.kv_transfer_error is None  # not a pull failure: no 502
    assert eng.stats().kv_blocks_used == 0
    # A real max_tokens of 1 is final: the connector is not asked to hold anything.
    eng.add_request("c", list(range(3, 20)), replace_max(p, 1), mode=ContextOnly())
    [out] = _run(eng)
    assert _ends(rec)[-1] == ("c", RequestStatus.FINISHED_LENGTH, False)


def replace_max(p: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(p, max_tokens=n)


def _pull(first: int) -> Pull:
    """A generation-only request's mode; its params stand in for a ContextParams."""
    params: Any = SimpleNamespace(first_gen_tokens=[first], first_gen_logprobs=None)
    return Pull(params, trusted=False)


def test_failed_pull_ends_the_request_with_a_typed_error(engine) -> None:
    eng, rec = engine
    eng.add_request("g", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4),
                    mode=_pull(7))
    assert _run(eng) == []  # waiting for its KV: nothing to step
    assert ("start_load", "g") in rec.calls and eng.stats().kv_blocks_used == 3
    err = KVTransferError.because(" (expired_lease) pulling lease 'x': gone", "expired_lease")
    rec.finished = FinishedTransfers(failed=[("g", err)])
    [out] = eng.service_transfers()
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.kv_transfer_error == err and out.error == err.message
    assert out.error.startswith("kv transfer failed (expired_lease)")
    assert _ends(rec) == [("g", RequestStatus.FINISHED_ERROR, False)]
    assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished()


def test_loaded_pull_decodes_from_the_context_token(engine) -> None:
    eng, rec = engine
    eng.add_request("g", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4,
                                                            ignore_eos=True), mode=_pull(7))
    _run(eng)
    rec.finished = FinishedTransfers(loaded=["g"])
    outs = _run(eng)
    assert outs[0].outputs[0].delta_token_ids == [7] and not outs[0].finished
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert outs[-1].kv_transfer_error is None
    assert _ends(rec) == [("g", RequestStatus.FINISHED_LENGTH, False)]
    assert eng.stats().kv_blocks_used == 0


def test_abort_while_pulling_tells_the_connector_once(engine) -> None:
    """The abort answers at once; the blocks stay out of the pool until the connector says
    the cancelled load stopped writing (loads_stopped), then they are free."""
    eng, rec = engine
    eng.add_request("g", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4),
                    mode=_pull(7))
    _run(eng)
    out = eng.abort_request("g")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert _ends(rec) == [("g", RequestStatus.FINISHED_ABORTED, False)]
    assert rec.stopping == ["g"] and eng.scheduler.draining == {"g": [0, 1, 2]}
    assert eng.service_transfers() == [] and eng.stats().kv_blocks_used == 3
    eng.add_request("h", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2))
    outs = _run(eng)  # another request runs meanwhile, on other blocks
    assert outs[-1].finished and eng.scheduler.draining == {"g": [0, 1, 2]}
    rec.finished = FinishedTransfers(loads_stopped=rec.stopping)
    eng.service_transfers()
    assert eng.stats().kv_blocks_used == 0 and not eng.scheduler.draining


def test_remote_request_needs_a_connector(engine) -> None:
    eng, _ = engine
    eng.connector = None
    with pytest.raises(ValueError, match="cannot pull KV"):
        eng.add_request("g", [3, 4, 5], SamplingParams(max_tokens=2), mode=_pull(7))
