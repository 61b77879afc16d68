"""weightsync, rollout side: validate and apply patches or buckets, all or nothing."""

from typing import Any

from protocol.config import load_config

from .base import PendingVersion, ReceiverBase
from .bucket import BucketReceiver
from .patch import PatchReceiver
from .stats import ApplyStats


def make_receiver(config: Any = None) -> PatchReceiver | BucketReceiver:
    """The receiver strategy a config's ``type`` names (``patch`` or ``bucket``)."""
    cfg = load_config(config)
    return PatchReceiver(cfg) if cfg.type == "patch" else BucketReceiver(cfg)


__all__ = ["ApplyStats", "BucketReceiver", "PatchReceiver", "PendingVersion", "ReceiverBase", "make_receiver"]
