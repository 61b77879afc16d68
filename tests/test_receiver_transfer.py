"""A part's one host-to-device transfer (receiver/transfer.py, protocol/codec/staging.py),
run on CPU tensors.

A receiver whose targets are on a GPU moves every device-coded payload of a part, and its
groups' offsets, to the device in one copy through a reused staging buffer. A CPU target
needs no copy, so the receiver stages nothing for it; here the pool is told to stage CPU
targets too (``StagingPool(cpu_too=True)``), which runs the GPU's path on CPU tensors,
and the transfer function (``staging.host_to_device``) is counted."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from channel import Channel
from test_device_path import HostReads, device_messages
from test_hostile import BF16, DEVICE_HOSTILE, DEVICE_TARGET, VALID_FLAT, VALID_NNZ, blocks, device_changes

import receiver
import sender
from protocol.codec import parallel, staging
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse, read_verdicts
from protocol.errors import IntegrityError, ProtocolError
from protocol.wire.framing import Encoding, Message, MessageType, decode_message, encode_message
from receiver.commit import commit
from receiver.transfer import Placement, transfer_part

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
    device coded: each part reaches the (stand-in) device in one transfer, the groups'
    offsets with it (no other copy to the device), the device is read once a part, the
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
            payloads = sum(memoryview(f).nbytes for f in msg.frames)
            offsets = sum(8 * (len(e.group) + 1) for e in msg.tensors if e.group)
            pieces = len(msg.tensors) + sum(1 for e in msg.tensors if e.group)
            assert payloads + offsets <= transfers.sizes[-1] < payloads + offsets + staging.ALIGN * pieces  # each piece aligned
            buffer = r.staging.buffer(CPU)
            assert buffer is not None
            buffers.add(buffer.data_ptr())
            commit(targets, updates, {})
        assert len(transfers.sizes) - before == len(messages)
        assert len(buffers) == 1 and r.staging.allocations == 1  # reused across the parts
        assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
    if patch.get("part_bytes") is not None:
        assert len(messages) > 1


async def test_a_part_without_device_coded_entries_is_not_transferred(transfers: Transfers) -> None:
    """The host codec's part, with the pool staging CPU targets: no transfer, no buffer."""
    r, model, state, messages = await device_messages(48, 4096, {"codec": "host", "group_numel": 0})
    r.staging = StagingPool(cpu_too=True)
    assert not any(e.encoding is Encoding.BLOCKS for m in messages for e in m.tensors)
    targets = r.targets(model)
    for msg in messages:
        commit(targets, r._decode(msg, targets), {})
    assert transfers.sizes == [] and r.staging.buffer(CPU) is None and r.staging.allocations == 0
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


def test_verdicts_use_offsets_already_on_the_device() -> None:
    """``read_verdicts`` takes a group's offsets where its transfer put them (no copy) or
    from the host (one copy for all), with the same cut points."""
    frames = blocks(device_changes(VALID_FLAT), VALID_NNZ)
    msg = decode_message(frames)
    offsets = np.array([0, 1000, 4000, 5000], dtype=np.int64)
    where = Placement((5000,), BF16, CPU, offsets)
    moved = transfer_part(msg.tensors, msg.frames, [where], StagingPool(cpu_too=True))
    assert set(moved.payloads) == set(moved.offsets) == {0}
    staged = decode_entry(msg.tensors[0], msg.frames, (5000,), BF16, CPU, payload=moved.payloads[0])
    plain = decode_entry(msg.tensors[0], msg.frames, (5000,), BF16, CPU)
    with HostReads() as reads:
        cuts = read_verdicts([(staged, moved.offsets[0])])
    assert dict(reads.syncs) == {"copy to the host": 1}  # no copy of the offsets
    assert cuts == read_verdicts([(plain, offsets)])
    assert staged.flat is not None and plain.flat is not None
    assert torch.equal(staged.flat, plain.flat) and torch.equal(staged.values, plain.values)
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
