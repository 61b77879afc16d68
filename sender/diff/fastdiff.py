"""A fused CPU diff: cast, compare, collect and update the snapshot.

The plain torch path makes several passes over model-sized arrays (cast to the receiver
dtype, compare, nonzero, gather, scatter into the snapshot). Here a numba kernel reads
the state and the snapshot once, writing one bit per element and a count per chunk
(64 compares shifted into each word, which vectorizes);
a second visits the changed elements alone to collect them and move the snapshot
forward. When more than ``dense_above`` of the elements changed, the second pass is
skipped: the caller sends the tensor whole, and the snapshot becomes a plain copy.

Given how many changes to expect (``expect``: the tensor's count last version), the compare
collects in the same pass, each word's changes while its elements are still in cache (the
second pass re-reads a changed element's cache line from memory: at 1% changed, that is
most lines). A serial pass (tensors below ``PARALLEL_MIN``) collects in order straight into
arrays with room for 1.5x the expected count, and what overflows them is collected after,
from the marks. The threaded pass (below ``THREADED_ONE_PASS_BELOW`` expected changed) gives
each chunk room for 1.5x its share and moves the chunks into place after; a chunk that
overflows its room is collected again from its marks (its snapshot moves only then).
Used for CPU tensors when the receiver dtype is the state's own, or fp32 state to a
bf16 receiver (the common RL case); other pairs, and CUDA tensors, take the torch path,
and so does everything when numba is missing.

fp32 -> bf16 rounds exactly as torch's CPU cast does: to nearest even, NaN to 0xFFFF.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import FunctionType
from typing import Any, NamedTuple

import numpy as np
import torch

from protocol.codec.aot import Signature, array, compile_all, scalar

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None  # type: ignore[assignment, unused-ignore]

CHUNK_WORDS = 1024  # 65536 elements per parallel task
PARALLEL_MIN = 1 << 22  # elements from which the kernels run on all cores
# The threaded one pass writes each change twice (into its chunk's room, then into place):
# from about this share expected changed, the two passes are faster. ms a 12.6M-element fp32
# tensor against bf16 (two passes, one pass), 2 cores: at 1% 5.4, 3.5; 3% 5.6, 3.5; 10% 4.3,
# 5.8; 16% 4.4, 8.0. The serial one pass writes each change once: 0.97-1.05x the two passes
# from 6% to 25%, 0.69-0.79x at 1-3% on 2.4M elements.
THREADED_ONE_PASS_BELOW = 0.05
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_NATIVE = {torch.float16, torch.float32, torch.float64, torch.int16, torch.int32, torch.int64}


def position_dtype(numel: int) -> type[np.signedinteger[Any]]:
    """What the flat indices of a tensor of ``numel`` elements are collected as: int32 where
    they fit, so a change captures 8 bytes (bf16) rather than 12, in memory and in writes."""
    return np.int32 if numel <= np.iinfo(np.int32).max else np.int64


class Diff(NamedTuple):
    """``changed`` elements; their sorted flat indices (``position_dtype``) and new and old values, or
    None for all three when the tensor went dense (past ``dense_above``)."""

    changed: int
    flat: torch.Tensor | None
    new: torch.Tensor | None
    old: torch.Tensor | None


class Kernels(NamedTuple):
    """One build (serial or threaded) of the two-pass kernels: mark, then collect."""

    mark: Any
    collect: Any


class ChunkedOnePass(NamedTuple):
    """The threaded one pass: each chunk collects into room of its own, moved into place after."""

    mark_collect: Any
    compact: Any


class SerialOnePass(NamedTuple):
    """The serial one pass: a tensor's changes in order, straight into their arrays."""

    mark_collect: Any
    collect_from: Any


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
    def _word(cur, snap, base, rounding):  # pragma: no cover - numba
        """Bit ``q`` set where element ``base + q`` changed, for the 64 elements from ``base``.
        One loop of compares shifted into a word: LLVM turns it into vector compares and
        byte masks, ~1.5x faster from memory than comparing into a byte buffer and packing."""
        m = np.uint64(0)
        if rounding:
            for q in range(64):
                m |= np.uint64(_bf16(cur[base + q]) != snap[base + q]) << np.uint64(q)
        else:
            for q in range(64):
                m |= np.uint64(cur[base + q] != snap[base + q]) << np.uint64(q)
        return m

    @numba.njit(inline="always")
    def _tail_word(cur, snap, base, rounding):  # pragma: no cover - numba
        """``_word`` for the last, partial word (from ``base`` to the end); zeros past it."""
        m = np.uint64(0)
        for q in range(cur.shape[0] - base):
            value = _bf16(cur[base + q]) if rounding else cur[base + q]
            m |= np.uint64(value != snap[base + q]) << np.uint64(q)
        return m

    @numba.njit(inline="always")
    def _take_word(cur, snap, rounding, m, w, flat, new, old, o, first=0, move=True):  # pragma: no cover - numba
        """Word ``w``'s changes (its mark ``m``) appended at ``o``, their positions offset by
        ``first`` (``cur`` and ``snap`` may be a chunk's views) and the snapshot moved unless
        not ``move``; the next ``o``.

        The indices are unsigned: for a signed one numba adds a negative-index fixup to every
        access, five a change (the serial one pass of the quick model's lr 1e-5 step: 6.5 -> 6.0 ms)."""
        at = np.uint64(o)
        start = np.uint64(w * 64)
        while m:
            i = start + np.uint64(_popcount((m & (~m + np.uint64(1))) - np.uint64(1)))  # the lowest set bit
            m &= m - np.uint64(1)
            value = _bf16(cur[i]) if rounding else cur[i]
            flat[at] = first + np.int64(i)
            new[at] = value
            old[at] = snap[i]
            if move:
                snap[i] = value
            at += np.uint64(1)
        return np.int64(at)

    @numba.njit(nogil=True, cache=True)
    def _chunk_marks(cur, snap, rounding, marks):  # pragma: no cover - numba
        """One chunk's marks (``cur``, ``snap`` and ``marks`` are its views); its count.
        A function of its own: with the partial word's loop inlined after the full words',
        the serial build no longer vectorized (3.5x slower)."""
        total = 0
        full_words = cur.shape[0] >> 6
        for w in range(full_words):
            m = _word(cur, snap, w * 64, rounding)
            marks[w] = m
            total += _popcount(m)
        if cur.shape[0] & 63:
            m = _tail_word(cur, snap, full_words * 64, rounding)
            marks[full_words] = m
            total += _popcount(m)
        return total

    @numba.njit(nogil=True, cache=True)
    def _chunk_mark_collect(cur, snap, rounding, marks, first, flat, new, old, room):  # pragma: no cover - numba
        """``_chunk_marks``, collecting the chunk's changes into ``flat``, ``new`` and
        ``old`` (its ``room`` slots) while their elements are in cache; the count, and
        whether they fit (the snapshot is moved only then). ``first``: the chunk's offset."""
        total = 0
        o = 0
        fits = True
        full_words = cur.shape[0] >> 6
        for w in range((cur.shape[0] + 63) >> 6):
            m = _word(cur, snap, w * 64, rounding) if w < full_words else _tail_word(cur, snap, w * 64, rounding)
            marks[w] = m
            k = _popcount(m)
            total += k
            if not fits or k == 0:
                continue
            if o + k > room:
                fits = False
                continue
            o = _take_word(cur, snap, rounding, m, w, flat, new, old, o, first, False)
        if fits:
            for j in range(o):
                snap[flat[j] - first] = new[j]
        return total, fits

    def _mark(cur, snap, rounding, marks, counts):  # pragma: no cover - numba
        """Bit ``i`` of ``marks`` is set where element ``i`` changed; ``counts`` per chunk."""
        n = cur.shape[0]
        for c in numba.prange(counts.shape[0]):
            first, end = c * CHUNK_WORDS * 64, min(n, (c + 1) * CHUNK_WORDS * 64)
            counts[c] = _chunk_marks(cur[first:end], snap[first:end], rounding, marks[c * CHUNK_WORDS:])

    def _collect(cur, snap, rounding, marks, offsets, only, flat, new, old):  # pragma: no cover - numba
        """The changes of the chunks ``only`` flags (all, when it is empty), from their marks."""
        for c in numba.prange(offsets.shape[0] - 1):
            o = offsets[c]
            if offsets[c + 1] == o or (only.shape[0] and not only[c]):
                continue
            for w in range(c * CHUNK_WORDS, min(marks.shape[0], (c + 1) * CHUNK_WORDS)):
                o = _take_word(cur, snap, rounding, marks[w], w, flat, new, old, o)

    def _mark_collect(cur, snap, rounding, marks, counts, flat, new, old, room, spilled):  # pragma: no cover - numba
        """``_mark``, collecting each chunk's changes into its ``room`` slots of ``flat``,
        ``new`` and ``old`` as it goes, and moving the snapshot once the chunk is done; a
        chunk with more changes than its room sets ``spilled`` and leaves its snapshot be."""
        n = cur.shape[0]
        for c in numba.prange(counts.shape[0]):
            first, end = c * CHUNK_WORDS * 64, min(n, (c + 1) * CHUNK_WORDS * 64)
            slots = slice(c * room, (c + 1) * room)
            total, fits = _chunk_mark_collect(
                cur[first:end], snap[first:end], rounding, marks[c * CHUNK_WORDS:], first, flat[slots], new[slots], old[slots], room
            )
            counts[c] = total
            if not fits:
                spilled[c] = 1

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

    @numba.njit(nogil=True, cache=True)
    def _run_mark_collect(cur, snap, rounding, marks, flat, new, old):  # pragma: no cover - numba
        """Marks, collecting each word's changes while its elements are in cache, in order,
        into ``flat``, ``new`` and ``old`` until they are full (moving the snapshot as it
        goes); (changes, collected, first word left to collect or -1)."""
        n = cur.shape[0]
        full_words = n >> 6
        total = 0
        o = 0
        stop = -1
        for w in range((n + 63) >> 6):
            m = _word(cur, snap, w * 64, rounding) if w < full_words else _tail_word(cur, snap, w * 64, rounding)
            marks[w] = m
            k = _popcount(m)
            total += k
            if k == 0 or stop >= 0:
                continue
            if o + k > flat.shape[0]:
                stop = w
                continue
            o = _take_word(cur, snap, rounding, m, w, flat, new, old, o)
        return total, o, stop

    @numba.njit(nogil=True, cache=True)
    def _run_collect_from(cur, snap, rounding, marks, first, flat, new, old, o):  # pragma: no cover - numba
        """The changes of words ``first`` on, from their marks, appended at ``o``."""
        for w in range(first, marks.shape[0]):
            o = _take_word(cur, snap, rounding, marks[w], w, flat, new, old, o)

    _SERIAL_ONE_PASS = SerialOnePass(_run_mark_collect, _run_collect_from)

    # The two-pass kernels twice: threads pay off on large tensors only. Waking a thread
    # team costs microseconds on an idle host and milliseconds on a busy one (a trainer's),
    # which would dominate a model's many small tensors. The two builds must be two
    # functions: numba's on-disk cache keys an entry by the function's name, line and
    # signature, not by ``parallel``, so one function compiled both ways would load
    # whichever build was cached first for both. Each copy gets its own name (so its own
    # cache file); the names are new, so no index written by the old one-function layout is ever read.
    _KERNELS = {
        parallel: Kernels(*(
            numba.njit(parallel=parallel, cache=True, nogil=True)(_named_copy(fn, "_parallel" if parallel else "_serial"))
            for fn in (_mark, _collect)
        ))
        for parallel in (False, True)
    }
    _THREADED_ONE_PASS = ChunkedOnePass(*(
        numba.njit(parallel=True, cache=True, nogil=True)(_named_copy(fn, "_parallel")) for fn in (_mark_collect, _compact)
    ))


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
    step = max(1, n // SAMPLE)
    # one pass moves the snapshot before the count is known: keep the rule's sample of it as it was
    before = snap_u[::step].copy() if callable(dense_above) and expect is not None else None

    def goes_whole(total: int) -> bool:
        if not callable(dense_above):
            return total > dense_above * n
        if before is None:
            return dense_above(total, lambda: sampled_differences(cur, snapshot, step))
        return dense_above(total, lambda: _differences(cur_u, before, rounding, step))

    if n < PARALLEL_MIN and expect is not None:
        return _serial_one_pass(cur, cur_u, snapshot, snap_u, rounding, expect, goes_whole)
    if expect is not None and expect > THREADED_ONE_PASS_BELOW * n:
        expect = None
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
        flat_t = np.empty(chunks * room, dtype=position_dtype(n))
        new_t, old_t = np.empty(chunks * room, dtype=snap_u.dtype), np.empty(chunks * room, dtype=snap_u.dtype)
        spilled = np.zeros(chunks, dtype=np.uint8)
        _THREADED_ONE_PASS.mark_collect(cur_u, snap_u, rounding, marks, counts, flat_t, new_t, old_t, room, spilled)
    if counts.size > 1:
        np.cumsum(counts, out=counts)
    total = int(offsets[-1])
    if goes_whole(total):
        snapshot.view(-1).copy_(cur)  # the same rounding as _bf16
        return Diff(total, None, None, None)
    if spilled is not None and chunks == 1 and not spilled[0]:  # collected where it stays
        return Diff(total, torch.from_numpy(flat_t[:total]), _tensor(new_t[:total], snapshot.dtype), _tensor(old_t[:total], snapshot.dtype))
    flat = np.empty(total, dtype=position_dtype(n))
    new = np.empty(total, dtype=snap_u.dtype)
    old = np.empty(total, dtype=snap_u.dtype)
    if total and spilled is None:
        kernels.collect(cur_u, snap_u, rounding, marks, offsets, _NO_CHUNKS, flat, new, old)
    elif total:
        assert spilled is not None
        _THREADED_ONE_PASS.compact(room, offsets, spilled, flat_t, new_t, old_t, flat, new, old)
        if spilled.any():
            kernels.collect(cur_u, snap_u, rounding, marks, offsets, spilled, flat, new, old)
    return Diff(total, torch.from_numpy(flat), _tensor(new, snapshot.dtype), _tensor(old, snapshot.dtype))


def _serial_one_pass(
    cur: torch.Tensor, cur_u: np.ndarray, snapshot: torch.Tensor, snap_u: np.ndarray, rounding: bool, expect: int,
    goes_whole: Callable[[int], bool],
) -> Diff:
    """``diff_and_update`` of a tensor below ``PARALLEL_MIN`` in one serial pass, collected
    in order into arrays with room for 1.5x ``expect``; the changes past that room are
    collected after, from the marks, into arrays of the right size."""
    n = cur_u.shape[0]
    room = min(n, (3 * expect) // 2 + 64)
    flat, new, old = np.empty(room, dtype=position_dtype(n)), np.empty(room, dtype=snap_u.dtype), np.empty(room, dtype=snap_u.dtype)
    marks = np.empty(-(-n // 64), dtype=np.uint64)
    total, collected, rest = _SERIAL_ONE_PASS.mark_collect(cur_u, snap_u, rounding, marks, flat, new, old)
    if goes_whole(total):
        snapshot.view(-1).copy_(cur)  # the same rounding as _bf16
        return Diff(total, None, None, None)
    if rest >= 0:
        flat, new, old = (np.concatenate([a[:collected], np.empty(total - collected, dtype=a.dtype)]) for a in (flat, new, old))
        _SERIAL_ONE_PASS.collect_from(cur_u, snap_u, rounding, marks, rest, flat, new, old, collected)
    return Diff(total, torch.from_numpy(flat[:total]), _tensor(new[:total], snapshot.dtype), _tensor(old[:total], snapshot.dtype))


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


def signatures(pairs: Iterable[tuple[torch.dtype, torch.dtype]], largest: int | None = None) -> list[Signature]:
    """What ``diff_and_update`` and ``sampled_differences`` hand the kernels for these
    (state, snapshot) dtype pairs (those ``supported``; ``protocol/codec/aot.py``): the
    elements' unsigned bits, and the changes' positions as ``position_dtype`` collects them.
    Positions are int64 only past 2**31 elements, which the threaded kernels alone see: their
    builds (~40% of the whole JIT) are left out where ``largest``, the most elements a tensor
    compared has, is below (None: any tensor, the compile step's)."""
    if numba is None:  # pragma: no cover - numba is a dependency
        return []
    builds: list[tuple[bool, type[np.signedinteger[Any]]]] = [(False, np.int32), (True, np.int32)]
    if largest is None or position_dtype(largest) is np.int64:
        builds.append((True, np.int64))
    flag, size, u8, u64, i64 = scalar(bool), scalar(int), array(np.uint8), array(np.uint64), array(np.int64)
    rows = []
    for state, snapshot in dict.fromkeys(pairs):
        if not supported(torch.empty(0, dtype=state), torch.empty(0, dtype=snapshot)):
            continue
        cur, snap = array(_UINT[state.itemsize]), array(_UINT[snapshot.itemsize])
        rows.append(Signature(_sample_new, (cur, flag, size, snap)))
        for parallel, positions in builds:
            flat, kernels = array(positions), _KERNELS[parallel]
            rows += [
                Signature(kernels.mark, (cur, snap, flag, u64, i64)),
                Signature(kernels.collect, (cur, snap, flag, u64, i64, u8, flat, snap, snap)),
            ]
            if parallel:
                rows += [
                    Signature(_THREADED_ONE_PASS.mark_collect, (cur, snap, flag, u64, i64, flat, snap, snap, size, u8)),
                    Signature(_THREADED_ONE_PASS.compact, (size, i64, u8, flat, snap, snap, flat, snap, snap)),
                ]
            else:
                rows += [
                    Signature(_SERIAL_ONE_PASS.mark_collect, (cur, snap, flag, u64, flat, snap, snap)),
                    Signature(_SERIAL_ONE_PASS.collect_from, (cur, snap, flag, u64, size, flat, snap, snap, size)),
                ]
    return rows


def warm_up(pairs: Iterable[tuple[torch.dtype, torch.dtype]], largest: int | None = None) -> None:
    """Compile (or load from numba's cache) the kernels for these (state, snapshot) dtype
    pairs (and tensors up to ``largest`` elements: ``signatures``) now, rather than in the
    first sync: each new pair costs seconds of JIT."""
    compile_all(signatures(pairs, largest))


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a (1-D) tensor as an unsigned numpy array (numpy has no bf16: those go
    through a signed torch view)."""
    if t.dtype in _NUMPY_NATIVE:
        return t.numpy().view(_UINT[t.element_size()])
    return t.view(_SIGNED[t.element_size()]).numpy().view(_UINT[t.element_size()])


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(_NP_SIGNED[a.itemsize])).view(dtype)
