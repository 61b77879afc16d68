"""weightsync, rollout side: validate and apply patches or buckets, all or nothing.

``Receiver`` is the daemon; ``PatchReceiver`` / ``BucketReceiver`` are the
transport-free strategies it runs, usable over any transport. Names load on first use,
so ``python -m receiver ctl`` (the control client) starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ApplyStats": ".stats",
    "BucketReceiver": ".bucket",
    "PatchReceiver": ".patch",
    "PendingVersion": ".pending",
    "ReadWriteLock": ".rwlock",
    "Receiver": ".service",
    "ReceiverBase": ".base",
    "StrategyHooks": ".hooks",
    "make_receiver": ".factory",
}

if TYPE_CHECKING:
    from .base import ReceiverBase
    from .bucket import BucketReceiver
    from .factory import make_receiver
    from .hooks import StrategyHooks
    from .patch import PatchReceiver
    from .pending import PendingVersion
    from .rwlock import ReadWriteLock
    from .service import Receiver
    from .stats import ApplyStats

__all__ = [
    "ApplyStats",
    "BucketReceiver",
    "PatchReceiver",
    "PendingVersion",
    "ReadWriteLock",
    "Receiver",
    "ReceiverBase",
    "StrategyHooks",
    "make_receiver",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'receiver' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
