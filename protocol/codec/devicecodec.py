"""The device codec: a tensor's sparse changes as one uint8 payload, coded and decoded by
batched torch operations on the tensors' own device (CUDA in production, CPU in tests).

The host codec (``packed``: rANS in numba) gets the fewest bytes but codes one change after
another on the CPU. Here every change and every block is coded at once: no loop over blocks
or changes, no numba, one host sync per encode (the payload's size, to allocate it) and
none per decode, which returns its verdict as a device tensor for the caller to read once.

Symbols. Each change gives one symbol ``u`` (a 64-bit pattern in int64) to each of two
streams: gaps (``u`` = position - previous position, the first one's previous being -1)
and values (``u`` = the zigzag of ``new_bits - old_bits`` wrapped to the dtype's width W).
A valid change has ``u >= 1`` in both (positions ascend; a change differs).

Blocks. The changes split into blocks of ``BLOCK`` (the last one shorter). Each block of
each stream has a low width ``b`` and an escape width ``h`` (0..64), chosen to minimise
its bits: every change stores a ``b``-bit field, ``u - 1`` when it is below ``2**b - 1``,
else the escape code ``2**b - 1`` (all of them escape at ``b = 0``, none at 64), and each
escaped change stores the rest, ``u - 2**b``, in ``h`` bits in its block's escape section,
in order. A patched frame of reference whose exceptions cost no index: the few long gaps
or large value moves do not widen their whole block. Any 64-bit symbol codes faithfully,
so a sender's bad positions reach the decoder as they are, and it refuses them.

Bytes are little-endian (the byte order of every CUDA and x86/ARM host torch runs on)::

    0   u64  checksum of bytes 8.. (``checksum``)
    8   u8   format version (1)
    9   u8   log2(BLOCK)
    10  u8   W, the value width in bits (8, 16, 32 or 64)
    11  u8 x 5  zero
    16  u64  nnz
    24  the block table: four planes of nblocks = ceil(nnz / BLOCK) bytes each: the gap
        stream's b, its h, the value stream's b, its h
    then one bit stream, least significant bit first within each little-endian u64 word:
        gap lows (block by block), gap escapes, value lows, value escapes, then zero bits
        to the end of the last byte.

The table holds widths only. Each block's bit offset is an exclusive prefix sum of
``n_j * b_j`` (lows) or ``E_j * h_j`` (escapes, ``E_j`` counted from the block's escape
codes), computed by the decoder in one ``cumsum``; storing the offsets would cost 32 bits
a block (~0.25 bit a change at 128 changes a block) and have to be checked anyway.

The packed bytes are contiguous and byte-aligned after the table, so an nvCOMP stage
(Cascaded or ANS) can compress the whole payload or the bit stream alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.errors import ConfigError, ProtocolError

VERSION = 1
# Changes a block, a power of two (the header stores its log2). 128 codes the real bf16 steps of
# ``python -m benchmarks.device_codec`` in the fewest bytes (64: +0.3-1%, 256: +0.2-1.3%, 512:
# +1-3.5%); uniform synthetic changes would take 512 (-1.5%): wider blocks halve the table.
BLOCK = 128
HEADER = 24  # bytes before the block table
PLANES = 4  # table bytes a block: b and h of each stream
_MOD = (1 << 31) - 1  # the checksum's prime modulus
_CHUNK = 1 << 15  # products the checksum sums before a remainder
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width signed views: differences wrap in them


# -- 64-bit patterns in int64 ----------------------------------------------------------------
# Shift amounts stay within 0..63 (what a shift by 64 gives differs between backends).
def _mask(width: torch.Tensor) -> torch.Tensor:
    """``2**width - 1`` for widths 0..64 (all ones at 64, where the product wraps to 0)."""
    half = width >> 1
    return ((1 << half) << (width - half)) - 1


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of each unsigned 64-bit pattern (0 for 0, 64 with the top bit set). float64
    rounds a pattern from ``2**53`` on up to one bit too many; one compare corrects it."""
    est = _length_estimate(x).clamp_(max=63)
    est -= ((x < (1 << (est - 1).clamp_(min=0))) & (est > 0)).long()
    return est.masked_fill_(x < 0, 64)


