"""The trainer's model as a block-fp8 rollout holds it: what the sender snapshots, diffs,
bootstraps and digests when a receiver declares fp8 weights at its HELLO.

The rollout's metadata names each weight it holds as ``float8_e4m3fn`` with a float32
``<weight>_scale_inv`` beside it (``protocol.quant.declared_fp8``); the trainer holds only
the weight, in bf16 or fp32. ``Fp8View.state`` is the trainer's state with each such weight
in fp8 and its scales after it, so the rest of the sender (snapshot, bitwise compare,
encoders, buckets) sees ordinary tensors: fp8 bytes diff like any 1-byte dtype, scales like
any fp32 tensor. ``Fp8View.tensors`` turns each version's trainer tensors into those.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from protocol.errors import MetadataMismatchError
from protocol.quant import FP8, BlockFp8, Fp8Format, declared_fp8, quantize_many, scale_shape
from protocol.state import ModelState, materialize, sync_keys
from protocol.wire.metadata import ModelMetadata


class Fp8View:
    """``trainer`` with the weights of ``pairs`` (weight -> scales key) quantized by ``settings``.

    ``state.tensors`` holds shape-only (``meta``) tensors for the quantized weights and their
    scales: the sender keeps no second copy of the model for them, and anything that reads
    them as data instead of through ``tensors`` fails loudly. Immutable once built: safe to
    share between threads; ``tensors`` is pure.
    """

    def __init__(self, trainer: ModelState, pairs: Mapping[str, str], settings: BlockFp8) -> None:
        self.settings, self.pairs = settings, dict(pairs)
        self.bases = {scales: weight for weight, scales in self.pairs.items()}
        tensors: dict[str, torch.Tensor] = {}
        self.devices: dict[str, torch.device] = {}
        for key, t in trainer.tensors.items():
            self.devices[key] = t.device
            if key not in self.pairs:
                tensors[key] = t
                continue
            shape = tuple(t.shape)
            tensors[key] = torch.empty(shape, dtype=FP8, device="meta")
            tensors[self.pairs[key]] = torch.empty(scale_shape(shape, settings.block), dtype=torch.float32, device="meta")
            self.devices[self.pairs[key]] = t.device
        tracked = set(trainer.tracked)
        # A tie survives only where both names are held alike (both quantized, or neither):
        # one quantized and one not are two tensors on the rollout, each sent on its own.
        aliases = {a: c for a, c in trainer.aliases.items() if (a in self.pairs) == (c in self.pairs)}
        aliases |= {self.pairs[a]: self.pairs[c] for a, c in aliases.items() if a in self.pairs}
        # the ties broken so (alias -> canonical): a caller holding only each storage once (the
        # daemon's copy before its first receiver) has the canonical name, read for both
        self.untied = {a: c for a, c in trainer.aliases.items() if a not in aliases}
        self.state = ModelState(tensors, [k for k in tensors if self.bases.get(k, k) in tracked], aliases)

    def tensors(self, trainer: Mapping[str, torch.Tensor], only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """A version's trainer tensors as the rollout holds them: every key of ``trainer``
        not quantized as given, and each quantized weight of ``only`` (rollout keys; default:
        the tracked ones read at each version) as its fp8 bytes and its scales, made in a
        few kernels per weight shape (``quantize_many``) on the weights' device."""
        wanted = sync_keys(self.state) if only is None else only
        weights = list(dict.fromkeys(self.bases.get(k, k) for k in wanted if self.bases.get(k, k) in self.pairs))
        out = {k: t for k, t in trainer.items() if k not in self.pairs}
        out |= {a: trainer[c] for a, c in self.untied.items() if a not in trainer and a not in self.pairs and c in trainer}

        def read(key: str) -> torch.Tensor:
            return materialize(trainer[key] if key in trainer else trainer[self.untied[key]])

        for weight, (q, scales) in zip(weights, quantize_many([read(weight) for weight in weights], self.settings)):
            out[weight], out[self.pairs[weight]] = q, scales
        return out


def fp8_view(trainer: ModelState, metadata: ModelMetadata, told: Fp8Format | None, settings: BlockFp8) -> Fp8View | None:
    """The view a receiver of ``metadata`` needs, None when it holds no weight in fp8.

    ``told``: the format its HELLO declares (None: ``settings``' block and scale format).
    ``MetadataMismatchError`` names the first weight that cannot be served: one the trainer
    does not hold, holds scales of already, or holds in a shape block fp8 cannot take, and
    scales whose shape the block does not give (the two sides' block sizes differ).
    """
    pairs = declared_fp8(metadata.keys, metadata.dtypes)
    if not pairs:
        return None
    settings = settings if told is None else settings.with_format(told)
    for weight, scales in pairs.items():
        t = trainer.tensors.get(weight)
        if t is None:
            raise MetadataMismatchError(f"key {weight!r} exists on the receiver (in block fp8) but not on the sender")
        if scales in trainer.tensors:
            raise MetadataMismatchError(
                f"key {weight!r}: the trainer holds {scales!r} itself; the sender quantizes the trainer's bf16/fp32 "
                "weights into the rollout's fp8 and cannot serve a model that is fp8 already"
            )
        if t.dim() not in (2, 3) or not t.is_floating_point() or t.element_size() == 1:
            raise MetadataMismatchError(
                f"key {weight!r}: the receiver holds it in block fp8 but the trainer's is {list(t.shape)} {t.dtype}; "
                "block fp8 quantizes 2-D [N, K] or 3-D [E, N, K] weights of a 16- or 32-bit float dtype"
            )
        want, held = scale_shape(tuple(t.shape), settings.block), metadata.shapes[metadata.ordinal(scales)]
        if held != want:
            raise MetadataMismatchError(
                f"key {scales!r}: the receiver holds {list(held)}; {weight!r} {list(t.shape)} in blocks of "
                f"{settings.block[0]}x{settings.block[1]} has {list(want)} (do the two sides' fp8 block sizes agree?)"
            )
    return Fp8View(trainer, pairs, settings)
