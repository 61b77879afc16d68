"""A Qwen2-shaped model whose ``load_weights`` places tensors as vLLM's parallel layers do.

One instance is one tensor-parallel rank of an engine. Its loaders repeat the arithmetic
of vLLM's own (``vllm.model_executor.layers``: ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` /
``ParallelLMHead``) and the checkpoint walk of ``Qwen2ForCausalLM.load_weights`` (fused
q/k/v and gate/up, a tied ``lm_head`` skipped), written out here so that
receiver/held/layout.py can be checked on any shape and rank without starting an engine:

- q/k/v rows fuse into ``qkv_proj`` (weight and bias), each rank taking its heads; with
  fewer kv heads than ranks, each kv head is replicated on ``tp // kv_heads`` ranks;
- gate/up rows fuse into ``gate_up_proj``; ``o_proj`` and ``down_proj`` split by columns;
- the vocabulary is padded to a multiple of 64 and split by rows; a rank's rows past the
  real vocabulary are zero (a rank may hold none);
- norms are replicated.

tests/test_vllm.py runs real vLLM workers; this is the same contract on many more shapes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks import qwen2

VOCAB_PADDING = 64  # vllm's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Shape:
    """A model's shape and the engine's tensor parallelism."""

    tp: int = 1
    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 2
    hidden: int = 6
    inter: int = 8
    vocab: int = 100
    bias: bool = True
    tied: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.tp or self.inter % self.tp:
            raise ValueError(f"{self}: heads and intermediate size must divide by tp")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:
            raise ValueError(f"{self}: kv heads and tp must divide one another")

    @property
    def vocab_padded(self) -> int:
        return -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The trainer's (Hugging Face) names and shapes, in state-dict order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qwen2.checkpoint_shapes(self.layers, self.hidden, self.inter, q, kv, self.vocab, bias=self.bias)

    def metadata(self, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(k, s, dtype) for k, s in self.checkpoint_shapes().items()]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class QKV(nn.Module):
    """``QKVParallelLinear`` at one rank: this rank's q heads, then k, then v."""

    def __init__(self, s: Shape, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rank, self.d = rank, s.head_dim
        self.heads = s.heads // s.tp
        self.kv_heads = max(s.kv_heads // s.tp, 1)
        self.replicas = max(s.tp // s.kv_heads, 1)
        rows = (self.heads + 2 * self.kv_heads) * s.head_dim
        self.weight = _param(rows, s.hidden, dtype=dtype)
        self.bias = _param(rows, dtype=dtype) if s.bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        q, kv = self.heads * self.d, self.kv_heads * self.d
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        shard_rank = self.rank if shard == "q" else self.rank // self.replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard_rank * size, size))


class GateUp(nn.Module):
    """``MergedColumnParallelLinear`` of gate and up at one rank."""

    def __init__(self, s: Shape, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rank, self.size = rank, s.inter // s.tp
        self.weight = _param(2 * self.size, s.hidden, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        param.data.narrow(0, shard * self.size, self.size).copy_(loaded.narrow(0, self.rank * self.size, self.size))


class RowParallel(nn.Module):
    """``RowParallelLinear`` at one rank: a slice of the input columns."""

    def __init__(self, rows: int, cols: int, s: Shape, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rank, self.cols = rank, cols // s.tp
        self.weight = _param(rows, self.cols, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.rank * self.cols, self.cols))


class VocabParallel(nn.Module):
    """``VocabParallelEmbedding`` / ``ParallelLMHead`` at one rank: rows of the padded
    vocabulary; those past the real one are zero."""

    def __init__(self, s: Shape, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        per_rank = s.vocab_padded // s.tp
        self.start = min(rank * per_rank, s.vocab)
        self.end = min((rank + 1) * per_rank, s.vocab)
        self.weight = _param(per_rank, s.hidden, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        held = loaded.narrow(0, self.start, self.end - self.start)
        param[: held.shape[0]].data.copy_(held)
        param[held.shape[0]:].data.fill_(0)


class Norm(nn.Module):
    def __init__(self, s: Shape, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(s.hidden, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


class Layer(nn.Module):
    def __init__(self, s: Shape, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        q = s.heads * s.head_dim
        self.qkv_proj = QKV(s, rank, dtype)
        self.o_proj = RowParallel(s.hidden, q, s, rank, dtype)
        self.gate_up_proj = GateUp(s, rank, dtype)
        self.down_proj = RowParallel(s.hidden, s.inter, s, rank, dtype)
        self.input_layernorm = Norm(s, dtype)
        self.post_attention_layernorm = Norm(s, dtype)


STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class Engine(nn.Module):
    """One rank's runtime parameters, and ``load_weights`` over checkpoint tensors."""

    def __init__(self, s: Shape, rank: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if not 0 <= rank < s.tp:
            raise ValueError(f"rank {rank} of tp {s.tp}")
        self.shape, self.rank = s, rank
        self.embed_tokens = VocabParallel(s, rank, dtype)
        self.layers = nn.ModuleList(Layer(s, rank, dtype) for _ in range(s.layers))
        self.norm = Norm(s, dtype)
        self.lm_head = VocabParallel(s, rank, dtype)
        if s.tied:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, as vLLM ties them

    def _module(self, name: str) -> tuple[nn.Module, str]:
        """The layer owning checkpoint name ``name`` (vLLM's names, without "model.")."""
        name = name.removeprefix("model.")
        path, _, attr = name.rpartition(".")
        module: nn.Module = self
        for part in path.split("."):
            if part in ("self_attn", "mlp"):
                continue
            module = getattr(module, part) if not part.isdigit() else module[int(part)]  # type: ignore[index]
        return module, attr

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, loaded in weights:
            if self.shape.tied and name.startswith("lm_head."):
                continue  # the head is the embedding: vLLM skips the checkpoint's copy
            for fused, part, shard in STACKED:
                if f".{part}." in name:
                    module, attr = self._module(name.replace(part, fused))
                    module.weight_loader(getattr(module, attr), loaded, shard)  # type: ignore[operator]
                    break
            else:
                if not name.endswith(tuple(f".{n}" for n in ("weight", "bias"))):
                    raise KeyError(name)
                module, attr = self._module(name)
                module.weight_loader(getattr(module, attr), loaded)  # type: ignore[operator]


def random_checkpoint(s: Shape, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of distinct random values; ``lm_head`` is the embedding when tied."""
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(shape, generator=g).to(dtype) for k, shape in s.checkpoint_shapes().items()}
    if s.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def loaded(s: Shape, rank: int, weights: dict[str, torch.Tensor]) -> Engine:
    """A fresh rank loaded by its own ``load_weights`` from ``weights``: the reference."""
    engine = Engine(s, rank)
    engine.load_weights(list(weights.items()))
    return engine


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of the parameters whose bits differ between two ranks of one shape."""
    pb = dict(b.named_parameters())
    out = []
    for name, p in a.named_parameters():
        q = pb[name]
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
        if p.shape != q.shape or not torch.equal(p.detach().view(bits), q.detach().view(bits)):
            out.append(name)
    return out
