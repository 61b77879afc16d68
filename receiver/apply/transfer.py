"""A part's host-to-device transfer: every device-coded payload of one message moved to the
target's device in one copy, through the receiver's reused staging buffer (``StagingPool``:
pinned where CUDA is available). Tensors sent whole (``Encoding.DENSE``: every entry of a
BUCKET or BOOTSTRAP message, and dense entries of a PATCH part) go in that same one copy a
message and device: their values' bytes as the host decodes them (a view of an uncompressed
frame, or decompressed and unshuffled), checked first, then viewed at the wire's dtype on the
device and cast there to the target's (``StagedUpdate.stage``). A CPU target needs no
transfer: its entries decode from their frames as they are, and nothing is staged for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from protocol.codec.compress import Codec
from protocol.codec.parallel import map_ordered
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import blocks_payload, dense_bytes, dense_spec
from protocol.wire.buffers import Buffer
from protocol.wire.framing import BufferSpec, TensorEntry


class Placement(NamedTuple):
    """Where an entry of a message decodes: its target's shape (a group's: its elements
    end to end; a span's: its elements, runs end to end), dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class Moved:
    """What a part's transfer brought to the devices, by the entry's index in its message:
    ``payloads`` a device-coded entry's payload or a dense entry's bytes (uint8 both)."""

    payloads: dict[int, torch.Tensor] = field(default_factory=dict)
    extra: list[torch.Tensor] = field(default_factory=list)  # the ``extra`` arrays, on their devices, in order


def transfer_part(
    entries: Sequence[TensorEntry], frames: list[Buffer], placements: Sequence[Placement], pool: StagingPool, *, exact_dtype: bool = True,
    extra: Sequence[tuple[torch.device, np.ndarray]] = (),
) -> Moved:
    """Move what of ``entries`` is bound for a device ``pool`` stages (any but the CPU):
    device-coded payloads and dense entries' values (their bytes: ``dense_bytes``), with
    one ``pool.stage`` a device: one host-to-device copy a message.
    Every entry moved is checked against its target first (``dense_spec``, ``blocks_payload``,
    with ``exact_dtype`` as ``decode_entry`` takes it): a ``ProtocolError`` before its bytes
    are decompressed, and before anything is copied; a compressed dense frame that does not
    decompress to its size (``IntegrityError``), or bool bytes other than 0 and 1, fail before
    anything is copied too: a bad entry moves nothing of its message. Nothing is moved, and
    nothing of the pool touched, for a message without such an entry (nor for a dense buffer
    nvCOMP compressed: it decompresses on the GPU, ``decode_entry``). ``extra``: host arrays
    (1-D, of a dtype the pool stages) for a device the pool stages, moved in the same copy:
    what the host decoded of the message for that device (``Moved.extra``)."""
    pieces: dict[int, np.ndarray] = {}
    dense: dict[int, BufferSpec] = {}
    for i, (entry, where) in enumerate(zip(entries, placements)):
        if not pool.stages(where.device):
            continue
        spec = dense_spec(entry, where.shape, where.dtype, exact_dtype)
        if spec is not None:
            dense[i] = spec
            continue
        payload = blocks_payload(entry, frames, where.shape, where.dtype)
        if payload is not None:
            pieces[i] = payload
    # The host's decode of dense values (a compressed one's decompression) in parallel, as
    # decode_entry's would be; an uncompressed frame is a view, taken here.
    compressed = [i for i, spec in dense.items() if spec.codec is not Codec.NONE]
    host = map_ordered(lambda i: dense_bytes(entries[i].key, dense[i], frames, placements[i].dtype), compressed)
    pieces.update(zip(compressed, host))
    for i, spec in dense.items():
        if i not in pieces:
            pieces[i] = dense_bytes(entries[i].key, spec, frames, placements[i].dtype)
    by_device: dict[torch.device, list[tuple[int, np.ndarray]]] = {}
    for i in sorted(pieces):
        by_device.setdefault(placements[i].device, []).append((i, pieces[i]))
    for j, (device, array) in enumerate(extra):
        by_device.setdefault(device, []).append((-1 - j, array))
    moved = Moved()
    extras: dict[int, torch.Tensor] = {}
    for device, mine in by_device.items():
        views = pool.stage(device, [array for _, array in mine])
        for (i, _), view in zip(mine, views):
            if i < 0:
                extras[-1 - i] = view
            else:
                moved.payloads[i] = view
    moved.extra = [extras[j] for j in range(len(extra))]
    return moved
