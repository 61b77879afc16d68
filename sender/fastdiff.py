"""A fused CPU diff: cast, compare, collect and update the snapshot.

The plain torch path makes several passes over model-sized arrays (cast to the receiver
dtype, compare, nonzero, gather, scatter into the snapshot). Here a numba kernel reads
the state and the snapshot once, writing one bit per element and a count per chunk
(compared a block at a time into bytes, which vectorizes, then packed into bits);
a second visits the changed elements alone to collect them and move the snapshot
forward. When more than ``dense_above`` of the elements changed, the second pass is
skipped: the caller sends the tensor whole, and the snapshot becomes a plain copy.

Given how many changes to expect (``expect``: the tensor's count last version), a large
tensor (``ONE_PASS_MIN``) is compared and collected in one pass: each block's changes are
collected while the block is still in cache, into room for 1.5x the expected count a chunk;
a chunk that overflows its room is collected again by the second pass, from its marks (its
snapshot moves only then). The second pass re-reads a changed element's cache line from
memory: at 1% changed, that is most lines.
Used for CPU tensors when the receiver dtype is the state's own, or fp32 state to a
bf16 receiver (the common RL case); other pairs, and CUDA tensors, take the torch path,
and so does everything when numba is missing.

fp32 -> bf16 rounds exactly as torch's CPU cast does: to nearest even, NaN to 0xFFFF.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any, NamedTuple

import numpy as np
import torch

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None  # type: ignore[assignment, unused-ignore]

CHUNK_WORDS = 1024  # 65536 elements per parallel task
PARALLEL_MIN = 1 << 22  # elements from which the kernels run on all cores
# Elements from which the compare collects in one pass (given ``expect``). Measured on the
# 2-core development machine, in the harness: one pass took the threaded compare and collect
# of 8M-element bf16 tensors at 1% from ~3.4 to ~2.3 ms a tensor, and the serial one of the
# quick suite's 256k-2M-element tensors from 3.5 to 4.0 ms a version (slower): so threaded only.
ONE_PASS_MIN = PARALLEL_MIN
BLOCK = 4096  # elements compared into a cache-resident byte buffer before packing to bits
_PACK = np.uint64(0x0102040810204080)  # (8 bytes of 0/1) * _PACK >> 56 = those 8 flags as bits
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_NATIVE = {torch.float16, torch.float32, torch.float64, torch.int16, torch.int32, torch.int64}


class Diff(NamedTuple):
    """``changed`` elements; their sorted int64 flat indices and new and old values, or
    None for all three when the tensor went dense (past ``dense_above``)."""

    changed: int
    flat: torch.Tensor | None
    new: torch.Tensor | None
    old: torch.Tensor | None


class Kernels(NamedTuple):
    """One build (serial or threaded) of the kernels."""

    mark: Any
    collect: Any
    mark_collect: Any
    compact: Any


DenseRule = Callable[[int, Callable[[], torch.Tensor]], bool]  # (changed, sample) -> whether it goes whole
SAMPLE = 2048  # elements sampled for the dense rule (``sampled_differences``)
_NO_CHUNKS = np.zeros(0, dtype=np.uint8)  # ``_collect``'s ``only``: every chunk


def _named_copy(fn: Callable[..., Any], suffix: str) -> FunctionType:
    """``fn`` under another name: numba caches it apart from ``fn`` and its other copies."""
    assert isinstance(fn, FunctionType)
    copy = FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    copy.__doc__ = fn.__doc__
    return copy


if numba is not None:

    @numba.njit(inline="always")
    def _bf16(u):  # pragma: no cover - numba
        rounded = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return np.uint16(0xFFFF) if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded

    @numba.njit(inline="always")
    def _popcount(x):  # pragma: no cover - numba; LLVM turns this into one instruction
        x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
        x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
        x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))

    @numba.njit(inline="always")
    def _flag_block(c_block, s_block, rounding, flags):  # pragma: no cover - numba
        """``flags[i]`` = whether element ``i`` of the block changed; zeros past its end.
        Indexed from 0 on block views: an index the compiler knows is not negative needs
        no wraparound check, and the compare loop vectorizes."""
        size = c_block.shape[0]
        if rounding:
            for i in range(size):
                flags[i] = _bf16(c_block[i]) != s_block[i]
        else:
            for i in range(size):
                flags[i] = c_block[i] != s_block[i]
        for i in range(size, flags.shape[0]):  # a partial last block: no stale flags
            flags[i] = 0

    @numba.njit(inline="always")
    def _word(words, w):  # pragma: no cover - numba
        """The 64 flags of ``words[w * 8:(w + 1) * 8]`` as the bits of one word."""
        m = np.uint64(0)
        for q in range(8):
            m |= ((words[w * 8 + q] * _PACK) >> np.uint64(56)) << np.uint64(8 * q)
        return m

    def _mark(cur, snap, rounding, marks, counts):  # pragma: no cover - numba
        """Bit ``i`` of ``marks`` is set where element ``i`` changed; ``counts`` per chunk.

        Compares a block at a time into bytes (a loop the compiler vectorizes), then packs
        each 8 bytes into 8 bits with one multiply."""
        n = cur.shape[0]
        for c in numba.prange(counts.shape[0]):
            flags = np.zeros(BLOCK, dtype=np.uint8)
            words = flags.view(np.uint64)
            total = 0
            chunk_end = min(n, (c + 1) * CHUNK_WORDS * 64)
            for start in range(c * CHUNK_WORDS * 64, chunk_end, BLOCK):
                end = min(chunk_end, start + BLOCK)
                _flag_block(cur[start:end], snap[start:end], rounding, flags)
                for w in range((end - start + 63) >> 6):
                    m = _word(words, w)
                    marks[(start >> 6) + w] = m
                    total += _popcount(m)
            counts[c] = total

    def _collect(cur, snap, rounding, marks, offsets, only, flat, new, old):  # pragma: no cover - numba
        """The changes of the chunks ``only`` flags (all, when it is empty), from their marks."""
        for c in numba.prange(offsets.shape[0] - 1):
            o = offsets[c]
            if offsets[c + 1] == o or (only.shape[0] and not only[c]):
                continue
            for w in range(c * CHUNK_WORDS, min(marks.shape[0], (c + 1) * CHUNK_WORDS)):
                m = marks[w]
                while m:
                    i = w * 64 + _popcount((m & (~m + np.uint64(1))) - np.uint64(1))  # the lowest set bit
                    m &= m - np.uint64(1)
                    value = _bf16(cur[i]) if rounding else cur[i]
                    flat[o] = i
                    new[o] = value
                    old[o] = snap[i]
                    snap[i] = value  # the snapshot moves to the new version in the same pass
                    o += 1

    def _mark_collect(cur, snap, rounding, marks, counts, flat, new, old, room, spilled):  # pragma: no cover - numba
        """``_mark``, collecting each chunk's changes into its ``room`` slots of ``flat``,
        ``new`` and ``old`` as it goes, and moving the snapshot once the chunk is done; a
        chunk with more changes than its room sets ``spilled`` and leaves its snapshot be."""
        n = cur.shape[0]
        for c in numba.prange(counts.shape[0]):
            flags = np.zeros(BLOCK, dtype=np.uint8)
            words = flags.view(np.uint64)
            total = 0
            base = c * room
            o = base
            full = False
            chunk_end = min(n, (c + 1) * CHUNK_WORDS * 64)
            for start in range(c * CHUNK_WORDS * 64, chunk_end, BLOCK):
                end = min(chunk_end, start + BLOCK)
                c_block, s_block = cur[start:end], snap[start:end]
                _flag_block(c_block, s_block, rounding, flags)
                for w in range((end - start + 63) >> 6):
                    m = _word(words, w)
                    marks[(start >> 6) + w] = m
                    k = _popcount(m)
                    total += k
                    if full or k == 0:
                        continue
                    if o - base + k > room:
                        full = True
                        continue
                    while m:  # the block is in cache: collect its changes now
                        j = w * 64 + _popcount((m & (~m + np.uint64(1))) - np.uint64(1))
                        m &= m - np.uint64(1)
                        flat[o] = start + j
                        new[o] = _bf16(c_block[j]) if rounding else c_block[j]
                        old[o] = s_block[j]
                        o += 1
            counts[c] = total
            if full:
                spilled[c] = 1
            else:
                for j in range(base, o):
                    snap[flat[j]] = new[j]

    def _compact(room, offsets, spilled, flat_t, new_t, old_t, flat, new, old):  # pragma: no cover - numba
        """Each collected chunk's changes from its room to its place at ``offsets``."""
        for c in numba.prange(offsets.shape[0] - 1):
            if spilled[c]:
                continue
            src, dst = c * room, offsets[c]
            for j in range(offsets[c + 1] - dst):
                flat[dst + j] = flat_t[src + j]
                new[dst + j] = new_t[src + j]
                old[dst + j] = old_t[src + j]

    @numba.njit(cache=True, nogil=True)
    def _sample_new(cur, rounding, step, out):  # pragma: no cover - numba
        """Every ``step``-th element of ``cur``, cast to the snapshot's bits when ``rounding``."""
        for j in range(out.shape[0]):
            out[j] = _bf16(cur[j * step]) if rounding else cur[j * step]

    # Each kernel twice: threads pay off on large tensors only. Waking a thread team costs
    # microseconds on an idle host and milliseconds on a busy one (a trainer's), which
    # would dominate a model's many small tensors. The two builds must be two functions:
    # numba's on-disk cache keys an entry by the function's name, line and signature,
    # not by ``parallel``, so one function compiled both ways would load whichever build
    # was cached first for both. Each copy gets its own name (so its own cache file); the
    # names are new, so no index written by the old one-function layout is ever read.
    _KERNELS = {
        parallel: Kernels(*(
            numba.njit(parallel=parallel, cache=True, nogil=True)(_named_copy(fn, "_parallel" if parallel else "_serial"))
            for fn in (_mark, _collect, _mark_collect, _compact)
        ))
        for parallel in (False, True)
    }


