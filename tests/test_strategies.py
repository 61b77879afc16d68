"""Integration tests of the transport-free strategies with a real model and real training.

A tiny transformer (fp32 master) is trained with AdamW and synced after every step to a
bf16 receiver model that starts from different random weights; after each step the
receiver must hold exactly the sender's bf16 cast, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from channel import Channel, Pipe
from models import Trainer, bits, cast_like, make_model, mismatches, snapshot

import receiver
import sender
from protocol.errors import ConfigError, MetadataMismatchError, StaleVersionError, WeightSyncError
from protocol.wire.framing import Encoding, MessageType, Role, ValueEncoding, decode_message

STEPS = 10


# -- helpers ------------------------------------------------------------------------------
def patch_cfg(**patch: Any) -> dict[str, Any]:
    return {"type": "patch", "patch": patch}


def bucket_cfg(**bucket: Any) -> dict[str, Any]:
    return {"type": "bucket", "bucket": bucket}


def make_pair(config: dict[str, Any]) -> tuple[Any, Any]:
    return sender.make_sender(config), receiver.make_receiver(config)


async def handshake(s: Any, r: Any, model: Any, rmodel: Any, ch: Channel, trainable_keys: Any = None) -> None:
    await asyncio.wait_for(
        asyncio.gather(
            s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv, trainable_keys=trainable_keys),
            r.init_receiver(rmodel, ch.to_receiver.recv, ch.to_sender.send),
        ),
        timeout=60,
    )


def messages(pipe: Pipe, start: int = 0) -> list[Any]:
    return [decode_message(frames) for frames in pipe.sent[start:]]


def assert_synced(model: Any, rmodel: Any) -> None:
    sd, rsd = model.state_dict(), rmodel.state_dict()
    assert set(sd) == set(rsd)
    bad = mismatches(cast_like(sd, rsd), rsd)
    assert bad == [], f"receiver differs from the sender's bf16 cast at {bad}"


def ordinals(r: Any, *keys: str) -> set[int]:
    return {r.metadata.ordinal(k) for k in keys}


PATCH_CONFIGS = {
    "default": patch_cfg(),
    "default-ungrouped": patch_cfg(group_numel=0),  # the default model's small tensors grouped above, alone here
    "seed-coo-delta": patch_cfg(position_encoding="coo", delta_encoding=True, value_encoding="raw", compression="none"),
    "seed-coo-abs": patch_cfg(position_encoding="coo", delta_encoding=False, value_encoding="raw", compression="none"),
    "gaps": patch_cfg(position_encoding="gaps"),
    "bitmap": patch_cfg(position_encoding="bitmap"),
    "gaps-raw": patch_cfg(position_encoding="gaps", value_encoding="raw"),
    "lz4": patch_cfg(compression="lz4"),
    "zstd": patch_cfg(compression="zstd", position_encoding="coo", delta_encoding=True, value_encoding="raw"),
    "zstd-xor": patch_cfg(compression="zstd"),
    "device": patch_cfg(codec="device"),  # the device codec (Encoding.BLOCKS) on CPU tensors, zstd on the dense entries only
    "device-ungrouped": patch_cfg(codec="device", group_numel=0),
}
EXPECTED_ENCODING = {
    "seed-coo-delta": {Encoding.COO_DELTA},
    "seed-coo-abs": {Encoding.COO},
    "gaps": {Encoding.GAPS},
    "bitmap": {Encoding.BITMAP},
    "gaps-raw": {Encoding.GAPS},
    "zstd": {Encoding.COO_DELTA},
    "device": {Encoding.BLOCKS},
    "device-ungrouped": {Encoding.BLOCKS},
}


# -- patch: training loop, bit-exact every step ----------------------------------------------
@pytest.mark.parametrize("compare", ["host", "device"])
@pytest.mark.parametrize("lr", [1e-3, 1e-6], ids=["lr1e-3", "lr1e-6"])
@pytest.mark.parametrize("name", list(PATCH_CONFIGS))
async def test_patch_training_bit_exact(name: str, lr: float, compare: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every encoding config, through the host compare and the device compare (forced here
    on CPU tensors: ``auto`` takes it on CUDA), with the codec the config chooses."""
    import sender.version.patch

    monkeypatch.setattr(sender.version.patch, "_requested", lambda config: compare)
    config = PATCH_CONFIGS[name]
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    assert mismatches(cast_like(model.state_dict(), rmodel.state_dict()), rmodel.state_dict())  # really different
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    assert r.version is None
    assert_synced(model, rmodel)
    assert type(s.builder.compare).__name__ == {"host": "HostCompare", "device": "DeviceCompare"}[compare]

    trainer = Trainer(model, lr)
    dense_seen = 0
    tracked = {k for k in model.state_dict() if k != "lm_head.weight"}
    tracked_numel = sum(model.state_dict()[k].numel() for k in tracked)
    for step in range(1, STEPS + 1):
        trainer.step()
        start = len(ch.to_receiver.sent)
        stats = await s.sync(model, ch.to_receiver.send, step)
        v = await r.apply(rmodel, ch.to_receiver.recv)
        assert v == step and r.version == step
        assert_synced(model, rmodel)
        assert int(rmodel.step_count) == step

        (msg,) = messages(ch.to_receiver, start)
        assert msg.type is MessageType.PATCH and msg.version == step
        assert msg.base_version == (None if step == 1 else step - 1)
        assert stats.messages == 1 and stats.version == step and stats.strategy == "patch"
        assert stats.changed_elements > 0  # at least the step counter
        assert stats.total_elements == tracked_numel
        assert 1 <= len(msg.tensors) <= stats.tensors_changed <= sum(len(e.covers) for e in msg.tensors)
        assert any(e.group for e in msg.tensors) == (config["patch"].get("group_numel") != 0 and config["patch"].get("position_encoding") != "coo")
        assert stats.wire_bytes == sum(len(f) for f in ch.to_receiver.sent[start])
        assert stats.tensors_dense == sum(len(e.covers) for e in msg.tensors if e.encoding is Encoding.DENSE)
        sparse_nnz = sum(e.nnz for e in msg.tensors if e.encoding is not Encoding.DENSE)
        assert sparse_nnz <= stats.changed_elements <= sum(e.nnz for e in msg.tensors)  # dense entries carry numel
        dense_seen += stats.tensors_dense
        sparse = {e.encoding for e in msg.tensors if e.encoding is not Encoding.DENSE}
        if name in EXPECTED_ENCODING:
            assert sparse <= EXPECTED_ENCODING[name]
        if config["patch"].get("value_encoding") == "raw":
            assert all(e.values is ValueEncoding.RAW for e in msg.tensors)
        if lr == 1e-6:
            assert stats.wire_bytes < stats.dense_bytes, stats
            assert stats.changed_fraction < 0.2
    if lr == 1e-3:
        assert dense_seen > 0  # AdamW at 1e-3 moves nearly every bf16 element of small weights


