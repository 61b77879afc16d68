"""A message's device-coded entries staged together (receiver/apply/stage_device.py).

Lone tensors, groups (one run over several tensors) and spans (a run inside a tensor: a
range, or a block of columns of some rows, its runs end to end), of mixed dtypes, staged
in one batch give what staging each entry alone gives (old + its differences, at its
tensor's positions), bit for bit; one bad payload anywhere raises the
typed error naming it and stages nothing; the host reads the device once a batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_device_codec import bits, bitwise_changes

from benchmarks.opcount import OpCounter
from protocol.codec import devicecodec
from protocol.codec.tensorcodec import BlocksEntry, DecodedTensor, PatchOptions, assemble, decode_blocks, encode_sparse, group_offsets
from protocol.errors import IntegrityError, ProtocolError
from protocol.wire.buffers import Buffer
from protocol.wire.framing import TensorEntry
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span
from receiver.apply import fused
from receiver.apply.commit import StagedUpdate, commit
from receiver.apply.stage_device import Coded, stage_coded

DEVICE = PatchOptions(dense_above=1.0, device_codec=True)
CPU = torch.device("cpu")
DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int32, torch.bool, torch.float8_e4m3fn)  # fp8: an fp8 rollout's weights


def moved(old: torch.Tensor, gen: torch.Generator, share: float) -> torch.Tensor:
    """``old`` with about ``share`` of its elements changed (at least one)."""
    flat = old.reshape(-1)
    picks = torch.rand(flat.numel(), generator=gen) < share
    picks[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = True
    if old.dtype == torch.bool:
        return (flat ^ picks).view(old.shape)
    if old.dtype.is_floating_point:
        return torch.where(picks, flat.float() * 1.5 + 0.25, flat.float()).to(old.dtype).view(old.shape)
    return torch.where(picks, flat + 7, flat).view(old.shape)


def scenario(seed: int, entries: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[tuple[int, ...]], list[Span | None]]:
    """A model (old), its next version (new), and the entries that carry the change: each a
    lone tensor, a group of 2-3 tensors of one dtype, or a span of a tensor (a range, or
    a block of columns of some rows)."""
    gen = torch.Generator().manual_seed(seed)
    old: dict[str, torch.Tensor] = {}
    groups: list[tuple[int, ...]] = []
    spans: list[Span | None] = []
    for _ in range(entries):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=gen))]
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        members = int(torch.randint(2, 4, (1,), generator=gen)) if kind == 1 else 1
        keys = []
        for _ in range(members):
            shape = (int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 70, (1,), generator=gen)))
            base = torch.randn(shape, generator=gen) * 4
            old[f"t{len(old)}"] = base.to(dtype) if dtype.is_floating_point else (base > 0) if dtype == torch.bool else base.to(dtype)
            keys.append(len(old) - 1)
        groups.append(tuple(keys) if members > 1 else ())
        numel = old[f"t{keys[0]}"].numel()
        rows, cols = old[f"t{keys[0]}"].shape
        if kind == 3 and rows > 2 and cols > 1:
            c0 = int(torch.randint(0, cols - 1, (1,), generator=gen))
            width = int(torch.randint(1, cols - c0 + 1, (1,), generator=gen))
            r0 = int(torch.randint(0, rows - 2, (1,), generator=gen))
            spans.append(Span(r0 * cols + c0, width, int(torch.randint(2, rows - r0 + 1, (1,), generator=gen)), cols))
        elif kind >= 2 and numel > 4:
            lo = int(torch.randint(0, numel // 2, (1,), generator=gen))
            spans.append(Span.range(lo, int(torch.randint(lo + 1, numel + 1, (1,), generator=gen))))
        else:
            spans.append(None)
    new = {k: moved(v, gen, 0.05 + 0.3 * (i % 3 == 0)) for i, (k, v) in enumerate(old.items())}
    # a span changes only inside its elements
    index = 0
    for group, span in zip(groups, spans):
        first = group[0] if group else index
        if span is not None:
            k = f"t{first}"
            keep = old[k].reshape(-1).clone()
            inside = span.indices()
            keep[inside] = new[k].reshape(-1)[inside]
            new[k] = keep.view(old[k].shape)
        index = (group[-1] if group else first) + 1
    return old, new, groups, spans


def coded_message(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], groups: list[tuple[int, ...]], spans: list[Span | None]
                  ) -> tuple[list[TensorEntry], list[Buffer], list[tuple[tuple[int, ...], torch.dtype, tuple[int, ...], Span | None]]]:
    """The device-coded entries of the change, as a sender makes them."""
    keys = list(old)
    encoded, places = [], []
    index = 0
    for group, span in zip(groups, spans):
        members = group or (index,)
        index = members[-1] + 1
        o = torch.cat([old[keys[k]].reshape(-1) for k in members])
        n = torch.cat([new[keys[k]].reshape(-1) for k in members])
        if span is not None:
            o, n = span.of(o).reshape(-1), span.of(n).reshape(-1)
        flat, new_at, old_at = bitwise_changes(o, n)
        if not flat.numel():  # a span with nothing changed in it: no entry
            continue
        encoded.append(encode_sparse(members[0], flat, new_at, old_at, (o.numel(),), DEVICE))
        places.append((group, o.dtype, (o.numel(),), span))
    specs, frames = assemble(encoded)
    return specs, frames, places


def decoded_of(specs: list[TensorEntry], frames: list[Buffer], places: list) -> list[DecodedTensor]:
    return decode_blocks([BlocksEntry(spec, shape, dtype, CPU) for spec, (_, dtype, shape, _) in zip(specs, places)], frames)


@pytest.fixture(params=["torch", "fused"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The torch ops, or the fused kernels (``receiver/apply/fused.py``) in Triton's interpreter."""
    if request.param == "fused":
        pytest.importorskip("triton")
        fused.interpret(True)
    yield request.param
    fused.interpret(False)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**31), st.integers(1, 12))
