"""weightsync inside real SGLang 0.5.23 engines on this CPU: its loader in the scheduler
processes, driven through SGLang's own surface only (``begin_weight_update`` /
``update_weights_from_tensor(load_format=<weightsync's loader>)`` / ``end_weight_update``,
the weight version label, pause and continue), never a stand-in for SGLang's loader or layers.

One scenario runs once per module (``followed``), and each test asserts one side of it:

- a Qwen2 trainer (fp32, real AdamW steps, untied head) drives a bf16 engine started from
  dummy weights, through a proxy that corrupts the first patch; versions 2 and 4 are sparse
  patches, version 3 moves most elements (its tensors travel whole);
- the engine's greedy tokens and top-k logprobs at the last version equal those of a fresh
  engine loaded from the trainer's weights saved at that version, bit for bit; the prompts were
  generated at earlier versions too, so a KV cache not flushed with the weights would show;
- the fresh engine's tokens equal transformers' ``generate`` on that checkpoint; it then reloads
  an earlier version through SGLang's own ``update_weights_from_disk`` and equals what the
  weightsync engine served at that version;
- failures: the corrupted patch is refused and the update lands the sender's resync; an update
  to a version that never comes raises ``WeightSyncTimeout`` through the client, with the
  engine's outputs and label unchanged and the engine still serving.

SGLang runs in ``.venv-sglang`` (``make sglang-env``); ``make test`` runs this file there in a
process of its own (``Engine.shutdown`` kills every child process of its caller).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_env import require_sglang

require_sglang(__file__)

from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy import CorruptAndRecord, Proxy, of_type  # noqa: E402

from examples.sglang_rollout import PROMPTS, generate, label, start_engine  # noqa: E402
from examples.vllm_rollout import CONFIG, Trainer  # noqa: E402
from protocol.errors import WeightSyncTimeout  # noqa: E402
from protocol.wire.framing import MessageType  # noqa: E402
from receiver.sglang.client import SGLangWeights  # noqa: E402

pytestmark = pytest.mark.timeout(600)
NEW_TOKENS = 8
SPARSE_LR, DENSE_LR = 2e-6, 1e-2
LONG = 200  # new tokens of the request in flight during an update (the tiny models' context is 256)


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario (module doc); what each test asserts is recorded here."""
    root = tmp_path_factory.mktemp("sglang-ws")
    trainer = Trainer(tie=False, lr=SPARSE_LR)
    tamper = CorruptAndRecord(of_type(MessageType.PATCH, payload=True), limit=1)
    port = int(trainer.sender.endpoint.rsplit(":", 1)[1])
    proxy = Proxy(("127.0.0.1", port), tamper=tamper)
    trainer.run(proxy.start())
    trainer.config.save_pretrained(root / "config")
    out: dict[str, Any] = {"served": {}, "labels": {}, "steps": {}}
    saved = {v: root / f"v{v}" for v in (2, 4)}
    engine = start_engine(str(root / "config"))
    try:
        refused = engine.update_weights_from_tensor([("lm_head.weight", torch.zeros(1))], load_format=None)
        out["raw_call_outside_window"] = (bool(refused[0]), str(refused[1]))
        weights = SGLangWeights(engine)
        out["init"] = weights.init(proxy.endpoint, config=CONFIG, timeout=120)
        out["labels"][0] = label(engine)
        out["served"][0] = generate(engine, NEW_TOKENS)

        # v1: its patch arrives corrupted: refused (checksum), NACKed, resynced; staged, not written
        out["steps"][1] = trainer.step()
        wait(lambda: tamper.hits == 1, 30, "the corrupted patch")
        first = tamper.seen.index(MessageType.PATCH) + 1
        wait(lambda: MessageType.BOOTSTRAP in tamper.seen[first:], 30, "the sender's resync after the NACK")
        out["served_before_update_1"] = generate(engine, NEW_TOKENS)
        out["held"] = {1: weights.update(1, timeout=60)}
        out["labels"][1] = label(engine)
        out["served"][1] = generate(engine, NEW_TOKENS)

        # an update to a version that never comes: a typed error, nothing written, still serving
        try:
            weights.update(trainer.version + 1, timeout=2.0)
            out["missing_version_error"] = None
        except WeightSyncTimeout as e:
            out["missing_version_error"] = str(e)
        out["served_after_failure"] = generate(engine, NEW_TOKENS)
        out["label_after_failure"] = label(engine)

        # v2 sparse, paused around the update; v3 dense (whole tensors); v4 sparse
        for version, lr, pause in ((2, SPARSE_LR, "retract"), (3, DENSE_LR, None), (4, SPARSE_LR, None)):
            out["steps"][version] = trainer.step(lr=lr)
            out["held"][version] = weights.update(version, timeout=60, pause=pause)
            out["labels"][version] = label(engine)
            out["served"][version] = generate(engine, NEW_TOKENS)
            if version in saved:
                trainer.save(str(saved[version]))
        out["status"] = weights.status()
        weights.shutdown()
    finally:
        engine.shutdown()
    trainer.run(proxy.close())
    trainer.close()
    out["hf_greedy"] = hf_greedy(saved[4])
    fresh = start_engine(str(saved[4]), weightsync=False)
    try:
        out["fresh"] = generate(fresh, NEW_TOKENS)
        ok, message = fresh.update_weights_from_disk(str(saved[2]))[:2]
        assert ok, message
        out["fresh_reloaded_2"] = generate(fresh, NEW_TOKENS)
    finally:
        fresh.shutdown()
    return out


