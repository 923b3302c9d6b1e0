# The two commands (see README):  make lab   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-lab lab test test-fast lint gpu-check amd-gpu-check bench mutate dist clean

# The test environment (scripts/setup.sh test); `make lab` sets up only what the demo needs.
setup:
	@scripts/setup.sh test

setup-lab:
	@scripts/setup.sh lab

# Extra flags for `jupyter lab`, e.g. make lab LAB_ARGS="--no-browser --port 8899"
LAB_ARGS ?=

lab: setup-lab
	@scripts/lab.sh $(LAB_ARGS)

test: setup
	@scripts/test.sh

# Every in-process test (tests/unit: no kernels, servers, browsers or other users), about a
# minute; `make test` runs these and everything else. Arguments: make test-fast ARGS="-x -k pick"
ARGS ?=
test-fast: setup
	$(PY) -m pytest tests/unit -q $(ARGS)

lint:
	$(VENV)/bin/ruff check autogpu_jupyter autogpu tests benchmarks build_backend
	$(VENV)/bin/mypy autogpu_jupyter

gpu-check: setup
	@scripts/gpu-check.sh

# On a machine with an AMD GPU (ROCm): amd-smi, pick, torch (fails, never skips, without a driver)
amd-gpu-check: setup
	@scripts/amd-gpu-check.sh

# Mutation testing of core/ against the fast unit tests (issue 15; [tool.mutmut] in pyproject.toml).
# Not part of `make test`: run before a release. MUTANTS narrows the run to some mutants by name,
# e.g. make mutate MUTANTS='autogpu_jupyter.core.units*'; MUTATE_JOBS is the number of workers.
# Results stay in mutants/ (`.venv/bin/mutmut browse` to read the survivors).
MUTATE_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MUTANTS ?=
mutate: setup
	$(VENV)/bin/mutmut run --max-children $(MUTATE_JOBS) $(MUTANTS)
	$(VENV)/bin/mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json && echo
	$(PY) scripts/mutation_score.py

# Every benchmark; the ratios (and the cluster view's latency) go to $(BENCH_RESULTS), and
# scripts/bench_compare.py names any that worsened by more than 20 % against the run recorded in
# docs/benchmarks.md (exit 1). Record a run there with: $(PY) scripts/bench_compare.py --record
BENCH_RESULTS ?= benchmarks/results/latest.json
bench: setup
	rm -f $(BENCH_RESULTS)
	$(PY) benchmarks/import_time.py
	$(PY) benchmarks/snapshot.py --results $(BENCH_RESULTS)
	$(PY) benchmarks/pick_latency.py --repeat 300 --results $(BENCH_RESULTS)
	$(PY) benchmarks/amd.py --results $(BENCH_RESULTS)
	$(PY) benchmarks/broker_pick.py --results $(BENCH_RESULTS)
	$(PY) benchmarks/herd.py
	$(PY) benchmarks/broker_herd.py
	@if [ "$$(id -u)" = 0 ]; then $(PY) benchmarks/broker_hostile.py; else echo "bench: broker_hostile.py needs root (other uids): skipped"; fi
	$(PY) benchmarks/placement.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/server.py
	$(PY) benchmarks/metrics.py
	flock /tmp/autogpu-realparts.lock $(PY) benchmarks/cluster.py --results $(BENCH_RESULTS)
	$(PY) scripts/bench_compare.py --results $(BENCH_RESULTS)

# The release files: a production build of the lab extension, then the sdist and the wheel built
# from it (python -m build, isolated), checked by twine and check-wheel-contents; into dist/.
dist: setup
	@scripts/dist.sh

clean:
	rm -rf $(VENV) .venv-ipk6 mutants build dist tests/fakenvml/build tests/fakecuda/build labextension/node_modules labextension/lib autogpu_jupyter/labextension
