"""A Megatron trainer synced through ``ShardedSync`` over a ``MegatronLayout``, in spawned gloo
ranks (``tests/test_megatron_sync.py``; the model and the training step: ``tests/megatron_ranks.py``).

Rank 0 leads: its Sender serves an in-process receiver that joins before v1 and one that joins
after v2 (both bootstrapped at the next version through the bridge's export). After every
version every rank runs the bridge's own ``export_hf_weights`` (the test's, outside the sync: a
collective) and the leader checks each receiver holds exactly it, cast to the receivers' dtype,
bit for bit. Everything found goes to ``out_dir/rank{r}.json``; the parent asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.megatron_ranks import Layout, build, init_rank, train_step

RECEIVER_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Scenario:
    """What one spawn does: the learning rate of each version (a large one changes every
    element: those tensors travel dense), the patch codec, whether the receivers are Hugging
    Face models (``hf_model``) or plain dicts in the checkpoint's names."""

    lrs: tuple[float, ...] = (1e-4, 1e-4, 1e-2, 1e-4)
    codec: str = "host"
    hf_model: bool = True
    late_after: int = 2  # a second receiver joins after this version
    fail_rank: int | None = None  # this rank's part fails at the last version + 1 (then a resync version)
    # then a receiver joins and the leader's Sender fails between the parts and the bootstrap the
    # other ranks are exporting for (then a resync version)
    leader_fails_at_boot: bool = False
    train: bool = True  # False: each "step" adds seeded noise to every local parameter (Megatron does not train MoE at TP > 1 here)


def receiver_model(hf_dir: str, hf_model: bool, names: dict[str, torch.Tensor], seed: int) -> Any:
    """A rollout's weights, randomly initialised: a transformers model from the checkpoint's
    config, or a dict of the exported names (transformers 5 fuses Qwen3-MoE experts in memory,
    while the checkpoint and the bridge name one tensor an expert)."""
    torch.manual_seed(seed)
    if not hf_model:
        return {n: torch.randn(t.shape).to(RECEIVER_DTYPE) for n, t in names.items()}
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=RECEIVER_DTYPE)


def exported(bridge: Any, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(RECEIVER_DTYPE, copy=True) for n, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}


def state_of(weights: Any) -> dict[str, torch.Tensor]:
    return dict(weights.state_dict()) if isinstance(weights, torch.nn.Module) else weights


