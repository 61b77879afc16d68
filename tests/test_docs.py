"""The docs say what the code does: the configuration reference covers every knob, and
every link between the pages resolves.

Walks the config dataclasses, the ``Sender`` / ``Receiver`` signatures and the CLI
parsers (``python -m sender``, ``python -m sender keygen``, ``python -m receiver``,
``python -m receiver ctl``) and fails when one of their keys, keyword arguments or flags
is missing from its table in docs/configuration.md, or documents another default. Nothing is listed by hand: a new field, argument or flag must be
documented to pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "configuration.md"
REFERENCE = "Configuration reference"


# -- the the reference's reference tables -------------------------------------------------------------
def sections(text: str) -> dict[str, str]:
    """Body of every heading, keyed by its title (without '#' and backticks), up to the
    next heading of the same or a higher level. Headings inside code blocks don't count."""
    lines = text.splitlines()
    heads: list[tuple[int, int, str]] = []
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{1,6})\s+(.*?)\s*$", line)):
            heads.append((i, len(m.group(1)), m.group(2).replace("`", "")))
    out = {}
    for n, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[n + 1:] if lv <= level), len(lines))
        out[title] = "\n".join(lines[i + 1:end])
    return out


def rows(body: str) -> list[list[str]]:
    """Cells of the table rows in ``body`` (header and separator rows excluded)."""
    out = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        if all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            continue
        out.append(cells)
    return out[1:] if out else out  # the first row is the header


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    found = sections(PAGE.read_text())
    assert REFERENCE in found, f"docs/configuration.md has no '# {REFERENCE}' section"
    return found


