"""weightsync's wire protocol: message framing, tensor codecs, checksums and errors.

Pure functions over tensors and bytes; no sockets, and no knowledge of either side.
"""

from .checksum import checksum, state_digest
from .compress import Codec
from .config import BucketConfig, InitSyncConfig, PatchConfig, SyncConfig, load_config
from .errors import (
    ConfigError,
    IntegrityError,
    LayoutError,
    MetadataMismatchError,
    ProtocolError,
    ResyncLimitError,
    StaleVersionError,
    WeightSyncError,
)
from .framing import (
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
from .metadata import ModelMetadata
from .state import ModelState, resolve_state

__all__ = [
    "PROTOCOL_VERSION",
    "BucketConfig",
    "BufferSpec",
    "Codec",
    "ConfigError",
    "Encoding",
    "InitSyncConfig",
    "IntegrityError",
    "LayoutError",
    "Message",
    "MessageType",
    "MetadataMismatchError",
    "ModelMetadata",
    "ModelState",
    "PatchConfig",
    "ProtocolError",
    "ResyncLimitError",
    "Role",
    "StaleVersionError",
    "SyncConfig",
    "TensorEntry",
    "ValueEncoding",
    "WeightSyncError",
    "checksum",
    "decode_message",
    "encode_message",
    "load_config",
    "resolve_state",
    "state_digest",
]
