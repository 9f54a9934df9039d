"""`disagg bench serve` / `plot`: datasets, and end-to-end runs against a streaming test server.

The server here is test infrastructure for a client tool: a minimal OpenAI-compatible FastAPI app
that streams ``max_tokens`` tokens in realistic SSE chunks (with usage when asked), counts what
it saw and fails chosen requests. It runs in a thread on an ephemeral 127.0.0.1 port and is
always stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request  # module level: FastAPI resolves the string annotations here

from disagg.bench.datasets import (
    DatasetError,
    exact_text,
    load_bench_tokenizer,
    sample_mooncake,
    sample_random,
    sample_sharegpt,
)
from disagg.cli import main as cli_main

# ----------------------------------------------------------------------------- tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across workers.",
    "KV cache blocks move from the context worker to the generation worker.",
    "Time to first token and time per output token are the two latencies users feel.",
    "Ünïcödé text, numbers 12345 and symbols #@!$%^&*() test byte-level merges.",
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real byte-level BPE (trained here, ~400 tokens) that adds BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok(tok_path: str) -> Any:
    return load_bench_tokenizer(tok_path)


# ------------------------------------------------------------------------------ datasets


def test_random_prompts_have_exact_lengths(tok: Any) -> None:
    samples = sample_random(tok, 40, input_len=40, output_len=8, range_ratio=0.5,
                            prefix_len=8, seed=1)
    prefix = os.path.commonprefix([s.prompt for s in samples])
    assert prefix  # the shared random prefix
    lens = set()
    for s in samples:
        assert s.exact
        assert len(tok.encode(s.prompt)) == s.prompt_len  # as the server will count it
        assert 8 + 20 <= s.prompt_len <= 8 + 60 and 4 <= s.expected_output_len <= 12
        lens.add(s.prompt_len)
    assert len(lens) > 5  # the range ratio spreads lengths
    again = sample_random(tok, 40, 40, 8, 0.5, 8, seed=1)
    assert [s.prompt for s in again] == [s.prompt for s in samples]  # seeded


def test_random_token_id_prompts(tok: Any) -> None:
    samples = sample_random(tok, 5, 30, 4, prefix_len=6, seed=0, as_token_ids=True)
    special = set(tok.all_special_ids)
    for s in samples:
        assert isinstance(s.prompt, list) and len(s.prompt) == s.prompt_len == 36
        assert s.prompt[:6] == samples[0].prompt[:6] and not special & set(s.prompt)


def test_exact_text_short_targets(tok: Any) -> None:
    rng = random.Random(0)
    ids = [i for i in range(tok.vocab_size) if i not in set(tok.all_special_ids)]
    for target in range(1, 12):
        text, n = exact_text(tok, target, rng, ids)
        assert n == target == len(tok.encode(text)), (target, text)


def test_random_exact_with_package_tokenizer(tmp_path: Path) -> None:
    try:
        from disagg.model.tiny import write_tiny_checkpoint
        from disagg.tokenizer import load_tokenizer
    except ImportError as e:
        pytest.skip(f"disagg.tokenizer / disagg.model.tiny not available yet ({e})")
    write_tiny_checkpoint(str(tmp_path))
    ptok = load_tokenizer(str(tmp_path))
    for s in sample_random(ptok, 20, input_len=64, output_len=4, range_ratio=0.5, seed=3):
        assert s.exact and len(ptok.encode(s.prompt)) == s.prompt_len


def test_sharegpt_parsing(tmp_path: Path, tok: Any) -> None:
    data = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "The quick brown fox?"},
            {"from": "gpt", "value": "jumps over the lazy dog."},
            {"from": "human", "value": "ignored later turn"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "no answer"}]},  # skipped
        {"id": "c", "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "Time to first token"},
            {"from": "gpt", "value": "is a latency."}]},
        {"id": "d"},  # skipped
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    samples = sample_sharegpt(str(path), tok, num_prompts=10, seed=0)
    by_prompt = {s.prompt: s for s in samples}
    assert set(by_prompt) == {"The quick brown fox?", "Time to first token"}
    s = by_prompt["The quick brown fox?"]
    assert s.prompt_len == len(tok.encode(s.prompt))
    assert s.expected_output_len == len(tok.encode("jumps over the lazy dog.",
                                                   add_special_tokens=False))
    assert len(sample_sharegpt(str(path), tok, num_prompts=1)) == 1
    fixed = sample_sharegpt(str(path), tok, 10, output_len=7, as_token_ids=True)
    assert all(x.expected_output_len == 7 and isinstance(x.prompt, list) for x in fixed)
    path.write_text("{}")
    with pytest.raises(DatasetError, match="JSON list"):
        sample_sharegpt(str(path), tok, 1)


def test_mooncake_trace(tmp_path: Path, tok: Any) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 45, "output_length": 6, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 30, "output_length": 7, "hash_ids": [1, 5]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ids = sample_mooncake(str(path), tok, 10, block_size=16, as_token_ids=True, speedup=2.0)
    assert [s.timestamp for s in ids] == [0.0, 0.25, 1.0]
    assert [len(s.prompt) for s in ids] == [40, 45, 30]
    assert [s.expected_output_len for s in ids] == [5, 6, 7]
    a, b, c = (s.prompt for s in ids)
    assert a[:40] == b[:40]  # same hash ids -> same content
    assert a[:16] == c[:16] and a[16:30] != c[16:30]  # shared block 1 only
    texts = sample_mooncake(str(path), tok, 10, block_size=16)
    assert [s.timestamp for s in texts] == [0.0, 0.5, 2.0]
    for s, want in zip(texts, (40, 45, 30), strict=True):
        assert s.exact and s.prompt_len == want == len(tok.encode(s.prompt))
    p0, p1, p2 = (s.prompt for s in texts)
    assert len(os.path.commonprefix([p0, p1])) > len(os.path.commonprefix([p0, p2])) > 0
    assert len(sample_mooncake(str(path), tok, 2, block_size=16)) == 2
    path.write_text('{"timestamp": 1, "input_length": 4}\n')
    with pytest.raises(DatasetError, match="trace.jsonl:1"):
        sample_mooncake(str(path), tok, 1)


# --------------------------------------------------------------------------- test server


@dataclass
class FakeServer:
    """Behaviour and tallies of the test server."""

    tok_path: str
    usage: bool = True  # honour stream_options.include_usage
    http_fail_every: int = 0  # every k-th request: HTTP 503
    stream_fail_every: int = 0  # every k-th request: an error event after 2 tokens
    requests: int = 0
    http_failed: int = 0
    stream_failed: int = 0
    completed_tokens: list[int] = field(default_factory=list)  # per completed request
    prompt_tokens: list[int] = field(default_factory=list)  # per completed request
    bodies: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tok_path)
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"},
                                               {"id": "other", "object": "model"}]}

        async def handle(request: Request, chat: bool) -> Any:
            body = await request.json()
            with self.lock:
                self.requests += 1
                n = self.requests
                self.bodies.append(body)
            if self.http_fail_every and n % self.http_fail_every == 0:
                with self.lock:
                    self.http_failed += 1
                return JSONResponse({"error": {"message": "injected overload", "code": 503}},
                                    status_code=503)
            fail_mid = bool(self.stream_fail_every and n % self.stream_fail_every == 0)
            if chat:
                prompt_len = len(tok.encode(body["messages"][0]["content"]).ids)
            elif isinstance(body["prompt"], list):
                prompt_len = len(body["prompt"])
            else:
                prompt_len = len(tok.encode(body["prompt"]).ids)
            max_tokens = int(body["max_tokens"])
            include_usage = self.usage and (body.get("stream_options") or {}).get("include_usage")
            base = {"id": f"cmpl-{n}", "created": 0, "model": body["model"],
                    "object": "chat.completion.chunk" if chat else "text_completion"}

            def chunk(text: str | None, finish: str | None = None) -> str:
                if chat:
                    delta = {"role": "assistant", "content": ""} if text is None \
                        else {"content": text}
                    choice: dict[str, Any] = {"index": 0, "delta": delta}
                else:
                    choice = {"index": 0, "text": text or "", "logprobs": None}
                choice["finish_reason"] = finish
                return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

            async def gen() -> Any:
                if chat:
                    yield chunk(None)  # the role-only first chunk real servers send
                for i in range(max_tokens):
                    await asyncio.sleep(0.001)  # simulated decode step
                    if fail_mid and i == 2:
                        with self.lock:
                            self.stream_failed += 1
                        err = {"error": {"message": "injected engine error", "code": 500}}
                        yield f"data: {json.dumps(err)}\n\n"
                        return
                    yield chunk(f" t{i}", "length" if i == max_tokens - 1 else None)
                if include_usage:
                    usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                             "total_tokens": prompt_len + max_tokens}
                    yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                with self.lock:
                    self.completed_tokens.append(max_tokens)
                    self.prompt_tokens.append(prompt_len)

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        return app


@contextmanager
def serving(app: Any, lifespan: str = "off") -> Iterator[str]:
    """Run ``app`` on an ephemeral port. The socket is bound and listening before the thread
    starts, so clients can connect at once (the kernel queues them until uvicorn, after its
    lifespan startup, accepts): no readiness wait is needed."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        assert not thread.is_alive(), "test server did not stop"


