# Set-up and checks. `make demo` and `make test` work on a fresh machine with python3 >= 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
BENCH_DIR := bench-results
TRAIN_DIR := tilecore-train

.PHONY: install install-dev demo test reference-test bench clean

# tilecore and its runtime dependencies only (what `make demo` needs).
install: $(STAMP)

# Plus the development tools (pytest, ruff, pyright, ...) that `make test` runs.
install-dev: $(DEV_STAMP)

# Reinstall only when the project's metadata changes. A dev install is also a runtime
# install, so it renews both stamps: `make test` then `make demo` installs nothing more.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

$(DEV_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(DEV_STAMP)

# Each run writes a new $(TRAIN_DIR)/run-NNN, so the demo can run any number of times.
demo: install
	$(BIN)/tilecore train

# One pytest worker more than the CPUs, at most 4: tests waiting on their subprocesses or
# on a bound leave a CPU idle otherwise (2 vCPUs, fresh clone: 2 workers 292 s, 3 252 s,
# 4 274 s).
TEST_WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 3 ? n + 1 : 4 )))

test: install-dev
	$(BIN)/ruff check src tests examples
	$(BIN)/pyright --pythonpath $(BIN)/python
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# Differential tests against the real reference (jax-tpu-embedding 0.2.0, Python >= 3.12) in
# its own venv; never a tilecore dependency. `make test` skips these tests when the venv is absent.
# The first python3.12 that runs (a pyenv shim exists without a 3.12 selected, and fails).
PYTHON312 ?= $(shell for p in $$(command -v python3.12) $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do "$$p" -c '' 2>/dev/null && { echo "$$p"; break; }; done)
REFERENCE_VENV := .venv-reference
REFERENCE_STAMP := $(REFERENCE_VENV)/.installed

$(REFERENCE_STAMP):
	test -n "$(PYTHON312)" || { echo "make reference-test needs python3.12 (set PYTHON312=...)"; exit 1; }
	test -x $(REFERENCE_VENV)/bin/python || $(PYTHON312) -m venv $(REFERENCE_VENV)
	$(REFERENCE_VENV)/bin/python -m pip install --quiet 'jax-tpu-embedding==0.2.0'
	touch $(REFERENCE_STAMP)

reference-test: install-dev $(REFERENCE_STAMP)
	$(BIN)/python -m pytest tests/test_reference_*.py

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
	rm -rf $(VENV) $(REFERENCE_VENV) $(BENCH_DIR) $(TRAIN_DIR) build dist src/*.egg-info .pytest_cache .ruff_cache .hypothesis
