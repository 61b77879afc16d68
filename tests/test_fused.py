"""The fused kernels (receiver/apply/fused.py) in Triton's interpreter, on CPU tensors.

``gather_add`` gives ``devicecodec.apply_differences``'s bits for every dtype a receiver
holds (wrapping at the width, a bool kept 0 or 1), across many tensors at once; ``scatter``
writes exactly the changed positions; the commit writes a whole batch in one launch, falls
back to one write a tensor when a tensor moved or only part of the batch is committed; and
what the kernels cannot address (engine-held tensors, non-contiguous ones) takes the torch
ops, and a message of several element widths (an fp8 rollout's) is staged as a batch a width.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_device_codec import bits
from test_stage_device import CPU, coded_message, decoded_of

from protocol.codec import devicecodec
from protocol.state import Placed
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span
from receiver.apply import fused
from receiver.apply.commit import commit
from receiver.apply.stage_device import Coded, stage_coded

pytest.importorskip("triton")

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn)


@pytest.fixture(autouse=True)
def interpreted() -> Iterator[None]:
    fused.interpret(True)
    yield
    fused.interpret(False)


def tensors_of(dtype: torch.dtype, count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        raw = torch.randint(-(2**62), 2**62, (7 + 13 * i,), generator=gen, dtype=torch.int64)
        out.append((raw & 1).to(torch.bool) if dtype == torch.bool else raw.view(torch.uint8)[: raw.numel() * dtype.itemsize].view(dtype).clone())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_add_and_scatter_across_tensors_bit_exact(dtype: torch.dtype) -> None:
    targets = tensors_of(dtype, 5, 3)
    gen = torch.Generator().manual_seed(4)
    flats = [torch.randperm(t.numel(), generator=gen)[: max(1, t.numel() // 3)].sort().values for t in targets]
    diffs = [torch.randint(-(2**63), 2**63 - 1, f.shape, generator=gen, dtype=torch.int64) for f in flats]
    owner = torch.cat([torch.full((f.numel(),), i) for i, f in enumerate(flats)])
    table = torch.tensor(fused.table(targets), dtype=torch.int64)
    new = fused.gather_add(table, owner, torch.cat(flats), torch.cat(diffs), dtype)
    want = torch.cat([devicecodec.apply_differences(t.reshape(-1)[f], d) for t, f, d in zip(targets, flats, diffs)])
    assert torch.equal(bits(new), bits(want))
    expected = [t.clone() for t in targets]
    for e, f, piece in zip(expected, flats, want.split([f.numel() for f in flats])):
        e.view(-1)[f] = piece
    fused.scatter(table, owner, torch.cat(flats), new)
    assert all(torch.equal(bits(t), bits(e)) for t, e in zip(targets, expected))


def staged_batch(seed: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list, ModelMetadata]:
    """A bf16 model of lone tensors, groups and spans and its next version, staged as one batch."""
    gen = torch.Generator().manual_seed(seed)
    old = {f"t{i}": (torch.randn(5 + i, 11, generator=gen) * 3).to(torch.bfloat16) for i in range(9)}
    new = {k: torch.where(torch.rand(v.shape, generator=gen) < 0.2, v.float() * 1.25 + 0.5, v.float()).to(torch.bfloat16) for k, v in old.items()}
    groups = [(), (1, 2, 3), (), (), ()]
    spans: list[Span | None] = [None, None, Span.range(3, 40), None, Span.range(0, 20)]
    # lone t0; a group t1..t3; span of t4; lone t5; span of t6 (t7, t8 unchanged)
    for k, span in (("t4", (3, 40)), ("t6", (0, 20))):
        keep = old[k].reshape(-1).clone()
        keep[span[0] : span[1]] = new[k].reshape(-1)[span[0] : span[1]]
        new[k] = keep.view(old[k].shape)
    new["t7"], new["t8"] = old["t7"].clone(), old["t8"].clone()
    metadata = ModelMetadata.of(old)
    specs, frames, places = coded_message(old, new, groups, spans)
    return old, new, [(d, p) for d, p in zip(decoded_of(specs, frames, places), places)], metadata


def stage(model: dict[str, torch.Tensor], decoded: list, metadata: ModelMetadata) -> list:
    coded = [Coded.of(d, group, span, metadata) for d, (group, _, _, span) in decoded]
    return [u for us in stage_coded(coded, list(model.values()), metadata) for u in us]


def test_a_batch_is_one_gather_and_one_scatter() -> None:
    old, new, decoded, metadata = staged_batch()
    model = {k: v.clone() for k, v in old.items()}
    before = fused.LAUNCHES.copy()
    updates = stage(model, decoded, metadata)
    assert len(updates) >= 6 and all(u.batch is not None and u.batch is updates[0].batch for u in updates)
    commit(list(model.values()), updates, {})
    assert fused.LAUNCHES - before == {"gather_add": 1, "scatter": 1}
    assert all(torch.equal(bits(model[k]), bits(new[k])) for k in old)


def test_a_tensor_that_moved_since_staging_is_written_where_it_is_now() -> None:
    old, new, decoded, metadata = staged_batch()
    model = {k: v.clone() for k, v in old.items()}
    updates = stage(model, decoded, metadata)
    stale = model["t0"]
    model["t0"] = stale.clone()  # an engine reallocated it: the staged address is stale
    stale.zero_()
    before = fused.LAUNCHES.copy()
    commit(list(model.values()), updates, {})
    assert (fused.LAUNCHES - before).get("scatter", 0) == 0  # nothing written through a stale address
    assert all(torch.equal(bits(model[k]), bits(new[k])) for k in old) and not stale.any()


def test_part_of_a_batch_is_written_one_by_one() -> None:
    old, new, decoded, metadata = staged_batch()
    model = {k: v.clone() for k, v in old.items()}
    updates = stage(model, decoded, metadata)
    first, rest = updates[:2], updates[2:]
    before = fused.LAUNCHES.copy()
    commit(list(model.values()), first, {})
    commit(list(model.values()), rest, {})
    assert (fused.LAUNCHES - before).get("scatter", 0) == 0
    assert all(torch.equal(bits(model[k]), bits(new[k])) for k in old)


def test_what_the_kernels_cannot_address_takes_the_torch_ops() -> None:
    plain = torch.zeros(8, dtype=torch.bfloat16)
    assert fused.usable([plain, torch.zeros(3, dtype=torch.float16)], CPU)
    assert not fused.usable([plain, torch.zeros(3, dtype=torch.float32)], CPU)  # two widths
    assert not fused.usable([plain, torch.zeros(4, 4, dtype=torch.bfloat16).t()], CPU)  # not contiguous
    assert not fused.usable([plain, Placed.__new__(Placed)], CPU)  # an engine's scattered tensor
    fused.interpret(False)
    assert not fused.usable([plain], CPU)  # CPU tensors take the torch ops unless interpreting


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_the_compiled_kernels_give_the_torch_ops_bits(dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    targets = [t.to(cuda) for t in tensors_of(dtype, 6, 8)]
    assert fused.usable(targets, cuda)
    gen = torch.Generator().manual_seed(9)
    flats = [torch.randperm(t.numel(), generator=gen)[: max(1, t.numel() // 4)].sort().values.to(cuda) for t in targets]
    diffs = [torch.randint(-(2**40), 2**40, f.shape, generator=gen, dtype=torch.int64).to(cuda) for f in flats]
    owner = torch.cat([torch.full((f.numel(),), i, device=cuda) for i, f in enumerate(flats)])
    table = torch.tensor(fused.table(targets), dtype=torch.int64, device=cuda)
    new = fused.gather_add(table, owner, torch.cat(flats), torch.cat(diffs), dtype)
    want = torch.cat([devicecodec.apply_differences(t.reshape(-1)[f], d) for t, f, d in zip(targets, flats, diffs)])
    assert torch.equal(bits(new.cpu()), bits(want.cpu()))
    fused.scatter(table, owner, torch.cat(flats), new)
    for t, f, piece in zip(targets, flats, want.split([f.numel() for f in flats])):
        assert torch.equal(bits(t.reshape(-1)[f].cpu()), bits(piece.cpu()))
