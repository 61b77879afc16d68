"""Whole tensors in size-bounded buckets: the init bootstrap, resyncs and the bucket strategy."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import assemble, encode_dense
from protocol.codec.tohost import to_host
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
    dtype: Callable[[str, torch.Tensor], torch.dtype],
    device: torch.device | None,
    *,
    version: int | None,
    copy: bool = True,
    copied: Callable[[float], None] | None = None,
) -> Iterator[Message]:
    """One message per bucket, built lazily so at most one bucket is materialized at a time.

    ``dtype`` gives a tensor its wire dtype; ``device`` (None: where it is) is where the
    cast happens before the bytes are copied to the host: a bucket's CUDA tensors in one
    copy to pinned memory (``tohost``). Frames reference their host tensors without
    copying, so ``copy`` must stay True unless ``source`` gives tensors that are never
    written again: a frame still queued must not change under the checksum. ``copied``
    gets the device seconds of each copy to the host.
    """
    for part, keys in enumerate(buckets):
        tensors = [source(key) for key in keys]
        hosts = to_host(tensors, [dtype(key, t) for key, t in zip(keys, tensors)], device, copy=copy, copied=copied)
        entries = [encode_dense(ordinal(key), host, Codec.NONE) for key, host in zip(keys, hosts)]
        del tensors, hosts
        specs, frames = assemble(entries)
        yield Message(mtype, version=version, part=part, last=part == len(buckets) - 1, tensors=specs, frames=frames)
