"""The rollout engine as the control API sees it: optional hooks, and the memory tags.

The receiver owns the weights; the engine owns generation and its KV cache. Pausing,
resuming and the KV cache's sleep and wakeup are the engine's to do, so the receiver
calls these hooks at the right moment of each control call. Hooks may be plain
functions or coroutines; a hook that raises fails the call and leaves the state as it was.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from protocol.errors import ConfigError

WEIGHT = "weight"
KV_CACHE = "kv_cache"
TAGS = (WEIGHT, KV_CACHE)

Hook = Callable[[], Any]
AbortHook = Callable[[bool, list[str]], Any]  # (abort_all, request ids) -> what was aborted, or None


@dataclass
class EngineHooks:
    on_pause: Hook | None = None  # stop generating: abort or finish in-flight requests
    on_resume: Hook | None = None  # generate again (weights are current)
    on_sleep_kv_cache: Hook | None = None  # release the KV cache's memory
    on_wakeup_kv_cache: Hook | None = None  # reallocate it (before the weights come back)
    on_abort_requests: AbortHook | None = None  # abort every request, or those ids (/v1/abort_requests)


async def call_hook(hook: Callable[..., Any] | None, *args: Any) -> Any:
    """Call a sync or async hook; returns what it returned (awaited)."""
    if hook is None:
        return None
    result = hook(*args)
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        result = await result
    return result


def parse_tags(tags: str | Iterable[str] | None) -> frozenset[str]:
    """``None`` means every tag; a string is comma-separated. Unknown or no tags: ``ConfigError``."""
    if tags is None:
        return frozenset(TAGS)
    items = [t.strip() for t in tags.split(",")] if isinstance(tags, str) else [str(t).strip() for t in tags]
    if not items or any(not t for t in items):
        raise ConfigError(f"tags must be a comma-separated subset of {list(TAGS)}, got {tags!r}")
    unknown = sorted(set(items) - set(TAGS))
    if unknown:
        raise ConfigError(f"unknown tag {unknown[0]!r}; tags are {list(TAGS)}")
    return frozenset(items)


def parse_version(version: object) -> int | None:
    """A version for ``update_weights``: an int, or a string whose trailing digits are the
    version (``"1200"``, ``"global_step_1200"``: checkpoint names as FastDeploy's API passes
    them). ``None`` means the sender's current version. Anything else: ``ConfigError``."""
    if version is None:
        return None
    if type(version) is int:
        if version < 0:
            raise ConfigError(f"version must be non-negative, got {version}")
        return version
    if isinstance(version, str):
        match = re.fullmatch(r"(?:.*?\D)?(\d+)", version.strip())
        if match:
            return int(match.group(1))
    raise ConfigError(f"version must be an int, a string ending in digits (global_step_1200) or null, got {version!r}")
