"""Worker-side cluster authentication (design rules 2-4, in-process workers, tiny model):

- the endpoint table: ``/server_info`` and ``/kv_events`` need a cluster signature or the API
  key (open only on a worker with neither), ``/metrics`` the API key or a signature when an API
  key is set (unless ``public_metrics``), ``/kv_leases/release`` a signature; the old
  ``X-Disagg-Cluster-Token`` header counts for nothing;
- a generation_only request's context addresses are used only when it is signed or every host
  is allow-listed; otherwise 400 and no connection at all (a TCP listener counts them);
- a generation_only request refused before the engine takes it releases its context lease,
  but only toward trusted addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_fixtures import Listener, serve_in_thread, signed, wait_for

from disagg.cluster_auth import PeerAllowlist
from disagg.config import build_engine_config
from disagg.engine import AsyncLLM
from disagg.kv_connector.settings import DisaggSettings
from disagg.server.app import ServerSettings, build_app

TOKEN = "worker-auth-test-secret"
KEY = "client-api-key"
B = 16
OPTIONS = dict(tokens_per_block=B, kv_cache_tokens=1024, max_num_tokens=256, max_model_len=512,
               max_batch_size=16)
C = "/v1/completions"
NO_CONNECTION_WAIT_S = 1.0  # a worker that connects does so within milliseconds


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint(seed=2)  # the weights these tests were written against


@pytest.fixture
def listener() -> Iterator[Any]:
    made: list[Listener] = []

    def make() -> Listener:
        made.append(Listener())
        return made[-1]

    yield make
    for lis in made:
        lis.close()


def _connected_within(lis: Listener, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lis.connections:
            return True
        time.sleep(0.02)
    return lis.connections > 0


# ---- the endpoint table ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def aggregated(model_dir: str) -> Iterator[SimpleNamespace]:
    """One engine behind four apps: API key + token, token only, API key + public metrics,
    neither."""
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    engine.start()
    base = dict(model_dir=model_dir, served_model_name="tiny", owns_engine=False)
    apps = {
        "key_token": ServerSettings(**base, api_key=KEY, cluster_token=TOKEN),
        "token": ServerSettings(**base, cluster_token=TOKEN),
        "key_public": ServerSettings(**base, api_key=KEY, public_metrics=True),
        "open": ServerSettings(**base),
    }
    try:
        with contextlib.ExitStack() as stack:
            urls = {name: stack.enter_context(serve_in_thread(build_app(engine, s)))
                    for name, s in apps.items()}
            yield SimpleNamespace(engine=engine, **urls)
    finally:
        asyncio.run(engine.shutdown())


def _get(url: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(url + path, timeout=10, **kw)


def _assert_401(r: httpx.Response, path: str) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and path in err["message"]


BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path", ["/server_info", "/kv_events", "/kv_events?since=3"])
def test_server_info_and_kv_events_need_a_signature_or_the_api_key(
        aggregated: SimpleNamespace, path: str) -> None:
    bare = path.partition("?")[0]
    for app in (aggregated.key_token, aggregated.token, aggregated.key_public):
        _assert_401(_get(app, path), bare)
        # the old shared-secret header is refused like an unsigned request
        _assert_401(_get(app, path, headers={"X-Disagg-Cluster-Token": TOKEN}), bare)
    for app in (aggregated.key_token, aggregated.key_public):
        assert _get(app, path, headers=BEARER).status_code == 200
        assert _get(app, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    for app in (aggregated.key_token, aggregated.token):
        r = _get(app, path, **signed(TOKEN, "GET", path, to=app))
        assert r.status_code == 200, r.text
        # the signature covers the token, the path and the query, and is good once
        _assert_401(_get(app, path, **signed("another-token", "GET", path, to=app)), bare)
        _assert_401(_get(app, bare + "?since=99", **signed(TOKEN, "GET", path, to=app)), bare)
        kw = signed(TOKEN, "GET", path, to=app)
        assert _get(app, path, **kw).status_code == 200
        r = _get(app, path, **kw)
        _assert_401(r, bare)
        assert "replayed" in r.json()["error"]["message"]
    # neither an API key nor a cluster token: open (the worker warned at start)
    assert _get(aggregated.open, path).status_code == 200


def test_worker_with_neither_key_nor_token_warns_at_start(
        model_dir: str, aggregated: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="disagg.server.app"):
        build_app(aggregated.engine, ServerSettings(model_dir=model_dir, owns_engine=False))
    assert "/server_info and /kv_events answer anyone" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="disagg.server.app"):
        build_app(aggregated.engine, ServerSettings(model_dir=model_dir, owns_engine=False,
                                                    cluster_token=TOKEN))
    assert "answer anyone" not in caplog.text


def test_metrics_need_the_api_key_or_a_signature_unless_public(
        aggregated: SimpleNamespace) -> None:
    app = aggregated.key_token
    _assert_401(_get(app, "/metrics"), "/metrics")
    assert _get(app, "/metrics", headers=BEARER).status_code == 200
    r = _get(app, "/metrics", **signed(TOKEN, "GET", "/metrics", to=app))
    assert r.status_code == 200 and "disagg_" in r.text
    # public_metrics, or no API key at all: open
    for app in (aggregated.key_public, aggregated.token, aggregated.open):
        assert _get(app, "/metrics").status_code == 200
    # /health and /version stay open everywhere
    for app in (aggregated.key_token, aggregated.token):
        assert _get(app, "/health").status_code == 200
        assert _get(app, "/version").status_code == 200


def test_a_signed_request_is_refused_by_another_member(aggregated: SimpleNamespace) -> None:
    """Issue 40: a request captured on its way to one worker and replayed to another (same
    cluster token, its own nonce store) is refused there, with a message saying why; each
    worker names its member id in /health; an old-format (v1) signature is refused."""
    a, b = aggregated.key_token, aggregated.token
    ids = {app: _get(app, "/health").json()["member_id"] for app in (a, b)}
    assert ids[a] != ids[b]
    kw = signed(TOKEN, "GET", "/server_info", to=a)
    assert f"aud={ids[a]}" in kw["headers"]["X-Disagg-Auth"]
    assert _get(a, "/server_info", **kw).status_code == 200
    r = _get(b, "/server_info", **kw)  # the captured copy, sent to the other member
    _assert_401(r, "/server_info")
    assert f"signed for member {ids[a]}, not this one" in r.json()["error"]["message"]
    assert "replayed" in _get(a, "/server_info", **kw).json()["error"]["message"]
    old = {"X-Disagg-Auth": f"v1;ts={int(time.time())};nonce={'0' * 32};sig={'0' * 64}"}
    r = _get(b, "/server_info", headers=old)
    _assert_401(r, "/server_info")
    assert "old signature format v1" in r.json()["error"]["message"]


# ---- disaggregated workers in this process --------------------------------------------------


@pytest.fixture(scope="module")
def disagg(model_dir: str) -> Iterator[SimpleNamespace]:
    """A context worker and two generation workers (one allow-listing 127.0.0.1), TCP."""
    config = build_engine_config(model_dir, **OPTIONS)

    def settings(role: str, allow: list[str] | None = None) -> DisaggSettings:
        return DisaggSettings(role=role, cluster_token=TOKEN, backend="TCP",
                              kv_peer_allowlist=PeerAllowlist.parse(allow))

    engines = {"ctx": AsyncLLM(config, disagg=settings("context")),
               "gen": AsyncLLM(config, disagg=settings("generation")),
               "gen_allow": AsyncLLM(config, disagg=settings("generation", ["127.0.0.1"]))}
    roles = {"ctx": "context", "gen": "generation", "gen_allow": "generation"}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve_in_thread(build_app(e, ServerSettings(
            model_dir=model_dir, served_model_name="tiny", role=roles[name]))))
            for name, e in engines.items()}
        yield SimpleNamespace(engines=engines, **urls)


def _gen_only(disagg: SimpleNamespace, address: str, lease: str, **extra: Any
              ) -> dict[str, Any]:
    """A well-formed generation_only body whose context KV is said to live at ``address``."""
    prompt = list(range(30, 30 + B + 5))
    layout = disagg.engines["gen"].transfer.layout.to_dict()
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "disaggregated_params": {
                "request_type": "generation_only", "ctx_request_id": lease,
                "first_gen_tokens": [5], "prompt_token_ids": prompt, "worker_id": "ctx-x",
                "backend": "TCP", "addresses": [address], "block_ids": [0, 1],
                "num_tokens": len(prompt), "layout": layout,
                "lease_expiry": time.time() + 30}, **extra}


def test_unsigned_request_with_unlisted_addresses_opens_no_connection(
        disagg: SimpleNamespace, listener: Any) -> None:
    lis = listener()
    r = httpx.post(disagg.gen + C, json=_gen_only(disagg, lis.addr, "forged-1"), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "disaggregated_params.addresses"
    assert "disaggregated_params.addresses" in err["message"] and lis.addr in err["message"]
    # refused for another reason too: still nothing sent there (not even a lease release)
    for extra in ({"temperature": -1}, {"stream": "maybe"}, {"stream_options": 5},
                  {"model": "nope"}):
        r = httpx.post(disagg.gen + C, json=_gen_only(disagg, lis.addr, "forged-2", **extra),
                       timeout=30)
        assert 400 <= r.status_code < 500, (extra, r.text)
    assert not _connected_within(lis, NO_CONNECTION_WAIT_S), "connected to an untrusted peer"


@pytest.mark.parametrize("extra", [{"stream": "maybe"}, {"stream_options": 5},
                                   {"stream": True, "stream_options": {"include_usage": "x"}},
                                   {"temperature": -1}, {"model": "nope"},
                                   {"max_tokens": 100_000}],
                         ids=["stream-maybe", "stream-options-5", "include-usage-x",
                              "temperature", "model", "too-long"])
def test_refused_trusted_request_releases_the_context_lease(
        disagg: SimpleNamespace, listener: Any, extra: dict[str, Any]) -> None:
    """Signed (the router's), or unsigned to allow-listed addresses: a refusal tells the
    context worker at once (it connects there), instead of leaving its KV until lease expiry."""
    signed_lis, listed_lis = listener(), listener()
    body = _gen_only(disagg, signed_lis.addr, "lease-signed", **extra)
    r = httpx.post(disagg.gen + C, timeout=30, **signed(TOKEN, "POST", C, body, to=disagg.gen))
    assert 400 <= r.status_code < 500, r.text
    wait_for(lambda: signed_lis.connections > 0, 10, what="release sent to the context worker")
    body = _gen_only(disagg, listed_lis.addr, "lease-listed", **extra)
    r = httpx.post(disagg.gen_allow + C, json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    wait_for(lambda: listed_lis.connections > 0, 10, what="release sent to the context worker")


def test_signed_request_reads_from_the_named_context_worker(
        disagg: SimpleNamespace, listener: Any) -> None:
    """The signature is what makes the addresses trusted: a signed request is accepted and
    the worker connects to read the KV (a silent peer: the read then fails or is aborted)."""
    lis = listener()
    body = _gen_only(disagg, lis.addr, "lease-read")
    # No answer comes while the peer is silent: hang up (the worker aborts the request).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(disagg.gen + C, timeout=httpx.Timeout(10, read=1.0),
                   **signed(TOKEN, "POST", C, body, to=disagg.gen))
    wait_for(lambda: lis.connections > 0, 10, what="KV read from the named worker")


def test_lease_release_endpoint_needs_a_signature(disagg: SimpleNamespace) -> None:
    path = "/kv_leases/release"
    body = {"ctx_request_id": "no-such-lease"}
    r = httpx.post(disagg.ctx + path, json=body, timeout=10)
    _assert_401(r, path)
    r = httpx.post(disagg.ctx + path, json=body, timeout=10,
                   headers={"X-Disagg-Cluster-Token": TOKEN})
    _assert_401(r, path)
    # the signature covers the body
    kw = signed(TOKEN, "POST", path, body, to=disagg.ctx)
    r = httpx.post(disagg.ctx + path, timeout=10, headers=kw["headers"],
                   content=b'{"ctx_request_id": "another-lease"}')
    _assert_401(r, path)
    r = httpx.post(disagg.ctx + path, timeout=10, **kw)
    assert r.status_code == 200 and r.json() == {"ctx_request_id": "no-such-lease",
                                                 "released": False}
    r = httpx.post(disagg.ctx + path, timeout=10, **kw)  # replayed
    _assert_401(r, path)
    r = httpx.post(disagg.ctx + path, timeout=10,
                   **signed(TOKEN, "POST", path, {"x": 1}, to=disagg.ctx))
    assert r.status_code == 400 and r.json()["error"]["param"] == "ctx_request_id"
    r = httpx.post(disagg.gen + path, timeout=10,
                   **signed(TOKEN, "POST", path, body, to=disagg.gen))
    assert r.status_code == 404
