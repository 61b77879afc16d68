"""``python -m sender compile`` and ``python -m receiver compile``: numba's kernels into its
cache ahead of the first start (an image build, ``make install``).

Run here against the cache the test session's start filled (tests/conftest.py), so each
loads rather than compiles; what a cold start costs is in docs/troubleshooting.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
T = 120.0


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=T)


PAIRS = "bf16:bf16,float16:float32,int32:int32"


@pytest.mark.parametrize("argv", [("sender", "compile"), ("sender", "compile", "--pairs", PAIRS), ("receiver", "compile")])
def test_compile_reports_what_it_compiled(argv: tuple[str, ...]) -> None:
    done = _run(*argv)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    report = json.loads(line)
    assert report["event"] == "compiled" and report["side"] == argv[0] and report["seconds"] >= 0
    if "--pairs" in argv:
        assert report["pairs"] == argv[-1]


@pytest.mark.parametrize("pairs, why", [("float32", "not enough values"), ("bogus:bfloat16", "unsupported float dtype 'bogus'")])
def test_compile_refuses_bad_dtype_pairs(pairs: str, why: str) -> None:
    done = _run("sender", "compile", "--pairs", pairs)
    assert done.returncode == 2 and why in done.stderr and done.stdout == ""
