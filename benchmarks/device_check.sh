#!/usr/bin/env bash
# The device path's GPU check as one prepared run on a lent device machine (an H100 or H200:
# torch 2.11+cu130, Python 3.12, numba, msgpack, uvloop, xxhash, aiohttp, pytest and Triton
# installed; see /work/.library/device/README.md). One command, under 8 minutes in all:
#
#   1. the CUDA-only tests, which skip on CPU machines (the device encoder's bytes and its one
#      pinned copy a part, whole tensors to pinned memory, the device codec on CUDA, the
#      receiver's one copy a part, the vLLM map's writes, phase times, a trainer stepping on a side
#      stream and the copy streams), the fused receiver kernels compiled for CUDA, and the device
#      path under torch.use_deterministic_algorithms(True);
#   2. benchmarks/gpu_check.py's kernel checks (bit-exact on the GPU, build vs read floor, with
#      its verdict line);
#   3. benchmarks/gpu_check.py e2e on the 1.78B shape of the earlier H200 baseline (Qwen2-1.5B's
#      widths, an untied head), 2 bf16 rollouts over TCP, one warm-up version before the timed
#      ones in every run: patch at lr 1e-6 and 1e-5 with the default snapshot place (auto), patch
#      at lr 1e-6 with snapshot_device cuda, bucket at 1e-6; each writes its JSON to $OUT (publish
#      them under benchmarks/published/ with this command) and prints a VERDICT line a target.
# The timeouts add up to 440 s. Not yet run on a GPU: the first session lent one should expect
# to adjust them.
#
# The machine lacks pyzmq, pytest-asyncio, pytest-timeout, hypothesis, lz4, zstandard, pyyaml,
# prometheus-client and nvCOMP: bring them as cp312 wheels in .whl (.gitignore'd), from the repo's
# root here, before the call:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq pytest-asyncio pytest-timeout hypothesis sortedcontainers attrs lz4 zstandard \
#     pyyaml prometheus-client nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13
#
# then run it with the device tool: command `bash benchmarks/device_check.sh`, carry [".whl"],
# timeout_s 590. On a machine without CUDA it runs the same steps tiny (a smoke test of the
# script itself: the CUDA tests skip, the kernel checks are left out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
status=0

echo "== 1. CUDA tests"
timeout 80 python3 -m pytest -q -p no:cacheprovider -o addopts= -k "cuda or pinned or deterministic" \
    tests/test_device_build.py tests/test_tohost.py tests/test_device_codec.py tests/test_receiver_transfer.py \
    tests/test_layout_device.py tests/test_phase_times.py tests/test_compare.py tests/test_streams.py \
    tests/test_fused.py tests/test_deterministic.py 2>&1 | tee "$OUT/device-tests.log" || status=1

shape=(--untied)  # Qwen2-1.5B's widths (the defaults) with a head of its own: 1.78B
if [ "$cuda" = 1 ]; then
    echo "== 2. kernel checks"
    timeout 80 python3 benchmarks/gpu_check.py --sizes-gb 1 8 2>&1 | tee "$OUT/gpu-kernels.log" || status=1
    # a run per JSON, so a slow one cannot take the other's figures with it
    echo "== 3. end to end: patch, lr 1e-6 and 1e-5, snapshot auto (the default)"
    timeout 140 python3 benchmarks/gpu_check.py e2e "${shape[@]}" --strategies patch --lrs 1e-6 1e-5 --versions 3 --warmup 1 \
        --codec auto --snapshot auto --json "$OUT/gpu-$(date +%F)-patch.json" 2>&1 | tee "$OUT/gpu-e2e-patch.log" || status=1
    echo "== 3b. end to end: patch, lr 1e-6, snapshot cuda"
    timeout 70 python3 benchmarks/gpu_check.py e2e "${shape[@]}" --strategies patch --lrs 1e-6 --versions 3 --warmup 1 \
        --codec auto --snapshot cuda --json "$OUT/gpu-$(date +%F)-patch-snapshot-cuda.json" 2>&1 | tee "$OUT/gpu-e2e-cuda.log" || status=1
    echo "== 3c. end to end: bucket, lr 1e-6"
    timeout 70 python3 benchmarks/gpu_check.py e2e "${shape[@]}" --strategies bucket --lrs 1e-6 --versions 2 --warmup 1 \
        --json "$OUT/gpu-$(date +%F)-bucket.json" 2>&1 | tee "$OUT/gpu-e2e-bucket.log" || status=1
else
    echo "== 3. end to end (no CUDA: tiny, a smoke test of this script)"
    timeout 300 python3 benchmarks/gpu_check.py e2e --untied --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \
        --vocab 512 --versions 2 --warmup 1 --lrs 1e-6 --codec device --snapshot auto cpu \
        --json "$OUT/gpu-smoke-$(date +%F).json" 2>&1 | tee "$OUT/gpu-e2e.log" || status=1
fi
echo "== verdicts"
grep -h "^VERDICT" "$OUT"/gpu-*.log 2>/dev/null
exit $status
