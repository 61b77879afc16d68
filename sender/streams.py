"""Asynchronous copies between host and CUDA device, and the same calls as plain copies on CPU.

One code path serves both: on CPU every "async" copy is an ordinary one and every event
is already complete, so the CPU tests exercise the same build loop the GPU runs.
"""

from __future__ import annotations

import contextlib

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


class CopyStream:
    """A dedicated copy stream on ``device`` (CUDA), or nothing at all (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``src`` to this device on the copy stream; wait with ``use``."""
        if src.device == self.device:
            return src, None
        if self.stream is None:
            return src.to(self.device), None
        with torch.cuda.stream(self.stream):
            dst = src.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return dst, event

    def use(self, t: torch.Tensor, event: torch.cuda.Event | None) -> torch.Tensor:
        """Make the current stream wait for ``t``'s copy before touching it."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            t.record_stream(current)  # allocated on the copy stream, used on this one
        return t

    def to_host(
        self, src: torch.Tensor, dst: torch.Tensor | None = None, span: DeviceSpan | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy ``src`` into (pinned) host memory after the current stream's work on it
        (``span``: timed on the copy stream, the copy alone)."""
        if src.device.type == "cpu":
            if dst is None:
                return src, None
            dst.copy_(src)
            return dst, None
        assert self.stream is not None
        dst = host_empty_like(src) if dst is None else dst
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            with span or contextlib.nullcontext():
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        src.record_stream(self.stream)
        return dst, event

    def to_host_all(self, srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """``to_host`` of several tensors behind one event (CPU: the tensors themselves)."""
        if self.stream is None:
            return srcs, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            hosts = [host_empty_like(src) for src in srcs]
            for host, src in zip(hosts, srcs):
                host.copy_(src, non_blocking=True)
                src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return hosts, event
