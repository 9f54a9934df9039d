"""Rank 0's per-request records (``kv_connector/records.py``) through every transition, on a
``DisaggConnector`` of a two-rank worker whose other rank is played by the test (the messages
it is sent, the events it answers) and whose puller is a stand-in (reads finish when the test
says so): which messages go out, what ``get_finished`` reports, what a role switch waits for."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import ContextOnly, ContextStream, Pull
from disagg.contracts.params import ContextParams
from disagg.contracts.roles import Role
from disagg.kv_connector.disagg_connector import DisaggConnector
from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.messages import (
    AnnounceLeases,
    CancelFetch,
    FetchDone,
    FetchStopped,
    LeaseEnded,
    ReleaseLeases,
    StartFetch,
    TransferMessage,
)
from disagg.kv_connector.pull import Loaded, Read
from disagg.kv_connector.pull import Pull as RankPull
from disagg.kv_connector.records import KVStatus
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import KVFetch, ScheduledRequest, SchedulerOutput
from disagg.transfer.stats import TransferStats

STATS = TransferStats().snapshot()


class Peers:
    """Rank 1, played by the test."""

    world_size = 2
    transfer_addresses = ["127.0.0.1:9"]

    def __init__(self) -> None:
        self.sent: list[TransferMessage] = []
        self.events: list[Any] = []

    def send_all(self, msg: TransferMessage) -> None:
        self.sent.append(msg)

    def take_events(self) -> list[Any]:
        out, self.events = self.events, []
        return out

    def on_event(self, callback: Callable[[], None]) -> None:
        pass


class Puller:
    """Rank 0's puller: a pull is one read whose future the test completes."""

    def __init__(self) -> None:
        self.futures: dict[str, cf.Future] = {}
        self.on_quiet: dict[str, Callable[[], None]] = {}
        self.released: list[str] = []

    def start(self, request_id: str, params: ContextParams, block_ids: list[int],
              on_read_done: Any = None) -> RankPull:
        fut = self.futures[request_id] = cf.Future()  # only the read's future matters here
        return RankPull(request_id, params, block_ids,
                        [Read(None, None, None, fut)], 0.0)  # type: ignore[arg-type]

    def finish(self, pull: RankPull, other_error: KVTransferError | None = None
               ) -> Loaded | KVTransferError:
        return other_error if other_error is not None else Loaded()

    def cancel(self, pull: RankPull | None, on_quiet: Callable[[], None]) -> None:
        rid = next((r for r, f in self.futures.items()
                    if pull is not None and pull.reads[0].future is f), None)
        self.on_quiet[rid or "nothing"] = on_quiet

    def release(self, params: Any) -> None:
        self.released.append(params.ctx_request_id)

    def close(self) -> None:
        pass


@pytest.fixture
def rig(model_dir: str) -> Iterator[tuple[DisaggConnector, Peers, Puller]]:
    cfg = build_engine_config(model_dir, tokens_per_block=4, kv_cache_tokens=256)
    kv = torch.zeros(64, 2, 2, 2, 4, 8)
    peers = Peers()
    conn = DisaggConnector(DisaggSettings(Role.CONTEXT, "records-secret", backend="TCP"), cfg, kv,
                           lambda: None, peers=peers)
    conn.puller.close()
    puller = Puller()
    conn.puller = puller  # type: ignore[assignment]
    try:
        yield conn, peers, puller
    finally:
        conn.shutdown()


def status(conn: DisaggConnector, rid: str) -> KVStatus | None:
    state = conn.request_state(rid)
    return state.status if state is not None else None


def ended(rid: str, status: RequestStatus) -> Request:
    req = Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    req.output_token_ids = [7]
    req.status = status
    return req


def plan_of(rid: str, blocks: list[int]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(rid, [1, 2, 3, 4, 5], 0, blocks, sample=True)],
                           0, 5, [], 1, 0)


def gen_params(conn: DisaggConnector, rid: str) -> ContextParams:
    return ContextParams(
        ctx_request_id=rid, first_gen_tokens=[7], prompt_token_ids=[1, 2, 3, 4, 5],
        worker_id="w", backend="TCP", addresses=["127.0.0.1:1"], block_ids=[0, 1],
        num_tokens=5, layout=conn.layout, lease_expiry=0.0)


