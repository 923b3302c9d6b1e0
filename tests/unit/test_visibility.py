"""core.visibility: the inherited allocation, read by CUDA's rules (pitfalls.md cases 1-7, 20, 21).

Visibility is pure given the device list, so these tests build the NVML listing themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.visibility import (
    Allocation,
    current_allocation,
    parse_cuda_visible_devices,
    visible_env,
)
from autogpu_jupyter.errors import UsageErrorBase
from tests.fakenvml import FakeNvml, fleet_4x, fleet_mig

ROOT = Path(__file__).resolve().parents[2]

A100 = "NVIDIA A100-SXM4-80GB"
L4 = "NVIDIA L4"
U0 = "GPU-5a1c0e2f-1111-2222-3333-000000000000"
U1 = "GPU-5a2d7b31-1111-2222-3333-111111111111"
U2 = "GPU-7b004c55-1111-2222-3333-222222222222"
U3 = "GPU-9e3f10aa-1111-2222-3333-333333333333"
MIG_A = "MIG-1f2e3d4c-aaaa-5555-6666-000000000000"
MIG_B = "MIG-1f9a8b7c-bbbb-5555-6666-111111111111"


def gpu(index: int, uuid: str, name: str = A100, **kw: object) -> DeviceSnapshot:
    return DeviceSnapshot(index=index, uuid=uuid, name=name, **kw)  # type: ignore[arg-type]


@pytest.fixture
def fleet() -> list[DeviceSnapshot]:
    """Four GPUs, two models (two A100 then two L4 in PCI order)."""
    return [gpu(0, U0), gpu(1, U1), gpu(2, U2, L4), gpu(3, U3, L4)]


@pytest.fixture
def same_model() -> list[DeviceSnapshot]:
    return [gpu(0, U0), gpu(1, U1), gpu(2, U2), gpu(3, U3)]


@pytest.fixture
def mig_fleet() -> list[DeviceSnapshot]:
    """GPU 0 in MIG mode with two MIG devices, GPU 1 a whole card."""
    return [
        gpu(0, U0, mig_enabled=True),
        gpu(0, MIG_A, f"{A100} MIG 3g.40gb", is_mig=True, parent_uuid=U0, mig_index=0),
        gpu(0, MIG_B, f"{A100} MIG 3g.40gb", is_mig=True, parent_uuid=U0, mig_index=1),
        gpu(1, U1),
    ]


PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def alloc(devices: list[DeviceSnapshot], **env: str) -> Allocation:
    return current_allocation(devices, {**PCI, **env})


# ---------------------------------------------------------------- case 1: CVD unset


def test_unset_grants_every_gpu_and_writes_full_uuids(fleet: list[DeviceSnapshot]) -> None:
    a = current_allocation(fleet, {})
    assert a == Allocation(source=None, raw=None, uuids=None, notes=())
    assert a.unrestricted and not a.empty
    assert all(a.allows(d) for d in fleet)
    assert a.describe() == (
        "no GPU restriction (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES and SLURM_*_GPUS set "
        "no limit): every GPU is granted"
    )
    assert visible_env([U2, U0]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": f"{U2},{U0}",
    }


# ---------------------------------------------------------------- case 2: none granted


@pytest.mark.parametrize(
    ("value", "note"),
    [
        ("", "CUDA_VISIBLE_DEVICES is set but empty: CUDA shows no GPU"),
        ("  ", "CUDA_VISIBLE_DEVICES is set but empty: CUDA shows no GPU"),
        ("-1", "CUDA_VISIBLE_DEVICES='-1' hides every GPU from CUDA"),
        (
            "NoDevFiles",
            "CUDA_VISIBLE_DEVICES='NoDevFiles' (Slurm's value for a job without GPUs): "
            "CUDA shows no GPU",
        ),
    ],
)
def test_no_device_values(fleet: list[DeviceSnapshot], value: str, note: str) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES=value)
    assert a.empty
    assert a.uuids == ()
    assert a.notes == (note,)
    assert a.source == "CUDA_VISIBLE_DEVICES"
    assert a.raw == value
    assert not any(a.allows(d) for d in fleet)
    assert a.describe() == f"CUDA_VISIBLE_DEVICES={value!r} grants no GPU to this process ({note})"


# ---------------------------------------------------------------- case 3: stop at invalid, order


def test_stops_at_first_invalid_entry(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="0,2,-1,1")
    assert a.uuids == (U0, U2)
    assert a.labels == ("GPU 0", "GPU 2")
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at '-1' (a negative index); later entries are ignored, "
        "as CUDA does",
    )
    assert a.describe() == "CUDA_VISIBLE_DEVICES='0,2,-1,1' grants GPU 0, GPU 2"
    assert [a.allows(d) for d in fleet] == [True, False, True, False]


def test_order_is_kept_and_choice_stays_inside(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="2,1")
    assert a.uuids == (U2, U1)
    assert a.notes == ()
    assert a.describe() == "CUDA_VISIBLE_DEVICES='2,1' grants GPU 2, GPU 1"
    assert [d.index for d in fleet if a.allows(d)] == [1, 2]


def test_whitespace_and_leading_digits(fleet: list[DeviceSnapshot]) -> None:
    assert alloc(fleet, CUDA_VISIBLE_DEVICES=" 1 , 3 ").uuids == (U1, U3)
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="0-2")
    assert a.uuids == (U0,)
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: '0-2' read as 0: CUDA reads only the leading digits "
        "(there are no ranges)",
    )
    assert alloc(fleet, CUDA_VISIBLE_DEVICES="3,x,1").uuids == (U3,)
    assert alloc(fleet, CUDA_VISIBLE_DEVICES="1,,2").notes == (
        "CUDA_VISIBLE_DEVICES: stopped at '' (an empty entry); later entries are ignored, "
        "as CUDA does",
    )


# ---------------------------------------------------------------- case 4: duplicates, past the end


@pytest.mark.parametrize("value", ["0,0", "0,00", "0, 0", "0,5,0"])
def test_duplicates_give_empty(fleet: list[DeviceSnapshot], value: str) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES=value)
    assert a.empty
    dup = value.split(",")[0].strip()
    assert a.notes == (
        f"CUDA_VISIBLE_DEVICES: device {int(dup)} is listed twice; CUDA then shows no GPU at all",
    )
    assert a.describe() == (
        f"CUDA_VISIBLE_DEVICES={value!r} grants no GPU to this process ({a.notes[0]})"
    )


def test_index_past_last_gpu(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="7")
    assert a.empty
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at '7' (no GPU with index 7; this host shows 4: 0-3); "
        "later entries are ignored, as CUDA does",
    )
    b = alloc(fleet, CUDA_VISIBLE_DEVICES="0,7,1")
    assert b.uuids == (U0,)
    assert b.describe() == "CUDA_VISIBLE_DEVICES='0,7,1' grants GPU 0"


def test_parse_function_directly(fleet: list[DeviceSnapshot]) -> None:
    assert parse_cuda_visible_devices("3,0", fleet) == ((U3, U0), ())
    assert parse_cuda_visible_devices("0", []) == (
        (),
        (
            "CUDA_VISIBLE_DEVICES: stopped at '0' (no GPU with index 0; this host shows no GPU); "
            "later entries are ignored, as CUDA does",
        ),
    )


# ---------------------------------------------------------------- case 5: UUIDs and prefixes


def test_full_uuid_and_unique_prefix(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES=f"{U3},GPU-5a1")
    assert a.uuids == (U3, U0)
    assert a.notes == ()
    assert a.describe() == f"CUDA_VISIBLE_DEVICES='{U3},GPU-5a1' grants GPU 3, GPU 0"


def test_ambiguous_prefix_ends_the_list(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="GPU-7b,GPU-5a,GPU-9e")
    assert a.uuids == (U2,)
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at 'GPU-5a' (ambiguous UUID prefix: it matches 2 devices "
        "(GPU 0, GPU 1)); later entries are ignored, as CUDA does",
    )


def test_unknown_uuid_ends_the_list(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="GPU-ffff,GPU-7b")
    assert a.empty
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at 'GPU-ffff' (no device has that UUID or UUID prefix); "
        "later entries are ignored, as CUDA does",
    )


def test_mixing_indices_and_uuids_ends_at_the_switch(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES="1,GPU-7b,3")
    assert a.uuids == (U1,)
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at 'GPU-7b' (a UUID after indices: CUDA does not allow "
        "mixing indices and UUIDs); later entries are ignored, as CUDA does",
    )
    b = alloc(fleet, CUDA_VISIBLE_DEVICES="GPU-7b,1")
    assert b.uuids == (U2,)
    assert b.notes == (
        "CUDA_VISIBLE_DEVICES: stopped at '1' (an index after UUIDs: CUDA does not allow mixing "
        "indices and UUIDs); later entries are ignored, as CUDA does",
    )


def test_same_device_by_uuid_and_prefix_is_a_duplicate(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, CUDA_VISIBLE_DEVICES=f"{U2},GPU-7b")
    assert a.empty
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES: 'GPU-7b' names GPU 2 again; CUDA then shows no GPU at all",
    )


# ---------------------------------------------------------------- case 6: MIG


def test_two_mig_uuids_grant_those_mig_devices_never_the_parent(
    mig_fleet: list[DeviceSnapshot],
) -> None:
    parent, mig_a, mig_b, other = mig_fleet
    a = alloc(mig_fleet, CUDA_VISIBLE_DEVICES=f"{MIG_A},{MIG_B}")
    assert a.uuids == (MIG_A, MIG_B)
    assert a.labels == ("GPU 0 MIG 0", "GPU 0 MIG 1")
    assert (a.allows(parent), a.allows(mig_a), a.allows(mig_b), a.allows(other)) == (
        False,
        True,
        True,
        False,
    )
    assert a.notes == (
        "2 MIG devices granted; CUDA uses one MIG device per process, so a pick uses one of them",
    )


def test_mig_prefix_and_parent_index(mig_fleet: list[DeviceSnapshot]) -> None:
    assert alloc(mig_fleet, CUDA_VISIBLE_DEVICES="MIG-1f9").uuids == (MIG_B,)
    a = alloc(mig_fleet, CUDA_VISIBLE_DEVICES="0")
    assert a.uuids == (U0,)
    assert [a.allows(d) for d in mig_fleet] == [True, True, True, False]
    # indices count whole GPUs only: index 1 is the second card, not a MIG device
    assert alloc(mig_fleet, CUDA_VISIBLE_DEVICES="1").uuids == (U1,)


def test_one_granted_mig_device_never_grants_its_parent(mig_fleet: list[DeviceSnapshot]) -> None:
    # The runtime granted one MIG slice; CVD=0 names the whole card, which is not granted.
    a = alloc(mig_fleet, NVIDIA_VISIBLE_DEVICES=MIG_A, CUDA_VISIBLE_DEVICES="0")
    assert a.uuids == ()
    assert [a.allows(d) for d in mig_fleet] == [False, False, False, False]
    assert a.notes == (
        "GPU 0 (from CUDA_VISIBLE_DEVICES) is outside the allocation of NVIDIA_VISIBLE_DEVICES: "
        "dropped",
    )
    # The slice itself, named by CVD, stays granted.
    assert alloc(mig_fleet, NVIDIA_VISIBLE_DEVICES=MIG_A, CUDA_VISIBLE_DEVICES=MIG_A).uuids == (
        MIG_A,
    )


def test_legacy_mig_form_is_rejected_with_a_note(mig_fleet: list[DeviceSnapshot]) -> None:
    a = alloc(mig_fleet, CUDA_VISIBLE_DEVICES=f"MIG-{U0}/1/0")
    assert a.empty
    assert a.notes == (
        f"CUDA_VISIBLE_DEVICES: stopped at 'MIG-{U0}/1/0': the legacy MIG-GPU-<uuid>/<gi>/<ci> "
        "form is not supported; use the MIG UUID that `nvidia-smi -L` prints (MIG-…)",
    )


def test_gpu_and_mig_uuids_do_not_mix(mig_fleet: list[DeviceSnapshot]) -> None:
    a = alloc(mig_fleet, CUDA_VISIBLE_DEVICES=f"{U1},{MIG_A}")
    assert a.uuids == (U1,)
    assert a.notes == (
        f"CUDA_VISIBLE_DEVICES: stopped at '{MIG_A}' (a MIG- UUID after GPU- UUIDs: CUDA does not "
        "allow mixing them); later entries are ignored, as CUDA does",
    )


# ---------------------------------------------------------------- case 7: device order


FASTEST_FIRST_NOTE = (
    "CUDA_VISIBLE_DEVICES='1' uses indices and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA "
    "numbers GPUs fastest first; this host mixes models (NVIDIA A100-SXM4-80GB, NVIDIA L4), so "
    "CUDA's index may name another GPU than NVML's: read here in PCI bus order (nvidia-smi's). "
    "UUIDs avoid the ambiguity"
)


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST"])
def test_fastest_first_with_mixed_models_adds_a_note(
    fleet: list[DeviceSnapshot], order: str | None
) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    if order:
        env["CUDA_DEVICE_ORDER"] = order
    a = current_allocation(fleet, env)
    assert a.uuids == (U1,)
    assert a.notes == (FASTEST_FIRST_NOTE,)


def test_no_order_note_when_unambiguous(
    fleet: list[DeviceSnapshot], same_model: list[DeviceSnapshot]
) -> None:
    assert alloc(fleet, CUDA_VISIBLE_DEVICES="1").notes == ()  # PCI_BUS_ID set
    assert current_allocation(same_model, {"CUDA_VISIBLE_DEVICES": "1"}).notes == ()
    assert current_allocation(fleet, {"CUDA_VISIBLE_DEVICES": U1}).notes == ()  # UUIDs


def test_written_env_names_the_picked_device_by_uuid(fleet: list[DeviceSnapshot]) -> None:
    # Under FASTEST_FIRST an index could open another card; the UUID cannot.
    env = visible_env([U2])
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": U2}
    assert current_allocation(fleet, env).uuids == (U2,)


@pytest.mark.parametrize("bad", [["2"], ["GPU-"], [" GPU-1"], ["GPU-1,GPU-2"]])
def test_visible_env_refuses_anything_but_full_uuids(bad: list[str]) -> None:
    with pytest.raises(UsageErrorBase) as err:
        visible_env(bad)
    assert str(err.value) == (
        f"not a full device UUID: {bad[0]!r}; expected UUIDs such as 'GPU-5a1c...' or "
        "'MIG-...' as nvidia-smi -L prints them"
    )


# ---------------------------------------------------------------- case 20: Slurm


def test_slurm_job_gpus_with_relative_cvd_never_leaves_the_allocation(
    fleet: list[DeviceSnapshot],
) -> None:
    # NVML shows all four GPUs; Slurm granted global GPU 3 and wrote CVD relative to the job.
    a = alloc(fleet, SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES="0")
    assert a.uuids == (U3,)
    assert a.source == "SLURM_JOB_GPUS + CUDA_VISIBLE_DEVICES"
    assert a.raw == "3 + 0"
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES='0' read relative to the job's GPUs (SLURM_JOB_GPUS='3'), as Slurm "
        "writes it under a device cgroup: GPU 3",
    )
    assert a.describe() == "SLURM_JOB_GPUS='3' and CUDA_VISIBLE_DEVICES='0' grant GPU 3"
    assert [d.index for d in fleet if a.allows(d)] == [3]


def test_slurm_under_device_cgroup_nvml_shows_only_the_job(fleet: list[DeviceSnapshot]) -> None:
    # With ConstrainDevices NVML shows just the job's GPU, numbered 0.
    only = [gpu(0, U3, L4)]
    a = alloc(only, SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES="0")
    assert a.uuids == (U3,)
    assert a.notes == (
        "SLURM_JOB_GPUS='3': NVML shows exactly the job's 1 GPU(s) (device cgroup), so all of "
        "them are granted",
    )


def test_slurm_global_cvd(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="1,3")
    assert a.uuids == (U1, U3)
    assert a.notes == ()
    b = alloc(fleet, SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="0,1")
    assert b.uuids == (U1, U3)  # relative: the job's first and second GPU


def test_slurm_ambiguous_cvd_is_read_global_and_says_so(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="1")
    assert a.uuids == (U1,)
    assert a.notes == (
        "CUDA_VISIBLE_DEVICES='1' read as global ids inside SLURM_JOB_GPUS='1,3' (GPU 1); read "
        "relative to the job it would be GPU 3",
    )


def test_slurm_alone_and_ranges(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="1,3")
    assert (a.uuids, a.source, a.describe()) == (
        (U1, U3),
        "SLURM_JOB_GPUS",
        "SLURM_JOB_GPUS='1,3' grants GPU 1, GPU 3",
    )
    assert alloc(fleet, SLURM_JOB_GPUS="0-2").uuids == (U0, U1, U2)
    step = alloc(fleet, SLURM_JOB_GPUS="0-2", SLURM_STEP_GPUS="2")
    assert (step.uuids, step.source) == ((U2,), "SLURM_STEP_GPUS")


def test_slurm_ids_nvml_does_not_list_grant_nothing(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="5", CUDA_VISIBLE_DEVICES="0")
    assert a.empty
    assert a.notes[0] == (
        "SLURM_JOB_GPUS='5' names GPUs that do not match what NVML shows (this host shows 4: "
        "0-3): cannot tell which GPUs are the job's, so none is granted"
    )
    assert a.notes[1:] == (
        "GPU 0 (from CUDA_VISIBLE_DEVICES) is outside the allocation of SLURM_JOB_GPUS: dropped",
    )
    bad = alloc(fleet, SLURM_JOB_GPUS="gpu:2")
    assert bad.empty
    assert bad.notes == (
        "SLURM_JOB_GPUS='gpu:2' is not a list of GPU ids (expected e.g. '0,2' or '0-3'): no GPU "
        "granted rather than guessing",
    )


def test_slurm_with_uuid_cvd_outside_is_dropped(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES=f"{U0},{U3}")
    assert a.uuids == (U3,)
    assert a.notes == (
        "GPU 0 (from CUDA_VISIBLE_DEVICES) is outside the allocation of SLURM_JOB_GPUS: dropped",
    )


def test_slurm_relative_cvd_past_the_job(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="2", CUDA_VISIBLE_DEVICES="0,1")
    assert a.uuids == (U2,)
    assert a.notes[0] == (
        "CUDA_VISIBLE_DEVICES: stopped at '1' (no GPU with index 1; the job has 1: 0); later "
        "entries are ignored, as CUDA does"
    )


# ---------------------------------------------------------------- case 21: NVIDIA_VISIBLE_DEVICES


@pytest.mark.parametrize("value", ["none", "void", "", "None"])
def test_nvidia_visible_devices_none(fleet: list[DeviceSnapshot], value: str) -> None:
    a = alloc(fleet, NVIDIA_VISIBLE_DEVICES=value)
    assert a.empty
    assert a.notes == (
        f"NVIDIA_VISIBLE_DEVICES={value!r}: the container runtime gives this container no GPU",
    )
    assert a.describe() == (
        f"NVIDIA_VISIBLE_DEVICES={value!r} grants no GPU to this process ({a.notes[0]})"
    )


def test_nvidia_visible_devices_all_is_unrestricted(fleet: list[DeviceSnapshot]) -> None:
    assert alloc(fleet, NVIDIA_VISIBLE_DEVICES="all") == Allocation(None, None, None, ())


def test_nvidia_visible_devices_uuids_narrow(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, NVIDIA_VISIBLE_DEVICES=f"{U1},{U2}")
    assert a.uuids == (U1, U2)
    both = alloc(fleet, NVIDIA_VISIBLE_DEVICES=f"{U1},{U2}", CUDA_VISIBLE_DEVICES="2,0")
    assert both.uuids == (U2,)
    assert both.notes == (
        "GPU 0 (from CUDA_VISIBLE_DEVICES) is outside the allocation of NVIDIA_VISIBLE_DEVICES: "
        "dropped",
    )


def test_nvidia_visible_devices_host_indices(fleet: list[DeviceSnapshot]) -> None:
    # inside a container showing two GPUs, renumbered 0 and 1: host indices 2,3 already applied
    inside = [gpu(0, U2, L4), gpu(1, U3, L4)]
    a = alloc(inside, NVIDIA_VISIBLE_DEVICES="2,3")
    assert a.uuids is None
    assert a.notes == (
        "NVIDIA_VISIBLE_DEVICES='2,3' lists host indices and NVML shows exactly 2 GPU(s): the "
        "container runtime already applied it",
    )
    # leaked onto a host that shows every GPU: read as NVML indices
    b = alloc(fleet, NVIDIA_VISIBLE_DEVICES="2,3")
    assert b.uuids == (U2, U3)


def test_nvidia_visible_devices_none_beats_cvd(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, NVIDIA_VISIBLE_DEVICES="none", CUDA_VISIBLE_DEVICES="0")
    assert a.empty
    assert a.describe().startswith(
        "NVIDIA_VISIBLE_DEVICES='none' and CUDA_VISIBLE_DEVICES='0' grant no GPU to this process"
    )


# ---------------------------------------------------------------- through the real NVML backend


NVML_SCRIPT = (
    "import json\n"
    "from autogpu_jupyter.core.backends.nvml import NvmlBackend\n"
    "from autogpu_jupyter.core.visibility import current_allocation\n"
    "devices = NvmlBackend().snapshot().devices\n"
    "a = current_allocation(devices)\n"  # this process's own os.environ
    "print(json.dumps({'uuids': a.uuids, 'describe': a.describe(),\n"
    "                  'allowed': [d.label for d in devices if a.allows(d)]}))\n"
)


def nvml_allocation(fake_nvml: FakeNvml, **env: str) -> dict[str, object]:
    """current_allocation() over the real pynvml binding and the fake libnvidia-ml.so.1."""
    from autogpu_jupyter.core.backends.nvml import NvmlBackend

    devices = NvmlBackend().snapshot().devices
    a = current_allocation(devices, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **env})
    return {
        "uuids": None if a.uuids is None else list(a.uuids),
        "describe": a.describe(),
        "allowed": [d.label for d in devices if a.allows(d)],
    }


def test_nvml_backend_stops_at_invalid_entry(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fake_nvml.write(fleet)
    uuids = [d["uuid"] for d in fleet["devices"]]
    assert nvml_allocation(fake_nvml, CUDA_VISIBLE_DEVICES="0,2,-1,1") == {
        "uuids": [uuids[0], uuids[2]],
        "describe": "CUDA_VISIBLE_DEVICES='0,2,-1,1' grants GPU 0, GPU 2",
        "allowed": ["GPU 0", "GPU 2"],
    }


def test_nvml_backend_slurm_case_20(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fake_nvml.write(fleet)
    uuids = [d["uuid"] for d in fleet["devices"]]
    assert nvml_allocation(fake_nvml, SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES="0") == {
        "uuids": [uuids[3]],
        "describe": "SLURM_JOB_GPUS='3' and CUDA_VISIBLE_DEVICES='0' grant GPU 3",
        "allowed": ["GPU 3"],
    }


def test_nvml_backend_two_mig_devices_not_the_parent(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fake_nvml.write(fleet)
    migs = [m["uuid"] for m in fleet["devices"][0]["mig_devices"]]
    assert nvml_allocation(fake_nvml, CUDA_VISIBLE_DEVICES=",".join(migs)) == {
        "uuids": migs,
        "describe": f"CUDA_VISIBLE_DEVICES='{','.join(migs)}' grants GPU 0 MIG 0, GPU 0 MIG 1",
        "allowed": ["GPU 0 MIG 0", "GPU 0 MIG 1"],
    }


def test_nvml_backend_in_a_subprocess_reads_its_own_environment(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_SIMULATE") and not k.startswith("SLURM_")
    }
    env.update(fake_nvml.env, PYTHONPATH=str(ROOT), NVIDIA_VISIBLE_DEVICES="none")
    proc = subprocess.run(
        [sys.executable, "-c", NVML_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "uuids": [],
        "describe": "NVIDIA_VISIBLE_DEVICES='none' grants no GPU to this process "
        "(NVIDIA_VISIBLE_DEVICES='none': the container runtime gives this container no GPU)",
        "allowed": [],
    }


def test_slurm_job_with_the_whole_host(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="0,1,2,3", CUDA_VISIBLE_DEVICES="2")
    assert (a.uuids, a.notes) == ((U2,), ())
    assert a.describe() == "SLURM_JOB_GPUS='0,1,2,3' and CUDA_VISIBLE_DEVICES='2' grant GPU 2"


def test_slurm_with_hidden_cvd(fleet: list[DeviceSnapshot]) -> None:
    a = alloc(fleet, SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES="-1")
    assert (a.uuids, a.notes) == ((), ("CUDA_VISIBLE_DEVICES='-1' hides every GPU from CUDA",))


def test_nvidia_visible_devices_forms_applied_by_the_runtime(fleet: list[DeviceSnapshot]) -> None:
    path = alloc(fleet, NVIDIA_VISIBLE_DEVICES="/var/run/nvidia-container-devices")
    assert (path.uuids, path.notes) == (
        None,
        (
            "NVIDIA_VISIBLE_DEVICES='/var/run/nvidia-container-devices' points at a device list "
            "the container runtime already applied: every GPU NVML shows is granted",
        ),
    )
    mig = alloc(fleet, NVIDIA_VISIBLE_DEVICES="0:1")
    assert (mig.uuids, mig.notes) == (
        None,
        (
            "NVIDIA_VISIBLE_DEVICES='0:1' (MIG or mixed entries) was applied by the container "
            "runtime: every GPU NVML shows is granted",
        ),
    )


# ---------------------------------------------------------------- visible_ids = "index" (issue 41)


def test_index_ids_write_nvml_indices_in_pci_order_which_read_back_as_the_same_gpus(
    fleet: list[DeviceSnapshot],
) -> None:
    """For Ray 2.8-2.9, older dask-cuda and NVML-based device_count(): indices, not UUIDs. What
    is written reads back (as CUDA reads it) as the devices chosen, in their order."""
    env = visible_env([U3, U1], fleet, "index")
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3,1"}
    assert parse_cuda_visible_devices(env["CUDA_VISIBLE_DEVICES"], fleet)[0] == (U3, U1)
    # the default: UUIDs
    assert visible_env([U3], fleet)["CUDA_VISIBLE_DEVICES"] == U3
    assert visible_env([U3], fleet, " UUID ")["CUDA_VISIBLE_DEVICES"] == U3


def test_index_ids_refuse_a_mig_device_in_one_line(mig_fleet: list[DeviceSnapshot]) -> None:
    with pytest.raises(UsageErrorBase) as err:
        visible_env([MIG_B], mig_fleet, "index")
    assert str(err.value) == (
        "visible_ids = 'index' cannot select GPU 0 MIG 1: CUDA selects a MIG device by its UUID "
        "only; set c.AutoGPU.visible_ids = 'uuid' (the default) for MIG devices")
    assert visible_env([U1], mig_fleet, "index")["CUDA_VISIBLE_DEVICES"] == "1"


def test_index_ids_refuse_a_gpu_after_an_unreadable_one(fleet: list[DeviceSnapshot]) -> None:
    """An unreadable GPU before the chosen one may be one CUDA cannot open: its numbering could
    differ from NVML's, so no index is guessed."""
    fleet[1] = gpu(1, U1, available=False, error="GPU is lost")
    with pytest.raises(UsageErrorBase) as err:
        visible_env([U2], fleet, "index")
    assert str(err.value) == (
        "visible_ids = 'index' cannot name GPU 2: GPU 1 before it is unreadable, so CUDA may "
        "number the GPUs otherwise; set c.AutoGPU.visible_ids = 'uuid' (the default)")
    assert visible_env([U0], fleet, "index")["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize("ids", ["idx", "", "UUIDs", None])
def test_a_bad_visible_ids_is_named_with_the_accepted_values(
    fleet: list[DeviceSnapshot], ids: object
) -> None:
    with pytest.raises(UsageErrorBase) as err:
        visible_env([U0], fleet, ids)  # type: ignore[arg-type]
    assert str(err.value) == (
        f"invalid visible_ids {ids!r} (c.AutoGPU.visible_ids or AUTOGPU_VISIBLE_IDS): expected "
        "'uuid' (the default) or 'index'")
