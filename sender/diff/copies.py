"""A host snapshot lent as its tensor's whole new value, and copied before it is written while lent.

A tensor that may go whole needs its new values held still while they are sent (and kept
in the sender's ring), and after its compare its snapshot holds exactly those values. So
the snapshot itself is lent to the version (``lend``: a view of it) instead of being copied,
and the key's next compare, if that version still holds the loan, first moves the snapshot
into a buffer no one holds (``writable``: copy on write). A version nobody holds any more
(a sparse send, or a dense one every receiver has and the ring let go) costs no copy at all;
one still held costs one copy, as a copy for every candidate did before.

A fresh buffer lands in fresh pages, and faulting them in costs several times the copy
itself here (200 MB: ~75 ms against ~11 ms into pages already touched), so each key keeps
its last ``KEPT`` replaced snapshots and copies into one that nothing holds any more (the
storage's reference count says). Torch builds without the count get a clone per loan.
"""

from __future__ import annotations

import torch

KEPT = 2  # a key's replaced snapshots kept for reuse: the newest is usually still in the ring

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage has no other holder (no view, numpy array or frame of it)."""
    if _use_count is None:
        return False
    # the count includes the Python storage object asked for it: t's reference and that one
    return int(_use_count(t.untyped_storage()._cdata)) <= 2


class LentSnapshots:
    """Which host snapshots are lent, and each key's spare buffers. Not thread-safe: one
    compare (or recapture) at a time uses it, the only code that writes snapshots."""

    def __init__(self) -> None:
        self._lent: set[str] = set()
        self._spare: dict[str, list[torch.Tensor]] = {}

    def lend(self, key: str, snap: torch.Tensor) -> torch.Tensor:
        """``snap``'s values, to send whole: a view of it (the holder counts as one), or a
        clone where torch cannot count holders. ``writable`` before ``snap`` is written again."""
        if _use_count is None:
            return snap.clone()
        self._lent.add(key)
        return snap.view(snap.shape)

    def writable(self, key: str, snap: torch.Tensor) -> torch.Tensor:
        """``key``'s snapshot ready to be written: ``snap`` itself unless a loan of it is
        still held, else a copy of it in a buffer no one holds, which the caller stores as
        the snapshot from now on (``snap`` becomes a spare, reused once let go)."""
        if key not in self._lent:
            return snap
        self._lent.discard(key)
        if _unshared(snap):
            return snap
        spares = self._spare.setdefault(key, [])
        free = next((t for t in spares if t.shape == snap.shape and t.dtype == snap.dtype and _unshared(t)), None)
        if free is None:
            free = torch.empty(snap.shape, dtype=snap.dtype, device=snap.device)
        else:
            spares.remove(free)
        free.copy_(snap)
        spares.append(snap)
        del spares[:-KEPT]  # the oldest is forgotten: freed once its holders let go
        return free

    def drop(self, key: str) -> None:
        """Forget ``key``'s spares (it no longer goes whole): their memory goes once their holders let go."""
        self._spare.pop(key, None)

    def spare_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for spares in self._spare.values() for t in spares)
