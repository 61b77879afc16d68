"""``protocol.wire.span.Span`` against Python sets: the elements a span covers, its wire
form (protocol 6's bytes for one run), the positions it maps, the view it takes, the
overlap test, and a receiver's ``claim`` of a tensor's spans in any order by it
(``receiver/apply/checks.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.wire.framing import Encoding, Message, MessageType, TensorEntry, ValueEncoding
from protocol.wire.span import EXACT_RUNS, Span
from receiver.apply.checks import Claims, claim


def elements(span: Span) -> list[int]:
    """What a span covers, by its definition: run k is [lo + k * stride, + length)."""
    return [span.lo + k * span.stride + i for k in range(span.count) for i in range(span.length)]


@st.composite
def spans(draw: Any, most: int = 80) -> Span:
    lo, length = draw(st.integers(0, most)), draw(st.integers(1, 12))
    if draw(st.booleans()):
        return Span(lo, length)
    return Span(lo, length, draw(st.integers(2, 9)), length + draw(st.integers(0, 12)))


@settings(max_examples=300, deadline=None)
@given(span=spans())
def test_a_span_covers_its_runs_and_travels_as_itself(span: Span) -> None:
    covered = elements(span)
    assert covered == sorted(set(covered))  # runs disjoint and ascending
    assert span.numel == len(covered) and span.hi == covered[-1] + 1 and span.lo == covered[0]
    assert span.contiguous == (covered == list(range(span.lo, span.hi)))
    wire = span.to_wire()
    assert len(wire) == (2 if span.count == 1 else 4) and wire[:2] == [span.lo, span.hi]
    assert Span.from_wire(wire) == span
    assert Span.range(span.lo, span.hi) == Span(span.lo, span.hi - span.lo)
    assert span.indices().tolist() == covered
    flat = torch.arange(span.hi + 7) * 3
    view = span.of(flat)
    assert view.reshape(-1).tolist() == [3 * p for p in covered]
    if span.count > 1 and not span.contiguous:
        assert view.data_ptr() == flat[span.lo:].data_ptr()  # a view, not a copy
        view[0, 0] = -1
        assert flat[span.lo] == -1
    rel = torch.tensor(sorted(set(range(0, span.numel, 3)) | {span.numel - 1}), dtype=torch.int32)
    assert span.positions(rel).dtype == torch.int64
    assert span.positions(rel).tolist() == [covered[int(r)] for r in rel]


@settings(max_examples=1500, deadline=None)
@given(a=spans(), b=spans())
def test_overlaps_is_exact(a: Span, b: Span) -> None:
    meet = bool(set(elements(a)) & set(elements(b)))
    assert a.overlaps(b) == meet and b.overlaps(a) == meet
    assert 1 <= a.overlap_cost(b) <= 1 + EXACT_RUNS


def test_interleaved_column_blocks_are_disjoint_in_constant_time() -> None:
    """A row-parallel weight's column blocks (Megatron TP): every row, a slice of its
    columns; the same stride, so one arithmetic test whatever the rows."""
    rows, cols = 1 << 20, 64
    blocks = [Span(c, 16, rows, cols) for c in (0, 16, 32, 48)]
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            assert not a.overlaps(b) and a.overlap_cost(b) == 1
    assert blocks[0].overlaps(Span(8, 16, rows, cols))  # one column block straddling two
    assert blocks[1].overlaps(Span.range(rows * cols - 40, rows * cols - 39))  # one element in the last row's block


def test_overlaps_refuses_what_it_cannot_test_cheaply() -> None:
    """Two strided spans of different strides whose ranges meet over more than
    ``EXACT_RUNS`` runs: True (a receiver refuses them), never a wrong False."""
    a = Span(0, 1, EXACT_RUNS * 4, 4)  # every fourth element
    b = Span(1, 1, EXACT_RUNS * 2, 8)  # every eighth, offset by one: disjoint from a
    assert a.overlaps(b) and a.overlap_cost(b) == 1 + EXACT_RUNS
    small_a, small_b = Span(0, 1, 100, 4), Span(1, 1, 50, 8)
    assert not small_a.overlaps(small_b) and small_a.overlap_cost(small_b) > 1


@pytest.mark.parametrize("raw", [
    None, (0, 4), [0], [0, 4, 1], [0, 4, 1, 2, 3], [0.0, 4], [True, 4], [0, "4"],
    [-1, 4], [4, 4], [5, 4],  # empty or negative
    [0, 10, 2, 1],  # stride < length: runs overlap
    [0, 10, 0, 0], [0, 10, -2, 3],  # no run length
    [0, 10, 3, 4],  # runs of 3 every 4 from 0 end at 3, 7, 11: not at 10
    [0, 3, 3, 5],  # a four-item span of one run
])
def test_malformed_wire_spans_are_refused(raw: Any) -> None:
    with pytest.raises(ProtocolError):
        Span.from_wire(raw)


@pytest.mark.parametrize("args", [(-1, 2), (0, 0), (0, 2, 0), (0, 2, 1, 5), (0, 4, 2, 3), (0.5, 2), (0, 2, 2, True)])
def test_invalid_spans_are_refused(args: tuple[Any, ...]) -> None:
    with pytest.raises(ProtocolError):
        Span(*args)


@settings(max_examples=400, deadline=None)
@given(seq=st.lists(spans(most=40), min_size=1, max_size=8))
def test_a_receiver_claims_a_tensors_spans_iff_they_are_disjoint(seq: list[Span]) -> None:
    """``receiver.apply.checks.claim`` over a version's span entries of one tensor, in
    arrival order: it refuses the first that shares an element with an earlier one (a set
    test), whatever the order, and accepts every other."""
    msg = Message(MessageType.PATCH, version=1, base_version=0)
    seen, covered = Claims(), set[int]()
    for span in seq:
        entry = TensorEntry(0, Encoding.DENSE, ValueEncoding.RAW, span.numel, (), span=span)
        mine = set(elements(span))
        if mine & covered:
            with pytest.raises(ProtocolError, match="overlaps"):
                claim(msg, entry, [(400,)], seen)
            return
        claim(msg, entry, [(400,)], seen)
        covered |= mine
