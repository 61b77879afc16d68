"""Relays: receivers that serve the versions they applied to receivers below them.

A trainer does real AdamW steps; relays follow it and leaves follow the relays, over
real tcp:// sockets, in patch and bucket mode. After every version each leaf holds the
trainer's bf16 weights bit for bit, the trainer served each version once per relay (not
per leaf), and acks, catch-up, resync and a relay's death all work through the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq
from daemon_helpers import CONFIGS, DAEMON_KW, Processes, T, Trainer, assert_matches, receiver_model, wait_until

from protocol.errors import ConfigError, MetadataMismatchError, WeightSyncError
from protocol.net.security import CurveClient, CurveServer, KeyPair
from protocol.wire.framing import Message, MessageType, decode_message
from receiver import Receiver
from sender import Sender

MODES = ["patch", "bucket"]


class Tree:
    """A sender and the receivers of one test, closed at the end (leaves first)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.trainer = Trainer()
        self.sender: Sender | None = None
        self.receivers: list[Receiver] = []

    async def start_sender(self, **kw: Any) -> Sender:
        self.sender = Sender("tcp://127.0.0.1:0", CONFIGS[self.mode], **{**DAEMON_KW, **kw})
        await asyncio.wait_for(self.sender.start(self.trainer.model, version=self.trainer.version), T)
        return self.sender

    async def start_relay(self) -> tuple[Sender, Receiver]:
        """The sender, and a relay ("relay") following it with its server up."""
        sender = await self.start_sender()
        relay = await self.start_receiver(sender.endpoint, "relay", relay=True)
        assert relay.relay_endpoint is not None and relay.relay is not None
        return sender, relay

    async def start_receiver(self, upstream: str | list[str], identity: str, *, relay: bool = False, **kw: Any) -> Receiver:
        r = Receiver(
            kw.pop("model", None) or receiver_model(), upstream, CONFIGS[self.mode], identity=identity,
            relay_endpoint="tcp://127.0.0.1:0" if relay else None, **{**DAEMON_KW, **kw},
        )
        self.receivers.append(r)
        await r.start(timeout=T)
        return r

    async def step(self, *receivers: Receiver) -> int:
        assert self.sender is not None
        version = await self.trainer.step_and_sync(self.sender)
        for r in receivers:
            await r.wait_for_version(version, timeout=T)
            await assert_matches(r, self.trainer, version)
        return version

    async def close(self) -> None:
        for r in reversed(self.receivers):
            await asyncio.wait_for(r.close(), T)
        if self.sender is not None:
            await asyncio.wait_for(self.sender.close(), T)


@contextlib.asynccontextmanager
async def tree(mode: str) -> AsyncIterator[Tree]:
    t = Tree(mode)
    try:
        yield t
    finally:
        await t.close()


@pytest.mark.parametrize("mode", [*MODES, "patch-device"])
async def test_two_level_tree_is_bit_identical_and_trainer_serves_each_version_once(mode):
    """trainer -> relay -> 2 leaves: every leaf bit-identical after each version; the
    trainer has one receiver, the relay two, and the relay acknowledges upstream."""
    async with tree(mode) as t:
        sender = await t.start_sender()
        relay = await t.start_receiver(sender.endpoint, "relay", relay=True)
        assert relay.relay_endpoint is not None and relay.relay_endpoint.startswith("tcp://127.0.0.1:")
        leaves = [await t.start_receiver(relay.relay_endpoint, f"leaf-{i}") for i in range(2)]
        for r in (relay, *leaves):
            await assert_matches(r, t.trainer, 0)
        for _ in range(4):
            version = await t.step(relay, *leaves)
            await asyncio.wait_for(sender.wait_acked(version), T)
            assert relay.relay is not None
            await asyncio.wait_for(relay.relay.server.wait_acked(version), T)
        assert list(sender.receivers) == ["relay"]
        assert relay.relay is not None and sorted(relay.relay.server.receivers) == ["leaf-0", "leaf-1"]
        assert relay.status()["relay_receivers"] == 2
        if mode.startswith("patch"):  # leaves were caught up by the forwarded patches, not resynced
            assert all(p["resyncs"] == 0 for p in relay.relay.server.receivers.values())
            assert all(leaf.stats[v].kind == "patch" for leaf in leaves for v in range(1, 5))


