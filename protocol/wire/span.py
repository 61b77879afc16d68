"""Which flat elements of a tensor a span entry covers (``TensorEntry.span``).

A ``Span`` is a strided block of a tensor's flat (row-major) elements: ``count`` runs of
``length`` elements, run k starting at ``lo + k * stride``. One run (``count`` 1) is
protocol 6's contiguous span ``[lo, hi)``; several are what a trainer's shard of a
column block is (a row-parallel weight's columns under tensor parallelism: every row, a
slice of its columns). Either way a span entry is coded as a 1-D tensor of ``numel``
elements, its element ``p`` at flat position ``lo + (p // length) * stride + p % length``:
ascending in ``p``, so sorted positions stay sorted.

On the wire: ``[lo, hi]`` for one run (bytes as in protocol 6), ``[lo, hi, length,
stride]`` for several, ``hi`` the end of the last run. Pure: no torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.errors import ProtocolError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Span:
    """``count`` runs of ``length`` flat elements, run k at ``lo + k * stride``.

    Valid when ``lo >= 0``, ``length >= 1``, ``count >= 1``, and for ``count > 1``
    ``stride >= length`` (runs disjoint and ascending); ``stride`` is 0 for one run."""

    lo: int
    length: int
    count: int = 1
    stride: int = 0

    def __post_init__(self) -> None:
        for name in ("lo", "length", "count", "stride"):
            if type(getattr(self, name)) is not int:
                raise ProtocolError(f"span {name} {getattr(self, name)!r} is not an int")
        if self.lo < 0 or self.length < 1 or self.count < 1:
            raise ProtocolError(f"span lo {self.lo}, length {self.length}, count {self.count}: empty or negative")
        if self.count == 1 and self.stride != 0:
            raise ProtocolError(f"a one-run span has stride 0, not {self.stride}")
        if self.count > 1 and self.stride < self.length:
            raise ProtocolError(f"span runs of {self.length} elements every {self.stride} overlap")

    @classmethod
    def range(cls, lo: int, hi: int) -> Span:
        """The contiguous span ``[lo, hi)``."""
        return cls(lo, hi - lo)

    @property
    def hi(self) -> int:
        """One past the last element covered."""
        return self.lo + (self.count - 1) * self.stride + self.length

    @property
    def numel(self) -> int:
        """The elements covered: the length of the 1-D tensor the entry is coded as."""
        return self.length * self.count

    @property
    def contiguous(self) -> bool:
        return self.count == 1 or self.stride == self.length

    def __str__(self) -> str:
        if self.count == 1:
            return f"[{self.lo}, {self.hi})"
        return f"[{self.lo}, {self.hi}) in {self.count} runs of {self.length} every {self.stride}"

    def to_wire(self) -> list[int]:
        return [self.lo, self.hi] if self.count == 1 else [self.lo, self.hi, self.length, self.stride]

    @classmethod
    def from_wire(cls, raw: Any) -> Span:
        """A span from its wire form, or ``ProtocolError``: two ints ``[lo, hi]``, or four
        ``[lo, hi, length, stride]`` whose runs end exactly at ``hi`` (at least two runs)."""
        if type(raw) is not list or len(raw) not in (2, 4) or any(type(v) is not int for v in raw):
            raise ProtocolError(f"malformed span {raw!r:.80}")
        if len(raw) == 2:
            lo, hi = raw
            if not 0 <= lo < hi:
                raise ProtocolError(f"span [{lo}, {hi}) is empty or negative")
            return cls(lo, hi - lo)
        lo, hi, length, stride = raw
        if not 0 <= lo < hi or length < 1 or stride < length:
            raise ProtocolError(f"span [{lo}, {hi}) of runs of {length} every {stride}: empty, negative or overlapping")
        runs, rest = divmod(hi - lo - length, stride)
        if rest or runs < 1:
            raise ProtocolError(f"span [{lo}, {hi}): runs of {length} every {stride} do not end at {hi} (or there is one run)")
        return cls(lo, length, runs + 1, stride)

    def positions(self, rel: torch.Tensor) -> torch.Tensor:
        """Positions ``rel`` (relative: in ``[0, numel)``, int) in the tensor's flat coordinates,
        int64, where ``rel`` is (no host sync)."""
        import torch

        rel = rel.to(torch.int64)
        if self.contiguous:
            return rel + self.lo
        return self.lo + torch.div(rel, self.length, rounding_mode="floor") * self.stride + rel % self.length

    def indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Every covered flat position, ascending, int64 on ``device``."""
        import torch

        if self.contiguous:
            return torch.arange(self.lo, self.hi, dtype=torch.int64, device=device)
        starts = torch.arange(self.count, dtype=torch.int64, device=device) * self.stride + self.lo
        return (starts[:, None] + torch.arange(self.length, dtype=torch.int64, device=device)).reshape(-1)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The covered elements of ``flat`` (a contiguous 1-D tensor of at least ``hi``
        elements), in order: a view (strided for several runs)."""
        if self.contiguous:
            return flat[self.lo:self.hi]
        return flat.as_strided((self.count, self.length), (self.stride, 1), flat.storage_offset() + self.lo)

    def overlaps(self, other: Span) -> bool:
        """Whether the two share an element: exact, but for two strided spans of different
        strides of which more than ``EXACT_RUNS`` runs of the one with fewer lie within the
        other's range (then True: refused). Costs ``overlap_cost`` run tests."""
        if self.hi <= other.lo or other.hi <= self.lo:
            return False
        if self.contiguous or other.contiguous:
            one, many = (self, other) if self.contiguous else (other, self)
            return many.contiguous or _meets(many, one.lo, one.hi)
        if self.stride == other.stride:  # each run's offset within a stride: arcs of one circle
            offset = (other.lo - self.lo) % self.stride
            if offset >= self.length and self.stride - offset >= other.length:
                return False  # disjoint columns on every row
        few, many = (self, other) if self.count <= other.count else (other, self)
        first, last = _runs_within(few, many.lo, many.hi)
        if last - first >= EXACT_RUNS:
            return True
        starts = range(few.lo + first * few.stride, few.lo + (last + 1) * few.stride, few.stride)
        return any(_meets(many, start, start + few.length) for start in starts)

    def overlap_cost(self, other: Span) -> int:
        """The run tests ``overlaps(other)`` makes (1 where it is arithmetic alone): what a
        receiver charges a sender's span checks to (``receiver/apply/checks.py``)."""
        if self.hi <= other.lo or other.hi <= self.lo or self.contiguous or other.contiguous or self.stride == other.stride:
            return 1
        few, many = (self, other) if self.count <= other.count else (other, self)
        first, last = _runs_within(few, many.lo, many.hi)
        return 1 + min(max(0, last - first + 1), EXACT_RUNS)


def _runs_within(span: Span, lo: int, hi: int) -> tuple[int, int]:
    """The first and last run of ``span`` that meet [lo, hi) (last < first: none)."""
    first = max(0, -(-(lo - span.lo - span.length + 1) // span.stride)) if span.count > 1 else 0
    last = min(span.count - 1, (hi - 1 - span.lo) // span.stride) if span.count > 1 else 0
    return first, last


def _meets(span: Span, lo: int, hi: int) -> bool:
    """Whether some run of ``span`` (strided, or one run) meets [lo, hi) (not empty)."""
    if span.hi <= lo or hi <= span.lo:
        return False
    if span.contiguous:
        return True
    first, last = _runs_within(span, lo, hi)
    return first <= last


EXACT_RUNS = 4096  # ``overlaps`` tests two strided spans of different strides run by run up to this many runs; past it, says True
