"""The checkpoints a trainer writes into ``python -m sender --watch DIR``.

A checkpoint is ``step_<version>.safetensors`` or ``step_<version>.pt`` holding a state dict,
as trainers write them (``safetensors.torch.save_file``, ``torch.save``, a Hugging Face
``save_pretrained``'s ``model.safetensors`` renamed into place): the version is the name's.
A file ``sender.write_snapshot`` wrote says its version in its metadata too, which must then
be the name's.

Atomicity is the trainer's: it writes under a name that is not ``step_<version>.*`` and
renames the file into place, so a reader sees all of it or none. A file read while still
being written, a torn one, one named without a version, or a state that does not fit the
model is refused (``CheckpointError``, its message naming the fix), once per file as it is;
the daemon serves the version before, and reads the file again once it changes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path

import torch

from protocol.errors import CheckpointError, ConfigError, ProtocolError
from protocol.host.cli import report
from protocol.host.snapfile import FORMAT, read_snapshot, read_tensors, safetensors_metadata

log = logging.getLogger("sender")

STEP = re.compile(r"^step_(\d+)\.(pt|safetensors)$")
LOOKS_LIKE = (".safetensors", ".pt", ".pth", ".bin")  # a state dict's usual suffixes: one without a version is reported
RENAME = "write it under a temporary name (step_<version>.safetensors.tmp, say) and rename it into place"
NAMING = "the name must be step_<version>.safetensors or step_<version>.pt, <version> an integer"
State = dict[str, torch.Tensor]


def candidates(files: Iterable[Path], after: int | None) -> list[tuple[int, Path]]:
    """The checkpoints among ``files`` (a folder's listing) newer than ``after``, newest first."""
    steps = sorted(((int(m.group(1)), f) for f in files if (m := STEP.match(f.name))), reverse=True)
    return [s for s in steps if after is None or s[0] > after]


def unversioned(files: Iterable[Path]) -> list[Path]:
    """Those of ``files`` named like a state dict but not ``step_<version>.*``: a trainer's
    ``model.safetensors`` left as saved, say. Hidden files are someone's temporary ones."""
    return sorted(f for f in files if f.suffix in LOOKS_LIKE and not f.name.startswith(".") and not STEP.match(f.name))


def load(path: Path) -> State:
    """The state dict in ``path``, read whole. A safetensors file shorter or longer than its
    header says is refused before it is read; ``torch.load`` refuses a torn ``.pt`` (its zip
    directory is at the end). Raises ``CheckpointError`` for what the file's form says,
    anything else for bytes the readers refuse."""
    if path.suffix == ".safetensors":
        if safetensors_metadata(path, RENAME).get("format") != FORMAT:
            return read_tensors(path)  # a trainer's own file: the version is its name's
        try:
            return read_snapshot(path)[1]  # write_snapshot's: its metadata must say the name's version
        except ProtocolError as e:
            raise CheckpointError(f"{e}: a sender.write_snapshot file keeps the name it was written under") from e
    state: State = torch.load(path, map_location="cpu", weights_only=True)
    return state


def ties(reference: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The groups of ``reference``'s names that are one tensor (an LM head tied to the
    embedding): ``save_pretrained`` writes one name of each group."""
    groups: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], list[str]] = {}
    for k, t in reference.items():
        if t.numel() and t.device.type != "meta":
            groups.setdefault((t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype), []).append(k)
    return [g for g in groups.values() if len(g) > 1]


def fits(path: Path, state: State, reference: Mapping[str, torch.Tensor], cast: bool) -> State:
    """``state`` checked against ``reference``, its tied names that the file left out
    filled from their twin. ``cast``: a floating dtype may differ (a model's
    ``load_state_dict`` casts); else every dtype is the reference's."""
    what = "the model's" if cast else "the first checkpoint's"
    for group in ties(reference):
        present = next((k for k in group if k in state), None)
        if present is not None:
            state.update({k: state[present] for k in group if k not in state})
    for key, want in reference.items():
        if key not in state:
            raise CheckpointError(f"{path}: no {key!r}, which {what} state dict has: save all of the model's state_dict()")
        got = state[key]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: {key!r} has shape {tuple(got.shape)}, {what} is {tuple(want.shape)}: "
                                  "save a model of the same architecture and sizes")
        if got.dtype != want.dtype and not (cast and got.is_floating_point() and want.is_floating_point()):
            raise CheckpointError(f"{path}: {key!r} is {got.dtype}, {what} is {want.dtype}: save it in {want.dtype}")
    extra = next((k for k in state if k not in reference), None)
    if extra is not None:
        raise CheckpointError(f"{path}: {extra!r} is not one of {what} keys: save the model's state_dict() alone "
                              "(no optimizer state, no wrapper's prefix)")
    return state