def test_a_lease_lives_until_it_ended_on_every_rank(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, _ = rig
    assert conn.add_request("c", ContextOnly(), lease=True)
    assert status(conn, "c") is KVStatus.MAY_LEASE
    conn.start_step(plan_of("c", [4, 5]))
    assert peers.sent == [AnnounceLeases((("c", (4, 5)),))]
    assert status(conn, "c") is KVStatus.ANNOUNCED
    params = conn.request_finished(ended("c", RequestStatus.FINISHED_LENGTH), [4, 5], None)
    assert params is not None and params.block_ids == [4, 5]
    state = conn.request_state("c")
    assert state is not None and state.status is KVStatus.LEASED and state.ranks == {0, 1}
    assert conn.drain_pending() == (1, 0) and conn.busy()
    assert conn.release_lease("c")
    assert peers.sent[-1] == ReleaseLeases(("c",))
    assert not conn.get_finished().leases_ended  # rank 1's lease still lives
    state = conn.request_state("c")
    assert state is not None and state.ranks == {1}
    assert conn.drain_pending() == (1, 0)
    peers.events.append(LeaseEnded(1, "c", "released", STATS))
    assert conn.get_finished().leases_ended == ["c"]
    assert conn.request_state("c") is None
    assert conn.drain_pending() == (0, 0) and not conn.busy()


def test_no_lease_after_a_stop_and_the_other_ranks_drop_theirs(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, _ = rig
    for rid in ("a", "b"):
        assert conn.add_request(rid, ContextOnly(), lease=True)
    assert not conn.add_request("one", ContextOnly(), lease=False)  # max_tokens 1: final
    assert conn.request_state("one") is None
    conn.start_step(plan_of("a", [1]))  # only "a" completes its prefill in this step
    for rid in ("a", "b"):
        assert conn.request_finished(ended(rid, RequestStatus.FINISHED_STOPPED), [1], None) \
            is None
        assert conn.request_state(rid) is None
    assert peers.sent == [AnnounceLeases((("a", (1,)),)), ReleaseLeases(("a",))]


def test_a_stream_is_leased_from_the_start_and_dropped_on_an_abort(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, _, _ = rig
    assert conn.add_request("s", ContextStream(5, "h" * 16), lease=False)
    state = conn.request_state("s")
    assert state is not None and state.status is KVStatus.STREAMING and state.ranks == {0, 1}
    assert conn.lease_is_live("s")
    assert conn.request_finished(ended("s", RequestStatus.FINISHED_ABORTED), None, None) is None
    assert conn.request_state("s") is None and not conn.lease_is_live("s")


def test_a_pull_is_loaded_once_every_rank_reported(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, puller = rig
    p = gen_params(conn, "ctx-g")
    assert not conn.add_request("g", Pull(p, trusted=True), lease=False)
    assert status(conn, "g") is KVStatus.AWAITING_BLOCKS
    conn.start_load(KVFetch("g", [3, 4], 5))
    assert peers.sent == [StartFetch("g", p, (3, 4))]
    assert status(conn, "g") is KVStatus.PULLING and conn.drain_pending() == (0, 1)
    puller.futures["g"].set_result(None)
    assert not conn.get_finished()  # rank 1 still pulls
    peers.events.append(FetchDone(1, "g", None, STATS))
    done = conn.get_finished()
    assert done.loaded == ["g"] and not done.failed
    assert conn.request_state("g") is None and puller.released == ["ctx-g"]
    # it ends later: nothing to cancel, nothing to give back twice
    assert conn.request_finished(ended("g", RequestStatus.FINISHED_LENGTH), None, None) is None
    assert puller.released == ["ctx-g"] and not conn.get_finished()


def test_a_failed_pull_gives_its_lease_back_when_the_request_ends(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, puller = rig
    conn.add_request("h", Pull(gen_params(conn, "ctx-h"), trusted=False), lease=False)
    conn.start_load(KVFetch("h", [3, 4], 5))
    error = KVTransferError.because(" on rank 1: boom")
    peers.events.append(FetchDone(1, "h", error, STATS))
    puller.futures["h"].set_result(None)
    assert conn.get_finished().failed == [("h", error)]
    assert status(conn, "h") is KVStatus.FAILED and puller.released == []
    conn.request_finished(ended("h", RequestStatus.FINISHED_ERROR), None, None)
    assert puller.released == ["ctx-h"]
    state = conn.request_state("h")
    assert state is not None and state.status is KVStatus.STOPPING and state.ranks == {0}
    assert not any(isinstance(m, CancelFetch) for m in peers.sent)  # no rank still pulls
    puller.on_quiet["nothing"]()
    assert conn.get_finished().loads_stopped == ["h"]
    assert conn.request_state("h") is None


def test_an_abort_mid_pull_frees_the_blocks_once_every_rank_is_quiet(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, puller = rig
    conn.add_request("k", Pull(gen_params(conn, "ctx-k"), trusted=False), lease=False)
    conn.start_load(KVFetch("k", [3, 4], 5))
    conn.request_finished(ended("k", RequestStatus.FINISHED_ABORTED), None, None)
    assert peers.sent[-1] == CancelFetch("k") and puller.released == ["ctx-k"]
    state = conn.request_state("k")
    assert state is not None and state.status is KVStatus.STOPPING and state.ranks == {0, 1}
    assert conn.drain_pending() == (0, 1) and conn.busy()
    puller.on_quiet["k"]()  # rank 0's reads stopped writing
    assert not conn.get_finished().loads_stopped
    peers.events.append(FetchDone(1, "k", None, STATS))  # a late report changes nothing
    peers.events.append(FetchStopped(1, "k", STATS))
    assert conn.get_finished().loads_stopped == ["k"]
    assert conn.request_state("k") is None and conn.drain_pending() == (0, 0)


def test_a_request_that_ends_before_its_blocks_stops_at_once(
        rig: tuple[DisaggConnector, Peers, Puller]) -> None:
    conn, peers, puller = rig
    conn.add_request("w", Pull(gen_params(conn, "ctx-w"), trusted=False), lease=False)
    conn.request_finished(ended("w", RequestStatus.FINISHED_ABORTED), None, None)
    assert puller.released == ["ctx-w"] and peers.sent == []
    puller.on_quiet["nothing"]()
    assert conn.get_finished().loads_stopped == ["w"]
