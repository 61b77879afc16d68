"""A message's device-coded entries staged together, in a few ops a part rather than a few a tensor.

``tensorcodec.decode_blocks`` decodes a message's device-coded entries as one batch a device
(``devicecodec.DecodedBatch``: every change end to end). Staged one by one, each tensor would
still cost a verdict read of its own, a search for its group's cut points, a shift of its
positions and four ops to add its differences: on a GPU, a kernel launch each. Here, a batch
at a time: the verdicts and every group's cut points are read in ONE host sync (the cut
points found by one ``searchsorted`` over the batch's positions made global: each entry's run
placed after the one before it), positions shifted to their tensors' coordinates in one op,
and the differences added a dtype at once. What is left a tensor is reading its old values
at those positions (``read_flat``), and the commit's write; where the fused kernels can
(``receiver/apply/fused.py``: plain contiguous tensors on a GPU, Triton there), those two are one
kernel each for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.codec import devicecodec
from protocol.codec.tensorcodec import DecodedTensor, group_offsets
from protocol.errors import IntegrityError, ProtocolError
from protocol.state import Placed
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span

from . import fused
from .commit import StagedUpdate, Target, read_flat


@dataclass(frozen=True)
class Coded:
    """A decoded device-coded entry, its verdict unread: the tensors its run covers
    (``keys``, one for a lone tensor) and the run's elements (``size``); a span entry's
    ``span`` (its run's element p is at ``span.positions(p)`` in its tensor), else None."""

    decoded: DecodedTensor
    keys: tuple[int, ...]
    size: int
    span: Span | None = None

    @property
    def lo(self) -> int:
        """Where the run starts in its tensor."""
        return 0 if self.span is None else self.span.lo

    @property
    def strided(self) -> bool:
        return self.span is not None and not self.span.contiguous

    @classmethod
    def of(cls, decoded: DecodedTensor, group: tuple[int, ...], span: Span | None, metadata: ModelMetadata) -> Coded:
        if group:
            return cls(decoded, group, int(group_offsets([metadata.shapes[k] for k in group])[-1]))
        if span is not None:
            return cls(decoded, (decoded.key,), span.numel, span)
        shape = metadata.shapes[decoded.key]
        return cls(decoded, (decoded.key,), int(np.prod(shape, dtype=np.int64)))


def stage_coded(coded: Sequence[Coded], targets: list[Target], metadata: ModelMetadata) -> list[list[StagedUpdate]]:
    """Each entry's updates (a group's: one a tensor with changes; a lone tensor's: one),
    once every verdict reads True; ``IntegrityError`` for a payload whose checksum fails,
    else ``ProtocolError`` for any other the decoder refused, naming the first, before
    anything is staged. One host sync a batch (a device)."""
    batches: dict[int, tuple[devicecodec.DecodedBatch, list[int]]] = {}
    for i, c in enumerate(coded):
        verdict = c.decoded.verdict
        if verdict is None or verdict.batch is None:  # refused on the host before decoding: its verdict is False
            _raise(c, intact=bool(verdict.intact) if verdict is not None else True)
        assert verdict is not None and verdict.batch is not None
        batches.setdefault(id(verdict.batch), (verdict.batch, []))[1].append(i)
    out: list[list[StagedUpdate]] = [[] for _ in coded]
    for batch, members in batches.values():
        for i, updates in zip(members, _stage_batch(batch, [coded[i] for i in members], targets, metadata)):
            out[i] = updates
    return out


def _raise(c: Coded, intact: bool) -> None:
    if not intact:
        raise IntegrityError(f"tensor {c.decoded.key}: device payload checksum mismatch")
    raise ProtocolError(f"tensor {c.decoded.key}: device payload refused (block table, widths, sizes, positions or values)")


def _stage_batch(batch: devicecodec.DecodedBatch, coded: list[Coded], targets: list[Target], metadata: ModelMetadata) -> list[list[StagedUpdate]]:
    """``stage_coded`` of the entries of one batch (in the batch's order)."""
    device = batch.flat.device
    nnz = [c.decoded.flat.numel() if c.decoded.flat is not None else 0 for c in coded]
    # Each run's member boundaries, the runs end to end: where each member's changes start
    # in the batch is where its boundary falls among the changes' positions made global.
    bases = np.cumsum([0] + [c.size for c in coded])
    bounds = [bases[j] + group_offsets([metadata.shapes[k] for k in c.keys]) if len(c.keys) > 1 else np.array([bases[j], bases[j + 1]])
              for j, c in enumerate(coded)]
    base_d, nnz_d, bound_d = _host_to(device, [bases[:-1], nnz, np.concatenate(bounds)])
    total = batch.flat.numel()
    shift = torch.repeat_interleave(base_d, nnz_d, output_size=total)
    cuts = torch.searchsorted(batch.flat + shift, bound_d)  # sorted when every verdict is True (else unread)
    # the batch holds exactly these entries (one refused on the host raised before): its verdicts are theirs
    read = torch.cat([batch.intact, batch.ok, cuts]).to("cpu", copy=True).tolist()  # the batch's one host sync
    n = len(coded)
    for j, c in enumerate(coded):
        if not read[n + j]:
            _raise(c, intact=bool(read[j]))
    at = 2 * n
    pieces: list[tuple[int, int, int, int]] = []  # (entry, key, first change, end) in the batch
    offsets: list[int] = []  # what each piece's positions lose: its member's start in the run, less a span's lo
    runs: list[int] = []  # where a strided span is in the batch: each piece's member start, lo, run length and stride
    strided = any(c.strided for c in coded)
    for j, c in enumerate(coded):
        edges = read[at : at + len(c.keys) + 1]
        at += len(c.keys) + 1
        member_starts = bounds[j] - bases[j]
        for m, key in enumerate(c.keys):
            start, end = edges[m], edges[m + 1]
            if end > start or len(c.keys) == 1:
                pieces.append((j, key, start, end))
                offsets.append(int(member_starts[m]) - c.lo)
                if strided:
                    runs += _runs(c, int(member_starts[m]), int(member_starts[m + 1] - member_starts[m]))
    if not pieces:
        return [[] for _ in coded]
    lengths = [end - start for _, _, start, end in pieces]
    # The fused kernels take targets of one element width (and bools alone): a part of an
    # fp8 rollout holds 1-byte weights, 4-byte scales and 2-byte norms, so each width is
    # its own set of launches (a few a width, never one a tensor).
    widths: dict[tuple[int, bool] | None, list[int]] = {}
    for p, (_, key, _, _) in enumerate(pieces):
        target = targets[key]
        width = None if isinstance(target, Placed) else (target.element_size(), target.dtype == torch.bool)
        widths.setdefault(width, []).append(p)
    fusable = [mine for w, mine in widths.items() if w is not None and fused.usable(_tensors(targets, pieces, mine), device)]
    together = [p for mine in fusable for p in mine]
    addresses = fused.table(_tensors(targets, pieces, together))
    offset_d, length_d, address_d, fused_length_d, *runs_d = _host_to(
        device, [offsets, lengths, addresses, [lengths[p] for p in together]] + ([runs] if strided else [])
    )
    covered = sum(lengths)
    first = pieces[0][2]
    if strided:  # positions placed in their spans' runs: a few ops for the batch, none a tensor
        local = _placed(batch.flat[first : first + covered], runs_d[0].view(-1, 4), length_d, covered)
    else:
        local = batch.flat[first : first + covered] - torch.repeat_interleave(offset_d, length_d, output_size=covered)
    diffs = batch.diffs[first : first + covered]
    # pieces tile the batch's changes in order (a verdict True says every change lies in its run)
    if len(fusable) == 1 and len(together) == len(pieces):
        return _fused(pieces, local, diffs, first, _tensors(targets, pieces, together), addresses, address_d, length_d, len(coded))
    out: list[list[StagedUpdate]] = [[] for _ in coded]
    at = 0  # where each width's pieces start in the fused table
    for mine in fusable:
        sub, sub_local, sub_diffs = _subset(pieces, mine, local, diffs, first)
        table = slice(at, at + len(mine))
        staged = _fused(sub, sub_local, sub_diffs, 0, _tensors(targets, pieces, mine), addresses[table], address_d[table],
                        fused_length_d[table], len(coded))
        at += len(mine)
        for j, updates in enumerate(staged):
            out[j] += updates
    taken = set(together)
    rest = [p for p in range(len(pieces)) if p not in taken]
    if rest:
        sub, sub_local, sub_diffs = _subset(pieces, rest, local, diffs, first)
        for j, updates in enumerate(_with_values(sub, sub_local, sub_diffs, 0, targets, len(coded))):
            out[j] += updates
    return out


def _runs(c: Coded, start: int, size: int) -> list[int]:
    """A piece's member start in its run, where the run starts in its tensor and the run's
    runs (length and stride): a strided span's, else one run of the member's ``size``."""
    if c.span is not None and c.strided:
        return [start, c.span.lo, c.span.length, c.span.stride]
    return [start, c.lo, max(size, 1), max(size, 1)]


def _placed(flat: torch.Tensor, runs: torch.Tensor, length_d: torch.Tensor, covered: int) -> torch.Tensor:
    """The batch's positions (``flat``: each piece's in its entry's run) in their tensors'
    coordinates, as ``Span.positions`` places them, every piece at once: ``runs`` a piece's
    (member start, lo, run length, stride), ``length_d`` each piece's changes."""
    each = torch.repeat_interleave(runs, length_d, dim=0, output_size=covered)
    rel = flat - each[:, 0]
    row = torch.div(rel, each[:, 2], rounding_mode="floor")
    return each[:, 1] + row * each[:, 3] + (rel - row * each[:, 2])


def _tensors(targets: list[Target], pieces: list[tuple[int, int, int, int]], chosen: list[int]) -> list[torch.Tensor]:
    """The targets of the ``chosen`` pieces (plain tensors: the fused kernels' table)."""
    return [t for t in (targets[pieces[p][1]] for p in chosen) if isinstance(t, torch.Tensor)]


def _subset(
    pieces: list[tuple[int, int, int, int]], chosen: list[int], local: torch.Tensor, diffs: torch.Tensor, first: int
) -> tuple[list[tuple[int, int, int, int]], torch.Tensor, torch.Tensor]:
    """The ``chosen`` pieces with their positions and differences end to end (one ``cat``
    each), the pieces re-based to start at 0."""
    spans = [(pieces[p][2] - first, pieces[p][3] - first) for p in chosen]
    sub, at = [], 0
    for p, (start, end) in zip(chosen, spans):
        sub.append((pieces[p][0], pieces[p][1], at, at + end - start))
        at += end - start
    return sub, torch.cat([local[a:b] for a, b in spans]), torch.cat([diffs[a:b] for a, b in spans])


def _fused(
    pieces: list[tuple[int, int, int, int]], local: torch.Tensor, diffs: torch.Tensor, first: int, owners: list[torch.Tensor],
    addresses: list[int], address_d: torch.Tensor, length_d: torch.Tensor, entries: int,
) -> list[list[StagedUpdate]]:
    """Every piece's new values in one kernel (``fused.gather_add``), and the write the commit
    makes of them all in one more (``fused.FusedWrite``)."""
    owner = torch.repeat_interleave(torch.arange(len(pieces), device=local.device), length_d, output_size=local.numel())
    bits = fused.gather_add(address_d, owner, local, diffs, owners[0].dtype)
    write = fused.FusedWrite(tuple(key for _, key, _, _ in pieces), tuple(addresses), address_d, owner, local, bits)
    out: list[list[StagedUpdate]] = [[] for _ in range(entries)]
    for (j, key, start, end), target in zip(pieces, owners):
        at = slice(start - first, end - first)
        out[j].append(StagedUpdate(key, local[at], bits[at].view(target.dtype), write))
    return out


def _with_values(
    pieces: list[tuple[int, int, int, int]], local: torch.Tensor, diffs: torch.Tensor, first: int, targets: list[Target], entries: int
) -> list[list[StagedUpdate]]:
    """Each piece's new values (old + differences), a dtype at once; its old values read a piece."""
    olds = []
    for _, key, start, end in pieces:
        target, flat = targets[key], local[start - first : end - first]
        olds.append(target.read(flat) if isinstance(target, Placed) else read_flat(target, flat))
    new: list[torch.Tensor | None] = [None] * len(pieces)
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for p, old in enumerate(olds):
        kinds.setdefault((old.device, old.dtype), []).append(p)
    for (dev, _), mine in kinds.items():
        old = olds[mine[0]] if len(mine) == 1 else torch.cat([olds[p] for p in mine])
        if len(mine) == len(pieces):
            d = diffs
        else:
            d = torch.cat([diffs[pieces[p][2] - first : pieces[p][3] - first] for p in mine])
        values = devicecodec.apply_differences(old, d.to(dev, non_blocking=True))
        for p, v in zip(mine, values.split([olds[p].numel() for p in mine])):
            new[p] = v
    out: list[list[StagedUpdate]] = [[] for _ in range(entries)]
    for (j, key, start, end), piece in zip(pieces, new):
        assert piece is not None
        target = targets[key]
        flat = local[start - first : end - first].to(target.device, non_blocking=True)
        out[j].append(StagedUpdate(key, flat, piece.to(target.device, non_blocking=True)))
    return out


def _host_to(device: torch.device, arrays: Sequence[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
    """Host int64 arrays on ``device`` in one copy, not waited for (``devicecodec``'s ``_ship``)."""
    return devicecodec.ship([np.asarray(a, dtype=np.int64) for a in arrays], device)
