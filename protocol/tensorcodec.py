"""Tensor entries: one tensor's update as manifest entries plus wire buffers.

The sender turns a tensor's changes (sorted flat indices and new values) or a whole
tensor into an ``EncodedTensor``; ``assemble`` numbers the frames of a message. The
receiver calls ``decode_entry`` with the target's shape and dtype, which checks the
entry against the target *before* decompressing anything, so sizes are bounded by the
model rather than by the message.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .buffers import Buffer, buffer_tensor, tensor_view
from .checksum import checksum
from .compress import Codec, compress, decompress, shuffle, unshuffle
from .dtypes import bits_dtype, dtype_code, dtype_from_code, itemsize
from .errors import ProtocolError
from .framing import BufferSpec, Encoding, Role, TensorEntry, ValueEncoding
from .positions import decode_positions, encode_positions, positions_nbytes

_ROLES = {
    Encoding.DENSE: {Role.VALUES},
    Encoding.COO: {Role.ROWS, Role.COLS, Role.VALUES},
    Encoding.COO_DELTA: {Role.ROWS, Role.COLS, Role.VALUES},
    Encoding.GAPS: {Role.POSITIONS, Role.VALUES},
    Encoding.BITMAP: {Role.POSITIONS, Role.VALUES},
}


@dataclass(frozen=True)
class PatchOptions:
    """How patches are encoded. ``positions`` None picks GAPS or BITMAP per tensor, by size."""

    positions: Encoding | None = None
    values: ValueEncoding = ValueEncoding.XOR
    codec: Codec = Codec.NONE


@dataclass
class EncodedTensor:
    key: int
    encoding: Encoding
    values: ValueEncoding
    nnz: int
    buffers: list[tuple[BufferSpec, Buffer]]  # specs with frame 0, numbered by ``assemble``

    @property
    def wire_nbytes(self) -> int:
        return sum(len(w) for _, w in self.buffers)


def pack_buffer(role: Role, t: torch.Tensor, codec: Codec) -> tuple[BufferSpec, Buffer]:
    """One buffer: bytes of ``t``, shuffled and compressed when that pays, and checksummed."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    size = itemsize(t.dtype)
    wire: Buffer | None = None
    shuffled = False
    if codec is not Codec.NONE and raw.numel():
        shuffled = size > 1
        wire = compress(shuffle(raw, size) if shuffled else raw, codec)
        if len(wire) >= raw.numel():  # incompressible: send as is
            wire, shuffled = None, False
    if wire is None:
        codec, wire = Codec.NONE, tensor_view(raw.cpu())
    spec = BufferSpec(0, role, dtype_code(t.dtype), tuple(t.shape), raw.numel(), codec, shuffled, len(wire), checksum(wire))
    return spec, wire


def encode_dense(key: int, t: torch.Tensor, codec: Codec) -> EncodedTensor:
    return EncodedTensor(key, Encoding.DENSE, ValueEncoding.RAW, t.numel(), [pack_buffer(Role.VALUES, t, codec)])


def sparse_buffers(
    flat: torch.Tensor,
    new: torch.Tensor,
    old: torch.Tensor,
    shape: tuple[int, ...],
    options: PatchOptions,
) -> tuple[Encoding, dict[Role, torch.Tensor]]:
    """Position and value buffers of changes at sorted int64 ``flat``, on ``flat``'s device."""
    encoding = options.positions
    if encoding is None:
        numel, nnz = math.prod(shape), flat.numel()
        max_gap = int((torch.diff(flat, prepend=flat.new_full((1,), -1)) - 1).max()) if nnz else 0
        gaps = positions_nbytes(nnz, numel, Encoding.GAPS, max_gap)
        encoding = Encoding.GAPS if gaps <= positions_nbytes(nnz, numel, Encoding.BITMAP, 0) else Encoding.BITMAP
    buffers = encode_positions(flat, shape, encoding)
    if options.values is ValueEncoding.XOR:
        bits = bits_dtype(new.dtype)
        buffers[Role.VALUES] = new.view(bits) ^ old.view(bits)
    else:
        buffers[Role.VALUES] = new
    return encoding, buffers


def pack_entry(
    key: int, encoding: Encoding, values: ValueEncoding, nnz: int, buffers: dict[Role, torch.Tensor], codec: Codec
) -> EncodedTensor:
    return EncodedTensor(key, encoding, values, nnz, [pack_buffer(r, t, codec) for r, t in buffers.items()])