def _length_estimate(x: torch.Tensor) -> torch.Tensor:
    """``_bit_length`` of non-negative patterns, exact below ``2**53``, at most one too many
    above: enough to choose widths (which fields escape is decided exactly)."""
    return torch.frexp(x.to(torch.float64))[1].to(torch.int64)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


# -- layout shared by both directions ---------------------------------------------------------
@dataclass(frozen=True)
class _Blocks:
    """Changes as a [blocks, BLOCK] grid, the last block padded; each block's length."""

    nnz: int
    block: int
    sizes: torch.Tensor  # [nblocks] changes a block
    lane: torch.Tensor  # [1, block]: a change's place in its block

    @classmethod
    def of(cls, nnz: int, block: int, device: torch.device) -> _Blocks:
        nblocks = -(-nnz // block)
        sizes = (nnz - torch.arange(nblocks, device=device) * block).clamp_(max=block)
        return cls(nnz, block, sizes, torch.arange(block, device=device)[None, :])

    @property
    def count(self) -> int:
        return self.sizes.numel()

    @property
    def padding(self) -> int:
        return self.count * self.block - self.nnz

    def grid(self) -> torch.Tensor:
        """Zeros for one int64 a change, as [blocks, BLOCK] (the padding stays 0)."""
        return torch.zeros(self.count, self.block, dtype=torch.int64, device=self.sizes.device)

    def clear_padding(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a grid) with the padding zeroed, in place: no work on the other blocks."""
        if self.padding:
            x[-1, self.block - self.padding :].zero_()  # a kernel (assigning a Python 0 makes a host tensor first)
        return x


def _low_at(blocks: _Blocks, b: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit offsets of a stream's low fields (block after block from bit ``start``), and the bit after them."""
    sizes = blocks.sizes * b
    return (start + _exclusive_cumsum(sizes))[:, None] + blocks.lane * b[:, None], start + sizes.sum()


def _high_at(blocks: _Blocks, h: torch.Tensor, escaped: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit offsets of the escape fields from bit ``start``, each block's escapes in order
    (a change that did not escape gets the next one's offset and writes nothing), and the bit after them."""
    rank = escaped.cumsum(1)
    sizes = rank[:, -1] * h
    rank -= escaped.long()  # escapes before it in its block
    return (start + _exclusive_cumsum(sizes))[:, None] + rank * h[:, None], start + sizes.sum()


# -- encode -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Coded:
    """One stream, coded: each block's widths, each change's fields (grids)."""

    b: torch.Tensor  # [nblocks]
    h: torch.Tensor  # [nblocks]
    low: torch.Tensor  # the b-bit field
    escaped: torch.Tensor  # bool
    high: torch.Tensor  # the h-bit field (0 where not escaped)


def _choose_widths(v: torch.Tensor, length: torch.Tensor, blocks: _Blocks, top_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's (b, h) of fewest bits ``n*b + E(b)*h(b)``, every b in 0..``top_width`` at
    once: E(b) from a histogram of the symbols' bit ``length`` (a field ``v`` escapes at b
    below its length; the padding's length 0 never does), h(b) the bit length of the largest
    escape field (estimated while choosing, exact for the choice). Symbols longer than
    ``top_width`` (only where they are invalid) still code, as escapes."""
    nb, candidates = blocks.count, top_width + 1
    counts = torch.zeros(nb, candidates, dtype=torch.int64, device=v.device)
    counts.scatter_add_(1, length.clamp(max=top_width), counts.new_ones(1, 1).expand_as(length))
    escapes = counts.flip(1).cumsum(1).flip(1)  # [:, L]: symbols of length >= L
    escapes = torch.cat([escapes[:, 1:], escapes.new_zeros(nb, 1)], 1)  # [:, b]: length > b
    low = torch.iinfo(torch.int64).min
    top = (v ^ low).amax(1) ^ low  # the unsigned maximum: flipping the top bit orders patterns as unsigned
    widths = torch.arange(candidates, device=v.device)
    over = top[:, None] - _mask(widths)
    h = _length_estimate(over).masked_fill_(over < 0, 64).masked_fill_(escapes == 0, 0)
    b = (blocks.sizes[:, None] * widths + escapes * h).argmin(1)  # the first minimum: the narrowest
    over = top - _mask(b)
    escaping = _escapes(top + 1, b)  # exactly: the largest field is >= 2**b - 1
    return b, torch.where(escaping, _bit_length(over), 0)


def _escapes(u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether a symbol ``u`` (its field ``u - 1``) escapes at width ``b`` (broadcast):
    ``u - 1 >= 2**b - 1`` unsigned, so ``u >= 2**b`` or ``u = 0`` (a field of all ones), below 64."""
    return (((u >> b.clamp(max=63)) != 0) | (u == 0)) & (b < 64)


def _code(u: torch.Tensor, blocks: _Blocks, top_width: int) -> _Coded:
    """A stream of symbols ``u`` (a grid, padding 0) coded block by block, at widths up to
    ``top_width`` (what the valid symbols need). Every 64-bit pattern codes faithfully (a 0
    too: the decoder, not the coder, refuses what is invalid)."""
    v = blocks.clear_padding(u - 1)
    length = blocks.clear_padding(_length_estimate(u).masked_fill_(u <= 0, 64))
    b, h = _choose_widths(v, length, blocks, top_width)
    escaped = blocks.clear_padding(_escapes(u, b[:, None]))
    low = torch.where(escaped, _mask(b)[:, None], v)
    high = torch.where(escaped, v - _mask(b)[:, None], 0)
    return _Coded(b, h, low, escaped, high)


def _put_bits(words: torch.Tensor, at: torch.Tensor, value: torch.Tensor) -> None:
    """OR fields ``value`` (already masked to their widths) into ``words`` at bit ``at``. The
    fields are disjoint, so adding is OR-ing, and integer adds are deterministic. The part
    of a field past its first word goes to the next (zero bits when nothing spills)."""
    at, value = at.reshape(-1), value.reshape(-1)
    k, s = at >> 6, at & 63
    words.index_add_(0, k, value << s)
    spill = ((value >> 1) & torch.iinfo(torch.int64).max) >> (63 - s)  # a logical shift by 64 - s, 0 at s = 0
    words[1:].index_add_(0, k, spill)


def _header(width: int, nnz: int, block: int, device: torch.device) -> torch.Tensor:
    """Bytes 8..24 of a payload (all but the checksum), made on the device: a tensor made
    from host data would be a blocking host-to-device copy, which waits for the device."""
    fields = VERSION | (block.bit_length() - 1) << 8 | width << 16
    return torch.cat([torch.full((1,), value, dtype=torch.int64, device=device) for value in (fields, nnz)]).view(torch.uint8)


@dataclass(frozen=True)
class Encoded:
    """A coded payload (uint8, on the changes' device) and its checksum (0-dim int64)."""

    payload: torch.Tensor
    checksum: torch.Tensor


def value_width(dtype: torch.dtype) -> int:
    """Bits of a dtype's values (its storage: a bool is a byte)."""
    return 8 * torch.empty((), dtype=dtype).element_size()


def differences(new_bits: torch.Tensor, old_bits: torch.Tensor) -> torch.Tensor:
    """``new - old`` of the bit patterns, wrapped to their width, sign-extended to int64."""
    ints = _INT[new_bits.element_size()]
    return (new_bits.view(ints) - old_bits.view(ints)).to(torch.int64)


def _symbols(flat: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, blocks: _Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The gap and value symbols of the changes, as grids (written in place: no copies)."""
    gaps, values = blocks.grid(), blocks.grid()
    line = gaps.view(-1)
    if blocks.nnz:
        line[:1] = flat[:1] + 1
        torch.sub(flat[1:], flat[:-1], out=line[1 : blocks.nnz])
    d = differences(new_bits, old_bits)
    torch.bitwise_xor(d << 1, d >> 63, out=values.view(-1)[: blocks.nnz])  # zigzag
    return gaps, values


@dataclass(frozen=True)
class Prepared:
    """Changes coded up to their size: every field and its bit offset on the device, and the
    payload's bit count (``nbits``, a 0-dim device tensor) for the caller to read. Reading
    the ``nbits`` of many ``Prepared`` at once (``sizes``) is what makes a part one sync."""

    nnz: int
    block: int
    width: int
    body: int  # bytes before the bit stream: header and block table
    table: torch.Tensor  # the four width planes, int64
    fields: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (bit offsets, values)
    nbits: torch.Tensor

    def nbytes(self, nbits: int) -> int:
        """The payload's size once ``nbits`` (``self.nbits``, read) is known."""
        return self.body + (nbits + 7) // 8

    def write(self, payload: torch.Tensor) -> torch.Tensor:
        """Write the payload into uint8 ``payload`` (exactly ``nbytes`` long, any offset of a
        larger buffer) and seal it; returns its checksum. No host sync."""
        device, nbytes = payload.device, payload.numel()
        # two words past the end, and a block of 64-bit fields: the padding's fields (zeros) land there
        words = torch.zeros((nbytes - self.body) // 8 + 2 + self.block, dtype=torch.int64, device=device)
        for at, value in self.fields:
            _put_bits(words, at, value)
        payload[8:HEADER] = _header(self.width, self.nnz, self.block, device)
        payload[HEADER : self.body] = self.table.to(torch.uint8)
        payload[self.body :] = words.view(torch.uint8)[: nbytes - self.body]
        return seal(payload)


def prepare(flat: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, *, block: int = BLOCK) -> Prepared:
    """``encode`` up to the payload's size, with no host sync (see ``Prepared``)."""
    if flat.dim() != 1 or new_bits.shape != flat.shape or old_bits.shape != flat.shape or new_bits.dtype != old_bits.dtype:
        raise ConfigError(f"changes of {list(flat.shape)} positions, {list(new_bits.shape)} new and {list(old_bits.shape)} old values")
    if block < 1 or block & (block - 1):
        raise ConfigError(f"block size {block} is not a power of two")
    nnz, device = flat.numel(), flat.device
    blocks = _Blocks.of(nnz, block, device)
    width = value_width(new_bits.dtype)
    gap_symbols, value_symbols = _symbols(flat, new_bits, old_bits, blocks)
    gaps, values = _code(gap_symbols, blocks, 64), _code(value_symbols, blocks, width)
    bit = torch.zeros((), dtype=torch.int64, device=device)  # where the next section starts
    fields = []  # (bit offset, value) of every field
    for coded in (gaps, values):
        low_at, bit = _low_at(blocks, coded.b, bit)
        high_at, bit = _high_at(blocks, coded.h, coded.escaped, bit)
        fields += [(low_at, coded.low), (high_at, coded.high)]
    table = torch.cat([gaps.b, gaps.h, values.b, values.h])
    return Prepared(nnz, block, width, HEADER + PLANES * blocks.count, table, tuple(fields), bit)


def encode(flat: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, *, block: int = BLOCK) -> Encoded:
    """The payload of changes at ascending int64 ``flat`` whose values go from ``old_bits``
    to ``new_bits`` (any dtype: its bit patterns are coded). One host sync: the size."""
    prepared = prepare(flat, new_bits, old_bits, block=block)
    payload = torch.empty(prepared.nbytes(int(prepared.nbits)), dtype=torch.uint8, device=flat.device)  # the one host sync
    return Encoded(payload, prepared.write(payload))


ALIGN = 8  # a part's payloads each start at a multiple of this many bytes (``aligned``)


def sizes(prepared: list[Prepared]) -> list[int]:
    """The payload sizes of ``prepared`` (all on one device), read in one host sync."""
    if not prepared:
        return []
    bits = torch.stack([p.nbits for p in prepared]).to("cpu", copy=True).tolist()  # the one host sync
    return [p.nbytes(n) for p, n in zip(prepared, bits)]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


# -- checksum ---------------------------------------------------------------------------------
def checksum(data: torch.Tensor) -> torch.Tensor:
    """A 62-bit Fletcher-style sum of uint8 ``data``, as a 0-dim int64 on its device.

    Over the 16-bit little-endian words ``w_i`` (a zero byte pads an odd length), modulo
    the prime ``p = 2**31 - 1``: ``A = (len + sum w_i) mod p`` and ``B = sum (i + 1) w_i
    mod p``; the sum is ``B << 32 | A``. A word changes by less than ``p``, so every error
    confined to one or two words (any burst of up to 17 bits, any swap of two words) and
    every change of length is caught, for payloads under 4 GiB; random corruption beyond
    that passes with probability about ``2**-62``. It guards against corruption, not
    forgery: anyone can recompute it (CURVE authenticates the link)."""
    n = data.numel()
    if n % 2 or data.storage_offset() % 2:
        data = torch.cat([data, data.new_zeros(n % 2)])
    w = data.view(torch.int16).to(torch.int64) & 0xFFFF
    weights = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=data.device)
    if w.numel() >= _MOD:
        weights %= _MOD
    # w * weight < 2**47: sums of 2**15 of them stay below 2**62 before their remainder
    chunks = -(-w.numel() // _CHUNK)
    products = torch.zeros(chunks * _CHUNK, dtype=torch.int64, device=data.device)
    products[: w.numel()] = w * weights
    a = (w.sum() + n) % _MOD
    b = (products.view(chunks, _CHUNK).sum(1) % _MOD).sum() % _MOD
    return (b << 32) | a


def seal(payload: torch.Tensor) -> torch.Tensor:
    """Write the checksum of ``payload[8:]`` into its first 8 bytes; returns it."""
    total = checksum(payload[8:])
    payload[:8] = total.reshape(1).view(torch.uint8)
    return total


# -- decode -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoded:
    """Decoded changes and the device's verdict on them.

    ``flat`` (int64, ascending when ``ok``) always lies in ``[0, numel)``, so a scatter
    never goes out of bounds even for a hostile payload; ``diffs`` are the value
    differences (int64, sign-extended from W bits) for ``apply_differences``. ``ok`` is a
    0-dim bool tensor: False for any payload the encoder could not have produced for
    these ``nnz``, ``numel`` and dtype, or whose checksum is wrong. Read it once (one host
    sync) before committing anything. ``intact`` (0-dim bool) is the checksum's part of
    that verdict alone: False says the bytes were damaged, not merely wrong."""

    flat: torch.Tensor
    diffs: torch.Tensor
    ok: torch.Tensor
    intact: torch.Tensor

    def raise_unless_ok(self, what: str = "device payload") -> None:
        """``ProtocolError`` unless the verdict is True (one host sync)."""
        if not bool(self.ok):
            raise ProtocolError(f"{what}: bad block table, widths, sizes, positions or checksum")


def _get_bits(words: torch.Tensor, at: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The ``width``-bit fields at bit ``at``; offsets past the words read clamped words."""
    k, s = (at >> 6).clamp_(0, words.numel() - 2), at & 63
    pair = words.unfold(0, 2, 1)[k]  # the field's word and the next
    first, second = pair[..., 0], pair[..., 1]
    # first >> s fills the top s bits with first's sign; xor-ing that sign into the next
    # word's bits before they move up cancels it, so the two halves join as a logical shift
    spill = ((second ^ (first >> 63)) << 1) << (63 - s)
    return ((first >> s) ^ spill) & _mask(width)


def _read_stream(
    words: torch.Tensor, blocks: _Blocks, b: torch.Tensor, h: torch.Tensor, start: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream's symbols ``u`` (a grid) and the bit after it. Lows first: they say which changes escaped."""
    low_at, high_start = _low_at(blocks, b, start)
    low = _get_bits(words, low_at, b[:, None])
    escaped = blocks.clear_padding((low == _mask(b)[:, None]) & (b < 64)[:, None])
    high_at, end = _high_at(blocks, h, escaped, high_start)
    high = _get_bits(words, high_at, h[:, None])  # read where nothing escaped too, and dropped
    return torch.where(escaped, (1 << b.clamp(max=63))[:, None] + high, low + 1), end


def _values_fit(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether every zigzagged difference is one the encoder makes for ``dtype``: not 0,
    within its width, and +-1 for a bool."""
    width = value_width(dtype)
    if width == 64:
        return (values != 0).all()
    top = 2 if dtype == torch.bool else (1 << width) - 1
    return ((values > 0) & (values <= top)).all()


def _empty(device: torch.device) -> Decoded:
    none, no = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.bool, device=device)
    return Decoded(none, none, no, no)


def min_nbytes(nnz: int, *, block: int = BLOCK) -> int:
    """The fewest bytes a payload of ``nnz`` changes takes: its header and block table."""
    return HEADER + PLANES * -(-nnz // block)


def max_nbytes(nnz: int, numel: int, dtype: torch.dtype, *, block: int = BLOCK) -> int:
    """The most bytes a payload of ``nnz`` changes to a target of ``numel`` elements of
    ``dtype`` can take (every field at the widest width the decoder allows, each change
    escaping): a bound on what a receiver copies before the decoder judges it."""
    bits = 2 * nnz * (numel.bit_length() + value_width(dtype))
    return min_nbytes(nnz, block=block) + -(-bits // 8)


def decode(payload: torch.Tensor, nnz: int, numel: int, dtype: torch.dtype, *, block: int = BLOCK) -> Decoded:
    """Changes of an untrusted ``payload`` (uint8, on the target's device) for a target of
    ``numel`` elements of ``dtype``; no host sync. What the host already knows to be wrong
    (a payload too short for its table, more changes than elements) comes back empty and
    not ok; everything else is checked on the device into ``Decoded.ok``."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ProtocolError(f"device payload of {payload.dtype}{list(payload.shape)}, expected uint8 bytes")
    if not 0 <= numel < 1 << 62:
        raise ConfigError(f"a target of {numel} elements")
    device, width = payload.device, value_width(dtype)
    body = min_nbytes(nnz, block=block)
    if not 0 <= nnz <= numel or payload.numel() < body:  # before allocating anything nnz long
        return _empty(device)
    blocks = _Blocks.of(nnz, block, device)
    table, widths_fit = _table(payload[HEADER:body], blocks.count, numel, width)
    words = _words(payload[body:])
    gaps, end = _read_stream(words, blocks, table[0], table[1], torch.zeros((), dtype=torch.int64, device=device))
    values, end = _read_stream(words, blocks, table[2], table[3], end)
    gaps, values = gaps.view(-1)[:nnz], values.view(-1)[:nnz]
    flat = torch.cumsum(gaps.clamp(1, max(numel, 1)), 0) - 1
    intact = checksum(payload[8:]) == payload[:8].clone().view(torch.int64)[0]
    checks = [
        intact,
        (payload[8:HEADER] == _header(width, nnz, block, device)).all(),
        widths_fit,
        body + (end + 7) // 8 == payload.numel(),
        _get_bits(words, end.reshape(1), (-end).reshape(1) % 8)[0] == 0,  # the last byte's padding
        ((gaps >= 1) & (gaps <= numel)).all(),
        (flat < numel).all(),  # with every gap in 1..numel < 2**62, no sum wraps unseen
        _values_fit(values, dtype),
    ]
    diffs = ((values >> 1) & torch.iinfo(torch.int64).max) ^ -(values & 1)  # unzigzag
    return Decoded(flat.clamp_(0, max(numel - 1, 0)), diffs, torch.stack(checks).all(), intact)


def _table(planes: torch.Tensor, count: int, numel: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table as [4, blocks] int64, each width clamped to what the target allows
    (a gap to ``numel``'s bit length, a value to ``width``), and whether none needed it."""
    table = planes.to(torch.int64).view(PLANES, count)
    limits = torch.where(torch.arange(PLANES, device=planes.device) < 2, numel.bit_length(), width)[:, None]
    return torch.minimum(table, limits), (table <= limits).all()


def _words(stream: torch.Tensor) -> torch.Tensor:
    """The bit stream's bytes as int64 words, zero-padded, with a spare word for reads past the end."""
    words = torch.zeros(-(-stream.numel() // 8) + 2, dtype=torch.int64, device=stream.device)
    words.view(torch.uint8)[: stream.numel()] = stream
    return words


def apply_differences(old_bits: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """New values from the old ones (any dtype, read as bit patterns) and ``diffs``:
    ``old + diff`` wrapped to the dtype's width, in ``old_bits``' dtype (a bool stays 0 or
    1 whatever the differences)."""
    ints = _INT[old_bits.element_size()]
    new = old_bits.view(ints).to(torch.int64) + diffs
    if old_bits.dtype == torch.bool:
        return (new & 1).to(torch.bool)
    return new.to(ints).view(old_bits.dtype)
