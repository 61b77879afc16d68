"""A tiny Megatron model built through Megatron-Bridge in spawned gloo ranks (``make megatron-env``).

The model is a real megatron-core GPTModel (local layer spec, RMSNorm, fusions off) made by the
bridge from a tiny Hugging Face checkpoint saved to a temporary directory, with its weights loaded by
``load_hf_weights``. Workers here run in ranks spawned by tests.ranks.spawn_ranks; each imports
tests/megatron_env.py first. Everything a rank finds is returned through files in ``out_dir``
(``torch.save``), never by assertion in the parent's place: the parent checks them.

Also here: ``train_step`` (one microbatch, forward/backward by hand across pipeline stages, AdamW)
and the probe map (``probe_codes``, ``decode_map``, ``Feed``): where each local element lands in
the bridge's ``export_hf_weights``, found by exporting integer codes (NOTES-59.md, section 4).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """One parallel layout: world = tp * pp * dp, and ep divides dp (EP is carved out of DP)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    vocab_divisible_by: int = 0  # Megatron pads the vocabulary to a multiple of this times tp; 0: the bridge's choice
    sequence_parallel: bool = False  # Megatron refuses to train MoE at TP > 1 without it
    bf16: bool = False  # bf16 parameters (params_dtype and the bf16 flag)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Tiny:
    """A tiny checkpoint. Vocab 250 is no multiple of 128: the bridge's default does not pad it
    (it divides by the largest power of two <= 128 that divides the vocab, here 2); a layout with
    ``vocab_divisible_by=128`` pads it to 256, and the bridge 0.6.2 then exports 256 rows."""

    moe: bool = False
    tied: bool = False  # tie_word_embeddings: no lm_head in the checkpoint
    layers: int = 2
    vocab: int = 250
    hidden: int = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_tiny_hf(directory: Path, tiny: Tiny, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a random tiny Qwen2 (or Qwen3-MoE) checkpoint in fp32; returns the checkpoint's tensors
    as saved (transformers 5 keeps Qwen3-MoE experts fused in memory, ``experts.gate_up_proj``, but
    saves, and the bridge exports, one ``experts.{i}.{gate,up,down}_proj.weight`` per expert)."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tiny.vocab, hidden_size=tiny.hidden, num_hidden_layers=tiny.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tiny.tied, torch_dtype="float32", rms_norm_eps=1e-6,
    )
    config: Any
    if tiny.moe:
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, intermediate_size=128)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make every element distinct
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return load_file(str(Path(directory) / "model.safetensors"))


def init_rank(rank: int, world: int, port: int) -> None:
    """Shims, then a gloo process group for this spawned rank."""
    from tests import megatron_env

    megatron_env.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def build(hf_dir: str, layout: Layout, moe: bool) -> tuple[Any, list[torch.nn.Module]]:
    """The bridge and this rank's model chunks, weights loaded from ``hf_dir``."""
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.expert_model_parallel_size = layout.ep
    provider.sequence_parallel = layout.sequence_parallel
    if layout.vocab_divisible_by:
        provider.make_vocab_size_divisible_by = layout.vocab_divisible_by
        provider.should_pad_vocab = True  # the bridge leaves it off for HF checkpoints
    provider.params_dtype = torch.bfloat16 if layout.bf16 else torch.float32
    provider.bf16 = layout.bf16
    provider.fp16 = False
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.persist_layer_norm = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    if moe:
        provider.moe_token_dispatcher_type = "allgather"  # alltoall builds a torch.cuda.Stream
        provider.moe_grouped_gemm = False
        provider.moe_router_fusion = False
        provider.moe_permute_fusion = False
    provider.transformer_layer_spec = get_gpt_layer_local_spec(
        num_experts=getattr(provider, "num_moe_experts", None), moe_grouped_gemm=False,
        qk_layernorm=bool(getattr(provider, "qk_layernorm", False)), normalization="RMSNorm",
    )
    provider.finalize()
    provider.initialize_model_parallel(seed=0, seed_kwargs={"inference_rng_tracker": True})
    from tests.megatron_env import tensor_cuda_noop

    with tensor_cuda_noop():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.load_hf_weights(model)
    return bridge, model


