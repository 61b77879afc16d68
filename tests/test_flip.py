"""One flip for the fleet (``Sender(commit="together")``): every receiver stages a version,
reports it, and commits it when the sender says so, all at once. Real sender and
receivers over TCP loopback, real AdamW steps; failures through the impairing proxy."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, assert_matches, receiver_model, wait_until
from proxy import Proxy, Stall, Tamper, Wire

import receiver.strategy.base
from protocol.errors import ConfigError, WeightSyncError
from protocol.net.flips import RELAY_SHARE, Flips
from protocol.wire.framing import Encoding, Message, MessageType, decode_message
from protocol.wire.messages import Beat, Hello
from receiver import Receiver, StrategyHooks
from sender import Sender


@dataclass
class Fleet:
    trainer: Trainer
    sender: Sender
    config: dict[str, Any]
    receivers: list[Receiver] = field(default_factory=list)
    commits: dict[int, dict[str, float]] = field(default_factory=dict)  # version -> receiver -> time.monotonic() at commit

    async def receiver(self, identity: str, endpoint: str | None = None, **kw: Any) -> Receiver:
        r = Receiver(receiver_model(), endpoint or self.sender.endpoint, self.config, identity=identity, **{**DAEMON_KW, **kw})
        r.on_update(lambda v: self.commits.setdefault(v, {}).setdefault(identity, time.monotonic()) if v is not None else None)
        self.receivers.append(r)
        await r.start(timeout=T)
        return r

    @property
    def upstream(self) -> tuple[str, int]:
        """The sender's host and port, for a proxy in front of it."""
        return _host_port(self.sender.endpoint)

    @contextlib.asynccontextmanager
    async def stalled(self, identity: str = "slow", version: int = 1, *, part: int = 0, finish: bool = False,
                      upstream: str | None = None, **kw: Any) -> AsyncIterator[tuple[Receiver, Stall]]:
        """A receiver whose connection stalls halfway through ``version``'s message ``part``,
        so it never stages it, until ``stall.release()``: then the rest comes (``finish``)
        or the connection is reset. ``upstream``: a relay's endpoint (default: the sender).
        ``kw``: the receiver's (``peer_timeout=20.0``: it stays stalled rather than reconnect)."""
        kind = MessageType.PATCH if self.config["type"] == "patch" else MessageType.BUCKET

        def select(w: Wire) -> bool:
            return w.type == kind and w.version == version and w.header is not None and w.header.get("part", 0) == part

        stall = Stall(select, fraction=0.5, finish=finish)
        async with Proxy(self.upstream if upstream is None else _host_port(upstream), tamper=stall) as path:
            yield await self.receiver(identity, path.endpoint, **kw), stall

    def spread(self, version: int) -> float:
        times = self.commits[version].values()
        return max(times) - min(times)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@pytest.fixture
async def fleet() -> AsyncIterator[Any]:
    made: list[Fleet] = []

    async def make(mode: str = "patch", **kw: Any) -> Fleet:
        trainer = Trainer()
        sender = Sender("tcp://127.0.0.1:0", CONFIGS[mode], **{**DAEMON_KW, **kw})
        await sender.start(trainer.model, version=trainer.version)
        made.append(Fleet(trainer, sender, CONFIGS[mode]))
        return made[-1]

    yield make
    for f in made:
        for r in reversed(f.receivers):
            await r.close()
        await f.sender.close()


def test_flips_decide_on_all_a_quorum_or_the_timeout() -> None:
    f = Flips()
    assert [x.version for x in f.published(1, [], now=0.0)] == [1]  # nobody to wait for
    assert f.published(2, ["a", "b"], now=1.0) == [] and f.flipped == 1
    assert f.staged("a", 2, now=1.1) == [] and f.staged("a", 2, now=1.2) == []  # reports repeat
    (flip,) = f.staged("b", 2, now=1.3)
    assert (flip.version, flip.missing, f.flipped) == (2, (), 2) and flip.seconds == pytest.approx(0.3)
    q = Flips(quorum=2, stage_timeout=5.0)
    q.published(1, ["a", "b", "c"], now=0.0)
    assert q.staged("a", 1, now=0.1) == [] and [x.missing for x in q.staged("c", 1, now=0.2)] == [("b",)]
    t = Flips(stage_timeout=2.0)
    t.published(1, ["a", "b"], now=0.0)
    t.staged("a", 1, now=0.5)
    assert t.due(now=1.9) == [] and [x.missing for x in t.due(now=2.0)] == [("b",)]
    gone = Flips()
    gone.published(1, ["a", "b"], now=0.0)
    gone.staged("a", 1)
    assert [x.version for x in gone.left("b")] == [1]  # a receiver that left is not waited for
    for bad in ({"quorum": 0}, {"stage_timeout": 0}):
        with pytest.raises(ConfigError):
            Flips(**bad)


