"""The runtime map recorded from a model's own load_weights (receiver/held/layout.py).

These models load like vLLM's layers do (fused q/k/v and gate/up rows, a padded
vocabulary, a column slice as tensor parallelism takes it), written here so that the
map's arithmetic is checked element by element without starting an engine; tests/
test_vllm.py runs the same code in real vLLM workers.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from protocol.errors import ConfigError, MetadataMismatchError, PlacementError
from protocol.state import Placed
from receiver.held.kinds import How
from receiver.held.layout import MappedTensor, derive_layout
from receiver.vllm.rules import VLLM, vouch

Q, KV, H, INTER, V, VPAD = 8, 4, 6, 10, 7, 8  # query rows, key/value rows, hidden, intermediate, vocab (padded)


class FusedModel(nn.Module):
    """q/k/v fused into qkv, gate/up into gate_up, vocab padded, and (``rank`` of 2) the
    down projection split by columns as a row-parallel layer is."""

    def __init__(self, rank: int | None = None, transform: str = "") -> None:
        super().__init__()
        self.rank, self.transform = rank, transform
        self.qkv = nn.Parameter(torch.zeros(Q + 2 * KV, H, dtype=torch.bfloat16), requires_grad=False)
        self.gate_up = nn.Parameter(torch.zeros(2 * INTER, H, dtype=torch.bfloat16), requires_grad=False)
        cols = H if rank is None else H // 2
        self.down = nn.Parameter(torch.zeros(H, cols, dtype=torch.bfloat16), requires_grad=False)
        self.embed = nn.Parameter(torch.zeros(VPAD, H, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        rows = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV), "gate": (0, INTER), "up": (INTER, INTER)}
        for name, w in weights:
            if name in ("q", "k", "v"):
                start, n = rows[name]
                if self.transform == "scale" and name == "k":
                    w = w * 2  # a transform: the copy's source is not the checkpoint tensor
                self.qkv.data.narrow(0, start, n).copy_(w)
            elif name in ("gate", "up"):
                start, n = rows[name]
                self.gate_up.data.narrow(0, start, n).copy_(w)
            elif name == "down":
                if self.rank is not None:
                    w = w.narrow(1, self.rank * (H // 2), H // 2)
                self.down.data.copy_(w)
                if self.transform == "inplace":
                    self.down.data.mul_(-1)  # after the copy: the values no longer equal the source
            elif name == "embed":
                self.embed.data[:V].copy_(w)
                self.embed.data[V:].fill_(0)
            elif name == "lm_head":
                pass  # tied: the engine keeps it once, as embed
            else:
                raise KeyError(name)


META = [
    ("q", (Q, H)), ("k", (KV, H)), ("v", (KV, H)), ("gate", (INTER, H)), ("up", (INTER, H)),
    ("down", (H, H)), ("embed", (V, H)), ("lm_head", (V, H)),
]


def metadata() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, s, torch.bfloat16) for k, s in META]


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in META}


def load_reference(rank: int | None, weights: dict[str, torch.Tensor]) -> FusedModel:
    ref = FusedModel(rank)
    ref.load_weights(list(weights.items()))
    return ref


def write_whole(tensor: torch.Tensor | Placed, values: torch.Tensor) -> None:
    if isinstance(tensor, Placed):
        tensor.assign(values)
    else:
        tensor.copy_(values)


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_map_places_every_element_as_load_weights_does(rank: int | None) -> None:
    model = FusedModel(rank)
    layout = derive_layout(model, metadata(), VLLM)
    weights = checkpoint(3)
    for key, tensor in layout.tensors.items():
        write_whole(tensor, weights[key])
    ref = load_reference(rank, weights)
    for name in ("qkv", "gate_up", "down", "embed"):
        assert torch.equal(getattr(model, name)[: V if name == "embed" else None], getattr(ref, name)[: V if name == "embed" else None]), name
    assert layout.unmapped == ["lm_head"]
    # Whole single copies are plain views of the parameter; a column slice is mapped.
    assert isinstance(layout.tensors["q"], torch.Tensor) and layout.tensors["q"].data_ptr() == model.qkv.data_ptr()
    assert isinstance(layout.tensors["down"], MappedTensor if rank is not None else torch.Tensor)


@pytest.mark.parametrize("rank", [None, 1])
def test_sparse_writes_and_reads_go_through_the_map(rank: int | None) -> None:
    model = FusedModel(rank)
    layout = derive_layout(model, metadata(), VLLM)
    base, new = checkpoint(4), checkpoint(5)
    for key, tensor in layout.tensors.items():
        write_whole(tensor, base[key])
    g = torch.Generator().manual_seed(6)
    expected = {k: v.clone() for k, v in base.items()}
    for key, tensor in layout.tensors.items():
        flat = torch.randperm(base[key].numel(), generator=g)[: base[key].numel() // 3].sort().values
        expected[key].view(-1)[flat] = new[key].view(-1)[flat]
        if isinstance(tensor, Placed):
            if tensor.held == tensor.numel():
                assert torch.equal(tensor.read(flat), base[key].view(-1)[flat])
            tensor.write(flat, new[key].view(-1)[flat])
        else:
            tensor.view(-1)[flat] = new[key].view(-1)[flat]
    ref = load_reference(rank, expected)
    assert torch.equal(model.qkv, ref.qkv) and torch.equal(model.gate_up, ref.gate_up) and torch.equal(model.down, ref.down)
    down = layout.tensors["down"]
    if isinstance(down, MappedTensor):  # half the columns live on the other rank
        assert down.held == H * H // 2 and down.materialize() is None
        flat = torch.arange(H * H)
        held_cols = (flat % H >= H // 2) if rank == 1 else (flat % H < H // 2)
        assert torch.equal(down.read(flat)[held_cols], expected["down"].view(-1)[held_cols])


@pytest.mark.parametrize("transform, culprit", [("scale", "'k'"), ("inplace", "'down'")])
def test_a_loader_that_transforms_a_tensor_gets_its_layer_reloaded_not_mapped(transform: str, culprit: str) -> None:
    """A loader that transforms values before the copy (``scale``) or after it
    (``inplace``) is not written through a guess: its layer (here the whole model, whose
    parameters sit on one module) is RELOAD, named with the tensor, and every tensor it
    loads is kept whole as a plain host copy, all handed over together."""
    model = FusedModel(transform=transform)
    layout = derive_layout(model, metadata(), VLLM)
    (layer, kind), = layout.reloads.layers.items()
    assert layer is model and kind.how is How.RELOAD and culprit in kind.reason, kind
    loaded = {"q", "k", "v", "gate", "up", "down", "embed"}  # lm_head is tied: load_weights skips it
    assert set(layout.reloads.mirrors) == loaded
    for key in loaded:
        mirror = layout.tensors[key]
        assert mirror is layout.reloads.mirrors[key] and isinstance(mirror, torch.Tensor) and mirror.device.type == "cpu"
        assert tuple(mirror.shape) == dict(META)[key] and not layout.segments.get(key)
    assert set(layout.reloads.weights_for(["q"])) == loaded  # one changed tensor reloads its whole layer
    assert layout.reloads.weights_for(["lm_head"]) == {}
    assert layout.unmapped == ["lm_head"]


def test_a_name_the_loader_does_not_know_is_a_metadata_mismatch() -> None:
    with pytest.raises(MetadataMismatchError, match="value_head"):
        derive_layout(FusedModel(), [*metadata(), ("value_head", (1, H), torch.bfloat16)], VLLM)
    assert issubclass(PlacementError, ConfigError)


def test_importing_weightsync_loads_no_jit_compiler() -> None:
    """vLLM's CPU worker dies at start when llvmlite was imported first, and it re-imports
    the user's main script: importing weightsync must not import numba."""
    code = (
        "import sys; import protocol, sender, receiver; from sender import Sender; from receiver import Receiver; "
        "import receiver.vllm, receiver.control.service, protocol.net.server; "
        "bad = [m for m in ('numba', 'llvmlite') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class PackOnLoad:
    """Post-load processing as vLLM's CPU build does it: the kernel reads a packed copy of
    the weight, and the parameter is emptied (``keep``: it stays, as an embedding's does)."""

    def __init__(self, keep: bool = False, in_place: bool = False) -> None:
        self.keep, self.in_place = keep, in_place

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.in_place:
            layer.weight.data = layer.weight.data.clone()  # rewrites the loaded tensor: refused
        layer.packed = layer.weight.detach().t().contiguous()
        if not self.keep:
            layer.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)


