"""The ``weightsync`` weight-transfer engine, run by every vLLM worker.

vLLM drives it through its own API (offline ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, or the same as
``vllm serve`` routes). Each worker runs a weightsync ``Receiver`` on its own thread and
event loop (``receiver.held.worker.HeldWorker``, the part every engine adapter shares),
over the worker's model as ``receiver.held.layout.derive_layout`` maps it: versions are
received, validated and staged in the background while vLLM generates (``hold=True``),
and written only inside ``update_weights``, at a cost proportional to what changed.

What a caller can rely on, beyond vLLM's contract for a backend:

- ``init_weight_transfer_engine`` returns once the worker holds the trainer's current
  version (bootstrapped), so an engine may start from ``--load-format dummy``.
- ``update_weights`` commits every staged version up to ``update_info["version"]`` in
  order, each all or nothing, and returns with the weights at that version or later
  (a resync may land past it); every worker of the engine ends at the same version.
  vLLM's ``sparse_nccl`` documents that a failed update leaves a worker half-written;
  here a failure (timeout, a corrupted patch, a lost trainer) raises through vLLM and
  the weights stay at the last fully applied version.
- ``start_weight_update`` and ``finish_weight_update`` hold nothing: patches land in place.
- Calls come from vLLM's worker thread one at a time (vLLM serialises its RPCs);
  a second ``init_weight_transfer_engine`` is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from protocol.errors import ConfigError, StateError

from ..control.service import Receiver
from ..engine import parse_version
from ..held.layout import Layout
from ..held.steps import StepVersions
from ..held.worker import CHECK_WRITES, HeldInit, HeldWorker, Targets, check_update
from .adapters import parse_specs
from .rules import VLLMSide

if TYPE_CHECKING:
    from .lora import AdapterSlots

log = logging.getLogger(__name__)
__all__ = ["CHECK_WRITES", "WeightsyncEngine", "WeightsyncInitInfo", "WeightsyncUpdateInfo"]


@dataclass
class WeightsyncInitInfo(HeldInit, WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine``: ``HeldInit``'s fields (endpoint,
    config, curve, name_mapping, timeout, insecure_plaintext, prepack, check_writes), and
    ``lora``: the trainer sends LoRA adapters only (PEFT names), written into the engine's
    adapter slots in place, the base weights untouched: ``{adapter name: {"id", "name", "r",
    "lora_alpha", "target_modules"}}`` (``receiver/vllm/adapters.py``, ``lora.py``)."""

    lora: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora is not None:
            parse_specs(self.lora)  # a ConfigError unless every adapter has its id, name and config


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``: ``version`` an int, a string ending in
    digits (``"global_step_12"``) or None for the sender's current version; ``timeout``
    in seconds; ``verify_checksum`` compares the state digest with the trainer's."""

    version: int | str | None = None
    timeout: float | None = 60.0
    verify_checksum: bool = False

    def __post_init__(self) -> None:
        check_update(self.version, self.timeout, self.verify_checksum)


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """vLLM's weight-transfer engine over a ``HeldWorker`` (see the module doc)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        dtype = self.model_config.dtype  # what the engine's weights are in: every float tensor is declared so
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"the engine's model dtype is {dtype!r}, not a torch dtype")
        self.held = HeldWorker(model, dtype, VLLMSide(self.model_config))

    # -- what tests, benchmarks and the worker extension read ---------------------------
    @property
    def receiver(self) -> Receiver | None:
        return self.held.receiver

    @property
    def layout(self) -> Layout | None:
        return self.held.layout

    @property
    def totals(self) -> dict[str, int]:
        return self.held.totals

    @property
    def last_timing(self) -> dict[str, float]:
        """The last update's commit, re-pack and read-back seconds (``HeldWorker.update``)."""
        return self.held.last_timing

    @property
    def step_versions(self) -> StepVersions | None:
        return self.held.step_versions

    @property
    def adapters(self) -> AdapterSlots | None:
        """init_info.lora: the adapters' slots (receiver/vllm/lora.py)."""
        return self.held.targets  # type: ignore[return-value]

    # -- vLLM's API ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if self.held.receiver is not None:
            raise StateError("the weightsync engine is already initialised; shut it down first")
        targets = None
        if init_info.lora is not None:  # the adapters only, into vLLM's LoRA slots; refused before any write
            specs = parse_specs(init_info.lora)

            def targets(shapes: list[tuple[str, tuple[int, ...]]]) -> Targets:
                from .lora import AdapterSlots

                return AdapterSlots(self.model, shapes, specs, verify=init_info.check_writes > 0)

        self.held.start(init_info, targets)

    def start_weight_update(self) -> None:
        self.held.healthy()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        self.held.update(parse_version(update_info.version), update_info.timeout, update_info.verify_checksum)

    def finish_weight_update(self) -> None:
        self.held.healthy()

    def shutdown(self) -> None:
        self.held.shutdown()
