"""``Receiver.close()`` stops everything the receiver started: once it returns, no task it
created is pending and no thread it started is alive or still working for it.

A real ``Sender`` and real receivers over tcp:// sockets apply a few versions, then close:
a plain receiver, a relay with a leaf below it, and a receiver closed while a version's
decode runs on its thread (``receiver/threads.py``: close waits for that thread).

What is shared by design and outlives one receiver is named here, not counted: the event
loop's default executor (``asyncio_*``, idle, shut down with the loop), the codec pool
(``weightsync-codec_*``, ``protocol/codec/parallel.py``: one per process), the ZAP handler
(``weightsync-zap``, one per ZeroMQ context), pyzmq's garbage collector thread (one per
process), and what the sender in the same process runs (``weightsync-encode_*`` threads,
``weightsync-sender-*`` tasks: the sender's own shutdown is not tested here).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, assert_matches, receiver_model
from zmq.utils.garbage import GarbageCollectorThread

from protocol.errors import WeightSyncError
from receiver import Receiver
from receiver.strategy.base import ReceiverBase
from sender import Sender

SHARED_THREADS = ("asyncio_", "weightsync-codec", "weightsync-zap", "weightsync-encode")
SENDER_TASKS = "weightsync-sender-"


def _shared(thread: threading.Thread) -> bool:
    return thread.name.startswith(SHARED_THREADS) or isinstance(thread, GarbageCollectorThread)


@contextmanager
def nothing_left_running() -> Iterator[None]:
    """Around starting and closing receivers: after, no thread started inside is alive
    (each joined for at most 2 s first) and no task created inside is pending."""
    threads = set(threading.enumerate())
    tasks = asyncio.all_tasks()
    yield
    started = [t for t in threading.enumerate() if t not in threads and not _shared(t)]
    for t in started:
        t.join(timeout=2)
    assert [t.name for t in started if t.is_alive()] == []
    pending = [t for t in asyncio.all_tasks() - tasks if not t.done() and not t.get_name().startswith(SENDER_TASKS)]
    assert pending == []


@asynccontextmanager
async def _sender(trainer: Trainer, mode: str) -> AsyncIterator[Sender]:
    """A sender at the trainer's version, closed at the end whatever happened."""
    sender = Sender("tcp://127.0.0.1:0", CONFIGS[mode], **DAEMON_KW)
    await asyncio.wait_for(sender.start(trainer.model, version=trainer.version), T)
    try:
        yield sender
    finally:
        await asyncio.wait_for(sender.close(), T)


async def _receiver(upstream: str, mode: str, identity: str, **kw: Any) -> Receiver:
    r = Receiver(receiver_model(), upstream, CONFIGS[mode], identity=identity, **{**DAEMON_KW, **kw})
    await r.start(timeout=T)
    return r


@pytest.mark.parametrize("mode", ["patch", "patch-device", "bucket"])
async def test_a_closed_receiver_leaves_nothing_running(mode: str) -> None:
    trainer = Trainer()
    async with _sender(trainer, mode) as sender:
        with nothing_left_running():
            r = await _receiver(sender.endpoint, mode, "r", control_address="127.0.0.1:0")
            for _ in range(3):
                version = await trainer.step_and_sync(sender)
                await r.wait_for_version(version, timeout=T)
            await assert_matches(r, trainer, version)
            await asyncio.wait_for(r.close(), T)
        assert not r.healthy


@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_a_closed_relay_and_its_leaf_leave_nothing_running(mode: str) -> None:
    trainer = Trainer()
    async with _sender(trainer, mode) as sender:
        with nothing_left_running():
            relay = await _receiver(sender.endpoint, mode, "relay", relay_endpoint="tcp://127.0.0.1:0")
            assert relay.relay_endpoint is not None
            leaf = await _receiver(relay.relay_endpoint, mode, "leaf")
            for _ in range(3):
                version = await trainer.step_and_sync(sender)
                for r in (relay, leaf):
                    await r.wait_for_version(version, timeout=T)
            await assert_matches(leaf, trainer, version)
            await asyncio.wait_for(relay.close(), T)  # the parent first: the leaf is left reconnecting
            await asyncio.wait_for(leaf.close(), T)


