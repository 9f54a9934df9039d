"""KV prefix reuse across workers, the engine's side (issue 41 item 2): a worker leases the
cached blocks of a prompt's leading full blocks to a peer (``LLMEngine.lease_prefix``), the
peer pulls them into its own blocks (``add_request(prefix=PrefixPull)``) and computes only the
rest; greedy outputs equal a run that computed everything; a failed pull (a flipped byte, a
dead lease) is not the request's failure: it computes the prefix; every lease and block is
given back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import ContextOnly, PrefixPull
from disagg.contracts.roles import Role
from disagg.engine import LLMEngine
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams

TOKEN = "peer-secret"
B = 8
WAIT_S = 20.0


def _engine(model: str, role: Role = Role.AGGREGATED, **options: Any) -> LLMEngine:
    cfg = build_engine_config(model, **{"tokens_per_block": B, "kv_cache_tokens": 512,
                                        **options})
    return LLMEngine(cfg, DisaggSettings(role, TOKEN, backend="TCP", kv_peer_reuse=True))


def _run(eng: LLMEngine, until: Any = None) -> list[Any]:
    """Step until nothing is left (or ``until()``), waiting for transfers in between."""
    outs: list[Any] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        outs += eng.service_transfers()
        if until is not None and until():
            return outs
        if eng.has_schedulable():
            outs += eng.step()
        elif eng.scheduler.has_unfinished() or eng.scheduler.num_fetching or until:
            threading.Event().wait(0.005)
        else:
            return outs
    raise AssertionError("the engine did not finish in time")


def _tokens(outs: list[Any], rid: str) -> list[int]:
    [final] = [o for o in outs if o.request_id == rid and o.finished]
    return list(final.outputs[0].token_ids)


def _leases_back(eng: LLMEngine) -> None:
    """Every lease ended and its blocks were freed (the lease table is empty and nothing is
    held), waiting for the peer's confirmation."""
    deadline = time.monotonic() + WAIT_S
    while eng.scheduler.held or (eng.connector is not None and eng.connector.busy()):
        assert time.monotonic() < deadline, (eng.scheduler.held, eng.connector)
        eng.service_transfers()
        threading.Event().wait(0.005)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 60))  # 57 tokens: 7 full blocks of 8 (56 tokens) + 1


@pytest.fixture()
def model(tiny_checkpoint: Any) -> str:
    return tiny_checkpoint(seed=3)


def test_a_peer_prefix_is_pulled_and_the_rest_computed(model: str) -> None:
    ref, owner, asker = _engine(model), _engine(model), _engine(model)
    try:
        turn2 = PROMPT + [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]  # 68 tokens
        ref.add_request("r", turn2, GREEDY)
        expected = _tokens(_run(ref), "r")

        owner.add_request("t1", PROMPT, GREEDY)  # the owner's cache now holds PROMPT's blocks
        _run(owner)
        params = owner.lease_prefix(turn2)
        assert params is not None
        # 7 full blocks of PROMPT are cached (the 8th would need token 64)
        assert params.num_tokens == 56 and params.prompt_token_ids == turn2[:56]
        assert params.first_gen_tokens == []
        assert owner.scheduler.held  # referenced until the lease ends

        asker.add_request("t2", turn2, GREEDY, prefix=PrefixPull(params, trusted=True))
        outs = _run(asker)
        assert _tokens(outs, "t2") == expected
        [final] = [o for o in outs if o.request_id == "t2" and o.finished]
        assert final.num_cached_tokens == 56  # pulled, not computed
        assert asker.scheduler.peer_prefix_tokens == 56
        assert asker.peer_prefix_pulls == 1 and asker.peer_prefix_failed == 0
        assert owner.peer_prefix_leases == 1
        _leases_back(owner)  # the asker gave the lease back: the owner's blocks are free
        # trusted: the pulled blocks serve the asker's own later hits
        asker.add_request("t3", turn2, GREEDY)
        outs = _run(asker)
        assert _tokens(outs, "t3") == expected
        [final] = [o for o in outs if o.request_id == "t3" and o.finished]
        assert final.num_cached_tokens >= 56
    finally:
        for e in (ref, owner, asker):
            e.shutdown()