def hf_greedy(path: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)[0, len(p):].tolist()
            for p in PROMPTS
        ]


def test_the_last_version_equals_a_fresh_engine_bit_for_bit(followed: dict[str, Any]) -> None:
    final, fresh = followed["served"][4], followed["fresh"]
    assert final["tokens"] == fresh["tokens"]
    assert final["top"] == fresh["top"]  # logprobs equal, not close: same weights, same kernels, KV cache flushed
    assert final["top"] != followed["served"][0]["top"], "the versions never changed the outputs: the test would miss a lost update"


def test_the_fresh_engine_agrees_with_transformers_and_with_sglangs_own_reload(followed: dict[str, Any]) -> None:
    assert followed["fresh"]["tokens"] == followed["hf_greedy"]
    assert followed["fresh_reloaded_2"] == followed["served"][2]  # SGLang's own disk reload of v2 = what weightsync served


def test_sparse_and_whole_versions_each_land_and_are_labelled(followed: dict[str, Any]) -> None:
    steps, held, labels = followed["steps"], followed["held"], followed["labels"]
    assert held == {1: 1, 2: 2, 3: 3, 4: 4}
    assert labels == {0: "0", 1: "1", 2: "2", 3: "3", 4: "4"}  # update_weight_version names what the workers hold
    assert 0 < steps[2]["changed_fraction"] < 0.25 and 0 < steps[4]["changed_fraction"] < 0.25  # patches
    assert steps[3]["changed_fraction"] > 0.5  # most elements: whole tensors
    tops = [followed["served"][v]["top"] for v in range(5)]
    assert all(a != b for a, b in itertools.pairwise(tops)), "some version did not change the engine's outputs"


def test_a_corrupted_patch_is_refused_and_the_resync_lands(followed: dict[str, Any]) -> None:
    assert followed["served_before_update_1"] == followed["served"][0]  # staged in the background, nothing written
    assert followed["held"][1] == 1 and followed["served"][1] != followed["served"][0]


def test_a_failed_update_raises_and_keeps_the_last_whole_version(followed: dict[str, Any]) -> None:
    assert followed["missing_version_error"] is not None, "an update to a version that never came did not raise"
    assert followed["served_after_failure"] == followed["served"][1]
    assert followed["label_after_failure"] == "1"


