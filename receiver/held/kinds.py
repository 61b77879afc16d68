"""Which runtime layers the map understands, and how a version reaches each of them.

The map is recorded from ``load_weights`` (``layout.py``), which shows where each
checkpoint element lands *at load time*. What the engine does after loading decides whether
that is where the running layer reads it, and the map never guesses. An engine says what
it knows of its own post-load processing in one ``Rules`` value (``receiver/vllm/rules.py``,
``receiver/sglang/rules.py``); everything else here is the same for every engine:

- ``MAPPED``: no post-load processing, or one the engine's rules name re-runnable over the
  loaded weights (vLLM's unquantized linear and embedding methods: on CPU they re-pack the
  weight into a kernel copy, which ``Layout.repack`` re-runs). Written element by element.
- ``PERMUTED``: processing that only moves elements, found out on index probes
  (``permute.discover``) and composed into the map, so writes land where the kernel reads
  them and nothing is re-run (vLLM's unquantized fused MoE: its CPU kernel tiles every
  expert's ``w13``/``w2`` once, at first load, and skips that when processing is run again,
  so re-running it, as vLLM's own layerwise reload does, leaves the experts untiled; and
  vLLM's block-fp8 linear layers, whose kernel's processing is probed the same way over the
  fp8 weight, its scales and a bias: an AMX host's prepack re-lays the weight out, without AMX
  nothing moves).
- ``RELOAD``: anything else (a quantization method, a module with post-load processing of
  its own such as MLA attention, a loader that transforms values): the tensors of such a
  layer are kept whole on the host and, when a version changes any of them, all of them go
  through the engine's own ``load_weights`` (``EngineSide.reload``). Slower, logged once per kind.

``Rules.vouch`` lets a user (or a test) declare another quantization method re-runnable.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .permute import Permutation, discover

log = logging.getLogger(__name__)

_MOE_WEIGHTS = ("w13_weight", "w2_weight")

# A layer whose parameters the engine replaced after loading -> its load-time parameters
# rebuilt (the shadows) and what they replaced (None: it had none of that name).
Shadows = dict[nn.Module, dict[str, nn.Parameter]]
Replaced = dict[nn.Module, dict[str, "nn.Parameter | None"]]


def _no_shadows(model: nn.Module, skip: Callable[[nn.Module], bool]) -> tuple[Shadows, Replaced]:
    return {}, {}


def _no_experts(layer: nn.Module) -> Any:
    return None


def _as_is(model: nn.Module) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class Rules:
    """What one engine's post-load processing is known to do; the map relies on nothing else.

    ``rerunnable``: quantization methods (by class name, as the engine names them) whose
    post-load processing may be re-run over loaded weights at any time and reads nothing
    else: the map writes the loaded weights and re-runs it (each checked against fresh
    engines by that engine's tests). ``permuting``: methods whose first-load processing is
    found out on index probes: a fused MoE layer's by ``experts(layer)``, the kernel object whose
    ``process_weights_after_loading(layer)`` does it (None: not there, so reloaded); any other
    layer's by its method's own ``process_weights_after_loading``.
    ``shadows(model, skip)``: the load-time parameters of layers whose processing replaced
    them with a kernel copy (the loaded layout the map writes), but those ``skip`` names.
    ``reprocess``: whether the map re-runs the post-load processing of the MAPPED layers a
    version wrote; False where the engine's own update window does it (SGLang's
    ``end_weight_update`` re-processes every layer, after ``begin_weight_update`` restored
    the loaded layout the map writes).
    ``loadable(model)``: a context in which ``load_weights`` takes checkpoint tensors again
    (vLLM's processing re-registers a quantized layer's parameters as plain ones, which its
    loaders refuse): the map's probe loads run inside it."""

    engine: str
    rerunnable: set[str] = field(default_factory=set)
    permuting: set[str] = field(default_factory=set)
    experts: Callable[[nn.Module], Any] = _no_experts
    shadows: Callable[[nn.Module, Callable[[nn.Module], bool]], tuple[Shadows, Replaced]] = _no_shadows
    reprocess: bool = True
    loadable: Callable[[nn.Module], AbstractContextManager[Any]] = _as_is

    def vouch(self, method_class_name: str) -> None:
        """Declare a quantization method's post-load processing re-runnable over the loaded
        weights: layers using it are then mapped element by element instead of reloaded.
        Only for methods you have checked."""
        self.rerunnable.add(method_class_name)


# For engines (and tests) whose layers have no post-load processing the map may re-run.
PLAIN = Rules("plain")


class How(enum.Enum):
    MAPPED = "mapped"
    PERMUTED = "permuted"
    RELOAD = "reload"


@dataclass(frozen=True)
class Kind:
    """How one layer is written: ``name`` is its kind (layer class / method), ``reason``
    why it is not written element by element (RELOAD only)."""

    how: How
    name: str
    reason: str = ""
    permutations: dict[str, Permutation] | None = None  # PERMUTED: parameter name -> its moves


def kind_name(layer: nn.Module) -> str:
    method = getattr(layer, "quant_method", None)
    return type(layer).__name__ + (f"/{type(method).__name__}" if method is not None else "")


def own_processing(module: nn.Module) -> bool:
    """A module that processes its weights after loading itself (vLLM's attention layers
    do, with the activation dtype): derived tensors the map would not refresh."""
    return callable(getattr(type(module), "process_weights_after_loading", None))


