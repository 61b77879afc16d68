"""The sender's device path as a whole (sender/version/encode_device.py behind sender/version/patch.py), on CPU tensors.

What a GPU needs, said on CPU: a version's compare and its parts' encoding make at most 4
host syncs a part, the same for a 48-tensor model as for a 480-tensor one of the same
elements; each part is coded in one batch (one sync for every payload's size) and moved
to the host in one copy; no numba kernel runs. And the entries are right: every sparse one
device coded and decoding to the model, a tensor whose payload would not be smaller sent whole.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from test_compare import CompareCounter, run_calling_no_numba, structure_model, structure_step

from protocol.codec import devicecodec
from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.framing import Encoding
from protocol.wire.metadata import ModelMetadata
from sender.plan import SyncPlan
from sender.stats import SyncStats
from sender.version import encode_device
from sender.version.encode import HostEncoder
from sender.version.encode_device import DeviceEncoder
from sender.version.patch import Captured, PatchBuilder


def builder_of(state: dict[str, torch.Tensor], **patch: Any) -> PatchBuilder:
    """A captured patch builder of ``state`` for bf16 receivers of its floating tensors
    (numba not warmed: ``compare.capture``)."""
    config = load_config({"type": "patch", "patch": {"codec": "device", **patch}})
    metadata = ModelMetadata.of({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in state.items()})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    builder.compare.capture(state)
    return builder


def no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.codec import entropy, packed
    from sender.diff import fastdiff

    def numba(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a numba kernel on the device path")

    for module, names in ((fastdiff, ("diff_and_update", "sampled_differences")), (packed, ("encode",)), (entropy, ("encode_values",))):
        for name in names:
            monkeypatch.setattr(module, name, numba)


Counted = tuple[Counter[str], list[Counter[str]], list[int], list[Any]]


def counted_version(tensors: int, patch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Counted:
    """One version of ``structure_model(tensors)``: the compare's syncs, each part's encode's
    syncs and copies to the host (``to_host`` calls), and the entries."""
    state = structure_model(tensors)
    builder = builder_of(state, **patch)
    assert isinstance(builder.encoder, DeviceEncoder)
    structure_step(state)
    copies: list[int] = []

    def counted(stream: Any, buffer: torch.Tensor, stats: Any = None) -> torch.Tensor:
        copies[-1] += 1
        return buffer

    monkeypatch.setattr(encode_device, "to_host", counted)
    with CompareCounter() as counter:
        captured = builder.compare.collect(state, SyncStats(1, "patch"), lambda c: Captured(c.captured_nbytes(), None, c))
        compared = Counter(counter.syncs)
        parts, entries = [], []
        for part in builder.parts(captured):
            before = Counter(counter.syncs)
            copies.append(0)
            entries += builder.encoder.encode([c.changes for c in part if c.changes is not None])
            parts.append(counter.syncs - before)
    return compared, parts, copies, entries


@pytest.mark.parametrize("patch", [{"group_numel": 0}, {}, {"group_numel": 0, "part_bytes": 16 << 10}], ids=["alone", "grouped", "parts"])
def test_host_syncs_a_version_are_per_part_not_per_tensor(patch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    no_numba(monkeypatch)
    seen = {}
    for tensors in (48, 480):
        compared, parts, copies, entries = counted_version(tensors, patch, monkeypatch)
        assert sum(len(e.group) or 1 for e in entries) == tensors
        encodings = {e.encoding for e in entries}  # the third tensor goes whole, unless in a group
        assert encodings == {Encoding.BLOCKS, Encoding.DENSE} if patch.get("group_numel") == 0 else encodings >= {Encoding.BLOCKS}
        # the payloads' sizes, read at once, and one copy to the host: in a part with a sparse
        # entry (on CPU, a part of whole tensors only has nothing to copy: they are host memory)
        assert all(sum(p.values()) <= 1 for p in parts) and sum(sum(p.values()) for p in parts) >= 1, parts
        assert copies == [sum(p.values()) for p in parts], (copies, parts)
        assert sum(compared.values()) + sum(sum(p.values()) for p in parts) <= 4 * len(parts)
        seen[tensors] = (compared, parts)
    assert seen[48][0] == seen[480][0]  # the compare's syncs: per run
    if "part_bytes" in patch:
        assert len(seen[48][1]) > 1 and len(seen[480][1]) > 1
    else:
        assert len(seen[48][1]) == len(seen[480][1]) == 1


def test_entries_decode_to_the_model_and_a_payload_that_would_not_be_smaller_goes_whole() -> None:
    """Several tensors in one part, one of them tiny and all changed: every BLOCKS entry
    decodes to its tensor's new bf16 bits; the tiny one travels whole (its payload's header
    alone outweighs it)."""
    gen = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(3000, generator=gen), "b": torch.randn(40, 50, generator=gen), "tiny": torch.randn(4, generator=gen)}
    builder = builder_of(state, group_numel=0, dense_above=1.0)
    old = {k: v.to(torch.bfloat16) for k, v in state.items()}
    state["a"][::7] += 0.5
    state["b"][3] -= 1.0
    state["tiny"] += 1.0
    captured = builder.compare.collect(state, SyncStats(1, "patch"), lambda c: Captured(c.captured_nbytes(), None, c))
    entries = builder.encoder.encode([c.changes for c in captured if c.changes is not None])
    keys = {builder.plan.ordinal(k): k for k in state}
    by_key = {keys[e.key]: e for e in entries}
    assert by_key["tiny"].encoding is Encoding.DENSE and by_key["a"].encoding is Encoding.BLOCKS and by_key["b"].encoding is Encoding.BLOCKS
    for key in ("a", "b"):
        entry = by_key[key]
        (_, frame), = entry.buffers
        payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        decoded = devicecodec.decode(payload, entry.nnz, old[key].numel(), torch.bfloat16)
        assert bool(decoded.ok)
        got = old[key].reshape(-1).view(torch.int16).clone()
        got[decoded.flat] = devicecodec.apply_differences(got[decoded.flat], decoded.diffs)
        assert torch.equal(got, state[key].to(torch.bfloat16).reshape(-1).view(torch.int16))


def test_the_codec_chooses_the_encoder_and_whether_the_compare_stages() -> None:
    state = structure_model(4, 4000)
    device = builder_of(state)
    host = builder_of(state, codec="host")
    auto = builder_of(state, codec="auto")  # CPU tensors: the host codec
    assert isinstance(device.encoder, DeviceEncoder) and not device.encoder.streams
    assert isinstance(host.encoder, HostEncoder) and host.encoder.streams and host.stages
    assert isinstance(auto.encoder, HostEncoder)
    assert not device.stages  # the device encoder codes changes where they are


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_part_is_the_same_bytes_and_one_copy_to_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    state = structure_model(48)
    cuda = {k: v.cuda() for k, v in state.items()}
    host_builder, cuda_builder = builder_of(state), builder_of(cuda)
    structure_step(state)
    for k in cuda:
        cuda[k].copy_(state[k])
    copies = []
    real = encode_device.to_host

    def counted(stream: Any, buffer: torch.Tensor, stats: Any = None) -> torch.Tensor:
        out = real(stream, buffer, stats)
        if buffer.is_cuda:  # the CPU builder's buffer is host memory already
            copies.append(out.is_pinned())
        return out

    monkeypatch.setattr(encode_device, "to_host", counted)
    got = []
    for builder, tensors in ((host_builder, state), (cuda_builder, cuda)):
        captured = builder.compare.collect(tensors, SyncStats(1, "patch"), lambda c: Captured(c.captured_nbytes(), None, c))
        entries = builder.encoder.encode([c.changes for c in captured if c.changes])
        got.append([(e.key, e.encoding, [bytes(w) for _, w in e.buffers]) for e in entries])
    assert got[0] == got[1]
    assert copies == [True]


def test_a_device_coded_builder_calls_no_numba() -> None:
    """In a fresh process, a PatchBuilder with patch.codec: device captures and builds two
    versions (compare and encode) and leaves every numba dispatcher uncompiled, if numba was
    imported at all: its capture does not warm the host codec's kernels either."""
    code = """
import asyncio, torch
from test_compare import structure_model, structure_step
from test_device_build import builder_of
state = structure_model(12, 12_000)
state["steps"] = torch.tensor(3)
builder = builder_of(state, group_numel=2000)
builder.capture(state)
async def main():
    for v in (1, 2):
        structure_step(state)
        state["steps"] += 1
        msg, stats = await builder.message(state, v, v - 1)
        assert msg.tensors and stats.changed_elements
asyncio.run(main())
"""
    run_calling_no_numba(code)
