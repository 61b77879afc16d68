"""The heartbeat ticker (protocol/net/heartbeat.py) both daemons judge silence by."""

from __future__ import annotations

import time

from protocol.net.heartbeat import STALL_GRACE, ticks


async def test_a_tick_after_the_loop_was_blocked_counts_as_stalled() -> None:
    interval = 0.02
    seen = []
    async for now, stalled in ticks(interval):
        seen.append((now, stalled))
        if len(seen) == 1:
            time.sleep(2 * interval + STALL_GRACE + 0.1)  # the loop blocked: the next tick comes late
        if len(seen) == 2:
            break
    assert seen[1][1] is True
    assert seen[1][0] - seen[0][0] > 2 * interval + STALL_GRACE
