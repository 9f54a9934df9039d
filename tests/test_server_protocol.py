"""Unit tests of the server's pure parts: request validation, response shapes, SSE, metrics,
and the ``serve`` option layers (defaults < YAML < flags). No model, no HTTP."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import StoppedEngine

from disagg.config import ENGINE_OPTION_NAMES, ConfigError
from disagg.contracts import protocol as P
from disagg.contracts.options import ENGINE_OPTIONS, load_worker_yaml
from disagg.request import SamplingParams
from disagg.server.cli import add_cli, resolve_options
from disagg.server.metrics import ServerMetrics


def parse(model: type, body: dict | bytes) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return P.parse_request(model, raw)


def api_error(fn, *args, **kwargs) -> P.APIError:
    with pytest.raises(P.APIError) as ei:
        fn(*args, **kwargs)
    return ei.value


# ---- request validation -----------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": P.MAX_N + 1}, "n"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"model": "m"}, "prompt"),
])
def test_completion_request_shape_errors(body: dict | bytes, param: str | None) -> None:
    e = api_error(parse, P.CompletionRequest, body)
    assert e.status == 400
    assert e.body()["error"]["type"] == "invalid_request_error"
    assert e.param == param
    if param:
        assert e.message.startswith(param)


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["ok", ""]])
def test_empty_prompt_is_400(prompt: object) -> None:
    req = parse(P.CompletionRequest, {"prompt": prompt})
    e = api_error(req.prompts)
    assert e.status == 400 and e.param == "prompt" and "empty" in e.message


def test_prompt_forms() -> None:
    def prompts(p: object) -> list:
        return parse(P.CompletionRequest, {"prompt": p}).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    # Booleans are not token ids.
    assert api_error(parse, P.CompletionRequest, {"prompt": [True]}).status == 400


@pytest.mark.parametrize("extra,param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 100}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"disaggregated_params": {"request_type": "prefill_please"}}, "disaggregated_params"),
])
def test_out_of_range_parameters_are_400(extra: dict, param: str) -> None:
    req = parse(P.CompletionRequest, {"prompt": "x", **extra})
    e = api_error(req.to_sampling_params, 3, 100)
    assert e.status == 400 and e.param == param, e.message
    assert e.message.startswith(param)


def test_context_length_is_400() -> None:
    req = parse(P.CompletionRequest, {"prompt": "x", "max_tokens": 10})
    req.to_sampling_params(90, 100)  # exactly fits
    e = api_error(req.to_sampling_params, 91, 100)
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert "maximum context length is 100" in e.message and "101" in e.message


def test_completion_sampling_params() -> None:
    req = parse(P.CompletionRequest, {
        "prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 11,
        "stop": "END", "ignore_eos": True, "logprobs": 2, "n": 3, "user": "u1",
    })
    sp = req.to_sampling_params(3, 100)
    assert sp == SamplingParams(n=3, max_tokens=7, temperature=0.0, top_p=0.5, top_k=3,
                                seed=11, stop=("END",), ignore_eos=True, logprobs=2)
    # n fans out into n engine requests: n=1 each, seed + i.
    assert [P.choice_params(sp, i).seed for i in range(3)] == [11, 12, 13]
    assert {P.choice_params(sp, i).n for i in range(3)} == {1}
    # OpenAI defaults when omitted.
    d = parse(P.CompletionRequest, {"prompt": "x"}).to_sampling_params(1, 100)
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.logprobs) == (16, 1.0, 1.0, 0, None)


def test_chat_request() -> None:
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 5, "max_tokens": 9, "logprobs": True, "top_logprobs": 2}
    req = parse(P.ChatCompletionRequest, body)
    msgs = req.chat_messages()
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    sp = req.to_sampling_params(10, 100)
    assert sp.max_tokens == 5 and sp.logprobs == 2  # max_completion_tokens wins
    # Without a limit: what the context (and the KV cache) leaves.
    req = parse(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
    assert req.to_sampling_params(10, 100).max_tokens == 90
    assert req.to_sampling_params(10, 100, kv_capacity_tokens=64).max_tokens == 54
    assert req.to_sampling_params(10, 100).logprobs is None


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 200}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"disaggregated_params": {}}, "disaggregated_params"),
])
def test_chat_errors(body: dict, param: str) -> None:
    full = {"messages": [{"role": "user", "content": "hi"}], **body}

    def go() -> None:
        req = parse(P.ChatCompletionRequest, full)
        req.chat_messages()
        req.to_sampling_params(10, 100)

    e = api_error(go)
    assert e.status == 400 and e.param == param, e.message


def test_unknown_fields_are_ignored() -> None:
    req = parse(P.CompletionRequest, {"prompt": "x", "some_vendor_flag": 1})
    assert req.model_extra == {"some_vendor_flag": 1}


# ---- responses ----------------------------------------------------------------------------


def test_error_body_shape() -> None:
    e = P.APIError(503, "busy", type="server_overloaded", code="queue_full",
                   headers={"Retry-After": "1"})
    assert e.body() == {"error": {"message": "busy", "type": "server_overloaded",
                                  "param": None, "code": "queue_full"}}


def test_value_error_names_param() -> None:
    e = P.from_value_error(ValueError("max_tokens: too many"))
    assert (e.status, e.param) == (400, "max_tokens")
    assert P.from_value_error(ValueError("something odd")).param is None


def test_usage() -> None:
    assert P.usage(5, 3, 2) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                "prompt_tokens_details": {"cached_tokens": 2}}


TEXT = {1: "a", 2: "bc", 3: "<eos>"}


def test_completion_logprobs_legacy_format() -> None:
    lps = [{1: -0.1, 2: -2.5}, {2: -3.0, 1: -0.2, 3: -0.5}]  # chosen: 1, then 2 (not top)
    out = P.completion_logprobs([1, 2], lps, TEXT.__getitem__, text_offset=4)
    assert out["tokens"] == ["a", "bc"]
    assert out["token_logprobs"] == [-0.1, -3.0]
    assert out["text_offset"] == [4, 5]
    assert list(out["top_logprobs"][1]) == ["a", "<eos>", "bc"]  # sorted, chosen included


def test_chat_logprobs_format() -> None:
    lps = [{2: -0.3, 1: -1.5, 3: -float("inf")}]
    out = P.chat_logprobs([2], lps, TEXT.__getitem__, top_n=2)
    (entry,) = out["content"]
    assert entry["token"] == "bc" and entry["logprob"] == -0.3
    assert entry["bytes"] == list(b"bc")
    assert [t["token"] for t in entry["top_logprobs"]] == ["bc", "a"]
    # -inf is not JSON: clamped to a finite number.
    all3 = P.chat_logprobs([2], lps, TEXT.__getitem__, top_n=3)["content"][0]["top_logprobs"]
    assert all(math.isfinite(t["logprob"]) for t in all3)
    json.dumps(all3, allow_nan=False)


def test_sse_format() -> None:
    assert P.sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert P.SSE_DONE == "data: [DONE]\n\n"
    chunk = P.completion_chunk("cmpl-1", 0, "m", [], with_usage_field=True)
    assert chunk["usage"] is None and "usage" not in P.completion_chunk("cmpl-1", 0, "m", [])


def test_ids() -> None:
    a, b = P.new_id("cmpl"), P.new_id("chatcmpl")
    assert a.startswith("cmpl-") and b.startswith("chatcmpl-") and a[5:] != b[9:]


# ---- metrics ------------------------------------------------------------------------------


class _StatsEngine(StoppedEngine):
    """A running engine's counters (an aggregated worker: no transfer metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats_value = SimpleNamespace(
            num_running=3, num_waiting=2, num_preempted_total=1, kv_blocks_used=6,
            kv_blocks_total=8, kv_blocks_cached=1, prefix_cache_queries_tokens=100,
            prefix_cache_hit_tokens=40, last_step_batch_size=3, last_step_num_tokens=35,
            steps_total=9, num_waiting_for_kv=1)

    def stats(self) -> SimpleNamespace:
        return self.stats_value

    def is_healthy(self) -> bool:
        return True


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_render_and_move() -> None:
    m = ServerMetrics(_StatsEngine(), "tiny", max_batch_size=4, max_num_tokens=64)
    other = ServerMetrics(_StatsEngine(), "other")  # own registry: no duplicate error
    m.admitted(5)
    m.tokens(1, None, 0.05)
    m.tokens(2, 0.02, None)
    m.finished("length", 5, 3, 0.2, 0.01)
    m.rejected("queue_full")
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    s = _samples(body.decode())
    lbl = (("model_name", "tiny"),)
    assert s[("disagg_prompt_tokens_total", lbl)] == 5
    assert s[("disagg_generation_tokens_total", lbl)] == 3
    assert s[("disagg_requests_finished_total",
              (("finish_reason", "length"), ("model_name", "tiny")))] == 1
    assert s[("disagg_requests_finished_total",
              (("finish_reason", "stop"), ("model_name", "tiny")))] == 0
    assert s[("disagg_requests_rejected_total",
              (("model_name", "tiny"), ("reason", "queue_full")))] == 1
    assert s[("disagg_time_to_first_token_seconds_count", lbl)] == 1
    assert s[("disagg_inter_token_latency_seconds_count", lbl)] == 2
    assert s[("disagg_e2e_request_latency_seconds_count", lbl)] == 1
    # Engine state, read at scrape time.
    assert s[("disagg_num_requests_running", lbl)] == 3
    assert s[("disagg_num_requests_waiting", lbl)] == 2
    assert s[("disagg_num_requests_waiting_for_kv", lbl)] == 1
    assert s[("disagg_iteration_batch_size", lbl)] == 3
    assert s[("disagg_iteration_num_tokens", lbl)] == 35
    assert s[("disagg_max_batch_size", lbl)] == 4
    assert s[("disagg_kv_blocks_used", lbl)] == 6
    assert s[("disagg_kv_blocks_total", lbl)] == 8
    assert s[("disagg_kv_cache_usage_ratio", lbl)] == 0.75
    assert s[("disagg_prefix_cache_hit_tokens_total", lbl)] == 40
    assert s[("disagg_num_preemptions_total", lbl)] == 1
    # The other server's registry is its own.
    o = _samples(other.render()[0].decode())
    assert o[("disagg_prompt_tokens_total", (("model_name", "other"),))] == 0


