"""How both daemons judge silence: the heartbeat ticker (protocol/net/heartbeat.py), and
the sender's look at what a receiver's kernel acknowledged (protocol/net/peers.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import zmq.asyncio

from protocol.net.heartbeat import STALL_GRACE, ticks
from protocol.net.peers import Peer
from protocol.net.sockets import DealerSocket, RouterSocket


async def test_a_tick_after_the_loop_was_blocked_counts_as_stalled() -> None:
    interval = 0.02
    seen = []
    async for now, stalled in ticks(interval):
        seen.append((now, stalled))
        if len(seen) == 1:
            time.sleep(2 * interval + STALL_GRACE + 0.1)  # the loop blocked: the next tick comes late
        if len(seen) == 2:
            break
    assert seen[1][1] is True
    assert seen[1][0] - seen[0][0] > 2 * interval + STALL_GRACE


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's byte counts are read on Linux only")
async def test_a_receiver_whose_kernel_acknowledges_our_bytes_is_not_silent(tmp_path: Path) -> None:
    """The sender's side of a slow link: a receiver's heartbeats can queue behind the
    version it is taking in, so its kernel acknowledging more of our bytes (read on the
    connection its messages come on) is life; acknowledging nothing more is silence, and a
    connection with no count (ipc) is judged by messages alone."""
    context = zmq.asyncio.Context.instance()
    router = RouterSocket(context, "tcp://127.0.0.1:0")
    dealer = DealerSocket(context, router.endpoint, b"r0")
    local = RouterSocket(context, f"ipc://{tmp_path}/s")
    over_ipc = DealerSocket(context, local.endpoint, b"r1")
    try:
        await dealer.send([b"hello"])
        identity, _, fd = await asyncio.wait_for(router.recv(), 10)
        peer = Peer(identity)
        peer.heard(fd)
        assert peer.link is not None

        peer.last_seen -= 5  # nothing from it for 5 s: the first look only notes the count
        assert peer.silence(time.monotonic(), 0.1) > 4.9
        assert router.try_send(identity, [b"x" * 100_000])
        await asyncio.wait_for(dealer.recv(), 10)
        assert peer.silence(time.monotonic(), 0.1) < 1.0  # its kernel acknowledged 100 kB meanwhile
        peer.last_seen -= 5
        assert peer.silence(time.monotonic(), 0.1) > 4.9  # and nothing since

        dealer.close()
        for _ in range(1000):  # ZeroMQ closes its end a moment later
            if peer.link is None:
                break
            peer.silence(time.monotonic(), 0.1)
            await asyncio.sleep(0.01)
        assert peer.link is None and peer.source is None  # gone: its next message names the new one

        await over_ipc.send([b"hello"])
        identity, _, fd = await asyncio.wait_for(local.recv(), 10)
        other = Peer(identity)
        other.heard(fd)
        other.last_seen -= 5
        assert other.link is None and other.silence(time.monotonic(), 0.1) > 4.9
    finally:
        over_ipc.close()
        for sock in (router, local):
            await sock.aclose()
