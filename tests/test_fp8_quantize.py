"""The block-fp8 quantizer (``protocol/quant/fp8.py``) against vLLM's own
``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``), byte for byte: the function vLLM
runs is ``torch.compile``d, so the fixed shapes compare against the compiled function (with
the recompile limit raised and a hit made an error, so no case quietly falls back to eager),
and the property test against its eager body (every new size-1 dimension would otherwise
cost a compile of several seconds); which names are quantized against explicit name sets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.opcount import OpCounter
from protocol.errors import ConfigError
from protocol.quant import BlockFp8, quantize, quantize_state, quantized_names, scale_name

Ref = Callable[..., tuple[torch.Tensor, torch.Tensor]]
RAGGED = [(300, 200), (129, 1), (1, 1), (4096, 128), (256, 384)]


@pytest.fixture(scope="module")
def compiled() -> Iterator[Ref]:
    """vLLM's ``per_block_cast_to_fp8`` as vLLM runs it: compiled, every case its own graph."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    import torch._dynamo.config as dynamo

    saved = dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit
    dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = 64, True
    yield deep_gemm.per_block_cast_to_fp8
    dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = saved


@pytest.fixture(scope="module")
def eager() -> Ref:
    """The same function's body run eagerly (what torch.compile wrapped)."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    return deep_gemm.per_block_cast_to_fp8._torchdynamo_orig_callable  # type: ignore[no-any-return]


def weights(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Trainer-like values (std 0.02) with a few outliers, as a layer's weight has."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.02
    x.view(-1)[:: 97] *= 40.0
    return x.to(dtype)


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal bytes and bit-equal scales, shapes and dtypes included."""
    (qa, sa), (qb, sb) = a, b
    return (
        qa.dtype == qb.dtype == torch.float8_e4m3fn
        and qa.shape == qb.shape
        and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
        and sa.dtype == sb.dtype == torch.float32
        and sa.shape == sb.shape
        and torch.equal(sa.view(torch.int32), sb.view(torch.int32))
    )


# -- bit-equal to vLLM ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_equal_to_vllms_compiled_quantizer_on_ragged_shapes(compiled: Ref, dtype: torch.dtype) -> None:
    master = BlockFp8(source="master")  # the input as given, in its own dtype
    for i, shape in enumerate(RAGGED):
        x = weights(shape, dtype, seed=i)
        q, s = quantize(x, master)
        assert same((q, s), compiled(x)), shape
        assert q.shape == shape and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        assert q.is_contiguous()


def test_by_default_the_bf16_cast_is_quantized_and_master_on_request(compiled: Ref) -> None:
    x = weights((300, 200))  # an fp32 master
    assert same(quantize(x), compiled(x.to(torch.bfloat16)))
    assert same(quantize(x, BlockFp8(source="master")), compiled(x))
    differ = (quantize(x)[0].view(torch.uint8) != quantize(x, BlockFp8(source="master"))[0].view(torch.uint8)).sum()
    assert differ > 0  # the two sources are different rollouts' bytes


def test_expert_stacks_have_blocks_per_expert(compiled: Ref) -> None:
    for shape in [(3, 300, 200), (4, 256, 128), (2, 129, 1)]:
        x = weights(shape, torch.bfloat16, seed=shape[1])
        q, s = quantize(x)
        experts = [compiled(x[e]) for e in range(shape[0])]
        assert same((q, s), (torch.stack([e[0] for e in experts]), torch.stack([e[1] for e in experts]))), shape
        assert s.shape == (shape[0], math.ceil(shape[1] / 128), math.ceil(shape[2] / 128))
    # a block never spans two experts: one expert's outlier leaves the others' scales alone
    x = weights((2, 128, 128), torch.bfloat16)
    y = x.clone()
    y[0, 0, 0] = 100.0
    assert torch.equal(quantize(x)[1][1], quantize(y)[1][1]) and not torch.equal(quantize(x)[1][0], quantize(y)[1][0])


def test_tied_weights_quantize_identically(compiled: Ref) -> None:
    w = weights((300, 256), torch.bfloat16)
    state = {"model.embed_tokens.weight": w, "lm_head.weight": w, "model.layers.0.mlp.down_proj.weight": w.t()}
    out = quantize_state(state, BlockFp8(skip=()))  # embeddings and lm_head quantized here, to see the tie
    assert set(out) == {*state, *(scale_name(n) for n in state)}
    tied = (out["model.embed_tokens.weight"], out["model.embed_tokens.weight_scale_inv"])
    assert same(tied, (out["lm_head.weight"], out["lm_head.weight_scale_inv"]))
    assert same(tied, compiled(w))
    assert same((out["model.layers.0.mlp.down_proj.weight"], out["model.layers.0.mlp.down_proj.weight_scale_inv"]), compiled(w.t().contiguous()))