def test_outside_a_window_sglang_refuses_and_the_steps_are_counted(followed: dict[str, Any]) -> None:
    ok, message = followed["raw_call_outside_window"]
    assert not ok and "begin_weight_update" in message
    (worker,) = followed["status"]
    assert worker["version"] == 4 and worker["steps"] >= 5 * NEW_TOKENS
    assert [run["version"] for run in worker["runs"]][-1] == 4


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_launch_server_driven_over_http_alone(tmp_path: Path) -> None:
    """``python -m sglang.launch_server --custom-weight-loader receiver.sglang.loader.weightsync``
    as its own process, a tied Llama (the second dense family) from dummy weights, driven by URL
    only: init, a version landing while a 200-token request is in flight (paused with ``retract``:
    the request finishes, recomputed), a version checked against the trainer's digest, the
    label on ``/model_info``; then the server's own ``/update_weights_from_disk`` of the
    trainer's saved weights changes none of the greedy tokens and logprobs."""
    import subprocess
    import time

    from daemon_helpers import free_port

    from examples.sglang_rollout import llama_config

    trainer = Trainer(tie=True, lr=SPARSE_LR, config=llama_config(True))
    trainer.config.save_pretrained(tmp_path / "config")
    port = free_port()
    args = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "config"), "--device", "cpu",
        "--attention-backend", "torch_native", "--skip-tokenizer-init", "--mem-fraction-static", "0.05",
        "--max-total-tokens", "512", "--port", str(port), "--load-format", "dummy", "--log-level", "error",
        "--custom-weight-loader", "receiver.sglang.loader.weightsync",
    ]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def gen(tokens: int, ids: list[Any] = PROMPTS) -> Any:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens},
                "return_logprob": True, "top_logprobs_num": 5}
        code, out = _http("POST", base + "/generate", body)
        assert code == 200, out
        return out

    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if _http("GET", base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the SGLang server did not come up"
            time.sleep(0.5)
        weights = SGLangWeights(base)
        assert weights.init(trainer.sender.endpoint, config=CONFIG, timeout=120) == 0
        assert _http("GET", base + "/model_info")[1]["weight_version"] == "0"

        long_request: dict[str, Any] = {}
        import threading

        runner = threading.Thread(target=lambda: long_request.update(out=gen(LONG, [1, 2, 3])))
        runner.start()
        time.sleep(1.0)  # in flight when the update pauses generation
        trainer.step()
        assert weights.update(1, timeout=60, pause="retract") == 1
        runner.join(120)
        meta = long_request["out"]["meta_info"]
        assert len(long_request["out"]["output_ids"]) == LONG and meta["finish_reason"]["type"] == "length"

        trainer.step()
        assert weights.update(2, timeout=60, verify_checksum=True) == 2  # the workers' state digest is the trainer's
        assert _http("GET", base + "/model_info")[1]["weight_version"] == "2"
        served = [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in gen(NEW_TOKENS)]
        weights.shutdown()

        trainer.save(str(tmp_path / "v2"))
        code, out = _http("POST", base + "/update_weights_from_disk", {"model_path": str(tmp_path / "v2"), "load_format": "auto"})
        assert code == 200 and out["success"], out
        reloaded = [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in gen(NEW_TOKENS)]
        assert served == reloaded
    finally:
        import os
        import signal

        os.killpg(server.pid, signal.SIGTERM)  # the server and its scheduler processes
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        trainer.close()


def test_tensor_parallel_two_mixture_of_experts_through_the_map(tmp_path: Path) -> None:
    """A Qwen3-MoE at TP=2 (gloo on this CPU): SGLang's FusedMoE ``w13``/``w2`` sliced per
    rank, the fused qkv/gate_up rows, the padded vocabulary split in two. A trainer that names
    its experts fused, as transformers 5 keeps them in memory (SGLang's loader silently skips
    those names), is refused at init on both ranks, loudly, with the engine's weights left as
    they were; one naming them expert by expert, as checkpoints do, is followed through
    versions, and the engine then equals SGLang's own reload of the trainer's saved weights
    (``update_weights_from_disk``) bit for bit."""
    from examples.vllm_rollout import tiny_config
    from protocol.errors import MetadataMismatchError

    config = tiny_config(False, family="qwen3_moe")
    fused = Trainer(tie=False, lr=SPARSE_LR, config=config)
    trainer = Trainer(tie=False, lr=SPARSE_LR, config=config, per_expert=True, seed=1)
    config.save_pretrained(tmp_path / "config")
    engine = start_engine(str(tmp_path / "config"), tp=2, mem_fraction_static=0.1)  # experts leave 0.05 too little KV cache
    try:
        weights = SGLangWeights(engine)
        dummy = generate(engine, NEW_TOKENS)
        with pytest.raises(MetadataMismatchError, match="land nowhere"):
            weights.init(fused.sender.endpoint, config=CONFIG, timeout=120)
        assert {a.rank for a in weights.last_answers} == {0, 1}
        assert generate(engine, NEW_TOKENS) == dummy  # the probes' bits were put back

        assert weights.init(trainer.sender.endpoint, config=CONFIG, timeout=120) == 0
        for version, lr in ((1, SPARSE_LR), (2, DENSE_LR), (3, SPARSE_LR)):
            trainer.step(lr=lr)
            assert weights.update(version, timeout=60) == version
        served = generate(engine, NEW_TOKENS)
        assert [a.rank for a in weights.last_answers] == [0, 1]
        weights.shutdown()
        trainer.save(str(tmp_path / "v3"))
        ok, message = engine.update_weights_from_disk(str(tmp_path / "v3"), load_format="auto")[:2]  # started as dummy
        assert ok, message
        assert generate(engine, NEW_TOKENS) == served
        assert served != dummy
    finally:
        engine.shutdown()
        fused.close()
        trainer.close()