async def test_three_levels_deep():
    """trainer -> relay -> relay -> leaf: versions pass through two relays intact."""
    async with tree("patch") as t:
        sender = await t.start_sender()
        top = await t.start_receiver(sender.endpoint, "top", relay=True)
        assert top.relay_endpoint is not None
        middle = await t.start_receiver(top.relay_endpoint, "middle", relay=True)
        assert middle.relay_endpoint is not None
        leaf = await t.start_receiver(middle.relay_endpoint, "leaf")
        for _ in range(3):
            await t.step(top, middle, leaf)


@pytest.mark.parametrize("mode", ["patch", "patch-device"])
async def test_late_leaf_is_bootstrapped_by_the_relay_and_a_slow_one_caught_up_from_its_ring(mode):
    """A leaf joining after several versions gets the relay's bootstrap; a leaf held back
    for two versions is caught up with the forwarded patches, one by one, no bootstrap."""
    async with tree(mode) as t:
        _, relay = await t.start_relay()
        for _ in range(3):
            await t.step(relay)
        late = await t.start_receiver(relay.relay_endpoint, "late")
        await assert_matches(late, t.trainer, 3)
        assert late.stats[3].kind == "bootstrap"
        await t.step(relay, late)

        async with late.reading():  # nothing can be committed on `late` meanwhile
            for _ in range(2):
                await t.step(relay)
            assert late.version == 4
        await late.wait_for_version(6, timeout=T)
        await assert_matches(late, t.trainer, 6)
        assert [late.stats[v].kind for v in (5, 6)] == ["patch", "patch"]
        assert relay.relay.server.receivers["late"]["resyncs"] == 0


