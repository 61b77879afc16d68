"""Named shared-memory regions: a set of tensors, their manifest and a seqlock.

Sidecars hand weights to the processes beside them through these. The trainer's client
publishes into a region the sender sidecar reads; the receiver sidecar writes each
version into a region a rollout engine maps its parameters onto. Both sides import this
module, so it is pure: no sockets, no sender or receiver.

A region is a file under ``/dev/shm`` (``WEIGHTSYNC_SHM_DIR`` overrides), so its name is
a path: creation is atomic (written under a temporary name, then renamed) and a reader
never maps a half-initialised region. Layout::

    [0, 128)          header, 16 little-endian int64 slots (see the _H_* indices)
    [128, ...)        manifest (msgpack): name, dtype code, shape, offset, tracked
    [data_offset, ..) tensor bytes, each tensor 64-byte aligned; tied names share an offset

Consistency (why two mechanisms):

* ``seq`` is a seqlock counter, odd while a writer is inside ``writing()``. A lock-free
  reader (``read_consistent``) reads ``seq``, copies, and retries if ``seq`` moved or was
  odd. This relies on x86-64 store/load ordering (TSO); use ``reading()`` elsewhere.
* Writers also hold an exclusive ``flock`` on the file and readers inside ``reading()`` a
  shared one, so a version never changes under a reader (an engine mid-forward) and the
  writer waits for the readers to leave. A waiting writer raises a flag that holds new
  readers back briefly, so busy readers do not starve it. The kernel drops a crashed
  process's flock; a writer that crashed mid-write leaves ``seq`` odd, and readers wait
  for the next complete write rather than see a torn version.

The trainer's latest version (slots 11-15): a receiver sidecar's region also says what the
sidecar last heard of the trainer's newest version and as of when (``publish_latest``,
``latest``), so that an engine can bound how far behind the weights it reads are
(``receiver/control/sidecar_lag.py``). These slots have their own seqlock, apart from the
weights' (publishing never waits for readers, nor they for it), and the same reliance on
x86-64's ordering as ``read_consistent``. Each slot is an aligned int64, stored and loaded
whole. They were zero, and unused, in the regions of sidecars before them (the layout
version did not change: such a region reads as one whose owner publishes no latest, and an
older engine ignores the slots), so old and new engines and sidecars work together, and a
bound is never checked against knowledge nobody publishes.

Ownership: the process that creates a region owns it and unlinks it (``unlink()``,
``close()`` of an owner, or at interpreter exit); attachers only unmap. An owner killed
with SIGKILL cannot unlink: the next ``create`` of the same name replaces the leftover.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgpack
import torch

from protocol.errors import MetadataMismatchError, ProtocolError, SharedMemoryError
from protocol.state import find_aliases
from protocol.wire.dtypes import dtype_code, dtype_from_code

MAGIC = b"WSYNCSHM"
LAYOUT_VERSION = 1
HEADER_NBYTES = 128
ALIGN = 64
MAX_MANIFEST = 64 << 20
NO_VERSION = -1
WRITER_GRACE = 0.2  # seconds new readers hold back while a writer waits for the lock
_POLL = 0.001
_LATEST_TRIES = 100  # reads of the latest-version slots a publication may overlap before it counts as torn

# header slots (int64 each); slot 0 holds MAGIC
_H_LAYOUT, _H_FLAGS, _H_MANIFEST, _H_DATA, _H_TOTAL, _H_SEQ, _H_VERSION, _H_WAITING, _H_GEN, _H_OWNER = range(1, 11)
# the trainer's latest version as the owner heard it, under its own seqlock (``publish_latest``)
_H_LSEQ, _H_LATEST, _H_LATEST_AT, _H_MAX_AGE, _H_PUBLISHER = range(11, 16)
_CLOSED = 1  # flag: the owner has unlinked this region; a new one may exist under the name

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
T = TypeVar("T")


def shm_dir() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_SHM_DIR", "/dev/shm"))


def region_path(name: str) -> Path:
    if not _NAME.match(name) or name.startswith("."):
        raise SharedMemoryError(f"bad region name {name!r}: use letters, digits, '_', '-', '.'")
    return shm_dir() / name


# -- manifest ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in a region (``offset`` is relative to the data start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    tracked: bool = True  # takes part in patches (False: a frozen parameter)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The manifest of a region: every tensor's name, dtype, shape and place, in order."""

    specs: tuple[TensorSpec, ...]
    data_nbytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], tracked: Iterable[str] | None = None) -> Layout:
        """Lay out ``tensors`` (a state dict); tied tensors get one shared place."""
        keep = set(tensors) if tracked is None else set(tracked)
        aliases = find_aliases(tensors)
        specs: list[TensorSpec] = []
        placed: dict[str, int] = {}
        end = 0
        for name, t in tensors.items():
            dtype_code(t.dtype)  # the allowlist: ProtocolError for anything else
            if name in aliases:
                offset = placed[aliases[name]]
            else:
                offset = placed[name] = end
                end = _align(end + t.numel() * t.element_size())
            specs.append(TensorSpec(name, t.dtype, tuple(t.shape), offset, name in keep))
        return cls(tuple(specs), end)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {s.name: s for s in self.specs})

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def get(self, name: str) -> TensorSpec | None:
        return self._index.get(name)  # type: ignore[attr-defined]

    @property
    def tracked(self) -> list[str]:
        return [s.name for s in self.specs if s.tracked]

    def mismatch(self, tensors: Mapping[str, torch.Tensor], *, cast: bool = False) -> str | None:
        """The first difference between ``tensors`` and this layout, in words, or None.

        With ``cast``, a floating tensor may have another floating dtype (it is converted
        on the way in); integer and bool tensors must match exactly either way.
        """
        for spec in self.specs:
            t = tensors.get(spec.name)
            if t is None:
                return f"key {spec.name!r} is in the region but not in the state"
            if tuple(t.shape) != spec.shape:
                return f"key {spec.name!r}: shape {list(t.shape)}, the region has {list(spec.shape)}"
            same = t.dtype == spec.dtype or (cast and t.dtype.is_floating_point and spec.dtype.is_floating_point)
            if not same:
                return f"key {spec.name!r}: dtype {t.dtype}, the region has {spec.dtype}"
        extra = [k for k in tensors if self.get(k) is None]
        if extra:
            return f"key {extra[0]!r} is in the state but not in the region"
        return None

    def check(self, tensors: Mapping[str, torch.Tensor], *, cast: bool = False) -> None:
        """Raise ``MetadataMismatchError`` naming the first key that does not fit."""
        why = self.mismatch(tensors, cast=cast)
        if why is not None:
            raise MetadataMismatchError(why)

    def same_as(self, other: Layout) -> str | None:
        """The first difference from ``other`` (names, dtypes, shapes, sharing), or None."""
        for a, b in zip(self.specs, other.specs):
            if a != b:
                return f"key {a.name!r}: {_describe(a)} here, {_describe(b)} there"
        if len(self.specs) != len(other.specs):
            longer = self.specs if len(self.specs) > len(other.specs) else other.specs
            return f"key {longer[min(len(self.specs), len(other.specs))].name!r} is on one side only"
        return None

    def to_bytes(self) -> bytes:
        entries = [[s.name, dtype_code(s.dtype), list(s.shape), s.offset, s.tracked] for s in self.specs]
        return msgpack.packb({"v": LAYOUT_VERSION, "tensors": entries, "nbytes": self.data_nbytes})

    @classmethod
    def from_bytes(cls, data: bytes, limit: int) -> Layout:
        """Parse a manifest from a region (untrusted: another process wrote it)."""
        try:
            body = msgpack.unpackb(data)
            entries, nbytes = body["tensors"], body["nbytes"]
        except Exception as e:
            raise SharedMemoryError(f"unreadable region manifest: {e}") from None
        if type(nbytes) is not int or not 0 <= nbytes <= limit or not isinstance(entries, list):
            raise SharedMemoryError("region manifest is malformed")
        specs = []
        for entry in entries:
            try:
                name, code, shape, offset, tracked = entry
                spec = TensorSpec(name, dtype_from_code(code), tuple(shape), offset, bool(tracked))
            except (ValueError, TypeError, ProtocolError) as err:
                raise SharedMemoryError(f"region manifest has a bad entry {entry!r:.80}: {err}") from None
            if type(name) is not str or any(type(d) is not int or d < 0 for d in spec.shape) or type(offset) is not int:
                raise SharedMemoryError(f"region manifest has a bad entry {entry!r:.80}")
            if offset < 0 or offset + spec.nbytes > nbytes or offset % spec.dtype.itemsize:
                raise SharedMemoryError(f"region manifest places {name!r} outside the region")
            specs.append(spec)
        if len({s.name for s in specs}) != len(specs):
            raise SharedMemoryError("region manifest repeats a name")
        return cls(tuple(specs), nbytes)


def _describe(s: TensorSpec) -> str:
    return f"{s.dtype} {list(s.shape)} at {s.offset}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Heard:
    """What a region's owner last published of the trainer's latest version (``Region.latest``)."""

    version: int | None  # the newest version the owner heard of (None: none yet)
    current_at: float  # ``time.monotonic()`` as of which it was known to be the latest (-inf: never)
    max_age: float  # seconds after which the owner's knowledge no longer counts as current, by its own rule
    publisher: int  # the pid of the process that published it

    def age(self, now: float | None = None) -> float:
        """Seconds since ``version`` was last known to be the latest (inf: never). The
        clock is CLOCK_MONOTONIC, one for all the processes of a host (outside time
        namespaces, which a host's ``/dev/shm`` does not cross in practice)."""
        return (time.monotonic() if now is None else now) - self.current_at


# -- the region ----------------------------------------------------------------------------------
class Region:
    """A mapped region. ``create`` (the owner) or ``attach`` (anyone else); see the module doc."""

    def __init__(self, name: str, path: Path, fd: int, mm: mmap.mmap, layout: Layout, owner: bool) -> None:
        self.name, self.path, self.layout, self.owner = name, path, layout, owner
        self._fd, self._mm = fd, mm
        self._header = torch.frombuffer(mm, dtype=torch.int64, count=HEADER_NBYTES // 8)
        self._data = int(self._header[_H_DATA])
        self._views: dict[str, torch.Tensor] | None = None
        self._read_lock = threading.Lock()  # threads of one process share one flock
        self._readers = 0
        self._ino = os.fstat(fd).st_ino
        self._finalizer = weakref.finalize(self, _release, fd, str(path) if owner else None, self._ino)

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, layout: Layout, *, adopt: bool = False, latest_max_age: float | None = None) -> Region:
        """Create ``name`` laid out as ``layout``, zero-filled, owned by this process.

        A region already there is a leftover of a killed owner: with ``adopt`` and the same
        layout it is taken over as it is (so processes attached to it stay attached, and
        its contents and version are kept); otherwise it is marked closed and replaced.
        ``latest_max_age``: this owner publishes the trainer's latest version with that
        ``max_age`` (``publish_latest``), none heard yet, from before the region appears
        or is taken over; None: it publishes none (what a leftover published is withdrawn).
        """
        path = region_path(name)
        if latest_max_age is not None and not latest_max_age > 0:
            raise SharedMemoryError(f"latest_max_age must be > 0 seconds, got {latest_max_age!r}")
        if path.exists():
            with contextlib.suppress(SharedMemoryError, OSError):
                old = cls.attach(name)
                if adopt and old.layout.same_as(layout) is None:
                    old.owner = True
                    old._header[_H_OWNER] = os.getpid()
                    old._finalizer.detach()
                    old._finalizer = weakref.finalize(old, _release, old._fd, str(path), old._ino)
                    old.publish_latest(None, -math.inf, latest_max_age)
                    return old
                old._header[_H_FLAGS] = int(old._header[_H_FLAGS]) | _CLOSED
                old.close()
        manifest = layout.to_bytes()
        data = -(-(HEADER_NBYTES + len(manifest)) // mmap.PAGESIZE) * mmap.PAGESIZE
        total = data + max(layout.data_nbytes, 1)
        tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
            mm[HEADER_NBYTES : HEADER_NBYTES + len(manifest)] = manifest
            header = torch.frombuffer(mm, dtype=torch.int64, count=HEADER_NBYTES // 8)
            header[_H_LAYOUT], header[_H_MANIFEST], header[_H_DATA], header[_H_TOTAL] = LAYOUT_VERSION, len(manifest), data, total
            header[_H_VERSION], header[_H_OWNER] = NO_VERSION, os.getpid()
            header[_H_GEN] = int.from_bytes(secrets.token_bytes(7), "little")
            _publish_latest(header, None, -math.inf, latest_max_age)
            del header
            mm[0:8] = MAGIC
            os.rename(tmp, path)  # atomic: attachers see nothing or a complete region
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(name, path, fd, mm, layout, owner=True)

    @classmethod
    def attach(cls, name: str, *, timeout: float | None = None) -> Region:
        """Map an existing region, waiting up to ``timeout`` seconds for it to appear."""
        path = region_path(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if deadline is None or time.monotonic() > deadline:
                    raise SharedMemoryError(f"no shared-memory region {name!r} ({path})") from None
                time.sleep(0.02)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_NBYTES:
                raise SharedMemoryError(f"region {name!r} is too small to be a weightsync region")
            mm = mmap.mmap(fd, size)
            header = torch.frombuffer(mm, dtype=torch.int64, count=HEADER_NBYTES // 8)
            if mm[0:8] != MAGIC or int(header[_H_LAYOUT]) != LAYOUT_VERSION:
                raise SharedMemoryError(f"{path} is not a weightsync region of layout {LAYOUT_VERSION}")
            manifest, data, total = (int(header[i]) for i in (_H_MANIFEST, _H_DATA, _H_TOTAL))
            if total != size or not 0 < manifest <= MAX_MANIFEST or not HEADER_NBYTES + manifest <= data <= total:
                raise SharedMemoryError(f"region {name!r} has an inconsistent header")
            del header
            layout = Layout.from_bytes(bytes(mm[HEADER_NBYTES : HEADER_NBYTES + manifest]), total - data)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, path, fd, mm, layout, owner=False)

    # -- contents ---------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Tensors viewing the region, by name (tied names share memory). Not a copy:
        write them only inside ``writing()``, read them inside ``reading()``."""
        if self._views is None:
            views: dict[str, torch.Tensor] = {}
            shared: dict[int, torch.Tensor] = {}
            for s in self.layout.specs:
                if s.numel == 0:
                    views[s.name] = torch.empty(s.shape, dtype=s.dtype)
                elif s.offset in shared and shared[s.offset].dtype == s.dtype and tuple(shared[s.offset].shape) == s.shape:
                    views[s.name] = shared[s.offset]
                else:
                    t = torch.frombuffer(self._mm, dtype=s.dtype, count=s.numel, offset=self._data + s.offset).view(s.shape)
                    views[s.name] = shared[s.offset] = t
            self._views = views
        return self._views

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into the region (cast to its dtypes); call inside ``writing()``."""
        self.layout.check(tensors, cast=True)
        views, done = self.tensors(), set()
        for s in self.layout.specs:
            if s.offset in done and s.numel:
                continue  # a tied name: its memory is already written
            done.add(s.offset)
            src = tensors[s.name].detach()
            if src.device.type != "cpu":
                raise SharedMemoryError(f"{s.name!r} is on {src.device}: shared-memory regions take CPU tensors")
            views[s.name].copy_(src)

    @property
    def version(self) -> int | None:
        """The version of the last complete write (None before the first)."""
        v = int(self._header[_H_VERSION])
        return None if v == NO_VERSION else v

    @property
    def seq(self) -> int:
        """The seqlock counter: odd while a write is in progress (or was torn by a crash)."""
        return int(self._header[_H_SEQ])

    @property
    def generation(self) -> int:
        """Random per created region: tells a re-created region under the same name apart."""
        return int(self._header[_H_GEN])

    @property
    def closed(self) -> bool:
        """The owner has unlinked this region; writes to it reach nobody new."""
        return bool(int(self._header[_H_FLAGS]) & _CLOSED)

    @property
    def owner_pid(self) -> int:
        """The pid of the process that created or last adopted the region."""
        return int(self._header[_H_OWNER])

    # -- the trainer's latest version, as the owner heard it ----------------------------------------
    def publish_latest(self, version: int | None, current_at: float, max_age: float | None) -> None:
        """Owner: the trainer's latest version is ``version`` as of ``current_at``
        (``time.monotonic()``; -inf: not known current), and knowledge older than
        ``max_age`` seconds is not current. ``max_age=None``: this owner publishes no latest
        (``latest()`` says None). One publisher at a time (the owner's one task); readers
        never wait for it, and retry a read it overlapped."""
        if not self.owner:
            raise SharedMemoryError(f"region {self.name!r}: only its owner publishes the latest version")
        _publish_latest(self._header, version, current_at, max_age)

    def latest(self) -> Heard | None:
        """What the owner last published of the trainer's latest version; None if it
        publishes none (a region of an older sidecar, or of one that follows no trainer).
        A read a publication overlapped is retried; if none completes (its publisher died
        midway), the knowledge reads as never current."""
        h = self._header
        for _ in range(_LATEST_TRIES):
            before = int(h[_H_LSEQ])
            if before % 2 == 0:
                version, at, max_age, publisher = (int(h[i]) for i in (_H_LATEST, _H_LATEST_AT, _H_MAX_AGE, _H_PUBLISHER))
                if int(h[_H_LSEQ]) == before:
                    if max_age <= 0:
                        return None
                    return Heard(None if version == NO_VERSION else version, at / 1e9 if at > 0 else -math.inf, max_age / 1e9, publisher)
            time.sleep(_POLL / 10)
        return Heard(None, -math.inf, max(int(h[_H_MAX_AGE]), 1) / 1e9, int(h[_H_PUBLISHER]))

    # -- writing ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, version: int | Callable[[], int | None] | None) -> Iterator[None]:
        """Write a whole version: readers wait, ``seq`` is odd inside. ``version`` (or what
        it returns, read on exit) becomes the region's version. If the body raises, ``seq``
        stays odd: the region is torn until the next complete write."""
        self._begin_write()
        with self._ending(version):
            yield

    @contextlib.asynccontextmanager
    async def writing_async(self, version: int | Callable[[], int | None] | None) -> AsyncIterator[None]:
        """``writing()`` for an event loop: waiting for readers happens in a thread."""
        started = asyncio.ensure_future(asyncio.to_thread(self._begin_write))
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:  # never leak the lock taken after we stopped waiting

            def release(f: asyncio.Future[None]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._end_write(None, ok=True, abort=True)

            started.add_done_callback(release)
            raise
        with self._ending(version):
            yield

    @contextlib.contextmanager
    def _ending(self, version: int | Callable[[], int | None] | None) -> Iterator[None]:
        """The body of a write, the lock taken: ends it whole (``version``) or torn (it raised)."""
        ok = False
        try:
            yield
            ok = True
        finally:
            self._end_write(_version_of(version) if ok else None, ok)

    def _begin_write(self) -> None:
        h = self._header
        h[_H_WAITING] = os.getpid()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        finally:
            h[_H_WAITING] = 0
        seq = int(h[_H_SEQ])
        h[_H_SEQ] = seq + (1 if seq % 2 == 0 else 2)  # odd, and changed even if a crash left it odd

    def _end_write(self, version: int | None, ok: bool, abort: bool = False) -> None:
        h = self._header
        try:
            if abort:  # nothing was written: back to the even value it had
                h[_H_SEQ] = int(h[_H_SEQ]) - 1 if int(h[_H_SEQ]) % 2 else int(h[_H_SEQ])
            elif ok:
                h[_H_VERSION] = NO_VERSION if version is None else version
                h[_H_SEQ] = int(h[_H_SEQ]) + 1
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- reading ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, timeout: float | None = None) -> Iterator[int | None]:
        """Hold the current version still while inside; yields it. The writer waits.

        Raises ``SharedMemoryError`` after ``timeout`` seconds if a crashed writer left the
        region torn and no complete write has followed.
        """
        with self._read_lock:
            if self._readers == 0:
                self._lock_shared(timeout)
            self._readers += 1
        try:
            yield self.version
        finally:
            with self._read_lock:
                self._readers -= 1
                if self._readers == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _lock_shared(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        held_back = time.monotonic() + WRITER_GRACE
        while True:
            if int(self._header[_H_WAITING]) and time.monotonic() < held_back:
                time.sleep(_POLL)  # a writer is waiting: let it in first
                continue
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            if self.seq % 2 == 0:
                return
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # torn by a crashed writer: wait for a full write
            if deadline is not None and time.monotonic() > deadline:
                raise SharedMemoryError(f"region {self.name!r} was left torn by a crashed writer (seq {self.seq})")
            time.sleep(0.01)

    def read_consistent(self, read: Callable[[], T], timeout: float | None = None) -> tuple[int | None, T]:
        """Lock-free seqlock read: run ``read()`` until no write overlapped it; returns
        ``(version, result)``. ``read`` must copy what it needs (it may run several times)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            before = self.seq
            if before % 2 == 0:
                version = self.version
                result = read()
                if self.seq == before:
                    return version, result
            if deadline is not None and time.monotonic() > deadline:
                raise SharedMemoryError(f"region {self.name!r}: no consistent read within {timeout}s (seq {self.seq})")
            time.sleep(_POLL)

    # -- closing ----------------------------------------------------------------------------------
    def unlink(self) -> None:
        """Owner: remove the name (mapped views stay valid) and mark the region closed."""
        self._header[_H_FLAGS] = int(self._header[_H_FLAGS]) | _CLOSED
        _unlink_if_ours(str(self.path), self._ino)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._fd, None, self._ino)

    def close(self) -> None:
        """Unlink (owner only) and release the file. The mapping itself goes away with the
        last tensor viewing it."""
        if self.owner:
            self.unlink()
        self._views = None
        self._finalizer()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Region({self.name!r}, {len(self.layout.specs)} tensors, v{self.version}, seq {self.seq}, owner={self.owner})"


def _publish_latest(h: torch.Tensor, version: int | None, current_at: float, max_age: float | None) -> None:
    """``Region.publish_latest`` into header ``h``: the slots between two steps of their seqlock."""
    if max_age is not None and not max_age > 0:
        raise SharedMemoryError(f"max_age must be > 0 seconds, got {max_age!r}")
    seq = int(h[_H_LSEQ])
    odd = seq + 1 if seq % 2 == 0 else seq + 2  # a publisher that crashed midway left it odd
    h[_H_LSEQ] = odd
    h[_H_LATEST] = NO_VERSION if version is None else version
    h[_H_LATEST_AT] = max(1, round(current_at * 1e9)) if math.isfinite(current_at) else 0
    h[_H_MAX_AGE] = 0 if max_age is None else max(1, round(max_age * 1e9))
    h[_H_PUBLISHER] = os.getpid()
    h[_H_LSEQ] = odd + 1


def _version_of(version: int | Callable[[], int | None] | None) -> int | None:
    return version() if callable(version) else version


def _unlink_if_ours(path: str, ino: int) -> None:
    """Unlink ``path`` only if it is still the file we created (not a successor's)."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == ino:
            os.unlink(path)


def _release(fd: int, path: str | None, ino: int) -> None:
    if path is not None:
        _unlink_if_ours(path, ino)
    with contextlib.suppress(OSError):
        os.close(fd)


def leftover_regions(prefix: str) -> list[str]:
    """Names of regions (and half-created temporaries) under ``prefix``: for leak checks."""
    return sorted(p.name for p in shm_dir().glob("*") if p.name.lstrip(".").startswith(prefix))
