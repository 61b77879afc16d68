"""Per-version figures of the receiver."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ApplyStats:
    version: int | None
    kind: str  # "patch", "bucket" or "bootstrap"
    messages: int = 0
    wire_bytes: int = 0
    changed_elements: int = 0
    tensors: int = 0
    receive_seconds: float = 0.0  # from the first message's arrival to the last one's
    decode_seconds: float = 0.0  # validate, decompress and stage (off the event loop)
    h2d_seconds: float = 0.0  # of decode_seconds, the parts' copies to a CUDA device, timed there (CUDA events)
    apply_seconds: float = 0.0  # the commit: writes into the model, until the device has done them
    apply_device_seconds: float = 0.0  # the commit's work on the device (CUDA events; wall time on CPU)
    staged_bytes_peak: int = 0  # most decoded bytes held at once before being written (load_instant: one message's)
    resent_parts: int = 0  # parts it held already that came again, after a resend was asked for (skipped)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LagWaits:
    """The waits of ``Receiver.reading(max_lag=...)`` for fresher weights, for the receiver's
    life: how many, how long in all, and the last one's start (the version held, the
    trainer's latest, their difference) and length."""

    count: int = 0
    seconds: float = 0.0
    timeouts: int = 0
    last: dict[str, Any] | None = None

    def waited(self, held: int | None, latest: int | None, seconds: float, *, timed_out: bool = False) -> None:
        self.count += 1
        self.seconds += seconds
        self.timeouts += timed_out
        lag = None if latest is None else latest - (-1 if held is None else held)
        self.last = {"version": held, "latest": latest, "lag": lag, "seconds": round(seconds, 4)}
