"""What the sender and the receiver share; it imports neither side.

``wire/`` (the message layout, inbound limits, dtypes, metadata, checksums) and
``codec/`` (a tensor's changes to buffers and back, compressors, buckets) are bytes and
tensors only; ``net/`` is the ZeroMQ plumbing both daemons serve with (the version
server, CURVE, ZAP); ``host/`` what processes on one host share (shared memory,
snapshot files, the CLI plumbing). Beside them: ``errors`` (the whole error family),
``config`` (the YAML), ``state`` (how either side sees a model). tests/test_layering.py
keeps these boundaries.
"""

from protocol.codec.compress import Codec
from protocol.config import BucketConfig, InitSyncConfig, PatchConfig, SyncConfig, load_config
from protocol.errors import (
    AdapterMismatchError,
    CheckpointError,
    ConfigError,
    GatherOrderError,
    IntegrityError,
    LagTimeoutError,
    LimitError,
    MetadataMismatchError,
    PeerGone,
    PlacementError,
    ProtocolError,
    ResyncLimitError,
    SharedMemoryError,
    StaleVersionError,
    StateError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WriteCheckError,
)
from protocol.state import ModelState, resolve_state
from protocol.wire.checksum import checksum, state_digest
from protocol.wire.framing import (
    PROTOCOL_VERSION,
    BufferSpec,
    Encoding,
    Message,
    MessageType,
    Role,
    TensorEntry,
    ValueEncoding,
    decode_message,
    encode_message,
)
from protocol.wire.metadata import ModelMetadata

__all__ = [
    "PROTOCOL_VERSION",
    "AdapterMismatchError",
    "BucketConfig",
    "BufferSpec",
    "Codec",
    "CheckpointError",
    "ConfigError",
    "Encoding",
    "GatherOrderError",
    "InitSyncConfig",
    "IntegrityError",
    "LagTimeoutError",
    "LimitError",
    "Message",
    "MessageType",
    "MetadataMismatchError",
    "ModelMetadata",
    "ModelState",
    "PatchConfig",
    "PeerGone",
    "PlacementError",
    "ProtocolError",
    "ResyncLimitError",
    "Role",
    "SharedMemoryError",
    "StaleVersionError",
    "StateError",
    "SyncConfig",
    "TensorEntry",
    "TransportError",
    "ValueEncoding",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WriteCheckError",
    "checksum",
    "decode_message",
    "encode_message",
    "load_config",
    "resolve_state",
    "state_digest",
]
