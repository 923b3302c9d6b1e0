"""An AMD host as real processes see it: the ``autogpu`` command, 32 pickers released at once,
and the too-late check of HIP, over AMD's real ``amdsmi`` binding and the fake ``libamd_smi.so``
(only the AMD fake on the library path: the processes find amdsmi by themselves)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.leasing import DirectoryStore
from tests.brokerhelpers import BrokerProc
from tests.fakeamdsmi import FakeAmdSmi, amd_rocr_uuid, amd_uuid, fleet_amd_8x
from tests.fakehip import INIT_SNIPPET, LOAD_SNIPPET, STATE_SNIPPET, build_fake_hip
from tests.leasehelpers import Gate, child_env, finish_all, start_pickers

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3


@pytest.fixture
def amd_env(fake_amdsmi: FakeAmdSmi, tmp_path: Path) -> dict[str, str]:
    env = child_env(dict(fake_amdsmi.env))
    env.pop("FAKE_NVML_SCENARIO", None)
    env["AUTOGPU_REGISTRY_DIR"] = str(tmp_path / "registry")
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autogpu_jupyter.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_list_finds_the_amd_gpus_by_itself(fake_amdsmi: FakeAmdSmi,
                                          amd_env: dict[str, str]) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    data = json.loads(cli(amd_env, "list", "--json").stdout)
    assert data["backend"] == "amdsmi"
    assert [(d["uuid"], d["name"], d["vendor"]) for d in data["devices"]] == [
        (amd_uuid(i), "AMD Instinct MI300X" if i < 4 else "AMD Instinct MI210", "amd")
        for i in range(8)
    ]
    out = cli(amd_env, "list")
    assert out.stdout.splitlines()[0] == "8 device(s) via amdsmi"


def test_pick_export_sets_the_rocm_variables(fake_amdsmi: FakeAmdSmi,
                                            amd_env: dict[str, str]) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    out = cli(amd_env, "pick", "--min-free", "10G", "--model", "MI210", "--export")
    assert out.returncode == 0, out.stderr
    # GPU 6: the idle MI210
    assert out.stdout.strip() == (
        f"export ROCR_VISIBLE_DEVICES={amd_rocr_uuid(6)}; export HIP_VISIBLE_DEVICES=0; "
        "export CUDA_VISIBLE_DEVICES=0; export GPU_DEVICE_ORDINAL=0;")


def test_run_gives_the_command_its_gpu(fake_amdsmi: FakeAmdSmi, amd_env: dict[str, str]) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    out = cli(amd_env, "run", "--min-free", "100G", "--", sys.executable, "-c",
              "import os; print(*(os.environ[k] for k in ('ROCR_VISIBLE_DEVICES', "
              "'HIP_VISIBLE_DEVICES', 'AUTOGPU_PICKED')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [amd_rocr_uuid(2), "0", amd_uuid(2)]


def test_a_missing_library_is_one_line_and_prints_nothing_else(amd_env: dict[str, str]) -> None:
    env = dict(amd_env, LD_LIBRARY_PATH=str(ROOT / "no-such-dir"), AUTOGPU_BACKEND="amdsmi")
    out = cli(env, "list")
    assert out.returncode == 4
    assert out.stdout == ""  # amdsmi's own prints never reach the user
    assert out.stderr == (
        "autogpu: no AMD GPU driver on this host (libamd_smi.so not found); to try autogpu "
        "without a GPU, set AUTOGPU_SIMULATE=demo-amd (a simulated fleet)\n")


def test_no_loaded_driver_is_one_line(fake_amdsmi: FakeAmdSmi, amd_env: dict[str, str]) -> None:
    fake_amdsmi.write({"driver": "none", "devices": []})
    out = cli(amd_env, "pick")
    assert (out.returncode, out.stdout) == (4, "")
    assert out.stderr == (
        "autogpu: no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded); to "
        "try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-amd (a simulated fleet)\n")


def _four_idle() -> dict[str, Any]:
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = fleet["devices"][:4]
    for d in fleet["devices"]:
        d.update(memory_used=0, utilization_pct=0)
    return fleet


@pytest.mark.slow
def test_32_simultaneous_pickers_on_4_amd_gpus_get_8_each(
    fake_amdsmi: FakeAmdSmi, amd_env: dict[str, str], tmp_path: Path
) -> None:
    fake_amdsmi.write(_four_idle())
    registry = tmp_path / "registry"
    gate = Gate(tmp_path / "gate")
    pickers = start_pickers(
        32, ["--registry", str(registry), "--gate", str(gate.path), "--hold"], amd_env)
    try:
        gate.open()
        results = [p.result() for p in pickers]
        gate.close()
        assert [r["event"] for r in results] == ["picked"] * 32
        assert collections.Counter(r["uuid"] for r in results) == {
            amd_uuid(i): 8 for i in range(4)}
        assert all(r["lease_note"] is None for r in results)
        assert len(DirectoryStore(registry).list_leases()) == 32
    finally:
        finish_all(pickers)
    assert DirectoryStore(registry).list_leases() == []


@pytest.mark.slow
def test_16_pickers_through_the_broker_on_4_amd_gpus_get_4_each(
    fake_amdsmi: FakeAmdSmi, amd_env: dict[str, str], tmp_path: Path
) -> None:
    fake_amdsmi.write(_four_idle())
    (tmp_path / "broker" / "run").mkdir(parents=True)
    broker = BrokerProc(tmp_path / "broker", env=dict(fake_amdsmi.env))
    gate = Gate(tmp_path / "gate")
    try:
        pickers = start_pickers(
            16, ["--broker", str(broker.socket), "--gate", str(gate.path), "--hold"], amd_env)
        try:
            gate.open()
            results = [p.result() for p in pickers]
            gate.close()
            assert [r["event"] for r in results] == ["picked"] * 16, results
            assert collections.Counter(r["uuid"] for r in results) == {
                amd_uuid(i): 4 for i in range(4)}
            assert len(broker.status()["leases"]) == 16
        finally:
            finish_all(pickers)
    finally:
        broker.stop()


def state_after(code: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code + STATE_SNIPPET], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hip_mapped_is_not_initialised_and_hip_init_is(amd_env: dict[str, str]) -> None:
    hsa = str(build_fake_hip().parent / "libhsa-runtime64.so.1")
    assert state_after("", amd_env) == {
        "initialized": False,
        "evidence": "no HIP or ROCr runtime mapped in this process: nothing has initialised HIP",
        "framework": None,
    }
    # what `import torch` does on a ROCm build: HIP and ROCr mapped, nothing initialised
    assert state_after(LOAD_SNIPPET, amd_env) == {
        "initialized": False,
        "evidence": f"ROCr is mapped ({hsa}) but hsa_system_get_info returned "
                    "HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B): hsa_init has not run yet",
        "framework": None,
    }
    assert state_after(INIT_SNIPPET, amd_env) == {
        "initialized": True,
        "evidence": f"hsa_system_get_info returned 0x0 from {hsa}: ROCr (HIP) has started",
        "framework": None,
    }
