# Every target creates .venv on first use and is safe to rerun.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean lmeval-venv test-lmeval bench-tasks

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

# lm-evaluation-harness in a venv of its own (lowbit does not depend on it): the slow-tier equality
# test and benchmarks/tasks_speed.py run lowbit from src/ inside it, beside lm-eval's HF backend.
LMEVAL       := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL)/.installed

$(LMEVAL_STAMP):
	test -x $(LMEVAL)/bin/python || $(PY) -m venv $(LMEVAL)
	# the CPU build of torch first, as for .venv; then lm-eval with what its HF backend needs
	$(LMEVAL)/bin/python -m pip install -q torch==2.13.0
	$(LMEVAL)/bin/python -m pip install -q lm-eval==0.4.13 transformers==5.24.0 tokenizers==0.23.3 accelerate \
		pyarrow safetensors rich pyyaml
	touch $(LMEVAL_STAMP)

lmeval-venv: $(LMEVAL_STAMP)

test-lmeval: setup lmeval-venv
	$(BIN)/lowbit assets fetch smollm2-135m tasks
	$(BIN)/python -m pytest -q tests/evaluation/test_tasks_lmeval.py

bench-tasks: lmeval-venv
	PYTHONPATH=src $(LMEVAL)/bin/python benchmarks/tasks_speed.py --limit 50

clean:
	rm -rf $(VENV) $(LMEVAL) build src/*.egg-info
