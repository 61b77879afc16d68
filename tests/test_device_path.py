"""The device codec on the wire (``patch.codec``, ``Encoding.BLOCKS``), run on CPU tensors.

A device-coded entry decodes to exactly the changes the host codec sends for the same
tensors (positions and new bits), grouped or not; ``patch.codec`` is validated and ``auto``
resolved as documented; and the receiver's decode and staging of a device-coded message
read the device back once per part, however many tensors it carries (what, on a GPU, is a
host synchronisation). Daemon scenarios with ``patch.codec: device`` are in
test_daemons/test_relay/test_parts, hostile payloads in test_hostile and test_fuzz.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from channel import Channel
from coded import stage_decoded
from hypothesis import given, settings
from hypothesis import strategies as st
from test_device_codec import FLOATS, INTEGERS, SyncCounter, bits, bitwise_changes, float_pair, integer_pair

import receiver
import sender
from benchmarks.opcount import OpCounter
from protocol.codec import parallel
from protocol.codec.compress import Codec
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import (
    BlocksEntry,
    EncodedTensor,
    PatchOptions,
    assemble,
    decode_blocks,
    decode_entry,
    encode_sparse,
    group_offsets,
    split_group,
)
from protocol.config import load_config
from protocol.errors import ConfigError, ProtocolError
from protocol.wire.framing import Encoding, Role, ValueEncoding, decode_message
from protocol.wire.framing import Message as WireMessage
from receiver.apply.commit import commit
from receiver.apply.transfer import Placement, transfer_part

CPU = torch.device("cpu")
HOST = PatchOptions(dense_above=1.0, device_codec=False)  # coded, never whole: the host codec's changes
DEVICE = PatchOptions(dense_above=1.0, device_codec=True)


Changes = list[tuple[torch.Tensor, torch.Tensor]]  # (positions, new bits), of a tensor or of each of a group's


def decoded_changes(
    entry: EncodedTensor, numel: int, dtype: torch.dtype, old: torch.Tensor, members: list[int] | None = None, staged: bool = False
) -> Changes:
    """What a receiver takes from ``entry`` (a 1-D target of ``numel``, whose values are
    ``old``): (positions, new bits) of the whole target, or of each of the group's
    ``members`` (their element counts), each against its own slice of ``old``. ``staged``:
    through a part's transfer (receiver/apply/transfer.py), as a GPU target's payload goes (a
    CPU target's decode from the frame otherwise). A device-coded entry is staged as the
    receiver stages it (``stage_coded``: its verdict and a group's cut points read at once),
    a host-coded one split as the receiver splits it (``split_group``)."""
    specs, frames = assemble([entry])
    offsets = group_offsets([(numel,)] if members is None else [(n,) for n in members])
    moved = transfer_part(specs, frames, [Placement((numel,), dtype, CPU)], StagingPool(cpu_too=staged))
    assert len(moved.payloads) == int(staged and entry.encoding is Encoding.BLOCKS)
    decoded = decode_entry(specs[0], frames, (numel,), dtype, CPU, payload=moved.payloads.get(0))
    keys = tuple(range(len(offsets) - 1))
    olds = dict(enumerate(old.reshape(-1).split([int(n) for n in offsets[1:] - offsets[:-1]])))
    if decoded.verdict is not None:
        (updates,) = stage_decoded([(decoded, keys if members is not None else (), None)], olds)
        return [(u.flat + int(offsets[u.ordinal]), bits(u.values)) for u in updates if u.flat is not None]
    pieces = [decoded] if members is None else split_group(decoded, keys, [(n,) for n in members])
    out = []
    for piece in pieces:
        start = int(offsets[piece.key])
        assert piece.flat is not None
        at = olds[piece.key][piece.flat]
        new = piece.values if piece.encoding is ValueEncoding.RAW else piece.new_values(at)
        out.append((piece.flat + start, bits(new)))
    return out


def as_one(pieces: Changes) -> tuple[list[int], list[int]]:
    return [int(x) for p in pieces for x in p[0]], [int(x) for p in pieces for x in p[1]]


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS + INTEGERS),
    numel=st.integers(1, 2500),
    density=st.sampled_from([0.0, 0.002, 0.05, 0.4, 1.0]),
    lr=st.sampled_from([1e-6, 1e-5, 1e-3]),
    members=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    staged=st.booleans(),
)
def test_device_entries_decode_to_exactly_the_host_codecs_changes(
    dtype: torch.dtype, numel: int, density: float, lr: float, members: int, seed: int, staged: bool
) -> None:
    """bf16/fp16/fp32 receivers of an fp32 master (NaN, -0.0, infinities, subnormals among
    the values) and integer buffers, from no change to every element changed, alone or as a
    group of up to three tensors: the same positions and new bits as the host codec's,
    decoded from the frame (a CPU target) or ``staged`` (a GPU target's path: the payload
    moved in the part's one transfer, ``receiver/apply/transfer.py``)."""
    old, new = float_pair(dtype, numel, density, lr, seed) if dtype.is_floating_point else integer_pair(dtype, numel, density, seed)
    flat, new_at, old_at = bitwise_changes(old, new)
    sizes = None if members == 1 else [numel // members] * (members - 1) + [numel - numel // members * (members - 1)]
    entries = {name: encode_sparse(0, flat, new_at, old_at, (numel,), options) for name, options in (("host", HOST), ("device", DEVICE))}
    assert entries["device"].encoding is Encoding.BLOCKS and entries["device"].values is ValueEncoding.ULP
    assert [spec.role for spec, _ in entries["device"].buffers] == [Role.VALUES]
    if flat.numel() == 0:  # nothing changed: such an entry is never sent, and refused by both alike
        for entry in entries.values():
            with pytest.raises(ProtocolError, match="0 changes"):
                decoded_changes(entry, numel, dtype, old, sizes, staged)
        return
    host, device = (as_one(decoded_changes(e, numel, dtype, old, sizes, staged)) for e in (entries["host"], entries["device"]))
    assert device == host
    assert device == (flat.tolist(), bits(new_at).tolist())  # and both are what a bitwise compare finds


def test_device_entries_are_never_compressed_again() -> None:
    old, new = float_pair(torch.bfloat16, 50_000, 0.3, 1e-3, 1)
    flat, new_at, old_at = bitwise_changes(old, new)
    entry = encode_sparse(0, flat, new_at, old_at, (50_000,), PatchOptions(codec=Codec.ZSTD, dense_above=1.0, device_codec=True))
    ((spec, _),) = entry.buffers
    assert entry.encoding is Encoding.BLOCKS and spec.codec is Codec.NONE and spec.nbytes > 4096


# -- patch.codec --------------------------------------------------------------------------------
def test_patch_codec_is_validated_and_auto_resolves_by_device() -> None:
    assert load_config(None).patch.codec == "auto" and load_config(None).patch.options().device_codec is None
    for name, device_codec in (("host", False), ("device", True), ("auto", None)):
        assert load_config({"patch": {"codec": name}}).patch.options().device_codec is device_codec
    for bad in ("gpu", "", None, True, ["device"]):
        with pytest.raises(ConfigError, match=r"patch\.codec"):
            load_config({"patch": {"codec": bad}})
    for clash in ({"position_encoding": "gaps"}, {"value_encoding": "xor"}, {"position_encoding": "coo"}):
        with pytest.raises(ConfigError, match=r"patch\.codec"):
            load_config({"patch": {"codec": "device", **clash}})
        assert load_config({"patch": {"codec": "auto", **clash}}).patch.options().resolved(True).device_codec is False
    with pytest.raises(ValueError):
        PatchOptions(Encoding.GAPS, device_codec=True)
    auto = PatchOptions()
    assert auto.resolved(True).device_codec is True and auto.resolved(False).device_codec is False
    assert auto.codes_on_device(torch.device("cuda")) and not auto.codes_on_device(CPU)
    assert PatchOptions(device_codec=True).resolved(False).device_codec is True
    assert PatchOptions(device_codec=False).resolved(True).device_codec is False


def test_auto_codes_cpu_tensors_on_the_host() -> None:
    """``auto`` (the default) on a CPU trainer keeps the host codec: no BLOCKS entry."""
    old, new = float_pair(torch.bfloat16, 4096, 0.05, 1e-5, 3)
    flat, new_at, old_at = bitwise_changes(old, new)
    assert encode_sparse(0, flat, new_at, old_at, (4096,), PatchOptions(dense_above=1.0)).encoding is not Encoding.BLOCKS


# -- structure: one read of the device a part -----------------------------------------------------
class HostReads(SyncCounter):
    """``SyncCounter``, and a copy of a tensor to the host (``_to_copy`` to an explicit cpu
    device): on CPU tensors it copies nothing between devices, but on CUDA it is the read
    that waits for the device."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and (kwargs or {}).get("device") == CPU:
            self.syncs["copy to the host"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def bf16_state(tensors: int, numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tensors)
    return {f"layers.{i}.weight": (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16) for i in range(tensors)}


def nudge(state: dict[str, torch.Tensor], share: float, seed: int) -> None:
    """Move ``share`` of every tensor's elements by one ulp, up or down (a small step)."""
    gen = torch.Generator().manual_seed(seed)
    for t in state.values():
        view = t.view(torch.int16)
        moved = (torch.rand(t.numel(), generator=gen) < share).to(torch.int16)
        view += moved * (torch.randint(0, 2, (t.numel(),), generator=gen, dtype=torch.int16) * 2 - 1)


State = dict[str, torch.Tensor]


async def device_messages(tensors: int, numel: int, patch: dict[str, Any]) -> tuple[Any, State, State, list[WireMessage]]:
    """A device-coded version of a state of ``tensors`` bf16 tensors: the receiver (at its
    base), its model, the sender's state and the version's messages, not yet applied."""
    config = {"type": "patch", "patch": {"codec": "device", **patch}}
    state = bf16_state(tensors, numel)
    model = {k: v.clone() for k, v in state.items()}
    s, r = sender.make_sender(config), receiver.make_receiver(config)
    ch = Channel()
    await asyncio.wait_for(
        asyncio.gather(s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv), r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send)),
        timeout=120,
    )
    nudge(state, 0.01, 7)
    start = len(ch.to_receiver.sent)
    await s.sync(state, ch.to_receiver.send, 1)
    return r, model, state, [decode_message(frames) for frames in ch.to_receiver.sent[start:]]


@pytest.mark.parametrize("patch", [{"group_numel": 0}, {}, {"group_numel": 0, "part_bytes": 16 << 10}], ids=["alone", "grouped", "parts"])
async def test_decode_and_stage_read_the_device_once_a_part_whatever_the_tensor_count(patch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 48-tensor and a 480-tensor bf16 model of the same 491,520 elements, 1% changed by
    one ulp: every sparse entry device coded, and the receiver's decode and staging of each
    part (``_decode``: every entry's payload decoded, the verdicts and cut points read,
    old + differences computed) make the same few host reads, at most 4 a part."""
    monkeypatch.setattr(parallel, "WORKERS", 1)  # every entry on this thread, where the counter sees it
    counts: dict[int, list[dict[str, int]]] = {}
    kernels: dict[int, int] = {}
    for tensors in (48, 480):
        r, model, state, messages = await device_messages(tensors, 491_520 // tensors, patch)
        assert all(e.encoding is Encoding.BLOCKS for m in messages for e in m.tensors)
        assert sum(len(e.covers) for m in messages for e in m.tensors) == tensors
        targets = r.targets(model)
        counts[tensors], kernels[tensors] = [], 0
        for msg in messages:
            with HostReads() as reads, OpCounter() as ops:
                updates = r._decode(msg, targets)
            counts[tensors].append(dict(reads.syncs))
            kernels[tensors] += ops.total
            commit(targets, updates, {})
        assert all(torch.equal(model[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
    # per part: one copy of the verdicts and groups' cut points to the host (what the host
    # knows goes to the device from pinned memory, not waited for)
    for tensors, parts in counts.items():
        assert all(part == {"copy to the host": 1} for part in parts), (tensors, parts)
    # kernels: within 300 a part and 3 a tensor, growing by one a tensor (reading its old values)
    parts = {t: len(c) for t, c in counts.items()}
    assert all(kernels[t] <= 300 * parts[t] + 3 * t for t in kernels), kernels
    assert kernels[480] - kernels[48] <= (480 - 48) + 300 * (parts[480] - parts[48]), kernels
    if patch.get("part_bytes") is None:  # one message either way
        assert len(counts[48]) == len(counts[480]) == 1
    else:
        assert len(counts[48]) > 1 and len(counts[480]) > 1


def test_a_verdict_read_is_one_copy_for_many_entries() -> None:
    """``stage_coded`` of 40 entries decoded as one batch, some grouped, reads the device once
    (every verdict and every group's cut points in one copy to the host), and cuts each group
    where its members' changes start."""
    entries, olds, changes, groups = [], {}, [], []
    for i in range(40):
        old, new = float_pair(torch.bfloat16, 900, 0.05, 1e-5, i)
        flat, new_at, old_at = bitwise_changes(old, new)
        key = len(olds)
        group = (key, key + 1) if i % 3 == 0 else ()
        olds.update({key: old[:300], key + 1: old[300:]} if group else {key: old})
        entries.append(encode_sparse(key, flat, new_at, old_at, (900,), DEVICE))
        changes.append((flat, new_at))
        groups.append(group)
    specs, frames = assemble(entries)
    decoded = decode_blocks([BlocksEntry(spec, (900,), torch.bfloat16, CPU) for spec in specs], frames)
    with HostReads() as reads:
        updates = stage_decoded([(d, group, None) for d, group in zip(decoded, groups)], olds)
    assert dict(reads.syncs) == {"copy to the host": 1}
    for (flat, new_at), group, mine in zip(changes, groups, updates):
        if group:
            low = int((flat < 300).sum())
            assert [(u.ordinal, u.flat.numel()) for u in mine] == [(k, n) for k, n in zip(group, (low, flat.numel() - low)) if n]
        placed = torch.cat([u.flat + (300 if group and u.ordinal == group[1] else 0) for u in mine])
        assert placed.tolist() == flat.tolist()
        assert torch.equal(torch.cat([bits(u.values) for u in mine]), bits(new_at))
    assert sum(1 for g in groups if g) == 14