def test_a_relays_flips_are_ready_when_its_receivers_staged_and_decided_by_its_upstream() -> None:
    """``follow`` (a relay): staging makes a flip *ready* (what the relay reports upward),
    never decided; a timeout makes it ready without the late ones, named with those a relay
    below went without; only ``decide`` flips it."""
    told: list[int] = []
    f = Flips(stage_timeout=1.0, follow=True)
    f.on_ready = lambda flip: told.append(flip.version)
    assert f.ready(7) is not None and f.ready(7).left_out() == ()  # nothing forwarded here: nobody to wait for
    assert f.published(1, ["a", "sub"], now=0.0) == [] and f.ready(1) is None
    assert f.staged("a", 1, now=0.1) == [] and f.ready(1) is None
    assert f.staged("sub", 1, now=0.2, below=["x", "y/z"]) == [] and told == [1]
    ready = f.ready(1)
    assert ready is not None and ready.left_out() == ("sub/x", "sub/y/z") and f.flipped is None
    assert f.published(1, ["a", "sub", "late"], now=0.5) == [] and f.record(1).cohort == {"a", "sub"}  # published again: the first stands
    f.published(2, ["a", "b"], now=1.0)
    f.staged("a", 2, now=1.1)
    assert f.due(now=1.9) == [] and f.ready(2) is None
    assert f.due(now=2.0) == [] and told == [1, 2] and f.ready(2).left_out() == ("b",)  # ready without b, not flipped
    (one, two) = f.decide(2, now=2.5)
    assert (one.missing, two.missing, f.flipped) == (("sub/x", "sub/y/z"), ("b",), 2)
    t = Flips()  # a trainer's: the relay's names below it, under its own
    t.published(1, ["relay", "direct"], now=0.0)
    t.staged("direct", 1, now=0.1)
    (flip,) = t.staged("relay", 1, now=0.2, below=["slow"])
    assert flip.missing == ("relay/slow",) and flip.unstaged == frozenset()


@pytest.mark.parametrize("mode", ["patch", "bucket", "patch-device"])
async def test_four_receivers_commit_each_version_together(fleet: Any, mode: str) -> None:
    """Each version staged by all four, then committed by all at the flip. ``patch-device``:
    the trainer's patches coded by the device codec (``Encoding.BLOCKS``, forced on CPU)."""
    f = await fleet(mode, commit="together")
    coded: dict[str, set[Encoding]] = {}  # receiver -> the encodings of the patch parts it staged

    def record(name: str) -> StrategyHooks:
        def on_part(_: Any, msg: Message) -> None:
            if msg.type is MessageType.PATCH:
                coded.setdefault(name, set()).update(e.encoding for e in msg.tensors)
        return StrategyHooks(on_part=on_part)

    rs = [await f.receiver(f"r{i}", hooks=record(f"r{i}")) for i in range(4)]
    spreads = []
    for _ in range(4):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.missing == () and flip.cohort == {"r0", "r1", "r2", "r3"}
        for r in rs:
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
            assert r.stats[v].kind == CONFIGS[mode]["type"]  # committed from what it staged, not a resync
        spreads.append(f.spread(v))
        assert f.sender.stats[v].flip_seconds is not None and f.sender.stats[v].flip_missing == ()
    assert statistics.median(spreads) < 0.25, spreads  # generous here (a loaded CI machine); benchmarks/flip.py measures it
    if mode != "bucket":
        assert sorted(coded) == ["r0", "r1", "r2", "r3"]
        assert all((Encoding.BLOCKS in c) == (mode == "patch-device") for c in coded.values()), coded


@dataclass
class DropFlip(Tamper):
    """Lose the first heartbeat that carries a flip: the receiver must commit on the next."""

    def act(self, w: Wire) -> list[Wire]:
        return []