async def test_close_mid_transfer_waits_for_the_decode_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while a patch decodes on its thread, the receiver returns from ``close`` only
    once that thread is done with it: nothing decodes into its buffers after ``close``."""
    trainer = Trainer()
    decode = ReceiverBase._decode
    slow, entered, release = False, threading.Event(), threading.Event()
    done: list[str] = []

    def slowed(self: ReceiverBase, *args: Any) -> Any:
        if not slow:
            return decode(self, *args)
        entered.set()
        release.wait(T)
        try:
            return decode(self, *args)
        finally:
            done.append("decoded")

    monkeypatch.setattr(ReceiverBase, "_decode", slowed)
    async with _sender(trainer, "patch") as sender:
        try:
            with nothing_left_running():
                r = await _receiver(sender.endpoint, "patch", "r")
                slow = True
                await trainer.step_and_sync(sender)
                assert await asyncio.to_thread(entered.wait, T), "the patch never reached its decode"
                closing = asyncio.create_task(r.close())
                for _ in range(20):  # let close go as far as it can while the thread is held
                    await asyncio.sleep(0.01)
                assert not closing.done(), "close returned while the receiver's decode thread still ran"
                release.set()
                await asyncio.wait_for(closing, T)
                assert done == ["decoded"]
                assert r.version == 0  # the version being decoded was never committed
        finally:
            release.set()


async def test_close_twice_at_once_returns_only_when_everything_stopped() -> None:
    """A second ``close`` while the first runs waits for the first (it does not return early,
    with the session still being torn down); one cancelled caller does not stop the close;
    ``start`` after ``close`` is refused."""
    trainer = Trainer()
    async with _sender(trainer, "patch") as sender:
        with nothing_left_running():
            before = asyncio.all_tasks()
            r = await _receiver(sender.endpoint, "patch", "r", relay_endpoint="tcp://127.0.0.1:0")
            version = await trainer.step_and_sync(sender)
            await r.wait_for_version(version, timeout=T)
            first = asyncio.create_task(r.close())
            cancelled = asyncio.create_task(r.close())
            await asyncio.sleep(0)  # both under way
            cancelled.cancel()
            await r.close()
            # the first caller may not have resumed yet; nothing of the receiver's is left
            left = {t for t in asyncio.all_tasks() - before if not t.done() and not t.get_name().startswith(SENDER_TASKS)}
            left -= {first, cancelled}
            assert left == set(), "a second close returned before the first finished"
            await asyncio.wait_for(first, T)
            with pytest.raises(asyncio.CancelledError):
                await cancelled
        assert not r.healthy
        with pytest.raises(WeightSyncError, match="closed"):
            await r.start(timeout=T)


async def test_close_while_start_compiles_starts_no_session() -> None:
    """``close`` while ``start`` is still preparing (compiling the kernels on a fresh install):
    ``start`` raises once the preparation ends, and no session is started to outlive close."""
    trainer = Trainer()
    async with _sender(trainer, "patch") as sender:
        with nothing_left_running():
            r = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="r", **DAEMON_KW)
            prepare, preparing, release = r.strategy.prepare, asyncio.Event(), asyncio.Event()

            async def slow_prepare() -> None:
                preparing.set()
                await release.wait()
                await prepare()

            r.strategy.prepare = slow_prepare  # type: ignore[method-assign]
            starting = asyncio.create_task(r.start(timeout=T))
            await asyncio.wait_for(preparing.wait(), T)
            await asyncio.wait_for(r.close(), T)
            release.set()
            with pytest.raises(WeightSyncError, match="closed while it started"):
                await asyncio.wait_for(starting, T)
        assert not r.healthy and r.version is None
        assert sender.receivers == {}  # it never said HELLO