def test_metrics_survive_a_broken_engine() -> None:
    class Broken(_StatsEngine):
        def stats(self) -> SimpleNamespace:
            raise RuntimeError("boom")

        def is_healthy(self) -> bool:
            raise RuntimeError("boom")

    s = _samples(ServerMetrics(Broken(), "tiny").render()[0].decode())
    assert s[("disagg_engine_healthy", (("model_name", "tiny"),))] == 0


# ---- serve options ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers())
    return p


def test_engine_options_match_config() -> None:
    assert set(ENGINE_OPTIONS) == set(ENGINE_OPTION_NAMES)


def test_yaml_then_flags(tmp_path) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("port: 9001\nmax_batch_size: 8\ntokens_per_block: 16\n"
                   "enable_prefix_caching: false\nkv_cache_fraction: 0.5\n"
                   "served_model_name: tiny\n")
    args = _parser().parse_args(["serve", "/m", "--config", str(cfg), "--max-batch-size", "4",
                                 "--enable-prefix-caching"])
    opts = resolve_options(args)
    assert opts.model == "/m" and opts.port == 9001 and opts.host == "127.0.0.1"
    assert opts.max_batch_size == 4  # flag beats YAML
    assert opts.tokens_per_block == 16 and opts.kv_cache_fraction == 0.5
    assert opts.enable_prefix_caching is True
    assert opts.served_model_name == "tiny" and opts.role == "aggregated"
    assert opts.max_num_tokens is None  # unset stays unset: the engine default applies
    assert "max_num_tokens" not in opts.engine_options()


