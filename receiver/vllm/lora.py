"""The trainer's LoRA adapters registered in a vLLM worker's LoRA manager, and read back.

vLLM keeps an adapter twice: registered in its LoRA manager (a ``LoRAModel``, packed and
with B scaled by alpha / r, on the host: what it copies into a slot whenever it activates
the adapter) and, while active, in its slot of each LoRA layer's stacked tensors
(``lora_a_stacked`` / ``lora_b_stacked`` at the slot's index, sliced for tensor
parallelism). The receiver writes versions into checkpoint-shaped buffers (this module's
state, the adapters only: the base weights are never a target).

vLLM drops every adapter at the end of each weight update (``finish_weight_update`` calls
``reset_lora_state``: its base weights may have changed); here they did not, so this
manager's ``remove_all_adapters`` is wrapped (on the instance, until ``close``) to build the
synced adapters again from the buffers, as vLLM builds one read from disk
(``LoRAModel.from_lora_tensors``), register and pin them (which activates each into a
slot through the layers' own ``set_lora``), then read back what now serves: every element
of each registered copy and of its slot in every layer, against the buffers (B scaled by
the same bf16 multiply vLLM applies). That rebuild is what serves, so a commit inside
``update_weights`` writes only the buffers: a copy of the version into the registered
adapter and its slots there would be dropped at ``finish_weight_update`` (work in the hold
for nothing), and until then the previous version, whole, stays registered.

A rebuild that reads back wrong raises ``WriteCheckError`` out of ``finish_weight_update``
after putting back the adapter that served before (the same ``LoRAModel``, registered,
pinned and activated again): the engine serves the last version that read back whole
(its weight version label stays that one's: vLLM sets it only once ``finish`` returns),
while the receiver holds the new one; the next update's ``finish_weight_update`` builds
from the receiver's state again. With tensor parallelism a rank whose rebuild passed
serves the new version: the error says the workers differ until the next update.

An adapter is registered at its first commit (the bootstrap: registered and read back
inside the commit, so a wrong build fails the handshake) and pinned, in the manager's
cache and in a slot, so that vLLM's LRU never evicts it and never reloads it from a path.
A ``LoRARequest(name, id, path)`` naming its id finds it registered; ``path`` is never read.
Removed by a caller (``remove_lora``), an adapter is registered again at the next commit.

The commits run inside the receiver's commit, while vLLM's worker waits in
``update_weights`` or ``init_weight_transfer_engine``; the rebuild in vLLM's
``finish_weight_update``: nothing generates meanwhile.
"""

from __future__ import annotations

import random
import time
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

from protocol.errors import ConfigError, WeightSyncError, WriteCheckError
from protocol.state import Placed
from protocol.wire.dtypes import bit_view

