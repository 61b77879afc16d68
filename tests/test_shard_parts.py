"""sender/sharded/shard_parts.py: every rank's encoded part moved to the leader, over 2 and 4 real gloo
ranks on CPU, each its own process (one spawn a world size; starting ranks is the slow part).

Each rank, in order: three versions of parts of random sizes (0, hundreds of bytes, a few MB;
the leader's own part empty in one), taken by ``parts`` and ``aparts``; the three
disagreements (another version, another layout digest, a rank without a part), each raised on
every rank; last, a rank that agrees and then never sends, the leader's ``WeightSyncTimeout``
timed, and every rank's next agreement failing (typed) instead of waiting. Each rank records
what it saw; the tests compare the records with parts regenerated here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import spawn_ranks

from examples.fsdp2_trainer import free_port
from protocol.errors import GatherOrderError, WeightSyncError, WeightSyncTimeout
from sender.sharded.shard_parts import PartMover, control_bytes, layout_digest

VERSIONS = (1, 2, 3)
TIMEOUT = 3.0  # the mover's timeout, seconds
SLACK = 2.0
DEADLINE = 90.0  # seconds for one spawn; a hang fails the tests instead of blocking them
DIGEST = layout_digest([("embed.weight", (64, 32)), ("head.weight", (64, 32)), "norm.weight"])


def part_size(version: int, rank: int) -> int:
    """Sizes covering empty parts (the leader's too, at version 3), small ones and a few MB."""
    kind = (version + rank) % 3
    if kind == 0:
        return 0
    seed = version * 1000 + rank
    return 1 + seed % 997 if kind == 1 else (2 << 20) + seed * 7919 % (1 << 20)


def make_part(version: int, rank: int) -> bytes:
    g = torch.Generator().manual_seed(version * 1000 + rank)
    return torch.randint(0, 256, (part_size(version, rank),), dtype=torch.uint8, generator=g).numpy().tobytes()


def _sha(b: memoryview | bytes) -> str:
    return hashlib.sha256(b).hexdigest()


async def _lead_async(mover: PartMover, agreed: Any, part: bytes) -> list[tuple[int, str]]:
    return [(r, _sha(b)) async for r, b in mover.aparts(agreed, part)]


def _rank(rank: int, world: int, out: Path) -> None:
    mover = PartMover(timeout=TIMEOUT)
    record: dict[str, Any] = {"versions": [], "disagreements": {}}
    for version in VERSIONS:
        part = make_part(version, rank)
        agreed = mover.agree(version, DIGEST, part)
        got: list[tuple[int, str]] = []
        if rank == 0:
            if version == 2:
                got = asyncio.run(_lead_async(mover, agreed, part))
            else:
                for r, b in mover.parts(agreed, part):
                    if r == 0:
                        got.append((r, "own" if b.obj is part else "copied"))  # the leader's own part: a view, not a copy
                    else:
                        got.append((r, _sha(b)))
        else:
            mover.send(agreed, part)
        record["versions"].append({"version": version, "sizes": agreed.sizes, "got": got, "moved": agreed.moved_bytes,
                                   "control": agreed.control_bytes, "group": agreed.group_bytes, "arrived": agreed.arrived})

    # Disagreements: every rank makes the one collective, so every rank raises, and the group stays in step.
    cases = {
        "version": (10 + (rank == world - 1), DIGEST, b"x"),
        "digest": (11, DIGEST if rank != 1 else layout_digest(["other"]), b"x"),
        "no_part": (12, DIGEST, None if rank == 1 else b"x"),
    }
    for name, (version, digest, part) in cases.items():
        try:
            mover.agree(version, digest, part)
            record["disagreements"][name] = None
        except GatherOrderError as e:
            record["disagreements"][name] = str(e)

    # A rank that never sends (the last): it agrees, then skips its send.
    version, silent = 20, world - 1
    part = make_part(1, rank) or b"p"  # every part non-empty: the silent one is waited for
    agreed = mover.agree(version, DIGEST, part)
    started = time.monotonic()
    if rank == 0:
        got = []
        try:
            for r, _ in mover.parts(agreed, part):
                got.append(r)
            record["silent"] = {"raised": None}
        except WeightSyncTimeout as e:
            record["silent"] = {"raised": "timeout", "message": str(e)}
        record["silent"].update(elapsed=time.monotonic() - started, got=got)
    elif rank != silent:
        mover.send(agreed, part)
    # The next version: no rank waits on the broken group past the timeout, each raises a typed error.
    started = time.monotonic()
    try:
        mover.agree(version + 1, DIGEST, part)
        record["next"] = {"raised": None}
    except WeightSyncError as e:
        record["next"] = {"raised": type(e).__name__}
    record["next"]["elapsed"] = time.monotonic() - started
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        _rank(rank, world, Path(out_dir))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"parts{world}")
    spawn_ranks(_worker, world, (world, free_port(), str(out)), DEADLINE, "a wait was not bounded")
    return world, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_sizes_cover_empty_small_and_megabytes() -> None:
    sizes = {part_size(v, r) for v in VERSIONS for r in range(4)}
    assert 0 in sizes and any(0 < n < 1000 for n in sizes) and any(n > 2 << 20 for n in sizes)
    assert part_size(3, 0) == 0  # the leader's own part empty once