@pytest.mark.parametrize("dense_above", [0.25, 1.0])
async def test_patch_dense_fallback_by_share_changed(dense_above: float) -> None:
    """A tensor with more than ``dense_above`` of its elements changed travels whole and
    uncompressed; the others stay sparse. Both apply bit for bit."""
    state = {"busy": torch.zeros(4096, dtype=torch.bfloat16), "quiet": torch.zeros(4096, dtype=torch.bfloat16)}
    target = {k: torch.ones_like(v) for k, v in state.items()}
    s, r = make_pair(patch_cfg(dense_above=dense_above, group_numel=0))
    ch = Channel()
    await handshake(s, r, state, target, ch)
    state["busy"][::2] = 1.5  # half of it changes
    state["quiet"][:40] = 2.0  # 1% of it
    start = len(ch.to_receiver.sent)
    stats = await s.sync(state, ch.to_receiver.send, 1)
    assert await r.apply(target, ch.to_receiver.recv) == 1
    assert all(torch.equal(bits(state[k]), bits(target[k])) for k in state)
    (msg,) = messages(ch.to_receiver, start)
    by_key = {r.metadata.keys[e.key]: e for e in msg.tensors}
    assert by_key["quiet"].encoding is not Encoding.DENSE
    busy = by_key["busy"]
    if dense_above < 0.5:
        assert busy.encoding is Encoding.DENSE and busy.nnz == 4096 and stats.tensors_dense == 1
        assert all(b.codec.name == "NONE" for b in busy.buffers)
    else:
        assert busy.encoding is not Encoding.DENSE and busy.nnz == 2048 and stats.tensors_dense == 0


