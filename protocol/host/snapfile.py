"""Snapshot files for the ``ipc_snapshot`` load strategy: one safetensors file per version.

The trainer writes ``<dir>/step_<version>.safetensors`` atomically (a temporary name,
fsync, rename), with the version also in the file's metadata; a reader therefore never
sees a half-written snapshot. ``read_snapshot`` loads a whole file and checks it
(version, names, shapes, dtypes) before the caller writes anything, so a bad file is
rejected and nothing is half-loaded. A trainer's own safetensors file (no such metadata)
is checked for being whole by ``safetensors_metadata`` and read by ``read_tensors``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from protocol.errors import CheckpointError, ConfigError, ProtocolError
from protocol.host.shm import Layout

SNAPSHOT = re.compile(r"^step_(\d+)\.safetensors$")
FORMAT = "weightsync-snapshot-1"
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


def _safetensors() -> tuple[object, object, object]:
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file
    except ImportError:
        raise ConfigError("the ipc_snapshot load strategy needs the 'safetensors' package") from None
    return safe_open, load_file, save_file


def snapshot_path(directory: Path, version: int) -> Path:
    return Path(directory) / f"step_{version}.safetensors"


def write_snapshot(tensors: Mapping[str, torch.Tensor], directory: Path, version: int) -> Path:
    """Write ``tensors`` as ``step_<version>.safetensors`` in ``directory``, atomically."""
    _, _, save_file = _safetensors()
    final = snapshot_path(directory, version)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # not matched by SNAPSHOT
    # safetensors refuses tensors that share memory (tied weights): each name gets its own copy
    owned = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
    try:
        save_file(owned, str(tmp), metadata={"format": FORMAT, "version": str(version)})  # type: ignore[operator]
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def newest_snapshot(directory: Path, after: int | None = None) -> tuple[int, Path] | None:
    """The newest ``step_<version>.safetensors`` in ``directory`` newer than ``after``."""
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := SNAPSHOT.match(p.name))]
    found = [f for f in found if after is None or f[0] > after]
    return max(found) if found else None


def read_snapshot(path: Path, layout: Layout | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Load a whole snapshot file and check it: its version metadata matches its name and,
    given ``layout``, every name, shape and dtype fits (floating dtypes may differ; they
    are cast on the way in). Raises ``ProtocolError`` / ``MetadataMismatchError``."""
    safe_open, load_file, _ = _safetensors()
    m = SNAPSHOT.match(Path(path).name)
    if m is None:
        raise ProtocolError(f"{path}: not a step_<version>.safetensors snapshot")
    with safe_open(str(path), framework="pt") as f:  # type: ignore[operator]
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT or meta.get("version") != m.group(1):
        raise ProtocolError(f"{path}: metadata {meta!r:.120} does not say version {m.group(1)} of {FORMAT}")
    tensors: dict[str, torch.Tensor] = load_file(str(path))  # type: ignore[operator]
    if layout is not None:
        layout.check(tensors, cast=True)
    return int(m.group(1)), tensors


def safetensors_metadata(path: Path, fix: str) -> dict[str, str]:
    """The metadata of the safetensors file at ``path``, once its size is the one its header
    says: ``CheckpointError`` (ending with ``fix``) for a file cut short, as one still being
    written is, or with bytes past its last tensor, or whose header is not one. Reads the
    header only."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, shorter than a safetensors header: torn, or still being written: {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CheckpointError(f"{path}: its header says {n} bytes of header, over {MAX_HEADER}: not a safetensors file, or torn: {fix}")
        if 8 + n > size:
            raise CheckpointError(f"{path}: {size} bytes, its header alone says {8 + n}: torn, or still being written: {fix}")
        try:
            header = json.loads(f.read(n))
            entries = [v for k, v in header.items() if k != "__metadata__"]
            end = max((int(v["data_offsets"][1]) for v in entries), default=0)
            meta = header.get("__metadata__") or {}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path}: its header is not a safetensors header ({type(e).__name__}: {e}): torn? {fix}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its header's __metadata__ is not a map: torn? {fix}")
    if size != 8 + n + end:
        state = "torn, or still being written" if size < 8 + n + end else "bytes past its last tensor: torn"
        raise CheckpointError(f"{path}: {size} bytes, its header says {8 + n + end}: {state}: {fix}")
    return {str(k): str(v) for k, v in meta.items()}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, whatever its metadata (a trainer's own file)."""
    _, load_file, _ = _safetensors()
    tensors: dict[str, torch.Tensor] = load_file(str(path))  # type: ignore[operator]
    return tensors
