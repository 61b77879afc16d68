"""The model factory ``python -m sender --watch ... --model tests.watch_models:qwen2`` builds in
tests/test_watch.py: the tiny Qwen2 of ``examples/hf_rollout.py`` (embedding and LM head
tied, as the small Qwen2 models are), in fp32 as a trainer holds it."""

from __future__ import annotations

from transformers import Qwen2ForCausalLM

from examples.hf_rollout import tiny_config


def qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(tiny_config())
