"""core.policy in detail: parsing and wording of constraints, device ids, every filter's reason,
the ranking key and the order of dropped devices, and what ``select`` takes."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
from autogpu_jupyter.core.policy import Booking, Candidate, Constraints, matches_id, rank, select
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.core.visibility import current_allocation
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3


def gpu(index: int, free_gib: float | None = 80, util: float | None = 0.0, *,
        uuid: str | None = None, total_gib: float | None = 80, name: str = "NVIDIA A100",
        **kw: object) -> DeviceSnapshot:
    total = None if total_gib is None else int(total_gib * GiB)
    free = None if free_gib is None else int(free_gib * GiB)
    return DeviceSnapshot(
        index=index, uuid=uuid or f"GPU-{index:04d}aaaa", name=name,
        memory_total_bytes=total, memory_free_bytes=free, utilization_pct=util,
        compute_mode="DEFAULT", **kw,  # type: ignore[arg-type]
    )


def mig(index: int, mig_index: int, parent: str, free_gib: float = 9, total_gib: float = 10,
        **kw: object) -> DeviceSnapshot:
    return gpu(index, free_gib, None, uuid=f"MIG-{index}{mig_index}bbbbbb", total_gib=total_gib,
               is_mig=True, parent_uuid=parent, mig_index=mig_index, mig_enabled=True, **kw)


def reasons(cands: list[Candidate]) -> dict[str, tuple[str, ...]]:
    return {c.device.label: c.reasons for c in cands}


# --------------------------------------------------------------------- Constraints.parse


def test_parse_defaults_and_empty_strings_mean_no_constraint() -> None:
    assert Constraints.parse() == Constraints()
    assert Constraints.parse(min_free="", max_util="", exclude=None) == Constraints()
    assert Constraints.parse().count == 1


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"count": " 2 "}, Constraints(count=2)),
        ({"count": 3}, Constraints(count=3)),
        ({"count": "1"}, Constraints(count=1)),
        ({"exclude": " 0 , 2 "}, Constraints(exclude=("0", "2"))),
        ({"exclude": "GPU-5a1b"}, Constraints(exclude=("GPU-5a1b",))),
        ({"exclude": [0, 2]}, Constraints(exclude=("0", "2"))),
        ({"exclusive": 1}, Constraints(exclusive=True)),
        ({"models": ["A100", "H100"]}, Constraints(models=("A100", "H100"))),
        ({"prefer": ["H100", "A100"]}, Constraints(prefer=("H100", "A100"))),
        ({"max_util": "50"}, Constraints(max_util_pct=50.0)),
        ({"min_free": "10G"}, Constraints(min_free=parse_size("10G"))),
    ],
)
def test_parse_accepts(kwargs: dict, expected: Constraints) -> None:
    got = Constraints.parse(**kwargs)
    assert got == expected
    assert type(got.exclusive) is bool


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": True}, "invalid --count True: expected a whole number >= 1, e.g. 2"),
        ({"count": False}, "invalid --count False: expected a whole number >= 1, e.g. 2"),
        ({"count": 2.0}, "invalid --count 2.0: expected a whole number >= 1, e.g. 2"),
        ({"count": 2.5}, "invalid --count 2.5: expected a whole number >= 1, e.g. 2"),
        ({"count": None}, "invalid --count None: expected a whole number >= 1, e.g. 2"),
        ({"exclude": []}, "invalid --exclude []: empty device id; expected NVML indices or UUIDs "
                          "separated by commas, e.g. 0,2 or GPU-5a1b"),
        ({"exclude": " , 1"}, "invalid --exclude ' , 1': empty device id; expected NVML indices "
                              "or UUIDs separated by commas, e.g. 0,2 or GPU-5a1b"),
    ],
)
def test_parse_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        Constraints.parse(**kwargs)
    assert str(info.value) == message


def test_parse_names_the_max_util_option_in_its_error() -> None:
    with pytest.raises(UsageErrorBase) as info:
        Constraints.parse(max_util="lots")
    assert str(info.value) == (
        "invalid --max-util 'lots': expected a number from 0 to 100, optionally followed by %, "
        "e.g. 50 or 50%"
    )


# ------------------------------------------------------------------- describe / to_json


@pytest.mark.parametrize(
    ("constraints", "text"),
    [
        (Constraints(), "no constraints"),
        (Constraints(count=1), "no constraints"),
        (Constraints(max_util_pct=12.5), "max util 12.5%"),
        (Constraints(count=3), "3 devices"),
        (Constraints(exclude=("0", "GPU-5a1b")), "excluding 0, GPU-5a1b"),
        (Constraints(exclusive=True), "exclusive"),
        (Constraints(models=("A100", "H100")), "model A100 or H100"),
        (Constraints(prefer=("H100", "A100")), "preferring H100, then A100"),
        (
            Constraints(min_free=parse_size("25%"), max_util_pct=50, count=2, exclude=("1",),
                        exclusive=True, models=("A100",), prefer=("H100",)),
            "min free 25% of the device, max util 50%, 2 devices, excluding 1, exclusive, "
            "model A100, preferring H100",
        ),
    ],
)
def test_describe(constraints: Constraints, text: str) -> None:
    assert constraints.describe() == text


def test_to_json_is_every_field() -> None:
    c = Constraints(min_free=parse_size("10G"), max_util_pct=50.0, count=2, exclude=("0",),
                    exclusive=True, models=("A100",), prefer=("H100", "A100"))
    assert c.to_json() == {
        "min_free": parse_size("10G").to_json(),
        "max_util_pct": 50.0,
        "count": 2,
        "exclude": ["0"],
        "exclusive": True,
        "models": ["A100"],
        "prefer": ["H100", "A100"],
        "devices": [],
    }
    assert Constraints().to_json() == {
        "min_free": None, "max_util_pct": None, "count": 1, "exclude": [], "exclusive": False,
        "models": [], "prefer": [], "devices": [],
    }
    assert Constraints(devices=("0", "3:1")).to_json()["devices"] == ["0", "3:1"]


def test_candidate_to_dict() -> None:
    d = gpu(3, 50, 20.0, uuid="GPU-3333cccc")
    b = Booking(d.uuid, lease_count=2, booked_bytes=10 * GiB)
    [c] = rank([d], Constraints(), bookings={d.uuid: b})
    assert c.to_dict() == {
        "uuid": "GPU-3333cccc",
        "label": "GPU 3",
        "name": "NVIDIA A100",
        "index": 3,
        "eligible": True,
        "reasons": ["2 live lease(s)"],
        "effective_free_bytes": 40 * GiB,
        "smoothed_util_pct": 20.0,
        "lease_count": 2,
        "booked_bytes": 10 * GiB,
    }


# ------------------------------------------------------------------------------- matches_id

PLAIN = gpu(3, uuid="GPU-5a1b2c3d-0000")
MIG31 = mig(3, 1, "GPU-5a1b2c3d-0000")


@pytest.mark.parametrize(
    ("device", "ident", "expected"),
    [
        (PLAIN, "3", True),
        (PLAIN, " 3 ", True),
        (PLAIN, "4", False),
        (PLAIN, "", False),
        (PLAIN, "   ", False),
        (MIG31, "3", False),  # an index names the GPU, not its MIG devices
        (MIG31, "3:1", True),
        (MIG31, "3:0", False),
        (MIG31, "2:1", False),
        (PLAIN, "3:1", False),  # a MIG id never names a plain GPU
        (MIG31, "3:1:0", False),  # not an index pair
        (PLAIN, "\u00b3", False),  # a superscript three is no index (and raises nothing)
        (MIG31, "3:\u00b9", False),
        (PLAIN, "\u0663", False),  # nor is an Arabic-Indic three: nvidia-smi prints ASCII digits
        (MIG31, "gpu 3 mig 1", True),
        (PLAIN, "gpu 3", True),
        (PLAIN, "GPU 4", False),
        (PLAIN, "GPU-5a1b2c3d-0000", True),
        (PLAIN, "GPU-5a", True),  # a prefix of six characters is enough
        (PLAIN, "GPU-5", False),  # five are too few
        (PLAIN, "GPU-5b", False),
        (PLAIN, "5a1b2c", False),  # a prefix, not any substring
    ],
)
def test_matches_id(device: DeviceSnapshot, ident: str, expected: bool) -> None:
    assert matches_id(device, ident) is expected


# ------------------------------------------------------------------------ filters, reasons


def test_an_unavailable_device_is_dropped_for_that_alone_and_ranked_last() -> None:
    lost = DeviceSnapshot(index=0, uuid="GPU-lost00", name="x", available=False,
                          memory_free_bytes=None, memory_total_bytes=None)
    ranked = rank([lost, gpu(1)], Constraints(min_free=parse_size("1G"), max_util_pct=10,
                                                 exclusive=True),
                  bookings={"GPU-lost00": Booking("GPU-lost00", lease_count=1)})
    assert [c.device.label for c in ranked] == ["GPU 1", "GPU 0"]
    assert ranked[1].reasons == ("unavailable: unknown error",)
    assert ranked[1].eligible is False


def test_outside_the_allocation_says_what_grants_what() -> None:
    devices = [gpu(0), gpu(1)]
    allocation = current_allocation(devices, {"CUDA_VISIBLE_DEVICES": "1"})
    ranked = rank(devices, Constraints(), allocation=allocation)
    assert [c.device.label for c in ranked if c.eligible] == ["GPU 1"]
    assert ranked[1].reasons == (
        f"outside this process's allocation ({allocation.describe()})",
    )
    assert ranked[1].reasons[0].startswith(
        "outside this process's allocation (CUDA_VISIBLE_DEVICES='1' grants GPU 1"
    )


def test_exclude_names_the_first_matching_id_once_and_covers_mig_devices_of_the_gpu() -> None:
    parent = gpu(0, uuid="GPU-parent00", mig_enabled=True)
    m0 = mig(0, 0, "GPU-parent00")
    other = gpu(1)
    orphan = mig(2, 0, "GPU-gone0000")  # its parent is not listed: only its own ids count
    ranked = rank([parent, m0, other, orphan], Constraints(exclude=("GPU 1", "1", "0")))
    got = reasons(ranked)
    assert got["GPU 1"] == ("excluded by --exclude GPU 1",)
    assert got["GPU 0 MIG 0"] == (
        "excluded by --exclude 0",
        "utilisation unknown: ranked by memory and leases",
    )
    assert got["GPU 0"] == (
        "excluded by --exclude 0",
        "MIG mode is on: use one of its 1 MIG devices instead",
    )
    assert [c.device.label for c in ranked if c.eligible] == ["GPU 2 MIG 0"]


def test_compute_modes() -> None:
    mine, theirs = ProcessSnapshot(pid=4242), ProcessSnapshot(pid=777)

    def with_mode(
        index: int, mode: str, procs: tuple[ProcessSnapshot, ...] | None
    ) -> DeviceSnapshot:
        return DeviceSnapshot(index=index, uuid=f"GPU-{index:04d}aaaa", name="x",
                              memory_total_bytes=80 * GiB, memory_free_bytes=80 * GiB,
                              utilization_pct=0.0, compute_mode=mode, processes=procs)

    devices = [
        with_mode(0, "EXCLUSIVE_THREAD", (theirs, mine)),
        with_mode(1, "EXCLUSIVE_PROCESS", None),  # processes unknown: not "used by others"
        with_mode(2, "EXCLUSIVE_PROCESS", (mine,)),
        with_mode(3, "DEFAULT", (theirs,)),
        with_mode(4, "EXCLUSIVE_PROCESS", (theirs, theirs)),
    ]
    ranked = rank(devices, Constraints(), self_pids=[4242])
    assert reasons(ranked)["GPU 0"] == (
        "compute mode EXCLUSIVE_THREAD and already used by 1 process(es)",
    )
    assert reasons(ranked)["GPU 4"] == (
        "compute mode EXCLUSIVE_PROCESS and already used by 2 process(es)",
    )
    assert [c.device.label for c in ranked if c.eligible] == ["GPU 1", "GPU 2", "GPU 3"]


def test_mig_rules_and_models() -> None:
    bare = gpu(0, uuid="GPU-bare0000", mig_enabled=True)  # MIG on, no MIG devices made
    parent = gpu(1, uuid="GPU-parent11", mig_enabled=True)
    m10, m11 = mig(1, 0, "GPU-parent11"), mig(1, 1, "GPU-parent11")
    h100 = gpu(2, name="NVIDIA H100 80GB HBM3")
    devices = [bare, parent, m10, m11, h100]
    got = reasons(rank(devices, Constraints(count=2)))
    assert got["GPU 0"] == ("MIG mode is on but it has no MIG devices",)
    assert got["GPU 1"] == ("MIG mode is on: use one of its 2 MIG devices instead",)
    assert got["GPU 1 MIG 0"] == (
        "a process can use only one MIG device; 2 devices were asked for",
        "utilisation unknown: ranked by memory and leases",
    )
    ranked = rank(devices, Constraints(models=("h100", "V100")))
    assert [c.device.label for c in ranked if c.eligible] == ["GPU 2"]
    assert reasons(ranked)["GPU 1 MIG 1"][0] == "model NVIDIA A100 is not h100 or V100"
    # One device wanted: each MIG device is a candidate of its own.
    assert [c.device.label for c in rank(devices, Constraints()) if c.eligible] == [
        "GPU 2", "GPU 1 MIG 0", "GPU 1 MIG 1",
    ]


def test_memory_filter_reasons() -> None:
    exact = gpu(0, 10)
    unknown_total = gpu(1, 50, total_gib=None)
    unknown_free = gpu(2, None)
    booked = gpu(3, 30)
    over = gpu(4, 5)
    bookings = {
        booked.uuid: Booking(booked.uuid, booked_bytes=25 * GiB),
        over.uuid: Booking(over.uuid, booked_bytes=8 * GiB),
    }
    ranked = rank([exact, unknown_total, unknown_free, booked, over],
                  Constraints(min_free=parse_size("10G")), bookings=bookings)
    assert reasons(ranked) == {
        "GPU 0": ("10.0 GiB free >= 10.0 GiB wanted",),
        "GPU 1": ("50.0 GiB free >= 10.0 GiB wanted",),
        "GPU 2": ("free memory unknown: cannot check min free 10.0 GiB",),
        "GPU 3": ("only 5.0 GiB free after 25.0 GiB booked by leases < 10.0 GiB wanted",),
        "GPU 4": ("only 0 B free after 8.0 GiB booked by leases < 10.0 GiB wanted",),
    }
    by = {c.device.label: c for c in ranked}
    assert by["GPU 4"].effective_free_bytes == 0  # never negative
    assert by["GPU 3"].effective_free_bytes == 5 * GiB
    assert by["GPU 2"].effective_free_bytes is None
    # A share of total memory cannot be checked when the total is unknown.
    ranked = rank([unknown_total], Constraints(min_free=parse_size("10%")))
    assert ranked[0].reasons == ("free memory unknown: cannot check min free 10% of the device",)
    # No min_free: unknown free memory is only noted.
    assert rank([unknown_free], Constraints())[0].reasons == (
        "free memory unknown: ranked last on memory",
    )
    assert rank([exact], Constraints())[0].reasons == ()


def test_utilisation_filter_reasons() -> None:
    ranked = rank([gpu(0, util=None), gpu(1, util=49.6), gpu(2, util=50.4)],
                  Constraints(max_util_pct=50))
    assert reasons(ranked) == {
        "GPU 0": ("utilisation unknown (not supported here): not filtered on it",),
        "GPU 1": (),
        "GPU 2": ("utilisation 50% > max 50%",),
    }


def test_smoothed_utilisation_replaces_the_reading_even_when_unknown() -> None:
    a, b = gpu(0, util=0.0), gpu(1, util=90.0)
    ranked = rank([a, b], Constraints(max_util_pct=50),
                  smoothed_util={a.uuid: 80.0, b.uuid: None})
    assert reasons(ranked) == {
        "GPU 0": ("utilisation 80% > max 50%",),
        "GPU 1": ("utilisation unknown (not supported here): not filtered on it",),
    }
    assert [c.smoothed_util_pct for c in ranked] == [None, 80.0]


def test_lease_filter_reasons() -> None:
    a, b, c, d = gpu(0), gpu(1), gpu(2), gpu(3)
    bookings = {
        a.uuid: Booking(a.uuid, lease_count=2, exclusive=True),
        b.uuid: Booking(b.uuid, lease_count=1),
        c.uuid: Booking(c.uuid, lease_count=1, exclusive=True),
    }
    got = reasons(rank([a, b, c, d], Constraints(exclusive=True), bookings=bookings))
    assert got == {
        "GPU 0": ("exclusive wanted but 2 lease(s) hold it",),
        "GPU 1": ("exclusive wanted but 1 lease(s) hold it",),
        "GPU 2": ("exclusive wanted but 1 lease(s) hold it",),
        "GPU 3": (),
    }
    got = reasons(rank([a, b, c, d], Constraints(), bookings=bookings))
    assert got == {
        "GPU 0": ("held exclusively by another lease",),
        "GPU 1": ("1 live lease(s)",),
        "GPU 2": ("held exclusively by another lease",),
        "GPU 3": (),
    }
    # A lease on a device dropped for something else is not worth a note.
    got = reasons(rank([b], Constraints(max_util_pct=-1), bookings=bookings))
    assert got == {"GPU 1": ("utilisation 0% > max -1%",)}


# ---------------------------------------------------------------------------- ranking key


def test_ranking_key_is_preference_load_leases_free_gib_uuid() -> None:
    h100 = gpu(0, 60.5, 12.0, uuid="GPU-h1000000", name="NVIDIA H100")
    a100 = gpu(1, 80, 3.0, uuid="GPU-a1000000")
    unknown = gpu(2, None, None, uuid="GPU-unknown0", total_gib=None, name="Tesla V100")
    zero_total = gpu(3, 0, None, uuid="GPU-zero0000", total_gib=0)
    bookings = {a100.uuid: Booking(a100.uuid, lease_count=2, booked_bytes=20 * GiB)}
    ranked = rank([h100, a100, unknown, zero_total], Constraints(prefer=("a100", "H100")),
                  bookings=bookings)
    keys = {c.device.label: c.key for c in ranked}
    assert keys == {
        # a100 first: 60 GiB effective free of 80 is 25 % memory in use -> load step 5
        "GPU 1": (0.0, 5.0, 2.0, -60.0, "GPU-a1000000"),
        # 19.5 GiB of 80 in use (24.4 %) beats 12 % utilisation -> step 4; 60.5 GiB -> 60
        "GPU 0": (1.0, 4.0, 0.0, -60.0, "GPU-h1000000"),
        # nothing known: load 100 %, free memory ranked below zero
        "GPU 2": (2.0, 20.0, 0.0, 1.0, "GPU-unknown0"),
        # a zero total says nothing about load
        "GPU 3": (0.0, 20.0, 0.0, -0.0, "GPU-zero0000"),
    }
    assert [c.device.label for c in ranked] == ["GPU 1", "GPU 3", "GPU 0", "GPU 2"]


@pytest.mark.parametrize(
    ("util", "free_gib", "step"),
    [
        (4.99, 80, 0.0),
        (5.0, 80, 1.0),
        (99.9, 80, 19.0),
        (100.0, 80, 20.0),
        (0.0, 76, 1.0),  # 5 % of memory in use
        (0.0, 76.1, 0.0),
        (0.0, 4.4, 18.0),  # 94.5 % of memory in use: step 18, not 19
        (None, 40, 10.0),
        (30.0, None, 6.0),
    ],
)
def test_load_step_is_the_busiest_resource_in_5_percent_steps(
    util: float | None, free_gib: float | None, step: float
) -> None:
    [c] = rank([gpu(0, free_gib, util)], Constraints())
    assert c.key[1] == step


def test_dropped_devices_follow_eligible_ones_by_index_then_mig_index() -> None:
    p2 = gpu(2, uuid="GPU-p2000000", mig_enabled=True)
    devices = [
        gpu(5, available=False),
        mig(2, 1, "GPU-p2000000", free_gib=0),
        gpu(1, available=False),
        p2,
        mig(2, 0, "GPU-p2000000", free_gib=0),
        gpu(4, 80, 50.0),
        gpu(3, 80, 10.0),
    ]
    ranked = rank(devices, Constraints(min_free=parse_size("1G")))
    assert [c.device.label for c in ranked] == [
        "GPU 3", "GPU 4", "GPU 1", "GPU 2", "GPU 2 MIG 0", "GPU 2 MIG 1", "GPU 5",
    ]


# --------------------------------------------------------------------------------- select


def test_select_takes_the_best_count_skipping_dropped_and_mig_devices_for_several() -> None:
    parent = gpu(0, uuid="GPU-parent00", mig_enabled=True)
    m0, m1 = mig(0, 0, "GPU-parent00", free_gib=10), mig(0, 1, "GPU-parent00", free_gib=10)
    plain = [gpu(1, 70), gpu(2, 60), gpu(3, 1, available=False)]
    ranked = rank([parent, m0, m1, *plain], Constraints())
    assert [c.device.label for c in ranked if c.eligible] == [
        "GPU 0 MIG 0", "GPU 0 MIG 1", "GPU 1", "GPU 2",
    ]
    assert [c.device.label for c in select(ranked, 1)] == ["GPU 0 MIG 0"]
    assert [c.device.label for c in select(ranked, 2)] == ["GPU 1", "GPU 2"]
    assert select(ranked, 3) == []
    assert select(ranked[2:], 1)[0].device.label == "GPU 1"
    # in any order: a dropped device is skipped, not the end of the list
    lost = next(c for c in ranked if not c.eligible and c.device.label == "GPU 3")
    assert [c.device.label for c in select([lost, *ranked[2:]], 1)] == ["GPU 1"]
