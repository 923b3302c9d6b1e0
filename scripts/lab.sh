#!/usr/bin/env bash
# What `make lab` runs (after scripts/setup.sh): JupyterLab with the extension, opened on
# demo/quickstart.ipynb. Arguments are passed to `jupyter lab`:
#   make lab LAB_ARGS="--no-browser --port 8899"      (a headless server: see the README)
#
# - The demo runs copies of notebooks/*.ipynb in demo/ (untracked, made once): running them
#   leaves the clone clean. Delete demo/ to start over.
# - No JupyterLab news pop-up over the first outputs, no update check: JupyterLab 4.6 asks "get
#   notified about official Jupyter news?" in a toast whatever --LabApp.news_url says, so the
#   answer ("never") goes into this environment's settings overrides, which the front end reads
#   (JupyterLab's and Notebook 7's share/jupyter/lab/settings/overrides.json; a value already
#   there is kept).
# - JupyterLab's terminals are bash with this environment's bin/ first on PATH, even where a
#   login shell's profile would reset PATH.
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

"$VENV/bin/python" - <<'PY'
import json, os, sys
path = os.path.join(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
try:
    with open(path, encoding="utf-8") as fh:
        overrides = json.load(fh)
except FileNotFoundError:
    overrides = {}
notification = overrides.setdefault("@jupyterlab/apputils-extension:notification", {})
if "fetchNews" not in notification:
    notification["fetchNews"] = "false"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(overrides, fh, indent=2)
    os.replace(path + ".tmp", path)
PY

"$VENV/bin/autogpu" kernelspec install --sys-prefix >/dev/null
echo "Kernel \"Python 3 (autogpu)\" installed in $VENV (it picks a GPU before the kernel starts)."

mkdir -p demo
for nb in notebooks/*.ipynb; do
  [ -e "demo/$(basename "$nb")" ] || cp "$nb" "demo/$(basename "$nb")"
done
echo "The demo runs your copies in demo/ (untracked; delete demo/ to start over)."

flags=()
# Jupyter refuses to run as root unless told; a container or a fresh VM often is root.
[ "$(id -u)" = 0 ] && flags+=(--allow-root)
if command -v bash >/dev/null 2>&1; then
  rc="$(cd "$VENV" && pwd)/autogpu-lab.bashrc"
  printf '%s\n' '[ -f ~/.bashrc ] && . ~/.bashrc' "export PATH=\"$(cd "$VENV/bin" && pwd):\$PATH\"" >"$rc"
  flags+=("--ServerApp.terminado_settings={'shell_command': ['bash', '--rcfile', '$rc', '-i']}")
fi
# No news pop-up over the first outputs, no update check (unless LAB_ARGS says otherwise: a
# flag given twice is an error for jupyter).
case " $* " in *news_url*) ;; *) flags+=(--LabApp.news_url=None) ;; esac
case " $* " in *check_for_updates_class*) ;; *)
  flags+=(--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate) ;; esac
# The printed URL (what a headless server's user copies) opens the quickstart too.
exec "$VENV/bin/jupyter" lab "${flags[@]}" \
  --LabApp.default_url=/lab/tree/demo/quickstart.ipynb "$@"
