"""Host staging for host-to-device copies: many small host pieces, one copy to the device.

A receiver whose model lives on a GPU gets each part of a patch as frames in host memory.
Copying each device-coded payload to the GPU on its own costs a ``cudaMemcpyAsync`` from
pageable memory per tensor (678 copies and 148 ms of CPU a version on an H200, measured by
``benchmarks/gpu_check.py e2e``: docs/performance.md).
``StagingPool.stage`` gathers a part's pieces instead into one host buffer, with one host
copy a piece, and moves the buffer with one ``host_to_device`` call; the pieces come back
as views of the device copy, each at their own dtype.

The host buffer is reused across parts, one per device, grown when a part does not fit.
Where CUDA is available it is pinned memory, so the copy is asynchronous: a CUDA event is
recorded after it, and the buffer is written again only once that event has passed. On a
machine without CUDA nothing is pinned, and there is nothing to wait for.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protocol.errors import ConfigError
from protocol.timing import DeviceSpan

ALIGN = 64  # every piece starts at a multiple of this in the buffer: any dtype's view of it is aligned
GROW_GRANULE = 1 << 20  # a buffer grows to at least twice its size, rounded up to this

_DTYPES = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one host-to-device transfer of a staged part: a new tensor on ``device``.

    Asynchronous from pinned memory on CUDA (the caller records an event after it). On a
    CPU device it is a plain copy, so a buffer reused afterwards never shows through the
    result (tests run the CUDA path's structure on CPU tensors this way). Named, and looked
    up as a module global on every call, so that a test can count the transfers."""
    return host.to(device, non_blocking=True, copy=True)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class _Slot:
    """A device's host buffer and the event after the last copy out of it (CUDA only)."""

    host: torch.Tensor
    pinned: bool
    copied: Any = None  # torch.cuda.Event, recorded after the last host_to_device from ``host``


class StagingPool:
    """Reused host buffers, one per device, for ``stage``.

    ``pin`` (default: whether CUDA is available) allocates a CUDA device's in pinned memory.
    ``cpu_too`` stages pieces bound for a CPU device as well (``stages``): a receiver never
    needs that, since a CPU target decodes straight from its frames, but it lets a test run
    the path a GPU takes on CPU tensors. Thread-safe: ``stage`` holds a lock while it fills
    the buffer and starts the copy, so two callers never write one buffer at once."""

    def __init__(self, *, pin: bool | None = None, cpu_too: bool = False) -> None:
        self._pin = pin  # None: asked of torch at the first buffer, not when a receiver is made
        self.cpu_too = cpu_too
        self.allocations = 0  # host buffers allocated so far (a new device, or one grown)
        self._slots: dict[torch.device, _Slot] = {}
        self._lock = threading.Lock()
        self._spans: list[DeviceSpan] = []  # the transfers since ``transfer_seconds`` last read them

    @property
    def pin(self) -> bool:
        """Whether buffers for a CUDA device are pinned (default: whether CUDA is available)."""
        if self._pin is None:
            self._pin = torch.cuda.is_available()
        return self._pin

    def stages(self, device: torch.device) -> bool:
        """Whether pieces bound for ``device`` go through this pool (any device but the CPU,
        unless ``cpu_too``)."""
        return device.type != "cpu" or self.cpu_too

    def buffer(self, device: torch.device) -> torch.Tensor | None:
        """The host buffer held for ``device`` (None before its first part)."""
        slot = self._slots.get(torch.device(device))
        return None if slot is None else slot.host

    def stage(self, device: torch.device, pieces: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """``pieces`` (1-D contiguous host arrays) on ``device`` with one ``host_to_device``
        call: one host copy a piece into the device's buffer, one transfer of the buffer, and
        each piece back as a view of the transferred copy, at its own dtype and length. No
        host synchronisation, except waiting for this buffer's previous copy to finish
        (already done, when the previous part's verdicts were read since)."""
        if not pieces:
            return []
        device = torch.device(device)
        starts, total = [], 0
        for piece in pieces:
            if piece.ndim != 1 or piece.dtype not in _DTYPES:
                raise ConfigError(f"cannot stage a {piece.dtype} array of {piece.ndim} dimensions")
            starts.append(total)
            total = _aligned(total + piece.nbytes)
        with self._lock:
            host = self._take(device, total)
            view = host.numpy()
            for piece, start in zip(pieces, starts):
                view[start : start + piece.nbytes] = piece.view(np.uint8)
            with DeviceSpan(device) as span:
                moved = host_to_device(host[:total], device)
            self._spans.append(span)
            self._copied(device)
        return [moved[start : start + piece.nbytes].view(_DTYPES[piece.dtype]) for piece, start in zip(pieces, starts)]

    def transfer_seconds(self) -> float:
        """The device time of the transfers since the last call (CUDA events, read once
        the transfers are done: after the part's verdicts are read; wall time on CPU)."""
        with self._lock:
            spans, self._spans = self._spans, []
        return sum(span.seconds() for span in spans)

    def clear(self) -> None:
        """Drop every buffer (once their copies have finished)."""
        with self._lock:
            for slot in self._slots.values():
                if slot.copied is not None:
                    slot.copied.synchronize()
            self._slots.clear()

    def _take(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The device's buffer, free to write and of at least ``nbytes``."""
        slot = self._slots.get(device)
        if slot is not None and slot.copied is not None:
            slot.copied.synchronize()  # the previous copy out of it may still be reading it
        if slot is None or slot.host.numel() < nbytes:
            size = nbytes if slot is None else max(nbytes, 2 * slot.host.numel())
            size = -(-size // GROW_GRANULE) * GROW_GRANULE
            pin = device.type == "cuda" and self.pin
            slot = self._slots[device] = _Slot(torch.empty(size, dtype=torch.uint8, pin_memory=pin), pin)
            self.allocations += 1
        return slot.host

    def _copied(self, device: torch.device) -> None:
        """Record that the buffer's copy to ``device`` was started (an event on the stream it runs on)."""
        slot = self._slots[device]
        if slot.pinned:  # else the copy read the buffer before it returned (plain memory, or a CPU device)
            if slot.copied is None:
                slot.copied = torch.cuda.Event()
            slot.copied.record(torch.cuda.current_stream(device))