# -- bucket: training loop, bit-exact every step ---------------------------------------------
@pytest.mark.parametrize("load_instant", [True, False], ids=["instant", "deferred"])
@pytest.mark.parametrize("bucket_dtype", [None, "bfloat16"], ids=["dtype-null", "dtype-bf16"])
async def test_bucket_training_bit_exact(bucket_dtype: str | None, load_instant: bool) -> None:
    config = bucket_cfg(
        bucket_size=8 << 10,
        bucket_dtype=bucket_dtype,
        bucket_device="cpu",
        load_instant=load_instant,
        init_sync={"enabled": True, "bucket_size": 6 << 10},
    )
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    boot = messages(ch.to_receiver)
    assert boot[0].type is MessageType.WELCOME and boot[0].body["bootstrap"] == len(boot) - 1 > 1
    assert all(m.type is MessageType.BOOTSTRAP for m in boot[1:])
    assert_synced(model, rmodel)

    trainer = Trainer(model, 1e-3)
    float_code_ok = torch.bfloat16 if bucket_dtype else torch.float32
    for step in range(1, STEPS + 1):
        trainer.step()
        start = len(ch.to_receiver.sent)
        stats = await s.sync(model, ch.to_receiver.send, step)
        v = await r.apply(rmodel, ch.to_receiver.recv)
        assert v == step == r.version
        assert_synced(model, rmodel)
        msgs = messages(ch.to_receiver, start)
        assert len(msgs) == stats.messages >= 3
        assert [m.part for m in msgs] == list(range(len(msgs)))
        assert all(m.type is MessageType.BUCKET and m.version == step and m.last == (m.part == len(msgs) - 1) for m in msgs)
        assert stats.wire_bytes == sum(len(f) for frames in ch.to_receiver.sent[start:] for f in frames)
        assert stats.changed_elements == stats.total_elements > 0
        assert stats.tensors_dense == stats.tensors_changed == len(model.state_dict()) - 1  # tied lm_head once
        seen_dtypes = set()
        for m in msgs:
            for e in m.tensors:
                key = r.metadata.keys[e.key]
                (spec,) = e.buffers
                from protocol.wire.dtypes import dtype_from_code

                dt = dtype_from_code(spec.dtype)
                seen_dtypes.add(dt)
                if key == "step_count":
                    assert dt == torch.int64  # non-float buffers keep their dtype
                else:
                    assert dt == float_code_ok
        assert torch.int64 in seen_dtypes


# -- frozen parameters, buffers ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_frozen_params_bootstrap_only(kind: str) -> None:
    config = patch_cfg() if kind == "patch" else bucket_cfg(bucket_size=16 << 10, init_sync={"enabled": True})
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    frozen = [k for k, _ in model.named_parameters() if k.startswith("blocks.0.")] + ["logit_scale"]
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    assert_synced(model, rmodel)  # the bootstrap carried frozen parameters too
    boot_keys = {r.metadata.keys[e.key] for m in messages(ch.to_receiver)[1:] for e in m.tensors}
    assert set(frozen) <= boot_keys
    bootstrapped = snapshot({k: v for k, v in rmodel.state_dict().items() if k in frozen})

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in frozen:
                p.add_(0.5)  # the trainer changes a frozen weight behind the syncer's back
    trainer = Trainer(model, 1e-3)
    frozen_ords = ordinals(r, *frozen)
    for step in range(1, 4):
        trainer.step()
        start = len(ch.to_receiver.sent)
        await s.sync(model, ch.to_receiver.send, step)
        assert await r.apply(rmodel, ch.to_receiver.recv) == step
        sent = {e.key for m in messages(ch.to_receiver, start) for e in m.tensors}
        assert not sent & frozen_ords
        rsd = rmodel.state_dict()
        assert mismatches(bootstrapped, {k: rsd[k] for k in frozen}) == []
        trainable = {k: v for k, v in model.state_dict().items() if k not in frozen}
        assert mismatches(cast_like(trainable, rsd), {k: rsd[k] for k in trainable}) == []