async def test_a_corrupted_forward_is_nacked_and_the_leaf_resynced_from_the_relay():
    """The relay only forwards what it applied; a leaf that rejects a message (here: one
    it is told never arrived intact) is resynced by the relay, the trainer never hears of it."""
    async with tree("patch") as t:
        sender, relay = await t.start_relay()
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        await t.step(relay, leaf)
        # Corrupt the next patch on its way from the relay to the leaf: flip a payload byte.
        original = relay.relay.server.publish_patch

        def corrupt(base: int | None, version: int, frames: list[Any], *, last: bool = True) -> None:
            frames = [frames[0], *(bytes(f) for f in frames[1:])]
            payload = bytearray(frames[1])
            payload[len(payload) // 2] ^= 0x10
            frames[1] = bytes(payload)
            relay.relay.server.publish_patch = original  # type: ignore[method-assign]
            original(base, version, frames, last=last)

        relay.relay.server.publish_patch = corrupt  # type: ignore[method-assign]
        await t.step(relay, leaf)  # the leaf rejected v2 and was resynced to it
        assert relay.relay.server.receivers["leaf"]["resyncs"] == 1
        assert leaf.stats[2].kind == "bootstrap"
        assert sender.receivers["relay"]["resyncs"] == 0
        await t.step(relay, leaf)


async def test_children_move_to_another_relay_when_theirs_dies():
    """Two relays; a leaf given both as its upstreams follows the first, and when that one
    dies it moves to the second, resumes from its ring (same lineage) and stays exact."""
    async with tree("patch") as t:
        sender = await t.start_sender()
        first = await t.start_receiver(sender.endpoint, "relay-a", relay=True)
        second = await t.start_receiver(sender.endpoint, "relay-b", relay=True)
        assert first.relay_endpoint and second.relay_endpoint and second.relay is not None
        leaf = await t.start_receiver([first.relay_endpoint, second.relay_endpoint], "leaf")
        assert leaf.endpoint == first.relay_endpoint
        await t.step(first, second, leaf)

        await first.close()  # the relay dies (its children hear nothing more)
        t.receivers.remove(first)
        await wait_until(lambda: "leaf" in second.relay.server.receivers, timeout=T)
        assert leaf.endpoint == second.relay_endpoint
        for _ in range(2):
            await t.step(second, leaf)
        assert second.relay.server.receivers["leaf"]["resyncs"] == 0
        assert leaf.reconnects >= 1


async def test_a_leaf_unlike_the_relay_is_refused_naming_the_key():
    """A relay's children must share its metadata exactly (same keys, shapes, dtypes)."""
    async with tree("patch") as t:
        sender = await t.start_sender()
        relay = await t.start_receiver(sender.endpoint, "relay", relay=True)
        assert relay.relay_endpoint is not None
        odd = Receiver(receiver_model().to(torch.float32), relay.relay_endpoint, CONFIGS["patch"], identity="odd", **DAEMON_KW)
        t.receivers.append(odd)
        expected = "key 'pos': this receiver holds [32, 64] torch.float32; this relay's model: [32, 64] torch.bfloat16"
        with pytest.raises(WeightSyncError, match=re.escape(expected)) as raised:
            await odd.start(timeout=T)
        assert isinstance(raised.value.__cause__, MetadataMismatchError)


async def test_a_relay_forwards_a_patch_before_it_applies_it():
    """While the relay is paused, the trainer moves on: the relay stages the version and
    keeps its own, and its leaf gets the version anyway, each part forwarded once it passed
    the relay's checks (a tree's latency does not grow by one apply a level); after resume
    the relay has it too. Each message the leaf sees is stamped by the trainer's lineage
    (upstream session)."""
    async with tree("patch") as t:
        sender, relay = await t.start_relay()
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        await relay.pause()
        version = await t.trainer.step_and_sync(sender)
        await leaf.wait_for_version(version, timeout=T)
        await assert_matches(leaf, t.trainer, version)
        assert relay.version == 0 and relay.pending_version == version and relay.relay.server.version == 0
        await relay.resume()
        await relay.wait_for_version(version, timeout=T)
        await assert_matches(relay, t.trainer, version)
        assert relay.relay.server.version == version
        assert relay.relay.server.session == sender.session
        entry = relay.relay.server._ring.newest
        assert entry is not None and entry.complete and all(decode_message(m).type is MessageType.PATCH for m in entry.messages)
        assert all(decode_message(m).session == sender.session for m in entry.messages)


async def test_a_relay_sleeps_its_weights_and_wakes():
    """``sleep`` on a relay (it was a ConfigError about engine shared memory, though the
    README said a relay could sleep): its weights' storages shrink to nothing; the leaf it
    holds keeps its version; a leaf joining meanwhile needs a bootstrap, is refused with a
    StateError and reconnects, never stopping; after ``wakeup`` the relay is bootstrapped
    by the trainer again and both leaves follow it bit for bit."""
    async with tree("patch") as t:
        sender, relay = await t.start_relay()
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        await t.step(relay, leaf)
        slept = await relay.sleep("weight")
        assert slept["asleep"] == ["weight"] and slept["freed_bytes"] > 0
        assert all(p.untyped_storage().nbytes() == 0 for p in relay.model.parameters())
        version = await t.trainer.step_and_sync(sender)  # the trainer moves on; the relay left it
        late = Receiver(receiver_model(), relay.relay_endpoint, CONFIGS["patch"], identity="late", **DAEMON_KW)
        t.receivers.append(late)
        joining = asyncio.ensure_future(late.start(timeout=T))
        await wait_until(lambda: late.reconnects >= 2 or joining.done())  # refused, and tried again
        assert not joining.done() and late.healthy and late.version is None
        assert leaf.version == 1 and leaf.healthy and "late" not in relay.relay.server.receivers
        await assert_matches(leaf, t.trainer, 1)
        woke = await relay.wakeup("weight")
        assert woke["asleep"] == [] and woke["version"] == version
        await asyncio.wait_for(joining, T)
        for r in (relay, leaf, late):
            await r.wait_for_version(version, timeout=T)
            await assert_matches(r, t.trainer, version)
        await t.step(relay, leaf, late)


async def test_a_leaf_the_sleeping_relay_cannot_serve_is_dropped_not_forgotten():
    """A paused leaf falls behind the relay's ring, then the relay sleeps, then the leaf
    resumes: catching it up needs a bootstrap the relay cannot build asleep, so its pump
    fails (StateError). The relay drops the leaf and tells it why; the leaf reconnects
    until the relay wakes, then is resynced. (The pump used to die silently: the leaf
    stayed registered and heartbeated, and was never served again.)"""
    async with tree("patch") as t:
        _, relay = await t.start_relay()
        server = relay.relay.server
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        await t.step(relay, leaf)
        await leaf.pause()  # it stages the next version and holds it: its credits run out
        for _ in range(server.ring_size + 4):
            await t.step(relay)
        assert leaf.version == 1 and server.receivers["leaf"]["sent"] == 1 + server.max_inflight
        await relay.sleep("weight")
        reconnects = leaf.reconnects
        await leaf.resume()
        await wait_until(lambda: leaf.reconnects > reconnects)  # dropped, told why: it tries again
        assert leaf.healthy and relay.healthy and not server._failure
        async with leaf.reading():
            assert leaf.version is not None and leaf.version < 1 + server.max_inflight + 1
            await assert_matches(leaf, t.trainer, leaf.version)
        await relay.wakeup("weight")
        await leaf.wait_for_version(t.trainer.version, timeout=T)
        await assert_matches(leaf, t.trainer, t.trainer.version)
        await t.step(relay, leaf)


async def test_sleep_still_refuses_weights_whose_writes_are_wrapped():
    """What the relay was wrongly refused for stays refused where it is true: a receiver
    whose writes go through ``wrap_write`` (a sidecar's shared memory, which an engine
    maps) cannot release its weights; nothing is paused or released."""
    async with tree("patch") as t:
        sender = await t.start_sender()
        wrapped = await t.start_receiver(sender.endpoint, "wrapped", wrap_write=lambda write: write)
        with pytest.raises(ConfigError, match="writes are wrapped"):
            await wrapped.sleep("weight")
        assert not wrapped.is_paused and wrapped.asleep == frozenset()
        await t.step(wrapped)


async def test_a_damaged_first_bootstrap_is_asked_for_again():
    """A receiver whose very first bootstrap arrives corrupted reconnects and asks again
    (it used to stop for good): here the relay damages the first one it sends."""
    async with tree("patch") as t:
        _, relay = await t.start_relay()
        await t.step(relay)
        original = relay.relay.server.resync_messages
        sent: list[bool] = []

        async def damaged_once() -> list[Message]:
            messages = await original()
            if sent:
                return messages
            sent.append(True)
            first = messages[0]
            payload = bytearray(first.frames[0])
            payload[0] ^= 0x01
            return [dataclasses.replace(first, frames=[bytes(payload), *first.frames[1:]]), *messages[1:]]

        relay.relay.server.resync_messages = damaged_once  # type: ignore[method-assign]
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        await assert_matches(leaf, t.trainer, 1)
        assert sent and leaf.reconnects >= 1
        await t.step(relay, leaf)


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE (built without libsodium)")
async def test_curve_on_every_hop_and_an_intruder_refused_by_the_relay():
    """The relay is a CURVE client of the trainer and a CURVE server to its leaves: the
    allowed leaf follows bit for bit, a leaf whose key the relay does not allow gets nothing."""
    sender_keys, relay_keys, leaf_keys, intruder_keys = (KeyPair.generate() for _ in range(4))
    async with tree("patch") as t:
        t.sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], curve=CurveServer(sender_keys, frozenset({relay_keys.public})), **DAEMON_KW)
        await asyncio.wait_for(t.sender.start(t.trainer.model, version=0), T)
        relay = await t.start_receiver(
            t.sender.endpoint, "relay", relay=True, curve=CurveClient(relay_keys, sender_keys.public),
            relay_curve=CurveServer(relay_keys, frozenset({leaf_keys.public})),
        )
        assert relay.relay_endpoint is not None and relay.relay is not None
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf", curve=CurveClient(leaf_keys, relay_keys.public))
        intruder = Receiver(receiver_model(), relay.relay_endpoint, CONFIGS["patch"], identity="intruder",
                            curve=CurveClient(intruder_keys, relay_keys.public), **DAEMON_KW)
        t.receivers.append(intruder)
        with pytest.raises(TimeoutError):
            await intruder.start(timeout=1.5)
        for _ in range(2):
            await t.step(relay, leaf)
        assert relay.relay.server.rejected_handshakes >= 1 and relay.relay.server.rejected_keys == {intruder_keys.public.decode()}
        assert intruder.version is None and sorted(relay.relay.server.receivers) == ["leaf"]


