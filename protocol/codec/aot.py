"""Ahead-of-time compile from one table of signatures.

numba compiles a kernel again for every new combination of argument types, array layouts
and read-only flags it is called with, seconds each, in whatever call meets it first (a
rollout's first apply). Each kernel module therefore lists, beside its kernels, the
argument types its own Python callers hand them for a set of dtypes (its ``signatures``
functions), and the compile steps (``sender/diff/warmup.py``, ``receiver/apply/warmup.py``) compile
exactly those: from numba's on-disk cache where it holds them, so a warm start costs
milliseconds. ``tests/test_compile.py`` runs every encoding after a compile step and fails
on any signature the table missed.

Here: the table's row type and its compile, and the (model, receiver) dtype pairs both
CLIs take (``--pairs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from protocol.errors import ConfigError
from protocol.wire.dtypes import parse_float_dtype

Pair = tuple[torch.dtype, torch.dtype]  # (model, receiver) dtypes

# (model, receiver) dtypes both compile steps cover by default: fp32 or bf16 training, bf16
# or fp32 rollouts, and int64 buffers (step counters, position ids). Between them every bit
# width a 2, 4 or 8-byte dtype compiles to (fp16 and bf16 alike, fp64 and int64 alike).
COMMON_PAIRS: tuple[Pair, ...] = (
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.int64, torch.int64),
)


class Signature(NamedTuple):
    """One row of the table: a kernel (a numba dispatcher) and the argument types it is called with."""

    kernel: Any
    args: tuple[Any, ...]


def array(dtype: Any, *, readonly: bool = False) -> Any:
    """numba's type of a 1-D C-contiguous numpy array of ``dtype`` (a numpy dtype or scalar
    type: what ``numba.typeof`` gives such an array, ``readonly`` where it is not writable)."""
    from numba import from_dtype, types

    return types.Array(from_dtype(np.dtype(dtype)), 1, "C", readonly=readonly)


def scalar(kind: type) -> Any:
    """numba's type of a Python ``int`` or ``bool`` argument."""
    from numba import types

    return {int: types.int64, bool: types.boolean}[kind]


def compile_all(table: Iterable[Signature]) -> int:
    """Compile (or load from numba's cache) every row of ``table``; how many rows there were."""
    rows = 0
    for kernel, args in dict.fromkeys(table):
        kernel.compile(args)
        rows += 1
    return rows


def receiver_dtypes(pairs: Iterable[Pair]) -> list[torch.dtype]:
    """The rollout side's dtypes of ``pairs``: what a receiver's targets hold."""
    return list(dict.fromkeys(receiver for _, receiver in pairs))


COMMON_DTYPES = tuple(receiver_dtypes(COMMON_PAIRS))  # the rollout side's of ``COMMON_PAIRS``


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_pairs(pairs: Iterable[Pair]) -> str:
    """``pairs`` as ``--pairs`` takes them: ``float32:bfloat16,...``."""
    return ",".join(f"{dtype_name(a)}:{dtype_name(b)}" for a, b in pairs)


def parse_dtype(name: str) -> torch.dtype:
    """A float dtype as configs name it (``bf16``, ``float32``), or any torch dtype by name (``int64``)."""
    found = getattr(torch, name.strip().removeprefix("torch."), None)
    if isinstance(found, torch.dtype):
        return found
    dtype = parse_float_dtype(name.strip())  # the aliases, or a ConfigError that lists them
    assert dtype is not None
    return dtype


def parse_pairs(text: str) -> list[Pair]:
    """``MODEL:RECEIVER,...`` (``--pairs``) as dtype pairs; ``ConfigError`` for a malformed one."""
    pairs = []
    for pair in text.split(","):
        parts = pair.split(":")
        if len(parts) != 2:
            raise ConfigError(f"{pair!r} is not MODEL:RECEIVER (not enough values)" if len(parts) < 2 else f"{pair!r}: too many values")
        pairs.append((parse_dtype(parts[0]), parse_dtype(parts[1])))
    return pairs


def pairs_option(add_argument: Callable[..., Any]) -> None:
    """Add both CLIs' ``--pairs`` option (``parser.add_argument``), its default ``COMMON_PAIRS``."""
    common = format_pairs(COMMON_PAIRS)
    add_argument("--pairs", default=common, help=f"MODEL:RECEIVER dtypes, comma-separated (default: {common})")


def compile_args(prog: str, description: str | None, argv: list[str]) -> tuple[list[Pair], str]:
    """Both compile CLIs' arguments: the ``--pairs`` given (parsed, and as written); a
    malformed one exits with argparse's usage error (status 2)."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=description)
    pairs_option(p.add_argument)
    args = p.parse_args(argv)
    try:
        return parse_pairs(args.pairs), args.pairs
    except ConfigError as e:
        p.error(f"--pairs {args.pairs!r}: {e}")