def test_ue8m0_scales_match_vllms_ue8m0_path(compiled: Ref) -> None:
    """vLLM has one: ``per_block_cast_to_fp8(..., use_ue8m0=True)``, what its
    ``requant_weight_ue8m0_inplace`` runs for DeepGEMM on Blackwell."""
    ue8m0 = BlockFp8(scale_format="ue8m0")
    for i, shape in enumerate([(300, 200), (4096, 128), (129, 1)]):
        x = weights(shape, torch.bfloat16, seed=i)
        q, s = quantize(x, ue8m0)
        assert same((q, s), compiled(x, use_ue8m0=True)), shape
        mantissa, _ = torch.frexp(s)
        assert torch.all(mantissa == 0.5)  # powers of two
        assert torch.all(s >= quantize(x)[1])  # rounded up: no element overflows
        assert not same((q, s), quantize(x))


@pytest.mark.parametrize("block", [(64, 64), (128, 64), (32, 256), (1, 128)])
def test_other_block_sizes_match_vllm_with_that_block_size(compiled: Ref, block: tuple[int, int]) -> None:
    x = weights((300, 200), torch.bfloat16, seed=block[0])
    q, s = quantize(x, BlockFp8(block=block))
    assert same((q, s), compiled(x, list(block)))
    assert s.shape == (math.ceil(300 / block[0]), math.ceil(200 / block[1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    experts=st.sampled_from([0, 1, 3]),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (64, 32), (16, 128)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
    scale_format=st.sampled_from(["fp32", "ue8m0"]),
    magnitude=st.sampled_from([0.0, 1e-9, 1e-3, 0.02, 3.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_bit_equal_on_random_shapes(
    eager: Ref, experts: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, scale_format: str, magnitude: float, seed: int
) -> None:
    """Any shape, block, dtype and magnitude (all-zero blocks, blocks under the 1e-4 amax
    floor, fp8 subnormals, large values): equal to vLLM's function, expert by expert."""
    shape = (experts, n, k) if experts else (n, k)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * magnitude).to(dtype)
    mode = BlockFp8(block=block, scale_format=scale_format, source="master")  # type: ignore[arg-type]
    q, s = quantize(x, mode)
    stack = [x[e] for e in range(experts)] if experts else [x]
    expected = [eager(m, list(block), use_ue8m0=scale_format == "ue8m0") for m in stack]
    if experts:
        assert same((q, s), (torch.stack([e[0] for e in expected]), torch.stack([e[1] for e in expected])))
    else:
        assert same((q, s), expected[0])


def test_multiplying_by_the_reciprocal_is_the_rule(eager: Ref) -> None:
    """Dividing by the scale instead rounds some elements to the other fp8 neighbour: only
    the reciprocal's product is vLLM's bytes."""
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    start = time.perf_counter()
    q, s = quantize(x)
    assert same((q, s), eager(x))
    blocks = x.float().reshape(32, 128, 32, 128)
    divided = (blocks / s.reshape(32, 1, 32, 1)).to(torch.float8_e4m3fn).reshape(4096, 4096)
    differ = int((divided.view(torch.uint8) != q.view(torch.uint8)).sum())
    print(f"dividing changes {differ} of {x.numel()} bytes ({time.perf_counter() - start:.2f} s)")
    assert differ > 0


def test_a_fixed_handful_of_ops_whatever_the_number_of_blocks() -> None:
    """One op a step of the formula, none a block: 1 block or 4,096 cost the same; a ragged
    edge adds its pad and the trim's copy; no host sync (a device never waits on the host)."""
    counts = {}
    for shape in [(128, 128), (2048, 1024), (8, 2048, 512), (300, 200), (4, 300, 200)]:
        x = torch.randn(shape)
        with OpCounter() as counter:
            quantize(x)
        ops, syncs = counter.take()
        assert not syncs
        counts[shape] = sum(ops.values())
    aligned, ragged = counts[(128, 128)], counts[(300, 200)]
    assert counts[(2048, 1024)] == counts[(8, 2048, 512)] == aligned <= 10, counts
    assert counts[(4, 300, 200)] == ragged == aligned + 2, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stay_on_the_device_and_quantize_as_on_cpu(eager: Ref) -> None:
    x = weights((300, 200), torch.bfloat16)
    q, s = quantize(x.cuda())
    assert q.device.type == s.device.type == "cuda"
    assert same((q.cpu(), s.cpu()), quantize(x))
    assert same((q.cpu(), s.cpu()), tuple(t.cpu() for t in eager(x.cuda())))  # type: ignore[arg-type]


# -- which names ---------------------------------------------------------------------------------
def qwen3_moe_names(layers: int) -> list[str]:
    """transformers' Qwen3-MoE state names: fused expert stacks, q/k norms, a router."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "mlp.gate.weight", p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


def deepseek_v3_names() -> list[str]:
    """DeepSeek-V3's names: MLA projections and norms, a dense first layer, then routed and
    shared experts with a router and its correction bias."""
    names = ["model.embed_tokens.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        attention = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
        names += [p + f"self_attn.{m}.weight" for m in attention]
        mlp = [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        if i:
            mlp = [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
            mlp += [p + f"mlp.experts.{e}.{m}.weight" for e in range(2) for m in ("gate_proj", "up_proj", "down_proj")]
            mlp += [p + f"mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        names += [*mlp, p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


def test_the_default_skip_list_leaves_what_qwen3_fp8_checkpoints_leave() -> None:
    names = [*qwen3_moe_names(2), "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.shared_expert_gate.weight"]
    assert quantized_names(names) == [
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in (*(f"self_attn.{p}_proj.weight" for p in "qkvo"), "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    ]


def test_the_default_skip_list_leaves_what_deepseek_v3_checkpoints_leave() -> None:
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    expected = [f"model.layers.0.self_attn.{m}.weight" for m in attention]
    expected += [f"model.layers.0.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    expected += [f"model.layers.1.self_attn.{m}.weight" for m in attention]
    expected += [f"model.layers.1.mlp.experts.{e}.{m}.weight" for e in range(2) for m in ("gate_proj", "up_proj", "down_proj")]
    expected += [f"model.layers.1.mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    assert quantized_names(deepseek_v3_names()) == expected


def test_first_and_last_layers_stay_bf16() -> None:
    names = qwen3_moe_names(6)
    layers = {int(n.split(".")[2]) for n in quantized_names(names, BlockFp8(bf16_layers=(1, 2)))}
    assert layers == {1, 2, 3}
    assert {int(n.split(".")[2]) for n in quantized_names(names, BlockFp8(bf16_layers=(0, 3)))} == {0, 1, 2}
    assert quantized_names(names, BlockFp8(bf16_layers=(3, 3))) == []
    # counted from the model's layer count when given, as NeMo-RL counts from num_hidden_layers
    subset = [n for n in names if ".layers.0." in n or ".layers.1." in n]
    assert {int(n.split(".")[2]) for n in quantized_names(subset, BlockFp8(bf16_layers=(0, 1)))} == {0}
    assert {int(n.split(".")[2]) for n in quantized_names(subset, BlockFp8(bf16_layers=(0, 1)), num_layers=6)} == {0, 1}
    gpt2 = ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight", "transformer.h.11.attn.c_attn.weight"]
    assert quantized_names(gpt2, BlockFp8(bf16_layers=(1, 0)), num_layers=12) == gpt2[1:]


def test_skip_and_include_are_settings() -> None:
    names = qwen3_moe_names(1)
    only_attention = BlockFp8(skip=(*BlockFp8().skip, r"\.mlp\."))
    assert quantized_names(names, only_attention) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    assert quantized_names(names, BlockFp8(include=r"weight$")) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    assert scale_name("model.layers.0.mlp.experts.gate_up_proj") == "model.layers.0.mlp.experts.gate_up_proj_scale_inv"
    assert scale_name("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight_scale_inv"


def test_the_state_quantized_as_a_checkpoint_holds_it() -> None:
    state = {n: torch.randn(200, 130) if "proj" in n else torch.ones(130) for n in qwen3_moe_names(1) if "experts" not in n}
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.randn(2, 260, 130)
    out = quantize_state(state)
    chosen = quantized_names(state)
    assert list(out) == [m for n in state for m in ((n, scale_name(n)) if n in chosen else (n,))]
    assert out["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (2, 3, 2)
    assert all(out[n] is state[n] for n in state if n not in chosen)


@pytest.mark.parametrize(
    "kwargs",
    [{"block": (0, 128)}, {"block": (128,)}, {"scale_format": "e8m0"}, {"source": "fp32"}, {"bf16_layers": (-1, 0)}, {"skip": ("[",)}],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="BlockFp8"):
        BlockFp8(**kwargs)  # type: ignore[arg-type]


def test_what_cannot_be_quantized_is_refused_by_name() -> None:
    for bad in (torch.ones(8), torch.ones(2, 3, 4, 5), torch.ones(4, 4, dtype=torch.int32), torch.ones(4, 4).to(torch.float8_e4m3fn)):
        with pytest.raises(ConfigError, match="block fp8 quantizes"):
            quantize(bad)
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*skip"):
        quantize_state({"model.layers.0.mlp.down_proj.weight": torch.ones(8)})
    with pytest.raises(ConfigError, match=r"already holds 'a\.weight_scale_inv'"):
        quantize_state({"a.weight": torch.ones(4, 4), "a.weight_scale_inv": torch.ones(1, 1)})
