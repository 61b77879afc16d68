"""Which versions a generation ran with, when weights may change while it runs.

``Receiver.reading()`` holds one version for a whole generation: its tag is that version.
An engine that lets new versions in between its steps instead (in-flight weight updates:
a long generation goes on across versions rather than hold every commit back) takes the
read side of the receiver's lock one step at a time, through ``Steps``: each step runs on
one whole version, commits happen between steps, and the ``Span`` it fills says which
versions the generation saw (first, last, how many switches), the tag such a sample needs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from .rwlock import ReadWriteLock


@dataclass
class Span:
    """The versions a generation's steps ran with: ``first`` and ``last`` (None before its
    first step), ``steps`` taken and ``switches`` (steps that ran on another version than
    the step before). ``first == last``: one version throughout."""

    first: int | None = None
    last: int | None = None
    steps: int = 0
    switches: int = 0

    def saw(self, version: int | None) -> None:
        if self.steps and version != self.last:
            self.switches += 1
        if not self.steps:
            self.first = version
        self.last = version
        self.steps += 1

    @property
    def mixed(self) -> bool:
        """Its steps ran on more than one version."""
        return self.switches > 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Steps:
    """A generation's steps, each on one whole version (the read side of ``lock``), and the
    ``span`` of versions they ran with.

    Concurrency: steps of one ``Steps`` may run from several tasks or threads (a span is
    one generation's, so they normally run one after another); each holds the read side
    only for itself, so a commit waits for the steps running and the steps after it wait
    for the commit (``ReadWriteLock``).
    """

    def __init__(self, lock: ReadWriteLock, version: Callable[[], int | None]) -> None:
        self._lock, self._version = lock, version
        self.span = Span()

    @contextlib.asynccontextmanager
    async def step(self) -> AsyncIterator[int | None]:
        """One step on an event loop: the version stays put inside; yields it."""
        async with self._lock.reading():
            version = self._version()
            self.span.saw(version)
            yield version

    @contextlib.contextmanager
    def step_sync(self) -> Iterator[int | None]:
        """``step`` for a thread (a generation run by ``asyncio.to_thread``)."""
        with self._lock.reading_sync():
            version = self._version()
            self.span.saw(version)
            yield version

    @contextlib.contextmanager
    def each_forward(self, module: nn.Module) -> Iterator[Span]:
        """Inside, every call of ``module``'s forward is one step (``step_sync``): a Hugging
        Face ``generate`` (run in a thread) lets versions in between tokens and reports the
        span it saw. The forward is restored on exit."""
        own = module.__dict__.get("forward")  # an instance's own forward, if it had one
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.step_sync():
                return original(*args, **kwargs)

        module.forward = forward
        try:
            yield self.span
        finally:
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own
