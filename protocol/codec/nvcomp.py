"""nvCOMP LZ4 on the GPU (optional extra ``gpu``: ``nvidia-nvcomp-cu12`` for CUDA 12 builds of
torch; ``gpu-cu13``: ``nvidia-nvcomp-cu13`` for CUDA 13 builds, such as torch 2.11+cu130).

Buffers are compressed on the CUDA device that holds them, in nvCOMP's native
bitstream (it carries its own sizes), and copied to the host for the frame; a host
buffer (the entropy coder's side tables: its counts tables and escapes are built on the
CPU) is first copied to the current CUDA device (the sender packs each tensor with the
device of its other buffers current). The
receiver copies a frame to its CUDA device and decodes it there. Codec objects are
not thread-safe, so each call makes its own, bound to torch's current stream.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.errors import ConfigError, IntegrityError
from protocol.wire.buffers import Buffer, buffer_tensor


def require() -> Any:
    """Import nvCOMP and check that a CUDA device is usable; ``ConfigError`` names what is missing."""
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found, attr-defined, unused-ignore]
    except ImportError:
        raise ConfigError(
            "compression 'nvcomp_lz4' needs nvCOMP: the package nvidia-nvcomp-cu12 for a CUDA 12 torch "
            "(pip install 'weightsync[gpu]') or nvidia-nvcomp-cu13 for a CUDA 13 torch (pip install 'weightsync[gpu-cu13]')"
        ) from None
    if not torch.cuda.is_available():
        raise ConfigError("compression 'nvcomp_lz4' needs a CUDA device, and torch sees none")
    return nvcomp


def _codec(nvcomp: Any, device: torch.device) -> Any:
    stream = torch.cuda.current_stream(device).cuda_stream
    return nvcomp.Codec(algorithm="LZ4", device_id=device.index or 0, cuda_stream=stream), stream


def _compress_device() -> torch.device:
    """Where a host buffer is compressed: the current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


def placed(data: torch.Tensor) -> torch.Tensor:
    """``data`` on the device it is compressed on: its own CUDA device, or, for a host
    tensor, a copy on ``_compress_device()``."""
    if data.device.type == "cuda":
        return data
    return data.to(_compress_device())


class Lz4Compressor:
    def compress(self, data: torch.Tensor) -> Buffer:
        nvcomp = require()
        data = placed(data)
        codec, stream = _codec(nvcomp, data.device)
        encoded = codec.encode(nvcomp.as_array(data, cuda_stream=stream))
        out = torch.from_dlpack(encoded).view(torch.uint8).reshape(-1)
        return out.cpu().numpy().data.toreadonly()

    def decompress(self, data: Buffer, nbytes: int, device: torch.device) -> torch.Tensor:
        nvcomp = require()
        if device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        src = buffer_tensor(data, torch.uint8, (len(data),)).to(device)
        codec, stream = _codec(nvcomp, device)
        try:
            decoded = codec.decode(nvcomp.as_array(src, cuda_stream=stream), data_type="|u1")
        except (RuntimeError, ValueError) as e:
            raise IntegrityError(f"nvcomp_lz4 buffer does not decompress: {e}") from None
        out = torch.from_dlpack(decoded).view(torch.uint8).reshape(-1)
        if out.numel() != nbytes:
            raise IntegrityError(f"nvcomp_lz4 buffer decompressed to {out.numel()} bytes, expected {nbytes}")
        return out.clone()  # own the memory: the nvcomp array is freed with the codec
