"""Post-load processing that only moves elements, found out by running it on index probes.

vLLM's CPU MoE kernel re-packs each expert's ``w13``/``w2`` into tiles after loading
(same shape and dtype, elements moved): a checkpoint element's load-time place is not
where the kernel reads it. Rather than encode any kernel's tiling here, the processing
itself is run on a stand-in whose parameters hold their own element indices (spread over
a few probes of 14 bits each, 6 for the 1-byte floats, as finite values), and each output element's index read back.
Every output must come from exactly one input (a bijection), else the processing computes
rather than moves and nothing is returned: the caller then does not map that layer.

A kernel tiles each expert alike, so the table is kept for one period (an expert's slice)
when every period moves the same way: a few MB for a real model, shared by its layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# (bits dtype, first pattern, index bits a probe carries): finite, positive patterns. The
# 1-byte floats carry 6 bits a round, patterns 0x10..0x4F: finite in both fp8 formats (e4m3fn's
# NaNs are 0x7F/0xFF, e5m2's infinities and NaNs 0x7C..0x7F/0xFC..0xFF), none a zero of either sign.
_CODES = {
    torch.bfloat16: (torch.int16, 0x3C00, 14),
    torch.float16: (torch.int16, 0x3C00, 14),
    torch.float32: (torch.int32, 0x3F800000, 22),
    torch.float8_e4m3fn: (torch.uint8, 0x10, 6),
    torch.float8_e5m2: (torch.uint8, 0x10, 6),
}


@dataclass(frozen=True)
class Permutation:
    """Where each load-time element offset of a parameter's storage lives at run time:
    ``offset // period * period + table[offset % period]``."""

    table: torch.Tensor  # int64, one period's runtime offsets
    period: int

    def __call__(self, offsets: torch.Tensor) -> torch.Tensor:
        table = self.table if self.table.device == offsets.device else self.table.to(offsets.device)
        base = torch.div(offsets, self.period, rounding_mode="floor") * self.period
        return base + table[offsets - base]

    def at(self, offset: int) -> int:
        base = offset // self.period * self.period
        return base + int(self.table[offset - base])

    def index(self, numel: int) -> torch.Tensor:
        """The runtime offset of every load-time offset of a storage of ``numel`` elements."""
        return self(torch.arange(numel, dtype=torch.int64))

    @property
    def identity(self) -> bool:
        return bool(torch.equal(self.table, torch.arange(self.period, dtype=self.table.dtype, device=self.table.device)))


def _probe(numel: int, dtype: torch.dtype, round_: int) -> torch.Tensor:
    """Round ``round_`` of the index probe: bits ``width * round_`` on of each element's index."""
    bits, first, width = _CODES[dtype]
    index = torch.arange(numel, dtype=torch.int64)
    return (((index >> (width * round_)) & ((1 << width) - 1)) + first).to(bits).view(dtype)


def _rounds(numel: int, dtype: torch.dtype) -> int:
    return max(1, math.ceil(max(numel - 1, 1).bit_length() / _CODES[dtype][2]))


def discover(
    params: Mapping[str, torch.Tensor], process: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> dict[str, Permutation] | None:
    """Run ``process`` (parameter name -> probe tensor in, the processed tensors out) on
    index probes of ``params`` and return, per parameter, where each load-time element
    ends up; None when any output is not exactly one input moved (the processing
    computes, pads, or changes a shape or dtype) or a dtype has no probe code. Decoded
    round by round: about 20 bytes an element at the peak, once per layer shape."""
    if any(p.dtype not in _CODES for p in params.values()):
        return None
    rounds = {name: _rounds(p.numel(), p.dtype) for name, p in params.items()}
    source = {name: torch.zeros(p.numel(), dtype=torch.int64) for name, p in params.items()}  # runtime offset -> load-time
    for r in range(max(rounds.values())):
        feed = {name: _probe(p.numel(), p.dtype, min(r, rounds[name] - 1)).view(p.shape) for name, p in params.items()}
        out = process(feed)
        for name, p in params.items():
            got = out.get(name)
            if got is None or tuple(got.shape) != tuple(p.shape) or got.dtype != p.dtype:
                return None
            if r >= rounds[name]:
                continue
            bits, first, width = _CODES[p.dtype]
            raw = got.detach().cpu().contiguous().view(bits).reshape(-1).to(torch.int64)
            if bits == torch.int16:
                raw = raw & 0xFFFF
            digit = raw - first
            if bool(((digit < 0) | (digit >= 1 << width)).any()):
                return None  # not a probe's pattern: computed
            source[name] += digit << (width * r)
    found = {}
    for name, p in params.items():
        n = p.numel()
        src = source[name]
        if bool((src >= n).any()):
            return None
        where = torch.full((n,), -1, dtype=torch.int64)
        where[src] = torch.arange(n, dtype=torch.int64)  # load-time offset -> runtime offset
        if bool((where < 0).any()):  # some input went nowhere: two outputs came from one input
            return None
        found[name] = _compress(where, tuple(p.shape))
    return found


def _compress(where: torch.Tensor, shape: tuple[int, ...]) -> Permutation:
    """One period's table when each slice of the leading dim moves alike, within itself."""
    if len(shape) > 1 and shape[0] > 1:
        period = where.numel() // shape[0]
        rows = where.view(shape[0], period) - torch.arange(shape[0], dtype=torch.int64).unsqueeze(1) * period
        if bool((rows == rows[0]).all()):
            return Permutation(rows[0].clone(), period)
    return Permutation(where, where.numel())
