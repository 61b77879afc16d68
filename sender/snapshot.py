"""The sender's snapshot: what the receivers hold, at the receivers' dtypes.

Patches are the bitwise difference between the current weights (cast to the
receiver's dtype) and this snapshot. It lives on ``cuda`` (fastest, costs a model's
worth of GPU memory) or ``cpu`` (pinned when CUDA is present). With a CPU snapshot and
CUDA weights, each tensor's snapshot is prefetched to the GPU on a copy stream, updated
there, and written back to host memory in the background; the next build waits for
those write-backs first.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import torch

from .streams import CopyStream, cuda_present, host_empty, host_empty_like, host_zeros


class Snapshot:
    def __init__(self, device: str) -> None:
        if device == "cuda" and not cuda_present():
            from protocol.errors import ConfigError

            raise ConfigError("snapshot_device: cuda, but torch sees no CUDA device")
        self.device = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        self.tensors: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, CopyStream] = {}
        self._writebacks: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def stream(self, device: torch.device) -> CopyStream:
        if device not in self._streams:
            self._streams[device] = CopyStream(device)
        return self._streams[device]

    def capture(self, key: str, t: torch.Tensor) -> None:
        """Store a copy of ``t`` (already at the receiver's dtype)."""
        if self.device.type == "cpu":
            stored = host_empty_like(t)
            stored.copy_(t)
        else:
            stored = t.to(self.device, copy=True).contiguous()
        self.tensors[key] = stored

    def capture_run(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor], starts: Sequence[int] | None = None, numel: int | None = None
    ) -> torch.Tensor:
        """Store copies of ``tensors`` (at the receiver's dtype, one dtype) in one buffer,
        returned: end to end, or from ``starts`` in a buffer of ``numel`` elements, zero
        between them. Each key's snapshot is its view of it, so one compare can cover them all."""
        padded = starts is not None  # gaps between the tensors: zeros, never changed
        starts = list(itertools.accumulate((t.numel() for t in tensors[:-1]), initial=0)) if starts is None else starts
        numel = starts[-1] + tensors[-1].numel() if numel is None else numel
        dtype = tensors[0].dtype
        if self.device.type == "cpu":
            run = (host_zeros if padded else host_empty)((numel,), dtype)
        else:
            run = (torch.zeros if padded else torch.empty)(numel, dtype=dtype, device=self.device)
        for key, t, start in zip(keys, tensors, starts):
            view = run[start:start + t.numel()].view(t.shape)
            view.copy_(t)
            self.tensors[key] = view
        return run

    def fetch(self, key: str, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start bringing ``key``'s snapshot to ``device``; pass the result to ``stream().use``."""
        return self.stream(device).to_device(self.tensors[key])

    def commit(self, key: str, working: torch.Tensor, flat: torch.Tensor | None, new: torch.Tensor) -> None:
        """Write ``new`` at ``flat`` (``flat`` None: ``new`` is the whole tensor) into
        ``working`` (the fetched snapshot) and, when that is a device copy of a host
        snapshot, write it back in the background."""
        if flat is None:
            working.view(-1).copy_(new)
        else:
            working.view(-1)[flat] = new
        self.store(working, self.tensors[key])

    def store(self, working: torch.Tensor, stored: torch.Tensor) -> None:
        """``working`` (a fetched copy of ``stored``, moved on) into ``stored``: in the
        background when that is host memory and ``working`` is on a CUDA device."""
        if working is stored:
            return
        if stored.device.type == "cpu" and working.device.type == "cuda":
            _, event = self.stream(working.device).to_host(working, stored)
            assert event is not None
            self._writebacks.append((event, working))
        else:
            stored.copy_(working)

    async def wait_writeback(self) -> None:
        """Wait until every background write-back has landed in host memory."""
        pending, self._writebacks = self._writebacks, []
        if pending:
            def drain() -> None:
                for event, _ in pending:
                    event.synchronize()

            await asyncio.to_thread(drain)
