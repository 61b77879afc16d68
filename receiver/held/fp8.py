"""An engine worker that holds block-fp8 weights declares them so at the handshake.

The trainer names its weights ``X`` in its own precision; a block-fp8 engine (vLLM with a
``quantization_config`` of ``quant_method: fp8`` and a ``weight_block_size``) holds the
quantized ones as ``X`` in ``float8_e4m3fn`` beside ``X_scale_inv``, fp32, one scale per
block, [ceil(N/bn), ceil(K/bk)] ([E, ...] for an expert stack). Which of the trainer's
tensors are held so is not guessed from names: one recorded probe load
(``layout.landing_dtypes``) shows the dtype of the parameters each lands in, and only those
landing in fp8 are declared fp8, each followed by its scales. The receiver then holds the
bytes and scales exactly as the engine does, and the sender, seeing fp8 in HELLO, sends
fp8 bytes and scales (a trainer that sends an fp8 checkpoint itself is taken as it is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError
from protocol.quant import FP8, SCALE_SUFFIX, Fp8Format, scale_name, scale_shape

from .kinds import Rules

Declared = list[tuple[str, tuple[int, ...], torch.dtype]]


def fp8_format(block: Sequence[Any], scale_format: str = "fp32") -> Fp8Format:
    """An engine's block-fp8 format from its quantization config, checked: ``ConfigError``
    for a block that is not two positive integers or a scale format but fp32 / ue8m0."""
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ConfigError(f"a block-fp8 engine's weight_block_size must be two positive integers, got {list(block)!r}")
    if scale_format not in ("fp32", "ue8m0"):
        raise ConfigError(f"a block-fp8 engine's scale format must be 'fp32' or 'ue8m0', got {scale_format!r}")
    return Fp8Format((block[0], block[1]), scale_format)  # type: ignore[arg-type]


def with_fp8(config: Any, fmt: Fp8Format | None) -> Any:
    """The receiver's config with the engine's block-fp8 format in ``fp8`` (what its HELLO
    declares, ``Hello.quant``): the engine's own quantization config wins over the file's."""
    if fmt is None:
        return config
    loaded: SyncConfig = load_config(config)
    return dataclasses.replace(loaded, fp8=loaded.fp8.with_format(fmt))


def _scales_of(name: str, shape: Sequence[int], fmt: Fp8Format) -> tuple[int, ...]:
    if len(shape) not in (2, 3):
        raise MetadataMismatchError(f"{name!r} lands in fp8 parameters but has shape {tuple(shape)}: block fp8 holds 2-D "
                                    "[N, K] weights and 3-D [E, N, K] expert stacks only")
    return scale_shape(tuple(shape), fmt.block)


def with_scales(names: dict[str, str], declared: Sequence[str]) -> dict[str, str]:
    """``names`` (trainer name -> checkpoint name) with the scales ``declared`` adds: the
    trainer's name of ``X_scale_inv`` is its name of ``X`` with the same suffix."""
    out = dict(names)
    checkpoint = set(names.values())
    trainer = {c: t for t, c in names.items()}
    for name in declared:
        base = name.removesuffix(SCALE_SUFFIX)
        if name != base and name not in checkpoint and base in trainer:
            out[scale_name(trainer[base])] = name
    return out


def declare_fp8(model: nn.Module, declared: Declared, fmt: Fp8Format, rules: Rules) -> Declared:
    """``declared`` (checkpoint name, shape, dtype as the trainer would send it) as this
    fp8 engine holds it: each tensor landing in fp8 parameters declared fp8 and followed
    by its scales (fp32, the block shape), unless the trainer declares those itself (an fp8
    checkpoint sent as it is), every other tensor as given. Writes probe values into the
    model (``landing_dtypes``). ``MetadataMismatchError`` for a trainer's scales whose weight
    is not held in fp8, or of another shape than the engine's blocks give."""
    from .layout import landing_dtypes

    landing = landing_dtypes(model, declared, rules)
    names = {name: (shape, dtype) for name, shape, dtype in declared}
    fp8 = {name for name, _, _ in declared if landing.get(name) == FP8}
    odd = sorted(name for name, _, _ in declared if landing.get(name) is not None and landing[name].itemsize == 1
                 and landing[name] != FP8 and landing[name] != names[name][1])
    if odd:
        raise MetadataMismatchError(f"{odd[:4]} land in 1-byte parameters of another format than float8_e4m3fn: not block fp8")
    out: Declared = []
    for name, shape, dtype in declared:
        base = name.removesuffix(SCALE_SUFFIX)
        if name.endswith(SCALE_SUFFIX) and base in names:
            if base not in fp8:
                raise MetadataMismatchError(f"the trainer sends {name!r}, but the engine does not hold {base!r} in fp8")
            want = _scales_of(base, names[base][0], fmt)
            if tuple(shape) != want:
                raise MetadataMismatchError(f"the trainer's {name!r} has shape {tuple(shape)}; the engine's "
                                            f"{list(fmt.block)} blocks of {base!r} {tuple(names[base][0])} make {want}")
            continue  # declared after its weight
        if name not in fp8:
            out.append((name, shape, dtype))
            continue
        out.append((name, shape, landing[name]))
        out.append((scale_name(name), _scales_of(name, shape, fmt), torch.float32))
    return out
