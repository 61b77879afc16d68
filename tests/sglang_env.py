"""Skip an SGLang test module where SGLang does not import: it lives in its own venv
(``make sglang-env``; docs/engines-sglang.md), and ``make test`` runs these modules there."""

from __future__ import annotations

from pathlib import Path

import pytest


def require_sglang(test_file: str) -> None:
    """Call at the top of a test module, before importing SGLang; skips the whole module."""
    try:
        import sglang  # noqa: F401
    except Exception as exc:  # ImportError, or a packaging fault raised while sglang imports
        name = Path(test_file).name
        pytest.skip(
            f"sglang is not importable in this interpreter ({type(exc).__name__}: {exc}); "
            f"build it with `make sglang-env` and run `.venv-sglang/bin/python -m pytest tests/{name}`",
            allow_module_level=True,
        )
