"""The builder a config's strategy names: the one place that knows the concrete builders,
so the daemon (``sender/serve/service.py``, ``sender/serve/source.py``) knows only ``VersionBuilder``."""

from __future__ import annotations

from protocol.config import SyncConfig

from ..plan import SyncPlan
from .bucket import BucketBuilder
from .builder import VersionBuilder
from .patch import PatchBuilder


def make_builder(plan: SyncPlan, config: SyncConfig) -> VersionBuilder:
    """``config.type``'s builder of ``plan``'s versions: patches or buckets."""
    if config.type == "patch":
        return PatchBuilder(plan, config.patch)
    return BucketBuilder(plan, config.bucket)
