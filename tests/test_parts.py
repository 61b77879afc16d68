"""Patches in parts (``patch.part_bytes``): the sender daemon serves each part as soon as it
is encoded; receivers stage each as it arrives and commit the version after the last one,
never before. Real AdamW steps, real sockets, bf16 receivers checked bit for bit."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from daemon_helpers import DAEMON_KW, T, Trainer, assert_matches, receiver_model, wait_until

from protocol.errors import ConfigError
from protocol.wire.checksum import checksum, state_digest
from protocol.wire.framing import Encoding, Message, MessageType, Role, decode_message, encode_message
from receiver import Receiver
from sender import Sender
from sender.version.collector import Collector
from sender.version.part_encoder import PartEncoder

# every tensor on its own (group_numel 0): this small model's tensors would otherwise make one group
PARTS = {"type": "patch", "patch": {"part_bytes": 4096, "group_numel": 0, "init_sync": {"bucket_size": 96 << 10}}}


class Fleet:
    def __init__(self, codec: str = "auto") -> None:
        self.daemons: list[Any] = []
        self.codec = codec  # patch.codec
        self.config = {**PARTS, "patch": {**PARTS["patch"], "codec": codec}}

    async def sender(self, trainer: Trainer) -> Sender:
        s = Sender("tcp://127.0.0.1:0", self.config, **DAEMON_KW)
        self.daemons.append(s)
        return await asyncio.wait_for(s.start(trainer.model, version=trainer.version), T)

    async def receiver(self, endpoint: str, identity: str, **kw: Any) -> Receiver:
        r = Receiver(receiver_model(), endpoint, self.config, identity=identity, **{**DAEMON_KW, **kw})
        self.daemons.insert(0, r)
        return await r.start(timeout=T)


@pytest.fixture
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """``patch.codec`` auto (the host codec, on CPU), or as the test parametrizes it (indirect)."""
    f = Fleet(getattr(request, "param", "auto"))
    try:
        yield f
    finally:
        for d in f.daemons:
            await asyncio.wait_for(d.close(), T)


def published_versions_are_whole(r: Receiver, trainer: Trainer) -> list[int | None]:
    """Record every version ``r`` publishes, checking then, under its read lock, that its
    model is exactly the trainer's image of the version it holds (a version published
    before its last part was written would differ; hooks run in their own task, so a newer
    version may be in by then)."""
    seen: list[int | None] = []

    async def check(version: int | None) -> None:
        async with r.reading() as held:
            whole = held is not None and version is not None and held >= version and state_digest(r.model.state_dict()) == trainer.digests[held]
        assert whole, (version, held)
        seen.append(version)

    r.on_update(check)
    return seen


@pytest.mark.parametrize("fleet", ["auto", "device"], indirect=True)
async def test_parts_are_bit_exact_through_a_relay(fleet: Fleet) -> None:
    trainer = Trainer()
    s = await fleet.sender(trainer)
    relay = await fleet.receiver(s.endpoint, "relay", relay_endpoint="tcp://127.0.0.1:0")
    assert relay.relay_endpoint is not None
    leaves = [await fleet.receiver(relay.relay_endpoint, f"leaf{i}") for i in range(2)]
    seen = [published_versions_are_whole(r, trainer) for r in (relay, *leaves)]
    for _ in range(3):
        version = await trainer.step_and_sync(s)
        await s.flush()
        assert s.stats[version].messages > 2  # this model at 4 kB a part
        for r in (relay, *leaves):
            await r.wait_for_version(version, timeout=T)
            await assert_matches(r, trainer, version)
            assert r.stats[version].kind == "patch" and r.stats[version].messages == s.stats[version].messages
    sparse = {e.encoding for frames in s.server._ring.newest.messages for e in decode_message(frames).tensors} - {Encoding.DENSE}
    assert sparse and (sparse == {Encoding.BLOCKS}) == (fleet.codec == "device"), sparse  # v3's sparse entries
    for r in (relay, *leaves):
        await r.hooks_idle(T)
    assert all(v == [1, 2, 3] for v in seen), seen  # each version once, none resynced
    assert all(info["resyncs"] == 0 for info in s.receivers.values())


async def test_a_part_is_served_before_the_next_is_encoded(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer()
    s = await fleet.sender(trainer)
    r = await fleet.receiver(s.endpoint, "r0")
    seen = published_versions_are_whole(r, trainer)
    release = asyncio.Event()
    encode_part = PartEncoder.part

    async def held_after_the_first(self: PartEncoder, changes: list[Any], version: int, base: int | None, stats: Any,
                                   part: int, parts: int) -> Message:
        if part == 1:
            await release.wait()
        return await encode_part(self, changes, version, base, stats, part, parts)

    monkeypatch.setattr(PartEncoder, "part", held_after_the_first)
    delivered = delivered_parts(monkeypatch, s)
    version = await trainer.step_and_sync(s)
    # Part 1 waits: part 0 is on its way to the receiver all the same, and the version is not published.
    await wait_until(lambda: (MessageType.PATCH, version, 0) in delivered)
    await asyncio.sleep(0.2)
    assert r.version == version - 1 and seen == []
    assert [d for d in delivered if d[1] == version] == [(MessageType.PATCH, version, 0)]
    release.set()
    await r.wait_for_version(version, timeout=T)
    await assert_matches(r, trainer, version)
    await r.hooks_idle(T)
    assert seen == [version] and s.stats[version].messages > 2


def damaged_device_payload(frames: list[Any]) -> list[Any] | None:
    """``frames`` with a byte of a device-coded payload flipped and the message framed
    again (frame and header checksums right): the device decoder's verdict must catch it.
    None for a part without a device-coded entry (every tensor in it sent whole)."""
    msg = decode_message(frames)
    entry = next((e for e in msg.tensors if e.encoding is Encoding.BLOCKS), None)
    if entry is None:
        return None
    spec = entry.buffer(Role.VALUES)
    payload = bytearray(msg.frames[spec.frame - 1])
    payload[len(payload) // 2] ^= 0x10
    msg.frames[spec.frame - 1] = bytes(payload)
    fixed = dataclasses.replace(spec, checksum=checksum(bytes(payload)))
    msg.tensors = [dataclasses.replace(e, buffers=tuple(fixed if b is spec else b for b in e.buffers)) if e is entry else e for e in msg.tensors]
    return list(encode_message(msg))


@pytest.mark.parametrize("fleet", ["auto", "device"], indirect=True)
async def test_a_damaged_part_publishes_nothing_and_is_resynced(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part damaged on its way (a frame's byte: its checksum fails; device-coded: a
    payload byte under valid frame checksums, which the decoder refuses) is NACKed, nothing
    of its version is published, and the receiver is resynced."""
    trainer = Trainer()
    s = await fleet.sender(trainer)
    r = await fleet.receiver(s.endpoint, "r0")
    seen = published_versions_are_whole(r, trainer)
    publish = s.server.publish_patch
    parts_seen: list[int] = []
    damaged: list[int] = []

    def damage_the_second(base: int | None, version: int, frames: list[Any], *, last: bool = True) -> None:
        parts_seen.append(version)
        if fleet.codec == "device" and version == 2 and not damaged:  # v2's first part with a device-coded entry
            bad = damaged_device_payload(frames)
            if bad is not None:
                frames = bad
                damaged.append(version)
        elif parts_seen.count(version) == 2 and version == 2:  # v2's second part: flip a payload byte
            payload = bytearray(frames[1])
            payload[len(payload) // 2] ^= 0x10
            frames = [frames[0], bytes(payload), *frames[2:]]
        publish(base, version, frames, last=last)

    monkeypatch.setattr(s.server, "publish_patch", damage_the_second)
    for _ in range(3):
        version = await trainer.step_and_sync(s)
        await r.wait_for_version(version, timeout=T)
        await assert_matches(r, trainer, version)
    await r.hooks_idle(T)
    assert seen == [1, 2, 3]  # v2 came by resync, whole; its damaged parts were never published
    assert damaged == ([2] if fleet.codec == "device" else [])
    assert r.stats[2].kind == "bootstrap" and s.receivers["r0"]["resyncs"] == 1


def compare_hooked(monkeypatch: pytest.MonkeyPatch, hook: Any) -> None:
    """Every compare on its thread (as a large model's is), ``hook(n)`` before its n-th kernel call."""
    from sender.diff import fastdiff

    real, calls = fastdiff.diff_and_update, [0]

    def hooked(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        hook(calls[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(Collector, "_inline", lambda self, tensors: False)
    monkeypatch.setattr(fastdiff, "diff_and_update", hooked)


def delivered_parts(monkeypatch: pytest.MonkeyPatch, s: Sender) -> list[tuple[MessageType, int | None, int]]:
    delivered: list[tuple[MessageType, int | None, int]] = []
    deliver = s.server._pump._deliver

    async def recorded(peer: Any, frames: list[Any]) -> None:
        msg = decode_message(frames)
        delivered.append((msg.type, msg.version, msg.part))
        await deliver(peer, frames)

    monkeypatch.setattr(s.server._pump, "_deliver", recorded)
    return delivered


async def test_parts_travel_while_the_compare_goes_on(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first parts leave while later tensors are still being compared: sync() has not
    returned, and the version is not published until its last part is in."""
    trainer = Trainer()
    s = await fleet.sender(trainer)
    r = await fleet.receiver(s.endpoint, "r0")
    seen = published_versions_are_whole(r, trainer)
    release = threading.Event()
    compare_hooked(monkeypatch, lambda n: n == 8 and release.wait(T))
    delivered = delivered_parts(monkeypatch, s)
    version = trainer.step()
    sync = asyncio.ensure_future(s.sync(trainer.model, version))
    await wait_until(lambda: (MessageType.PATCH, version, 0) in delivered)
    await asyncio.sleep(0.1)
    assert not sync.done() and r.version == version - 1 and seen == []
    release.set()
    await asyncio.wait_for(sync, T)
    await r.wait_for_version(version, timeout=T)
    await assert_matches(r, trainer, version)
    await r.hooks_idle(T)
    assert seen == [version] and s.stats[version].messages > 2


async def test_a_compare_failing_after_parts_went_out_resyncs(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of a version whose compare then fails are abandoned: the receiver holding them
    publishes nothing of it, and takes the next version's resync in their place."""
    trainer = Trainer()
    s = await fleet.sender(trainer)
    rs = [await fleet.receiver(s.endpoint, f"r{i}") for i in range(2)]
    seen = [published_versions_are_whole(r, trainer) for r in rs]
    delivered = delivered_parts(monkeypatch, s)
    loop = asyncio.get_running_loop()

    def fail_the_eighth(n: int) -> None:
        if n == 8:
            # once the first part reached both receivers
            asyncio.run_coroutine_threadsafe(wait_until(lambda: delivered.count((MessageType.PATCH, 1, 0)) == 2), loop).result(T)
            raise RuntimeError("compare failed")

    compare_hooked(monkeypatch, fail_the_eighth)
    with pytest.raises(RuntimeError, match="compare failed"):
        await s.sync(trainer.model, trainer.step())
    await asyncio.sleep(0.2)
    assert all(r.version == 0 for r in rs) and seen == [[], []]
    monkeypatch.undo()
    delivered = delivered_parts(monkeypatch, s)
    version = await trainer.step_and_sync(s)
    for r in rs:
        await r.wait_for_version(version, timeout=T)
        await assert_matches(r, trainer, version)
        assert r.stats[version].kind == "bootstrap"
    assert {d[0] for d in delivered} == {MessageType.BOOTSTRAP}
    version = await trainer.step_and_sync(s)
    for r in rs:
        await r.wait_for_version(version, timeout=T)
        await assert_matches(r, trainer, version)
        assert r.stats[version].kind == "patch"
    for r in rs:
        await r.hooks_idle(T)
    assert seen == [[2, 3], [2, 3]] and s.failure is None
    assert all(info["resyncs"] == 1 for info in s.receivers.values()), s.receivers


def test_part_bytes_is_checked() -> None:
    for bad in (-1, 1.5, "1MiB", True):
        with pytest.raises(ConfigError, match="part_bytes"):
            Sender("tcp://127.0.0.1:0", {"type": "patch", "patch": {"part_bytes": bad}})
