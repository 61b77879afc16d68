"""Keeps numba's on-disk cache of the codec's kernels in step with their sources.

numba keys a cached kernel by its own source file only. A kernel that calls, inlines or
reads constants from another file's (``packed`` from ``rans`` and ``entropy``) keeps the
code it was compiled with after that file changes, so a changed coder would go on running
its old self, tests included. ``drop_stale`` (run when ``protocol.codec`` is imported,
before any kernel module) drops every cached codec kernel whenever one of these sources
differs from the last import's; they are compiled again on first use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("rans.py", "entropy.py", "packed.py")  # the modules whose kernels use each other's
STAMP = "kernel-sources.sha256"


def digest(directory: Path = HERE) -> str:
    """One hash of every source in ``SOURCES``."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((directory / name).read_bytes())
    return h.hexdigest()


def drop_stale(directory: Path = HERE) -> bool:
    """Remove ``directory``'s cached kernels if its sources changed since the stamp was
    written (then write it); True if any were removed. Best effort: a read-only install,
    whose files do not change, is left as it is."""
    cache = directory / "__pycache__"
    stamp = cache / STAMP
    now = digest(directory)
    try:
        if stamp.read_text() == now:
            return False
    except OSError:
        pass
    removed = False
    try:
        for path in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            path.unlink(missing_ok=True)
            removed = True
        cache.mkdir(exist_ok=True)
        stamp.write_text(now)
    except OSError:
        pass
    return removed
