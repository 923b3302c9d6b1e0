"""On a real NVIDIA machine: our snapshot against ``nvidia-smi``, and ``%gpu pick`` against the
device a framework really opens. Marked ``gpu``. Where no NVIDIA driver is installed (no
``nvidia-smi``) they are skipped, and reported as skipped. A driver that is there but broken
(``nvidia-smi`` fails) fails them, and so does a missing driver where one is expected
(``AUTOGPU_EXPECT_GPU=1``, which ``scripts/gpu-check.sh`` sets): a broken GPU machine must not read
as "skipped". The framework checks need torch or cupy: without either they skip, except where a
GPU is expected, where they fail (a GPU check that never opened the device proves nothing).
``scripts/gpu-check.sh`` runs exactly these and prints what they saw.

Everything runs in subprocesses / kernels with a clean environment, never in the test process:
other test modules may have loaded the fake ``libnvidia-ml.so.1`` into it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernelhelpers import REPO, Kernel

pytestmark = pytest.mark.gpu

MiB = 1024**2
FAKE_VARS = (
    "FAKE_NVML_SCENARIO",
    "AUTOGPU_SIMULATE",
    "LD_PRELOAD",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "AUTOGPU_PICKED",
    "NVIDIA_VISIBLE_DEVICES",
)


def real_env(tmp: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FAKE_VARS}
    ld = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and "fake" not in p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    env["PYTHONPATH"] = str(REPO)
    if tmp is not None:
        env["AUTOGPU_REGISTRY_DIR"] = str(tmp / "registry")
    return env


def _driver_problem() -> tuple[str | None, bool]:
    """What keeps the driver from being used (``None``: nothing), and whether it is installed."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA driver here (nvidia-smi not found)", False
    try:
        proc = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            check=False,
            env=real_env(),
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "nvidia-smi -L hung for 60 s", True
    if proc.returncode != 0 or "GPU " not in proc.stdout:
        out = (proc.stderr or proc.stdout).strip()[:200]
        return f"nvidia-smi -L failed (exit status {proc.returncode}): {out}", True
    return None, True


_PROBLEM, _INSTALLED = _driver_problem()
_EXPECTED = os.environ.get("AUTOGPU_EXPECT_GPU") == "1"
if _PROBLEM and not _INSTALLED and not _EXPECTED:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=_PROBLEM)]


@pytest.fixture(autouse=True)
def _driver_works() -> None:
    """A broken driver, or none where one is expected, fails each test instead of skipping it."""
    if _PROBLEM:
        why = "AUTOGPU_EXPECT_GPU=1" if not _INSTALLED else "nvidia-smi is installed"
        pytest.fail(f"{_PROBLEM} ({why}: a working NVIDIA driver was expected)", pytrace=False)

SNAPSHOT = (
    "import json\n"
    "from autogpu_jupyter.core.backends.nvml import NvmlBackend\n"
    "print(json.dumps(NvmlBackend().snapshot().to_dict()))\n"
)


def test_snapshot_matches_nvidia_smi() -> None:
    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=real_env(),
        timeout=60,
    ).stdout
    ours = subprocess.run(
        [sys.executable, "-c", SNAPSHOT],
        capture_output=True,
        text=True,
        check=True,
        env=real_env(),
        timeout=120,
        cwd=REPO,
    ).stdout
    devices = [d for d in json.loads(ours)["devices"] if not d["is_mig"]]
    rows = [[c.strip() for c in line.split(",")] for line in smi.strip().splitlines()]
    print("nvidia-smi:", rows)
    print(
        "autogpu:   ",
        [
            (d["index"], d["uuid"], d["name"], d["memory_total_bytes"], d["memory_used_bytes"])
            for d in devices
        ],
    )
    assert [int(r[0]) for r in rows] == [d["index"] for d in devices]
    assert [r[1] for r in rows] == [d["uuid"] for d in devices]
    assert [r[2] for r in rows] == [d["name"] for d in devices]
    for r, d in zip(rows, devices, strict=True):
        assert abs(int(r[3]) - d["memory_total_bytes"] // MiB) <= 1, (r, d)
        # used memory moves between the two reads; both exclude driver-reserved memory on R510+
        assert abs(int(r[4]) - d["memory_used_bytes"] // MiB) <= 512, (r, d)


FRAMEWORK_UUID = """
import json
try:
    import torch
    props = torch.cuda.get_device_properties(0)
    uuid = str(props.uuid)
    fw = 'torch'
except ImportError:
    import cupy, uuid as _u
    raw = cupy.cuda.runtime.getDeviceProperties(0)['uuid']
    uuid = str(_u.UUID(bytes=bytes(raw)))
    fw = 'cupy'
print(json.dumps({'framework': fw, 'uuid': uuid}))
"""


def _have_framework() -> str | None:
    for name in ("torch", "cupy"):
        proc = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            capture_output=True,
            env=real_env(),
            check=False,
            timeout=120,
        )
        if proc.returncode == 0:
            return name
    return None


@pytest.fixture
def framework() -> str:
    """torch or cupy, whichever this environment has. Neither: the test skips, or fails where a
    GPU is expected (``AUTOGPU_EXPECT_GPU=1``)."""
    name = _have_framework()
    if name is None:
        why = "neither torch nor cupy is installed in this environment"
        if _EXPECTED:
            pytest.fail(f"{why} (AUTOGPU_EXPECT_GPU=1: the framework checks must run; install "
                        "torch or cupy, or set AUTOGPU_EXPECT_GPU=0)", pytrace=False)
        pytest.skip(why)
    return name


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(real_env(tmp_path))
    try:
        assert k.run("%load_ext autogpu").status == "ok"
        yield k
    finally:
        k.close()


def test_framework_opens_the_picked_device(framework: str, kernel: Kernel) -> None:
    r = kernel.run("%gpu pick")
    print(r.stdout)
    assert r.status == "ok", r
    picked = kernel.env()["CUDA_VISIBLE_DEVICES"]
    assert picked and picked.startswith(("GPU-", "MIG-"))
    r = kernel.run(FRAMEWORK_UUID)
    assert r.status == "ok", r
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    print("picked", picked, "opened by", seen["framework"], seen["uuid"])
    # torch / cupy print the bare UUID; NVML and CUDA_VISIBLE_DEVICES prefix it with GPU- / MIG-
    assert picked.split("-", 1)[1] == seen["uuid"].removeprefix("GPU-").removeprefix("MIG-")


def test_pick_after_cuda_is_available_is_refused(framework: str, kernel: Kernel) -> None:
    code = (
        "import torch; print(torch.cuda.is_available())"
        if framework == "torch"
        else "import cupy; print(cupy.cuda.runtime.getDeviceCount() > 0)"
    )
    r = kernel.run(code)
    assert r.status == "ok" and r.stdout.strip() == "True", r
    r = kernel.run("%gpu pick")
    print(r.stderr)
    assert r.error is not None and r.error[0] == "UsageError", r
    assert r.stderr.startswith("UsageError: CUDA is already initialised in this kernel")
    assert kernel.env() == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}