def test_no_lease_without_a_cached_prefix(model: str) -> None:
    owner = _engine(model)
    try:
        assert owner.lease_prefix(PROMPT) is None
        assert not owner.scheduler.held
        owner.add_request("a", PROMPT[:20], GREEDY)
        _run(owner)
        # 2 full blocks cached, but a lease covers fewer tokens than the prompt only
        params = owner.lease_prefix(PROMPT[:17])
        assert params is not None and params.num_tokens == 16
        assert owner.lease_prefix(PROMPT[:16]) is not None  # (8: the last token is left)
        owner.release_lease(params.ctx_request_id)
    finally:
        owner.shutdown()


def test_an_own_hit_as_long_gives_the_lease_back(model: str) -> None:
    owner, asker = _engine(model), _engine(model)
    try:
        for e in (owner, asker):
            e.add_request("t1", PROMPT, GREEDY)
            _run(e)
        params = owner.lease_prefix(PROMPT + [90, 91])
        assert params is not None
        asker.add_request("t2", PROMPT + [90, 91], GREEDY, prefix=PrefixPull(params, True))
        assert asker.scheduler.num_fetching == 0
        _run(asker)
        assert asker.peer_prefix_pulls == 0
        _leases_back(owner)
    finally:
        owner.shutdown()
        asker.shutdown()


def test_a_failed_pull_computes_the_prefix(model: str) -> None:
    ref, owner, asker = _engine(model), _engine(model), _engine(model)
    try:
        turn2 = PROMPT + [81, 82, 83]
        ref.add_request("r", turn2, GREEDY)
        expected = _tokens(_run(ref), "r")
        owner.add_request("t1", PROMPT, GREEDY)
        _run(owner)
        params = owner.lease_prefix(turn2)
        assert params is not None
        owner.release_lease(params.ctx_request_id)  # gone before the asker reads it
        _leases_back(owner)
        asker.add_request("t2", turn2, GREEDY, prefix=PrefixPull(params, trusted=True))
        outs = _run(asker)
        assert _tokens(outs, "t2") == expected
        assert asker.peer_prefix_failed == 1 and asker.peer_prefix_pulls == 0
        [final] = [o for o in outs if o.request_id == "t2" and o.finished]
        assert final.num_cached_tokens == 0
        assert not asker.scheduler.fetching and not asker.scheduler.draining
    finally:
        for e in (ref, owner, asker):
            e.shutdown()