def supported(cur: torch.Tensor, snapshot: torch.Tensor) -> bool:
    """Whether the fused kernels handle this pair (else use the torch path)."""
    if numba is None or cur.device.type != "cpu" or snapshot.device.type != "cpu" or not snapshot.is_contiguous():
        return False
    same = cur.dtype == snapshot.dtype and cur.element_size() in _UINT
    return same or (cur.dtype == torch.float32 and snapshot.dtype == torch.bfloat16)


def diff_and_update(
    cur: torch.Tensor,
    snapshot: torch.Tensor,
    dense_above: float | DenseRule = 1.0,
    expect: int | None = None,
) -> Diff:
    """Where ``cur`` (cast to the snapshot's dtype) differs bitwise from ``snapshot``;
    ``snapshot`` is moved to the new values in place either way. ``dense_above``: a share,
    or a callable given the count of changed elements and a function returning the
    ``sampled_differences`` of the tensor against the snapshot as it was, that says
    whether the tensor goes whole. ``expect``: about how many changes there will be
    (one pass instead of two; None: unknown)."""
    n = cur.numel()
    rounding = cur.dtype != snapshot.dtype
    cur = cur.reshape(-1).contiguous()
    cur_u, snap_u = _bits(cur), _bits(snapshot.view(-1))
    if n < ONE_PASS_MIN:
        expect = None
    step = max(1, n // SAMPLE)
    # one pass moves the snapshot before the count is known: keep the rule's sample of it as it was
    before = snap_u[::step].copy() if callable(dense_above) and expect is not None else None
    words = -(-n // 64)
    marks = np.empty(words, dtype=np.uint64)
    chunks = -(-words // CHUNK_WORDS)
    offsets = np.empty(chunks + 1, dtype=np.int64)
    offsets[0] = 0
    counts = offsets[1:]  # the mark writes each chunk's count; summed in place into offsets
    kernels = _KERNELS[n >= PARALLEL_MIN]
    if expect is None:
        kernels.mark(cur_u, snap_u, rounding, marks, counts)
        spilled = None
    else:
        room = min(CHUNK_WORDS * 64, n, (3 * expect) // (2 * max(1, chunks)) + 64)
        flat_t = np.empty(chunks * room, dtype=np.int64)
        new_t, old_t = np.empty(chunks * room, dtype=snap_u.dtype), np.empty(chunks * room, dtype=snap_u.dtype)
        spilled = np.zeros(chunks, dtype=np.uint8)
        kernels.mark_collect(cur_u, snap_u, rounding, marks, counts, flat_t, new_t, old_t, room, spilled)
    if counts.size > 1:
        np.cumsum(counts, out=counts)
    total = int(offsets[-1])
    if callable(dense_above):
        if before is None:
            dense = dense_above(total, lambda: sampled_differences(cur, snapshot, step))
        else:
            dense = dense_above(total, lambda: _differences(cur_u, before, rounding, step))
    else:
        dense = total > dense_above * n
    if dense:
        snapshot.view(-1).copy_(cur)  # the same rounding as _bf16
        return Diff(total, None, None, None)
    if spilled is not None and chunks == 1 and not spilled[0]:  # collected where it stays
        return Diff(total, torch.from_numpy(flat_t[:total]), _tensor(new_t[:total], snapshot.dtype), _tensor(old_t[:total], snapshot.dtype))
    flat = np.empty(total, dtype=np.int64)
    new = np.empty(total, dtype=snap_u.dtype)
    old = np.empty(total, dtype=snap_u.dtype)
    if total and spilled is None:
        kernels.collect(cur_u, snap_u, rounding, marks, offsets, _NO_CHUNKS, flat, new, old)
    elif total:
        assert spilled is not None
        kernels.compact(room, offsets, spilled, flat_t, new_t, old_t, flat, new, old)
        if spilled.any():
            kernels.collect(cur_u, snap_u, rounding, marks, offsets, spilled, flat, new, old)
    return Diff(total, torch.from_numpy(flat), _tensor(new, snapshot.dtype), _tensor(old, snapshot.dtype))


def sampled_differences(cur: torch.Tensor, snapshot: torch.Tensor, step: int) -> torch.Tensor:
    """The nonzero ulp differences (``new_bits - old_bits`` wrapping at the snapshot's width,
    as int64) of every ``step``-th element of ``cur`` (cast) against ``snapshot``, as torch's
    ops would give them, in one kernel call and three numpy ops."""
    cur_u, snap_u = _bits(cur.reshape(-1)), _bits(snapshot.view(-1))
    return _differences(cur_u, snap_u[::step], cur.dtype != snapshot.dtype, step)


def _differences(cur_u: np.ndarray, old: np.ndarray, rounding: bool, step: int) -> torch.Tensor:
    """``sampled_differences`` against ``old``, the snapshot's every ``step``-th element."""
    new = np.empty(old.size, dtype=old.dtype)
    _sample_new(cur_u, rounding, step, new)
    diffs = (new - old).view(_NP_SIGNED[old.itemsize]).astype(np.int64)
    return torch.from_numpy(diffs[diffs != 0])


def warm_up(pairs: set[tuple[torch.dtype, torch.dtype]]) -> None:
    """Compile (or load from numba's cache) the kernels for these (state, snapshot) dtype
    pairs now, rather than in the first sync: each new pair costs seconds of JIT."""
    for state_dtype, snapshot_dtype in pairs:
        for n in (9, PARALLEL_MIN):
            cur, snapshot = torch.ones(n, dtype=state_dtype), torch.zeros(n, dtype=snapshot_dtype)
            if supported(cur, snapshot):
                sampled_differences(cur, snapshot, 2)
                diff_and_update(cur, snapshot)
                diff_and_update(cur, snapshot, expect=1)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a (1-D) tensor as an unsigned numpy array (numpy has no bf16: those go
    through a signed torch view)."""
    if t.dtype in _NUMPY_NATIVE:
        return t.numpy().view(_UINT[t.element_size()])
    return t.view(_SIGNED[t.element_size()]).numpy().view(_UINT[t.element_size()])


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(_NP_SIGNED[a.itemsize])).view(dtype)
