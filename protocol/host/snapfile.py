"""Snapshot files for the ``ipc_snapshot`` load strategy: one safetensors file per version.

The trainer writes ``<dir>/step_<version>.safetensors`` atomically (a temporary name,
fsync, rename), with the version also in the file's metadata; a reader therefore never
sees a half-written snapshot. ``read_snapshot`` loads a whole file and checks it
(version, names, shapes, dtypes) before the caller writes anything, so a bad file is
rejected and nothing is half-loaded.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import torch

from protocol.errors import ConfigError, ProtocolError
from protocol.host.shm import Layout

SNAPSHOT = re.compile(r"^step_(\d+)\.safetensors$")
FORMAT = "weightsync-snapshot-1"


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
