"""Helpers of the install tests (``tests/packaging/``): clean environments, the smoke test.

Environments are made with ``uv`` (a test tool): seconds per venv with a warm cache, where pip takes
tens. Every install reaches PyPI (through uv's cache) the way a user's does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager

from tests.kernelhelpers import Kernel

ROOT = Path(__file__).resolve().parents[1]
BUILT_LABEXTENSION = ROOT / "autogpu_jupyter" / "labextension"
UV = str(Path(sys.executable).parent / "uv")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Runs in the environment under test: %load_ext autogpu, %gpu pick, %gpu, %gpu panel, release in
#: a real InteractiveShell (a terminal IPython), then the panel object itself (ipywidgets, the
#: sampler, numpy and pandas: what the panel and %gpu import).
SMOKE = r"""
import contextlib, io, json, time
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    shell.run_line_magic("load_ext", "autogpu")
    shell.run_line_magic("gpu", "pick --min-free 10G")
    shell.run_line_magic("gpu", "")
    shell.run_line_magic("gpu", "panel")
    shell.run_line_magic("gpu", "release")
from autogpu_jupyter import Panel
panel = Panel(window_s=60)
panel.close()
import numpy, pandas, IPython, ipywidgets
print(json.dumps({"out": out.getvalue(), "panel": type(panel).__name__, "versions": {
    "numpy": numpy.__version__, "pandas": pandas.__version__, "ipython": IPython.__version__,
    "ipywidgets": ipywidgets.__version__}}))
"""


#: A fixed simulated fleet (demo-4x's load moves with time): only GPU 1 has 10 GiB free.
FLEET = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0a0a0a0a-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:07:00.0", "memory_total": "80G", "memory_used": "75G",
         "utilization_pct": 90, "temperature_c": 70, "power_w": 350, "power_limit_w": 400,
         "processes": [{"pid": 4242, "user": "alice", "used_memory": "75G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-1b1b1b1b-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:17:00.0", "memory_total": "24G", "memory_used": "1G",
         "utilization_pct": 5, "temperature_c": 38, "power_w": 20, "power_limit_w": 72,
         "processes": []},
    ],
}
GPU1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"


def clean_env(tmp: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A user's environment on a host without a driver: the fixed simulated :data:`FLEET`, a
    registry and Jupyter/IPython state of its own, nothing on ``PYTHONPATH``."""
    fleet = tmp / "fleet.json"
    if not fleet.exists():
        fleet.write_text(json.dumps(FLEET))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AUTOGPU_", "CUDA_", "NVIDIA_", "SLURM_", "JUPYTER", "IPYTHON",
                             "VIRTUAL_ENV", "PYTEST_"))
        and k not in ("PYTHONPATH", "LD_PRELOAD", "FAKE_NVML_SCENARIO", "JPY_SESSION_NAME")
    }
    env.update(
        AUTOGPU_SIMULATE=str(fleet),
        AUTOGPU_REGISTRY_DIR=str(tmp / "registry"),
        JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
        JUPYTER_DATA_DIR=str(tmp / "jupyter-data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"),
        JUPYTER_PLATFORM_DIRS="1",
        IPYTHONDIR=str(tmp / "ipython"),
        NO_COLOR="1",
    )
    env.update(extra or {})
    return env


def run(cmd: list[str], env: Mapping[str, str], cwd: Path, timeout: float = 600,
        ) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; fail the test with its output when it exits non-zero."""
    proc = subprocess.run(cmd, env=dict(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def uv_venv(path: Path, python: str, env: Mapping[str, str]) -> Path:
    """A fresh venv at ``path`` for ``python``; its interpreter."""
    run([UV, "venv", "-q", "-p", python, str(path)], env, path.parent)
    return path / "bin" / "python"


def installed(python: Path, env: Mapping[str, str]) -> dict[str, str]:
    """Every distribution of the environment of ``python``: normalised name -> version."""
    freeze = run([UV, "pip", "list", "-p", str(python), "--format", "freeze"], env,
                 python.parent).stdout
    pairs = (line.split("==", 1) for line in freeze.split())
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pairs}


def check_smoke(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What :data:`SMOKE` printed, checked: the pick, the table, the panel's hint in a terminal,
    the release; the report (versions) for more checks."""
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    lines = report["out"].splitlines()
    assert lines[0].startswith("autogpu [SIMULATED]: picked GPU 1 · NVIDIA L4 · GPU-1b1b1b1b")
    # (on a loaded machine a pick that took a second adds "waited 1.1s in line" above it)
    assert f"  CUDA_VISIBLE_DEVICES={GPU1}" in lines, lines
    assert [line for line in lines if line.startswith("GPUs on this host — SIMULATED fleet")]
    assert [line for line in lines if line.startswith("▶  GPU 1 ")], lines
    assert "this kernel: ▶ GPU 1 (%gpu pick, min free 10.0 GiB)" in lines, lines
    assert lines[-2] == (
        "autogpu: %gpu panel is a live widget and needs a notebook (JupyterLab, Notebook 7, "
        "VS Code); here, %gpu prints the same devices and holders as a table"
    )
    assert lines[-1] == "autogpu: released GPU 1 and its lease; CUDA_VISIBLE_DEVICES is unset again"
    assert report["panel"] == "Panel"
    return report


def check_cli_pick(python: Path, env: Mapping[str, str], cwd: Path) -> None:
    """``autogpu pick`` from the environment's own console script."""
    proc = run([str(python.parent / "autogpu"), "pick", "--min-free", "10G"], env, cwd)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("GPU 1 NVIDIA L4 GPU-1b1b1b1b"), lines
    assert lines[-1] == f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={GPU1}"


class EnvKernel(Kernel):
    """A real kernel of the environment under test (its python, its ipykernel), started by this
    test process's jupyter_client from a kernelspec in ``cwd``."""

    def __init__(self, python: Path, env: dict[str, str], cwd: Path) -> None:
        spec = cwd / "kernels" / "env-under-test"
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "env under test", "language": "python",
        }))
        self.km = KernelManager(kernel_name="env-under-test")
        self.km.kernel_spec_manager.kernel_dirs = [str(spec.parent)]
        self.km.start_kernel(env=env, cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)


def check_kernel_magics(kernel: Kernel, prefix_part: str) -> None:
    """``%load_ext autogpu``, ``%gpu pick``, ``%gpu``, ``%gpu panel`` in ``kernel``, whose
    ``sys.prefix`` contains ``prefix_part`` (the environment under test, not this one)."""
    where = kernel.run("import autogpu_jupyter, sys; print(sys.prefix)")
    assert where.status == "ok", where
    assert prefix_part in where.stdout
    assert kernel.run("%load_ext autogpu").status == "ok"
    pick = kernel.run("%gpu pick --min-free 10G")
    assert pick.status == "ok", pick
    assert pick.stdout.startswith("autogpu [SIMULATED]: picked GPU 1 · NVIDIA L4"), pick.stdout
    status = kernel.run("%gpu")
    assert status.status == "ok", status
    shown = status.stdout + "\n".join(status.texts())
    assert "GPU 1" in shown and "this kernel" in shown, shown
    panel = kernel.run("%gpu panel")
    assert panel.status == "ok", panel
    views = [o["content"]["data"] for o in panel.outputs if o["msg_type"] == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in d for d in views), panel.outputs
    assert kernel.run("%gpu release").status == "ok"