async def test_buffers_persistent_synced_non_persistent_not() -> None:
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    assert "pos_cache" not in model.state_dict()
    with torch.no_grad():
        rmodel.pos_cache.fill_(7.0)  # a receiver-local value that must survive every sync
        model.step_count.fill_(41)
    s, r = make_pair(patch_cfg())
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    assert "pos_cache" not in r.metadata.keys
    assert int(rmodel.step_count) == 41 and rmodel.step_count.dtype == torch.int64
    trainer = Trainer(model, 1e-3)
    for step in range(1, 4):
        trainer.step()
        await s.sync(model, ch.to_receiver.send, step)
        await r.apply(rmodel, ch.to_receiver.recv)
        assert int(rmodel.step_count) == 41 + step
        assert torch.equal(bits(rmodel.ema_loss), bits(model.ema_loss.to(torch.bfloat16)))
        assert bool((rmodel.pos_cache == 7.0).all())


# -- init_sync ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_init_sync_disabled_requires_identical_start(kind: str) -> None:
    config = patch_cfg(init_sync={"enabled": False}) if kind == "patch" else bucket_cfg(bucket_size=16 << 10)
    model = make_model(0)
    rmodel = copy.deepcopy(model).to(torch.bfloat16)  # identical start, as the seed requires
    assert rmodel.lm_head.weight is rmodel.embed.weight
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    (welcome,) = messages(ch.to_receiver)
    assert welcome.type is MessageType.WELCOME and welcome.body["bootstrap"] == 0
    assert_synced(model, rmodel)
    trainer = Trainer(model, 1e-3)
    for step in range(1, 4):
        trainer.step()
        await s.sync(model, ch.to_receiver.send, step)
        assert await r.apply(rmodel, ch.to_receiver.recv) == step
        assert_synced(model, rmodel)


async def test_init_sync_prefixes_bootstrap_only_matching_keys() -> None:
    prefixes = ["blocks.0.attn", "ln_f.weight", "embed"]
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    before = snapshot(rmodel.state_dict())
    s, r = make_pair(patch_cfg(init_sync={"enabled": True, "prefixes": prefixes, "bucket_size": 4 << 10}))
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)

    def matches(k: str) -> bool:
        return any(k == p or k.startswith(p + ".") for p in prefixes)

    boot = {r.metadata.keys[e.key] for m in messages(ch.to_receiver)[1:] for e in m.tensors}
    assert boot == {k for k in model.state_dict() if matches(k) and k != "lm_head.weight"}
    assert "blocks.0.attn.in_proj_weight" in boot and "ln_f.bias" not in boot and "embed.weight" in boot
    sd, rsd = model.state_dict(), rmodel.state_dict()
    chosen = {k for k in sd if matches(k)} | {"lm_head.weight"}  # tied to embed.weight on the receiver
    assert mismatches(cast_like({k: sd[k] for k in chosen}, rsd), {k: rsd[k] for k in chosen}) == []
    others = {k for k in sd if k not in chosen}
    assert others and mismatches({k: before[k] for k in others}, {k: rsd[k] for k in others}) == []


@pytest.mark.parametrize("prefix", ["blocks.0.ln", "nonexistent", "embed.weigh"])
async def test_init_sync_prefix_matching_nothing_raises(prefix: str) -> None:
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    config = patch_cfg(init_sync={"enabled": True, "prefixes": ["embed", prefix]})
    s, r = make_pair(config)
    ch = Channel()
    with pytest.raises(ConfigError, match=prefix):
        await s.init_sender(model, ch.to_receiver.send, _hello_from(r, rmodel, ch))


def _hello_from(r: Any, rmodel: Any, ch: Channel) -> Any:
    """A recv for the sender that yields the receiver's real HELLO."""

    async def recv() -> Any:
        task = asyncio.ensure_future(r.init_receiver(rmodel, ch.to_receiver.recv, ch.to_sender.send))
        frames = await ch.to_sender.recv()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, WeightSyncError):
            await task
        return frames

    return recv