def test_a_batch_stages_every_kind_of_entry_bit_exact(path: str, seed: int, entries: int) -> None:
    old, new, groups, spans = scenario(seed, entries)
    specs, frames, places = coded_message(old, new, groups, spans)
    metadata = ModelMetadata.of(old)
    model = {k: v.clone() for k, v in old.items()}
    targets = list(model.values())
    decoded = decoded_of(specs, frames, places)
    coded = [Coded.of(d, group, span, metadata) for d, (group, _, _, span) in zip(decoded, places)]
    with OpCounter() as reads:
        staged = stage_coded(coded, targets, metadata)
    assert reads.sync_count == (1 if coded else 0), reads.syncs  # verdicts and cut points, at once
    updates = [u for us in staged for u in us]
    assert all(isinstance(u, StagedUpdate) and u.flat is not None for u in updates)
    # the fused kernels take the tensors of one element size and one kind (bool or not) a
    # batch: a message of several widths is a batch a width (an fp8 rollout's 1-byte weights,
    # 4-byte scales and 2-byte norms), never one a tensor; the torch ops without them
    kinds = {(targets[u.ordinal].element_size(), targets[u.ordinal].dtype == torch.bool) for u in updates}
    assert all(u.batch is not None for u in updates) == (path == "fused") or not updates
    batches = {id(u.batch) for u in updates if u.batch is not None}
    assert len(batches) == (len(kinds) if path == "fused" else 0)
    launched = sum(fused.LAUNCHES.values())
    commit(targets, updates, {})
    assert sum(fused.LAUNCHES.values()) - launched == len(batches)  # one scatter a width
    for k in old:
        assert torch.equal(bits(model[k]), bits(new[k])), k