def test_a_corrupted_prefix_is_never_served(model: str, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """A byte flipped on the way: the checksum refuses the payload, the request computes the
    prefix and answers as a run without a peer."""
    from disagg.transfer import integrity, service

    real = integrity.payload_checksum
    flipped = []

    def flip_on_arrival(views: Any) -> str:  # (the receiver checks what landed)
        data = integrity._as_tensor(views[0])
        data[0] ^= 0x10
        flipped.append(1)
        return real(views)

    ref, owner, asker = _engine(model), _engine(model), _engine(model)
    try:
        turn2 = PROMPT + [84, 85, 86]
        ref.add_request("r", turn2, GREEDY)
        expected = _tokens(_run(ref), "r")
        owner.add_request("t1", PROMPT, GREEDY)
        _run(owner)
        monkeypatch.setattr(service, "payload_checksum", flip_on_arrival)
        params = owner.lease_prefix(turn2)
        assert params is not None
        asker.add_request("t2", turn2, GREEDY, prefix=PrefixPull(params, trusted=True))
        outs = _run(asker)
        assert _tokens(outs, "t2") == expected
        assert flipped and asker.peer_prefix_failed == 1
        _leases_back(owner)
    finally:
        for e in (ref, owner, asker):
            e.shutdown()


def test_a_context_request_pulls_a_prefix_then_leases_its_blocks(model: str) -> None:
    """Disaggregated: the context worker's prefix comes from a generation-side cache (here
    another worker's), then its own lease is made as usual."""
    owner, ctx = _engine(model, Role.GENERATION), _engine(model, Role.CONTEXT)
    try:
        owner.add_request("t1", PROMPT, GREEDY)
        _run(owner)
        turn2 = PROMPT + [87, 88, 89, 90]
        params = owner.lease_prefix(turn2)
        assert params is not None
        ctx.add_request("c2", turn2, GREEDY, mode=ContextOnly(),
                        prefix=PrefixPull(params, trusted=True))
        outs = _run(ctx)
        [final] = [o for o in outs if o.request_id == "c2" and o.finished]
        assert final.disaggregated_params is not None  # leased for a generation worker
        assert final.disaggregated_params["cached_tokens"] == 56
        assert ctx.peer_prefix_pulls == 1
        ctx.release_lease("c2")
        _leases_back(ctx)
        _leases_back(owner)
    finally:
        owner.shutdown()
        ctx.shutdown()


# ---- over HTTP: POST /kv_prefix on one worker, kv_prefix on another's request ---------------


def test_http_prefix_lease_and_pull(tiny_checkpoint: Any) -> None:
    import httpx
    from router_fixtures import ROUTER_TOKEN, metric, worker_app
    from server_fixtures import serve_in_thread, signed, signed_post

    model = tiny_checkpoint(seed=3)
    plain = worker_app(model, "aggregated")  # no kv_peer_reuse
    with serve_in_thread(worker_app(model, "aggregated", kv_peer_reuse=True)) as a, \
            serve_in_thread(worker_app(model, "aggregated", kv_peer_reuse=True)) as b, \
            serve_in_thread(plain) as c:
        for url, on in ((a, True), (c, False)):
            info = httpx.get(url + "/server_info",
                             **signed(ROUTER_TOKEN, "GET", "/server_info", to=url)).json()
            assert info["kv_peer_reuse"] is on
        prompt = list(range(3, 60))  # 57 tokens: 3 full blocks of 16 (48) + 9
        turn2 = prompt + list(range(70, 90))
        body = {"model": "tiny", "prompt": turn2, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        expected = httpx.post(c + "/v1/completions", json=body, timeout=60).json()
        r = httpx.post(a + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert r.status_code == 200
        # unsigned: refused
        assert httpx.post(a + "/kv_prefix", json={"prompt_token_ids": turn2}).status_code in (
            401, 403)
        assert signed_post(c, "/kv_prefix", {"prompt_token_ids": turn2},
                           ROUTER_TOKEN).status_code == 404
        bad = signed_post(a, "/kv_prefix", {"prompt_token_ids": "x"}, ROUTER_TOKEN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_token_ids"
        none = signed_post(a, "/kv_prefix", {"prompt_token_ids": [1, 2, 3]}, ROUTER_TOKEN)
        assert none.json() == {"num_tokens": 0, "kv_prefix": None}
        got = signed_post(a, "/kv_prefix", {"prompt_token_ids": turn2}, ROUTER_TOKEN).json()
        assert got["num_tokens"] == 48 and got["kv_prefix"]["first_gen_tokens"] == []
        # a prefix that is not this prompt's: 400 naming kv_prefix, the lease given back
        wrong = {**body, "prompt": [5] + turn2[1:], "kv_prefix": got["kv_prefix"]}
        r = httpx.post(b + "/v1/completions", timeout=60,
                       **signed(ROUTER_TOKEN, "POST", "/v1/completions", wrong, to=b))
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_prefix"
        _until(lambda: metric(a, "disagg_kv_blocks_used") == 0)
        got = signed_post(a, "/kv_prefix", {"prompt_token_ids": turn2}, ROUTER_TOKEN).json()
        # unsigned, its peer not allowlisted: refused before anything connects
        unsigned = httpx.post(b + "/v1/completions", json={**body, "kv_prefix": got["kv_prefix"]},
                              timeout=60)
        assert unsigned.status_code == 400
        assert unsigned.json()["error"]["param"] == "kv_prefix.addresses"
        # (nothing connects where an unsigned request points, not even to release: the
        # router releases a lease it could not hand over)
        lease = got["kv_prefix"]["ctx_request_id"]
        rel = signed_post(a, "/kv_leases/release", {"ctx_request_id": lease}, ROUTER_TOKEN)
        assert rel.json() == {"ctx_request_id": lease, "released": True}
        _until(lambda: metric(a, "disagg_kv_blocks_used") == 0)
        got = signed_post(a, "/kv_prefix", {"prompt_token_ids": turn2}, ROUTER_TOKEN).json()
        req = {**body, "kv_prefix": got["kv_prefix"]}
        r = httpx.post(b + "/v1/completions", timeout=60,
                       **signed(ROUTER_TOKEN, "POST", "/v1/completions", req, to=b))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == expected["choices"][0]["text"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert metric(b, "disagg_kv_peer_prefix_pulls_total") == 1
        assert metric(b, "disagg_kv_peer_prefix_tokens_total") == 48
        assert metric(a, "disagg_kv_peer_prefix_leases_total") == 3
        _until(lambda: metric(a, "disagg_kv_blocks_used") == 0)  # every lease ended


def _until(cond: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        threading.Event().wait(0.02)


def test_a_tp2_peer_leases_to_a_one_rank_worker(model: str) -> None:
    """The lease exists on both of the owner's ranks before its params leave (each rank
    serves its kv heads); the one-rank asker reads both and converts the layout."""
    ref, owner, asker = _engine(model), _engine(model, tensor_parallel_size=2), _engine(model)
    try:
        turn2 = PROMPT + [91, 92, 93, 94]
        ref.add_request("r", turn2, GREEDY)
        expected = _tokens(_run(ref), "r")
        owner.add_request("t1", PROMPT, GREEDY)
        _run(owner)
        params = owner.lease_prefix(turn2)
        assert params is not None and len(params.addresses) == 2
        asker.add_request("t2", turn2, GREEDY, prefix=PrefixPull(params, trusted=True))
        outs = _run(asker)
        assert _tokens(outs, "t2") == expected
        assert asker.peer_prefix_pulls == 1 and asker.peer_prefix_failed == 0
        _leases_back(owner)  # ended on both ranks: the blocks are free
    finally:
        for e in (ref, owner, asker):
            e.shutdown()


def test_a_prefix_in_the_peers_host_tier_is_loaded_then_leased(model: str) -> None:
    """The owner's pool evicted the history into its host tier: the lease copies it back
    into the pool (the tiers' loader) and then leases it; the asker's output is exact."""
    ref, asker = _engine(model), _engine(model)
    owner = _engine(model, kv_offload_host_gib=0.01, kv_cache_tokens=128)  # 16 blocks
    try:
        turn2 = PROMPT + [95, 96, 97]
        ref.add_request("r", turn2, GREEDY)
        expected = _tokens(_run(ref), "r")
        owner.add_request("t1", PROMPT, GREEDY)
        _run(owner)
        for i in range(3):  # other prompts push PROMPT's blocks out of the 16-block pool
            owner.add_request(f"o{i}", [200 + i] * 60, GREEDY)
            _run(owner)
        probe_hits = owner.scheduler.lease_prefix("probe", turn2, from_tiers=False)
        owner.scheduler.release_held("probe")
        assert isinstance(probe_hits, list) and len(probe_hits) < 7  # not all in the pool
        got: list[Any] = []
        owner.start_prefix_lease(turn2, lambda p, e: got.append((p, e)))
        _run(owner, until=lambda: bool(got))
        [(params, error)] = got
        assert error is None and params is not None and params.num_tokens == 56
        assert owner.offload is not None and owner.offload.stats().loaded_host > 0
        asker.add_request("t2", turn2, GREEDY, prefix=PrefixPull(params, trusted=True))
        outs = _run(asker)
        assert _tokens(outs, "t2") == expected
        assert asker.peer_prefix_pulls == 1
        _leases_back(owner)
        assert not owner.scheduler.prefix_loads
    finally:
        for e in (ref, owner, asker):
            e.shutdown()
