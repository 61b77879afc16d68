"""A receiver's connection as one object (receiver/session/session.py), against a real ROUTER on
loopback: what it routes, what ends it, and that closing it leaves nothing behind."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from protocol.errors import UNKNOWN_PEER, StateError, WeightSyncError, WeightSyncTimeout, error_code
from protocol.net.sockets import DealerSocket
from protocol.wire.framing import Message, MessageType, decode_message, encode_message
from protocol.wire.limits import DEFAULT_LIMITS
from protocol.wire.messages import Ack, DigestReply, DigestRequest, ErrorReport, Welcome
from receiver.session.session import Leave, Reconnect, Session

T = 10.0


@pytest.fixture
async def upstream() -> AsyncIterator[zmq.asyncio.Socket]:
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:*")
    yield router
    router.close(linger=0)


def session(peer_timeout: float = 30.0) -> Session:
    return Session("r1", heartbeat=lambda: (7, Ack()), heartbeat_interval=0.05, peer_timeout=peer_timeout)


async def opened(upstream: zmq.asyncio.Socket, link: Session) -> bytes:
    """Open ``link`` to ``upstream`` and return its identity as the ROUTER sees it (from a heartbeat)."""
    link.open(zmq.asyncio.Context.instance(), upstream.getsockopt_string(zmq.LAST_ENDPOINT), curve=None, limits=DEFAULT_LIMITS)
    identity, frame, *_ = await asyncio.wait_for(upstream.recv_multipart(), T)
    heartbeat = decode_message([frame])
    assert (heartbeat.type, heartbeat.version) == (MessageType.HEARTBEAT, 7)
    return identity


async def send(upstream: zmq.asyncio.Socket, identity: bytes, msg: Message) -> None:
    await upstream.send_multipart([identity, *encode_message(msg)])


async def test_updates_before_welcome_are_dropped_and_bye_ends_the_session(upstream: zmq.asyncio.Socket) -> None:
    link = session()
    identity = await opened(upstream, link)
    stale = Message(MessageType.PATCH, version=3, base_version=2)  # a previous connection's, still on its way
    await send(upstream, identity, stale)
    await send(upstream, identity, Welcome("patch", (), 0).to_message(5))
    await send(upstream, identity, stale)  # after WELCOME: this session's
    assert decode_message(await asyncio.wait_for(link.recv(), T)).type is MessageType.WELCOME
    assert decode_message(await asyncio.wait_for(link.recv(), T)).type is MessageType.PATCH
    await send(upstream, identity, Message(MessageType.BYE))
    with pytest.raises(Reconnect, match="goodbye"):
        await asyncio.wait_for(link.recv(), T)
    await link.close()


@pytest.mark.parametrize("code, why", [(UNKNOWN_PEER, "does not know"), (error_code(StateError("x")), "cannot serve")])
async def test_an_upstream_that_forgot_us_or_cannot_serve_ends_the_session(upstream: zmq.asyncio.Socket, code: str, why: str) -> None:
    link = session()
    identity = await opened(upstream, link)
    await send(upstream, identity, ErrorReport(code, "say HELLO").to_message())
    with pytest.raises(Reconnect, match=why):
        await asyncio.wait_for(link.recv(), T)
    await link.close()


async def test_ask_is_answered_by_nonce_and_close_fails_the_queries_left(upstream: zmq.asyncio.Socket) -> None:
    link = session()
    identity = await opened(upstream, link)
    asked = asyncio.create_task(link.ask(7, True, T))
    while True:  # heartbeats come too; answer the request
        _, frame, *_ = await asyncio.wait_for(upstream.recv_multipart(), T)
        msg = decode_message([frame])
        if msg.type is MessageType.DIGEST_REQUEST:
            break
    request = DigestRequest.from_body(msg.body)
    await send(upstream, identity, DigestReply("not-the-nonce", "bad").to_message(1))  # nobody's: ignored
    await send(upstream, identity, DigestReply(request.nonce, "abc").to_message(9))
    assert await asyncio.wait_for(asked, T) == (9, "abc")
    with pytest.raises(WeightSyncTimeout):
        await link.ask(7, False, 0.05)  # nobody answers
    pending = asyncio.create_task(link.ask(7, False, None))
    await asyncio.sleep(0.05)
    await link.close()
    with pytest.raises(WeightSyncError, match="ended before it answered"):
        await asyncio.wait_for(pending, T)
    assert not link.is_open and all(t.done() for t in link._tasks)
    with pytest.raises(WeightSyncError, match="not connected"):
        await link.ask(7, False, 1.0)


async def test_leave_before_open_and_silence_end_the_session(upstream: zmq.asyncio.Socket) -> None:
    link = session()
    link.leave("asked to leave")  # while the receiver still prepares its HELLO
    with pytest.raises(Leave):
        await link.recv()
    await link.close()
    quiet = session(peer_timeout=0.2)
    await opened(upstream, quiet)  # the upstream never answers
    with pytest.raises(Reconnect, match="no message from the sender"):
        await asyncio.wait_for(quiet.recv(), T)
    await quiet.close(Message(MessageType.BYE))


async def test_a_task_that_dies_ends_the_session(upstream: zmq.asyncio.Socket) -> None:
    def broken() -> tuple[int | None, Ack]:
        raise RuntimeError("heartbeat body failed")

    link = Session("r1", heartbeat=broken, heartbeat_interval=0.05, peer_timeout=30.0)
    link.open(zmq.asyncio.Context.instance(), upstream.getsockopt_string(zmq.LAST_ENDPOINT), curve=None, limits=DEFAULT_LIMITS)
    with pytest.raises(Reconnect, match="heartbeat body failed"):
        await asyncio.wait_for(link.recv(), T)
    await link.close()


async def test_two_asks_at_once_each_get_their_own_answer(upstream: zmq.asyncio.Socket) -> None:
    link = session()
    identity = await opened(upstream, link)
    first, second = asyncio.create_task(link.ask(7, False, T)), asyncio.create_task(link.ask(7, True, T))
    requests: list[DigestRequest] = []
    while len(requests) < 2:
        _, frame, *_ = await asyncio.wait_for(upstream.recv_multipart(), T)
        msg = decode_message([frame])
        if msg.type is MessageType.DIGEST_REQUEST:
            requests.append(DigestRequest.from_body(msg.body))
    for request in reversed(requests):  # answered in the other order, each by what it asked
        digest = "with-digest" if request.digest else None
        await send(upstream, identity, DigestReply(request.nonce, digest).to_message(2 if request.digest else 1))
    assert await asyncio.wait_for(first, T) == (1, None)
    assert await asyncio.wait_for(second, T) == (2, "with-digest")
    await link.close()


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's byte count is read on Linux only")
async def test_bytes_received_counts_what_arrives_over_tcp_and_nothing_over_ipc(upstream: zmq.asyncio.Socket, tmp_path: Path) -> None:
    """What the silence check counts: the kernel's bytes received on the TCP connection,
    which move with every message (framing included); an ipc socket has no count."""
    context = zmq.asyncio.Context.instance()
    tcp = DealerSocket(context, upstream.getsockopt_string(zmq.LAST_ENDPOINT), b"b1")
    local = context.socket(zmq.ROUTER)
    local.linger = 0
    local.bind(f"ipc://{tmp_path}/s")
    ipc = DealerSocket(context, f"ipc://{tmp_path}/s", b"b2")
    watches = [asyncio.create_task(s.watch(name)) for s, name in ((tcp, "b1"), (ipc, "b2"))]
    try:
        for sock, router in ((tcp, upstream), (ipc, local)):
            await sock.send([b"hello"])
            identity, _ = await asyncio.wait_for(router.recv_multipart(), T)
        counted = tcp.bytes_received()
        for _ in range(int(T / 0.01)):  # the CONNECTED event reaches watch() a moment after the connect
            if counted is not None:
                break
            await asyncio.sleep(0.01)
            counted = tcp.bytes_received()
        assert counted is not None
        await upstream.send_multipart([b"b1", b"x" * 100_000])
        await asyncio.wait_for(tcp.recv(), T)
        after = tcp.bytes_received()
        assert after is not None and after - counted >= 100_000
        await local.send_multipart([identity, b"y" * 1000])
        await asyncio.wait_for(ipc.recv(), T)
        assert ipc.bytes_received() is None
    finally:
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        tcp.close()
        ipc.close()
        local.close(linger=0)


async def test_a_receiver_pointed_at_something_else_says_so_once_and_backs_off(
    upstream: zmq.asyncio.Socket, caplog: pytest.LogCaptureFixture
) -> None:
    """A ZeroMQ peer that is not a weightsync sender answers HELLO with bytes that are no
    weightsync message: the receiver names the address and what it got, once (ERROR), then
    retries quietly with a backoff growing past its usual cap (it logged a msgpack error at
    every try, every 2 s, forever)."""
    import logging

    import torch

    from receiver import Receiver

    endpoint = upstream.getsockopt_string(zmq.LAST_ENDPOINT)
    hellos = 0

    async def answer_with_garbage() -> None:
        nonlocal hellos
        while True:
            identity, *frames = await upstream.recv_multipart()
            if frames:  # any message (HELLO, heartbeats): answered with something else
                hellos += 1
                await upstream.send_multipart([identity, b"HTTP/1.1 400 Bad Request\r\n\r\n"])

    peer = asyncio.create_task(answer_with_garbage())
    model = torch.nn.Linear(4, 4)
    receiver = Receiver(model, endpoint, None, identity="lost", reconnect_backoff=(0.05, 0.2), heartbeat_interval=0.05)
    try:
        with caplog.at_level(logging.DEBUG, logger="receiver.session.follower"):
            with pytest.raises((WeightSyncTimeout, TimeoutError, WeightSyncError)):  # no bootstrap ever comes
                await receiver.start(timeout=4.0)
            await receiver.close()  # no try under way while counting
    finally:
        peer.cancel()
        await receiver.close()
    said = [r for r in caplog.records if "not a weightsync message" in r.getMessage()]
    errors = [r for r in said if r.levelno == logging.ERROR]
    assert len(errors) == 1 and endpoint in errors[0].getMessage(), [r.getMessage() for r in said]
    assert receiver.reconnects >= 2 and len(said) in (receiver.reconnects, receiver.reconnects + 1)  # every later try at DEBUG only
    assert receiver.reconnects <= 12  # backing off past the 0.2 s cap: 4 s at 0.2 s would be ~20 tries
