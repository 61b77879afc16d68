"""The Sender and Receiver daemons in-process, over real ZeroMQ sockets.

A trainer does real AdamW steps on the tiny transformer (fp32); bf16 receivers that
start from other weights must hold, after each acknowledged version, exactly the
trainer's weights cast to bf16, bit for bit, over tcp://, ipc:// and inproc://, in
patch and bucket mode, through late joins, receiver and sender restarts, a slow
reader, and a receiver whose model does not match.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from daemon_helpers import CONFIGS, DAEMON_KW, PEER_TIMEOUT, T, Trainer, assert_matches, free_port, receiver_model, wait_until

from protocol.errors import MetadataMismatchError, WeightSyncError
from protocol.wire.checksum import state_digest
from receiver import Receiver
from sender import Sender

MODES = ["patch", "bucket"]
STEPS = 5


class Daemons:
    """Creates senders and receivers with test timings; closes them all at the end."""

    def __init__(self, context: zmq.asyncio.Context | None = None) -> None:
        self.context = context
        self.senders: list[Sender] = []
        self.receivers: list[Receiver] = []

    async def sender(self, trainer: Trainer, mode: str, endpoint: str = "tcp://127.0.0.1:0", **kw: Any) -> Sender:
        s = Sender(endpoint, CONFIGS[mode], context=self.context, **{**DAEMON_KW, **kw})
        self.senders.append(s)
        await asyncio.wait_for(s.start(trainer.model, version=trainer.version), T)
        return s

    def receiver(self, endpoint: str, mode: str, identity: str, model: torch.nn.Module | None = None, **kw: Any) -> Receiver:
        r = Receiver(
            receiver_model() if model is None else model, endpoint, CONFIGS[mode], identity=identity,
            context=self.context, **{**DAEMON_KW, **kw},
        )
        self.receivers.append(r)
        return r

    async def start_receiver(self, endpoint: str, mode: str, identity: str, model: torch.nn.Module | None = None) -> Receiver:
        r = self.receiver(endpoint, mode, identity, model)
        await r.start(timeout=T)
        return r

    async def close(self) -> None:
        for d in [*self.receivers, *self.senders]:
            await asyncio.wait_for(d.close(), T)


@contextlib.asynccontextmanager
async def open_daemons(shared_context: bool = False) -> AsyncIterator[Daemons]:
    """``shared_context``: inproc:// only connects sockets of one context, so both sides
    get this test's own; otherwise each uses the process-wide default."""
    context = zmq.asyncio.Context() if shared_context else None
    d = Daemons(context)
    try:
        yield d
    finally:
        try:
            await d.close()
        finally:
            if context is not None:
                context.destroy(linger=0)


@pytest.fixture
async def daemons() -> AsyncIterator[Daemons]:
    async with open_daemons() as d:
        yield d


def endpoint_for(transport: str, tmp_path: Path) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    if transport == "ipc":
        return f"ipc://{tmp_path}/weights.sock"
    return f"inproc://weightsync-{uuid.uuid4().hex[:8]}"


async def step_all(trainer: Trainer, s: Sender, receivers: list[Receiver]) -> int:
    """Train, sync, wait until every receiver acknowledged, check every one bit for bit."""
    version = await trainer.step_and_sync(s)
    await s.wait_acked(version, timeout=T)
    for r in receivers:
        await r.wait_for_version(version, timeout=T)
        await assert_matches(r, trainer, version)
    return version


# -- the basic loop, every mode and transport -------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "ipc", "inproc"])
@pytest.mark.parametrize("mode", MODES)
async def test_two_receivers_bit_identical_after_every_step(mode: str, transport: str, tmp_path: Path) -> None:
    async with open_daemons(shared_context=transport == "inproc") as d:
        await _two_receivers(d, mode, transport, tmp_path)


