"""ROCm visibility, read value by value: every result is checked whole, notes word for word.

Tables of (environment value -> exact result) over the four GPUs of ``test_rocm_visibility``
(ROCr UUIDs ``GPU-BABABABABABABABA``, ``GPU-ABBAABBAABBAABBA``, ``GPU-BABAABBAABBABABA``,
``GPU-ABBABABABABAABBA``): ROCr's and HIP's lists, what stops them and why, and how
``rocm_allocation`` combines Slurm's grant, ROCR_VISIBLE_DEVICES and the HIP lists.
"""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.visibility import (
    ROCM_VARS,
    SLURM_VARS,
    Allocation,
    _rocm_read,
    parse_hip_visible_devices,
    parse_rocr_visible_devices,
    rocm_allocation,
)
from tests.unit.test_rocm_visibility import GPUS

ROCR, HIP, CVD, GDO = ROCM_VARS
JOB, STEP = "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"
NO_UUID = "no GPU has that ROCr UUID (GPU-<16 hex digits>) or prefix"
HOST4 = "this host shows 4: 0-3"


def stop(var: str, token: str, why: str, runtime: str) -> str:
    return f"{var}: stopped at {token!r} ({why}); later entries are ignored, as {runtime} does"


def amd(*idx: int) -> tuple[str, ...]:
    return tuple(f"amd-{i}" for i in idx)


def relative(var: str, value: str) -> str:
    return (f"{var}={value!r} read relative to the Slurm job's GPUs, as Slurm writes it under a "
            "device cgroup")


@pytest.mark.parametrize(
    ("value", "uuids", "notes"),
    [
        ("", (), (f"{ROCR} is set but empty: ROCr shows no GPU",)),
        ("1,1,2", amd(1), (stop(ROCR, "1", "that GPU is already listed", "ROCr"),)),
        ("2,x,1", amd(2), (stop(ROCR, "X", "not an index", "ROCr"),)),
        ("2,7", amd(2), (stop(ROCR, "7", f"no GPU with index 7; {HOST4}", "ROCr"),)),
        ("-1", (), (stop(ROCR, "-1", f"no GPU with index -1; {HOST4}", "ROCr"),)),
        # strtol base 0: "010" is octal 8 (not 10, not 9)
        ("0x1,010", amd(1), (stop(ROCR, "010", f"no GPU with index 8; {HOST4}", "ROCr"),)),
        ("07", (), (stop(ROCR, "07", f"no GPU with index 7; {HOST4}", "ROCr"),)),
        ("1,,2", amd(1, 0, 2), (f"{ROCR}: an empty entry reads as GPU index 0, as ROCr reads it",)),
        ("3,GPU-XX", amd(3), (stop(ROCR, "GPU-XX", NO_UUID, "ROCr"),)),
        # a UUID token is 5 to 20 characters: shorter ones match nothing, even as a prefix
        ("GPU-", (), (stop(ROCR, "GPU-", NO_UUID, "ROCr"),)),
        ("g,1", (), (stop(ROCR, "G", NO_UUID, "ROCr"),)),
        ("GPU-A", (), (stop(ROCR, "GPU-A", "ambiguous: it matches several GPUs", "ROCr"),)),
        ("gpu-bABAA,1", amd(2, 1), ()),
        ("GPU-ABBABABABABAABBA,0", amd(3, 0), ()),
    ],
)
def test_rocr_list_read_whole(value: str, uuids: tuple[str, ...], notes: tuple[str, ...]) -> None:
    assert parse_rocr_visible_devices(value, GPUS) == (uuids, notes)


def test_a_rocr_uuid_token_longer_than_20_characters_matches_nothing() -> None:
    long = [DeviceSnapshot(index=0, uuid="long", name="AMD", vendor="amd",
                           runtime_uuid="GPU-0123456789abcdef0")]
    assert parse_rocr_visible_devices("GPU-0123456789ABCDEF", long) == (("long",), ())
    token = "GPU-0123456789ABCDEF0"
    assert parse_rocr_visible_devices(token, long, var=GDO) == (
        (), (stop(GDO, token, NO_UUID, "ROCr"),))


@pytest.mark.parametrize(
    ("value", "uuids", "notes"),
    [
        ("", (), ()),
        ("4", (), (stop(HIP, "4", "no GPU with index 4; ROCr shows 4: 0-3", "HIP"),)),
        ("3,x", amd(3), (stop(HIP, "x", "not a GPU index or UUID", "HIP"),)),
        ("GPU-babaabba,1,1", amd(2, 1), ()),
    ],
)
def test_hip_list_read_whole(value: str, uuids: tuple[str, ...], notes: tuple[str, ...]) -> None:
    assert parse_hip_visible_devices(value, GPUS) == (uuids, notes)


def alloc(parts: tuple[tuple[str, str], ...], uuids: tuple[str, ...],
          notes: tuple[str, ...]) -> Allocation:
    return Allocation(
        source=" + ".join(n for n, _ in parts), raw=" + ".join(v for _, v in parts),
        uuids=uuids, notes=notes, labels=tuple(f"GPU {u[4:]}" for u in uuids), parts=parts)


EMPTY = "is set but empty: HIP reads that as unset"
REPEAT = ("repeats ROCR_VISIBLE_DEVICES: read as the same GPUs (Slurm writes both unless "
          "gres.conf says Flags=amd_gpu_env)")