@pytest.mark.parametrize("text,needle", [
    ("max_batch_sise: 4\n", "unknown key 'max_batch_sise'"),
    ("urls: [a]\n", "unknown key 'urls'"),
    ("max_batch_size: four\n", "max_batch_size: expected int"),
    ("max_batch_size: true\n", "max_batch_size: expected int"),
    ("role: boss\n", "role: 'boss' is not one of"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "invalid YAML"),
])
def test_bad_yaml_names_key_and_file(tmp_path, text: str, needle: str) -> None:
    cfg = tmp_path / "w.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_worker_yaml(str(cfg))
    assert str(cfg) in str(ei.value) and needle in str(ei.value)


def test_yaml_model_key_and_missing_model(tmp_path) -> None:
    cfg = tmp_path / "w.yaml"
    cfg.write_text("model: /from/yaml\n")
    assert resolve_options(_parser().parse_args(["serve", "--config", str(cfg)])).model == (
        "/from/yaml")
    with pytest.raises(ConfigError, match="MODEL_DIR"):
        resolve_options(_parser().parse_args(["serve"]))


def test_kv_cache_flags_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "/m", "--kv-cache-tokens", "64",
                              "--kv-cache-fraction", "0.5"])


def test_benchmark_gen_only_needs_the_generation_role(capsys, monkeypatch) -> None:
    from disagg.cli import main

    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", "t")
    for role in ("context", "aggregated"):
        assert main(["serve", "/nonexistent", "--role", role, "--benchmark-gen-only"]) == 2
        err = capsys.readouterr().err
        assert "benchmark_gen_only: needs role 'generation'" in err, err


