"""The architecture as the import graph must keep it (DESIGN.md): read from the source
with ``ast``, every import, including those inside functions.

- ``protocol`` imports neither side; ``sender`` and ``receiver`` never import each other.
- ``protocol.wire`` and ``protocol.codec`` are bytes and tensors only: no ZeroMQ, no event
  loop, no file locks, and nothing of ``protocol.net`` / ``protocol.host``.
- No import cycle among the modules of ``protocol``, ``sender`` and ``receiver``: the
  dependencies form layers, each module usable (and testable) with only those below it.

What counts as a dependency, for the cycle check: every import statement anywhere in a
file (module level, inside functions and methods, under ``if TYPE_CHECKING:``) and every
module named by a string to ``lazy_module`` (protocol/lazy.py) or
``importlib.import_module``. A function-level or lazy import defers *when* a module is
loaded (numba's start-up cost, a heavy optional package), not *whether* one module needs
the other: a cycle through one is still two modules that cannot be understood, loaded or
replaced apart, and it breaks at import time as soon as the deferred call runs during the
other's import. None is exempt; the tree has no cycle that needs one. A type-only import is
counted too: it is a real dependency of the annotations, and the tree does not need one to
close a cycle. Not counted: the package that Python imports before a submodule (a
package's ``__init__`` importing its own submodules is how packages are built, and would
make every package a cycle); ``from pkg import name`` counts as ``pkg.name`` when that is
a module, else as ``pkg``.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "sender", "receiver")
LAZY_IMPORTERS = ("lazy_module", "import_module")  # called with a module's absolute name

RULES: list[tuple[str, tuple[str, ...]]] = [
    ("protocol", ("sender", "receiver")),
    ("sender", ("receiver",)),
    ("receiver", ("sender",)),
    ("protocol/wire", ("zmq", "asyncio", "fcntl", "protocol.net", "protocol.host")),
    ("protocol/codec", ("zmq", "asyncio", "fcntl", "protocol.net", "protocol.host")),
]
# Each side's rooms (sub-packages, docs/layout.md), lowest first: a room imports the rooms
# below it and its side's floor (the side's top-level modules), never one above it. A
# storey of several rooms (a tuple) holds siblings that never import each other: the
# engine adapters, each one folder over ``receiver/held``, the part they share.
ENGINES = ("vllm", "sglang")
ROOMS: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "sender": ("diff", "version", "serve", "sharded"),
    "receiver": ("apply", "strategy", "session", "control", "held", ENGINES),
}


def rooms_of(side: str) -> list[str]:
    return [room for s in ROOMS[side] for room in ((s,) if isinstance(s, str) else s)]


for side, storeys in ROOMS.items():
    for i, storey in enumerate(storeys):
        above = [room for s in storeys[i + 1 :] for room in ((s,) if isinstance(s, str) else s)]
        for room in (storey,) if isinstance(storey, str) else storey:
            siblings = [] if isinstance(storey, str) else [r for r in storey if r != room]
            if above or siblings:
                RULES.append((f"{side}/{room}", tuple(f"{side}.{other}" for other in above + siblings)))


def _from_base(node: ast.ImportFrom, module: str) -> str:
    """The absolute name a ``from ... import`` in a file of ``module`` imports from."""
    if not node.level:
        return node.module or ""
    package = module.split(".")[:-1]  # a module's package; for a package's __init__, the package
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(source: str, module: str, *, from_bases: bool = True) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, a file of ``module``,
    and of every module named to ``lazy_module`` / ``importlib.import_module``.
    ``from pkg import name`` gives ``pkg.name`` (``from protocol import net``), and ``pkg``
    too with ``from_bases``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _from_base(node, module)
            out += [(node.lineno, name)] if from_bases else []
            out += [(node.lineno, name if alias.name == "*" else f"{name}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else ""
            if func in LAZY_IMPORTERS and not node.args[0].value.startswith("."):
                out.append((node.lineno, node.args[0].value))
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


@pytest.mark.parametrize("side", sorted(ROOMS))
def test_a_sides_floor_imports_none_of_its_rooms(side: str) -> None:
    """The top-level modules every room may use (the package's ``__init__`` and CLI aside,
    which assemble the public API from the rooms) import no room."""
    found = []
    for path in sorted((ROOT / side).glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for line, name in imports(path.read_text(), f"{side}.{path.stem}"):
            if any(name == f"{side}.{room}" or name.startswith(f"{side}.{room}.") for room in rooms_of(side)):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert found == []


@pytest.mark.parametrize("side", sorted(ROOMS))
def test_every_module_lives_in_a_room_of_at_most_about_15(side: str) -> None:
    """A newcomer finds where a change goes from the folder names: no folder of a side holds
    more than 16 modules, and its rooms are the ones named here."""
    folders = {p.parent for p in (ROOT / side).rglob("*.py") if "__pycache__" not in p.parts}
    assert {f.relative_to(ROOT / side).parts[0] for f in folders if f != ROOT / side} >= set(rooms_of(side))
    sizes = {str(f.relative_to(ROOT)): sum(1 for p in f.glob("*.py") if p.name != "__init__.py") for f in folders}
    assert max(sizes.values()) <= 16, sizes


def test_no_module_imports_a_private_module_of_another_room() -> None:
    """A module (or package) whose name starts with ``_`` is its room's own."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            room = module.rsplit(".", 1)[0]
            for line, name in imports(path.read_text(), module, from_bases=False):
                parts = name.split(".")
                private = next((i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")
                                and (ROOT.joinpath(*parts[: i + 1]).with_suffix(".py").exists() or ROOT.joinpath(*parts[: i + 1]).is_dir())), None)
                if private is not None and parts[0] in PACKAGES and ".".join(parts[:private]) != room:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert found == []


