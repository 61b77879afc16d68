"""The device path under ``torch.use_deterministic_algorithms(True)``.

Deterministic mode makes torch raise for an op with no deterministic implementation on the
tensors' device (2-D ``scatter_add_`` on CUDA is one), and makes others (``index_add_``,
``index_put_``) take slower, ordered paths. The batched codec counts into 1-D bins and adds
disjoint bit fields, so it must run in that mode and give the bytes it gives without it:
encode, decode and stage on CPU here, and on CUDA where there is one
(``benchmarks/device_check.sh`` runs this file).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_device_build import builder_of
from test_device_codec import bits
from test_fused import staged_batch
from test_stage_device import coded_message, decoded_of, scenario

from protocol.codec import devicecodec as dc
from protocol.wire.metadata import ModelMetadata
from receiver.apply import fused
from receiver.apply.commit import commit
from receiver.apply.stage_device import Coded, stage_coded
from sender.stats import SyncStats
from sender.version.patch import Captured

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture
def deterministic() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def coded_buffer(entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    prepared = dc.prepare(*[[e[i].to(device) for e in entries] for i in range(3)])
    sizes = prepared.sizes()
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at = dc.aligned(at + n)
    buffer = torch.zeros(at + dc.slack(), dtype=torch.uint8, device=device)
    prepared.write(buffer, starts)
    return buffer, starts, sizes


@pytest.mark.parametrize("device", DEVICES)
def test_codec_in_deterministic_mode_gives_the_same_bytes(device: str) -> None:
    old, new, _, _ = scenario(21, 10)
    keys = list(old)
    entries = []
    for k in keys:
        o, n = old[k].reshape(-1), new[k].reshape(-1)
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
        flat = torch.nonzero(o.view(width) != n.view(width)).squeeze(1)
        entries.append((flat, n[flat], o[flat]))
    dev = torch.device(device)
    free, _, _ = coded_buffer(entries, dev)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        buffer, starts, sizes = coded_buffer(entries, dev)
        targets = [dc.Target(f.numel(), old[k].numel(), old[k].dtype) for (f, _, _), k in zip(entries, keys)]
        decoded = dc.decode_many(buffer, starts, sizes, targets)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(buffer.cpu(), free.cpu())
    for (flat, n, o), d in zip(entries, decoded):
        assert bool(d.ok) and torch.equal(d.flat.cpu(), flat)
        assert torch.equal(bits(dc.apply_differences(o, d.diffs.cpu())), bits(n))


def test_staging_and_commit_in_deterministic_mode(deterministic: None) -> None:
    old, new, groups, spans = scenario(5, 9)
    specs, frames, places = coded_message(old, new, groups, spans)
    metadata = ModelMetadata.of(old)
    model = {k: v.clone() for k, v in old.items()}
    coded = [Coded.of(d, group, span, metadata) for d, (group, _, _, span) in zip(decoded_of(specs, frames, places), places)]
    commit(list(model.values()), [u for us in stage_coded(coded, list(model.values()), metadata) for u in us], {})
    assert all(torch.equal(bits(model[k]), bits(new[k])) for k in old)


def test_fused_kernels_in_deterministic_mode(deterministic: None) -> None:
    pytest.importorskip("triton")
    fused.interpret(True)
    try:
        old, new, decoded, metadata = staged_batch()
        model = {k: v.clone() for k, v in old.items()}
        coded = [Coded.of(d, group, span, metadata) for d, (group, _, _, span) in decoded]
        updates = [u for us in stage_coded(coded, list(model.values()), metadata) for u in us]
        assert all(u.batch is not None for u in updates)
        commit(list(model.values()), updates, {})
    finally:
        fused.interpret(False)
    assert all(torch.equal(bits(model[k]), bits(new[k])) for k in old)


def test_the_device_compare_and_encoder_in_deterministic_mode(deterministic: None) -> None:
    from test_compare import structure_model, structure_step

    state = structure_model(48)
    builder = builder_of(state)
    structure_step(state)
    captured = builder.compare.collect(state, SyncStats(1, "patch"), lambda c: Captured(c.captured_nbytes(), None, c))
    entries = [e for part in builder.parts(captured) for e in builder.encoder.encode([c.changes for c in part if c.changes is not None])]
    assert entries and sum(len(e.group) or 1 for e in entries) == 48
