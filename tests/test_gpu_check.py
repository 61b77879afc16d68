"""``benchmarks/gpu_check.py e2e`` on CPU, tiny: the end-to-end daemon scenario (a
Qwen2-shaped fp32 model trained by AdamW, the Sender in the trainer's process, 2 bf16
receivers in their own processes over TCP loopback) runs, every receiver matches the trainer
bit for bit, and its JSON holds every figure it promises; the GPU run is the same command
without the size options."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check, qwen2  # noqa: E402
from receiver.stats import ApplyStats  # noqa: E402
from sender.stats import SyncStats  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "512"]
VERSION_KEYS = ("version", "loss", "sync_s", "e2e_s", "e2e_acked_s", "decode_s", "commit_s", "receive_s", "wire_bytes",
                "dense_bytes", "changed_fraction", "applied_as", "incidents", "sender", "receivers", "digests")


def test_the_default_shape_is_qwen2_1_5b() -> None:
    s = qwen2.Shape()
    assert (s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.vocab, s.head_dim) == (28, 1536, 8960, 12, 2, 151936, 128)
    assert s.parameters() == 1_543_714_304  # Qwen2-1.5B, embeddings tied
    model = qwen2.Qwen2Shaped(qwen2.Shape(layers=1, hidden=32, intermediate=48, heads=4, kv_heads=2, vocab=64))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == model.shape.parameters()
    assert "model.layers.0.self_attn.k_proj.bias" in model.state_dict() and "lm_head.weight" in model.state_dict()


@pytest.mark.parametrize("tied", [True, False])
def test_one_qwen2_table_names_the_model_the_engine_layout_and_transformers(tied: bool) -> None:
    """``qwen2.checkpoint_shapes`` is the table ``Qwen2Shaped`` builds, tests/vllm_like.py's
    engine is laid out from, and Hugging Face's own Qwen2 has: names, shapes and order."""
    shape = qwen2.Shape(layers=2, hidden=32, intermediate=48, heads=4, kv_heads=2, vocab=64, tied=tied)
    table = shape.checkpoint_shapes()
    built = {k: tuple(v.shape) for k, v in qwen2.Qwen2Shaped(shape).state_dict().items()}
    assert list(built.items()) == list(table.items())
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tied)
    hf = {k: tuple(v.shape) for k, v in transformers.Qwen2ForCausalLM(config).state_dict().items()}
    assert list(hf.items()) == list(table.items())
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_like import Shape as EngineShape

    engine = EngineShape(layers=2, hidden=32, inter=48, heads=4, kv_heads=2, head_dim=8, vocab=64, tied=tied)
    assert engine.checkpoint_shapes() == table


@pytest.mark.timeout(180)
def test_e2e_on_cpu_tiny_patch_and_bucket_device_and_host_codec(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "e2e", "--device", "cpu", *TINY, "--versions", "2", "--lrs", "1e-5",
         "--strategies", "patch", "bucket", "--codec", "device", "host", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    for key in ("device", "torch", "command", "argv", "config", "library", "runs", "first_bootstrap", "digests_equal", "notes", "wall_s"):
        assert key in doc, key
    assert doc["device"]["device"] == "cpu" and doc["device"]["name"].startswith("cpu") and doc["device"]["platform"]
    assert doc["command"].startswith("python benchmarks/gpu_check.py e2e --device cpu")
    assert doc["config"]["model"]["layers"] == 2 and doc["config"]["model"]["vocab"] == 512 and doc["config"]["receivers"] == 2
    assert doc["digests_equal"] is True
    runs = {(r["strategy"], r["codec"]): r for r in doc["runs"]}
    assert set(runs) == {("patch", "device"), ("patch", "host"), ("bucket", None)}
    assert runs["patch", "device"]["config"]["patch"]["codec"] == "device"
    dense = 2 * qwen2.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512).parameters()
    sync_fields = {f.name for f in dataclasses.fields(SyncStats)}
    apply_fields = {f.name for f in dataclasses.fields(ApplyStats)}
    for (strategy, _), run in runs.items():
        assert run["digests_equal"] is True and run["incidents"] == 0
        boot = run["bootstrap"]
        assert boot["s"] > 0 and boot["wall_s"] >= boot["s"] and len(boot["per_receiver_s"]) == 2 and boot["digests"]["equal"]
        assert [b["kind"] for b in boot["receivers"]] == ["bootstrap", "bootstrap"]
        assert len(run["warmup"]) == 1 and [v["version"] for v in run["versions"]] == [2, 3]
        for v in run["warmup"] + run["versions"]:
            assert set(VERSION_KEYS) <= set(v)
            assert v["sync_s"] > 0 and v["e2e_s"] > 0 and v["e2e_acked_s"] >= v["sync_s"]
            assert v["decode_s"] > 0 and v["commit_s"] > 0
            assert v["dense_bytes"] == dense and 0 < v["changed_fraction"] <= 1
            assert v["applied_as"] == [strategy] and v["incidents"] == 0
            d = v["digests"]
            assert d["equal"] and d["receivers"] == [d["trainer"]] * 2 and d["receiver_versions"] == [v["version"]] * 2
            assert sync_fields <= set(v["sender"])  # every SyncStats field, new ones included
            assert all(apply_fields <= set(r) and r["kind"] == strategy for r in v["receivers"])
        if strategy == "patch":
            assert all(0 < v["wire_bytes"] < dense / 2 for v in run["versions"])
        m = run["median"]
        assert all(m[k] is not None for k in ("sync_s", "e2e_s", "decode_s", "commit_s", "wire_bytes", "dense_bytes", "changed_fraction"))
        numeric = {f.name for f in dataclasses.fields(SyncStats) if f.type in ("int", "float")}  # what has a median
        assert numeric - {"version"} <= set(run["median_sender_stats"])
        assert apply_fields - {"version", "kind"} <= set(run["median_receiver_stats"])

    # Every run trained the same trajectory from the same seed: the trainer's digests agree
    # across runs, and both codecs found the same changes.
    def trainer(run: dict[str, Any]) -> list[str]:
        return [v["digests"]["trainer"] for v in run["warmup"] + run["versions"]]

    assert trainer(runs["patch", "device"]) == trainer(runs["patch", "host"]) == trainer(runs["bucket", None])
    changed = [[v["sender"]["changed_elements"] for v in runs["patch", codec]["versions"]] for codec in ("device", "host")]
    assert changed[0] == changed[1]
    assert "lr1e-05-patch-device" in done.stdout and "digests equal" in done.stdout