async def _two_receivers(d: Daemons, mode: str, transport: str, tmp_path: Path) -> None:
    trainer = Trainer()
    s = await d.sender(trainer, mode, endpoint_for(transport, tmp_path))
    if transport == "tcp":
        assert not s.endpoint.endswith(":0") and int(s.endpoint.rsplit(":", 1)[1]) > 0
    rs = [await d.start_receiver(s.endpoint, mode, f"r{i}") for i in range(2)]
    await s.wait_for_receivers(2, timeout=T)
    await s.wait_acked(0, timeout=T)
    for r in rs:
        await assert_matches(r, trainer, 0)
        assert r.stats[0].kind == "bootstrap"
    for _ in range(STEPS):
        version = await step_all(trainer, s, rs)
        for r in rs:
            assert r.stats[version].kind == mode  # the normal path, not a resync
    assert sorted(s.receivers) == ["r0", "r1"]
    assert all(info["acked"] == STEPS and info["resyncs"] == 0 for info in s.receivers.values()), s.receivers
    assert all(r.reconnects == 0 for r in rs)
    assert set(s.stats) == set(range(1, STEPS + 1))


# -- joining late, restarting a receiver ----------------------------------------------------
@pytest.mark.parametrize("others", [0, 2], ids=["alone", "with-others"])
@pytest.mark.parametrize("mode", MODES)
async def test_late_receiver_is_bootstrapped_to_the_current_version(mode: str, others: int, daemons: Daemons) -> None:
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    rs = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(others)]
    for _ in range(3):
        if rs:
            await step_all(trainer, s, rs)
        else:  # nobody listening: only the version moves
            await trainer.step_and_sync(s)
    late = await daemons.start_receiver(s.endpoint, mode, "late")
    assert late.version == 3
    await assert_matches(late, trainer, 3)
    assert late.stats[3].kind == "bootstrap"
    await s.wait_acked(3, timeout=T)
    for _ in range(2):
        await step_all(trainer, s, [*rs, late])


@pytest.mark.parametrize("fresh_model", [True, False], ids=["fresh-model", "same-model"])
@pytest.mark.parametrize("mode", MODES)
async def test_receiver_restarted_with_same_identity_converges(mode: str, fresh_model: bool, daemons: Daemons) -> None:
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    r0, r1 = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(2)]
    await step_all(trainer, s, [r0, r1])
    await step_all(trainer, s, [r0, r1])
    await asyncio.wait_for(r0.close(), T)
    await wait_until(lambda: "r0" not in s.receivers)  # it said goodbye
    for _ in range(2):  # versions it misses
        await step_all(trainer, s, [r1])
    model = receiver_model(seed=2) if fresh_model else r0.model
    again = await daemons.start_receiver(s.endpoint, mode, "r0", model)
    assert again.version == 4
    await assert_matches(again, trainer, 4)
    for _ in range(2):
        await step_all(trainer, s, [again, r1])
    assert sorted(s.receivers) == ["r0", "r1"]


async def test_receiver_replaced_without_goodbye_converges(daemons: Daemons) -> None:
    """A second daemon takes over a live identity (ROUTER_HANDOVER) while the first one is
    silenced without saying goodbye, as after a crash the sender has not noticed yet."""
    mode = "patch"
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    r0, r1 = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(2)]
    await step_all(trainer, s, [r0, r1])
    assert r0._task is not None
    r0._task.cancel()  # the daemon dies: no BYE
    await asyncio.wait_for(asyncio.gather(r0._task, return_exceptions=True), T)
    await trainer.step_and_sync(s)
    again = await daemons.start_receiver(s.endpoint, mode, "r0", receiver_model(seed=3))
    await s.wait_acked(trainer.version, timeout=T)
    await assert_matches(again, trainer, trainer.version)
    for _ in range(2):
        await step_all(trainer, s, [again, r1])


