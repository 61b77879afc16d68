# Set-up and everyday commands. Everything installs into the Python you run make with
# (PYTHON=..., default python3), keeping any torch already there; with no torch, the
# CPU build torch==2.13.0 is installed first.
PYTHON ?= python3
STAMP := .make/installed

.PHONY: install test demo lint bench fuzz clean

$(STAMP): pyproject.toml
	@mkdir -p .make
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP)

test: $(STAMP)
	$(PYTHON) -m pytest -q

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
