"""Reading back a sample of what a commit wrote, before the version is published.

An engine holds checkpoint tensors fused, sliced and padded (``receiver.vllm.layout``): a
whole tensor lands there by copying boxes between strided views, a sparse change by flat
index arithmetic. A mistake in either writes the right bytes to the wrong place and the
engine serves weights no checkpoint holds, silently. Reading a few written elements back
(``Placed.peek``: each index located in plain integers and mapped back through the
recorded forward map, independent of the view copies and of the vectorised ``locate``)
and comparing their bits with the staged values turns such a mistake into an error at the
commit. For a sparse change it also proves the write landed and nothing written after it
covered it.

The cost is a handful of integer operations and one or two small reads per tensor,
whatever its size: it runs inside the commit, which holds the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from protocol.errors import WriteCheckError
from protocol.state import Placed
from protocol.wire.dtypes import bits_at

from .commit import StagedUpdate, Target


def check_written(name: str, target: Target, update: StagedUpdate, samples: int, rng: random.Random) -> int:
    """Compare up to ``samples`` elements ``update`` wrote into ``target`` with its staged
    values; returns how many were compared (those this worker holds). ``WriteCheckError``
    names the first that differs."""
    if samples <= 0:
        return 0
    if update.flat is None:
        picks = _sample(target.numel(), samples, rng)
        flat, want = picks, _bits_at(update.values.reshape(-1), picks, target.dtype)
    else:
        picks = _sample(update.flat.numel(), samples, rng)
        flat = bits_at(update.flat, picks)
        want = _bits_at(update.values, picks, target.dtype)
    got = target.peek(flat) if isinstance(target, Placed) else _bits_at(target.reshape(-1), flat, target.dtype)
    compared = 0
    for f, g, w in zip(flat, got, want):
        if g is None:
            continue  # another worker holds it
        if g != w:
            raise WriteCheckError(
                f"tensor {name!r}: element {f} reads {g!r} (bits) after the commit, staged {w!r}: "
                "the engine's runtime map writes this tensor somewhere else"
            )
        compared += 1
    return compared


def _sample(n: int, k: int, rng: random.Random) -> list[int]:
    """Up to ``k`` distinct indices below ``n``, ascending: all of them when ``n <= k``."""
    return list(range(n)) if n <= k else sorted(rng.sample(range(n), k))


def _bits_at(values: torch.Tensor, at: Sequence[int], dtype: torch.dtype) -> list[int]:
    return bits_at(values if values.dtype == dtype else values.to(dtype), at)
