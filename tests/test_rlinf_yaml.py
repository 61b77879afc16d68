"""RLinf's ``weight_syncer`` YAML, as its users have it in their files, loads and works.

RLinf's ``WeightSyncer.create`` reads, besides the seed's keys, the top-level NCCL options
``use_ring_sync``, ``nccl_max_ctas`` and ``nccl_min_ctas`` and two aliases,
``patch.compression_algorithm`` (over ``patch.compression``) and
``patch.init_sync.buckets_size`` (for ``bucket_size``). These files are written to disk
and loaded through ``load_config`` like a user's; the patch one then drives a real Sender
and Receiver, so an alias is shown to take effect, not only to parse.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from daemon_helpers import DAEMON_KW, T, Trainer, assert_matches, receiver_model, wait_until

from protocol import config as config_module
from protocol.codec.compress import Codec
from protocol.config import load_config
from protocol.errors import ConfigError
from receiver import Receiver
from sender import Sender

pytestmark = pytest.mark.timeout(60)

# Every key RLinf reads for the patch strategy, its aliases in place of weightsync's names.
RLINF_PATCH = """\
weight_syncer:
  type: patch
  use_ring_sync: true
  nccl_max_ctas: 8
  nccl_min_ctas: 2
  patch:
    snapshot_device: cpu
    transport_device: cpu
    delta_encoding: true
    compression_algorithm: lz4
    init_sync:
      enabled: true
      prefixes: null
      buckets_size: 65536
"""

# Every key RLinf reads for the bucket strategy (the seed's bucket_syncer.yaml, plus the NCCL options).
RLINF_BUCKET = """\
weight_syncer:
  type: bucket
  use_ring_sync: false
  nccl_max_ctas: null
  nccl_min_ctas: null
  bucket:
    bucket_size: 536870912
    bucket_dtype: null
    bucket_device: cuda
    is_agent: false
    load_instant: true
"""

# The seed's own patch example, RLinf's docs verbatim in shape.
SEED_PATCH = """\
weight_syncer:
  type: patch
  patch:
    snapshot_device: cpu
    transport_device: cpu
    delta_encoding: true
    compression: none
    init_sync:
      enabled: true
      prefixes: null
      bucket_size: 134217728
"""


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings as a new process would."""
    monkeypatch.setattr(config_module, "_warned", set())


def write(tmp_path: Path, text: str, name: str = "weight_syncer.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "protocol.config" and r.levelno == logging.WARNING]


def test_rlinf_patch_file_loads_with_its_aliases_and_warns_once_per_nccl_option(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, RLINF_PATCH)
    with caplog.at_level(logging.WARNING, logger="protocol.config"):
        config = load_config(path)
        again = load_config(path)  # both sides load the file: the warnings are not repeated
    for c in (config, again):
        assert (c.type, c.patch.compression, c.patch.compressor) == ("patch", "lz4", Codec.LZ4)
        assert (c.patch.init_sync.enabled, c.patch.init_sync.prefixes, c.patch.init_sync.bucket_size) == (True, None, 65536)
        assert (c.patch.snapshot_device, c.patch.transport_device, c.patch.delta_encoding) == ("cpu", "cpu", True)
    messages = warned(caplog)
    assert len(messages) == 3, messages
    for key, value in (("use_ring_sync", "True"), ("nccl_max_ctas", "8"), ("nccl_min_ctas", "2")):
        assert sum(f"'{key}' ({value})" in m and "ignores it" in m for m in messages) == 1, (key, messages)


def test_rlinf_bucket_file_and_the_seed_examples_load_without_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="protocol.config"):
        bucket = load_config(write(tmp_path, RLINF_BUCKET, "bucket.yaml"))
        seed = load_config(write(tmp_path, SEED_PATCH, "patch.yaml"))
        for name in ("patch_syncer.yaml", "bucket_syncer.yaml"):  # the repository's commented examples
            load_config(Path(__file__).resolve().parent.parent / "examples" / "config" / "weight_syncer" / name)
    assert warned(caplog) == []  # the NCCL options at their defaults lose nothing: no warning
    assert (bucket.type, bucket.bucket.bucket_size, bucket.bucket.bucket_device, bucket.bucket.is_agent) == ("bucket", 536870912, "cuda", False)
    assert bucket.bucket.dtype is None and bucket.bucket.load_instant is True
    assert (seed.patch.compression, seed.patch.init_sync.bucket_size) == ("none", 134217728)


def test_an_alias_equal_to_its_key_is_fine_a_different_one_is_refused() -> None:
    same = load_config({"patch": {"compression": "zstd", "compression_algorithm": "zstd", "init_sync": {"bucket_size": 4096, "buckets_size": 4096}}})
    assert (same.patch.compression, same.patch.init_sync.bucket_size) == ("zstd", 4096)
    with pytest.raises(ConfigError, match=r"'patch\.compression_algorithm' \('lz4'\) and 'patch\.compression' \('zstd'\) .* disagree"):
        load_config({"patch": {"compression": "zstd", "compression_algorithm": "lz4"}})
    with pytest.raises(ConfigError, match=r"'patch\.init_sync\.buckets_size' \(1\) and 'patch\.init_sync\.bucket_size' \(2\)"):
        load_config({"patch": {"init_sync": {"bucket_size": 2, "buckets_size": 1}}})
    # an alias is checked as the key it stands for
    with pytest.raises(ConfigError, match="compression"):
        load_config({"patch": {"compression_algorithm": "brotli"}})
    with pytest.raises(ConfigError, match="bucket sizes must be positive integers"):
        load_config({"patch": {"init_sync": {"buckets_size": "128MiB"}}})


