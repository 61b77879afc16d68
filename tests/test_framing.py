"""Message framing, receiver metadata and configuration loading."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from protocol.codec.compress import COMPRESSION_NAMES, Codec
from protocol.codec.tensorcodec import PatchOptions, assemble, encode_dense, encode_sparse
from protocol.config import BucketConfig, PatchConfig, SyncConfig, load_config
from protocol.errors import ConfigError, IntegrityError, MetadataMismatchError, ProtocolError
from protocol.wire.checksum import checksum
from protocol.wire.framing import (
    PROTOCOL_VERSION,
    Encoding,
    Message,
    MessageType,
    Role,
    ValueEncoding,
    decode_message,
    encode_message,
    peek_type,
)
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "examples" / "config" / "weight_syncer"


def to_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def reseal(header: dict) -> bytes:
    """A header frame for ``header`` with a valid ``hsum``, as encode_message computes it."""
    header = {k: v for k, v in header.items() if k != "hsum"}
    header["hsum"] = checksum(msgpack.packb(header, use_bin_type=True))
    return msgpack.packb(header, use_bin_type=True)


def header_of(frames: Sequence[Any]) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def sparse_entry(key: int, encoding: Encoding, codec: Codec = Codec.NONE):
    shape = (6, 7)
    flat = torch.tensor([0, 9, 10, 41])
    return encode_sparse(key, flat, torch.ones(4), torch.zeros(4), shape, PatchOptions(encoding, ValueEncoding.RAW, codec))


# --------------------------------------------------------------------------- frames


@pytest.mark.parametrize(
    ("encoding", "nbuffers"),
    [(Encoding.COO, 3), (Encoding.COO_DELTA, 3), (Encoding.GAPS, 2), (Encoding.BITMAP, 2)],
)
def test_sparse_entry_frame_count(encoding, nbuffers):
    tensors, frames = assemble([sparse_entry(0, encoding)])
    encoded = encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=tensors, frames=frames))
    assert len(encoded) == 1 + nbuffers
    roles = {b.role for b in decode_message(to_bytes(encoded)).tensors[0].buffers}
    expected = {Role.ROWS, Role.COLS, Role.VALUES} if nbuffers == 3 else {Role.POSITIONS, Role.VALUES}
    assert roles == expected


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
def test_dense_entry_is_one_frame(codec):
    tensors, frames = assemble([encode_dense(0, torch.zeros(64, 3), codec)])
    assert len(encode_message(Message(MessageType.BUCKET, version=1, tensors=tensors, frames=frames))) == 2


def test_mixed_message_frames_are_numbered_in_order():
    entries = [
        sparse_entry(0, Encoding.COO),
        sparse_entry(1, Encoding.GAPS, Codec.ZSTD),
        encode_dense(2, torch.arange(10, dtype=torch.int64), Codec.NONE),
        sparse_entry(3, Encoding.BITMAP, Codec.LZ4),
        sparse_entry(4, Encoding.COO_DELTA),
    ]
    tensors, frames = assemble(entries)
    encoded = encode_message(Message(MessageType.PATCH, version=2, base_version=1, tensors=tensors, frames=frames))
    assert len(encoded) == 1 + 3 + 2 + 1 + 2 + 3
    # Payload frames are the buffers themselves, in manifest order, not copies inside msgpack.
    wires = [w for e in entries for _, w in e.buffers]
    assert all(a is b for a, b in zip(encoded[1:], wires))
    assert len(encoded[0]) < 1024  # tensor bytes never go inside the header
    msg = decode_message(to_bytes(encoded))
    assert [b.frame for t in msg.tensors for b in t.buffers] == list(range(1, 12))
    assert [t.key for t in msg.tensors] == [0, 1, 2, 3, 4]
    assert [t.encoding for t in msg.tensors] == [e.encoding for e in entries]
    for t, e in zip(msg.tensors, entries):
        for spec, (want, w) in zip(t.buffers, e.buffers):
            assert (spec.role, spec.dtype, spec.shape, spec.nbytes, spec.codec, spec.shuffle, spec.checksum) == (
                want.role, want.dtype, want.shape, want.nbytes, want.codec, want.shuffle, want.checksum)
            assert msg.frames[spec.frame - 1] == bytes(w)
    assert msg.payload_nbytes == sum(len(bytes(w)) for w in wires)


def test_message_without_tensors_is_one_frame():
    assert len(encode_message(Message(MessageType.HEARTBEAT))) == 1


# --------------------------------------------------------------------------- header and body


@pytest.mark.parametrize("mtype", list(MessageType), ids=lambda t: t.name)
def test_header_roundtrip_every_type(mtype):
    body = {"reason": "because", "n": [1, 2, 3], "nested": {"a": b"\x00\xff", "f": 1.5, "none": None}, "ok": True}
    msg = Message(mtype, session="sess-\u00e9", seq=42, version=9, base_version=8, part=1, last=False, body=body)
    out = decode_message(to_bytes(encode_message(msg)))
    assert out.type is mtype
    assert (out.session, out.seq, out.version, out.base_version, out.part, out.last) == ("sess-\u00e9", 42, 9, 8, 1, False)
    assert out.body == body
    assert out.tensors == [] and out.frames == []


def test_header_optional_versions_roundtrip():
    out = decode_message(to_bytes(encode_message(Message(MessageType.HELLO, version=None, base_version=None))))
    assert out.version is None and out.base_version is None
    assert (out.seq, out.part, out.last, out.session, out.body) == (0, 0, True, "", {})


def test_header_carries_protocol_version_and_checksum():
    header = header_of(encode_message(Message(MessageType.ACK, version=3)))
    assert header["proto"] == PROTOCOL_VERSION
    assert header["type"] == int(MessageType.ACK)
    assert type(header["hsum"]) is int


@pytest.mark.parametrize("proto", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99])
def test_protocol_version_mismatch(proto):
    frames = to_bytes(encode_message(Message(MessageType.HELLO)))
    header = header_of(frames)
    header["proto"] = proto
    with pytest.raises(ProtocolError, match=f"protocol version {proto}"):
        decode_message([reseal(header)])


def spanned_message(span: Span) -> list[bytes]:
    entry = dataclasses.replace(encode_dense(3, torch.ones(span.numel), Codec.NONE), span=span)
    tensors, frames = assemble([entry])
    return to_bytes(encode_message(Message(MessageType.PATCH, version=2, base_version=1, tensors=tensors, frames=frames)))


@pytest.mark.parametrize("span", [Span.range(5, 17), Span(3, 4, 5, 10), Span(0, 2, 3, 2)], ids=["range", "strided", "runs-end-to-end"])
def test_span_entries_roundtrip(span: Span) -> None:
    """A range travels as protocol 6 wrote it ([lo, hi]); a strided block as [lo, hi, length, stride]."""
    frames = spanned_message(span)
    wire = header_of(frames)["tensors"][0][-1]
    assert wire == {"s": [span.lo, span.hi] if span.count == 1 else [span.lo, span.hi, span.length, span.stride]}
    (entry,) = decode_message(frames).tensors
    assert entry.span == span


@pytest.mark.parametrize("raw", [
    {"s": [0, 10, 3, 4]},  # runs of 3 every 4 from 0 do not end at 10
    {"s": [0, 10, 4, 3]},  # stride below length
    {"s": [0, 4, 4, 8]},  # one run in the four-item form
    {"s": [4, 4]}, {"s": [0, 4, 1]}, {"s": "0-4"}, {"t": [0, 4]}, {"s": [0, 4], "x": 1}, {"s": [0, 4.0]},
])
def test_malformed_spans_are_refused_by_the_framing(raw: dict) -> None:
    frames = spanned_message(Span.range(0, 4))
    header = header_of(frames)
    header["tensors"][0][-1] = raw
    with pytest.raises(ProtocolError, match="tensor 3"):
        decode_message([reseal(header), *frames[1:]])


@pytest.mark.parametrize("raw_type", [0, max(MessageType) + 1, 255, 2**40])
def test_unknown_message_type(raw_type):
    header = header_of(encode_message(Message(MessageType.HELLO)))
    header["type"] = raw_type
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode_message([reseal(header)])


def test_reseal_matches_encode_message():
    """The test helper computes the header checksum exactly as the library does."""
    frames = encode_message(Message(MessageType.PATCH, version=2, base_version=1, body={"x": 1}))
    assert reseal(header_of(frames)) == bytes(frames[0])


def test_modified_header_without_new_checksum_is_an_integrity_error():
    header = header_of(encode_message(Message(MessageType.PATCH, version=2, base_version=1)))
    header["version"] = 3
    with pytest.raises(IntegrityError):
        decode_message([msgpack.packb(header, use_bin_type=True)])


@pytest.mark.parametrize(("part", "last"), [(-1, True), (0, 1), (0, 0), (0, None), (0.0, True)])
def test_part_fields_of_the_wrong_kind(part, last):
    header = header_of(encode_message(Message(MessageType.BUCKET, version=1)))
    header["part"], header["last"] = part, last
    with pytest.raises(ProtocolError):
        decode_message([reseal(header)])


# --------------------------------------------------------------------------- metadata


def sample_state() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
        "scale": torch.tensor(1.0),
        "blocks.0.mix": torch.zeros(2, 3, 4),
        "step": torch.zeros((), dtype=torch.int64),
        "mask": torch.zeros(5, dtype=torch.bool),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    }


def test_metadata_roundtrip_through_a_hello_body():
    meta = ModelMetadata.of(sample_state())
    frames = encode_message(Message(MessageType.HELLO, body={"metadata": meta.to_body(), "version": None}))
    body = decode_message(to_bytes(frames)).body
    back = ModelMetadata.from_body(body["metadata"])
    assert back == meta
    assert back.keys == tuple(sample_state())  # order is kept: it defines the tensor ordinals
    assert back.ordinal("step") == 3 and "mask" in back and "nope" not in back
    assert back.shapes[1] == () and back.dtypes[0] == torch.bfloat16


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"keys": ["a"], "shapes": [[1]]},
        {"keys": "a", "shapes": [[1]], "dtypes": [1]},
        {"keys": ["a", "b"], "shapes": [[1]], "dtypes": [1]},
        {"keys": ["a", "a"], "shapes": [[1], [1]], "dtypes": [1, 1]},
        {"keys": [1], "shapes": [[1]], "dtypes": [1]},
        {"keys": ["a"], "shapes": [[-1]], "dtypes": [1]},
        {"keys": ["a"], "shapes": [["1"]], "dtypes": [1]},
        {"keys": ["a"], "shapes": [[1] * 100], "dtypes": [1]},
        {"keys": ["a"], "shapes": [5], "dtypes": [1]},
        {"keys": ["a"], "shapes": [[1]], "dtypes": [999]},
        {"keys": ["a"], "shapes": [[1]], "dtypes": ["float32"]},
    ],
)
def test_metadata_from_bad_body(body):
    with pytest.raises(ProtocolError):
        ModelMetadata.from_body(body)


def test_check_against_accepts_matching_and_float_conversions():
    state = sample_state()
    meta = ModelMetadata.of(state)
    meta.check_against(state)
    # The receiver's own float dtypes may differ from the trainer's (fp32 master, bf16 rollout).
    meta.check_against({k: (t.float() if t.is_floating_point() else t) for k, t in state.items()})


def test_check_against_names_a_key_missing_on_the_receiver():
    meta = ModelMetadata.of(sample_state())
    with pytest.raises(MetadataMismatchError, match=r"'extra\.bias'.*not on the receiver"):
        meta.check_against({**sample_state(), "extra.bias": torch.zeros(3)})


def test_check_against_names_a_key_missing_on_the_sender():
    meta = ModelMetadata.of(sample_state())
    state = sample_state()
    del state["blocks.0.mix"]
    with pytest.raises(MetadataMismatchError, match=r"'blocks\.0\.mix'.*not on the sender"):
        meta.check_against(state)
    meta.check_against(state, keys=list(state))  # restricted to the keys that travel: fine


def test_check_against_names_a_shape_mismatch():
    meta = ModelMetadata.of(sample_state())
    state = sample_state()
    state["embed.weight"] = torch.zeros(11, 4, dtype=torch.bfloat16)
    with pytest.raises(MetadataMismatchError) as err:
        meta.check_against(state)
    assert "'embed.weight'" in str(err.value) and "[11, 4]" in str(err.value) and "[10, 4]" in str(err.value)


def test_check_against_names_the_first_mismatch():
    meta = ModelMetadata.of(sample_state())
    state = sample_state()
    state["scale"] = torch.zeros(2)
    state["mask"] = torch.zeros(6, dtype=torch.bool)
    with pytest.raises(MetadataMismatchError, match="'scale'"):
        meta.check_against(state)


def test_check_against_rejects_float_into_integer():
    meta = ModelMetadata.of(sample_state())
    state = sample_state()
    state["step"] = torch.zeros(())
    with pytest.raises(MetadataMismatchError, match="'step'"):
        meta.check_against(state)


# --------------------------------------------------------------------------- configuration


def test_config_defaults():
    cfg = load_config()
    assert cfg.type == "patch"
    p = cfg.patch
    assert (p.snapshot_device, p.transport_device, p.delta_encoding) == ("auto", "cpu", True)
    assert p.compression in COMPRESSION_NAMES and p.compressor is not Codec.NVCOMP_LZ4  # a default must work on CPU
    assert cfg.init_sync is p.init_sync and p.init_sync.enabled and p.init_sync.prefixes is None
    assert p.init_sync.bucket_size == 128 << 20
    assert p.options() == PatchOptions(None, ValueEncoding.ULP, COMPRESSION_NAMES[p.compression])
    assert cfg.bucket.bucket_size == 512 << 20 and not cfg.bucket.init_sync.enabled
    assert load_config({}) == cfg
    assert load_config(SyncConfig()) == cfg


def test_config_coo_with_and_without_delta():
    cfg = load_config({"patch": {"position_encoding": "coo"}})
    assert cfg.patch.options().positions is Encoding.COO_DELTA
    cfg = load_config({"patch": {"position_encoding": "coo", "delta_encoding": False, "compression": "lz4"}})
    assert cfg.patch.options() == PatchOptions(Encoding.COO, ValueEncoding.ULP, Codec.LZ4)


def test_config_weight_syncer_wrapper():
    cfg = load_config({"weight_syncer": {"type": "bucket", "bucket": {"bucket_size": 1024, "bucket_dtype": "bf16"}}})
    assert cfg.type == "bucket" and cfg.bucket.bucket_size == 1024 and cfg.bucket.dtype == torch.bfloat16
    assert cfg.init_sync is cfg.bucket.init_sync and not cfg.init_sync.enabled


def test_config_bucket_init_sync_defaults_to_disabled():
    cfg = load_config({"type": "bucket", "bucket": {"init_sync": {"prefixes": ["model."]}}})
    assert not cfg.bucket.init_sync.enabled and cfg.bucket.init_sync.prefixes == ["model."]
    cfg = load_config({"patch": {"init_sync": {"prefixes": ["model."]}}})
    assert cfg.patch.init_sync.enabled


def test_config_from_yaml_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("weight_syncer:\n  type: patch\n  patch:\n    compression: zstd\n    init_sync:\n      enabled: false\n")
    cfg = load_config(path)
    assert cfg.patch.compressor is Codec.ZSTD and not cfg.patch.init_sync.enabled
    assert load_config(str(path)) == cfg
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == load_config()


def test_config_from_attribute_object():
    from types import SimpleNamespace

    cfg = load_config(SimpleNamespace(type="patch", patch=SimpleNamespace(compression="lz4", value_encoding="raw")))
    assert cfg.patch.options().codec is Codec.LZ4 and cfg.patch.options().values is ValueEncoding.RAW


@pytest.mark.skipif(not (CONFIG_DIR / "patch_syncer.yaml").exists(), reason="no examples/config/.../patch_syncer.yaml")
def test_example_patch_syncer_yaml():
    cfg = load_config(CONFIG_DIR / "patch_syncer.yaml")
    assert cfg.type == "patch"
    assert isinstance(cfg.patch, PatchConfig)
    cfg.patch.options()  # every setting resolves


@pytest.mark.skipif(not (CONFIG_DIR / "bucket_syncer.yaml").exists(), reason="no examples/config/.../bucket_syncer.yaml")
def test_example_bucket_syncer_yaml():
    cfg = load_config(CONFIG_DIR / "bucket_syncer.yaml")
    assert cfg.type == "bucket"
    assert isinstance(cfg.bucket, BucketConfig)
    cfg.bucket.dtype  # noqa: B018 - resolves


@pytest.mark.parametrize(
    ("data", "name"),
    [
        ({"typo": 1}, "typo"),
        ({"patch": {"compresion": "lz4"}}, "patch.compresion"),
        ({"patch": {"init_sync": {"enable": True}}}, "patch.init_sync.enable"),
        ({"bucket": {"bucket_sz": 1}}, "bucket.bucket_sz"),
        ({"weight_syncer": {"type": "patch", "extra": 1}}, "extra"),
        ({"weight_syncer": {}, "other": {}}, "other"),  # a wrapper only when it is the sole key
    ],
)
def test_config_unknown_key_is_named(data, name):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert repr(name) in str(err.value)


@pytest.mark.parametrize(
    "data",
    [
        {"type": "stream"},
        {"patch": {"snapshot_device": "tpu"}},
        {"patch": {"transport_device": "gpu"}},
        {"patch": {"compression": "gzip"}},
        {"patch": {"compression": "nvcomp_lz4"}},  # needs transport_device: cuda
        {"patch": {"position_encoding": "rle"}},
        {"patch": {"value_encoding": "delta"}},
        {"patch": {"dense_above": 1.5}},
        {"patch": {"dense_above": -0.1}},
        {"patch": {"dense_above": "0.3"}},
        {"patch": {"dense_above": True}},
        {"patch": {"init_sync": {"bucket_size": 0}}},
        {"patch": {"init_sync": {"bucket_size": -5}}},
        {"patch": {"init_sync": {"bucket_size": 1.5}}},
        {"patch": {"init_sync": {"bucket_size": True}}},
        {"patch": {"init_sync": {"prefixes": "model."}}},
        {"patch": {"init_sync": {"prefixes": ["model.", ""]}}},
        {"patch": {"init_sync": 5}},
        {"patch": "fast"},
        {"bucket": {"bucket_size": "512MiB"}},
        {"bucket": {"bucket_device": "tpu"}},
        {"type": "bucket", "bucket": {"bucket_dtype": "int8"}},
        [1, 2],
        "not-a-file.yaml",
    ],
)
def test_config_bad_values(data):
    with pytest.raises(ConfigError):
        load_config(data)


@pytest.mark.parametrize(
    "data",
    [
        {"patch": {"delta_encoding": "false"}},
        {"patch": {"init_sync": {"enabled": "no"}}},
        {"bucket": {"load_instant": 0}},
    ],
)
def test_config_boolean_settings_must_be_booleans(data):
    """A quoted "false" is a truthy string: accepting it would silently turn the setting on."""
    with pytest.raises(ConfigError):
        load_config(data)


@pytest.mark.parametrize("inner", [[1, 2], "patch", 5])
def test_config_wrapper_content_must_be_a_mapping(inner):
    with pytest.raises(ConfigError):
        load_config({"weight_syncer": inner})


def test_config_empty_wrapper_is_defaults_or_a_config_error():
    try:
        cfg = load_config({"weight_syncer": None})
    except ConfigError:
        return
    assert cfg == load_config()


def test_config_unreadable_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("weight_syncer: [unclosed\n")
    with pytest.raises(ConfigError):
        load_config(path)


# -- routing and receiving (protocol/net/sockets.py) -----------------------------------------------
@pytest.mark.parametrize("mtype", list(MessageType))
def test_peek_type_matches_the_decoded_type(mtype):
    frames = encode_message(Message(mtype, version=3, body={"pad": "x" * 1000}))
    assert peek_type(frames) is decode_message(frames).type is mtype


def test_peek_type_of_other_layouts_and_garbage():
    """A header whose first key is not ``type`` is parsed whole; garbage is None."""
    header = header_of(encode_message(Message(MessageType.ACK, version=1)))
    reordered = reseal({"body": {}, **{k: v for k, v in header.items() if k != "body"}})
    assert next(iter(msgpack.unpackb(reordered, raw=False))) == "body"
    assert peek_type([reordered]) is MessageType.ACK
    assert peek_type([msgpack.packb({"type": 99})]) is None
    assert peek_type([b"\xc1garbage"]) is None
    assert peek_type([b""]) is None
    assert peek_type([msgpack.packb([1, 2])]) is None


async def test_dealer_receives_a_many_frame_message_whole_and_bounded():
    """A 3,000-frame message arrives whole and in order (read with one await); one over the
    frame count is a LimitError that keeps nothing, and the next message is intact."""
    import asyncio

    import zmq
    import zmq.asyncio

    from protocol.errors import LimitError
    from protocol.net.sockets import DealerSocket
    from protocol.wire.limits import Limits

    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = DealerSocket(context, f"tcp://127.0.0.1:{port}", b"r", limits=Limits(frames=3001, message_bytes=1 << 20))
    try:
        await dealer.send([b"hello"])
        identity, _ = await asyncio.wait_for(router.recv_multipart(), 10)
        big = [b"header", *(i.to_bytes(4, "little") * (1 + i % 5) for i in range(2999))]
        await router.send_multipart([identity, *big])
        assert [bytes(f) for f in await asyncio.wait_for(dealer.recv(), 10)] == big
        await router.send_multipart([identity, b"h", *[b""] * 5000])  # over the frame count
        await router.send_multipart([identity, b"h", b"x" * 600_000, b"y" * 600_000])  # over the total
        await router.send_multipart([identity, *big[:3]])
        for limit in ("frame count", "message bytes"):
            with pytest.raises(LimitError) as e:
                await asyncio.wait_for(dealer.recv(), 10)
            assert e.value.limit == limit
        assert [bytes(f) for f in await asyncio.wait_for(dealer.recv(), 10)] == big[:3]
    finally:
        dealer.close()
        router.close(linger=0)
        context.destroy(linger=0)
