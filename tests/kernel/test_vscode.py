"""A kernel started the way VS Code's Jupyter extension starts one, and what autogpu can do in it.

VS Code (its "raw" local kernels, the default) runs the kernelspec's ``argv`` itself: no Jupyter
server, so no kernel provisioner (the "Python 3 (autogpu)" kernelspec's pick before start does not
happen) and no ``JPY_SESSION_NAME``. It drops ``-f {connection_file}`` from the argv and appends
``--f=<runtime dir>/kernel-v3<40 hex digits>.json`` (a file it writes first), adds
``PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING=1`` to the environment, and, once the kernel is up, runs its
start-up code, which sets ``__vsc_ipynb_file__`` to the notebook's path in the user namespace
(vscode-jupyter ``src/kernels/raw/launcher/kernelProcess.node.ts``, ``src/kernels/kernel.ts``).

What works there (the README's VS Code paragraph): the magics, the panel (VS Code renders
ipywidgets 8), leases, with the notebook's name taken from ``__vsc_ipynb_file__``. What does not:
the pick before start and ``%gpu move`` (both need the provisioner), and the sidebar (a JupyterLab
front end).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from tests.installhelpers import FLEET, GPU1
from tests.kernelhelpers import Kernel, kernel_env

pytestmark = pytest.mark.slow


class VSCodeKernel(Kernel):
    """``python -m ipykernel_launcher --f=<runtime>/kernel-v3<hex>.json`` in the notebook's folder,
    with VS Code's environment, and its start-up code run."""

    def __init__(self, notebook: Path, env: dict[str, str], runtime: Path) -> None:
        runtime.mkdir(parents=True, exist_ok=True)
        connection = runtime / f"kernel-v3{secrets.token_hex(20)}.json"
        write_connection_file(str(connection), ip="127.0.0.1")
        log = runtime / "kernel.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ipykernel_launcher", f"--f={connection}"],
            env=env, cwd=notebook.parent, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        # No kernel manager watches the process: wait until it listens (it says so) before the
        # client's heartbeat decides whether it is alive.
        deadline = time.monotonic() + 60
        while f"--existing {connection}" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        self.kc = BlockingKernelClient(connection_file=str(connection))
        self.kc.load_connection_file()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        # VS Code's start-up code, silently, before the user's first cell
        path = str(notebook).replace("\\", "\\\\")
        self.kc.execute(f'__vsc_ipynb_file__ = "{path}"', silent=True, store_history=False)

    def close(self) -> None:
        self.kc.stop_channels()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def vscode(tmp_path: Path) -> Iterator[tuple[VSCodeKernel, Path, dict[str, str]]]:
    import json

    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(FLEET))
    notebook = tmp_path / "project" / "analysis.ipynb"
    notebook.parent.mkdir()
    notebook.write_text("{}")
    env = kernel_env({
        "AUTOGPU_SIMULATE": str(fleet),
        "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry"),
        "PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING": "1",
        "IPYTHONDIR": str(tmp_path / "ipython"),
    })
    env.pop("JPY_SESSION_NAME", None)
    env.pop("AUTOGPU_PROVISIONED", None)
    kernel = VSCodeKernel(notebook, env, tmp_path / "runtime")
    try:
        yield kernel, notebook, env
    finally:
        kernel.close()


def test_magics_panel_and_a_lease_named_after_the_notebook(
    vscode: tuple[VSCodeKernel, Path, dict[str, str]],
) -> None:
    kernel, notebook, env = vscode
    assert kernel.run("%load_ext autogpu").status == "ok"
    # no provisioner ran: nothing was picked before the kernel started
    before = kernel.run("%gpu")
    assert "this kernel: no GPU picked yet (%gpu pick)" in before.stdout + "".join(before.texts())
    pick = kernel.run("%gpu pick --min-free 10G")
    assert pick.status == "ok", pick
    assert pick.stdout.startswith("autogpu [SIMULATED]: picked GPU 1 · NVIDIA L4"), pick.stdout
    assert kernel.env()["CUDA_VISIBLE_DEVICES"] == GPU1
    panel = kernel.run("%gpu panel")
    views = [o["content"]["data"] for o in panel.outputs if o["msg_type"] == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in d for d in views), panel.outputs

    # Another shell sees the lease, and which notebook holds it (0.1 showed none here).
    pid = int(kernel.run("import os; print(os.getpid())").stdout)
    leases = subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "leases"], env=env, capture_output=True,
        text=True, timeout=60, check=False,
    )
    assert leases.returncode == 0, leases.stderr
    mine = [line for line in leases.stdout.splitlines() if f" pid {pid} " in line]
    assert len(mine) == 1, leases.stdout
    assert str(notebook) in mine[0], mine[0]


def test_move_says_it_needs_the_autogpu_kernelspec(
    vscode: tuple[VSCodeKernel, Path, dict[str, str]],
) -> None:
    kernel, _, _ = vscode
    assert kernel.run("%load_ext autogpu").status == "ok"
    move = kernel.run("%gpu move --best")
    assert move.status == "error"
    assert "kernelspec" in move.stderr + str(move.error), move
