"""KV offload tiers in the engine (issue 41): prefix blocks evicted from a small KV cache come
back from the host tier, the disk tier, or a disk tier alone, and greedy outputs stay exactly
those of an engine without tiers; a corrupted tier block is never served; tiers keep their
sizes; the disk tier is emptied at start; a failing disk turns the disk tier off, no request
fails."""

from __future__ import annotations

import errno
import os
import random

import pytest

from disagg import LLM, SamplingParams
from disagg.config import ConfigError

B = 4  # tokens per block
KV_TOKENS = 96  # 24 blocks: one conversation's turn fits, the history of all of them does not
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _conversations(n: int = 6, seed: int = 0) -> list[list[int]]:
    """``n`` prompts sharing a 16-token system prefix, each with 36 tokens of its own."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(16)]
    return [system + [rng.randrange(3, 250) for _ in range(36)] for _ in range(n)]


def _gib(llm_blocks: int, block_bytes: int) -> float:
    return llm_blocks * block_bytes / (1 << 30)


@pytest.fixture(scope="module")
def reference(tiny_llama: str) -> tuple[list[list[int]], int]:
    """Greedy outputs without tiers (a KV cache big enough for everything), and the bytes
    of one KV block."""
    llm = LLM(tiny_llama, kv_cache_tokens=4096, tokens_per_block=B)
    outs = llm.generate(_conversations(), PARAMS)
    kv = llm.engine.runner.kv_cache
    block_bytes = kv[0].numel() * kv.element_size()
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], block_bytes


def _two_rounds(llm: LLM) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Every conversation once (one at a time: each evicts the ones before it), then again;
    returns both rounds' tokens and the second round's cached tokens."""
    prompts = _conversations()
    first = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    again = [llm.generate([p], PARAMS)[0] for p in prompts]
    return first, [o.outputs[0].token_ids for o in again], [o.num_cached_tokens for o in again]


def test_host_tier_serves_evicted_prefixes_exactly(tiny_llama, reference) -> None:
    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(200, block_bytes))
    first, second, cached = _two_rounds(llm)
    assert first == expected and second == expected
    s = llm.engine.stats().kv_offload
    # 52-token prompts: 12 full blocks (one token left to compute) found again each time
    assert cached == [48] * 6
    assert s.loaded_host > 0 and s.loaded_disk == 0 and s.failed_loads == 0
    assert s.stored_host > 0 and s.host_blocks <= s.host_capacity == 200
    pool = llm.engine.kv.stats()
    assert pool.free + pool.used + pool.cached == pool.total and pool.used == 0
    llm.engine.shutdown()


def test_without_tiers_the_same_workload_recomputes(tiny_llama, reference) -> None:
    expected, _ = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B)
    _, second, cached = _two_rounds(llm)
    assert second == expected
    assert sum(cached) < 48 * 6  # (what the tiers bring back is not in the pool)
    assert llm.engine.stats().kv_offload is None
    llm.engine.shutdown()


def test_host_then_disk_tier_and_disk_alone(tiny_llama, reference, tmp_path) -> None:
    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(12, block_bytes),
              kv_offload_disk_dir=str(tmp_path / "tier"),
              kv_offload_disk_gib=_gib(400, block_bytes))
    _, second, cached = _two_rounds(llm)
    assert second == expected and cached == [48] * 6
    s = llm.engine.stats().kv_offload
    assert s.loaded_host > 0 and s.loaded_disk > 0 and s.failed_loads == 0
    assert s.host_blocks <= 12 and s.disk_enabled
    llm.engine.shutdown()

    disk_only = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
                    kv_offload_disk_dir=str(tmp_path / "tier"),
                    kv_offload_disk_gib=_gib(400, block_bytes))
    # the folder was emptied when this worker started: nothing of the last one is served
    assert disk_only.engine.offload.disk.folder == str(tmp_path / "tier" / "worker-0")
    assert [f for f in os.listdir(tmp_path / "tier" / "worker-0") if f.endswith(".kv")] == []
    _, second, cached = _two_rounds(disk_only)
    s = disk_only.engine.stats().kv_offload
    assert second == expected and cached == [48] * 6
    assert s.loaded_disk > 0 and s.loaded_host == 0 and s.host_capacity == 0
    disk_only.engine.shutdown()


