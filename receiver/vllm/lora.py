"""The trainer's LoRA adapters written into a vLLM worker's adapter slots, in place.

vLLM keeps an adapter twice: registered in its LoRA manager (a ``LoRAModel``, packed and
with B scaled by alpha / r, on the host: what it copies into a slot whenever it activates
the adapter) and, while active, in its slot of each LoRA layer's stacked tensors
(``lora_a_stacked`` / ``lora_b_stacked`` at the slot's index, sliced for tensor
parallelism). The receiver writes versions into checkpoint-shaped buffers (this module's
state, the adapters only: the base weights are never a target). Each commit then carries
what it wrote into both copies: the registered matrices in place (B scaled by the same
bf16 multiply vLLM applies when it loads from disk), and each touched layer's slot through
the layer's own ``set_lora`` (its slicing for tensor parallelism), so requests naming the
adapter's id serve the new version at once, without a disk round trip.

An adapter is registered at its first commit (the bootstrap) and pinned, in the manager's
cache and in a slot, so that vLLM's LRU never evicts it and never reloads it from a path.
A ``LoRARequest(name, id, path)`` naming its id finds it registered; ``path`` is never read.
vLLM drops every adapter at the end of each weight update (``finish_weight_update`` calls
``reset_lora_state``: its base weights may have changed); here they did not, so this
manager's ``remove_all_adapters`` is wrapped (on the instance, until ``close``) to register
the synced adapters again from the buffers, at once. Removed by a caller
(``remove_lora``), an adapter is registered again at the next commit.

Everything here runs inside the receiver's commit, while vLLM's worker waits in
``update_weights`` or ``init_weight_transfer_engine``: nothing generates meanwhile.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from vllm.lora.layers import BaseLayerWithLoRA
from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
from vllm.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA
from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.layers.linear import QKVParallelLinear

from protocol.errors import AdapterMismatchError, ConfigError, WriteCheckError
from protocol.state import Placed
from protocol.wire.dtypes import bit_view

from ..apply.commit import StagedUpdate
from ..apply.readback import check_all
from .adapters import AdapterSpec, Planned, Slots, SlotShape, plan_adapters
from .layout import Layout


def describe(manager: Any) -> Slots:
    """The LoRA linear layers of a vLLM LoRA manager and its limits, as ``Slots``."""
    config = manager.lora_config
    if config.fully_sharded_loras:
        raise ConfigError("weightsync writes LoRA slots of engines without fully_sharded_loras only")
    modules: dict[str, SlotShape] = {}
    for name, layer in manager.modules.items():
        if not isinstance(layer, BaseLinearLayerWithLoRA):
            continue  # embeddings, logits, experts: not written by weightsync
        base: Any = layer.base_layer
        leaf = name.rpartition(".")[2]
        packed: list[str] = list(manager.packed_modules_mapping.get(leaf, ()))
        subs = tuple(packed) or (leaf,)
        if len(subs) == 1:
            out: tuple[int, ...] = (int(base.output_size),)
        elif isinstance(base, QKVParallelLinear):  # whole q, k, v sizes (kv heads replicated across ranks aside)
            q, kv = base.total_num_heads * base.head_size, base.total_num_kv_heads * base.head_size
            out = (q, kv, kv)
        else:
            out = tuple(int(s) for s in base.output_sizes)
        if len(out) != len(subs):
            continue  # a packing weightsync does not know: not a target
        modules[name] = SlotShape(subs, int(base.input_size), out)
    return Slots(modules, int(config.max_lora_rank), int(config.max_loras), int(config.max_cpu_loras))


class SlotView(Placed):
    """One adapter matrix (checkpoint shape) as it lies in its slot of one layer: for
    reading back what a commit wrote. Worked out from the layer's geometry (its rank's
    shard of the rows or columns), independently of ``set_lora``'s slicing."""

    def __init__(self, layer: BaseLinearLayerWithLoRA, index: int, sub: int, a: bool, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.layer, self.slot, self.sub, self.a = layer, index, sub, a
        self.shape, self.dtype = shape, dtype
        stacked = (layer.lora_a_stacked if a else layer.lora_b_stacked)[sub]
        self.device = stacked.device
        self.stacked = stacked.reshape(-1)  # contiguous: a view
        self.rows, self.cols = int(stacked.shape[2]), int(stacked.shape[3])
        rank = int(layer.tp_rank)
        self.row0, self.col0 = 0, 0
        self.row_held, self.col_held = shape[0], shape[1]
        if a and isinstance(layer, RowParallelLinearWithLoRA):  # A's input columns are sharded
            self.col0, self.col_held = rank * self.cols, self.cols
        elif not a and isinstance(layer, ColumnParallelLinearWithLoRA):  # B's output rows are sharded
            ids = getattr(layer, "output_ids", None)
            self.row_held = int(layer.output_slices[sub]) if ids is not None else int(layer.output_size)
            self.row0 = (int(ids[sub]) if ids is not None else rank) * self.row_held

    def places(self, flat: Sequence[int]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        at, offsets = [], []
        width = self.shape[1]
        for i, f in enumerate(flat):
            r, c = divmod(int(f), width)
            r, c = r - self.row0, c - self.col0
            if 0 <= r < self.row_held and 0 <= c < self.col_held:
                at.append(i)
                offsets.append(self.slot * self.rows * self.cols + r * self.cols + c)
        return [(self.stacked, at, offsets)]


class AdapterSlots:
    """The adapters ``init_info.lora`` declares, on one worker: their buffers (the
    receiver's state), where each lands, and the writes into vLLM's copies. Built (and
    every check made) before the receiver starts, so a refused adapter writes nothing.

    Not locked: ``commit`` and ``check`` run in the receiver's commit (its event-loop
    thread), the wrapped ``remove_all_adapters`` on vLLM's worker thread. They never
    overlap: the receiver is held (``hold=True``), so it commits only while the worker
    thread waits in ``init_weight_transfer_engine`` or ``update_weights``, never during
    ``finish_weight_update`` or a forward pass."""

    def __init__(self, model: torch.nn.Module, tensors: Sequence[tuple[str, tuple[int, ...]]], specs: dict[str, AdapterSpec]) -> None:
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            raise ConfigError("init_info.lora needs an engine started with LoRA enabled (enable_lora=True, max_lora_rank, max_loras)")
        self.manager, self.specs = manager, specs
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        self.mapper: Any = mapper.get_rename_mapper() if mapper is not None else None
        rename = (lambda m: self.mapper._map_name(m) or m) if self.mapper is not None else (lambda m: m)
        self.plan: dict[str, Planned] = plan_adapters(tensors, specs, describe(manager), rename)
        self.dtype: torch.dtype = manager.lora_config.lora_dtype
        shapes = dict(tensors)
        self.buffers = {name: torch.zeros(shapes[name], dtype=self.dtype) for name in self.plan}
        self.layout = Layout(model, dict(self.buffers), [], {})  # the state: no base weight is a target
        self._base = self._sample_base(8)
        self._live: set[str] = set()  # adapters committed at least once: registered again after vLLM drops them
        self._drop_all = manager.remove_all_adapters
        manager.remove_all_adapters = self._dropped

    def close(self) -> None:
        """Give vLLM back its own ``remove_all_adapters``; the adapters stay registered."""
        if self.manager.__dict__.get("remove_all_adapters") == self._dropped:
            del self.manager.remove_all_adapters

    def _dropped(self) -> None:
        """vLLM's ``remove_all_adapters``, then the synced adapters registered again (the
        end of every weight update: vLLM's worker thread, no commit in progress)."""
        self._drop_all()
        for adapter in sorted(self._live):
            self._register(self.specs[adapter])

    # -- the commit ------------------------------------------------------------------------
    @torch.no_grad()
    def commit(self, written: Iterable[str]) -> None:
        """Carry the written buffers into each adapter's registered copy and its slot;
        register (and pin) an adapter the manager does not hold."""
        touched: dict[str, set[str]] = {}
        for name in written:
            planned = self.plan.get(name)
            if planned is not None:
                touched.setdefault(planned.key.adapter, set()).add(name)
        for adapter, names in touched.items():
            spec = self.specs[adapter]
            registered = self.manager.get_adapter(spec.id)
            if registered is None:
                self._register(spec)
                self._live.add(adapter)
                continue
            layers: set[str] = set()
            for name in names:
                planned = self.plan[name]
                target = self._registered(registered, planned)
                target.copy_(self.buffers[name])
                if not planned.key.a:
                    target *= spec.scaling  # in the adapter's dtype, as vLLM's LoRALayerWeights.optimize
                layers.add(planned.layer)
            index = self._slot(spec)
            if index is not None:
                for layer in sorted(layers):
                    weights = registered.loras[layer]
                    self.manager.modules[layer].set_lora(index, weights.lora_a, weights.lora_b)

    def _register(self, spec: AdapterSpec) -> None:
        """Build the adapter from the buffers as vLLM builds one read from disk, register
        it and pin it (which activates it into a slot)."""
        tensors = {p.key.file_name: self.buffers[n].clone() for n, p in self.plan.items() if p.key.adapter == spec.adapter}
        helper = PEFTHelper.from_dict({**spec.peft_config(), "vllm_max_position_embeddings": None})
        lora = LoRAModel.from_lora_tensors(
            spec.id, tensors, helper, device="cpu", dtype=self.dtype, weights_mapper=self.mapper,
            skip_prefixes=getattr(self.manager.model, "lora_skip_prefixes", None),
        )
        self.manager.add_adapter(lora)
        self.manager.pin_adapter(spec.id)

    def _registered(self, lora: Any, planned: Planned) -> torch.Tensor:
        weights = lora.loras.get(planned.layer)
        if weights is None:
            raise AdapterMismatchError(f"the engine's registered adapter {lora.id} has no weights for {planned.layer!r}")
        held = weights.lora_a if planned.key.a else weights.lora_b
        return held[planned.index] if isinstance(held, list) else held

    def _slot(self, spec: AdapterSpec) -> int | None:
        ids = list(self.manager.lora_index_to_id)
        return ids.index(spec.id) if spec.id in ids else None

    # -- the read-back ----------------------------------------------------------------------
    def check(self, writes: Sequence[tuple[str, StagedUpdate]], samples: int, rng: random.Random) -> int:
        """Read back up to ``samples`` written elements of each adapter tensor in its
        registered copy and in its slot (B scaled as vLLM scales it), and a fixed sample of
        each LoRA layer's base weight (untouched since init). Returns how many tensors were
        read; ``WriteCheckError`` names the first that differs."""
        if samples <= 0:
            return 0
        checks: list[tuple[str, Any, StagedUpdate]] = []
        for name, update in writes:
            planned = self.plan.get(name)
            if planned is None:
                continue
            spec = self.specs[planned.key.adapter]
            registered = self.manager.get_adapter(spec.id)
            if registered is None:
                raise WriteCheckError(f"adapter {spec.adapter!r} (id {spec.id}) is not registered after the commit that wrote {name!r}")
            want = update.values if planned.key.a else update.values.to(self.dtype, copy=True).mul_(spec.scaling)
            expected = StagedUpdate(update.ordinal, update.flat, want)
            checks.append((f"{name} (registered)", self._registered(registered, planned), expected))
            index = self._slot(spec)
            if index is not None:
                layer = self.manager.modules[planned.layer]
                view = SlotView(layer, index, planned.index, planned.key.a, tuple(self.buffers[name].shape), self.dtype)
                checks.append((f"{name} (slot {index})", view, expected))
        check_all(checks, samples, rng)
        self._check_base()
        return len(checks)

    def _sample_base(self, samples: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(layer, its base weight, sampled flat indices, their bits) of each LoRA layer."""
        rng = random.Random(0)
        out = []
        for name, layer in self.manager.modules.items():
            weight = getattr(getattr(layer, "base_layer", None), "weight", None)
            if not isinstance(layer, BaseLayerWithLoRA) or weight is None or not weight.numel():
                continue  # a weight vLLM re-packed into a kernel copy (emptied): nothing to read
            flat = weight.reshape(-1)
            picked = sorted(rng.sample(range(flat.numel()), min(samples, flat.numel())))
            out.append((name, flat, torch.tensor(picked), bit_view(flat[picked]).clone()))
        return out

    def _check_base(self) -> None:
        for name, flat, picked, bits in self._base:
            if not torch.equal(bit_view(flat[picked]), bits):
                raise WriteCheckError(f"the base weight of {name!r} changed under adapter-only sync")
