# dbr — top-level build.  `make build` sets up .venv and the agent; `make test`,
# `make demo` and `make bench` build first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: build agent pyc test test-long test-unit demo bench bench-quick bench-setup bench-long bench-long-quick clean lint

build: $(STAMP) agent pyc

# Byte-compile dbr's own modules: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# nothing else writes .pyc files, and compiling ~40 modules cost every `dbr` command
# 60 ms.  Only stale files are rewritten.
pyc: $(STAMP)
	$(PY) -m compileall -q dbr_service dbr_agent bench

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

agent:
	$(MAKE) -C dbr_agent

test: build lint
	$(PY) -m pytest -q -p no:cacheprovider tests

test-long: build
	$(PY) -m pytest -q -p no:cacheprovider -m long tests

# the unit layer alone (pure Python: no service, no agent, no program of its own; seconds)
test-unit: build
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

demo: build
	$(PY) -m dbr_service.commands.demo

bench: build
	$(PY) -m bench

# ruff (installed by build, settings in pyproject.toml) and the structure test (import
# cycles, package order, module sizes: tests/unit/test_structure.py); fails on any finding
lint: build
	$(VENV)/bin/ruff check dbr_service tests bench tools
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_structure.py

clean:
	$(MAKE) -C dbr_agent clean
	rm -rf build *.egg-info

# the comparison and scaling benchmarks in quick mode (< 3 min)
bench-quick: build
	$(PY) -m bench --quick compare scaling

# long-running programs (15-60 s) under dbr, BOLT and PGO.  bench-setup
# installs what they need (apt: bolt-19 linux-perf redis-server redis-tools sqlite3;
# PyPI: the lupa sdist, for Lua's sources); bench-long takes about 45 minutes,
# bench-long-quick under 10.  Results in bench/results/long-<timestamp>/.
bench-setup: build
	$(PY) -m bench long --setup

bench-long: build
	$(PY) -m bench long

bench-long-quick: build
	$(PY) -m bench long --quick
