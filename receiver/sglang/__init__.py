"""weightsync in SGLang's workers, through SGLang's own ``--custom-weight-loader`` extension
point (``loader.py``, imported by SGLang in each scheduler process) and driven from the
engine's owner or over HTTP (``client.SGLangWeights``). Nothing here patches SGLang.
See docs/engines-sglang.md."""

from __future__ import annotations

from .commands import LOADER

__all__ = ["LOADER"]
