"""The wire format: the one place that knows how a message is laid out in frames.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map (the header);
frames 1..n are raw buffers, each described by one ``BufferSpec`` in the header's
manifest. Tensor bytes never travel inside msgpack.

Header keys (protocol version 7; the versions before it: docs/wire.md)::

    type     MessageType            proto    PROTOCOL_VERSION
    session  sender session id      seq      per-session message counter
    version  weight version or nil  base     base_version of a patch, or nil
    part     index of this message within its version (0, 1, ...)
    last     whether it is the version's last message (a patch's parts go out while
             later ones are still being compared, so their count is not known up front)
    tensors  [[key, encoding, values, nnz, [buffer, ...]], ...]
             buffer = [frame, role, dtype, shape, nbytes, codec, shuffle, wire_nbytes, checksum]
             a grouped entry adds a sixth item, [key, ordinal, ...]: small tensors of one
             dtype coded as one flat run, their elements end to end in that order
             a span entry adds a last item {"s": [lo, hi]}: it covers flat elements
             [lo, hi) of its tensor only, coded as a 1-D tensor of hi - lo elements;
             or {"s": [lo, hi, length, stride]}: a strided block, runs of length
             elements every stride from lo, the last ending at hi, coded as a 1-D
             tensor of its elements in order (``protocol/wire/span.py``)
    body     small type-specific map (metadata, reasons, ...)
    hsum     xxh3-64 of the msgpack encoding of all the other keys

``decode_message`` checks everything that can be checked without the target model:
structure and types, frame count and every frame's length, checksums, dtype codes, and
``prod(shape) * itemsize == nbytes``. Checks against the model (key range, shapes,
index bounds) belong to the receiver, and also happen before anything is written.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from protocol.codec.compress import Codec
from protocol.errors import IntegrityError, LimitError, ProtocolError
from protocol.wire.buffers import Buffer
from protocol.wire.checksum import checksum
from protocol.wire.dtypes import dtype_from_code
from protocol.wire.limits import DEFAULT_LIMITS, Limits
from protocol.wire.span import Span

PROTOCOL_VERSION = 7  # senders and receivers match exactly; what each version added: docs/wire.md
MAX_DIMS = 8


class MessageType(IntEnum):
    HELLO = 1  # receiver -> sender: metadata, applied version, state digest
    WELCOME = 2  # sender -> receiver: session, aliases, whether a bootstrap follows
    BOOTSTRAP = 3  # sender -> receiver: a bucket of the init bootstrap / resync
    PATCH = 4  # sender -> receiver: sparse changes on top of base_version
    BUCKET = 5  # sender -> receiver: whole tensors of one version (bucket strategy)
    ACK = 6  # receiver -> sender: version applied
    NACK = 7  # receiver -> sender: message rejected; asks for a resync
    HEARTBEAT = 8  # either way: liveness
    ERROR = 9  # either way: a fatal error the peer should surface
    BYE = 10  # either way: orderly goodbye
    DIGEST_REQUEST = 11  # receiver -> sender: your current version (and its state digest, if body.digest)
    DIGEST = 12  # sender -> receiver: the reply: version, body {nonce, digest}


class Encoding(IntEnum):
    """How a tensor's changed positions travel."""

    DENSE = 0  # the whole tensor, no positions
    COO = 1  # RLinf's 2-D COO: absolute rows and cols
    COO_DELTA = 2  # RLinf's delta-encoded rows and cols
    GAPS = 3  # flat-index gaps (zero-run lengths between changes)
    BITMAP = 4  # one bit per element
    ANS_GAPS = 5  # gaps, entropy coded (protocol/codec/entropy.py)
    BLOCKS = 6  # gaps and ULP values bit-packed in blocks, one uint8 buffer (protocol/codec/devicecodec.py)


class ValueEncoding(IntEnum):
    RAW = 0  # the new values
    XOR = 1  # new bits XOR old bits: valid only on top of exactly base_version
    ULP = 2  # new bits - old bits, coded (entropy or BLOCKS): valid only on top of exactly base_version


