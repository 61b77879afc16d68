"""The fixed dtype allowlist of the wire and the integer views used for bitwise work.

Codes are part of the protocol: never renumber, only append. Decoders accept
only codes listed here, so untrusted input never names an arbitrary torch attribute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.errors import ConfigError, ProtocolError

_CODES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int8,
    6: torch.int16,
    7: torch.int32,
    8: torch.int64,
    9: torch.uint8,
    10: torch.bool,
    11: torch.uint16,
    12: torch.uint32,
    13: torch.uint64,
    14: torch.float8_e4m3fn,
    15: torch.float8_e5m2,
}
_BY_DTYPE: dict[torch.dtype, int] = {d: c for c, d in _CODES.items()}

# Same-width integer dtype for bitwise comparison and XOR (NaN, -0.0 compare by bits).
_BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

UNSIGNED_INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; raises ``ProtocolError`` for a dtype outside the allowlist."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} is not in the wire allowlist") from None


def dtype_from_code(code: object) -> torch.dtype:
    """The dtype for a wire code from untrusted input."""
    if type(code) is not int or code not in _CODES:
        raise ProtocolError(f"unknown dtype code {code!r}")
    return _CODES[code]


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of the same width, for bitwise views."""
    return _BITS[itemsize(dtype)]


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as signed integers of its width, for comparing bits (NaN payloads, -0.0);
    integer and bool tensors as they are."""
    if t.dtype == torch.bool or not t.dtype.is_floating_point:
        return t
    return t.view(bits_dtype(t.dtype))


def bits_at(t: torch.Tensor, at: Sequence[int]) -> list[int]:
    """``bit_view(t)``'s elements at a few flat indices of a 1-D ``t``, as Python ints: read
    through numpy on the host (a torch op per read costs more than the read)."""
    if not at:
        return []
    if t.device.type == "cpu":
        return bit_view(t).numpy()[list(at)].tolist()
    return bit_view(t[torch.tensor(list(at), device=t.device)]).tolist()


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def smallest_unsigned(max_value: int) -> torch.dtype:
    """Smallest unsigned dtype holding ``max_value`` (index downscaling)."""
    for dt, limit in zip(UNSIGNED_INDEX_DTYPES, (0xFF, 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF)):
        if max_value <= limit:
            return dt
    raise ProtocolError(f"index value {max_value} exceeds 64 bits")


def parse_float_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A config's float dtype name (``bfloat16``, ``float16``, ``float32``, ...) or None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _NAMES:
        raise ConfigError(f"unsupported float dtype {name!r}; use one of {sorted(set(_NAMES))}")
    return _NAMES[key]
