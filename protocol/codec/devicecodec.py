"""The device codec: a tensor's sparse changes as one uint8 payload, coded and decoded by
batched torch operations on the tensors' own device (CUDA in production, CPU in tests).

The host codec (``packed``: rANS in numba) gets the fewest bytes but codes one change after
another on the CPU. Here every change and every block of every entry of a part is coded at
once (``prepare``, ``decode_many``): no loop over entries, blocks or changes, no numba. On a
GPU each torch op is a kernel launch costing 5-10 us of host time, so a part costs a fixed
number of launches whatever its entry count (``python -m benchmarks.device_ops`` counts
them), one host sync to encode (the payloads' sizes, to place them) and none to decode,
which returns its verdicts as device tensors for the caller to read once.

Symbols. Each change gives one symbol ``u`` (a 64-bit pattern in int64) to each of two
streams: gaps (``u`` = position - previous position, the first one's previous being -1)
and values (``u`` = the zigzag of ``new_bits - old_bits`` wrapped to the dtype's width W).
A valid change has ``u >= 1`` in both (positions ascend; a change differs).

Blocks. An entry's changes split into blocks of ``BLOCK`` (the last one shorter). Each block
of each stream has a low width ``b`` and an escape width ``h`` (0..64), chosen to minimise
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

Batches. A part's entries are laid out as one grid of blocks (each entry's blocks after the
previous entry's, its last block padded), so one set of ops codes them all: per-entry sums
(bit offsets, positions from gaps, checksums) are prefix sums over the whole batch less each
entry's base, and per-entry verdicts are failures counted into a bin an entry (``index_add_``
in 1-D: deterministic on CUDA too). What the host knows (entry sizes, where payloads lie)
goes to the device as one int64 array a step (``ship``), never as a host read.

The packed bytes are contiguous and byte-aligned after the table, so an nvCOMP stage
(Cascaded or ANS) can compress the whole payload or the bit stream alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.errors import ConfigError, ProtocolError

VERSION = 1
# Changes a block, a power of two (the header stores its log2). 128 codes the real bf16 steps of
# ``python -m benchmarks.device_codec`` in the fewest bytes (64: +0.3-1%, 256: +0.2-1.3%, 512:
# +1-3.5%); uniform synthetic changes would take 512 (-1.5%): wider blocks halve the table.
BLOCK = 128
HEADER = 24  # bytes before the block table
PLANES = 4  # table bytes a block: b and h of each stream
ALIGN = 8  # every payload of a batch starts at a multiple of this many bytes (``aligned``)
_MOD = (1 << 31) - 1  # the checksum's prime modulus
_CHUNK = 1 << 15  # products the checksum sums before a remainder
_TOP = 64  # the widest field
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


def _escapes(u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether a symbol ``u`` (its field ``u - 1``) escapes at width ``b`` (broadcast):
    ``u - 1 >= 2**b - 1`` unsigned, so ``u >= 2**b`` or ``u = 0`` (a field of all ones), below 64."""
    return (((u >> b.clamp(max=63)) != 0) | (u == 0)) & (b < 64)


def value_width(dtype: torch.dtype) -> int:
    """Bits of a dtype's values (its storage: a bool is a byte)."""
    return 8 * dtype.itemsize


def differences(new_bits: torch.Tensor, old_bits: torch.Tensor) -> torch.Tensor:
    """``new - old`` of the bit patterns, wrapped to their width, sign-extended to int64."""
    ints = _INT[new_bits.element_size()]
    return (new_bits.view(ints) - old_bits.view(ints)).to(torch.int64)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slack(block: int = BLOCK) -> int:
    """Bytes a batch's buffer holds past its last payload: a padding lane's field (all zero)
    is added up to a block of 64-bit fields past its stream's end (``PreparedBatch.write``)."""
    return 8 * (block + 2)


