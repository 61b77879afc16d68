"""Buffer compressors and byte shuffling.

Every buffer on the wire is a 1-D uint8 tensor that may be byte-shuffled (the bytes of
each element regrouped by significance, so the near-constant high bytes of indices and
float exponents compress well) and then compressed. Decompression is bounded by the size
the header announced, so a hostile frame cannot make the receiver allocate more.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Protocol

import lz4.block
import torch
import zstandard

from protocol.errors import ConfigError, IntegrityError, ProtocolError
from protocol.wire.buffers import Buffer, buffer_tensor, tensor_view


class Codec(IntEnum):
    """Wire codes of the compressors (protocol constants: append only)."""

    NONE = 0
    LZ4 = 1
    ZSTD = 2
    NVCOMP_LZ4 = 3


COMPRESSION_NAMES: dict[str, Codec] = {
    "none": Codec.NONE,
    "lz4": Codec.LZ4,
    "zstd": Codec.ZSTD,
    "nvcomp_lz4": Codec.NVCOMP_LZ4,
}

ZSTD_LEVEL = 3


class _Compressor(Protocol):
    def compress(self, data: torch.Tensor) -> Buffer: ...
    def decompress(self, data: Buffer, nbytes: int, device: torch.device) -> torch.Tensor: ...


def parse_compression(name: str, transport_device: str = "cpu", key: str = "patch.compression") -> Codec:
    """Validate a ``compression`` setting (the config's ``key``) against the transport device
    and installed packages."""
    if name not in COMPRESSION_NAMES:
        raise ConfigError(f"{key}: unknown compression {name!r}; choose one of {sorted(COMPRESSION_NAMES)}")
    codec = COMPRESSION_NAMES[name]
    if codec is Codec.NVCOMP_LZ4:
        if transport_device != "cuda":
            raise ConfigError(
                f"{key}: 'nvcomp_lz4' compresses on the GPU and needs transport_device: cuda, "
                f"got transport_device: {transport_device}"
            )
        from protocol.codec import nvcomp

        nvcomp.require()
    return codec


def compress(data: torch.Tensor, codec: Codec) -> Buffer:
    """Compress a 1-D uint8 tensor into host bytes ready for a frame."""
    return _compressor(codec).compress(data)


def decompress(data: Buffer, codec: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Decompress a frame into exactly ``nbytes`` bytes (1-D uint8 on ``device``)."""
    try:
        out = _compressor(Codec(codec)).decompress(data, nbytes, device)
    except ValueError as e:  # Codec(codec) on an unknown code
        raise ProtocolError(f"unknown compression code {codec!r}") from e
    if out.numel() != nbytes:
        raise IntegrityError(f"buffer decompressed to {out.numel()} bytes, header announced {nbytes}")
    return out


def shuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Regroup bytes by significance: all first bytes, then all second bytes, ..."""
    if itemsize <= 1 or data.numel() == 0:
        return data
    return data.view(-1, itemsize).t().contiguous().view(-1)


def unshuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize <= 1 or data.numel() == 0:
        return data
    return data.view(itemsize, -1).t().contiguous().view(-1)


class _NoCompression:
    def compress(self, data: torch.Tensor) -> Buffer:
        return tensor_view(data.cpu())

    def decompress(self, data: Buffer, nbytes: int, device: torch.device) -> torch.Tensor:
        return buffer_tensor(data, torch.uint8, (len(data),)).to(device)


class _Lz4:
    def compress(self, data: torch.Tensor) -> Buffer:
        return lz4.block.compress(tensor_view(data.cpu()), store_size=False)

    def decompress(self, data: Buffer, nbytes: int, device: torch.device) -> torch.Tensor:
        try:
            raw = lz4.block.decompress(data, uncompressed_size=nbytes)
        except lz4.block.LZ4BlockError as e:
            raise IntegrityError(f"lz4 buffer does not decompress: {e}") from None
        return buffer_tensor(raw, torch.uint8, (len(raw),)).to(device)


class _Zstd:
    """zstd with one compression and one decompression context per thread, reused.

    Creating a ``ZstdCompressor`` costs more than compressing a small buffer, and an
    instance must not be used by two threads at once (zstandard's rule), so each codec
    thread keeps its own."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "compressor", None)
        if c is None:
            c = self._local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "decompressor", None)
        if d is None:
            d = self._local.decompressor = zstandard.ZstdDecompressor()
        return d

    def compress(self, data: torch.Tensor) -> Buffer:
        return self._compressor().compress(tensor_view(data.cpu()))

    def decompress(self, data: Buffer, nbytes: int, device: torch.device) -> torch.Tensor:
        try:
            # Read at most one byte more than announced: a lying frame cannot inflate us.
            with self._decompressor().stream_reader(data) as reader:
                raw = reader.read(nbytes + 1)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"zstd buffer does not decompress: {e}") from None
        return buffer_tensor(raw, torch.uint8, (len(raw),)).to(device)


def _compressor(codec: Codec) -> _Compressor:
    if codec is Codec.NVCOMP_LZ4:
        from protocol.codec import nvcomp

        return nvcomp.Lz4Compressor()
    return _CPU[codec]


_CPU: dict[Codec, _Compressor] = {Codec.NONE: _NoCompression(), Codec.LZ4: _Lz4(), Codec.ZSTD: _Zstd()}
