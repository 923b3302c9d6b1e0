# The two commands (see README):  make lab   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-lab lab test test-fast lint gpu-check amd-gpu-check bench mutate mutate-ts dist clean

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

# Mutation testing of the whole package against the fast unit tests (issues 15, 22; [tool.mutmut] in
# pyproject.toml, scripts/mutation_run.py). Not part of `make test`: run before a release. A full
# run is about 23,600 mutants (a night on two cores); narrow it:
#   make mutate MODULES='broker brokerd.*'      every mutant of these modules (dotted, globs)
#   make mutate SAMPLE=40 [SEED=22] [MODULES=..] a seeded random sample of 40 mutants per module,
#                                                scored with a 95 % interval (an estimate)
#   make mutate MUTANTS='autogpu_jupyter.cli.x_main*'  mutmut's own names or globs
# MUTATE_JOBS is the number of workers (at most 2 by default). Results stay in mutants/
# (`.venv/bin/mutmut browse` to read the survivors, `mutmut show NAME` for one diff).
MUTATE_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 2 ] && n=2; echo $$n)
MUTANTS ?=
MODULES ?=
SAMPLE ?=
SEED ?= 22
mutate: setup
	set -f; nice $(PY) scripts/mutation_run.py --jobs $(MUTATE_JOBS) $(if $(SAMPLE),--sample $(SAMPLE) --seed $(SEED)) $(if $(MODULES),--modules $(MODULES)) $(MUTANTS)
	$(PY) scripts/mutation_score.py $(if $(SAMPLE),--sample mutants/sample.txt)

# Mutation testing of the sidebar's models (labextension/src/model.ts, clustermodel.ts) against
# the jest tests: Stryker (labextension/stryker.config.mjs); the report in
# labextension/reports/mutation/. STRYKER_JOBS is the number of test runners.
STRYKER_JOBS ?= 2
mutate-ts: setup
	cd labextension && STRYKER_JOBS=$(STRYKER_JOBS) nice ../$(VENV)/bin/jlpm stryker run

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
	$(PY) benchmarks/broker_pick.py --backend nvml --results $(BENCH_RESULTS)
	$(PY) benchmarks/herd.py
	$(PY) benchmarks/broker_herd.py
	@if [ "$$(id -u)" = 0 ]; then $(PY) benchmarks/broker_hostile.py; else echo "bench: broker_hostile.py needs root (other uids): skipped"; fi
	@if [ "$$(id -u)" = 0 ]; then $(PY) benchmarks/broker_scale.py --results $(BENCH_RESULTS); else echo "bench: broker_scale.py needs root (16 users, 12,000 descriptors): skipped"; fi
	@if [ "$$(id -u)" = 0 ]; then $(PY) benchmarks/broker_orphans.py --results $(BENCH_RESULTS); else echo "bench: broker_orphans.py needs root (other uids): skipped"; fi
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
	rm -rf $(VENV) .venv-ipk6 mutants build dist tests/fakenvml/build tests/fakecuda/build labextension/node_modules labextension/lib autogpu_jupyter/labextension labextension/reports labextension/.stryker-tmp
