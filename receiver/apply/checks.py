"""The checks a message passes against the model and the version so far, before any of it
is staged: its type and version against the receiver's, its place in its version, and
which tensors (or spans of them) its entries write."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from protocol.errors import LimitError, MetadataMismatchError, ProtocolError, StaleVersionError
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message, MessageType, TensorEntry
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span

MAX_SPANS = 1024  # ``claim``: span entries of one tensor in one version (past it: LimitError)
# ``claim``: the overlap tests (``Span.overlap_cost``) a version's span entries may take, past
# which a LimitError: this many, plus SPAN_WORK_PER_SPAN for each span entry claimed so far (a
# tensor-parallel rank's column block tests each other rank's: TP - 1 tests, amortized)
MAX_SPAN_WORK = 1 << 20
SPAN_WORK_PER_SPAN = 64


def check_span(msg: Message, key: int, span: Span, shape: tuple[int, ...]) -> None:
    """A span entry's rules that need the model: only in a patch, within the tensor
    (``span.hi <= numel``; the rest the wire checked: ``Span.from_wire``)."""
    numel = math.prod(shape)
    if msg.type is not MessageType.PATCH:
        raise ProtocolError(f"{msg.describe()}: tensor {key}: a span entry outside a patch")
    if span.hi > numel:
        raise ProtocolError(f"{msg.describe()}: tensor {key}: span {span} is not within its {numel} elements")


class Claims:
    """What a version's entries wrote so far (``claim``): the tensors written whole, each
    other tensor's spans (and the end of the last-ending), the span entries claimed and
    the overlap tests made. One version's, filled by one task."""

    def __init__(self) -> None:
        self.whole: set[int] = set()
        self.spans: dict[int, list[Span]] = {}
        self.ends: dict[int, int] = {}  # ordinal -> the largest hi of its spans so far
        self.claimed = 0
        self.work = 0


def check_first(msg: Message, bootstrap: bool, data_type: MessageType, current: int | None) -> None:
    """A version's first message, to a receiver of ``data_type`` at version ``current``."""
    allowed = (MessageType.BOOTSTRAP,) if bootstrap else (data_type, MessageType.BOOTSTRAP)
    if msg.type not in allowed:
        raise ProtocolError(f"unexpected {msg.describe()}; this receiver takes {[t.name for t in allowed]}")
    if msg.type is MessageType.PATCH:
        if msg.version is None or msg.base_version != current:
            raise StaleVersionError(
                f"patch v{msg.version} applies on top of v{msg.base_version}, receiver is at v{current}",
                current=current, got=msg.base_version, held=type(msg.version) is int and current is not None and msg.version <= current,
            )
        if msg.base_version is not None and msg.version <= msg.base_version:
            raise ProtocolError(f"patch v{msg.version} does not follow its base v{msg.base_version}")
    elif msg.type is MessageType.BUCKET:
        if msg.version is None or (current is not None and msg.version <= current):
            raise StaleVersionError(
                f"bucket v{msg.version} is not newer than v{current}", current=current, got=msg.version, held=msg.version is not None,
            )
    elif not bootstrap and msg.version is not None and current is not None and msg.version < current:
        raise StaleVersionError(f"bootstrap v{msg.version} is older than v{current}", current=current, got=msg.version)


def check_same_version(first: Message, msg: Message) -> None:
    if (msg.type, msg.version, msg.base_version) != (first.type, first.version, first.base_version):
        raise ProtocolError(f"{msg.describe()} arrived while {first.describe()} was incomplete")


def claim(msg: Message, entry: TensorEntry, shapes: Sequence[tuple[int, ...]], seen: Claims) -> None:
    """Check that ``entry`` writes what no earlier entry of its version wrote (``seen``),
    and record it: a tensor travels in one entry, or in span entries only
    (``TensorEntry.span``), in a patch, each within the tensor and disjoint from the others
    (in any order, across parts too: interleaved column blocks of tensor-parallel ranks
    arrive as they come). So every entry covers something new, and a version's entries are
    bounded by its elements. A span past every earlier one's end is not tested further;
    others are tested against each (``Span.overlaps``, exact), at most ``MAX_SPANS`` spans
    a tensor, and test costs of ``MAX_SPAN_WORK`` a version plus ``SPAN_WORK_PER_SPAN`` a
    span entry: a hostile sender's work stays bounded (``LimitError`` past either). ``shapes``: the model's, in metadata order."""
    span = entry.span
    for key in entry.covers:
        if key >= len(shapes):
            raise ProtocolError(f"{msg.describe()}: tensor ordinal {key} out of range or repeated")
        if span is None:
            if key in seen.whole or key in seen.spans:
                raise ProtocolError(f"{msg.describe()}: tensor ordinal {key} out of range or repeated"
                                    + (" (a whole entry after span entries of it)" if key in seen.spans else ""))
            seen.whole.add(key)
            continue
        check_span(msg, key, span, shapes[key])
        if key in seen.whole:
            raise ProtocolError(f"{msg.describe()}: tensor {key}: a span entry {span} beside a whole entry of it")
        earlier = seen.spans.setdefault(key, [])
        if len(earlier) >= MAX_SPANS:
            raise LimitError("span entries of one tensor in a version", len(earlier) + 1, MAX_SPANS, f"{msg.describe()}: tensor {key}")
        if span.lo < seen.ends.get(key, 0):  # not past every earlier span: test against each
            allowed = MAX_SPAN_WORK + SPAN_WORK_PER_SPAN * seen.claimed
            for other in earlier:
                seen.work += span.overlap_cost(other)
                if seen.work > allowed:
                    raise LimitError("overlap tests of a version's span entries", seen.work, allowed, f"{msg.describe()}: tensor {key}")
                if span.overlaps(other):
                    raise ProtocolError(f"{msg.describe()}: tensor {key}: span {span} overlaps span {other} "
                                        "of it (a tensor's spans in a version are disjoint)")
        earlier.append(span)
        seen.ends[key] = max(seen.ends.get(key, 0), span.hi)
        seen.claimed += 1


def check_untracked(tensors: Mapping[str, Any], metadata: ModelMetadata, untracked: Sequence[tuple[int, str]]) -> None:
    """WELCOME's ``untracked``: the digest of each tensor the sender will never send (a
    frozen weight under ``init_sync`` off). This receiver's copy must be the trainer's, or
    it would differ from it every version without a word: ``MetadataMismatchError`` naming
    the first that differs, and the fix. A tensor held in parts (an engine's ``Placed``)
    cannot be hashed here and is not checked."""
    for ordinal, digest in untracked:
        if ordinal >= len(metadata.keys):
            raise ProtocolError(f"WELCOME names untracked tensor {ordinal}: this model has {len(metadata.keys)}")
        key = metadata.keys[ordinal]
        t = tensors[key]
        if not isinstance(t, torch.Tensor):
            continue
        if state_digest({key: t}, [key]) != digest:
            raise MetadataMismatchError(
                f"key {key!r}: this receiver's copy differs from the trainer's, and the sender never sends it (not "
                "tracked, e.g. frozen, and not in the bootstrap: init_sync is off or leaves it out), so it would differ "
                "every version; turn init_sync on (init_sync.enabled: true) or load the trainer's checkpoint here"
            )
