"""The bodies of the messages one side builds and the other reads, as typed records.

A message's ``body`` is a small msgpack map (``framing.Message.body``). Each record here
is one such body: ``to_body()`` is the map that travels (keys and values exactly as
they always have, in the same order: the bytes on the wire are the contract), and
``from_body(body)`` reads an untrusted one, checking every field's type and raising a
``ProtocolError`` that names the message and the field. Keys a reader does not know are
ignored. Checks that need the model (an alias ordinal in range, shapes that match) stay
with the reader that has it. ``to_message(version)`` wraps a record in its ``Message``.

    HELLO           receiver -> sender  Hello         metadata, who, applied version, digest, session
    WELCOME         sender -> receiver  Welcome       strategy, aliases, bootstrap size, flips
    ACK, HEARTBEAT  receiver -> sender  Ack           a relay's receivers below it, a version staged
    HEARTBEAT       sender -> receiver  Beat          the trainer's latest version (from a relay), flips
    NACK            receiver -> sender  Nack          why an update was rejected, or BEHIND
    DIGEST_REQUEST  receiver -> sender  DigestRequest nonce; the digest? the metadata?
    DIGEST          sender -> receiver  DigestReply   nonce, state digest, latest
                                        Description   nonce, metadata (before HELLO)
    ERROR           either way          ErrorReport   wire code (``protocol.errors``), text
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from protocol.errors import ProtocolError, WeightSyncError, error_code, error_from_code
from protocol.quant import Fp8Format
from protocol.wire.framing import Message, MessageType
from protocol.wire.metadata import ModelMetadata

__all__ = ["BEHIND", "LOST", "Ack", "Beat", "Description", "DigestReply", "DigestRequest", "ErrorReport", "Hello", "Nack", "Welcome"]

# A NACK's reason when nothing was rejected: the receiver heard of a version it never
# received (a message lost on a connection ZeroMQ re-established) and asks to be sent what
# follows the version it holds. A server of an older protocol takes it as any NACK and
# resyncs: more bytes, the same weights.
BEHIND = "Behind"
# A NACK's reason when what was sent again after its asks (``BEHIND``) was lost too: the
# receiver gives up on resends and asks for a resync of the current version, which every
# server, of any protocol version, does for a NACK of any other reason.
LOST = "Lost"

_MISSING = object()


def _field(kind: MessageType, body: Mapping[Any, Any], name: str, want: str, ok: Any, *, optional: bool = False) -> Any:
    """``body[name]`` if ``ok(value)``; absent reads as None where ``optional``."""
    value = body.get(name, _MISSING)
    if value is _MISSING and optional:
        return None
    if value is _MISSING or not ok(value):
        got = "nothing" if value is _MISSING else f"{value!r:.60}"
        raise ProtocolError(f"{kind.name} body: {name!r} must be {want}, got {got}")
    return value


def _str(v: object) -> bool:
    return type(v) is str


def _str_or_none(v: object) -> bool:
    return v is None or type(v) is str


def _int_or_none(v: object) -> bool:
    return v is None or type(v) is int


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


def _count_or_none(v: object) -> bool:
    return v is None or _count(v)


def _bool(v: object) -> bool:
    return type(v) is bool


class _Body:
    TYPE: ClassVar[MessageType]

    def to_body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Self:
        raise NotImplementedError

    @classmethod
    def from_message(cls, msg: Message) -> Self:
        """The body of ``msg``, which must be of this record's type (``ProtocolError``)."""
        if msg.type is not cls.TYPE:
            raise ProtocolError(f"expected {cls.TYPE.name}, got {msg.describe()}")
        return cls.from_body(msg.body)

    def to_message(self, version: int | None = None) -> Message:
        """This body in a message of its type."""
        return Message(self.TYPE, version=version, body=self.to_body())