def _flips(w: Wire) -> bool:
    if w.type != MessageType.HEARTBEAT or w.header is None:
        return False
    return Beat.from_body(decode_message(w.frames).body).flipped is not None and w.version is not None and w.version >= 1


async def test_a_lost_flip_is_taken_from_the_next_heartbeat(fleet: Any) -> None:
    f = await fleet(commit="together")
    drop = DropFlip(_flips, limit=1)
    async with Proxy(f.upstream, tamper=drop) as proxy:
        r = await f.receiver("r", proxy.endpoint)
        v = await f.trainer.step_and_sync(f.sender)
        await r.wait_for_version(v, timeout=T)
        await assert_matches(r, f.trainer, v)
        assert drop.hits == 1
        await r.close()


@pytest.mark.parametrize("mode, part", [("patch", 0), ("bucket", 1)])
async def test_a_receiver_that_never_stages_is_left_out_named_and_resynced(fleet: Any, mode: str, part: int) -> None:
    """``bucket``, part 1: the stalled receiver has checked the version's first part; a
    bucket version written on arrival (``load_instant``) is still not staged before its last."""
    f = await fleet(mode, commit="together", stage_timeout=1.0)
    fast = await f.receiver("fast")
    async with f.stalled(part=part) as (slow, stall):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.missing == ("slow",) and flip.seconds is not None and flip.seconds >= 1.0
        await fast.wait_for_version(v, timeout=T)
        assert slow.version == 0 and f.sender.stats[v].flip_missing == ("slow",)
        stall.release()  # the connection is reset mid-message: it reconnects, behind, and is resynced
        await slow.wait_for_version(v, timeout=T)
        await assert_matches(slow, f.trainer, v)
        await slow.close()


@pytest.mark.parametrize("finish", [False, True])
async def test_a_quorum_flips_without_the_one_that_never_stages_which_then_catches_up(fleet: Any, finish: bool) -> None:
    """quorum=2 of three: the two that staged v1 flip at once, not at ``stage_timeout``;
    the stalled one is named and left on v0. Released, it reaches v1 (``finish=False``:
    its connection reset, it reconnects at v0 and is sent v1; ``True``: the rest of v1
    arrives late and it commits what flipped already), then flips v2 with its peers."""
    f = await fleet(commit="together", quorum=2, stage_timeout=60.0)
    fast = [await f.receiver(f"r{i}") for i in range(2)]
    async with f.stalled(peer_timeout=20.0, finish=finish) as (slow, stall):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)  # T < stage_timeout: the quorum decided
        assert flip.cohort == {"r0", "r1", "slow"} and flip.missing == ("slow",) and f.sender.stats[v].flip_missing == ("slow",)
        for r in fast:
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
        assert slow.version == 0 and slow.pending_version is None and stall.stalled.is_set()
        stall.release()
        await slow.wait_for_version(v, timeout=T)
        await assert_matches(slow, f.trainer, v)
        assert slow.reconnects == (0 if finish else 1)  # reset: it said HELLO at v0 again and was sent what follows
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.cohort == {"r0", "r1", "slow"} and len(flip.missing) <= 1  # the first two to stage flip it
        for r in (*fast, slow):
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
        assert set(f.commits) == {0, 1, 2}
        await slow.close()


async def test_a_receiver_cut_off_between_staged_and_flip_keeps_its_version_then_rejoins(fleet: Any) -> None:
    """``slow`` never stages v1, so the flip waits; ``cut`` stages v1 and loses its connection
    before the flip: it drops its staged copy, keeps v0 (never a half or another version than
    its peers), reconnects, and ends on v1 with the others."""
    f = await fleet(commit="together", stage_timeout=3.0)
    async with f.stalled(peer_timeout=20.0) as (slow, stall), Proxy(f.upstream) as cut_path:
        cut = await f.receiver("cut", cut_path.endpoint)
        v = await f.trainer.step_and_sync(f.sender)
        await wait_until(lambda: cut.pending_version == v)  # staged, waiting for the flip
        cut_path.sever()
        await wait_until(lambda: cut.reconnects >= 1)
        assert cut.version == 0
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert "slow" in flip.missing
        stall.release()
        for r in (cut, slow):
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
        assert all(ver in (0, v) for ver in f.commits)  # nobody ever published another version
        await slow.close()
        await cut.close()


