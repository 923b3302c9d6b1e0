"""The "Python 3 (autogpu)" kernel on an AMD host: the kernel provisioner (found through its
entry point, as Jupyter finds it) picks over AMD's real ``amdsmi`` binding and the fake
``libamd_smi.so`` before the kernel exists; the kernel's environment is read from
``/proc/<pid>/environ``, what it had before any user code."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leasing import DirectoryStore
from tests.fakeamdsmi import FakeAmdSmi, amd_rocr_uuid, amd_uuid, fleet_amd_8x
from tests.kernelhelpers import kernel_environ

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix(fake_amdsmi: FakeAmdSmi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "prefix" / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                "GPU_DEVICE_ORDINAL", "AUTOGPU_PICKED", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(var, raising=False)
    fake_amdsmi.write(fleet_amd_8x())
    return tmp_path / "prefix"


def kernel_env(fake: FakeAmdSmi) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "FAKE_NVML_SCENARIO"}
    env.update(fake.env)
    env["PYTHONPATH"] = str(REPO)
    return env


def started_env(fake: FakeAmdSmi, name: str) -> dict[str, str]:
    async def main() -> dict[str, str]:
        km = AsyncKernelManager(kernel_name=name)
        await km.start_kernel(env=kernel_env(fake), cwd=str(REPO))
        try:
            return kernel_environ(int(km.provisioner.pid))
        finally:
            await km.shutdown_kernel(now=True)

    return asyncio.run(main())


def test_the_autogpu_kernel_starts_on_its_amd_gpu(fake_amdsmi: FakeAmdSmi, prefix: Path) -> None:
    kernelspec.install("agp", "Python 3 (agp)", {"min_free": "10G", "model": "MI210"},
                       prefix=str(prefix))
    seen: list[tuple[str, ...]] = []

    async def main() -> dict[str, str]:
        km = AsyncKernelManager(kernel_name="agp")
        await km.start_kernel(env=kernel_env(fake_amdsmi), cwd=str(REPO))
        try:
            (lease,) = DirectoryStore(os.environ["AUTOGPU_REGISTRY_DIR"]).list_leases()
            seen.append(lease.device_uuids)
            return kernel_environ(int(km.provisioner.pid))
        finally:
            await km.shutdown_kernel(now=True)

    env = asyncio.run(main())
    assert seen == [(amd_uuid(6),)]  # the idle MI210, leased for the kernel
    assert {k: env.get(k) for k in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                    "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
                                    "AUTOGPU_PICKED")} == {
        "ROCR_VISIBLE_DEVICES": amd_rocr_uuid(6), "HIP_VISIBLE_DEVICES": "0",
        "CUDA_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0", "AUTOGPU_PICKED": amd_uuid(6)}


def test_nothing_fits_starts_the_kernel_without_any_amd_gpu(
    fake_amdsmi: FakeAmdSmi, prefix: Path
) -> None:
    kernelspec.install("big", "Python 3 (big)", {"min_free": "500G"}, prefix=str(prefix))
    env = started_env(fake_amdsmi, "big")
    # an empty CUDA_VISIBLE_DEVICES alone would hide nothing from HIP: ROCr's variable does
    assert env["ROCR_VISIBLE_DEVICES"] == ""
    assert env["AUTOGPU_PICK_NOTE"].startswith("no device fits: kernel started CPU-only")
