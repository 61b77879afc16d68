"""Command-line plumbing shared by ``python -m sender`` and ``python -m receiver``:
logging, the event loop (uvloop when installed), signals, and ``module:callable`` specs."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from protocol.errors import ConfigError, WeightSyncError
from protocol.host import logs


def setup_logging(level: str, fmt: str = "text") -> None:
    """The daemons' logging: ``level``, and ``fmt`` text or json (``protocol.host.logs``)."""
    logs.setup_logging(level, fmt)


def load_object(spec: str) -> Any:
    """``package.module:attribute`` -> the attribute (a model factory, say)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise SystemExit(f"expected module:callable, got {spec!r}")
    sys.path.insert(0, ".")  # let a daemon started in a project import its modules
    return getattr(importlib.import_module(module), attr)


def report(event: str, **fields: Any) -> None:
    """One JSON line on stdout: machine-readable progress for scripts and tests."""
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def run(main: Callable[[asyncio.Event], Awaitable[None]], *, prog: str = "weightsync", verbose: bool = False) -> None:
    """Run ``main(stop)`` on uvloop when available; SIGINT/SIGTERM set ``stop``. A
    ``WeightSyncError`` that ends it is one log line (``prog: Type: message``, JSON under
    ``--log-format json``) and the exit code: 2 for a ``ConfigError`` (a setting to fix),
    1 for any other; ``verbose`` raises it instead, with its traceback."""
    try:
        _run(main)
    except WeightSyncError as e:
        if verbose:
            raise
        logging.getLogger(prog).error("%s: %s: %s", prog, type(e).__name__, e, extra={"error_type": type(e).__name__})
        sys.exit(2 if isinstance(e, ConfigError) else 1)


def _run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop
    except ImportError:
        asyncio.run(wrapper())
    else:
        uvloop.run(wrapper())