async def test_a_sender_gone_before_the_flip_leaves_every_receiver_on_its_version(fleet: Any) -> None:
    f = await fleet(commit="together", stage_timeout=60.0)
    async with f.stalled(peer_timeout=20.0) as (_, stall):
        staged = await f.receiver("staged")
        await f.trainer.step_and_sync(f.sender)
        await wait_until(lambda: staged.pending_version == 1)
        await f.sender.close()  # before the flip: nobody may commit v1
        await wait_until(lambda: staged.pending_version is None)
        assert staged.version == 0 and 1 not in f.commits
        stall.release()


async def test_a_receiver_that_cannot_flip_is_refused_at_hello(fleet: Any) -> None:
    f = await fleet(commit="together")
    r = Receiver(receiver_model(), f.sender.endpoint, f.config, identity="old", **DAEMON_KW)
    f.receivers.append(r)
    init = r.strategy.init_receiver

    async def predates_flip(*a: Any, **kw: Any) -> Any:  # a receiver of before commit="together"
        kw.pop("flip", None)
        return await init(*a, **kw)

    r.strategy.init_receiver = predates_flip  # type: ignore[method-assign]
    with pytest.raises(WeightSyncError, match="commits versions together"):
        await r.start(timeout=T)


def test_commit_must_be_known() -> None:
    with pytest.raises(ConfigError, match="commit"):
        Sender("tcp://127.0.0.1:0", CONFIGS["patch"], commit="sometimes")


async def test_a_held_receiver_commits_a_flipped_version_when_asked(fleet: Any) -> None:
    """hold=True (the vLLM backend's mode) and a flip both gate the commit: update_weights
    waits for the flip, and a flip waits for update_weights."""
    f = await fleet(commit="together")
    free = await f.receiver("free")
    held = await f.receiver("held", hold=True)
    v = await f.trainer.step_and_sync(f.sender)
    await f.sender.wait_flipped(v, timeout=T)
    await free.wait_for_version(v, timeout=T)
    assert held.version == 0 and held.pending_version == v  # flipped, staged, not asked yet
    assert await held.update_weights(version=v, timeout=T) == v
    await assert_matches(held, f.trainer, v)


def test_the_sender_cli_passes_the_commit_mode_and_the_staleness_bound() -> None:
    from sender.__main__ import parse_args

    args = parse_args(["--watch", "/tmp", "--commit", "together", "--quorum", "3", "--stage-timeout", "5",
                       "--max-lag", "2", "--lag-policy", "wait", "--lag-timeout", "9"])
    assert args.policy == {"max_lag": 2, "lag_policy": "wait", "lag_timeout": 9.0, "commit": "together", "quorum": 3, "stage_timeout": 5.0}
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **args.policy)
    assert sender.commit == "together" and sender.server.flips is not None and sender.server.flips.quorum == 3
    assert (sender.lag.max_lag, sender.lag.policy, sender.lag.timeout) == (2, "wait", 9.0)
    with pytest.raises(ConfigError, match="max_lag"):
        Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **parse_args(["--watch", "/tmp", "--lag-policy", "drop"]).policy)


async def test_sleep_while_a_version_waits_for_its_flip_does_not_hang(fleet: Any) -> None:
    """A receiver staged and waiting for a flip that is held up (a peer never stages) is put
    to sleep: it leaves at once, never committing the staged version (its weights released:
    it holds none); woken, it rejoins and ends on what flipped."""
    f = await fleet(commit="together", stage_timeout=2.0)
    async with f.stalled(peer_timeout=20.0) as (_, stall):
        r = await f.receiver("r")
        v = await f.trainer.step_and_sync(f.sender)
        await wait_until(lambda: r.pending_version == v)
        await asyncio.wait_for(r.sleep(), 5)
        assert r.version is None and 1 not in f.commits  # asleep: no weights, and v1 never committed
        await f.sender.wait_flipped(v, timeout=T)
        await r.wakeup(timeout=T)
        await r.wait_for_version(v, timeout=T)
        await assert_matches(r, f.trainer, v)
        stall.release()


STAGING = 0.3  # seconds a leaf's staging takes past its relay's (an engine's re-pack, say): the flip must wait for it


