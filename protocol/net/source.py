"""What a version server asks of where its versions come from (the trainer's model,
``sender/serve/source.py``; a relay's receiver, ``receiver/session/relay.py``)."""

from __future__ import annotations

from typing import Protocol

from protocol.wire.framing import Message
from protocol.wire.messages import Hello, Welcome
from protocol.wire.metadata import ModelMetadata


class VersionSource(Protocol):
    """What a ``VersionServer`` asks of where its versions come from. ``admit``,
    ``bootstrap`` and ``digest`` are called under the server's ``lock``: the version at
    rest does not move while they run."""

    async def admit(self, hello: Hello) -> Welcome:
        """Check a receiver's HELLO; the WELCOME it gets (the server fills in the bootstrap
        size). Raise a ``WeightSyncError`` to refuse it: it is sent to the receiver."""
        ...

    async def bootstrap(self, version: int | None) -> list[Message] | None:
        """The BOOTSTRAP messages of ``version``, the current one; None where they cannot be
        built now (a sharded trainer's are gathered at its next version, in lockstep): the
        server asks again once the version has moved, for that version."""
        ...

    async def digest(self, version: int | None) -> str | None:
        """The state digest of ``version``, the current one, at the receivers' dtypes; None
        where it is not known (a receiver claiming the version is then resynced)."""
        ...

    def describe(self) -> ModelMetadata | None:
        """The keys and shapes a receiver must declare in HELLO, with the dtypes held here
        (None before there is a model). A receiver that derives its own layout from the
        trainer's names asks for them first (``receiver.vllm``)."""
        ...
