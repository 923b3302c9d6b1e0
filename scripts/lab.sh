#!/usr/bin/env bash
# What `make lab` runs (after scripts/setup.sh): JupyterLab with the extension, opened on
# notebooks/quickstart.ipynb. Arguments are passed to `jupyter lab`:
#   make lab LAB_ARGS="--no-browser --port 8899"      (a headless server: see the README)
#
# - No NVIDIA driver here: the demo runs on the simulated fleet demo-4x (AUTOGPU_SIMULATE).
# - A fleet file given as a relative path is resolved here, once, to an absolute path: the
#   server and every kernel (which run in other directories) read the same file.
# - The lease registry is the default one (/var/tmp/autogpu, or $AUTOGPU_REGISTRY_DIR if you
#   set it), the one `autogpu leases` / `autogpu run` read in any shell of this host: the CLI
#   sees the notebooks' leases and the notebooks see the CLI's.
# - The "Python 3 (autogpu)" kernel is installed into this environment (sys.prefix), so the
#   Launcher shows it; nothing is written to your home directory.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

if [ -z "${AUTOGPU_SIMULATE:-}" ] && ! (ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1'); then
  echo "No NVIDIA driver found: starting on the SIMULATED fleet demo-4x (AUTOGPU_SIMULATE=demo-4x)."
  echo "In a terminal, run the CLI on the same fleet with: export AUTOGPU_SIMULATE=demo-4x"
  export AUTOGPU_SIMULATE=demo-4x
fi
if [ -n "${AUTOGPU_SIMULATE:-}" ] && [ -e "$AUTOGPU_SIMULATE" ]; then
  AUTOGPU_SIMULATE=$(realpath "$AUTOGPU_SIMULATE")
  export AUTOGPU_SIMULATE
  echo "Simulated fleet file: AUTOGPU_SIMULATE=$AUTOGPU_SIMULATE"
fi

# JupyterLab's terminals (File > New > Terminal) find `autogpu` and this environment's Python.
PATH="$(cd "$VENV/bin" && pwd):$PATH"
export PATH

"$VENV/bin/autogpu" kernelspec install --sys-prefix >/dev/null
echo "Kernel \"Python 3 (autogpu)\" installed in $VENV (it picks a GPU before the kernel starts)."

flags=()
# Jupyter refuses to run as root unless told; a container or a fresh VM often is root.
[ "$(id -u)" = 0 ] && flags+=(--allow-root)
# Without a terminal (nohup, a service, a CI job) jupyter starts its terminals as login shells,
# whose profile resets PATH and loses this environment's bin/; start them as it does in a
# terminal instead, with the PATH above. (Given in LAB_ARGS, your own shell_command wins.)
if [ ! -t 1 ]; then
  flags+=("--ServerApp.terminado_settings=shell_command=${SHELL:-/bin/sh}")
fi
# The printed URL (what a headless server's user copies) opens the quickstart too.
exec "$VENV/bin/jupyter" lab "${flags[@]}" \
  --LabApp.default_url=/lab/tree/notebooks/quickstart.ipynb "$@"
