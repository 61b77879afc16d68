"""Rollout engines on shared memory: the receiver sidecar writes, the engine's model reads.

The receiver sidecar (``python -m receiver --shm NAME``) creates and owns the region and
writes every version into it under the region's seqlock. The engine process calls
``attach(model, NAME)``: the model's parameters and persistent buffers become views of
the region (same names, shapes, dtypes, checked), so a new version needs no copy on the
engine's side. The engine runs inference under ``with attached.reading():``, which holds
the current version still (the sidecar's next write waits for it); it never sees a
half-applied version; ``reading(max_lag=k, timeout=...)`` also bounds how far behind the
trainer's latest those weights are (``sidecar_lag.py``). ``attached.snapshot()`` is the
lock-free alternative: a copy, retried until no write overlapped it.

Who owns what: the region belongs to the receiver sidecar, which unlinks it when it stops
(and replaces or adopts a leftover when it restarts, see ``engine_region``); engines only
unmap. An engine that outlives its sidecar keeps the last complete version it mapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import torch
from torch import nn

from protocol.host.shm import Heard, Layout, Region

from ..stats import LagWaits
from .sidecar_lag import bounded_reading, check_bound

WriteGuard = Callable[[], AbstractAsyncContextManager[Any]]


class AttachedModel:
    """An engine's module mapped onto a region; see the module doc for the guarantees."""

    def __init__(self, module: nn.Module, region: Region) -> None:
        self.module, self.region = module, region
        self.lag_waits = LagWaits()  # reading(max_lag=...)'s waits for fresher weights

    @property
    def latest(self) -> Heard | None:
        """The trainer's latest version as the sidecar last heard and published it (None:
        this sidecar publishes none); ``reading(max_lag=...)`` bounds by it."""
        return self.region.latest()

    @property
    def version(self) -> int | None:
        """The version the region holds now (it may change unless inside ``reading()``)."""
        return self.region.version

    @property
    def closed(self) -> bool:
        """The sidecar has stopped (or a restarted one replaced the region): no new
        versions will arrive here; attach again to follow the new region."""
        return self.region.closed

    def reading(
        self, timeout: float | None = None, *, max_lag: int | None = None, max_age: float | None = None,
    ) -> contextlib.AbstractContextManager[int | None]:
        """Hold the model's weights still; yields their version. Blocks while a version is
        being written: call it from the inference thread (or ``asyncio.to_thread``).

        ``max_lag=k`` bounds staleness as ``Receiver.reading`` does in process: the weights
        held are at most ``k`` versions behind the trainer's latest, as the sidecar last
        heard it and published it in the region. Further behind, it waits, outside the
        hold so that the sidecar's commits go on, for at most ``timeout`` seconds
        (``WeightSyncTimeout``; None: as long as it takes). What the sidecar heard counts
        only while younger than ``max_age`` seconds (default: the sidecar's, two of its
        heartbeat intervals); older, the engine waits for the sidecar to refresh it
        (``receiver/control/sidecar_lag.py``), so a sidecar stopped or cut off is a timeout,
        never a stale read. A bad ``max_lag`` or ``max_age`` is a ``ConfigError`` (here,
        not on entry); a sidecar that publishes no latest, a ``SharedMemoryError``.
        Without ``max_lag``, ``timeout`` only bounds the wait for a region a crashed
        writer left torn (``SharedMemoryError``).

        Concurrency: any number of threads read at once, each its own bound; the sidecar's
        next write waits for all of them to leave, and new readers wait for it.
        """
        if max_lag is None:
            return self.region.reading(timeout)
        check_bound(max_lag, max_age)
        return bounded_reading(self.region, max_lag, timeout, max_age, self.lag_waits)

    def snapshot(self, timeout: float | None = None) -> tuple[int | None, dict[str, torch.Tensor]]:
        """A consistent copy of the state dict and its version, without blocking the writer."""
        views = self.region.tensors()
        return self.region.read_consistent(lambda: {k: v.clone() for k, v in views.items()}, timeout)

    def close(self) -> None:
        """Unmap the region once the module's tensors are gone (engines never unlink)."""
        self.region.close()


def attach(module: nn.Module, name: str, *, timeout: float | None = 30.0) -> AttachedModel:
    """Map ``module``'s parameters and persistent buffers onto region ``name``.

    Waits up to ``timeout`` seconds for the sidecar to create the region. Raises
    ``MetadataMismatchError`` naming the first key whose name, shape or dtype differs
    (build the engine's model at the receiver's dtype).
    """
    region = Region.attach(name, timeout=timeout)
    try:
        bind(module, region)
    except BaseException:
        region.close()
        raise
    return AttachedModel(module, region)


def bind(module: nn.Module, region: Region) -> None:
    """Make ``module``'s state-dict tensors views of ``region``; checked first, so a
    mismatch leaves the module untouched."""
    state = module.state_dict(keep_vars=True)
    region.layout.check(state)
    views = region.tensors()
    with torch.no_grad():
        for name, t in state.items():
            if isinstance(t, nn.Parameter):
                t.data = views[name]  # keeps the Parameter object: tied weights stay tied
            else:
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, views[name])


def engine_region(module: nn.Module, name: str, max_age: float | None = None) -> Region:
    """Receiver sidecar: create region ``name`` shaped like ``module``, holding its
    weights, and map ``module`` onto it. A leftover region of a killed sidecar with the
    same layout is adopted (engines attached to it stay attached; the sidecar's first
    bootstrap rewrites it); any other leftover is replaced. ``max_age``: this sidecar
    publishes the trainer's latest version (``sidecar_lag.LatestPublisher``), with that
    ``max_age``, and none heard yet; None: it publishes none (what a leftover said is
    withdrawn)."""
    state = module.state_dict()
    region = Region.create(name, Layout.of(state), adopt=True, latest_max_age=max_age)
    if region.version is None and region.seq % 2 == 0:
        with region.writing(None):
            region.load(state)
    bind(module, region)
    return region


def seqlock_writes(region: Region, version: Callable[[], int | None]) -> Callable[[WriteGuard], WriteGuard]:
    """A ``Receiver(wrap_write=...)`` hook: each version's write also holds the region's
    write side (engines wait, ``seq`` odd), and ``version()`` is recorded as it ends."""

    def wrap(inner: WriteGuard) -> WriteGuard:
        @contextlib.asynccontextmanager
        async def guard() -> AsyncIterator[None]:
            async with inner(), region.writing_async(version):
                yield

        return guard

    return wrap
