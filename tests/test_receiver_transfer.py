"""A part's one host-to-device transfer (receiver/apply/transfer.py, protocol/codec/staging.py),
run on CPU tensors.

A receiver whose targets are on a GPU moves every device-coded payload of a part to the
device in one copy through a reused staging buffer, and in that same copy the bytes of
every tensor sent whole (a bucket's, a bootstrap's, a patch part's dense entries), cast to
the target's dtype once there. A CPU target needs no copy, so the receiver stages nothing
for it; here the pool is told to stage CPU targets too (``StagingPool(cpu_too=True)``),
which runs the GPU's path on CPU tensors, and the transfer function
(``staging.host_to_device``) is counted."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
from channel import Channel, Pipe
from coded import stage_decoded
from test_device_path import HostReads, bf16_state, device_messages
from test_hostile import BF16, DEVICE_HOSTILE, DEVICE_TARGET, VALID_FLAT, VALID_NNZ, blocks, device_changes

import receiver
import sender
from protocol.codec import parallel, staging
from protocol.codec.compress import Codec, compress
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import (
    BlocksEntry,
    EncodedTensor,
    PatchOptions,
    assemble,
    decode_blocks,
    decode_entry,
    encode_dense,
    encode_sparse,
    pack_entry,
)
from protocol.errors import IntegrityError, ProtocolError
from protocol.wire.checksum import checksum
from protocol.wire.dtypes import dtype_code, dtype_from_code
from protocol.wire.framing import (
    BufferSpec,
    Encoding,
    Message,
    MessageType,
    Role,
    TensorEntry,
    ValueEncoding,
    decode_message,
    encode_message,
)
from protocol.wire.metadata import ModelMetadata
from receiver.apply.commit import commit
from receiver.apply.transfer import Placement, transfer_part

CPU = torch.device("cpu")


class Transfers:
    """Counts ``host_to_device`` calls and the bytes each moved. The copy is a ``clone`` (on
    CPU what the real call does too), not a ``_to_copy`` to the CPU, which ``HostReads``
    would count as a read of the device."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert host.device == CPU and host.dtype == torch.uint8 and host.dim() == 1
        self.sizes.append(host.numel())
        return host.clone()


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Transfers:
    counter = Transfers()
    monkeypatch.setattr(staging, "host_to_device", counter)
    return counter


