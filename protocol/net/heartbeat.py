"""The heartbeat ticker both daemons run: a tick every interval, and whether it came late.

A tick woken well past its time means the event loop was blocked (a long GIL-holding
call, say): the peer's messages are still queued, unread, so silence must not be judged
on that tick. The sender's per-peer check and the receiver's check of its sender both
skip a stalled tick and judge on the next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

STALL_GRACE = 0.5  # seconds a tick may be late (beyond two intervals) before the loop counts as stalled


async def ticks(interval: float) -> AsyncIterator[tuple[float, bool]]:
    """``(now, stalled)`` every ``interval`` seconds (monotonic clock), forever."""
    tick = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        stalled, tick = now - tick > 2 * interval + STALL_GRACE, now
        yield now, stalled
