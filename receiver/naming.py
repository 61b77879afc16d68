"""Explicit mapping from the rollout model's parameter names to the trainer's.

Inference engines often name parameters differently from the training framework (a
wrapper module's prefix, fused projections renamed). The receiver renames its own state
before the handshake, so the sender only ever sees trainer names and the wire format is
unchanged; the tensors are the same objects, so updates land in the rollout model.

Nothing is guessed: a mapping is a dict, a callable, or the named preset ``"is_agent"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch

from protocol.errors import ConfigError

# RLinf's weight syncer names an ``is_agent`` naming option without defining it. weightsync defines it
# as: the trainer holds the rollout's model as the ``model`` submodule of an agent
# wrapper, so every trainer name is the rollout name with this prefix.
AGENT_PREFIX = "model."

NameMappingSpec = Mapping[str, str] | Callable[[str], str] | str


def add_prefix(prefix: str) -> Callable[[str], str]:
    """A mapping that prepends ``prefix`` to every rollout name."""
    return lambda name: prefix + name


class NameMapping:
    """Rollout name -> trainer name, validated against the rollout model's names.

    A dict lists the names it renames; names it does not list keep their own. A callable
    must return a non-empty string for every name. Two rollout names that map to one
    trainer name, or a dict entry the model does not have, are a ``ConfigError``.
    """

    def __init__(self, spec: NameMappingSpec, names: Iterable[str]) -> None:
        if spec == "is_agent":
            spec = add_prefix(AGENT_PREFIX)
        elif isinstance(spec, str):
            raise ConfigError(f"unknown name_mapping preset {spec!r}; use a dict, a callable or 'is_agent'")
        self.spec = spec
        self.forward = self._build(list(names))
        self.backward = {v: k for k, v in self.forward.items()}

    def _build(self, names: list[str]) -> dict[str, str]:
        spec = self.spec
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - set(names))
            if unknown:
                raise ConfigError(f"name_mapping renames {unknown[0]!r}, which the rollout model does not have ({len(unknown)} such names)")
            out = {n: spec.get(n, n) for n in names}
        elif callable(spec):
            out = {n: spec(n) for n in names}
        else:
            raise ConfigError(f"name_mapping must be a dict, a callable or 'is_agent', got {type(spec).__name__}")
        seen: dict[str, str] = {}
        for name, mapped in out.items():
            if not isinstance(mapped, str) or not mapped:
                raise ConfigError(f"name_mapping leaves {name!r} unmapped (got {mapped!r}, expected a trainer name)")
            if mapped in seen:
                raise ConfigError(f"name_mapping maps both {seen[mapped]!r} and {name!r} to the trainer name {mapped!r}")
            seen[mapped] = name
        return out

    def rename(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The same tensors under trainer names (a new dict; no tensor is copied)."""
        return {self.forward.get(k, k): t for k, t in tensors.items()}

    def explain(self, message: str) -> str:
        """Add the rollout name to an error that quotes a trainer name."""
        match = re.search(r"key '([^']*)'", message)
        key = match.group(1) if match else None
        if key in self.backward and self.backward[key] != key:
            return f"{message} (rollout name {self.backward[key]!r}, renamed by name_mapping)"
        if key in self.forward and self.forward[key] != key:
            return f"{message} (name_mapping renames the rollout's {key!r} to {self.forward[key]!r})"
        near = self.nearest(key) if key is not None else None
        if near is not None:
            return f"{message} (names are after name_mapping, which sends the rollout's {near!r} as {self.forward[near]!r})"
        return f"{message} (names are after name_mapping)"

    def nearest(self, trainer_name: str) -> str | None:
        """The rollout name that most likely should have mapped to ``trainer_name``: the
        one sharing the longest dotted suffix with it (two parts at least, and no tie), so
        a wrong prefix or a forgotten dict entry is pointed at rather than left to guess."""
        want = trainer_name.split(".")
        best: list[str] = []
        length = 1
        for name in self.forward:
            n = _common_suffix(want, name.split("."))
            if n > length:
                best, length = [name], n
            elif n == length and best:
                best.append(name)
        return best[0] if len(best) == 1 else None


def _common_suffix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n
