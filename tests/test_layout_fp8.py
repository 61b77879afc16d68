"""The runtime map over block-fp8 layers, without an engine (tests/test_vllm_fp8.py runs vLLM).

A small model loads and processes its weights as vLLM's block-fp8 linear layers do: a fused
q/k/v weight held as float8_e4m3fn [N, K] with its fp32 ``weight_scale_inv`` [N/bn, K/bk]
stacked the same way, a plain bf16 norm beside it. Its post-load processing either re-lays
the weight bytes out in tiles and keeps the scales (what the issue describes the AMX prepack of vLLM's CPU
kernel is: a permutation), or computes from them (a requantisation): the map must compose
the first and reload the second, never write where the kernel does not read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from protocol.config import load_config
from protocol.errors import ConfigError, MetadataMismatchError
from protocol.quant import FP8, BlockFp8, Fp8Format, quantize
from protocol.state import Placed
from protocol.wire.dtypes import bit_view
from receiver.held.fp8 import declare_fp8, fp8_format, with_fp8, with_scales
from receiver.held.kinds import How, Rules
from receiver.held.layout import _fp8_bits, _probe, derive_layout, landing_dtypes
from receiver.held.permute import discover

BLOCK = (4, 4)
HIDDEN, KV = 8, 4  # q 8 rows, k and v 4 each: qkv [16, 8], blocks of 4 x 4


def tiles(w: torch.Tensor) -> torch.Tensor:
    """Rows regrouped in pairs, column-major within a pair (a byte re-layout, same shape)."""
    rows, cols = w.shape
    return w.reshape(rows // 2, 2, cols).transpose(1, 2).contiguous().view(rows, cols)


def untiles(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(rows // 2, cols, 2).transpose(1, 2).contiguous().view(rows, cols)


class Fp8Method:
    """Block-fp8 linear processing: ``prepack`` re-lays the bytes out (as a new parameter,
    like vLLM's ``replace_parameter``), ``requant`` computes new scales from the old."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.mode == "prepack":
            layer.weight = nn.Parameter(tiles(layer.weight.data), requires_grad=False)
        elif self.mode == "requant":
            layer.weight_scale_inv = nn.Parameter(layer.weight_scale_inv.data * 2, requires_grad=False)


class QKV(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        rows = HIDDEN + 2 * KV
        self.weight = nn.Parameter(torch.zeros(rows, HIDDEN, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.zeros(rows // BLOCK[0], HIDDEN // BLOCK[1]), requires_grad=False)
        self.quant_method = Fp8Method(mode)


class Model(nn.Module):
    """One fp8 qkv layer and a bf16 norm; ``load_weights`` stacks q, k and v (weights and
    scales alike) as vLLM's QKVParallelLinear does."""

    def __init__(self, mode: str = "prepack") -> None:
        super().__init__()
        self.qkv = QKV(mode)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.lenient = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rows = {"q": (0, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN + KV, KV)}
        for name, t in weights:
            if name == "norm.weight":
                self.norm.weight.data.copy_(t)
                continue
            part, _, what = name.removeprefix("attn.").partition("_proj.")
            if part not in rows and self.lenient:  # a loader that skips names it has no parameter for, as many do
                continue
            start, size = rows[part]
            if what == "weight":
                self.qkv.weight.data.narrow(0, start, size).copy_(t)
            elif what == "weight_scale_inv":
                self.qkv.weight_scale_inv.data.narrow(0, start // BLOCK[0], size // BLOCK[0]).copy_(t)
            else:
                raise KeyError(name)

    def process(self) -> None:
        self.qkv.quant_method.process_weights_after_loading(self.qkv)


RULES = Rules("fp8-test", permuting={"Fp8Method"})
TRAINER = [("attn.q_proj.weight", (HIDDEN, HIDDEN), torch.bfloat16), ("attn.k_proj.weight", (KV, HIDDEN), torch.bfloat16),
           ("attn.v_proj.weight", (KV, HIDDEN), torch.bfloat16), ("norm.weight", (HIDDEN,), torch.bfloat16)]
FMT = Fp8Format(BLOCK, "fp32")


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A block-fp8 checkpoint of random weights, as ``quantize`` makes it."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape, _ in TRAINER:
        w = torch.randn(shape, generator=gen)
        if name == "norm.weight":
            out[name] = w.to(torch.bfloat16)
        else:
            out[name], out[name + "_scale_inv"] = quantize(w, BlockFp8(block=BLOCK))
    return out


def loaded(mode: str, state: dict[str, torch.Tensor]) -> Model:
    model = Model(mode)
    model.load_weights(state.items())
    model.process()
    return model


def test_fp8_probe_bytes_are_finite_never_negative_zero_and_varied() -> None:
    bits = _fp8_bits((64, 64), torch.Generator().manual_seed(1))
    assert bits.dtype == torch.uint8
    assert not bool(((bits == 0x7F) | (bits == 0xFF) | (bits == 0x80)).any())  # e4m3fn's NaNs, negative zero
    assert len(bits.unique()) > 200  # two probes tell a copy from a transform
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        probe = _probe([("w", (64, 64), dtype)], 1)["w"]
        assert probe.dtype == dtype and bool(torch.isfinite(probe.float()).all())
    first, second = (_probe([("w", (64, 64), FP8)], seed)["w"] for seed in (1, 2))
    assert bool((first.view(torch.uint8) != second.view(torch.uint8)).float().mean() > 0.9)


def test_discover_finds_an_fp8_byte_relayout_and_refuses_a_computation() -> None:
    w = torch.zeros(16, 8, dtype=FP8)
    s = torch.zeros(4, 2)
    found = discover({"w": w, "s": s}, lambda feed: {"w": tiles(feed["w"]), "s": feed["s"]})
    assert found is not None and found["s"].identity and not found["w"].identity
    x = torch.randint(0, 0x7E, (16, 8), dtype=torch.uint8).view(FP8)
    moved = tiles(x).view(torch.uint8).reshape(-1)
    assert torch.equal(moved[found["w"].index(x.numel())], x.view(torch.uint8).reshape(-1))
    assert discover({"w": w}, lambda feed: {"w": (feed["w"].float() * 2).to(FP8)}) is None  # computes
    assert discover({"w": w}, lambda feed: {"w": feed["w"].float()}) is None  # changes the dtype


def test_declare_fp8_names_what_lands_in_fp8_with_its_scales() -> None:
    model = Model()
    declared = declare_fp8(model, list(TRAINER), FMT, RULES)
    assert declared == [
        ("attn.q_proj.weight", (HIDDEN, HIDDEN), FP8), ("attn.q_proj.weight_scale_inv", (2, 2), torch.float32),
        ("attn.k_proj.weight", (KV, HIDDEN), FP8), ("attn.k_proj.weight_scale_inv", (1, 2), torch.float32),
        ("attn.v_proj.weight", (KV, HIDDEN), FP8), ("attn.v_proj.weight_scale_inv", (1, 2), torch.float32),
        ("norm.weight", (HIDDEN,), torch.bfloat16),
    ]
    assert landing_dtypes(model, TRAINER, RULES)["norm.weight"] == torch.bfloat16
    names = with_scales({"trainer.q": "attn.q_proj.weight", "trainer.n": "norm.weight"}, [d[0] for d in declared])
    assert names["trainer.q_scale_inv"] == "attn.q_proj.weight_scale_inv" and "trainer.n_scale_inv" not in names
    # a trainer that sends an fp8 checkpoint itself: its scales are taken, after their weights, checked
    sent = [(k, tuple(t.shape), t.dtype) for k, t in checkpoint(0).items()]
    assert declare_fp8(model, sent, FMT, RULES) == declared
    with pytest.raises(MetadataMismatchError, match="blocks of"):  # the trainer's scales are of 4x4 blocks, not 8x8
        declare_fp8(model, sent, Fp8Format((8, 8), "fp32"), RULES)
    bad = [(k, (3, 3) if k.endswith("_scale_inv") else s, d) for k, s, d in sent]
    with pytest.raises(MetadataMismatchError, match="refused"):  # the engine's own loader refuses them first
        declare_fp8(model, bad, FMT, RULES)
    odd = [*TRAINER, ("norm.weight_scale_inv", (1, 1), torch.float32)]
    with pytest.raises(MetadataMismatchError, match="refused"):
        declare_fp8(model, odd, FMT, RULES)
    model.lenient = True
    with pytest.raises(MetadataMismatchError, match=r"does not hold 'norm\.weight' in fp8"):
        declare_fp8(model, odd, FMT, RULES)


def put(target: torch.Tensor | Placed, flat: torch.Tensor, whole: torch.Tensor) -> None:
    """Elements ``flat`` of checkpoint tensor ``whole`` into a map entry, bit for bit."""
    values = whole.reshape(-1)[flat]
    if isinstance(target, Placed):
        target.write(flat, values)
    else:  # a view of one parameter (nothing moved): written as bits, as the receiver writes
        bit_view(target).view(-1)[flat] = bit_view(values)


@pytest.mark.parametrize("mode", ["prepack", "none"])
def test_a_permuting_fp8_layer_is_written_where_its_kernel_reads(mode: str) -> None:
    """Bootstrapped, then patched element by element: the processed layer holds exactly what
    the engine would hold had it loaded and processed the new checkpoint itself."""
    start, final = checkpoint(0), checkpoint(1)
    model = loaded(mode, start)
    declared = declare_fp8(model, list(TRAINER), FMT, RULES)
    layout = derive_layout(model, declared, RULES)
    kind = layout.kinds[model.qkv]
    assert kind.how is How.PERMUTED and kind.permutations is not None
    assert kind.permutations["weight"].identity is (mode == "none") and kind.permutations["weight_scale_inv"].identity
    for key, t in start.items():  # the bootstrap: every element
        put(layout.tensors[key], torch.arange(t.numel()), t)
    for key, t in final.items():  # a patch: the elements whose bits changed, by checkpoint index
        put(layout.tensors[key], (bit_view(t) != bit_view(start[key])).reshape(-1).nonzero().view(-1), t)
    want = loaded(mode, final)
    assert torch.equal(model.qkv.weight.view(torch.uint8), want.qkv.weight.view(torch.uint8))
    assert torch.equal(model.qkv.weight_scale_inv, want.qkv.weight_scale_inv)
    assert torch.equal(model.norm.weight, want.norm.weight)


def test_a_computing_fp8_layer_is_reloaded_never_guessed() -> None:
    model = loaded("requant", checkpoint(0))
    layout = derive_layout(model, declare_fp8(model, list(TRAINER), FMT, RULES), RULES)
    kind = layout.kinds[model.qkv]
    assert kind.how is How.RELOAD and "computes" in kind.reason
    assert set(layout.reloads.mirrors) == {k for k, _, _ in declare_fp8(copy.deepcopy(model), list(TRAINER), FMT, RULES)} - {"norm.weight"}


def test_the_engine_format_reaches_the_receivers_config() -> None:
    assert with_fp8(None, None) is None
    config = with_fp8({"type": "patch"}, fp8_format([64, 128], "ue8m0"))
    assert load_config(config).fp8.format == Fp8Format((64, 128), "ue8m0")
    for block, scale in (([128], "fp32"), ([0, 128], "fp32"), ([128, 128], "e8m0")):
        with pytest.raises(ConfigError):
            fp8_format(block, scale)


def test_vllm_side_reads_the_checkpoint_quantization_config() -> None:
    from types import SimpleNamespace

    from receiver.vllm.rules import VLLMSide

    def side(quant: dict | None) -> VLLMSide:
        return VLLMSide(SimpleNamespace(hf_config=SimpleNamespace(quantization_config=quant), quantization=None if quant is None else "fp8"))

    assert side(None).quant() is None
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "fmt": "e4m3"}
    assert side(block).quant() == Fp8Format((128, 128), "fp32")
    assert side({**block, "scale_fmt": "ue8m0"}).quant() == Fp8Format((128, 128), "ue8m0")
    assert side({"quant_method": "awq", "bits": 4}).quant() is None  # another method: classed (and reloaded) by kinds.py
    with pytest.raises(ConfigError, match="per-tensor"):
        side({"quant_method": "fp8", "activation_scheme": "dynamic"}).quant()


def test_vllm_processed_fp8_parameters_take_checkpoint_tensors_again_inside_loadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's fp8 processing re-registers a layer's weight and scales as plain parameters,
    whose loaders (``ModelWeightParameter.load_column_parallel_weight``...) are gone. Inside
    ``Rules.loadable`` the layer holds its load-time class and attributes again (from vLLM's
    own reload metadata) over the same storage; on leaving, its own parameters are back."""
    pytest.importorskip("vllm")
    import vllm.model_executor.parameter as parameter
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading
    from vllm.model_executor.parameter import ModelWeightParameter
    from vllm.model_executor.utils import replace_parameter

    from receiver.vllm.rules import VLLM

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)  # one rank, no process group
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    calls: list[str] = []

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = ModelWeightParameter(data=torch.zeros(4, 4, dtype=FP8), input_dim=1, output_dim=0, weight_loader=self.load)
            self.register_parameter("weight", weight)

        def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
            calls.append(type(param).__name__)
            param.load_column_parallel_weight(loaded_weight=loaded)  # only vLLM's parameter class has it

    model = nn.Module()
    model.layer = Layer()
    record_metadata_for_reloading(model)
    replace_parameter(model.layer, "weight", model.layer.weight.data)  # what Fp8LinearMethod's processing does
    plain = model.layer.weight
    assert type(plain) is nn.Parameter and not hasattr(plain, "load_column_parallel_weight")
    bytes_ = torch.arange(16, dtype=torch.uint8).view(4, 4).view(FP8)
    with VLLM.loadable(model):
        alias = model.layer.weight
        assert isinstance(alias, ModelWeightParameter) and alias.data_ptr() == plain.data_ptr()
        alias.weight_loader(alias, bytes_)
    assert model.layer.weight is plain and calls == ["ModelWeightParameter"]
    assert torch.equal(plain.view(torch.uint8), bytes_.view(torch.uint8))  # landed where the layer reads


def test_an_engine_side_that_cannot_say_its_fp8_format_is_refused() -> None:
    """An engine holding float8 parameters whose side has no ``quant`` (SGLang's, today) is
    refused when its worker is built: its fp8 weights are never written by a guess. One whose
    side says a format, or that holds no float8 parameter, is taken."""
    from receiver.held.worker import HeldWorker

    class Side:  # the part of an EngineSide the worker reads when it is built
        rules = None

    model = torch.nn.Linear(4, 4, bias=False)
    model.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ConfigError, match="float8 parameters"):
        HeldWorker(model, torch.bfloat16, Side())  # type: ignore[arg-type]

    class Fp8Side(Side):
        def quant(self) -> Fp8Format:
            return Fp8Format((128, 128))

    assert HeldWorker(model, torch.bfloat16, Fp8Side()).quant == Fp8Format((128, 128))  # type: ignore[arg-type]
    assert HeldWorker(torch.nn.Linear(4, 4), torch.bfloat16, Side()).quant is None  # type: ignore[arg-type]
