# The two commands (see README):  make lab   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
# No NVIDIA driver here: run the demo on the simulated 4-GPU fleet.
HAVE_DRIVER := $(shell (ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1') && echo 1)
# Jupyter refuses to run as root unless told; a container or a fresh VM often is root.
LAB_FLAGS := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: setup lab test test-fast lint gpu-check bench mutate clean

setup:
	@scripts/setup.sh

lab: setup
ifeq ($(HAVE_DRIVER),1)
	$(VENV)/bin/jupyter lab $(LAB_FLAGS) notebooks/quickstart.ipynb
else
	@echo "No NVIDIA driver found: starting on the SIMULATED fleet demo-4x (AUTOGPU_SIMULATE=demo-4x)."
	AUTOGPU_SIMULATE=$${AUTOGPU_SIMULATE:-demo-4x} AUTOGPU_REGISTRY_DIR=$${AUTOGPU_REGISTRY_DIR:-/var/tmp/autogpu-demo} \
		$(VENV)/bin/jupyter lab $(LAB_FLAGS) notebooks/quickstart.ipynb
endif

test: setup
	@scripts/test.sh

lint:
	$(VENV)/bin/ruff check autogpu_jupyter autogpu tests benchmarks
	$(VENV)/bin/mypy autogpu_jupyter/core

gpu-check: setup
	@scripts/gpu-check.sh

# Mutation testing of core/ against the fast unit tests (issue 15; [tool.mutmut] in pyproject.toml).
# Not part of `make test`: run before a release. MUTANTS narrows the run to some mutants by name,
# e.g. make mutate MUTANTS='autogpu_jupyter.core.units*'; MUTATE_JOBS is the number of workers.
# Results stay in mutants/ (`.venv/bin/mutmut browse` to read the survivors).
MUTATE_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MUTANTS ?=
mutate: setup
	$(VENV)/bin/mutmut run --max-children $(MUTATE_JOBS) $(MUTANTS)
	$(VENV)/bin/mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json && echo

bench: setup
	$(PY) benchmarks/import_time.py
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/pick_latency.py
	$(PY) benchmarks/herd.py
	$(PY) benchmarks/broker_herd.py
	$(PY) benchmarks/placement.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/server.py
	$(PY) benchmarks/metrics.py
	$(PY) benchmarks/cluster.py

clean:
	rm -rf $(VENV) .venv-ipk6 mutants build dist tests/fakenvml/build tests/fakecuda/build labextension/node_modules labextension/lib autogpu_jupyter/labextension
