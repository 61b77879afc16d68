"""A trainer's LoRA adapters checked against an engine's adapter slots (imports no vLLM).

The trainer tracks only its adapters' A and B matrices under PEFT's live names,
``base_model.model.<module>.lora_A.<adapter>.weight``; a PEFT model saves them without the
adapter's name (``...lora_A.weight``), which is what vLLM loads. ``init_info.lora`` gives
each adapter name the engine's id for it (a ``LoRARequest``'s ``lora_int_id``), the
``lora_name`` requests use, and its PEFT config (``r``, ``lora_alpha``, ``target_modules``).

``plan_adapters`` checks everything the engine's slots can be told in advance (ranks,
modules, shapes, how many adapters) so that an adapter that does not fit is refused with
an ``AdapterMismatchError`` before a single element is written. Pure functions over plain
values: the vLLM side (``lora.py``) describes the engine as ``Slots``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import AdapterMismatchError, ConfigError

PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
_SPEC_KEYS = {"id", "name", "r", "lora_alpha", "target_modules", "use_rslora"}


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as ``init_info.lora`` declares it (PEFT's config, plus vLLM's id and name)."""

    adapter: str  # PEFT's adapter name inside the trainer's names ("default")
    id: int  # the engine's lora_int_id
    name: str  # the lora_name requests use
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """What B is multiplied by in the engine (PEFT's: alpha / r, or / sqrt(r) for rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def peft_config(self) -> dict[str, Any]:
        """The adapter_config.json content vLLM would read for this adapter."""
        return {"peft_type": "LORA", "r": self.r, "lora_alpha": self.lora_alpha, "target_modules": list(self.target_modules),
                "use_rslora": self.use_rslora, "bias": "none"}

    def targets(self, module: str) -> bool:
        """PEFT's rule for a list of target modules: the module's name or a dotted suffix of it."""
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def parse_specs(value: Any) -> dict[str, AdapterSpec]:
    """``init_info.lora``: ``{adapter name: {"id", "name", "r", "lora_alpha", "target_modules"
    [, "use_rslora"]}}``, checked at the boundary (``ConfigError`` on anything else)."""
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"init_info.lora must map each PEFT adapter name to its id, name and config, got {value!r}")
    specs: dict[str, AdapterSpec] = {}
    for adapter, spec in value.items():
        where = f"init_info.lora[{adapter!r}]"
        if not isinstance(adapter, str) or not re.fullmatch(r"[^.\s]+", adapter):
            raise ConfigError(f"init_info.lora: an adapter name must be a non-empty string without dots, got {adapter!r}")
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {type(spec).__name__}")
        unknown = sorted(set(spec) - _SPEC_KEYS)
        missing = sorted({"id", "name", "r", "lora_alpha", "target_modules"} - set(spec))
        if unknown or missing:
            raise ConfigError(f"{where}: unknown keys {unknown}, missing keys {missing}")
        ident, rank, alpha, targets = spec["id"], spec["r"], spec["lora_alpha"], spec["target_modules"]
        if type(ident) is not int or ident < 1:
            raise ConfigError(f"{where}.id must be an int >= 1 (vLLM's lora_int_id), got {ident!r}")
        if not isinstance(spec["name"], str) or not spec["name"]:
            raise ConfigError(f"{where}.name must be a non-empty string (the LoRARequest's lora_name), got {spec['name']!r}")
        if type(rank) is not int or rank < 1:
            raise ConfigError(f"{where}.r must be a positive int, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ConfigError(f"{where}.lora_alpha must be a positive number, got {alpha!r}")
        if not isinstance(targets, list | tuple) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"{where}.target_modules must be a non-empty list of module names, got {targets!r}")
        rslora = spec.get("use_rslora", False)
        if type(rslora) is not bool:
            raise ConfigError(f"{where}.use_rslora must be true or false, got {rslora!r}")
        specs[adapter] = AdapterSpec(adapter, ident, spec["name"], rank, alpha, tuple(targets), rslora)
    for field in ("id", "name"):
        seen = [getattr(s, field) for s in specs.values()]
        if len(set(seen)) != len(seen):
            raise ConfigError(f"init_info.lora: two adapters share one {field}: {seen}")
    return specs


@dataclass(frozen=True)
class AdapterKey:
    """A trainer's adapter tensor: which adapter, which checkpoint module, A or B."""

    adapter: str
    module: str  # the checkpoint module, e.g. model.layers.0.self_attn.q_proj
    a: bool  # lora_A (else lora_B)

    @property
    def file_name(self) -> str:
        """Its name in a saved PEFT adapter (adapter_model.safetensors): what vLLM loads."""
        return f"{PEFT_PREFIX}{self.module}.lora_{'A' if self.a else 'B'}.weight"


