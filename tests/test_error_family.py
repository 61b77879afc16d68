"""Every exception weightsync creates is one of its family (``protocol.errors``), or one of
the few exceptions docs/errors.md lists, each where and why it may be raised.

Walks the source of ``protocol/``, ``sender/`` and ``receiver/`` (nothing is imported but
the modules that define what a name refers to): every ``raise`` and every call that builds
an exception. Each is resolved to its class, through the module's imports, its own
classes, builtins, or a function's return annotation, and must be:

* a ``WeightSyncError`` (``TransportError`` for what ZeroMQ refuses, ``LimitError`` for an
  inbound bound, ``ConfigError`` for a bad argument or setting, ``StateError``, ...);
* one of ``OUTSIDE``, in the place its rule allows (``asyncio.CancelledError``, an abstract
  method's ``NotImplementedError``, ...);
* or one of ``SIGNALS``: raised and caught inside weightsync, never leaving a public call;
  each must be caught somewhere by name.

A ``raise`` of a value (``raise error``, ``raise counter.error``) re-raises an exception
built elsewhere, and that construction is walked where it is. A raised call the walk
cannot resolve must be named in ``RAISED_CALLS`` with the function it calls.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import importlib
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from protocol.errors import WeightSyncError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "sender", "receiver")
DOC = ROOT / "docs" / "errors.md"


@dataclass(frozen=True)
class Site:
    path: str  # relative to ROOT
    line: int
    function: ast.FunctionDef | ast.AsyncFunctionDef | None  # the innermost one around it
    raised: bool  # a raise statement (else a call that builds an exception)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def _abstract(site: Site) -> bool:
    """The whole body of a method (after its docstring) is this raise."""
    fn = site.function
    if fn is None:
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].lineno == site.line


def _in(*names: str) -> Callable[[Site], bool]:
    return lambda site: site.function is not None and site.function.name in names


def _cli(site: Site) -> bool:
    return site.path.endswith("__main__.py") or site.path == "protocol/host/cli.py"


# Outside the family, each where its rule allows (docs/errors.md, "Outside the family").
OUTSIDE: dict[type[BaseException], tuple[Callable[[Site], bool], str]] = {
    asyncio.CancelledError: (lambda site: True, "a cancellation passed on once the thread it waited for is done"),
    StopAsyncIteration: (_in("__anext__"), "the end of an async iterator (Python's protocol)"),
    NotImplementedError: (_abstract, "an abstract method a subclass overrides"),
    AttributeError: (_in("__getattr__", "__setattr__"), "a module's or proxy's __getattr__: what getattr and hasattr expect; "
                     "a read-only attribute's __setattr__ (a strategy's hooks): what a frozen dataclass raises"),
    SystemExit: (_cli, "a command line exiting with its message"),
}

# Raised and caught inside weightsync: control flow, not errors, kept out of the family so
# that no ``except WeightSyncError`` takes one for a failure. By class name, wherever in
# weightsync the class is defined.
SIGNALS: dict[str, str] = {
    "Reconnect": "ends a receiver's session; its loop opens a new one",
    "Foreign": "a Reconnect whose upstream answered with no weightsync message: said once, retried with a long backoff",
    "Leave": "ends a receiver's session on purpose (pause, sleep, close)",
    "_Superseded": "a resync overtook an incomplete patch; the receive takes the resync",
    "BuildFailed": "a version's build failed or was not synced; its parts already out are abandoned",
}

# Raised calls of a method on a local value, which the walk cannot resolve from the source:
# the callee as written -> the function called, whose return annotation says what it raises.
RAISED_CALLS: dict[str, str] = {
    "report.error": "protocol.wire.messages:ErrorReport.error",
}


def _sources() -> Iterator[tuple[str, str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            module = rel[:-3].replace("/", ".").removesuffix(".__init__")
            yield rel, module, ast.parse(path.read_text(), rel)


def _imports(module: str, is_package: bool, tree: ast.Module) -> dict[str, str]:
    """Every name the module's imports bind (at any depth), to "module:attribute" or "module"."""
    names: dict[str, str] = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # "import a.b" binds a; "import a.b as c", c to a.b
                top = alias.name.partition(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}:{alias.name}"
    return names


