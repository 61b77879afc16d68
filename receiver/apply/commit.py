"""Writing a fully validated update into the model: the only code that touches it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.codec.tensorcodec import DecodedTensor
from protocol.errors import ProtocolError
from protocol.lazy import lazy_module
from protocol.state import Placed
from protocol.wire.framing import ValueEncoding

if TYPE_CHECKING:
    from . import kernels
    from .fused import FusedWrite
else:  # numba loads on first use (protocol/lazy.py)
    kernels = lazy_module("receiver.apply.kernels")


Target = torch.Tensor | Placed  # a model tensor, or one an engine holds scattered (protocol.state.Placed)


@dataclass
class StagedUpdate:
    """One tensor's update, decoded, validated and already on the target's device."""

    ordinal: int
    flat: torch.Tensor | None  # None: replace the whole tensor
    values: torch.Tensor  # final values at the target's dtype (sparse) or the whole tensor (dense)
    batch: FusedWrite | None = None  # written with the rest of its batch in one kernel, when the commit has them all

    @classmethod
    def stage(cls, decoded: DecodedTensor, target: Target) -> StagedUpdate:
        """Resolve XOR and ulp values against ``target`` and move everything to its device.
        A device-coded update (its verdict already read: ``stage_device.stage_coded``) is
        resolved on the target's device, with no host sync; so is a dense one already there
        (moved with its message: ``receiver/apply/transfer.py``), cast there to the target's dtype."""
        if decoded.verdict is not None and decoded.flat is not None:
            return cls._stage_on_device(decoded, decoded.flat, target)
        raw = decoded.encoding is ValueEncoding.RAW  # final values: sent raw, or decoded onto the target
        if decoded.flat is None:
            update = cls(decoded.key, None, decoded.values.to(target.device, target.dtype))
        elif isinstance(target, Placed):  # it reads and writes by flat index itself
            values = decoded.values if raw else decoded.new_values(target.read(decoded.flat).cpu())
            update = cls(decoded.key, decoded.flat, values.to(target.device))
        else:
            flat = decoded.flat.to(target.device)
            if raw:
                update = cls(decoded.key, flat, decoded.values.to(target.device))
            elif decoded.encoding is ValueEncoding.ULP and kernels.supported(target):
                update = cls(decoded.key, flat, kernels.gather_add(target, flat, decoded.values.cpu()))
            else:
                update = cls(decoded.key, flat, decoded.new_values(read_flat(target, flat)).to(target.device))
        if decoded.checked:  # dense values (a dense span's too) moved with their message, their bytes checked on the host first
            return update
        if target.dtype == torch.bool and update.values.numel() and int(update.values.view(torch.uint8).max()) > 1:
            raise ProtocolError(f"tensor {decoded.key}: bool values other than 0 and 1")  # XOR/ulp bits, or raw bytes
        return update

    @classmethod
    def _stage_on_device(cls, decoded: DecodedTensor, flat: torch.Tensor, target: Target) -> StagedUpdate:
        """New values = old + differences where the target is (a bool stays 0 or 1: no check needed)."""
        if isinstance(target, Placed):  # it reads and writes by flat index itself
            return cls(decoded.key, flat, decoded.new_values(target.read(flat)).to(target.device, non_blocking=True))
        flat = flat.to(target.device, non_blocking=True)
        return cls(decoded.key, flat, decoded.new_values(read_flat(target, flat)))


def read_flat(target: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    if target.is_contiguous():
        return target.view(-1)[flat]
    return target[torch.unravel_index(flat, target.shape)]


@torch.no_grad()
def write(target: Target, update: StagedUpdate) -> None:
    if isinstance(target, Placed):
        if update.flat is None:
            target.assign(update.values)
        else:
            target.write(update.flat, update.values)
    elif update.flat is None:
        target.copy_(update.values)
    elif kernels.supported(target) and update.values.dtype == target.dtype:
        kernels.scatter(target, update.flat, update.values)
    elif target.is_contiguous():
        target.view(-1)[update.flat] = update.values
    else:
        target[torch.unravel_index(update.flat, target.shape)] = update.values


def commit(targets: Sequence[Target], updates: Sequence[StagedUpdate], aliases: dict[int, list[int]]) -> None:
    """Write every update, and the same into untied aliases of its tensor. Updates staged
    as one batch (``receiver/apply/stage_device.py``) are written in one kernel, where the first
    of them comes, when all of them are here and their tensors have not moved since; the
    rest one by one."""
    whole = _whole_batches(updates)
    done: set[int] = set()  # batches written
    for update in updates:
        target = targets[update.ordinal]
        batch = update.batch
        if batch is None or id(batch) not in whole:
            write(target, update)
        elif id(batch) not in done:
            done.add(id(batch))
            if not batch.write(targets):  # a tensor moved since: one by one
                for member in whole[id(batch)]:
                    write(targets[member.ordinal], member)
        for alias in aliases.get(update.ordinal, ()):
            other = targets[alias]
            if not _same_storage(other, target):
                write(other, update)


def _whole_batches(updates: Sequence[StagedUpdate]) -> dict[int, list[StagedUpdate]]:
    """The batches every update of which is in ``updates``, by id."""
    batches: dict[int, list[StagedUpdate]] = {}
    for update in updates:
        if update.batch is not None:
            batches.setdefault(id(update.batch), []).append(update)
    return {k: members for k, members in batches.items() if sorted(u.ordinal for u in members) == sorted(members[0].batch.keys)}  # type: ignore[union-attr]


def _same_storage(a: Target, b: Target) -> bool:
    if isinstance(a, Placed) or isinstance(b, Placed):
        return a is b
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
