"""What ``%load_ext autogpu`` loads, in a fresh process: the magics and the settings, not the
pick machinery, the lease stores (the port's records and admission phrases may come, with the
ranking's words) or numpy/pandas (those come with the first magic that needs
them; benchmarks/import_time.py measures the cost)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.brokerhelpers import REPO

LAZY = ("autogpu_jupyter.api", "autogpu_jupyter.core.picker", "autogpu_jupyter.core.decision",
        "autogpu_jupyter.core.leasing.directory", "autogpu_jupyter.core.leasing.brokerclient",
        "autogpu_jupyter.core.leasing.factory", "numpy", "pandas", "ipywidgets", "pynvml")


def _loaded_after(code: str) -> dict[str, bool]:
    probe = (
        "import json, sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        f"{code}\n"
        f"print(json.dumps({{m: m in sys.modules for m in {list(LAZY)!r}}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=str(REPO))
    loaded: dict[str, bool] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def test_load_ext_loads_no_pick_machinery_lease_store_or_numpy() -> None:
    loaded = _loaded_after("shell.run_line_magic('load_ext', 'autogpu')\n"
                           "assert 'gpu' in shell.magics_manager.magics['line']")
    assert [m for m, present in loaded.items() if present] == []


def test_the_first_pick_brings_them() -> None:
    loaded = _loaded_after("import os\nos.environ['AUTOGPU_SIMULATE'] = 'demo-4x'\n"
                           "os.environ['AUTOGPU_USE_LEASES'] = '0'\n"
                           "shell.run_line_magic('load_ext', 'autogpu')\n"
                           "shell.run_line_magic('gpu', 'pick --dry-run')")
    assert loaded["autogpu_jupyter.api"] and loaded["autogpu_jupyter.core.leasing.factory"]
    assert not loaded["ipywidgets"]
