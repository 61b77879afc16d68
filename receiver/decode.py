"""One message's entries decoded into staged updates, each checked against the model
before anything of the message is staged: where it decodes, its values, its verdict."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.codec.parallel import map_ordered
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import (
    BlocksEntry,
    DecodedTensor,
    at_span,
    decode_blocks,
    decode_entry,
    group_offsets,
    is_blocks,
    read_verdicts,
    split_group,
)
from protocol.errors import ProtocolError
from protocol.wire.framing import Message, MessageType, TensorEntry, ValueEncoding
from protocol.wire.metadata import ModelMetadata

from .checks import check_span
from .commit import StagedUpdate, Target
from .transfer import Placement, transfer_part


@dataclass(frozen=True)
class _Unread:
    """A device-coded entry decoded, its verdict not yet read (``tensorcodec.read_verdicts``)."""

    decoded: DecodedTensor
    group: tuple[int, ...] = ()
    shapes: list[tuple[int, ...]] | None = None  # a group's
    offsets: np.ndarray | torch.Tensor | None = None  # a group's ``group_offsets``: on its device when its part's transfer moved them

    def stage(self, targets: list[Target], cuts: list[int] | None) -> list[StagedUpdate]:
        if self.shapes is None:
            return [StagedUpdate.stage(self.decoded, targets[self.decoded.key])]
        pieces = split_group(self.decoded, self.group, self.shapes, cuts)
        return [StagedUpdate.stage(piece, targets[piece.key]) for piece in pieces]


def decode_part(
    msg: Message, targets: list[Target], metadata: ModelMetadata, decode_device: torch.device, staging: StagingPool
) -> list[StagedUpdate]:
    """``msg``'s updates of ``targets`` (the model's tensors in ``metadata`` order), decoded
    on ``decode_device`` and moved to each target's through ``staging``."""
    exact = msg.type is MessageType.PATCH  # buckets and bootstraps may carry a float dtype to convert

    def place(entry: TensorEntry) -> Placement:
        """Where the entry decodes (checked: values and groups only in a patch, a group of one dtype)."""
        if entry.values is not ValueEncoding.RAW and msg.type is not MessageType.PATCH:
            raise ProtocolError(f"{msg.describe()}: {entry.values.name} values outside a patch")
        device = targets[entry.key].device
        if entry.span is not None:  # a 1-D tensor of its hi - lo elements
            check_span(msg, entry.key, entry.span, metadata.shapes[entry.key])
            return Placement((entry.span[1] - entry.span[0],), metadata.dtypes[entry.key], device)
        if not entry.group:
            return Placement(metadata.shapes[entry.key], metadata.dtypes[entry.key], device)
        dtype = metadata.dtypes[entry.key]
        if msg.type is not MessageType.PATCH or any(metadata.dtypes[k] != dtype for k in entry.group):
            raise ProtocolError(f"{msg.describe()}: tensor {entry.key}: a group outside a patch, or of tensors of several dtypes")
        offsets = group_offsets([metadata.shapes[k] for k in entry.group])
        return Placement((int(offsets[-1]),), dtype, device, offsets)

    placements = [place(entry) for entry in msg.tensors]
    # Device-coded payloads bound for a GPU (and their groups' offsets) and whole tensors'
    # bytes: one copy to it for the message, everything checked before it.
    moved = transfer_part(msg.tensors, msg.frames, placements, staging, exact_dtype=exact)
    # Device-coded entries: decoded together, a fixed number of kernels a device for the message.
    coded = [i for i, entry in enumerate(msg.tensors) if is_blocks(entry)]
    blocks = dict(zip(coded, decode_blocks(
        [BlocksEntry(msg.tensors[i], placements[i].shape, placements[i].dtype, placements[i].device, moved.payloads.get(i)) for i in coded],
        msg.frames,
    )))

    def one(i: int) -> list[StagedUpdate] | _Unread:
        """The entry's updates, or, for a device-coded one, its decode with the verdict unread
        (``payload``: what the transfer moved for it, a device-coded payload or dense bytes)."""
        entry, where = msg.tensors[i], placements[i]
        payload = moved.payloads.get(i)
        if i in blocks:
            decoded = blocks[i]
            if entry.span is not None:  # its positions in the tensor's flat coordinates, before anything reads there
                decoded = at_span(decoded, entry.span)
            if not entry.group:
                return _Unread(decoded)
            return _Unread(decoded, entry.group, [metadata.shapes[k] for k in entry.group], moved.offsets.get(i, where.offsets))
        if not entry.group:
            target = targets[entry.key]
            base = target if isinstance(target, torch.Tensor) else None  # read where the entry's values are relative
            if entry.span is not None and base is not None:  # a span's values are relative to its range
                base = base.view(-1)[entry.span[0]:entry.span[1]] if base.is_contiguous() else None
            decoded = decode_entry(
                entry, msg.frames, where.shape, where.dtype, decode_device, exact_dtype=exact, base=base,
                target_device=where.device, payload=payload,
            )
            if entry.span is not None:  # its positions in the tensor's flat coordinates, before anything reads there
                decoded = at_span(decoded, entry.span)
            if decoded.verdict is not None:
                return _Unread(decoded)
            return [StagedUpdate.stage(decoded, target)]
        shapes = [metadata.shapes[k] for k in entry.group]
        decoded = decode_entry(entry, msg.frames, where.shape, where.dtype, decode_device, target_device=where.device, payload=payload)
        if decoded.verdict is not None:
            return _Unread(decoded, entry.group, shapes, moved.offsets.get(i, where.offsets))
        return [StagedUpdate.stage(piece, targets[piece.key]) for piece in split_group(decoded, entry.group, shapes)]

    done = map_ordered(one, range(len(msg.tensors)))
    unread = [d for d in done if isinstance(d, _Unread)]
    if unread:
        # Device-coded entries: every verdict (and every group's cut points) read at once,
        # one host sync for the message, before anything of it is staged.
        cuts = read_verdicts([(u.decoded, u.offsets) for u in unread])
        staged = iter(map_ordered(lambda uc: uc[0].stage(targets, uc[1]), list(zip(unread, cuts))))
        done = [next(staged) if isinstance(d, _Unread) else d for d in done]
    return [update for updates in done if not isinstance(updates, _Unread) for update in updates]
