"""The panel in real kernels (jupyter_client / nbclient) while the test moves load in the fleet.

The kernel's Python is parametrised: ``.venv/bin/python`` (ipykernel 7) and, when it exists,
``.venv-ipk6/bin/python`` (ipykernel 6); or set ``AUTOGPU_TEST_KERNEL_PYTHONS`` to a
``os.pathsep``-separated list of interpreters. The fleet comes from a simulated fleet file
(``AUTOGPU_SIMULATE``) and, when ``tests/conftest.py`` provides ``fake_nvml``, also from the
fake ``libnvidia-ml.so.1`` through the real pynvml binding.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3
GPU0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
GPU1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
GPU2 = "GPU-2c2c2c2c-1111-2222-3333-444444444444"


def _kernel_pythons() -> list[str]:
    env = os.environ.get("AUTOGPU_TEST_KERNEL_PYTHONS")
    if env:
        return [p for p in env.split(os.pathsep) if p]
    found = [sys.executable]
    ipk6 = REPO / ".venv-ipk6" / "bin" / "python"
    if ipk6.exists():
        found.append(str(ipk6))
    return found


#: Another process of the test's user (a real one, so NVML backends find its user in /proc).
USER = getpass.getuser()
_other_pid: list[int] = []


@pytest.fixture(scope="module", autouse=True)
def other_process() -> Any:
    proc = subprocess.Popen(["sleep", "3600"])
    _other_pid[:] = [proc.pid]
    yield proc
    proc.kill()
    proc.wait()


def fleet(gpu0_util: float, other_mem_gib: int, *, lost_gpu2: bool = False) -> dict[str, Any]:
    """Three 80 GiB GPUs; another process (``other_process``) loads GPU 0, this kernel's."""
    gpu2: dict[str, Any] = {
        "uuid": GPU2,
        "name": "Fake A100 80GB",
        "memory_total": 80 * GiB,
        "utilization_pct": 40,
        "memory_used": 20 * GiB,
        "processes": [{"pid": 52002, "user": "dave", "used_memory": 20 * GiB}],
    }
    if lost_gpu2:
        gpu2 = {"uuid": GPU2, "name": "Fake A100 80GB", "lost": True}
    return {
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": GPU0,
                "name": "Fake A100 80GB",
                "memory_total": 80 * GiB,
                "utilization_pct": gpu0_util,
                "memory_used": other_mem_gib * GiB,
                "temperature_c": 50,
                "power_w": 200.0,
                "processes": [
                    {"pid": _other_pid[0], "user": USER, "used_memory": other_mem_gib * GiB}
                ],
            },
            {
                "uuid": GPU1,
                "name": "Fake A100 80GB",
                "memory_total": 80 * GiB,
                "utilization_pct": 0,
                "memory_used": 1 * GiB,
                "temperature_c": 35,
                "power_w": 60.0,
                "processes": [],
            },
            gpu2,
        ],
    }


