"""The compare: model against snapshot, the changes collected and the snapshot moved on.

Two implementations behind one interface (DESIGN.md, *Two codecs, one pipeline*): the host
compare (``compare_host``: numba kernels, tensor by tensor) and the device compare
(``compare_device``: batched torch ops in runs, a bounded number of host syncs per run).
Both hand the encoder the same ``Changes`` and leave the same snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import torch

from protocol.codec.tensorcodec import PatchOptions
from protocol.errors import ConfigError

from ..plan import SyncPlan
from ..stats import SyncStats
from .changes import Changes, Group
from .compare_device import DeviceCompare
from .compare_host import HostCompare
from .snapshot import Snapshot

T = TypeVar("T")
KINDS = ("auto", "host", "device")


class Compare(Protocol):
    """What a patch builder asks of a compare. One call at a time, on any one thread."""

    snapshot: Snapshot

    def capture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the snapshot of the tracked tensors: what the receivers hold after the bootstrap."""

    def recapture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the snapshot anew, into the same buffers (what resynced receivers will hold)."""

    def collect(self, tensors: Mapping[str, torch.Tensor], stats: SyncStats, emit: Callable[[Changes], T]) -> list[T]:
        """Each changed tensor's (or group's) ``Changes``, through ``emit`` as collected; the
        snapshot holds ``tensors`` (at the receivers' dtypes) once it returns, stored or
        being written back (``Snapshot.wait_writeback``)."""
        ...


def choose(kind: str, on_cuda: bool) -> str:
    """``host`` or ``device`` for ``patch.codec`` (``kind``): ``auto`` compares on the device
    where the tracked tensors live on CUDA (``on_cuda``), else on the host."""
    if kind not in KINDS:
        raise ConfigError(f"patch.codec must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    return "device" if on_cuda else "host"


def make_compare(
    kind: str, plan: SyncPlan, options: PatchOptions, snapshot: Snapshot, groups: Mapping[str, Group], *, stage: bool
) -> HostCompare | DeviceCompare:
    """The compare ``kind`` (see ``choose``) of ``plan``'s tracked tensors. ``stage``: changes
    on a CUDA device go to pinned host memory (the host codec encodes them)."""
    if choose(kind, plan.on_cuda) == "device":
        return DeviceCompare(plan, options, snapshot, groups, stage=stage)
    return HostCompare(plan, options, snapshot, groups, stage=stage)
