"""The worker server live, in-process (uvicorn in a thread, ephemeral port), driven by the
official ``openai`` client and raw HTTP: outputs equal the offline ``LLM``, usage numbers,
streaming, concurrency, every bad-input status, disconnect aborts, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import StoppedEngine, protocol_gaps, serve_in_thread, wait_for

from disagg import LLM, SamplingParams
from disagg.config import build_engine_config
from disagg.engine import AsyncLLM, EngineClient
from disagg.server.app import ServerSettings, build_app

KEY = "sk-test-key"
NAME = "tiny"
# Small but not trivial: 16-token blocks, a KV cache that several long requests can share.
OPTIONS = dict(tokens_per_block=16, kv_cache_tokens=8192, max_num_tokens=256, max_model_len=1024,
               max_batch_size=64)
PROMPTS = ["The harbour was quiet", "Memory is organised in small blocks.", "Numbers: 1, 2, 3"]


@pytest.fixture(scope="module")
def live(model_dir: str) -> Iterator[SimpleNamespace]:
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           api_key=KEY))
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, tokenizer=engine.tokenizer,
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY,
                                                   max_retries=0, timeout=60))


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, **OPTIONS)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    # the live worker has an API key: /metrics needs it (README, Security model)
    text = httpx.get(url + "/metrics", timeout=10, headers=auth()).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": NAME, **labels}.items())))
    return metric_samples(url).get(key, 0.0)


def idle(engine: AsyncLLM) -> bool:
    s = engine.stats()
    return s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0


# ---- info endpoints -----------------------------------------------------------------------


def test_info_endpoints(live: SimpleNamespace) -> None:
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    assert httpx.get(live.url + "/version").json()["version"]
    models = live.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(live.url + "/server_info").status_code == 401  # the API key is set
    info = httpx.get(live.url + "/server_info", headers=auth()).json()
    assert info["role"] == "aggregated" and info["model"] == NAME
    assert info["tokens_per_block"] == 16 and info["block_hash_scheme"] == "sha256-chain-v1"
    assert info["max_batch_size"] == 64 and info["max_num_tokens"] == 256
    assert info["max_model_len"] == 1024 and info["kv_cache_blocks"] == 8192 // 16
    par = info["parallel"]
    assert (par["tensor_parallel_size"], par["pipeline_parallel_size"], par["world_size"]) == (
        1, 1, 1)
    assert len(par["layouts"]) == 1 and par["layouts"][0]["layer_range"] == [0, 2]
    assert par["layouts"][0]["kv_head_range"] == [0, 2] and len(par["rank_pids"]) == 1


# ---- outputs ------------------------------------------------------------------------------


def test_completions_match_offline_greedy(live: SimpleNamespace, offline: LLM) -> None:
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    resp = live.client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8,
                                          temperature=0, user="tester")
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, r in zip(resp.choices, ref, strict=True):
        assert choice.text == r.outputs[0].text
        assert choice.finish_reason == r.outputs[0].finish_reason
    prompt_tokens = sum(len(live.tokenizer.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(r.outputs[0].token_ids) for r in ref)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == completion_tokens
    assert resp.usage.total_tokens == prompt_tokens + completion_tokens


def test_token_id_prompt_and_length_finish(live: SimpleNamespace, offline: LLM) -> None:
    ids = live.tokenizer.encode(PROMPTS[0])
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=5,
                                                 ignore_eos=True))[0].outputs[0]
    resp = live.client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5 and resp.usage.prompt_tokens == len(ids)


def chat_ids(live: SimpleNamespace, messages: list[dict]) -> list[int]:
    text = live.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return live.tokenizer.encode(text, add_special_tokens=False)


def test_chat_matches_offline_greedy(live: SimpleNamespace, offline: LLM) -> None:
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Why does the river flow toward the sea?"}]
    ids = chat_ids(live, messages)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    resp = live.client.chat.completions.create(model=NAME, messages=messages,
                                               max_completion_tokens=10, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)


def test_streaming_completion_with_usage(live: SimpleNamespace) -> None:
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    full = live.client.completions.create(**kw)
    chunks = list(live.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and set(finishes[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_ends_with_done(live: SimpleNamespace) -> None:
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=auth(),
                      timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    json.loads(events[-2][6:])  # the events before [DONE] are JSON


def test_prefix_cache_hit_is_reported_as_cached_tokens(live: SimpleNamespace) -> None:
    prompt = " ".join(["the library was the oldest building in the city"] * 8)  # > 3 blocks
    kw = dict(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    live.client.completions.create(**kw)
    second = live.client.completions.create(**kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * 3 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_n_choices_with_seed_match_offline(live: SimpleNamespace, offline: LLM) -> None:
    ref = offline.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0.9, seed=7,
                                                        max_tokens=6))[0]
    resp = live.client.completions.create(model=NAME, prompt=PROMPTS[0], n=3, seed=7,
                                          temperature=0.9, max_tokens=6)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    by_index = {c.index: c.text for c in resp.choices}
    assert [by_index[i] for i in range(3)] == [o.text for o in ref.outputs]
    # Chat, streamed: every choice gets a role delta first and a finish_reason at the end.
    chunks = list(live.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
        stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason is not None


def test_stop_string(live: SimpleNamespace) -> None:
    kw = dict(model=NAME, prompt=PROMPTS[2], temperature=0, extra_body={"ignore_eos": True})
    text = live.client.completions.create(**kw, max_tokens=12).choices[0].text
    stop = text.strip()[2:5] if len(text.strip()) >= 5 else None
    if not stop:
        pytest.skip(f"greedy output too short to pick a stop string from: {text!r}")
    out = live.client.completions.create(**kw, max_tokens=12, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert text.startswith(out.text)


def test_logprobs(live: SimpleNamespace) -> None:
    resp = live.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5,
                                          temperature=0, logprobs=2,
                                          extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and chosen <= 0 and tok in top
        assert abs(max(top.values()) - chosen) < 1e-4  # greedy: the chosen token is the best
    chat = live.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    # Streamed logprobs cover the same tokens.
    chunks = list(live.client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_async_client_32_concurrent_streams(live: SimpleNamespace) -> None:
    async def main() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0,
                                    timeout=120)

        async def one(i: int) -> tuple[str, str | None]:
            text, finish = "", None
            if i % 2:
                stream = await client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=6, stream=True, temperature=0.7, seed=i)
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
            else:
                stream = await client.completions.create(
                    model=NAME, prompt=f"request number {i}", max_tokens=6, stream=True)
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
            return text, finish

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 120)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32 and all(f in ("stop", "length") for _, f in results)
    wait_for(lambda: idle(live.engine), 10, what="engine idle")


# ---- bad input ----------------------------------------------------------------------------


BAD = [
    # (path, body (dict, or raw bytes), headers, status, param)
    ("/v1/completions", {"model": NAME, "prompt": "x"}, {}, 401, None),
    ("/v1/completions", {"model": NAME, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401,
     None),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, {}, 401, None),
    ("/v1/models", None, {}, 401, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     None, 404, "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ', None, 400, None),
    ("/v1/chat/completions", b"\xff\xfe", None, 400, None),
    ("/v1/completions", {"model": NAME, "prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": []}, None, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2000}, None, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [1] * 1020, "max_tokens": 8}, None, 400,
     "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [600]}, None, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": -0.5}, None, 400,
     "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 2}, None, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, None, 400,
     "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 0}, None, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 50}, None, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_k": -5}, None, 400, "top_k"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stream": "yes please"}, None, 400,
     "stream"),
    ("/v1/completions", {"model": NAME, "prompt": "x",
                         "disaggregated_params": {"request_type": "context_only"}}, None, 400,
     "disaggregated_params"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "temperature": 200, "stream": True}, None, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2000, "stream": True},
     None, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,headers,status,param", BAD)
def test_bad_input_status_and_error_body(live: SimpleNamespace, path: str, body: object,
                                         headers: dict | None, status: int,
                                         param: str | None) -> None:
    h = auth() if headers is None else headers
    if body is None:
        r = httpx.get(live.url + path, headers=h, timeout=30)
    elif isinstance(body, bytes):
        r = httpx.post(live.url + path, content=body,
                       headers={**h, "Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(live.url + path, json=body, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    assert err["param"] == param


def test_openai_client_raises_typed_errors(live: SimpleNamespace) -> None:
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        live.client.completions.create(model=NAME, prompt="x", max_tokens=5000)
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_json_404(live: SimpleNamespace) -> None:
    r = httpx.get(live.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(live.url + "/v1/completions", headers=auth())
    assert r.status_code == 405 and r.json()["error"]


# ---- disconnects --------------------------------------------------------------------------


def test_disconnect_storm_frees_kv(live: SimpleNamespace) -> None:
    aborts0 = metric(live.url, "disagg_requests_finished_total", finish_reason="abort")

    async def storm() -> int:
        async with httpx.AsyncClient(base_url=live.url, headers=auth(), timeout=60) as client:
            async def one(i: int) -> bool:
                body = {"model": NAME, "prompt": f"storm {i}", "max_tokens": 900,
                        "stream": True, "ignore_eos": True}
                if i % 2:
                    body = {"model": NAME, "messages": [{"role": "user", "content": str(i)}],
                            "max_tokens": 900, "stream": True, "ignore_eos": True}
                path = "/v1/chat/completions" if i % 2 else "/v1/completions"
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and "[DONE]" not in line:
                            return True  # got a chunk: hang up mid-stream
                return False

            return sum(await asyncio.gather(*(one(i) for i in range(16))))

    assert asyncio.run(storm()) == 16
    wait_for(lambda: idle(live.engine), 20, what="KV blocks to be freed after disconnects")
    assert live.engine.stats().kv_blocks_used == 0
    wait_for(lambda: metric(live.url, "disagg_requests_finished_total",
                            finish_reason="abort") >= aborts0 + 16, 10, what="abort count")
    assert metric(live.url, "disagg_kv_blocks_used") == 0


def test_non_streaming_disconnect_aborts(live: SimpleNamespace) -> None:
    aborts0 = metric(live.url, "disagg_requests_finished_total", finish_reason="abort")

    async def go() -> None:
        async with httpx.AsyncClient(base_url=live.url, headers=auth(), timeout=60) as client:
            body = {"model": NAME, "prompt": "a long answer", "max_tokens": 1000,
                    "ignore_eos": True}
            task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            deadline = time.monotonic() + 20
            while live.engine.stats().num_running == 0:  # wait until it is generating
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.005)
            task.cancel()  # hang up
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    wait_for(lambda: idle(live.engine), 20, what="KV blocks to be freed after a disconnect")
    assert metric(live.url, "disagg_requests_finished_total", finish_reason="abort") >= (
        aborts0 + 1)


# ---- metrics ------------------------------------------------------------------------------


def test_metrics_move(live: SimpleNamespace) -> None:
    before = metric_samples(live.url)

    def get(samples: dict, name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted({"model_name": NAME, **labels}.items()))), 0.0)

    resp = live.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    after = metric_samples(live.url)
    assert get(after, "disagg_requests_finished_total", finish_reason="length") == get(
        before, "disagg_requests_finished_total", finish_reason="length") + 1
    assert get(after, "disagg_prompt_tokens_total") - get(
        before, "disagg_prompt_tokens_total") == resp.usage.prompt_tokens
    assert get(after, "disagg_generation_tokens_total") - get(
        before, "disagg_generation_tokens_total") == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert get(after, f"disagg_{h}_count") == get(before, f"disagg_{h}_count") + 1
    assert get(after, "disagg_inter_token_latency_seconds_count") == get(
        before, "disagg_inter_token_latency_seconds_count") + 3
    assert get(after, "disagg_engine_steps_total") > get(before, "disagg_engine_steps_total")
    assert get(after, "disagg_iteration_batch_size") >= 1  # the last step had our request
    assert get(after, "disagg_kv_blocks_total") == 8192 // 16
    assert get(after, "disagg_max_batch_size") == 64
    assert get(after, "disagg_num_requests_running") == 0
    assert get(after, "disagg_engine_healthy") == 1
    assert get(after, "disagg_requests_rejected_total", reason="unauthorized") >= 0


# ---- overload and health ------------------------------------------------------------------


def test_queue_full_is_503_with_retry_after(model_dir: str) -> None:
    # max_queue=0: no request may wait, and every new request waits first: all refused.
    engine = AsyncLLM.from_options(model_dir, **{**OPTIONS, "max_queue": 0})
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME))
    with serve_in_thread(app) as url:
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "x"}],
                                                     "stream": True, "n": 2})):
            r = httpx.post(url + path, json={"model": NAME, **body}, timeout=30)
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
        wait_for(lambda: idle(engine), 10, what="engine idle")
        assert metric_samples(url)[("disagg_requests_rejected_total",
                                    (("model_name", NAME), ("reason", "queue_full")))] == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model=NAME, prompt="x")
        assert ei.value.status_code == 503


def test_health_503_when_the_engine_is_not_running(model_dir: str) -> None:
    not_started = StoppedEngine(build_engine_config(model_dir, **OPTIONS))
    app = build_app(not_started, ServerSettings(model_dir=model_dir, owns_engine=False))
    with serve_in_thread(app) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "retry-after" in r.headers
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/server_info").json()["kv_cache_blocks"] is None


def test_the_stand_in_engine_is_an_engine_client() -> None:
    assert protocol_gaps(StoppedEngine(), EngineClient) == []


def test_metrics_show_why_batches_are_small(model_dir: str) -> None:
    # Seed 000: batch of 1 with requests queued, because the KV cache is tiny (4 blocks: one
    # request's lifetime each). The scrape must show it: waiting > 0, batch 1, KV nearly full,
    # while max_batch_size is far from reached.
    engine = AsyncLLM.from_options(model_dir, **{**OPTIONS, "kv_cache_tokens": 64})
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME))
    with serve_in_thread(app) as url:
        async def load() -> list[str]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            try:
                outs = await asyncio.gather(*(
                    client.completions.create(model=NAME, prompt=f"go {i}", max_tokens=40,
                                              extra_body={"ignore_eos": True})
                    for i in range(4)))
                return [o.choices[0].finish_reason for o in outs]
            finally:
                await client.close()

        seen: list[dict] = []

        def watch() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                s = metric_samples(url)
                lbl = (("model_name", NAME),)
                if s[("disagg_num_requests_waiting", lbl)] >= 1:
                    seen.append({k[0]: v for k, v in s.items() if k[1] == lbl})
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert asyncio.run(load()) == ["length"] * 4
        watcher.join(60)
        assert seen, "never saw a waiting request"
        m = seen[0]
        assert m["disagg_num_requests_running"] == 1
        assert m["disagg_kv_blocks_total"] == 4 and m["disagg_kv_blocks_used"] >= 1
        assert m["disagg_max_batch_size"] == 64
        assert m["disagg_iteration_batch_size"] <= 1
