"""A tiny real decoder-only transformer and helpers for the strategy integration tests.

The model has what real checkpoints have and what weight sync must get right: an
embedding tied to the lm_head, LayerNorms, attention and MLP weights, a 3-D and a 0-D
parameter (the N-D and scalar COO views), a persistent int64 step counter buffer, a
persistent float buffer, and a non-persistent buffer that must never travel.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 61
D_MODEL = 32
SEQ = 12


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        # 9*d hidden units: fc2.weight has more than 256 columns, so COO cols need uint16
        self.fc1 = nn.Linear(d, 9 * d)
        self.fc2 = nn.Linear(9 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = D_MODEL, layers: int = 2, heads: int = 2, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=0.05)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        # A 3-D parameter: (groups, d/groups, d/groups) block-diagonal mixing; N-D COO view.
        g = 4
        self.mix = nn.Parameter(torch.randn(g, d // g, d // g) * 0.05)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))  # a 0-D parameter
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("step_count", torch.zeros((), dtype=torch.int64))  # persistent int64
        self.register_buffer("ema_loss", torch.zeros(1))  # persistent float buffer
        pos = torch.arange(SEQ, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, d, 2) / d))
        self.register_buffer("pos_cache", torch.cat([pos.sin(), pos.cos()], 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos_cache[:n]
        b, _, d = x.shape
        g = self.mix.shape[0]
        x = x + torch.einsum("btgi,gij->btgj", x.view(b, n, g, d // g), self.mix).reshape(b, n, d)
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x)) * self.logit_scale


def make_model(seed: int, *, dtype: torch.dtype = torch.float32, **kwargs: object) -> TinyDecoder:
    torch.manual_seed(seed)
    model = TinyDecoder(**kwargs)  # type: ignore[arg-type]
    return model.to(dtype)


class Trainer:
    """An fp32 master model trained with AdamW on random next-token batches."""

    def __init__(self, model: nn.Module, lr: float, seed: int = 1234) -> None:
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.model.step_count += 1
            self.model.ema_loss.mul_(0.9).add_(0.1 * loss.detach())
        return float(loss.detach())


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t`` for bitwise comparison (NaN and -0.0 safe)."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def cast_like(sender: Mapping[str, torch.Tensor], receiver: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sender's tensors cast to the receiver's dtypes (what the receiver must hold)."""
    return {k: sender[k].detach().to(receiver[k].dtype) for k in sender}


def mismatches(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ bit for bit (or in shape/dtype), or exist on one side only."""
    bad = sorted(set(expected) ^ set(actual))
    for k in expected:
        if k not in actual:
            continue
        a, b = expected[k], actual[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            bad.append(k)
    return bad


def snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent copies of every tensor, to check later that nothing was written."""
    return {k: v.detach().clone() for k, v in state.items()}


def iter_float_keys(state: Mapping[str, torch.Tensor]) -> Iterator[str]:
    return (k for k, v in state.items() if v.is_floating_point())


def numel(state: Mapping[str, torch.Tensor]) -> int:
    return sum(math.prod(v.shape) for v in state.values())
