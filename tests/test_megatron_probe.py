"""Megatron-core models built through Megatron-Bridge in spawned gloo ranks (issue 59 groundwork):
the bridge's export equals the checkpoint, one real training step matches Hugging Face's loss, and
the probe map (codes fed through ``export_hf_weights``) rebuilds every exported tensor after that
step from the ranks' local parameters alone, bit for bit.

Runs in the Megatron venv: ``make megatron-env`` then
``.venv-megatron/bin/python -m pytest -q tests/test_megatron_probe.py``; skipped elsewhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron_env import require_megatron
from tests.megatron_ranks import (
    Feed,
    Layout,
    Tiny,
    free_port,
    hf_loss,
    probe_worker,
    save_tiny_hf,
    scatter_through_maps,
    shifted_export_worker,
)
from tests.ranks import spawn_ranks


def test_spans_fold_into_strided_blocks() -> None:
    """Runs anywhere (no Megatron): the span and block folding the map summary relies on."""
    # a column block of a [4, 6] HF tensor: local [4, 2] lands at columns 2..3 of each row
    local = torch.arange(8)
    hf = torch.tensor([2, 3, 8, 9, 14, 15, 20, 21])
    feed = Feed("w", local, hf)
    assert feed.spans() == [(0, 2, 2), (2, 8, 2), (4, 14, 2), (6, 20, 2)]
    assert feed.blocks() == [(0, 2, 2, 4, 2, 6)]
    assert Feed("w", torch.arange(5), torch.arange(10, 15)).blocks() == [(0, 10, 5, 1, 0, 0)]
    # spans of unequal length do not fold
    assert Feed("w", torch.arange(5), torch.tensor([0, 1, 5, 6, 7])).blocks() == [(0, 0, 2, 1, 0, 0), (2, 5, 3, 1, 0, 0)]


# name: (layout, checkpoint, whether a training step runs). Megatron refuses to train MoE at
# TP > 1 without sequence parallelism, which the local spec's torch norms refuse: "moe-tp2"
# (experts tensor-parallel, ETP = TP = 2) checks the probe map against the loaded weights only.
LAYOUTS = {
    "tp2": (Layout(tp=2), Tiny(), True),
    "pp2": (Layout(pp=2), Tiny(), True),
    "tp2xpp2": (Layout(tp=2, pp=2), Tiny(), True),
    "tied-pp2": (Layout(pp=2), Tiny(tied=True), True),
    "moe-ep2": (Layout(ep=2, dp=2), Tiny(moe=True), True),
    "moe-tp2": (Layout(tp=2), Tiny(moe=True), False),
    "bf16-tp2": (Layout(tp=2, bf16=True), Tiny(), True),
}


@pytest.fixture(scope="module")
def megatron() -> None:
    require_megatron(__file__)


def run(tmp_path: Path, layout: Layout, tiny: Tiny, train: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], torch.Tensor]:
    hf_dir = tmp_path / "hf"
    out = tmp_path / "out"
    out.mkdir()
    checkpoint = save_tiny_hf(hf_dir, tiny)
    tokens = torch.randint(0, tiny.vocab, (1, 17), generator=torch.Generator().manual_seed(1))
    args = (layout.world, free_port(), str(hf_dir), layout, tiny.moe, str(out), tokens, tiny.hidden, train)
    spawn_ranks(probe_worker, layout.world, args, deadline=300)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(layout.world)]
    return checkpoint, results, tokens


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_probe_map_rebuilds_the_export_after_a_training_step(megatron: None, tmp_path: Path, name: str) -> None:
    layout, tiny, train = LAYOUTS[name]
    checkpoint, results, tokens = run(tmp_path, layout, tiny, train)

    dtype = torch.bfloat16 if layout.bf16 else torch.float32  # the bridge exports the parameters' dtype
    checkpoint = {k: v.to(dtype) for k, v in checkpoint.items()}
    for rank, res in enumerate(results):  # the bridge's export of the loaded model is the checkpoint
        assert set(res["loaded"]) == set(checkpoint), rank
        for k, v in checkpoint.items():
            assert torch.equal(res["loaded"][k], v), (rank, k)

    losses = [r["loss"] for r in results if r["loss"] is not None]
    if train:
        reference = hf_loss(str(tmp_path / "hf"), tokens)  # the training step's forward is HF's
        assert len(losses) == layout.world // layout.pp
        for loss in losses:
            assert math.isclose(loss, reference, rel_tol=1e-2 if layout.bf16 else 1e-5), (loss, reference)
    else:
        assert losses == []

    for res in results:  # the descending probe found the same map as the ascending one
        assert res["disagree"] == []
    after = results[0]["after"]
    for res in results:  # every rank's export after the step is the same
        assert all(torch.equal(res["after"][k], after[k]) for k in after)
    changed = [k for k in checkpoint if not torch.equal(after[k], checkpoint[k])]
    assert len(changed) == (len(checkpoint) if train else 0)  # the step moved every tensor: the check below has teeth
    if tiny.tied and layout.pp > 1:  # the last stage's copy of the embedding: kept equal, owned by nobody
        first, last = results[0], results[-1]
        assert torch.equal(first["local"]["0.embedding.word_embeddings.weight"], last["local"]["0.output_layer.weight"])
        assert last["owned"]["0.output_layer.weight"] == []

    shapes = {k: v.shape for k, v in after.items()}
    for hf_name, (values, hits) in scatter_through_maps(results, shapes).items():
        assert int((hits == 0).sum()) == 0, f"{hf_name}: positions no rank's map feeds"
        assert int((hits > 1).sum()) == 0, f"{hf_name}: positions two owners feed"
        assert torch.equal(values.reshape(shapes[hf_name]), after[hf_name]), hf_name

    # the layouts the map found, per kind (what the wire must carry; NOTES-59.md)
    for res in results:
        for local_name, feeds in res["owned"].items():
            # every (local parameter, HF tensor) pair is one strided block (count 1: one span)
            assert all(len(f.blocks()) == 1 for f in feeds), (local_name, [f.blocks() for f in feeds])
            blocks = {f.hf_name.rsplit(".", 2)[-2]: f.blocks() for f in feeds}
            if local_name.endswith("linear_fc1.weight"):  # [gate; up] of this shard: one span each
                assert sorted(blocks) == ["gate_proj", "up_proj"] and all(len(b) == 1 and b[0][3] == 1 for b in blocks.values())
            if local_name.endswith(("linear_fc2.weight", "linear_proj.weight")) and layout.tp == 2:
                (block,) = next(iter(blocks.values()))  # a row-parallel column block: one strided block,
                numel = res["local"][local_name].numel()  # a row of the shard every HF row
                assert block[2] * block[3] == numel and block[4] == block[2] and block[5] == layout.tp * block[2], block
            if local_name.endswith("linear_qkv.weight") and feeds:  # per query group, interleaved
                groups = 2 // layout.tp
                assert sorted(blocks) == ["k_proj", "q_proj", "v_proj"]
                assert all(len(b) == 1 and b[0][3] == groups for b in blocks.values()), blocks


def test_a_shifted_value_is_caught_by_the_second_probe(megatron: None, tmp_path: Path) -> None:
    """One probe alone decodes a shifted tensor without complaint (into the wrong elements); the
    descending probe disagrees on exactly that tensor, on every rank."""
    layout = Layout(tp=2)
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    out.mkdir()
    save_tiny_hf(hf_dir, Tiny())
    shifted = "model.layers.0.post_attention_layernorm.weight"
    spawn_ranks(shifted_export_worker, layout.world, (layout.world, free_port(), str(hf_dir), layout, str(out), shifted), deadline=300)
    for rank in range(layout.world):
        res = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert res["decoded"]
        assert res["disagree"] == [shifted]
