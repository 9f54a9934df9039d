"""The worker's KV event log (``GET /kv_events``) and the benchmark gen-only mode."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_fixtures import serve_in_thread, wait_for

from disagg.config import build_engine_config
from disagg.engine import AsyncLLM
from disagg.kv_cache.block_pool import KVCacheEvent
from disagg.kv_cache.events import KVEventLog
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME, hash_token_blocks
from disagg.kv_connector.settings import DisaggSettings
from disagg.server.app import ServerSettings, build_app

B = 16
OPTIONS = dict(tokens_per_block=B, kv_cache_tokens=1024, max_num_tokens=256, max_model_len=512,
               max_batch_size=16)

# ---- the log, exactly ---------------------------------------------------------------------


def test_log_keeps_the_tier_a_stored_event_went_to() -> None:
    """A block that left the KV cache for an offload tier is ``stored`` with its medium;
    the medium goes when its event leaves the retained window."""
    log = KVEventLog(max_events=2)
    log.append([KVCacheEvent("stored", [1, 2]), KVCacheEvent("stored", [2], medium="host")])
    b = log.since(0)
    assert b.events == [(0, "stored", [1, 2]), (1, "stored", [2])] and b.media == {1: "host"}
    assert log.since(2).media == {}
    log.append([KVCacheEvent("removed", [1]), KVCacheEvent("stored", [3], medium="disk")])
    assert log.since(2).media == {3: "disk"}  # (seq 1's went with its event)
    assert log._media == {3: "disk"}


def test_log_returns_events_in_order_from_since() -> None:
    log = KVEventLog(max_events=8)
    log.append([KVCacheEvent("stored", [1, 2]), KVCacheEvent("removed", [1]),
                KVCacheEvent("stored", [])])  # empty events are not recorded
    b = log.since(0)
    assert (b.next_seq, b.snapshot) == (2, None)
    assert b.events == [(0, "stored", [1, 2]), (1, "removed", [1])]
    assert log.since(1).events == [(1, "removed", [1])]
    assert log.since(2).events == [] and log.since(2).snapshot is None


def test_log_gives_a_snapshot_to_a_reader_that_fell_behind_or_is_ahead() -> None:
    log = KVEventLog(max_events=2)
    log.append([KVCacheEvent("stored", [5, 6, 7])])
    log.append([KVCacheEvent("removed", [6])])
    log.append([KVCacheEvent("stored", [8])])  # event 0 is dropped now
    behind = log.since(0)
    assert behind.events == [] and behind.snapshot == [5, 7, 8]
    assert behind.next_seq == 3
    assert log.since(1).events == [(1, "removed", [6]), (2, "stored", [8])]
    ahead = log.since(10)  # a reader of a previous incarnation of the worker
    assert ahead.snapshot == [5, 7, 8] and ahead.events == []


def test_log_rejects_an_empty_capacity() -> None:
    with pytest.raises(ValueError, match="max_events"):
        KVEventLog(max_events=0)


# ---- live: the endpoint mirrors the block pool ----------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint(seed=3)  # the weights these tests were written against


@pytest.fixture(scope="module")
def live(model_dir: str) -> Iterator[SimpleNamespace]:
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name="tiny"))
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine)


def _complete(url: str, prompt: list[int], max_tokens: int = 4, **extra: object) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_events_report_the_prompt_blocks_as_the_router_hashes_them(live) -> None:
    first = httpx.get(live.url + "/kv_events", timeout=10).json()
    assert first["tokens_per_block"] == B and first["block_hash_scheme"] == BLOCK_HASH_SCHEME
    info = httpx.get(live.url + "/server_info", timeout=10).json()
    assert first["worker_id"] == info["worker_id"] == live.engine.worker_id
    prompt = [(7 * i + 3) % 200 + 5 for i in range(3 * B + 5)]  # 3 full blocks
    _complete(live.url, prompt)
    expected = hash_token_blocks(prompt, B)
    seq = first["next_seq"]
    # The engine thread appends after the step; poll until the prompt's blocks show up.
    stored: set[int] = set()

    def seen() -> bool:
        nonlocal seq
        body = httpx.get(live.url + "/kv_events", params={"since": seq}, timeout=10).json()
        assert body["snapshot"] is None
        for ev in body["events"]:
            assert ev["seq"] >= seq
            if ev["type"] == "stored":
                stored.update(ev["block_hashes"])
        seq = body["next_seq"]
        return set(expected) <= stored

    wait_for(seen, timeout=30)
    # A reader from another incarnation (since beyond next_seq) resyncs from a snapshot.
    snap = httpx.get(live.url + "/kv_events", params={"since": seq + 100}, timeout=10).json()
    assert set(expected) <= set(snap["snapshot"])


# ---- benchmark gen-only -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen_only(model_dir: str) -> Iterator[SimpleNamespace]:
    config = build_engine_config(model_dir, **OPTIONS)
    disagg = DisaggSettings(role="generation", cluster_token="t", backend="TCP")
    engine = AsyncLLM(config, disagg=disagg)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name="tiny",
                                           role="generation", benchmark_gen_only=True))
    plain = AsyncLLM(config, disagg=disagg)
    app_plain = build_app(plain, ServerSettings(model_dir=model_dir, served_model_name="tiny",
                                                role="generation"))
    with serve_in_thread(app) as url, serve_in_thread(app_plain) as url_plain:
        yield SimpleNamespace(url=url, engine=engine, url_plain=url_plain)


def test_gen_only_decodes_max_tokens_without_a_context_worker(gen_only) -> None:
    prompt = list(range(10, 10 + 2 * B + 3))
    body = _complete(gen_only.url, prompt, max_tokens=7,
                     disaggregated_params={"request_type": "generation_only"})
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 7
    # Chat, and ids given in the params, work too.
    r = httpx.post(gen_only.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "ignore_eos": True, "disaggregated_params": {"request_type": "generation_only",
                                                     "prompt_token_ids": prompt}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": len(prompt),
                                 "completion_tokens": 3}
    # Its blocks never enter the prefix cache (their contents are not the prompt's KV).
    wait_for(lambda: gen_only.engine.stats().kv_blocks_used == 0, timeout=30)
    assert gen_only.engine.stats().kv_blocks_cached == 0


def test_gen_only_requests_are_refused_without_the_flag(gen_only) -> None:
    r = httpx.post(gen_only.url_plain + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2,
        "disaggregated_params": {"request_type": "generation_only"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "disaggregated_params"


def test_gen_only_bad_token_ids_are_a_400(gen_only) -> None:
    r = httpx.post(gen_only.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "x", "max_tokens": 2,
        "disaggregated_params": {"request_type": "generation_only", "prompt_token_ids": "no"}})
    assert r.status_code == 400, r.text
    assert "prompt_token_ids" in r.json()["error"]["message"]
