# Set-up and checks. `make demo` and `make test` work on a fresh machine with python3 >= 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_DIR := bench-results

.PHONY: install demo test bench clean

install: $(STAMP)

# Reinstall only when the project's metadata changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/tilecore train

test: install
	$(BIN)/ruff check src tests examples
	$(BIN)/pyright --pythonpath $(BIN)/python
	$(BIN)/python -m pytest

# Host-preprocessing throughput, one JSON file per run under bench-results/.
bench: install
	mkdir -p $(BENCH_DIR)
	for workload in criteo multihot stacked; do \
	  for threads in 1 2; do \
	    $(BIN)/tilecore bench preprocess --workload $$workload --topology 1x4 \
	      --threads $$threads --json $(BENCH_DIR)/$$workload-1x4-t$$threads.json || exit 1; \
	  done; \
	done

clean:
	rm -rf $(VENV) $(BENCH_DIR) build dist src/*.egg-info .pytest_cache .ruff_cache .hypothesis
