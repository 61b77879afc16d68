"""Span entries (``TensorEntry.span``): a tensor's changes of one version in several
entries, one per span of its flat elements (a trainer rank's shard: a range [lo, hi),
protocol 6, or a strided block of columns, protocol 7), each coded as a 1-D tensor of the
span's elements.

A version split into span entries, whatever the split (row or flat ranges, 1 to 4 of them,
gaps between them, or 2-D tensors cut into column blocks as tensor-parallel ranks hold a
row-parallel weight), the arrival order (by tensor, interleaved, shuffled: a tensor's spans
in any order), the codec of each span (the host codec's encodings, the device codec,
dense), the targets (plain, non-contiguous, ``Placed``) and the delivery (one message or
several parts, decoded from the frames or staged as a GPU target's are), leaves a real
receiver bit-identical to what the unsplit message makes. Hostile spans are in test_hostile.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from channel import Channel
from coded import stage_decoded
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_device_codec import bits, bitwise_changes, float_pair, integer_pair

import receiver
import sender
from protocol.codec.compress import Codec
from protocol.codec.spans import encode_dense_span, encode_span
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import BlocksEntry, EncodedTensor, PatchOptions, assemble, at_span, decode_blocks, decode_entry, encode_sparse
from protocol.errors import ProtocolError
from protocol.state import Placed
from protocol.wire.framing import Encoding, Message, MessageType, ValueEncoding, decode_message, encode_message
from protocol.wire.span import Span
from receiver.held.layout import MappedTensor, Segment

CPU = torch.device("cpu")
CONFIG = {"type": "patch", "patch": {"group_numel": 0}}
DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool)
HOST_OPTIONS = {
    "default": PatchOptions(dense_above=1.0, device_codec=False),  # packed ANS_GAPS + ULP, or gaps/bitmap + XOR when few
    "gaps-raw": PatchOptions(Encoding.GAPS, ValueEncoding.RAW, dense_above=1.0),
    "bitmap-xor-zstd": PatchOptions(Encoding.BITMAP, ValueEncoding.XOR, Codec.ZSTD, dense_above=1.0),
    "coo-delta-raw-lz4": PatchOptions(Encoding.COO_DELTA, ValueEncoding.RAW, Codec.LZ4, dense_above=1.0),
    "ans-ulp-separate": PatchOptions(Encoding.ANS_GAPS, ValueEncoding.ULP, dense_above=1.0),
}
DEVICE = PatchOptions(dense_above=1.0, device_codec=True)
WHOLE = HOST_OPTIONS["default"]
CODECS = [*HOST_OPTIONS, "device", "dense"]


# -- targets ------------------------------------------------------------------------------------
def mapped(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> MappedTensor:
    """A ``Placed`` target: its flat elements in two storages, the first at an offset."""
    n = math.prod(shape)
    m = n // 2
    a, b = torch.zeros(m + 3, dtype=dtype), torch.zeros(n - m, dtype=dtype)
    segments = [Segment("a", a, 0, (m,), (1,), 3, (1,), "range"), Segment("b", b, m, (n - m,), (1,), 0, (1,), "range")]
    return MappedTensor(key, shape, dtype, CPU, [s for s in segments if s.numel])


def target(key: str, shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor | Placed:
    if layout == "strided" and len(shape) == 2:  # a transposed view: not contiguous
        return torch.zeros(shape[::-1], dtype=dtype).t()
    if layout == "placed":
        return mapped(key, shape, dtype)
    return torch.zeros(shape, dtype=dtype)


def whole(t: torch.Tensor | Placed) -> torch.Tensor:
    if isinstance(t, Placed):
        out = t.materialize()
        assert out is not None
        return out
    return t


# -- delivery -----------------------------------------------------------------------------------
async def at_base(state: dict[str, torch.Tensor], model: dict[str, Any], staged: bool) -> Any:
    """A patch receiver holding ``state`` at v0 (bootstrapped by a real sender) in ``model``;
    ``staged``: its entries go through a part's one transfer, as a GPU target's do."""
    s, r = sender.make_sender(CONFIG), receiver.make_receiver(CONFIG)
    if staged:
        r.staging = StagingPool(cpu_too=True)
    ch = Channel()
    await asyncio.wait_for(
        asyncio.gather(
            s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv, version=0),
            r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send),
        ),
        timeout=60,
    )
    assert r.version == 0
    return r


def frames_of(r: Any, parts: list[list[EncodedTensor]], version: int = 1, mtype: MessageType = MessageType.PATCH) -> list[list[bytes]]:
    """The messages of a version of ``parts`` (each a message's entries), from ``r``'s sender session."""
    out = []
    for i, entries in enumerate(parts):
        tensors, frames = assemble(entries)
        msg = Message(mtype, session=r.session, seq=100 + i, version=version, base_version=version - 1 if mtype is MessageType.PATCH else None,
                      part=i, last=i == len(parts) - 1, tensors=tensors, frames=frames)
        out.append([bytes(f) for f in encode_message(msg)])
    return out


def recv_of(messages: list[list[bytes]]) -> Callable[[], Awaitable[list[bytes]]]:
    """A receiver's ``recv`` that hands out ``messages`` in order (and fails past the last)."""
    pending = iter(messages)

    async def recv() -> list[bytes]:
        frames = next(pending, None)
        if frames is None:
            raise AssertionError("the receiver waited for a message past the version's last")
        return frames

    return recv


async def deliver(r: Any, model: dict[str, Any], messages: list[list[bytes]]) -> int:
    return int(await asyncio.wait_for(r.apply(model, recv_of(messages)), timeout=60))


# -- the property -------------------------------------------------------------------------------
def split(draw: Any, shape: tuple[int, ...], ranges: int) -> list[Span]:
    """The shards' spans, tiling the tensor: ranges cut at row boundaries of a 2-D tensor or
    anywhere, or a 2-D tensor's column blocks (every row's columns [c_i, c_i+1): strided)."""
    n = math.prod(shape)
    if len(shape) == 2 and shape[1] > 1 and draw(st.booleans()):
        rows, cols = shape
        inner = sorted(set(draw(st.lists(st.integers(1, cols - 1), min_size=1, max_size=max(1, ranges - 1)))))
        cuts = [0, *inner, cols]
        return [Span(a, b - a, rows, cols) if rows > 1 else Span.range(a, b) for a, b in itertools.pairwise(cuts)]
    if len(shape) == 2 and draw(st.booleans()):
        rows = sorted(set(draw(st.lists(st.integers(1, shape[0] - 1), max_size=ranges - 1)))) if shape[0] > 1 else []
        inner = [r * shape[1] for r in rows]
    else:
        inner = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=ranges - 1)))) if n > 1 else []
    cuts = [0, *inner, n]
    return [Span.range(a, b) for a, b in itertools.pairwise(cuts)]