async def test_the_trainer_can_wait_for_the_whole_tree():
    """Relays report the receivers below them with their acks and heartbeats:
    ``wait_acked(v, tree=True)`` returns only once every leaf under every relay has v,
    and a leaf held back keeps it waiting while the relay itself is already there."""
    async with tree("patch") as t:
        sender = await t.start_sender()
        relay = await t.start_receiver(sender.endpoint, "relay", relay=True)
        assert relay.relay_endpoint is not None
        leaves = [await t.start_receiver(relay.relay_endpoint, f"leaf-{i}") for i in range(2)]
        # both leaves counted first: with one counted, the tree is "all at 0" before the other joins
        await wait_until(lambda: sender.receivers["relay"]["below"] == 2, timeout=T)
        await asyncio.wait_for(sender.wait_acked(0, tree=True), T)
        assert sender.subtree() == (3, 0)

        async with leaves[1].reading():  # leaf-1 cannot apply anything meanwhile
            version = await t.trainer.step_and_sync(sender)
            await asyncio.wait_for(sender.wait_acked(version), T)  # the relay has it
            with pytest.raises(TimeoutError):
                await sender.wait_acked(version, timeout=1.0, tree=True)
            assert sender.receivers["relay"]["below_acked"] == 0
        await asyncio.wait_for(sender.wait_acked(version, tree=True), T)
        for r in (relay, *leaves):
            await assert_matches(r, t.trainer, version)


