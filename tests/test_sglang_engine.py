"""The real SGLang 0.5.23 engine on this CPU, and its own weight-update path (issue 57 groundwork).

No weightsync code runs here yet: these tests pin down what the SGLang adapter will build on.
One ``sglang.Engine`` is started on a tiny bf16 Qwen2 checkpoint made from a config (no hub
download). Its greedy tokens must equal transformers' ``generate`` on the same weights. Then a
second set of weights (a few real AdamW steps of the fp32 master, cast to bf16) goes in through
SGLang's own ``begin_weight_update`` / ``update_weights_from_tensor(load_format=None)`` /
``end_weight_update``, so the model's own ``load_weights`` fills the fused qkv/gate_up rows; the
engine's greedy tokens and top-k logprobs must then equal a fresh engine started on the second
checkpoint, bit for bit.

SGLang is not in the project's main environment (its vLLM tests must not see a torchvision):
``make sglang-env`` builds ``.venv-sglang`` layered over it, and these tests run there as
``.venv-sglang/bin/python -m pytest tests/test_sglang_engine.py``. Anywhere else they skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import sglang
    from transformers import Qwen2Config, Qwen2ForCausalLM
except Exception as exc:  # ImportError, or a packaging fault raised while sglang imports
    pytest.skip(
        f"sglang is not importable in this interpreter ({type(exc).__name__}: {exc}); "
        "build it with `make sglang-env` and run `.venv-sglang/bin/python -m pytest tests/test_sglang_engine.py`",
        allow_module_level=True,
    )

# An engine start is 15-30 s on 2 cores; two starts and four short generations fit well inside this.
pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3], [200, 7, 7, 7, 41, 8]]
NEW_TOKENS = 8
TOP_K = 5


def tiny_qwen2() -> Qwen2ForCausalLM:
    """fp32 master: 2 layers, GQA (4 query heads, 2 kv heads), untied head. A wider init than
    the default makes the logits peaked, so a bf16 rounding cannot flip a near-tie greedy pick."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
    )
    return Qwen2ForCausalLM(config).float()


def save_bf16(model: Qwen2ForCausalLM, path: Path) -> Path:
    model.to(torch.bfloat16).save_pretrained(path)
    model.float()
    return path


def adamw_steps(model: Qwen2ForCausalLM, steps: int = 3) -> None:
    """Real training steps on random token sequences (next-token loss), as a trainer would."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sglang")
    model = tiny_qwen2()
    first = save_bf16(model, root / "a")
    adamw_steps(model)
    second = save_bf16(model, root / "b")
    return first, second


def start(path: Path) -> Any:
    return sglang.Engine(
        model_path=str(path), device="cpu", attention_backend="torch_native", skip_tokenizer_init=True,
        mem_fraction_static=0.05, max_total_tokens=512, log_level="error",
    )


def greedy(engine: Any) -> tuple[list[list[int]], list[list[list[tuple[float, int]]]]]:
    """Each prompt's greedy tokens and, for each new token, the top-k (logprob, token id) pairs."""
    outs = engine.generate(
        input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS},
        return_logprob=True, top_logprobs_num=TOP_K,
    )
    tokens = [out["output_ids"] for out in outs]
    tops = [[[(lp, tok) for lp, tok, _ in step] for step in out["meta_info"]["output_top_logprobs"]] for out in outs]
    return tokens, tops


def hf_greedy(path: Path) -> list[list[int]]:
    model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)[0, len(p):].tolist()
            for p in PROMPTS
        ]


def bf16_state(path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under their Hugging Face names, as a trainer would hand them."""
    model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    return [(name, t.detach().clone()) for name, t in model.state_dict().items()]


@pytest.fixture(scope="module")
def engine(checkpoints: tuple[Path, Path]) -> Iterator[Any]:
    """One engine for the module, started on the first checkpoint. The update test shuts it down
    before starting a fresh one (one engine at a time: each takes every core); a second
    ``shutdown`` finds nothing left to stop. Note ``Engine.shutdown`` kills every child process
    of the calling process, not only its own: keep other subprocesses out of this module."""
    eng = start(checkpoints[0])
    try:
        yield eng
    finally:
        eng.shutdown()


def test_greedy_tokens_equal_transformers(engine: Any, checkpoints: tuple[Path, Path]) -> None:
    tokens, _ = greedy(engine)
    assert all(len(t) == NEW_TOKENS for t in tokens)
    assert tokens == hf_greedy(checkpoints[0])


def test_update_outside_a_session_is_refused(engine: Any, checkpoints: tuple[Path, Path]) -> None:
    """SGLang 0.5.23 refuses ``update_weights_from_tensor`` outside begin/end, and keeps its weights."""
    before = greedy(engine)
    ok, message = engine.update_weights_from_tensor(bf16_state(checkpoints[1]), load_format=None)[:2]
    assert not ok
    assert "begin_weight_update" in message
    assert greedy(engine) == before


def test_update_in_place_equals_fresh_engine(engine: Any, checkpoints: tuple[Path, Path]) -> None:
    first_tokens, first_tops = greedy(engine)
    assert engine.begin_weight_update()[0]
    ok, message = engine.update_weights_from_tensor(bf16_state(checkpoints[1]), load_format=None)[:2]
    assert ok, message
    assert engine.end_weight_update()[0]
    tokens, tops = greedy(engine)
    engine.shutdown()

    fresh = start(checkpoints[1])
    try:
        fresh_tokens, fresh_tops = greedy(fresh)
    finally:
        fresh.shutdown()
    assert fresh_tokens != first_tokens, "the AdamW steps did not change the greedy tokens: the test would not see a lost update"
    assert tokens == fresh_tokens
    assert tops == fresh_tops  # logprobs bit-equal, not close: same weights, same kernels
    assert fresh_tops != first_tops
