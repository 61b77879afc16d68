"""Asynchronous copies between host and CUDA device, and the same calls as plain copies on CPU.

One code path serves both: on CPU every "async" copy is an ordinary one and every event
is already complete (``None``), so the CPU tests exercise the same build loop the GPU runs.

Ordering is by events, never by a whole stream: a copy waits for an event recorded right
after the work that produced what it copies, and a compare on its own thread waits for the
``Mark`` its ``sync()`` recorded on the caller's streams (a trainer may step on a side stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from protocol.timing import DeviceSpan


def cuda_present() -> bool:
    return torch.cuda.is_available()


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like ``t``, pinned when CUDA is present (fast async copies)."""
    return host_empty(t.shape, t.dtype)


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor, pinned when CUDA is present (fast async copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=cuda_present())


def host_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor, pinned when CUDA is present."""
    return torch.zeros(shape, dtype=dtype, pin_memory=cuda_present())


def record(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on this thread's current stream of ``device``
    (None on CPU, where that work is done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait(device: torch.device, event: torch.cuda.Event | None) -> None:
    """Make this thread's current stream of ``device`` wait for ``event`` (None: for nothing)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


@dataclass(frozen=True)
class Mark:
    """Where the current streams of the caller of ``sync()`` stood when it was called: the
    trainer's step is queued there, on whatever stream it chose. The compare runs on a thread
    of its own, whose current stream knows nothing of it: it ``wait``s for this first."""

    events: tuple[tuple[torch.device, torch.cuda.Event | None], ...]

    @classmethod
    def now(cls, tensors: Iterable[torch.Tensor]) -> Mark:
        """An event on this thread's current stream of each device ``tensors`` live on."""
        return cls(tuple((device, record(device)) for device in dict.fromkeys(t.device for t in tensors)))

    def wait(self) -> None:
        """Make this thread's current streams wait for the work marked (a no-op on CPU)."""
        for device, event in self.events:
            wait(device, event)


class CopyStream:
    """Copies between host memory and ``device`` (CUDA) on two streams of its own, or plain
    copies (CPU: no streams). ``fetch`` carries the snapshot's copies to the device and its
    write-backs, in order; ``out`` the changes and parts leaving for the host, so neither
    kind ever queues behind the other. Each copy waits only for the event of the work that
    produced its source (``after``; by default one recorded on the current stream at the call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.fetch = torch.cuda.Stream(device) if cuda else None
        self.out = torch.cuda.Stream(device) if cuda else None

    def to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``src`` to this device on the fetch stream; wait with ``use``."""
        if src.device == self.device:
            return src, None
        if self.fetch is None:
            return src.to(self.device), None
        with torch.cuda.stream(self.fetch):
            dst = src.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.fetch)
        return dst, event

    def use(self, t: torch.Tensor, event: torch.cuda.Event | None) -> torch.Tensor:
        """Make the current stream wait for ``t``'s copy before touching it."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            t.record_stream(current)  # allocated on the fetch stream, used on this one
        return t

    def to_host(
        self, src: torch.Tensor, dst: torch.Tensor | None = None, span: DeviceSpan | None = None,
        after: torch.cuda.Event | None = None,
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy ``src`` into (pinned) host memory on the out stream, once ``after`` (the work
        that produced it) is done (``span``: timed on that stream, the copy alone)."""
        if src.device.type == "cpu":
            if dst is None:
                return src, None
            dst.copy_(src)
            return dst, None
        assert self.out is not None
        dst = host_empty_like(src) if dst is None else dst
        return dst, _copied(self.out, [src], [dst], after, span)

    def to_host_all(
        self, srcs: list[torch.Tensor], after: torch.cuda.Event | None = None
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """``to_host`` of several tensors behind one event (CPU, or none: the tensors themselves)."""
        if self.out is None or not srcs:
            return srcs, None
        hosts = [host_empty_like(src) for src in srcs]
        return hosts, _copied(self.out, srcs, hosts, after)

    def write_back(
        self, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy ``src`` (a fetched snapshot, moved on) into ``dst``, its host snapshot, on the
        fetch stream: the next fetch of it comes after (None: copied already, on CPU)."""
        if src.device.type == "cpu" or self.fetch is None:
            dst.copy_(src)
            return None
        return _copied(self.fetch, [src], [dst], after)


def _copied(
    stream: torch.cuda.Stream, srcs: list[torch.Tensor], dsts: list[torch.Tensor], after: torch.cuda.Event | None,
    span: DeviceSpan | None = None,
) -> torch.cuda.Event:
    """``srcs`` copied into ``dsts`` on ``stream`` once ``after`` is done (None: the current
    stream's work so far), behind the event returned; the sources kept alive until then."""
    waited = after if after is not None else record(srcs[0].device)
    assert waited is not None  # srcs are on a CUDA device
    stream.wait_event(waited)
    with torch.cuda.stream(stream):
        with span or contextlib.nullcontext():
            for src, dst in zip(srcs, dsts):
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    for src in srcs:
        src.record_stream(stream)  # made on another stream: its memory is not reused before this copy
    return event