# -- no import cycles --------------------------------------------------------------------------
Graph = dict[str, dict[str, tuple[str, int]]]  # module -> {module it depends on: (file, first line)}


def import_graph(files: dict[str, tuple[str, str]]) -> Graph:
    """The dependencies among ``files`` (module name, a package's as ``pkg.__init__`` ->
    (its path for messages, its source)), each resolved to the longest module name that is
    one of them (``protocol.errors.ConfigError`` -> ``protocol.errors``); the rest ignored."""
    node = {name: name.removesuffix(".__init__") for name in files}
    modules = set(node.values())
    graph: Graph = {m: {} for m in modules}
    for name, (path, source) in files.items():
        for line, dep in imports(source, name, from_bases=False):  # a package is not its submodules' dependency
            while dep and dep not in modules:
                dep = dep.rpartition(".")[0]
            if dep and dep != node[name]:
                graph[node[name]].setdefault(dep, (path, line))
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``, shortest through its first module) in every strongly
    connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in sorted(components):
        start, inside = component[0], set(component)
        came: dict[str, str] = {}
        queue = deque([start])
        while start not in came:  # breadth first, back to start: a shortest cycle
            v = queue.popleft()
            for w in sorted(graph[v]):
                if w in inside and w not in came:
                    came[w] = v
                    queue.append(w)
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came[path[-1]])
        found.append(path[::-1])
    return found


def describe(graph: Graph, cycle: list[str]) -> str:
    """``a -> b (a's file:line) -> a (b's file:line)``."""
    return cycle[0] + "".join(f" -> {b} ({graph[a][b][0]}:{graph[a][b][1]})" for a, b in itertools.pairwise(cycle))


def project_files() -> dict[str, tuple[str, str]]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            files[".".join(rel.with_suffix("").parts)] = (str(rel), path.read_text())
    return files


def test_no_import_cycles() -> None:
    graph = import_graph(project_files())
    assert len(graph) > 50 and "protocol.codec.entropy" in graph["protocol.codec.packed"]  # it reads the real tree
    found = [describe(graph, cycle) for cycle in cycles(graph)]
    assert not found, "import cycles (tests/test_layering.py's docstring says which imports count):\n" + "\n".join(found)