async def test_a_differing_digest_fails_the_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The exit status follows the digests: 1 when any receiver differed."""
    args = gpu_check.parser().parse_args(["e2e", "--device", "cpu", *TINY, "--lrs", "1e-5", "--strategies", "bucket"])

    async def fake_run(args: argparse.Namespace, shape: Any, lr: float, strategy: str, codec: str | None, snapshot: str) -> dict[str, Any]:
        median = dict.fromkeys(("sync_s", "e2e_s", "decode_s", "commit_s", "wire_bytes", "dense_bytes", "changed_fraction"))
        return {"name": "fake", "lr": lr, "strategy": strategy, "codec": codec, "snapshot": snapshot, "bootstrap": {"s": None},
                "median": median, "digests_equal": equal}

    monkeypatch.setattr(gpu_check, "e2e_run", fake_run)
    equal = True
    assert await gpu_check.e2e(args) == 0
    equal = False
    assert await gpu_check.e2e(args) == 1
    out = capsys.readouterr().out
    assert "DIFFER" in out
    # one verdict line a target: the patch targets unmeasured (no patch run), the digests failed
    assert "VERDICT NONE patch lr 1e-6 end to end <= 50 ms" in out and "VERDICT FAIL digests equal" in out


def test_verdicts_pick_the_default_patch_run_at_lr_1e_6() -> None:
    def run(lr: float, snapshot: str, codec: str, e2e: float) -> dict[str, Any]:
        median = {"e2e_s": e2e, "sync_s": 0.004, "decode_s": 0.003, "commit_s": 0.002}
        return {"strategy": "patch", "lr": lr, "snapshot": snapshot, "codec": codec, "median": median, "digests_equal": True,
                "bootstrap": {"s": 2.0}}

    runs = [run(1e-5, "auto", "auto", 0.2), run(1e-6, "cuda", "auto", 0.3), run(1e-6, "auto", "auto", 0.04)]
    lines = [v["line"] for v in gpu_check.e2e_verdicts(runs)]
    assert lines[0] == "VERDICT PASS patch lr 1e-6 end to end <= 50 ms: 40.0 ms (limit 0.05 s)"
    assert lines[2].startswith("VERDICT PASS patch lr 1e-6 receiver decode + commit <= 10 ms: 5.0 ms")
    assert lines[3].startswith("VERDICT NONE bucket") and lines[4].startswith("VERDICT PASS bootstrap")


# -- the quick suite's device-codec row --------------------------------------------------------
def test_the_quick_suite_has_a_device_codec_row_beside_the_host_one() -> None:
    """``real-bf16-lr1e-6-device``: the host row's workload with ``patch.codec: device``, right
    after it, its targets reported but not counted; the full suite is unchanged."""
    from benchmarks.e2e import patch_config
    from benchmarks.workloads import SUITES, workloads

    quick = workloads(SUITES["quick"])
    names = [w.name for w in quick]
    assert names.index("real-bf16-lr1e-6-device") == names.index("real-bf16-lr1e-6") + 1
    host, device = quick[names.index("real-bf16-lr1e-6")], quick[names.index("real-bf16-lr1e-6-device")]
    assert patch_config(device)["patch"]["codec"] == "device" and "codec" not in patch_config(host)["patch"]
    assert (host.counted, device.counted) == (True, False)
    assert {k: v for k, v in device.params.items() if k != "patch"} == host.params and device.params["patch"] == {"codec": "device"}
    assert "real-bf16-lr1e-6-device" not in [w.name for w in workloads(SUITES["full"])]


def test_targets_of_a_row_not_counted_are_reported_apart() -> None:
    from benchmarks.report import evaluate_targets

    row = {"workload": "w", "kind": "real", "density": 0.02, "wire_bytes": 130.0, "entropy_floor_bytes": 100.0, "seed_format_bytes": 1000.0,
           "dense_bytes": 10_000, "build_s": 1.0, "read_floor_s": 1.0, "e2e_patch_s": 1.0, "e2e_bucket_s": 1.0,
           "e2e_safetensors_s": 1.0, "e2e_gloo_s": 1.0, "bucket_Bps": 1.0, "zmq_raw_Bps": 1.0}
    counted = evaluate_targets([row])
    apart = evaluate_targets([{**row, "workload": "w-device", "targets_counted": False}])
    assert counted["failed"] > 0 and counted["not_counted"] == {}
    assert (apart["passed"], apart["failed"], apart["workloads"]) == (0, 0, {})
    assert apart["not_counted"]["w-device"] == counted["workloads"]["w"]