def encode_sparse(
    key: int,
    flat: torch.Tensor,
    new: torch.Tensor,
    old: torch.Tensor,
    shape: tuple[int, ...],
    options: PatchOptions,
) -> EncodedTensor:
    """Changed positions ``flat`` (sorted int64) with their ``new`` and ``old`` values."""
    encoding, buffers = sparse_buffers(flat, new, old, shape, options)
    return pack_entry(key, encoding, options.values, flat.numel(), buffers, options.codec)


def raw_nbytes(buffers: dict[Role, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in buffers.values())


def assemble(entries: list[EncodedTensor]) -> tuple[list[TensorEntry], list[Buffer]]:
    """Number the buffers of ``entries`` as frames 1..n of one message."""
    tensors: list[TensorEntry] = []
    frames: list[Buffer] = []
    for e in entries:
        specs = []
        for spec, wire in e.buffers:
            frames.append(wire)
            specs.append(dataclasses.replace(spec, frame=len(frames)))
        tensors.append(TensorEntry(e.key, e.encoding, e.values, e.nnz, tuple(specs)))
    return tensors, frames


def unpack_buffer(spec: BufferSpec, frame: Buffer, device: torch.device) -> torch.Tensor:
    """The typed tensor a buffer carries (its size and checksum already checked by framing)."""
    dtype = dtype_from_code(spec.dtype)
    if spec.codec is Codec.NONE:
        return buffer_tensor(frame, dtype, spec.shape).to(device)
    raw = decompress(frame, spec.codec, spec.nbytes, device)
    if spec.shuffle:
        raw = unshuffle(raw, itemsize(dtype))
    return raw.view(dtype).reshape(spec.shape)


@dataclass
class DecodedTensor:
    """A validated tensor update: ``flat`` is None for a dense tensor."""

    key: int
    flat: torch.Tensor | None
    values: torch.Tensor  # dense: the tensor; sparse: new values or XOR bits
    encoding: ValueEncoding

    def new_values(self, old: torch.Tensor) -> torch.Tensor:
        """New values of a sparse update, given the old values at ``flat``."""
        if self.encoding is ValueEncoding.XOR:
            bits = bits_dtype(old.dtype)
            return (old.view(bits) ^ self.values.to(old.device)).view(old.dtype)
        return self.values


def decode_entry(
    entry: TensorEntry,
    frames: list[Buffer],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    exact_dtype: bool = True,
) -> DecodedTensor:
    """Check ``entry`` against a target of ``shape``/``dtype``, then decode its buffers.

    ``exact_dtype`` False accepts dense values of another dtype of the same kind (bucket
    mode converts floating tensors). ``frames`` are the message's payload frames.
    """
    where = f"tensor {entry.key}"
    roles = {b.role for b in entry.buffers}
    if roles != _ROLES[entry.encoding]:
        raise ProtocolError(f"{where}: {entry.encoding.name} needs buffers {sorted(r.name for r in _ROLES[entry.encoding])}")
    numel = math.prod(shape)
    vspec = entry.buffer(Role.VALUES)
    vdtype = dtype_from_code(vspec.dtype)
    if entry.encoding is Encoding.DENSE:
        if entry.values is not ValueEncoding.RAW or entry.nnz != numel or vspec.shape != tuple(shape):
            raise ProtocolError(f"{where}: dense values of shape {list(vspec.shape)}, target has {list(shape)}")
        convertible = not exact_dtype and vdtype.is_floating_point and dtype.is_floating_point
        if vdtype != dtype and not convertible:
            raise ProtocolError(f"{where}: values of dtype {vdtype} cannot load into {dtype}")
        return DecodedTensor(entry.key, None, unpack_buffer(vspec, frames[vspec.frame - 1], device), entry.values)
    if not 0 < entry.nnz <= numel:
        raise ProtocolError(f"{where}: {entry.nnz} changes for a tensor of {numel} elements")
    want = bits_dtype(dtype) if entry.values is ValueEncoding.XOR else dtype
    if vdtype != want or vspec.shape != (entry.nnz,):
        raise ProtocolError(f"{where}: values {vdtype}{list(vspec.shape)}, expected {want}[{entry.nnz}]")
    for b in entry.buffers:  # bound every index buffer by the target before decompressing
        if b.role is not Role.VALUES and math.prod(b.shape) > max(entry.nnz, math.ceil(numel / 8)):
            raise ProtocolError(f"{where}: {b.role.name.lower()} buffer of shape {list(b.shape)} is too large")
    index: dict[Role, torch.Tensor] = {
        b.role: unpack_buffer(b, frames[b.frame - 1], device) for b in entry.buffers if b.role is not Role.VALUES
    }
    flat = decode_positions(index, tuple(shape), entry.encoding, entry.nnz)
    values = unpack_buffer(vspec, frames[vspec.frame - 1], device)
    return DecodedTensor(entry.key, flat, values, entry.values)
