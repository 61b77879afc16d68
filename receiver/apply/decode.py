"""One message's entries decoded into staged updates, each checked against the model
before anything of the message is staged: where it decodes, its values, its verdict."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from protocol.codec.parallel import map_ordered
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import BlocksEntry, DecodedTensor, at_span, decode_blocks, decode_entry, group_offsets, is_blocks, split_group
from protocol.errors import ProtocolError
from protocol.wire.framing import Encoding, Message, MessageType, TensorEntry, ValueEncoding
from protocol.wire.metadata import ModelMetadata

from .checks import check_span
from .commit import StagedUpdate, Target
from .stage_device import Coded, stage_coded
from .transfer import Placement, transfer_part


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
        if entry.span is not None:  # a 1-D tensor of its span's elements
            check_span(msg, entry.key, entry.span, metadata.shapes[entry.key])
            return Placement((entry.span.numel,), metadata.dtypes[entry.key], device)
        if not entry.group:
            return Placement(metadata.shapes[entry.key], metadata.dtypes[entry.key], device)
        dtype = metadata.dtypes[entry.key]
        if msg.type is not MessageType.PATCH or any(metadata.dtypes[k] != dtype for k in entry.group):
            raise ProtocolError(f"{msg.describe()}: tensor {entry.key}: a group outside a patch, or of tensors of several dtypes")
        return Placement((int(group_offsets([metadata.shapes[k] for k in entry.group])[-1]),), dtype, device)

    placements = [place(entry) for entry in msg.tensors]
    # Host-coded sparse entries bound for a GPU: decoded on the host first (in parallel), so
    # that their positions and values join the message's one copy to it.
    hosted = [i for i, entry in enumerate(msg.tensors) if _decoded_on_host(entry, placements[i], targets, staging)]
    pieces = dict(zip(hosted, map_ordered(lambda i: _host_pieces(msg, i, placements[i], metadata, decode_device), hosted)))
    arrays = [(placements[i].device, a) for i in hosted for piece in pieces[i] for a in _host_arrays(piece)]
    # Device-coded payloads bound for a GPU, whole tensors' bytes and what the host decoded
    # for it: one copy to it for the message, everything checked before it.
    moved = transfer_part(msg.tensors, msg.frames, placements, staging, exact_dtype=exact, extra=arrays)
    there = iter(moved.extra)
    for i in hosted:
        pieces[i] = [_on_device(piece, next(there), next(there)) for piece in pieces[i]]
    # Device-coded entries: decoded together, a fixed number of kernels a device for the message.
    coded = [i for i, entry in enumerate(msg.tensors) if is_blocks(entry)]
    blocks = dict(zip(coded, decode_blocks(
        [BlocksEntry(msg.tensors[i], placements[i].shape, placements[i].dtype, placements[i].device, moved.payloads.get(i)) for i in coded],
        msg.frames,
    )))

    def one(i: int) -> list[StagedUpdate]:
        """The updates of an entry not device-coded (``payload``: dense bytes the transfer moved for it)."""
        entry, where = msg.tensors[i], placements[i]
        payload = moved.payloads.get(i)
        if i in pieces:
            return [StagedUpdate.stage(piece, targets[piece.key]) for piece in pieces[i]]
        if not entry.group:
            target = targets[entry.key]
            base = target if isinstance(target, torch.Tensor) else None  # read where the entry's values are relative
            if entry.span is not None and base is not None:  # a span's values are relative to its elements
                base = entry.span.of(base.view(-1)) if base.is_contiguous() else None  # a strided block's: not decoded onto
            decoded = decode_entry(
                entry, msg.frames, where.shape, where.dtype, decode_device, exact_dtype=exact, base=base,
                target_device=where.device, payload=payload,
            )
            if entry.span is not None:  # its positions in the tensor's flat coordinates, before anything reads there
                decoded = at_span(decoded, entry.span)
            return [StagedUpdate.stage(decoded, target)]
        shapes = [metadata.shapes[k] for k in entry.group]
        decoded = decode_entry(entry, msg.frames, where.shape, where.dtype, decode_device, target_device=where.device, payload=payload)
        return [StagedUpdate.stage(piece, targets[piece.key]) for piece in split_group(decoded, entry.group, shapes)]

    done = map_ordered(one, [i for i in range(len(msg.tensors)) if i not in blocks]) if len(blocks) < len(msg.tensors) else []
    # Device-coded entries: every verdict (and every group's cut points) read at once, one
    # host sync a device for the message, before anything of it is staged; then staged a part at once.
    staged = iter(stage_coded([Coded.of(d, msg.tensors[i].group, msg.tensors[i].span, metadata) for i, d in blocks.items()], targets, metadata))
    rest = iter(done)
    ordered = [next(staged) if i in blocks else next(rest) for i in range(len(msg.tensors))]
    return [update for updates in ordered for update in updates]


def _decoded_on_host(entry: TensorEntry, where: Placement, targets: list[Target], staging: StagingPool) -> bool:
    """A host-coded sparse entry whose tensors the pool stages for (plain tensors on a GPU)."""
    if entry.encoding is Encoding.DENSE or is_blocks(entry) or not staging.stages(where.device):
        return False
    return all(isinstance(targets[k], torch.Tensor) for k in (entry.group or (entry.key,)))


def _host_pieces(msg: Message, i: int, where: Placement, metadata: ModelMetadata, decode_device: torch.device) -> list[DecodedTensor]:
    """A host-coded sparse entry decoded (on ``decode_device``, the host), one piece a tensor with changes."""
    entry = msg.tensors[i]
    decoded = decode_entry(entry, msg.frames, where.shape, where.dtype, decode_device, target_device=where.device)
    if entry.span is not None:  # its positions in the tensor's flat coordinates
        decoded = at_span(decoded, entry.span)
    if not entry.group:
        return [decoded]
    return split_group(decoded, entry.group, [metadata.shapes[k] for k in entry.group])


def _host_arrays(piece: DecodedTensor) -> tuple[np.ndarray, np.ndarray]:
    """A host-decoded piece's positions and values as bytes for the staging pool."""
    assert piece.flat is not None
    return (piece.flat.cpu().contiguous().view(-1).view(torch.uint8).numpy(), piece.values.cpu().contiguous().view(-1).view(torch.uint8).numpy())


def _on_device(piece: DecodedTensor, flat: torch.Tensor, values: torch.Tensor) -> DecodedTensor:
    """``piece`` with its positions and values the views the transfer made of them."""
    assert piece.flat is not None
    return dataclasses.replace(
        piece, flat=flat.view(piece.flat.dtype).view(piece.flat.shape), values=values.view(piece.values.dtype).view(piece.values.shape)
    )