class SimulatedFleet:
    """A fleet file that the simulated backend re-reads when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.env = {"AUTOGPU_SIMULATE": str(path)}

    def write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


@pytest.fixture(scope="module", params=["simulated", "fake_nvml"])
def fleet_source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "simulated":
        src = SimulatedFleet(tmp_path_factory.mktemp("fleet") / "fleet.json")
    else:
        # conftest's fake_nvml is function-scoped; the kernel lives for the module, so build
        # the same FakeNvml here over the session's library.
        from tests.fakenvml import FakeNvml

        request.getfixturevalue("fake_nvml_library")
        src = FakeNvml(tmp_path_factory.mktemp("fake-nvml"))
    src.write(fleet(gpu0_util=5, other_mem_gib=10))
    return src


class Kernel:
    """A real kernel with a blocking client; :meth:`run` executes code and returns its stdout."""

    def __init__(self, python: str, env: dict[str, str], spec_dir: Path) -> None:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        kdir = spec_dir / "autogpu-test"
        kdir.mkdir(parents=True, exist_ok=True)
        (kdir / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "autogpu test",
                    "language": "python",
                }
            )
        )
        ksm = KernelSpecManager(kernel_dirs=[str(spec_dir)])
        self.km = KernelManager(kernel_name="autogpu-test", kernel_spec_manager=ksm)
        self.km.start_kernel(env=env, cwd=str(REPO))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 60) -> tuple[str, list[dict[str, Any]]]:
        """Execute ``code``; return (stdout, every iopub message seen until it went idle)."""
        msg_id = self.kc.execute(code)
        out: list[str] = []
        seen: list[dict[str, Any]] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            seen.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif kind == "error":
                raise AssertionError("kernel error:\n" + "\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        return "".join(out), seen

    def json(self, code: str, timeout: float = 60) -> Any:
        """Run ``code`` whose last stdout line is JSON; return it decoded."""
        text, _ = self.run(code, timeout)
        return json.loads(text.strip().splitlines()[-1])

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module", params=_kernel_pythons(), ids=lambda p: Path(p).parent.parent.name)
def kernel(
    request: pytest.FixtureRequest, fleet_source: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    env = {
        **os.environ,
        **fleet_source.env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "AUTOGPU_SAMPLE_INTERVAL": "0.2",
        "CUDA_VISIBLE_DEVICES": "",  # replaced in the kernel below: this kernel "picks" GPU 0
    }
    env.pop("AUTOGPU_PICKED", None)
    if "AUTOGPU_SIMULATE" not in fleet_source.env:
        env.pop("AUTOGPU_SIMULATE", None)
    k = Kernel(request.param, env, tmp_path_factory.mktemp("kernels"))
    fleet_source.write(fleet(gpu0_util=5, other_mem_gib=10))
    try:
        k.run(
            "import os, json, time, threading\n"
            f"os.environ['CUDA_DEVICE_ORDER'] = 'PCI_BUS_ID'\n"
            f"os.environ['CUDA_VISIBLE_DEVICES'] = {GPU0!r}\n"
            "from IPython.display import display\n"
            "from autogpu_jupyter import Panel\n"
            "from autogpu_jupyter.core import overload\n"
            "from autogpu_jupyter.core.overload import Thresholds\n"
            "th = Thresholds(util_pct=90, window_s=1.0, memory_pct=95)\n"
            "panel = Panel(window_s=60, thresholds=th)\n"
            "display(panel)\n"
            "def wait_until(cond, limit_s=30):\n"
            "    end = time.monotonic() + limit_s\n"
            "    while not cond() and time.monotonic() < end:\n"
            "        time.sleep(0.05)\n"
            "    return cond()\n"
            "def state():\n"
            "    return {'banner': panel.banner.value, 'display': panel.banner.layout.display,\n"
            "            'header': panel.header.value, 'charts': panel.charts.value,\n"
            "            'table': panel.table.value, 'samples': panel.sampler.sample_count,\n"
            "            'warnings': [w.message() for w in panel.warnings]}\n"
        )
        yield k
    finally:
        k.shutdown()


def test_panel_header_and_charts_show_the_kernel_device(kernel: Kernel) -> None:
    st = kernel.json("wait_until(lambda: panel.update_count >= 2)\nprint(json.dumps(state()))")
    assert "This kernel: GPU 0 · Fake A100 80GB · GPU-0a0a0a0a" in st["header"]
    assert st["charts"].count("<svg") == 3
    assert f'data-uuid="{GPU0}" data-kernel="1"' in st["charts"]
    assert f'data-uuid="{GPU1}" data-kernel="0"' in st["charts"]
    assert "GPU 0 (this kernel)" in st["table"]
    assert f"{USER}: pid {_other_pid[0]} (10.0 GiB used)" in st["table"]
    assert st["banner"] == ""
    assert st["display"] == "none"
    assert st["warnings"] == []


def test_other_load_raises_warning_then_clears(kernel: Kernel, fleet_source: Any) -> None:
    fleet_source.write(fleet(gpu0_util=97, other_mem_gib=60))
    st = kernel.json("wait_until(lambda: bool(panel.warnings))\nprint(json.dumps(state()))")
    assert "97%" in st["table"]
    assert f"{USER}: pid {_other_pid[0]} (60.0 GiB used)" in st["table"]
    assert len(st["warnings"]) == 1
    msg = st["warnings"][0]
    assert msg.startswith("autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 97% for ")
    assert f"(over 90%), caused by 1 other process holding 60.0 GiB (user {USER})." in msg
    assert msg.endswith(
        "Best alternative: move to GPU 1 (79.0 GiB free, 0% busy): "
        "restart the kernel and run %gpu pick."
    )
    assert "<b>GPU 0 (this kernel's GPU) is overloaded</b>: utilisation 97% for " in st["banner"]
    assert st["display"] == "block"

    # printed once for users without the panel: the hook gets it once, then nothing
    first, second = kernel.json(
        "print(json.dumps([overload.pending_warning(panel.thresholds),\n"
        "                  overload.pending_warning(panel.thresholds)]))"
    )
    assert first.startswith(
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 97% for "
    )
    assert first.endswith(msg.split("(over 90%)")[1])
    assert second is None

    fleet_source.write(fleet(gpu0_util=5, other_mem_gib=10))
    st = kernel.json("wait_until(lambda: not panel.warnings)\nprint(json.dumps(state()))")
    assert st["warnings"] == []
    assert st["banner"] == ""
    assert st["display"] == "none"
    assert f"{USER}: pid {_other_pid[0]} (10.0 GiB used)" in st["table"]


def test_memory_nearly_full_warns_without_waiting(kernel: Kernel, fleet_source: Any) -> None:
    fleet_source.write(fleet(gpu0_util=5, other_mem_gib=78))
    st = kernel.json("wait_until(lambda: bool(panel.warnings))\nprint(json.dumps(state()))")
    assert len(st["warnings"]) == 1
    assert (
        "is overloaded: memory 98% full (over 95%), caused by 1 other process holding "
        f"78.0 GiB (user {USER})." in st["warnings"][0]
    )
    fleet_source.write(fleet(gpu0_util=5, other_mem_gib=10))
    st = kernel.json("wait_until(lambda: not panel.warnings)\nprint(json.dumps(state()))")
    assert st["warnings"] == []


def test_long_running_cell_keeps_updating(kernel: Kernel) -> None:
    model_id = kernel.json("print(json.dumps(panel.charts.model_id))")
    before = kernel.json("print(json.dumps(panel.sampler.sample_count))")
    _, msgs = kernel.run("time.sleep(3)")
    after = kernel.json("print(json.dumps(panel.sampler.sample_count))")
    assert after > before + 2
    # updates of the chart widget reached the iopub channel while the cell slept
    updates = [
        m
        for m in msgs
        if m["msg_type"] == "comm_msg"
        and m["content"].get("comm_id") == model_id
        and m["content"]["data"].get("method") == "update"
        and "value" in m["content"]["data"].get("state", {})
    ]
    assert len(updates) >= 3


def test_lost_gpu_shows_lost_and_others_keep_updating(kernel: Kernel, fleet_source: Any) -> None:
    fleet_source.write(fleet(gpu0_util=33, other_mem_gib=10, lost_gpu2=True))
    st = kernel.json(
        "wait_until(lambda: 'lost: GPU is lost' in panel.charts.value\n"
        "           and '33%' in panel.table.value)\n"
        "print(json.dumps(state()))"
    )
    assert "lost: GPU is lost" in st["charts"]
    assert st["charts"].count("<svg") == 3
    assert "GPU 2" in st["table"] and "lost: GPU is lost" in st["table"]
    assert "33%" in st["table"]  # GPU 0 still updates
    n = st["samples"]
    later = kernel.json(
        f"wait_until(lambda: panel.sampler.sample_count > {n} + 2)\n"
        "print(json.dumps(state()['samples']))"
    )
    assert later > n + 2
    fleet_source.write(fleet(gpu0_util=5, other_mem_gib=10))


def test_sampler_restart_leaves_one_thread(kernel: Kernel) -> None:
    counts = kernel.json(
        "from autogpu_jupyter.core.sampler import get_sampler, stop_sampler\n"
        "def n(): return sum(t.name == 'autogpu-sampler' for t in threading.enumerate())\n"
        "c = [n()]\n"
        "stop_sampler(); c.append(n())\n"
        "get_sampler(); get_sampler(); c.append(n())\n"
        "stop_sampler(); get_sampler(); c.append(n())\n"
        "print(json.dumps(c))"
    )
    assert counts == [1, 0, 1, 1]


def test_reload_ext_leaves_one_sampler_thread(kernel: Kernel) -> None:
    counts = kernel.json(
        "from autogpu_jupyter.core.sampler import get_sampler\n"
        "def n(): return sum(t.name == 'autogpu-sampler' for t in threading.enumerate())\n"
        "get_ipython().run_line_magic('load_ext', 'autogpu')\n"
        "get_sampler(); c = [n()]\n"
        "get_ipython().run_line_magic('reload_ext', 'autogpu')\n"
        "get_sampler(); c.append(n())\n"
        "get_ipython().run_line_magic('unload_ext', 'autogpu')\n"
        "c.append(n())\n"
        "print(json.dumps(c))"
    )
    assert counts == [1, 1, 0]


def test_notebook_runs_headless_with_nbclient(tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "notebooks" / "panel.ipynb", as_version=4)
    env_keys = {
        "AUTOGPU_SIMULATE": str(REPO / "notebooks" / "panel-fleet.json"),
        "PYTHONPATH": str(REPO),
    }
    old = {k: os.environ.get(k) for k in env_keys}
    os.environ.update(env_keys)
    try:
        NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    panel_out = nb.cells[2].outputs
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in panel_out)
    text = "".join(o.get("text", "") for o in nb.cells[3].outputs)
    assert text.startswith("autogpu: GPU 1 (this kernel's GPU) is overloaded: ")
    assert "caused by 2 other processes holding " in text
    assert "(users bob, carol)" in text
    assert re.search(r"Best alternative: move to GPU [023] \(", text)  # the demo load moves