def differing(held: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose held bits differ from the expected ones (or that are missing), each with how
    many elements differ."""
    out = []
    for name, want in expected.items():
        got = held.get(name)
        if got is None or got.shape != want.shape:
            out.append(f"{name} (missing or shaped {None if got is None else tuple(got.shape)})")
        elif not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            out.append(f"{name} ({int((got.view(torch.int16) != want.view(torch.int16)).sum())} of {want.numel()})")
    return out


def perturb(model: list[torch.nn.Module], version: int, scale: float) -> None:
    """Seeded noise on every local parameter: the same for a parameter's replicas on every rank
    (its name and shape seed it), so replicated parameters stay alike, as training keeps them."""
    with torch.no_grad():
        for i, chunk in enumerate(model):
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(f"{version}/{i}/{name}/{tuple(p.shape)}".encode()))
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)


def step(model: list[torch.nn.Module], tokens: torch.Tensor, hidden: int, version: int, lr: float, train: bool) -> float | None:
    if train:
        return train_step(model, tokens, hidden, lr=lr)
    perturb(model, version, lr)
    return None


@dataclass(frozen=True)
class Case:
    """One model and layout synced in a spawn: ``hf_dir`` the checkpoint, ``out`` its results' folder."""

    name: str
    hf_dir: str
    layout: Layout
    moe: bool
    hidden: int
    scenario: Scenario
    out: str


def sync_worker(rank: int, world: int, port: int, cases: list[Case], tokens: torch.Tensor) -> None:
    """Every case in turn on this rank's one gloo group (Megatron's model-parallel state made
    for each and destroyed after it: one spawn, one Megatron import, for several layouts)."""
    from megatron.core import parallel_state

    init_rank(rank, world, port)
    for case in cases:
        bridge, model = build(case.hf_dir, case.layout, case.moe)
        loaded = {n: t.detach().clone() for n, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
        out = asyncio.run(_scenario(rank, bridge, model, case.hf_dir, tokens, case.hidden, case.scenario))
        if rank == 0:  # the bridge's export of the loaded model is the checkpoint (in the parameters' dtype)
            from safetensors.torch import load_file

            checkpoint = load_file(str(Path(case.hf_dir) / "model.safetensors"))
            out["loaded_is_checkpoint"] = sorted(loaded) == sorted(checkpoint) and all(
                torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in checkpoint.items())
        out["hf_dir"] = case.hf_dir
        Path(case.out, f"rank{rank}.json").write_text(json.dumps(out))
        del bridge, model
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


async def _scenario(
    rank: int, bridge: Any, model: list[torch.nn.Module], hf_dir: str, tokens: torch.Tensor, hidden: int, scenario: Scenario
) -> dict[str, Any]:
    from protocol.errors import GatherOrderError
    from receiver import Receiver
    from sender import Sender
    from sender.sharded.megatron import MegatronLayout
    from sender.sharded.sync import ShardedSync

    layout = MegatronLayout(bridge, model)
    sharded = ShardedSync(layout, timeout=60)
    out: dict[str, Any] = {"landings": [[x.tensor, x.param, x.local.to_wire(), x.span.to_wire()] for x in layout.landings],
                           "versions": [], "exports_at_start": layout.stats.gathers}
    config = {"weight_syncer": {"type": "patch", "patch": {"codec": scenario.codec, "part_bytes": 4096}}}
    async with contextlib.AsyncExitStack() as stack:
        sender = Sender("tcp://127.0.0.1:0", config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
        if sender is not None:
            await stack.enter_async_context(sender)
        await sharded.start(sender, version=0)
        receivers: list[tuple[Receiver, Any]] = []
        joining: list[asyncio.Task[Any]] = []

        async def join() -> None:
            assert sender is not None
            weights = receiver_model(hf_dir, scenario.hf_model, layout.meta, seed=len(receivers) + 1)
            receiver = Receiver(weights, sender.endpoint, config, identity=f"rollout-{len(receivers)}")
            await stack.enter_async_context(receiver)
            receivers.append((receiver, weights))
            joining.append(asyncio.ensure_future(receiver.start()))
            deadline = asyncio.get_running_loop().time() + 30
            while not sender.bootstrap_wanted:  # bootstrapped at the next version
                if joining[-1].done():
                    joining[-1].result()  # its start failed: say why
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError("no receiver asked for a bootstrap")
                await asyncio.sleep(0.01)

        async def check(version: int) -> list[list[Any]]:
            expected = exported(bridge, model)  # every rank: the bridge's own export of this step
            if sender is None:
                return []
            for task in joining:
                await task
            joining.clear()
            await sender.flush()
            found = []
            for receiver, weights in receivers:
                await receiver.wait_for_version(version, timeout=60)
                async with receiver.reading():
                    found.append([receiver.identity, differing(state_of(weights), expected), len(expected)])
            return found

        if rank == 0:
            await join()
        for version, lr in enumerate(scenario.lrs, start=1):
            loss = step(model, tokens, hidden, version, lr, scenario.train)
            stats = await sharded.sync(sender, version)
            record: dict[str, Any] = {"version": version, "exported": list(sharded.stats.last), "checks": await check(version), "loss": loss}
            if stats is not None:
                record.update(changed=stats.changed_elements, total=stats.total_elements, dense=stats.tensors_dense,
                              tensors=stats.tensors_changed, wire=stats.wire_bytes)
            out["versions"].append(record)
            if version == scenario.late_after and rank == 0:
                await join()
        version = len(scenario.lrs)

        async def failing_version(target: Any, name: str, where: str) -> str | None:
            """A version with ``target.name`` raising (None: this rank injects nothing): every rank's
            error type, None where the version went through; then a version that resyncs."""
            nonlocal version
            version += 1
            step(model, tokens, hidden, version, 1e-4, scenario.train)
            with contextlib.ExitStack() as undo:
                if target is not None:
                    real = getattr(target, name)
                    undo.callback(setattr, target, name, real)

                    def failing(*args: Any) -> Any:
                        raise RuntimeError(f"injected: {where}")

                    setattr(target, name, failing)
                try:
                    await sharded.sync(sender, version)
                    return None
                except GatherOrderError as e:
                    return type(e).__name__

        if scenario.fail_rank is not None:  # one rank's part fails: every rank raises, nothing published
            out["failure"] = await failing_version(sharded._build if rank == scenario.fail_rank else None, "part", "this rank's part fails")
            out["after_failure"] = None if sender is None else sender.version
            version += 1
            step(model, tokens, hidden, version, 1e-4, scenario.train)
            await sharded.sync(sender, version)  # every receiver resynced by bootstrap
            out["resync"] = {"version": version, "exported": list(sharded.stats.last), "checks": await check(version)}
        if scenario.leader_fails_at_boot:  # after every part, before the bootstrap the others export for
            if rank == 0:
                await join()
            source = None if sender is None else sender._sharded
            out["boot_failure"] = await failing_version(source, "drop_offer", "the leader's Sender fails before the bootstrap")
            version += 1
            step(model, tokens, hidden, version, 1e-4, scenario.train)
            await sharded.sync(sender, version)
            out["boot_resync"] = {"version": version, "checks": await check(version)}
        if sender is not None:
            out["resyncs"] = sum(int(r["resyncs"]) for r in sender.receivers.values())  # type: ignore[call-overload]
    return out


# ---------------------------------------------------------------------------------------------
# A real vLLM engine as the receiver (tests/megatron_vllm.py drives it; test_megatron_vllm.py).


@dataclass(frozen=True)
class Lockstep:
    """The files through which rank 0 and an engine in another process step together, in
    ``directory``: rank 0 writes ``endpoint`` (its Sender's), then per version the bridge's
    export of that step as a bf16 checkpoint ``v{n}/`` (with the checkpoint's config) and
    ``v{n}.json`` (the version's figures); the engine's side answers ``v{n}.ack`` once it has
    checked that version. Each wait is bounded by ``timeout`` seconds."""

    directory: str
    timeout: float = 180.0

    def path(self, name: str) -> Path:
        return Path(self.directory) / name


async def wait_path(path: Path, seconds: float, what: str) -> None:
    """Until ``path`` exists (an event loop's wait: the Sender keeps serving), at most ``seconds``."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + seconds
    while not path.exists():
        if loop.time() > ends:
            raise TimeoutError(f"no {what} in {seconds:.0f}s ({path})")
        await asyncio.sleep(0.02)


def save_checkpoint(weights: dict[str, torch.Tensor], hf_dir: str, directory: Path) -> None:
    """``weights`` as a safetensors checkpoint with ``hf_dir``'s config files (what vLLM loads)."""
    import shutil

    from safetensors.torch import save_file

    directory.mkdir()
    for config in Path(hf_dir).glob("*.json"):
        shutil.copy(config, directory)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"))


def engine_worker(
    rank: int, world: int, port: int, hf_dir: str, layout: Layout, tokens: torch.Tensor, hidden: int, lrs: tuple[float, ...],
    config: Any, lockstep: Lockstep,
) -> None:
    """A Megatron trainer whose rank 0 serves an engine in another process (``lockstep``): one
    real step at each of ``lrs``, synced through ``ShardedSync`` (the leader's Sender with
    ``config``); the engine's bootstrap is served at v1 (it asks before, rank 0 waits for it)."""
    init_rank(rank, world, port)
    bridge, model = build(hf_dir, layout, False)
    asyncio.run(_engine_versions(rank, bridge, model, hf_dir, tokens, hidden, lrs, config, lockstep))
    torch.distributed.destroy_process_group()


async def _engine_versions(
    rank: int, bridge: Any, model: list[torch.nn.Module], hf_dir: str, tokens: torch.Tensor, hidden: int, lrs: tuple[float, ...],
    config: Any, lockstep: Lockstep,
) -> None:
    from sender import Sender
    from sender.sharded.megatron import MegatronLayout
    from sender.sharded.sync import ShardedSync
    from tests.ranks import write_file

    layout = MegatronLayout(bridge, model)
    sharded = ShardedSync(layout, timeout=60)
    strided = sum(len(x.span.to_wire()) == 4 for x in layout.landings)  # row-parallel shards: strided in the checkpoint
    async with contextlib.AsyncExitStack() as stack:
        sender = Sender("tcp://127.0.0.1:0", config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
        if sender is not None:
            await stack.enter_async_context(sender)
        await sharded.start(sender, version=0)
        if sender is not None:  # the others wait in the first step's collectives meanwhile
            write_file(lockstep.path("endpoint"), sender.endpoint)
            loop = asyncio.get_running_loop()
            ends = loop.time() + lockstep.timeout
            while not sender.bootstrap_wanted:
                if loop.time() > ends:
                    raise TimeoutError(f"the engine did not ask for a bootstrap in {lockstep.timeout:.0f}s")
                await asyncio.sleep(0.02)
        for version, lr in enumerate(lrs, start=1):
            train_step(model, tokens, hidden, lr=lr)
            stats = await sharded.sync(sender, version)
            expected = exported(bridge, model)  # every rank: the bridge's own export of this step
            if sender is None:
                continue
            assert stats is not None
            await sender.flush()
            save_checkpoint(expected, hf_dir, lockstep.path(f"v{version}"))
            figures = {"version": version, "lr": lr, "exported": list(sharded.stats.last), "changed": stats.changed_elements,
                       "total": stats.total_elements, "dense": stats.tensors_dense, "tensors": stats.tensors_changed, "strided": strided}
            write_file(lockstep.path(f"v{version}.json"), json.dumps(figures))
            await wait_path(lockstep.path(f"v{version}.ack"), lockstep.timeout, f"engine's answer to v{version}")
