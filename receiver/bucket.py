"""The bucket strategy, rollout side."""

from __future__ import annotations

from protocol.framing import MessageType

from .base import ReceiverBase


class BucketReceiver(ReceiverBase):
    """Applies BUCKET versions: whole tensors, converted to the model's dtypes.

    ``load_instant`` True decodes and stages each bucket as it arrives; False keeps the
    raw frames until the last bucket. Either way the model is written once, at the end.
    """

    strategy = "bucket"
    data_type = MessageType.BUCKET

    @property
    def decode_on_arrival(self) -> bool:
        return self.config.bucket.load_instant
