"""The encode: a version's collected ``Changes`` made into message entries.

Two implementations behind one interface, as the compare has (DESIGN.md, *Two codecs, one
pipeline*): ``HostEncoder`` codes each tensor on its own, on host threads, as soon as the
compare hands it over (numba's entropy coder, or plain buffers); ``DeviceEncoder``
(``encode_device``) codes a whole part at once with batched torch operations where the
changes live, and moves it to the host in one copy. Either decodes on any receiver: each
entry says its encoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from protocol.codec.parallel import map_ordered
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, pack_entry, raw_nbytes, sampled_differences, sparse_buffers
from protocol.wire.framing import Encoding, ValueEncoding

from ..diff import warmup
from ..diff.changes import Changes, whole
from ..stats import SyncStats
from ..streams import CopyStream
from .encode_device import DeviceEncoder


def make_encoder(options: PatchOptions, stream: Callable[[torch.device], CopyStream]) -> Encoder:
    """The encoder ``options`` (``patch.codec`` resolved) ask for: the device encoder (with
    ``stream``, the snapshot's copy stream of a device) or the host's."""
    if options.device_codec:
        return DeviceEncoder(stream)
    return HostEncoder(options)


class Encoder(Protocol):
    """What a patch builder asks of an encoder. ``encode`` may run on any thread, and
    several at once (parts of one version are encoded in order, one after another)."""

    # whether each tensor may be encoded alone as it is collected (on the builder's encoder
    # threads, beside the compare), rather than with its part
    streams: bool
    # whether it codes changes held in host memory (a compare on CUDA stages them there), or
    # where they are
    on_host: bool

    def warm_up(self, dtypes: Iterable[torch.dtype]) -> None:
        """Compile or load what the first encode of changes of these (receiver) dtypes would
        (called at capture, off the hot path)."""
        ...

    def encode_one(self, changes: Changes) -> EncodedTensor:
        """One tensor's (or group's) entry."""
        ...

    def encode(self, changes: list[Changes], stats: SyncStats | None = None) -> list[EncodedTensor]:
        """A part's entries, in order (``stats``: the version's, for the phases it times)."""
        ...


class HostEncoder:
    """Each tensor coded on its own: the host codec (or the device codec, one tensor at a
    time, where ``patch.codec: device`` asks for it on a compare that staged its changes)."""

    streams = True
    on_host = True

    def __init__(self, options: PatchOptions) -> None:
        self.options = options

    def warm_up(self, dtypes: Iterable[torch.dtype]) -> None:
        warmup.compile_encoders(set(dtypes))

    def encode(self, changes: list[Changes], stats: SyncStats | None = None) -> list[EncodedTensor]:
        return map_ordered(self.encode_one, changes)

    def encode_one(self, changes: Changes) -> EncodedTensor:
        changes.wait()
        # Host buffers nvcomp_lz4 compresses (the entropy coder's side tables) go to the device
        # of the tensor's other buffers: made current in this codec thread while it is packed.
        held = changes.flat if changes.flat is not None else changes.dense
        device = None if held is None else held.device
        with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
            return self._pack(changes)

    def _pack(self, changes: Changes) -> EncodedTensor:
        dense, nnz = changes.dense, changes.nnz
        if dense is not None and (changes.flat is None or self._goes_dense(changes, dense)):  # whole and fast
            return whole(changes, dense)
        assert changes.flat is not None and changes.new is not None and changes.old is not None
        encoding, values, buffers = sparse_buffers(changes.flat, changes.new, changes.old, changes.shape, self.options)
        if dense is not None and raw_nbytes(buffers) >= dense.numel() * dense.element_size():  # coding did not pay
            return whole(changes, dense, self.options.codec_for(Encoding.DENSE, ValueEncoding.RAW))
        return pack_entry(changes.key, encoding, values, nnz, buffers, self.options.codec_for(encoding, values), changes.group)

    def _goes_dense(self, changes: Changes, dense: torch.Tensor) -> bool:
        diffs = None
        if changes.new is not None and changes.old is not None:  # a sample of how far the values moved
            diffs = sampled_differences(changes.new, changes.old)
        return self.options.goes_dense(changes.nnz, dense.numel(), dense.element_size(), diffs)
