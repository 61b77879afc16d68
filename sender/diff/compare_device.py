"""The device compare: tracked tensors compared in runs, with batched torch ops where they live.

Compared one by one on a GPU, each tensor costs a host sync (its ``nonzero``), ~10 launches
and several device-to-host copies (396 syncs and 3,342 launches a version of a 1.78B model on
an H200: ``benchmarks/gpu_check.py e2e``, docs/performance.md). Here the tracked tensors of
one device and receiver dtype share runs (``runs``: one snapshot buffer a run, each key's
snapshot a view of it, each key's count of changes a sum of block counts). A run's version
costs one multi-tensor cast copy into a work buffer (``torch._foreach_copy_``), then for the
whole run: a bitwise compare on integer views (NaN
payloads and -0.0 are changes), block counts summed per key, ONE host sync to read those
counts (a second only when a count leaves a tensor's dense rule to its values: the samples
of those tensors, read at once), one compaction of the changed positions (``nonzero_static``:
its size is known by then, so it waits for nothing), gathers of the new and old values, and
the snapshot moved (the changes scattered in, or the run copied whole when many changed).

The output is the host compare's: the same ``Changes`` (positions ascending per tensor or
group, the same dense decisions), so either codec encodes them. FSDP2 DTensors and groups
whose tensors span devices are compared by ``HostCompare``, one by one, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TypeVar

import torch

from protocol.codec.tensorcodec import DenseCost, PatchOptions
from protocol.errors import MetadataMismatchError
from protocol.state import is_dtensor
from protocol.wire.dtypes import bits_dtype

from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import record
from .changes import Changes, Group, KeyInfo, dense_rule, sample_step, wrapped_differences
from .compare_host import HostCompare
from .runs import Run, lay_out
from .snapshot import Snapshot

T = TypeVar("T")

DENSE_COPY = 8  # from 1/DENSE_COPY of a run's elements changed, its snapshot is copied whole, not scattered into
_NO_DIFFS = torch.zeros(0, dtype=torch.int64)


def _given(sample: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: sample


def _read(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's values on the host: every host sync of this compare is one of these."""
    return t.to("cpu", copy=True)


