"""Per-version figures of the sender."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class SyncStats:
    version: int
    strategy: str  # "patch" or "bucket"
    messages: int = 0
    wire_bytes: int = 0  # every frame of every message, headers included
    dense_bytes: int = 0  # the tracked tensors at the receiver's dtypes: what a full copy sends
    total_elements: int = 0
    changed_elements: int = 0
    tensors_changed: int = 0
    tensors_dense: int = 0  # changed tensors sent whole because a patch would be larger
    build_seconds: float = 0.0  # what blocks the trainer: compare and collect (patch), or build (bucket)
    # an fp8 rollout's: quantizing the version into its format before the compare (not in build_seconds)
    quantize_seconds: float = 0.0
    backlog_wait_seconds: float = 0.0  # of build_seconds, the compare waiting for the encoder (patch.encode_backlog_bytes)
    # entropy coding and packing after the compare (what encoding beside it did not hide; the daemon does it in the background)
    encode_seconds: float = 0.0
    send_seconds: float = 0.0  # time spent in the injected send()
    # copies of the version's changes (device encoder) or whole tensors (buckets) from a CUDA
    # device to host memory, timed on the device (CUDA events); 0 where they are host memory
    d2h_seconds: float = 0.0
    # the staleness bound (``Sender(max_lag=..., lag_policy=...)``): time this sync waited for
    # receivers before building, and the receivers it left behind to be resynced
    lag_wait_seconds: float = 0.0
    lag_dropped: tuple[str, ...] = ()
    # commit="together": from publication to the flip, and the receivers it went without
    # (filled in when the flip is decided: ``await sender.wait_flipped(version)``). Through
    # relays a flip waits for the leaves (a relay reports a version staged once its subtree
    # has), so ``flip_seconds`` includes their staging; a receiver below a relay that the
    # relay's deadline went without is named by its path, ``"relay-id/leaf-id"``
    # (``"relay-a/relay-b/leaf"`` deeper); a direct receiver (or a relay, whole) by its identity.
    flip_seconds: float | None = None
    flip_missing: tuple[str, ...] = ()

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def compression_ratio(self) -> float:
        """Dense bytes per wire byte (higher is better)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed_fraction": self.changed_fraction}
