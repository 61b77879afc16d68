"""weightsync, rollout side: validate and apply patches or buckets, all or nothing.

``Receiver`` is the daemon; ``PatchReceiver`` / ``BucketReceiver`` are the
transport-free strategies it runs, usable over any transport.
"""

from .base import PendingVersion, ReceiverBase
from .bucket import BucketReceiver
from .factory import make_receiver
from .patch import PatchReceiver
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
    "make_receiver",
]