def parse_key(name: str) -> AdapterKey:
    """A PEFT LoRA tensor name, or ``AdapterMismatchError`` naming it."""
    m = _KEY.match(name)
    if m is None:
        raise AdapterMismatchError(
            f"trainer tensor {name!r} is not a PEFT LoRA matrix (base_model.model.<module>.lora_A|lora_B.<adapter>.weight): "
            "a sender for LoRA sync tracks the adapters only"
        )
    return AdapterKey(m["adapter"], m["module"], m["which"] == "A")


@dataclass(frozen=True)
class SlotShape:
    """One engine LoRA layer: its packed sub-modules' names (one for an unpacked layer),
    its input size and each sub-module's output size (whole, before tensor parallelism)."""

    subs: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]


@dataclass(frozen=True)
class Slots:
    """What an engine's LoRA manager takes: its LoRA layers by name, ``max_lora_rank``,
    ``max_loras`` (adapters active at once) and ``max_cpu_loras`` (registered)."""

    modules: Mapping[str, SlotShape]
    max_rank: int
    max_loras: int
    max_cpu_loras: int

    def find(self, module: str) -> tuple[str, int] | None:
        """(the engine layer a checkpoint module lands in, its sub-module index), or None."""
        prefix, _, leaf = module.rpartition(".")
        for name, shape in self.modules.items():
            parent, _, _ = name.rpartition(".")
            if parent == prefix and leaf in shape.subs:
                return name, shape.subs.index(leaf)
        return None


@dataclass(frozen=True)
class Planned:
    """Where a trainer tensor goes: its key, the engine layer and sub-module index."""

    key: AdapterKey
    layer: str
    index: int


def plan_adapters(
    tensors: Sequence[tuple[str, tuple[int, ...]]], specs: Mapping[str, AdapterSpec], slots: Slots,
    rename: Callable[[str], str] = lambda module: module,
) -> dict[str, Planned]:
    """Each trainer tensor ``(name, shape)`` mapped to its engine layer, or
    ``AdapterMismatchError`` naming the first thing the engine could not take. ``rename``:
    the engine's checkpoint-name mapping of a module name (vLLM's ``hf_to_vllm_mapper``)."""
    if len(specs) > slots.max_loras or len(specs) > slots.max_cpu_loras:
        raise AdapterMismatchError(
            f"{len(specs)} adapters, each pinned in its own slot, but the engine has max_loras={slots.max_loras}, "
            f"max_cpu_loras={slots.max_cpu_loras} (keep one more slot free for adapters loaded from disk)"
        )
    for spec in specs.values():
        if spec.r > slots.max_rank:
            raise AdapterMismatchError(f"adapter {spec.adapter!r} has rank {spec.r}, above the engine's max_lora_rank {slots.max_rank}")
    planned: dict[str, Planned] = {}
    seen: dict[str, set[tuple[str, bool]]] = {a: set() for a in specs}
    for name, shape in tensors:
        key = parse_key(name)
        found_spec = specs.get(key.adapter)
        if found_spec is None:
            raise AdapterMismatchError(f"trainer tensor {name!r} belongs to adapter {key.adapter!r}, which init_info.lora gives no id")
        spec = found_spec
        if not spec.targets(key.module):
            raise AdapterMismatchError(f"trainer tensor {name!r}: module {key.module!r} is not among adapter "
                                       f"{key.adapter!r}'s target_modules {list(spec.target_modules)}")
        found = slots.find(rename(key.module))
        if found is None:
            raise AdapterMismatchError(f"trainer tensor {name!r}: the engine has no LoRA layer for module {key.module!r} "
                                       "(not a LoRA-capable layer of this model, or outside the engine's --lora-target-modules)")
        layer, index = found
        slot = slots.modules[layer]
        want = (spec.r, slot.in_features) if key.a else (slot.out_features[index], spec.r)
        if tuple(shape) != want:
            raise AdapterMismatchError(
                f"trainer tensor {name!r} has shape {tuple(shape)}, the engine's {layer!r} takes {want} "
                f"(rank {spec.r} as declared; a rank other than declared, or another model's module)"
            )
        seen[key.adapter].add((key.module, key.a))
        planned[name] = Planned(key, layer, index)
    for adapter, got in seen.items():
        if not got:
            raise AdapterMismatchError(f"init_info.lora names adapter {adapter!r}, which the trainer does not send")
        half = sorted(m for m, a in got if (m, not a) not in got)
        if half:
            raise AdapterMismatchError(f"adapter {adapter!r}: module {half[0]!r} has only one of lora_A and lora_B")
    return planned
