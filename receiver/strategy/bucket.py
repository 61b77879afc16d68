"""The bucket strategy, rollout side."""

from __future__ import annotations

from protocol.wire.framing import MessageType

from .base import ReceiverBase


class BucketReceiver(ReceiverBase):
    """Applies BUCKET versions: whole tensors, converted to the model's dtypes.

    ``load_instant`` True writes each bucket (and each bootstrap bucket) into the model as
    it arrives, under the write side held for the whole version: one bucket is staged at
    a time instead of the whole model, and a version that fails midway leaves the model
    torn, readers kept out, until a resync is written (``ReceiverBase``). False keeps the
    raw frames until the last bucket and writes the checked version at once: all or
    nothing, a staged copy of the model the price.
    """

    strategy = "bucket"
    data_type = MessageType.BUCKET

    @property
    def decode_on_arrival(self) -> bool:
        return self.config.bucket.load_instant

    @property
    def writes_on_arrival(self) -> bool:
        return self.config.bucket.load_instant
