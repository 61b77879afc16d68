"""A small real transformer language model for the demo, the daemons' examples and tests.

Token embedding tied to the output head, pre-norm blocks, a persistent step-counter
buffer and a non-persistent rotary cache, so every kind of state-dict entry the
syncer handles is present.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # persistent
        self.register_buffer("causal", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        for block in self.blocks:
            x = block(x, self.causal[:n, :n])
        return self.head(self.norm(x))


def build(seed: int = 0, **kwargs: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def train_step(model: TinyLM, optimizer: torch.optim.Optimizer, generator: torch.Generator, batch: int = 8) -> float:
    """One real next-token AdamW step on a synthetic but learnable sequence task."""
    context = model.pos.shape[0]
    start = torch.randint(0, 200, (batch, 1), generator=generator)
    tokens = (start + torch.arange(context + 1)) % model.embed.num_embeddings  # counting sequences
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    model.steps += 1
    return float(loss.detach())


@torch.no_grad()
def generate(model: TinyLM, prompt: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """Greedy decoding: the rollout's inference."""
    tokens = prompt
    for _ in range(steps):
        window = tokens[:, -model.pos.shape[0]:]
        logits = model(window)[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens
