"""Configuration in RLinf's YAML shape, shared by both sides.

::

    weight_syncer:            # optional wrapper, as in a Hydra config group
      type: patch             # or bucket
      patch: {snapshot_device, transport_device, delta_encoding, compression, codec,
              position_encoding, value_encoding, dense_above, part_bytes,
              encode_backlog_bytes, encode_threads, group_numel,
              init_sync: {enabled, prefixes, bucket_size}}
      bucket: {bucket_size, bucket_dtype, bucket_device, is_agent, load_instant, init_sync}
      fp8: {block, scale_format, source, skip, include, bf16_layers}   # block-fp8 rollouts (protocol/quant.py)

Unknown keys are errors, so a typo never silently falls back to a default. RLinf's own
``weight_syncer`` group loads unchanged: its aliases (``patch.compression_algorithm``,
``init_sync.buckets_size``) read as weightsync's names, and its NCCL broadcast options
(``use_ring_sync``, ``nccl_max_ctas``, ``nccl_min_ctas``), which have no effect over
ZeroMQ, are checked and, when set, warned about once per process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.codec.compress import Codec, parse_compression
from protocol.codec.tensorcodec import DenseCost, PatchOptions
from protocol.errors import ConfigError
from protocol.quant import BlockFp8
from protocol.wire.dtypes import parse_float_dtype
from protocol.wire.framing import Encoding, ValueEncoding

log = logging.getLogger(__name__)

MiB = 1 << 20
DEVICES = ("cpu", "cuda")
POSITION_ENCODINGS = {"auto": None, "ans": Encoding.ANS_GAPS, "coo": Encoding.COO, "gaps": Encoding.GAPS, "bitmap": Encoding.BITMAP}
VALUE_ENCODINGS = {"ulp": ValueEncoding.ULP, "raw": ValueEncoding.RAW, "xor": ValueEncoding.XOR}
CODECS = {"auto": None, "host": False, "device": True}  # patch.codec -> PatchOptions.device_codec


@dataclass
class InitSyncConfig:
    """The one-time bootstrap at init: whole state dict (``prefixes`` None) or matching keys."""

    enabled: bool = True
    prefixes: list[str] | None = None
    bucket_size: int = 128 * MiB


@dataclass
class PatchConfig:
    # Where the sender's snapshot lives: cpu (pinned when CUDA is present), cuda, or auto: the
    # trainer's GPU when it takes at most half the memory free there (sender/diff/snapshot.py), else cpu.
    snapshot_device: str = "auto"
    transport_device: str = "cpu"  # where patch buffers are packed: cuda for nvcomp_lz4
    delta_encoding: bool = True  # RLinf's COO only: delta-encode rows/cols
    compression: str = "zstd"  # none | lz4 | zstd | nvcomp_lz4
    # Which codec codes sparse changes: host (numba, entropy coded: the fewest bytes), device
    # (batched torch ops on the tensors' device: protocol/codec/devicecodec.py), or auto: the
    # device codec where the tracked tensors are on CUDA, else the host's. A receiver decodes either.
    codec: str = "auto"
    position_encoding: str = "auto"  # auto | ans (entropy-coded gaps) | gaps | bitmap | coo (RLinf's)
    value_encoding: str = "ulp"  # ulp (entropy-coded bit differences) | xor | raw (RLinf's new values)
    # How each changed tensor travels: "auto" whole, coded or plain (raw gaps and values),
    # whichever is estimated fastest (at 1 Gb/s a receiver, 25 ns of CPU a coded change, 12 a
    # plain one; {link_gbps: G, ns_per_change: N, plain_ns_per_change: P} sets
    # those), or a share: a tensor with more than it of its elements changed is sent whole
    # (1.0: never, except where coding would not be smaller). See tensorcodec.DenseCost.
    dense_above: float | str | dict[str, float] = "auto"
    # A patch travels in parts of at least this many bytes of changes each, each sent as
    # soon as it is encoded, so receivers decode one while the next is encoded; 0: one message.
    part_bytes: int = 16 * MiB  # large: a part's fixed cost stays small beside its work (docs/performance.md)
    # How many bytes of collected changes may wait for the encoder before the compare waits
    # for it (what the sender's memory grows by when the compare outruns the encoder).
    # None: a 32nd of the snapshot, at least 4 MiB; 0: unbounded.
    encode_backlog_bytes: int | None = None
    # Threads that encode what a compare on a worker thread (a state over 64 MiB read, or on
    # CUDA) collects, beside it; None: half the host's cores, 1 to 4 (1 on 2 cores).
    encode_threads: int | None = None
    # Tensors of at most this many elements are compared and coded in groups of up to 4x
    # that (biases, norms: an entry costs tens of us a side whatever its size); 0: never.
    group_numel: int = 64 * 1024
    init_sync: InitSyncConfig = field(default_factory=InitSyncConfig)

    def options(self) -> PatchOptions:
        """The encoding options these settings select."""
        positions = POSITION_ENCODINGS[self.position_encoding]
        if positions is Encoding.COO and self.delta_encoding:
            positions = Encoding.COO_DELTA
        return PatchOptions(
            positions, VALUE_ENCODINGS[self.value_encoding], self.compressor, dense_rule(self.dense_above), CODECS[self.codec]
        )

    @property
    def compressor(self) -> Codec:
        """``compression`` as the codec that compresses buffers."""
        return parse_compression(self.compression, self.transport_device)


@dataclass
class BucketConfig:
    bucket_size: int = 512 * MiB
    bucket_dtype: str | None = None  # None keeps dtypes; a float dtype converts floating tensors only
    bucket_device: str = "auto"  # where buckets are assembled: cpu, cuda, or auto (the tensor's device)
    is_agent: bool = False  # RLinf's sender-side rename; only false is accepted (name maps are explicit)
    load_instant: bool = True  # decode each bucket on arrival; False keeps frames until the last one
    init_sync: InitSyncConfig = field(default_factory=lambda: InitSyncConfig(enabled=False))

    @property
    def dtype(self) -> torch.dtype | None:
        return parse_float_dtype(self.bucket_dtype)


@dataclass
class SyncConfig:
    type: str = "patch"
    patch: PatchConfig = field(default_factory=PatchConfig)
    bucket: BucketConfig = field(default_factory=BucketConfig)
    # Block fp8, for rollouts whose metadata holds weights in it: a receiver declares
    # block and scale_format in its HELLO (an engine's own quantization config wins); the
    # sender quantizes from `source` (bf16 or master). Unused when no receiver holds fp8.
    fp8: BlockFp8 = field(default_factory=BlockFp8)

    @property
    def init_sync(self) -> InitSyncConfig:
        return self.patch.init_sync if self.type == "patch" else self.bucket.init_sync

    def validate(self) -> SyncConfig:
        if self.type not in ("patch", "bucket"):
            raise ConfigError(f"type must be 'patch' or 'bucket', got {self.type!r}")
        p, b = self.patch, self.bucket
        for name, value, allowed in (
            ("patch.snapshot_device", p.snapshot_device, (*DEVICES, "auto")),
            ("patch.transport_device", p.transport_device, DEVICES),
            ("patch.position_encoding", p.position_encoding, tuple(POSITION_ENCODINGS)),
            ("patch.value_encoding", p.value_encoding, tuple(VALUE_ENCODINGS)),
            ("patch.codec", p.codec, tuple(CODECS)),
            ("bucket.bucket_device", b.bucket_device, (*DEVICES, "auto")),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
        for name, flag in (
            ("patch.delta_encoding", p.delta_encoding),
            ("patch.init_sync.enabled", p.init_sync.enabled),
            ("bucket.is_agent", b.is_agent),
            ("bucket.load_instant", b.load_instant),
            ("bucket.init_sync.enabled", b.init_sync.enabled),
        ):
            if type(flag) is not bool:  # "false" is a true string: never guess
                raise ConfigError(f"{name} must be true or false, got {flag!r}")
        if b.is_agent:
            raise ConfigError(
                "bucket.is_agent: true is RLinf's sender-side rename of 'model.language_model.<x>' to 'model.<x>' "
                "(vision-language agents); weightsync renames on the receiver only, explicitly: leave is_agent false "
                "and give the receiver name_mapping={'model.<x>': 'model.language_model.<x>', ...} (or a callable)"
            )
        if p.codec == "device" and (p.position_encoding != "auto" or p.value_encoding != "ulp"):
            raise ConfigError(
                "patch.codec: device codes positions and values itself: leave patch.position_encoding auto and "
                f"patch.value_encoding ulp (got {p.position_encoding!r} and {p.value_encoding!r}), or use patch.codec: host"
            )
        dense_rule(p.dense_above)
        if type(p.part_bytes) is not int or p.part_bytes < 0:
            raise ConfigError(f"patch.part_bytes must be an int >= 0 (0: one message a version), got {p.part_bytes!r}")
        if p.encode_backlog_bytes is not None and (type(p.encode_backlog_bytes) is not int or p.encode_backlog_bytes < 0):
            raise ConfigError(
                f"patch.encode_backlog_bytes must be an int >= 0 (0: unbounded) or null (automatic), got {p.encode_backlog_bytes!r}"
            )
        if p.encode_threads is not None and (type(p.encode_threads) is not int or p.encode_threads < 1):
            raise ConfigError(f"patch.encode_threads must be an int >= 1 or null (automatic), got {p.encode_threads!r}")
        if type(p.group_numel) is not int or p.group_numel < 0:
            raise ConfigError(f"patch.group_numel must be an int >= 0 (0: every tensor on its own), got {p.group_numel!r}")
        if self.type == "patch":
            parse_compression(p.compression, p.transport_device)
        else:
            b.dtype  # noqa: B018 - validates the name
        for name, init in (("patch", p.init_sync), ("bucket", b.init_sync)):
            for size in (init.bucket_size, b.bucket_size):
                if type(size) is not int or size <= 0:
                    raise ConfigError(f"{name}: bucket sizes must be positive integers, got {size!r}")
            if init.prefixes is not None and (
                not isinstance(init.prefixes, list) or not all(isinstance(x, str) and x for x in init.prefixes)
            ):
                raise ConfigError(f"{name}.init_sync.prefixes must be null or a list of non-empty strings")
        return self


# RLinf's names for weightsync's keys, per section: {section: {alias: key}}. Both at once
# must agree (RLinf would silently prefer one).
ALIASES: dict[type, dict[str, str]] = {
    PatchConfig: {"compression_algorithm": "compression"},
    InitSyncConfig: {"buckets_size": "bucket_size"},
}

# RLinf's top-level NCCL broadcast options (CollectiveGroupOptions): weightsync sends over
# ZeroMQ, so they cannot apply. Key -> (the value meaning "not set", a check of a set value).
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "use_ring_sync": (False, "true or false"),
    "nccl_max_ctas": (None, "a positive integer or null"),
    "nccl_min_ctas": (None, "a positive integer or null"),
}
_warned: set[str] = set()  # keys already warned about in this process
DENSE_COST_KEYS = {"link_gbps": True, "ns_per_change": False, "plain_ns_per_change": False}  # name: must be positive


def dense_rule(value: Any) -> float | DenseCost:
    """``patch.dense_above`` as ``PatchOptions`` takes it; ``ConfigError`` when malformed."""
    if value == "auto" and type(value) is str:
        return DenseCost()
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(DENSE_COST_KEYS))
        if unknown:
            raise ConfigError(f"patch.dense_above: unknown key {unknown[0]!r}; known keys: {list(DENSE_COST_KEYS)}")
        for name, positive in DENSE_COST_KEYS.items():
            v = value.get(name, getattr(DenseCost, name))
            if type(v) not in (int, float) or not (v > 0 if positive else v >= 0) or v != v or v == float("inf"):
                raise ConfigError(f"patch.dense_above.{name} must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
        return DenseCost(**{name: float(value.get(name, getattr(DenseCost, name))) for name in DENSE_COST_KEYS})
    if type(value) not in (int, float) or not 0 <= value <= 1:
        raise ConfigError(f"patch.dense_above must be 'auto', {{{', '.join(DENSE_COST_KEYS)}}} or a number in [0, 1], got {value!r}")
    return float(value)


def load_config(source: SyncConfig | Mapping[str, Any] | str | Path | object | None = None) -> SyncConfig:
    """A validated ``SyncConfig`` from a YAML path, a mapping, a config object or None (defaults)."""
    if source is None:
        return SyncConfig().validate()
    if isinstance(source, SyncConfig):
        return source.validate()
    if isinstance(source, (str, Path)):
        import yaml

        try:
            source = yaml.safe_load(Path(source).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {source}: {e}") from None
    data = _plain(source)
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    if set(data) == {"weight_syncer"}:
        data = data["weight_syncer"] or {}
        if not isinstance(data, dict):
            raise ConfigError(f"weight_syncer must be a mapping, got {type(data).__name__}")
    return _build(SyncConfig, _drop_no_effect(data), "").validate()


def _drop_no_effect(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys in ``NO_EFFECT``: each is type-checked, and one set to
    anything but its default is warned about once per process (both sides load the file)."""
    kept = dict(data)
    for key, (unset, expected) in NO_EFFECT.items():
        if key not in kept:
            continue
        value = kept.pop(key)
        ok = type(value) is bool if unset is False else value is None or (type(value) is int and value > 0)
        if not ok:
            raise ConfigError(f"{key} must be {expected}, got {value!r}")
        if value != unset and key not in _warned:
            _warned.add(key)
            log.warning("config key %r (%r) is an RLinf NCCL broadcast option; weightsync sends over ZeroMQ and ignores it", key, value)
    return kept


def _plain(obj: Any) -> Any:
    """Mappings, dataclasses and attribute objects (OmegaConf, SimpleNamespace) as plain dicts."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__dict__") and not isinstance(obj, (str, bytes, int, float, bool, list, tuple)):
        return {k: _plain(v) for k, v in vars(obj).items() if not k.startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _unalias(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = dict(data)
    for alias, key in ALIASES.get(cls, {}).items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if key in out and out[key] != value:
            raise ConfigError(f"config keys {where + alias!r} ({value!r}) and {where + key!r} ({out[key]!r}) name one setting "
                              "and disagree; keep one")
        out[key] = value
    return out


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    data = _unalias(cls, data, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {where + unknown[0]!r}; known keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = {"patch": PatchConfig, "bucket": BucketConfig, "init_sync": InitSyncConfig, "fp8": BlockFp8}.get(name)
        if sub is not None:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key {where + name!r} must be a mapping")
            if sub is InitSyncConfig and cls is BucketConfig:
                value = {"enabled": False, **value}
            kwargs[name] = _build(sub, value, f"{where}{name}.")
        else:
            kwargs[name] = value
    return cls(**kwargs)
