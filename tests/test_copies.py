"""Whole copies of tensors that may go dense (sender/copies.py): reused from version to
version, never while anything still holds the last one (a frame, a view, a message)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from channel import Channel
from test_strategies import handshake, make_pair, patch_cfg

from protocol.wire.framing import Encoding
from sender import copies as copies_module
from sender.copies import WholeCopies

# Reuse needs torch's storage use count (a private call); without it every copy is fresh.
reuses = pytest.mark.skipif(copies_module._use_count is None, reason="this torch has no storage use count: copies are never reused")


@reuses
def test_two_copies_alternate_while_the_newest_is_still_held() -> None:
    """The steady state of a tensor that goes whole every version: the newest patch is in
    the sender's ring while the next copy is written."""
    copies = WholeCopies()
    src = torch.arange(1000, dtype=torch.float32)
    newest = copies.copy("w", src)
    ptrs = set()
    for i in range(6):
        newest = copies.copy("w", src + i)  # the one before is released by this assignment
        ptrs.add(newest.data_ptr())
        assert torch.equal(newest, src + i)
    assert len(ptrs) == 2 and copies.nbytes() == 2 * 4000


@reuses
def test_a_copy_is_reused_once_nothing_holds_it() -> None:
    copies = WholeCopies()
    src = torch.arange(1000, dtype=torch.float32)
    first = copies.copy("w", src)
    assert torch.equal(first, src) and first.data_ptr() != src.data_ptr()
    ptr = first.data_ptr()
    del first
    again = copies.copy("w", src + 1)
    assert again.data_ptr() == ptr and torch.equal(again, src + 1)


def test_a_held_copy_is_never_overwritten() -> None:
    copies = WholeCopies()
    src = torch.arange(1000, dtype=torch.float32)
    for hold in (lambda t: t.view(10, 100), lambda t: t.numpy(), lambda t: t.view(torch.uint8).numpy().data, lambda t: t):
        copies.drop("w")
        held = hold(copies.copy("w", src))
        later = copies.copy("w", src * 2)
        assert np.asarray(held).tobytes() == src.numpy().tobytes()
        assert torch.equal(later, src * 2)
        del held, later


def test_another_shape_or_dtype_gets_a_new_copy_and_drop_forgets() -> None:
    copies = WholeCopies()
    copies.copy("w", torch.zeros(8))
    assert copies.copy("w", torch.zeros(4, 2)).shape == (4, 2)
    assert copies.copy("w", torch.zeros(8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert copies.nbytes() == 32 + 16  # the last two kept
    copies.drop("w")
    assert copies.nbytes() == 0


def test_a_dense_version_still_being_sent_keeps_its_bytes_while_the_next_is_built() -> None:
    """A message's dense frames are views of the copy (zero-copy): the next version's
    build must not write into them until the message is gone."""

    async def main() -> None:
        state = {"w": torch.zeros(1 << 16, dtype=torch.float32)}
        s, r = make_pair(patch_cfg(group_numel=0))
        ch = Channel()
        await handshake(s, r, state, {"w": torch.zeros(1 << 16)}, ch)
        builder = s.builder
        versions = []
        for v in (1, 2, 3):
            state["w"].add_(1.0)  # every element moves: dense
            msg, _ = await builder.build(dict(state), v, v - 1)
            (entry,) = msg.tensors
            assert entry.encoding is Encoding.DENSE
            versions.append((msg, state["w"].clone()))
        for msg, want in versions:  # each message still carries its own version's values
            frame = msg.frames[msg.tensors[0].buffers[0].frame - 1]
            assert torch.equal(torch.frombuffer(bytearray(frame), dtype=torch.float32), want)
        del versions, msg, entry, frame
        assert builder._copies.nbytes() == 2 * (1 << 16) * 4  # the key's last two copies kept

    asyncio.run(main())
