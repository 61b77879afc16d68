"""What a compare hands the encoder: each changed tensor's (or group's) ``Changes``, and what
both compares share to reach them: the groups of small tensors, each key's fixed facts, and
the dense rule decided as the changes are counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, pack_entry
from protocol.wire.framing import Encoding, Role, ValueEncoding

from ..plan import SyncPlan

DenseRule = Callable[[int, Callable[[], torch.Tensor]], bool]  # (changed, sample) -> whether it goes whole
SAMPLE = 2048  # elements of a tensor sampled for its dense rule (every ``sample_step``-th)
GROUP_SPAN = 4  # a group holds up to this many times ``patch.group_numel`` elements


@dataclass
class Changes:
    """One tensor's changes, captured: host copies (or copies under way) of the changed
    positions and their new and old values, so encoding can run after the trainer moved on.
    Where it surely goes whole (``PatchOptions.surely_dense``) only the whole new tensor is kept."""

    key: int
    shape: tuple[int, ...]
    nnz: int
    flat: torch.Tensor | None
    new: torch.Tensor | None
    old: torch.Tensor | None
    dense: torch.Tensor | None  # the whole new tensor, kept when a dense send may be cheaper
    events: list[torch.cuda.Event]
    group: tuple[int, ...] = ()  # a group's ordinals: ``key`` is the first, ``shape`` their elements end to end
    kept: bool = False  # ``dense`` is the snapshot, lent (``LentSnapshots``): no memory of its own

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()

    def captured_nbytes(self) -> int:
        """What this capture holds: changed positions and values, or the whole tensor."""
        held = (self.flat, self.new, self.old) if self.flat is not None else (self.dense,)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def pending_nbytes(self) -> int:
        """What holding this capture until it is encoded adds to the sender's memory: its
        changes, and its whole copy unless that is the snapshot, lent (``LentSnapshots``)."""
        held = (self.flat, self.new, self.old, None if self.kept else self.dense)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


@dataclass(frozen=True)
class Group:
    """Small tracked tensors of one receiver dtype, captured as one run of their elements end
    to end (``Changes.group``, ``TensorEntry.group``): an entry costs tens of us a side
    whatever its size, so biases and norms travel together."""

    keys: tuple[str, ...]
    ordinals: tuple[int, ...]
    offsets: tuple[int, ...]  # where each key's elements start in the run, and its end

    @property
    def numel(self) -> int:
        return self.offsets[-1]


def plan_groups(plan: SyncPlan, group_numel: int) -> dict[str, Group]:
    """Each tracked key that travels in a group, with its group: keys of at most
    ``group_numel`` elements, by receiver dtype in tracked order, up to ``GROUP_SPAN``
    times that many elements a group; a key left alone travels on its own."""
    bins: dict[torch.dtype, list[str]] = {}
    closed: list[list[str]] = []
    numel = {k: plan.state.tensors[k].numel() for k in plan.tracked}
    for key in plan.tracked:
        if not 0 < numel[key] <= group_numel:
            continue
        members = bins.setdefault(plan.receiver_dtype(key), [])
        if members and sum(numel[k] for k in members) + numel[key] > GROUP_SPAN * group_numel:
            closed.append(members)
            members = bins[plan.receiver_dtype(key)] = []
        members.append(key)
    groups: dict[str, Group] = {}
    for members in [*closed, *bins.values()]:
        if len(members) < 2:
            continue
        offsets = [0]
        for k in members:
            offsets.append(offsets[-1] + numel[k])
        group = Group(tuple(members), tuple(plan.ordinal(k) for k in members), tuple(offsets))
        groups.update(dict.fromkeys(members, group))
    return groups


@dataclass(frozen=True)
class KeyInfo:
    """What the plan fixes about a tracked key, looked up once rather than per sync."""

    ordinal: int
    dtype: torch.dtype  # the receivers'
    itemsize: int
    candidate: float  # PatchOptions.dense_candidate: from this share a whole copy is kept
    surely: float  # PatchOptions.surely_dense: past this share it goes whole whatever the values

    @classmethod
    def of(cls, plan: SyncPlan, options: PatchOptions, key: str) -> KeyInfo:
        dtype = plan.receiver_dtype(key)
        size = dtype.itemsize
        return cls(plan.ordinal(key), dtype, size, options.dense_candidate(size), options.surely_dense(size))

    def open(self, total: int, numel: int) -> bool:
        """Whether ``total`` changes leave the dense rule to the values (it needs the sample)."""
        return self.candidate * numel < total <= self.surely * numel


def dense_rule(options: PatchOptions, info: KeyInfo, numel: int) -> DenseRule:
    """Whether a tensor with ``total`` changes goes whole, given a function returning its
    sampled differences (taken only where the counts leave it open): decided as the changes
    are counted, so a tensor that goes whole has none collected. Every compare applies it."""

    def goes_dense(total: int, sample: Callable[[], torch.Tensor]) -> bool:
        if total <= info.candidate * numel:
            return False
        if total > info.surely * numel:  # what options.goes_dense says whatever the sample
            return options.goes_dense(total, numel, info.itemsize, None)
        return options.goes_dense(total, numel, info.itemsize, sample())

    return goes_dense


def sample_step(numel: int) -> int:
    """The dense rule's sample of a ``numel``-element tensor: every this-many-th element from the first."""
    return max(1, numel // SAMPLE)


def wrapped_differences(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new - old`` of two bit views (signed integers of one width) wrapping at that width,
    as int64: the ulp differences the value coder codes (``fastdiff.sampled_differences``)."""
    width = 8 * new.element_size()
    d = new.to(torch.int64) - old.to(torch.int64)
    if width < 64:
        half = 1 << (width - 1)
        d = ((d + half) & ((1 << width) - 1)) - half
    return d


def whole(changes: Changes, dense: torch.Tensor, codec: Codec = Codec.NONE) -> EncodedTensor:
    """The entry of a tensor (or group) sent whole: its new values, raw (``codec``: compressed)."""
    buffers = {Role.VALUES: dense.view(changes.shape)}
    return pack_entry(changes.key, Encoding.DENSE, ValueEncoding.RAW, dense.numel(), buffers, codec, changes.group)
