"""The device compare's layout: tracked tensors of one device and receiver dtype in runs.

A run's snapshot is one buffer, each key's snapshot a view of it. Each key starts a block of
``ALIGN`` elements (zeros between keys), so a mask of changes over the run counts per key as
sums of block counts: a few batched ops, whatever the number of keys. Runs hold at most
``RUN_NUMEL`` elements (a larger tensor runs alone), which bounds the compare's work buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protocol.state import is_dtensor, materialize

from ..plan import SyncPlan
from .changes import Group
from .snapshot import Snapshot

ALIGN = 128  # each key starts a block of this many elements: its count is a sum of block counts
RUN_NUMEL = 1 << 26  # elements a run holds at most (its work buffers: ~3 bytes an element); a larger tensor runs alone
_LANES = 0x00FF00FF00FF00FF


@dataclass(frozen=True)
class Unit:
    """What one ``Changes`` covers: a key alone, or a group (its keys consecutive in the run)."""

    keys: tuple[str, ...]
    group: Group | None


@dataclass
class Run:
    """Units of one device and receiver dtype, laid out in one snapshot buffer."""

    device: torch.device  # where the tensors live, and the run is compared
    dtype: torch.dtype  # the receivers'
    units: tuple[Unit, ...]
    keys: tuple[str, ...]
    starts: tuple[int, ...]  # each key's first element in the run, a multiple of ALIGN
    numel: int  # the run's elements, gaps included: a multiple of ALIGN
    stored: torch.Tensor  # the snapshot's buffer (on the snapshot's device)
    # on ``device``, made once: each key's first block and the run's end (block counts ->
    # key counts), each key's start (changes -> keys), and start less its offset in its unit
    bounds: torch.Tensor
    firsts: torch.Tensor
    shifts: torch.Tensor
    gaps: torch.Tensor  # the elements between keys: zeroed in a shared work buffer another run wrote
    wide: bool  # a unit past int32 positions

    def counts(self, changed: torch.Tensor) -> torch.Tensor:
        """Each key's count of changes in ``changed`` (a mask over the run): block counts
        (bytes summed as words, then their lanes), summed from each key's first block to the next's."""
        words = changed.view(torch.int64).view(-1, ALIGN // 8).sum(1)  # 8 lanes of at most ALIGN/8
        words = (words & _LANES) + ((words >> 8) & _LANES)
        words = words + (words >> 16)
        blocks = (words + (words >> 32)) & 0xFFFF
        return F.pad(blocks.cumsum(0), (1, 0)).index_select(0, self.bounds).diff()

    def spans(self, indices: Sequence[int]) -> Iterator[tuple[int, int]]:
        """The runs of consecutive keys among ``indices`` as element ranges (gaps included)."""
        i = 0
        while i < len(indices):
            j = i
            while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
                j += 1
            last = indices[j]
            yield self.starts[indices[i]], self.starts[last + 1] if last + 1 < len(self.keys) else self.numel
            i = j + 1


def lay_out(
    plan: SyncPlan, groups: Mapping[str, Group], snapshot: Snapshot, tensors: Mapping[str, torch.Tensor]
) -> tuple[list[str], list[Run]]:
    """The keys that cannot be compared in runs (DTensors, groups across devices), and the
    runs of the others, their snapshot captured; groups first, then keys alone, in tracked order."""
    distinct = list(dict.fromkeys(groups[k] for k in plan.tracked if k in groups))
    units = [Unit(g.keys, g) for g in distinct] + [Unit((k,), None) for k in plan.tracked if k not in groups]
    alone: list[str] = []
    bins: dict[tuple[torch.device, torch.dtype], list[Unit]] = {}
    for unit in units:
        held = [tensors[k] for k in unit.keys]
        if any(is_dtensor(t) for t in held) or len({t.device for t in held}) > 1:
            alone.extend(unit.keys)
        else:
            bins.setdefault((held[0].device, plan.receiver_dtype(unit.keys[0])), []).append(unit)
    runs = [_run(snapshot, device, dtype, cut, tensors) for (device, dtype), members in bins.items() for cut in _cut(members, tensors)]
    return alone, runs


def _padded(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def _cut(units: list[Unit], tensors: Mapping[str, torch.Tensor]) -> Iterator[list[Unit]]:
    """``units`` in runs of at most ``RUN_NUMEL`` elements (a larger unit alone)."""
    run: list[Unit] = []
    size = 0
    for unit in units:
        numel = sum(_padded(tensors[k].numel()) for k in unit.keys)
        if run and size + numel > RUN_NUMEL:
            yield run
            run, size = [], 0
        run.append(unit)
        size += numel
    if run:
        yield run


def _run(snapshot: Snapshot, device: torch.device, dtype: torch.dtype, units: list[Unit], tensors: Mapping[str, torch.Tensor]) -> Run:
    keys = tuple(k for u in units for k in u.keys)
    starts, shifts, wide = [], [], False
    at = 0
    for unit in units:
        offset = 0
        for k in unit.keys:
            starts.append(at)
            shifts.append(at - offset)
            n = tensors[k].numel()
            offset += n
            at += _padded(n)
        wide |= offset > torch.iinfo(torch.int32).max
    copies = [materialize(tensors[k]).detach().to(dtype) for k in keys]
    stored = snapshot.capture_run(keys, copies, starts, max(at, ALIGN))
    numel = stored.numel()

    def table(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    bounds = table([s // ALIGN for s in starts] + [numel // ALIGN])
    ends = [s + t.numel() for s, t in zip(starts, copies)]
    gaps = table([i for end, start in zip(ends, [*starts[1:], numel]) for i in range(end, start)])
    return Run(device, dtype, tuple(units), keys, tuple(starts), numel, stored, bounds, table(starts), table(shifts), gaps, wide)
