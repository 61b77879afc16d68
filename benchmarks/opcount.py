"""Counting what a GPU would launch, on CPU tensors: every dispatched torch op on every thread.

On a GPU each non-view op is a kernel launch costing 5-10 us of host time, so the op count
of a version, not its bytes, bounds the device path's speed at RL step sizes. A
``TorchDispatchMode`` sees every op a thread dispatches, but its stack is thread-local:
``OpCounter`` enters one on the thread that opens it and, while open, on every thread pool
work item (``asyncio.to_thread``, ``ThreadPoolExecutor``) and every new thread, all feeding
one locked tally. View ops (no kernel) are not counted; host syncs (what makes a host wait
for a device) are counted apart by name, as ``tests/test_device_codec.py`` names them.
"""

from __future__ import annotations

import concurrent.futures.thread as pool_thread
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = ("aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique", "aten::_unique", "aten::lift_fresh")
_COPIES = ("aten::_to_copy", "aten::copy_")
_PACKAGES = ("protocol", "sender", "receiver")  # whose functions ``OpCounter(sites=True)`` names


def _site() -> str:
    """The innermost function of weightsync's packages on the stack (``module.function``), else "other"."""
    frame = sys._getframe(3)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".", 1)[0] in _PACKAGES:
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def blocking_transfer(args: Any, kwargs: dict[str, Any]) -> bool:
    """A copy from one device to another that the host waits for (a copy to the host, or a
    blocking one to a device)."""
    if len(args) > 1 and isinstance(args[1], torch.Tensor):  # copy_(dst, src, non_blocking)
        source, target = args[1].device, args[0].device
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking"))
    else:  # _to_copy(src, ..., device=, non_blocking=)
        source, target = args[0].device, torch.device(kwargs.get("device") or args[0].device)
        non_blocking = bool(kwargs.get("non_blocking"))
    return source != target and (target.type == "cpu" or not non_blocking)


def _is_host_copy(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """An explicit copy to the host (``.to("cpu")``): a host sync on a GPU, whatever the source here."""
    return name == "aten::_to_copy" and str(kwargs.get("device")) == "cpu"


def is_sync(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an op makes the host wait for a device: a ``SYNCING`` op, a blocking copy
    between devices, or an explicit copy to the host (``.to("cpu")``, a sync on a GPU
    whatever the source here)."""
    return name.startswith(SYNCING) or (name in _COPIES and blocking_transfer(args, kwargs)) or _is_host_copy(name, args, kwargs)


class _Mode(TorchDispatchMode):
    def __init__(self, tally: OpCounter) -> None:
        super().__init__()
        self._tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not func.is_view:
            self._tally.record(func._schema.name, args, kwargs)
        return func(*args, **kwargs)


class OpCounter:
    """Counts non-view ops by name, and host syncs, on every thread while open; with
    ``sites``, ops by the weightsync function that dispatched them too (slower: it walks
    the stack). Not reentrant."""

    def __init__(self, sites: bool = False) -> None:
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[str] | None = Counter() if sites else None
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self._mode: _Mode | None = None
        self._local = threading.local()  # whether this thread counts already (modes nested would count twice)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def record(self, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        sync = is_sync(name, args, kwargs)
        site = _site() if self.sites is not None else None
        with self._lock:
            self.ops[name] += 1
            if sync:
                self.syncs[name] += 1
            if site is not None and self.sites is not None:
                self.sites[site] += 1

    def take(self) -> tuple[Counter[str], Counter[str]]:
        """The counts so far (ops, syncs), and zero them (the sites too)."""
        with self._lock:
            ops, syncs = self.ops, self.syncs
            self.ops, self.syncs = Counter(), Counter()
            if self.sites is not None:
                self.sites = Counter()
        return ops, syncs

    def take_sites(self) -> Counter[str]:
        """The ops by site so far, and zero them (empty without ``sites``)."""
        with self._lock:
            sites = self.sites or Counter()
            if self.sites is not None:
                self.sites = Counter()
        return sites

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(this: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(counter._local, "on", False):
                return original(this, *args, **kwargs)
            counter._local.on = True
            try:
                with _Mode(counter):
                    return original(this, *args, **kwargs)
            finally:
                counter._local.on = False

        setattr(owner, name, counted)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> OpCounter:
        self._wrap(pool_thread._WorkItem, "run")  # every pool task, on threads started before too
        self._wrap(threading.Thread, "run")  # threads started from now on
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._local.on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._local.on = False
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def breakdown(ops: Counter[str], top: int = 12) -> list[tuple[str, int]]:
    """The ``top`` op names by count."""
    return ops.most_common(top)