@st.composite
def versions(draw: Any) -> dict[str, Any]:
    tensors = []
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = (draw(st.integers(1, 9)), draw(st.integers(1, 60))) if draw(st.booleans()) else (draw(st.integers(1, 700)),)
        layout = draw(st.sampled_from(["plain", "strided", "placed"]))
        spans = split(draw, shape, draw(st.integers(1, 4)))
        tensors.append({
            "key": f"t{i}", "dtype": dtype, "shape": shape, "layout": layout, "spans": spans,
            "codecs": [draw(st.sampled_from(CODECS)) for _ in spans],
            "skip": [draw(st.booleans()) and draw(st.booleans()) for _ in spans],  # spans need not cover the tensor
            "density": draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0])),
        })
    return {
        "tensors": tensors, "seed": draw(st.integers(0, 2**16)), "staged": draw(st.booleans()),
        "order": draw(st.sampled_from(["by-tensor", "interleaved", "shuffled"])), "parts": draw(st.sampled_from(["one", "each", "two"])),
    }


def old_and_new(spec: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, dtype = math.prod(spec["shape"]), spec["dtype"]
    if dtype.is_floating_point:
        old, new = float_pair(dtype, n, spec["density"], 1e-3, seed)
    else:
        old, new = integer_pair(dtype, n, spec["density"], seed)
    if spec["density"] == 0.0:
        new = old.clone()
    return old.reshape(spec["shape"]), new.reshape(spec["shape"])


def span_entries(key: int, old: torch.Tensor, new: torch.Tensor, spec: dict[str, Any]) -> list[EncodedTensor]:
    """The tensor's changes in one entry per span of ``spec`` (those left out: none), each
    encoded from its own elements only (``Span.of``: a column block's rows end to end), as a
    rank holding that shard would."""
    out = []
    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    for span, codec, skip in zip(spec["spans"], spec["codecs"], spec["skip"]):
        mine_old, mine_new = span.of(flat_old).reshape(-1), span.of(flat_new).reshape(-1)
        local, new_at, old_at = bitwise_changes(mine_old, mine_new)  # the shard's own compare
        if codec == "dense" and not (skip and local.numel() == 0):  # a dense span may have no changes
            out.append(encode_dense_span(key, span, mine_new.clone(), Codec.ZSTD if (span.lo + span.hi) % 2 else Codec.NONE))
            continue
        if local.numel() == 0:  # left out: spans need not cover the tensor
            continue
        if skip:  # a span with changes may not be left out (the unsplit message writes them): sent whole
            out.append(encode_dense_span(key, span, mine_new.clone(), Codec.NONE))
            continue
        out.append(encode_span(key, span, local, new_at, old_at, DEVICE if codec == "device" else HOST_OPTIONS[codec]))
    return out


def ordered(per_tensor: list[list[EncodedTensor]], order: str, seed: int) -> list[EncodedTensor]:
    """The entries by tensor, interleaved (a tensor's spans ascending), or shuffled (any order)."""
    if order == "by-tensor":
        return [e for entries in per_tensor for e in entries]
    if order == "shuffled":
        out = [e for entries in per_tensor for e in entries]
        random.Random(seed).shuffle(out)
        return out
    longest = max((len(e) for e in per_tensor), default=0)
    return [entries[i] for i in range(longest) for entries in per_tensor if i < len(entries)]


def into_parts(entries: list[EncodedTensor], parts: str) -> list[list[EncodedTensor]]:
    if not entries:
        return [[]]
    if parts == "each":
        return [[e] for e in entries]
    if parts == "two" and len(entries) > 1:
        return [entries[: len(entries) // 2], entries[len(entries) // 2 :]]
    return [entries]


async def applied(case: dict[str, Any], old: dict[str, torch.Tensor], parts: list[list[EncodedTensor]]) -> dict[str, torch.Tensor]:
    """The receiver's tensors after ``parts`` on top of ``old``, its targets laid out as ``case`` says."""
    model = {spec["key"]: target(spec["key"], spec["shape"], spec["dtype"], spec["layout"]) for spec in case["tensors"]}
    r = await at_base(old, model, case["staged"])
    assert all(torch.equal(bits(whole(model[k])), bits(old[k])) for k in old)
    assert await deliver(r, model, frames_of(r, parts)) == 1
    assert r.version == 1 and not r.torn
    return {k: whole(t).clone() for k, t in model.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=versions())
def test_a_version_split_into_spans_applies_bit_identically(case: dict[str, Any]) -> None:
    """bf16/fp32 (NaN, -0.0, infinities among them), int64 and bool tensors, 1-D and 2-D,
    plain, transposed and ``Placed`` targets: each tensor's changes cut into 1-4 row or
    flat ranges or 2-4 column blocks (strided spans), each coded on its own (the host
    codec's encodings, the device codec, dense, some with no entry), arriving by tensor,
    interleaved or shuffled, in one message or in several parts, decoded from the frames or
    staged: the model equals what the unsplit message makes, and the new values, bit for bit."""
    event("column blocks" if any(not sp.contiguous for t in case["tensors"] for sp in t["spans"]) else "ranges only")
    old, new, pieces, unsplit = {}, {}, [], []
    for key, spec in enumerate(case["tensors"]):
        o, n = old_and_new(spec, case["seed"] + key)
        old[spec["key"]], new[spec["key"]] = o, n
        pieces.append(span_entries(key, o, n, spec))
        flat, new_at, old_at = bitwise_changes(o, n)
        if flat.numel():
            unsplit.append(encode_sparse(key, flat, new_at, old_at, spec["shape"], WHOLE))
    with_spans = asyncio.run(applied(case, old, into_parts(ordered(pieces, case["order"], case["seed"]), case["parts"])))
    reference = asyncio.run(applied(case, old, [unsplit]))
    for key in old:
        assert torch.equal(bits(with_spans[key]), bits(reference[key])), key
        assert torch.equal(bits(with_spans[key]), bits(new[key])), key


# -- the helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize("span", [Span.range(1200, 3900), Span(20, 54, 49, 100)], ids=["range", "columns"])
@pytest.mark.parametrize("options", [*HOST_OPTIONS, "device"])
def test_encode_span_codes_a_span_as_a_tensor_of_its_elements(options: str, span: Span) -> None:
    """``encode_span`` of a span's changes is ``encode_sparse`` of them as a 1-D tensor of
    ``span.numel`` elements, byte for byte, plus the span; it decodes (``at_span``, and the
    device staging) to the tensor's own positions and new values, a range's and a column
    block's (columns 20-73 of rows 0-48 of a (50, 100) tensor) alike."""
    opts = DEVICE if options == "device" else HOST_OPTIONS[options]
    old, new = float_pair(torch.bfloat16, 5000, 0.05, 1e-3, 3)
    flat, new_at, old_at = bitwise_changes(old, new)
    local, local_new, local_old, inside = changes_within(flat, new_at, old_at, span)
    assert torch.equal(span.positions(local), flat[inside]) and local.numel() > 50
    entry = encode_span(7, span, local, local_new, local_old, opts)
    plain = encode_sparse(7, local, local_new, local_old, (span.numel,), opts)
    assert entry.span == span and plain.span is None
    assert (entry.encoding, entry.values, entry.nnz) == (plain.encoding, plain.values, plain.nnz)
    assert [(s, bytes(w)) for s, w in entry.buffers] == [(s, bytes(w)) for s, w in plain.buffers]
    specs, frames = assemble([entry])
    msg = decode_message(encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames)))
    (spec,) = msg.tensors
    assert spec.span == span
    decoded = decode_entry(spec, msg.frames, (span.numel,), torch.bfloat16, CPU)
    if decoded.verdict is not None:  # device-coded: staged as the receiver stages it, its verdict read first
        ((update,),) = stage_decoded([(decoded, (), spec.span)], {7: old})
        assert update.ordinal == 7 and update.flat is not None
        assert update.flat.tolist() == flat[inside].tolist()
        assert torch.equal(bits(update.values), bits(new_at[inside]))
    placed = at_span(decoded, span)
    assert placed.flat is not None
    assert placed.flat.tolist() == flat[inside].tolist()
    got = placed.values if placed.encoding is ValueEncoding.RAW else placed.new_values(old.reshape(-1)[placed.flat])
    assert torch.equal(bits(got), bits(new_at[inside]))


def test_device_coded_spans_of_every_kind_stage_together() -> None:
    """One batch of device-coded entries: a whole tensor, a range and two column blocks of
    another (the strided ones placed in their runs by the batch's few ops), staged at once:
    each update at its tensor's own positions with its new values."""
    old, new = float_pair(torch.bfloat16, 5000, 0.1, 1e-3, 9)
    flat, new_at, old_at = bitwise_changes(old, new)
    spans = [Span.range(0, 700), Span(10, 30, 40, 100), Span(60, 40, 45, 100)]
    entries = [encode_sparse(3, flat, new_at, old_at, (5000,), DEVICE)]
    expected = [(flat, new_at)]
    for span in spans:
        local, local_new, local_old, inside = changes_within(flat, new_at, old_at, span)
        entries.append(encode_span(4, span, local, local_new, local_old, DEVICE))
        expected.append((flat[inside], new_at[inside]))
    specs, frames = assemble(entries)
    decoded = decode_blocks([BlocksEntry(spec, (spec.span.numel if spec.span else 5000,), torch.bfloat16, CPU) for spec in specs], frames)
    assert len({id(d.verdict.batch) for d in decoded if d.verdict is not None}) == 1  # one batch
    staged = stage_decoded([(d, (), spec.span) for d, spec in zip(decoded, specs)], {3: old.clone(), 4: old.clone()})
    for (update,), (positions, values) in zip(staged, expected):
        assert update.flat is not None and update.flat.tolist() == positions.tolist()
        assert torch.equal(bits(update.values), bits(values))


def test_dense_spans_and_the_helpers_refuse_what_cannot_travel() -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    entry = encode_dense_span(2, Span.range(10, 22), values, Codec.NONE)
    specs, frames = assemble([entry])
    assert specs[0].span == Span.range(10, 22) and specs[0].nnz == 12 and specs[0].buffers[0].shape == (12,)
    decoded = at_span(decode_entry(specs[0], frames, (12,), torch.float32, CPU), Span.range(10, 22))
    assert decoded.flat is not None and decoded.flat.tolist() == list(range(10, 22))
    assert decoded.values.tolist() == list(range(12)) and decoded.encoding is ValueEncoding.RAW
    columns = Span(1, 4, 3, 6)  # columns 1-4 of a (3, 6) tensor
    specs, frames = assemble([encode_dense_span(2, columns, values, Codec.LZ4)])
    decoded = at_span(decode_entry(specs[0], frames, (12,), torch.float32, CPU), specs[0].span)
    assert decoded.flat is not None and decoded.flat.tolist() == [1, 2, 3, 4, 7, 8, 9, 10, 13, 14, 15, 16]
    assert decoded.values.tolist() == list(range(12))
    with pytest.raises(ValueError):
        encode_dense_span(2, Span.range(10, 21), values, Codec.NONE)  # 12 values for 11 elements
    with pytest.raises(ValueError):
        encode_dense_span(2, (10, 22), values, Codec.NONE)  # type: ignore[arg-type]  # a tuple is not a Span
    for bad in ((5, 5), (6, 5), (-1, 4)):
        with pytest.raises(ProtocolError):
            Span.range(*bad)
    with pytest.raises(ValueError):
        encode_span(2, Span.range(0, 10), torch.tensor([], dtype=torch.int64), torch.tensor([]), torch.tensor([]), WHOLE)


def test_an_entry_without_a_span_keeps_its_bytes() -> None:
    """A span is a last item only when set: a message of whole entries is what protocol 5
    wrote, one of ranges what protocol 6 did (but the version); a strided block's is four ints."""
    entry = encode_dense_span(0, Span.range(0, 4), torch.ones(4), Codec.NONE)
    specs, _ = assemble([entry])
    assert specs[0].to_wire()[-1] == {"s": [0, 4]}
    entry = encode_dense_span(0, Span(2, 3, 4, 8), torch.ones(12), Codec.NONE)
    specs, _ = assemble([entry])
    assert specs[0].to_wire()[-1] == {"s": [2, 29, 3, 8]}
    old = encode_sparse(0, torch.tensor([1, 3]), torch.ones(2), torch.zeros(2), (4,), WHOLE)
    specs, _ = assemble([old])
    assert len(specs[0].to_wire()) == 5


def changes_within(
    flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, span: Span
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of a tensor's changes at sorted flat positions ``flat`` (with their ``new`` and ``old``
    values), those ``span`` covers, their positions made relative to it (the p-th element it
    covers: what ``encode_span`` takes), and which they were (a mask over ``flat``)."""
    at = flat - span.lo
    run, offset = (at // span.stride, at % span.stride) if span.count > 1 else (torch.zeros_like(at), at)
    inside = (at >= 0) & (run < span.count) & (offset < span.length)
    return (run * span.length + offset)[inside], new[inside], old[inside], inside