async def test_relay_processes_and_a_leaf_that_outlives_its_relay(tmp_path):
    """The CLI: two ``python -m receiver --relay-bind`` processes under an in-process
    trainer, a leaf process given both (``--endpoint`` twice). ``kill -9`` of the leaf's
    relay: it moves to the other, and every version it reports has the trainer's digest."""
    timing = ["--heartbeat", "0.1", "--peer-timeout", "2.0", "--digest"]
    model = "examples.tiny_model:build"
    procs = Processes(tmp_path)
    async with tree("patch") as t:
        try:
            sender = await t.start_sender()
            relays = [
                await procs.spawn(name, "receiver", "--endpoint", sender.endpoint, "--model", model, "--identity", name,
                                  "--relay-bind", "tcp://127.0.0.1:0", *timing)
                for name in ("relay-a", "relay-b")
            ]
            parents = [(await r.wait_event(lambda e: e.get("event") == "relay"))["endpoint"] for r in relays]
            leaf = await procs.spawn("leaf", "receiver", "--endpoint", parents[0], "--endpoint", parents[1], "--model", model,
                                     "--identity", "leaf", *timing)

            async def step_and_check() -> int:
                version = await t.trainer.step_and_sync(sender)
                event = await leaf.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version)
                assert event["digest"] == t.trainer.digests[version]
                return version

            await leaf.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == 0)
            await step_and_check()
            await relays[0].kill()
            for _ in range(3):
                await step_and_check()
            await sender.wait_acked(t.trainer.version, timeout=T)
            assert sorted(sender.receivers) == ["relay-b"]
            assert all(e["digest"] == t.trainer.digests[e["version"]] for e in leaf.applied() if "superseded_by" not in e)
            assert await leaf.terminate() == 0
        finally:
            await procs.cleanup()


async def test_an_endpoint_resolver_follows_a_sender_that_moved():
    """``Receiver(model, resolver)``: the address is asked for before each session, so a
    sender restarted on another port (a Ray actor, a rescheduled pod) is found again."""
    async with tree("patch") as t:
        first = await t.start_sender()
        where = {"endpoint": first.endpoint}
        asked: list[str] = []

        async def resolve() -> str:
            asked.append(where["endpoint"])
            return where["endpoint"]

        r = Receiver(receiver_model(), resolve, CONFIGS["patch"], identity="rollout", **DAEMON_KW)
        t.receivers.append(r)
        await r.start(timeout=T)
        assert r.endpoint == first.endpoint
        await t.step(r)

        await first.close()  # the trainer's sender restarts elsewhere, at the version it had
        second = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
        await asyncio.wait_for(second.start(t.trainer.model, version=t.trainer.version), T)
        t.sender = second
        where["endpoint"] = second.endpoint
        await asyncio.wait_for(second.wait_for_receivers(1), T)
        assert r.endpoint == second.endpoint and asked[-1] == second.endpoint
        for _ in range(2):
            await t.step(r)


def test_a_relay_beyond_loopback_needs_curve_or_the_insecure_flag():
    """Like a sender, a relay refuses to serve weights in plaintext off loopback."""
    with pytest.raises(ConfigError, match=r"the relay would use tcp://0\.0\.0\.0:0 without CURVE.*--relay-curve-allow"):
        Receiver(receiver_model(), "tcp://127.0.0.1:1", CONFIGS["patch"], relay_endpoint="tcp://0.0.0.0:0")
    allowed = Receiver(receiver_model(), "tcp://127.0.0.1:1", CONFIGS["patch"], relay_endpoint="tcp://0.0.0.0:0", insecure_plaintext=True)
    assert allowed.relay is not None


async def test_a_relay_serves_a_trainer_that_has_no_version_yet():
    """A sender started without a version (``start(model)``): the relay and its leaf are
    bootstrapped to the unversioned weights, then follow the first versions."""
    async with tree("patch") as t:
        t.sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
        await asyncio.wait_for(t.sender.start(t.trainer.model), T)
        relay = await t.start_receiver(t.sender.endpoint, "relay", relay=True)
        assert relay.relay_endpoint is not None and relay.version is None
        leaf = await t.start_receiver(relay.relay_endpoint, "leaf")
        assert leaf.version is None
        for _ in range(2):
            await t.step(relay, leaf)