@pytest.mark.parametrize("fault", ["checksum", "structure"])
def test_one_bad_entry_stages_nothing_and_is_named(fault: str) -> None:
    old, new, groups, spans = scenario(4, 8)
    specs, frames, places = coded_message(old, new, groups, spans)
    metadata = ModelMetadata.of(old)
    victim = len(specs) // 2
    at = specs[victim].buffers[0].frame - 1
    payload = torch.frombuffer(bytearray(bytes(frames[at])), dtype=torch.uint8)
    if fault == "checksum":
        payload[-1] ^= 0x40
    else:
        payload[16] ^= 1  # nnz in the header, the checksum made right: the structure gives it away
        devicecodec.seal(payload)
    frames[at] = payload.numpy().tobytes()
    decoded = decoded_of(specs, frames, places)
    coded = [Coded.of(d, group, span, metadata) for d, (group, _, _, span) in zip(decoded, places)]
    model = {k: v.clone() for k, v in old.items()}
    error = IntegrityError if fault == "checksum" else ProtocolError
    with pytest.raises(error, match=f"tensor {specs[victim].key}:"):
        stage_coded(coded, list(model.values()), metadata)
    assert all(torch.equal(bits(model[k]), bits(old[k])) for k in old)


def test_group_cut_points_match_a_search_of_each_run() -> None:
    """Each group member's changes are where ``searchsorted`` of its run's offsets puts them."""
    old, new, groups, spans = scenario(6, 10)
    specs, frames, places = coded_message(old, new, groups, [None] * len(spans))
    metadata = ModelMetadata.of(old)
    decoded = decoded_of(specs, frames, places)
    staged = stage_coded([Coded.of(d, group, None, metadata) for d, (group, _, _, _) in zip(decoded, places)], list(old.values()), metadata)
    assert any(group for group, _, _, _ in places)
    for d, (group, _, _, _), updates in zip(decoded, places, staged):
        if not group:
            continue
        offsets = group_offsets([metadata.shapes[k] for k in group])
        assert d.flat is not None
        cuts = torch.searchsorted(d.flat, torch.from_numpy(offsets)).tolist()
        want = [(k, cuts[m + 1] - cuts[m]) for m, k in enumerate(group) if cuts[m + 1] > cuts[m]]
        assert [(u.ordinal, u.flat.numel()) for u in updates if u.flat is not None] == want
        assert all(int(u.flat.max()) < math.prod(metadata.shapes[u.ordinal]) for u in updates if u.flat is not None)


def staged_ops(blocks: list[Span], tensors: int) -> int:
    """The ops ``stage_coded`` spends on one batch of ``tensors`` bf16 (20, 30) tensors, each
    with an entry of each of ``blocks`` (changes at every third element of the span)."""
    gen = torch.Generator().manual_seed(tensors)
    old = {f"t{i}": torch.randn(20, 30, generator=gen).to(torch.bfloat16) for i in range(tensors)}
    encoded, places = [], []
    for key, t in enumerate(old.values()):
        for span in blocks:
            o = span.of(t.reshape(-1)).reshape(-1)
            flat = torch.arange(0, span.numel, 3)
            encoded.append(encode_sparse(key, flat, (o[flat].float() + 1).to(o.dtype), o[flat], (span.numel,), DEVICE))
            places.append(((), o.dtype, (span.numel,), span))
    specs, frames = assemble(encoded)
    metadata = ModelMetadata.of(old)
    coded = [Coded.of(d, (), span, metadata) for d, (_, _, _, span) in zip(decoded_of(specs, frames, places), places)]
    with OpCounter() as ops:
        stage_coded(coded, list(old.values()), metadata)
    return ops.total


def test_column_blocks_cost_a_few_ops_a_batch_not_a_tensor(path: str) -> None:
    """Strided spans' positions are placed in their runs by a few ops for the whole batch:
    what they cost beyond ranges of as many elements is the same for 3 tensors and for 12."""
    columns = [Span(0, 10, 20, 30), Span(10, 20, 20, 30)]  # every row's columns 0-9 and 10-29
    ranges = [Span.range(0, 200), Span.range(200, 600)]
    extra = [staged_ops(columns, n) - staged_ops(ranges, n) for n in (3, 12)]
    assert extra[0] == extra[1] and 0 < extra[0] <= 10, extra