@pytest.mark.parametrize("patch", [{"group_numel": 0}, {}, {"group_numel": 0, "part_bytes": 16 << 10}], ids=["alone", "grouped", "parts"])
async def test_one_transfer_a_part_whatever_the_tensor_count(
    patch: dict[str, Any], transfers: Transfers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """48 and 480 bf16 tensors of the same 491,520 elements, 1% changed, every sparse entry
    device coded: each part reaches the (stand-in) device in one transfer of its payloads
    and nothing else (no other copy to the device), the device is read once a part, the
    staging buffer is the same one for every part, and the model ends bit-exact."""
    monkeypatch.setattr(parallel, "WORKERS", 1)  # every entry on this thread, where the counter sees it
    for tensors in (48, 480):
        r, model, state, messages = await device_messages(tensors, 491_520 // tensors, patch)
        r.staging = StagingPool(cpu_too=True)
        assert all(e.encoding is Encoding.BLOCKS for m in messages for e in m.tensors)
        targets = r.targets(model)
        before, buffers = len(transfers.sizes), set()
        for msg in messages:
            called = len(transfers.sizes)
            with HostReads() as reads:
                updates = r._decode(msg, targets)
            assert len(transfers.sizes) == called + 1, (tensors, len(msg.tensors))
            assert dict(reads.syncs) == {"copy to the host": 1}, (tensors, dict(reads.syncs))
            assert transfers.sizes[-1] == sum(aligned(memoryview(f).nbytes) for f in msg.frames)  # each payload aligned, no more
            buffer = r.staging.buffer(CPU)
            assert buffer is not None
            buffers.add(buffer.data_ptr())
            commit(targets, updates, {})
        assert len(transfers.sizes) - before == len(messages)
        assert len(buffers) == 1 and r.staging.allocations == 1  # reused across the parts
        assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
    if patch.get("part_bytes") is not None:
        assert len(messages) > 1


async def test_host_coded_entries_join_the_parts_one_copy(transfers: Transfers) -> None:
    """The host codec's part, with the pool staging CPU targets (as for a GPU's): every
    entry decoded on the host first, its positions and values moved in the part's one copy,
    staged from there."""
    r, model, state, messages = await device_messages(48, 4096, {"codec": "host", "group_numel": 0})
    r.staging = StagingPool(cpu_too=True)
    assert not any(e.encoding is Encoding.BLOCKS for m in messages for e in m.tensors)
    assert any(e.encoding is not Encoding.DENSE for m in messages for e in m.tensors)
    targets = r.targets(model)
    for msg in messages:
        updates = r._decode(msg, targets)
        buffer = r.staging.buffer(CPU)
        assert buffer is not None and len(transfers.sizes) >= 1
        sparse = [u.flat for u in updates if u.flat is not None]
        assert sparse and len({flat.untyped_storage().data_ptr() for flat in sparse}) == 1  # all in the part's one copy
        commit(targets, updates, {})
    assert len(transfers.sizes) == len(messages) and r.staging.allocations == 1
    assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


async def test_a_cpu_receiver_stages_nothing(transfers: Transfers) -> None:
    """A receiver's own pool leaves CPU targets alone: they decode from their frames."""
    r, model, state, messages = await device_messages(48, 4096, {})
    assert not r.staging.stages(CPU) and r.staging.pin is torch.cuda.is_available()
    targets = r.targets(model)
    for msg in messages:
        commit(targets, r._decode(msg, targets), {})
    assert transfers.sizes == [] and r.staging.buffer(CPU) is None
    assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def test_the_pool_reuses_its_buffer_and_grows_for_a_larger_part() -> None:
    """Pieces come back at their dtypes and values, each aligned; a second part of the same
    size is staged in the same (plain, unpinned: no CUDA is needed) buffer; a larger one
    grows it (to at least twice); what an earlier part moved is never overwritten."""
    pool = StagingPool(cpu_too=True, pin=False)
    gen = np.random.default_rng(0)
    first = [gen.integers(0, 256, 1000, dtype=np.uint8), np.arange(5, dtype=np.int64), gen.integers(0, 256, 77, dtype=np.uint8)]
    moved = pool.stage(CPU, first)
    assert [m.dtype for m in moved] == [torch.uint8, torch.int64, torch.uint8]
    assert all(np.array_equal(m.numpy(), p) for m, p in zip(moved, first))
    assert all(m.storage_offset() * m.element_size() % staging.ALIGN == 0 for m in moved)
    held = pool.buffer(CPU)
    assert held is not None and not held.is_pinned() and pool.allocations == 1
    second = [gen.integers(0, 256, 900, dtype=np.uint8)]
    again = pool.stage(CPU, second)
    assert pool.buffer(CPU) is held and pool.allocations == 1  # reused
    assert np.array_equal(again[0].numpy(), second[0])
    assert all(np.array_equal(m.numpy(), p) for m, p in zip(moved, first))  # the first part's copy is its own
    large = [gen.integers(0, 256, held.numel() + 1, dtype=np.uint8), np.arange(3, dtype=np.int64)]
    grown = pool.stage(CPU, large)
    bigger = pool.buffer(CPU)
    assert bigger is not None and bigger is not held and bigger.numel() >= 2 * held.numel() and pool.allocations == 2
    assert all(np.array_equal(m.numpy(), p) for m, p in zip(grown, large))
    pool.stage(CPU, second)
    assert pool.buffer(CPU) is bigger and pool.allocations == 2  # and kept at its new size
    assert pool.stage(CPU, []) == [] and pool.allocations == 2
    pool.clear()
    assert pool.buffer(CPU) is None
    with pytest.raises(ValueError):
        pool.stage(CPU, [np.zeros((2, 2), dtype=np.uint8)])


def test_a_buffer_is_written_again_only_after_its_last_copy_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a copy runs asynchronously (pinned memory to CUDA), the pool records an event
    after it and waits on that event before it writes the buffer again: here a stand-in
    event, waited on before the next part's bytes go in."""
    pool = StagingPool(cpu_too=True, pin=False)
    pool.stage(CPU, [np.full(10, 1, dtype=np.uint8)])
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            order.append("waited")

    slot = pool._slots[CPU]
    slot.copied = Event()
    real = staging.host_to_device

    def moving(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        order.append(f"moved {int(host[0])}")
        return real(host, device)

    monkeypatch.setattr(staging, "host_to_device", moving)
    pool.stage(CPU, [np.full(10, 2, dtype=np.uint8)])
    assert order == ["waited", "moved 2"]


def test_a_staged_group_stages_as_its_frame_does(transfers: Transfers) -> None:
    """A device-coded group's payload, moved in its part's transfer (the payload alone: the
    group's cut points are found on the device, ``stage_coded``), decodes and stages to the
    same updates as from its frame, cut where each member's changes start, with one read of
    the device; a staged payload of the wrong size is refused."""
    frames = blocks(device_changes(VALID_FLAT), VALID_NNZ)
    msg = decode_message(frames)
    moved = transfer_part(msg.tensors, msg.frames, [Placement((5000,), BF16, CPU)], StagingPool(cpu_too=True))
    assert set(moved.payloads) == {0} and not moved.extra
    assert transfers.sizes == [aligned(moved.payloads[0].numel())]
    gen = torch.Generator().manual_seed(3)
    olds = {k: torch.randn(n, generator=gen).to(BF16) for k, n in enumerate((1000, 3000, 1000))}
    got = {}
    for how, payload in (("staged", moved.payloads[0]), ("plain", None)):
        (decoded,) = decode_blocks([BlocksEntry(msg.tensors[0], (5000,), BF16, CPU, payload)], msg.frames)
        with HostReads() as reads:
            (updates,) = stage_decoded([(decoded, (0, 1, 2), None)], olds)
        assert dict(reads.syncs) == {"copy to the host": 1}, how  # verdict and cut points at once
        got[how] = [(u.ordinal, u.flat.tolist(), raw(u.values).tolist()) for u in updates if u.flat is not None]
    assert got["staged"] == got["plain"]
    cuts = np.searchsorted(VALID_FLAT, [0, 1000, 4000, 5000]).tolist()
    assert [(k, len(flat)) for k, flat, _ in got["staged"]] == [(k, cuts[k + 1] - cuts[k]) for k in range(3)]
    assert [p + at for (_, flat, _), at in zip(got["staged"], (0, 1000, 4000)) for p in flat] == VALID_FLAT
    with pytest.raises(ValueError, match="staged payload"):
        decode_entry(msg.tensors[0], msg.frames, (5000,), BF16, CPU, payload=moved.payloads[0][:-1])


@pytest.mark.parametrize("name", ["past-the-bound", "truncated-to-its-table", "not-ulp"])
def test_an_entry_is_checked_before_anything_is_staged(name: str) -> None:
    """An entry its target refuses by size (a payload past the target's bound, or too short
    for its own block table) is a ``ProtocolError`` before the pool holds any buffer; one
    that is not device coded (RAW values) is not staged, and its decode refuses it."""
    msg = decode_message(DEVICE_HOSTILE[name][0]())
    pool = StagingPool(cpu_too=True)
    ((shape, dtype),) = DEVICE_TARGET.values()
    where = Placement(shape, dtype, CPU)
    if name == "not-ulp":
        assert transfer_part(msg.tensors, msg.frames, [where], pool).payloads == {}
    else:
        with pytest.raises(ProtocolError):
            transfer_part(msg.tensors, msg.frames, [where], pool)
    assert pool.buffer(CPU) is None


@pytest.mark.parametrize("name", ["out-of-range", "decreasing", "truncated", "lying-widths", "bad-checksum"])
async def test_a_hostile_staged_part_is_refused_and_writes_nothing(name: str, transfers: Transfers) -> None:
    """A damaged payload beside a valid one, both moved in the part's one transfer: the
    same typed error as from frames, the model and version untouched (test_hostile's
    receiver case, through the transfer)."""
    config = {"type": "patch", "patch": {"codec": "device", "group_numel": 0}}
    r = receiver.make_receiver(config)
    r.staging = StagingPool(cpu_too=True)
    gen = torch.Generator().manual_seed(5)
    model = {"a": torch.randn(50, 100, generator=gen).to(BF16), "b": torch.randn(300, generator=gen).to(BF16)}
    s = sender.make_sender(config)
    ch = Channel()
    state = {k: v.clone() for k, v in model.items()}
    await asyncio.wait_for(
        asyncio.gather(s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv, version=0),
                       r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send)),
        timeout=60,
    )
    before = {k: v.clone() for k, v in model.items()}
    assert len(transfers.sizes) == 1  # the bootstrap's one message, its dense tensors in one transfer
    transfers.sizes.clear()
    old = model["b"][::3].clone()  # the valid entry: tensor "b" one ulp up at every third element
    good = encode_sparse(1, torch.arange(0, 300, 3), (old.view(torch.int16) + 1).view(BF16), old, (300,), PatchOptions(device_codec=True))
    specs, frames = assemble([good])
    hostile = decode_message(DEVICE_HOSTILE[name][0]())
    entries = [*specs, dataclasses.replace(hostile.tensors[0], buffers=tuple(
        dataclasses.replace(b, frame=b.frame + len(frames)) for b in hostile.tensors[0].buffers))]
    patch = Message(MessageType.PATCH, session=r.session, seq=99, version=1, base_version=0, tensors=entries, frames=[*frames, *hostile.frames])
    wire = [bytes(f) for f in encode_message(patch)]

    async def recv() -> list[bytes]:
        return wire

    with pytest.raises(DEVICE_HOSTILE[name][1]) as caught:
        await r.apply(model, recv)
    assert isinstance(caught.value, (ProtocolError, IntegrityError))
    assert len(transfers.sizes) == 1  # both payloads, one transfer
    assert r.version == 0 and not r.torn
    assert all(torch.equal(model[k].view(torch.int16), before[k].view(torch.int16)) for k in model)


# -- whole tensors (Encoding.DENSE): buckets, bootstraps and a patch's dense entries ------------
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool)
SHAPES = ((), (0, 3), (7,), (5, 9), (48, 64), (0,), (3, 4, 6))  # 7 shapes, 5 dtypes: every pair within 35 tensors
WIRE = {torch.bfloat16: torch.float32, torch.float16: torch.bfloat16, torch.float32: torch.float16}  # a cast, down and up
State = dict[str, torch.Tensor]


