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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