vouch("PackOnLoad")  # re-runnable over the loaded weight, as vLLM's unquantized linear method is


class Packed(nn.Module):
    def __init__(self, rows: int, keep: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, H, dtype=torch.bfloat16), requires_grad=False)
        self.quant_method = PackOnLoad(keep)


class PackedModel(nn.Module):
    """q/k/v fused into a re-packed layer; an embedding that keeps its weight, tied to a
    head that is a second layer over the same parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.embed, self.head = Packed(Q + 2 * KV), Packed(VPAD, keep=True), Packed(VPAD, keep=True)
        self.head.weight = self.embed.weight

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        rows = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}
        for name, w in weights:
            if name == "embed":
                self.embed.weight.data[:V].copy_(w)
            else:
                self.qkv.weight.data.narrow(0, *rows[name]).copy_(w)


PACKED_META = [("q", (Q, H)), ("k", (KV, H)), ("v", (KV, H)), ("embed", (V, H))]


def packed_engine(weights: dict[str, torch.Tensor]) -> tuple[PackedModel, Any]:
    """Loaded, then processed as vLLM's loader does; qkv's loaded weight kept as its shadow
    (what receiver/held/layout.py rebuilds from vLLM's reload metadata)."""
    model = PackedModel()
    layout = derive_layout(model, [(k, s, torch.bfloat16) for k, s in PACKED_META], VLLM)
    for key, tensor in layout.tensors.items():
        write_whole(tensor, weights[key])
    layout.shadows[model.qkv] = {"weight": model.qkv.weight}
    assert layout.repack([model.qkv, model.embed]) == 2
    model.head.quant_method.process_weights_after_loading(model.head)
    return model, layout


def sparse_version(weights: dict[str, torch.Tensor], seed: int) -> list[Any]:
    from receiver.apply.commit import StagedUpdate

    g = torch.Generator().manual_seed(seed)
    updates = []
    for ordinal, (key, shape) in enumerate(PACKED_META):
        n = math.prod(shape)
        flat = torch.randperm(n, generator=g)[: n // 5].sort().values
        values = torch.randn(flat.numel(), generator=g).to(torch.bfloat16)
        weights[key].view(-1)[flat] = values
        updates.append(StagedUpdate(ordinal, flat, values))
    return updates


def test_layers_prepacked_ahead_equal_an_inline_repack_and_touch_nothing_until_installed() -> None:
    """Layout.prepack processes copies while a version is staged; after the commit,
    install swaps them in. Two versions in a row (the second commits into the copies the
    first installed), against the same versions committed and re-packed inline. The
    updates the copies hold are not committed again: the installed copies must carry them."""
    from receiver.apply.commit import commit

    weights = checkpoint(7)
    base = {k: weights[k] for k, _ in PACKED_META}
    ahead_model, ahead_layout = packed_engine(base)
    inline_model, inline_layout = packed_engine(base)
    expected = {k: v.clone() for k, v in base.items()}
    keys = [k for k, _ in PACKED_META]
    for seed in (8, 9):
        updates = sparse_version(expected, seed)
        layers = ahead_layout.layers_of(keys)
        before = {name: getattr(ahead_model, name).packed.clone() for name in ("qkv", "embed", "head")}
        prepack = ahead_layout.prepack(layers, [(keys[u.ordinal], u) for u in updates])
        assert set(prepack.layers) == {ahead_model.qkv, ahead_model.embed, ahead_model.head}
        for name, packed in before.items():  # nothing the model runs on moved
            assert torch.equal(getattr(ahead_model, name).packed, packed), name
        # What the engine commits: only updates the copies do not hold entirely (none here).
        assert all(ahead_layout.holds(prepack, k) for k in keys)
        commit([inline_layout.tensors[k] for k in keys], updates, {})
        for layer in layers:
            ahead_layout.install(prepack, layer)
        assert inline_layout.repack(inline_layout.layers_of(keys)) == 3
        assert ahead_model.head.weight is ahead_model.embed.weight  # still tied: one copy for both layers
        reference = PackedModel()
        reference.load_weights(list(expected.items()))
        for name in ("qkv", "embed", "head"):
            want = getattr(reference, name).weight.detach().t().contiguous()
            assert torch.equal(getattr(ahead_model, name).packed, want), (seed, name)
            assert torch.equal(getattr(inline_model, name).packed, want), (seed, name)
        assert ahead_model.qkv.weight.numel() == 0 and torch.equal(ahead_layout.shadows[ahead_model.qkv]["weight"], reference.qkv.weight)
        for key in keys:  # the map reads through the installed copies
            t = ahead_layout.tensors[key]
            got = t.materialize() if isinstance(t, Placed) else t
            assert torch.equal(got, expected[key]), (seed, key)


def test_prepack_refuses_processing_that_rewrites_the_loaded_weight() -> None:
    model, layout = packed_engine({k: v for k, v in checkpoint(10).items() if k in dict(PACKED_META)})
    model.qkv.quant_method.in_place = True
    with pytest.raises(PlacementError, match="rewrote the loaded weight"):
        layout.prepack([model.qkv], [])


def test_prepack_leaves_out_a_layer_whose_parameter_a_module_outside_it_shares() -> None:
    """embed's weight is also head's: copying it for embed alone would split the tie."""
    model, layout = packed_engine({k: v for k, v in checkpoint(11).items() if k in dict(PACKED_META)})
    assert set(layout.prepack([model.embed, model.qkv], []).layers) == {model.qkv}
    assert set(layout.prepack([model.embed, model.head], []).layers) == {model.embed, model.head}


class Quantize:
    """A post-load processing nobody vouched for (as a quantization method's)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.scale = layer.weight.detach().abs().amax()


def test_a_layer_whose_processing_the_map_does_not_know_is_reloaded_and_its_neighbours_mapped() -> None:
    """The qkv layer's method is unknown: q, k and v are kept whole for vLLM's reload and
    the layer is never re-run by the map; the embedding (vouched for) is still mapped."""
    model = PackedModel()
    model.qkv.quant_method = Quantize()  # type: ignore[assignment]
    layout = derive_layout(model, [(k, s, torch.bfloat16) for k, s in PACKED_META], VLLM)
    assert set(layout.reloads.mirrors) == {"q", "k", "v"}
    kind = layout.reloads.layers[model.qkv]
    assert kind.how is How.RELOAD and "Quantize" in kind.reason and kind.name == "Packed/Quantize"
    assert "embed" not in layout.reloads.mirrors and layout.segments["embed"] and layout.kinds[model.embed].how is How.MAPPED
    assert layout.repack([model.qkv]) == 0  # vLLM's reload processes it, not the map


class Rows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, H, dtype=torch.bfloat16), requires_grad=False)


class Reordering(nn.Module):
    """Two layers, each loaded through a transform (its rows re-ordered by a concatenation,
    as Falcon's loader does to query_key_value): a copy from no probe."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Rows(), Rows()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            getattr(self, name).weight.data.copy_(torch.cat([w[2:], w[:2]]))


def test_every_layer_loaded_through_a_transform_is_found_whatever_was_probed_before() -> None:
    """Finding which tensor reaches the first layer loads every candidate again; the second
    layer must still be found (it once was not: the search had left it holding the first
    probe, so it no longer looked moved, and was mapped by guess: wrong in a real engine)."""
    model = Reordering()
    layout = derive_layout(model, [("a", (4, H), torch.bfloat16), ("b", (4, H), torch.bfloat16)], VLLM)
    assert set(layout.reloads.layers) == {model.a, model.b}
    assert "'a'" in layout.reloads.layers[model.a].reason and "'b'" in layout.reloads.layers[model.b].reason
    assert set(layout.reloads.mirrors) == {"a", "b"} and layout.reloads.weights_for(["b"]).keys() == {"b"}
