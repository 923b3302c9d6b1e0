"""Ray and dask-cuda after ``%gpu pick --count 2`` (docs/usage.md, "Ray and Dask"), for real.

A fresh venv gets this checkout's wheel plus ``ray``, ``dask-cuda`` and ``cuda-bindings`` (which
dask-cuda needs to import) from PyPI. The host is the fake NVIDIA driver (``tests/fakenvml``) with
four GPUs: autogpu, Ray's bundled pynvml and dask-cuda's pynvml all read those four, and a terminal
IPython picks two of them. Then each library starts for real in that process, with nothing but the
environment the pick left:

* Ray: ``ray.init()`` (kept local and light: loopback address, no dashboard, one CPU, no usage
  stats, a temp dir of its own) counts 2 GPUs, not the driver's 4, and two actors with
  ``num_gpus=1`` each get one picked UUID in their ``CUDA_VISIBLE_DEVICES`` and from
  ``ray.get_gpu_ids()``. Every Ray process is stopped afterwards, by pid.
* dask-cuda: ``LocalCUDACluster()`` starts one worker per picked GPU, each with the picked list
  rotated so its own GPU comes first. Its device-specific worker plugins are switched off with
  dask-cuda's own test switch ``DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC=1``: the CPU-affinity plugin
  calls ``nvmlDeviceGetCpuAffinity``, which the fake driver does not have, and RMM needs a real
  device. The worker layout (how many workers, which ``CUDA_VISIBLE_DEVICES`` each gets) does not
  depend on them. The workers log that they cannot create a CUDA context (no ``libcuda`` here);
  dask-cuda carries on without one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakenvml import FakeNvml, fleet_4x
from tests.installhelpers import UV, clean_env, run, uv_venv

pytestmark = pytest.mark.slow

#: Ray 2.8-2.9 cannot parse UUIDs in CUDA_VISIBLE_DEVICES (docs/usage.md, "Ray and Dask").
STACK = ("ray>=2.10", "dask-cuda", "cuda-bindings")
HOST_UUIDS = [d["uuid"] for d in fleet_4x()["devices"]]

#: In the environment under test: the notebook's first cell, in a real (terminal) IPython shell.
PICK = r"""
import contextlib, io, json, os, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    shell.run_line_magic("load_ext", "autogpu")
    shell.run_line_magic("gpu", "pick --count 2")
report = {"pick": out.getvalue(), "picked": os.environ["CUDA_VISIBLE_DEVICES"].split(",")}
"""

RAY = PICK + r"""
import ray
from ray._private.accelerators import get_accelerator_manager_for_resource

nvidia = get_accelerator_manager_for_resource("GPU")
report["driver_gpus"] = nvidia.get_current_node_num_accelerators()  # Ray's own NVML count
ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1,
         _temp_dir=sys.argv[1])
try:
    report["cluster_gpus"] = ray.cluster_resources().get("GPU")

    @ray.remote(num_gpus=1, num_cpus=0)
    class OnOneGpu:
        def seen(self):
            return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(i) for i in ray.get_gpu_ids()]

    actors = [OnOneGpu.remote() for _ in range(2)]  # alive together: two different GPUs
    report["actors"] = ray.get([a.seen.remote() for a in actors], timeout=120)
finally:
    ray.shutdown()
print(json.dumps(report))
"""

DASK = PICK + r"""
from dask_cuda import LocalCUDACluster
from dask_cuda.utils import get_gpu_count
from distributed import Client

report["driver_gpus"] = get_gpu_count()
if __name__ == "__main__":
    with LocalCUDACluster(protocol="tcp", host="127.0.0.1", dashboard_address=None,
                          local_directory=sys.argv[1]) as cluster, Client(cluster) as client:
        report["workers"] = sorted(
            client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"].split(",")).values())
    print(json.dumps(report))
"""


def _processes_of(venv: Path) -> list[int]:
    """Pids of processes running from ``venv`` (its python, Ray's raylet and GCS server)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(venv).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _stop_processes_of(venv: Path) -> list[int]:
    """Stop what is left of the processes this module started (each by its pid); their pids."""
    left = _processes_of(venv)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _processes_of(venv):
            time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def stack(wheel: Path, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(python, home, env) of a fresh venv with the wheel, Ray and dask-cuda, on a fake 4-GPU
    driver. Every process left running from the venv is stopped at the end."""
    home = tmp_path_factory.mktemp("ray-dask")
    fake = FakeNvml(home / "nvml")
    fake.write(fleet_4x())
    env = clean_env(home)
    del env["AUTOGPU_SIMULATE"]  # the fake driver is the host: what Ray and dask-cuda read too
    env.update(fake.env)
    python = uv_venv(home / "venv", sys.executable, env)
    # --refresh-package: this wheel, never a cached one of the same name and version
    run([UV, "pip", "install", "-q", "-p", str(python), "--refresh-package", "autogpu-jupyter",
         str(wheel), *STACK], env, home)
    # Ray keeps its state (a login token) in HOME: the test's own, not the user running it.
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    try:
        yield python, home, env
    finally:
        _stop_processes_of(home / "venv")


def _check_pick(report: dict[str, object]) -> list[str]:
    """The pick took two of the host's four GPUs; their UUIDs, as the pick set them."""
    assert str(report["pick"]).startswith("autogpu: picked 2 devices:"), report["pick"]
    picked = report["picked"]
    assert isinstance(picked, list) and len(set(picked)) == 2, picked
    assert set(picked) <= set(HOST_UUIDS), picked
    return picked


def test_ray_init_after_the_pick_sees_the_picked_gpus(
    stack: tuple[Path, Path, dict[str, str]],
) -> None:
    python, home, env = stack
    # a short temp dir: Ray's Unix sockets live below it (a socket path is at most 107 bytes)
    temp = tempfile.mkdtemp(prefix="autogpu-ray-")
    try:
        proc = run([str(python), "-c", RAY, temp], env, home, timeout=180)
    finally:
        _stop_processes_of(home / "venv")
        shutil.rmtree(temp, ignore_errors=True)
    report = json.loads(proc.stdout.splitlines()[-1])
    picked = _check_pick(report)
    assert report["driver_gpus"] == 4  # Ray's own NVML count: the whole host
    assert report["cluster_gpus"] == 2.0  # ray.init() capped it by the pick's variable
    seen = report["actors"]
    assert sorted(visible for visible, _ in seen) == sorted(picked), seen
    assert [[visible] for visible, _ in seen] == [ids for _, ids in seen], seen


def test_local_cuda_cluster_after_the_pick_has_one_worker_per_picked_gpu(
    stack: tuple[Path, Path, dict[str, str]],
) -> None:
    python, home, env = stack
    local = home / "dask-workers"
    local.mkdir(exist_ok=True)
    proc = run([str(python), "-c", DASK, str(local)],
               {**env, "DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC": "1"}, home, timeout=180)
    report = json.loads(proc.stdout.splitlines()[-1])
    picked = _check_pick(report)
    assert report["driver_gpus"] == 4  # dask-cuda's own NVML count: the whole host
    # one worker per picked GPU, its own first, the other one after it
    assert report["workers"] == sorted([picked, picked[::-1]]), report["workers"]
