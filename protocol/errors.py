"""The error family every weightsync failure belongs to.

Callers catch ``WeightSyncError`` for everything, or one of the narrower classes
for what they can act on: a bad message (``ProtocolError``), corrupted bytes
(``IntegrityError``), two models that do not match (``MetadataMismatchError``),
an update that does not apply on top of the current version
(``StaleVersionError``), a setting that cannot work here (``ConfigError``; an engine
whose loader transforms a tensor: ``PlacementError``), or a
receiver that kept refusing its resyncs and was given up on (``ResyncLimitError``).
"""

from __future__ import annotations


class WeightSyncError(Exception):
    """Base of every error raised by weightsync."""


class ProtocolError(WeightSyncError):
    """A message is malformed: wrong frame count, bad header, bad index, bad size."""


class IntegrityError(WeightSyncError):
    """A buffer's bytes do not match the checksum its header announced."""


class MetadataMismatchError(WeightSyncError):
    """Sender and receiver models disagree on keys or shapes; names the first offending key."""


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
    """A setting is invalid, or needs a package or device that is not available."""


class LayoutError(WeightSyncError, ValueError):
    """A tensor cannot be viewed in the 2-D COO layout the patch format needs."""


class PlacementError(ConfigError):
    """A checkpoint tensor's place in an engine's runtime parameters cannot be patched
    element by element (its loader transforms the values); names the tensor."""


class SharedMemoryError(WeightSyncError):
    """A shared-memory region is missing or malformed, or a writer that crashed left it torn."""


class StateError(WeightSyncError):
    """A control call does not fit the receiver's state (``update_weights`` while not
    paused, waking the weights while the KV cache sleeps): change the state, then retry."""


class ResyncLimitError(WeightSyncError):
    """A receiver refused every resync of a run of them (each NACKed, no ACK between): the
    server stopped serving it rather than send whole models forever. Something on that
    receiver's side (its limits, its wire, a version it holds that the server has not)
    needs a look: reconnecting would only start the same run again."""