SUMMARY_FIELDS = [
    "num_requests", "completed", "failed", "duration_s", "total_input_tokens",
    "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
    "request_goodput", "goodput_slos_ms", "mean_tokens_per_s_per_user", "errors",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
     for stat in ("mean", "median", "std", "p90", "p99")]

RECORD_FIELDS = ["index", "success", "error", "start_s", "ttft_ms", "tpot_ms", "itl_ms",
                 "e2el_ms", "prompt_len", "server_prompt_tokens", "expected_output_len",
                 "output_tokens", "finish_reason"]


def _run_cli(argv: list[str]) -> int:
    return cli_main(["bench", "serve", "--no-progress", *argv])


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_serve_end_to_end(tmp_path: Path, tok_path: str, tok: Any, http_client: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeServer(tok_path)
    out = tmp_path / "result.json"
    with serving(fake.app()) as url:
        rc = _run_cli(["--base-url", url + "/v1", "--tokenizer", tok_path,
                       "--num-prompts", "12", "--random-input-len", "24",
                       "--random-output-len", "6", "--random-range-ratio", "0.5",
                       "--random-prefix-len", "4", "--max-concurrency", "4",
                       "--ignore-eos", "--num-warmups", "2", "--goodput", "ttft:60000",
                       "tpot:60000", "--percentiles", "90,99", "--http-client", http_client,
                       "--save-result", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 TPOT (ms):" in printed
    res = json.loads(out.read_text())
    assert res["kind"] == "disagg-bench-serve"
    s = res["summary"]
    assert not [f for f in SUMMARY_FIELDS if f not in s]
    assert res["config"]["model"] == "fake-model"  # the first of /v1/models
    assert res["config"]["goodput_slos_ms"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert (s["num_requests"], s["completed"], s["failed"], s["errors"]) == (12, 12, 0, {})
    # The server saw 2 warmups (all done before the run) then the 12 requests.
    assert fake.requests == 14 and len(fake.completed_tokens) == 14
    assert s["total_output_tokens"] == sum(fake.completed_tokens[2:])
    assert s["total_input_tokens"] == sum(fake.prompt_tokens[2:])
    assert s["good_requests"] == 12
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    recs = res["requests"]
    assert [r["index"] for r in recs] == list(range(12))
    for r in recs:
        assert not [f for f in RECORD_FIELDS if f not in r]
        assert r["success"] and r["output_tokens"] == r["expected_output_len"]
        assert r["prompt_len"] == r["server_prompt_tokens"]  # exact random lengths
        assert len(r["itl_ms"]) == r["output_tokens"] - 1
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
    for b in fake.bodies:  # the request contract
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["model"] == "fake-model"

    pngs = cli_main(["bench", "plot", str(out), str(out), "--out-dir", str(tmp_path / "p")])
    assert pngs == 0
    for name in ("latency_cdf.png", "throughput_vs_speed.png"):
        data = (tmp_path / "p" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_serve_counts_failures_chat_without_usage(tmp_path: Path, tok_path: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeServer(tok_path, usage=False, http_fail_every=4, stream_fail_every=5)
    out = tmp_path / "r.json"
    with serving(fake.app()) as url:
        rc = _run_cli(["--base-url", url, "--endpoint", "chat", "--model", "m",
                       "--tokenizer", tok_path, "--num-prompts", "20",
                       "--random-input-len", "10", "--random-output-len", "5",
                       "--request-rate", "400", "--burstiness", "0.5",
                       "--save-result", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    # Requests 4, 8, 12, 16, 20 -> 503; 5, 10, 15 -> error event mid-stream.
    assert fake.requests == 20 and (fake.http_failed, fake.stream_failed) == (5, 3)
    assert (s["completed"], s["failed"]) == (12, 8)
    assert s["errors"] == {"HTTP 503: injected overload": 5,
                           "error in stream: injected engine error": 3}
    # No usage: tokens are counted from content chunks (one token per chunk here).
    assert s["total_output_tokens"] == sum(fake.completed_tokens) == 12 * 5
    assert "injected overload" in capsys.readouterr().out


def test_serve_token_id_prompts_and_trace(tmp_path: Path, tok_path: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 10 * i, "input_length": 20 + i,
                                           "output_length": 3, "hash_ids": [7, i]})
                               for i in range(6)))
    fake = FakeServer(tok_path)
    with serving(fake.app()) as url:
        rc = _run_cli(["--base-url", url, "--tokenizer", tok_path, "--dataset",
                       "mooncake-trace", "--dataset-path", str(trace), "--trace-block-size",
                       "16", "--prompt-as-token-ids", "--trace-speedup", "10"])
    assert rc == 0
    assert fake.prompt_tokens and sorted(fake.prompt_tokens) == [20 + i for i in range(6)]
    prompts = [b["prompt"] for b in fake.bodies]
    assert all(p[:16] == prompts[0][:16] for p in prompts)  # hash id 7 shared


def test_serve_gen_only_adds_the_marker(tmp_path: Path, tok_path: str) -> None:
    """--gen-only: every body carries request_type generation_only (merged with any
    --extra-body params) and ignore_eos; the result records it."""
    fake = FakeServer(tok_path)
    out = tmp_path / "g.json"
    with serving(fake.app()) as url:
        rc = _run_cli(["--base-url", url, "--tokenizer", tok_path, "--num-prompts", "3",
                       "--random-input-len", "8", "--random-output-len", "3", "--gen-only",
                       "--extra-body", '{"disaggregated_params": {"note": 1}, "top_k": 2}',
                       "--num-warmups", "1", "--save-result", str(out)])
    assert rc == 0
    assert len(fake.bodies) == 4
    for b in fake.bodies:  # warmup too
        assert b["disaggregated_params"] == {"note": 1, "request_type": "generation_only"}
        assert b["ignore_eos"] is True and b["top_k"] == 2
    cfg = json.loads(out.read_text())["config"]
    assert cfg["gen_only"] is True and cfg["ignore_eos"] is True
    assert cfg["extra_body"] == {"disaggregated_params": {"note": 1}, "top_k": 2}


def test_serve_all_failed_and_unreachable(tmp_path: Path, tok_path: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    rc = _run_cli(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer",
                   tok_path, "--num-prompts", "3", "--random-input-len", "5",
                   "--save-result", str(out)])
    assert rc == 1
    s = json.loads(out.read_text())["summary"]
    assert (s["completed"], s["failed"]) == (0, 3) and sum(s["errors"].values()) == 3
    assert "every request failed" in capsys.readouterr().err
    rc = _run_cli(["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tok_path])
    assert rc == 1 and "/v1/models failed" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--goodput", "ttft"], "--goodput"),
    (["--percentiles", "200"], "--percentiles"),
    (["--dataset", "sharegpt"], "--dataset-path"),
    (["--endpoint", "chat", "--prompt-as-token-ids"], "--prompt-as-token-ids"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
])
def test_bad_flags_name_the_flag(argv: list[str], flag: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _run_cli(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_plot_rejects_non_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "other"}')
    with pytest.raises(SystemExit):
        cli_main(["bench", "plot", str(bad)])
    assert "x.json" in capsys.readouterr().err


def _prom_total(text: str, name: str) -> float:
    """Sum of every sample of counter ``name`` (all label sets) in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        pytest.fail(f"the worker's /metrics has no {name}")
    return total


def test_serve_against_live_worker(tmp_path: Path) -> None:
    """The real aggregated worker (tiny model, CPU): counts match the worker's own metrics."""
    try:
        from disagg.config import build_engine_config
        from disagg.engine import AsyncLLM
        from disagg.model.tiny import write_tiny_checkpoint
        from disagg.server.app import ServerSettings, build_app
    except ImportError as e:
        pytest.skip(f"worker pieces not available ({e})")
    import httpx

    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    # A small KV cache: allocating the default share of free memory is slow and not needed.
    # Prefix caching on (the default): the warmup resends prompt 0, a full prefix hit.
    engine = AsyncLLM(build_engine_config(model, kv_cache_tokens=4096,
                                          enable_prefix_caching=True))
    app = build_app(engine, ServerSettings(model_dir=model))
    out = tmp_path / "r.json"
    with serving(app, lifespan="on") as url:
        rc = _run_cli(["--base-url", url, "--num-prompts", "8", "--random-input-len", "40",
                       "--random-output-len", "6", "--random-range-ratio", "0.5",
                       "--ignore-eos", "--request-rate", "50", "--num-warmups", "1",
                       "--request-timeout", "120", "--save-result", str(out)])
        metrics = httpx.get(url + "/metrics", timeout=30).text
    assert rc == 0
    res = json.loads(out.read_text())
    s, recs = res["summary"], res["requests"]
    assert not [f for f in SUMMARY_FIELDS if f not in s]
    assert res["config"]["model"] == model  # from /v1/models; tokenizer = the model folder
    assert (s["completed"], s["failed"]) == (8, 0)
    for r in recs:  # exact prompt lengths as the worker counted them; ignore_eos honoured
        assert r["prompt_len"] == r["server_prompt_tokens"]
        assert r["output_tokens"] == r["expected_output_len"]
    # The warmup reuses request 0's prompt and length.
    assert _prom_total(metrics, "disagg_requests_finished_total") == 8 + 1
    assert _prom_total(metrics, "disagg_generation_tokens_total") == \
        s["total_output_tokens"] + recs[0]["output_tokens"]
    assert _prom_total(metrics, "disagg_prompt_tokens_total") == \
        s["total_input_tokens"] + recs[0]["prompt_len"]


def test_serve_against_router(tmp_path: Path, tiny_llama: str) -> None:
    """`bench serve` through the router of a launched 1 context + 1 generation cluster: every
    count matches the router's and both workers' own metrics."""
    import httpx

    from disagg.bench.ratematch import LaunchedCluster

    n, warm = 6, 1
    out = tmp_path / "r.json"
    cluster = LaunchedCluster(tiny_llama, "tiny", 1, 1, {"kv_cache_tokens": 4096,
                                                         "max_model_len": 512},
                              str(tmp_path / "launch"), timeout_s=120, stop_timeout_s=30)
    with cluster as url:
        rc = _run_cli(["--base-url", url, "--tokenizer", tiny_llama, "--num-prompts", str(n),
                       "--random-input-len", "40", "--random-output-len", "5",
                       "--random-range-ratio", "0.5", "--ignore-eos", "--request-rate", "20",
                       "--num-warmups", str(warm), "--request-timeout", "60",
                       "--save-result", str(out)])
        router, ctx, gen = (httpx.get(u + "/metrics", timeout=30).text
                            for u in (url, cluster.ctx_urls[0], cluster.gen_urls[0]))
    assert cluster.proc is None  # stopped and reaped
    assert rc == 0
    res = json.loads(out.read_text())
    s, recs = res["summary"], res["requests"]
    assert not [f for f in SUMMARY_FIELDS if f not in s]
    assert (s["completed"], s["failed"]) == (n, 0)
    assert res["config"]["model"] == "tiny"
    warm_in, warm_out = recs[0]["prompt_len"], recs[0]["output_tokens"]  # warmup = request 0
    assert _prom_total(router, "disagg_router_requests_total") == n + warm
    # Every request went context -> generation: one context pass and one KV pull each.
    assert _prom_total(ctx, "disagg_requests_finished_total") == n + warm
    assert _prom_total(ctx, "disagg_prompt_tokens_total") == s["total_input_tokens"] + warm_in
    assert _prom_total(gen, "disagg_kv_transfers_total") == n + warm
    assert _prom_total(gen, "disagg_requests_finished_total") == n + warm
    assert _prom_total(gen, "disagg_generation_tokens_total") == \
        s["total_output_tokens"] + warm_out
    for r in recs:
        assert r["output_tokens"] == r["expected_output_len"]
        assert r["prompt_len"] == r["server_prompt_tokens"]
