"""A fused CPU diff: cast, compare, collect and update the snapshot in few passes.

The plain torch path makes several passes over model-sized arrays (cast to the receiver
dtype, compare, nonzero, gather, scatter into the snapshot). Here numba kernels read
the state and the snapshot once to mark changes (one byte per element), then visit the
changed elements alone to collect them and move the snapshot forward. Used for CPU
tensors when the receiver dtype is the state's own, or fp32 state to a bf16 receiver
(the common RL case); other pairs, and CUDA tensors, take the torch path, and so does
everything when numba is missing.

fp32 -> bf16 rounds exactly as torch's CPU cast does: to nearest even, NaN to 0xFFFF.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None  # type: ignore[assignment]

CHUNK_BITS = 16  # 65536 elements per parallel task
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}

if numba is not None:

    @numba.njit(inline="always")
    def _bf16(u):
        rounded = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return np.uint16(0xFFFF) if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded

    # One kernel per case, so each inner loop is branch-free and vectorizes.
    @numba.njit(parallel=True, cache=True, nogil=True)
    def _mark_bf16(cur, snap, marks):
        n = cur.shape[0]
        for c in numba.prange((n + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS):
            for i in range(c << CHUNK_BITS, min(n, (c + 1) << CHUNK_BITS)):
                marks[i] = _bf16(cur[i]) != snap[i]

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _mark_same(cur, snap, marks):
        n = cur.shape[0]
        for c in numba.prange((n + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS):
            for i in range(c << CHUNK_BITS, min(n, (c + 1) << CHUNK_BITS)):
                marks[i] = cur[i] != snap[i]

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _count(words, counts):
        per_chunk = 1 << (CHUNK_BITS - 3)  # marks are bytes: 8 to a word
        for c in numba.prange(counts.shape[0]):
            total = 0
            for w in range(c * per_chunk, min(words.shape[0], (c + 1) * per_chunk)):
                total += (words[w] * np.uint64(0x0101010101010101)) >> np.uint64(56)  # bytes are 0 or 1
            counts[c] = total

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _collect(cur, snap, rounding, words, offsets, flat, new, old):
        per_chunk = 1 << (CHUNK_BITS - 3)
        for c in numba.prange(offsets.shape[0] - 1):
            o = offsets[c]
            if offsets[c + 1] == o:
                continue
            for w in range(c * per_chunk, min(words.shape[0], (c + 1) * per_chunk)):
                if words[w] == 0:  # eight unchanged elements at once
                    continue
                for i in range(w * 8, w * 8 + 8):
                    if (words[w] >> np.uint64(8 * (i - w * 8))) & np.uint64(1):
                        value = _bf16(cur[i]) if rounding else cur[i]
                        flat[o] = i
                        new[o] = value
                        old[o] = snap[i]
                        snap[i] = value  # the snapshot moves to the new version in the same pass
                        o += 1


def supported(cur: torch.Tensor, snapshot: torch.Tensor) -> bool:
    """Whether the fused kernels handle this pair (else use the torch path)."""
    if numba is None or cur.device.type != "cpu" or snapshot.device.type != "cpu" or not snapshot.is_contiguous():
        return False
    same = cur.dtype == snapshot.dtype and cur.element_size() in _UINT
    return same or (cur.dtype == torch.float32 and snapshot.dtype == torch.bfloat16)


def diff_and_update(cur: torch.Tensor, snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted int64 flat indices where ``cur`` (cast to the snapshot's dtype) differs
    bitwise from ``snapshot``, and the new and old values there; ``snapshot`` is moved
    to the new values in place."""
    n = cur.numel()
    rounding = cur.dtype != snapshot.dtype
    cur_u, snap_u = _bits(cur.reshape(-1).contiguous()), _bits(snapshot.view(-1))
    marks = np.zeros(-(-n // 8) * 8, dtype=np.bool_)  # whole words: the tail stays unmarked
    (_mark_bf16 if rounding else _mark_same)(cur_u, snap_u, marks)
    words = marks.view(np.uint64)
    counts = np.empty((n + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS, dtype=np.int64)
    _count(words, counts)
    offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    flat = np.empty(total, dtype=np.int64)
    new = np.empty(total, dtype=snap_u.dtype)
    old = np.empty(total, dtype=snap_u.dtype)
    if total:
        _collect(cur_u, snap_u, rounding, words, offsets, flat, new, old)
    return torch.from_numpy(flat), _tensor(new, snapshot.dtype), _tensor(old, snapshot.dtype)


def warm_up(pairs: set[tuple[torch.dtype, torch.dtype]]) -> None:
    """Compile (or load from numba's cache) the kernels for these (state, snapshot) dtype
    pairs now, rather than in the first sync: each new pair costs seconds of JIT."""
    for state_dtype, snapshot_dtype in pairs:
        cur, snapshot = torch.ones(9, dtype=state_dtype), torch.zeros(9, dtype=snapshot_dtype)
        if supported(cur, snapshot):
            diff_and_update(cur, snapshot)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a contiguous tensor as an unsigned numpy array (numpy has no bf16)."""
    return t.view(_SIGNED[t.element_size()]).numpy().view(_UINT[t.element_size()])


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    signed = {2: np.int16, 4: np.int32, 8: np.int64}[a.itemsize]
    return torch.from_numpy(a.view(signed)).view(dtype)