def ship(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host-known int64 arrays on ``device`` in one copy, from pinned memory and not waited
    for (a tensor made from host data, ``torch.tensor``, is a blocking copy: it waits for the device)."""
    flat = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    host = torch.empty(sum(a.size for a in flat), dtype=torch.int64, pin_memory=device.type == "cuda")
    if host.numel():
        np.concatenate(flat, out=host.numpy())
    if device.type != "cpu":
        host = host.to(device, non_blocking=True)
    return list(host.split([a.size for a in flat]))


# -- layout shared by both directions ---------------------------------------------------------
class _Layout:
    """Entries' changes as one grid of blocks, as the host knows it (numpy): entry ``e``'s
    ``nnz[e]`` changes fill ``count[e]`` blocks from block ``first[e]`` (its last block
    padded), and are changes ``start[e]..`` of the batch's concatenation."""

    def __init__(self, nnz: Sequence[int] | np.ndarray, block: int) -> None:
        self.block = block
        self.nnz = np.asarray(nnz, dtype=np.int64).reshape(-1)
        self.count = -(-self.nnz // block)
        self.first = np.cumsum(self.count) - self.count
        self.start = np.cumsum(self.nnz) - self.nnz
        self.blocks, self.changes = int(self.count.sum()), int(self.nnz.sum())
        self.entry_of_block = np.repeat(np.arange(len(self.nnz)), self.count)
        self.sizes = np.full(self.blocks, block, dtype=np.int64)  # changes a block
        busy = self.count > 0
        self.sizes[(self.first + self.count - 1)[busy]] = (self.nnz - block * (self.count - 1))[busy]
        self.first_of_block = self.first[self.entry_of_block]

    @property
    def entries(self) -> int:
        return len(self.nnz)

    def body(self) -> np.ndarray:
        """Bytes before each entry's bit stream: header and block table."""
        return HEADER + PLANES * self.count

    def table_at(self, starts: np.ndarray) -> np.ndarray:
        """[PLANES, blocks] byte offsets of each block's table bytes, payloads at ``starts``."""
        e = self.entry_of_block
        local = np.arange(self.blocks) - self.first_of_block
        return (starts[e] + HEADER + local)[None, :] + np.arange(PLANES)[:, None] * self.count[e][None, :]


class _Grid(_Layout):
    """A ``_Layout`` on ``device``: what the host knows shipped in one copy (``extra`` host
    arrays with it), and each change's entry and place in the grid, computed there."""

    def __init__(self, layout: _Layout, device: torch.device, extra: Sequence[np.ndarray] = ()) -> None:
        self.__dict__.update(layout.__dict__)
        self.device = device
        shipped = ship([self.sizes, self.entry_of_block, self.nnz, self.first * self.block - self.start, self.start, *extra], device)
        self.sizes_d, self.block_entry, nnz_d, shift, self.start_d = shipped[:5]
        self.extra = shipped[5:]
        self.lane = torch.arange(self.block, device=device)[None, :]
        self.pad = self.lane >= self.sizes_d[:, None]  # [blocks, BLOCK]: the padding of each entry's last block
        # each change's entry and place in the grid (entry by entry, in order)
        self.change_entry = torch.repeat_interleave(torch.arange(self.entries, device=device), nnz_d, output_size=self.changes)
        self.change_at = torch.arange(self.changes, device=device) + shift[self.change_entry]

    def grid(self, *values: torch.Tensor) -> torch.Tensor:
        """[len(values) * blocks, BLOCK]: each a stream's symbols (one a change) in its own
        grid of blocks, the padding 0."""
        out = torch.zeros(len(values) * self.blocks * self.block, dtype=torch.int64, device=self.device)
        n = self.blocks * self.block
        at = self.change_at if len(values) == 1 else torch.cat([self.change_at + i * n for i in range(len(values))])
        out.index_copy_(0, at, values[0] if len(values) == 1 else torch.cat(values))
        return out.view(len(values) * self.blocks, self.block)

    def per_change(self, grid: torch.Tensor) -> torch.Tensor:
        """A [blocks, BLOCK] grid's values back as one a change, entry after entry."""
        return grid.reshape(-1)[self.change_at]


def _segmented(x: torch.Tensor, grid: _Grid, first_of_block: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exclusive prefix sums of ``x`` (one a block) within each entry's blocks, and each
    entry's total (``bounds``: each entry's first block and the block after its last)."""
    sums = torch.cat([x.new_zeros(1), torch.cumsum(x, 0)])
    at = sums[bounds].view(2, -1)
    return sums[:-1] - sums[first_of_block], at[1] - at[0]


# -- encode -----------------------------------------------------------------------------------
def _choose_widths(v: torch.Tensor, length: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's (b, h) of fewest bits ``n*b + E(b)*h(b)``, every b in 0..64 at once:
    E(b) from a histogram of the symbols' bit ``length`` (a field ``v`` escapes at b below
    its length; the padding's length 0 never does), h(b) the bit length of the largest
    escape field (estimated while choosing, exact for the choice). The widest choice a
    valid stream needs is its own (W for values): a wider b costs more bits and no fewer
    escapes, so the first minimum never lies past it."""
    rows, candidates = v.shape[0], _TOP + 1
    counts = torch.zeros(rows * candidates, dtype=torch.int64, device=v.device)
    bins = (torch.arange(rows, device=v.device) * candidates)[:, None] + length
    counts.index_add_(0, bins.view(-1), counts.new_ones(1).expand(bins.numel()))  # 1-D: deterministic on CUDA
    counts = counts.view(rows, candidates)
    escapes = counts.flip(1).cumsum(1).flip(1)  # [:, L]: symbols of length >= L
    escapes = torch.cat([escapes[:, 1:], escapes.new_zeros(rows, 1)], 1)  # [:, b]: length > b
    low = torch.iinfo(torch.int64).min
    top = (v ^ low).amax(1) ^ low  # the unsigned maximum: flipping the top bit orders patterns as unsigned
    widths = torch.arange(candidates, device=v.device)
    over = top[:, None] - _mask(widths)
    h = _length_estimate(over).masked_fill_(over < 0, 64).masked_fill_(escapes == 0, 0)
    b = (sizes[:, None] * widths + escapes * h).argmin(1)  # the first minimum: the narrowest
    escaping = _escapes(top + 1, b)  # exactly: the largest field is >= 2**b - 1
    return b, torch.where(escaping, _bit_length(top - _mask(b)), 0)


def _put_bits(words: torch.Tensor, at: torch.Tensor, value: torch.Tensor) -> None:
    """OR fields ``value`` (already masked to their widths) into ``words`` at bit ``at``. The
    fields are disjoint, so adding is OR-ing, and integer adds are deterministic. The part
    of a field past its first word goes to the next (zero bits when nothing spills)."""
    at, value = at.reshape(-1), value.reshape(-1)
    k, s = at >> 6, at & 63
    words.index_add_(0, k, value << s)
    spill = ((value >> 1) & torch.iinfo(torch.int64).max) >> (63 - s)  # a logical shift by 64 - s, 0 at s = 0
    words[1:].index_add_(0, k, spill)


@dataclass(frozen=True)
class Encoded:
    """A coded payload (uint8, on the changes' device) and its checksum (0-dim int64)."""

    payload: torch.Tensor
    checksum: torch.Tensor


class PreparedBatch:
    """Entries' changes coded up to their sizes (``prepare``): every field of every entry and
    its bit offset within its entry's stream, on the device. ``sizes`` reads the payloads'
    sizes (the one host sync), then ``write`` places them anywhere in one buffer. Entries are
    kept by value width internally; both methods speak the caller's order."""

    def __init__(self, grid: _Grid, order: list[int], widths: list[int], coded: dict[str, torch.Tensor]) -> None:
        self._grid, self._order, self._widths, self._coded = grid, order, widths, coded
        self._nbytes: np.ndarray | None = None  # in the batch's order, once read

    def __len__(self) -> int:
        return self._grid.entries

    def sizes(self) -> list[int]:
        """Each entry's payload size in bytes, read in one host sync (once)."""
        if self._nbytes is None:
            bits = np.asarray(self._coded["nbits"].to("cpu", copy=True), dtype=np.int64)  # the one host sync
            self._nbytes = self._grid.body() + (bits + 7) // 8
        out = [0] * len(self)
        for at, i in enumerate(self._order):
            out[i] = int(self._nbytes[at])
        return out

    def write(self, buffer: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
        """Write each entry's payload into ``buffer`` (uint8 on the changes' device, its
        first byte 8-aligned, zero where the payloads and ``slack`` go) at byte ``starts``
        (multiples of ``ALIGN``, the caller's order, not overlapping), and seal them; returns
        their checksums ([entries] int64, the caller's order). No host sync (``sizes`` first)."""
        grid, n, c = self._grid, self._grid.blocks, self._coded
        if self._nbytes is None:
            raise ConfigError("write before the sizes were read")
        at = np.asarray(starts, dtype=np.int64)[self._order]  # the batch's order
        nbytes = self._nbytes
        by_start = np.argsort(at, kind="stable")
        ends = at[by_start] + nbytes[by_start]
        if buffer.storage_offset() % ALIGN or (at % ALIGN).any() or (at[by_start][1:] < ends[:-1]).any() or (at < 0).any():
            raise ConfigError(f"payloads at {at.tolist()} of {nbytes.tolist()} bytes overlap or are not {ALIGN}-byte aligned")
        end = int(ends.max())
        if end + slack(grid.block) > buffer.numel():
            raise ConfigError(f"a buffer of {buffer.numel()} bytes for payloads ending at {end} and their slack")
        words = buffer[: buffer.numel() // 8 * 8].view(torch.int64)
        fields = VERSION | (grid.block.bit_length() - 1) << 8 | np.asarray(self._widths, dtype=np.int64) << 16
        sealed = [at[by_start], nbytes[by_start]]
        caller = np.asarray(self._order)[by_start]  # the caller's index of each sealed payload
        shipped = ship(
            [np.concatenate([at // 8 + 1, at // 8 + 2]), np.concatenate([fields, grid.nnz]), grid.table_at(at),
             (8 * (at + grid.body()))[grid.entry_of_block], *sealed, np.argsort(caller)], buffer.device,
        )
        head_at, head, table_at, first_bit, sealed_at, sealed_nbytes, back = shipped
        words.index_copy_(0, head_at, head)
        table = torch.stack([c["b"][:n], c["h"][:n], c["b"][n:], c["h"][n:]])
        buffer.index_copy_(0, table_at.view(-1), table.view(-1).to(torch.uint8))
        first = first_bit.repeat(2)[:, None]
        escaped = c["escaped"]
        rank = escaped.cumsum(1) - escaped.long()  # escapes before a change in its block
        low_at = first + c["starts"][0::2].reshape(-1, 1) + grid.lane * c["b"][:, None]
        high_at = first + c["starts"][1::2].reshape(-1, 1) + rank * c["h"][:, None]
        _put_bits(words, torch.cat([low_at, high_at]), torch.cat([c["low"], c["high"]]))
        sums = _checksums(buffer, sealed_at, sealed_nbytes, end)
        words.index_copy_(0, sealed_at // 8, sums)
        return sums if (np.diff(caller) == 1).all() else sums[back]


def prepare(flats: Sequence[torch.Tensor], news: Sequence[torch.Tensor], olds: Sequence[torch.Tensor], *, block: int = BLOCK) -> PreparedBatch:
    """Code entries (changes at ascending positions ``flats[i]``, whose values go from
    ``olds[i]`` to ``news[i]``, any dtype: their bit patterns are coded), all on one device,
    up to their sizes: a fixed number of ops whatever the entries, no host sync."""
    if not len(flats) == len(news) == len(olds) or not flats:
        raise ConfigError(f"{len(flats)} positions, {len(news)} new and {len(olds)} old values to code")
    for flat, new, old in zip(flats, news, olds):
        if flat.dim() != 1 or new.shape != flat.shape or old.shape != flat.shape or new.dtype != old.dtype:
            raise ConfigError(f"changes of {list(flat.shape)} positions, {list(new.shape)} new and {list(old.shape)} old values")
    if block < 1 or block & (block - 1):
        raise ConfigError(f"block size {block} is not a power of two")
    device = flats[0].device
    # The batch's order: entries by value width, so a width's differences are one subtraction.
    order = sorted(range(len(flats)), key=lambda i: news[i].element_size())
    layout = _Layout([flats[i].numel() for i in order], block)
    grid = _Grid(layout, device, [np.flatnonzero(layout.nnz > 0)])
    (busy,) = grid.extra
    flat = torch.cat([flats[i] for i in order]).to(torch.int64)
    diffs = []
    for size in sorted({news[i].element_size() for i in order}):
        ints = _INT[size]
        mine = [i for i in order if news[i].element_size() == size]
        diffs.append(differences(torch.cat([news[i].view(ints) for i in mine]), torch.cat([olds[i].view(ints) for i in mine])))
    d = torch.cat(diffs) if len(diffs) > 1 else diffs[0]
    gaps = torch.empty_like(flat)
    if grid.changes:
        torch.sub(flat[1:], flat[:-1], out=gaps[1:])
        begins = grid.start_d[busy]
        gaps.index_copy_(0, begins, flat[begins] + 1)  # an entry's first gap is from -1
    u = grid.grid(gaps, (d << 1) ^ (d >> 63))  # gap symbols' blocks, then the zigzagged values'
    pad, sizes = grid.pad.repeat(2, 1), grid.sizes_d.repeat(2)
    v = (u - 1).masked_fill_(pad, 0)
    length = _length_estimate(u).masked_fill_(u <= 0, 64).masked_fill_(pad, 0)
    b, h = _choose_widths(v, length, sizes)
    escaped = _escapes(u, b[:, None]).masked_fill_(pad, False)
    low = torch.where(escaped, _mask(b)[:, None], v)
    high = torch.where(escaped, v - _mask(b)[:, None], 0)
    # Each block's four sections (gap lows, gap escapes, value lows, value escapes) summed in
    # stream order (an entry's sections one after another) in one pass, less each entry's base.
    n = grid.blocks
    chunks = torch.stack([sizes * b, escaped.sum(1) * h]).view(2, 2, n).transpose(0, 1).reshape(PLANES, n)
    e, local = grid.entry_of_block, np.arange(n) - grid.first_of_block
    ordered = PLANES * grid.first_of_block + np.arange(PLANES)[:, None] * grid.count[e] + local
    ordered_at, base_at, bounds = ship(
        [ordered, PLANES * grid.first_of_block, PLANES * np.concatenate([grid.first, grid.first + grid.count])], device
    )
    line = torch.zeros(PLANES * n + 1, dtype=torch.int64, device=device)
    line[1:].index_copy_(0, ordered_at.view(-1), chunks.reshape(-1))
    offsets = line.cumsum_(0)
    starts = offsets[ordered_at].view(PLANES, n) - offsets[base_at]
    ends = offsets[bounds].view(2, -1)
    coded = {"b": b, "h": h, "low": low, "high": high, "escaped": escaped, "starts": starts, "nbits": ends[1] - ends[0]}
    return PreparedBatch(grid, order, [value_width(news[i].dtype) for i in order], coded)


def encode(flat: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, *, block: int = BLOCK) -> Encoded:
    """The payload of changes at ascending int64 ``flat`` whose values go from ``old_bits``
    to ``new_bits`` (any dtype: its bit patterns are coded). One host sync: the size."""
    prepared = prepare([flat], [new_bits], [old_bits], block=block)
    (nbytes,) = prepared.sizes()
    buffer = torch.zeros(aligned(nbytes) + slack(block), dtype=torch.uint8, device=flat.device)
    sums = prepared.write(buffer, [0])
    return Encoded(buffer[:nbytes], sums[0])


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


def _checksums(buffer: torch.Tensor, starts: torch.Tensor, nbytes: torch.Tensor, end: int) -> torch.Tensor:
    """``checksum`` of bytes 8.. of each payload of ``buffer`` (at ascending, even ``starts``,
    of ``nbytes``, none past ``end``), in one pass over the buffer's 16-bit words: each word
    summed into its payload's bin (an odd payload's last word by its low byte alone)."""
    words = (end + 1) // 2
    data = buffer[: 2 * words]
    if data.numel() < 2 * words:  # an odd end at the buffer's last byte
        data = torch.cat([data, data.new_zeros(1)])
    w = data.view(torch.int16).to(torch.int64) & 0xFFFF
    i = torch.arange(words, device=buffer.device)
    lo = (starts + 8) >> 1
    seg = (torch.searchsorted(lo, i, right=True) - 1).clamp_(min=0)
    local = i - lo[seg]
    stop = (starts + nbytes)[seg]
    w = torch.where(2 * i + 1 < stop, w, w & 0xFF).masked_fill_((local < 0) | (2 * i >= stop), 0)
    weights = local + 1
    if words >= _MOD:
        weights %= _MOD
    bins = torch.zeros(2, starts.numel(), dtype=torch.int64, device=buffer.device)
    bins[0].index_add_(0, seg, w)
    bins[1].index_add_(0, seg, (w * weights) % _MOD)  # below 2**31 each: 2**32 of them stay below 2**63
    a = (bins[0] + nbytes - 8) % _MOD
    return ((bins[1] % _MOD) << 32) | a


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
    batch: DecodedBatch | None = None  # the batch it was decoded in (``decode_many``), its changes from ``at``
    at: int = 0

    def raise_unless_ok(self, what: str = "device payload") -> None:
        """``ProtocolError`` unless the verdict is True (one host sync)."""
        if not bool(self.ok):
            raise ProtocolError(f"{what}: bad block table, widths, sizes, positions or checksum")


@dataclass(frozen=True)
class DecodedBatch:
    """A ``decode_many``'s changes end to end (each payload's ``Decoded.flat`` and
    ``diffs`` are slices of these) and its verdicts, one a payload: what lets a caller
    stage a whole part's updates in a few ops rather than a few a payload."""

    flat: torch.Tensor
    diffs: torch.Tensor
    ok: torch.Tensor
    intact: torch.Tensor


def _get_bits(words: torch.Tensor, at: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The ``width``-bit fields at bit ``at``; offsets past the words read clamped words."""
    k, s = (at >> 6).clamp_(0, words.numel() - 2), at & 63
    pair = words.unfold(0, 2, 1)[k]  # the field's word and the next
    first, second = pair[..., 0], pair[..., 1]
    # first >> s fills the top s bits with first's sign; xor-ing that sign into the next
    # word's bits before they move up cancels it, so the two halves join as a logical shift
    spill = ((second ^ (first >> 63)) << 1) << (63 - s)
    return ((first >> s) ^ spill) & _mask(width)


def min_nbytes(nnz: int, *, block: int = BLOCK) -> int:
    """The fewest bytes a payload of ``nnz`` changes takes: its header and block table."""
    return HEADER + PLANES * -(-nnz // block)


def max_nbytes(nnz: int, numel: int, dtype: torch.dtype, *, block: int = BLOCK) -> int:
    """The most bytes a payload of ``nnz`` changes to a target of ``numel`` elements of
    ``dtype`` can take (every field at the widest width the decoder allows, each change
    escaping): a bound on what a receiver copies before the decoder judges it."""
    bits = 2 * nnz * (numel.bit_length() + value_width(dtype))
    return min_nbytes(nnz, block=block) + -(-bits // 8)


@dataclass(frozen=True)
class Target:
    """What a payload decodes for: its changes' count and its target's elements and dtype."""

    nnz: int
    numel: int
    dtype: torch.dtype


def join(payloads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``payloads`` (uint8, one device) as one buffer ``decode_many`` reads, and where each
    starts in it: their own storage when they are views of one at 8-byte aligned offsets (a
    part's one transfer, ``receiver/apply/transfer.py``), else one copy of them all, each at a
    multiple of ``ALIGN``."""
    for p in payloads:
        if p.dtype != torch.uint8 or p.dim() != 1:
            raise ProtocolError(f"device payload of {p.dtype}{list(p.shape)}, expected uint8 bytes")
    first = payloads[0]
    storage = first.untyped_storage()
    offsets = [int(p.storage_offset()) for p in payloads]
    base = min(offsets)
    stop = aligned(max(o + p.numel() for o, p in zip(offsets, payloads)) - base) + 16
    if (base % ALIGN == 0 and base + stop <= storage.nbytes() and first.is_contiguous()
            and all(p.untyped_storage().data_ptr() == storage.data_ptr() and (p.storage_offset() - base) % ALIGN == 0
                    and p.stride() == (1,) for p in payloads)):
        return first.as_strided((stop,), (1,), base), [o - base for o in offsets]
    starts, at = [], 0
    for p in payloads:
        starts.append(at)
        at = aligned(at + p.numel())
    zeros = first.new_zeros(ALIGN + 16)
    pieces = []
    for p, s in zip(payloads, starts):
        pieces += [p, zeros[: aligned(s + p.numel()) - s - p.numel()]]
    return torch.cat([*pieces, zeros[:16]]), starts


def decode_many(
    buffer: torch.Tensor, starts: Sequence[int], nbytes: Sequence[int], targets: Sequence[Target], *, block: int = BLOCK
) -> list[Decoded]:
    """Changes of untrusted payloads (``nbytes[i]`` bytes of uint8 ``buffer`` at ``starts[i]``,
    ascending multiples of ``ALIGN``: ``join``) for ``targets``, one set of ops for all of them
    and no host sync. What the host already knows to be wrong (a payload too short for its
    table, more changes than elements) comes back empty and not ok; everything else is checked
    on the device into each ``Decoded.ok``, one payload's faults never touching another's."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ProtocolError(f"device payloads in {buffer.dtype}{list(buffer.shape)}, expected uint8 bytes")
    if not len(starts) == len(nbytes) == len(targets):
        raise ConfigError(f"{len(starts)} starts, {len(nbytes)} sizes and {len(targets)} targets")
    if block < 1 or block & (block - 1):
        raise ConfigError(f"block size {block} is not a power of two")
    for t in targets:
        if not 0 <= t.numel < 1 << 62:
            raise ConfigError(f"a target of {t.numel} elements")
    at = np.asarray(starts, dtype=np.int64).reshape(-1)
    if buffer.storage_offset() % ALIGN or (at % ALIGN).any() or (np.diff(at) < np.asarray(nbytes[:-1])).any() or (at < 0).any():
        raise ConfigError(f"payloads at {at.tolist()} overlap or are not {ALIGN}-byte aligned")
    if len(at) and int(at[-1]) + int(nbytes[-1]) > buffer.numel():
        raise ConfigError(f"payloads past a buffer of {buffer.numel()} bytes")
    device = buffer.device
    if buffer.numel() < 16:  # _get_bits reads pairs of words
        buffer = torch.cat([buffer, buffer.new_zeros(16)])
    fit = [i for i, (t, n) in enumerate(zip(targets, nbytes)) if 0 <= t.nnz <= t.numel and n >= min_nbytes(t.nnz, block=block)]
    decoded = _decode_fitting(buffer, at[fit], np.asarray(nbytes, dtype=np.int64)[fit], [targets[i] for i in fit], block) if fit else []
    if len(fit) == len(targets):
        return decoded
    refused = _empty(device)
    out = [refused] * len(targets)
    for i, d in zip(fit, decoded):
        out[i] = d
    return out


def _decode_fitting(buffer: torch.Tensor, at: np.ndarray, nbytes: np.ndarray, targets: list[Target], block: int) -> list[Decoded]:
    """``decode_many`` of payloads the host found nothing wrong with."""
    device = buffer.device
    numel = np.asarray([t.numel for t in targets], dtype=np.int64)
    widths = np.asarray([value_width(t.dtype) for t in targets], dtype=np.int64)
    limits = np.stack([np.asarray([int(m).bit_length() for m in numel], dtype=np.int64), widths])
    # the largest valid zigzagged value (a bool's moves are +-1); -1: any non-zero 64-bit pattern
    tops = np.where(widths == 64, -1, (1 << np.minimum(widths, 62)) - 1)
    tops[[t.dtype == torch.bool for t in targets]] = 2
    fields = VERSION | (block.bit_length() - 1) << 8 | widths << 16
    pre = _Layout([t.nnz for t in targets], block)
    e = pre.entry_of_block
    body = pre.body()
    grid = _Grid(
        pre, device,
        [pre.table_at(at), np.repeat(limits, 2, axis=0)[:, e], 8 * (at + body)[e], pre.first_of_block,
         np.concatenate([pre.first, pre.first + pre.count]), numel, tops, np.concatenate([at // 8, at // 8 + 1, at // 8 + 2]),
         np.concatenate([fields, pre.nnz]), nbytes - body, 8 * (at + body), at, nbytes],
    )
    table_at, limit, first_bit, first_of_block, bounds, numel_d, top_d, head_at, head, room, stream_at, at_d, nbytes_d = grid.extra
    n, entries = grid.blocks, grid.entries
    words = buffer[: buffer.numel() // 8 * 8].view(torch.int64)
    raw = buffer[table_at].to(torch.int64).view(PLANES, n)
    limit = limit.view(PLANES, n)
    table = torch.minimum(raw, limit)
    fails = torch.zeros(entries, dtype=torch.int64, device=device)
    fails.index_add_(0, grid.block_entry, (raw > limit).any(0).long())
    bg, hg, bv, hv = table

    def lows(b: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """A stream's low fields' bit offsets, from each block's entry's ``start``."""
        before, _ = _segmented(grid.sizes_d * b, grid, first_of_block, bounds)
        return (start + before)[:, None] + grid.lane * b[:, None]

    def escapes(low: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((low == _mask(b)[:, None]) & (b < 64)[:, None]).masked_fill_(grid.pad, False)

    def highs(escaped: torch.Tensor, h: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stream's escape fields' bit offsets (from ``start``), and each entry's escape bits."""
        rank = escaped.cumsum(1)
        before, total = _segmented(rank[:, -1] * h, grid, first_of_block, bounds)
        return (start + before)[:, None] + (rank - escaped.long()) * h[:, None], total

    # An entry's stream: gap lows, gap escapes, value lows, value escapes. Lows say which
    # changes escaped, so each section's offsets wait for the one before it.
    _, gap_low_bits = _segmented(grid.sizes_d * bg, grid, first_of_block, bounds)
    _, value_low_bits = _segmented(grid.sizes_d * bv, grid, first_of_block, bounds)
    owner = grid.block_entry
    gl = _get_bits(words, lows(bg, first_bit), bg[:, None])
    g_esc = escapes(gl, bg)
    gh_at, gap_high_bits = highs(g_esc, hg, first_bit + gap_low_bits[owner])
    vl_at = lows(bv, first_bit + (gap_low_bits + gap_high_bits)[owner])
    both = _get_bits(words, torch.cat([gh_at, vl_at]), torch.cat([hg, bv])[:, None])  # gap escapes and value lows at once
    gh, vl = both[:n], both[n:]
    v_esc = escapes(vl, bv)
    before_values = gap_low_bits + gap_high_bits + value_low_bits
    vh_at, value_high_bits = highs(v_esc, hv, first_bit + before_values[owner])
    vh = _get_bits(words, vh_at, hv[:, None])
    end = before_values + value_high_bits  # each entry's bits

    def symbols(escaped: torch.Tensor, b: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        return grid.per_change(torch.where(escaped, (1 << b.clamp(max=63))[:, None] + high, low + 1))

    gaps, values = symbols(g_esc, bg, gh, gl), symbols(v_esc, bv, vh, vl)
    numel_c = numel_d[grid.change_entry]
    sums = torch.cat([gaps.new_zeros(1), torch.cumsum(torch.minimum(gaps.clamp(min=1), numel_c), 0)])
    flat = sums[1:] - sums[grid.start_d[grid.change_entry]] - 1  # with every gap in 1..numel < 2**62, no sum wraps unseen
    top_c = top_d[grid.change_entry]
    values_fit = (values != 0) & ((top_c < 0) | ((values > 0) & (values <= top_c)))
    bad = (gaps < 1) | (gaps > numel_c) | (flat >= numel_c) | ~values_fit
    fails.index_add_(0, grid.change_entry, bad.long())
    stored = words[head_at]
    intact = _checksums(buffer, at_d, nbytes_d, int((at + nbytes).max())) == stored[:entries]
    heads_fit = (stored[entries:].view(2, entries) == head.view(2, entries)).all(0)
    fits = (end + 7) // 8 == room  # the stream ends in the payload's last byte
    padding = _get_bits(words, stream_at + end, (-end) % 8) == 0  # the last byte's padding
    ok = (fails == 0) & intact & heads_fit & fits & padding
    diffs = ((values >> 1) & torch.iinfo(torch.int64).max) ^ -(values & 1)  # unzigzag
    flat = torch.minimum(flat.clamp_(min=0), (numel_c - 1).clamp_(min=0))
    batch = DecodedBatch(flat, diffs, ok, intact)
    return [
        Decoded(flat[s : s + k], diffs[s : s + k], ok[i], intact[i], batch, s)
        for i, (s, k) in enumerate(zip(grid.start.tolist(), grid.nnz.tolist()))
    ]


def _empty(device: torch.device) -> Decoded:
    none, no = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.bool, device=device)
    return Decoded(none, none, no, no)


def decode(payload: torch.Tensor, nnz: int, numel: int, dtype: torch.dtype, *, block: int = BLOCK) -> Decoded:
    """Changes of one untrusted ``payload`` (uint8, on the target's device) for a target of
    ``numel`` elements of ``dtype``: ``decode_many`` of one (its payload copied once, aligned)."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ProtocolError(f"device payload of {payload.dtype}{list(payload.shape)}, expected uint8 bytes")
    buffer, starts = join([payload])
    return decode_many(buffer, starts, [payload.numel()], [Target(nnz, numel, dtype)], block=block)[0]


def apply_differences(old_bits: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """New values from the old ones (any dtype, read as bit patterns) and ``diffs``:
    ``old + diff`` wrapped to the dtype's width, in ``old_bits``' dtype (a bool stays 0 or
    1 whatever the differences)."""
    ints = _INT[old_bits.element_size()]
    new = old_bits.view(ints).to(torch.int64) + diffs
    if old_bits.dtype == torch.bool:
        return (new & 1).to(torch.bool)
    return new.to(ints).view(old_bits.dtype)
