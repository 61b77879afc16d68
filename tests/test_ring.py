"""The sender's ring of recent patches (protocol/net/ring.py): at most ``ring_size`` of
them, and newest first only as many as add up to ``ring_bytes`` (a Sender's default: a
whole copy of its state), so a receiver behind by more than a whole copy's worth of
patches is resynced, and a model whose patches go dense is not held eight times over."""

from __future__ import annotations

import pytest
from test_relay import tree

from protocol.errors import ConfigError
from protocol.net.server import VersionServer


def kept(server: VersionServer) -> list[int]:
    return [entry.version for entry in server._ring]


def test_the_ring_keeps_the_newest_patches_that_fit_in_its_bytes() -> None:
    server = VersionServer("tcp://127.0.0.1:0", ring_size=4, ring_bytes=100)
    for version, size in enumerate([30, 30, 30, 30, 50], start=1):
        server.publish_patch(version - 1, version, [b"h", b"x" * (size - 1)])
        if version == 3:
            assert kept(server) == [1, 2, 3]  # 90 bytes
    assert kept(server) == [4, 5]  # 30 + 50; with v3, 110 > 100
    server.publish_patch(5, 6, [b"x" * 500])  # larger than the cap alone: it still stays, alone
    assert kept(server) == [6]


def test_parts_of_the_newest_patch_count_as_they_arrive() -> None:
    server = VersionServer("tcp://127.0.0.1:0", ring_size=8, ring_bytes=100)
    server.publish_patch(0, 1, [b"x" * 40])
    server.publish_patch(1, 2, [b"x" * 40], last=False)
    assert kept(server) == [1, 2]
    server.publish_patch(1, 2, [b"x" * 40], last=True)  # v2 is now 80 bytes: v1 no longer fits
    assert kept(server) == [2] and server._ring.newest.complete


def test_without_a_byte_cap_only_the_count_applies() -> None:
    server = VersionServer("tcp://127.0.0.1:0", ring_size=3)
    for version in range(1, 6):
        server.publish_patch(version - 1, version, [b"x" * 10**6])
    assert kept(server) == [3, 4, 5]


@pytest.mark.parametrize("ring_bytes", [-1, 1.5, "1"])
def test_a_bad_byte_cap_is_a_config_error(ring_bytes: object) -> None:
    with pytest.raises(ConfigError, match="ring_bytes"):
        VersionServer("tcp://127.0.0.1:0", ring_bytes=ring_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("ring_bytes,caught_up", [(None, True), (1, False)])
async def test_a_receiver_held_back_is_caught_up_from_the_ring_or_resynced_past_its_bytes(ring_bytes: int | None, caught_up: bool) -> None:
    """Held back three versions (one in flight to it, two waiting for its credit): with the
    default cap (a whole copy of the state; these patches are a few percent of it) the
    ring's patches catch it up one by one; with a cap of one byte only the newest patch
    is kept, and it is resynced with a bootstrap."""
    async with tree("patch") as t:
        sender = await t.start_sender(ring_bytes=ring_bytes, max_inflight=1)
        assert sender.server.ring_bytes == (ring_bytes or sum(v.numel() * v.element_size() for v in t.trainer.model.state_dict().values()))
        fast = await t.start_receiver(sender.endpoint, "fast")
        held = await t.start_receiver(sender.endpoint, "held")
        await t.step(fast, held)
        async with held.reading():  # nothing is committed on `held` meanwhile
            for _ in range(3):
                await t.step(fast)
            assert held.version == 1
        await held.wait_for_version(4, timeout=30)
        await t.step(fast, held)  # and it follows again
        kinds = [held.stats[v].kind for v in sorted(held.stats) if v > 1]
        if caught_up:
            assert kinds == ["patch"] * 4 and sender.receivers["held"]["resyncs"] == 0
        else:
            assert sender.receivers["held"]["resyncs"] == 1 and "bootstrap" in kinds
