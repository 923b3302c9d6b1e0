# The two commands (see README):  make lab   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup lab test test-fast lint gpu-check bench clean

setup:
	@scripts/setup.sh

# Extra flags for `jupyter lab`, e.g. make lab LAB_ARGS="--no-browser --port 8899"
LAB_ARGS ?=

lab: setup
	@scripts/lab.sh $(LAB_ARGS)

test: setup
	@scripts/test.sh

lint:
	$(VENV)/bin/ruff check autogpu_jupyter autogpu tests benchmarks
	$(VENV)/bin/mypy autogpu_jupyter/core

gpu-check: setup
	@scripts/gpu-check.sh

bench: setup
	$(PY) benchmarks/import_time.py
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/pick_latency.py
	$(PY) benchmarks/herd.py
	$(PY) benchmarks/placement.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/server.py

clean:
	rm -rf $(VENV) .venv-ipk6 build dist tests/fakenvml/build tests/fakecuda/build labextension/node_modules labextension/lib autogpu_jupyter/labextension
