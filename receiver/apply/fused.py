"""One kernel for a batch's sparse updates across many tensors, through a table of their addresses.

With torch ops, reading a tensor's old values at its changed positions and writing its new
values there cost a kernel launch each a tensor (an index and an ``index_put_``): on a GPU,
5-10 us of host time each, so a 480-tensor model pays ten times a 48-tensor one for the same
bytes. Here a Triton kernel takes every change of a batch at once, each with the index of
its tensor in a table of the tensors' addresses (int64, cast to a pointer in the kernel):
``gather_add`` reads old bits and adds the decoded differences (wrapping at the dtype's
width, a bool kept 0 or 1), ``scatter`` writes values; one launch a dtype width.

Raw addresses: only for contiguous plain tensors on one device, positions already checked
within their tensors (the verdicts, ``receiver/apply/stage_device.py``). Used for CUDA tensors when
Triton imports; elsewhere the torch ops run (``usable``). On CPU tensors Triton's interpreter
runs the same kernels (``interpret(True)``: the tests, and ``benchmarks.device_ops``, which
counts each launch as one op through ``LAUNCHES``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from protocol.state import Placed

BLOCK = 1024  # changes a program
LAUNCHES: Counter[str] = Counter()  # kernels launched, by name (what ``benchmarks.opcount`` adds to its tally)
_lock = threading.Lock()
_interpret = False  # run on CPU tensors, in Triton's interpreter
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def interpret(on: bool) -> None:
    """Take the fused path for CPU tensors too, in Triton's interpreter (tests, op counts)."""
    global _interpret
    _interpret = on


@cache
def _kernels(interpreted: bool) -> Any:
    """The two kernels (compiled for CUDA, or interpreted), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    def gather_add(table: Any, owner: Any, flat: Any, diffs: Any, out: Any, n: Any, BOOL: tl.constexpr, BLOCK: tl.constexpr) -> None:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        address = tl.load(table + tl.load(owner + i, mask=live, other=0), mask=live, other=0)
        at = address.to(tl.pointer_type(out.dtype.element_ty), bitcast=True) + tl.load(flat + i, mask=live, other=0)
        new = tl.load(at, mask=live, other=0).to(tl.int64) + tl.load(diffs + i, mask=live, other=0)
        if BOOL:
            new = new & 1
        tl.store(out + i, new.to(out.dtype.element_ty), mask=live)

    def scatter(table: Any, owner: Any, flat: Any, values: Any, n: Any, BLOCK: tl.constexpr) -> None:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        address = tl.load(table + tl.load(owner + i, mask=live, other=0), mask=live, other=0)
        at = address.to(tl.pointer_type(values.dtype.element_ty), bitcast=True) + tl.load(flat + i, mask=live, other=0)
        tl.store(at, tl.load(values + i, mask=live, other=0), mask=live)

    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(gather_add), InterpretedFunction(scatter)
    return triton.jit(gather_add), triton.jit(scatter)


def usable(targets: Sequence[object], device: torch.device) -> bool:
    """Whether the fused kernels can update ``targets`` (all on ``device``): contiguous plain
    tensors of one element size, Triton importable, on CUDA (or on CPU when interpreting)."""
    if not targets or (device.type != "cuda" and not (device.type == "cpu" and _interpret)):
        return False
    first = targets[0]
    if not isinstance(first, torch.Tensor):
        return False
    size = first.element_size()
    for t in targets:
        if isinstance(t, Placed) or not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device != device or t.element_size() != size:
            return False
    return size in _INTS and _kernels(device.type == "cpu") is not None


def table(targets: Sequence[torch.Tensor]) -> list[int]:
    """The targets' addresses, for the kernels' table (shipped to the device by the caller)."""
    return [t.data_ptr() for t in targets]


def _launch(name: str, kernel: Any, n: int, *args: Any, **meta: Any) -> None:
    with _lock:
        LAUNCHES[name] += 1
    grid = (-(-n // BLOCK),)
    if args[0].device.type != "cpu":
        kernel[grid](*args, n, BLOCK=BLOCK, **meta)
        return
    # The interpreter copies its arguments with torch ops of its own: not the kernel's work (a
    # GPU launches the kernel alone), so a dispatch mode counting ops (``benchmarks.opcount``) skips them.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        kernel[grid](*args, n, BLOCK=BLOCK, **meta)


def gather_add(addresses: torch.Tensor, owner: torch.Tensor, flat: torch.Tensor, diffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New values (``dtype``) of changes at ``flat`` of the tensors ``owner`` indexes in
    ``addresses``: old bits + ``diffs`` (int64), wrapped to the width. One launch."""
    out = torch.empty(flat.numel(), dtype=_INTS[dtype.itemsize], device=flat.device)
    if flat.numel():
        kernels = _kernels(flat.device.type == "cpu")
        _launch("gather_add", kernels[0], flat.numel(), addresses, owner, flat, diffs, out, BOOL=dtype == torch.bool)
    return out.view(dtype)


def scatter(addresses: torch.Tensor, owner: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` at ``flat`` of the tensors ``owner`` indexes in ``addresses``. One launch."""
    if flat.numel():
        kernels = _kernels(flat.device.type == "cpu")
        _launch("scatter", kernels[1], flat.numel(), addresses, owner, flat, values.view(_INTS[values.element_size()]))


@dataclass(frozen=True)
class FusedWrite:
    """A batch's staged updates, written by the commit in one ``scatter``: the tensors
    (``keys``, one a piece, in order) at the ``addresses`` they had when staged, and every
    change's piece (``owner``), position and new bits."""

    keys: tuple[int, ...]
    addresses: tuple[int, ...]
    table: torch.Tensor
    owner: torch.Tensor
    flat: torch.Tensor
    bits: torch.Tensor

    def write(self, targets: Sequence[object]) -> bool:
        """Write every piece, if each tensor still lies where it was staged (else write
        nothing and return False: the caller writes the updates one by one)."""
        for key, address in zip(self.keys, self.addresses):
            target = targets[key]
            if not isinstance(target, torch.Tensor) or target.data_ptr() != address or not target.is_contiguous():
                return False
        scatter(self.table, self.owner, self.flat, self.bits)
        return True
