#!/usr/bin/env bash
# One-time (idempotent) set-up for a fresh machine: a virtual environment with autogpu and its
# test tools, Debian's Chromium for the browser tests, Debian's prometheus and slurm-wlm (+ munge)
# for the cluster and Slurm tests, and the built JupyterLab extension.
# Called by `make lab` and `make test`; safe to run again (it skips what is already done).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.autogpu-setup"

need_py=1
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt labextension/package.json ]; then
  need_py=0
fi

if ! command -v node >/dev/null 2>&1; then
  echo "setup: installing Node.js (needed to build the JupyterLab extension from source)"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; else
    echo "setup: please install Node.js >= 18 (apt-get install nodejs npm)" >&2; exit 1; fi
fi

if [ "$need_py" = 1 ]; then
  echo "setup: creating $VENV and installing autogpu-jupyter (editable) with test tools"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The editable install builds the JupyterLab extension through hatch-jupyter-builder (jlpm).
  # Drop our link first, so that pip writes its copy into the venv, never through the link.
  link="$VENV/share/jupyter/labextensions/autogpu-jupyter"
  if [ -L "$link" ]; then rm "$link"; fi
  "$VENV/bin/python" -m pip install -q -e ".[test,bench,dev]"
  # Link (not copy) the built extension into the venv, as `jupyter labextension develop` would,
  # so that a later `jlpm build` in labextension/ reaches `make lab` without reinstalling.
  rm -rf "$link"
  ln -s "$PWD/autogpu_jupyter/labextension" "$link"
  touch "$stamp"
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
