"""fp8 rollouts from a bf16 trainer (issue 58): the rollout declares block fp8 at HELLO,
the sender quantizes each version into it and diffs there, the receiver writes fp8 bytes
and scales as they come and holds, after every version, exactly what the reference
quantizer makes of the trainer's weights.

A real fp32 Hugging Face trainer (AdamW) and plain-torch rollouts holding ``float8_e4m3fn``
weights beside fp32 ``_scale_inv`` scales (``fp8_models``). The matrix: strategy (patch with
the host codec, patch with the device codec, bucket) x model (Qwen2 tied and untied,
Qwen3-MoE with [E, N, K] expert stacks) x settings (fp32 or ue8m0 scales, from the bf16
cast or the master, first/last layers kept in bf16, a tie quantized on both names or on
one), at lr 1e-6 and 1e-5 for five versions each and one at 1e-3 whose tensors travel
whole; in process and over real sockets (a late joiner, a relay); and the refusals: what a
rollout declares that cannot be served, a second receiver of another format, a corrupted
fp8 patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from channel import Channel, Pipe
from fp8_models import BLOCK, Trainer, differences, rollout_state

import receiver
import sender
from benchmarks.opcount import OpCounter
from protocol.config import load_config
from protocol.errors import ConfigError, IntegrityError, MetadataMismatchError, ProtocolError, WeightSyncError
from protocol.quant import DEFAULT_SKIP, FP8, BlockFp8, Fp8Format
from protocol.state import resolve_state
from protocol.wire.framing import decode_message, encode_message
from protocol.wire.messages import Hello
from protocol.wire.metadata import ModelMetadata
from receiver import Receiver
from sender import Sender
from sender.base import plan_for
from sender.serve.shard_source import ShardedSource

T = 60.0
LRS = [1e-6] * 5 + [1e-5] * 5 + [1e-3]  # versions 1-5, 6-10, and 11, whose tensors travel whole
# dense_above 0.5: the lr 1e-3 version (about 75% of fp8 elements changed) travels whole with
# either codec (the device codec's own rule would still code it: smaller than whole there)
STRATEGIES = {
    "patch-host": {"type": "patch", "patch": {"codec": "host", "group_numel": 4096, "dense_above": 0.5}},
    "patch-device": {"type": "patch", "patch": {"codec": "device", "group_numel": 4096, "dense_above": 0.5}},
    "bucket": {"type": "bucket", "bucket": {"bucket_size": 64 << 10, "init_sync": {"enabled": True}}},
}
SETTINGS = {
    "default": BlockFp8(block=BLOCK),
    "ue8m0": BlockFp8(block=BLOCK, scale_format="ue8m0"),
    "master": BlockFp8(block=BLOCK, source="master"),
    "bf16-layers": BlockFp8(block=BLOCK, bf16_layers=(1, 1)),
    # the tied embedding quantized on both names, and on one only (the tie is then two tensors)
    "tie-both": BlockFp8(block=BLOCK, skip=tuple(p for p in DEFAULT_SKIP if p not in ("embed", r"(^|\.)lm_head\."))),
    "tie-one": BlockFp8(block=BLOCK, skip=tuple(p for p in DEFAULT_SKIP if p != "embed")),
    "tie-head": BlockFp8(block=BLOCK, skip=tuple(p for p in DEFAULT_SKIP if p != r"(^|\.)lm_head\.")),  # the alias, not the canonical
}


def config_of(strategy: str, settings: BlockFp8) -> dict[str, Any]:
    return {**STRATEGIES[strategy], "fp8": dataclasses.asdict(settings)}


@contextlib.asynccontextmanager
async def paired(config: dict[str, Any], trainer: Trainer, rollout: dict[str, torch.Tensor]) -> AsyncIterator[tuple[Any, Any, Channel]]:
    """A transport-free sender of ``trainer`` and receiver of ``rollout``, handshaken."""
    s, r, ch = sender.make_sender(config), receiver.make_receiver(config), Channel()
    try:
        await asyncio.gather(
            s.init_sender(trainer.model, ch.to_receiver.send, ch.to_sender.recv),
            r.init_receiver(rollout, ch.to_receiver.recv, ch.to_sender.send),
        )
        yield s, r, ch
    finally:
        await s.close()


async def follow(strategy: str, family: str, tie: bool, settings: BlockFp8, lrs: list[float] = LRS) -> list[Any]:
    """A transport-free sender and receiver through every version of ``lrs``; checks the
    rollout bit for bit after the bootstrap and after each version; returns the stats."""
    trainer = Trainer(family, tie)
    layers = trainer.model.config.num_hidden_layers
    rollout = rollout_state(Trainer(family, tie, seed=1).model.state_dict(), settings, layers)  # other weights
    async with paired(config_of(strategy, settings), trainer, rollout) as (s, r, ch):
        assert differences(rollout_state(trainer.model.state_dict(), settings, layers), rollout) == []
        stats = []
        for version, lr in enumerate(lrs, 1):
            trainer.step(lr)
            stats.append(await s.sync(trainer.model, ch.to_receiver.send, version))
            assert await r.apply(rollout, ch.to_receiver.recv) == version
            bad = differences(rollout_state(trainer.model.state_dict(), settings, layers), rollout)
            assert bad == [], f"v{version} (lr {lr}): {bad[:5]}"
        return stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen2", False), ("qwen3_moe", True)], ids=["qwen2-tied", "qwen2", "qwen3-moe"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
async def test_rollout_holds_the_reference_quantization_after_every_version(strategy: str, family: str, tie: bool) -> None:
    stats = await follow(strategy, family, tie, SETTINGS["default"])
    if strategy.startswith("patch"):
        sparse = [st for st in stats if st.version <= 10]
        assert all(0 < st.changed_fraction < 0.05 for st in sparse[:5]), [st.changed_fraction for st in sparse]  # lr 1e-6
        assert all(st.tensors_dense == 0 for st in stats[:5])
        assert stats[-1].tensors_dense > 0, stats[-1]  # lr 1e-3: tensors travel whole
        assert all(st.wire_bytes < 0.5 * st.dense_bytes for st in stats[:5])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in SETTINGS if n != "default"])
@pytest.mark.parametrize("strategy,family", [("patch-host", "qwen2"), ("patch-device", "qwen3_moe")])
async def test_each_option_against_the_reference(name: str, strategy: str, family: str) -> None:
    await follow(strategy, family, True, SETTINGS[name], LRS[:2] + LRS[5:7] + LRS[-1:])


@pytest.mark.timeout(120)
async def test_the_rollout_declares_which_weights_are_fp8() -> None:
    """The sender follows the rollout's metadata, not its own skip list: a rollout keeping
    one more layer in bf16 than ``fp8.bf16_layers`` says (the sender's config) still gets it."""
    held = SETTINGS["bf16-layers"]
    config = config_of("patch-host", SETTINGS["default"])  # the sender's config quantizes every layer
    trainer = Trainer()
    rollout = rollout_state(Trainer(seed=1).model.state_dict(), held, 3)
    async with paired(config, trainer, rollout) as (s, r, ch):
        trainer.step(1e-5)
        await s.sync(trainer.model, ch.to_receiver.send, 1)
        assert await r.apply(rollout, ch.to_receiver.recv) == 1
        assert rollout["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
        assert differences(rollout_state(trainer.model.state_dict(), held, 3), rollout) == []


# -- the handshake ------------------------------------------------------------------------------
def hello_of(state: dict[str, torch.Tensor], quant: Fp8Format | None = None) -> Hello:
    return Hello(ModelMetadata.of(state), quant=quant)


def test_hello_carries_the_format_and_refuses_a_malformed_one() -> None:
    hello = hello_of({"w": torch.zeros(2, dtype=FP8)}, Fp8Format((64, 128), "ue8m0"))
    assert Hello.from_body(decode_message(encode_message(hello.to_message(None))).body) == hello
    assert Hello.from_body(hello_of({"w": torch.zeros(2)}).to_body()).quant is None
    for bad in ({"method": "nvfp4", "block": [128, 128], "scale_format": "fp32"}, {"method": "block_fp8", "block": [0, 128], "scale_format": "fp32"},
                {"method": "block_fp8", "block": [128], "scale_format": "fp32"}, {"method": "block_fp8", "block": [128, 128], "scale_format": "e8"},
                {"block": [128, 128]}, [128, 128], {"method": "block_fp8", "block": [128.0, 128], "scale_format": "fp32"}):
        with pytest.raises(ProtocolError):
            Hello.from_body({**hello.to_body(), "quant": bad})


def test_fp8_settings_load_from_the_yaml_shape() -> None:
    config = load_config({"weight_syncer": {"type": "patch", "fp8": {"block": [64, 64], "scale_format": "ue8m0", "source": "master"}}})
    assert config.fp8 == BlockFp8(block=(64, 64), scale_format="ue8m0", source="master")
    assert load_config(dataclasses.asdict(config)).fp8 == config.fp8  # a dumped config loads back
    for bad in ({"blocks": [64, 64]}, {"block": [64]}, {"scale_format": "e4m3"}, {"source": "fp16"}, {"skip": ["("]}, {"bf16_layers": [-1, 0]}):
        with pytest.raises(ConfigError):
            load_config({"fp8": bad})


def _refusal(mutate: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the trainer's state, a rollout's state edited by ``mutate``)."""
    trainer = {"a.weight": torch.randn(70, 100), "b.weight": torch.randn(40, 30), "n.weight": torch.ones(30)}
    rollout = rollout_state(trainer, BlockFp8(block=BLOCK, skip=(r"^n\.",)))
    if mutate == "block":
        rollout["a.weight_scale_inv"] = torch.ones(2, 2)  # blocks of 64 x 64, not 32 x 48
    elif mutate == "e5m2":
        rollout["b.weight"] = rollout["b.weight"].to(torch.float8_e5m2)
    elif mutate == "no-scales":
        del rollout["b.weight_scale_inv"]
    elif mutate == "bf16-scales":
        rollout["b.weight_scale_inv"] = rollout["b.weight_scale_inv"].bfloat16()
    elif mutate == "trainer-has-scales":
        trainer["b.weight_scale_inv"] = torch.ones(2, 1)
    elif mutate == "1d":
        rollout["n.weight"], rollout["n.weight_scale_inv"] = torch.zeros(30, dtype=FP8), torch.ones(1)
    elif mutate == "unknown":
        rollout["c.weight"], rollout["c.weight_scale_inv"] = torch.zeros(8, 8, dtype=FP8), torch.ones(1, 1)
    return trainer, rollout


@pytest.mark.parametrize(
    "mutate,names",
    [("block", "a.weight_scale_inv"), ("e5m2", "b.weight"), ("no-scales", "b.weight"), ("bf16-scales", "b.weight"),
     ("trainer-has-scales", "b.weight"), ("1d", "n.weight"), ("unknown", "c.weight")],
)
def test_what_cannot_be_served_is_refused_naming_the_key(mutate: str, names: str) -> None:
    trainer, rollout = _refusal(mutate)
    with pytest.raises(MetadataMismatchError, match=f"'{names}'"):
        plan_for(resolve_state(trainer), hello_of(rollout, Fp8Format(BLOCK)), load_config(None))


def test_a_block_size_only_the_hello_says_is_taken_from_it() -> None:
    """Two block sizes giving the same scale shapes: the HELLO's is used, not the config's."""
    trainer = {"w.weight": torch.randn(64, 64)}
    settings = BlockFp8(block=(40, 40))
    rollout = rollout_state(trainer, settings)  # [2, 2] scales, as blocks of 32 would give too
    plan = plan_for(resolve_state(trainer), hello_of(rollout, settings.format), load_config({"fp8": {"block": [32, 32]}}))
    assert plan.view is not None and plan.view.settings.block == (40, 40)
    assert differences(rollout, plan.rollout(trainer)) == []


def test_a_sharded_trainer_refuses_an_fp8_rollout() -> None:
    trainer, rollout = _refusal("none")
    source = ShardedSource(resolve_state(trainer), load_config(None))
    with pytest.raises(ConfigError, match="sharded"):
        asyncio.run(source.admit(hello_of(rollout, Fp8Format(BLOCK))))
    assert source.plan is None


# -- over sockets: mixed fleets, late joiners, a relay, a corrupted patch ------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["patch-host", "bucket"])
async def test_daemons_fleet_late_joiner_relay_and_refusals(strategy: str) -> None:
    settings = SETTINGS["default"]
    config = config_of(strategy, settings)
    kw: dict[str, Any] = {"heartbeat_interval": 0.1, "peer_timeout": 5.0}
    trainer = Trainer()
    other = Trainer(seed=1).model.state_dict()
    expect = lambda: rollout_state(trainer.model.state_dict(), settings, 3)  # noqa: E731
    s = Sender("tcp://127.0.0.1:0", config, **kw)
    daemons: list[Any] = []
    try:
        await s.start(trainer.model, version=0)
        first = Receiver(rollout_state(other, settings, 3), s.endpoint, config, identity="fp8-a", relay_endpoint="tcp://127.0.0.1:0", **kw)
        daemons.append(first)
        await first.start(timeout=T)
        assert first.relay_endpoint is not None
        child = Receiver(rollout_state(other, settings, 3), first.relay_endpoint, config, identity="child", **kw)
        daemons.append(child)
        await child.start(timeout=T)
        for version, lr in enumerate([1e-6, 1e-5, 1e-5], 1):
            trainer.step(lr)
            await s.sync(trainer.model, version)
            for r in (first, child):
                await r.wait_for_version(version, timeout=T)
                async with r.reading():
                    assert differences(expect(), r.model) == [], r.identity
        late = Receiver(rollout_state(other, settings, 3), s.endpoint, config, identity="late", **kw)
        daemons.append(late)
        await late.start(timeout=T)
        assert late.version == 3 and differences(expect(), late.model) == []
        # one sender, one format: a bf16 rollout, and an fp8 rollout of other scales, are refused
        bf16 = {k: (v.detach().bfloat16() if v.is_floating_point() else v).clone() for k, v in other.items()}
        ue8m0 = {**config, "fp8": dataclasses.asdict(SETTINGS["ue8m0"])}
        for model, cfg, match in ((bf16, config, "one weight format"), (rollout_state(other, SETTINGS["ue8m0"], 3), ue8m0, "ue8m0")):
            refused = Receiver(model, s.endpoint, cfg, identity="refused", **kw)
            daemons.append(refused)
            with pytest.raises(WeightSyncError, match=match):
                await refused.start(timeout=T)
        trainer.step(1e-5)
        await s.sync(trainer.model, 4)
        for r in (first, child, late):
            await r.wait_for_version(4, timeout=T)
            async with r.reading():
                assert differences(expect(), r.model) == [], r.identity
    finally:
        for d in reversed(daemons):
            await asyncio.wait_for(d.close(), T)
        await s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["tie-both", "tie-one", "tie-head"])
async def test_daemon_serves_a_tie_quantized_on_both_names_or_one(name: str) -> None:
    """The daemon holds each storage once until its first receiver (``TrainerSource.hold``):
    a tie the rollout holds on one name in fp8 and the other in bf16 is two tensors there,
    the one missing from that copy read through its canonical name."""
    settings = SETTINGS[name]
    config = config_of("patch-host", settings)
    trainer = Trainer()
    rollout = rollout_state(Trainer(seed=1).model.state_dict(), settings, 3)
    s = Sender("tcp://127.0.0.1:0", config, heartbeat_interval=0.1, peer_timeout=5.0)
    r: Receiver | None = None
    try:
        await s.start(trainer.model, version=0)
        trainer.step(1e-5)
        await s.sync(trainer.model, 1)  # before any receiver: only the held copy moves
        r = Receiver(rollout, s.endpoint, config, identity="r", heartbeat_interval=0.1, peer_timeout=5.0)
        await r.start(timeout=T)
        for version in (1, 2):
            if version == 2:
                trainer.step(1e-5)
                await s.sync(trainer.model, 2)
            await r.wait_for_version(version, timeout=T)
            async with r.reading():
                assert differences(rollout_state(trainer.model.state_dict(), settings, 3), r.model) == [], version
    finally:
        if r is not None:
            await asyncio.wait_for(r.close(), T)
        await s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frame", ["fp8-bytes", "scales", "header"])
async def test_a_corrupted_fp8_patch_is_refused_and_writes_nothing(frame: str) -> None:
    settings = SETTINGS["default"]
    config = {"type": "patch", "patch": {"codec": "host", "compression": "none", "group_numel": 0}, "fp8": dataclasses.asdict(settings)}
    trainer = Trainer()
    rollout = rollout_state(Trainer(seed=1).model.state_dict(), settings, 3)
    async with paired(config, trainer, rollout) as (s, r, _):
        trainer.step(1e-5)
        captured = Pipe()
        await s.sync(trainer.model, captured.send, 1)
        frames = [list(f) for f in captured.sent]
        msg = decode_message(frames[0])
        bad = [bytearray(f) for f in frames[0]]
        if frame == "header":
            bad[0][len(bad[0]) // 2] ^= 0xFF
        else:  # one byte in the middle of a payload frame of an fp8 weight, or of a scale tensor
            index = _payload_of(msg, "scale" if frame == "scales" else "fp8", list(rollout), rollout)
            bad[index][len(bad[index]) // 2] ^= 0x01
        before = {k: v.clone() for k, v in rollout.items()}
        feed = Pipe()
        await feed.send([bytes(b) for b in bad])
        with pytest.raises((IntegrityError, ProtocolError)):
            await asyncio.wait_for(r.apply(rollout, feed.recv), T)
        assert r.version is None
        assert differences(before, rollout) == []
        good = Pipe()
        for f in frames:
            await good.send(f)
        assert await r.apply(rollout, good.recv) == 1
        assert differences(rollout_state(trainer.model.state_dict(), settings, 3), rollout) == []


def _payload_of(msg: Any, want: str, keys: list[str], rollout: dict[str, torch.Tensor]) -> int:
    """The frame index of a payload buffer of a tensor held in fp8 (``want`` "fp8") or of a
    scale tensor ("scale"), in the first part of a version."""
    for entry in msg.tensors:
        key = keys[entry.key]
        if (want == "scale" and key.endswith("_scale_inv")) or (want == "fp8" and rollout[key].dtype == FP8):
            return int(max(entry.buffers, key=lambda b: b.wire_nbytes).frame)
    raise AssertionError(f"no {want} payload in {msg.describe()}")


# -- what the quantizing costs on a GPU, counted on CPU ------------------------------------------
@pytest.mark.parametrize("source", ["bf16", "master"])
def test_quantizing_a_version_takes_kernels_per_shape_not_per_tensor(source: str) -> None:
    counts = {}
    for layers in (2, 6):
        trainer = Trainer(layers=layers).model.state_dict()
        settings = BlockFp8(block=BLOCK, source=source)  # type: ignore[arg-type]
        rollout = rollout_state(trainer, settings, layers)
        plan = plan_for(resolve_state(trainer), hello_of(rollout, settings.format), load_config({"fp8": dataclasses.asdict(settings)}))
        with OpCounter() as counter:
            plan.rollout(trainer)
        ops, syncs = counter.take()
        counts[layers] = sum(ops.values())
        assert not syncs, syncs  # nothing the host waits for
    # 3x the weights, the same launches (view ops aside): one stack of each shape, quantized at once
    assert counts[2] == counts[6], counts
