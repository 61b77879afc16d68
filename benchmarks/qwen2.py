"""A Qwen2-shaped causal LM from plain torch modules, for ``benchmarks/gpu_check.py e2e``.

The defaults are Qwen2-1.5B's shapes: 28 layers, hidden 1536, MLP 8960, 12 attention heads
over 2 key/value heads (head size 128, q/k/v with biases), vocabulary 151,936, RMSNorm, the
embedding tied to the output head (``lm_head.weight`` is ``model.embed_tokens.weight``), and
HF's parameter names. 1.54B parameters. No rotary embedding and no pretrained weights: what
matters here is the tensors' shapes, names and dtypes, and that an optimizer step moves them
as a real step does (a next-token loss on random tokens, backpropagated; weights start as HF
initialises them, normal with std 0.02, norms at 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    layers: int = 28
    hidden: int = 1536
    intermediate: int = 8960
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 151936
    tied: bool = True  # the output head is the embedding (Qwen2-1.5B); untied: a head of its own (1.78B at these widths)

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}), and heads by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + h + 2 * (h * kv + kv) + h * h
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp + 2 * h) + self.vocab * h * (1 if self.tied else 2) + h

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """This model's parameter names and shapes, in state-dict order (``Qwen2Shaped``'s)."""
        return checkpoint_shapes(self.layers, self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.vocab)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "head_dim": self.head_dim, "parameters": self.parameters(), "tied_embeddings": self.tied}


def checkpoint_shapes(layers: int, hidden: int, intermediate: int, q: int, kv: int, vocab: int, *, bias: bool = True) -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen2's parameter names and shapes, in state-dict order: the one table
    this model, tests/vllm_like.py's engine layout and their tests are checked against
    (``lm_head.weight`` listed tied or not, as ``state_dict()`` lists it)."""
    h = hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (q, h)
        if bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        if bias:
            out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if bias:
            out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "mlp.gate_proj.weight"] = (intermediate, h)
        out[p + "mlp.up_proj.weight"] = (intermediate, h)
        out[p + "mlp.down_proj.weight"] = (h, intermediate)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab, h)
    return out


class Attention(nn.Module):
    def __init__(self, s: Shape, **dd: Any) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=True, **dd)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=True, **dd)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=True, **dd)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape, **dd: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False, **dd)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False, **dd)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: Shape, **dd: Any) -> None:
        super().__init__()
        self.self_attn = Attention(s, **dd)
        self.mlp = MLP(s, **dd)
        self.input_layernorm = nn.RMSNorm(s.hidden, eps=1e-6, **dd)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden, eps=1e-6, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s: Shape, **dd: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden, **dd)
        self.layers = nn.ModuleList(Layer(s, **dd) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden, eps=1e-6, **dd)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Qwen2Shaped(nn.Module):
    def __init__(self, shape: Shape | None = None, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        s = shape or Shape()
        dd = {"device": device, "dtype": dtype}
        self.shape = s
        self.model = Body(s, **dd)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False, **dd)
        if s.tied:
            self.lm_head.weight = self.model.embed_tokens.weight  # tied, as Qwen2-1.5B
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


def build(shape: Shape, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> Qwen2Shaped:
    torch.manual_seed(seed)
    return Qwen2Shaped(shape, device=device, dtype=dtype)


def train_step(model: Qwen2Shaped, optimizer: torch.optim.Optimizer, generator: torch.Generator, batch: int, seq: int) -> float:
    """One real AdamW step: next-token cross entropy on random tokens, backpropagated."""
    device = model.lm_head.weight.device
    tokens = torch.randint(0, model.shape.vocab, (batch, seq + 1), generator=generator, device=device)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
