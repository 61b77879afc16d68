"""Zero-copy conversion between tensors and the byte buffers ZeroMQ frames carry."""

from __future__ import annotations

import warnings

import torch

from protocol.errors import ConfigError

Buffer = bytes | bytearray | memoryview


def tensor_view(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a CPU tensor's data; copies only if ``t`` is not contiguous."""
    if t.device.type != "cpu":
        raise ConfigError(f"tensor_view needs a CPU tensor, got one on {t.device}")
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.toreadonly()


def buffer_tensor(buf: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buf`` without copying; callers copy before writing to it.

    The caller has already checked that ``len(buf)`` equals ``prod(shape) * itemsize``.
    """
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # Frames are read-only; we never write through this view, only copy out of it.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
