"""Where each element of a rank's local parameters lands in the checkpoint tensors its trainer
exports, recorded by probing the trainer's own export, never guessed from names.

A trainer that lays its parameters out for parallelism (Megatron-core: fused QKV, gate and up
stacked, tensor-parallel splits, pipeline stages, expert-parallel experts) reaches checkpoint
(Hugging Face) tensors only through its bridge's export, a collective. ``probe`` gives every
element of every rank a distinct integer code, swaps each parameter's storage for its codes in
float64 (exact to 2**53), runs the export once, puts the storage back, and reads where every code
landed: that is the map, and it costs one export at start, never one a version.

Trusted only when (each a ``ConfigError`` naming the tensor otherwise):

* every exported value is an exact integer below the number of codes (a bridge that computes
  on values, not only moves them, is caught here), in a dtype that holds it exactly;
* a second probe with the codes in descending order decodes to the same map (a bridge that
  moved values *and* shifted them by a constant would decode in one order without complaint);
* every element of every exported tensor comes from some parameter (code 0: none);
* each (parameter, tensor) pair folds into one strided block on both sides (``Span``), so a
  version's changes of it are one span entry in the checkpoint's coordinates;
* ``verify``: on the real weights, each rank's blocks of its parameters equal, bit for bit,
  the same blocks of the real export.

A parameter several ranks hold alike (a norm under tensor parallelism, a dense weight under
expert parallelism) lands in each rank's export from that rank's own copy; its owner is the
rank whose code the group's rank 0 export holds (broadcast), so every element has exactly one
rank that compares and sends it. A parameter no export reads (the last stage's copy of tied
embeddings) has no landing: nothing of it is sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from protocol.errors import ConfigError
from protocol.wire.span import Span

Export = Callable[[], Iterable[tuple[str, torch.Tensor]]]
EXACT_BELOW = {torch.float64: 2**53, torch.float32: 2**24, torch.bfloat16: 2**8, torch.float16: 2**11}


@dataclass(frozen=True)
class Landing:
    """One parameter's elements in one exported tensor: ``local`` of the parameter's flat
    elements are ``span`` of the tensor's, in the same order."""

    tensor: str
    param: str
    local: Span
    span: Span


def probe(params: Sequence[tuple[str, torch.Tensor]], export: Export, group: dist.ProcessGroup | None = None) -> tuple[Landing, ...]:
    """This rank's landings (see the module docstring), in the export's tensor order. A collective of ``group``: every rank calls
    it with its own ``params`` (its local parameters, in a fixed order) and the same
    ``export``. The parameters' values are put back whatever happens."""
    bases = _bases(params, group)
    first = _decode(params, export, bases, group, descending=False)
    second = _decode(params, export, bases, group, descending=True)
    failed = None
    if first != second:
        differ = sorted({a.tensor for a in set(first) ^ set(second)})
        failed = ConfigError(
            f"the export moves and transforms values of {differ[:4]}: two probes disagree on where they land; "
            "those tensors cannot be sent shard by shard"
        )
    _agree(failed, group)
    return first


