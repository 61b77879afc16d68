"""Versions as a receiver gets them, for the runtime-map tests (test_layout_tp.py,
test_layout_moe.py): the next checkpoint and its decoded updates (sparse, XOR-coded, whole,
whole inside one run), and what a receiver and the vLLM backend do with them."""

from __future__ import annotations

import random

import torch

from protocol.codec.tensorcodec import DecodedTensor, split_group
from protocol.wire.framing import ValueEncoding
from receiver.apply.commit import StagedUpdate, commit
from receiver.apply.readback import check_written
from receiver.held.layout import Layout


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def version_updates(
    keys: list[str], aliases: dict[int, list[int]], old: dict[str, torch.Tensor], actions: list[str], g: torch.Generator
) -> tuple[dict[str, torch.Tensor], list[DecodedTensor]]:
    """The next checkpoint and the decoded updates that carry it, as a receiver gets them."""
    tied = {a for targets in aliases.values() for a in targets}
    new = dict(old)
    decoded: list[DecodedTensor] = []
    run: list[int] = []
    for ordinal, (key, action) in enumerate(zip(keys, actions)):
        if ordinal in tied or action == "same":
            continue
        t = old[key]
        if action in ("whole", "run"):
            new[key] = torch.randn(t.shape, generator=g).to(t.dtype)
            if action == "run":
                run.append(ordinal)
            else:  # a view into a buffer, past other bytes, as a received frame holds it
                buffer = torch.cat([torch.zeros(3, dtype=t.dtype), new[key].reshape(-1)])
                decoded.append(DecodedTensor(ordinal, None, buffer[3:].view(t.shape), ValueEncoding.RAW))
            continue
        n = t.numel()
        flat = torch.randperm(n, generator=g)[: max(1, n // 7)].sort().values
        values = torch.randn(flat.numel(), generator=g).to(t.dtype)
        changed = t.clone()
        changed.view(-1)[flat] = values
        new[key] = changed
        if action == "xor":
            decoded.append(DecodedTensor(ordinal, flat, bits(t.reshape(-1)[flat]) ^ bits(values), ValueEncoding.XOR))
        else:
            decoded.append(DecodedTensor(ordinal, flat, values, ValueEncoding.RAW))
    if run:
        shapes_ = [tuple(old[keys[o]].shape) for o in run]
        buffer = torch.cat([new[keys[o]].reshape(-1) for o in run])
        whole = DecodedTensor(run[0], None, buffer, ValueEncoding.RAW)
        decoded.extend(split_group(whole, tuple(run), shapes_))
    for canonical, targets in aliases.items():
        for alias in targets:
            new[keys[alias]] = new[keys[canonical]]
    return new, decoded


def apply(layout: Layout, keys: list[str], aliases: dict[int, list[int]], decoded: list[DecodedTensor], check: bool = True) -> None:
    """What a receiver does with a validated version: stage against the targets, commit;
    then what the vLLM engine does before publishing it (``check``): read a sample of each back."""
    targets = [layout.tensors[k] for k in keys]
    staged = [StagedUpdate.stage(d, targets[d.key]) for d in decoded]
    commit(targets, staged, aliases)
    if not check:
        return
    rng = random.Random(len(staged))
    for u in staged:
        for ordinal in (u.ordinal, *aliases.get(u.ordinal, ())):
            check_written(keys[ordinal], targets[ordinal], u, 16, rng)
