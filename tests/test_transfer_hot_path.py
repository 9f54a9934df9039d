"""The cheaper forms on a KV read's path (issue 44 item 3, ``bench/kv_read_overhead.py``) give
what the plain ones give: proofs from a per-connection HMAC state, a signed header encoded
once, ``bounded`` as ``wait_for`` without a task of its own, the mapped answer checked against
the request as built, the block id check at C speed, a plan without a zero-copy view."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from disagg.cluster_auth import hmac_finish, hmac_hex, hmac_prefix
from disagg.transfer.base import (
    HEADER_MAX_BYTES,
    Connection,
    ProtocolError,
    ReadRequest,
    bounded,
    decode_header,
    encode_header,
    encode_signed,
)
from disagg.transfer.cuda_ipc import answered_request
from disagg.transfer.handshake import ClientSession, ServerSession, canonical, request_proof
from disagg.transfer.payload import payload_shape, plan_read

TOKEN = "hot-path-secret"


def _pair() -> tuple[ClientSession, ServerSession]:
    c, s = ClientSession(TOKEN), ServerSession(TOKEN, "srv", "tcp")
    c.accept(s.answer_hello(c.hello()))
    return c, s


def test_hmac_prefix_then_finish_is_hmac_hex() -> None:
    prefix = hmac_prefix(TOKEN, "domain", "a", b"\x00b")
    for rest in ((), ("c",), ("c", "d" * 1000), (b"",)):
        assert hmac_finish(prefix, *rest) == hmac_hex(TOKEN, "domain", "a", b"\x00b", *rest)
    # the prefix is not consumed, and the parts stay length-prefixed: ("ab",) != ("a", "b")
    assert hmac_finish(prefix, "ab") != hmac_finish(prefix, "a", "b")
    assert hmac_finish(hmac_prefix(TOKEN), "x") == hmac_hex(TOKEN, "x")


def test_session_proofs_are_request_proof() -> None:
    c, s = _pair()
    assert c.server_nonce is not None
    for seq, header in enumerate(({"op": "AUTH"}, {"op": "READ", "block_ids": [3, 1]},
                                  {"op": "DONE", "lease_id": "é"})):
        signed = c.sign(header)
        assert signed["proof"] == request_proof(TOKEN, c.server_nonce, c.client_nonce, seq,
                                                header)
        assert s.verify(signed)


def test_a_header_encoded_while_signed_verifies_and_reads_the_same() -> None:
    c, s = _pair()
    header = {"op": "READ", "lease_id": "l-é", "block_ids": list(range(300)),
              "layer_slice": [0, 2], "wait_s": 0.1 + 0.2, "first_token": True}
    data = encode_signed(*c.sign_canonical(header))
    got = decode_header(data[4:])
    assert {k: v for k, v in got.items() if k != "proof"} == header
    assert len(data) - 4 == int.from_bytes(data[:4], "big")
    assert s.verify(got)
    # the same proof as sign() gives for that sequence number, and the number moved on
    c2, s2 = _pair()
    assert c2.sign(header)["proof"] != got["proof"]  # other nonces
    _, proof = c2.sign_canonical(header)
    assert proof == request_proof(TOKEN, c2.server_nonce or "", c2.client_nonce, 1, header)
    assert not s2.verify({**header, "proof": proof})  # seq 1 offered where 0 is due
    # tampered after signing: refused
    c3, s3 = _pair()
    bad = decode_header(encode_signed(*c3.sign_canonical(header))[4:])
    bad["block_ids"] = [1]
    assert not s3.verify(bad)
    # an empty header, and one too big for the wire
    c4, s4 = _pair()
    assert s4.verify(decode_header(encode_signed(*c4.sign_canonical({}))[4:]))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_signed(*c4.sign_canonical({"x": "y" * HEADER_MAX_BYTES}))
    with pytest.raises(ValueError, match="JSON object"):
        encode_signed("[1]", "00")


def test_send_encoded_defaults_to_send_header() -> None:
    """A connection without its own ``send_encoded`` sends the header it decodes."""

    class Recording(Connection):
        def __init__(self) -> None:
            self.sent: list[Mapping[str, Any]] = []

        async def send_header(self, obj: Mapping[str, Any]) -> None:
            self.sent.append(obj)

        async def recv_header(self, max_bytes: int = HEADER_MAX_BYTES) -> dict[str, Any]:
            raise NotImplementedError

        async def send_payload(self, data: Any) -> None:
            raise NotImplementedError

        async def recv_payload_into(self, out: Any) -> None:
            raise NotImplementedError

        @property
        def closed(self) -> bool:
            return False

        @property
        def peer_host(self) -> str:
            return "127.0.0.1"

        async def close(self) -> None:
            return None

    conn = Recording()
    asyncio.run(conn.send_encoded(encode_header({"op": "PING", "n": [1, 2]})))
    assert conn.sent == [{"op": "PING", "n": [1, 2]}]


def test_bounded_is_wait_for_in_the_calling_task() -> None:
    async def main() -> None:
        outer = asyncio.current_task()

        async def where() -> Any:
            return asyncio.current_task()

        # Python 3.11+: no task of its own (3.10: wait_for's)
        if hasattr(asyncio, "timeout"):
            assert await bounded(where(), 5.0) is outer
        assert await bounded(asyncio.sleep(0, "x"), 5.0) == "x"
        with pytest.raises(asyncio.TimeoutError):
            await bounded(asyncio.sleep(10), 0.01)
        with pytest.raises(KeyError):
            await bounded(_raise(KeyError("k")), 5.0)
        # a cancel from outside is a cancel, not a timeout
        task = asyncio.ensure_future(bounded(asyncio.sleep(10), 5.0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


async def _raise(e: Exception) -> None:
    raise e


def test_a_mapped_answer_is_checked_against_the_request_as_built() -> None:
    cache = torch.zeros(24, 4, 2, 4, 8, 16)
    req = ReadRequest("r", (3, 4, 9), (0, 4), (0, 4))
    assert answered_request(req, {"block_ids": [3, 4, 9]}, cache) is req  # nothing re-parsed
    assert answered_request(req.to_wire("float32", 0), {"block_ids": [3, 4, 9]}, cache) == req
    for bad in ([3, 4], [3, 4, 10], [], "3,4,9", None, [3, 4, True]):
        with pytest.raises(ValueError, match="other block ids"):
            answered_request(req, {"block_ids": bad}, cache)
    with pytest.raises(ValueError, match="ids < 24"):
        answered_request(ReadRequest("r", (3, 24), (0, 4), (0, 4)), {"block_ids": [3, 24]},
                         cache)
    with pytest.raises(ValueError, match="beyond"):
        answered_request(ReadRequest("r", (3,), (0, 5), (0, 4)), {"block_ids": [3]}, cache)
    streamed = ReadRequest("s", (), (0, 2), (0, 4), num_tokens=17, format="tokens",
                           wait_s=5.0, tokens_hash="ab" * 8)
    got = answered_request(streamed, {"block_ids": [7, 1, 2]}, cache)
    assert got.block_ids == (7, 1, 2) and got.wait_s is None and got.tokens_hash is None
    for bad in ([7, 1, 24], [7, 1, -1], [7, 1, True], [7, 1.0, 2]):
        with pytest.raises(ValueError, match="ids < 24"):
            answered_request(streamed, {"block_ids": bad}, cache)


def test_block_ids_are_checked_the_same_at_c_speed() -> None:
    class Id(enum.IntEnum):
        A = 7

    assert ReadRequest("r", (Id.A, 8), (0, 1), (0, 1)).block_ids == (7, 8)  # an int subclass
    assert ReadRequest("r", list(range(512)), (0, 1), (0, 1)).block_ids == tuple(range(512))
    for bad in ((1, True), (1, -1), (1, 2.0), (1, "2"), (None,)):
        with pytest.raises(ValueError, match="block_ids"):
            ReadRequest("r", bad, (0, 1), (0, 1))
    with pytest.raises(ValueError, match="non-empty"):
        ReadRequest("r", (), (0, 1), (0, 1))


def test_a_plan_without_a_view() -> None:
    kv = torch.zeros(16, 2, 2, 2, 4, 8)
    req = ReadRequest("r", (4, 5, 6), (0, 2), (0, 2))
    with_view, without = plan_read(kv, req), plan_read(kv, req, view=False)
    assert with_view.zero_copy is not None and without.zero_copy is None
    assert (with_view.shape, with_view.nbytes) == (without.shape, without.nbytes)
    assert without.nbytes == 4 * 3 * 2 * 2 * 2 * 4 * 8
    assert without.shape == payload_shape(tuple(kv.shape), req)


def test_canonical_is_sorted_compact_ascii() -> None:
    text = canonical({"b": [1, {"d": 1, "c": "é"}], "a": 0.5, "proof": "x"})
    assert text == '{"a":0.5,"b":[1,{"c":"\\u00e9","d":1}]}'
    assert json.loads(text) == {"a": 0.5, "b": [1, {"c": "é", "d": 1}]}