def read_checkpoint(path: Path, reference: Mapping[str, torch.Tensor] | None, cast: bool = True) -> State:
    """``path``'s state dict, checked against ``reference`` (the model's, or the first
    checkpoint's): ``CheckpointError`` naming the file, what is wrong and the fix."""
    try:
        state = load(path)
    except (CheckpointError, FileNotFoundError, ConfigError):  # ConfigError: no safetensors package, a set-up's fault
        raise
    except Exception as e:  # the file's bytes are input: torch.load's, pickle's and safetensors' refusals alike
        raise CheckpointError(f"{path}: cannot be read (torn, or read while still being written? {RENAME}): "
                              f"{type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        keys = f" with {list(state)[:4]!r:.80}" if isinstance(state, dict) else ""
        raise CheckpointError(f"{path}: not a state dict of named tensors (a {type(state).__name__}{keys}): "
                              "save the model's state_dict() itself")
    return state if reference is None else fits(path, state, reference, cast)


def stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_mtime_ns, st.st_size, st.st_ino  # a file renamed over another is another inode


class Checkpoints:
    """The watched directory's next good checkpoint: a bad one is refused once (logged and
    reported), skipped while its file stays as it is, and read again once rewritten.
    One caller at a time (the daemon's loop, on a worker thread)."""

    def __init__(self, watch: Path) -> None:
        self.watch = watch
        self._refused: dict[Path, tuple[int, int, int]] = {}  # path -> the stamp it was refused at

    def next(self, after: int | None, reference: Mapping[str, torch.Tensor] | None,
             cast: bool = True) -> tuple[int, Path, State] | None:
        """The newest readable checkpoint newer than ``after`` that fits ``reference``
        (``cast``: its floating tensors may be of other dtypes, as a model casts them)."""
        files = set(self.watch.iterdir())
        self._refused = {p: s for p, s in self._refused.items() if p in files}  # forget the files gone
        for path in unversioned(files):
            self._check(path, None, partial(self._refuse_name, path))
        for step, path in candidates(files, after):
            state = self._check(path, step, partial(read_checkpoint, path, reference, cast))
            if state is not None:
                return step, path, state
        return None

    @staticmethod
    def _refuse_name(path: Path) -> State:
        raise CheckpointError(f"{path}: has no version in its name: {NAMING}; rename it into place under such a name")

    def _check(self, path: Path, step: int | None, read: Callable[[], State]) -> State | None:
        """``read()`` of ``path`` unless refused as it is; refused once if it raises or the
        file changed in place while it was read (still being written)."""
        try:
            before = stamp(path.stat())
        except FileNotFoundError:  # replaced or removed meanwhile
            return None
        if self._refused.get(path) == before:
            return None
        try:
            state = read()
            after = stamp(path.stat())
            if after[2] != before[2]:
                return None  # renamed over while read: the new file on the next scan
            if after != before:
                raise CheckpointError(f"{path}: changed while it was read, so it is still being written: {RENAME}")
            return state
        except FileNotFoundError:
            return None
        except CheckpointError as e:
            self._refused[path] = before
            log.error("%s: %s; still serving the version before it", type(e).__name__, e, extra={"path": str(path), "version": step})
            report("refused", version=step, path=str(path), error=str(e))
            return None
