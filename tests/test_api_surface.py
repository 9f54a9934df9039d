"""The small API surface agents and benchmark clients lean on, on a worker and through the
router of a disaggregated cluster (1 context + 1 generation worker, TCP transfer):

- ``GET /v1/models/{id}`` (``client.models.retrieve``): the listed model, a served name with
  ``/`` in it too; an unknown id is 404 ``model_not_found``; the API key is checked;
- ``null`` equals absent for every optional request field (``{"n": null}`` ...), required
  ones still 400 naming the field;
- ``stream_options.continuous_usage_stats``: every chunk carries its choice's running usage
  (vLLM's semantics), through the router too (the generation worker's stream, and the
  router's own chunks of a context worker's final answer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from router_fixtures import ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import (
    serve_in_thread,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.engine import AsyncLLM
from disagg.server.app import ServerSettings, build_app

NAME = "org/tiny"  # a served name with "/" in it, as "org/model" names are
KEY = "sk-surface"
C, CHAT = "/v1/completions", "/v1/chat/completions"
OPTIONS = dict(tokens_per_block=16, kv_cache_tokens=4096, max_model_len=512, max_num_tokens=256,
               max_batch_size=32)
FLAGS = ["--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
         "--max-batch-size", "32", "--tokens-per-block", "16", "--served-model-name", NAME,
         "--kv-transfer-backend", "TCP", "--log-level", "warning"]
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "The harbour was quiet"
# Optional fields sent as null: each must act as if absent.
NULLS_COMMON = {"n": None, "stream": None, "stream_options": None, "seed": None, "stop": None,
                "top_p": None, "top_k": None, "min_p": None, "presence_penalty": None,
                "frequency_penalty": None, "repetition_penalty": None, "logit_bias": None,
                "stop_token_ids": None, "min_tokens": None, "ignore_eos": None,
                "include_stop_str_in_output": None, "skip_special_tokens": None,
                "user": None, "response_format": None, "prompt_logprobs": None,
                "structured_outputs": None, "guided_json": None, "use_beam_search": None,
                "priority": None}
NULLS = {
    C: {**NULLS_COMMON, "logprobs": None, "echo": None, "suffix": None, "best_of": None,
        "add_special_tokens": None},
    CHAT: {**NULLS_COMMON, "logprobs": None, "top_logprobs": None, "tools": None,
           "tool_choice": None, "parallel_tool_calls": None, "max_completion_tokens": None,
           "add_generation_prompt": None, "continue_final_message": None,
           "chat_template_kwargs": None, "add_special_tokens": None},
}


def base(path: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": NAME, "max_tokens": 6, "temperature": 0, **extra}
    if path == C:
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    return body


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def chunks_of(url: str, path: str, body: dict[str, Any], key: str | None = None
              ) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed answer (its ``[DONE]`` checked)."""
    with httpx.stream("POST", url + path, json=body, timeout=60, headers=auth(key)) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def answer(r: httpx.Response) -> dict[str, Any]:
    """A JSON answer without what differs between two requests (id, time, the prompt's
    cached tokens: an earlier request cached them)."""
    assert r.status_code == 200, r.text
    out = {k: v for k, v in r.json().items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process, with an API key."""
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           api_key=KEY))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory, loop: LoopThread
            ) -> Iterator[SimpleNamespace]:
    """A context and a generation worker (subprocesses) and the router (API key KEY)."""
    tmp = tmp_path_factory.mktemp("surface-logs")
    env = {"DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    ws = [start_worker_proc(tmp, model_dir, "ctx", ["--role", "context", *FLAGS], env),
          start_worker_proc(tmp, model_dir, "gen", ["--role", "generation", *FLAGS], env)]
    try:
        wait_all_healthy(ws, 120.0)
        config = {"model": model_dir, "health_check_interval_sec": 0.2, "api_key": KEY,
                  "context_servers": {"urls": [ws[0].addr]},
                  "generation_servers": {"urls": [ws[1].addr]}}
        with running_router(config, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            yield SimpleNamespace(url=url, ctx=ws[0], gen=ws[1])
    finally:
        stop_all(ws)


# ---- GET /v1/models/{id} --------------------------------------------------------------------


def _check_models_retrieve(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [NAME]
    (card,) = httpx.get(url + "/v1/models", headers=auth(KEY), timeout=30).json()["data"]
    got = client.models.retrieve(NAME)  # the SDK sends /v1/models/org%2Ftiny
    assert got.id == NAME and got.to_dict() == card
    r = httpx.get(f"{url}/v1/models/{NAME}", headers=auth(KEY), timeout=30)  # "/" as it is
    assert r.status_code == 200 and r.json() == card
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other")
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"
    assert err["param"] == "model" and "org/other" in err["message"]
    r = httpx.get(f"{url}/v1/models/{NAME}", timeout=30)  # no key
    assert r.status_code == 401, r.text
    r = httpx.get(f"{url}/v1/models/{NAME}", headers=auth("wrong"), timeout=30)
    assert r.status_code == 401, r.text


def test_models_retrieve_on_a_worker(worker: str) -> None:
    _check_models_retrieve(worker)


def test_models_retrieve_through_the_router(cluster: SimpleNamespace) -> None:
    _check_models_retrieve(cluster.url)


# ---- null equals absent ---------------------------------------------------------------------


def _check_nulls(url: str, key: str | None) -> None:
    for path in (C, CHAT):
        want = answer(httpx.post(url + path, json=base(path), headers=auth(key), timeout=60))
        got = answer(httpx.post(url + path, json=base(path, **NULLS[path]), headers=auth(key),
                                timeout=60))
        assert got == want, path
        # one field at a time: none of them is a 400 on its own either
        for name, value in NULLS[path].items():
            r = httpx.post(url + path, json=base(path, **{name: value}), headers=auth(key),
                           timeout=60)
            assert answer(r) == want, (path, name)
        # a stream whose options are null: usage absent, as without them
        streamed = chunks_of(url, path, base(path, stream=True, stream_options=None), key)
        assert all("usage" not in c for c in streamed)
        # nested: stream_options' own fields too
        streamed = chunks_of(url, path, base(path, stream=True, stream_options={
            "include_usage": None, "continuous_usage_stats": None}), key)
        assert streamed[-1]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    # required fields stay required
    for path, field in ((C, "prompt"), (CHAT, "messages")):
        r = httpx.post(url + path, json={**base(path), field: None}, headers=auth(key),
                       timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_null_is_absent_on_a_worker(worker: str) -> None:
    _check_nulls(worker, KEY)
    # /tokenize and /detokenize too
    r = httpx.post(worker + "/tokenize", headers=auth(KEY), timeout=30, json={
        "model": NAME, "prompt": PROMPT, "add_special_tokens": None,
        "return_token_strs": None, "messages": None})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    r = httpx.post(worker + "/detokenize", headers=auth(KEY), timeout=30,
                   json={"model": None, "tokens": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_null_is_absent_through_the_router(cluster: SimpleNamespace) -> None:
    """Disaggregated: the router's own reads of the body and both workers take null as
    absent; nothing is left holding KV."""
    _check_nulls(cluster.url, KEY)
    # the generation worker's output length is what the client asked for (max_tokens, its
    # max_completion_tokens null)
    r = httpx.post(cluster.url + CHAT, headers=auth(KEY), timeout=60, json=base(
        CHAT, max_completion_tokens=None, max_tokens=5, ignore_eos=True))
    assert answer(r)["usage"]["completion_tokens"] == 5
    cluster.ctx.wait_blocks(0)
    cluster.gen.wait_blocks(0)


# ---- stream_options.continuous_usage_stats ------------------------------------------------


def counts(usage: dict[str, Any]) -> tuple[int, int, int]:
    """A usage's token counts (its cached_tokens differ: the first request cached the
    prompt)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def _running(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's usage in the order of its chunks (the usage-only last chunk left out)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).append(c["usage"])
    return out


def _check_running(usages: list[dict[str, Any]], prompt_tokens: int, final: int) -> None:
    done = [u["completion_tokens"] for u in usages]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    assert done == sorted(done) and done[-1] == final, done


def test_continuous_usage_on_a_worker(worker: str) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    # chat, two choices: each chunk counts its own choice's tokens (the role chunk 0)
    body = base(CHAT, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
    whole = answer(httpx.post(worker + CHAT, json=body, headers=auth(KEY), timeout=60))
    chunks = chunks_of(worker, CHAT, {**body, "stream": True, "stream_options": opts}, KEY)
    assert all(isinstance(c.get("usage"), dict) for c in chunks)
    prompt = whole["usage"]["prompt_tokens"]
    per_choice = _running(chunks)
    assert sorted(per_choice) == [0, 1]
    for usages in per_choice.values():
        assert usages[0]["completion_tokens"] == 0  # the role chunk
        _check_running(usages, prompt, 8)
    assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(
        whole["usage"])

    # completions, two prompts of different lengths: each chunk its own prompt's count; the
    # running count covers every token whose logprobs were sent so far
    body = {"model": NAME, "prompt": [PROMPT, PROMPT + " and the boats were still"],
            "max_tokens": 6, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    ids = [httpx.post(worker + "/tokenize", headers=auth(KEY), timeout=30, json={
        "model": NAME, "prompt": p}).json()["count"] for p in body["prompt"]]
    chunks = chunks_of(worker, C, {**body, "stream": True, "stream_options": opts}, KEY)
    sent: dict[int, int] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        sent[ch["index"]] = sent.get(ch["index"], 0) + len(ch["logprobs"]["tokens"])
        assert c["usage"]["completion_tokens"] >= sent[ch["index"]]
    for i, usages in _running(chunks).items():
        _check_running(usages, ids[i], 6)
        assert sent[i] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(ids)
    assert chunks[-1]["usage"]["completion_tokens"] == 12

    # scoring (echo, max_tokens 0): no token is the answer's, running or final
    chunks = chunks_of(worker, C, {"model": NAME, "prompt": PROMPT, "echo": True,
                                   "max_tokens": 0, "stream": True, "stream_options": opts},
                       KEY)
    assert all(c["usage"]["completion_tokens"] == 0 for c in chunks)


@pytest.mark.parametrize(("opts", "usage"), [
    ({"include_usage": False, "continuous_usage_stats": True}, "none"),
    ({"continuous_usage_stats": True}, "continuous"),  # include_usage: vLLM's default, true
    ({}, "last"),
    ({"include_usage": True}, "last"),
], ids=["include-false", "include-absent", "empty", "include-only"])
def test_stream_options_as_vllm_reads_them(worker: str, opts: dict[str, Any],
                                           usage: str) -> None:
    """Without include_usage (false) continuous_usage_stats changes nothing; include_usage
    defaults to true once stream_options is sent, as in vLLM."""
    for path in (C, CHAT):
        chunks = chunks_of(worker, path, base(path, stream=True, stream_options=opts), KEY)
        if usage == "none":
            assert all("usage" not in c for c in chunks)
        elif usage == "last":
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        else:
            assert all(isinstance(c["usage"], dict) for c in chunks)


def test_continuous_usage_through_the_router(cluster: SimpleNamespace) -> None:
    """The generation worker's stream as relayed: prompt_tokens is the context side's prompt
    in every chunk; and the router's own chunks of a final context answer (max_tokens 1)."""
    url = cluster.url
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for path in (C, CHAT):
        for max_tokens in (7, 1):
            body = base(path, max_tokens=max_tokens, ignore_eos=True)
            whole = answer(httpx.post(url + path, json=body, headers=auth(KEY), timeout=60))
            chunks = chunks_of(url, path, {**body, "stream": True, "stream_options": opts},
                               KEY)
            assert all(isinstance(c.get("usage"), dict) for c in chunks), chunks
            (usages,) = _running(chunks).values()
            _check_running(usages, whole["usage"]["prompt_tokens"], max_tokens)
            if path == CHAT:
                assert usages[0]["completion_tokens"] == 0  # the role chunk
            assert chunks[-1]["choices"] == []
            assert counts(chunks[-1]["usage"]) == counts(whole["usage"])
    cluster.ctx.wait_blocks(0)
    cluster.gen.wait_blocks(0)