@pytest.mark.parametrize(
    "data,text",
    [
        ({"use_ring_sync": "true"}, "use_ring_sync must be true or false"),
        ({"use_ring_sync": 1}, "use_ring_sync must be true or false"),
        ({"nccl_max_ctas": 0}, "nccl_max_ctas must be a positive integer or null"),
        ({"nccl_min_ctas": 2.5}, "nccl_min_ctas must be a positive integer or null"),
        ({"nccl_min_ctas": True}, "nccl_min_ctas must be a positive integer or null"),
        ({"use_ring_synk": True}, "unknown config key 'use_ring_synk'"),  # a typo is still an error
        ({"patch": {"compression_algoritm": "lz4"}}, "unknown config key 'patch.compression_algoritm'"),
    ],
)
def test_bad_rlinf_keys_are_clear_errors(data: dict[str, object], text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        load_config({"weight_syncer": {"type": "patch", **data}})


def test_bucket_is_agent_true_is_refused_with_what_it_means_in_rlinf() -> None:
    for source in ({"type": "bucket", "bucket": {"is_agent": True}}, {"type": "patch", "bucket": {"is_agent": True}}):
        with pytest.raises(ConfigError, match=r"is_agent: true is RLinf's sender-side rename of 'model\.language_model\.<x>'.*name_mapping"):
            load_config(source)
    with pytest.raises(ConfigError, match=r"bucket\.is_agent must be true or false"):
        load_config({"type": "bucket", "bucket": {"is_agent": "false"}})


async def test_an_rlinf_patch_file_drives_a_real_sync(tmp_path: Path) -> None:
    """lz4 from ``compression_algorithm`` and 64 KiB bootstrap buckets from ``buckets_size``
    are what the sender really uses: the bootstrap is several buckets, patches are lz4."""
    path = write(tmp_path, RLINF_PATCH)
    trainer = Trainer()
    async with Sender("tcp://127.0.0.1:0", path, **DAEMON_KW) as sender:
        await asyncio.wait_for(sender.start(trainer.model, version=0), T)
        async with Receiver(receiver_model(), sender.endpoint, path, **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)
            await assert_matches(receiver, trainer, 0)
            boot = receiver.stats[0]
            assert boot.kind == "bootstrap" and boot.messages > 1  # 64 KiB buckets; the default 128 MiB is one message
            for _ in range(2):
                version = await trainer.step_and_sync(sender)
                await receiver.wait_for_version(version, timeout=T)
                await assert_matches(receiver, trainer, version)
            assert sender.config.patch.compressor is Codec.LZ4 and receiver.config.patch.compressor is Codec.LZ4


SHIPPED_BUCKET = Path(__file__).resolve().parent.parent / "examples" / "config" / "weight_syncer" / "bucket_syncer.yaml"


async def test_the_shipped_bucket_file_refuses_a_rollout_whose_frozen_weight_differs() -> None:
    """``bucket_syncer.yaml`` (init_sync off, as in RLinf) never sends a frozen weight: a
    rollout whose copy differs would differ from the trainer every version, silently. WELCOME
    carries the digest of what is never sent: such a rollout is refused, naming the key and
    the fix; one that loaded the trainer's checkpoint follows it; with init_sync on, the
    same different rollout is bootstrapped instead."""
    import torch

    from examples.tiny_model import build, train_step
    from protocol.errors import MetadataMismatchError, WeightSyncError

    model = build(seed=0)
    model.pos.requires_grad_(False)  # frozen: tracked by no version
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    async with Sender("tcp://127.0.0.1:0", str(SHIPPED_BUCKET), **DAEMON_KW) as sender:
        await asyncio.wait_for(sender.start(model, version=0), T)
        other = build(seed=1).to(torch.bfloat16)
        async with Receiver(other, sender.endpoint, str(SHIPPED_BUCKET), identity="other", **DAEMON_KW) as refused:
            with pytest.raises(WeightSyncError) as caught:
                await refused.start(timeout=T)
        cause = caught.value.__cause__ or caught.value
        assert isinstance(cause, MetadataMismatchError), repr(caught.value)
        assert "key 'pos'" in str(cause) and "init_sync" in str(cause) and "checkpoint" in str(cause), str(cause)
        await wait_until(lambda: "other" not in sender.receivers, timeout=5)  # dropped at its BYE, which may still be on its way
        same = build(seed=0).to(torch.bfloat16)  # the trainer's initial checkpoint, in the rollout's dtype
        async with Receiver(same, sender.endpoint, str(SHIPPED_BUCKET), identity="same", **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)
            train_step(model, optimizer, generator)
            await sender.sync(model, 1)
            await receiver.wait_for_version(1, timeout=T)
            want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
            async with receiver.reading():
                held = same.state_dict()
                assert [k for k in want if not torch.equal(held[k], want[k])] == []
    config = {"weight_syncer": {"type": "bucket", "bucket": {"init_sync": {"enabled": True}}}}
    async with Sender("tcp://127.0.0.1:0", config, **DAEMON_KW) as sender:
        await asyncio.wait_for(sender.start(model, version=1), T)
        other = build(seed=1).to(torch.bfloat16)
        async with Receiver(other, sender.endpoint, config, identity="bootstrapped", **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)
            async with receiver.reading():
                assert torch.equal(other.pos, model.pos.detach().to(torch.bfloat16))
