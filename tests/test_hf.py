"""A Hugging Face transformers model as the rollout, its names mapped from the trainer's.

The trainer (``examples/hf_rollout.py``) holds the LM as ``policy`` inside an
actor-critic and takes real AdamW steps in fp32; the rollout is a bf16
``Qwen2ForCausalLM`` built from a config. Over real TCP sockets the rollout must end
bit-identical to the trainer's policy at bf16 under every version, compute exactly the
trainer's logits, and a mapping that does not fit must fail the handshake with a typed
error naming the key.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import hf_rollout  # noqa: E402
from examples.hf_rollout import (  # noqa: E402
    NAME_MAPPING,
    POLICY,
    ActorCritic,
    bf16,
    build_rollout,
    generate,
    rollout_digest,
    tiny_config,
    train_step,
    trainer_digest,
)
from protocol.errors import MetadataMismatchError, WeightSyncError  # noqa: E402
from receiver import Receiver  # noqa: E402
from sender import Sender  # noqa: E402

T = 30.0  # per await: never fires on a healthy run
FAST: dict[str, Any] = {"heartbeat_interval": 0.1, "peer_timeout": 5.0}
VERSIONS = 4


def _rollout_names() -> list[str]:
    return list(build_rollout(tiny_config()).state_dict())


async def test_example_runs_and_every_version_matches() -> None:
    """The example end to end: on-policy lockstep, one digest comparison per version."""
    args = argparse.Namespace(endpoint="tcp://127.0.0.1:0", config=None, steps=VERSIONS, lr=1e-5, untied=False)
    summary = await hf_rollout.main(args)
    assert summary["digests_equal"] == VERSIONS


@pytest.mark.parametrize(("trainer_tied", "rollout_tied"), [(True, True), (False, False), (True, False)], ids=["tied", "untied", "tied-to-untied"])
async def test_bit_identical_with_a_dict_mapping(trainer_tied: bool, rollout_tied: bool) -> None:
    """Every tensor equal at bf16 after every version, and the rollout computes the very
    logits of the trainer's policy cast to bf16. A trainer tie the rollout lacks is fine:
    the receiver writes the tied tensor into both of its copies."""
    agent = ActorCritic(tiny_config(trainer_tied))
    rollout = build_rollout(tiny_config(rollout_tied))
    mapping = {name: POLICY + name for name in rollout.state_dict()}  # the explicit form of NAME_MAPPING
    optimizer = torch.optim.AdamW(agent.parameters(), lr=1e-4, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.tensor(hf_rollout.PROMPT)
    with torch.no_grad():
        before = rollout(prompt).logits

    async with Sender("tcp://127.0.0.1:0", None, **FAST) as sender:
        await sender.start(agent.synced_state(), version=0)
        async with Receiver(rollout, sender.endpoint, None, identity="hf-test", name_mapping=mapping, **FAST) as receiver:
            await receiver.start(timeout=T)
            assert rollout_digest(rollout) == trainer_digest(agent)  # the bootstrap
            changed = []
            for version in range(1, VERSIONS + 1):
                train_step(agent, optimizer, generator)
                changed.append((await sender.sync(agent.synced_state(), version)).changed_elements)
                await receiver.wait_for_version(version, timeout=T)
                async with receiver.reading():
                    assert rollout_digest(rollout) == trainer_digest(agent), f"v{version} differs"
            async with receiver.reading():
                expected = bf16(agent.synced_state())
                got = {mapping[k]: v for k, v in rollout.state_dict().items()}
                assert got.keys() == expected.keys()
                unequal = [k for k in expected if not torch.equal(got[k], expected[k])]
                assert unequal == []
                assert (rollout.lm_head.weight is rollout.model.embed_tokens.weight) == rollout_tied

                # generate() works on the synced weights, and the model is the trainer's: same logits, same tokens.
                reference = copy.deepcopy(agent.policy).to(torch.bfloat16).eval()
                with torch.no_grad():
                    logits, want = rollout(prompt).logits, reference(prompt).logits
                assert torch.equal(logits, want)
                assert not torch.equal(logits, before)
                tokens = await asyncio.to_thread(generate, rollout)
                assert len(tokens) == 6 and tokens == generate(reference)
    assert all(n > 0 for n in changed), changed  # real steps: every version moved some bf16 weights


async def _handshake_error(mapping: Any) -> WeightSyncError:
    agent = ActorCritic(tiny_config())
    async with Sender("tcp://127.0.0.1:0", None, **FAST) as sender:
        await sender.start(agent.synced_state(), version=0)
        receiver = Receiver(build_rollout(tiny_config()), sender.endpoint, None, name_mapping=mapping, **FAST)
        async with receiver:
            with pytest.raises(WeightSyncError) as err:
                await receiver.start(timeout=T)
            assert receiver.version is None
    cause = err.value.__cause__
    assert isinstance(cause, MetadataMismatchError), repr(err.value)
    return cause


async def test_missing_mapping_fails_the_handshake_naming_the_key() -> None:
    error = await _handshake_error(None)
    assert "key 'policy.model.embed_tokens.weight' exists on the sender but not on the receiver" in str(error)


async def test_wrong_mapping_fails_the_handshake_naming_both_names() -> None:
    error = await _handshake_error(lambda name: "actor." + name)
    assert "key 'policy.model.embed_tokens.weight' exists on the sender but not on the receiver" in str(error)
    assert "sends the rollout's 'model.embed_tokens.weight' as 'actor.model.embed_tokens.weight'" in str(error)


async def test_dict_mapping_missing_an_entry_names_it() -> None:
    """A dict keeps the names it omits: the forgotten one is named on both sides."""
    mapping = {n: POLICY + n for n in _rollout_names() if n != "model.norm.weight"}
    error = await _handshake_error(mapping)
    assert "key 'policy.model.norm.weight' exists on the sender but not on the receiver" in str(error)
    assert "the rollout's 'model.norm.weight' as 'model.norm.weight'" in str(error)



async def test_rollout_tie_the_trainer_lacks_is_refused() -> None:
    """An untied trainer sends lm_head and embed_tokens separately; a tied rollout would
    write both into one storage and silently diverge. It should be refused at handshake."""
    agent = ActorCritic(tiny_config(tie_word_embeddings=False))
    rollout = build_rollout(tiny_config(tie_word_embeddings=True))
    async with Sender("tcp://127.0.0.1:0", None, **FAST) as sender:
        await sender.start(agent.synced_state(), version=0)
        async with Receiver(rollout, sender.endpoint, None, name_mapping=NAME_MAPPING, **FAST) as receiver:
            with pytest.raises(WeightSyncError, match=r"lm_head\.weight"):
                await receiver.start(timeout=T)
