"""Import a module on first use, so that importing weightsync loads no JIT compiler.

numba (and its llvmlite) are needed only once something is encoded or applied. vLLM's
CPU worker scans every loaded module's namespace at start and fails on one of
llvmlite's objects, and a spawned worker re-imports the user's main script: a script
that imports weightsync at the top must not have loaded numba by then. The proxy is a
plain object with a real ``__dict__``, so such scans read it without importing anything.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for ``name`` and imports it at the first attribute read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (loaded)'}>"


def lazy_module(name: str) -> Any:
    return LazyModule(name)