def _staging(staged: dict[int, dict[str, float]], name: str, delay: float = 0.0) -> StrategyHooks:
    """Hooks of a receiver that records when it has staged each version (``time.monotonic``,
    before it reports it), staging ``delay`` seconds longer than it would."""

    async def on_staged(pending: Any) -> None:
        await asyncio.sleep(delay)
        if pending.version is not None:
            staged.setdefault(pending.version, {})[name] = time.monotonic()

    return StrategyHooks(on_staged=on_staged)


@pytest.mark.parametrize("mode", ["patch", "bucket"])
@pytest.mark.parametrize("direct", [False, True], ids=["tree", "mixed"])
async def test_a_flip_through_a_relay_waits_for_the_leaves_below_it(fleet: Any, mode: str, direct: bool) -> None:
    """trainer -> relay -> two leaves (``mixed``: and a receiver of the trainer's own). Each
    leaf stages each version ``STAGING`` after the relay: the relay reports it staged only
    once both leaves have, the trainer flips only then, and the flip comes down (the relay
    flips its leaves as it commits): nobody commits before everybody staged."""
    f = await fleet(mode, commit="together")
    staged: dict[int, dict[str, float]] = {}
    relay = await f.receiver("relay", relay_endpoint="tcp://127.0.0.1:0", hooks=_staging(staged, "relay"))
    assert relay.relay_endpoint is not None and relay.relay is not None and relay.relay.server.flips is not None
    others = [await f.receiver("direct", hooks=_staging(staged, "direct"))] if direct else []
    leaves = [await f.receiver(f"leaf{i}", relay.relay_endpoint, hooks=_staging(staged, f"leaf{i}", STAGING)) for i in range(2)]
    everyone = [relay, *others, *leaves]
    for _ in range(3):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.cohort == {r.identity for r in (relay, *others)} and flip.missing == ()
        for r in everyone:
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
            assert r.stats[v].kind == mode  # committed from what it staged, at the flip: not a resync
        below = relay.relay.server.flips.record(v)
        assert below is not None and below.missing == () and below.staged >= {"leaf0", "leaf1"}
        assert flip.decided_at is not None and below.ready_at is not None
        # the order: each leaf staged, then its relay's receivers were all staged, then the trainer flipped, then the commits
        assert max(staged[v][leaf.identity] for leaf in leaves) <= below.ready_at <= flip.decided_at
        assert max(staged[v].values()) <= flip.decided_at <= min(f.commits[v].values())
        assert set(staged[v]) == set(f.commits[v]) == {r.identity for r in everyone}
        assert f.sender.stats[v].flip_missing == ()


@pytest.mark.parametrize("mode, part", [("patch", 0), ("bucket", 1)])
async def test_a_leaf_that_never_stages_is_named_through_its_relay_and_resynced(fleet: Any, mode: str, part: int) -> None:
    """A leaf below a relay stalls on v1: the relay's deadline (``RELAY_SHARE`` of the
    trainer's ``stage_timeout``) goes without it, the relay reports v1 staged naming it,
    and the trainer flips without it (``flip_missing``: ``relay/slow``) before its own
    timeout would have left the whole relay out. The stalled leaf never commits v1 until it
    is resynced; then everyone flips v2 together. No version is committed before its flip.
    The trainer's deadline is 4 s, the relay's 2 s: at 2 s and 1 s the relay's report once
    came after the trainer's own deadline, beside the whole suite on 2 cores."""
    timeout = 4.0
    f = await fleet(mode, commit="together", stage_timeout=timeout)
    relay = await f.receiver("relay", relay_endpoint="tcp://127.0.0.1:0")
    assert relay.relay_endpoint is not None and relay.relay is not None and relay.relay.server.flips is not None
    direct = await f.receiver("direct")
    fast = await f.receiver("fast", relay.relay_endpoint)
    async with f.stalled(upstream=relay.relay_endpoint, part=part, peer_timeout=20.0) as (slow, stall):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.cohort == {"relay", "direct"} and flip.missing == ("relay/slow",) and f.sender.stats[v].flip_missing == ("relay/slow",)
        assert flip.seconds is not None and flip.seconds >= RELAY_SHARE * timeout  # the relay's deadline decided it
        for r in (relay, direct, fast):
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
        below = relay.relay.server.flips.record(v)
        assert below is not None and below.missing == ("slow",)
        assert slow.version == 0 and slow.pending_version is None and stall.stalled.is_set()
        stall.release()  # the connection is reset mid-message: it reconnects, behind, and catches up
        await slow.wait_for_version(v, timeout=T)
        await assert_matches(slow, f.trainer, v)
        v2 = await f.trainer.step_and_sync(f.sender)
        flip2 = await f.sender.wait_flipped(v2, timeout=T)
        assert flip2.missing == () and relay.relay.server.flips.record(v2).missing == ()
        for r in (relay, direct, fast, slow):
            await r.wait_for_version(v2, timeout=T)
            await assert_matches(r, f.trainer, v2)
        assert set(f.commits) == {0, v, v2} and set(f.commits[v2]) == {"relay", "direct", "fast", "slow"}
        for version, decided in ((v, flip.decided_at), (v2, flip2.decided_at)):
            assert decided is not None and min(f.commits[version].values()) >= decided  # nothing committed unflipped
        await slow.close()