async def handshake(s: Any, r: Any, state: State, model: State, ch: Channel, version: int | None = None) -> None:
    await asyncio.wait_for(
        asyncio.gather(
            s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv, version=version),
            r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send),
        ),
        timeout=120,
    )


def values_of(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Compressible values (small integers, mostly-false bools, floats near 0 whose shuffled
    exponent bytes repeat), floats with NaN, -0.0, an infinity and a subnormal among them."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.2
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen)
    t = torch.randn(shape, generator=gen) * 0.02
    if t.numel() >= 4:
        t.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])
    return t.to(dtype)


def mixed_state(n: int, seed: int, master: bool = False) -> State:
    """``n`` tensors of every dtype of ``DTYPES`` and shape of ``SHAPES`` (0-d and empty ones
    among them); ``master``: the floating ones in fp32, as a trainer holds them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        out[f"layers.{i}.w"] = values_of(torch.float32 if master and dtype.is_floating_point else dtype, SHAPES[i % len(SHAPES)], gen)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bit-exact comparisons: NaN equals NaN of the same bits)."""
    return t.detach().reshape(-1).view(torch.uint8)


def same_bits(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(raw(a[k]), raw(b[k])) for k in a)


def aligned(nbytes: int) -> int:
    return -(-nbytes // staging.ALIGN) * staging.ALIGN


@pytest.mark.parametrize("tensors", [48, 480])
@pytest.mark.parametrize(
    "bucket",
    [{}, {"bucket_dtype": "bfloat16"}, {"load_instant": False}, {"bucket_size": 4 << 10, "init_sync": {"enabled": True, "bucket_size": 4 << 10}}],
    ids=["instant", "bf16-wire", "staged-version", "parts"],
)
async def test_whole_tensors_reach_the_device_in_one_transfer_a_message(tensors: int, bucket: dict[str, Any], transfers: Transfers) -> None:
    """The bucket strategy end to end, its bootstrap and a version: every message's whole
    tensors (bf16/fp16/fp32/int64/bool, 0-d and empty among them) reach the (stand-in) device
    in one transfer, whether written on arrival (``load_instant``) or kept for the commit, and
    the model ends bit-exact with a receiver's that stages nothing, NaNs included: the
    bootstrap at the model's dtypes, the version from the trainer's fp32 (or bf16 on the wire,
    ``bucket_dtype``) cast to each target's dtype."""
    config = {"type": "bucket", "bucket": {"bucket_device": "cpu", "init_sync": {"enabled": True}, **bucket}}
    models: dict[bool, State] = {}
    for staged in (False, True):
        state, model = mixed_state(tensors, 0, master=True), mixed_state(tensors, 1)
        s, r = sender.make_sender(config), receiver.make_receiver(config)
        if staged:
            r.staging = StagingPool(cpu_too=True)
        ch = Channel()
        await handshake(s, r, state, model, ch)
        assert r.last_stats is not None
        boot = r.last_stats.messages
        assert same_bits(model, {k: state[k].to(model[k].dtype) for k in state})
        assert len(transfers.sizes) == (boot if staged else 0)
        if staged and boot == 1:
            assert transfers.sizes[-1] == sum(aligned(t.numel() * t.element_size()) for t in model.values())
        new = mixed_state(tensors, 2, master=True)
        for k in state:
            state[k].copy_(new[k])
        await s.sync(state, ch.to_receiver.send, 1)
        assert await asyncio.wait_for(r.apply(model, ch.to_receiver.recv), timeout=60) == 1
        parts = r.last_stats.messages
        assert len(transfers.sizes) == (boot + parts if staged else 0)
        wire = {k: torch.bfloat16 if bucket.get("bucket_dtype") and t.is_floating_point() else t.dtype for k, t in state.items()}
        if staged and parts == 1:
            assert transfers.sizes[-1] == sum(aligned(t.numel() * wire[k].itemsize) for k, t in state.items())
        assert same_bits(model, {k: state[k].to(wire[k]).to(model[k].dtype) for k in state})
        models[staged] = model
        transfers.sizes.clear()
    assert same_bits(models[True], models[False])
    if "bucket_size" in bucket:
        assert boot > 1 and parts > 1


def mixed_message(kind: MessageType, n: int, codec: Codec) -> tuple[State, State, Message]:
    """A model of ``n`` mixed tensors (``mixed_state``), what a message of ``kind`` makes of
    it, and the message: every tensor whole, its frame compressed with ``codec`` where that
    pays, floats at another dtype to convert (``WIRE``) outside a patch; a patch also codes
    every other float tensor of 64 elements or more on the device (one ulp up at every fifth
    element) and sends three bf16 tensors as one dense group."""
    model = mixed_state(n, 1)
    if kind is MessageType.PATCH:
        gen = torch.Generator().manual_seed(3)
        model.update({f"group.{i}": values_of(torch.bfloat16, shape, gen) for i, shape in enumerate([(7,), (), (48, 64)])})
    new = mixed_state(n, 2)
    expected, encoded = {}, []
    for i, (key, old) in enumerate(model.items()):
        if key.startswith("group."):
            continue
        if kind is MessageType.PATCH and old.dtype in (torch.bfloat16, torch.float32) and old.numel() >= 64 and i % 2 == 0:
            flat = torch.arange(4, old.numel(), 5)
            bits = old.reshape(-1)[flat].view(torch.int16 if old.dtype == torch.bfloat16 else torch.int32)
            changed = (bits + 1).view(old.dtype)
            encoded.append(encode_sparse(i, flat, changed, old.reshape(-1)[flat], tuple(old.shape), PatchOptions(device_codec=True)))
            after = old.clone()
            after.view(-1)[flat] = changed
            expected[key] = after
            continue
        sent = new[key].to(WIRE.get(old.dtype, old.dtype)) if kind is not MessageType.PATCH else new[key]
        encoded.append(encode_dense(i, sent, codec))
        expected[key] = sent.to(old.dtype)
    if kind is MessageType.PATCH:
        keys = [k for k in model if k.startswith("group.")]
        ordinals = tuple(list(model).index(k) for k in keys)
        gen = torch.Generator().manual_seed(4)
        run = torch.cat([values_of(torch.bfloat16, tuple(model[k].shape), gen).reshape(-1) for k in keys])
        encoded.append(pack_entry(ordinals[0], Encoding.DENSE, ValueEncoding.RAW, run.numel(), {Role.VALUES: run}, codec, ordinals))
        at = 0
        for k in keys:
            expected[k] = run[at : at + model[k].numel()].view(model[k].shape)
            at += model[k].numel()
    specs, frames = assemble(encoded)
    msg = Message(kind, session="s", version=1, base_version=0 if kind is MessageType.PATCH else None, tensors=specs, frames=frames)
    return model, expected, decode_message([bytes(f) for f in encode_message(msg)])


def decoding_receiver(kind: MessageType, model: State, staged: bool) -> Any:
    r = receiver.make_receiver({"type": "patch" if kind is MessageType.PATCH else "bucket"})
    r.metadata = ModelMetadata.of(model)
    if staged:
        r.staging = StagingPool(cpu_too=True)
    return r


@pytest.mark.parametrize("tensors", [48, 480])
@pytest.mark.parametrize("codec", [Codec.NONE, Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
@pytest.mark.parametrize("kind", [MessageType.PATCH, MessageType.BUCKET, MessageType.BOOTSTRAP], ids=lambda k: k.name)
def test_a_messages_whole_tensors_move_in_its_one_transfer_bit_exact(
    kind: MessageType, codec: Codec, tensors: int, transfers: Transfers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One message, decoded by a receiver that stages nothing and by one that stages (the
    GPU's path): compressed frames decompressed and unshuffled on the host first, cast to
    the target's dtype after the move (bucket and bootstrap), a patch part's dense entries,
    dense group and device-coded payloads all in the one transfer. The same bits either way,
    the ones sent; the staged decode reads nothing back (no bool check where the values
    are: their bytes were checked on the host), but a patch's one read of its verdicts."""
    monkeypatch.setattr(parallel, "WORKERS", 1)  # every entry on this thread, where the counter sees it
    model, expected, msg = mixed_message(kind, tensors, codec)
    if codec is not Codec.NONE:  # compressed frames among them, shuffled ones too
        assert any(b.codec is codec for e in msg.tensors for b in e.buffers)
        assert any(b.codec is codec and b.shuffle for e in msg.tensors for b in e.buffers)
    blocks = sum(e.encoding is Encoding.BLOCKS for e in msg.tensors)
    assert (blocks > 0) == (kind is MessageType.PATCH) and any(e.group for e in msg.tensors) == (kind is MessageType.PATCH)
    results = {}
    for staged in (False, True):
        mine = {k: v.clone() for k, v in model.items()}
        r = decoding_receiver(kind, mine, staged)
        targets = r.targets(mine)
        with HostReads() as reads:
            updates = r._decode(msg, targets)
        if staged:
            assert len(transfers.sizes) == 1
            wanted = sum(aligned(b.nbytes) for e in msg.tensors for b in e.buffers)
            assert transfers.sizes[0] == wanted  # every entry's bytes, decompressed, nothing else (no device-coded group here)
            # the verdicts' one read, and each cast: on CPU targets a ``_to_copy`` to the CPU that
            # HostReads counts, on a GPU a cast on the device; no bool check (``int(max)``) anywhere
            keys = list(model)
            casts = sum(e.encoding is Encoding.DENSE and dtype_from_code(e.buffers[0].dtype) != model[keys[e.key]].dtype for e in msg.tensors)
            assert (casts > 0) == (kind is not MessageType.PATCH)
            assert dict(reads.syncs) == ({"copy to the host": int(blocks > 0) + casts} if blocks or casts else {})
        else:
            assert transfers.sizes == []
        commit(targets, updates, {})
        results[staged] = mine
    assert same_bits(results[True], results[False])
    assert same_bits(results[True], expected)


async def test_a_patch_part_mixing_whole_and_device_coded_tensors_is_one_transfer(transfers: Transfers) -> None:
    """A device-codec patch end to end: every other tensor changed at 60% (sent whole,
    ``dense_above`` 0.3), the others at 1% (device coded), in parts of 16 KiB: each part,
    both kinds in it, is one transfer, and the model ends bit-exact."""
    config = {"type": "patch", "patch": {"codec": "device", "dense_above": 0.3, "group_numel": 0, "part_bytes": 16 << 10}}
    state = bf16_state(48, 4096)
    model = {k: v.clone() for k, v in state.items()}
    s, r = sender.make_sender(config), receiver.make_receiver(config)
    r.staging = StagingPool(cpu_too=True)
    ch = Channel()
    await handshake(s, r, state, model, ch)
    transfers.sizes.clear()
    gen = torch.Generator().manual_seed(9)
    for i, t in enumerate(state.values()):
        t.view(torch.int16)[torch.rand(t.numel(), generator=gen) < (0.6 if i % 2 else 0.01)] += 1
    start = len(ch.to_receiver.sent)
    await s.sync(state, ch.to_receiver.send, 1)
    assert await asyncio.wait_for(r.apply(model, ch.to_receiver.recv), timeout=60) == 1
    sent = [decode_message(frames) for frames in ch.to_receiver.sent[start:]]
    assert len(sent) > 1 and len(transfers.sizes) == len(sent)
    assert any({e.encoding for e in m.tensors} == {Encoding.DENSE, Encoding.BLOCKS} for m in sent)
    assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def lying_dense(key: int, shape: tuple[int, ...], dtype: torch.dtype) -> EncodedTensor:
    """A dense entry whose header says its target's size and whose zstd frame decompresses to less."""
    nbytes = math.prod(shape) * dtype.itemsize
    wire = bytes(compress(torch.zeros(nbytes // 2, dtype=torch.uint8), Codec.ZSTD))
    spec = BufferSpec(0, Role.VALUES, dtype_code(dtype), shape, nbytes, Codec.ZSTD, False, len(wire), checksum(wire))
    return EncodedTensor(key, Encoding.DENSE, ValueEncoding.RAW, math.prod(shape), [(spec, wire)])


HOSTILE_DENSE = {  # a dense entry beside a good one, and what refuses it: its target is ordinal 1 (bf16[300]) or 2 (bool[64])
    "wrong-shape": (lambda: encode_dense(1, torch.zeros(301, dtype=torch.bfloat16), Codec.NONE), ProtocolError),
    "decompresses-short": (lambda: lying_dense(1, (300,), torch.bfloat16), IntegrityError),
    "bool-bytes": (lambda: encode_dense(2, torch.full((64,), 2, dtype=torch.uint8).view(torch.bool), Codec.NONE), ProtocolError),
}


@pytest.mark.parametrize("kind", ["patch", "bucket"])
@pytest.mark.parametrize("name", list(HOSTILE_DENSE))
async def test_a_hostile_dense_entry_is_refused_as_before_and_nothing_is_written(name: str, kind: str, transfers: Transfers) -> None:
    """A damaged whole tensor beside a good one, in a patch and in a bucket written on arrival
    (``load_instant``): the same typed error, word for word, from a receiver that stages as
    from one that does not; the staging one refuses it before its transfer (none made); the
    model and version untouched, the model not torn."""
    errors = {}
    for staged in (False, True):
        config = {"type": kind, "patch": {"codec": "device"}}
        r = receiver.make_receiver(config)
        if staged:
            r.staging = StagingPool(cpu_too=True)
        gen = torch.Generator().manual_seed(5)
        model = {"a": torch.randn(50, 100, generator=gen).to(BF16), "b": torch.randn(300, generator=gen).to(BF16)}
        model["c"] = torch.rand(64, generator=gen) < 0.5
        s = sender.make_sender(config)
        await handshake(s, r, {k: v.clone() for k, v in model.items()}, model, Channel(), version=0)
        transfers.sizes.clear()
        before = {k: v.clone() for k, v in model.items()}
        good = encode_dense(0, torch.ones(50, 100, dtype=BF16), Codec.NONE)
        specs, frames = assemble([good, HOSTILE_DENSE[name][0]()])
        mtype = MessageType.PATCH if kind == "patch" else MessageType.BUCKET
        msg = Message(mtype, session=r.session, seq=99, version=1, base_version=0 if kind == "patch" else None, tensors=specs, frames=frames)
        pipe = Pipe()
        await pipe.send(encode_message(msg))
        with pytest.raises(HOSTILE_DENSE[name][1]) as caught:
            await r.apply(model, pipe.recv)
        errors[staged] = (type(caught.value), str(caught.value))
        assert transfers.sizes == []  # refused before the transfer
        assert r.version == 0 and not r.torn
        assert same_bits(model, before)
    assert errors[True] == errors[False]


def test_a_dense_frame_nvcomp_compressed_is_left_to_its_decode() -> None:
    """nvCOMP decompresses on the GPU: such a dense entry is checked but not staged (on a
    machine without nvCOMP its decode is refused, with or without staging)."""
    wire = b"\x00" * 16
    spec = BufferSpec(1, Role.VALUES, dtype_code(torch.float32), (100,), 400, Codec.NVCOMP_LZ4, False, len(wire), checksum(wire))
    entry = TensorEntry(0, Encoding.DENSE, ValueEncoding.RAW, 100, (spec,))
    pool = StagingPool(cpu_too=True)
    assert transfer_part([entry], [wire], [Placement((100,), torch.float32, CPU)], pool).payloads == {}
    assert pool.buffer(CPU) is None
    with pytest.raises(ProtocolError):  # checked all the same
        transfer_part([entry], [wire], [Placement((101,), torch.float32, CPU)], pool)