# -- a slow receiver never blocks the trainer -------------------------------------------------
@pytest.mark.parametrize("mode", [*MODES, "patch-device"])
async def test_slow_receiver_does_not_block_the_trainer(mode: str, daemons: Daemons) -> None:
    trainer = Trainer()
    ring, inflight = 2, 1
    s = await daemons.sender(trainer, mode, ring_size=ring, max_inflight=inflight)
    fast, slow = [await daemons.start_receiver(s.endpoint, mode, name) for name in ("fast", "slow")]
    await step_all(trainer, s, [fast, slow])
    held = trainer.version
    release = asyncio.Event()
    holding = asyncio.Event()

    async def hold() -> None:
        async with slow.reading():  # no version can be committed on `slow` while inside
            holding.set()
            await asyncio.wait_for(release.wait(), 3 * T)

    holder = asyncio.ensure_future(hold())
    try:
        await asyncio.wait_for(holding.wait(), T)
        for _ in range(ring + inflight + 3):
            version = await trainer.step_and_sync(s)  # completes although `slow` cannot apply anything
            await fast.wait_for_version(version, timeout=T)
            await assert_matches(fast, trainer, version)
            assert slow.version == held
        await asyncio.sleep(PEER_TIMEOUT + 0.5)  # stay blocked longer than any peer timeout
        assert slow.version == held
        assert sorted(s.receivers) == ["fast", "slow"]  # still connected, heartbeats flowed
        assert s.receivers["fast"]["acked"] == trainer.version
    finally:
        release.set()
        await asyncio.wait_for(holder, T)
    await s.wait_acked(trainer.version, timeout=T)
    await assert_matches(slow, trainer, trainer.version)
    applied = [v for v in slow.stats if v > held]
    assert applied[-1] == trainer.version and len(applied) < trainer.version - held, applied  # it skipped versions
    if mode.startswith("patch"):  # it fell out of the ring of recent patches: resynced to the current version
        assert s.receivers["slow"]["resyncs"] >= 1 and slow.stats[trainer.version].kind == "bootstrap"
    await step_all(trainer, s, [fast, slow])
    await step_all(trainer, s, [fast, slow])