class Role(IntEnum):
    """What a buffer holds within its tensor entry."""

    VALUES = 0
    ROWS = 1
    COLS = 2
    POSITIONS = 3  # gaps, bitmap, or the entropy-coded high parts of gaps
    LOW_BITS = 4  # entropy-coded gaps: their low bits
    POSITION_MODEL = 5  # entropy-coded gaps: the split and the counts table
    POSITION_ESCAPES = 6  # entropy-coded gaps: gaps too large for the table
    VALUE_MODEL = 7  # entropy-coded values: the counts table
    VALUE_EXTRA = 8  # entropy-coded values: the low bits of large differences


@dataclass(frozen=True)
class BufferSpec:
    frame: int
    role: Role
    dtype: int  # dtype code of the decoded elements
    shape: tuple[int, ...]  # decoded element shape
    nbytes: int  # decoded size
    codec: Codec
    shuffle: bool  # bytes regrouped by significance before compression
    wire_nbytes: int
    checksum: int

    def to_wire(self) -> list[Any]:
        return [self.frame, int(self.role), self.dtype, list(self.shape), self.nbytes,
                int(self.codec), self.shuffle, self.wire_nbytes, self.checksum]


@dataclass(frozen=True)
class TensorEntry:
    key: int  # ordinal in the receiver's ordered keys (a group's first)
    encoding: Encoding
    values: ValueEncoding
    nnz: int  # changed elements (numel for DENSE)
    buffers: tuple[BufferSpec, ...]
    # A grouped entry: the ordinals of the tensors it covers, ``key`` first, coded as one
    # flat tensor of their elements end to end. Small tensors are coded together because
    # each entry costs tens of microseconds a side whatever its size. () for one tensor.
    group: tuple[int, ...] = ()
    # A span entry: it covers the flat elements ``span`` names of its tensor (row-major, of
    # the whole tensor: a range [lo, hi), or a strided block of runs) and codes them as a
    # 1-D tensor of ``span.numel`` elements, its positions relative to the span's first (a
    # dense one: exactly those values). A tensor's changes of one version may then travel
    # in several entries, one per trainer rank's shard, in disjoint spans in any order.
    # Never on a grouped entry; None: the whole tensor.
    span: Span | None = None

    @property
    def covers(self) -> tuple[int, ...]:
        """The ordinals this entry writes."""
        return self.group or (self.key,)

    def buffer(self, role: Role) -> BufferSpec:
        for b in self.buffers:
            if b.role is role:
                return b
        raise ProtocolError(f"tensor {self.key}: missing {role.name.lower()} buffer")

    def to_wire(self) -> list[Any]:
        wire = [self.key, int(self.encoding), int(self.values), self.nnz, [b.to_wire() for b in self.buffers]]
        if self.group:
            wire.append(list(self.group))
        if self.span is not None:
            wire.append({SPAN_KEY: self.span.to_wire()})
        return wire


@dataclass
class Message:
    type: MessageType
    session: str = ""
    seq: int = 0
    version: int | None = None
    base_version: int | None = None
    part: int = 0
    last: bool = True
    tensors: list[TensorEntry] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    frames: list[Buffer] = field(default_factory=list)  # payload frames 1..n

    @property
    def payload_nbytes(self) -> int:
        return sum(len(f) for f in self.frames)

    def describe(self) -> str:
        return f"{self.type.name} v{self.version} part {self.part + 1}{' (last)' if self.last else ''} seq {self.seq}"


def encode_message(msg: Message) -> list[Buffer]:
    """Frames for ``msg``: the header, then the payload buffers as they are (no copy)."""
    header: dict[str, Any] = {
        "type": int(msg.type),
        "proto": PROTOCOL_VERSION,
        "session": msg.session,
        "seq": msg.seq,
        "version": msg.version,
        "base": msg.base_version,
        "part": msg.part,
        "last": msg.last,
        "tensors": [t.to_wire() for t in msg.tensors],
        "body": msg.body,
    }
    packed = msgpack.packb(header, use_bin_type=True)
    header["hsum"] = checksum(packed)
    return [msgpack.packb(header, use_bin_type=True), *msg.frames]


