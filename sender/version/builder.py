"""What the sender daemon asks of a strategy's builder (``VersionBuilder``), and nothing else.

A builder turns the trainer's model into a version's messages: the patch builder
(``sender/version/patch.py``: the changes since its snapshot, compared on the host or the device,
behind ``sender/diff/compare.py`` and ``sender/version/encode.py``) and the bucket builder
(``sender/version/bucket.py``: every tracked tensor whole). ``Sender`` (``sender/serve/service.py``) knows
them only through this interface, and gets one from ``sender/version/builders.py``
(``tests/test_layering.py`` checks it imports no concrete builder).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from protocol.wire.framing import Message

from ..stats import SyncStats
from ..streams import Mark


class BuildFailed(Exception):
    """Raised by a ``Build``'s ``parts`` when its read failed or was cancelled: the parts
    already out must be abandoned (the read's own error reaches whoever awaited ``read``)."""


@dataclass(frozen=True)
class Build:
    """One version under way.

    ``read()``: until the model has been read whole (the trainer may change it from then
    on), raising what the read raised: what ``Sender.sync`` waits for. ``parts``: the
    version's messages, in order, each as soon as it is built; iterated once (and
    ``aclose``d by whoever stops early). A builder whose ``streams`` is true yields its
    first parts while ``read`` still runs (iterate them in another task); otherwise
    iterate them after ``read`` returned.
    """

    read: Callable[[], Awaitable[None]]
    parts: AsyncGenerator[Message, None]


class VersionBuilder(ABC):
    """A strategy's builder of versions, for the sender daemon. Async throughout; one build
    at a time (the daemon serialises them), and ``close`` once done with it."""

    # Its versions are patches from the version before (streamed: served part by part in the
    # ring while the model is read, the last part once the version has moved), or whole
    # versions (served, all messages at once, before the version moves).
    streams: ClassVar[bool]

    @abstractmethod
    async def hold(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """Take ``tensors``' version as the one at rest (the first receiver's plan is known):
        the snapshot the patches are made from, or the copy the buckets are."""

    @abstractmethod
    def held(self) -> dict[str, torch.Tensor]:
        """The tracked tensors of the version at rest (once ``settled``)."""

    @abstractmethod
    async def settled(self) -> None:
        """Until ``held`` is the current version."""

    @abstractmethod
    def build(
        self, tensors: dict[str, torch.Tensor], version: int, base: int | None, stats: SyncStats, after: Mark | None = None
    ) -> Build:
        """``version`` from ``tensors``, its messages from ``base`` (the version before), its
        figures in ``stats``; the version at rest becomes ``version`` once read. The read
        comes after the work ``after`` marks (``Sender.sync``'s caller's streams; default:
        the current streams at this call), whatever thread it runs on."""

    @property
    def diverged(self) -> bool:
        """The version at rest may differ from what every receiver was sent (a build failed
        midway): the next version must ``recapture`` and resync them all instead."""
        return False

    async def recapture(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """The version at rest anew from ``tensors`` (read after ``after``, as ``build``):
        what receivers resynced to it hold."""
        await self.hold(tensors, after)

    @property
    def backlog_bytes(self) -> int:
        """Bytes read and waiting to be encoded now (0 where nothing waits)."""
        return 0

    async def close(self) -> None:  # noqa: B027 - optional: a builder that owns no thread has nothing to stop
        """Stop every thread and pool the builder owns, once a read under way has ended (a
        thread cannot be interrupted). Idempotent; a build after it raises."""
