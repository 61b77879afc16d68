"""What weightsync relies on in vLLM's workers: the rules of its post-load processing, its
reload path and its worker group (``receiver.held.worker.EngineSide``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from protocol.errors import ConfigError, PlacementError
from protocol.quant import Fp8Format

from ..held.fp8 import fp8_format
from ..held.kinds import Replaced, Rules, Shadows


def _fused_experts(layer: nn.Module) -> Any:
    """vLLM's experts kernel of a fused MoE layer, whose processing tiles ``w13``/``w2``."""
    return getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)


def _shadows(model: nn.Module, skip: Callable[[nn.Module], bool]) -> tuple[Shadows, Replaced]:
    """Give every layer whose parameters vLLM replaced after loading its load-time ones back
    (but those ``skip`` names), rebuilt from vLLM's own reload metadata. Returns the
    shadows and what they replaced (``layout._unshadow``)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # a vLLM without reload metadata: nothing was re-packed that we could undo
        return {}, {}
    shadows: Shadows = {}
    replaced: Replaced = {}
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or skip(layer):
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
        replaced[layer] = {}
        for name, shadow in made.items():
            replaced[layer][name] = layer._parameters.get(name)
            if hasattr(layer, name):
                delattr(layer, name)
            layer.register_parameter(name, shadow)
        shadows[layer] = made
    return shadows, replaced


@contextlib.contextmanager
def _loadable(model: nn.Module) -> Iterator[None]:
    """For the length of the block, every parameter vLLM's post-load processing re-registered
    as a plain ``Parameter`` of the same shape and dtype (its block-fp8 linear method does,
    ``replace_parameter``) is given its load-time class and attributes back (its loaders,
    from vLLM's own reload metadata) over the same storage, so ``load_weights`` takes
    checkpoint tensors and copies them where the layer reads them. The layers get their
    own parameters back on leaving; nothing is copied."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # a vLLM without reload metadata: its parameters are its loaders' own
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None:
                continue
            for name, meta in info.restore_metadata[0].items():
                current = layer._parameters.get(name)
                if (current is None or type(current) is type(meta) or tuple(current.shape) != tuple(meta.shape)
                        or current.dtype != meta.dtype):
                    continue
                alias = current.data  # the same storage
                alias.__class__ = type(meta)
                alias.__dict__ = dict(meta.__dict__)
                restore_layer_refs(alias, layer)
                layer._parameters[name] = alias  # type: ignore[assignment]
                swapped.append((layer, name, current))
        yield
    finally:
        for layer, name, current in reversed(swapped):
            layer._parameters[name] = current


# vLLM's unquantized linear and embedding methods re-pack the loaded weight into a kernel
# copy on CPU and may be re-run at any time; its unquantized fused MoE tiles the experts once
# (found out on probes). Its block-fp8 linear method's processing is probed too: on CPU its
# kernel's AMX prepack (``convert_weight_packed``) re-lays the weight out and keeps the scales, where the CPU has
# AMX; a GPU kernel's that computes (requantised ue8m0 scales, say) makes those layers reloaded.
# Checked against fresh engines by tests/test_vllm.py and tests/test_vllm_fp8.py.
VLLM = Rules(
    "vllm",
    rerunnable={"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"},
    permuting={"UnquantizedFusedMoEMethod", "Fp8LinearMethod"},
    experts=_fused_experts,
    shadows=_shadows,
    loadable=_loadable,
)
vouch = VLLM.vouch


class VLLMSide:
    """``EngineSide`` for a vLLM worker: vLLM's layerwise reload, its world group."""

    name = "vllm"
    rules = VLLM

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config

    def quant(self) -> Fp8Format | None:
        """The model's block-fp8 format from its checkpoint's ``quantization_config`` (what
        vLLM's ``Fp8Config`` reads): ``weight_block_size``, and ``scale_fmt: ue8m0`` for
        power-of-two scales (vLLM then turns DeepGEMM's UE8M0 on); None for a model that is
        not block fp8. Refused (``ConfigError``): fp8 without blocks, scales stored as e8m0 bytes."""
        config = getattr(getattr(self.model_config, "hf_config", None), "quantization_config", None)
        if config is None and getattr(self.model_config, "quantization", None) is None:
            return None
        config = config if isinstance(config, dict) else getattr(config, "to_dict", lambda: {})()
        method = config.get("quant_method", getattr(self.model_config, "quantization", None))
        if method != "fp8":
            return None  # another quantization: its layers are classed (and reloaded) by kinds.py
        block = config.get("weight_block_size")
        if block is None:
            raise ConfigError("this vLLM model is fp8 without a weight_block_size (per-tensor scales): weightsync follows "
                              "block-fp8 engines only")
        if config.get("scale_dtype") in ("e8m0", "float8_e8m0fnu") or getattr(self.model_config, "is_scale_e8m0", False):
            raise ConfigError("this vLLM model stores its fp8 scales as e8m0 bytes: weightsync follows fp32 scales only")
        return fp8_format(block, "ue8m0" if config.get("scale_fmt") == "ue8m0" else "fp32")

    @torch.no_grad()
    def reload(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """Load ``weights`` (checkpoint name -> whole tensor) through vLLM's layerwise reload
        (``initialize_layerwise_reload`` / ``load_weights`` / ``finalize_layerwise_reload``,
        as vLLM's own checkpoint-format weight-transfer engines do), which rebuilds each layer
        at its load-time layout, loads, runs its post-load processing and copies the result
        into the storage the engine runs on. Layers none of them reaches keep their tensors."""
        if not weights:
            return
        try:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        except ImportError as e:  # pragma: no cover - every vLLM with weight transfer has it
            raise PlacementError(f"this vLLM has no layerwise reload, so layers the map does not know cannot be updated: {e}") from e
        device = _device(model)
        initialize_layerwise_reload(model)
        try:
            model.load_weights([(name, t.to(device)) for name, t in weights.items()])  # type: ignore[operator]
        finally:
            finalize_layerwise_reload(model, self.model_config)

    def step_module(self, model: nn.Module) -> nn.Module:
        return model  # vLLM's eager paths call the model itself once per step

    def world(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().world_size)
        except (ImportError, AssertionError):
            return 1

    def rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)

    def broadcast(self, value: Any) -> Any:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        box = [value]
        torch.distributed.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        out: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(out, value, group=group.cpu_group)
        return out


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")