def verify(
    params: Sequence[tuple[str, torch.Tensor]], landings: Iterable[Landing], exported: Iterable[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Check ``landings`` on the real weights: each equals, bit for bit, its block of the real
    ``exported`` tensor (the parameter cast to the tensor's dtype, as a receiver of that dtype
    gets it). A collective of ``group`` (the export runs to its end on every rank, and every rank
    raises if one fails: a ``ConfigError`` naming the first that differs). Returns a meta
    tensor of each exported tensor's shape and dtype, in the export's order."""
    by_tensor: dict[str, list[Landing]] = {}
    for landing in landings:
        by_tensor.setdefault(landing.tensor, []).append(landing)
    named = dict(params)
    seen: dict[str, torch.Tensor] = {}
    failed: ConfigError | None = None
    for name, t in exported:
        seen[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        flat = t.detach().reshape(-1)
        for landing in by_tensor.pop(name, []):
            mine = landing.local.of(named[landing.param].detach().reshape(-1)).reshape(-1).to(flat.device, t.dtype)
            if failed is None and not _same_bits(mine, landing.span.of(flat).reshape(-1)):
                failed = ConfigError(
                    f"{landing.param!r} does not equal its place in the export's {name!r} on the real weights: "
                    "the export transforms its values; it cannot be sent shard by shard"
                )
    if failed is None and by_tensor:
        failed = ConfigError(f"the export no longer yields {sorted(by_tensor)[:4]}, which the probe found")
    _agree(failed, group)
    return seen


def _agree(failed: ConfigError | None, group: dist.ProcessGroup | None) -> None:
    """Every rank raises when any failed (one all-reduce): no rank goes on into a collective alone."""
    flag = torch.tensor([int(failed is not None)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if failed is not None:
        raise failed
    if int(flag):
        raise ConfigError("another rank's parameters could not be mapped through the export (see its error)")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _bases(params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's first code (rank r owns codes [bases[r], bases[r + 1])); code 0 is "fed by
    nothing"."""
    size = torch.tensor([sum(p.numel() for _, p in params)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    bases = [1]
    for s in sizes:
        bases.append(bases[-1] + int(s))
    if bases[-1] >= EXACT_BELOW[torch.float64]:
        raise ConfigError(f"{bases[-1]} parameter elements: more than float64 probe codes can number")
    return bases


def _codes(
    params: Sequence[tuple[str, torch.Tensor]], export: Export, first: int, end: int, descending: bool
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The export of the probe codes: each parameter's storage swapped for float64 codes
    (``descending``: end - code), restored after (also on failure)."""
    saved = [p.data for _, p in params]
    try:
        with torch.no_grad():
            code = first
            for _, p in params:
                numbers = torch.arange(code, code + p.numel(), dtype=torch.float64, device=p.device)
                p.data = (end - numbers if descending else numbers).reshape(p.shape)
                code += p.numel()
        for name, t in export():
            yield name, t.detach()
    finally:
        for (_, p), s in zip(params, saved):
            p.data = s


def _decode(
    params: Sequence[tuple[str, torch.Tensor]], export: Export, bases: list[int], group: dist.ProcessGroup | None, *, descending: bool
) -> tuple[Landing, ...]:
    rank = dist.get_rank(group)
    end = bases[-1]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    starts = torch.tensor([bases[rank], *(bases[rank] + n for n in _cumulative(p.numel() for _, p in params))], dtype=torch.int64)
    landings: list[Landing] = []
    failed: ConfigError | None = None  # the first failure: the export still runs to its end, in step with the other ranks
    with contextlib.closing(_codes(params, export, bases[rank], end, descending)) as exported:
        for name, t in exported:
            values = t.reshape(-1).to("cpu", torch.float64)
            dist.broadcast(values, src=src, group=group)  # the owner of every element: whose code rank 0's export holds
            if failed is None:
                try:
                    landings += _landings(name, t.dtype, values, params, starts, end, descending)
                except ConfigError as e:
                    failed = e
    _agree(failed, group)
    return tuple(landings)


def _landings(
    name: str, dtype: torch.dtype, values: torch.Tensor, params: Sequence[tuple[str, torch.Tensor]], starts: torch.Tensor, end: int,
    descending: bool,
) -> list[Landing]:
    """Where this rank's elements (codes [starts[0], starts[-1]), parameter k's from starts[k])
    land in one exported tensor's codes (``values``, float64)."""
    if dtype not in EXACT_BELOW or end > EXACT_BELOW[dtype]:
        raise ConfigError(f"the export gives {name!r} in {dtype}: probe codes up to {end} are not exact there")
    codes = values.round()
    if not torch.equal(codes, values) or bool(((codes < 0) | (codes >= end)).any()):
        raise ConfigError(f"the export computes on the values of {name!r} (a probe code came back as another number)")
    codes = codes.to(torch.int64)
    if descending:
        codes = torch.where(codes == 0, 0, end - codes)
    if bool((codes == 0).any()):
        raise ConfigError(f"{int((codes == 0).sum())} elements of the export's {name!r} come from no parameter")
    mine = ((codes >= starts[0]) & (codes < starts[-1])).nonzero().reshape(-1)
    out = []
    if mine.numel():
        which = torch.searchsorted(starts, codes[mine], right=True) - 1
        for k in which.unique().tolist():
            at = mine[which == k]
            local = codes[at] - starts[k]
            order = torch.argsort(local)
            local_span, span = fold(local[order], at[order], f"{params[k][0]!r} in {name!r}")
            out.append(Landing(name, params[k][0], local_span, span))
    return out


def _cumulative(sizes: Iterable[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        total += n
        out.append(total)
    return out


def fold(local: torch.Tensor, hf: torch.Tensor, what: str) -> tuple[Span, Span]:
    """Matched flat positions (``local`` ascending, ``hf`` beside it, int64) as one strided
    block on each side, or ``ConfigError``: runs where both step by one, all of one length,
    their starts stepping evenly on both sides (ascending)."""
    n = local.numel()
    breaks = ((local[1:] - local[:-1] != 1) | (hf[1:] - hf[:-1] != 1)).nonzero().reshape(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.diff(torch.cat([starts, torch.tensor([n])]))
    length, count = int(lengths[0]), starts.numel()
    if count == 1:
        return Span(int(local[0]), length), Span(int(hf[0]), length)
    local_steps, hf_steps = torch.diff(local[starts]), torch.diff(hf[starts])
    if (
        bool((lengths != length).any()) or bool((local_steps != local_steps[0]).any()) or bool((hf_steps != hf_steps[0]).any())
        or int(hf_steps[0]) < length
    ):
        raise ConfigError(f"{what}: its elements do not land as one strided block ({count} runs); it cannot be sent shard by shard")
    return _block(int(local[0]), length, count, int(local_steps[0])), _block(int(hf[0]), length, count, int(hf_steps[0]))


def _block(lo: int, length: int, count: int, stride: int) -> Span:
    """Runs end to end are one run: a span has one form."""
    return Span(lo, length * count) if stride == length else Span(lo, length, count, stride)
