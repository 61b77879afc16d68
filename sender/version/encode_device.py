"""The device encoder: a part's changes coded where they live, moved to the host in one copy.

Coded one by one, each sparse tensor would cost a host sync (its payload's size), a copy to
the host of its own and some 300 kernel launches. Here a part's sparse changes are coded by
the device codec as one batch (``devicecodec.prepare``: a fixed number of ops for the part,
then ONE host sync reads every payload's size), written with the part's whole tensors into
one device buffer, and that buffer goes to host memory in ONE copy on the copy stream
(``CopyStream.to_host``: pinned memory from torch's caching host allocator, so a version's
buffers are the blocks the versions before it freed once their frames were sent). Each
entry's frame is a view of that host buffer: nothing is copied again before the socket.

On CPU tensors (the tests, and a forced ``patch.codec: device``) the same code runs: the
buffer is host memory already and the copy is skipped. The dense decision is the
compare's (``changes.dense_rule``, applied as it counted); the one made here is that a
payload no smaller than its tensor sends the tensor whole instead, as the host encoder does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from protocol.codec import devicecodec
from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import EncodedTensor, pack_entry
from protocol.errors import ConfigError
from protocol.timing import DeviceSpan
from protocol.wire.framing import Encoding, Role, ValueEncoding

from ..diff.changes import Changes, whole
from ..stats import SyncStats
from ..streams import CopyStream


@dataclass(frozen=True)
class _Placed:
    """Where one entry's bytes lie in its part's buffer, and how they are made."""

    at: slice
    coded: bool  # a device-coded payload, else the whole tensor
    dense: torch.Tensor | None


def to_host(stream: CopyStream, buffer: torch.Tensor, stats: SyncStats | None = None) -> torch.Tensor:
    """``buffer`` in host memory, waited for: a part's one copy from the device (none on
    CPU), its device time added to ``stats.d2h_seconds``."""
    span = DeviceSpan(buffer.device) if buffer.device.type == "cuda" else None
    host, event = stream.to_host(buffer, span=span)
    if event is not None:
        event.synchronize()
    if stats is not None and span is not None:
        stats.d2h_seconds += span.seconds()
    return host


class DeviceEncoder:
    """Codes every sparse entry of a part with the device codec (``Encoding.BLOCKS``), a
    part at once: one host sync for the sizes and one copy to the host a part and device."""

    streams = False
    on_host = False

    def __init__(self, stream: Callable[[torch.device], CopyStream]) -> None:
        self._stream = stream  # the snapshot's copy stream of a device

    def warm_up(self, dtypes: Iterable[torch.dtype]) -> None:
        """Nothing to compile: batched torch operations, no numba."""

    def encode_one(self, changes: Changes) -> EncodedTensor:
        return self.encode([changes])[0]

    def encode(self, changes: list[Changes], stats: SyncStats | None = None) -> list[EncodedTensor]:
        entries: list[EncodedTensor | None] = [None] * len(changes)
        by_device: dict[torch.device, list[int]] = {}
        for i, c in enumerate(changes):
            c.wait()
            held = c.flat if c.flat is not None else c.dense
            if held is None:
                raise ConfigError(f"tensor {c.key}: changes with neither positions nor a whole copy")
            by_device.setdefault(held.device, []).append(i)
        for device, ids in by_device.items():
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                for i, entry in zip(ids, self._encode_on(device, [changes[i] for i in ids], stats)):
                    entries[i] = entry
        done = [e for e in entries if e is not None]
        assert len(done) == len(changes), "every change has its device's entry"
        return done

    def _encode_on(self, device: torch.device, changes: list[Changes], stats: SyncStats | None) -> list[EncodedTensor]:
        sparse = [c for c in changes if c.flat is not None]
        sizes: dict[int, int] = {}
        prepared = None
        if sparse:
            assert all(c.new is not None and c.old is not None for c in sparse)
            prepared = devicecodec.prepare([c.flat for c in sparse], [c.new for c in sparse], [c.old for c in sparse])  # type: ignore[misc]
            sizes = dict(zip(map(id, sparse), prepared.sizes()))  # the part's one host sync
        staged = device.type == "cuda"  # whole tensors join the part's one copy (on CPU they are host memory already)
        placed: list[_Placed] = []
        at = 0
        for c in changes:
            nbytes = sizes.get(id(c))
            dense = c.dense
            if nbytes is not None and (dense is None or nbytes < dense.numel() * dense.element_size()):
                placed.append(_Placed(slice(at, at + nbytes), True, None))
                at += devicecodec.aligned(nbytes)
            else:
                assert dense is not None
                size = dense.numel() * dense.element_size() if staged else 0
                placed.append(_Placed(slice(at, at + size), False, dense))
                at += devicecodec.aligned(size)
        # A payload that lost to its whole tensor is still written (every payload is, in one
        # go), past the part's end, where nothing copies it.
        extra = {id(c): devicecodec.aligned(sizes[id(c)]) for c, p in zip(changes, placed) if id(c) in sizes and not p.coded}
        buffer = torch.zeros(at + sum(extra.values()) + devicecodec.slack(), dtype=torch.uint8, device=device)
        if prepared is not None:
            starts, spare = [], at
            for c, p in zip(changes, placed):
                if id(c) in sizes:
                    starts.append(p.at.start if p.coded else spare)
                    spare += extra.get(id(c), 0)
            prepared.write(buffer, starts)
        for p in placed:
            if staged and p.dense is not None and p.dense.numel():
                buffer[p.at].view(p.dense.dtype).copy_(p.dense.reshape(-1))
        host = to_host(self._stream(device), buffer[:at], stats) if at else buffer
        entries = []
        for c, p in zip(changes, placed):
            if p.coded:
                entries.append(pack_entry(c.key, Encoding.BLOCKS, ValueEncoding.ULP, c.nnz, {Role.VALUES: host[p.at]}, Codec.NONE, c.group))
            elif staged and p.dense is not None:
                entries.append(whole(c, host[p.at].view(p.dense.dtype)))
            else:
                assert p.dense is not None
                entries.append(whole(c, p.dense))
        return entries