async def test_init_sync_bad_prefix_is_reported_to_receiver() -> None:
    """The receiver should learn about the sender's config failure (ERROR), not hang waiting for WELCOME."""
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(patch_cfg(init_sync={"enabled": True, "prefixes": ["nonexistent"]}))
    ch = Channel()
    rtask = asyncio.ensure_future(r.init_receiver(rmodel, ch.to_receiver.recv, ch.to_sender.send))
    with pytest.raises(ConfigError):
        await s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv)
    try:
        with pytest.raises(ConfigError):
            await asyncio.wait_for(rtask, timeout=3)
    finally:
        rtask.cancel()
        with contextlib.suppress(BaseException):
            await rtask


async def test_init_sync_prefix_naming_a_tied_alias() -> None:
    """``lm_head`` is a real state-dict key (tied to embed.weight): it must bootstrap, not be 'no key'."""
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(patch_cfg(init_sync={"enabled": True, "prefixes": ["lm_head"]}))
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    rsd = rmodel.state_dict()
    assert torch.equal(bits(rsd["lm_head.weight"]), bits(model.lm_head.weight.detach().to(torch.bfloat16)))


# -- tied weights --------------------------------------------------------------------------------
@pytest.mark.parametrize("receiver_tied", [True, False], ids=["receiver-tied", "receiver-untied"])
async def test_tied_weights_travel_once(receiver_tied: bool) -> None:
    model = make_model(0)
    rmodel = make_model(1, dtype=torch.bfloat16, tie=receiver_tied)
    assert model.lm_head.weight is model.embed.weight
    s, r = make_pair(patch_cfg())
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    welcome = messages(ch.to_receiver)[0]
    emb, head = r.metadata.ordinal("embed.weight"), r.metadata.ordinal("lm_head.weight")
    assert welcome.body["aliases"] == [[head, emb]]
    boot_keys = [e.key for m in messages(ch.to_receiver)[1:] for e in m.tensors]
    assert boot_keys.count(emb) == 1 and head not in boot_keys
    assert_synced(model, rmodel)

    trainer = Trainer(model, 1e-3)
    for step in range(1, 5):
        trainer.step()
        start = len(ch.to_receiver.sent)
        await s.sync(model, ch.to_receiver.send, step)
        await r.apply(rmodel, ch.to_receiver.recv)
        keys = [k for m in messages(ch.to_receiver, start) for e in m.tensors for k in e.covers]
        assert keys.count(emb) == 1 and head not in keys
        assert_synced(model, rmodel)
        assert torch.equal(bits(rmodel.lm_head.weight), bits(rmodel.embed.weight))


# -- plain state dicts and DTensors -------------------------------------------------------------
async def test_plain_state_dict_with_trainable_keys() -> None:
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    sd = model.state_dict()  # live views of the parameters
    rsd = rmodel.state_dict()
    trainable = [k for k in sd if not k.startswith("blocks.1.")]
    untracked = [k for k in sd if k.startswith("blocks.1.")]
    s, r = make_pair(patch_cfg(compression="zstd"))
    ch = Channel()
    await handshake(s, r, sd, rsd, ch, trainable_keys=trainable)
    assert mismatches(cast_like(sd, rsd), rsd) == []
    bootstrapped = snapshot({k: rsd[k] for k in untracked})
    trainer = Trainer(model, 1e-3)  # trains every parameter, including the untracked ones
    for step in range(1, 4):
        trainer.step()
        start = len(ch.to_receiver.sent)
        await s.sync(sd, ch.to_receiver.send, step)
        assert await r.apply(rsd, ch.to_receiver.recv) == step
        assert not {e.key for m in messages(ch.to_receiver, start) for e in m.tensors} & ordinals(r, *untracked)
        assert mismatches(cast_like({k: sd[k] for k in trainable}, rsd), {k: rsd[k] for k in trainable}) == []
        assert mismatches(bootstrapped, {k: rsd[k] for k in untracked}) == []
    # the dict views alias the receiver module: it is synced too
    assert torch.equal(bits(rmodel.mix), bits(model.mix.detach().to(torch.bfloat16)))


