"""The sender's snapshot: what the receivers hold, at the receivers' dtypes.

Patches are the bitwise difference between the current weights (cast to the
receiver's dtype) and this snapshot. It lives on ``cuda`` (fastest, costs a model's
worth of GPU memory) or ``cpu`` (pinned when CUDA is present); ``auto`` (the default)
chooses at the first capture (``choose_place``): the trainer's GPU where the snapshot
fits ``SNAPSHOT_BUDGET`` of its free memory, else the host. With a CPU snapshot and
CUDA weights, each tensor's snapshot is prefetched to the GPU on a copy stream, updated
there, and written back to host memory in the background; the next build waits for
those write-backs first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from protocol.errors import StateError

from ..streams import CopyStream, cuda_present, host_empty, host_empty_like, host_zeros, record

log = logging.getLogger(__name__)

# ``auto`` keeps the snapshot on the trainer's GPU when it takes at most this share of the
# memory free there at the first capture: the rest is left to the trainer's later peaks.
SNAPSHOT_BUDGET = 0.5
_GiB = float(1 << 30)


def trainer_device(devices: Iterable[torch.device]) -> torch.device | None:
    """The one CUDA device every tracked tensor lives on; None for a CPU trainer, or one
    whose tensors span devices (each tensor's snapshot is then fetched to its own)."""
    found = set(devices)
    if len(found) != 1:
        return None
    (device,) = found
    return device if device.type == "cuda" else None


def choose_place(trainer: torch.device | None, nbytes: int, free: int | None, budget: float = SNAPSHOT_BUDGET) -> torch.device:
    """Where ``auto`` keeps a snapshot of ``nbytes`` (at the receivers' dtypes): on
    ``trainer`` (``trainer_device``) when that is a GPU with ``free`` bytes of which
    ``budget`` holds it (no copies over PCIe a version), else in pinned host memory."""
    if trainer is None or free is None or nbytes > budget * free:
        return torch.device("cpu")
    return trainer


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` as the driver counts them: memory PyTorch's caching
    allocator holds (the trainer's, reusable by it alone) counts as taken."""
    return int(torch.cuda.mem_get_info(device)[0])


class Snapshot:
    def __init__(self, device: str) -> None:
        if device == "cuda" and not cuda_present():
            from protocol.errors import ConfigError

            raise ConfigError("snapshot_device: cuda, but torch sees no CUDA device")
        self._device: torch.device | None = None  # auto: settled by ``place``
        if device == "cpu":
            self._device = torch.device("cpu")
        elif device == "cuda":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.tensors: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, CopyStream] = {}
        self._writebacks: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    @property
    def device(self) -> torch.device:
        """Where the snapshot lives (``auto``: once ``place``d)."""
        if self._device is None:
            raise StateError("snapshot_device auto: place() the snapshot before its first capture")
        return self._device

    def place(self, tensors: Mapping[str, torch.Tensor], dtype: Callable[[str], torch.dtype]) -> torch.device:
        """Settle ``auto`` (once; a set device stays) for a snapshot of the tracked
        ``tensors`` at the receivers' dtypes (``dtype`` of a key): by ``choose_place``, with
        the trainer's device and free memory now, and say so in the log."""
        if self._device is not None:
            return self._device
        nbytes = sum(t.numel() * dtype(key).itemsize for key, t in tensors.items())
        trainer = trainer_device(t.device for t in tensors.values())
        free = None if trainer is None else free_memory(trainer)
        self._device = place = choose_place(trainer, nbytes, free)
        facts = {"snapshot_device": str(place), "snapshot_bytes": nbytes, "free_bytes": free}
        if trainer is None:
            log.info("snapshot_device auto: cpu, the tracked tensors are not on one CUDA device (%.2f GiB snapshot)",
                     nbytes / _GiB, extra=facts)
        else:
            assert free is not None
            verdict = "fits within" if place == trainer else "exceeds"
            log.info("snapshot_device auto: %s, the %.2f GiB snapshot (at the receivers' dtypes) %s %.0f%% of %s's %.2f GiB free",
                     "pinned cpu" if place.type == "cpu" else place, nbytes / _GiB, verdict, SNAPSHOT_BUDGET * 100, trainer,
                     free / _GiB, extra=facts)
        return place

    def stream(self, device: torch.device) -> CopyStream:
        """``device``'s copy streams: the snapshot's fetches and write-backs on one, the
        changes and parts leaving for the host on the other (``CopyStream``)."""
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
            # on the fetch stream, after the work that moved ``working`` (just queued on this one)
            event = self.stream(working.device).write_back(working, stored, after=record(working.device))
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
