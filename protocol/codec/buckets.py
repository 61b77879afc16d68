"""Whole tensors in size-bounded buckets: the init bootstrap, resyncs and the bucket strategy."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import assemble, encode_dense
from protocol.state import materialize
from protocol.wire.framing import Message, MessageType


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
    source: Callable[[str], torch.Tensor],
    ordinal: Callable[[str], int],
    cast: Callable[[str, torch.Tensor], torch.Tensor],
    device: torch.device | None,
    *,
    version: int | None,
    copy: bool = True,
) -> Iterator[Message]:
    """One message per bucket, built lazily so at most one bucket is materialized at a time.

    ``cast`` gives a tensor its wire dtype; ``device`` (None: where it is) is where the
    cast happens before the bytes are copied to the host. Frames reference their
    tensors without copying, so ``copy`` must stay True unless ``source`` gives tensors
    that are never written again: a frame still queued must not change under the checksum.
    """
    for part, keys in enumerate(buckets):
        entries = []
        for key in keys:
            src = materialize(source(key)).detach()
            t = src if device is None else src.to(device, non_blocking=True)
            host = cast(key, t).cpu()
            if copy and host.data_ptr() == src.data_ptr():  # neither the cast nor a move copied it
                host = host.clone()
            entries.append(encode_dense(ordinal(key), host, Codec.NONE))
        specs, frames = assemble(entries)
        yield Message(mtype, version=version, part=part, last=part == len(buckets) - 1, tensors=specs, frames=frames)
