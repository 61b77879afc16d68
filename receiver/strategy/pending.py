"""A version on its way into the model: what WELCOME announced of a bootstrap, the version
received and staged (``PendingVersion``), and the resync that replaces an incomplete version."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ProtocolError
from protocol.wire.framing import Message, MessageType

from ..apply.commit import StagedUpdate
from ..stats import ApplyStats


class _Superseded(Exception):
    """A resync's first message arrived while a version was incomplete: it replaces that version."""

    def __init__(self, pending: str, parts: int, by: Message) -> None:
        super().__init__(pending)
        self.pending, self.parts, self.by = pending, parts, by


@dataclass(frozen=True)
class Announced:
    """The bootstrap WELCOME announced: every part is checked against it before any of it
    is written, so a bootstrap that contradicts its WELCOME writes nothing (or, written
    on arrival, is refused at the part that gives it away)."""

    version: int | None
    parts: int

    def check(self, msg: Message) -> None:
        if msg.version != self.version:
            raise ProtocolError(f"{msg.describe()}: WELCOME announced a bootstrap at v{self.version}")
        if msg.part >= self.parts or msg.last != (msg.part + 1 == self.parts):
            raise ProtocolError(f"{msg.describe()}: WELCOME announced a bootstrap of {self.parts} parts")


@dataclass
class PendingVersion:
    """A version received, validated and staged, not yet written."""

    type: MessageType
    version: int | None
    base_version: int | None
    updates: list[StagedUpdate] = field(default_factory=list)
    stats: ApplyStats = field(default_factory=lambda: ApplyStats(None, ""))
    messages: list[Message] = field(default_factory=list)  # as received, when the receiver keeps them (a relay)
    written: bool = False  # written into the model as it arrived (bucket.load_instant): commit() only records it
    staged_bytes: int = 0  # of ``updates``