def decode_message(frames: Sequence[Buffer], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate ``frames``; raises ``ProtocolError`` (``LimitError`` past
    ``limits``, checked before the header is parsed) or ``IntegrityError``."""
    if not frames:
        raise ProtocolError("empty message: no header frame")
    if len(frames) > limits.frames:
        raise LimitError("frame count", len(frames), limits.frames)
    if len(frames[0]) > limits.header_bytes:
        raise LimitError("header bytes", len(frames[0]), limits.header_bytes)
    total = 0
    for f in frames:
        if len(f) > limits.frame_bytes:
            raise LimitError("frame bytes", len(f), limits.frame_bytes)
        total += len(f)
    if total > limits.message_bytes:
        raise LimitError("message bytes", total, limits.message_bytes)
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, expected a map")
    hsum = header.pop("hsum", None)
    if type(hsum) is not int:
        raise ProtocolError("header has no checksum")
    if checksum(msgpack.packb(header, use_bin_type=True)) != hsum:
        raise IntegrityError("header checksum mismatch")
    proto = _get(header, "proto", int)
    if proto != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {proto} is not supported (this side speaks {PROTOCOL_VERSION})")
    raw_type = _get(header, "type", int)
    try:
        mtype = MessageType(raw_type)
    except ValueError:
        raise ProtocolError(f"unknown message type {raw_type}") from None
    msg = Message(
        type=mtype,
        session=_get(header, "session", str),
        seq=_nonneg(_get(header, "seq", int), "seq"),
        version=_get(header, "version", int, optional=True),
        base_version=_get(header, "base", int, optional=True),
        part=_nonneg(_get(header, "part", int), "part"),
        last=_get(header, "last", bool),
        body=_get(header, "body", dict),
    )
    where = msg.describe()
    raw_tensors = _get(header, "tensors", list)
    if len(raw_tensors) > limits.tensors:
        raise LimitError("tensor entries", len(raw_tensors), limits.tensors, where)
    msg.tensors = [_tensor_entry(t, where, limits.tensors) for t in raw_tensors]
    specs = [b for t in msg.tensors for b in t.buffers]
    if len(frames) != len(specs) + 1:
        raise ProtocolError(f"{where}: {len(frames) - 1} payload frames, manifest lists {len(specs)}")
    if sorted(b.frame for b in specs) != list(range(1, len(specs) + 1)):
        raise ProtocolError(f"{where}: manifest frame indices are not 1..{len(specs)} each once")
    for t in msg.tensors:
        for b in t.buffers:
            frame = frames[b.frame]
            if len(frame) != b.wire_nbytes:
                raise ProtocolError(
                    f"{where}: tensor {t.key} {b.role.name.lower()} frame {b.frame} has {len(frame)} bytes, "
                    f"manifest says {b.wire_nbytes}"
                )
            if b.codec is Codec.NONE and b.wire_nbytes != b.nbytes:
                raise ProtocolError(f"{where}: tensor {t.key} frame {b.frame}: uncompressed size mismatch")
            if checksum(frame) != b.checksum:
                raise IntegrityError(f"{where}: tensor {t.key} {b.role.name.lower()} frame {b.frame} checksum mismatch")
    msg.frames = list(frames[1:])
    return msg


# Wire code -> member: a dict lookup costs ~25 ns here, ``Role(code)`` ~240 ns, and a
# patch header has one of each per buffer (``python -m benchmarks.micro --only header``).
_ENCODINGS = {int(e): e for e in Encoding}
_VALUE_ENCODINGS = {int(v): v for v in ValueEncoding}
_ROLES = {int(r): r for r in Role}
_CODECS = {int(c): c for c in Codec}


SPAN_KEY = "s"  # a span entry's last item: {SPAN_KEY: [lo, hi]} or {SPAN_KEY: [lo, hi, length, stride]}


def _tensor_entry(raw: Any, where: str, max_group: int) -> TensorEntry:
    if not isinstance(raw, list) or len(raw) not in (5, 6, 7):
        raise ProtocolError(f"{where}: malformed tensor entry {raw!r:.80}")
    key, enc, val, nnz, bufs = raw[:5]
    key = _nonneg(_typed(key, int, "tensor key"), "tensor key")
    span = None
    if len(raw) > 5 and type(raw[-1]) is dict:
        span = _span(raw[-1], key, where)
        raw = raw[:-1]
    if len(raw) == 7:
        raise ProtocolError(f"{where}: malformed tensor entry {raw!r:.80}")
    group = _group(raw[5], key, where, max_group) if len(raw) == 6 else ()
    if group and span is not None:
        raise ProtocolError(f"{where}: tensor {key}: a grouped entry cannot have a span")
    encoding, values = _ENCODINGS.get(_typed(enc, int, "encoding")), _VALUE_ENCODINGS.get(_typed(val, int, "value encoding"))
    if encoding is None or values is None:
        raise ProtocolError(f"{where}: tensor {key}: unknown encoding {enc!r}/{val!r}")
    if not isinstance(bufs, list):
        raise ProtocolError(f"{where}: tensor {key}: buffers is not a list")
    specs = tuple([_buffer_spec(b, where, key) for b in bufs])
    if len({b.role for b in specs}) != len(specs):
        raise ProtocolError(f"{where}: tensor {key}: a buffer role appears twice")
    return TensorEntry(key, encoding, values, _nonneg(_typed(nnz, int, "nnz"), "nnz"), specs, group, span)


def _span(raw: dict[Any, Any], key: int, where: str) -> Span:
    """A span entry's span (``Span.from_wire``: [lo, hi], or [lo, hi, length, stride] whose
    runs end at hi; ``hi`` against the tensor's size is the receiver's check); the map holds
    nothing else."""
    if len(raw) != 1 or SPAN_KEY not in raw:
        raise ProtocolError(f"{where}: tensor {key}: malformed span {raw!r:.80}")
    try:
        return Span.from_wire(raw[SPAN_KEY])
    except ProtocolError as e:
        raise ProtocolError(f"{where}: tensor {key}: {e}") from None


def _group(raw: Any, key: int, where: str, most: int) -> tuple[int, ...]:
    """A grouped entry's ordinals: at least two, distinct, non-negative, ``key`` first."""
    if type(raw) is list and len(raw) > most:
        raise LimitError("group size", len(raw), most, f"{where}: tensor {key}")
    if type(raw) is not list or len(raw) < 2 or any(type(k) is not int or k < 0 for k in raw):
        raise ProtocolError(f"{where}: tensor {key}: malformed group {raw!r:.80}")
    if raw[0] != key or len(set(raw)) != len(raw):
        raise ProtocolError(f"{where}: tensor {key}: a group must start with its key and name each tensor once")
    return tuple(raw)


