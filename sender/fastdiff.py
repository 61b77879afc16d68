"""A fused CPU diff: cast, compare, collect and update the snapshot in two passes.

The plain torch path makes several passes over model-sized arrays (cast to the receiver
dtype, compare, nonzero, gather, scatter into the snapshot). Here a numba kernel reads
the state and the snapshot once, writing one bit per element and a count per chunk
(compared a block at a time into bytes, which vectorizes, then packed into bits);
a second visits the changed elements alone to collect them and move the snapshot
forward. When more than ``dense_above`` of the elements changed, the second pass is
skipped: the caller sends the tensor whole, and the snapshot becomes a plain copy.
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
                # Indexed from 0 on block views: an index the compiler knows is not
                # negative needs no wraparound check, and the compare loop vectorizes.
                size = end - start
                c_block, s_block = cur[start:end], snap[start:end]
                if rounding:
                    for i in range(size):
                        flags[i] = _bf16(c_block[i]) != s_block[i]
                else:
                    for i in range(size):
                        flags[i] = c_block[i] != s_block[i]
                for i in range(size, BLOCK):  # a partial last block: no stale flags
                    flags[i] = 0
                for w in range((size + 63) >> 6):
                    m = np.uint64(0)
                    for q in range(8):
                        m |= ((words[w * 8 + q] * _PACK) >> np.uint64(56)) << np.uint64(8 * q)
                    marks[(start >> 6) + w] = m
                    total += _popcount(m)
            counts[c] = total

    def _collect(cur, snap, rounding, marks, offsets, flat, new, old):  # pragma: no cover - numba
        for c in numba.prange(offsets.shape[0] - 1):
            o = offsets[c]
            if offsets[c + 1] == o:
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
        parallel: tuple(
            numba.njit(parallel=parallel, cache=True, nogil=True)(_named_copy(fn, "_parallel" if parallel else "_serial"))
            for fn in (_mark, _collect)
        )
        for parallel in (False, True)
    }


def supported(cur: torch.Tensor, snapshot: torch.Tensor) -> bool:
    """Whether the fused kernels handle this pair (else use the torch path)."""
    if numba is None or cur.device.type != "cpu" or snapshot.device.type != "cpu" or not snapshot.is_contiguous():
        return False
    same = cur.dtype == snapshot.dtype and cur.element_size() in _UINT
    return same or (cur.dtype == torch.float32 and snapshot.dtype == torch.bfloat16)


def diff_and_update(cur: torch.Tensor, snapshot: torch.Tensor, dense_above: float | Callable[[int], bool] = 1.0) -> Diff:
    """Where ``cur`` (cast to the snapshot's dtype) differs bitwise from ``snapshot``;
    ``snapshot`` is moved to the new values in place either way. ``dense_above``: a share,
    or a callable given the count of changed elements (``snapshot`` not yet moved) that
    says whether the tensor goes whole."""
    n = cur.numel()
    rounding = cur.dtype != snapshot.dtype
    cur = cur.reshape(-1).contiguous()
    cur_u, snap_u = _bits(cur), _bits(snapshot.view(-1))
    words = -(-n // 64)
    marks = np.empty(words, dtype=np.uint64)
    offsets = np.empty(-(-words // CHUNK_WORDS) + 1, dtype=np.int64)
    offsets[0] = 0
    counts = offsets[1:]  # mark writes each chunk's count; summed in place into offsets
    mark, collect = _KERNELS[n >= PARALLEL_MIN]
    mark(cur_u, snap_u, rounding, marks, counts)
    if counts.size > 1:
        np.cumsum(counts, out=counts)
    total = int(offsets[-1])
    if (dense_above(total) if callable(dense_above) else total > dense_above * n):
        snapshot.view(-1).copy_(cur)  # the same rounding as _bf16
        return Diff(total, None, None, None)
    flat = np.empty(total, dtype=np.int64)
    new = np.empty(total, dtype=snap_u.dtype)
    old = np.empty(total, dtype=snap_u.dtype)
    if total:
        collect(cur_u, snap_u, rounding, marks, offsets, flat, new, old)
    return Diff(total, torch.from_numpy(flat), _tensor(new, snapshot.dtype), _tensor(old, snapshot.dtype))


def sampled_differences(cur: torch.Tensor, snapshot: torch.Tensor, step: int) -> torch.Tensor:
    """The nonzero ulp differences (``new_bits - old_bits`` wrapping at the snapshot's width,
    as int64) of every ``step``-th element of ``cur`` (cast) against ``snapshot``: the
    torch ops' result (``patch.sampled_differences``) in one kernel call and three numpy ops."""
    cur_u, snap_u = _bits(cur.reshape(-1)), _bits(snapshot.view(-1))
    old = snap_u[::step]
    new = np.empty(old.size, dtype=snap_u.dtype)
    _sample_new(cur_u, cur.dtype != snapshot.dtype, step, new)
    diffs = (new - old).view(_NP_SIGNED[snap_u.itemsize]).astype(np.int64)
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


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a (1-D) tensor as an unsigned numpy array (numpy has no bf16: those go
    through a signed torch view)."""
    if t.dtype in _NUMPY_NATIVE:
        return t.numpy().view(_UINT[t.element_size()])
    return t.view(_SIGNED[t.element_size()]).numpy().view(_UINT[t.element_size()])


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(_NP_SIGNED[a.itemsize])).view(dtype)