def export(bridge: Any, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The bridge's own export on this rank (a collective: every rank calls it)."""
    return {name: t.detach().clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}


# ---------------------------------------------------------------------------------------------
# One real optimizer step on CPU. Megatron's pipeline schedules allocate on device="cuda", so this
# is a hand-written one-microbatch forward/backward: gloo send/recv of the activations (forward) and
# of their gradients (backward) between stages, then torch AdamW on this rank's local parameters.


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's convention: True where attention is NOT allowed."""
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def train_step(model: list[torch.nn.Module], tokens: torch.Tensor, hidden: int, lr: float = 1e-2) -> float | None:
    """One forward/backward over ``tokens`` [1, s+1] (predict token t+1 from tokens <= t) and one
    AdamW step; returns the mean loss on the last pipeline stage, None on the others."""
    from megatron.core import parallel_state as ps

    (chunk,) = model  # no virtual pipeline here
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    group = ps.get_pipeline_model_parallel_group()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    received: torch.Tensor | None = None
    if not first:  # activations are [s, b, h] between Megatron stages
        received = torch.empty(seq, 1, hidden, requires_grad=False)
        torch.distributed.recv(received, src=prev_rank, group=group)
        received.requires_grad_(True)
    chunk.set_input_tensor(received)
    out = chunk(inputs, position_ids, causal_mask(seq), labels=labels if last else None)
    loss: float | None = None
    if last:
        mean = out.float().mean()  # out is the per-token loss [b, s]
        mean.backward()
        loss = float(mean.detach())
    else:
        torch.distributed.send(out.detach().contiguous(), dst=next_rank, group=group)
        grad = torch.empty_like(out)
        torch.distributed.recv(grad, src=next_rank, group=group)
        out.backward(grad)
    if received is not None:
        assert received.grad is not None
        torch.distributed.send(received.grad.contiguous(), dst=prev_rank, group=group)
    # Tied embeddings split across stages: the first stage's embedding and the last stage's output
    # layer are two copies of one weight; Megatron's finalize_model_grads all-reduces their grads
    # over the embedding group, and so does this step.
    embedding_group = ps.get_embedding_group(check_initialized=False)
    inner = getattr(chunk, "module", chunk)  # bf16: the GPTModel inside Megatron's Float16Module
    if (
        inner.share_embeddings_and_output_weights
        and embedding_group is not None
        and torch.distributed.get_world_size(embedding_group) > 1
        and torch.distributed.get_rank() in torch.distributed.get_process_group_ranks(embedding_group)
    ):
        shared = inner.shared_embedding_or_output_weight()
        assert shared.grad is not None
        torch.distributed.all_reduce(shared.grad, group=embedding_group)
    params = [p for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# ---------------------------------------------------------------------------------------------
# The probe map: where each local element lands in the bridge's export, found by exporting codes.

CODE_LIMIT = 1 << 24  # every integer up to 2**24 is exact in fp32


def local_params(model: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters in a fixed order, named ``{chunk}.{megatron name}``."""
    return [(f"{i}.{n}", p) for i, chunk in enumerate(model) for n, p in chunk.named_parameters()]


def probe_codes(bridge: Any, model: list[torch.nn.Module], descending: bool = False) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Fill every local element of every rank with a distinct integer code (1 + its global number;
    0 means "fed by nothing"), export through the bridge, restore the weights. Returns the export as
    int64 codes and every rank's first code (rank r owns codes [bases[r], bases[r+1])).

    ``descending``: fill with last + 1 - code instead and map back, so a second probe that agrees
    with the first rules out a bridge that moves values AND shifts them (a +1 on a zero-centred
    norm would decode to the next element in one order and the previous one in the other)."""
    params = local_params(model)
    total = sum(p.numel() for _, p in params)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(sizes, torch.tensor([total]))
    bases = [1]
    for s in sizes:
        bases.append(bases[-1] + int(s))
    if bases[-1] > CODE_LIMIT:
        raise ValueError(f"{bases[-1]} codes do not fit fp32's exact integers")
    rank = torch.distributed.get_rank()
    # fp32 holds every code exactly; a bf16 parameter's storage is swapped for an fp32 one for the
    # probe (p.data = ...), and the original storage put back after it.
    saved = [p.detach().clone() if p.dtype == torch.float32 else p.data for _, p in params]
    with torch.no_grad():
        code = bases[rank]
        for _, p in params:
            if p.dtype != torch.float32:
                p.data = torch.empty(p.shape, dtype=torch.float32)
            numbers = torch.arange(code, code + p.numel(), dtype=torch.float64)
            p.copy_((bases[-1] - numbers if descending else numbers).reshape(p.shape))
            code += p.numel()
    try:
        exported = export(bridge, model)
    finally:
        with torch.no_grad():
            for (_, p), s in zip(params, saved):
                if p.data.dtype != s.dtype:
                    p.data = s
                else:
                    p.copy_(s)
    codes: dict[str, torch.Tensor] = {}
    for name, t in exported.items():
        flat = t.flatten().to(torch.float64)
        as_int = flat.round()
        if not torch.equal(as_int, flat):
            raise ValueError(f"{name}: the bridge transformed probe values (not only moved them)")
        as_codes = as_int.to(torch.int64)
        codes[name] = torch.where(as_codes == 0, 0, bases[-1] - as_codes) if descending else as_codes
    return codes, bases


@dataclass
class Feed:
    """Where one local parameter lands in one HF tensor: flat indices, sorted by local index."""

    hf_name: str
    local_index: torch.Tensor
    hf_index: torch.Tensor

    def spans(self) -> list[tuple[int, int, int]]:
        """Maximal runs (local_start, hf_start, length) where both indices step by one."""
        li, hi = self.local_index, self.hf_index
        breaks = ((li[1:] - li[:-1] != 1) | (hi[1:] - hi[:-1] != 1)).nonzero().flatten() + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), len(li)]
        return [(int(li[a]), int(hi[a]), b - a) for a, b in zip(starts, ends)]

    def blocks(self) -> list[tuple[int, int, int, int, int, int]]:
        """The spans folded into strided blocks (local_start, hf_start, length, count, local_stride,
        hf_stride): consecutive spans of one length whose starts step evenly on both sides."""
        out: list[tuple[int, int, int, int, int, int]] = []
        for ls, hs, n in self.spans():
            if out:
                l0, h0, m, count, lstep, hstep = out[-1]
                if m == n and count == 1:
                    out[-1] = (l0, h0, m, 2, ls - l0, hs - h0)
                    continue
                if m == n and ls - (l0 + (count - 1) * lstep) == lstep and hs - (h0 + (count - 1) * hstep) == hstep:
                    out[-1] = (l0, h0, m, count + 1, lstep, hstep)
                    continue
            out.append((ls, hs, n, 1, 0, 0))
        return out


def decode_map(codes: dict[str, torch.Tensor], bases: list[int], rank: int, model: list[torch.nn.Module]) -> dict[str, list[Feed]]:
    """This rank's map: per local parameter, the HF tensors it feeds and where, from its own codes."""
    params = local_params(model)
    starts = [bases[rank]]
    for _, p in params:
        starts.append(starts[-1] + p.numel())
    first, stop = bases[rank], bases[rank + 1]
    table = torch.tensor(starts)
    out: dict[str, list[Feed]] = {n: [] for n, _ in params}
    for hf_name, c in codes.items():
        mine = ((c >= first) & (c < stop)).nonzero().flatten()
        if mine.numel() == 0:
            continue
        which = torch.searchsorted(table, c[mine], right=True) - 1
        for k in which.unique().tolist():
            sel = mine[which == k]
            local = c[sel] - starts[k]
            order = torch.argsort(local)
            out[params[k][0]].append(Feed(hf_name, local[order], sel[order]))
    return out


def probe_worker(
    rank: int, world: int, port: int, hf_dir: str, layout: Layout, moe: bool, out_dir: str, tokens: torch.Tensor, hidden: int,
    train: bool = True,
) -> None:
    """Build and load; export (vs the checkpoint, in the parent); record the probe map; one real
    training step (``train``: Megatron refuses to train MoE at TP > 1 without sequence parallelism,
    which the local spec's torch norms refuse); export again. Saves all of it, with the local
    parameters after the step (``loss`` None where no step ran or on a non-last stage)."""
    import time

    init_rank(rank, world, port)
    bridge, model = build(hf_dir, layout, moe)
    loaded = export(bridge, model)
    t = time.monotonic()
    codes, bases = probe_codes(bridge, model)
    again, _ = probe_codes(bridge, model, descending=True)
    disagree = sorted(name for name in codes if not torch.equal(codes[name], again[name]))
    feeds = decode_map(codes, bases, rank, model)  # what this rank's own export took from it
    # A replicated parameter (TP-replicated norms; dense parameters on the EP ranks) lands in each
    # rank's export from that rank's own copy. One owner sends it: the rank whose codes global rank
    # 0's export holds, so every rank decodes rank 0's codes for the map the sender would use.
    agreed = {}
    for name in sorted(codes):
        c = codes[name].clone()
        torch.distributed.broadcast(c, src=0)
        agreed[name] = c
    owned = decode_map(agreed, bases, rank, model)
    probe_s = time.monotonic() - t
    t = time.monotonic()
    loss = train_step(model, tokens, hidden) if train else None
    step_s = time.monotonic() - t
    after = export(bridge, model)
    local = {n: p.detach().clone() for n, p in local_params(model)}
    torch.save(
        {"loaded": loaded, "codes": codes, "bases": bases, "feeds": feeds, "owned": owned, "disagree": disagree, "loss": loss, "after": after,
         "local": local, "probe_s": probe_s, "step_s": step_s},
        Path(out_dir) / f"rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()


def hf_loss(hf_dir: str, tokens: torch.Tensor) -> float:
    """Hugging Face's mean next-token loss on ``tokens`` (the reference for train_step's)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:]))


def scatter_through_maps(
    results: list[dict[str, Any]], shapes: dict[str, torch.Size], key: str = "owned"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every HF tensor rebuilt from every rank's local parameters through its probe map alone:
    (values, how many local elements landed on each position)."""
    dtype = next(iter(results[0]["local"].values())).dtype  # the parameters' (fp32 or bf16)
    rebuilt = {n: (torch.zeros(s, dtype=dtype).flatten(), torch.zeros(s, dtype=torch.int64).flatten()) for n, s in shapes.items()}
    for res in results:
        for local_name, feeds in res[key].items():
            flat = res["local"][local_name].flatten()
            for f in feeds:
                values, hits = rebuilt[f.hf_name]
                values[f.hf_index] = flat[f.local_index]
                hits[f.hf_index] += 1
    return rebuilt


def shifted_export_worker(rank: int, world: int, port: int, hf_dir: str, layout: Layout, out_dir: str, shifted: str) -> None:
    """The probe against a bridge that moves AND shifts one tensor's values (+1, as a zero-centred
    norm's conversion would): the export is wrapped here to add 1 to ``shifted`` (a fault injected
    by the test, standing for such a bridge). Saves both probes' disagreements and whether the
    ascending probe alone decoded without complaint."""
    init_rank(rank, world, port)
    bridge, model = build(hf_dir, layout, False)
    real = bridge.export_hf_weights

    def shifting(*args: Any, **kwargs: Any) -> Any:
        for name, t in real(*args, **kwargs):
            yield name, (t + 1 if name == shifted else t)

    bridge.export_hf_weights = shifting
    codes, bases = probe_codes(bridge, model)
    again, _ = probe_codes(bridge, model, descending=True)
    disagree = sorted(name for name in codes if not torch.equal(codes[name], again[name]))
    torch.save({"disagree": disagree, "decoded": bool(decode_map(codes, bases, rank, model))}, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
