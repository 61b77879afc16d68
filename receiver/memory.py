"""Releasing and reallocating the weights' memory for ``sleep`` / ``wakeup``.

Every synced tensor keeps its Python object, shape and dtype; only its storage shrinks to
zero bytes, so the engine's references to the parameters (and the receiver's name
mapping) stay valid and the memory goes back to the allocator. Tied tensors share a
storage, released once. Non-persistent buffers are not synced, so they are kept.

A storage PyTorch has marked non-resizable (any ``tensor.numpy()`` export does that) is
swapped instead: the model's own parameters and buffers on it move to a new storage that
is then shrunk, and the old one is freed once nothing else references it (a view the
engine made of a parameter earlier keeps it alive). Contents are gone either way: after
``restore`` the storages hold uninitialised memory until a bootstrap writes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from protocol.state import StateLike


@dataclass
class ReleasedWeights:
    storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storages)

    def restore(self) -> None:
        """Give every storage its size back (contents undefined)."""
        for storage, nbytes in self.storages:
            storage.resize_(nbytes)


def _ident(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _owners(model: StateLike) -> Iterator[torch.Tensor]:
    """The tensor objects the model itself holds (not state-dict aliases)."""
    if isinstance(model, nn.Module):
        yield from (t for _, t in model.named_parameters(remove_duplicate=False))
        yield from (t for _, t in model.named_buffers(remove_duplicate=False))
    else:
        yield from (t for t in model.values() if isinstance(t, torch.Tensor))


@torch.no_grad()
def release(model: StateLike, synced: Mapping[str, torch.Tensor]) -> ReleasedWeights:
    """Shrink the storage of every tensor in ``synced`` (the state of ``model``) to zero
    bytes; call under the model's write lock."""
    storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    for t in synced.values():
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(_ident(t), storage)
    owners: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for t in _owners(model):
        if _ident(t) in storages:
            owners.setdefault(_ident(t), []).append(t)
    out = ReleasedWeights()
    for ident, storage in storages.items():
        nbytes = storage.nbytes()
        if not storage.resizable():
            fresh = torch.UntypedStorage(nbytes, device=storage.device)
            for t in owners.get(ident, []):
                t.set_(fresh, t.storage_offset(), t.shape, t.stride())
            storage = fresh
        storage.resize_(0)
        out.storages.append((storage, nbytes))
    return out
