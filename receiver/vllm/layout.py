"""Where every checkpoint element lives in a vLLM worker's runtime parameters.

The trainer speaks checkpoint names and shapes; vLLM fuses them (``qkv_proj`` from
``q/k/v_proj``), slices them by tensor parallelism and pads them (vocab). The map is not
a table per architecture: it is recorded from the model's own ``load_weights``. Each
checkpoint tensor is fed as a probe of distinct random bits, and every ``aten.copy_``
from a probe's storage into a parameter's storage is recorded as a pair of strided views
(source box in the checkpoint tensor, destination in the parameter). A second probe with
other bits then checks the map: every mapped element must hold its source's bits, and
no other parameter element may depend on the probe. A loader that transforms values
(quantization, transposes into a copy, custom kernels) fails that check and the
handshake refuses it, naming the tensor: never silently wrong.

Layers that vLLM processes after loading (on CPU, linear layers re-pack their weight
into a kernel copy and keep an empty parameter) get *shadows*: the load-time
parameters, rebuilt from vLLM's own reload metadata, hold the runtime layout, patches
land there, and ``repack`` re-runs the layer's ``process_weights_after_loading`` for the
layers a version touched. Elsewhere (GPU, unquantized) the writes land in place.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.errors import ConfigError, MetadataMismatchError
from protocol.state import Placed

log = logging.getLogger(__name__)


class LayoutError(ConfigError):
    """A checkpoint tensor's runtime placement cannot be patched element by element."""


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


def storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of ``t`` (element offsets as its views use)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


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

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def dst_view(self) -> torch.Tensor:
        return self.storage.as_strided(self.sizes, self.dst_strides, self.dst_offset)

    def src_view(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.reshape(-1).as_strided(self.sizes, self.src_strides, self.src_offset)

    def locate(self, flat: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of ``flat`` held by this segment, their offsets in ``storage``)."""
        if self.kind == "range":
            k = flat - self.src_offset
            held = (k >= 0) & (k < self.numel)
            k = k[held]
            if self.dst_strides == _contiguous_strides(self.sizes):
                return held, k + self.dst_offset
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
            coords = [c[held] for c in coords]
        dst = torch.full_like(coords[0], self.dst_offset) if coords else flat[held] * 0 + self.dst_offset
        for c, stride in zip(coords, self.dst_strides):
            dst += c * stride
        return held, dst


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


class MappedTensor(Placed):
    """A checkpoint tensor as the runtime parameters hold it (``protocol.state.Placed``)."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, segments: list[Segment]) -> None:
        self.key, self.shape, self.dtype, self.device, self.segments = key, shape, dtype, device, segments
        self.held = sum(s.numel for s in segments)

    def read(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(flat.numel(), dtype=self.dtype, device=self.device)
        for seg in self.segments:
            held, dst = seg.locate(flat, self.shape)
            out[held.to(self.device)] = seg.storage[dst.to(self.device)].to(self.dtype)
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        for seg in self.segments:
            held, dst = seg.locate(flat.cpu(), self.shape)
            seg.storage[dst.to(seg.storage.device)] = values[held.to(values.device)].to(seg.storage.device, seg.storage.dtype)

    @torch.no_grad()
    def assign(self, values: torch.Tensor) -> None:
        for seg in self.segments:
            seg.dst_view().copy_(seg.src_view(values.to(self.dtype)))

    def materialize(self) -> torch.Tensor | None:
        if self.held != self.numel():
            return None
        out = torch.empty(self.shape, dtype=self.dtype)
        for seg in self.segments:
            seg.src_view(out).copy_(seg.dst_view())
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
    shadows: dict[nn.Module, dict[str, nn.Parameter]] = field(default_factory=dict)

    def layers_of(self, keys: Iterable[str]) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for key in keys:
            for layer in self.owners.get(key, ()):
                seen.setdefault(id(layer), layer)
        return list(seen.values())

    @torch.no_grad()
    def repack(self, layers: Iterable[nn.Module]) -> int:
        """Re-run vLLM's post-load processing of ``layers`` over their current weights
        (shadows put back first). Returns how many layers were processed."""
        count = 0
        for layer in layers:
            method = getattr(layer, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            shadows = self.shadows.get(layer, {})
            before = {name: (p.data_ptr(), tuple(p.shape)) for name, p in shadows.items()}
            for name, shadow in shadows.items():
                setattr(layer, name, shadow)
            if hasattr(layer, "_already_called_process_weights_after_loading"):
                delattr(layer, "_already_called_process_weights_after_loading")
            method.process_weights_after_loading(layer)
            for name, p in shadows.items():
                if (p.data_ptr(), tuple(p.shape)) != before[name]:
                    raise LayoutError(f"{type(layer).__name__}.{name}: post-load processing rewrote the loaded weight in place")
            count += 1
        return count


def _install_shadows(model: nn.Module) -> dict[nn.Module, dict[str, nn.Parameter]]:
    """Give every layer whose parameters vLLM replaced after loading its load-time ones back."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # a vLLM without reload metadata: nothing was re-packed that we could undo
        return {}
    shadows: dict[nn.Module, dict[str, nn.Parameter]] = {}
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        restore_params = info.restore_metadata[0]
        current = dict(layer.named_parameters(recurse=False))
        changed = [
            n for n, meta in restore_params.items()
            if n not in current or tuple(current[n].shape) != tuple(meta.shape) or current[n].dtype != meta.dtype
        ]
        if not changed:
            continue
        made: dict[str, nn.Parameter] = {}
        with info.restore_device:
            for name, meta in restore_params.items():
                tensor = materialize_meta_tensor(restore_layer_refs(meta, layer))
                made[name] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
        for name, shadow in made.items():
            if hasattr(layer, name):
                delattr(layer, name)
            layer.register_parameter(name, shadow)
        shadows[layer] = made
    return shadows


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
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randint(0, 100, shape, generator=gen).to(dtype)
        out[key] = t.contiguous()
    return out


def derive_layout(model: nn.Module, metadata: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
    """Record where each checkpoint tensor ``(name, shape, dtype)`` lands in ``model``.

    Writes probe values into the runtime parameters (they are overwritten by the
    bootstrap that follows); holds one copy of the parameters while checking."""
    shadows = _install_shadows(model)
    params: dict[str, torch.Tensor] = {}  # one name per storage (tied layers share one)
    layer_of: dict[str, list[nn.Module]] = {}  # every layer that uses it
    ptrs: dict[int, str] = {}
    for lname, layer in model.named_modules(remove_duplicate=False):
        for pname, p in layer.named_parameters(recurse=False):
            if not p.numel():
                continue
            name = ptrs.setdefault(p.untyped_storage().data_ptr(), f"{lname}.{pname}" if lname else pname)
            params.setdefault(name, p)
            users = layer_of.setdefault(name, [])
            if all(u is not layer for u in users):
                users.append(layer)
    storages = {name: storage_flat(p) for name, p in params.items()}
    shapes = {key: tuple(shape) for key, shape, _ in metadata}

    def load(probes: dict[str, torch.Tensor]) -> _Recorder:
        recorder = _Recorder({t.untyped_storage().data_ptr(): k for k, t in probes.items() if t.numel()}, ptrs)
        with torch.no_grad(), recorder:
            model.load_weights(list(probes.items()))  # type: ignore[operator]
        return recorder

    first = _probe(metadata, 1)
    try:
        recorded = load(first)
    except (KeyError, ValueError, AssertionError, RuntimeError) as e:
        raise MetadataMismatchError(f"the engine's load_weights refused the trainer's checkpoint names: {type(e).__name__}: {e}") from e
    segments: dict[str, list[Segment]] = {}
    for key, pname, src, dst in recorded.copies:
        seg = _segment(shapes[key], src, dst, pname, storages[pname])
        if seg is None:
            raise LayoutError(f"checkpoint tensor {key!r} reaches {pname!r} through a copy of shape {tuple(src.shape)} that is not a box of it")
        segments.setdefault(key, []).append(seg)
    after_first = {name: s.clone() for name, s in storages.items()}
    second = _probe(metadata, 2)
    load(second)
    mapped = {name: torch.zeros(s.numel(), dtype=torch.bool) for name, s in storages.items()}
    for key, segs in segments.items():
        for seg in segs:
            dst = seg.dst_view()
            want = seg.src_view(second[key]).to(dst.dtype)
            if not torch.equal(_bits(dst.cpu()), _bits(want)):
                raise LayoutError(f"checkpoint tensor {key!r}: {seg.param!r} does not hold the loaded values (the loader transforms them)")
            mask = mapped[seg.param].as_strided(seg.sizes, seg.dst_strides, seg.dst_offset)
            if mask.any():
                raise LayoutError(f"checkpoint tensor {key!r} is written over another one in {seg.param!r}")
            mask.fill_(True)
    for name, s in storages.items():
        moved = _bits(s.cpu()) != _bits(after_first[name].cpu())
        if (moved & ~mapped[name]).any():
            culprits = _culprits(load, first, name, s, [k for k, _, _ in metadata if k not in segments])
            raise LayoutError(
                f"checkpoint tensor {culprits or '(unknown)'} reaches runtime parameter {name!r} through something other than a "
                "copy (a transform): it cannot be patched element by element"
            )
    del after_first
    tensors: dict[str, torch.Tensor | Placed] = {}
    owners: dict[str, list[nn.Module]] = {}
    unmapped = []
    for key, shape, dtype in metadata:
        segs = segments.get(key, [])
        owners[key] = list({id(layer): layer for s in segs for layer in layer_of[s.param]}.values())
        if not segs:
            unmapped.append(key)
        whole = _as_view(shape, dtype, segs)
        tensors[key] = whole if whole is not None else MappedTensor(key, shape, dtype, _device(segs, params), segs)
    if unmapped:
        log.info("load_weights places %d checkpoint tensors elsewhere or nowhere on this worker: %s", len(unmapped), unmapped[:8])
    return Layout(model, tensors, unmapped, owners, shadows)


def _culprits(load: Any, probes: dict[str, torch.Tensor], param: str, storage: torch.Tensor, candidates: list[str]) -> list[str]:
    """The unplaced checkpoint tensors whose loading changes ``param``: loaded one at a time."""
    found = []
    for key in candidates:
        before = _bits(storage.cpu()).clone()
        try:
            load({key: probes[key]})
        except Exception:  # only naming the culprit; the error raised is the layout's
            continue
        if not torch.equal(before, _bits(storage.cpu())):
            found.append(key)
    return found


def _as_view(shape: tuple[int, ...], dtype: torch.dtype, segs: list[Segment]) -> torch.Tensor | None:
    """The checkpoint tensor as one view of a parameter, when a single copy placed all of it."""
    if len(segs) != 1:
        return None
    seg = segs[0]
    if seg.kind != "range" or seg.src_offset != 0 or seg.numel != math.prod(shape) or seg.storage.dtype != dtype:
        return None
    view = seg.dst_view()
    return view.view(shape) if view.is_contiguous() else None


def _device(segs: list[Segment], params: Mapping[str, torch.Tensor]) -> torch.device:
    return segs[0].storage.device if segs else next(iter(params.values())).device


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool or not t.dtype.is_floating_point:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