async def test_plain_state_dict_unknown_trainable_key() -> None:
    model = make_model(0)
    s, _ = make_pair(patch_cfg())
    with pytest.raises(ConfigError, match="no_such_key"):
        await s.init_sender(model.state_dict(), Pipe().send, Pipe().recv, trainable_keys=["no_such_key"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def gloo_group() -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_dtensor_state_dict(kind: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    config = (
        patch_cfg() if kind == "patch" else bucket_cfg(bucket_size=8 << 10, bucket_dtype="bfloat16", init_sync={"enabled": True})
    )
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    with gloo_group() as mesh:
        by_storage: dict[int, Any] = {}
        dsd: dict[str, Any] = {}
        for k, t in model.state_dict().items():
            if t.data_ptr() not in by_storage:  # one DTensor per storage keeps the tie
                placement = Shard(0) if t.dim() >= 1 else Replicate()
                by_storage[t.data_ptr()] = distribute_tensor(t.detach().clone(), mesh, [placement])
            dsd[k] = by_storage[t.data_ptr()]
        assert {type(v).__name__ for v in dsd.values()} == {"DTensor"}

        def refresh() -> None:
            with torch.no_grad():
                for k, t in model.state_dict().items():
                    dsd[k].to_local().copy_(t)

        s, r = make_pair(config)
        ch = Channel()
        await handshake(s, r, dsd, rmodel, ch)
        assert_synced(model, rmodel)
        trainer = Trainer(model, 1e-3)
        for step in range(1, 4):
            trainer.step()
            refresh()
            await s.sync(dsd, ch.to_receiver.send, step)
            assert await r.apply(rmodel, ch.to_receiver.recv) == step
            assert_synced(model, rmodel)
        assert dist.is_initialized()
    assert not dist.is_initialized()


# -- versions -------------------------------------------------------------------------------------
async def trained_pair(kind: str) -> tuple[Any, Any, Any, Any, Channel, Trainer]:
    """A handshaken pair of ``kind`` and its trainer, one step past the bootstrap."""
    config = patch_cfg() if kind == "patch" else bucket_cfg(bucket_size=16 << 10)
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    trainer = Trainer(model, 1e-3)
    trainer.step()
    return s, r, model, rmodel, ch, trainer


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_versions_strictly_increase(kind: str) -> None:
    s, r, model, rmodel, ch, trainer = await trained_pair(kind)
    await s.sync(model, ch.to_receiver.send, 3)
    assert await r.apply(rmodel, ch.to_receiver.recv) == 3
    trainer.step()
    sent = len(ch.to_receiver.sent)
    for bad in (3, 2, 0):
        with pytest.raises(StaleVersionError):
            await s.sync(model, ch.to_receiver.send, bad)
    for bad in (-1, 4.0, "4"):
        with pytest.raises(WeightSyncError):
            await s.sync(model, ch.to_receiver.send, bad)  # type: ignore[arg-type]
    assert len(ch.to_receiver.sent) == sent  # nothing went out
    assert s.version == 3
    # the failed calls did not disturb the snapshot: the next version is still exact
    await s.sync(model, ch.to_receiver.send, 7)
    assert await r.apply(rmodel, ch.to_receiver.recv) == 7
    assert_synced(model, rmodel)


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_syncs_called_at_once_run_one_after_another(kind: str) -> None:
    """Two syncs started together run in the order they were called: each version's messages
    go out whole, before the next one's; a version called after a higher one is refused as
    stale and sends nothing. Two applies at once take a version each, in turn."""
    s, r, model, rmodel, ch, trainer = await trained_pair(kind)
    start = len(ch.to_receiver.sent)
    first, second = await asyncio.gather(s.sync(model, ch.to_receiver.send, 1), s.sync(model, ch.to_receiver.send, 2))
    assert (first.version, second.version) == (1, 2)
    assert [m.version for m in messages(ch.to_receiver, start)] == [1] * first.messages + [2] * second.messages
    # two applies at once, the same: each takes one whole version, in turn
    assert await asyncio.gather(r.apply(rmodel, ch.to_receiver.recv), r.apply(rmodel, ch.to_receiver.recv)) == [1, 2]
    assert_synced(model, rmodel)

    trainer.step()
    start = len(ch.to_receiver.sent)
    ahead, behind = await asyncio.gather(s.sync(model, ch.to_receiver.send, 4), s.sync(model, ch.to_receiver.send, 3), return_exceptions=True)
    assert isinstance(behind, StaleVersionError) and s.version == 4
    assert not isinstance(ahead, BaseException)
    assert [m.version for m in messages(ch.to_receiver, start)] == [4] * ahead.messages
    assert await r.apply(rmodel, ch.to_receiver.recv) == 4
    assert_synced(model, rmodel)


# -- metadata mismatch -----------------------------------------------------------------------------
def _missing_key(rsd: dict[str, torch.Tensor]) -> str:
    del rsd["blocks.1.fc2.bias"]
    return "blocks.1.fc2.bias"


def _wrong_shape(rsd: dict[str, torch.Tensor]) -> str:
    rsd["blocks.0.fc1.weight"] = torch.zeros(63, 32, dtype=torch.bfloat16)
    return "blocks.0.fc1.weight"


def _extra_key(rsd: dict[str, torch.Tensor]) -> str:
    rsd["value_head.weight"] = torch.zeros(1, 32, dtype=torch.bfloat16)
    return "value_head.weight"


@pytest.mark.parametrize("kind", ["patch", "bucket"])
@pytest.mark.parametrize("mutate", [_missing_key, _wrong_shape, _extra_key], ids=["missing", "shape", "extra"])
async def test_metadata_mismatch_raised_on_both_sides(kind: str, mutate: Any) -> None:
    config = patch_cfg() if kind == "patch" else bucket_cfg(init_sync={"enabled": True})
    model = make_model(0)
    rsd = dict(make_model(1, dtype=torch.bfloat16).state_dict())
    key = mutate(rsd)
    before = snapshot(rsd)
    s, r = make_pair(config)
    ch = Channel()
    sres, rres = await asyncio.wait_for(
        asyncio.gather(
            s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv),
            r.init_receiver(rsd, ch.to_receiver.recv, ch.to_sender.send),
            return_exceptions=True,
        ),
        timeout=30,
    )
    assert isinstance(sres, MetadataMismatchError) and key in str(sres), sres
    assert isinstance(rres, MetadataMismatchError) and key in str(rres), rres
    (err,) = messages(ch.to_receiver)
    assert err.type is MessageType.ERROR and err.body["code"] == "metadata_mismatch"
    assert mismatches(before, rsd) == [] and r.version is None
    with pytest.raises(WeightSyncError):
        await s.sync(model, ch.to_receiver.send, 1)  # never initialised


# -- a sync that fails midway -------------------------------------------------------------------
def _sender_missing(sd: dict[str, torch.Tensor]) -> None:
    del sd["blocks.1.fc2.bias"]  # late in the order: the tensors before it compare first


def _sender_reshaped(sd: dict[str, torch.Tensor]) -> None:
    sd["blocks.1.fc1.weight"] = torch.zeros(63, 32)


@pytest.mark.parametrize("kind", ["patch", "bucket"])
@pytest.mark.parametrize("mutate", [_sender_missing, _sender_reshaped], ids=["missing", "shape"])
async def test_sync_of_a_mismatched_model_moves_nothing(kind: str, mutate: Any) -> None:
    """Refused before anything is read: a compare that had moved the snapshot of the
    tensors before the bad one would leave the receiver behind on them for good (the
    next patch, diffed against that snapshot, would not carry those changes)."""
    config = patch_cfg() if kind == "patch" else bucket_cfg(bucket_size=16 << 10)
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    Trainer(model, 1e-3).step()
    bad = dict(model.state_dict())
    mutate(bad)
    sent = len(ch.to_receiver.sent)
    with pytest.raises(MetadataMismatchError, match=r"blocks\.1\.fc"):
        await s.sync(bad, ch.to_receiver.send, 1)
    assert len(ch.to_receiver.sent) == sent and s.version is None
    await s.sync(model, ch.to_receiver.send, 2)  # the same weights: only what the snapshot lacks travels
    assert await r.apply(rmodel, ch.to_receiver.recv) == 2
    assert_synced(model, rmodel)
    if kind == "patch":
        assert not s.builder.diverged
        assert {m.type for m in messages(ch.to_receiver, sent)} == {MessageType.PATCH}


async def test_patch_sync_failing_midway_resyncs_by_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compare that fails after moving part of the snapshot: the next version goes as a
    bootstrap of a new snapshot, then patches resume, exact throughout."""
    from sender.diff import fastdiff

    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s, r = make_pair(patch_cfg())
    ch = Channel()
    await handshake(s, r, model, rmodel, ch)
    trainer = Trainer(model, 1e-3)
    real, calls = fastdiff.diff_and_update, []

    def fails_second(*args: Any, **kwargs: Any) -> Any:  # the first moved the small tensors' run
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("compare failed")
        return real(*args, **kwargs)

    trainer.step()
    monkeypatch.setattr(fastdiff, "diff_and_update", fails_second)
    with pytest.raises(RuntimeError, match="compare failed"):
        await s.sync(model, ch.to_receiver.send, 1)
    monkeypatch.setattr(fastdiff, "diff_and_update", real)
    assert s.builder.diverged and s.version is None
    with pytest.raises(WeightSyncError, match="recapture"):  # the builder itself refuses to patch from it
        await s.builder.collect(dict(model.state_dict()), 1)
    sent = len(ch.to_receiver.sent)
    await s.sync(model, ch.to_receiver.send, 2)
    assert {m.type for m in messages(ch.to_receiver, sent)} == {MessageType.BOOTSTRAP}
    assert await r.apply(rmodel, ch.to_receiver.recv) == 2 and r.version == 2
    assert_synced(model, rmodel)
    for version in (3, 4):
        trainer.step()
        sent = len(ch.to_receiver.sent)
        await s.sync(model, ch.to_receiver.send, version)
        assert {m.type for m in messages(ch.to_receiver, sent)} == {MessageType.PATCH}
        assert await r.apply(rmodel, ch.to_receiver.recv) == version
        assert_synced(model, rmodel)


# -- nvcomp_lz4 with the default encodings ----------------------------------------------------
async def test_nvcomp_lz4_gets_the_entropy_coders_host_tables_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compression: nvcomp_lz4`` with the default encodings (ANS positions, ULP values):
    the entropy coder built its side tables (counts, escapes) on the host, and the GPU
    compressor refused them ("nvcomp_lz4 compresses CUDA tensors"), so every patch with
    512+ changes failed to encode. Each host buffer is moved to the compressor's device
    first; since the packed entries, the entropy-coded ones have no side buffers left to
    compress, and the others (XOR values, dense tensors) still go to it. No GPU here: nvCOMP's codec is a stand-in that records what it is
    handed, and the compressor's device is ``meta``; the sender's whole encode path is
    real (a real optimizer step, config validation, the entropy coder, packing)."""
    from protocol.codec import nvcomp

    handed: list[torch.device] = []

    class Codec:
        def encode(self, data: torch.Tensor) -> torch.Tensor:
            handed.append(data.device)
            return torch.zeros(1, dtype=torch.uint8)  # "compressed": a host tensor, as from_dlpack takes it

    class NvComp:
        @staticmethod
        def as_array(data: torch.Tensor, cuda_stream: Any = None) -> torch.Tensor:
            return data

    monkeypatch.setattr(nvcomp, "require", lambda: NvComp)
    monkeypatch.setattr(nvcomp, "_codec", lambda _nvcomp, device: (Codec(), None))
    monkeypatch.setattr(nvcomp, "_compress_device", lambda: torch.device("meta"))
    config = {"type": "patch", "patch": {"compression": "nvcomp_lz4", "transport_device": "cuda"}}
    model, rmodel = make_model(0), make_model(1, dtype=torch.bfloat16)
    s = sender.make_sender(config)
    ch = Channel()
    await asyncio.gather(
        s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv),
        receiver.make_receiver({"type": "patch"}).init_receiver(rmodel, ch.to_receiver.recv, ch.to_sender.send),
    )
    Trainer(model, 1e-5).step()
    cap = Pipe()
    await s.sync(model, cap.send, 1)
    msg = decode_message(cap.sent[0])
    ans = [e for e in msg.tensors if e.encoding is Encoding.ANS_GAPS and e.values is ValueEncoding.ULP]
    assert ans, [(e.encoding, e.values) for e in msg.tensors]  # the default encodings were chosen
    compressed = [b for e in msg.tensors for b in e.buffers if b.codec == 3]  # Codec.NVCOMP_LZ4
    # An entropy-coded entry travels packed (protocol/codec/packed.py): one buffer, not compressed again.
    assert all([(b.role, b.codec) for b in e.buffers] == [(Role.VALUES, 0)] for e in ans)
    assert handed and set(handed) == {torch.device("meta")} and len(handed) >= len(compressed)
