"""Every note and grant of core.visibility, exactly, on hosts whose GPU indices have gaps
(what NVML shows under a device cgroup or after a GPU fell off the bus)."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.visibility import (
    Allocation,
    current_allocation,
    parse_cuda_visible_devices,
    visible_env,
)
from autogpu_jupyter.errors import UsageErrorBase

A100 = "NVIDIA A100-SXM4-80GB"
L4 = "NVIDIA L4"
G0 = "GPU-a0000000-1111-2222-3333-000000000000"
G2 = "GPU-b0000000-1111-2222-3333-222222222222"
G5 = "GPU-c0000000-1111-2222-3333-555555555555"
G7 = "GPU-e0000000-1111-2222-3333-777777777777"
MIG_X = "MIG-d0000000-aaaa-5555-6666-000000000000"
MIG_Y = "MIG-d1000000-bbbb-5555-6666-111111111111"
STOP = "later entries are ignored, as CUDA does"
CVD = "CUDA_VISIBLE_DEVICES"
NVD = "NVIDIA_VISIBLE_DEVICES"


def gpu(index: int, uuid: str, name: str = A100, **kw: object) -> DeviceSnapshot:
    return DeviceSnapshot(index=index, uuid=uuid, name=name, **kw)  # type: ignore[arg-type]


#: Three whole GPUs at NVML indices 0, 2 and 5, one model.
GAPS = [gpu(5, G5), gpu(0, G0), gpu(2, G2)]
#: GPU 0 split into two MIG devices, then GPU 2 whole.
MIGS = [
    gpu(0, G0, mig_enabled=True),
    gpu(0, MIG_X, f"{A100} MIG 3g.40gb", is_mig=True, parent_uuid=G0, mig_index=0),
    gpu(0, MIG_Y, f"{A100} MIG 3g.40gb", is_mig=True, parent_uuid=G0, mig_index=1),
    gpu(2, G2),
]


def alloc(devices: list[DeviceSnapshot], **env: str) -> Allocation:
    return current_allocation(devices, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **env})


@pytest.mark.parametrize(
    ("env", "uuids", "notes"),
    [
        ({CVD: "9"}, (), (f"{CVD}: stopped at '9' (no GPU with index 9; this host shows 3: "
                          f"0,2,5); {STOP}",)),
        ({CVD: "1"}, (), (f"{CVD}: stopped at '1' (no GPU with index 1; this host shows 3: "
                          f"0,2,5); {STOP}",)),
        ({CVD: "5,0"}, (G5, G0), ()),
        ({CVD: "+2"}, (G2,), ()),
        ({CVD: "2gpu"}, (G2,), (f"{CVD}: '2gpu' read as 2: CUDA reads only the leading digits "
                                "(there are no ranges)",)),
        ({CVD: "gpu0"}, (), (f"{CVD}: stopped at 'gpu0' (not a device index); {STOP}",)),
        ({CVD: "0,MIG-d0"}, (G0,), (f"{CVD}: stopped at 'MIG-d0' (a UUID after indices: CUDA "
                                    f"does not allow mixing indices and UUIDs); {STOP}",)),
        ({CVD: "0,-2"}, (G0,), (f"{CVD}: stopped at '-2' (a negative index); {STOP}",)),
        ({CVD: "GPU-a,x"}, (G0,), (f"{CVD}: stopped at 'x' (not a device UUID); {STOP}",)),
        ({CVD: "GPU-a,"}, (G0,), (f"{CVD}: stopped at '' (an empty entry); {STOP}",)),
        ({CVD: "GPU-b, GPU-b"}, (), (f"{CVD}: 'GPU-b' is listed twice; CUDA then shows no GPU at "
                                     "all",)),
        ({CVD: f"GPU-c,{G0},GPU-"}, (G5, G0), (f"{CVD}: stopped at 'GPU-' (ambiguous UUID prefix: "
                                               "it matches 3 devices (GPU 5, GPU 0, GPU 2)); "
                                               f"{STOP}",)),
        ({NVD: "/var/run/nvidia-container-devices"}, None, (
            f"{NVD}='/var/run/nvidia-container-devices' points at a device list the container "
            "runtime already applied: every GPU NVML shows is granted",)),
        ({NVD: " ALL "}, None, ()),
        ({NVD: "0,7,0"}, (G0,), (
            f"{NVD}='0,7,0' read as NVML indices (NVML shows more GPUs than it lists)",
            f"{NVD}: index 7 dropped (this host shows 3: 0,2,5)",
        )),
        ({NVD: "0,7,9,2"}, (G0, G2), (
            f"{NVD}='0,7,9,2' read as NVML indices (NVML shows more GPUs than it lists)",
            f"{NVD}: index 7, 9 dropped (this host shows 3: 0,2,5)",
        )),
        ({NVD: "5,2"}, (G5, G2), (
            f"{NVD}='5,2' read as NVML indices (NVML shows more GPUs than it lists)",)),
        ({NVD: "7,1,3"}, None, (
            f"{NVD}='7,1,3' lists host indices and NVML shows exactly 3 GPU(s): the container "
            "runtime already applied it",)),
        ({NVD: "0:1"}, None, (
            f"{NVD}='0:1' (MIG or mixed entries) was applied by the container runtime: every GPU "
            "NVML shows is granted",)),
        ({NVD: "0,\u00b2"}, None, (  # a superscript two is no index (and raises nothing)
            f"{NVD}='0,\u00b2' (MIG or mixed entries) was applied by the container runtime: "
            "every GPU NVML shows is granted",)),
        ({NVD: "GPU-a, GPU-zz,GPU-c,,GPU-a0000000"}, (G0, G5), (
            f"{NVD}: 'GPU-zz' dropped (no device has that UUID or UUID prefix)",)),
        ({"SLURM_JOB_GPUS": "NoDevFiles"}, (), (
            "SLURM_JOB_GPUS='NoDevFiles': the Slurm job has no GPU",)),
        ({"SLURM_STEP_GPUS": " "}, (), ("SLURM_STEP_GPUS=' ': the Slurm job has no GPU",)),
        ({"SLURM_JOB_GPUS": "3-1"}, (), (
            "SLURM_JOB_GPUS='3-1' is not a list of GPU ids (expected e.g. '0,2' or '0-3'): no GPU "
            "granted rather than guessing",)),
        ({"SLURM_JOB_GPUS": "2-2,0"}, (G2, G0), ()),
        ({"SLURM_JOB_GPUS": " 0 , 2,2 "}, (G0, G2), ()),
        ({"SLURM_JOB_GPUS": "0,2,5"}, (G0, G2, G5), ()),
        ({"SLURM_JOB_GPUS": "5,0,2"}, (G0, G2, G5), ()),
        ({"SLURM_JOB_GPUS": "0-2"}, (G0, G2, G5), (
            "SLURM_JOB_GPUS='0-2': NVML shows exactly the job's 3 GPU(s) (device cgroup), so all "
            "of them are granted",)),
        ({"SLURM_JOB_GPUS": "0,1"}, (), (
            "SLURM_JOB_GPUS='0,1' names GPUs that do not match what NVML shows (this host shows "
            "3: 0,2,5): cannot tell which GPUs are the job's, so none is granted",)),
        ({"SLURM_JOB_GPUS": "0-3"}, (), (
            "SLURM_JOB_GPUS='0-3' names GPUs that do not match what NVML shows (this host shows "
            "3: 0,2,5): cannot tell which GPUs are the job's, so none is granted",)),
    ],
)
def test_each_variable_alone_on_a_host_with_index_gaps(
    env: dict[str, str], uuids: tuple[str, ...] | None, notes: tuple[str, ...]
) -> None:
    a = alloc(GAPS, **env)
    assert (a.uuids, a.notes) == (uuids, notes)


def test_host_index_spans_in_notes() -> None:
    def note(devices: list[DeviceSnapshot]) -> str:
        return parse_cuda_visible_devices("9", devices)[1][0]

    assert note([gpu(3, G0)]) == (
        f"{CVD}: stopped at '9' (no GPU with index 9; this host shows 1: 3); {STOP}"
    )
    assert note([gpu(3, G0), gpu(4, G2), gpu(5, G5)]) == (
        f"{CVD}: stopped at '9' (no GPU with index 9; this host shows 3: 3-5); {STOP}"
    )
    assert note([gpu(1, G0), gpu(2, G2), gpu(4, G5)]) == (
        f"{CVD}: stopped at '9' (no GPU with index 9; this host shows 3: 1,2,4); {STOP}"
    )
    # MIG devices are not GPUs an index can name
    assert note(MIGS) == (
        f"{CVD}: stopped at '9' (no GPU with index 9; this host shows 2: 0,2); {STOP}"
    )


def test_a_value_is_read_the_same_whatever_the_device_listing_order() -> None:
    assert parse_cuda_visible_devices(" 2 , 0 ", GAPS) == ((G2, G0), ())
    assert parse_cuda_visible_devices("0,2", list(reversed(GAPS))) == ((G0, G2), ())


def test_the_legacy_mig_form_after_a_mig_uuid_ends_the_list() -> None:
    uuids, notes = parse_cuda_visible_devices(f"{MIG_X},MIG-{G0}/1/0,{MIG_Y}", MIGS)
    assert uuids == (MIG_X,)
    assert notes == (
        f"{CVD}: stopped at 'MIG-{G0}/1/0': the legacy MIG-GPU-<uuid>/<gi>/<ci> form is not "
        "supported; use the MIG UUID that `nvidia-smi -L` prints (MIG-…)",
    )
    # after GPU UUIDs it is just a MIG entry where GPU UUIDs were expected
    uuids, notes = parse_cuda_visible_devices(f"{G2},MIG-{G0}/1/0", MIGS)
    assert uuids == (G2,)
    assert notes == (
        f"{CVD}: stopped at 'MIG-{G0}/1/0' (a MIG- UUID after GPU- UUIDs: CUDA does not allow "
        f"mixing them); {STOP}",
    )


def test_a_device_is_named_by_its_label_else_by_its_uuid() -> None:
    a = alloc(GAPS, **{NVD: f"{G0},{G2}", CVD: "GPU-c"})
    assert a.notes == (
        f"GPU 5 (from {CVD}) is outside the allocation of {NVD}: dropped",
    )
    # an Allocation built without labels (or not one per UUID) names its devices by UUID
    gone = Allocation(CVD, "x", ("GPU-ffffffff-0000", "weird"), labels=())
    assert gone.describe() == f"{CVD}='x' grants GPU-ffffffff-0000, weird"


def test_a_mig_device_inside_a_granted_gpu_stays_granted() -> None:
    a = alloc(MIGS, SLURM_JOB_GPUS="0", **{CVD: MIG_Y})
    assert (a.uuids, a.labels) == ((MIG_Y,), ("GPU 0 MIG 1",))
    b = alloc(MIGS, **{NVD: G0, CVD: f"{MIG_X},{MIG_Y}"})
    assert b.uuids == (MIG_X, MIG_Y)
    assert b.notes == (
        "2 MIG devices granted; CUDA uses one MIG device per process, so a pick uses one of them",
    )
    # a whole GPU is not inside a grant because some MIG device of another GPU is
    whole = alloc(MIGS, **{NVD: G0, CVD: G2})
    assert (whole.uuids, whole.notes) == (
        (), (f"GPU 2 (from {CVD}) is outside the allocation of {NVD}: dropped",)
    )
    c = alloc(MIGS, **{NVD: G2, CVD: MIG_X})
    assert c.uuids == ()
    assert c.notes == (f"GPU 0 MIG 0 (from {CVD}) is outside the allocation of {NVD}: dropped",)
    one = alloc(MIGS, **{CVD: MIG_Y})
    assert one.notes == ()
    # whole GPUs are no MIG devices, even on a host that has some
    assert alloc(MIGS, **{CVD: "0,2"}).notes == ()


def test_a_grant_outside_two_allocations_names_both() -> None:
    a = alloc(GAPS, **{NVD: G0, "SLURM_JOB_GPUS": "0,2", CVD: f"{G5},{G0}"})
    assert a.uuids == (G0,)
    assert a.source == f"{NVD} + SLURM_JOB_GPUS + {CVD}"
    assert a.raw == f"{G0} + 0,2 + {G5},{G0}"
    assert a.parts == ((NVD, G0), ("SLURM_JOB_GPUS", "0,2"), (CVD, f"{G5},{G0}"))
    assert a.notes == (
        f"GPU 5 (from {CVD}) is outside the allocation of {NVD} and SLURM_JOB_GPUS: dropped",
    )
    assert a.describe() == (
        f"{NVD}={G0!r} and SLURM_JOB_GPUS='0,2' and {CVD}='{G5},{G0}' grant GPU 0"
    )


def test_the_notes_of_every_variable_are_kept_in_order() -> None:
    a = alloc(GAPS, **{NVD: "0,7,0", "SLURM_JOB_GPUS": "0-1", CVD: "x"})
    assert a.uuids == ()
    assert a.notes == (
        f"{NVD}='0,7,0' read as NVML indices (NVML shows more GPUs than it lists)",
        f"{NVD}: index 7 dropped (this host shows 3: 0,2,5)",
        "SLURM_JOB_GPUS='0-1' names GPUs that do not match what NVML shows (this host shows 3: "
        "0,2,5): cannot tell which GPUs are the job's, so none is granted",
        f"{CVD}: stopped at 'x' (not a device index); {STOP}",
    )


def test_slurm_relative_reading_when_the_global_one_leaves_the_job() -> None:
    a = alloc(GAPS, SLURM_STEP_GPUS="5,2", SLURM_JOB_GPUS="0", **{CVD: "1"})
    assert a.uuids == (G2,)
    assert a.source == f"SLURM_STEP_GPUS + {CVD}"
    assert a.notes == (
        f"{CVD}='1' read relative to the job's GPUs (SLURM_STEP_GPUS='5,2'), as Slurm writes it "
        "under a device cgroup: GPU 2",
    )
    # nothing of the job at that relative index: the note says no GPU
    b = alloc(GAPS, SLURM_JOB_GPUS="5", **{CVD: "3"})
    assert b.uuids == ()
    assert b.notes == (
        f"{CVD}: stopped at '3' (no GPU with index 3; the job has 1: 0); {STOP}",
        f"{CVD}='3' read relative to the job's GPUs (SLURM_JOB_GPUS='5'), as Slurm writes it "
        "under a device cgroup",
    )


def test_slurm_global_reading_says_what_the_relative_one_would_be() -> None:
    a = alloc(GAPS, SLURM_JOB_GPUS="2,0", **{CVD: "0"})
    assert a.uuids == (G0,)
    assert a.notes == (
        f"{CVD}='0' read as global ids inside SLURM_JOB_GPUS='2,0' (GPU 0); read relative to the "
        "job it would be GPU 2",
    )
    # both readings agree: no note
    assert alloc(GAPS, SLURM_JOB_GPUS="0,2", **{CVD: "0"}).notes == ()
    # the relative reading is broken (index 2 past the job): the global one, without a note
    assert alloc(GAPS, SLURM_JOB_GPUS="0,2", **{CVD: "2"}).notes == ()
    # UUIDs are no ids to reinterpret
    assert alloc(GAPS, SLURM_JOB_GPUS="0,2", **{CVD: "GPU-b"}).uuids == (G2,)


def test_a_slurm_job_with_the_whole_host_reads_cvd_as_the_host_does() -> None:
    # Global and relative ids are one and the same: no second reading, no note about Slurm.
    a = alloc(GAPS, SLURM_JOB_GPUS="0,2,5", **{CVD: "7"})
    assert (a.uuids, a.notes) == ((), (
        f"{CVD}: stopped at '7' (no GPU with index 7; this host shows 3: 0,2,5); {STOP}",
    ))
    b = alloc(GAPS, SLURM_JOB_GPUS="5,2,0", **{CVD: "2,0"})
    assert (b.uuids, b.notes) == ((G2, G0), ())


def test_slurm_readings_of_several_gpus_list_them_all() -> None:
    host = [*GAPS, gpu(7, G7)]
    a = alloc(host, SLURM_JOB_GPUS="5,0,2", **{CVD: "0,2"})
    assert a.uuids == (G0, G2)
    assert a.notes == (
        f"{CVD}='0,2' read as global ids inside SLURM_JOB_GPUS='5,0,2' (GPU 0, GPU 2); read "
        "relative to the job it would be GPU 5, GPU 2",
    )
    b = alloc(host, SLURM_JOB_GPUS="5,0,2", **{CVD: "1,0"})
    assert b.uuids == (G0, G5)
    assert b.notes == (
        f"{CVD}='1,0' read relative to the job's GPUs (SLURM_JOB_GPUS='5,0,2'), as Slurm writes "
        "it under a device cgroup: GPU 0, GPU 5",
    )


def test_a_full_uuid_that_prefixes_another_names_its_own_device() -> None:
    short, long = "GPU-abc", "GPU-abcd"
    devices = [gpu(0, short), gpu(1, long)]
    assert parse_cuda_visible_devices(short, devices) == ((short,), ())
    assert parse_cuda_visible_devices(long, devices) == ((long,), ())
    assert alloc(devices, **{NVD: short}).uuids == (short,)


def test_slurm_on_a_cgroup_host_leaves_cvd_as_it_is() -> None:
    # NVML shows exactly the job's GPUs: CVD is read against them, never re-mapped
    a = alloc(GAPS, SLURM_JOB_GPUS="0,2,5", **{CVD: "5"})
    assert (a.uuids, a.notes) == ((G5,), ())


def test_index_order_note_only_when_cuda_may_order_otherwise() -> None:
    mixed = [gpu(0, G0), gpu(2, G2, L4)]
    order_note = (
        f"{CVD}='2' uses indices and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA numbers GPUs "
        "fastest first; this host mixes models (NVIDIA A100-SXM4-80GB, NVIDIA L4), so CUDA's "
        "index may name another GPU than NVML's: read here in PCI bus order (nvidia-smi's). "
        "UUIDs avoid the ambiguity"
    )
    assert current_allocation(mixed, {CVD: "2"}).notes == (order_note,)
    assert current_allocation(mixed, {CVD: "2", "CUDA_DEVICE_ORDER": "pci_bus_id"}).notes == (
        order_note,
    )
    assert current_allocation(mixed, {CVD: "7"}).notes == (
        f"{CVD}: stopped at '7' (no GPU with index 7; this host shows 2: 0,2); {STOP}",
    )
    # a MIG device's model does not count as a second model
    assert current_allocation(MIGS, {CVD: "2"}).notes == ()


def test_describe_without_parts_falls_back_to_source_and_raw() -> None:
    assert Allocation(CVD, "0", (G0,), labels=("GPU 0",)).describe() == f"{CVD}='0' grants GPU 0"
    assert Allocation(None, None, ()).describe() == "?='' grants no GPU to this process"
    assert Allocation(CVD, "", (), notes=("a", "b")).describe() == (
        f"{CVD}='' grants no GPU to this process (a; b)"
    )
    two = Allocation("x", "y", (G0, G2), labels=("GPU 0",), parts=(("A", "1"), ("B", "2")))
    assert two.describe() == f"A='1' and B='2' grant {G0}, {G2}"


def test_allows_a_mig_device_only_through_itself_or_its_parent() -> None:
    by_parent = Allocation(CVD, "0", (G0,))
    assert [by_parent.allows(d) for d in MIGS] == [True, True, True, False]
    orphan = gpu(0, "MIG-orphan", is_mig=True, parent_uuid=None)
    assert not by_parent.allows(orphan)
    # a whole GPU whose parent_uuid is set (as some listings do) is not a MIG device
    odd = gpu(7, "GPU-odd", parent_uuid=G0)
    assert not by_parent.allows(odd)
    assert Allocation(None, None, None).allows(orphan)
    assert Allocation(CVD, "", ()).empty and not Allocation(CVD, "", ()).unrestricted


def test_current_allocation_reads_this_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in (NVD, "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(CVD, "2")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert current_allocation(GAPS).uuids == (G2,)


@pytest.mark.parametrize(
    "bad", [["GPU-"], ["MIG-"], ["GPU-1 "], ["gpu-1"], [3], ["GPU-1", "GPU-2,GPU-3"]]
)
def test_visible_env_refuses_what_is_no_full_uuid(bad: list[object]) -> None:
    with pytest.raises(UsageErrorBase) as err:
        visible_env(bad)  # type: ignore[arg-type]
    shown = ", ".join(repr(b) for b in bad if b != "GPU-1")
    assert str(err.value) == (
        f"not a full device UUID: {shown}; expected UUIDs such as 'GPU-5a1c...' or 'MIG-...' as "
        "nvidia-smi -L prints them"
    )


def test_visible_env_lists_every_uuid_in_order() -> None:
    assert visible_env(["GPU-1", MIG_X]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", CVD: f"GPU-1,{MIG_X}"
    }
    assert visible_env([]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", CVD: ""}
    with pytest.raises(UsageErrorBase) as err:
        visible_env(["0", "GPU-"])
    assert str(err.value).startswith("not a full device UUID: '0', 'GPU-'; expected")
