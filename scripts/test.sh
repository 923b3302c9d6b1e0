#!/usr/bin/env bash
# Every test: lint, the TypeScript model's jest tests, then Python (unit, real kernels, a real
# Jupyter server, a real browser, real Unix users when root). Screenshots land in test-artifacts/.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
mkdir -p test-artifacts
status=0
"$VENV/bin/ruff" check autogpu_jupyter autogpu || status=1
if [ -d labextension/node_modules ]; then
  (cd labextension && PATH="$PWD/../$VENV/bin:$PATH" jlpm -s test) || status=1
fi
"$VENV/bin/python" -m pytest "$@" || status=1
exit $status
