"""ROCm's visibility variables, read by the runtimes' rules and written so every reader agrees.

The examples of ROCr's own filter (``amd_filter_device.h``: four GPUs with the UUIDs below) are
checked as ROCr documents them; HIP's list is read over what ROCr left; Slurm's grant is an upper
bound that no value widens (checked over every combination of a set of values).
"""

from __future__ import annotations

import itertools

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.visibility import (
    ROCM_VARS,
    SLURM_VARS,
    Allocation,
    _rocm_read,
    current_allocation,
    parse_hip_visible_devices,
    parse_rocr_visible_devices,
    rocm_allocation,
    rocm_env,
    visible_env,
)

ROCR_UUIDS = ["GPU-BABABABABABABABA", "GPU-ABBAABBAABBAABBA", "GPU-BABAABBAABBABABA",
              "GPU-ABBABABABABAABBA"]
GPUS = [
    DeviceSnapshot(index=i, uuid=f"amd-{i}", name="AMD Instinct MI300X", vendor="amd",
                   runtime_uuid=ROCR_UUIDS[i].lower().replace("gpu-", "GPU-"))
    for i in range(4)
]
#: Eight partitions of one GPU sharing one ROCr UUID (drivers before ROCm 7.12), then a GPU.
PARTS = [
    DeviceSnapshot(index=i, uuid=f"part-{i}", name=f"AMD Instinct MI300X (CPX {i}, NPS1)",
                   vendor="amd", runtime_uuid="GPU-7f3c2a1b0e9d8c76")
    for i in range(8)
] + [DeviceSnapshot(index=8, uuid="whole", name="AMD Instinct MI300X", vendor="amd",
                    runtime_uuid="GPU-5b6c7d8e9fa01234")]


def rocr(value: str) -> list[int]:
    uuids, _ = parse_rocr_visible_devices(value, GPUS)
    return [int(u.removeprefix("amd-")) for u in uuids]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        # ROCr's documented examples (A1-A3, B, C, D)
        ("", []),
        ("-1", []),
        ("GPU-XX", []),
        ("3,GPU-BABABABABABABABA,4", [3, 0]),
        ("1,GPU-ABBAABBAABBAABBA,GPU-XX", [1]),  # GPU-ABBA... is GPU 1 again: ends the list
        ("3,GPU-BABAABBA,GPU-XX", [3, 2]),
        # strtol(base 0), the whole token: hex and octal read, "0-2" and "1gpu" end the list
        ("0x2,010", [2]),
        ("02,1", [2, 1]),
        ("0-2", []),
        ("1gpu,2", []),
        (" 2 , 1 ", [2, 1]),
        ("gpu-babababababababa,3", [0, 3]),  # upper-cased first
        ("GPU-ABBA", []),  # a prefix of two GPUs' UUIDs: ambiguous, ends the list
        ("1,,2", [1, 0, 2]),  # an empty token reads as 0
        ("0,1,2,3,0", [0, 1, 2, 3]),
        ("3,", [3]),
    ],
)
def test_rocr_visible_devices_as_rocr_reads_it(value: str, shown: list[int]) -> None:
    assert rocr(value) == shown


def test_a_rocr_uuid_shared_by_partitions_names_none_of_them() -> None:
    uuids, notes = parse_rocr_visible_devices("GPU-7f3c2a1b0e9d8c76,8", PARTS)
    assert uuids == ()
    assert notes == ("ROCR_VISIBLE_DEVICES: stopped at 'GPU-7F3C2A1B0E9D8C76' (ambiguous: it "
                     "matches several GPUs); later entries are ignored, as ROCr does",)
    assert parse_rocr_visible_devices("3,8", PARTS)[0] == ("part-3", "whole")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("2,0", [2, 0]),
        ("2,2,1", [2, 1]),  # HIP skips a repeated GPU
        ("01,2", []),  # not canonical decimal: ends the list
        (" 1", []),
        ("+1", []),
        ("1,-1,2", [1]),
        ("GPU-abbaabbaabbaabba,0", [1, 0]),  # UUIDs in the runtime's (lower-case) spelling
        ("GPU-ABBAABBAABBAABBA", []),  # HIP compares case-sensitively
        ("GPU-abba", [1]),  # a substring: the first GPU whose UUID contains it
        ("4", []),
    ],
)
def test_hip_visible_devices_as_hip_reads_it(value: str, shown: list[int]) -> None:
    uuids, _ = parse_hip_visible_devices(value, GPUS)
    assert [int(u.removeprefix("amd-")) for u in uuids] == shown


