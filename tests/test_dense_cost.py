"""How a changed tensor travels: ``patch.dense_above`` (protocol/codec/tensorcodec.py DenseCost).

By default ("auto") a tensor travels whole, or its changes plain (raw gaps and values), where
that is estimated to be faster than coding its changes (CPU per change against wire time per
byte at an assumed link speed); a number keeps the old meaning, a fixed share of
changed elements. Every case applies bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from channel import Channel
from models import bits
from test_strategies import handshake, make_pair, messages, patch_cfg

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import DenseCost, PatchOptions, binary_entropy, plain_gap_bytes, value_bits
from protocol.config import PatchConfig, load_config
from protocol.errors import ConfigError
from protocol.wire.framing import Encoding, ValueEncoding

N = 1 << 16


def moved(t: torch.Tensor, share: float, ulps: int, seed: int) -> torch.Tensor:
    """``t`` with ``share`` of its elements moved by +-1..``ulps`` ulp (on the bit pattern)."""
    g = torch.Generator().manual_seed(seed)
    width = {2: torch.int16, 4: torch.int32}[t.element_size()]
    out = t.clone().view(width)
    mask = torch.rand(t.shape, generator=g) < share
    step = torch.randint(1, ulps + 1, t.shape, generator=g) * (torch.randint(0, 2, t.shape, generator=g) * 2 - 1)
    out[mask] += step[mask].to(width)
    return out.view(t.dtype)


async def sync_once(config: dict[str, Any], state: dict[str, torch.Tensor], changes: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bootstrap ``state``, sync ``changes`` as version 1; the entries by key, after
    checking the receiver holds the trainer's bits."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    # each tensor decides for itself here (these are small enough to travel in a group)
    config = {**config, "patch": {"group_numel": 0, **config.get("patch", {})}}
    s, r = make_pair(config)
    ch = Channel()
    await handshake(s, r, state, target, ch)
    for k, v in changes.items():
        state[k].copy_(v)
    start = len(ch.to_receiver.sent)
    await s.sync(state, ch.to_receiver.send, 1)
    assert await r.apply(target, ch.to_receiver.recv) == 1
    assert all(torch.equal(bits(state[k]), bits(target[k])) for k in state)
    (msg,) = messages(ch.to_receiver, start)
    return {r.metadata.keys[k]: e for e in msg.tensors for k in e.covers}


def base_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16_21pct": (torch.randn(N, generator=g) * 0.02).to(torch.bfloat16),
        "bf16_all": (torch.randn(N, generator=g) * 0.02).to(torch.bfloat16),
        "fp32_all": torch.randn(N, generator=g) * 0.02,
    }


async def test_auto_codes_a_21pct_changed_tensor_and_sends_a_fully_changed_one_whole() -> None:
    state = base_state()
    changes = {
        "bf16_21pct": moved(state["bf16_21pct"], 0.21, 3, 1),
        "bf16_all": moved(state["bf16_all"], 1.0, 3, 2),
        "fp32_all": moved(state["fp32_all"], 1.0, 5000, 3),  # AdamW-sized moves at fp32: ~14 bits a change
    }
    by_key = await sync_once(patch_cfg(), state, changes)
    coded = by_key["bf16_21pct"]
    assert coded.encoding is Encoding.ANS_GAPS and 0.2 * N < coded.nnz < 0.22 * N
    assert sum(b.wire_nbytes for b in coded.buffers) < 0.2 * 2 * N  # ~6x smaller than whole
    for key in ("bf16_all", "fp32_all"):
        assert by_key[key].encoding is Encoding.DENSE and by_key[key].nnz == N


async def test_a_slow_link_codes_even_a_fully_changed_bf16_tensor_and_a_fast_one_sends_21pct_whole() -> None:
    state = base_state()
    changes = {"bf16_21pct": moved(state["bf16_21pct"], 0.21, 3, 1), "bf16_all": moved(state["bf16_all"], 1.0, 1, 2)}
    slow = await sync_once(patch_cfg(dense_above={"link_gbps": 0.05}), base_state() | {}, changes)
    assert slow["bf16_all"].encoding is Encoding.ANS_GAPS and slow["bf16_21pct"].encoding is Encoding.ANS_GAPS
    fast = await sync_once(patch_cfg(dense_above={"link_gbps": 100, "ns_per_change": 25}), state, changes)
    assert fast["bf16_21pct"].encoding is Encoding.DENSE and fast["bf16_all"].encoding is Encoding.DENSE


async def test_small_tensors_changed_everywhere_are_coded_in_a_group() -> None:
    """Norm-sized tensors moved everywhere by an ulp go whole on their own (coding each
    would cost its entry's fixed cost for a few hundred bytes); grouped with the layer's
    sparsely changed vectors they are coded with the rest, in one entry."""
    def fresh() -> dict[str, torch.Tensor]:
        norms = {f"norm{i}": torch.ones(256, dtype=torch.bfloat16) * (1 + i / 64) for i in range(16)}
        return norms | {f"bias{i}": torch.zeros(2048, dtype=torch.bfloat16) + i for i in range(32)}

    base = fresh()
    changes = {k: moved(t, 1.0 if k.startswith("norm") else 0.02, 1, i) for i, (k, t) in enumerate(base.items())}
    alone = await sync_once(patch_cfg(), fresh(), changes)
    assert all(alone[f"norm{i}"].encoding is Encoding.DENSE for i in range(16))
    grouped = await sync_once(patch_cfg(group_numel=1 << 16), fresh(), changes)
    (entry,) = set(grouped.values())
    assert len(entry.group) == 48 and entry.encoding is Encoding.ANS_GAPS
    whole = sum(t.numel() * 2 for t in base.values())
    assert sum(b.wire_nbytes for b in entry.buffers) < 0.2 * whole


@pytest.mark.parametrize("share,dense", [(0.2, False), (0.3, True), (1.0, True)])
async def test_a_number_is_a_fixed_share(share: float, dense: bool) -> None:
    state = {"t": torch.zeros(N, dtype=torch.bfloat16)}
    changed = moved(state["t"], share, 1, 4)
    by_key = await sync_once(patch_cfg(dense_above=0.25), state, {"t": changed})
    assert (by_key["t"].encoding is Encoding.DENSE) is dense


def test_the_cost_model() -> None:
    cost = DenseCost()
    # bf16: the cut-off falls as values need more bits, and as the link gets faster
    cuts = [cost.share_above(2, b) for b in (0.0, 2.0, 8.0, 17.0)]
    assert cuts == sorted(cuts, reverse=True) and 0.25 < cuts[-1] < cuts[0] < 1.0
    assert DenseCost(link_gbps=10).share_above(2, 2.0) < 0.15 < cost.share_above(2, 2.0)
    assert DenseCost(link_gbps=0.05).share_above(2, 2.0) > 1.0  # never: coding always wins
    assert cost.share_above(4, 2.0) > 1.0 and cost.share_above(4, 14.0) < 1.0
    assert cost.dense_wins(N, N, 2, 1.0) and not cost.dense_wins(N // 5, N, 2, 2.0)
    assert binary_entropy(0.5) == 1.0 and binary_entropy(0.0) == binary_entropy(1.0) == 0.0
    options = PatchOptions()
    assert options.dense_candidate(2) <= options.surely_dense(2)
    assert not options.goes_dense(N // 5, N, 2, None) and options.goes_dense(N, N, 2, None)


def test_plain_changes_win_on_a_fast_link_only() -> None:
    n = 1 << 20
    slow, fast = DenseCost(), DenseCost(link_gbps=10)
    for share in (0.01, 0.03, 0.15):  # a real step's values move a few ulps (value_bits ~2-3)
        nnz = int(share * n)
        assert not slow.plain_wins(nnz, n, 2, 2.5) and fast.plain_wins(nnz, n, 2, 2.5)
    # values that moved far cost the coder more bits than a plain value's own 16
    assert slow.plain_wins(n // 10, n, 2, 17.0)
    assert plain_gap_bytes(n // 5, n) == 1 and plain_gap_bytes(n // 100, n) == 2 and plain_gap_bytes(10, 1 << 40) == 8
    # a whole tensor is weighed against the cheaper of the two
    assert fast.dense_wins(n // 3, n, 2, 2.5) and not fast.dense_wins(n // 20, n, 2, 2.5)
    assert fast.plain_ns(n // 20, n, 2) < fast.coded_ns(n // 20, n, 2.5)


@pytest.mark.parametrize("link,plain", [(1, False), (4, True)])
async def test_the_link_decides_between_plain_and_coded_changes(link: float, plain: bool) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"t": (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16)}
    changed = moved(state["t"], 0.1, 1, 5)  # ~26k changes of one ulp
    by_key = await sync_once(patch_cfg(dense_above={"link_gbps": link}), state, {"t": changed})
    entry = by_key["t"]
    if plain:  # uncompressed too: the CPU zstd costs is what plain changes save
        assert (entry.encoding, entry.values) == (Encoding.GAPS, ValueEncoding.RAW)
        assert all(b.codec == Codec.NONE for b in entry.buffers)
    else:
        assert (entry.encoding, entry.values) == (Encoding.ANS_GAPS, ValueEncoding.ULP)


def test_value_bits_estimates_the_value_coder() -> None:
    assert value_bits(torch.ones(5000, dtype=torch.int64)) == pytest.approx(0.0)
    assert value_bits(torch.tensor([1, -1] * 2000)) == pytest.approx(1.0, abs=0.01)
    wide = value_bits(torch.randint(-(1 << 13), 1 << 13, (100_000,)))
    assert 12.5 < wide < 15.5
    assert value_bits(torch.zeros(0, dtype=torch.int64)) == 0.0
    # 64-bit integers' differences wrap: the estimate stays finite and wide, never an error
    wrapped = value_bits(torch.tensor([(1 << 63) - 1, -(1 << 63), 8625564197744295888, -1] * 100))
    assert 32.0 < wrapped < 66.0


@pytest.mark.parametrize("value", ["auto", 0, 0.25, 1, {"link_gbps": 10}, {"ns_per_change": 0}, {"link_gbps": 1, "ns_per_change": 30.5},
                                   {"plain_ns_per_change": 4}, {"link_gbps": 2.5, "plain_ns_per_change": 0}])
def test_config_accepts(value: Any) -> None:
    config = load_config({"type": "patch", "patch": {"dense_above": value}})
    rule = config.patch.options().dense_above
    if isinstance(value, dict):
        defaults = {"link_gbps": 1.0, "ns_per_change": 25.0, "plain_ns_per_change": 12.0}
        given = {name: float(value.get(name, default)) for name, default in defaults.items()}
        assert rule == DenseCost(**given)
    elif value == "auto":
        assert rule == DenseCost()
    else:
        assert rule == value


@pytest.mark.parametrize("value", ["fast", 1.5, -0.1, True, None, [0.5], {"link_gbps": 0}, {"link_gbps": "1"},
                                   {"ns_per_change": -1}, {"gbps": 1}, {"link_gbps": float("nan")}, {"link_gbps": "fast"},
                                   {"plain_ns_per_change": -1}, {"plain_ns_per_change": "4"}])
def test_config_refuses(value: Any) -> None:
    with pytest.raises(ConfigError, match="dense_above"):
        load_config({"type": "patch", "patch": {"dense_above": value}})


def test_default_is_auto() -> None:
    assert PatchConfig().dense_above == "auto" and PatchConfig().options().dense_above == DenseCost()


# -- the receiver's fused paths (tensorcodec.positions_of_gaps, kernels.gather_add) ------------
def test_positions_of_gaps_matches_the_reference_and_refuses_bad_gaps() -> None:
    from protocol.codec.tensorcodec import positions_of_gaps
    from protocol.errors import ProtocolError

    gaps = torch.tensor([0, 3, 0, 7, 2], dtype=torch.int64)
    reference = torch.cumsum(gaps + 1, 0) - 1
    assert torch.equal(positions_of_gaps(gaps.clone(), 17), reference)
    with pytest.raises(ProtocolError):
        positions_of_gaps(gaps.clone(), 16)  # the last position is 16
    assert positions_of_gaps(torch.zeros(0, dtype=torch.int64), 4).numel() == 0
    for bad, numel in (([0, -1], 8), ([8], 8), ([4, 3], 8), ([0, 1 << 62], (1 << 62) + 1)):
        with pytest.raises(ProtocolError):
            positions_of_gaps(torch.tensor(bad, dtype=torch.int64), numel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_gather_add_takes_wide_differences_and_wraps_like_the_encoder(dtype: torch.dtype) -> None:
    from protocol.codec import entropy
    from receiver.apply import kernels

    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(width)
    old_bits = torch.tensor([info.max, info.min, 0, 5, -7], dtype=width)
    new_bits = torch.tensor([info.min, info.max, -1, 6, 100], dtype=width)
    target = old_bits.view(dtype).clone()
    flat = torch.arange(5)
    diffs = entropy.ulp_differences(new_bits.view(dtype), old_bits.view(dtype))  # int64, wrapped at the width
    assert diffs.dtype == torch.int64
    out = kernels.gather_add(target, flat, diffs)
    assert torch.equal(out.view(width), new_bits)
    assert torch.equal(entropy.apply_differences(target, diffs).view(width), new_bits)
