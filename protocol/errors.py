"""The error family every weightsync failure belongs to.

Callers catch ``WeightSyncError`` for everything, or one of the narrower classes
for what they can act on: a bad message (``ProtocolError``; one over a bound:
``LimitError``), corrupted bytes (``IntegrityError``), two models that do not match
(``MetadataMismatchError``), an update that does not apply on top of the current version
(``StaleVersionError``), a setting or argument that cannot work here (``ConfigError``; an
engine whose loader transforms a tensor: ``PlacementError``), a call that does not fit the
current state (``StateError``), a socket that failed (``TransportError``), a
receiver that kept refusing its resyncs and was given up on (``ResyncLimitError``), or a
wait that ran out of time (``WeightSyncTimeout``, which is also a ``TimeoutError``).
weightsync raises nothing else out of a public call but ``asyncio.CancelledError``; what the
code it calls raises (torch, your callbacks) passes through. docs/errors.md lists the few
other exceptions and why; tests/test_error_family.py walks every raise.

Errors travel by ``code``: the ERROR message a server sends a receiver and the sidecar
hand-off's error reply carry ``error_code(err)``; the side that reads one raises
``error_from_code(code, message)``. ``WIRE_CODES`` is the one table of both directions.
"""

from __future__ import annotations

import sys


class WeightSyncError(Exception):
    """Base of every error raised by weightsync."""


class ProtocolError(WeightSyncError):
    """A message is malformed: wrong frame count, bad header, bad index, bad size."""


class LimitError(ProtocolError):
    """A message exceeds a configured bound (``protocol.wire.limits.Limits``); ``limit``
    names which, ``value`` says by how much."""

    def __init__(self, limit: str, value: int, allowed: int, where: str = "message") -> None:
        super().__init__(f"{where}: {limit} {value} exceeds the limit of {allowed}")
        self.limit, self.value, self.allowed = limit, value, allowed


class IntegrityError(WeightSyncError):
    """A buffer's bytes do not match the checksum its header announced."""


class MetadataMismatchError(WeightSyncError):
    """Sender and receiver models disagree on keys or shapes; names the first offending key."""


class CheckpointError(WeightSyncError):
    """A checkpoint file a sender was to serve is torn or still being written, unreadable,
    named without a version, or its keys, shapes or dtypes differ from the model's; names the
    file, the first offending key and the fix. The sender refuses it and keeps serving the
    version it has."""


class StaleVersionError(WeightSyncError):
    """An update does not apply on top of the receiver's current version.

    ``held``: the update's version is one the receiver already holds or passed (a replay,
    or a patch sent before a resync that overtook it), so there is nothing to recover."""

    def __init__(self, message: str, *, current: int | None = None, got: int | None = None, held: bool = False):
        super().__init__(message)
        self.current = current
        self.got = got
        self.held = held


class ConfigError(WeightSyncError, ValueError):
    """A setting or an argument is invalid, or needs a package or device that is not
    available. Also a ``ValueError``: what Python raises for a bad argument, which callers
    and vLLM's own checks of ``init_info`` / ``update_info`` catch."""


class PlacementError(ConfigError):
    """A checkpoint tensor's place in an engine's runtime parameters cannot be patched
    element by element (its loader transforms the values); names the tensor."""


class WriteCheckError(PlacementError):
    """An element read back after a commit does not hold the value staged for it: the
    engine's runtime map put a tensor's elements somewhere else (``receiver.apply.readback``).
    The version is not published; names the tensor and the element."""


class AdapterMismatchError(ConfigError):
    """A trainer's LoRA adapter does not fit the engine's adapter slots (a rank above the
    engine's ``max_lora_rank`` or other than declared, a module the engine has no LoRA layer
    for or that is not a declared target, a shape other than the module's, too many
    adapters for its slots). Raised before anything is written; names the first problem."""


class GatherOrderError(WeightSyncError):
    """A gather the other ranks are not making: out of order, twice, or outside a sync.
    Raised before the collective, on the rank that would have made it."""


