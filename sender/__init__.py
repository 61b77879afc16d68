"""weightsync, actor side: build patches or buckets of the trainer's weights and send them.

``Sender`` is the daemon; ``PatchSender`` / ``BucketSender`` are the transport-free
strategies, usable over any transport.
"""

from typing import Any

from protocol.config import load_config

from .base import SenderBase
from .bucket import BucketSender
from .patch import PatchSender
from .service import Sender
from .stats import SyncStats


def make_sender(config: Any = None) -> PatchSender | BucketSender:
    """The sender strategy a config's ``type`` names (``patch`` or ``bucket``)."""
    cfg = load_config(config)
    return PatchSender(cfg) if cfg.type == "patch" else BucketSender(cfg)


__all__ = ["BucketSender", "PatchSender", "Sender", "SenderBase", "SyncStats", "make_sender"]
