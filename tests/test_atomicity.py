"""All-or-nothing: after any rejected message the receiver's tensors are bit-identical to
before and its version is unchanged; the genuine message still applies afterwards.

The exception is the bucket strategy's ``load_instant``, which writes each bucket as it
arrives: a version rejected after its first bucket leaves the model *torn* (no version,
readers kept out) until a whole version is written over it. Those cases are marked
``torn`` and checked for that instead.

Every bad message is a modified copy of real frames captured from a real sender
(``Pipe.sent``), fed to the receiver through a fresh ``Pipe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from channel import Channel, Pipe
from models import Trainer, cast_like, make_model, mismatches, snapshot

import receiver
import receiver.strategy.write_side
import sender
from protocol.codec.compress import Codec
from protocol.errors import IntegrityError, ProtocolError, StaleVersionError, WeightSyncError
from protocol.wire.checksum import checksum
from protocol.wire.framing import Encoding, Message, MessageType, Role, decode_message, encode_message
from receiver.rwlock import ReadWriteLock

Frames = list[bytes]

# The tiny model's tensors would all travel as one group by default (patch.group_numel):
# at 512 its vectors go in groups and its matrices on their own, so a message has both.
PATCH = {"type": "patch", "patch": {"compression": "none", "group_numel": 512}}
PATCH_CONFIGS = {
    "default": {"type": "patch", "patch": {"group_numel": 512}},
    "ungrouped": {"type": "patch", "patch": {"group_numel": 0}},
    "seed-coo-raw": {"type": "patch", "patch": {"position_encoding": "coo", "delta_encoding": True, "value_encoding": "raw"}},
    "zstd": {"type": "patch", "patch": {"compression": "zstd", "group_numel": 512}},
}


def bucket_config(load_instant: bool = True, bucket_dtype: str | None = "bfloat16") -> dict[str, Any]:
    # 40 KiB buckets of bf16: exactly three buckets per version for the tiny model
    return {
        "type": "bucket",
        "bucket": {
            "bucket_size": 40 << 10,
            "bucket_dtype": bucket_dtype,
            "load_instant": load_instant,
            "init_sync": {"enabled": True, "bucket_size": 16 << 10},
        },
    }


@dataclass
class Pair:
    model: torch.nn.Module
    rmodel: torch.nn.Module
    s: Any
    r: Any
    ch: Channel
    trainer: Trainer

    async def step(self, version: int) -> None:
        """Train one step and sync it normally."""
        self.trainer.step()
        await self.s.sync(self.model, self.ch.to_receiver.send, version)
        assert await self.r.apply(self.rmodel, self.ch.to_receiver.recv) == version

    async def capture(self, version: int) -> list[Frames]:
        """Train one step and capture the version's real frames without delivering them."""
        self.trainer.step()
        cap = Pipe()
        await self.s.sync(self.model, cap.send, version)
        return cap.sent

    def before(self) -> tuple[dict[str, torch.Tensor], int | None]:
        return snapshot(self.rmodel.state_dict()), self.r.version

    def assert_untouched(self, before: tuple[dict[str, torch.Tensor], int | None]) -> None:
        state, version = before
        assert mismatches(state, self.rmodel.state_dict()) == [], "receiver tensors were written"
        assert self.r.version == version

    def assert_synced(self) -> None:
        sd, rsd = self.model.state_dict(), self.rmodel.state_dict()
        assert mismatches(cast_like(sd, rsd), rsd) == []

    async def feed(self, messages: list[Frames]) -> int:
        pipe = Pipe()
        for frames in messages:
            await pipe.send(frames)
        return int(await asyncio.wait_for(self.r.apply(self.rmodel, pipe.recv), timeout=10))

    async def reject(self, messages: list[Frames], error: type[BaseException], *, torn: bool = False) -> BaseException:
        """``torn``: rejected after a part was written on arrival (load_instant): the
        receiver then holds no version, rather than the one before."""
        before = self.before()
        with pytest.raises(error) as info:
            await self.feed(messages)
        if torn:
            assert self.r.torn and self.r.version is None
        else:
            self.assert_untouched(before)
        return info.value

    async def recover(self, messages: list[Frames], version: int, *, latest: bool = True) -> None:
        """The genuine version still applies after the rejection (bit-exact when it is the
        sender's latest)."""
        assert await self.feed(messages) == version
        assert self.r.version == version
        if latest:
            self.assert_synced()


async def make_pair(config: dict[str, Any], steps: int = 2, lr: float = 1e-3, hooks: receiver.StrategyHooks | None = None) -> Pair:
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = sender.make_sender(config), receiver.make_receiver(config, hooks)
    ch = Channel()
    await asyncio.gather(
        s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv),
        r.init_receiver(rmodel, ch.to_receiver.recv, ch.to_sender.send),
    )
    pair = Pair(model, rmodel, s, r, ch, Trainer(model, lr))
    for v in range(1, steps + 1):
        await pair.step(v)
    pair.assert_synced()
    return pair