class DeviceCompare:
    """Compares the tracked tensors in runs (see the module) and moves the snapshot with
    them. ``stage``: changes on a CUDA device are copied to pinned host memory, a run's at
    once behind one event (the host codec encodes them)."""

    def __init__(self, plan: SyncPlan, options: PatchOptions, snapshot: Snapshot, groups: Mapping[str, Group], *, stage: bool) -> None:
        self.plan = plan
        self.options = options
        self.snapshot = snapshot
        self.stage = stage
        self._keys = {key: KeyInfo.of(plan, options, key) for key in plan.tracked}
        self._groups = dict(groups)
        # what cannot be compared in runs (DTensors, groups across devices), and runs whose
        # tensors moved since: compared one by one; never lent (a view of a run cannot be)
        self._host = HostCompare(plan, options, snapshot, groups, stage=stage, lend=False)
        self._alone: list[str] = []
        self._runs: list[Run] = []
        self._work: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, list[Run | None]]] = {}

    # -- the snapshot ---------------------------------------------------------------------
    def capture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the snapshot in runs: what the receivers hold after the bootstrap."""
        self.snapshot.place({k: tensors[k] for k in self.plan.tracked}, self.plan.receiver_dtype)  # auto: where it goes
        self._alone, self._runs = lay_out(self.plan, self._groups, self.snapshot, tensors)
        self._host.capture(tensors, self._alone)
        for run in self._runs:  # one pair of work buffers for each device and dtype, as large as its largest run
            work = self._work.get((run.device, run.dtype))
            if work is None or work[0].numel() < run.numel:
                cur = torch.zeros(run.numel, dtype=run.dtype, device=run.device)
                self._work[(run.device, run.dtype)] = (cur, torch.empty(run.numel, dtype=torch.bool, device=run.device), [None])

    def recapture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The snapshot anew from ``tensors``, in place (each key's view of its run)."""
        self._host.recapture(tensors)

    # -- the compare ----------------------------------------------------------------------
    def collect(self, tensors: Mapping[str, torch.Tensor], stats: SyncStats, emit: Callable[[Changes], T]) -> list[T]:
        """Each changed tensor's (or group's) ``Changes``, passed through ``emit`` run by run."""
        for key in self.plan.tracked:
            if key not in tensors:
                raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
            if tuple(tensors[key].shape) != tuple(self.snapshot.tensors[key].shape):
                shape = list(self.snapshot.tensors[key].shape)
                raise MetadataMismatchError(f"key {key!r} changed shape from {shape} to {list(tensors[key].shape)}")
        if any(is_dtensor(tensors[k]) for k in self.plan.tracked):
            # gathered one by one, in tracked order: the order every rank of a sharded trainer
            # gathers in (``sender.sharded.sync``), which runs by device and dtype would not keep
            return self._host.collect(tensors, stats, emit, self.plan.tracked)
        captured = self._host.collect(tensors, stats, emit, self._alone) if self._alone else []
        with torch.no_grad():
            fetched = self._fetch(self._runs[0]) if self._runs else None
            for i, run in enumerate(self._runs):
                assert fetched is not None
                working, event = fetched
                if i + 1 < len(self._runs):  # the next run's snapshot comes while this one is compared
                    fetched = self._fetch(self._runs[i + 1])
                if not all(t.device == run.device and not is_dtensor(t) for t in (tensors[k] for k in run.keys)):
                    captured.extend(self._host.collect(tensors, stats, emit, run.keys))  # moved: one by one
                    continue
                snap = self.snapshot.stream(run.device).use(working, event)
                captured.extend(emit(c) for c in self._compare(run, tensors, snap, stats))
        return captured

    def _fetch(self, run: Run) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        return self.snapshot.stream(run.device).to_device(run.stored)

    def _compare(self, run: Run, tensors: Mapping[str, torch.Tensor], snap: torch.Tensor, stats: SyncStats) -> list[Changes]:
        """One run's changes; moves ``snap`` (its snapshot, fetched to its device) and stores it."""
        cur, changed = self._load(run, tensors)
        bits = bits_dtype(run.dtype)
        torch.ne(cur.view(bits), snap.view(bits), out=changed)
        counts = _read(run.counts(changed)).tolist()  # the run's one host sync
        whole = self._whole(run, cur, snap, counts)
        dense = [i for i, w in enumerate(whole) if w]
        for start, end in run.spans(dense):  # changes of tensors going whole are not collected
            changed[start:end].zero_()
        kept = sum(n for n, w in zip(counts, whole) if not w)
        flat = new = old = None
        if kept:
            pos = torch.nonzero_static(changed, size=kept).view(-1)
            # gathered and scattered as bits: one path for every dtype (torch has no fp8 index kernels on CPU)
            new, old = cur.view(bits)[pos].view(run.dtype), snap.view(bits)[pos].view(run.dtype)
            flat = pos - run.shifts[torch.searchsorted(run.firsts, pos, right=True) - 1]
            flat = flat if run.wide else flat.to(torch.int32)
        if sum(counts) * DENSE_COPY > run.numel:
            snap.copy_(cur)
        else:
            if new is not None:
                snap.view(bits)[pos] = new.view(bits)
            for start, end in run.spans(dense):
                snap[start:end] = cur[start:end]
        self.snapshot.store(snap, run.stored)
        return self._changes(run, snap, counts, whole, flat, new, old, stats)

    def _load(self, run: Run, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's work buffers, the tensors cast into the first (its gaps zero), the second to compare into."""
        cur, changed, owner = self._work[(run.device, run.dtype)]
        cur, changed = cur[:run.numel], changed[:run.numel]
        if owner[0] is not run:  # another run's tensors may lie where this one's gaps are
            cur.view(bits_dtype(run.dtype)).index_fill_(0, run.gaps, 0)  # zero bits: +0.0 in every float dtype
            owner[0] = run
        # One op for the run (on CUDA one multi-tensor kernel, casting as it copies), not one a
        # tensor. Flat views: a 0-d copy would cast through a scalar path (fp32 NaN -> bf16
        # 0x7FC0, not the 0xFFFF of torch's loops and of ``fastdiff``).
        sources = [tensors[key].reshape(-1) for key in run.keys]
        torch._foreach_copy_([cur[start:start + t.numel()] for t, start in zip(sources, run.starts)], sources)
        return cur, changed

    def _whole(self, run: Run, cur: torch.Tensor, snap: torch.Tensor, counts: list[int]) -> list[bool]:
        """Which keys go whole (a group's member never does alone), by the dense rule every
        compare applies; the samples it needs (a tensor whose count leaves it to its values)
        are taken together, in one more host sync."""
        alone = {u.keys[0] for u in run.units if u.group is None}
        numels = [self.snapshot.tensors[k].numel() for k in run.keys]
        costed = isinstance(self.options.dense_above, DenseCost)
        asked = [i for i, k in enumerate(run.keys) if costed and k in alone and self._keys[k].open(counts[i], numels[i])]
        samples = self._samples(run, cur, snap, asked, numels)
        whole = []
        for i, key in enumerate(run.keys):
            if key not in alone:
                whole.append(False)
                continue
            whole.append(dense_rule(self.options, self._keys[key], numels[i])(counts[i], _given(samples.get(i, _NO_DIFFS))))
        return whole

    def _samples(self, run: Run, cur: torch.Tensor, snap: torch.Tensor, asked: list[int], numels: list[int]) -> dict[int, torch.Tensor]:
        """The dense rule's sample of each key in ``asked``: the nonzero wrapped differences of
        every ``sample_step``-th element, as ``fastdiff.sampled_differences`` takes them, in
        order. Sorted on the device (each key's nonzero ones first, stably) and read with
        their counts in one copy: what the host holds after it are views of it."""
        if not asked:
            return {}
        bits = bits_dtype(run.dtype)
        strided = [slice(run.starts[i], run.starts[i] + numels[i], sample_step(numels[i])) for i in asked]
        new = torch.cat([cur.view(bits)[s] for s in strided])
        old = torch.cat([snap.view(bits)[s] for s in strided])
        diffs = wrapped_differences(new, old)
        owner = torch.cat([torch.full((len(range(s.start, s.stop, s.step)),), j, device=run.device) for j, s in enumerate(strided)])
        zero = diffs == 0
        kept = torch.zeros(len(asked), dtype=torch.int64, device=run.device).index_add_(0, owner, (~zero).long())
        ordered = diffs[torch.argsort(owner * 2 + zero, stable=True)]
        host = _read(torch.cat([kept, ordered]))  # the run's second host sync
        counts = host[:len(asked)].tolist()
        out, at = {}, len(asked)
        for i, s, n in zip(asked, strided, counts):
            out[i] = host[at:at + n]
            at += len(range(s.start, s.stop, s.step))
        return out

    def _changes(
        self, run: Run, snap: torch.Tensor, counts: list[int], whole: list[bool],
        flat: torch.Tensor | None, new: torch.Tensor | None, old: torch.Tensor | None, stats: SyncStats,
    ) -> list[Changes]:
        """Each unit's ``Changes``: views of the run's changes, and whole copies where dense may win."""
        index = {k: i for i, k in enumerate(run.keys)}
        views = {k: snap[s:s + self.snapshot.tensors[k].numel()].view(self.snapshot.tensors[k].shape) for k, s in zip(run.keys, run.starts)}
        made: list[Changes] = []
        at = 0
        for unit in run.units:
            ids = [index[k] for k in unit.keys]
            info = self._keys[unit.keys[0]]
            numel = sum(views[k].numel() for k in unit.keys)
            nnz = sum(counts[i] for i in ids)
            stats.total_elements += numel
            stats.dense_bytes += numel * info.itemsize
            stats.changed_elements += nnz
            stats.tensors_changed += sum(counts[i] > 0 for i in ids)
            if nnz == 0:
                continue
            copy = None
            if nnz > info.candidate * numel:  # the snapshot holds exactly the new values now
                copy = views[unit.keys[0]].clone() if unit.group is None else torch.cat([views[k].reshape(-1) for k in unit.keys])
            if unit.group is None and whole[ids[0]]:
                key = unit.keys[0]
                made.append(Changes(info.ordinal, tuple(views[key].shape), nnz, None, None, None, copy, []))
                continue
            assert flat is not None and new is not None and old is not None
            taken = slice(at, at + nnz)
            at += nnz
            if unit.group is None:
                shape = tuple(views[unit.keys[0]].shape)
                made.append(Changes(info.ordinal, shape, nnz, flat[taken], new[taken], old[taken], copy, []))
            else:
                group = unit.group
                made.append(Changes(group.ordinals[0], (group.numel,), nnz, flat[taken], new[taken], old[taken], copy, [], group.ordinals))
        if self.stage and run.device.type == "cuda":
            made = self._staged(run, made, flat, new, old)
        return made

    def _staged(
        self, run: Run, made: list[Changes], flat: torch.Tensor | None, new: torch.Tensor | None, old: torch.Tensor | None
    ) -> list[Changes]:
        """``made`` as views of pinned host copies of the run's changes, and of its whole
        copies, taken on the out stream behind one event, after the compare that made them."""
        held = [t for t in (flat, new, old) if t is not None] + [c.dense for c in made if c.dense is not None]
        hosts, event = self.snapshot.stream(run.device).to_host_all(held, after=record(run.device))
        events = [] if event is None else [event]
        if flat is not None:
            flat, new, old = hosts[:3]
        copies = iter(hosts[3 if flat is not None else 0:])
        at, staged = 0, []
        for c in made:
            dense = next(copies) if c.dense is not None else None
            if c.flat is None:
                staged.append(replace(c, dense=dense, events=events))
                continue
            assert flat is not None and new is not None and old is not None
            taken = slice(at, at + c.nnz)
            at += c.nnz
            staged.append(replace(c, flat=flat[taken], new=new[taken], old=old[taken], dense=dense, events=events))
        return staged
