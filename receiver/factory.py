"""The receiver strategy a config names."""

from __future__ import annotations

from typing import Any

from protocol.config import load_config

from .bucket import BucketReceiver
from .patch import PatchReceiver


def make_receiver(config: Any = None) -> PatchReceiver | BucketReceiver:
    """The receiver strategy a config's ``type`` names (``patch`` or ``bucket``)."""
    cfg = load_config(config)
    return PatchReceiver(cfg) if cfg.type == "patch" else BucketReceiver(cfg)