def test_tiers_keep_their_sizes_with_more_prefixes_than_fit(tiny_llama, reference,
                                                             tmp_path) -> None:
    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(10, block_bytes),
              kv_offload_disk_dir=str(tmp_path / "tier"),
              kv_offload_disk_gib=_gib(20, block_bytes) + 0.9 * 2 ** -30 * 4096)
    offload = llm.engine.offload
    assert offload is not None and offload.index.disk_capacity == 20
    prompts = _conversations(16, seed=5)  # 16 x 12 distinct-ish blocks > 24 + 10 + 20
    for p in prompts:
        llm.generate([p], PARAMS)
        s = llm.engine.stats().kv_offload
        assert s.host_blocks <= 10 and s.disk_blocks <= 20
    assert offload.disk is not None and offload.disk.flush()
    files = [f for f in os.listdir(offload.disk.folder) if f.endswith(".kv")]
    assert len(files) == offload.index.stats().disk_blocks <= 20
    assert llm.generate(_conversations(), PARAMS)[0].outputs[0].token_ids == expected[0]
    llm.engine.shutdown()
    # a clean shutdown deletes the tier's files (a crash leaves them to the next start)
    assert [f for f in os.listdir(offload.disk.folder) if f.endswith(".kv")] == []


def test_corrupted_host_and_disk_blocks_are_never_served(tiny_llama, reference,
                                                         tmp_path) -> None:
    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(12, block_bytes),
              kv_offload_disk_dir=str(tmp_path / "tier"),
              kv_offload_disk_gib=_gib(400, block_bytes))
    prompts = _conversations()
    for p in prompts:
        llm.generate([p], PARAMS)
    offload = llm.engine.offload
    assert offload is not None and offload.host is not None and offload.disk is not None
    assert offload.disk.flush()
    # every host slot and every block file's payload overwritten (served, they would
    # change the tokens): the header and the stored checksum stay as they were
    offload.host.data.fill_(7.0)
    payload = block_bytes
    folder = tmp_path / "tier" / "worker-0"
    assert offload.disk.folder == str(folder)
    for name in os.listdir(folder):
        if name.endswith(".kv"):
            path = folder / name
            raw = bytearray(path.read_bytes())
            raw[-payload:] = bytes(range(256)) * (payload // 256) + bytes(payload % 256)
            path.write_bytes(bytes(raw))
    before = llm.engine.stats().kv_offload
    outs = [llm.generate([p], PARAMS)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.stats().kv_offload
    assert s.failed_loads > before.failed_loads == 0
    # what the tiers served after the failures were blocks stored again since (computed
    # afresh by the failed requests and evicted once more)
    llm.engine.shutdown()


def test_a_failing_disk_turns_the_disk_tier_off_and_no_request_fails(
        tiny_llama, reference, tmp_path, monkeypatch) -> None:
    from disagg.engine import kv_tiers

    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(48, block_bytes),
              kv_offload_disk_dir=str(tmp_path / "tier"),
              kv_offload_disk_gib=_gib(400, block_bytes))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_tiers, "_write_block_file", full)
    _, second, _ = _two_rounds(llm)
    assert second == expected
    s = llm.engine.stats().kv_offload
    assert not s.disk_enabled and s.disk_capacity == 0 and s.disk_blocks == 0
    assert s.loaded_host > 0  # the host tier went on
    llm.engine.shutdown()


def test_workers_sharing_a_disk_dir_take_a_folder_each(tiny_llama, tmp_path) -> None:
    """Two workers (a cluster YAML section's instances) given one kv_offload_disk_dir: each
    takes a worker-N folder no other live one holds; a restart takes a free one again."""
    opts = dict(kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
                kv_offload_disk_dir=str(tmp_path / "tier"), kv_offload_disk_gib=0.01)
    a, b = LLM(tiny_llama, **opts), LLM(tiny_llama, **opts)
    folders = {a.engine.offload.disk.folder, b.engine.offload.disk.folder}
    assert folders == {str(tmp_path / "tier" / "worker-0"), str(tmp_path / "tier" / "worker-1")}
    a.engine.shutdown()
    c = LLM(tiny_llama, **opts)
    assert c.engine.offload.disk.folder == str(tmp_path / "tier" / "worker-0")
    b.engine.shutdown()
    c.engine.shutdown()