from ..apply.commit import StagedUpdate
from ..apply.readback import check_all
from ..held.layout import Layout
from .adapters import AdapterSpec, Planned, Slots, SlotShape, plan_adapters


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
        self.tile = stacked[index, 0]  # the slot: (rows, cols), zero-padded past the adapter's rank
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

    def expected(self, whole: torch.Tensor) -> torch.Tensor:
        """What the slot holds when it holds ``whole`` (checkpoint shape, this view's
        dtype): this rank's box of it, zeros elsewhere (vLLM resets a slot before it sets)."""
        out = torch.zeros(self.rows, self.cols, dtype=self.dtype)
        rows = max(0, min(self.row_held, self.shape[0] - self.row0, self.rows))
        cols = max(0, min(self.col_held, self.shape[1] - self.col0, self.cols))
        out[:rows, :cols] = whole[self.row0 : self.row0 + rows, self.col0 : self.col0 + cols]
        return out

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
    receiver's state), where each lands, their registration in vLLM's manager and its
    read-back. Built (and every check made) before the receiver starts, so a refused
    adapter writes nothing. ``verify`` False (``check_writes`` 0) skips the read-backs.

    Not locked: ``commit`` and ``check`` run in the receiver's commit (its event-loop
    thread), the wrapped ``remove_all_adapters`` on vLLM's worker thread. They never
    overlap: the receiver is held (``hold=True``), so it commits only while the worker
    thread waits in ``init_weight_transfer_engine`` or ``update_weights``, never during
    ``finish_weight_update`` or a forward pass."""

    def __init__(self, model: torch.nn.Module, tensors: Sequence[tuple[str, tuple[int, ...]]], specs: dict[str, AdapterSpec],
                 verify: bool = True) -> None:
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            raise ConfigError("init_info.lora needs an engine started with LoRA enabled (enable_lora=True, max_lora_rank, max_loras)")
        self.manager, self.specs, self.verify = manager, specs, verify
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
        self._fresh: set[str] = set()  # registered by the commit in progress: read back by ``check``
        self.last_rebuild_s = 0.0  # the last ``remove_all_adapters``: rebuild, register and read back (in the hold)
        self._drop_all = manager.remove_all_adapters
        manager.remove_all_adapters = self._dropped

    def close(self) -> None:
        """Give vLLM back its own ``remove_all_adapters``; the adapters stay registered."""
        if self.manager.__dict__.get("remove_all_adapters") == self._dropped:
            del self.manager.remove_all_adapters

    def _dropped(self) -> None:
        """vLLM's ``remove_all_adapters``, then the synced adapters built again from the
        buffers, registered and read back (the end of every weight update: vLLM's worker
        thread, no commit in progress). One that reads back wrong is replaced by the copy
        that served before; ``WriteCheckError`` names it once every adapter is done (a
        failure other than a read-back: ``WeightSyncError``, the same way)."""
        started = time.perf_counter()
        serving = {adapter: self.manager.get_adapter(self.specs[adapter].id) for adapter in self._live}
        self._drop_all()
        failed: list[tuple[Exception, str]] = []
        for adapter in sorted(self._live):
            spec = self.specs[adapter]
            try:
                self._register(spec)
                if self.verify:
                    self._read_back(spec)
            except Exception as e:  # the others are still rebuilt; this one put back as it served
                failed.append((e, self._restore(spec, serving[adapter])))
        self.last_rebuild_s = time.perf_counter() - started
        if failed:
            what = "; ".join(f"{e} ({kept})" for e, kept in failed)
            other = next((e for e, _ in failed if not isinstance(e, WriteCheckError)), None)
            if other is not None:
                raise WeightSyncError(f"weightsync: registering the adapters again at the end of the weight update failed: {what}") from other
            raise WriteCheckError(f"weightsync: the adapters registered again at the end of the weight update do not hold the version: {what}")

    def _restore(self, spec: AdapterSpec, serving: Any) -> str:
        """``spec``'s adapter out of the manager, and ``serving`` (what it held before, if
        any) registered, pinned and activated again; says which."""
        self.manager.remove_adapter(spec.id)
        if serving is None:
            return f"adapter {spec.adapter!r} (id {spec.id}) is not registered now; the next commit registers it"
        self.manager.add_adapter(serving)
        self.manager.pin_adapter(spec.id)
        return f"adapter {spec.adapter!r} (id {spec.id}) serves the version it held before this update"

    # -- the commit ------------------------------------------------------------------------
    def commit(self, written: Iterable[str]) -> None:
        """Register (and pin) each written adapter the manager does not hold. One it holds
        is left as it is: vLLM drops it at ``finish_weight_update`` and ``_dropped`` builds
        this version from the buffers then; a copy into it now would be work in the hold
        for nothing, and the previous version serves whole until then."""
        for adapter in sorted({planned.key.adapter for name in written if (planned := self.plan.get(name)) is not None}):
            spec = self.specs[adapter]
            self._live.add(adapter)
            if self.manager.get_adapter(spec.id) is None:
                self._register(spec)
                self._fresh.add(adapter)

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
            raise WriteCheckError(f"the engine's registered adapter {lora.id} has no weights for {planned.layer!r}")
        held = weights.lora_a if planned.key.a else weights.lora_b
        return held[planned.index] if isinstance(held, list) else held

    def _slot(self, spec: AdapterSpec) -> int | None:
        ids = list(self.manager.lora_index_to_id)
        return ids.index(spec.id) if spec.id in ids else None

    # -- the read-back ----------------------------------------------------------------------
    def check(self, writes: Sequence[tuple[str, StagedUpdate]], samples: int, rng: random.Random) -> int:
        """Inside the commit: read back up to ``samples`` elements of each adapter tensor
        ``writes`` wrote into its buffer (the version the adapters are built from), every
        element of each adapter the commit registered (``_read_back``: one that differs
        is removed, nothing wrong serves), and a fixed sample of each LoRA layer's base
        weight (untouched since init). Returns how many tensors were read;
        ``WriteCheckError`` names the first that differs."""
        fresh, self._fresh = self._fresh, set()
        if samples <= 0:
            return 0
        checks = [(f"{name} (buffer)", self.buffers[name], update) for name, update in writes if name in self.plan]
        check_all(checks, samples, rng)
        read = len(checks)
        for adapter in sorted(fresh):
            spec = self.specs[adapter]
            try:
                read += self._read_back(spec)
            except WriteCheckError:
                self.manager.remove_adapter(spec.id)
                raise
        self._check_base()
        return read

    @torch.no_grad()
    def _read_back(self, spec: AdapterSpec) -> int:
        """Every element of ``spec``'s registered copy and of its slot in each layer against
        the buffers (B scaled as vLLM scales it); returns how many tensors were read."""
        registered, index = self.manager.get_adapter(spec.id), self._slot(spec)
        if registered is None or index is None:
            raise WriteCheckError(f"adapter {spec.adapter!r} (id {spec.id}) is not registered and active after it was registered")
        read = 0
        for name, planned in self.plan.items():
            if planned.key.adapter != spec.adapter:
                continue
            want = self.buffers[name] if planned.key.a else self.buffers[name].to(self.dtype, copy=True).mul_(spec.scaling)
            layer = self.manager.modules[planned.layer]
            view = SlotView(layer, index, planned.index, planned.key.a, tuple(want.shape), self.dtype)
            for where, got, expected in ((f"registered adapter {spec.id}", self._registered(registered, planned), want),
                                         (f"slot {index} of {planned.layer}", view.tile, view.expected(want))):
                if got.shape != expected.shape or not torch.equal(bit_view(got.to(self.dtype)), bit_view(expected)):
                    differs = "its shape" if got.shape != expected.shape else f"{int((bit_view(got) != bit_view(expected)).sum())} elements"
                    raise WriteCheckError(f"tensor {name!r} in the {where} differs from the version in {differs}")
                read += 1
        return read

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
