"""The state digest of what a receiver holds: compared with the sender's at a handshake
(HELLO's ``digest``) and by ``update_weights(verify_checksum=True)``.

An engine may hold a tensor in its own layout (``protocol.state.Placed``), or a tied one
only once: each is read whole (``materialize``) first, or, where one cannot be, there is
no digest (a tensor-parallel rank holds only part of the model).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from protocol.state import Placed
from protocol.wire.checksum import state_digest
from protocol.wire.metadata import ModelMetadata

from ..rwlock import ReadWriteLock
from ..threads import in_thread


async def digest_of(
    tensors: Mapping[str, torch.Tensor | Placed], lock: ReadWriteLock, metadata: ModelMetadata | None, aliases: Mapping[int, list[int]],
) -> str | None:
    """The digest of ``tensors`` under ``lock``'s read side, off the event loop; None when
    some tensor cannot be read whole. ``metadata`` and ``aliases``: the tied names
    (``ReceiverBase``'s, from WELCOME), a placed one read from its twin."""
    async with lock.reading():
        if not any(isinstance(t, Placed) for t in tensors.values()):
            return await in_thread(state_digest, tensors, list(tensors))
        whole = await in_thread(materialize, tensors, metadata, aliases)
        return None if whole is None else await in_thread(state_digest, whole, list(whole))


def materialize(
    tensors: Mapping[str, torch.Tensor | Placed], metadata: ModelMetadata | None, aliases: Mapping[int, list[int]],
) -> dict[str, torch.Tensor] | None:
    """Every tensor whole; a tied one the engine keeps only once is read from its twin."""
    twins: dict[str, list[str]] = {}
    if metadata is not None:
        for canonical, group in aliases.items():
            names = [metadata.keys[canonical], *(metadata.keys[a] for a in group)]
            for name in names:
                twins[name] = names
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        whole = t.materialize() if isinstance(t, Placed) else t
        for twin in twins.get(key, ()):
            if whole is not None:
                break
            other = tensors[twin]
            whole = other.materialize() if isinstance(other, Placed) else other
        if whole is None:
            return None
        out[key] = whole
    return out