def _load(target: str) -> object:
    """"module:attr.attr" or "module" -> the object."""
    module, _, attrs = target.partition(":")
    try:
        obj: object = importlib.import_module(module)
    except ModuleNotFoundError:  # "from package import module"
        module, _, last = module.rpartition(".")
        obj = getattr(importlib.import_module(module), last)
    for attr in filter(None, attrs.split(".")):
        if not hasattr(obj, attr) and isinstance(obj, types.ModuleType):  # a submodule not imported yet
            importlib.import_module(f"{obj.__name__}.{attr}")
        obj = getattr(obj, attr)
    return obj


def _followed(target: str) -> bool:
    """Imports followed: weightsync's own and the standard library's. A third party's
    (torch, zmq, vllm) are not imported here; a raise of one cannot be resolved, and fails."""
    top = target.partition(":")[0].partition(".")[0]
    return top in PACKAGES or top in sys.stdlib_module_names


class _Resolver:
    def __init__(self, module: str, is_package: bool, tree: ast.Module) -> None:
        self.module = module
        self.imports = _imports(module, is_package, tree)
        self.functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        self.exceptions = self._exception_classes([n for n in tree.body if isinstance(n, ast.ClassDef)])

    def _exception_classes(self, classes: list[ast.ClassDef]) -> set[str]:
        """The module's own exception classes, told from their bases without importing it."""
        found: set[str] = set()
        while True:
            more = {c.name for c in classes if c.name not in found and any(
                (isinstance(b, ast.Name) and b.id in found) or _is_exception(self._outer(b)) for b in c.bases)}
            if not more:
                return found
            found |= more

    def _outer(self, expr: ast.expr) -> object | None:
        """What a name or dotted name imported or built in refers to; None if neither."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        head, rest = expr.id, ".".join(parts)
        if head in self.imports:
            target = self.imports[head]
            if not _followed(target):
                return None
            with contextlib.suppress(ImportError):  # an optional package's module (vllm's backend): not ours to raise
                return _load(f"{target}.{rest}" if ":" in target and rest else f"{target}:{rest}" if rest else target)
            return None
        if not parts and hasattr(builtins, head):
            return getattr(builtins, head)
        return None

    def __call__(self, expr: ast.expr, *, functions: bool = False) -> object | None:
        """What a name or dotted name refers to at module level; None for a local value, or
        a class of this module that is not an exception (or a function, unless ``functions``)."""
        if isinstance(expr, ast.Name) and (expr.id in self.exceptions or (functions and expr.id in self.functions)):
            return _load(f"{self.module}:{expr.id}")
        return self._outer(expr)


def _is_exception(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


def _returns(function: object) -> object:
    return typing.get_type_hints(function).get("return")


@dataclass(frozen=True)
class Found:
    site: Site
    what: str  # the source of the raised expression
    cls: type[BaseException] | None  # None: a value re-raised


def _walk_tree(path: str, module: str, tree: ast.Module) -> Iterator[Found]:
    resolve = _Resolver(module, path.endswith("__init__.py"), tree)

    def visit(node: ast.AST, function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> Iterator[Found]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Raise) and child.exc is not None:
                yield raised(child.exc, Site(path, child.lineno, inner, True))
                for sub in ast.iter_child_nodes(child.exc):  # its arguments may build exceptions too
                    yield from visit(sub, inner)
                if child.cause is not None:
                    yield from visit(child.cause, inner)
                continue
            if isinstance(child, ast.Call) and _is_exception(target := resolve(child.func)):
                yield Found(Site(path, child.lineno, inner, False), ast.unparse(child.func), typing.cast(type, target))
            yield from visit(child, inner)

    def raised(exc: ast.expr, site: Site) -> Found:
        callee = exc.func if isinstance(exc, ast.Call) else exc
        text = ast.unparse(callee)
        target = resolve(callee, functions=True)
        if _is_exception(target):
            return Found(site, text, typing.cast(type, target))
        if callable(target):  # a function that returns the exception
            return Found(site, text, _returns(target))
        if isinstance(exc, ast.Call):
            named = RAISED_CALLS.get(text)
            assert named is not None, f"{site}: raise {text}(...): cannot tell what it raises; list it in RAISED_CALLS"
            return Found(site, text, _returns(_load(named)))
        return Found(site, text, None)

    yield from visit(tree, None)


def _walk() -> Iterator[Found]:
    for path, module, tree in _sources():
        yield from _walk_tree(path, module, tree)


def _signal(cls: type[BaseException]) -> bool:
    return cls.__qualname__ in SIGNALS and cls.__module__.partition(".")[0] in PACKAGES


def _outside(found: list[Found]) -> list[str]:
    """The sites that raise or build an exception outside the family and its allowances."""
    wrong = []
    for each in found:
        cls = each.cls
        if cls is None or (isinstance(cls, type) and issubclass(cls, WeightSyncError)) or _signal(cls):
            continue
        rule = OUTSIDE.get(cls) if isinstance(cls, type) else None
        if rule is None or not rule[0](each.site):
            wrong.append(f"{each.site}: {each.what} ({getattr(cls, '__name__', cls)})")
    return wrong


FOUND = list(_walk())


def test_every_exception_raised_is_of_the_family_or_listed() -> None:
    wrong = _outside(FOUND)
    assert not wrong, "outside weightsync's error family (protocol/errors.py):\n" + "\n".join(wrong)


def test_the_walk_sees_what_it_checks() -> None:
    """Catches a walk that resolves nothing: each kind it must tell apart is found."""
    kinds = {found.cls for found in FOUND}
    from protocol.errors import LimitError, PeerGone, StateError, TransportError

    assert {LimitError, PeerGone, StateError, TransportError, WeightSyncError, NotImplementedError, None} <= kinds
    assert any(found.what == "error_from_code" and found.cls is WeightSyncError for found in FOUND)  # a function's return annotation
    assert sum(not found.site.raised for found in FOUND) > 0  # built, not raised: handed to a future


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_each_signal_is_raised_and_caught_inside(name: str) -> None:
    assert any(found.cls is not None and _signal(found.cls) and found.cls.__name__ == name for found in FOUND), name
    caught = False
    for _, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                named = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                caught = caught or any(ast.unparse(t).rpartition(".")[2] == name for t in named)
    assert caught, f"{name} is raised but never caught by name: it would leave a public call"


def test_the_allowances_are_documented() -> None:
    """docs/errors.md names every exception outside the family that this test allows."""
    text = DOC.read_text()
    names = [cls.__name__ for cls in OUTSIDE] + list(SIGNALS)
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"not in {DOC.relative_to(ROOT)}: {missing}"


SAMPLE = """
import asyncio
import zmq
from protocol.errors import ConfigError, error_from_code