@dataclass(frozen=True)
class Hello(_Body):
    """A receiver's first message: its model's metadata, its identity, the version it
    holds (``applied``), that version's state digest, and the sender session it last
    followed (to resume from that sender's ring). ``flip``: it can stage a version and
    commit it when told (``Welcome.together``); a receiver that predates it says nothing.
    ``subtree``: were it to relay, its ``Ack.staged`` would wait for the receivers below it
    too (``Ack.missing``); a server that flips refuses a relay that does not say so (its
    staged report would let a flip go before its receivers staged). ``quant``: the block
    and scale format of the weights its metadata holds in block fp8 (``protocol.quant``);
    absent, the sender's ``SyncConfig.fp8`` says."""

    TYPE: ClassVar[MessageType] = MessageType.HELLO
    metadata: ModelMetadata
    receiver: str = ""
    applied: int | None = None
    digest: str | None = None
    session: str | None = None
    flip: bool = False
    subtree: bool = False
    quant: Fp8Format | None = None

    def to_body(self) -> dict[str, Any]:
        body = {**self.metadata.to_body(), "receiver": self.receiver, "applied": self.applied, "digest": self.digest, "session": self.session}
        if self.flip:
            body["flip"] = True
        if self.subtree:
            body["subtree"] = True
        if self.quant is not None:
            body["quant"] = self.quant.to_body()
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Hello:
        k = cls.TYPE
        return cls(
            ModelMetadata.from_body(body),
            receiver=_field(k, body, "receiver", "a string", _str, optional=True) or "",
            applied=_field(k, body, "applied", "an int or nil", _int_or_none, optional=True),
            digest=_field(k, body, "digest", "a string or nil", _str_or_none, optional=True),
            session=_field(k, body, "session", "a string or nil", _str_or_none, optional=True),
            flip=_field(k, body, "flip", "a bool", _bool, optional=True) or False,
            subtree=_field(k, body, "subtree", "a bool", _bool, optional=True) or False,
            quant=None if body.get("quant") is None else Fp8Format.from_body(body["quant"]),
        )


@dataclass(frozen=True)
class Welcome(_Body):
    """A server's answer to HELLO: its strategy, its tied tensors as (alias, canonical)
    ordinal pairs, how many BOOTSTRAP messages follow (0: none), and ``untracked``: the
    (ordinal, state digest) of each tensor it will never send (not tracked, not in the
    bootstrap: a frozen weight under ``init_sync`` off), in the receiver's dtype, for the
    receiver to check it holds the same. Optional on the wire: a peer without it checks
    nothing. ``together``: versions are committed when the server says so (``Beat.flipped``),
    each staged first and reported (``Ack.staged``); a server only says so to a receiver
    whose HELLO said ``flip``. ``stage_timeout`` (with ``together``; seconds): how long the
    server waits for a version's cohort to stage it; a relay decides its own receivers'
    staging within a share of it (``protocol.net.flips.RELAY_SHARE``). Absent: not said."""

    TYPE: ClassVar[MessageType] = MessageType.WELCOME
    strategy: str
    aliases: tuple[tuple[int, int], ...]
    bootstrap: int
    untracked: tuple[tuple[int, str], ...] = ()
    together: bool = False
    stage_timeout: float | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"strategy": self.strategy, "aliases": [[a, c] for a, c in self.aliases], "bootstrap": self.bootstrap}
        if self.untracked:
            body["untracked"] = [[o, d] for o, d in self.untracked]
        if self.together:
            body["together"] = True
        if self.stage_timeout is not None:
            body["stage_timeout"] = self.stage_timeout
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Welcome:
        k = cls.TYPE
        strategy = _field(k, body, "strategy", "a string", _str)
        bootstrap = _field(k, body, "bootstrap", "an int >= 0 (the bootstrap size)", _count)
        aliases = _field(k, body, "aliases", "a list of [alias, canonical] ordinals", lambda v: isinstance(v, list))
        for pair in aliases:
            if not (isinstance(pair, list) and len(pair) == 2 and all(_count(x) for x in pair)):
                raise ProtocolError(f"{k.name} body: 'aliases' has a bad entry {pair!r:.60}")
        untracked = _field(k, body, "untracked", "a list of [ordinal, digest] pairs", lambda v: isinstance(v, list), optional=True) or []
        for pair in untracked:
            if not (isinstance(pair, list) and len(pair) == 2 and _count(pair[0]) and _str(pair[1]) and len(pair[1]) <= 64):
                raise ProtocolError(f"{k.name} body: 'untracked' has a bad entry {pair!r:.60}")
        together = _field(k, body, "together", "a bool", _bool, optional=True) or False
        timeout = _field(k, body, "stage_timeout", "a number of seconds > 0", _seconds, optional=True)
        return cls(strategy, tuple((a, c) for a, c in aliases), bootstrap, tuple((o, d) for o, d in untracked), together,
                   None if timeout is None else float(timeout))


