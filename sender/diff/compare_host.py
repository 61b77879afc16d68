"""The host compare: each tracked tensor compared with its snapshot on its own.

Plain CPU tensors take the fused numba kernels (``fastdiff``: one read of the state and
the snapshot, the changes collected while they are in cache); other dtype pairs, CUDA
tensors and FSDP2 DTensors (gathered one at a time) take torch ops, one tensor after
another. A host snapshot that may go whole is lent to the version rather than copied
(``LentSnapshots``). The device compare (``compare_device``) falls back to this one for
what it cannot compare in runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from protocol.codec.tensorcodec import PatchOptions
from protocol.errors import MetadataMismatchError
from protocol.lazy import lazy_module
from protocol.state import is_dtensor, materialize
from protocol.wire.dtypes import bits_dtype

from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import record
from .changes import Changes, DenseRule, Group, KeyInfo, dense_rule, sample_step, wrapped_differences
from .copies import LentSnapshots
from .snapshot import Snapshot

if TYPE_CHECKING:
    from . import fastdiff
else:  # numba loads on first use (protocol/lazy.py)
    fastdiff = lazy_module("sender.diff.fastdiff")

T = TypeVar("T")


@dataclass
class _Member:
    """A group member compared on its own (not as part of its run): its changes, and its
    snapshot, moved, for the run's whole copy."""

    flat: torch.Tensor
    new: torch.Tensor
    old: torch.Tensor
    snap: torch.Tensor


