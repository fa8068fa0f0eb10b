# Every target creates .venv on first use and is safe to rerun.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first (it lies on local disk); the package only asks torch>=2.4.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/lowbit assets fetch smollm2-135m wiki
	$(BIN)/lowbit compare smollm2-135m

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/fake_quant_speed.py
	$(BIN)/python benchmarks/eval_speed.py --rounds 3
	$(BIN)/python benchmarks/compare_time.py
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/sim_validation.py

clean:
	rm -rf $(VENV) build src/*.egg-info
