"""Host snapshots lent as whole new values (sender/diff/copies.py): written in place once no one
holds the loan, copied first while anything still does (a frame, a view, a message)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from channel import Channel
from test_strategies import handshake, make_pair, patch_cfg

from protocol.wire.framing import Encoding
from sender.diff import copies as copies_module
from sender.diff.copies import LentSnapshots

# Lending needs torch's storage use count (a private call); without it each loan is a clone.
counts = pytest.mark.skipif(copies_module._use_count is None, reason="this torch has no storage use count: loans are clones")


@counts
def test_a_loan_no_one_holds_costs_no_copy() -> None:
    lent = LentSnapshots()
    snap = torch.arange(1000, dtype=torch.float32)
    loan = lent.lend("w", snap)
    assert loan.data_ptr() == snap.data_ptr()
    del loan
    assert lent.writable("w", snap) is snap
    assert lent.spare_nbytes() == 0


@counts
def test_two_buffers_alternate_while_the_newest_loan_is_still_held() -> None:
    """The steady state of a tensor that goes whole every version: the newest patch is in
    the sender's ring while the next version is compared."""
    lent = LentSnapshots()
    snap = torch.arange(1000, dtype=torch.float32)
    loan = lent.lend("w", snap)
    ptrs = set()
    for _ in range(6):
        snap = lent.writable("w", snap)
        assert snap.data_ptr() != loan.data_ptr() and torch.equal(snap, loan)
        snap.add_(1)  # the compare writes the next version
        assert torch.equal(loan, snap - 1)
        loan = lent.lend("w", snap)  # the one before is let go by this assignment
        ptrs.add(snap.data_ptr())
    assert len(ptrs) == 2 and lent.spare_nbytes() == 4000


def test_a_held_loan_is_never_written() -> None:
    src = torch.arange(1000, dtype=torch.float32)
    for hold in (lambda t: t.view(10, 100), lambda t: t.numpy(), lambda t: t.view(torch.uint8).numpy().data, lambda t: t):
        lent = LentSnapshots()
        snap = src.clone()
        held = hold(lent.lend("w", snap))
        snap = lent.writable("w", snap)
        snap.mul_(2)
        assert np.asarray(held).tobytes() == src.numpy().tobytes()
        assert torch.equal(snap, src * 2)
        del held


@counts
def test_a_spare_is_reused_only_once_let_go_and_drop_forgets() -> None:
    lent = LentSnapshots()
    first = torch.zeros(8)
    loan = lent.lend("w", first)
    second = lent.writable("w", first)  # first is a spare, still held by ``loan``
    held_again = lent.lend("w", second)
    third = lent.writable("w", second)
    assert third.data_ptr() not in (first.data_ptr(), second.data_ptr())  # both still held
    del loan
    loan = lent.lend("w", third)
    fourth = lent.writable("w", third)
    assert fourth.data_ptr() == first.data_ptr()  # let go: reused
    assert lent.spare_nbytes() == 2 * 32
    lent.drop("w")
    assert lent.spare_nbytes() == 0
    del held_again, loan


def test_without_a_use_count_a_loan_is_a_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies_module, "_use_count", None)
    lent = LentSnapshots()
    snap = torch.arange(10.0)
    loan = lent.lend("w", snap)
    assert loan.data_ptr() != snap.data_ptr() and torch.equal(loan, snap)
    assert lent.writable("w", snap) is snap


async def one_tensor_builder() -> tuple[dict[str, torch.Tensor], Any]:
    """A patch sender's builder of one fp32 tensor, handshaken with an fp32 receiver (so
    every element changes each version: it goes whole)."""
    state = {"w": torch.zeros(1 << 16, dtype=torch.float32)}
    s, r = make_pair(patch_cfg(group_numel=0))
    await handshake(s, r, state, {"w": torch.zeros(1 << 16)}, Channel())
    return state, s.builder


def test_a_dense_version_still_being_sent_keeps_its_bytes_while_the_next_is_built() -> None:
    """A message's dense frames are views of the lent snapshot (zero-copy): the next
    version's build must not write into them until the message is gone."""

    async def main() -> None:
        state, builder = await one_tensor_builder()
        versions = []
        for v in (1, 2, 3):
            state["w"].add_(1.0)
            msg, _ = await builder.message(dict(state), v, v - 1)
            (entry,) = msg.tensors
            assert entry.encoding is Encoding.DENSE
            versions.append((msg, state["w"].clone()))
        for msg, want in versions:  # each message still carries its own version's values
            frame = msg.frames[msg.tensors[0].buffers[0].frame - 1]
            assert torch.equal(torch.frombuffer(bytearray(frame), dtype=torch.float32), want)
        assert torch.equal(builder.snapshot.tensors["w"], state["w"])
        del versions, msg, entry, frame
        if copies_module._use_count is not None:
            assert builder.compare._lent.spare_nbytes() == 2 * (1 << 16) * 4  # the key's last two replaced snapshots kept

    asyncio.run(main())


async def let_go(t: torch.Tensor) -> None:
    """Until nothing but ``t`` holds its storage: the encode's finished futures let go of
    its message a moment after ``build`` returns (the loop's last wake-up, the pool's work item)."""
    for _ in range(1000):
        if copies_module._unshared(t):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("something still holds the snapshot a second after its message is gone")


@counts
def test_a_dense_version_no_one_holds_is_sent_from_the_snapshot_itself() -> None:
    """The memory a dense version saves: once its message is gone, the next one is the
    snapshot, compared in place and lent, with no copy beside it."""

    async def main() -> None:
        state, builder = await one_tensor_builder()
        ptr = builder.snapshot.tensors["w"].data_ptr()
        for v in (1, 2, 3):
            state["w"].add_(1.0)
            msg, _ = await builder.message(dict(state), v, v - 1)
            frame = msg.frames[msg.tensors[0].buffers[0].frame - 1]
            assert msg.tensors[0].encoding is Encoding.DENSE
            assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == ptr  # zero-copy, from the snapshot
            assert torch.equal(torch.frombuffer(bytearray(frame), dtype=torch.float32), state["w"])
            del msg, frame
            await let_go(builder.snapshot.tensors["w"])
        assert builder.snapshot.tensors["w"].data_ptr() == ptr and builder.compare._lent.spare_nbytes() == 0

    asyncio.run(main())


def test_a_recapture_does_not_write_into_a_held_dense_version() -> None:
    async def main() -> None:
        state, builder = await one_tensor_builder()
        state["w"].add_(1.0)
        msg, _ = await builder.message(dict(state), 1, 0)
        want = state["w"].clone()
        state["w"].add_(5.0)
        await builder.recapture(dict(state))
        frame = msg.frames[msg.tensors[0].buffers[0].frame - 1]
        assert torch.equal(torch.frombuffer(bytearray(frame), dtype=torch.float32), want)
        assert torch.equal(builder.snapshot.tensors["w"], state["w"])

    asyncio.run(main())
