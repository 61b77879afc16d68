"""Checksums of wire buffers and digests of whole model states (xxHash3)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from protocol.wire.buffers import Buffer, tensor_view
from protocol.wire.dtypes import dtype_code


def checksum(buf: Buffer) -> int:
    """64-bit xxh3 of a buffer's bytes, as carried in a buffer's manifest entry."""
    return xxhash.xxh3_64_intdigest(buf)


def state_digest(tensors: Mapping[str, torch.Tensor], keys: list[str] | None = None) -> str:
    """A digest of names, dtypes, shapes and bytes; equal digests mean bit-identical states.

    ``keys`` restricts and orders what is hashed (default: all keys, sorted). CUDA
    tensors are copied to the host one at a time.
    """
    h = xxhash.xxh3_128()
    for key in sorted(tensors) if keys is None else keys:
        t = tensors[key].detach()
        h.update(key.encode())
        h.update(f"|{dtype_code(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(tensor_view(t.cpu()))
    return h.hexdigest()