def _buffer_spec(raw: Any, where_msg: str, key: int) -> BufferSpec:
    if type(raw) is not list or len(raw) != 9:
        raise ProtocolError(f"{where_msg}: tensor {key}: malformed buffer entry {raw!r:.80}")
    frame, role, dtype, shape, nbytes, codec, shuf, wire, csum = raw
    if not (  # the common case in one test; anything else takes the checks below, in order, for the error
        type(frame) is int and type(role) is int and (role_e := _ROLES.get(role)) is not None
        and type(codec) is int and (codec_e := _CODECS.get(codec)) is not None
        and type(shape) is list and len(shape) <= MAX_DIMS and type(nbytes) is int and nbytes >= 0
        and type(shuf) is bool and type(wire) is int and wire >= 0 and type(csum) is int
    ):
        return _buffer_spec_checked(raw, where_msg, key)
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"{where_msg}: tensor {key}: bad shape {shape!r:.80}")
    dt = dtype_from_code(dtype)
    if math.prod(shape) * dt.itemsize != nbytes:
        raise ProtocolError(f"{where_msg}: tensor {key}: shape {shape} of {dt} is not {nbytes} bytes")
    # Every field checked: build the frozen record without its per-field __setattr__
    # (~0.9 us -> ~0.45 us, once per buffer of every message).
    spec: BufferSpec = _new(BufferSpec)
    spec.__dict__.update(frame=frame, role=role_e, dtype=dtype, shape=tuple(shape), nbytes=nbytes, codec=codec_e,
                         shuffle=shuf, wire_nbytes=wire, checksum=csum)
    return spec


_new = object.__new__