def test_the_cycle_check_sees_deferred_imports_and_names_the_cycle() -> None:
    files = {
        "pkg.__init__": ("pkg/__init__.py", "from pkg import a\nfrom pkg.b import B\n"),  # a package's own: no cycle
        "pkg.a": ("pkg/a.py", "from . import b\n"),
        "pkg.b": ("pkg/b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"),
        "pkg.c": ("pkg/c.py", "def f():\n    from .d import D\n"),
        "pkg.d": ("pkg/d.py", "from protocol.lazy import lazy_module\na = lazy_module('pkg.a')\n"),
        "pkg.e": ("pkg/e.py", "import importlib\nimport pkg.f\n"),
        "pkg.f": ("pkg/f.py", "import importlib\nx = importlib.import_module('pkg.e')\n"),
        "pkg.g": ("pkg/g.py", "from pkg import a, b\nfrom pkg.a import thing\n"),  # depends on a cycle, is in none
    }
    graph = import_graph(files)
    assert graph["pkg.g"] == {"pkg.a": ("pkg/g.py", 1), "pkg.b": ("pkg/g.py", 1)}
    assert graph["pkg"] == {"pkg.a": ("pkg/__init__.py", 1), "pkg.b": ("pkg/__init__.py", 2)}
    assert [describe(graph, c) for c in cycles(graph)] == [
        "pkg.a -> pkg.b (pkg/a.py:1) -> pkg.c (pkg/b.py:3) -> pkg.d (pkg/c.py:2) -> pkg.a (pkg/d.py:2)",
        "pkg.e -> pkg.f (pkg/e.py:2) -> pkg.e (pkg/f.py:2)",
    ]
    files["pkg.d"] = ("pkg/d.py", "a = 'pkg.a'\n")  # a string is not an import
    assert cycles(import_graph(files)) == [["pkg.e", "pkg.f", "pkg.e"]]


def test_the_checker_sees_every_kind_of_import() -> None:
    source = (
        "import zmq\nfrom asyncio import Event\nfrom protocol import net\n"
        "def f():\n    from ....sender import Sender\n    from ..net.server import VersionServer\n"
        "zmq_ = lazy_module('protocol.net.sockets')\n"
    )
    names = {name for _, name in imports(source, "protocol.codec.sub.mod")}
    assert {"zmq", "asyncio", "protocol.net", "sender", "protocol.codec.net.server", "protocol.net.sockets"} <= names


# -- the sender daemon knows builders only by their interface ------------------------------------
BUILDER_INTERFACE = "sender.version.builder"  # VersionBuilder
BUILDER_USERS = ("sender/serve/service.py", "sender/serve/feed.py", "sender/serve/source.py")  # source.py gets them from sender/version/builders.py


def builder_modules() -> set[str]:
    """The modules of ``sender`` that define a class deriving from ``VersionBuilder``."""
    found = set()
    for path in sorted((ROOT / "sender").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "VersionBuilder" for b in node.bases):
                found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def _imported(user: str) -> set[str]:
    return {name for _, name in imports((ROOT / user).read_text(), ".".join(Path(user).with_suffix("").parts))}


@pytest.mark.parametrize("user", BUILDER_USERS)
def test_the_daemon_imports_no_concrete_builder(user: str) -> None:
    concrete = builder_modules()
    assert {"sender.version.patch", "sender.version.bucket"} <= concrete  # it reads the real tree
    assert not {n for n in _imported(user) if any(n == c or n.startswith(c + ".") for c in concrete)}


def test_the_sender_service_asks_the_builder_interface_never_the_type() -> None:
    for user in ("sender/serve/feed.py", "sender/serve/source.py"):  # where the daemon handles its builder
        assert BUILDER_INTERFACE in _imported(user), user
    assert "sender.version.builders" in _imported("sender/serve/source.py")
    for user in ("sender/serve/service.py", "sender/serve/feed.py"):
        assert "isinstance(" not in (ROOT / user).read_text(), user


def test_the_package_cites_no_issue_numbers() -> None:
    """Code says why in its own terms: a reader of the package cannot look up an issue
    number (a figure cites the benchmark and doc that measured it)."""
    import re

    cited = re.compile(r"\bissues?\s+#?\d+|\(#\d+\)", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if cited.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["sender", "receiver", "protocol"])
def test_every_public_name_resolves_from_the_package(package: str) -> None:
    """The rooms are the package's own business: what it exports (``__all__``) is reached
    from the package itself, wherever it lives inside."""
    import importlib

    module = importlib.import_module(package)
    assert [name for name in getattr(module, "__all__", []) if getattr(module, name, None) is None] == []
