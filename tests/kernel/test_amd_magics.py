"""``%gpu`` / ``%%gpu`` in a REAL IPython kernel on an AMD host: AMD's real ``amdsmi`` binding over
the fake ``libamd_smi.so`` (found by the kernel by itself: only the AMD fake is on its library
path), and the fake HIP runtime (``tests/fakehip``) for what happens when ROCm starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakeamdsmi import FakeAmdSmi, amd_rocr_uuid, fleet_amd_8x
from tests.fakehip import INIT_SNIPPET, LOAD_SNIPPET, build_fake_hip
from tests.kernelhelpers import Kernel, kernel_env

VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL", "CUDA_DEVICE_ORDER")
NONE: dict[str, str | None] = dict.fromkeys(VARS)


def picked(i: int) -> dict[str, str | None]:
    return {"ROCR_VISIBLE_DEVICES": amd_rocr_uuid(i), "HIP_VISIBLE_DEVICES": "0",
            "CUDA_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0", "CUDA_DEVICE_ORDER": None}


def env_in(kernel: Kernel) -> dict[str, str | None]:
    r = kernel.run("import json as _j, os as _o\n"
                   f"print(_j.dumps({{k: _o.environ.get(k) for k in {VARS!r}}}))")
    assert r.status == "ok", r
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def amd_kernel(base: Path) -> tuple[FakeAmdSmi, Kernel]:
    fake = FakeAmdSmi(base / "amd")
    fake.write(fleet_amd_8x())
    env = kernel_env({**fake.env, "AUTOGPU_REGISTRY_DIR": str(base / "registry")})
    for name in ("FAKE_NVML_SCENARIO", "AUTOGPU_BACKEND", *VARS):
        env.pop(name, None)
    kernel = Kernel(env)
    r = kernel.run("%load_ext autogpu")
    assert r.status == "ok", r
    return fake, kernel


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fake, kernel = amd_kernel(tmp_path_factory.mktemp("amd-kernel"))
    try:
        yield {"fake": fake, "kernel": kernel}
    finally:
        kernel.close()


@pytest.fixture
def k(host: dict[str, Any]) -> Iterator[Kernel]:
    host["fake"].write(fleet_amd_8x())
    kernel: Kernel = host["kernel"]
    kernel.run("%gpu release")
    kernel.run("from autogpu_jupyter.core.sampler import stop_sampler as _ss\n_ss()")
    assert env_in(kernel) == NONE
    yield kernel


def test_pick_sets_the_rocm_variables_and_release_restores_them(k: Kernel) -> None:
    r = k.run("%gpu pick --min-free 10G")
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    # GPU 2 (the idle MI300X) is the least loaded; ROCr's UUID names it, HIP counts from 0
    # the short id shown is the start of what ROCR_VISIBLE_DEVICES is set to (issue 41)
    shown = amd_rocr_uuid(2)[:12]
    assert lines[0] == (f"autogpu: picked GPU 2 · AMD Instinct MI300X · {shown}: "
                        "192.0 GiB free of 192.0 GiB, util 0%")
    assert lines[-1] == f"  ROCR_VISIBLE_DEVICES={amd_rocr_uuid(2)} HIP_VISIBLE_DEVICES=0"
    assert env_in(k) == picked(2)
    r = k.run("%gpu release")
    assert r.stdout.startswith("autogpu: released GPU 2 and its lease; ROCR_VISIBLE_DEVICES is "
                               "unset again"), r
    assert env_in(k) == NONE


def test_model_and_cell_magic_on_amd(k: Kernel) -> None:
    r = k.run("%%gpu --min-free 10G --model MI210\nx = 1")
    assert r.status == "ok", r
    assert env_in(k) == picked(6)  # the idle MI210


def test_an_inherited_grant_is_never_widened(k: Kernel) -> None:
    # what Slurm writes for a job holding GPUs 1 and 3 (gres.conf Flags=amd_gpu_env)
    k.run("import os\nos.environ.update(SLURM_STEP_GPUS='1,3', ROCR_VISIBLE_DEVICES='1,3')")
    r = k.run("%gpu pick")
    assert r.status == "ok", r
    assert env_in(k) == picked(3)  # GPU 3 (60 %) over GPU 1 (96 %), never the idle GPU 2
    k.run("%gpu release")
    env = env_in(k)
    assert env["ROCR_VISIBLE_DEVICES"] == "1,3"
    k.run("os.environ.pop('SLURM_STEP_GPUS'); os.environ.pop('ROCR_VISIBLE_DEVICES')")


def test_refuses_after_hip_initialised(tmp_path: Path) -> None:
    build_fake_hip()
    _fake, kernel = amd_kernel(tmp_path)
    try:
        # `import torch` on ROCm maps HIP (and ROCr) but initialises nothing: still in time
        assert kernel.run(LOAD_SNIPPET).status == "ok"
        r = kernel.run("%gpu pick --min-free 10G")
        assert r.status == "ok", r
        assert env_in(kernel) == picked(2)
        # the first GPU call initialises HIP, which reads the variables autogpu set: GPU 2 is
        # HIP's device 0
        r = kernel.run(INIT_SNIPPET + "import ctypes\n"
                       "for f in (_fake_hip.fakeHipInitVisibleDevices,):\n"
                       "    f.restype = ctypes.c_char_p\n"
                       "_hsa = ctypes.CDLL(_fake_hip._name.replace('libamdhip64.so', "
                       "'libhsa-runtime64.so.1'))\n"
                       "_hsa.fakeHsaInitVisibleDevices.restype = ctypes.c_char_p\n"
                       "print(_hsa.fakeHsaInitVisibleDevices().decode(), "
                       "_fake_hip.fakeHipInitVisibleDevices().decode())")
        assert r.stdout.split() == [amd_rocr_uuid(2), "0"], r
        r = kernel.run("%gpu pick --min-free 10G --model MI210")
        assert r.status == "error"
        assert r.error is not None and r.error[0] == "UsageError"
        assert "HIP (ROCm) is already initialised in this kernel (hsa_system_get_info " in (
            r.stderr)
        assert "nothing was changed" in r.stderr
        assert env_in(kernel) == picked(2)  # unchanged
        r = kernel.run("%gpu release")
        assert r.stdout.splitlines()[-1] == (
            "  HIP (ROCm) is already initialised in this kernel: it keeps using GPU 2 until you "
            "restart the kernel"), r
    finally:
        kernel.close()
