"""Tensor entries: one tensor's update as manifest entries plus wire buffers.

The sender turns a tensor's changes (sorted flat indices and new values) or a whole
tensor into an ``EncodedTensor``; ``assemble`` numbers the frames of a message. The
receiver calls ``decode_entry`` with the target's shape and dtype, which checks the
entry against the target *before* decompressing anything, so sizes are bounded by the
model rather than by the message.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from protocol.codec import devicecodec
from protocol.codec.compress import Codec, compress, decompress, shuffle, unshuffle
from protocol.codec.positions import decode_positions, downscale, encode_positions, gaps_and_top, positions_nbytes
from protocol.errors import ConfigError, ProtocolError
from protocol.lazy import lazy_module
from protocol.wire.buffers import Buffer, buffer_tensor, tensor_view
from protocol.wire.checksum import checksum
from protocol.wire.dtypes import UNSIGNED_INDEX_DTYPES, bits_dtype, dtype_code, dtype_from_code, itemsize, smallest_unsigned
from protocol.wire.framing import BufferSpec, Encoding, Role, TensorEntry, ValueEncoding
from protocol.wire.span import Span

if TYPE_CHECKING:
    from protocol.codec import entropy, packed, rans
else:  # numba loads on first use (protocol/lazy.py)
    entropy, rans = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.rans")
    packed = lazy_module("protocol.codec.packed")

_POSITION_ROLES = {
    Encoding.DENSE: frozenset(),
    Encoding.COO: frozenset({Role.ROWS, Role.COLS}),
    Encoding.COO_DELTA: frozenset({Role.ROWS, Role.COLS}),
    Encoding.GAPS: frozenset({Role.POSITIONS}),
    Encoding.BITMAP: frozenset({Role.POSITIONS}),
    Encoding.ANS_GAPS: frozenset({Role.POSITIONS, Role.LOW_BITS, Role.POSITION_MODEL, Role.POSITION_ESCAPES}),
    Encoding.BLOCKS: frozenset(),  # with ULP values: one uint8 VALUES buffer (``_is_blocks``)
}
_VALUE_ROLES = {
    ValueEncoding.RAW: frozenset({Role.VALUES}),
    ValueEncoding.XOR: frozenset({Role.VALUES}),
    ValueEncoding.ULP: frozenset({Role.VALUES, Role.VALUE_MODEL, Role.VALUE_EXTRA}),
}
# Entropy-coded buffers are already dense: compressing them again only costs time.
_ENTROPY_CODED = frozenset({Role.LOW_BITS, Role.VALUE_EXTRA})
# zstd costs ~13 us a call here even on 256 bytes (``python -m benchmarks.micro --only
# compress``) and saves at most what the buffer holds: smaller buffers travel as they are.
ZSTD_MIN_BYTES = 4096
ANS_MIN_CHANGES = 512  # below this, counts tables and per-call overhead cost more than they save
# A packed entry (ANS_GAPS + ULP, protocol/codec/packed.py) costs ~40 bytes more than its coded
# changes (header, counts tables, the streams' final states), where raw gaps and XOR values cost
# 2-3 bytes a change more than coding them: from about 32 changes on it is the smaller, and it
# codes in ~15 us (within the 20 us a tensor budgeted for the encoder: docs/performance.md,
# ``python -m benchmarks.micro``).
PACKED_MIN_CHANGES = 32
# Deciding between plain and coded changes takes a sample of the values (~30 us); below this
# the coder's per-tensor cost is small beside that, so a small tensor is coded.
PLAIN_MIN_CHANGES = 16384
# wire.dtypes.bits_dtype builds a tensor to learn an itemsize (~1.3 us); a tensor's path asks it up to 3 times.
_bits_of = functools.cache(bits_dtype)


@dataclass(frozen=True)
class DenseCost:
    """``patch.dense_above: auto`` (the default): how each changed tensor travels, by which
    is estimated fastest: whole, its changes entropy coded, or its changes plain (raw gaps
    and new values, uncompressed). Coding costs CPU time per change (``ns_per_change``: the
    sender's collect and encode plus a receiver's decode and apply; ~20 ns measured on the
    development machine, ``python -m benchmarks.micro --only codec apply``) and wire time
    for the coded bytes; plain changes cost less CPU (``plain_ns_per_change``) and more
    bytes (a gap of 1-8 bytes and the value's own); a dense tensor costs wire time for all
    of its bytes. Wire time is at ``link_gbps``, the bandwidth each receiver gets. Coded
    bytes are estimated at the entropy floor: positions at ``numel * H(nnz / numel)`` bits,
    values at the bits a sample of their ulp differences needs (``value_bits``).

    At the defaults (1 Gb/s, 25 ns, 12 ns) a bf16 tensor is coded up to ~45-75% changed,
    depending on how far its values moved, and sent whole past that; an fp32 tensor whose
    every element moved by thousands of ulps (``value_bits`` ~14) is sent whole. On a faster
    link the cut-off falls and plain changes win over coded ones (from ~1.5-2 Gb/s on a real
    bf16 step: the wire's bytes are cheaper there than the coder's CPU); on a slower one
    coding wins everywhere."""

    link_gbps: float = 1.0
    ns_per_change: float = 25.0
    # The collect, the gaps and a receiver's scatter: 12.6 ns a change less than coding, as
    # measured on a real bf16 step (docs/performance.md, *Plain changes on a fast link*).
    plain_ns_per_change: float = 12.0

    @property
    def ns_per_byte(self) -> float:
        return 8.0 / self.link_gbps

    def coded_ns(self, nnz: int, numel: int, value_bits: float) -> float:
        """Estimated time to send ``nnz`` coded changes of a ``numel``-element tensor."""
        bits = numel * binary_entropy(nnz / numel) + nnz * value_bits if numel else 0.0
        return nnz * self.ns_per_change + bits / 8 * self.ns_per_byte

    def plain_ns(self, nnz: int, numel: int, itemsize: int) -> float:
        """Estimated time to send ``nnz`` changes of a ``numel``-element tensor plain."""
        return nnz * (self.plain_ns_per_change + (plain_gap_bytes(nnz, numel) + itemsize) * self.ns_per_byte)

    def dense_ns(self, numel: int, itemsize: int) -> float:
        return numel * itemsize * self.ns_per_byte

    def dense_wins(self, nnz: int, numel: int, itemsize: int, value_bits: float) -> bool:
        sparse = min(self.coded_ns(nnz, numel, value_bits), self.plain_ns(nnz, numel, itemsize))
        return nnz > 0 and self.dense_ns(numel, itemsize) <= sparse

    def plain_wins(self, nnz: int, numel: int, itemsize: int, value_bits: float) -> bool:
        """Whether ``nnz`` changes travel faster plain than coded."""
        return nnz > 0 and self.plain_ns(nnz, numel, itemsize) < self.coded_ns(nnz, numel, value_bits)

    def share_above(self, itemsize: int, value_bits: float) -> float:
        """The share of changed elements from which the tensor goes whole (> 1: never)."""
        return _share_above(self, itemsize, round(value_bits, 1))


@functools.lru_cache(maxsize=4096)
def _share_above(cost: DenseCost, itemsize: int, value_bits: float) -> float:
    # Both costs are linear in numel at a given share, so the cut-off depends on the share
    # alone; coded cost rises with it (ns_per_change dominates H's fall past one half).
    n = 1 << 20
    if not cost.dense_wins(n, n, itemsize, value_bits):
        return 1.5
    lo, hi = 0.0, 1.0
    for _ in range(24):
        mid = (lo + hi) / 2
        if cost.dense_wins(max(1, int(mid * n)), n, itemsize, value_bits):
            hi = mid
        else:
            lo = mid
    return hi


def plain_gap_bytes(nnz: int, numel: int) -> int:
    """The bytes a plain gap is estimated to take: raw gaps travel in the smallest unsigned
    dtype holding the largest, and the largest of ``nnz`` gaps spread at random over
    ``numel`` elements is about ``numel / nnz * ln(nnz)``."""
    if nnz <= 0:
        return 1
    top = min(numel, math.ceil(numel / nnz * max(1.0, math.log(nnz))))  # no gap is longer than the tensor
    return smallest_unsigned(top).itemsize


def binary_entropy(p: float) -> float:
    """Bits per element of a set of positions with density ``p`` (what ideal coding costs)."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def value_bits(diffs: torch.Tensor, sample: int = 2048) -> float:
    """Bits per change the value coder needs for integer ulp ``diffs`` (``new_bits -
    old_bits``), estimated from an evenly strided sample: the order-0 entropy of the coder's
    symbols (small zigzagged differences are their own symbol, larger ones one symbol per
    bit length) plus the low bits each large one carries. numpy: ~30 us on 2,048."""
    flat = diffs.reshape(-1)
    if flat.numel() > sample:
        flat = flat[:: flat.numel() // sample]
    d = flat.to(torch.int64).cpu().numpy()
    if d.size == 0:
        return 0.0
    z = ((d << 1) ^ (d >> 63)).view(np.uint64)  # zigzag, unsigned: 64-bit integers' differences wrap
    width = np.frexp(np.maximum(z, 1).astype(np.float64))[1]  # bit length
    small = z < entropy.DIRECT
    symbols = np.where(small, z.astype(np.int64), entropy.DIRECT + width - entropy.DIRECT_BITS - 1)
    extra = float(np.where(small, 0, width - 1).mean())
    counts = np.bincount(symbols)
    prob = counts[counts > 0] / d.size
    return float(-(prob * np.log2(prob)).sum()) + extra


def sampled_differences(new: torch.Tensor, old: torch.Tensor, sample: int = 2048) -> torch.Tensor:
    """The ulp differences of about ``sample`` evenly strided changes (what ``value_bits`` reads)."""
    step = max(1, new.numel() // sample)
    return entropy.ulp_differences(new[::step], old[::step])


@dataclass(frozen=True)
class PatchOptions:
    """How patches are encoded. ``positions`` None picks per tensor: entropy-coded gaps
    when there are enough changes, else the smaller of raw gaps and a bitmap.
    ``dense_above``: a ``DenseCost`` (the default) sends a tensor whole where that is
    estimated to be faster; a number sends whole, uncompressed, any tensor with more than
    that share of its elements changed (1.0: only where coding would not be smaller).
    ``device_codec`` (``patch.codec``): True codes every sparse entry with the device codec
    (``Encoding.BLOCKS``, protocol/codec/devicecodec.py) on the changes' own device, False
    with the host codec; None (``auto``) with the device codec where the changes are on CUDA
    and the encodings are the defaults (a sender resolves it by where its tracked tensors
    live: ``resolved``)."""

    positions: Encoding | None = None
    values: ValueEncoding = ValueEncoding.ULP
    codec: Codec = Codec.NONE
    dense_above: float | DenseCost = DenseCost()
    device_codec: bool | None = None

    def __post_init__(self) -> None:
        if self.device_codec and not self.default_encodings:
            raise ConfigError("the device codec codes positions and values itself: positions must be None (auto) and values ULP")

    @property
    def default_encodings(self) -> bool:
        return self.positions is None and self.values is ValueEncoding.ULP

    def resolved(self, on_cuda: bool) -> PatchOptions:
        """These options with ``device_codec`` None (auto) decided: the device codec for
        tensors on CUDA (``on_cuda``) where the encodings are the defaults, else the host's."""
        if self.device_codec is not None:
            return self
        return dataclasses.replace(self, device_codec=on_cuda and self.default_encodings)

    def codes_on_device(self, device: torch.device) -> bool:
        """Whether sparse changes held on ``device`` are coded by the device codec."""
        if self.device_codec is None:
            return device.type == "cuda" and self.default_encodings
        return self.device_codec

    def dense_candidate(self, itemsize: int) -> float:
        """The share of changed elements from which a tensor may go whole, whatever its
        values: from there on the sender keeps a copy of the whole new tensor."""
        if isinstance(self.dense_above, DenseCost):
            return min(self.dense_above.share_above(itemsize, 8.0 * itemsize + 1), 1.0)
        return min(self.dense_above, 1 / 3)

    def surely_dense(self, itemsize: int) -> float:
        """The share of changed elements past which a tensor goes whole whatever its values
        (the sender need not collect its changes)."""
        if isinstance(self.dense_above, DenseCost):
            return self.dense_above.share_above(itemsize, 0.0)
        return self.dense_above

    def goes_dense(self, nnz: int, numel: int, itemsize: int, diffs: torch.Tensor | None) -> bool:
        """Whether ``nnz`` changes whose ulp differences are ``diffs`` travel whole."""
        if nnz == 0:
            return False
        if not isinstance(self.dense_above, DenseCost):
            return nnz > self.dense_above * numel
        if nnz <= self.dense_candidate(itemsize) * numel:
            return False
        if nnz > self.surely_dense(itemsize) * numel or diffs is None:
            return nnz > self.surely_dense(itemsize) * numel
        bits = value_bits(diffs) if self.values is ValueEncoding.ULP else 8.0 * itemsize
        return self.dense_above.dense_wins(nnz, numel, itemsize, bits)

    def codec_for(self, encoding: Encoding, values: ValueEncoding) -> Codec:
        """The compression of an entry's buffers: none for plain changes (raw gaps and values
        where ``ulp`` was asked for: ``goes_plain``), chosen to save the CPU it costs."""
        plain = encoding is Encoding.GAPS and values is ValueEncoding.RAW and self.values is ValueEncoding.ULP
        return Codec.NONE if plain or encoding is Encoding.BLOCKS else self.codec  # device entries: nvCOMP later

    def goes_plain(self, nnz: int, numel: int, new: torch.Tensor, old: torch.Tensor) -> bool:
        """Whether ``nnz`` changes of a ``numel``-element tensor (``new`` and ``old`` values)
        travel plain rather than entropy coded: only where the encodings are the defaults'
        and ``dense_above`` is a ``DenseCost``, from ``PLAIN_MIN_CHANGES`` on."""
        cost = self.dense_above
        if not isinstance(cost, DenseCost) or self.positions is not None or self.values is not ValueEncoding.ULP:
            return False
        if nnz < PLAIN_MIN_CHANGES:
            return False
        size = new.element_size()
        if not cost.plain_wins(nnz, numel, size, 8.0 * size + 1):  # coded wins however far the values moved
            return False
        return cost.plain_wins(nnz, numel, size, value_bits(sampled_differences(new, old)))


@dataclass
class EncodedTensor:
    key: int
    encoding: Encoding
    values: ValueEncoding
    nnz: int
    buffers: list[tuple[BufferSpec, Buffer]]  # specs with frame 0, numbered by ``assemble``
    group: tuple[int, ...] = ()  # a grouped entry's ordinals (TensorEntry.group)
    span: Span | None = None  # a span entry's flat elements of its tensor (TensorEntry.span)

    @property
    def wire_nbytes(self) -> int:
        return sum(len(w) for _, w in self.buffers)


def pack_buffer(role: Role, t: torch.Tensor, codec: Codec) -> tuple[BufferSpec, Buffer]:
    """One buffer: bytes of ``t``, shuffled and compressed when that pays, and checksummed."""
    flat = t.detach() if t.requires_grad else t
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    if flat.numel() == 0:  # empty tensors may carry any stride, which view() refuses
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    else:
        raw = flat.contiguous().view(torch.uint8)
    nbytes = raw.numel()
    size = t.element_size()
    wire: Buffer | None = None
    shuffled = False
    if codec is Codec.ZSTD and nbytes < ZSTD_MIN_BYTES:
        codec = Codec.NONE
    if codec is not Codec.NONE and nbytes:
        shuffled = size > 1
        wire = compress(shuffle(raw, size) if shuffled else raw, codec)
        if len(wire) >= nbytes:  # incompressible: send as is
            wire, shuffled = None, False
    if wire is None:
        # ``raw`` is contiguous uint8 already: its bytes as they are (tensor_view, inlined:
        # this runs for every buffer of every tensor)
        codec = Codec.NONE
        wire = raw.numpy().data.toreadonly() if nbytes and raw.is_cpu else tensor_view(raw.cpu())
    spec = BufferSpec(0, role, dtype_code(t.dtype), tuple(t.shape), nbytes, codec, shuffled, len(wire), checksum(wire))
    return spec, wire


def encode_dense(key: int, t: torch.Tensor, codec: Codec) -> EncodedTensor:
    return EncodedTensor(key, Encoding.DENSE, ValueEncoding.RAW, t.numel(), [pack_buffer(Role.VALUES, t, codec)])


def sparse_buffers(
    flat: torch.Tensor,
    new: torch.Tensor,
    old: torch.Tensor,
    shape: tuple[int, ...],
    options: PatchOptions,
) -> tuple[Encoding, ValueEncoding, dict[Role, torch.Tensor]]:
    """Position and value buffers of changes at sorted ``flat`` (int32 or int64: the same bytes), and the encodings
    chosen. Raw, XOR and device-coded buffers stay on ``flat``'s device; entropy-coded ones are on the host."""
    if options.codes_on_device(flat.device):
        return Encoding.BLOCKS, ValueEncoding.ULP, {Role.VALUES: device_payload(flat, new, old)}
    encoding = options.positions
    nnz = flat.numel()
    values = options.values
    if options.goes_plain(nnz, math.prod(shape), new, old):
        return Encoding.GAPS, ValueEncoding.RAW, {**encode_positions(flat, shape, Encoding.GAPS), Role.VALUES: new}
    if values is ValueEncoding.ULP and encoding in (None, Encoding.ANS_GAPS) and nnz >= PACKED_MIN_CHANGES:
        return Encoding.ANS_GAPS, values, {Role.VALUES: packed.encode(flat, new, old)}
    flat = flat.long()  # the other encodings' buffers take their dtypes from it
    if encoding is None and nnz >= ANS_MIN_CHANGES:
        encoding = Encoding.ANS_GAPS
    if encoding is None:
        encoding, buffers = _gaps_or_bitmap(flat, shape)
    else:
        buffers = encode_positions(flat, shape, encoding)
    if values is ValueEncoding.ULP and nnz >= ANS_MIN_CHANGES:
        coded = entropy.encode_values(entropy.ulp_differences(new, old).cpu())
        buffers.update({Role.VALUES: coded["words"], Role.VALUE_MODEL: coded["model"], Role.VALUE_EXTRA: coded["extra"]})
        return encoding, values, buffers
    if values is ValueEncoding.ULP:
        values = ValueEncoding.XOR
    if values is ValueEncoding.XOR:
        bits = _bits_of(new.dtype)
        buffers[Role.VALUES] = new.view(bits) ^ old.view(bits)
    else:
        buffers[Role.VALUES] = new
    return encoding, values, buffers


def device_payload(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """A ``BLOCKS`` entry's one buffer: the device codec's payload of the changes (uint8, on
    their device; one host sync, for its size)."""
    return devicecodec.encode(flat.long(), new, old).payload


def _gaps_or_bitmap(flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Encoding, dict[Role, torch.Tensor]]:
    """Raw gaps or a bitmap, whichever is smaller, the gaps computed once for both the choice and the buffer."""
    gaps, top = gaps_and_top(flat)
    numel, nnz = math.prod(shape), flat.numel()
    if positions_nbytes(nnz, numel, Encoding.GAPS, top) <= positions_nbytes(nnz, numel, Encoding.BITMAP, 0):
        return Encoding.GAPS, {Role.POSITIONS: downscale(gaps, top)}
    return Encoding.BITMAP, encode_positions(flat, shape, Encoding.BITMAP)


def pack_entry(
    key: int, encoding: Encoding, values: ValueEncoding, nnz: int, buffers: dict[Role, torch.Tensor], codec: Codec,
    group: tuple[int, ...] = (), span: Span | None = None,
) -> EncodedTensor:
    """An entry of ``buffers`` (``span``: one covering those flat elements of its tensor,
    its buffers coded as a 1-D tensor of ``span.numel`` elements: ``protocol/codec/spans.py``)."""
    packed = [pack_buffer(r, t, Codec.NONE if _entropy_coded(r, encoding, values) else codec) for r, t in buffers.items()]
    return EncodedTensor(key, encoding, values, nnz, packed, group, span)


def _entropy_coded(role: Role, encoding: Encoding, values: ValueEncoding) -> bool:
    return (
        role in _ENTROPY_CODED
        or (role is Role.POSITIONS and encoding is Encoding.ANS_GAPS)
        or (role is Role.VALUES and values is ValueEncoding.ULP)  # packed, rANS or BLOCKS
    )


def encode_sparse(
    key: int,
    flat: torch.Tensor,
    new: torch.Tensor,
    old: torch.Tensor,
    shape: tuple[int, ...],
    options: PatchOptions,
) -> EncodedTensor:
    """Changed positions ``flat`` (sorted, int32 or int64) with their ``new`` and ``old`` values."""
    encoding, values, buffers = sparse_buffers(flat, new, old, shape, options)
    return pack_entry(key, encoding, values, flat.numel(), buffers, options.codec_for(encoding, values))


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
        tensors.append(TensorEntry(e.key, e.encoding, e.values, e.nnz, tuple(specs), e.group, e.span))
    return tensors, frames


# Frames are read-only, and buffer_tensor guards torch's warning about that with
# warnings.catch_warnings (~3 us a buffer); a small frame is copied into a writable one instead
# (~0.3 us), a large one stays zero-copy.
COPY_FRAMES_BELOW = 1 << 16


def _frame_tensor(frame: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if 0 < len(frame) < COPY_FRAMES_BELOW:
        return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape)
    return buffer_tensor(frame, dtype, shape)


def unpack_buffer(spec: BufferSpec, frame: Buffer, device: torch.device) -> torch.Tensor:
    """The typed tensor a buffer carries (its size and checksum already checked by framing)."""
    dtype = dtype_from_code(spec.dtype)
    if spec.codec is Codec.NONE:
        return _frame_tensor(frame, dtype, spec.shape).to(device)
    return _decompressed(spec, frame, device).view(dtype).reshape(spec.shape)


def _decompressed(spec: BufferSpec, frame: Buffer, device: torch.device) -> torch.Tensor:
    """A compressed buffer's bytes (1-D uint8), decompressed and unshuffled."""
    raw = decompress(frame, spec.codec, spec.nbytes, device)
    if spec.shuffle:
        raw = unshuffle(raw, itemsize(dtype_from_code(spec.dtype)))
    return raw


@dataclass(frozen=True)
class Verdict:
    """A device-coded entry's checks, unread: 0-dim bool tensors on its device
    (``devicecodec.Decoded``): ``ok`` for all of them, ``intact`` for its checksum."""

    ok: torch.Tensor
    intact: torch.Tensor
    batch: devicecodec.DecodedBatch | None = None  # decoded with others (``decode_blocks``): its changes from ``at`` there
    at: int = 0


@dataclass
class DecodedTensor:
    """A validated tensor update: ``flat`` is None for a dense tensor. A device-coded one
    (``verdict`` set) is validated only once its verdict is read (the receiver's
    ``stage_coded``, receiver/apply/stage_device.py); its positions always lie within the
    target, so reading the old values there is safe before."""

    key: int
    flat: torch.Tensor | None
    values: torch.Tensor  # dense: the tensor; sparse: new values, XOR bits or ulp differences
    encoding: ValueEncoding
    verdict: Verdict | None = None
    # Dense values moved with the rest of their message (``decode_entry``'s ``payload``), their
    # bytes checked on the host before they moved (``dense_bytes``): nothing is left to check
    # where they are now (which, on a GPU, would be a host sync a tensor).
    checked: bool = False

    def new_values(self, old: torch.Tensor) -> torch.Tensor:
        """New values of a sparse update, given the old values at ``flat``."""
        if self.verdict is not None:  # on ``old``'s device, without numba or a host sync
            return devicecodec.apply_differences(old, self.values.to(old.device, non_blocking=True))
        if self.encoding is ValueEncoding.XOR:
            bits = _bits_of(old.dtype)
            return (old.view(bits) ^ self.values.to(old.device)).view(old.dtype)
        if self.encoding is ValueEncoding.ULP:
            return entropy.apply_differences(old, self.values.to(old.device))
        return self.values


def decode_entry(
    entry: TensorEntry,
    frames: list[Buffer],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    exact_dtype: bool = True,
    base: torch.Tensor | None = None,
    target_device: torch.device | None = None,
    payload: torch.Tensor | None = None,
) -> DecodedTensor:
    """Check ``entry`` against a target of ``shape``/``dtype``, then decode its buffers.

    ``exact_dtype`` False accepts dense values of another dtype of the same kind (bucket
    mode converts floating tensors). ``frames`` are the message's payload frames. ``base``,
    the target's values now (only read), lets a packed entry decode straight to its new
    values (``packed.decode_onto``, where it takes ``base``): they come back RAW.
    A device-coded entry (``Encoding.BLOCKS``) is decoded on ``target_device`` (default
    ``device``) with no host sync; it comes back with its ``verdict`` unread (``Verdict``).
    ``payload``: such an entry's payload (``blocks_payload``) already on that device, moved
    there with the rest of its message (``receiver/apply/transfer.py``); without it the payload is
    copied there on its own (a CPU target decodes it from its frame). A dense entry's
    ``payload`` is its values' bytes (``dense_bytes``) moved the same way: its values come
    back as a view of them, at the wire's dtype, on that device (``checked``); without it
    they are decoded on ``device``.
    """
    numel, vspec = _checked(entry, shape, dtype, exact_dtype)
    if entry.encoding is Encoding.DENSE:
        if payload is not None:
            return DecodedTensor(entry.key, None, _staged_dense(entry, vspec, payload, target_device or device), entry.values, checked=True)
        return DecodedTensor(entry.key, None, unpack_buffer(vspec, frames[vspec.frame - 1], device), entry.values)
    nnz = entry.nnz
    if _is_blocks(entry.encoding, entry.values):
        return _decode_blocks(entry, vspec, frames[vspec.frame - 1], numel, dtype, target_device or device, payload)
    if _is_packed(entry.encoding, entry.values):
        buf = _host_bytes(vspec, frames[vspec.frame - 1])
        if base is not None and packed.decodes_onto(base):
            if base.dtype != dtype or base.numel() != numel:
                raise ConfigError(f"tensor {entry.key}: base of {base.dtype}[{base.numel()}] for a target of {dtype}[{numel}]")
            flat, values = packed.decode_onto(buf, nnz, base)
            return DecodedTensor(entry.key, flat, values, ValueEncoding.RAW)
        flat, diffs = packed.decode(buf, nnz, numel)
        return DecodedTensor(entry.key, flat, diffs, entry.values)
    decoded = {b.role: unpack_buffer(b, frames[b.frame - 1], device) for b in entry.buffers}
    if entry.encoding is Encoding.ANS_GAPS:
        gaps = entropy.decode_gaps(
            decoded[Role.POSITIONS], decoded[Role.LOW_BITS], decoded[Role.POSITION_MODEL], decoded[Role.POSITION_ESCAPES], nnz
        )
        flat = positions_of_gaps(gaps, numel)
    else:
        flat = decode_positions(decoded, tuple(shape), entry.encoding, nnz)
    if entry.values is ValueEncoding.ULP:
        values = entropy.decode_values(decoded[Role.VALUES].cpu(), decoded[Role.VALUE_MODEL].cpu(), decoded[Role.VALUE_EXTRA].cpu(), nnz)
    else:
        values = decoded[Role.VALUES]
    return DecodedTensor(entry.key, flat, values, entry.values)


def blocks_payload(entry: TensorEntry, frames: list[Buffer], shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray | None:
    """A device-coded entry's payload as host bytes (a view of its frame), once the entry
    passes every check ``decode_entry`` makes before decoding (so a payload is bounded by
    its target before anything copies it); None for an entry of any other encoding."""
    if not _is_blocks(entry.encoding, entry.values):
        return None
    _, vspec = _checked(entry, shape, dtype)
    return _host_bytes(vspec, frames[vspec.frame - 1])


def dense_spec(entry: TensorEntry, shape: tuple[int, ...], dtype: torch.dtype, exact_dtype: bool = True) -> BufferSpec | None:
    """A dense entry's VALUES buffer, once the entry passes every check ``decode_entry``
    makes before decoding (``exact_dtype`` as there); None for an entry of any other
    encoding, and for a buffer nvCOMP compressed (it decompresses on a GPU already)."""
    if entry.encoding is not Encoding.DENSE:
        return None
    _, vspec = _checked(entry, shape, dtype, exact_dtype)
    return None if vspec.codec is Codec.NVCOMP_LZ4 else vspec


def dense_bytes(key: int, spec: BufferSpec, frames: list[Buffer], dtype: torch.dtype) -> np.ndarray:
    """The bytes of a dense entry's values (``spec``: its ``dense_spec``) on the host, as
    ``decode_entry`` decodes them: a view of the frame when it is uncompressed, else
    decompressed and unshuffled (``IntegrityError`` for a frame that does not decompress
    to its announced size). For a bool target (``dtype``) the bytes are checked here, before
    they move: ``ProtocolError`` for any other than 0 and 1 (``StagedUpdate.stage``'s check
    of values it is given on the host)."""
    frame = frames[spec.frame - 1]
    raw = np.frombuffer(frame, dtype=np.uint8) if spec.codec is Codec.NONE else _decompressed(spec, frame, torch.device("cpu")).numpy()
    if dtype == torch.bool and raw.size and int(raw.max()) > 1:
        raise ProtocolError(f"tensor {key}: bool values other than 0 and 1")
    return raw


def _staged_dense(entry: TensorEntry, spec: BufferSpec, payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A dense entry's values from its bytes already on ``device`` (``dense_bytes``, moved
    with its message): a view of them at the wire's dtype and shape."""
    if payload.device != device or payload.dtype != torch.uint8 or tuple(payload.shape) != (spec.nbytes,):
        raise ConfigError(f"tensor {entry.key}: staged dense bytes of {payload.dtype}{list(payload.shape)} on {payload.device}, "
                         f"expected uint8[{spec.nbytes}] on {device}")
    return payload.view(dtype_from_code(spec.dtype)).reshape(spec.shape)


def _checked(entry: TensorEntry, shape: tuple[int, ...], dtype: torch.dtype, exact_dtype: bool = True) -> tuple[int, BufferSpec]:
    """``decode_entry``'s checks of ``entry`` against its target, before anything is
    decoded: the target's element count and the entry's VALUES buffer."""
    where = f"tensor {entry.key}"
    roles = {b.role for b in entry.buffers}
    if entry.encoding is Encoding.BLOCKS and entry.values is not ValueEncoding.ULP:
        raise ProtocolError(f"{where}: device-coded (BLOCKS) changes carry ULP values, not {entry.values.name}")
    wanted = _WANTED_ROLES[entry.encoding, entry.values]
    if roles != wanted:
        raise ProtocolError(f"{where}: {entry.encoding.name}/{entry.values.name} needs buffers {sorted(r.name for r in wanted)}")
    numel = math.prod(shape)
    vspec = entry.buffer(Role.VALUES)
    vdtype = dtype_from_code(vspec.dtype)
    if _is_blocks(entry.encoding, entry.values) and vspec.codec is not Codec.NONE:
        raise ProtocolError(f"{where}: a device-coded payload is never compressed (it came {vspec.codec.name})")
    if entry.encoding is Encoding.DENSE:
        if entry.values is not ValueEncoding.RAW or entry.nnz != numel or vspec.shape != tuple(shape):
            raise ProtocolError(f"{where}: dense values of shape {list(vspec.shape)}, target has {list(shape)}")
        convertible = not exact_dtype and vdtype.is_floating_point and dtype.is_floating_point
        if vdtype != dtype and not convertible:
            raise ProtocolError(f"{where}: values of dtype {vdtype} cannot load into {dtype}")
        return numel, vspec
    nnz = entry.nnz
    if not 0 < nnz <= numel:
        raise ProtocolError(f"{where}: {nnz} changes for a tensor of {numel} elements")
    for b in entry.buffers:  # bound every buffer by the target before decompressing anything
        allowed, limit = _buffer_rule(b.role, entry, dtype, numel)
        if dtype_from_code(b.dtype) not in allowed or len(b.shape) != 1 or b.shape[0] > limit:
            raise ProtocolError(
                f"{where}: {b.role.name.lower()} buffer {dtype_from_code(b.dtype)}{list(b.shape)}, expected {allowed} of at most {limit}"
            )
    if entry.values in (ValueEncoding.RAW, ValueEncoding.XOR) and vspec.shape != (nnz,):
        raise ProtocolError(f"{where}: {vspec.shape[0]} values for {nnz} changes")
    if _is_blocks(entry.encoding, entry.values) and vspec.shape[0] < devicecodec.min_nbytes(nnz):
        raise ProtocolError(f"{where}: a device payload of {vspec.shape[0]} bytes is too short for {nnz} changes")
    return numel, vspec


def _decode_blocks(
    entry: TensorEntry, spec: BufferSpec, frame: Buffer, numel: int, dtype: torch.dtype, device: torch.device, payload: torch.Tensor | None
) -> DecodedTensor:
    """A device-coded entry, decoded on ``device`` (no host sync): ``decode_blocks`` of one."""
    return _decode_payloads([(entry, _device_payload(entry, spec, frame, device, payload), numel, dtype)])[0]


def _device_payload(entry: TensorEntry, spec: BufferSpec, frame: Buffer, device: torch.device, payload: torch.Tensor | None) -> torch.Tensor:
    """A device-coded entry's payload on ``device``: ``payload`` when its message's transfer
    brought it there, else copied there alone (from pageable memory, staged at once; a CPU
    target reads its frame)."""
    if payload is None:
        return unpack_buffer(spec, frame, torch.device("cpu")).to(device, non_blocking=True)
    if payload.device != device or payload.dtype != torch.uint8 or tuple(payload.shape) != spec.shape:
        raise ConfigError(f"tensor {entry.key}: a staged payload of {payload.dtype}{list(payload.shape)} on {payload.device}, "
                         f"expected uint8{list(spec.shape)} on {device}")
    return payload


class BlocksEntry(NamedTuple):
    """A device-coded entry of a message and where it decodes: its target's shape (a group's
    or a span's: its elements end to end), dtype and device, and its payload already there
    (moved with its message, ``receiver/apply/transfer.py``), else None."""

    entry: TensorEntry
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    payload: torch.Tensor | None = None


def decode_blocks(items: Sequence[BlocksEntry], frames: list[Buffer]) -> list[DecodedTensor]:
    """A message's device-coded entries, each checked as ``decode_entry`` checks it, then
    decoded together: one ``devicecodec.decode_many`` a device, a fixed number of kernels
    whatever the entry count, no host sync. Each comes back with its ``verdict`` unread
    (the receiver reads a batch's at once: ``stage_coded``, receiver/apply/stage_device.py)."""
    decodable = []
    for item in items:
        numel, spec = _checked(item.entry, item.shape, item.dtype)
        if not _is_blocks(item.entry.encoding, item.entry.values):
            raise ConfigError(f"tensor {item.entry.key}: {item.entry.encoding.name} is not device-coded")
        payload = _device_payload(item.entry, spec, frames[spec.frame - 1], item.device, item.payload)
        decodable.append((item.entry, payload, numel, item.dtype))
    return _decode_payloads(decodable)


def _decode_payloads(items: Sequence[tuple[TensorEntry, torch.Tensor, int, torch.dtype]]) -> list[DecodedTensor]:
    """Checked device-coded entries and their payloads, decoded a device at once."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, payload, _, _) in enumerate(items):
        by_device.setdefault(payload.device, []).append(i)
    out: list[DecodedTensor | None] = [None] * len(items)
    for members in by_device.values():
        buffer, starts = devicecodec.join([items[i][1] for i in members])
        targets = [devicecodec.Target(items[i][0].nnz, items[i][2], items[i][3]) for i in members]
        for i, d in zip(members, devicecodec.decode_many(buffer, starts, [items[i][1].numel() for i in members], targets)):
            out[i] = DecodedTensor(items[i][0].key, d.flat, d.diffs, ValueEncoding.ULP, Verdict(d.ok, d.intact, d.batch, d.at))
    return [d for d in out if d is not None]


def at_span(decoded: DecodedTensor, span: Span) -> DecodedTensor:
    """A span entry's update (``decode_entry`` of its 1-D target of ``span.numel`` elements,
    its positions relative to the span) in its tensor's flat coordinates: sparse positions
    mapped (``Span.positions``: moved up by lo, or placed in their runs), where they are (on
    a device, with no host sync); a dense one's values as the changes at every position the
    span covers (an index a value, on the values' device), RAW. Read the old values a sparse
    one is relative to only after this: at its tensor's positions."""
    if decoded.flat is not None:
        return dataclasses.replace(decoded, flat=span.positions(decoded.flat))
    values = decoded.values.reshape(-1)
    if values.numel() != span.numel:  # decode_entry checked it against (span.numel,)
        raise ConfigError(f"tensor {decoded.key}: {values.numel()} dense values for a span of {span.numel}")
    return dataclasses.replace(decoded, flat=span.indices(values.device), values=values, encoding=ValueEncoding.RAW)


def group_offsets(shapes: Sequence[tuple[int, ...]]) -> np.ndarray:
    """Where each tensor of a group starts in its run (the elements end to end), and the run's end."""
    return np.cumsum([0, *(math.prod(s) for s in shapes)])


def split_group(decoded: DecodedTensor, group: tuple[int, ...], shapes: list[tuple[int, ...]]) -> list[DecodedTensor]:
    """A grouped entry's decoded run (``decode_entry`` of a 1-D target of all the group's
    elements) as one update per tensor of ``group`` (of ``shapes``): every tensor for a
    dense run, those with changes for a sparse one (whose positions are sorted). The
    receiver splits no device-coded run here: it stages those with the rest of their batch,
    their cut points read with their verdicts (``receiver/apply/stage_device.py``)."""
    offsets = group_offsets(shapes)
    if decoded.flat is None:
        values = decoded.values.reshape(-1)
        return [
            DecodedTensor(k, None, values[offsets[i]:offsets[i + 1]].view(shapes[i]), decoded.encoding, checked=decoded.checked)
            for i, k in enumerate(group)
        ]
    flat, values = decoded.flat, decoded.values
    host = flat.numpy() if flat.device.type == "cpu" else None  # numpy's calls cost a fraction of torch's, per member
    cuts = (np.searchsorted(host, offsets) if host is not None else torch.searchsorted(flat, torch.from_numpy(offsets).to(flat.device))).tolist()
    pieces = []
    for i, k in enumerate(group):
        start, end = cuts[i], cuts[i + 1]
        if end > start:
            local = torch.from_numpy(host[start:end] - offsets[i]) if host is not None else flat[start:end] - int(offsets[i])
            pieces.append(DecodedTensor(k, local, values[start:end], decoded.encoding, decoded.verdict))
    return pieces


def _is_packed(encoding: Encoding, values: ValueEncoding) -> bool:
    """ANS_GAPS positions with ULP values travel as one uint8 VALUES buffer (protocol/codec/packed.py)."""
    return encoding is Encoding.ANS_GAPS and values is ValueEncoding.ULP


def is_blocks(entry: TensorEntry) -> bool:
    """Whether ``entry`` is device-coded (``decode_blocks`` decodes it)."""
    return _is_blocks(entry.encoding, entry.values)


def _is_blocks(encoding: Encoding, values: ValueEncoding) -> bool:
    """A device-coded entry: gaps and ULP values in one uint8 VALUES buffer (protocol/codec/devicecodec.py)."""
    return encoding is Encoding.BLOCKS and values is ValueEncoding.ULP


def _roles(encoding: Encoding, values: ValueEncoding) -> frozenset[Role]:
    if _is_packed(encoding, values) or _is_blocks(encoding, values):
        return frozenset({Role.VALUES})
    return _POSITION_ROLES[encoding] | _VALUE_ROLES[values]


_WANTED_ROLES = {(e, v): _roles(e, v) for e in Encoding for v in ValueEncoding}


def _host_bytes(spec: BufferSpec, frame: Buffer) -> np.ndarray:
    """A buffer's bytes as a host uint8 array (a view of the frame when it is uncompressed)."""
    if spec.codec is Codec.NONE:
        return np.frombuffer(frame, dtype=np.uint8)
    return unpack_buffer(spec, frame, torch.device("cpu")).numpy()


def positions_of_gaps(gaps: torch.Tensor, numel: int) -> torch.Tensor:
    """Sorted flat positions from untrusted int64 zero-run ``gaps``, in place, in one pass
    (``positions.decode_positions`` makes five: max, +1, cumsum, -1, last); ``ProtocolError``
    for a negative gap or a position past ``numel``."""
    if gaps.numel() and not packed.positions_into(gaps.numpy(), numel, gaps.numpy()):
        raise ProtocolError(f"gaps run past the tensor's {numel} elements (or are negative)")
    return gaps


def _buffer_rule(role: Role, entry: TensorEntry, dtype: torch.dtype, numel: int) -> tuple[tuple[torch.dtype, ...], int]:
    """The dtypes a sparse entry's buffer may have, and its most elements."""
    nnz = entry.nnz
    if role is Role.VALUES and _is_packed(entry.encoding, entry.values):
        return (torch.uint8,), packed.max_nbytes(nnz)  # the packed buffer
    if role is Role.VALUES and _is_blocks(entry.encoding, entry.values):
        return (torch.uint8,), devicecodec.max_nbytes(nnz, numel, dtype)  # the device payload
    if role is Role.VALUES:
        if entry.values is ValueEncoding.ULP:
            return (torch.uint16,), nnz + rans.FLUSH_WORDS  # rANS: at most one word a symbol, plus the states
        return ((_bits_of(dtype) if entry.values is ValueEncoding.XOR else dtype),), nnz
    if role is Role.POSITIONS and entry.encoding is Encoding.ANS_GAPS:
        return (torch.uint16,), nnz + rans.FLUSH_WORDS
    if role is Role.POSITIONS and entry.encoding is Encoding.BITMAP:
        return (torch.uint8,), math.ceil(numel / 8)
    if role is Role.LOW_BITS:
        return (torch.uint8,), math.ceil(nnz * entropy.MAX_K / 8)
    if role is Role.POSITION_MODEL:
        return (torch.int64,), 1 + entropy.HIGH_SYMBOLS
    if role is Role.VALUE_MODEL:
        return (torch.int64,), entropy.VALUE_SYMBOLS
    if role is Role.POSITION_ESCAPES:
        return (torch.int64,), nnz
    if role is Role.VALUE_EXTRA:
        return (torch.uint8,), math.ceil(nnz * 63 / 8)
    return UNSIGNED_INDEX_DTYPES, nnz  # rows, cols and raw gaps: one per change
