"""Whole copies of host tensors that may travel dense, reused from version to version.

A patch keeps a whole copy of each tensor that may go whole (its snapshot is overwritten
by the next version while the copy is still being sent). A fresh copy of a large tensor
lands in fresh pages, and faulting them in costs several times the copy itself here
(200 MB: ~75 ms against ~11 ms into pages already touched). So each key keeps its last
``KEPT`` copies and writes the next one into one that nothing else holds any more: no
frame being sent, no patch in the sender's ring (the storage's reference count says;
torch builds that lack the count get a fresh copy every time).
"""

from __future__ import annotations

import torch

KEPT = 2  # a key's copies: the newest patch's (in the ring, being sent) and the one being written

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage has no other holder (no view, numpy array or frame of it)."""
    if _use_count is None:
        return False
    # the count includes the Python storage object asked for it: t's reference and that one
    return int(_use_count(t.untyped_storage()._cdata)) <= 2


class WholeCopies:
    """A few reusable whole copies a key. Not thread-safe: one compare at a time uses it."""

    def __init__(self) -> None:
        self._held: dict[str, list[torch.Tensor]] = {}

    def copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``src``: into one of ``key``'s earlier ones that no one holds any more."""
        held = self._held.setdefault(key, [])
        free = next((t for t in held if t.shape == src.shape and t.dtype == src.dtype and t.device == src.device and _unshared(t)), None)
        if free is None:
            free = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            held.append(free)
            del held[:-KEPT]  # the oldest is forgotten: freed once its holders let go
        free.copy_(src)
        return free.view(free.shape)  # a view: whoever holds it counts as a holder of the storage

    def drop(self, key: str) -> None:
        """Forget ``key``'s copies (it no longer goes whole): their memory goes once their users let go."""
        self._held.pop(key, None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self._held.values() for t in held)
