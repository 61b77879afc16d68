"""weightsync, rollout side: validate and apply patches or buckets, all or nothing.

``Receiver`` is the daemon; ``PatchReceiver`` / ``BucketReceiver`` are the
transport-free strategies it runs, usable over any transport; ``attach`` runs a receiver
beside a model a process already holds. Names load on first use,
so ``python -m receiver ctl`` (the control client) starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ApplyStats": ".stats",
    "BucketReceiver": ".strategy.bucket",
    "PatchReceiver": ".strategy.patch",
    "PendingVersion": ".strategy.pending",
    "ReadWriteLock": ".rwlock",
    "Receiver": ".control.service",
    "ReceiverBase": ".strategy.base",
    "Span": ".spans",
    "Steps": ".spans",
    "StrategyHooks": ".strategy.hooks",
    "attach": ".control.attach",
    "make_receiver": ".strategy.factory",
}

if TYPE_CHECKING:
    from .control.attach import attach
    from .control.service import Receiver
    from .rwlock import ReadWriteLock
    from .spans import Span, Steps
    from .stats import ApplyStats
    from .strategy.base import ReceiverBase
    from .strategy.bucket import BucketReceiver
    from .strategy.factory import make_receiver
    from .strategy.hooks import StrategyHooks
    from .strategy.patch import PatchReceiver
    from .strategy.pending import PendingVersion

__all__ = [
    "ApplyStats",
    "BucketReceiver",
    "PatchReceiver",
    "PendingVersion",
    "ReadWriteLock",
    "Receiver",
    "ReceiverBase",
    "Span",
    "Steps",
    "StrategyHooks",
    "attach",
    "make_receiver",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'receiver' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
