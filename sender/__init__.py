"""weightsync, actor side: build patches or buckets of the trainer's weights and send them.

``Sender`` is the daemon; ``PatchSender`` / ``BucketSender`` are the transport-free
strategies, usable over any transport; ``ShardedSync`` drives them from every rank of a
sharded trainer, FSDP2 or Megatron-core (``MegatronLayout``; both loaded on first use:
``torch.distributed``); ``adapter_state`` is a LoRA model's adapters
alone, to track; ``SidecarClient`` hands a trainer's weights to a
``python -m sender`` sidecar (``write_snapshot``: to one watching a folder).
"""

from typing import Any

from protocol.config import load_config

from .adapters import adapter_state
from .base import SenderBase
from .serve.client import SidecarClient, write_snapshot
from .serve.service import Sender
from .stats import SyncStats
from .version.bucket import BucketSender
from .version.patch import PatchSender


def make_sender(config: Any = None) -> PatchSender | BucketSender:
    """The sender strategy a config's ``type`` names (``patch`` or ``bucket``)."""
    cfg = load_config(config)
    return PatchSender(cfg) if cfg.type == "patch" else BucketSender(cfg)


def __getattr__(name: str) -> Any:
    if name == "ShardedSync":  # torch.distributed's import, only for a sharded trainer
        from .sharded.sync import ShardedSync

        return ShardedSync
    if name == "MegatronLayout":
        from .sharded.megatron import MegatronLayout

        return MegatronLayout
    raise AttributeError(f"module 'sender' has no attribute {name!r}")


__all__ = [
    "BucketSender", "MegatronLayout", "PatchSender", "Sender", "SenderBase", "ShardedSync", "SidecarClient", "SyncStats", "adapter_state",
    "make_sender", "write_snapshot",
]
