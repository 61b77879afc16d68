"""The receiver strategy a config names."""

from __future__ import annotations

from typing import Any

from protocol.config import load_config

from .bucket import BucketReceiver
from .hooks import StrategyHooks
from .patch import PatchReceiver


def make_receiver(config: Any = None, hooks: StrategyHooks | None = None) -> PatchReceiver | BucketReceiver:
    """The receiver strategy a config's ``type`` names (``patch`` or ``bucket``), calling ``hooks``."""
    cfg = load_config(config)
    return PatchReceiver(cfg, hooks) if cfg.type == "patch" else BucketReceiver(cfg, hooks)
