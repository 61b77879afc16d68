"""A patch cut into parts: consecutive groups of a version's ``Captured`` changes of at
least ``part_bytes`` each (by the bytes captured: positions and values, or the whole
tensor), so a receiver decodes one part while the next is encoded and sent."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable

from .captured import Captured


def cut(captured: list[Captured], part_bytes: int) -> list[list[Captured]]:
    """The parts of a collected version; one group for ``part_bytes`` 0, for no changes, or
    for fewer changes than ``part_bytes``."""
    groups: list[list[Captured]] = [[]]
    size = 0
    for c in captured:
        if part_bytes and size >= part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(c)
        size += c.nbytes
    return groups


async def cut_stream(stream: AsyncIterable[Captured], part_bytes: int) -> AsyncGenerator[tuple[list[Captured], bool], None]:
    """The parts of a version still being collected, each with whether it is the last: a
    part is yielded once the change after it has come (or the stream ended), so the first
    parts go out while the rest is compared. The same groups as ``cut``."""
    group: list[Captured] = []
    size = 0
    async for c in stream:
        if group and part_bytes and size >= part_bytes:
            yield group, False
            group, size = [], 0
        group.append(c)
        size += c.nbytes
    yield group, True