def test_hip_indices_count_what_rocr_left() -> None:
    alloc = rocm_allocation(GPUS, {"ROCR_VISIBLE_DEVICES": "3,1,2", "HIP_VISIBLE_DEVICES": "2,0"})
    assert alloc.uuids == ("amd-2", "amd-3")
    assert alloc.describe() == (
        "ROCR_VISIBLE_DEVICES='3,1,2' and HIP_VISIBLE_DEVICES='2,0' grant GPU 2, GPU 3")
    # HIP_VISIBLE_DEVICES wins over CUDA_VISIBLE_DEVICES; an empty one counts as unset
    both = {"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "3"}
    assert rocm_allocation(GPUS, both).uuids == ("amd-3",)
    assert rocm_allocation(GPUS, {**both, "HIP_VISIBLE_DEVICES": ""}).uuids == ("amd-1",)
    # GPU_DEVICE_ORDINAL (OpenCL) bounds the grant too
    assert rocm_allocation(GPUS, {"GPU_DEVICE_ORDINAL": "0,2"}).uuids == ("amd-0", "amd-2")


def test_an_amd_host_reads_the_rocm_variables() -> None:
    env = {"ROCR_VISIBLE_DEVICES": "GPU-ABBABABABABAABBA"}
    assert current_allocation(GPUS, env).uuids == ("amd-3",)
    assert current_allocation(GPUS, {}).unrestricted


def test_the_written_environment_shows_exactly_the_chosen_gpus_as_0_to_n() -> None:
    env = visible_env(["amd-3", "amd-1"], GPUS)
    assert env == {
        "ROCR_VISIBLE_DEVICES": "GPU-abbababababaabba,GPU-abbaabbaabbaabba",
        "HIP_VISIBLE_DEVICES": "0,1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "GPU_DEVICE_ORDINAL": "0,1",
    }
    # read back by the runtimes' rules: exactly those GPUs, in that order
    assert rocm_allocation(GPUS, env).uuids == ("amd-3", "amd-1")


def test_partitions_sharing_a_uuid_are_written_by_index() -> None:
    env = rocm_env([PARTS[5]], PARTS)
    assert env["ROCR_VISIBLE_DEVICES"] == "5"
    assert rocm_allocation(PARTS, env).uuids == ("part-5",)
    assert rocm_env([PARTS[8]], PARTS)["ROCR_VISIBLE_DEVICES"] == "GPU-5b6c7d8e9fa01234"


SLURM_ENVS = [
    # gres.conf Flags=amd_gpu_env (AutoDetect=rsmi's default): only ROCR_VISIBLE_DEVICES
    {"SLURM_STEP_GPUS": "1,2", "ROCR_VISIBLE_DEVICES": "1,2"},
    # no flags: Slurm writes the same ids to every variable (global ids, no device cgroup)
    {"SLURM_STEP_GPUS": "1,2", "ROCR_VISIBLE_DEVICES": "1,2", "CUDA_VISIBLE_DEVICES": "1,2",
     "GPU_DEVICE_ORDINAL": "1,2"},
    # under a device cgroup amdsmi does not honour: ids relative to the job
    {"SLURM_STEP_GPUS": "1,2", "ROCR_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0,1",
     "GPU_DEVICE_ORDINAL": "0,1"},
]


@pytest.mark.parametrize("env", SLURM_ENVS)
def test_slurms_grant_is_read_as_the_jobs_gpus(env: dict[str, str]) -> None:
    assert rocm_allocation(GPUS, env).uuids == ("amd-1", "amd-2")


VALUES = ["", "0", "3", "1,2", "2,1", "0,3", "GPU-abbaabbaabbaabba", "GPU-BABABABABABABABA",
          "-1", "0,1,2,3"]


@pytest.mark.parametrize("slurm", ["1,2", "3", "0"])
def test_no_value_of_any_variable_widens_slurms_grant(slurm: str) -> None:
    granted = {f"amd-{i}" for i in map(int, slurm.split(","))}
    for rocr_v, hip_v, cvd_v in itertools.product([None, *VALUES], [None, *VALUES[:6]],
                                                  [None, *VALUES[:6]]):
        env = {"SLURM_JOB_GPUS": slurm}
        for var, v in (("ROCR_VISIBLE_DEVICES", rocr_v), ("HIP_VISIBLE_DEVICES", hip_v),
                       ("CUDA_VISIBLE_DEVICES", cvd_v)):
            if v is not None:
                env[var] = v
        alloc = rocm_allocation(GPUS, env)
        assert alloc.uuids is not None and set(alloc.uuids) <= granted, env


def test_a_hip_list_that_stops_says_which_variable_stopped_where() -> None:
    assert parse_hip_visible_devices("1,x,2", GPUS) == (
        ("amd-1",),
        ("HIP_VISIBLE_DEVICES: stopped at 'x' (not a GPU index or UUID); later entries are "
         "ignored, as HIP does",),
    )
    _, notes = parse_hip_visible_devices("x", GPUS, var="GPU_DEVICE_ORDINAL")
    assert notes[0].startswith("GPU_DEVICE_ORDINAL: stopped at 'x'")


# ---- every result read whole, notes word for word ----
# Tables of (environment value -> exact result) over GPUS: ROCr's and HIP's lists, what stops them
# and why, and how rocm_allocation combines Slurm's grant, ROCR_VISIBLE_DEVICES and the HIP lists.
# Found by the mutation run of issue 22.
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
    # _rocm_read itself: through rocm_allocation the grant is read from the same devices, so a
    # grant as large as the base yet naming GPUs outside it (what tells `<` from `<=`) cannot
    # be built
    base = list(GPUS[:2])
    # a grant as large as the base is no device cgroup: the plain reading stands
    assert _rocm_read(ROCR, "1", base, amd(0, 2), parse_rocr_visible_devices) == (amd(1), [])
    assert _rocm_read(ROCR, "1", GPUS, amd(0, 2), parse_rocr_visible_devices) == (
        amd(2), [relative(ROCR, "1")])
