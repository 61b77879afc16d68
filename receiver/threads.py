"""The receiver's work on worker threads, which ends before the task that started it.

A thread cannot be stopped. So a task cancelled while its thread runs (``Receiver.close``
cancels the session loop mid-version) waits for the thread before the cancellation goes
on: nothing the receiver started writes into the model, decodes into its staging buffers
or reads the model for a digest once ``close`` has returned. The threads themselves are
the event loop's default executor's (``asyncio.to_thread``), idle between calls and shut
down with the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


async def in_thread(fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` on a worker thread; cancelled meanwhile, returns (raising
    ``CancelledError``) only once the thread is done with it."""
    thread = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while not thread.done():
        try:
            await asyncio.wait((thread,))
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return thread.result()