# -- the sender restarts on the same endpoint -------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "transport", "later"),
    [("patch", "tcp", True), ("bucket", "ipc", True), ("patch", "ipc", False), ("bucket", "tcp", False)],
    ids=["patch-tcp-later-version", "bucket-ipc-later-version", "patch-ipc-same-version", "bucket-tcp-same-version"],
)
async def test_sender_restart_on_same_endpoint(mode: str, transport: str, later: bool, daemons: Daemons, tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else f"ipc://{tmp_path}/weights.sock"
    trainer = Trainer()
    first = await daemons.sender(trainer, mode, endpoint)
    rs = [await daemons.start_receiver(endpoint, mode, f"r{i}") for i in range(2)]
    for _ in range(2):
        await step_all(trainer, first, rs)
    before = {r.identity: r.stats[2] for r in rs}
    await asyncio.wait_for(first.close(), T)
    await wait_until(lambda: all(not r.connected and r.reconnects >= 1 for r in rs))
    if later:
        for _ in range(2):
            trainer.step()  # training goes on while no sender is up
    await asyncio.sleep(PEER_TIMEOUT + 0.5)  # down for longer than a peer timeout
    for r in rs:  # the receivers keep serving their last version
        await assert_matches(r, trainer, 2)
    second = await daemons.sender(trainer, mode, endpoint)
    assert second.session != first.session
    await second.wait_for_receivers(2, timeout=T)
    await second.wait_acked(trainer.version, timeout=T)
    for r in rs:
        await r.wait_for_version(trainer.version, timeout=T)
        await assert_matches(r, trainer, trainer.version)
        if later:
            assert r.stats[trainer.version].kind == "bootstrap"
        else:  # already current with a matching digest: no second bootstrap
            assert r.stats[2] is before[r.identity]
    for _ in range(2):
        await step_all(trainer, second, rs)


# -- a sync that fails midway ----------------------------------------------------------------
@pytest.mark.parametrize("how", ["fails", "cancelled"])
async def test_a_sync_broken_off_midway_resyncs_every_receiver(how: str, daemons: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compare that fails, or whose sync is cancelled while it runs on its thread, after
    it moved part of the snapshot: the next version resyncs every receiver by bootstrap
    (a patch from that snapshot would leave them behind on those tensors), then patches resume."""
    from sender.diff import fastdiff
    from sender.version.collector import Collector

    monkeypatch.setattr(Collector, "_inline", lambda self, tensors: False)  # the compare on its thread
    trainer = Trainer()
    s = await daemons.sender(trainer, "patch")
    rs = [await daemons.start_receiver(s.endpoint, "patch", f"r{i}") for i in range(2)]
    await step_all(trainer, s, rs)
    real, calls, started = fastdiff.diff_and_update, [], asyncio.Event()
    loop = asyncio.get_running_loop()

    def broken(*args: Any, **kwargs: Any) -> Any:  # the first call moves the small tensors' run
        calls.append(1)
        if len(calls) == 2:
            if how == "fails":
                raise RuntimeError("compare failed")
            loop.call_soon_threadsafe(started.set)
            time.sleep(0.5)  # cancelled meanwhile: the thread goes on, and moves this one too
        return real(*args, **kwargs)

    monkeypatch.setattr(fastdiff, "diff_and_update", broken)
    broken_version = trainer.step()
    sync = asyncio.ensure_future(s.sync(trainer.model, broken_version))
    if how == "fails":
        with pytest.raises(RuntimeError, match="compare failed"):
            await asyncio.wait_for(sync, T)
    else:
        await asyncio.wait_for(started.wait(), T)
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sync
    assert s.version == broken_version - 1
    monkeypatch.setattr(fastdiff, "diff_and_update", real)
    version = await step_all(trainer, s, rs)  # waits for the cancelled compare first
    for r in rs:
        assert r.stats[version].kind == "bootstrap"
    version = await step_all(trainer, s, rs)
    for r in rs:
        assert r.stats[version].kind == "patch"
    assert s.failure is None


async def test_a_sync_of_a_mismatched_model_moves_nothing(daemons: Daemons) -> None:
    trainer = Trainer()
    s = await daemons.sender(trainer, "patch")
    rs = [await daemons.start_receiver(s.endpoint, "patch", "r0")]
    await step_all(trainer, s, rs)
    version = trainer.step()
    bad = dict(trainer.model.state_dict())
    del bad["norm.bias"]  # late in the order: refused before the tensors before it are compared
    with pytest.raises(MetadataMismatchError, match=r"norm\.bias"):
        await s.sync(bad, version)
    assert s.version == version - 1
    await s.sync(trainer.model, version)  # the same weights again: all of the step must travel
    await s.wait_acked(version, timeout=T)
    await assert_matches(rs[0], trainer, version)
    assert rs[0].stats[version].kind == "patch"


# -- a receiver whose model does not match ----------------------------------------------------
@pytest.mark.parametrize("bad_first", [False, True], ids=["bad-later", "bad-first"])
@pytest.mark.parametrize("mode", MODES)
async def test_metadata_mismatch_is_refused_others_unaffected(mode: str, bad_first: bool, daemons: Daemons) -> None:
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)

    async def bad_join() -> None:
        bad = daemons.receiver(s.endpoint, mode, "bad", receiver_model(vocab=128))  # embed/head: [128, 64]
        with pytest.raises(WeightSyncError) as info:
            await bad.start(timeout=T)
        cause = info.value.__cause__
        text = f"{info.value} {type(cause).__name__} {cause}"
        assert "MetadataMismatch" in text or "metadata" in text.lower(), text
        assert "embed.weight" in text or "head.weight" in text, text
        await asyncio.wait_for(bad.close(), T)
        assert "bad" not in s.receivers

    if bad_first:
        await bad_join()
    rs = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(2)]
    await step_all(trainer, s, rs)
    if not bad_first:
        await bad_join()
    for _ in range(2):
        await step_all(trainer, s, rs)
    assert sorted(s.receivers) == ["r0", "r1"]


async def test_a_later_receiver_of_another_dtype_is_told_what_the_others_hold(daemons: Daemons) -> None:
    """Receivers of one sender share the wire's dtypes: a later one in fp32 beside bf16 ones
    is told its own shape and dtype, the others', and the trainer's shape (it was told only
    'this receiver differs from the other receivers')."""
    trainer = Trainer()
    s = await daemons.sender(trainer, "patch")
    await daemons.start_receiver(s.endpoint, "patch", "r0")  # bf16
    odd = daemons.receiver(s.endpoint, "patch", "odd", receiver_model().to(torch.float32))
    with pytest.raises(WeightSyncError) as info:
        await odd.start(timeout=T)
    text = f"{info.value} | {info.value.__cause__}"
    assert isinstance(info.value.__cause__, MetadataMismatchError), text
    assert "this receiver holds [" in text and "torch.float32; the other receivers: [" in text and "torch.bfloat16" in text, text
    assert "the trainer's shape: [" in text, text
    await asyncio.wait_for(odd.close(), T)
    assert "odd" not in s.receivers


# -- readers never see a half-applied version -------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_readers_never_see_a_half_applied_version(mode: str, daemons: Daemons) -> None:
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    rs = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(2)]
    published: dict[str, list[int | None]] = {r.identity: [] for r in rs}
    for r in rs:
        r.on_update(published[r.identity].append)
    seen: dict[str, list[int]] = {r.identity: [] for r in rs}
    stop = asyncio.Event()

    async def read(r: Receiver) -> None:
        while not stop.is_set():
            async with r.reading():
                claimed = r.version
                state = r.model.state_dict()
                digest = await asyncio.to_thread(state_digest, state)
                held = trainer.version_of(digest)
                assert held is not None, f"{r.identity} holds weights of no version (claims v{claimed})"
                assert claimed is not None and claimed <= held, f"{r.identity} published v{claimed} but holds v{held}"
                assert r.version == claimed or r.version == held
            seen[r.identity].append(held)
            await asyncio.sleep(0)

    readers = [asyncio.ensure_future(read(r)) for r in rs]
    try:
        for _ in range(8):
            await trainer.step_and_sync(s)  # back to back: commits race the readers
            await asyncio.sleep(0.02)
        await s.wait_acked(trainer.version, timeout=T)
        await wait_until(lambda: all(seen[r.identity] and seen[r.identity][-1] == trainer.version for r in rs))
    finally:
        stop.set()
        done, _ = await asyncio.wait(readers, timeout=T)
    assert len(done) == len(readers)
    for task in readers:
        task.result()  # re-raise a reader's failed assertion
    for r in rs:
        assert seen[r.identity] == sorted(seen[r.identity]), "a reader saw versions go backwards"
        versions = published[r.identity]
        assert versions == sorted(set(versions)) and versions[-1] == trainer.version, versions
        await assert_matches(r, trainer, trainer.version)


# -- start-up order and what a joining receiver is told --------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_receiver_started_before_the_sender(mode: str, daemons: Daemons) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    trainer = Trainer()
    r = daemons.receiver(endpoint, mode, "early")
    starting = asyncio.ensure_future(r.start(timeout=T))
    try:
        await asyncio.sleep(0.3)  # it keeps trying to reach a sender that is not up yet
        assert not starting.done() and r.version is None
        s = await daemons.sender(trainer, mode, endpoint)
        await asyncio.wait_for(asyncio.shield(starting), T)
    finally:
        if not starting.done():
            starting.cancel()
        await asyncio.wait_for(asyncio.gather(starting, return_exceptions=True), T)
    starting.result()
    await assert_matches(r, trainer, 0)
    await step_all(trainer, s, [r])


@pytest.mark.parametrize("others", [0, 1], ids=["first-receiver", "with-others"])
@pytest.mark.parametrize("mode", MODES)
async def test_receiver_joining_between_syncs_gets_the_synced_version(mode: str, others: int, daemons: Daemons) -> None:
    """The trainer synced v2, then took another optimizer step (not synced yet: rollouts
    are still running, say) before a receiver joined. The receiver is told v2, so it must
    hold v2's weights, not the newer ones the trainer's model holds by now."""
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    rs = [await daemons.start_receiver(s.endpoint, mode, f"r{i}") for i in range(others)]
    for _ in range(2):
        await trainer.step_and_sync(s)
    await s.wait_acked(2, timeout=T)
    trainer.step()  # v3 in the trainer's model, not yet synced
    late = await daemons.start_receiver(s.endpoint, mode, "late")
    assert late.version == 2
    await assert_matches(late, trainer, 2)
    await asyncio.wait_for(s.sync(trainer.model, 3), T)
    await s.wait_acked(3, timeout=T)
    for r in [*rs, late]:
        await assert_matches(r, trainer, 3)


@pytest.mark.parametrize("mode", MODES)
async def test_wait_acked_waits_for_a_joining_receivers_bootstrap(mode: str, daemons: Daemons) -> None:
    """``wait_acked(v)`` promises every connected receiver has *applied* v: a receiver that
    joined at v but has not committed its bootstrap yet has not."""
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    r0 = await daemons.start_receiver(s.endpoint, mode, "r0")
    for _ in range(2):
        await step_all(trainer, s, [r0])
    late = daemons.receiver(s.endpoint, mode, "late")
    starting: asyncio.Future[Any] | None = None
    acked: asyncio.Future[Any] | None = None
    try:
        async with late.reading():  # its bootstrap can arrive but cannot be committed while we hold the model
            starting = asyncio.ensure_future(late.start(timeout=T))
            await s.wait_for_receivers(2, timeout=T)
            acked = asyncio.ensure_future(s.wait_acked(2, timeout=T))
            await asyncio.sleep(0.5)
            assert late.version is None
            assert not acked.done(), f"wait_acked(2) returned while 'late' has applied nothing: {s.receivers['late']}"
        await asyncio.wait_for(asyncio.shield(acked), T)
        await asyncio.wait_for(asyncio.shield(starting), T)
    finally:
        pending = [f for f in (starting, acked) if f is not None and not f.done()]
        for f in pending:
            f.cancel()
        await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), T)
    await assert_matches(late, trainer, 2)


async def test_sender_close_after_a_receiver_vanished(daemons: Daemons) -> None:
    """A rollout that died (no goodbye) before the trainer shuts down: ``close()`` must still
    stop the sender and release its endpoint, not raise for the peer it cannot reach."""
    trainer = Trainer()
    # Slow heartbeats and a long peer timeout: the sender has not noticed the loss when it closes.
    s = await daemons.sender(trainer, "patch", heartbeat_interval=60.0, peer_timeout=120.0)
    r = await daemons.start_receiver(s.endpoint, "patch", "r0")
    await s.wait_acked(0, timeout=T)
    assert r._task is not None
    r._task.cancel()  # the receiver dies: its socket closes, no BYE
    await asyncio.wait_for(asyncio.gather(r._task, return_exceptions=True), T)
    await asyncio.sleep(0.5)  # the closed connection reaches the sender's socket
    port = int(s.endpoint.rsplit(":", 1)[1])
    await asyncio.wait_for(s.close(), T)
    await wait_until(lambda: port_is_free(port))  # it stopped listening (eventually: see the next test)


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_endpoint_is_free_once_close_returns(daemons: Daemons) -> None:
    """Restarting a sender in-process on its endpoint right after ``close()`` returns (a
    trainer recovering from an error, say) must not fail with EADDRINUSE. ZeroMQ closes
    sockets asynchronously, so with live connections the listener can outlive ``close()``."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    trainer = Trainer()
    context = zmq.asyncio.Context()  # a few bare connections, as idle receivers would hold
    try:
        s = await daemons.sender(trainer, "patch", endpoint)
        for _ in range(40):
            dealers = [context.socket(zmq.DEALER) for _ in range(3)]
            for d in dealers:
                d.setsockopt(zmq.LINGER, 0)
                d.connect(endpoint)
            await asyncio.sleep(0.02)  # the connections are established
            await asyncio.wait_for(s.close(), T)
            s = await daemons.sender(trainer, "patch", endpoint)  # raises TransportError (EADDRINUSE) when it is still bound
            for d in dealers:
                d.close(linger=0)
    finally:
        context.destroy(linger=0)


async def test_on_update_fires_once_per_committed_version(daemons: Daemons) -> None:
    """``on_update`` hooks run "after each version is committed": a reconnect to a restarted
    sender that needs no bootstrap (same version, same digest) commits nothing."""
    mode = "patch"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    trainer = Trainer()
    first = await daemons.sender(trainer, mode, endpoint)
    r = await daemons.start_receiver(endpoint, mode, "r0")
    calls: list[int | None] = []
    r.on_update(calls.append)
    for _ in range(2):
        await step_all(trainer, first, [r])
    committed = dict(r.stats)
    await asyncio.wait_for(first.close(), T)
    await wait_until(lambda: r.reconnects >= 1)
    second = await daemons.sender(trainer, mode, endpoint)
    await second.wait_for_receivers(1, timeout=T)
    await wait_until(lambda: r.connected)
    assert dict(r.stats) == committed  # nothing was applied on reconnecting
    await step_all(trainer, second, [r])
    assert calls == [1, 2, 3], calls


async def test_an_applied_version_leaves_no_staged_changes(daemons: Daemons) -> None:
    """Between versions a receiver holds its model, not the last version's staged changes
    (an index and a value each: as much again as the update) until the next one arrives.
    Whole tensors staged as views of the received frames may stay (receiver/session/follower.py says why)."""
    import gc

    from receiver.apply.commit import StagedUpdate

    trainer = Trainer(lr=1e-4)
    s = await daemons.sender(trainer, "patch")
    r = await daemons.start_receiver(s.endpoint, "patch", "r0")
    for _ in range(2):
        version = await step_all(trainer, s, [r])
        assert r.stats[version].kind == "patch"
        gc.collect()
        staged = [o for o in gc.get_objects() if type(o) is StagedUpdate]
        assert not [u for u in staged if u.flat is not None], len(staged)


# -- handshakes that take a while ---------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_a_sender_slow_to_answer_hello_is_waited_for_not_left(mode: str, daemons: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answering the first HELLO can take longer than ``peer_timeout`` (the snapshot of a
    large model, a cold start compiling its kernels): the sender heartbeats the receiver
    meanwhile, so it waits rather than reconnecting (and sending a HELLO that starts the
    answer over, every time)."""
    from sender.serve.source import TrainerSource

    admit = TrainerSource.admit

    async def slow_admit(self: TrainerSource, hello: Any) -> Any:
        await asyncio.sleep(3 * PEER_TIMEOUT)
        return await admit(self, hello)

    monkeypatch.setattr(TrainerSource, "admit", slow_admit)
    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    r = await daemons.start_receiver(s.endpoint, mode, "r0")
    assert r.reconnects == 0
    await assert_matches(r, trainer, trainer.version)
    await step_all(trainer, s, [r])


async def test_a_bootstrap_longer_than_the_handshake_bound_completes_while_it_progresses(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handshake's bound (``peer_timeout + HANDSHAKE_GRACE``) is on each of its
    messages, not on the whole bootstrap: a large model's bootstrap takes as long as its
    bytes take, and must not be cut off (and asked for again) at a fixed total."""
    import receiver.session.follower
    from protocol.wire.framing import MessageType, peek_type
    from receiver.session.session import Session

    monkeypatch.setattr(receiver.session.follower, "HANDSHAKE_GRACE", 0.0)  # each message within PEER_TIMEOUT
    recv = Session.recv
    buckets = 0

    async def slow_recv(self: Session) -> Any:
        nonlocal buckets
        frames = await recv(self)
        if peek_type(frames) is MessageType.BOOTSTRAP:
            buckets += 1
            await asyncio.sleep(0.45 * PEER_TIMEOUT)  # each within the bound, three together past it
        return frames

    monkeypatch.setattr(Session, "recv", slow_recv)
    trainer = Trainer()
    trainer.step()  # a version past the initial weights: the bootstrap carries every tensor
    s = await daemons.sender(trainer, "patch")
    started = time.monotonic()
    r = await daemons.start_receiver(s.endpoint, "patch", "r0")
    assert time.monotonic() - started > PEER_TIMEOUT, "the bootstrap was not slower than the bound: this test tests nothing"
    assert buckets >= 3 and r.reconnects == 0, (buckets, r.reconnects)
    await assert_matches(r, trainer, trainer.version)


async def test_start_does_not_count_compiling_the_kernels_in_its_timeout(daemons: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh install the first start compiles the decoders (tens of seconds on a busy
    host, three rollouts compiling at once): local work, done before the handshake's clock
    starts, so ``start(timeout=...)`` bounds only what it says. A second start while the
    first compiles, or after it, is refused and changes nothing."""
    from receiver.strategy.patch import PatchReceiver

    prepare, compiled = PatchReceiver.prepare, False

    async def cold_prepare(self: PatchReceiver) -> None:
        nonlocal compiled
        if not compiled:  # the first call compiles; later ones find the kernels compiled
            await asyncio.sleep(3 * PEER_TIMEOUT)
            compiled = True
        await prepare(self)

    monkeypatch.setattr(PatchReceiver, "prepare", cold_prepare)
    trainer = Trainer()
    s = await daemons.sender(trainer, "patch")
    r = daemons.receiver(s.endpoint, "patch", "r0")
    first = asyncio.ensure_future(r.start(timeout=PEER_TIMEOUT))
    await asyncio.sleep(0.1)  # the first start is compiling
    with pytest.raises(WeightSyncError, match="already started"):
        await r.start(timeout=PEER_TIMEOUT)
    await first
    assert compiled and r.reconnects == 0
    with pytest.raises(WeightSyncError, match="already started"):
        await r.start(timeout=PEER_TIMEOUT)
    await step_all(trainer, s, [r])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["bucket", "patch-device"])
async def test_the_pinned_staging_buffer_goes_with_the_weights_and_with_close(mode: str, daemons: Daemons) -> None:
    """The receiver's staging pool (pinned host memory on a GPU, up to a bucket) is let go
    when ``sleep`` releases the weights, and at ``close``; a wakeup stages again. Here the
    pool is told to stage CPU targets, as it stages a GPU's."""
    from protocol.codec.staging import StagingPool

    trainer = Trainer()
    s = await daemons.sender(trainer, mode)
    r = daemons.receiver(s.endpoint, mode, "r0")
    r.strategy.staging = StagingPool(cpu_too=True)
    await r.start(timeout=T)
    await step_all(trainer, s, [r])
    cpu = torch.device("cpu")
    assert r.strategy.staging.buffer(cpu) is not None
    await r.sleep("weight")
    assert r.strategy.staging.buffer(cpu) is None
    await r.wakeup(timeout=T)
    await step_all(trainer, s, [r])
    assert r.strategy.staging.buffer(cpu) is not None
    await r.close()
    assert r.strategy.staging.buffer(cpu) is None