def test_leader_gets_every_part_bit_exact_in_rank_order(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, records = ranks
    for record in records:
        assert [v["version"] for v in record["versions"]] == list(VERSIONS)
    for v in records[0]["versions"]:
        version = v["version"]
        expected = [(r, "own" if r == 0 else _sha(make_part(version, r))) for r in range(world) if part_size(version, r)]
        if version == 2:  # aparts: hashes for every part
            expected = [(r, _sha(make_part(version, r))) for r, _ in expected]
        assert [tuple(x) for x in v["got"]] == expected, version  # empty parts neither sent nor yielded
        assert v["arrived"] == [r for r, _ in expected]
        for record in records:  # every rank learnt every size
            assert record["versions"][version - 1]["sizes"] == [part_size(version, r) for r in range(world)]


def test_accounting_is_the_parts_plus_the_control(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, records = ranks
    assert control_bytes(world) == world * (world - 1) * 64  # 8 int64 a rank, to each other rank
    for v in records[0]["versions"]:
        version = v["version"]
        remote = sum(part_size(version, r) for r in range(1, world))
        assert v["moved"] == remote and v["control"] == control_bytes(world)
        assert v["group"] == remote + control_bytes(world)
    for rank, record in enumerate(records[1:], start=1):
        for v in record["versions"]:
            assert v["moved"] == part_size(v["version"], rank)  # what this rank sent


def test_disagreements_raise_on_every_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    _, records = ranks
    for name in ("version", "digest", "no_part"):
        messages = [record["disagreements"][name] for record in records]
        assert all(messages), (name, messages)
        assert len(set(messages)) == 1, messages  # the same error, word for word, on every rank
    assert "different versions" in records[0]["disagreements"]["version"]
    assert "ranks [1]" in records[0]["disagreements"]["digest"]
    assert "ranks [1] have no part" in records[0]["disagreements"]["no_part"]


def test_a_rank_that_never_sends_times_out_on_the_leader(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, records = ranks
    silent = records[0]["silent"]
    assert silent["raised"] == "timeout", silent
    assert f"rank {world - 1}'s part of version 20" in silent["message"]
    assert silent["got"] == list(range(world - 1))  # the parts before it were taken
    assert TIMEOUT - 0.5 <= silent["elapsed"] <= TIMEOUT + SLACK
    for rank, record in enumerate(records):  # the group is broken: the next agreement fails, bounded, everywhere
        assert record["next"]["raised"] in ("WeightSyncError", "WeightSyncTimeout"), (rank, record["next"])
        assert record["next"]["elapsed"] <= TIMEOUT + SLACK, (rank, record["next"])