def _buffer_spec_checked(raw: list[Any], where_msg: str, key: int) -> BufferSpec:
    where = f"{where_msg}: tensor {key}"
    frame, role, dtype, shape, nbytes, codec, shuf, wire, csum = raw
    role_e, codec_e = _ROLES.get(_typed(role, int, "role")), _CODECS.get(_typed(codec, int, "codec"))
    if role_e is None or codec_e is None:
        raise ProtocolError(f"{where}: unknown buffer role {role!r} or codec {codec!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(f"{where}: bad shape {shape!r:.80}")
    dt = dtype_from_code(dtype)
    nbytes = _nonneg(_typed(nbytes, int, "nbytes"), "nbytes")
    if math.prod(shape) * dt.itemsize != nbytes:
        raise ProtocolError(f"{where}: shape {shape} of {dt} is not {nbytes} bytes")
    return BufferSpec(
        frame=_typed(frame, int, "frame"),
        role=role_e,
        dtype=dtype,
        shape=tuple(shape),
        nbytes=nbytes,
        codec=codec_e,
        shuffle=_typed(shuf, bool, "shuffle"),
        wire_nbytes=_nonneg(_typed(wire, int, "wire_nbytes"), "wire_nbytes"),
        checksum=_typed(csum, int, "checksum"),
    )


def _typed(value: Any, kind: type, what: str) -> Any:
    if type(value) is not kind:
        raise ProtocolError(f"{what} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _nonneg(value: int, what: str) -> int:
    if value < 0:
        raise ProtocolError(f"{what} is negative ({value})")
    return value


def _get(header: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    if key not in header:
        raise ProtocolError(f"header lacks {key!r}")
    value = header[key]
    if value is None and optional:
        return None
    return _typed(value, kind, f"header field {key!r}")


def peek_type(frames: Sequence[Buffer]) -> MessageType | None:
    """The message type, read without validating anything, to route a message cheaply.

    Only for routing: the message must still go through ``decode_message`` before use.
    ``encode_message`` writes ``type`` first, so this reads the header's first key and
    value only (a few bytes, not the whole header: the event loop routes every message,
    and ``decode_message`` parses it once, off the loop); a header laid out otherwise is
    parsed whole, as before.
    """
    try:
        head = frames[0]
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(1, len(head)))
        unpacker.feed(memoryview(head)[:PEEK_BYTES])
        if unpacker.read_map_header() and unpacker.unpack() == "type":
            return MessageType(unpacker.unpack())
    except Exception:
        pass
    try:
        header = msgpack.unpackb(frames[0], raw=False)
        return MessageType(header["type"])
    except Exception:
        return None


PEEK_BYTES = 32  # a map header, the key "type" and an int: at most 5 + 5 + 9 bytes
_VERSION_AT = 5  # ``encode_message`` writes type, proto, session, seq, version first


def peek_version(frames: Sequence[Buffer], newer_than: int | None = None) -> int | None:
    """The message's ``version``, once its header's checksum holds; None if it has none, the
    header is damaged, or (cheaply, without the checksum) it is not above ``newer_than``.

    For what arrives ahead of its decode (a receiver hears of a version from its first
    part): the header alone is checked, not the payload. The first fields are read as a
    stream first, so a message of a version already known costs a few bytes' parse; only a
    newer one's header is parsed whole and its checksum verified, so a damaged header never
    names a version.
    """
    try:
        head = frames[0]
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(1, len(head)))
        unpacker.feed(memoryview(head)[:PEEK_BYTES * 4])
        pairs = unpacker.read_map_header()
        for _ in range(min(pairs, _VERSION_AT)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key == "version":
                if type(value) is not int or (newer_than is not None and value <= newer_than):
                    return None
                break
    except Exception:
        pass  # laid out otherwise, or longer than read: parsed whole below
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
        hsum = header.pop("hsum")
        if type(hsum) is not int or checksum(msgpack.packb(header, use_bin_type=True)) != hsum:
            return None
        version = header["version"]
    except Exception:
        return None
    if type(version) is not int or version < 0 or (newer_than is not None and version <= newer_than):
        return None
    return version


class Stamper:
    """Frames a message with a sender session id and the next sequence number."""

    def __init__(self) -> None:
        self.session = uuid.uuid4().hex
        self._seq = 0

    def __call__(self, msg: Message) -> list[Buffer]:
        msg.session = self.session
        msg.seq = self._seq
        self._seq += 1
        return encode_message(msg)

