"""Span entries (``TensorEntry.span``): the changes of some flat elements of a tensor (a
range [lo, hi), protocol 6, or a strided block of runs, protocol 7: ``protocol/wire/span.py``)
as an entry of their own, so a tensor's changes of a version can travel in several entries,
one per trainer rank's shard, and no rank gathers the tensor.

A span entry is coded exactly as a 1-D tensor of ``span.numel`` elements would be (the
span's elements in order: a strided block's runs end to end), its positions relative to the
span, by the same encoders the patch builder uses (``sparse_buffers``: the host codec, or
the device codec where ``options`` say so); a dense one carries exactly the span's values.
The receiver decodes it as such a tensor (XOR and ulp values against the span's old values)
and writes it at the positions the span maps its own to (``tensorcodec.at_span``). A
tensor's span entries within a version are disjoint, in any order, across parts too; none
is grouped, and none travels outside a PATCH.
"""

from __future__ import annotations

import dataclasses

import torch

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, encode_dense, encode_sparse
from protocol.errors import ConfigError
from protocol.wire.framing import Encoding
from protocol.wire.span import Span


def as_span(entry: EncodedTensor, span: Span, key: int | None = None) -> EncodedTensor:
    """``entry``, coded as a 1-D tensor of ``span.numel`` elements (by any encoder: sparse or
    dense, host or device codec), as the span entry of ``span`` of tensor ``key`` (default:
    its own) it then is, byte for byte. The one place a span entry is made."""
    if not isinstance(span, Span):
        raise ConfigError(f"a span is a protocol.wire.span.Span, not {type(span).__name__}")
    if entry.group or entry.span is not None:
        raise ConfigError(f"tensor {entry.key}: a grouped entry, or one that is a span already, cannot become a span")
    if entry.encoding is Encoding.DENSE and entry.nnz != span.numel:
        raise ConfigError(f"{entry.nnz} values for a span of {span.numel} elements")
    return dataclasses.replace(entry, key=entry.key if key is None else key, span=span)


def encode_span(key: int, span: Span, flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, options: PatchOptions) -> EncodedTensor:
    """The changes of the flat elements ``span`` covers of tensor ``key`` as a span entry:
    ``flat`` their positions relative to the span (its p-th element: sorted, int32 or int64,
    each below ``span.numel``, at least one), ``new`` and ``old`` their values, coded as
    ``encode_sparse`` codes a tensor of ``span.numel`` elements (``options``: the encodings,
    the compression, host or device codec)."""
    if flat.numel() == 0:
        raise ConfigError("a span entry carries at least one change")
    return as_span(encode_sparse(key, flat, new, old, (span.numel,), options), span)


def encode_dense_span(key: int, span: Span, values: torch.Tensor, codec: Codec) -> EncodedTensor:
    """The flat elements ``span`` covers of tensor ``key`` sent whole: ``values``, ``span.numel``
    of them in the span's order (any shape: they are taken flat, row-major; a strided block's
    ``span.of(flat)`` is one), ``codec`` compressing them where that pays."""
    return as_span(encode_dense(key, values.reshape(-1), codec), span)