class HostCompare:
    """Compares tracked tensors one by one (groups of plain CPU tensors as one run) and
    moves the snapshot with them. ``stage``: changes on a CUDA device are copied to pinned
    host memory (the host codec encodes them). ``lend``: a host snapshot that may go whole
    is lent, not copied (off where the snapshot is a view of a larger run)."""

    def __init__(
        self, plan: SyncPlan, options: PatchOptions, snapshot: Snapshot, groups: Mapping[str, Group], *, stage: bool, lend: bool = True,
    ) -> None:
        self.plan = plan
        self.options = options
        self.snapshot = snapshot
        self.stage = stage
        self._lend = lend
        self._keys = {key: KeyInfo.of(plan, options, key) for key in plan.tracked}
        self._groups = dict(groups)
        self._runs: dict[Group, torch.Tensor] = {}  # each captured group's snapshot, its keys' end to end
        # changes in each key's (or run's, by its first key) last compare: the next one collects as it compares
        self._expect: dict[str, int] = {}
        self._lent = LentSnapshots()  # host snapshots lent as whole new values, and their spares
        self._largest = 0  # elements of the largest tensor (or run) captured: the kernels' positions dtype

    def capture(self, tensors: Mapping[str, torch.Tensor], keys: Sequence[str] | None = None) -> None:
        """Take the snapshot of ``keys`` (default: every tracked key): what the receivers
        hold after the bootstrap; a group is captured as one run when all of it is in ``keys``."""
        self.snapshot.place({k: tensors[k] for k in self.plan.tracked}, self.plan.receiver_dtype)  # auto: where it goes
        keys = self.plan.tracked if keys is None else keys
        chosen = set(keys)
        for key in keys:
            if key not in self._groups:
                self.snapshot.capture(key, self._receiver_copy(tensors, key))
        for group in dict.fromkeys(self._groups[k] for k in keys if k in self._groups):
            if chosen.issuperset(group.keys):
                self._runs[group] = self.snapshot.capture_run(group.keys, [self._receiver_copy(tensors, k) for k in group.keys])
            else:
                for k in group.keys:
                    if k in chosen:
                        self.snapshot.capture(k, self._receiver_copy(tensors, k))
        if keys:  # JIT now (or load from numba's cache), rather than in the first sync
            self._largest = max(self._largest, *(tensors[k].numel() for k in keys), *(run.numel() for run in self._runs.values()))
            self.warm_up({(tensors[k].dtype, self.plan.receiver_dtype(k)) for k in keys})

    def warm_up(self, pairs: Iterable[tuple[torch.dtype, torch.dtype]]) -> None:
        """Compile the fused kernels for these (model, receiver) dtype pairs now, not in the
        first sync (for tensors up to the largest captured: ``fastdiff.signatures``)."""
        fastdiff.warm_up(set(pairs), self._largest)

    def _receiver_copy(self, tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
        return materialize(tensors[key]).detach().to(self.plan.receiver_dtype(key))

    def recapture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The snapshot anew from ``tensors``, in place (a held loan is copied on write first)."""
        stored = self.snapshot.tensors
        for key in self.plan.tracked:
            target = stored[key] = self._lent.writable(key, stored[key])
            target.copy_(self._receiver_copy(tensors, key))
        self._expect.clear()

    def collect(
        self, tensors: Mapping[str, torch.Tensor], stats: SyncStats, emit: Callable[[Changes], T], keys: Sequence[str] | None = None
    ) -> list[T]:
        """Each changed tensor's (or group's) ``Changes`` among ``keys`` (default: all
        tracked; a group's keys all or none), passed through ``emit`` as it is collected."""
        keys = self.plan.tracked if keys is None else keys
        captured: list[T] = []
        one_by_one: set[Group] = set()
        for group in dict.fromkeys(self._groups[k] for k in keys if k in self._groups):
            if self._compares_whole(group, tensors):
                item = self._run_diff(group, tensors, stats)
                if item is not None:
                    captured.append(emit(item))
            else:
                one_by_one.add(group)  # one by one, gathered into one run after the last
        # The rest in ``keys`` order: DTensors are gathered in this order, which every rank of
        # a sharded trainer follows (``sender.sharded.sync``): a group's members keep their places.
        alone = [k for k in keys if k not in self._groups or self._groups[k] in one_by_one]
        members: dict[Group, list[_Member]] = {}
        fetched = self._fetch(alone[0], tensors) if alone else None
        for i, key in enumerate(alone):
            assert fetched is not None
            working, event = fetched
            if i + 1 < len(alone):  # prefetch the next snapshot while this one is compared
                fetched = self._fetch(alone[i + 1], tensors)
            cur = materialize(tensors[key]).detach()
            snap = working if event is None else self.snapshot.stream(cur.device).use(working, event)
            member_of = self._groups.get(key)
            item = None
            if member_of is None:
                item = self._diff(key, cur, snap, stats)
            else:
                _, flat, new, old = self._compare(key, cur, snap, stats, 1.0)  # a member never goes whole alone
                assert flat is not None and new is not None and old is not None
                members.setdefault(member_of, []).append(_Member(flat, new, old, snap))
                if key == member_of.keys[-1]:
                    item = self._grouped(member_of, members.pop(member_of))
            # A sharded (FSDP2) weight was gathered whole: drop it before the next
            # gather, so no more than one full tensor is alive at a time.
            del cur, snap
            if item is not None:
                captured.append(emit(item))
        return captured

    def _compares_whole(self, group: Group, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``group`` compares as one run: it was captured as one, and its tensors are
        plain CPU tensors of one dtype the fused kernels take against the snapshot on the host."""
        run = self._runs.get(group)
        first = tensors.get(group.keys[0])
        if run is None or run.device.type != "cpu" or first is None:
            return False
        dtype = first.dtype
        for key in group.keys:
            t = tensors.get(key)
            if t is None or t.device.type != "cpu" or t.dtype != dtype or is_dtensor(t) or t.shape != self.snapshot.tensors[key].shape:
                return False  # the one-by-one path says what is wrong, if anything is
        return fastdiff.supported(first, run)

    def _run_diff(self, group: Group, tensors: Mapping[str, torch.Tensor], stats: SyncStats) -> Changes | None:
        """A group's changes by one compare of its tensors end to end against its run."""
        run = self._runs[group]
        cur = torch.cat([tensors[k].detach().reshape(-1) for k in group.keys])
        info = self._keys[group.keys[0]]
        stats.total_elements += group.numel
        stats.dense_bytes += group.numel * info.itemsize
        nnz, flat, new, old = fastdiff.diff_and_update(cur, run, 1.0, self._expect.get(group.keys[0]))
        self._expect[group.keys[0]] = nnz
        if nnz == 0:
            return None
        assert flat is not None
        stats.changed_elements += nnz
        stats.tensors_changed += int(np.count_nonzero(np.diff(np.searchsorted(flat.numpy(), group.offsets))))
        dense = run.clone() if nnz > info.candidate * group.numel else None
        return Changes(group.ordinals[0], (group.numel,), nnz, flat, new, old, dense, [], group.ordinals)

    def _fetch(self, key: str, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if key not in tensors:
            raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
        return self.snapshot.fetch(key, tensors[key].device)

    def _compare(
        self, key: str, cur: torch.Tensor, snap: torch.Tensor, stats: SyncStats, dense_above: float | DenseRule
    ) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``fastdiff.diff_and_update``'s (changed, flat, new, old) for ``key``, however it is compared."""
        info = self._keys[key]
        if cur.shape != snap.shape:
            raise MetadataMismatchError(f"key {key!r} changed shape from {list(snap.shape)} to {list(cur.shape)}")
        numel = cur.numel()
        stats.total_elements += numel
        stats.dense_bytes += numel * info.itemsize
        if snap is self.snapshot.tensors[key] and fastdiff.supported(cur, snap):
            expect = self._expect.get(key)
            if callable(dense_above) and expect is not None and expect > info.candidate * numel:
                # It may go whole again: counted first, not collected in the same pass (which
                # writes 6-12 bytes a change, fresh memory a whole send then throws away).
                expect = None
            nnz, flat, new, old = fastdiff.diff_and_update(cur, snap, dense_above, expect)
            self._expect[key] = nnz
        else:
            nnz, flat, new, old = self._torch_diff(key, info.dtype, cur, snap, dense_above)
        if nnz:
            stats.changed_elements += nnz
            stats.tensors_changed += 1
        return nnz, flat, new, old

    def _diff(self, key: str, cur: torch.Tensor, snap: torch.Tensor, stats: SyncStats) -> Changes | None:
        info = self._keys[key]
        stored = snap is self.snapshot.tensors[key]  # compared (and written) in place on the host
        if stored:
            snap = self.snapshot.tensors[key] = self._lent.writable(key, snap)
        nnz, flat, new, old = self._compare(key, cur, snap, stats, self._dense_rule(info, cur.numel()))
        kept = False
        if nnz > info.candidate * cur.numel():
            # The snapshot now holds exactly the new tensor: lend it, as dense may win.
            lend = self._lend and stored and snap.device.type == "cpu"
            dense = self._lent.lend(key, snap) if lend else snap.clone()
            kept = dense.data_ptr() == snap.data_ptr()
        else:
            dense = None
            self._lent.drop(key)
        if nnz == 0:
            return None
        return self._capture(Changes(info.ordinal, tuple(cur.shape), nnz, flat, new, old, dense, [], kept=kept))

    def _grouped(self, group: Group, members: list[_Member]) -> Changes | None:
        """A group's members' changes (each compared on its own) as one run's."""
        changed = [(offset, m) for offset, m in zip(group.offsets, members) if m.flat.numel()]
        nnz = sum(m.flat.numel() for _, m in changed)
        if nnz == 0:
            return None
        flat = torch.cat([m.flat + offset for offset, m in changed])
        new = torch.cat([m.new for _, m in changed])
        old = torch.cat([m.old for _, m in changed])
        # The snapshots now hold exactly the new tensors: keep them when dense may win.
        dense = torch.cat([m.snap.reshape(-1) for m in members]) if nnz > self._keys[group.keys[0]].candidate * group.numel else None
        return self._capture(Changes(group.ordinals[0], (group.numel,), nnz, flat, new, old, dense, [], group.ordinals))

    def _capture(self, changes: Changes) -> Changes:
        """``changes`` as they are where they are on the host (or encoding runs on the device),
        else copied to pinned host memory behind events."""
        held = changes.flat if changes.flat is not None else changes.dense
        if held is None or held.device.type == "cpu" or not self.stage:  # nothing to stage
            return changes
        return self._staged(changes)

    def _dense_rule(self, info: KeyInfo, numel: int) -> DenseRule:
        return dense_rule(self.options, info, numel)

    def _torch_diff(
        self, key: str, dtype: torch.dtype, cur: torch.Tensor, snap: torch.Tensor, dense_above: float | DenseRule
    ) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The diff in torch ops (CUDA, dtype pairs the fused kernels lack), with the fused
        kernels' dense rule and sample; commits the snapshot."""
        cast = cur.to(dtype).reshape(-1)
        snap_flat = snap.view(-1)
        bits = bits_dtype(dtype)
        changed = cast.view(bits) != snap_flat.view(bits)
        flat = torch.nonzero(changed).squeeze(1)
        nnz = flat.numel()
        step = sample_step(cast.numel())

        def sample() -> torch.Tensor:
            diffs = wrapped_differences(cast.view(bits)[::step], snap_flat.view(bits)[::step])
            return diffs[diffs != 0]

        whole = dense_above(nnz, sample) if callable(dense_above) else nnz > dense_above * cast.numel()
        if whole:
            self.snapshot.commit(key, snap, None, cast)
            return nnz, None, None, None
        new, old = cast[flat], snap_flat[flat]
        if nnz:
            self.snapshot.commit(key, snap, flat, new)
        return nnz, flat, new, old

    def _staged(self, changes: Changes) -> Changes:
        """``changes`` with their device tensors copied to pinned host memory, behind events:
        on the out stream, after the compare that made them (not behind snapshot fetches)."""
        events: list[torch.cuda.Event] = []
        staged: list[torch.Tensor | None] = []
        held = changes.flat if changes.flat is not None else changes.dense
        assert held is not None
        after = record(held.device)  # the compare's work that made them: the last queued
        for t in (changes.flat, changes.new, changes.old, changes.dense):
            if t is None:
                staged.append(t)
                continue
            host, event = self.snapshot.stream(t.device).to_host(t, after=after)
            staged.append(host)
            if event is not None:
                events.append(event)
        flat, new, old, dense = staged
        return replace(changes, flat=flat, new=new, old=old, dense=dense, events=events)
