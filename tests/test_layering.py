"""The architecture as the import graph must keep it (DESIGN.md): read from the source
with ``ast``, every import, including those inside functions.

- ``protocol`` imports neither side; ``sender`` and ``receiver`` never import each other.
- ``protocol.wire`` and ``protocol.codec`` are bytes and tensors only: no ZeroMQ, no event
  loop, no file locks, and nothing of ``protocol.net`` / ``protocol.host``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RULES: list[tuple[str, tuple[str, ...]]] = [
    ("protocol", ("sender", "receiver")),
    ("sender", ("receiver",)),
    ("receiver", ("sender",)),
    ("protocol/wire", ("zmq", "asyncio", "fcntl", "protocol.net", "protocol.host")),
    ("protocol/codec", ("zmq", "asyncio", "fcntl", "protocol.net", "protocol.host")),
]


def imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, a file of ``module``."""
    out = []
    package = module.split(".")[:-1]  # a module's package; for a package's __init__, the package
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]  # from protocol import net
    return out


def violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for line, name in imports(path.read_text(), module):
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize(("folder", "banned"), RULES, ids=[f"{f}-{'-'.join(b)}" for f, b in RULES])
def test_layers_import_only_what_they_may(folder: str, banned: tuple[str, ...]) -> None:
    assert (ROOT / folder).is_dir()
    assert violations(folder, banned) == []


def test_the_checker_sees_every_kind_of_import() -> None:
    source = (
        "import zmq\nfrom asyncio import Event\nfrom protocol import net\n"
        "def f():\n    from ....sender import Sender\n    from ..net.server import VersionServer\n"
    )
    names = {name for _, name in imports(source, "protocol.codec.sub.mod")}
    assert {"zmq", "asyncio", "protocol.net", "sender", "protocol.codec.net.server"} <= names