def check(x):
    if x is None:
        raise ConfigError("x is None")
    raise ValueError("x")

def unfinished():
    x = 1
    raise NotImplementedError

def abstract():
    \"\"\"Overridden.\"\"\"
    raise NotImplementedError

async def stop(error):
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("built, not raised"))
    if error is not None:
        raise error
    raise error_from_code("config", "from a code")

def sent():
    raise zmq.ZMQError()
"""


def test_the_walk_finds_what_it_must() -> None:
    """A module of every kind: a third party's exception cannot be resolved, and of the rest
    only the raw builtins (raised or built) and the method that is not abstract are reported."""
    tree = ast.parse(SAMPLE)
    with pytest.raises(AssertionError, match=r"sample.py:\d+: raise zmq.ZMQError\(\.\.\.\): cannot tell"):
        list(_walk_tree("protocol/sample.py", "protocol.sample", tree))
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "sent")]
    found = list(_walk_tree("protocol/sample.py", "protocol.sample", tree))
    lines = SAMPLE.splitlines()
    reported = {line.partition(": ")[2] for line in _outside(found)}
    assert reported == {"ValueError (ValueError)", "NotImplementedError (NotImplementedError)", "RuntimeError (RuntimeError)"}, reported
    assert [lines[f.site.line - 1].strip() for f in found if f.cls is None] == ["raise error"]  # a value: re-raised
    assert any(f.what == "error_from_code" and f.cls is WeightSyncError for f in found)


def test_the_whole_family_is_exported_from_protocol() -> None:
    """``from protocol import X`` works for every class a caller may catch."""
    import protocol
    from protocol import errors

    family = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, errors.WeightSyncError)}
    assert family - set(protocol.__all__) == set()
    assert all(getattr(protocol, name) is getattr(errors, name) for name in family)
