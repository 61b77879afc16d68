"""Reading back a sample of what a commit wrote, before the version is published.

An engine holds checkpoint tensors fused, sliced and padded (``receiver.vllm.layout``): a
whole tensor lands there by copying boxes between strided views, a sparse change by flat
index arithmetic. A mistake in either writes the right bytes to the wrong place and the
engine serves weights no checkpoint holds, silently. Reading a few written elements back
by flat index (``Placed.read_held``, a path independent of the view copies) and comparing
their bits with the staged values turns such a mistake into an error at the commit. For a
sparse change it proves the write landed and nothing written after it covered it; the flat
index arithmetic itself is the map's, checked when the map is derived.

The cost is a few small tensor operations per tensor written, whatever its size.
"""

from __future__ import annotations

import torch

from protocol.errors import WriteCheckError
from protocol.state import Placed

from .commit import StagedUpdate, Target, read_flat

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_written(name: str, target: Target, update: StagedUpdate, samples: int, generator: torch.Generator) -> int:
    """Compare up to ``samples`` elements ``update`` wrote into ``target`` with its staged
    values; returns how many were compared. ``WriteCheckError`` names the first that differs."""
    if samples <= 0:
        return 0
    if update.flat is None:
        flat = _sample(target.numel(), samples, generator)
        want = update.values.reshape(-1)[flat.to(update.values.device)]
    else:
        m = update.flat.numel()
        if m == 0:
            return 0
        pick = _sample(m, samples, generator)
        flat = update.flat.cpu()[pick]
        want = update.values[pick.to(update.values.device)]
    if isinstance(target, Placed):
        held, got = target.read_held(flat)
        held = held.cpu()
    else:
        got = read_flat(target, flat.to(target.device))
        held = torch.ones(flat.numel(), dtype=torch.bool)
    got, want = _bits(got.cpu()[held]), _bits(want.cpu().to(target.dtype)[held])
    bad = (got != want).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        where = int(flat[held][i])
        raise WriteCheckError(
            f"tensor {name!r}: element {where} reads {got[i].item()!r} (bits) after the commit, staged {want[i].item()!r}: "
            "the engine's runtime map writes this tensor somewhere else"
        )
    return int(held.sum())


def _sample(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``k`` distinct indices below ``n``, ascending: all of them when ``n <= k``."""
    if n <= k:
        return torch.arange(n)
    return torch.randint(n, (k,), generator=generator).unique()


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return t
    return t.view(_BITS[t.element_size()])
