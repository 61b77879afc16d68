"""A part's host-to-device transfer: every device-coded payload of one message (and the
offsets of its grouped entries, which the verdict read needs there) moved to the target's
device in one copy, through the receiver's reused staging buffer (``StagingPool``: pinned
where CUDA is available). A CPU target needs no transfer: its entries decode from their
frames as they are, and nothing is staged for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import blocks_payload
from protocol.wire.buffers import Buffer
from protocol.wire.framing import TensorEntry


class Placement(NamedTuple):
    """Where an entry of a message decodes: its target's shape (a group's: its elements
    end to end), dtype and device, and a group's ``group_offsets`` (None for a lone tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    offsets: np.ndarray | None = None


@dataclass
class Moved:
    """What a part's transfer brought to the devices, by the entry's index in its message."""

    payloads: dict[int, torch.Tensor] = field(default_factory=dict)
    offsets: dict[int, torch.Tensor] = field(default_factory=dict)


def transfer_part(entries: Sequence[TensorEntry], frames: list[Buffer], placements: Sequence[Placement], pool: StagingPool) -> Moved:
    """Move the device-coded payloads of ``entries`` whose targets are on a device ``pool``
    stages (any but the CPU), and their groups' offsets, with one ``pool.stage`` a device:
    one host-to-device copy a part. Each payload is checked against its target first
    (``blocks_payload``: a ``ProtocolError`` before anything is copied). Nothing is moved,
    and nothing of the pool touched, for a part without such an entry."""
    pieces: dict[torch.device, list[tuple[int, bool, np.ndarray]]] = {}
    for i, (entry, where) in enumerate(zip(entries, placements)):
        if not pool.stages(where.device):
            continue
        payload = blocks_payload(entry, frames, where.shape, where.dtype)
        if payload is None:
            continue
        mine = pieces.setdefault(where.device, [])
        mine.append((i, False, payload))
        if where.offsets is not None:
            mine.append((i, True, where.offsets))
    moved = Moved()
    for device, mine in pieces.items():
        views = pool.stage(device, [array for _, _, array in mine])
        for (i, is_offsets, _), view in zip(mine, views):
            (moved.offsets if is_offsets else moved.payloads)[i] = view
    return moved
