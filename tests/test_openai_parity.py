"""OpenAI API parity through the official ``openai`` client: penalties, logit_bias, min_p,
scoring (echo + logprobs, prompt_logprobs), /tokenize, /detokenize, /version, chat options,
and the 400s for what is not supported. Against one aggregated worker (served in this
process) and a router over a context + generation worker pair (TCP), whose answers must equal
the aggregated worker's; scores also equal transformers' log-softmax."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from router_fixtures import ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import (
    WorkerProc,
    reference_server,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg import __version__

transformers = pytest.importorskip("transformers")

NAME = "tiny"
COMMON = ["--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
          "--max-batch-size", "32", "--tokens-per-block", "16", "--kv-transfer-backend", "TCP",
          "--served-model-name", NAME, "--log-level", "warning"]
PROMPT = "Memory is organised in small blocks of tokens, and every block holds sixteen."
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
# On this prompt, the bias alone makes token 47 the answer 12 times over; with the penalties
# the second token is another one only because the first (the context worker's) is counted.
BIAS = {"47": 20}
PENALTIES: dict[str, Any] = {"frequency_penalty": 2.0, "presence_penalty": 1.0,
                             "logit_bias": BIAS}
EXTRA: dict[str, Any] = {"repetition_penalty": 1.05, "min_p": 0.1, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory, loop: LoopThread
            ) -> Iterator[dict[str, str]]:
    """URLs: ``router`` (over one context and one generation worker), ``ctx`` (that context
    worker) and ``aggregated``."""
    tmp = tmp_path_factory.mktemp("parity-logs")
    env = {"DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    ws: list[WorkerProc] = [
        start_worker_proc(tmp, model_dir, "ctx", ["--role", "context", *COMMON], env),
        start_worker_proc(tmp, model_dir, "gen", ["--role", "generation", *COMMON], env)]
    try:
        with reference_server(model_dir, NAME) as aggregated:
            wait_all_healthy(ws, 120.0)
            cfg = {"model": model_dir, "health_check_interval_sec": 0.2,
                   "context_servers": {"urls": [ws[0].addr]},
                   "generation_servers": {"urls": [ws[1].addr]}}
            with running_router(cfg, loop) as router:
                wait_for(lambda: httpx.get(router + "/health").status_code == 200, 30,
                         what="router")
                yield {"router": router, "aggregated": aggregated, "ctx": ws[0].url}
    finally:
        stop_all(ws)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def _complete(url: str, stream: bool = False, **kw: Any) -> str:
    args = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    c = _client(url).completions
    if not stream:
        return c.create(**args).choices[0].text
    return "".join(ch.text for ev in c.create(stream=True, **args) for ch in ev.choices)


def _chat(url: str, stream: bool = False, **kw: Any) -> str:
    args = {"model": NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **kw}
    c = _client(url).chat.completions
    if not stream:
        return c.create(**args).choices[0].message.content or ""
    return "".join(ch.delta.content or "" for ev in c.create(stream=True, **args)
                   for ch in ev.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_penalties_disaggregated_equal_aggregated(cluster: dict[str, str],
                                                  stream: bool) -> None:
    """The context worker samples the first token with the penalties, the generation worker
    continues with counts that include it: the same text as one aggregated worker."""
    agg, router = cluster["aggregated"], cluster["router"]
    want = _complete(agg, stream, **PENALTIES, extra_body=EXTRA)
    assert _complete(router, stream, **PENALTIES, extra_body=EXTRA) == want
    # ... and the penalties changed it (else this test could not fail).
    biased = _complete(agg, stream, logit_bias=BIAS, extra_body={"ignore_eos": True})
    assert want != biased and want.startswith(biased[:1])
    chat_want = _chat(agg, stream, **PENALTIES, extra_body=EXTRA)
    assert _chat(router, stream, **PENALTIES, extra_body=EXTRA) == chat_want
    # Seeded sampling with them (min_p now filters too): the same draws on both.
    sampled = {"temperature": 0.9, "seed": 7, **PENALTIES, "extra_body": EXTRA}
    assert _complete(router, stream, **sampled) == _complete(agg, stream, **sampled)


def _hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_logprobs_score_the_prompt(cluster: dict[str, str], model_dir: str,
                                        max_tokens: int) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs (the first
    null) equal transformers', aggregated and through the router (max_tokens 0 and 1: the
    context worker's answer; 4: the generation worker's, with the context worker's scores)."""
    ids = httpx.post(cluster["aggregated"] + "/tokenize", json={"prompt": PROMPT},
                     timeout=30).json()["tokens"]
    ref = _hf_logprobs(model_dir, ids)
    answers = []
    for url in (cluster["aggregated"], cluster["router"]):
        r = _client(url).completions.create(model=NAME, prompt=ids, echo=True, logprobs=1,
                                            max_tokens=max_tokens, temperature=0)
        ch = r.choices[0]
        lp = ch.logprobs
        assert lp is not None and lp.token_logprobs is not None
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        got = lp.token_logprobs[1:len(ids)]
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert got == pytest.approx(want, abs=1e-3)
        assert r.usage is not None and r.usage.completion_tokens == max_tokens
        assert ch.text.startswith(httpx.post(url + "/detokenize", json={"tokens": ids},
                                             timeout=30).json()["prompt"])
        assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)
        answers.append((ch.text, lp.tokens, lp.token_logprobs))
    assert answers[0][:2] == answers[1][:2]  # text and tokens
    for a, b in zip(answers[0][2][1:], answers[1][2][1:], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def _finished(url: str) -> float:
    """A worker's finished engine requests (all reasons), from its /metrics."""
    return sum(float(line.rpartition(" ")[2]) for line in
               httpx.get(url + "/metrics", timeout=30).text.splitlines()
               if line.startswith("disagg_requests_finished_total{"))


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_batch_of_one_prompt_is_disaggregated(cluster: dict[str, str], max_tokens: int
                                              ) -> None:
    """lm-evaluation-harness sends ``prompt: [[ids]]`` (a batch of one): the router splits it
    like one prompt (the context worker prefills and scores it; before, a generation worker
    served it whole) and the answer equals the aggregated worker's."""
    ids = httpx.post(cluster["aggregated"] + "/tokenize", json={"prompt": PROMPT},
                     timeout=30).json()["tokens"]
    for prompt in ([ids], [PROMPT]):
        body = {"model": NAME, "prompt": prompt, "echo": True, "logprobs": 1,
                "max_tokens": max_tokens, "temperature": 0}
        before = _finished(cluster["ctx"])
        answers = [httpx.post(url + "/v1/completions", json=body, timeout=60)
                   for url in (cluster["aggregated"], cluster["router"])]
        assert [a.status_code for a in answers] == [200, 200], answers[1].text
        assert _finished(cluster["ctx"]) == before + 1  # through the context worker
        agg, dis = (a.json()["choices"] for a in answers)
        assert len(agg) == len(dis) == 1 and agg[0]["index"] == dis[0]["index"] == 0
        assert dis[0]["text"] == agg[0]["text"]
        assert dis[0]["logprobs"]["tokens"] == agg[0]["logprobs"]["tokens"]
        assert dis[0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
            agg[0]["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_prompt_logprobs_extension(cluster: dict[str, str]) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        got = []
        for url in (cluster["aggregated"], cluster["router"]):
            r = httpx.post(url + path, json={"model": NAME, "max_tokens": 3, "temperature": 0,
                                             "prompt_logprobs": 2, **body}, timeout=60)
            assert r.status_code == 200, r.text
            data = r.json()
            plps = (data["choices"][0] if path == "/v1/completions" else data)["prompt_logprobs"]
            assert plps[0] is None and all(2 <= len(e) <= 3 for e in plps[1:])
            got.append(plps)
        assert len(got[0]) == len(got[1])
        for a, b in zip(got[0][1:], got[1][1:], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k]["logprob"] == pytest.approx(b[k]["logprob"], abs=1e-4)
                assert a[k]["rank"] == b[k]["rank"] >= 1


def test_tokenize_detokenize_version(cluster: dict[str, str]) -> None:
    agg, router = cluster["aggregated"], cluster["router"]
    for body in ({"model": NAME, "prompt": PROMPT},
                 {"model": NAME, "prompt": PROMPT, "add_special_tokens": False},
                 {"model": NAME, "messages": MESSAGES, "add_generation_prompt": True},
                 {"messages": [{"role": "user", "content": [
                     {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                  "return_token_strs": True}):
        a = httpx.post(agg + "/tokenize", json=body, timeout=30)
        assert a.status_code == 200, a.text
        assert httpx.post(router + "/tokenize", json=body, timeout=30).json() == a.json()
        out = a.json()
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    strs = out["token_strs"]
    assert "a" in strs and "b" in strs and strs.index("b") - strs.index("a") == 2  # "a\nb"
    with_bos = httpx.post(agg + "/tokenize", json={"prompt": "x"}, timeout=30).json()
    without = httpx.post(agg + "/tokenize", json={"prompt": "x", "add_special_tokens": False},
                         timeout=30).json()
    assert with_bos["count"] == without["count"] + 1
    d = httpx.post(router + "/detokenize", json={"model": NAME, "tokens": without["tokens"]},
                   timeout=30)
    assert d.json() == {"prompt": "x"}
    bad = httpx.post(router + "/detokenize", json={"tokens": [10 ** 6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(router + "/tokenize", json={"messages": MESSAGES,
                                                 "chat_template": "{{ 1 }}"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    assert httpx.get(router + "/version", timeout=30).json() == {"version": __version__}


def test_chat_template_options(cluster: dict[str, str]) -> None:
    agg = cluster["aggregated"]
    msgs = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    tok = httpx.post(agg + "/tokenize", json={
        "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
        "return_token_strs": True}, timeout=30).json()
    # The prompt ends inside the assistant's message: no end-of-turn after it.
    assert "".join(tok["token_strs"]).endswith("The sea is")
    cont = _chat(agg, messages=msgs, extra_body={"continue_final_message": True,
                                                 "add_generation_prompt": False})
    assert cont == _chat(cluster["router"], messages=msgs, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    # chat_template_kwargs reach the template (an unused variable changes nothing).
    assert _chat(agg, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
        _chat(agg)


@pytest.mark.parametrize("kw,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"allowed_token_ids": [1, 2]}}, "allowed_token_ids"),
    ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
])
def test_bad_values_are_400_naming_the_field(cluster: dict[str, str], kw: dict[str, Any],
                                             param: str) -> None:
    for url in (cluster["aggregated"], cluster["router"]):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(url, **kw)
        body = e.value.body
        assert isinstance(body, dict) and body.get("param") == param, body


def test_echo_streamed_equals_whole(cluster: dict[str, str]) -> None:
    """A streamed echo sends the prompt (and its logprobs) in each choice's first chunk."""
    for url in (cluster["aggregated"], cluster["router"]):
        args = {"model": NAME, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3,
                "temperature": 0}
        whole = _client(url).completions.create(**args).choices[0]
        text, tokens, lps = "", [], []
        for ev in _client(url).completions.create(stream=True, **args):
            for ch in ev.choices:
                text += ch.text
                if ch.logprobs is not None:
                    tokens += ch.logprobs.tokens or []
                    lps += ch.logprobs.token_logprobs or []
        assert text == whole.text and text.startswith(PROMPT)
        assert whole.logprobs is not None and tokens == whole.logprobs.tokens
        assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                           abs=1e-4)
