"""Typed message bodies (protocol/wire/messages.py): the bytes on the wire are those the
dict-building code produced before the records existed, and an untrusted body with a
field of the wrong type is a ProtocolError that names the message and the field.

Every expected body below is written out literally, key order included (msgpack keeps
it, so the order is part of the bytes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch

import receiver
import sender
from protocol.errors import UNKNOWN_PEER, ConfigError, ProtocolError, StateError, WeightSyncError
from protocol.net.peers import Peer
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, decode_message, encode_message
from protocol.wire.messages import Ack, Description, DigestReply, DigestRequest, ErrorReport, Hello, Nack, Welcome
from protocol.wire.metadata import ModelMetadata
from receiver.session.relay import Relay

META = ModelMetadata(("emb.weight", "head.weight"), ((4, 2), (4, 2)), (torch.float32, torch.bfloat16))
META_BODY = {"keys": ["emb.weight", "head.weight"], "shapes": [[4, 2], [4, 2]], "dtypes": [1, 3]}

# (record, the body the old code built for it)
CASES: list[tuple[Any, dict[str, Any]]] = [
    (Hello(META, receiver="r1", applied=7, digest="ab12", session="s0"),
     {"keys": ["emb.weight", "head.weight"], "shapes": [[4, 2], [4, 2]], "dtypes": [1, 3],
      "receiver": "r1", "applied": 7, "digest": "ab12", "session": "s0"}),
    (Hello(META, receiver="", applied=None, digest=None, session=None),
     {"keys": ["emb.weight", "head.weight"], "shapes": [[4, 2], [4, 2]], "dtypes": [1, 3],
      "receiver": "", "applied": None, "digest": None, "session": None}),
    (Welcome("patch", ((1, 0),), 3), {"strategy": "patch", "aliases": [[1, 0]], "bootstrap": 3}),
    (Welcome("bucket", (), 0), {"strategy": "bucket", "aliases": [], "bootstrap": 0}),
    (Ack(), {}),
    (Ack((3, 6)), {"below": [3, 6]}),
    (Ack((2, None)), {"below": [2, None]}),
    (Ack((2, 4), 5, ("leaf", "relay2/leaf")), {"below": [2, 4], "staged": 5, "missing": ["leaf", "relay2/leaf"]}),
    (Hello(META, receiver="r", flip=True, subtree=True),
     {**META_BODY, "receiver": "r", "applied": None, "digest": None, "session": None, "flip": True, "subtree": True}),
    (Welcome("patch", (), 0, together=True, stage_timeout=2.5),
     {"strategy": "patch", "aliases": [], "bootstrap": 0, "together": True, "stage_timeout": 2.5}),
    (Nack("IntegrityError", "tensor 3: checksum mismatch"), {"reason": "IntegrityError", "message": "tensor 3: checksum mismatch"}),
    (DigestRequest("n1", digest=False), {"nonce": "n1", "digest": False}),
    (DigestRequest("n1", digest=True), {"nonce": "n1", "digest": True}),
    (DigestRequest("n1", metadata=True), {"nonce": "n1", "metadata": True}),
    (DigestReply("n1", "ab12"), {"nonce": "n1", "digest": "ab12"}),
    (DigestReply("n1", None), {"nonce": "n1", "digest": None}),
    (Description("n1", None), {"nonce": "n1", "digest": None, "metadata": None}),
    (Description("n1", META), {"nonce": "n1", "digest": None, "metadata": META_BODY}),
    (ErrorReport(UNKNOWN_PEER, "say HELLO"), {"code": "unknown_peer", "message": "say HELLO"}),
    (ErrorReport.of(StateError("asleep")), {"code": "state", "message": "asleep"}),
    (ErrorReport.of(WeightSyncError("odd")), {"code": "error", "message": "odd"}),
]
IDS = [f"{type(r).__name__}-{i}" for i, (r, _) in enumerate(CASES)]


def packed(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body)


@pytest.mark.parametrize(("record", "expected"), CASES, ids=IDS)
def test_a_record_travels_as_the_old_dict(record: Any, expected: dict[str, Any]) -> None:
    assert packed(record.to_body()) == packed(expected)  # same keys, values and order
    frames = encode_message(record.to_message(5))
    old = encode_message(Message(record.TYPE, version=5, body=expected))
    assert [bytes(f) for f in frames] == [bytes(f) for f in old]
    back = decode_message(frames)
    assert back.type is record.TYPE and back.version == 5
    assert type(record).from_body(back.body) == record


def test_unknown_keys_are_ignored_and_optional_flags_may_be_absent() -> None:
    assert Welcome.from_body({"strategy": "patch", "aliases": [], "bootstrap": 1, "later": {"x": 1}}) == Welcome("patch", (), 1)
    assert DigestRequest.from_body({"nonce": "n"}) == DigestRequest("n")
    assert DigestReply.from_body({"nonce": "n"}) == DigestReply("n", None)
    assert Description.from_body({"nonce": "n", "digest": None}) == Description("n", None)
    assert Hello.from_body(META_BODY) == Hello(META)


BAD: list[tuple[type[Any], dict[Any, Any], str]] = [
    (Hello, {**META_BODY, "applied": "7"}, "HELLO body: 'applied'"),
    (Hello, {**META_BODY, "applied": True}, "HELLO body: 'applied'"),
    (Hello, {**META_BODY, "digest": 5}, "HELLO body: 'digest'"),
    (Hello, {**META_BODY, "session": b"s"}, "HELLO body: 'session'"),
    (Hello, {**META_BODY, "receiver": None}, "HELLO body: 'receiver'"),
    (Hello, {"keys": ["a"], "shapes": [[1]]}, "metadata needs lists"),
    (Welcome, {"strategy": 1, "aliases": [], "bootstrap": 0}, "WELCOME body: 'strategy'"),
    (Welcome, {"strategy": "patch", "aliases": [], "bootstrap": -1}, "WELCOME body: 'bootstrap'"),
    (Welcome, {"strategy": "patch", "aliases": [], "bootstrap": 1.0}, "WELCOME body: 'bootstrap'"),
    (Welcome, {"strategy": "patch", "bootstrap": 0}, "WELCOME body: 'aliases' must be a list of [alias, canonical] ordinals, got nothing"),
    (Welcome, {"strategy": "patch", "aliases": {}, "bootstrap": 0}, "WELCOME body: 'aliases'"),
    (Welcome, {"strategy": "patch", "aliases": [[1, -1]], "bootstrap": 0}, "WELCOME body: 'aliases' has a bad entry"),
    (Welcome, {"strategy": "patch", "aliases": [[1, 0, 2]], "bootstrap": 0}, "WELCOME body: 'aliases' has a bad entry"),
    (Welcome, {"strategy": "patch", "aliases": [[True, 0]], "bootstrap": 0}, "WELCOME body: 'aliases' has a bad entry"),
    (Ack, {"below": [3]}, "ACK body: 'below'"),
    (Ack, {"below": [-1, None]}, "ACK body: 'below'"),
    (Ack, {"below": [1, -2]}, "ACK body: 'below'"),
    (Ack, {"below": None}, "ACK body: 'below'"),
    (Ack, {"missing": "leaf"}, "ACK body: 'missing'"),
    (Ack, {"missing": ["a", 3]}, "ACK body: 'missing'"),
    (Ack, {"missing": [""]}, "ACK body: 'missing'"),
    (Ack, {"missing": ["n"] * 4097}, "ACK body: 'missing'"),
    (Welcome, {"strategy": "patch", "aliases": [], "bootstrap": 0, "stage_timeout": 0}, "WELCOME body: 'stage_timeout'"),
    (Welcome, {"strategy": "patch", "aliases": [], "bootstrap": 0, "stage_timeout": float("nan")}, "WELCOME body: 'stage_timeout'"),
    (Welcome, {"strategy": "patch", "aliases": [], "bootstrap": 0, "stage_timeout": True}, "WELCOME body: 'stage_timeout'"),
    (Hello, {**META_BODY, "subtree": 1}, "HELLO body: 'subtree'"),
    (Nack, {"reason": "X"}, "NACK body: 'message'"),
    (DigestRequest, {"nonce": 3}, "DIGEST_REQUEST body: 'nonce'"),
    (DigestRequest, {"nonce": "n", "digest": 1}, "DIGEST_REQUEST body: 'digest' must be true or false"),
    (DigestReply, {"nonce": "n", "digest": 12}, "DIGEST body: 'digest'"),
    (Description, {"nonce": "n", "metadata": [1]}, "DIGEST body: 'metadata' must be a map or nil"),
    (ErrorReport, {"message": "x"}, "ERROR body: 'code' must be a string, got nothing"),
    (ErrorReport, {"code": "config", "message": None}, "ERROR body: 'message'"),
]


@pytest.mark.parametrize(("record", "body", "says"), BAD, ids=[f"{r.__name__}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_a_bad_field_is_a_protocol_error_naming_it(record: type[Any], body: dict[Any, Any], says: str) -> None:
    with pytest.raises(ProtocolError) as info:
        record.from_body(body)
    assert says in str(info.value)


def test_an_error_report_raises_as_its_class() -> None:
    err = ErrorReport.from_body({"code": "config", "message": "no"}).error("sender reported: ")
    assert type(err) is ConfigError and str(err) == "sender reported: no"


def test_a_peer_ignores_a_malformed_below() -> None:
    peer = Peer(b"p")
    assert peer.report_below({"below": [2, 5]}) and (peer.below, peer.below_acked) == (2, 5)
    for bad in ({"below": [2]}, {"below": ["2", 5]}, {"below": [2, "5"]}, {}, {"below": None}):
        assert not peer.report_below(bad) and (peer.below, peer.below_acked) == (2, 5), bad


class Tied(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 2)
        self.head = torch.nn.Linear(2, 4, bias=False)
        self.head.weight = self.emb.weight
        self.to(dtype)


def body_items(frames: Sequence[Buffer]) -> list[tuple[Any, Any]]:
    """The body as it lies in the header, in wire order."""
    return list(msgpack.unpackb(bytes(frames[0]))["body"].items())


class Stop(Exception):
    pass


async def test_a_receivers_hello_is_the_old_dict() -> None:
    sent: list[Sequence[Buffer]] = []

    async def send(frames: Sequence[Buffer]) -> None:
        sent.append(frames)

    async def recv() -> Sequence[Buffer]:
        raise Stop

    r = receiver.make_receiver({"type": "patch"})
    with pytest.raises(Stop):
        await r.init_receiver(Tied(torch.bfloat16), recv, send, receiver_id="r1", digest="d1")
    assert decode_message(sent[0]).type is MessageType.HELLO
    assert body_items(sent[0]) == list({
        "keys": ["emb.weight", "head.weight"], "shapes": [[4, 2], [4, 2]], "dtypes": [3, 3],
        "receiver": "r1", "applied": None, "digest": "d1", "session": None,
    }.items())


async def test_a_senders_and_a_relays_welcome_are_the_old_dict() -> None:
    hello = Message(MessageType.HELLO, body={**META_BODY, "dtypes": [3, 3], "receiver": "r1", "applied": None, "digest": None, "session": None})
    sent: list[Sequence[Buffer]] = []

    async def send(frames: Sequence[Buffer]) -> None:
        sent.append(frames)

    async def recv() -> Sequence[Buffer]:
        return encode_message(hello)

    s = sender.make_sender({"type": "patch"})
    await asyncio.wait_for(s.init_sender(Tied(), send, recv, version=0), 30)
    welcome, bootstrap = decode_message(sent[0]), [decode_message(f) for f in sent[1:]]
    assert welcome.type is MessageType.WELCOME and bootstrap and all(m.type is MessageType.BOOTSTRAP for m in bootstrap)
    assert body_items(sent[0]) == list({"strategy": "patch", "aliases": [[1, 0]], "bootstrap": len(bootstrap)}.items())

    said = Hello.from_message(hello)
    relay = SimpleNamespace(_strategy=SimpleNamespace(strategy="patch", aliases={0: [1], 2: [3, 4]}, metadata=said.metadata))
    welcome = await Relay.admit(relay, said)  # type: ignore[arg-type]  # only its strategy is read
    msg = dataclasses.replace(welcome, bootstrap=2).to_message(9)  # as the server sends it
    assert (msg.type, msg.version) == (MessageType.WELCOME, 9)
    assert body_items(encode_message(msg)) == list({"strategy": "patch", "aliases": [[1, 0], [3, 2], [4, 2]], "bootstrap": 2}.items())


def test_from_message_refuses_a_message_of_another_type() -> None:
    welcome = Welcome("patch", (), 0).to_message(3)
    assert Welcome.from_message(welcome) == Welcome("patch", (), 0)
    with pytest.raises(ProtocolError, match="expected HELLO, got WELCOME"):
        Hello.from_message(welcome)