def classify(model: nn.Module, layers: Iterable[nn.Module], rules: Rules) -> dict[nn.Module, Kind]:
    """The kind of each of ``layers`` (modules holding parameters the map writes), by ``rules``."""
    layers = list(layers)
    wanted = {id(layer) for layer in layers}
    processors: dict[int, str] = {}  # a written layer -> the module with its own processing above it
    for module in model.modules():
        if module is model or not own_processing(module):
            continue
        for sub in module.modules():
            if id(sub) in wanted:
                processors.setdefault(id(sub), type(module).__name__)
    shared: dict[tuple[Any, ...], dict[str, Permutation] | None] = {}  # one discovery per experts kind and shape
    out: dict[nn.Module, Kind] = {}
    for layer in layers:
        name = kind_name(layer)
        if id(layer) in processors:
            out[layer] = Kind(How.RELOAD, name, f"{processors[id(layer)]} processes its weights after loading itself")
            continue
        method = getattr(layer, "quant_method", None)
        if method is None or not callable(getattr(method, "process_weights_after_loading", None)):
            out[layer] = Kind(How.MAPPED, name)
            continue
        method_name = type(method).__name__
        if method_name in rules.rerunnable:
            out[layer] = Kind(How.MAPPED, name)
        elif method_name in rules.permuting and all(isinstance(getattr(layer, n, None), torch.Tensor) for n in _MOE_WEIGHTS):
            out[layer] = _moe_kind(layer, name, shared, rules.experts(layer))
        elif method_name in rules.permuting:
            out[layer] = _layer_kind(layer, name, shared, method)
        else:
            out[layer] = Kind(How.RELOAD, name, f"{method_name} processes the loaded weights in a way the map does not know")
    return out


def _moe_kind(layer: nn.Module, name: str, shared: dict[tuple[Any, ...], dict[str, Permutation] | None], experts: Any) -> Kind:
    params = {n: getattr(layer, n, None) for n in _MOE_WEIGHTS}
    if experts is None or not all(isinstance(p, torch.Tensor) for p in params.values()):
        return Kind(How.RELOAD, name, "a fused MoE layer without the experts kernel or the w13/w2 weights the map knows")
    others = [n for n, p in layer.named_parameters(recurse=False) if n not in _MOE_WEIGHTS and p.numel()]
    if others:  # biases, scales: their processing is not probed
        return Kind(How.RELOAD, name, f"a fused MoE layer with {others} beside w13/w2")
    key = (type(experts), getattr(experts, "isa", None), *((tuple(p.shape), p.dtype) for p in params.values()))  # type: ignore[union-attr]
    if key not in shared:
        shared[key] = _moe_permutation(layer, experts, params)  # type: ignore[arg-type]
    found = shared[key]
    if found is None:
        return Kind(How.RELOAD, name, f"{type(experts).__name__} computes, pads or reshapes the experts after loading")
    return Kind(How.PERMUTED, f"{name}/{type(experts).__name__}", permutations=found)


def _layer_kind(layer: nn.Module, name: str, shared: dict[tuple[Any, ...], dict[str, Permutation] | None], method: Any) -> Kind:
    """A layer whose quantization method the rules name permuting (vLLM's block-fp8 linear
    method): its own post-load processing run on index probes of every parameter it holds
    (weights, scales, a bias), on a stand-in; PERMUTED when it only moves elements within
    each (vLLM's CPU fp8 kernel on an AMX host re-lays the weight out, ``convert_weight_packed``, and keeps the
    scales; with no prepack, nothing moves), else RELOAD."""
    params: dict[str, torch.Tensor] = {n: p for n, p in layer.named_parameters(recurse=False) if p.numel()}
    kernel = getattr(method, "fp8_linear", None) or getattr(method, "kernel", None)
    key = (type(method), type(kernel), *((n, tuple(p.shape), p.dtype) for n, p in params.items()))
    if key not in shared:
        shared[key] = _permutation(layer, method, params)
    found = shared[key]
    if found is None:
        return Kind(How.RELOAD, name, f"{type(method).__name__}'s post-load processing computes, pads or reshapes the loaded weights")
    return Kind(How.PERMUTED, name + (f"/{type(kernel).__name__}" if kernel is not None else ""), permutations=found)


@torch.no_grad()
def _permutation(layer: nn.Module, processor: Any, params: dict[str, torch.Tensor]) -> dict[str, Permutation] | None:
    """What ``processor.process_weights_after_loading`` does to ``params``, run on a stand-in
    of the layer (its own tables) so the layer the engine runs is not touched; None unless it
    only moves elements (or the processor refused the probes: not understood)."""

    def process(feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stand = copy.copy(layer)
        for table in ("_parameters", "_buffers", "_modules"):
            object.__setattr__(stand, table, dict(getattr(layer, table)))
        stand.__dict__.pop("_already_called_process_weights_after_loading", None)
        for n, t in feed.items():
            stand._parameters[n] = nn.Parameter(t.to(params[n].device), requires_grad=False)
        processor.process_weights_after_loading(stand)
        return {n: getattr(stand, n) for n in feed}

    try:
        return discover(params, process)
    except Exception as e:  # the processing refused probes: not understood, so reloaded
        log.info("probing %s's post-load processing failed (%s): its layers are reloaded", type(processor).__name__, e)
        return None


def _moe_permutation(layer: nn.Module, experts: Any, params: dict[str, torch.Tensor]) -> dict[str, Permutation] | None:
    """What the experts kernel's first-load processing does to ``w13``/``w2`` (``_permutation``)."""
    return _permutation(layer, experts, params)
