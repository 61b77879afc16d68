"""Reading back a sample of what a commit wrote, before the version is published.

An engine holds checkpoint tensors fused, sliced and padded (``receiver.held.layout``): a
whole tensor lands there by copying boxes between strided views, a sparse change by flat
index arithmetic. A mistake in either writes the right bytes to the wrong place and the
engine serves weights no checkpoint holds, silently. Reading a few written elements back
(``Placed.peek``: each index located in plain integers and mapped back through the
recorded forward map, independent of the view copies and of the vectorised ``locate``)
and comparing their bits with the staged values turns such a mistake into an error at the
commit. For a sparse change it also proves the write landed and nothing written after it
covered it.

The cost is a handful of integer operations per tensor, whatever its size, and two reads of
each device per commit, whatever the number of tensors (``check_all``): it runs inside the
commit, which holds the engine, and a read of a GPU waits for everything queued before it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from protocol.errors import WriteCheckError
from protocol.state import Placed
from protocol.wire.dtypes import bit_view

from .commit import StagedUpdate, Target


def check_written(name: str, target: Target, update: StagedUpdate, samples: int, rng: random.Random) -> int:
    """Compare up to ``samples`` elements ``update`` wrote into ``target`` with its staged
    values; returns how many were compared (those this worker holds). ``WriteCheckError``
    names the first that differs."""
    return check_all([(name, target, update)], samples, rng)


def check_all(checks: Sequence[tuple[str, Target, StagedUpdate]], samples: int, rng: random.Random) -> int:
    """``check_written`` of a commit's tensors together, in two reads of each device
    whatever their number: the sampled indices and staged bits of all of them, then the
    bits read back at those indices (located on the host in plain integers, gathered on
    the device). Returns how many elements were compared; ``WriteCheckError`` names the
    first tensor, in order, with an element that differs."""
    if samples <= 0 or not checks:
        return 0
    # the staged bits of each sampled element, and where a sparse update wrote them
    requests: list[tuple[torch.Tensor, list[int], torch.dtype | None]] = []
    picks: list[list[int] | None] = []  # dense: the sampled indices; sparse: read from the device
    for _, target, update in checks:
        if update.flat is None:
            picked = _sample(target.numel(), samples, rng)
            picks.append(picked)
            requests.append((update.values, picked, target.dtype))
        else:
            picked = _sample(update.flat.numel(), samples, rng)
            picks.append(None)
            requests += [(update.values, picked, target.dtype), (update.flat, picked, None)]
    read = iter(read_all(gather_all(requests)))  # the first read
    wanted, flats = [], []
    for known in picks:
        wanted.append(next(read))
        flats.append(known if known is not None else next(read))
    # the bits now at those elements: located on the host, gathered where they are
    requests = []
    placed: list[list[list[int]]] = []  # each check's positions in its flat, a list per request
    got: list[list[int | None]] = []
    for (_, target, _), flat in zip(checks, flats):
        got.append([None] * len(flat))
        placed.append([])
        if isinstance(target, Placed):
            places = target.places(flat)
            if places is None:  # a Placed that cannot say where: its own (slower) read
                got[-1] = target.peek(flat)
                continue
        else:
            places = [(target, list(range(len(flat))), list(flat))]
        for storage, at, offsets in places:
            requests.append((storage, offsets, target.dtype))
            placed[-1].append(at)
    read = iter(read_all(gather_all(requests)))  # the second read
    for out, positions in zip(got, placed):
        for at in positions:
            for i, bits in zip(at, next(read)):
                out[i] = bits
    compared = 0
    for (name, _, _), flat, read_back, want in zip(checks, flats, got, wanted):
        for f, g, w in zip(flat, read_back, want):
            if g is None:
                continue  # another worker holds it
            if g != w:
                raise WriteCheckError(
                    f"tensor {name!r}: element {f} reads {g!r} (bits) after the commit, staged {w!r}: "
                    "the engine's runtime map writes this tensor somewhere else"
                )
            compared += 1
    return compared


def read_all(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each of ``tensors`` (int64, any device) as a list of ints, with one copy to the host
    a device: the only reads of a device the check makes."""
    out: list[list[int]] = [[] for _ in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for ids in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in ids]).to("cpu", copy=True).tolist()
        at = 0
        for i in ids:
            n = tensors[i].numel()
            out[i] = flat[at : at + n]
            at += n
    return out


def gather_all(requests: Sequence[tuple[torch.Tensor, list[int], torch.dtype | None]]) -> list[torch.Tensor]:
    """``t.reshape(-1)[at]`` of each request (its bits at ``dtype``, as int64; the values
    themselves where ``dtype`` is None), where ``t`` is. The host's indices go to each
    device at once: one tensor made from host data a device, moved from pinned memory
    without waiting for the device (a copy from pageable memory would wait for it)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (t, _, _) in enumerate(requests):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    for device, ids in by_device.items():
        index = torch.tensor([a for i in ids for a in requests[i][1]], dtype=torch.int64)
        if device.type == "cuda":
            index = index.pin_memory().to(device, non_blocking=True)
        at = 0
        for i in ids:
            t, wanted, dtype = requests[i]
            picked = t.reshape(-1)[index[at : at + len(wanted)]]
            at += len(wanted)
            out[i] = picked.to(torch.int64) if dtype is None else _bits64(picked, dtype)
    return out


def _bits64(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bits of ``values`` at ``dtype`` (``bit_view``), as int64."""
    return bit_view(values if values.dtype == dtype else values.to(dtype)).to(torch.int64)


def _sample(n: int, k: int, rng: random.Random) -> list[int]:
    """Up to ``k`` distinct indices below ``n``, ascending: all of them when ``n <= k``."""
    return list(range(n)) if n <= k else sorted(rng.sample(range(n), k))
