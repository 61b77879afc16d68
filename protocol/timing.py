"""How long queued device work took: CUDA events where the work is asynchronous.

A CUDA copy or kernel returns to the host before it runs, so ``perf_counter`` around it
measures the launch, not the work. ``DeviceSpan`` records an event on the current stream
at enter and at exit and reads their distance once the work is done (``seconds`` waits for
the end event: call it after the caller's own sync point, and it costs nothing more). On
CPU the work is done when the call returns: the span is wall time.
"""

from __future__ import annotations

import time
from types import TracebackType

import torch


class DeviceSpan:
    """The time of the work queued on ``device``'s current stream inside ``with``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._started = 0.0
        self._wall = 0.0

    def __enter__(self) -> DeviceSpan:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
            self._events = (start, end)
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))
        else:
            self._wall = time.perf_counter() - self._started

    def seconds(self) -> float:
        """The span's device time (waits for its end on CUDA)."""
        if self._events is None:
            return self._wall
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