ALLOCATIONS = [
    # empty HIP lists count as unset: no grant at all, but said
    ({HIP: "", CVD: "", GDO: ""},
     Allocation(source=None, raw=None, uuids=None,
                notes=(f"{HIP} {EMPTY}", f"{CVD} {EMPTY}", f"{GDO} {EMPTY}"))),
    ({HIP: "1", CVD: ""}, alloc(((HIP, "1"),), amd(1), (f"{CVD} {EMPTY}",))),
    # HIP indexes what ROCr left, renumbered from 0
    ({ROCR: "3,1", HIP: "0,2"},
     alloc(((ROCR, "3,1"), (HIP, "0,2")), amd(3),
           (stop(HIP, "2", "no GPU with index 2; ROCr shows 2: 0-1", "HIP"),))),
    # without Slurm, a HIP list equal to ROCr's is read over what ROCr left like any other
    ({ROCR: "1,2", HIP: "1,2"},
     alloc(((ROCR, "1,2"), (HIP, "1,2")), amd(2),
           (stop(HIP, "2", "no GPU with index 2; ROCr shows 2: 0-1", "HIP"),))),
    # every note is kept, in order: ROCr's, then HIP's
    ({ROCR: "x", HIP: "0"},
     alloc(((ROCR, "x"), (HIP, "0")), (),
           (stop(ROCR, "X", "not an index", "ROCr"),
            stop(HIP, "0", "no GPU with index 0; ROCr shows no GPU", "HIP")))),
    ({CVD: "x"}, alloc(((CVD, "x"),), (), (stop(CVD, "x", "not a GPU index or UUID", "HIP"),))),
    # GPU_DEVICE_ORDINAL bounds HIP's list
    ({HIP: "0", GDO: "1"},
     alloc(((HIP, "0"), (GDO, "1")), (),
           (f"GPU 1 (from {GDO}) is outside the allocation of {HIP}: dropped",))),
    # Slurm's notes are kept beside ROCr's and HIP's
    ({JOB: "", ROCR: "x"},
     alloc(((JOB, ""), (ROCR, "x")), (),
           (f"{JOB}='': the Slurm job has no GPU", stop(ROCR, "X", "not an index", "ROCr")))),
    ({JOB: "", HIP: "x"},
     alloc(((JOB, ""), (HIP, "x")), (),
           (f"{JOB}='': the Slurm job has no GPU",
            stop(HIP, "x", "not a GPU index or UUID", "HIP")))),
    # no ROCR_VISIBLE_DEVICES: a HIP list that leaves Slurm's grant is read relative to it
    ({JOB: "1,2", HIP: "0"}, alloc(((JOB, "1,2"), (HIP, "0")), amd(1), (relative(HIP, "0"),))),
    ({JOB: "1,2", CVD: "3,5"},
     alloc(((JOB, "1,2"), (CVD, "3,5")), (),
           (stop(CVD, "3", "no GPU with index 3; ROCr shows 2: 0-1", "HIP"),
            relative(CVD, "3,5")))),
    ({JOB: "1,2", GDO: "2"},
     alloc(((JOB, "1,2"), (GDO, "2")), amd(2), ())),
    # Slurm wrote the same list everywhere: the repeat names ROCr's GPUs, later lists still count
    ({STEP: "1,2", ROCR: "1,2", CVD: "1,2", GDO: "0"},
     alloc(((STEP, "1,2"), (ROCR, "1,2"), (CVD, "1,2"), (GDO, "0")), amd(1),
           (f"{CVD}='1,2' {REPEAT}",))),
    ({STEP: "1,2", ROCR: "0,1", HIP: "0,1", GDO: "0,1"},
     alloc(((STEP, "1,2"), (ROCR, "0,1"), (HIP, "0,1"), (GDO, "0,1")), amd(1, 2),
           (relative(ROCR, "0,1"), f"{HIP}='0,1' {REPEAT}", f"{GDO}='0,1' {REPEAT}"))),
]


@pytest.mark.parametrize(("env", "expected"), ALLOCATIONS)
def test_rocm_allocation_read_whole(env: dict[str, str], expected: Allocation) -> None:
    assert rocm_allocation(GPUS, env) == expected


def test_without_rocr_the_hip_note_names_the_gpus_by_their_own_indices() -> None:
    gaps = [DeviceSnapshot(index=i, uuid=f"amd-{i}", name="AMD", vendor="amd") for i in (0, 2, 5)]
    assert rocm_allocation(gaps, {HIP: "7"}).notes == (
        stop(HIP, "7", "no GPU with index 7; ROCr shows 3: 0,2,5", "HIP"),)


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ROCM_VARS, *SLURM_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ROCR, "2")
    assert rocm_allocation(GPUS).uuids == amd(2)


def test_slurm_relative_reading_only_where_the_grant_is_smaller_than_the_base() -> None:
    base = list(GPUS[:2])
    # a grant as large as the base is no device cgroup: the plain reading stands
    assert _rocm_read(ROCR, "1", base, amd(0, 2), parse_rocr_visible_devices) == (amd(1), [])
    assert _rocm_read(ROCR, "1", GPUS, amd(0, 2), parse_rocr_visible_devices) == (
        amd(2), [relative(ROCR, "1")])
