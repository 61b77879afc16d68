"""Span entries (protocol 6, ``TensorEntry.span``): the changes of one range [lo, hi) of a
tensor's flat elements as an entry of their own, so a tensor's changes of a version can
travel in several entries, one per trainer rank's shard, and no rank gathers the tensor.

A span entry is coded exactly as a 1-D tensor of hi - lo elements would be, its positions
relative to lo, by the same encoders the patch builder uses (``sparse_buffers``: the host
codec, or the device codec where ``options`` say so); a dense one carries exactly the
hi - lo values of its range. The receiver decodes it as such a tensor (XOR and ulp values
against the range's old values) and writes it at lo + its positions
(``tensorcodec.at_span``). A tensor's span entries within a version are disjoint and
ascending, across parts too; none is grouped, and none travels outside a PATCH.
"""

from __future__ import annotations

import dataclasses

import torch

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, encode_dense, encode_sparse
from protocol.errors import ConfigError
from protocol.wire.framing import Encoding


def _checked(span: tuple[int, int]) -> tuple[int, int]:
    lo, hi = span
    if not 0 <= lo < hi:
        raise ConfigError(f"span [{lo}, {hi}) is empty or negative")
    return lo, hi


def as_span(entry: EncodedTensor, span: tuple[int, int], key: int | None = None) -> EncodedTensor:
    """``entry``, coded as a 1-D tensor of hi - lo elements (by any encoder: sparse or
    dense, host or device codec), as the span entry of [lo, hi) of tensor ``key`` (default:
    its own) it then is, byte for byte. The one place a span entry is made."""
    lo, hi = _checked(span)
    if entry.group or entry.span is not None:
        raise ConfigError(f"tensor {entry.key}: a grouped entry, or one that is a span already, cannot become a span")
    if entry.encoding is Encoding.DENSE and entry.nnz != hi - lo:
        raise ConfigError(f"{entry.nnz} values for a span of {hi - lo} elements")
    return dataclasses.replace(entry, key=entry.key if key is None else key, span=(lo, hi))


def encode_span(
    key: int, span: tuple[int, int], flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, options: PatchOptions
) -> EncodedTensor:
    """The changes of flat elements [lo, hi) of tensor ``key`` as a span entry: ``flat``
    their positions relative to lo (sorted, int32 or int64, each below hi - lo, at least
    one), ``new`` and ``old`` their values, coded as ``encode_sparse`` codes a tensor of
    hi - lo elements (``options``: the encodings, the compression, host or device codec)."""
    lo, hi = _checked(span)
    if flat.numel() == 0:
        raise ConfigError("a span entry carries at least one change")
    return as_span(encode_sparse(key, flat, new, old, (hi - lo,), options), span)


def encode_dense_span(key: int, span: tuple[int, int], values: torch.Tensor, codec: Codec) -> EncodedTensor:
    """Flat elements [lo, hi) of tensor ``key`` sent whole: ``values``, hi - lo of them (any
    shape: they are taken flat, row-major), ``codec`` compressing them where that pays."""
    return as_span(encode_dense(key, values.reshape(-1), codec), span)