class SharedMemoryError(WeightSyncError):
    """A shared-memory region is missing or malformed, or a writer that crashed left it torn."""


class StateError(WeightSyncError):
    """A control call does not fit the receiver's state (``update_weights`` while not
    paused, waking the weights while the KV cache sleeps): change the state, then retry."""


class TransportError(WeightSyncError):
    """A socket could not do what was asked: bind an address (in use: ``errno`` is
    ``EADDRINUSE``), connect to a malformed endpoint, send or receive on a socket whose
    context is gone. Names the operation and the address; ``__cause__`` is ZeroMQ's error."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class PeerGone(TransportError):
    """A server's send found the receiver's connection gone (``EHOSTUNREACH``): drop that
    receiver, serve the others."""


class ResyncLimitError(WeightSyncError):
    """A receiver refused every resync of a run of them (each NACKed, no ACK between): the
    server stopped serving it rather than send whole models forever. Something on that
    receiver's side (its limits, its wire, a version it holds that the server has not)
    needs a look: reconnecting would only start the same run again."""


if sys.version_info >= (3, 11):

    class WeightSyncTimeout(WeightSyncError, TimeoutError):
        """A public call ran out of time (a wait for a version, an answer, a handshake).
        Also a ``TimeoutError`` (since Python 3.11, ``asyncio.TimeoutError`` too), so
        ``except TimeoutError`` catches it."""

else:  # Python 3.10: asyncio's and concurrent.futures' TimeoutError are other classes
    import asyncio
    import concurrent.futures

    class WeightSyncTimeout(WeightSyncError, TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
        """A public call ran out of time (a wait for a version, an answer, a handshake).
        Also a ``TimeoutError``, ``asyncio.TimeoutError`` and ``concurrent.futures.TimeoutError``."""


class LagTimeoutError(WeightSyncTimeout):
    """``Sender.sync`` under ``lag_policy="wait"`` waited its ``lag_timeout`` and receivers
    are still more than ``max_lag`` versions behind: nothing was built. ``receivers``: each
    late receiver's name and the version it has acknowledged."""

    def __init__(self, message: str, receivers: dict[str, int | None] | None = None) -> None:
        super().__init__(message)
        self.receivers = dict(receivers or {})


# -- on the wire --------------------------------------------------------------------------
# The ``code`` of an ERROR message's body and of a sidecar hand-off error reply. The most
# specific class listed wins (a PlacementError travels as "config"); an error of no class
# here travels as GENERIC_CODE and is read back as a plain WeightSyncError. These strings
# are on the wire: never rename one.
WIRE_CODES: dict[type[WeightSyncError], str] = {
    MetadataMismatchError: "metadata_mismatch",
    StaleVersionError: "stale_version",
    SharedMemoryError: "shared_memory",
    ConfigError: "config",
    ProtocolError: "protocol",
    ResyncLimitError: "resync_limit",
    StateError: "state",
    WriteCheckError: "write_check",
    WeightSyncTimeout: "timeout",
}
GENERIC_CODE = "error"
UNKNOWN_PEER = "unknown_peer"  # a server's ERROR to a receiver it has no HELLO from: say HELLO
_BY_CODE = {code: cls for cls, code in WIRE_CODES.items()}


def error_code(error: BaseException) -> str:
    """The wire code of ``error``: that of the most specific class of it in ``WIRE_CODES``."""
    for cls in type(error).__mro__:
        code = WIRE_CODES.get(cls)
        if code is not None:
            return code
    return GENERIC_CODE


def error_from_code(code: object, message: str) -> WeightSyncError:
    """The error a peer reported under ``code`` (an unknown or missing one: ``WeightSyncError``).
    A ``StaleVersionError`` read back has no ``current``/``got``: they do not travel."""
    return _BY_CODE.get(str(code), WeightSyncError)(message)  # StaleVersionError's other arguments are keywords