async def test_a_leaf_two_relays_down_is_named_by_its_path_within_each_relays_share(fleet: Any) -> None:
    """trainer -> relay-a -> relay-b -> {fast, slow}: each relay decides within half its
    parent's deadline (the trainer's ``stage_timeout`` / 2, then / 4), so relay-b goes
    without the stalled leaf, relay-a reports its subtree staged naming ``relay-b/slow``, and
    the trainer flips before its own timeout, naming the leaf by its whole path."""
    timeout = 4.0
    f = await fleet(commit="together", stage_timeout=timeout)
    a = await f.receiver("relay-a", relay_endpoint="tcp://127.0.0.1:0")
    assert a.relay_endpoint is not None and a.relay is not None and a.relay.server.flips is not None
    b = await f.receiver("relay-b", a.relay_endpoint, relay_endpoint="tcp://127.0.0.1:0")
    assert b.relay_endpoint is not None and b.relay is not None and b.relay.server.flips is not None
    assert (a.relay.server.flips.stage_timeout, b.relay.server.flips.stage_timeout) == (RELAY_SHARE * timeout, RELAY_SHARE**2 * timeout)
    fast = await f.receiver("fast", b.relay_endpoint)
    async with f.stalled(upstream=b.relay_endpoint, peer_timeout=20.0) as (slow, stall):
        v = await f.trainer.step_and_sync(f.sender)
        flip = await f.sender.wait_flipped(v, timeout=T)
        assert flip.missing == ("relay-a/relay-b/slow",) and f.sender.stats[v].flip_missing == ("relay-a/relay-b/slow",)
        assert flip.seconds is not None and flip.seconds >= RELAY_SHARE**2 * timeout
        for r in (a, b, fast):
            await r.wait_for_version(v, timeout=T)
            await assert_matches(r, f.trainer, v)
        assert slow.version == 0 and "slow" not in f.commits.get(v, {})
        assert (a.relay.server.flips.record(v).missing, b.relay.server.flips.record(v).missing) == (("relay-b/slow",), ("slow",))
        stall.release()
        await slow.wait_for_version(v, timeout=T)
        await assert_matches(slow, f.trainer, v)
        decided = flip.decided_at
        assert decided is not None and min(f.commits[v].values()) >= decided
        await slow.close()


async def test_a_relay_that_predates_flips_through_relays_is_refused(fleet: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay whose HELLO does not say ``subtree`` (before flips waited for the receivers
    below a relay) would report versions staged before its receivers have: a together
    sender refuses it, clearly, at its first report; a receiver of that age that does not
    relay is served as before."""
    monkeypatch.setattr(receiver.strategy.base, "Hello", lambda *a, **kw: Hello(*a, **{**kw, "subtree": False}))
    f = await fleet(commit="together")
    with pytest.raises(WeightSyncError, match="predates"):
        old = await f.receiver("old", relay_endpoint="tcp://127.0.0.1:0")
        await old.wait_for_version(1, timeout=T)
    await wait_until(lambda: "old" not in f.sender.server.receivers)
    leaf = await f.receiver("leaf")
    v = await f.trainer.step_and_sync(f.sender)
    assert (await f.sender.wait_flipped(v, timeout=T)).missing == ()
    await leaf.wait_for_version(v, timeout=T)
    await assert_matches(leaf, f.trainer, v)