@dataclass(frozen=True)
class Ack(_Body):
    """The body of an ACK or a HEARTBEAT: empty, or, from a relay, ``below``: how many
    receivers it feeds and the lowest version any of them applied (None until all have
    one); under ``Welcome.together``, ``staged``: the version it holds staged, waiting for
    the word to commit it; from a relay (``Hello.subtree``), only once the receivers below
    it staged it too, or its own deadline went without some of them: ``missing`` names
    those, each as its path below the relay (``"leaf"``, ``"relay2/leaf"``). ``TYPE`` is
    ACK; a heartbeat is ``Message(MessageType.HEARTBEAT, body=...)``."""

    TYPE: ClassVar[MessageType] = MessageType.ACK
    below: tuple[int, int | None] | None = None
    staged: int | None = None
    missing: tuple[str, ...] = ()

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {} if self.below is None else {"below": list(self.below)}
        if self.staged is not None:
            body["staged"] = self.staged
        if self.missing:
            body["missing"] = list(self.missing)
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any], kind: MessageType = MessageType.ACK) -> Ack:
        below = _field(kind, body, "below", "[receivers >= 0, lowest applied version >= 0 or nil]", _below, optional=True)
        staged = _field(kind, body, "staged", "an int >= 0 or nil", _count_or_none, optional=True)
        missing = _field(kind, body, "missing", f"a list of at most {MAX_MISSING} names", _names, optional=True) or []
        return cls(None if below is None else (below[0], below[1]), staged, tuple(missing))


MAX_MISSING = 4096  # names an Ack's ``missing`` may carry (a relay's whole subtree, bounded)