def test_bad_tier_options_name_the_field(tiny_llama, tmp_path) -> None:
    with pytest.raises(ConfigError, match="kv_offload_host_gib: .* holds no KV block"):
        LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
            kv_offload_host_gib=1e-9)
    with pytest.raises(ConfigError, match="kv_offload_disk_gib: a disk tier needs both"):
        LLM(tiny_llama, kv_offload_disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="kv_offload_host_gib: .*draft model"):
        LLM(tiny_llama, kv_offload_host_gib=1, speculative_config={
            "method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2})


def test_disagg_serve_with_host_and_disk_tiers(tiny_llama, reference, tmp_path) -> None:
    """The flags through ``disagg serve``: a prompt evicted by others comes back from the
    tiers (its usage reports the cached tokens), the same text as the first time, and the
    tiers' series are in /metrics."""
    import httpx
    from server_fixtures import start_worker_proc, stop_all, wait_all_healthy

    _, block_bytes = reference
    w = start_worker_proc(tmp_path, tiny_llama, "tiers", [
        "--kv-cache-tokens", str(KV_TOKENS), "--tokens-per-block", str(B),
        "--kv-offload-host-gib", repr(_gib(16, block_bytes)),
        "--kv-offload-disk-dir", str(tmp_path / "tier"),
        "--kv-offload-disk-gib", repr(_gib(400, block_bytes))], env={})
    try:
        wait_all_healthy([w], 120)

        def complete(prompt: list[int]) -> dict:
            r = httpx.post(w.url + "/v1/completions", json={
                "model": tiny_llama, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        prompts = _conversations()
        first = [complete(p) for p in prompts]
        again = [complete(p) for p in prompts]
        assert [a["choices"][0]["text"] for a in again] == [
            f["choices"][0]["text"] for f in first]
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in again] == [48] * 6
        metrics = httpx.get(w.url + "/metrics", timeout=10).text
        loaded = {line.split("tier=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines()
                  if line.startswith("disagg_kv_offload_loaded_blocks_total{")}
        assert loaded["host"] > 0 and loaded["disk"] > 0
        assert "disagg_kv_offload_failed_blocks_total" in metrics
    finally:
        stop_all([w])


def test_integrity_off_takes_no_checksum_and_serves_what_the_tier_holds(
        tiny_llama, reference) -> None:
    """``kv_integrity: false``: tier blocks are neither summed nor checked (for those who
    measured the cost and want it gone): exact as long as the bytes are intact, and a
    corrupted block is served (what the check exists for)."""
    from disagg.engine.kv_tiers import UNCHECKED

    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B,
              kv_offload_host_gib=_gib(200, block_bytes), kv_integrity=False)
    _, second, cached = _two_rounds(llm)
    assert second == expected and cached == [48] * 6
    offload = llm.engine.offload
    assert offload is not None and offload.host is not None
    assert set(offload.host._checksums) <= {UNCHECKED, None}
    offload.host.data.fill_(7.0)
    corrupted = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in _conversations()]
    assert corrupted != expected and llm.engine.stats().kv_offload.failed_loads == 0
    llm.engine.shutdown()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)],
                         ids=["one-rank", "tp2"])
def test_concurrent_requests_with_aborts_while_loading_leave_nothing_held(
        tiny_llama, reference, tmp_path, tp: int) -> None:
    """Many concurrent requests over shared prefixes through AsyncLLM, some cancelled at
    random points (while their blocks come back from a tier too, on every rank of a TP=2
    worker): every finished answer is the reference's, and at the end no block is held, none
    drains, no load is in flight and the pool adds up."""
    import asyncio

    from disagg.engine import AsyncLLM

    expected, block_bytes = reference
    prompts = _conversations()
    rng = random.Random(7)

    async def main() -> None:
        engine = AsyncLLM.from_options(
            tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B, device="cpu",
            tensor_parallel_size=tp,
            kv_offload_host_gib=_gib(12, block_bytes),
            kv_offload_disk_dir=str(tmp_path / "tier"),
            kv_offload_disk_gib=_gib(200, block_bytes))
        engine.start()
        try:
            async def one(i: int, cancel_after: int | None) -> tuple[int, list[int] | None]:
                tokens: list[int] = []
                agen = engine.generate(f"r{i}", prompts[i % 6], PARAMS)
                n = 0
                async for out in agen:
                    tokens = out.outputs[0].token_ids
                    n += 1
                    if cancel_after is not None and n >= cancel_after:
                        await agen.aclose()
                        return i, None
                return i, tokens

            for _ in range(3):  # rounds: each round's prefixes were evicted by the last
                jobs = [one(i, rng.choice([None, None, 1, 2])) for i in range(18)]
                for i, tokens in await asyncio.gather(*jobs):
                    if tokens is not None:
                        assert tokens == expected[i % 6]
            # cancelled right away: some of these are still queued or loading from a tier
            tasks = [asyncio.ensure_future(one(i, None)) for i in range(12)]
            await asyncio.sleep(0)
            for t in tasks[::2]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

            def settled() -> bool:
                sch = engine.engine.scheduler
                s = engine.stats()
                return (s.kv_blocks_used == 0 and not sch.draining and sch.num_loading == 0
                        and not sch.requests and not engine.engine.offload.busy)

            for _ in range(500):
                if settled():
                    break
                await asyncio.sleep(0.01)
            assert settled()
            pool = engine.engine.kv.stats()
            assert pool.free + pool.used + pool.cached == pool.total
            s = engine.stats().kv_offload
            assert s.loaded_host + s.loaded_disk > 0 and s.failed_loads == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


# ---- multi-rank workers: every rank keeps its own slice's tier bytes --------------------------


def _rank_files(folder: object) -> set[str]:
    return {f for f in os.listdir(folder) if f.endswith(".kv")} if os.path.isdir(folder) else set()


