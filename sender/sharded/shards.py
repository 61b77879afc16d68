"""A sharded trainer's compare, rank by rank: each rank compares its own shard of each tracked
tensor with its own shard of the snapshot and encodes the changes as span entries in the
full tensor's flat coordinates (the wire: ``protocol/codec/spans.py``). Nothing
here gathers a tracked tensor or makes a collective.

* ``local_range``: the flat elements [lo, hi) of the full tensor a rank's shard holds, for a
  DTensor on a 1-D mesh placed ``Shard(0)`` (rows, chunked as torch chunks them: the last
  shard may be shorter, trailing ones empty) or ``Replicate`` (the whole tensor, compared by
  the mesh's rank 0 alone; ``None`` on the others), and for a plain tensor (a buffer FSDP2
  leaves whole on every rank: as ``Replicate``). Other placements are a ``ConfigError``.
* ``ShardCompare``: one rank's snapshot shards (at the receivers' dtypes, on the shards'
  device) and its compare: ``capture``, then ``collect`` at every version, the rank's span
  entries. Its shards are compared by the unsharded build's own compare (``make_compare``:
  the host compare's fused kernels, or the device compare's runs) as plain 1-D tensors of
  hi - lo elements, so NaN payloads, -0.0 and the dense rule (per shard) are what the
  unsharded build does, and encoded by its own encoders (host or device codec, as
  ``patch.codec`` says), each entry then given its span: an entry coded as a 1-D tensor of
  hi - lo elements is exactly a span entry of [lo, hi) (``encode_span``/``encode_dense_span``).

Used by ``shard_build.ShardBuild``, one rank's side of ``ShardedSync``'s sharded build.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.codec.spans import as_span
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions
from protocol.config import InitSyncConfig, PatchConfig
from protocol.errors import ConfigError, MetadataMismatchError, WeightSyncError
from protocol.state import ModelState, is_dtensor
from protocol.wire.framing import Encoding
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span

from ..diff.compare import make_compare
from ..diff.snapshot import Snapshot
from ..plan import SyncPlan
from ..stats import SyncStats
from ..version.encode import Encoder, make_encoder

COMPARING_RANK = 0  # the mesh rank that compares a replicated tensor (and a plain one)


def row_range(shape: Sequence[int], rank: int, world: int) -> tuple[int, int]:
    """The flat range [lo, hi) of a tensor of ``shape`` that ``rank`` of ``world`` holds when
    its rows (dim 0) are chunked as ``torch.chunk`` (and DTensor's ``Shard(0)``) chunk them:
    ceil(rows / world) rows a rank, the last shard shorter, trailing ones empty (lo == hi)."""
    if not shape:
        raise ConfigError("a 0-dim tensor has no rows to shard")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} outside a world of {world}")
    rows = shape[0]
    row_numel = 1
    for d in shape[1:]:
        row_numel *= d
    chunk = -(-rows // world)
    start = min(rows, chunk * rank)
    end = min(rows, start + chunk)
    return start * row_numel, end * row_numel


def local_range(t: torch.Tensor, key: str = "tensor", *, rank: int | None = None) -> tuple[int, int] | None:
    """The flat elements [lo, hi) of the full tensor that this rank's shard of ``t`` holds and
    compares (lo == hi: a shard with no rows), or None where another rank compares them all.

    A DTensor on a 1-D mesh: ``Shard(0)`` -> its rows' range, from the global shape, the
    mesh's size and this rank's place in it; ``Replicate`` -> the whole tensor on the mesh's
    rank ``COMPARING_RANK``, None elsewhere. A plain tensor (not sharded, the same on every
    rank) is compared as a replicated one, ``rank`` (default: this process's rank in the
    default group, 0 without torch.distributed) saying which rank this is; for a DTensor,
    ``rank`` overrides its mesh coordinate. Anything else (``Shard`` of another dim, a mesh
    of more dims, ``Partial``) is a ``ConfigError`` naming ``key``: those keep the gathering build.
    """
    numel = t.numel()
    if not is_dtensor(t):
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        return (0, numel) if rank == COMPARING_RANK else None
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1:
        raise ConfigError(
            f"{key!r}: a DTensor on a {mesh.ndim}-D mesh (placements {placements}) is not compared shard by shard: "
            "only a 1-D mesh (Shard(0) or Replicate) is; use the gathering build"
        )
    (placement,) = placements
    if rank is None:
        rank = mesh.get_local_rank()
    if type(placement) is Replicate:
        return (0, numel) if rank == COMPARING_RANK else None
    if type(placement) is Shard and placement.dim == 0 and t.dim() > 0:
        return row_range(tuple(t.shape), rank, mesh.size())
    raise ConfigError(
        f"{key!r}: placement {placement} is not compared shard by shard (only Shard(0) and Replicate are); use the gathering build"
    )


@dataclass(frozen=True)
class ShardKey:
    """A tracked tensor this rank compares: its key, the receivers' ordinal and dtype of it,
    the flat elements of the full tensor its shard holds (``span``: a range [lo, hi) under
    FSDP2, a strided block for a Megatron row-parallel shard; not empty), and where this rank
    holds them: ``source``, the rank's tensor (its ``tensors()`` key; "" for ``key`` itself),
    and ``local``, which of that tensor's local elements, flat, in the span's order (None: all
    of them; a Megatron layout's landing: ``probe.Landing``)."""

    key: str
    ordinal: int
    dtype: torch.dtype
    span: Span
    source: str = ""
    local: Span | None = None

    @property
    def numel(self) -> int:
        return self.span.numel

    @property
    def label(self) -> str:
        """A name unique among one rank's keys (a tensor may be fed by several of its tensors)."""
        return self.key if not self.source else f"{self.key}<-{self.source}"


def shard_keys(
    tensors: Mapping[str, torch.Tensor],
    keys: Iterable[str],
    ordinals: Mapping[str, int],
    dtypes: Mapping[str, torch.dtype],
    *,
    rank: int | None = None,
) -> list[ShardKey]:
    """The ``ShardKey`` of each of ``keys`` (tracked, without aliases, in order) whose shard
    this rank compares: those with elements here (``local_range``), at the receivers'
    ``ordinals`` and ``dtypes``."""
    out = []
    for key in keys:
        span = local_range(tensors[key], key, rank=rank)
        if span is not None and span[0] < span[1]:
            out.append(ShardKey(key, ordinals[key], dtypes[key], Span.range(*span)))
    return out


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``t`` (a DTensor's local shard, a plain tensor itself), flat:
    never gathered."""
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return local.detach().reshape(-1)


class ShardCompare:
    """One rank's compare of its shards (``keys``) of a sharded model: the snapshot of each
    shard at the receivers' dtype on the shards' device, and at every version the rank's
    changes as span entries (``collect``). ``tensors``: the model's tensors as this rank holds
    them (DTensors or plain local tensors, each with ``ShardKey.numel`` elements here).

    ``options`` and ``compare`` are ``patch.options()`` and ``patch.codec`` (``from_config``):
    the host or device compare, the host or device codec, as the unsharded build picks them
    for tensors where these shards live. Small tensors are not grouped: a span entry is never
    grouped. One call at a time."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], keys: Sequence[ShardKey], options: PatchOptions, *, compare: str = "auto"
    ) -> None:
        self.keys = list(keys)
        self.options = options
        local = self._locals(tensors)
        # The unsharded build's plan over this rank's shards as 1-D tensors of their own: its
        # ordinals are positions in ``keys`` (made the receivers' by ``_as_span``).
        names = tuple(k.label for k in self.keys)
        metadata = ModelMetadata(names, tuple((k.numel,) for k in self.keys), tuple(k.dtype for k in self.keys))
        self.plan = SyncPlan(ModelState(local, list(names)), metadata, InitSyncConfig(enabled=False))
        devices = {t.device for t in local.values()}
        if len(devices) > 1:
            raise ConfigError(f"a rank's shards are on several devices ({sorted(map(str, devices))}); one device a rank")
        on = next(iter(devices), torch.device("cpu"))
        if on.type == "cuda" and on.index not in (None, torch.cuda.current_device()):
            # the snapshot lives beside the shards: Snapshot("cuda") is on the current device
            raise ConfigError(f"the shards are on {on}, the current CUDA device is {torch.cuda.current_device()}: torch.cuda.set_device first")
        self.snapshot = Snapshot("cuda" if on.type == "cuda" else "cpu")
        resolved = options.resolved(self.plan.on_cuda)
        self.encoder: Encoder = make_encoder(resolved, self.snapshot.stream)
        # as the patch builder: changes on CUDA go to pinned host memory for the host codec
        self.compare = make_compare(compare, self.plan, options, self.snapshot, {}, stage=self.encoder.streams)
        self.diverged = False  # a collect failed midway: the snapshot may be ahead of the receivers (recapture)

    @classmethod
    def from_config(cls, tensors: Mapping[str, torch.Tensor], keys: Sequence[ShardKey], config: PatchConfig) -> ShardCompare:
        """The compare ``config`` (a sender's ``patch`` settings) asks for."""
        return cls(tensors, keys, config.options(), compare=config.codec)

    def _locals(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each key's local elements, flat, checked to number what its span says: a view where
        they are contiguous in their tensor; where strided (a Megatron rank's query groups in
        its fused QKV), copied, one ``cat`` for all the keys of one run length, dtype and device
        (kernels a version per such group, not per key)."""
        out: dict[str, torch.Tensor] = {}
        strided: dict[tuple[int, torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
        for k in self.keys:
            t = tensors.get(k.source or k.key)
            if t is None:
                raise MetadataMismatchError(f"key {k.source or k.key!r} was tracked at init but is missing from the model now")
            local = local_shard(t)
            if k.local is not None:
                if local.numel() < k.local.hi:
                    raise MetadataMismatchError(f"{k.source!r} holds {local.numel()} elements here, fewer than its map reads ({k.local.hi})")
                local = k.local.of(local)
            if local.numel() != k.numel:
                raise MetadataMismatchError(
                    f"key {k.key!r}: this rank holds {local.numel()} elements, its span {k.span} has {k.numel}"
                )
            if local.is_contiguous():
                out[k.label] = local.reshape(-1)
            else:
                strided.setdefault((local.shape[-1], local.dtype, local.device), []).append((k.label, local))
        for views in strided.values():
            joined = torch.cat([v for _, v in views]) if len(views) > 1 else views[0][1].contiguous()
            at = 0
            for label, v in views:
                out[label] = joined[at:at + v.shape[0]].reshape(-1)
                at += v.shape[0]
        return {k.label: out[k.label] for k in self.keys}

    def capture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the snapshot of this rank's shards: what the receivers hold of them after the bootstrap."""
        self.compare.capture(self._locals(tensors))
        self.diverged = False

    def recapture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The snapshot anew, in place (receivers resynced to ``tensors`` hold it)."""
        self.compare.recapture(self._locals(tensors))
        self.diverged = False

    def collect(self, tensors: Mapping[str, torch.Tensor], stats: SyncStats | None = None) -> list[EncodedTensor]:
        """This rank's changes since the snapshot as span entries, encoded, in ``keys`` order
        (none for a shard without changes; a shard whose changes go dense by the dense rule
        as a dense span of all its elements); the snapshot moves on to ``tensors``. ``stats``
        (optional) gets this rank's counts and timings."""
        if self.diverged:
            raise WeightSyncError("this rank's snapshot diverged from the receivers in a failed collect: recapture() first")
        stats = SyncStats(0, "patch") if stats is None else stats
        local = self._locals(tensors)
        self.diverged = True  # until the changes are encoded
        changes = self.compare.collect(local, stats, lambda c: c)
        entries = [self._as_span(e) for e in self.encoder.encode(changes, stats)]
        stats.tensors_dense += sum(1 for e in entries if e.encoding is Encoding.DENSE)
        self.diverged = False
        return entries

    def _as_span(self, entry: EncodedTensor) -> EncodedTensor:
        """An entry of a shard, coded as a 1-D tensor of its local elements, as the span
        entry of its ``ShardKey.span`` of its tensor under the receivers' ordinal (``spans.as_span``)."""
        k = self.keys[entry.key]
        return as_span(entry, k.span, k.ordinal)