def table(reference: dict[str, str], title: str) -> list[list[str]]:
    assert title in reference, f"docs/configuration.md lacks the '## {title}' table"
    got = rows(reference[title])
    assert got, f"docs/configuration.md '## {title}' has no table"
    return got


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# -- YAML keys ---------------------------------------------------------------------------------
def config_keys() -> Iterator[tuple[str, Any]]:
    """Every leaf of the config as a dotted path, with its default (nested dataclasses
    walked through their default instances, so each side's own defaults are seen)."""
    from protocol.config import SyncConfig

    def walk(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    yield from walk(SyncConfig(), "")


def yaml_form(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (tuple, list)):  # a YAML flow list; strings single-quoted (backslashes kept)
        return "[" + ", ".join(f"'{v}'" if isinstance(v, str) else yaml_form(v) for v in value) + "]"
    return str(value)


def test_every_config_key_is_documented(reference: dict[str, str]) -> None:
    documented = {span: cells for cells in table(reference, "YAML keys") for span in code_spans(cells[0])}
    keys = list(config_keys())
    assert len(keys) > 10, keys  # the walk found the nested dataclasses
    missing = [k for k, _ in keys if k not in documented]
    assert not missing, f"config keys missing from the reference's 'YAML keys' table: {missing}"
    wrong = [
        (k, yaml_form(v), documented[k][1]) for k, v in keys if f"`{yaml_form(v)}`" not in documented[k][1].replace("\\|", "|")
    ]
    assert not wrong, f"the reference's 'YAML keys' table documents other defaults (key, code default, reference cell): {wrong}"


# -- constructor arguments -----------------------------------------------------------------------
def python_form(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("name", ["Sender", "Receiver"])
def test_every_constructor_argument_is_documented(reference: dict[str, str], name: str) -> None:
    if name == "Sender":
        from sender import Sender as cls
    else:
        from receiver import Receiver as cls
    params = [
        p for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    assert params
    documented = {span: cells for cells in table(reference, f"{name}(...)") for span in code_spans(cells[0])}
    missing = [p.name for p in params if p.name not in documented]
    assert not missing, f"{name}(...) arguments missing from the reference's '{name}(...)' table: {missing}"
    wrong = []
    for p in params:
        cell = documented[p.name][1]
        expected = "required" if p.default is p.empty else f"`{python_form(p.default)}`"
        if expected not in cell:
            wrong.append((p.name, expected, cell))
    assert not wrong, f"the reference's '{name}(...)' table documents other defaults (argument, expected, reference cell): {wrong}"


# -- CLI flags ---------------------------------------------------------------------------------
class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def capture_parser(build: Callable[[], Any]) -> argparse.ArgumentParser | None:
    """The parser ``build()`` creates, caught when it starts parsing (nothing after runs)."""

    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    patches = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args", "parse_intermixed_args")}
    try:
        for name in patches:
            setattr(argparse.ArgumentParser, name, caught)
        build()
    except _Parsed as e:
        return e.parser
    except (Exception, SystemExit):
        return None
    finally:
        for name, original in patches.items():
            setattr(argparse.ArgumentParser, name, original)
    return None


def help_flags(argv: list[str]) -> set[str]:
    """Fallback: the flags ``python -m ... --help`` lists."""
    done = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = [line for line in done.stdout.splitlines() if re.match(r"^\s{2}(-\w[ ,].*)?--[a-z]", line)]  # option lines only
    return {m.group(1) for line in listed for m in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split("  ")[1])} - {"--help"}


def called(module: str, function: str) -> Callable[[], Any]:
    """``module.function([])``, the module imported only when it is called (inside ``capture_parser``)."""
    return lambda: getattr(importlib.import_module(module), function)([])


def cli_parsers() -> dict[str, tuple[Callable[[], Any], list[str]]]:
    """Reference table title -> (a call that builds and parses, the module argv for --help)."""
    return {
        "python -m sender": (called("sender.__main__", "parse_args"), ["sender"]),
        "python -m sender keygen": (called("sender.__main__", "keygen"), ["sender", "keygen"]),
        "python -m sender compile": (called("sender.__main__", "compile_kernels_main"), ["sender", "compile"]),
        "python -m receiver compile": (called("receiver.__main__", "compile_main"), ["receiver", "compile"]),
        "python -m receiver": (called("receiver.control.daemon", "parse_args"), ["receiver"]),
        "python -m receiver ctl": (called("receiver.control.http_client", "parse_args"), ["receiver", "ctl"]),
    }


def flags_of(cells: list[str]) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(code_spans(cells[0])))


@pytest.mark.parametrize("title", list(cli_parsers()))
def test_every_cli_flag_is_documented(reference: dict[str, str], title: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WEIGHTSYNC_CONTROL_TOKEN", "WEIGHTSYNC_CONTROL_URL"):  # defaults read from the environment
        monkeypatch.delenv(var, raising=False)
    build, argv = cli_parsers()[title]
    body_rows = table(reference, title)
    documented = {flag: cells for cells in body_rows for flag in flags_of(cells)}
    parser = capture_parser(build)
    if parser is None:  # the module no longer builds its parser where this test looks: ask --help
        missing = sorted(help_flags(argv) - documented.keys())
        assert not missing, f"{title} flags missing from the reference's '{title}' table: {missing}"
        return
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    options = [a for a in actions if a.option_strings]
    assert options
    missing = [a.option_strings[-1] for a in options if not any(s in documented for s in a.option_strings)]
    assert not missing, f"{title} flags missing from the reference's '{title}' table: {missing}"
    body = reference[title]
    for positional in (a for a in actions if not a.option_strings):  # subcommands: each choice named
        absent = [c for c in positional.choices or () if f"`{c}`" not in body]
        assert not absent, f"{title}: {positional.dest} choices missing from the reference: {absent}"
    wrong = []
    for a in options:
        cells = next(documented[s] for s in a.option_strings if s in documented)
        if a.required:
            expected = "required"
        elif a.default is None or isinstance(a.default, bool) or a.default is argparse.SUPPRESS:
            continue
        elif isinstance(a.default, (list, tuple)):
            expected = " ".join(f"`{v}`" for v in a.default)
        else:
            expected = f"`{a.default}`"
        if expected not in cells[1]:
            wrong.append((a.option_strings[-1], expected, cells[1]))
    assert not wrong, f"the reference's '{title}' table documents other defaults (flag, expected, reference cell): {wrong}"


# -- the test's own parsing ------------------------------------------------------------------
def test_reference_parsing_finds_tables() -> None:
    text = "## Configuration reference\n\n### T\n\n| a | b |\n| --- | --- |\n| `--x N` `-y` | `1` |\n```\n# not a heading\n```\n"
    found = sections(text)
    assert set(found) == {"Configuration reference", "T"}
    assert rows(found["T"]) == [["`--x N` `-y`", "`1`"]]
    assert flags_of(rows(found["T"])[0]) == ["--x"]
    parser = capture_parser(lambda: argparse.ArgumentParser(prog="x").parse_args(["--nope"]))
    assert parser is not None and parser.prog == "x"


# -- the pages and their links ----------------------------------------------------------------
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-"))
    return out


def test_the_front_page_gives_the_two_commands() -> None:
    quick = sections(README.read_text())["Quick start"]
    assert "make demo" in quick and "make test" in quick


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_between_pages_resolves(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken


# -- what the pages name exists ----------------------------------------------------------------
OURS = r"((?:protocol|sender|receiver)(?:\.\w+)*)"
PACKAGE_IMPORT = re.compile(rf"^[ \t]*(?:from[ \t]+{OURS}[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)|import[ \t]+{OURS})", re.M)
PACKAGE_PATH = re.compile(r"(?<![\w/.])((?:protocol|sender|receiver)/(?:\w+/)*\w+\.py)\b")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[\w-]*\n(.*?)```", text, re.S)


@pytest.mark.parametrize("page", [*PAGES, *sorted((ROOT / "examples").glob("*.md"))], ids=lambda p: p.name)
def test_every_import_a_page_shows_works(page: Path) -> None:
    """A user copying a page's code imports what it names: the public API has not moved."""
    import importlib

    missing = []
    for block in code_blocks(page.read_text()):
        for found in PACKAGE_IMPORT.finditer(block):
            module = found.group(1) or found.group(3)
            try:
                imported = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{module}: {e}")
                continue
            for name in re.split(r"[\s,()]+", found.group(2) or ""):
                name = name.split(" as ")[0].strip()
                if name and name != "as" and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        missing.append(f"{module}.{name}")
    assert missing == []


@pytest.mark.parametrize("page", [*PAGES, *sorted((ROOT / "examples").glob("*.md"))], ids=lambda p: p.name)
def test_every_source_file_a_page_names_exists(page: Path) -> None:
    """A moved or renamed module leaves no page pointing at nothing."""
    names = set(PACKAGE_PATH.findall(page.read_text()))
    assert sorted(n for n in names if not (ROOT / n).exists()) == []