def test_disaggregated_role_needs_a_cluster_token(capsys, monkeypatch) -> None:
    from disagg.cli import main

    monkeypatch.delenv("DISAGG_CLUSTER_TOKEN", raising=False)
    assert main(["serve", "/nonexistent", "--role", "context"]) == 2
    assert "cluster token" in capsys.readouterr().err


def test_worker_yaml_transfer_keys(tmp_path) -> None:
    cfg = tmp_path / "w.yaml"
    cfg.write_text("model: /m\nrole: context\ncache_transceiver_config: {backend: tcp}\n"
                   "kv_lease_ttl_s: 5\n")
    opts = resolve_options(_parser().parse_args(["serve", "--config", str(cfg)]))
    assert opts.kv_transfer_backend == "TCP" and opts.kv_lease_ttl_s == 5.0
    # The lease TTL's other spellings: the flag, and a worker file's key under the flag's name.
    args = _parser().parse_args(["serve", "--config", str(cfg), "--kv-lease-ttl", "7"])
    assert resolve_options(args).kv_lease_ttl_s == 7.0
    cfg.write_text("model: /m\nkv_lease_ttl: 6\n")
    assert resolve_options(_parser().parse_args(["serve", "--config", str(cfg)])
                           ).kv_lease_ttl_s == 6.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: /m\ncache_transceiver_config: {backend: RDMA}\n")
    with pytest.raises(ConfigError, match="cache_transceiver_config"):
        resolve_options(_parser().parse_args(["serve", "--config", str(bad)]))


def test_kv_peer_allowlist_from_yaml_and_flag(tmp_path) -> None:
    import argparse

    from disagg.cluster_auth import PeerAllowlist
    from disagg.config import ConfigError
    from disagg.contracts.options import load_worker_yaml
    from disagg.server.cli import add_cli, resolve_options

    y = tmp_path / "w.yaml"
    y.write_text("kv_peer_allowlist: [10.0.0.0/24, ctx-0]\n")
    assert load_worker_yaml(str(y))["kv_peer_allowlist"] == ["10.0.0.0/24", "ctx-0"]
    y.write_text("kv_peer_allowlist: 10.0.0.0/24\n")
    with pytest.raises(ConfigError, match="kv_peer_allowlist: expected a list of strings"):
        load_worker_yaml(str(y))
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--kv-peer-allowlist", "10.0.0.0/24, fd00::/64"])
    allow = PeerAllowlist.parse(resolve_options(args).kv_peer_allowlist)
    assert allow.allows_host("10.0.0.3") and allow.allows_host("fd00::1")


def test_public_metrics_from_yaml_and_flag(tmp_path) -> None:
    y = tmp_path / "w.yaml"
    y.write_text("model: /m\napi_key: k\npublic_metrics: true\n")
    assert resolve_options(_parser().parse_args(["serve", "--config", str(y)])
                           ).public_metrics is True
    args = _parser().parse_args(["serve", "--config", str(y), "--no-public-metrics"])
    assert resolve_options(args).public_metrics is False
    assert resolve_options(_parser().parse_args(["serve", "/m", "--public-metrics"])
                           ).public_metrics is True
    y.write_text("public_metrics: yes please\n")
    with pytest.raises(ConfigError, match="public_metrics: expected bool"):
        resolve_options(_parser().parse_args(["serve", "--config", str(y)]))
