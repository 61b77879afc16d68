# Set-up and everyday commands. Everything installs into the Python you run make with
# (PYTHON=..., default python3), keeping any torch already there; with no torch, the
# CPU build torch==2.13.0 is installed first.
PYTHON ?= python3
STAMP := .make/installed

.PHONY: install test demo lint bench clean

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
	$(PYTHON) -m mypy protocol

bench: $(STAMP)
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m benchmarks --suite quick --json benchmarks/results/quick.json --plot benchmarks/results/quick.png

clean:
	rm -rf .make build *.egg-info .pytest_cache .hypothesis