def _names(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_MISSING and all(_str(n) and 0 < len(n) <= 1024 for n in v)


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def _below(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and _count(v[0]) and (v[1] is None or _count(v[1]))


@dataclass(frozen=True)
class Beat(_Body):
    """The body of a server's HEARTBEAT (the message's version is the server's own):
    ``latest``, the newest version the trainer published as this server last heard it,
    where that is not the server's own (a relay a version behind its upstream). Absent on
    the wire: the heartbeat's version is the latest. A peer that predates it ignores it.
    ``flipped`` (under ``Welcome.together``): the newest version every receiver may commit
    now; sent at once when it moves, and repeated by every heartbeat, so one lost is not waited on.
    ``news``: sent at once, off the heartbeats' pace, because the version or the latest moved
    (a version published, a flip): it says what is latest, but is no sample of the pace a
    receiver judges the freshness of its knowledge by (``receiver/session/lag.py``). A peer
    that predates it takes it as a heartbeat."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    latest: int | None = None
    flipped: int | None = None
    news: bool = False

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {} if self.latest is None else {"latest": self.latest}
        if self.flipped is not None:
            body["flipped"] = self.flipped
        if self.news:
            body["news"] = True
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Beat:
        k = cls.TYPE
        return cls(
            _field(k, body, "latest", "an int >= 0 or nil", _count_or_none, optional=True),
            _field(k, body, "flipped", "an int >= 0 or nil", _count_or_none, optional=True),
            _field(k, body, "news", "a bool", _bool, optional=True) or False,
        )


@dataclass(frozen=True)
class Nack(_Body):
    """A receiver rejected an update (``reason``: the error's class) and asks for a resync;
    or, with ``reason`` ``BEHIND``, asks for the versions after the one it holds."""

    TYPE: ClassVar[MessageType] = MessageType.NACK
    reason: str
    message: str

    def to_body(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Nack:
        k = cls.TYPE
        return cls(_field(k, body, "reason", "a string", _str), _field(k, body, "message", "a string", _str))


@dataclass(frozen=True)
class DigestRequest(_Body):
    """Ask the server its current version; with ``digest``, that version's state digest
    too; with ``metadata`` (before HELLO), the metadata a receiver must declare. A flag
    left None does not travel."""

    TYPE: ClassVar[MessageType] = MessageType.DIGEST_REQUEST
    nonce: str
    digest: bool | None = None
    metadata: bool | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"nonce": self.nonce}
        if self.digest is not None:
            body["digest"] = self.digest
        if self.metadata is not None:
            body["metadata"] = self.metadata
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> DigestRequest:
        k = cls.TYPE
        return cls(
            _field(k, body, "nonce", "a string", _str),
            digest=_field(k, body, "digest", "true or false", _bool, optional=True),
            metadata=_field(k, body, "metadata", "true or false", _bool, optional=True),
        )


@dataclass(frozen=True)
class DigestReply(_Body):
    """The answer to a DIGEST_REQUEST (the message's version is the server's): the
    request's nonce, when asked and available the state digest, and ``latest`` as in
    ``Beat`` (absent: the server's version is the latest)."""

    TYPE: ClassVar[MessageType] = MessageType.DIGEST
    nonce: str
    digest: str | None = None
    latest: int | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"nonce": self.nonce, "digest": self.digest}
        if self.latest is not None:
            body["latest"] = self.latest
        return body

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> DigestReply:
        k = cls.TYPE
        return cls(
            _field(k, body, "nonce", "a string", _str),
            _field(k, body, "digest", "a string or nil", _str_or_none, optional=True),
            _field(k, body, "latest", "an int >= 0 or nil", _count_or_none, optional=True),
        )


@dataclass(frozen=True)
class Description(_Body):
    """The answer to a DIGEST_REQUEST for ``metadata``, from a server that has no HELLO
    from the asker: the keys and shapes it must declare (None: no model yet)."""

    TYPE: ClassVar[MessageType] = MessageType.DIGEST
    nonce: str
    metadata: ModelMetadata | None = None

    def to_body(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "digest": None, "metadata": None if self.metadata is None else self.metadata.to_body()}

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> Description:
        k = cls.TYPE
        nonce = _field(k, body, "nonce", "a string", _str)
        metadata = _field(k, body, "metadata", "a map or nil", lambda v: v is None or isinstance(v, dict), optional=True)
        return cls(nonce, None if metadata is None else ModelMetadata.from_body(metadata))


@dataclass(frozen=True)
class ErrorReport(_Body):
    """An ERROR: the error's wire code (``protocol.errors.WIRE_CODES``, or ``UNKNOWN_PEER``)
    and its text."""

    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> ErrorReport:
        """The ERROR that reports ``error`` (``state``: not now, e.g. a relay asleep; the
        receiver tries again later)."""
        return cls(error_code(error), str(error))

    def error(self, prefix: str = "") -> WeightSyncError:
        """The error this reports, as its class on this side."""
        return error_from_code(self.code, prefix + self.message)

    def to_body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_body(cls, body: Mapping[Any, Any]) -> ErrorReport:
        k = cls.TYPE
        return cls(_field(k, body, "code", "a string", _str), _field(k, body, "message", "a string", _str))
