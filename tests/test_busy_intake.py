"""A busy receiver keeps reading its socket: ``on_update`` hooks run in their own task, a
version is announced by its first part's arrival and by the sender's publication, and so
``reading(max_lag=k)`` holds while a hook or a commit is slow.

The scenario a user hit: one receiver whose ``on_update`` hook takes 0.4 s, a trainer
syncing a version every 0.1 s, readers polling every 30 ms: ``reading(max_lag=1)`` yielded
weights 4 versions behind, because the hook was awaited in the session loop and nothing was
read meanwhile. Real sender, receivers and relays over TCP loopback, real AdamW steps,
heartbeats at 0.5 s (the default), so that heartbeats alone could not keep it current.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import pytest
from daemon_helpers import CONFIGS, PEER_TIMEOUT, T, Trainer, receiver_model, wait_until

from protocol.errors import ConfigError
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message, MessageType, encode_message, peek_version
from protocol.wire.messages import Beat
from receiver import Receiver
from receiver.session.lag import Latest
from receiver.session.updates import UpdateHooks
from sender import Sender

SLOW = 0.4  # seconds a slow hook or commit takes
EVERY = 0.1  # seconds between the trainer's versions
POLL = 0.03  # seconds between a reader's reads
VERSIONS = 14
KW: dict[str, Any] = {"heartbeat_interval": 0.5, "peer_timeout": PEER_TIMEOUT}


# -- the hooks' task (no sockets) ------------------------------------------------------------------
async def test_hooks_are_told_in_order_one_version_at_a_time_and_failures_are_counted() -> None:
    hooks = UpdateHooks("r", timeout=5.0)
    told: list[tuple[str, int | None]] = []
    running = 0

    async def slow(v: int | None) -> None:
        nonlocal running
        running += 1
        assert running == 1  # one version at a time
        await asyncio.sleep(0.01)
        told.append(("slow", v))
        running -= 1

    def failing(v: int | None) -> None:
        told.append(("failing", v))
        raise RuntimeError(f"bad at {v}")

    hooks.add(slow)
    hooks.add(failing)
    for v in range(1, 6):
        hooks.published(v)  # never waits
    assert hooks.waiting == 5 and told == []
    await hooks.idle(T)
    assert told == [(name, v) for v in range(1, 6) for name in ("slow", "failing")]
    assert hooks.counts.calls == 10 and hooks.counts.failures == 5 and hooks.counts.timeouts == 0
    assert hooks.counts.last_error is not None and "RuntimeError: bad at 5" in hooks.counts.last_error
    assert hooks.waiting == 0
    await hooks.close()


async def test_a_hook_that_never_returns_is_cancelled_at_its_timeout_and_the_next_versions_go_on() -> None:
    hooks = UpdateHooks("r")
    cancelled: list[int | None] = []
    told: list[int | None] = []

    async def stuck(v: int | None) -> None:
        if v == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(v)
                raise

    hooks.add(stuck, timeout=0.2)
    hooks.add(told.append)
    began = time.monotonic()
    hooks.published(1)
    hooks.published(2)
    await hooks.idle(T)
    assert cancelled == [1] and told == [1, 2] and hooks.counts.timeouts == 1
    assert 0.2 <= time.monotonic() - began < 5
    assert "timeout of 0.2s" in (hooks.counts.last_error or "")

    def blocking(v: int | None) -> None:  # sync: runs on the loop, cannot be stopped, is reported
        time.sleep(0.15)

    hooks.add(blocking, timeout=0.05)
    hooks.published(3)
    await hooks.idle(T)
    assert hooks.counts.timeouts == 2 and "blocked the event loop" in (hooks.counts.last_error or "")
    await hooks.close()


async def test_a_full_backlog_skips_the_oldest_and_close_cancels_the_hook_running() -> None:
    hooks = UpdateHooks("r", backlog=3)
    gate = asyncio.Event()
    told: list[int | None] = []
    stopped: list[int | None] = []

    async def held(v: int | None) -> None:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            stopped.append(v)
            raise
        told.append(v)

    hooks.add(held)
    hooks.published(1)
    await asyncio.sleep(0.05)  # v1 is being told
    for v in range(2, 7):
        hooks.published(v)
    assert hooks.counts.skipped == 2 and hooks.waiting == 4  # 2 and 3 dropped; 4, 5, 6 wait behind v1
    gate.set()
    await hooks.idle(T)
    assert told == [1, 4, 5, 6]
    gate.clear()
    hooks.published(7)
    await asyncio.sleep(0.05)
    await hooks.close()
    assert stopped == [7]
    hooks.published(8)  # closed: nothing starts again
    await hooks.idle(1)
    assert told == [1, 4, 5, 6]
    with pytest.raises(ConfigError, match="timeout"):
        hooks.add(told.append, timeout=0)


# -- what announces a version: the sender's news, a first part -------------------------------------
def test_news_beats_say_the_version_but_not_the_pace() -> None:
    assert Beat(news=True).to_body() == {"news": True} and Beat.from_body({"news": True}).news
    assert not Beat.from_body({}).news  # an older server's heartbeat
    latest = Latest(0.5)
    latest.beat(1, now=10.0)
    latest.beat(1, now=10.5)
    assert latest.age(10.5) == 0.0
    assert latest.beat(2, now=10.6, paced=False)  # a version announced: news, and the pace kept
    assert latest.beat(2, now=11.0) is False and latest.age(11.0) == 0.0  # 0.5 s after the last paced beat: current
    heard: list[int] = []
    latest.listen(heard.append)
    latest.saw(3)
    latest.saw(3)
    assert heard == [3]


def test_peek_version_reads_a_header_whose_checksum_holds_and_only_a_newer_version() -> None:
    frames = encode_message(Message(MessageType.PATCH, session="s" * 32, seq=4, version=17, base_version=16, part=0))
    assert peek_version(frames) == 17 and peek_version(frames, 16) == 17
    assert peek_version(frames, 17) is None and peek_version(frames, 40) is None
    head = bytearray(frames[0])
    at = bytes(head).find(b"\xa7version") + len(b"\xa7version")
    head[at] = 99  # the version's byte changed: the checksum no longer holds
    assert peek_version([bytes(head), *frames[1:]]) is None
    assert peek_version([b"\x93garbage"]) is None and peek_version([b""]) is None


# -- the scenario, end to end ----------------------------------------------------------------------
@dataclass
class Reads:
    """Each read's (the sender's version when it began, the version it held)."""

    seen: list[tuple[int, int | None]] = field(default_factory=list)

    def worst(self) -> int:
        return max((began - (held if held is not None else -1) for began, held in self.seen), default=0)


def slow_writes(seconds: float) -> Callable[[Callable[[], AbstractAsyncContextManager[Any]]], Callable[[], AbstractAsyncContextManager[Any]]]:
    """``Receiver(wrap_write=)``: every version's write takes ``seconds`` longer (an engine's slow install)."""

    def wrap(writing: Callable[[], AbstractAsyncContextManager[Any]]) -> Callable[[], AbstractAsyncContextManager[Any]]:
        @contextlib.asynccontextmanager
        async def slow() -> AsyncIterator[None]:
            async with writing():
                yield
                await asyncio.sleep(seconds)

        return slow

    return wrap


async def run_scenario(mode: str, where: str, slow: str, max_lag: int) -> tuple[Reads, Receiver, list[int | None], Trainer]:
    trainer = Trainer()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS[mode], **KW)
    await sender.start(trainer.model, version=trainer.version)
    opened: list[Receiver] = []
    try:
        endpoint = sender.endpoint
        if where == "relay":
            relay = Receiver(receiver_model(), endpoint, CONFIGS[mode], identity="relay", relay_endpoint="tcp://127.0.0.1:0", **KW)
            opened.append(relay)
            await relay.start(timeout=T)
            assert relay.relay_endpoint is not None
            endpoint = relay.relay_endpoint
        wrap = slow_writes(SLOW) if slow == "commit" else None
        r = Receiver(receiver_model(), endpoint, CONFIGS[mode], identity="busy", wrap_write=wrap, **KW)
        opened.append(r)
        hooked: list[int | None] = []

        async def hook(v: int | None) -> None:
            await asyncio.sleep(SLOW)
            hooked.append(v)

        if slow == "hook":
            r.on_update(hook)
        else:
            r.on_update(hooked.append)
        await r.start(timeout=T)
        reads, done = Reads(), asyncio.Event()

        async def reader() -> None:
            while not done.is_set() or r.version != trainer.version:
                began = sender.version
                assert began is not None
                async with r.reading(max_lag=max_lag, timeout=T) as held:
                    reads.seen.append((began, held))
                    assert held == r.version
                    if len(reads.seen) % 7 == 0:  # now and then, the weights read are the version's, bit for bit
                        assert held is not None and state_digest(r.model.state_dict()) == trainer.digests[held]
                await asyncio.sleep(POLL)

        readers = [asyncio.create_task(reader()) for _ in range(2)]
        for _ in range(VERSIONS):
            await trainer.step_and_sync(sender)
            await asyncio.sleep(EVERY)
        done.set()
        await asyncio.wait_for(asyncio.gather(*readers), T)
        await r.hooks_idle(T)
        return reads, r, hooked, trainer
    finally:
        for receiver in reversed(opened):
            await receiver.close()
        await sender.close()


@pytest.mark.parametrize(("mode", "where", "slow"), [
    ("patch", "direct", "hook"), ("bucket", "direct", "hook"), ("patch", "relay", "hook"),
    ("patch", "direct", "commit"), ("patch", "relay", "commit"),
])
async def test_max_lag_holds_while_a_hook_or_a_commit_is_slow(mode: str, where: str, slow: str) -> None:
    """Never more than ``k`` versions behind what the sender had published when the read
    began, plus the one announcement in flight."""
    k = 1
    reads, r, hooked, trainer = await run_scenario(mode, where, slow, k)
    assert reads.worst() <= k + 1, reads.seen
    if slow == "hook":  # the commits kept up: readers were served all along
        assert len(reads.seen) > 20, reads.seen
    else:  # each commit is slower than the trainer: readers waited (never served stale weights), then were served
        assert r.lag_waits.count > 0 and len(reads.seen) >= 2, reads.seen
    assert r.version == trainer.version
    assert hooked == sorted(hooked) and len(set(hooked)) == len(hooked)  # in order, each once
    assert r.hook_counts.failures == r.hook_counts.timeouts == 0
    if slow == "hook":  # the hook was slower than the trainer: its backlog, not the commits, fell behind
        assert len(hooked) >= 3 and r.hook_counts.calls == len(hooked)


async def test_the_session_reads_on_while_a_hook_never_returns() -> None:
    """A hook stuck for good: versions keep committing and readers keep being served; the
    hook is cancelled at its timeout, counted, and the next versions reach it."""
    trainer = Trainer()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **KW)
    await sender.start(trainer.model, version=trainer.version)
    r = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="stuck", **KW)
    told: list[int | None] = []

    async def stuck(v: int | None) -> None:
        if v == 1:
            await asyncio.Event().wait()
        told.append(v)

    r.on_update(stuck, timeout=1.0)
    try:
        await r.start(timeout=T)
        for _ in range(3):
            await trainer.step_and_sync(sender)
            await r.wait_for_version(trainer.version, timeout=T)  # committed while v1's hook hangs
        async with r.reading(max_lag=0, timeout=T) as held:
            assert held == 3
        await r.hooks_idle(T)
        assert r.hook_counts.timeouts == 1 and told == [0, 2, 3]
        status = r.status()["hooks"]
        assert status["timeouts"] == 1 and status["waiting"] == 0 and "stuck at v1" in status["last_error"]
        assert [(name.rpartition(".")[2], n) for name, n in status["by_hook"].items()] == [("stuck", 1)]  # which hook, by name
        text = r.metrics.render()[0].decode()
        assert 'weightsync_receiver_hook_failures_total{reason="timeout"} 1.0' in text, text
    finally:
        await r.close()
        await sender.close()


async def test_a_hook_added_after_start_and_close_while_a_hook_runs() -> None:
    trainer = Trainer()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **KW)
    await sender.start(trainer.model, version=trainer.version)
    r = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="late", **KW)
    running = asyncio.Event()
    cancelled = asyncio.Event()

    async def long(v: int | None) -> None:
        running.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        await r.start(timeout=T)
        r.on_update(long)
        await trainer.step_and_sync(sender)
        await asyncio.wait_for(running.wait(), T)
    finally:
        began = time.monotonic()
        await r.close()  # does not wait for the hook: cancels it
        await sender.close()
    assert cancelled.is_set() and time.monotonic() - began < 10
    await wait_until(lambda: r.status()["hooks"]["waiting"] == 0)