# -- frame surgery ---------------------------------------------------------------------------
def flip(frames: Frames, index: int, pos: int | None = None) -> Frames:
    out = list(frames)
    buf = bytearray(out[index])
    pos = len(buf) // 2 if pos is None else pos
    buf[pos] ^= 0x01
    out[index] = bytes(buf)
    return out


def reencode(frames: Frames, edit: Callable[[Message], None]) -> Frames:
    """Decode real frames, edit the message, encode it again with valid checksums."""
    msg = decode_message(frames)
    edit(msg)
    return [bytes(f) for f in encode_message(msg)]


def replace_frame(msg: Message, frame: int, data: bytes) -> None:
    """Put ``data`` into payload frame ``frame`` (1-based) and fix its manifest entry."""
    msg.frames = list(msg.frames)
    msg.frames[frame - 1] = data
    for i, t in enumerate(msg.tensors):
        specs = tuple(
            dataclasses.replace(b, wire_nbytes=len(data), checksum=checksum(data)) if b.frame == frame else b for b in t.buffers
        )
        msg.tensors[i] = dataclasses.replace(t, buffers=specs)


# -- patches ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PATCH_CONFIGS))
async def test_corrupted_payload_byte(name: str) -> None:
    pair = await make_pair(PATCH_CONFIGS[name])
    (good,) = await pair.capture(3)
    filled = [i for i, f in enumerate(good) if i and len(f)]  # payload frames with a byte to flip
    assert len(filled) > 2
    for index in (filled[0], filled[len(filled) // 2], filled[-1]):
        await pair.reject([flip(good, index)], IntegrityError)
    await pair.reject([flip(good, filled[-1], pos=0)], IntegrityError)
    await pair.recover([good], 3)


async def test_corrupted_header() -> None:
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    for pos in (0, 5, len(good[0]) // 2, len(good[0]) - 1):
        await pair.reject([flip(good, 0, pos)], WeightSyncError)
    await pair.reject([[b"\xc1garbage", *good[1:]]], ProtocolError)
    await pair.recover([good], 3)


async def test_truncated_message() -> None:
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    await pair.reject([good[:-1]], ProtocolError)  # last frame missing
    await pair.reject([good[:1]], ProtocolError)  # header only
    await pair.reject([[]], ProtocolError)  # nothing at all
    await pair.reject([[*good[:-1], good[-1][:-1]]], ProtocolError)  # last frame one byte short
    await pair.reject([[good[0][:-3], *good[1:]]], WeightSyncError)  # header cut
    await pair.reject([[*good, b"extra"]], ProtocolError)  # a frame too many
    await pair.recover([good], 3)


async def test_patch_on_wrong_base_version_is_stale() -> None:
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    assert decode_message(good).base_version == 2
    for base in (1, 0, None):
        bad = reencode(good, lambda m, b=base: setattr(m, "base_version", b))
        err = await pair.reject([bad], StaleVersionError)
        assert err.current == 2  # type: ignore[attr-defined]
    # a base ahead of the receiver (it missed a version) is stale too
    bad = reencode(good, lambda m: (setattr(m, "base_version", 3), setattr(m, "version", 4)))
    await pair.reject([bad], StaleVersionError)
    await pair.recover([good], 3)


async def test_replayed_patch_is_stale() -> None:
    pair = await make_pair(PATCH, steps=0)
    v1 = await pair.capture(1)
    await pair.recover(v1, 1)
    v2 = await pair.capture(2)
    await pair.recover(v2, 2)
    await pair.reject(v1, StaleVersionError)  # an old patch
    await pair.reject(v2, StaleVersionError)  # the current one again
    v3 = await pair.capture(3)
    await pair.recover(v3, 3)


async def test_message_from_another_session() -> None:
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    forged = reencode(good, lambda m: setattr(m, "session", uuid.uuid4().hex))
    await pair.reject([forged], ProtocolError)
    # a real patch of a real second sender with the same base version
    other = sender.make_sender(PATCH)
    ch = Channel()
    twin = make_model(1, dtype=torch.bfloat16)
    await asyncio.gather(
        other.init_sender(pair.model, ch.to_receiver.send, ch.to_sender.recv, version=2),
        receiver.make_receiver(PATCH).init_receiver(twin, ch.to_receiver.recv, ch.to_sender.send),
    )
    saved = pair.model.mix.detach().clone()
    with torch.no_grad():
        pair.model.mix.add_(1.0)
    cap = Pipe()
    await other.sync(pair.model, cap.send, 3)
    assert decode_message(cap.sent[0]).base_version == 2
    await pair.reject(cap.sent, ProtocolError)
    with torch.no_grad():
        pair.model.mix.copy_(saved)
    await pair.recover([good], 3)


async def test_invalid_last_entry_writes_nothing() -> None:
    """Checksums are fine but the last tensor entry does not fit its target: earlier
    entries (valid) must not have been written either."""
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    msg = decode_message(good)
    assert len(msg.tensors) >= 3
    keys = pair.r.metadata.keys
    shapes = pair.r.metadata.shapes
    last = msg.tensors[-1]
    wrong = next(i for i, s in enumerate(shapes) if s != shapes[last.key] and i not in {t.key for t in msg.tensors})

    def retarget(m: Message) -> None:
        m.tensors[-1] = dataclasses.replace(m.tensors[-1], key=wrong)

    await pair.reject([reencode(good, retarget)], ProtocolError)

    def out_of_range(m: Message) -> None:
        m.tensors[-1] = dataclasses.replace(m.tensors[-1], key=len(keys) + 5)

    await pair.reject([reencode(good, out_of_range)], ProtocolError)

    def repeat_first(m: Message) -> None:
        m.tensors[-1] = dataclasses.replace(m.tensors[-1], key=m.tensors[0].key)

    await pair.reject([reencode(good, repeat_first)], ProtocolError)
    await pair.recover([good], 3)


async def test_bad_groups_write_nothing() -> None:
    """Grouped entries that name a tensor twice, one past the model, tensors of another
    dtype, or fewer elements than their positions reach: rejected, nothing written."""
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    msg = decode_message(good)
    grouped = [i for i, t in enumerate(msg.tensors) if t.group]
    alone = [t.key for t in msg.tensors if not t.group]
    assert grouped and alone
    at = grouped[-1]
    group = msg.tensors[at].group
    metadata = pair.r.metadata
    int64 = next(i for i, d in enumerate(metadata.dtypes) if d == torch.int64)

    def regroup(members: tuple[int, ...]) -> Callable[[Message], None]:
        def edit(m: Message) -> None:
            m.tensors[at] = dataclasses.replace(m.tensors[at], key=members[0], group=members)
        return edit

    def without(key: int) -> Callable[[Message], None]:
        def edit(m: Message) -> None:  # the entry and its frames, the others renumbered
            kept, frames = [], []
            for t in m.tensors:
                if t.key == key:
                    continue
                specs = []
                for b in t.buffers:
                    frames.append(m.frames[b.frame - 1])
                    specs.append(dataclasses.replace(b, frame=len(frames)))
                kept.append(dataclasses.replace(t, buffers=tuple(specs)))
            m.tensors, m.frames = kept, frames
        return edit

    for members in (
        (*group, alone[0]),  # a tensor that also travels on its own
        (*group, len(metadata.keys) + 3),  # past the model
        group[:-1],  # fewer elements than the changes' positions reach
    ):
        await pair.reject([reencode(good, regroup(members))], ProtocolError)
    if int64 in alone:  # another dtype: drop its own entry, so the group is the only one to name it
        await pair.reject([reencode(reencode(good, without(int64)), regroup((*group, int64)))], ProtocolError)
    await pair.recover([good], 3)


async def test_out_of_bounds_positions_with_valid_checksums() -> None:
    pair = await make_pair({"type": "patch", "patch": {"compression": "none", "group_numel": 0}})
    (good,) = await pair.capture(3)
    msg = decode_message(good)
    sparse = [t for t in msg.tensors if t.encoding is not Encoding.DENSE]
    assert sparse, "expected at least one sparse tensor (LayerNorm weights move little)"
    entry = sparse[-1]
    spec = entry.buffer(Role.POSITIONS if entry.encoding in (Encoding.GAPS, Encoding.BITMAP) else Role.COLS)
    assert spec.codec is Codec.NONE

    def poison(m: Message) -> None:
        replace_frame(m, spec.frame, b"\xff" * spec.wire_nbytes)

    await pair.reject([reencode(good, poison)], ProtocolError)

    def nnz_lies(m: Message) -> None:
        i = next(i for i, t in enumerate(m.tensors) if t.key == entry.key)
        m.tensors[i] = dataclasses.replace(m.tensors[i], nnz=m.tensors[i].nnz + 1)

    await pair.reject([reencode(good, nnz_lies)], ProtocolError)
    await pair.recover([good], 3)


async def test_bucket_message_to_patch_receiver() -> None:
    pair = await make_pair(PATCH)
    (good,) = await pair.capture(3)
    # a real BUCKET message of a bucket sender for the same model
    bs = sender.make_sender(bucket_config())
    ch = Channel()
    await asyncio.gather(
        bs.init_sender(pair.model, ch.to_receiver.send, ch.to_sender.recv, version=2),
        receiver.make_receiver(bucket_config()).init_receiver(
            make_model(2, dtype=torch.bfloat16), ch.to_receiver.recv, ch.to_sender.send
        ),
    )
    cap = Pipe()
    await bs.sync(pair.model, cap.send, 3)
    await pair.reject(cap.sent, ProtocolError)  # wrong session, and wrong type
    # the same BUCKET forged into the patch sender's session: the type alone is refused
    session = pair.s.session
    forged = [reencode(f, lambda m: setattr(m, "session", session)) for f in cap.sent]
    assert decode_message(forged[0]).type is MessageType.BUCKET
    await pair.reject(forged, ProtocolError)
    # other message types in place of a patch
    for mtype in (MessageType.HELLO, MessageType.WELCOME, MessageType.ACK):
        await pair.reject([reencode(good, lambda m, t=mtype: setattr(m, "type", t))], ProtocolError)
    await pair.recover([good], 3)


# -- buckets -----------------------------------------------------------------------------------
@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
async def test_corrupted_bucket_2_of_3(load_instant: bool) -> None:
    pair = await make_pair(bucket_config(load_instant))
    good = await pair.capture(3)
    assert [decode_message(f).part for f in good] == [0, 1, 2]
    assert [decode_message(f).last for f in good] == [False, False, True]
    for index in (1, 2):  # bucket 2 of 3, then the last one
        bad = list(good)
        bad[index] = flip(good[index], len(good[index]) - 1)
        await pair.reject(bad, IntegrityError, torn=load_instant)
    # valid checksums, but bucket 2 has a tensor of the wrong shape
    bad = list(good)

    def wrong_key(m: Message) -> None:
        m.tensors[0] = dataclasses.replace(m.tensors[0], key=pair.r.metadata.ordinal("step_count"))

    bad[1] = reencode(good[1], wrong_key)
    await pair.reject(bad, ProtocolError, torn=load_instant)
    await pair.recover(good, 3)
    assert not pair.r.torn


@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
async def test_parts_of_two_versions_interleaved(load_instant: bool) -> None:
    pair = await make_pair(bucket_config(load_instant))
    v3 = await pair.capture(3)
    v4 = await pair.capture(4)
    await pair.reject([v3[0], v4[1]], ProtocolError, torn=load_instant)
    await pair.reject([v3[0], v3[1], v4[2]], ProtocolError, torn=load_instant)
    await pair.reject([v4[0], v3[1]], ProtocolError, torn=load_instant)
    # a part before the last with no tensors: a version's parts are bounded by its tensors
    def emptied(m: Message) -> None:
        m.tensors, m.frames = [], []

    err = await pair.reject([reencode(v3[0], emptied), v3[1], v3[2]], ProtocolError)
    assert "no tensors" in str(err)
    await pair.recover(v3, 3, latest=False)
    await pair.recover(v4, 4)


@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
async def test_duplicated_part(load_instant: bool) -> None:
    pair = await make_pair(bucket_config(load_instant))
    good = await pair.capture(3)
    await pair.reject([good[0], good[0]], ProtocolError, torn=load_instant)
    await pair.reject([good[0], good[1], good[1]], ProtocolError, torn=load_instant)
    # the same part again with a fresh sequence number is still a duplicate
    await pair.reject([good[0], good[1], reencode(good[1], lambda m: setattr(m, "seq", m.seq + 10))], ProtocolError, torn=load_instant)
    await pair.recover(good, 3)


@pytest.mark.parametrize("config", ["instant", "deferred", "patch-parts"])
async def test_parts_sent_again_after_a_resend_was_asked_for(config: str) -> None:
    """After ``resend_asked`` (the session's NACK ``BEHIND``: parts were lost), the version in
    progress comes again from its first part: the parts held already, the same messages
    again (same sequence numbers), are skipped and the version completes with the rest,
    bit for bit. A repeat that is not the same message is still refused, and so is any
    repeat once that version is done: the ask holds for one version."""
    parts = {"type": "patch", "patch": {"part_bytes": 2048, "group_numel": 0}}
    pair = await make_pair(parts if config == "patch-parts" else bucket_config(config == "instant"))
    good = await pair.capture(3)
    assert len(good) >= 3
    pair.r.resend_asked()
    assert await pair.feed([good[0], good[1], good[0], good[1], *good[2:]]) == 3
    pair.assert_synced()
    assert pair.r.last_stats is not None and pair.r.last_stats.resent_parts == 2 and pair.r.last_stats.messages == len(good)
    v4 = await pair.capture(4)
    await pair.reject([v4[0], v4[0]], ProtocolError, torn=config == "instant")  # no ask: a repeat is a broken stream
    pair.r.resend_asked()
    again = reencode(v4[0], lambda m: setattr(m, "seq", m.seq + 10))  # the same part, another message
    await pair.reject([v4[0], again], ProtocolError, torn=config == "instant")
    await pair.recover(v4, 4)


def _bucket_keys(pair: Pair, frames: Frames) -> list[str]:
    assert pair.r.metadata is not None
    return [pair.r.metadata.keys[e.key] for e in decode_message(frames).tensors]


@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
async def test_load_instant_writes_each_bucket_as_it_arrives(load_instant: bool) -> None:
    """With load_instant the first bucket of v3 is in the model, under the write side
    (readers wait), before the second arrives, and no more than one bucket is ever staged;
    v3 is published only once all three are written. Deferred, nothing is written before
    the last bucket, and the whole version is staged at once."""
    lock = ReadWriteLock()
    pair = await make_pair(bucket_config(load_instant), hooks=receiver.StrategyHooks(write_guard=lock.writing))
    good = await pair.capture(3)
    expected = cast_like(pair.model.state_dict(), pair.rmodel.state_dict())
    first, rest = _bucket_keys(pair, good[0]), [k for f in good[1:] for k in _bucket_keys(pair, f)]
    inbox: asyncio.Queue[Frames] = asyncio.Queue()
    asked: list[asyncio.Event] = [asyncio.Event() for _ in good]

    async def recv() -> Frames:
        asked[sum(e.is_set() for e in asked)].set()
        return await inbox.get()

    before = snapshot(pair.rmodel.state_dict())
    await inbox.put(good[0])
    applying = asyncio.ensure_future(pair.r.apply(pair.rmodel, recv))
    await asyncio.wait_for(asked[1].wait(), 10)  # bucket 1 is done with: the receiver asks for bucket 2
    state = pair.rmodel.state_dict()
    if load_instant:  # bucket 1 is in the model, the others not yet
        assert mismatches({k: expected[k] for k in first}, {k: state[k] for k in first}) == []
        assert mismatches({k: before[k] for k in rest}, {k: state[k] for k in rest}) == []
        assert mismatches({k: before[k] for k in first}, {k: state[k] for k in first})  # it did change something
    else:
        assert mismatches(before, state) == []
    assert pair.r.version == 2 and not pair.r.torn
    readable = lock.acquire_read(blocking=False)
    if readable:
        lock.release_read()
    assert readable is not load_instant  # the write side is held for the whole version
    for frames in good[1:]:
        await inbox.put(frames)
    assert await asyncio.wait_for(applying, 10) == 3
    pair.assert_synced()
    assert lock.acquire_read(blocking=False)
    lock.release_read()
    sizes = {k: t.numel() * t.element_size() for k, t in pair.rmodel.state_dict().items()}
    per_bucket = [sum(sizes[k] for k in _bucket_keys(pair, f)) for f in good]
    stats = pair.r.last_stats
    assert stats is not None and stats.version == 3
    assert stats.staged_bytes_peak == (max(per_bucket) if load_instant else sum(per_bucket)), (stats, per_bucket)


async def test_load_instant_failure_midway_keeps_readers_out_until_a_whole_version() -> None:
    """v3 fails in its second bucket, its first already written: the model holds no
    version (``version`` None, ``torn``), readers stay out and nothing is published; a
    whole version written over it (the resync: here v3 again) lets them in."""
    lock = ReadWriteLock()
    pair = await make_pair(bucket_config(True), hooks=receiver.StrategyHooks(write_guard=lock.writing))
    good = await pair.capture(3)
    bad = [good[0], flip(good[1], len(good[1]) - 1), good[2]]
    await pair.reject(bad, IntegrityError, torn=True)
    assert not lock.acquire_read(blocking=False)  # readers are kept out of the torn model
    await pair.reject([good[1]], ProtocolError, torn=True)  # the rest of it: refused, still torn
    assert not lock.acquire_read(blocking=False)
    await pair.recover(good, 3)
    assert not pair.r.torn and lock.acquire_read(blocking=False)
    lock.release_read()


@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
async def test_reordered_parts_are_rejected(load_instant: bool) -> None:
    """ZeroMQ keeps a peer's messages in order, so parts out of order mean a broken
    stream: rejected, nothing written, and the genuine order still applies after."""
    pair = await make_pair(bucket_config(load_instant))
    good = await pair.capture(3)
    await pair.reject([good[2], good[0], good[1]], ProtocolError)  # refused before anything is written
    await pair.reject([good[0], good[2], good[1]], ProtocolError, torn=load_instant)
    await pair.recover(good, 3)


async def test_stale_and_foreign_buckets() -> None:
    pair = await make_pair(bucket_config())
    v3 = await pair.capture(3)
    await pair.recover(v3, 3)
    await pair.reject(v3, StaleVersionError)  # replay
    v4 = await pair.capture(4)
    await pair.reject([reencode(f, lambda m: setattr(m, "version", 2)) for f in v4], StaleVersionError)
    await pair.reject([reencode(f, lambda m: setattr(m, "session", "0" * 32)) for f in v4], ProtocolError)

    # a PATCH sent to a BucketReceiver
    def as_patch(m: Message) -> None:
        m.type, m.base_version, m.parts = MessageType.PATCH, 3, 1

    forged = reencode(v4[0], as_patch)
    await pair.reject([forged], ProtocolError)
    await pair.recover(v4, 4)


# -- the init bootstrap ----------------------------------------------------------------------------
async def _capture_init(config: dict[str, Any], model: torch.nn.Module, version: int | None = None) -> tuple[Any, list[Frames]]:
    """The WELCOME and bootstrap frames a real sender sends to a receiver of this model's shape."""
    s = sender.make_sender(config)
    ch = Channel()
    await asyncio.gather(
        s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv, version=version),
        receiver.make_receiver(config).init_receiver(make_model(7, dtype=torch.bfloat16), ch.to_receiver.recv, ch.to_sender.send),
    )
    return s, ch.to_receiver.sent


async def _init_from(r: Any, rmodel: torch.nn.Module, messages: list[Frames]) -> int | None:
    pipe, back = Pipe(), Pipe()
    for frames in messages:
        await pipe.send(frames)
    return await asyncio.wait_for(r.init_receiver(rmodel, pipe.recv, back.send), timeout=10)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_corrupted_bootstrap_writes_nothing(kind: str) -> None:
    # load_instant writes a bootstrap as it arrives (tested below): the all-or-nothing bucket mode is the other
    config = {"type": "patch", "patch": {"init_sync": {"bucket_size": 16 << 10}}} if kind == "patch" else bucket_config(False)
    model = make_model(0)
    _, sent = await _capture_init(config, model)
    assert len(sent) >= 4  # WELCOME and at least three bootstrap buckets
    rmodel = make_model(1, dtype=torch.bfloat16)
    before = snapshot(rmodel.state_dict())
    for bad in ([sent[0], sent[1], flip(sent[2], len(sent[2]) - 1), *sent[3:]], [*sent[:-1], sent[-1][:1]]):
        r = receiver.make_receiver(config)
        with pytest.raises(WeightSyncError):
            await _init_from(r, rmodel, bad)
        assert mismatches(before, rmodel.state_dict()) == [] and r.version is None
    r = receiver.make_receiver(config)
    await _init_from(r, rmodel, sent)
    assert mismatches(cast_like(model.state_dict(), rmodel.state_dict()), rmodel.state_dict()) == []


async def test_welcome_with_mismatched_alias_is_rejected_before_writing() -> None:
    """A WELCOME that ties two tensors of different shapes must be refused up front, not
    fail in the middle of the bootstrap commit with the model half-written."""
    config = {"type": "patch"}
    model = make_model(0)
    _, sent = await _capture_init(config, model)
    rmodel = make_model(1, dtype=torch.bfloat16)
    probe = receiver.make_receiver(config)
    await _init_from(probe, make_model(1, dtype=torch.bfloat16), sent)
    emb, ln = probe.metadata.ordinal("embed.weight"), probe.metadata.ordinal("ln_f.bias")

    def bad_alias(m: Message) -> None:
        m.body = {**m.body, "aliases": [*m.body["aliases"], [ln, emb]]}

    forged = [reencode(sent[0], bad_alias), *sent[1:]]
    before = snapshot(rmodel.state_dict())
    r = receiver.make_receiver(config)
    try:
        with pytest.raises(WeightSyncError):
            await _init_from(r, rmodel, forged)
    finally:
        assert mismatches(before, rmodel.state_dict()) == [], "model half-written by a failed bootstrap"
        assert r.version is None


# -- a version that fails once written: torn, never the old version over mixed weights ------------
# Every way a receiver writes, each taking a version three ways: a fresh receiver's handshake
# bootstrap, the resync bootstrap of one at v2, and v3 on top of v2. A failure before anything
# is written leaves the model and version as they were; once anything is written it leaves
# the model torn: no version, readers kept out until a whole version is written over it.
WRITERS = {
    "bucket-instant": bucket_config(True),
    "bucket-deferred": bucket_config(False),
    "patch": {"type": "patch", "patch": {"part_bytes": 2048, "init_sync": {"bucket_size": 16 << 10}}},
}
SCENES = ["fresh-bootstrap", "resync-bootstrap", "next-version"]
RESYNC = 5  # the version the sender bootstraps at


def _writes_on_arrival(config: dict[str, Any]) -> bool:
    return bool(config["type"] == "bucket" and config["bucket"]["load_instant"])


@dataclass
class Scene:
    """A receiver, its model lock and the messages it is about to take (a handshake's
    WELCOME and bootstrap, or a version's parts), and a bootstrap to recover with."""

    pair: Pair
    r: Any
    lock: ReadWriteLock
    messages: list[Frames]
    handshake: bool
    resync: list[Frames]
    before: tuple[dict[str, torch.Tensor], int | None]

    @property
    def first_part(self) -> int:
        """Where the version's parts start in ``messages`` (after a WELCOME)."""
        return 1 if self.handshake else 0

    async def take(self, recv: Callable[[], Awaitable[Frames]]) -> None:
        if self.handshake:
            await self.r.init_receiver(self.pair.rmodel, recv, Pipe().send)
        else:
            await self.r.apply(self.pair.rmodel, recv)

    def readable(self) -> bool:
        if not self.lock.acquire_read(blocking=False):
            return False
        self.lock.release_read()
        return True

    def assert_untouched(self) -> None:
        state, version = self.before
        assert mismatches(state, self.pair.rmodel.state_dict()) == [], "a version failing before its first write wrote"
        assert self.r.version == version and not self.r.torn and self.readable()

    def assert_torn(self) -> None:
        assert mismatches(self.before[0], self.pair.rmodel.state_dict()), "nothing was written: the case tests nothing"
        assert self.r.torn and self.r.version is None, f"a version failing once written left v{self.r.version}, torn={self.r.torn}"
        assert not self.readable(), "readers are let into a torn model"

    async def recover(self) -> None:
        """The resync bootstrap, whole, puts the model at its version and lets readers in."""
        assert await asyncio.wait_for(self.r.init_receiver(self.pair.rmodel, recv_over(self.resync), Pipe().send), 10) == RESYNC
        assert self.r.version == RESYNC and not self.r.torn and self.readable()
        self.pair.assert_synced()


async def make_scene(config: dict[str, Any], scene: str, on_commit: Callable[[Any], None] | None = None) -> Scene:
    """``on_commit``: the receiver's hook, beside its write guard (the scene's ``lock``)."""
    lock = ReadWriteLock()
    hooks = receiver.StrategyHooks(write_guard=lock.writing, on_commit=() if on_commit is None else (on_commit,))
    pair = await make_pair(config, hooks=hooks)
    if scene == "next-version":
        messages, handshake, r = await pair.capture(3), False, pair.r
    else:
        pair.trainer.step()
        _, messages = await _capture_init(config, pair.model, RESYNC)
        handshake, r = True, pair.r if scene == "resync-bootstrap" else receiver.make_receiver(config, hooks)
    _, resync = await _capture_init(config, pair.model, RESYNC)
    assert len(messages) - handshake >= 2, "a version in one part: no two parts to fail between"
    state, version = pair.before()
    return Scene(pair, r, lock, messages, handshake, resync, (state, version if r is pair.r else None))


def recv_over(
    messages: list[Frames], stop_at: int | None = None, error: BaseException | None = None, *,
    taken: list[Frames] | None = None, asked: asyncio.Event | None = None,
) -> Callable[[], Awaitable[Frames]]:
    """``recv`` over ``messages``, each one it returns added to ``taken``; asked for the one
    at ``stop_at`` it sets ``asked`` and raises ``error``, or without one waits for ever
    (to be cancelled)."""
    pending = iter(enumerate(messages))

    async def recv() -> Frames:
        i, frames = next(pending)
        if i == stop_at:
            if asked is not None:
                asked.set()
            if error is not None:
                raise error
            await asyncio.Event().wait()
        if taken is not None:
            taken.append(frames)
        return frames

    return recv


def forge_welcome(frames: Frames, **body: Any) -> Frames:
    """A WELCOME with ``body``'s fields (``version`` the header's) rewritten, validly encoded."""
    version = body.pop("version", None)

    def edit(m: Message) -> None:
        m.body = {**m.body, **body}
        if version is not None:
            m.version = version

    return reencode(frames, edit)


@pytest.mark.parametrize("scene", ["fresh-bootstrap", "resync-bootstrap"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("lie", ["version", "one-part", "fewer-parts", "more-parts"])
async def test_bootstrap_contradicting_welcome(writer: str, scene: str, lie: str) -> None:
    """Found by the fuzzer: a WELCOME announcing another version or part count than its
    bootstrap carries. The version and a count the first part already contradicts are
    refused at that part, before anything is written; a count found wrong later, written
    on arrival, leaves the model torn: never a version published over weights the check
    refused (a fresh receiver at the bootstrap's version, or one at v2 still saying v2)."""
    config = WRITERS[writer]
    s = await make_scene(config, scene)
    parts = len(s.messages) - 1
    assert parts >= 3, "fewer-parts must leave one part written and one refused"
    welcome = s.messages[0]
    forged = {"version": forge_welcome(welcome, version=RESYNC + 1), "one-part": forge_welcome(welcome, bootstrap=1),
              "fewer-parts": forge_welcome(welcome, bootstrap=parts - 1),
              "more-parts": forge_welcome(welcome, bootstrap=parts + 1)}[lie]
    taken: list[Frames] = []
    with pytest.raises(ProtocolError, match="WELCOME announced"):
        await asyncio.wait_for(s.take(recv_over([forged, *s.messages[1:]], taken=taken)), 10)
    if _writes_on_arrival(config) and lie in ("fewer-parts", "more-parts"):
        s.assert_torn()
    else:
        s.assert_untouched()
    if lie in ("version", "one-part"):
        assert len(taken) == 2, "refused only after the first part"  # WELCOME and the part that contradicts it
    await s.recover()


@pytest.mark.parametrize("scene", SCENES)
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("failure", ["cancelled", "error"])
async def test_failure_between_two_parts(writer: str, scene: str, failure: str) -> None:
    """A version broken off while the receiver waits for its second part (cancelled, or
    the sender's error): torn if its first part was written on arrival, else untouched."""
    config = WRITERS[writer]
    s = await make_scene(config, scene)
    error = None if failure == "cancelled" else ProtocolError("sender reported: the trainer went away")
    asked = asyncio.Event()
    taking = asyncio.ensure_future(s.take(recv_over(s.messages, s.first_part + 1, error, asked=asked)))
    await asyncio.wait_for(asked.wait(), 10)  # the first part is done with: the receiver asks for the second
    if error is None:
        taking.cancel()
    with pytest.raises(asyncio.CancelledError if error is None else ProtocolError):
        await asyncio.wait_for(taking, 10)
    if _writes_on_arrival(config):
        s.assert_torn()
    else:
        s.assert_untouched()
    await s.recover()


class SlowWrite:
    """``receiver.strategy.write_side.commit`` whose ``n``-th call writes half its updates, then waits
    for ``release`` (or raises), then writes the rest: a write the test can break into."""

    def __init__(self, n: int, fail: bool = False) -> None:
        self.n, self.fail, self.calls = n, fail, 0
        self.entered, self.release = threading.Event(), threading.Event()
        self.finished = False
        self.real = receiver.strategy.write_side.commit

    def __call__(self, targets: Any, updates: Any, aliases: Any) -> None:
        self.calls += 1
        if self.calls != self.n:
            return self.real(targets, updates, aliases)
        half = max(1, len(updates) // 2)
        self.real(targets, updates[:half], aliases)
        self.entered.set()
        if self.fail:
            raise RuntimeError("the device went away mid-write")
        assert self.release.wait(10)
        self.real(targets, updates[half:], aliases)
        self.finished = True
        return None


@pytest.mark.parametrize("scene", SCENES)
@pytest.mark.parametrize("writer", sorted(WRITERS))
async def test_cancelled_while_writing(writer: str, scene: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while a write runs on its thread (the second part's, written on arrival;
    else the whole version's commit): the thread cannot be stopped, so the cancellation
    waits for it, and then the model is torn (not the old version over mixed weights)."""
    config = WRITERS[writer]
    s = await make_scene(config, scene)
    write = SlowWrite(2 if _writes_on_arrival(config) else 1)
    monkeypatch.setattr(receiver.strategy.write_side, "commit", write)
    taking = asyncio.ensure_future(s.take(recv_over(s.messages)))
    assert await asyncio.to_thread(write.entered.wait, 10)
    taking.cancel()
    await asyncio.sleep(0.2)
    assert not taking.done(), "a cancelled write returned while its thread still writes into the model"
    write.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(taking, 10)
    assert write.finished
    s.assert_torn()
    await s.recover()


@pytest.mark.parametrize("scene", SCENES)
@pytest.mark.parametrize("writer", sorted(WRITERS))
async def test_error_while_writing(writer: str, scene: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails halfway (the second part's, or the whole version's) leaves the
    model torn."""
    config = WRITERS[writer]
    s = await make_scene(config, scene)
    monkeypatch.setattr(receiver.strategy.write_side, "commit", SlowWrite(2 if _writes_on_arrival(config) else 1, fail=True))
    with pytest.raises(RuntimeError, match="mid-write"):
        await asyncio.wait_for(s.take(recv_over(s.messages)), 10)
    s.assert_torn()
    monkeypatch.undo()
    await s.recover()


@pytest.mark.parametrize("scene", SCENES)
@pytest.mark.parametrize("writer", sorted(WRITERS))
async def test_failing_on_commit(writer: str, scene: str) -> None:
    """``on_commit`` is part of the write (an engine installs layers there): failing, it
    leaves the model torn, and the write side is still held, not lost."""
    config = WRITERS[writer]
    failing = False

    def fail(pending: Any) -> None:
        if failing:
            raise RuntimeError("the engine could not install the layers")

    s = await make_scene(config, scene, on_commit=fail)
    failing = True
    with pytest.raises(RuntimeError, match="install"):
        await asyncio.wait_for(s.take(recv_over(s.messages)), 10)
    s.assert_torn()
    failing = False
    await s.recover()
