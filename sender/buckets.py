"""Whole tensors in size-bounded buckets: the init bootstrap, resyncs and the bucket strategy."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from protocol.compress import Codec
from protocol.framing import Message, MessageType
from protocol.state import materialize
from protocol.tensorcodec import assemble, encode_dense


def plan_buckets(keys: list[str], nbytes: Callable[[str], int], bucket_size: int) -> list[list[str]]:
    """Group ``keys`` in order into buckets of at most ``bucket_size`` bytes.

    A tensor larger than ``bucket_size`` travels alone in its own bucket.
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key in keys:
        n = nbytes(key)
        if current and size + n > bucket_size:
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size += n
    if current:
        buckets.append(current)
    return buckets


def bucket_messages(
    mtype: MessageType,
    buckets: list[list[str]],
    tensors: dict[str, torch.Tensor],
    ordinal: Callable[[str], int],
    cast: Callable[[str, torch.Tensor], torch.Tensor],
    device: torch.device | None,
    *,
    version: int | None,
) -> Iterator[Message]:
    """One message per bucket, built lazily so at most one bucket is materialized at a time.

    ``cast`` gives a tensor its wire dtype; ``device`` (None: where it is) is where the
    cast happens before the bytes are copied to the host.
    """
    for part, keys in enumerate(buckets):
        entries = []
        for key in keys:
            t = materialize(tensors[key]).detach()
            if device is not None:
                t = t.to(device, non_blocking=True)
            entries.append(encode_dense(ordinal(key), cast(key, t).cpu(), Codec.NONE))
        specs, frames = assemble(entries)
        yield Message(mtype, version=version, part=part, parts=len(buckets), tensors=specs, frames=frames)