def _corrupt_payloads(folder: object, payload: int) -> int:
    """Overwrite the payload of every block file in ``folder`` (header and checksum kept)."""
    n = 0
    for name in _rank_files(folder):
        path = os.path.join(folder, name)
        with open(path, "r+b") as f:
            f.seek(-payload, os.SEEK_END)
            f.write(bytes(range(256)) * (payload // 256) + bytes(payload % 256))
        n += 1
    return n


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_multi_rank_worker_tiers_are_exact_and_a_rank_corrupted_block_is_recomputed(
        tiny_llama, reference, tmp_path, tp: int, pp: int) -> None:
    """A TP=2 / PP=2 worker (real rank processes, gloo): evicted prefixes come back from the
    host and the disk tier of every rank, greedy outputs exactly those without tiers; rank
    1 keeps its files in worker-0/rank-1. Then only rank 1's disk blocks are corrupted: they
    are detected there and recomputed, never served; then only rank 0's host slots. Last,
    rank 1's disk fails: the disk tier is off for the whole worker, no request fails."""
    from server_fixtures import wait_for

    expected, block_bytes = reference
    llm = LLM(tiny_llama, kv_cache_tokens=KV_TOKENS, tokens_per_block=B, device="cpu",
              tensor_parallel_size=tp, pipeline_parallel_size=pp,
              kv_offload_host_gib=_gib(12, block_bytes),
              kv_offload_disk_dir=str(tmp_path / "tier"),
              kv_offload_disk_gib=_gib(400, block_bytes))
    try:
        offload = llm.engine.offload
        assert offload is not None and offload.world_size == 2
        assert offload.host is not None and offload.disk is not None
        # a tier block is its slices on both ranks: 12 blocks' worth holds 12 host slots
        assert sum(llm.engine.runner.kv_block_bytes) == block_bytes
        assert offload.index.host_capacity == 12
        first, second, cached = _two_rounds(llm)
        assert first == expected and second == expected and cached == [48] * 6
        s = llm.engine.stats().kv_offload
        assert s.loaded_host > 0 and s.loaded_disk > 0 and s.failed_loads == 0
        assert s.host_blocks <= 12 and s.disk_enabled

        # every block on disk has its rank-1 slice in rank 1's own folder
        rank0, rank1 = tmp_path / "tier" / "worker-0", tmp_path / "tier" / "worker-0" / "rank-1"
        assert offload.disk.folder == str(rank0) and offload.disk.flush()
        on_disk = {f"{h:016x}.kv" for h in offload.index.disk_order()}
        assert on_disk and _rank_files(rank0) == on_disk
        wait_for(lambda: _rank_files(rank1) == on_disk, 30, what="rank 1's disk writes")

        # rank 1's disk slices corrupted (rank 0's intact): caught on rank 1, recomputed
        payload = block_bytes // 2  # (each rank holds half a block here)
        assert _corrupt_payloads(rank1, payload) == len(on_disk)
        outs = [llm.generate([p], PARAMS)[0] for p in _conversations()]
        assert [o.outputs[0].token_ids for o in outs] == expected
        after_disk = llm.engine.stats().kv_offload
        assert after_disk.failed_loads > 0
        # the failed entries were forgotten on every rank (their files deleted)
        assert offload.disk.flush()
        now_on_disk = {f"{h:016x}.kv" for h in offload.index.disk_order()}
        assert now_on_disk != on_disk and _rank_files(rank0) == now_on_disk
        wait_for(lambda: _rank_files(rank1) == now_on_disk, 30, what="rank 1's deletions")

        # rank 0's host slices corrupted (rank 1's intact): caught on rank 0, recomputed
        offload.host.data.fill_(7.0)
        outs = [llm.generate([p], PARAMS)[0] for p in _conversations()]
        assert [o.outputs[0].token_ids for o in outs] == expected
        s = llm.engine.stats().kv_offload
        assert s.failed_loads > after_disk.failed_loads

        # rank 1's disk fails (its folder gone): the worker's disk tier is off, no request
        # fails, the host tier goes on
        os.rename(rank1, tmp_path / "tier" / "gone")
        for p in _conversations(seed=9):  # new blocks: demotions write to disk
            llm.generate([p], PARAMS)
        _, second, _ = _two_rounds(llm)
        assert second == expected
        s = llm.engine.stats().kv_offload
        assert not s.disk_enabled and s.disk_capacity == 0 and s.disk_blocks == 0
        pool = llm.engine.kv.stats()
        assert pool.free + pool.used + pool.cached == pool.total and pool.used == 0
        assert not offload.busy
    finally:
        llm.shutdown()
    # a clean stop deletes every rank's files
    assert _rank_files(tmp_path / "tier" / "worker-0") == set()
