"""The pure ranking: filters with reasons, a deterministic key, MIG and lease rules."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
from autogpu_jupyter.core.policy import Booking, Constraints, rank, select
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3


def dev(index: int, free_gib: float, util: float | None = 0.0, *, uuid: str | None = None,
        total_gib: float = 80, **kw: object) -> DeviceSnapshot:
    total = int(total_gib * GiB)
    free = int(free_gib * GiB)
    return DeviceSnapshot(
        index=index, uuid=uuid or f"GPU-{index:08d}-0000-0000-0000-000000000000", name="A100",
        memory_total_bytes=total, memory_used_bytes=total - free, memory_free_bytes=free,
        utilization_pct=util, compute_mode="DEFAULT", **kw,  # type: ignore[arg-type]
    )


def labels(cands: list) -> list[str]:
    return [c.device.label for c in cands if c.eligible]


def test_least_loaded_first_by_its_busiest_resource_then_most_free_memory() -> None:
    devices = [dev(0, 10, 0), dev(1, 70, 50), dev(2, 70, 10), dev(3, 40, 0)]
    ranked = rank(devices, Constraints())
    assert labels(ranked) == ["GPU 2", "GPU 1", "GPU 3", "GPU 0"]


def test_noise_of_a_few_mib_does_not_outrank_utilisation() -> None:
    # 3 MiB more free on the busy GPU must not beat the idle one.
    busy = DeviceSnapshot(index=0, uuid="GPU-a", name="x", memory_total_bytes=80 * GiB,
                          memory_free_bytes=70 * GiB + 3 * 1024**2, utilization_pct=95.0)
    idle = DeviceSnapshot(index=1, uuid="GPU-b", name="x", memory_total_bytes=80 * GiB,
                          memory_free_bytes=70 * GiB, utilization_pct=2.0)
    assert labels(rank([busy, idle], Constraints())) == ["GPU 1", "GPU 0"]


def test_ties_are_broken_by_uuid_not_index() -> None:
    devices = [
        dev(0, 80, uuid="GPU-ffff"), dev(1, 80, uuid="GPU-0000"), dev(2, 80, uuid="GPU-8888")
    ]
    assert labels(rank(devices, Constraints())) == ["GPU 1", "GPU 2", "GPU 0"]
    # Deterministic: the same input gives the same order whatever the input order.
    assert labels(rank(list(reversed(devices)), Constraints())) == ["GPU 1", "GPU 2", "GPU 0"]


def test_min_free_drops_with_reason_and_accepts_percent() -> None:
    devices = [dev(0, 5), dev(1, 30)]
    ranked = rank(devices, Constraints(min_free=parse_size("10G")))
    assert labels(ranked) == ["GPU 1"]
    dropped = ranked[1]
    assert dropped.device.label == "GPU 0"
    assert dropped.reasons == ("only 5.0 GiB free < 10.0 GiB wanted",)
    assert ranked[0].reasons == ("30.0 GiB free >= 10.0 GiB wanted",)
    # 25% of 80 GiB is 20 GiB
    assert labels(rank(devices, Constraints(min_free=parse_size("25%")))) == ["GPU 1"]
    assert labels(rank(devices, Constraints(min_free=parse_size("40%")))) == []


def test_unknown_values_are_explained_not_silently_passed() -> None:
    unknown_mem = DeviceSnapshot(index=0, uuid="GPU-a", name="x", utilization_pct=0.0)
    unknown_util = dev(1, 50, None)
    ranked = rank(
        [unknown_mem, unknown_util], Constraints(min_free=parse_size("1G"), max_util_pct=50)
    )
    assert labels(ranked) == ["GPU 1"]
    by = {c.device.label: c for c in ranked}
    assert by["GPU 0"].reasons == ("free memory unknown: cannot check min free 1.0 GiB",)
    assert "utilisation unknown (not supported here): not filtered on it" in by["GPU 1"].reasons


def test_max_util() -> None:
    ranked = rank([dev(0, 80, 60), dev(1, 10, 20)], Constraints(max_util_pct=50))
    assert labels(ranked) == ["GPU 1"]
    assert ranked[1].reasons == ("utilisation 60% > max 50%",)


def test_max_util_is_at_most_so_the_limit_itself_is_kept() -> None:
    ranked = rank([dev(0, 80, 50.0), dev(1, 80, 51.0)], Constraints(max_util_pct=50))
    assert labels(ranked) == ["GPU 0"]
    assert ranked[1].reasons == ("utilisation 51% > max 50%",)


def test_lost_prohibited_and_occupied_exclusive_are_never_chosen() -> None:
    lost = DeviceSnapshot(index=0, uuid="GPU-a", name="x", available=False, error="GPU is lost")
    prohibited = DeviceSnapshot(index=1, uuid="GPU-b", name="x", memory_free_bytes=80 * GiB,
                                memory_total_bytes=80 * GiB, compute_mode="PROHIBITED")
    excl_busy = DeviceSnapshot(index=2, uuid="GPU-c", name="x", memory_free_bytes=80 * GiB,
                               memory_total_bytes=80 * GiB, compute_mode="EXCLUSIVE_PROCESS",
                               processes=(ProcessSnapshot(pid=999999),))
    excl_free = DeviceSnapshot(index=3, uuid="GPU-d", name="x", memory_free_bytes=1 * GiB,
                               memory_total_bytes=80 * GiB, compute_mode="EXCLUSIVE_PROCESS")
    ranked = rank([lost, prohibited, excl_busy, excl_free], Constraints())
    assert labels(ranked) == ["GPU 3"]
    reasons = {c.device.label: c.reasons[0] for c in ranked if not c.eligible}
    assert reasons == {
        "GPU 0": "unavailable: GPU is lost",
        "GPU 1": "compute mode PROHIBITED: no CUDA context allowed",
        "GPU 2": "compute mode EXCLUSIVE_PROCESS and already used by 1 process(es)",
    }
    # Our own process on an exclusive GPU does not make it "occupied".
    assert labels(rank([excl_busy], Constraints(), self_pids=[999999])) == ["GPU 2"]


def test_mig_devices_are_candidates_parent_is_not_and_one_per_pick() -> None:
    parent = dev(0, 80, None, uuid="GPU-parent", mig_enabled=True)
    mig_a = dev(0, 10, None, uuid="MIG-aaaa", total_gib=10, is_mig=True, parent_uuid="GPU-parent",
                mig_index=0, mig_enabled=True)
    mig_b = dev(0, 20, None, uuid="MIG-bbbb", total_gib=20, is_mig=True, parent_uuid="GPU-parent",
                mig_index=1, mig_enabled=True)
    plain = dev(1, 5, 0)
    ranked = rank([parent, mig_a, mig_b, plain], Constraints())
    assert labels(ranked) == ["GPU 0 MIG 1", "GPU 0 MIG 0", "GPU 1"]
    assert [c.device.label for c in select(ranked, 1)] == ["GPU 0 MIG 1"]
    parent_c = next(c for c in ranked if c.device.uuid == "GPU-parent")
    assert parent_c.reasons[0] == "MIG mode is on: use one of its 2 MIG devices instead"
    # Two devices wanted: MIG devices cannot be combined.
    ranked2 = rank([parent, mig_a, mig_b, plain, dev(2, 4, 0)], Constraints(count=2))
    assert [c.device.label for c in select(ranked2, 2)] == ["GPU 1", "GPU 2"]


def test_bookings_lower_effective_free_and_spread_pickers() -> None:
    devices = [dev(i, 80) for i in range(4)]
    bookings: dict[str, Booking] = {}
    counts = {d.uuid: 0 for d in devices}
    for _ in range(32):
        ranked = rank(devices, Constraints(min_free=parse_size("2G")), bookings=bookings)
        best = select(ranked, 1)[0]
        u = best.device.uuid
        counts[u] += 1
        b = bookings.get(u, Booking(u))
        bookings[u] = Booking(u, b.lease_count + 1, b.booked_bytes + 2 * GiB)
    assert sorted(counts.values()) == [8, 8, 8, 8]


def test_lease_count_spreads_when_nothing_is_booked() -> None:
    devices = [dev(i, 80) for i in range(2)]
    b = {devices[0].uuid: Booking(devices[0].uuid, lease_count=1)}
    assert labels(rank(devices, Constraints(), bookings=b)) == ["GPU 1", "GPU 0"]


def test_exclusive() -> None:
    devices = [dev(0, 80), dev(1, 80)]
    b = {devices[0].uuid: Booking(devices[0].uuid, lease_count=1)}
    ranked = rank(devices, Constraints(exclusive=True), bookings=b)
    assert labels(ranked) == ["GPU 1"]
    assert ranked[1].reasons[-1] == "exclusive wanted but 1 lease(s) hold it"
    held = {devices[1].uuid: Booking(devices[1].uuid, lease_count=1, exclusive=True)}
    ranked = rank(devices, Constraints(), bookings=held)
    assert labels(ranked) == ["GPU 0"]
    assert ranked[1].reasons[-1] == "held exclusively by another lease"


def test_a_device_a_waiting_ticket_takes_names_the_ticket_never_another_lease() -> None:
    devices = [dev(0, 80), dev(1, 80)]
    u0, u1 = devices[0].uuid, devices[1].uuid
    waiting = "rt3b's waiting ticket (4 GPUs, since 12:01)"
    b = {
        u0: Booking(u0, lease_count=1, exclusive=True, exclusive_by=(f"reserved for {waiting}",),
                    waiting=(waiting,)),
        u1: Booking(u1, lease_count=2, waiting=(waiting,)),
    }
    ranked = rank(devices, Constraints(), bookings=b)
    assert ranked[1].device.uuid == u0
    assert ranked[1].reasons[-1] == f"reserved for {waiting}"
    ranked = rank(devices, Constraints(exclusive=True), bookings=b)
    assert {c.device.uuid: c.reasons[-1] for c in ranked} == {
        u0: f"exclusive wanted but it is reserved for {waiting}",
        u1: f"exclusive wanted but 1 lease(s) hold it; it is reserved for {waiting}",
    }
    both = {u0: Booking(u0, lease_count=2, exclusive=True, exclusive_by=(
        "held exclusively by another lease", f"reserved for {waiting}"), waiting=(waiting,))}
    ranked = rank(devices[:1], Constraints(), bookings=both)
    assert ranked[0].reasons[-1] == (
        f"held exclusively by another lease; reserved for {waiting}"
    )


def test_exclude_by_index_uuid_prefix_and_label() -> None:
    devices = [
        dev(0, 80, uuid="GPU-11111111"),
        dev(1, 80, uuid="GPU-22222222"),
        dev(2, 80, uuid="GPU-33333333"),
    ]
    assert labels(rank(devices, Constraints(exclude=("0", "GPU-222222")))) == ["GPU 2"]
    assert labels(rank(devices, Constraints(exclude=("gpu 2",)))) == ["GPU 0", "GPU 1"]


def test_select_needs_enough_devices() -> None:
    devices = [dev(0, 80), dev(1, 1)]
    ranked = rank(devices, Constraints(min_free=parse_size("10G"), count=2))
    assert select(ranked, 2) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": "-1"}, "invalid --count '-1': expected a whole number >= 1, e.g. 2"),
        ({"count": 0}, "invalid --count 0: expected a whole number >= 1, e.g. 2"),
        ({"count": "two"}, "invalid --count 'two': expected a whole number >= 1, e.g. 2"),
        ({"exclude": ""}, "invalid --exclude '': empty device id; expected NVML indices or UUIDs "
                          "separated by commas, e.g. 0,2 or GPU-5a1b"),
        ({"exclude": "0,,1"}, "invalid --exclude '0,,1': empty device id; expected NVML indices or "
                              "UUIDs separated by commas, e.g. 0,2 or GPU-5a1b"),
    ],
)
def test_constraints_parse_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        Constraints.parse(**kwargs)
    assert str(info.value) == message


def test_constraints_describe() -> None:
    c = Constraints.parse(min_free="10G", max_util="50", count=2, exclude="0,3", exclusive=True)
    assert c.describe() == "min free 10.0 GiB, max util 50%, 2 devices, excluding 0, 3, exclusive"
    assert Constraints().describe() == "no constraints"


def test_load_is_the_busiest_resource() -> None:
    # Nearly full memory at 0 % utilisation is more loaded than 25 % memory at 40 %.
    full_idle = dev(0, 4, 0.0)
    half_busy = dev(1, 60, 40.0)
    ranked = rank([full_idle, half_busy], Constraints())
    assert labels(ranked) == ["GPU 1", "GPU 0"]


def test_leases_rank_before_free_memory_at_equal_load() -> None:
    a = dev(0, 79, 0.0)  # one lease, a bit more memory
    b = dev(1, 77, 0.0)
    ranked = rank([a, b], Constraints(), bookings={a.uuid: Booking(a.uuid, lease_count=1)})
    assert labels(ranked) == ["GPU 1", "GPU 0"]


def test_unknown_utilisation_ranks_by_memory_and_says_so() -> None:
    mig = dev(0, 9, None, uuid="MIG-1", total_gib=10, is_mig=True, parent_uuid="GPU-p", mig_index=0)
    plain = dev(1, 40, 30.0)
    ranked = rank([mig, plain], Constraints())
    # MIG: 10 % of memory in use, utilisation unknown -> load 10 %; plain GPU: 50 % memory.
    assert labels(ranked) == ["GPU 0 MIG 0", "GPU 1"]
    assert ranked[0].reasons == ("utilisation unknown: ranked by memory and leases",)


def _mig_family() -> list[DeviceSnapshot]:
    parent = dev(0, 80, None, uuid="GPU-parent", mig_enabled=True)
    mig_a = dev(0, 30, None, uuid="MIG-aaaa", total_gib=40, is_mig=True, parent_uuid="GPU-parent",
                mig_index=0, mig_enabled=True)
    mig_b = dev(0, 10, None, uuid="MIG-bbbb", total_gib=10, is_mig=True, parent_uuid="GPU-parent",
                mig_index=1, mig_enabled=True)
    return [parent, mig_a, mig_b, dev(1, 80, 0.0)]


def test_a_mig_device_is_ranked_by_its_own_leases_not_its_parents() -> None:
    """Issue 22: a MIG device is booked by the leases naming it, never by its parent's or its
    siblings' (separate memory, separate holders). Caught: ``rank`` reading the booking of
    ``parent_uuid or uuid`` (MIG 1's own lease ignored, the parent's lease count charged to
    both MIGs)."""
    devices = _mig_family()
    held = {"MIG-bbbb": Booking("MIG-bbbb", lease_count=1, booked_bytes=2 * GiB)}
    ranked = rank(devices, Constraints(), bookings=held)
    assert sorted((c.device.label, c.eligible, c.lease_count, c.effective_free_bytes)
                  for c in ranked if c.device.is_mig) == [
        ("GPU 0 MIG 0", True, 0, 30 * GiB), ("GPU 0 MIG 1", True, 1, 8 * GiB)]
    # A booking under the parent's UUID (a lease written before MIG mode was switched on) books
    # neither MIG device: both keep their own free memory and lease count.
    on_parent = {"GPU-parent": Booking("GPU-parent", lease_count=3, booked_bytes=70 * GiB)}
    ranked = rank(devices, Constraints(min_free=parse_size("8G")), bookings=on_parent)
    assert sorted((c.device.label, c.lease_count, c.effective_free_bytes) for c in ranked
                  if c.eligible) == [
        ("GPU 0 MIG 0", 0, 30 * GiB), ("GPU 0 MIG 1", 0, 10 * GiB), ("GPU 1", 0, 80 * GiB)]


def reasons_of(ranked: list, uuid: str) -> tuple[bool, tuple[str, ...]]:
    (c,) = [c for c in ranked if c.device.uuid == uuid]
    return c.eligible, c.reasons


def test_exclusivity_follows_the_physical_gpu_across_parent_and_siblings() -> None:
    """Issue 39, break 4: a lease held exclusively on a MIG device keeps its siblings and its
    parent out, and one on the parent keeps every MIG device of it out, in the admission's
    words; a plain GPU beside them is untouched. Seen failing: both MIG devices stayed
    eligible beside an exclusive lease on their parent."""
    devices = _mig_family()
    note = "utilisation unknown: ranked by memory and leases"
    on_b = {"MIG-bbbb": Booking("MIG-bbbb", lease_count=1, exclusive=True)}
    ranked = rank(devices, Constraints(), bookings=on_b)
    assert labels(ranked) == ["GPU 1"]
    assert reasons_of(ranked, "MIG-aaaa") == (False, (
        note, "its sibling MIG device GPU 0 MIG 1 is held exclusively by another lease"))
    assert reasons_of(ranked, "MIG-bbbb") == (False, (note, "held exclusively by another lease"))
    assert reasons_of(ranked, "GPU-parent")[1][-1] == (
        "its MIG device GPU 0 MIG 1 is held exclusively by another lease")
    on_parent = {"GPU-parent": Booking("GPU-parent", lease_count=1, exclusive=True,
                                       exclusive_by=("reserved for group(s) ml by the admin",))}
    ranked = rank(devices, Constraints(), bookings=on_parent)
    assert labels(ranked) == ["GPU 1"]
    for uuid in ("MIG-aaaa", "MIG-bbbb"):
        assert reasons_of(ranked, uuid) == (False, (
            note, "its parent GPU 0 is reserved for group(s) ml by the admin"))


def test_an_exclusive_pick_wants_the_whole_physical_gpu_free() -> None:
    """Exclusive wanted: a MIG device whose sibling or parent any lease or waiting ticket
    uses is dropped, naming them; a shared pick still takes it (leases stay per device)."""
    devices = _mig_family()
    note = "utilisation unknown: ranked by memory and leases"
    waiting = "rt3b's waiting ticket (1 GPU, since 12:01)"
    held = {
        "MIG-bbbb": Booking("MIG-bbbb", lease_count=2, waiting=(waiting,)),
    }
    ranked = rank(devices, Constraints(exclusive=True), bookings=held)
    assert labels(ranked) == ["GPU 1"]
    assert reasons_of(ranked, "MIG-aaaa") == (False, (
        note, "exclusive wanted but its sibling MIG device GPU 0 MIG 1 is held by 1 lease(s) "
        f"and reserved for {waiting}"))
    only_ticket = {"GPU-parent": Booking("GPU-parent", lease_count=1, waiting=(waiting,))}
    ranked = rank(devices, Constraints(exclusive=True), bookings=only_ticket)
    assert reasons_of(ranked, "MIG-bbbb") == (False, (
        note, f"exclusive wanted but its parent GPU 0 is reserved for {waiting}"))
    assert sorted(labels(rank(devices, Constraints(), bookings=held))) == [
        "GPU 0 MIG 0", "GPU 0 MIG 1", "GPU 1"]


def test_a_mig_device_reserved_itself_is_not_worded_twice() -> None:
    """A device already out for its own exclusive booking (a reservation that covers the
    whole physical GPU) keeps that one reason, not its parent's again."""
    devices = _mig_family()
    phrase = "reserved for group(s) ml by the admin"
    bookings = {u: Booking(u, lease_count=1, exclusive=True, exclusive_by=(phrase,))
                for u in ("GPU-parent", "MIG-aaaa", "MIG-bbbb")}
    ranked = rank(devices, Constraints(), bookings=bookings)
    assert reasons_of(ranked, "MIG-aaaa") == (False, (
        "utilisation unknown: ranked by memory and leases", phrase))


def test_the_fleet_names_the_physical_gpu_when_only_a_part_is_ranked() -> None:
    """A waiting ticket ranks only the devices it may use: the parent's exclusive lease is
    found through ``fleet``, the whole host."""
    parent, mig_a, mig_b, _plain = _mig_family()
    on_parent = {"GPU-parent": Booking("GPU-parent", lease_count=1, exclusive=True)}
    assert labels(rank([mig_a], Constraints(), bookings=on_parent)) == ["GPU 0 MIG 0"]
    ranked = rank([mig_a], Constraints(), bookings=on_parent, fleet=[parent, mig_a, mig_b])
    assert reasons_of(ranked, "MIG-aaaa")[1][-1] == (
        "its parent GPU 0 is held exclusively by another lease")


# ---- named devices (issue 41) ------------------------------------------------------------------


def test_named_devices_are_the_only_candidates_by_index_uuid_prefix_label_and_mig_id() -> None:
    parent = dev(0, 80, None, uuid="GPU-parent", mig_enabled=True)
    mig_a = dev(0, 10, None, uuid="MIG-aaaaaaaa", total_gib=10, is_mig=True,
                parent_uuid="GPU-parent", mig_index=0, mig_enabled=True)
    mig_b = dev(0, 20, None, uuid="MIG-bbbbbbbb", total_gib=20, is_mig=True,
                parent_uuid="GPU-parent", mig_index=1, mig_enabled=True)
    idle, busy = dev(1, 80, 0, uuid="GPU-11111111"), dev(2, 8, 90, uuid="GPU-22222222")
    fleet = [parent, mig_a, mig_b, idle, busy]
    # the busy GPU 2, because it was named: the ranking never looks at the others
    assert labels(rank(fleet, Constraints(devices=("2",)))) == ["GPU 2"]
    assert labels(rank(fleet, Constraints(devices=("GPU-222222",)))) == ["GPU 2"]
    assert labels(rank(fleet, Constraints(devices=("gpu 2", "1")))) == ["GPU 1", "GPU 2"]
    # a MIG id names one MIG device; a GPU in MIG mode named stands for its MIG devices
    assert labels(rank(fleet, Constraints(devices=("0:0",)))) == ["GPU 0 MIG 0"]
    assert labels(rank(fleet, Constraints(devices=("0",)))) == ["GPU 0 MIG 1", "GPU 0 MIG 0"]
    other = next(c for c in rank(fleet, Constraints(devices=("2",))) if c.device.index == 1)
    assert other.reasons == ("not named (only 2 asked for)",)
    assert other.fixed


def test_a_drop_that_no_wait_changes_is_marked_fixed_and_a_busy_device_is_not() -> None:
    """What `--wait` can never help (issue 41): the request's own restrictions."""
    devices = [dev(0, 80, uuid="GPU-11111111"), dev(1, 2, 0, uuid="GPU-22222222")]
    fixed = {
        c.device.label: c.fixed
        for c in rank(devices, Constraints.parse(exclude="0", min_free="10G"))
    }
    assert fixed == {"GPU 0": True, "GPU 1": False}  # GPU 1 may free its memory
    assert all(c.fixed for c in rank(devices, Constraints(models=("H100",))))
    assert not any(c.fixed for c in rank(devices, Constraints()))


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("0,", "invalid --devices '0,': empty device id; expected device indices, UUIDs (or their "
               "first 6 or more characters) or MIG ids such as 3:1, separated by commas, e.g. 2 "
               "or 0,3 or GPU-5a1b"),
        ([], "invalid --devices []: empty device id"),
    ],
)
def test_named_devices_parse_refuses_an_empty_id(devices: object, message: str) -> None:
    with pytest.raises(UsageErrorBase) as err:
        Constraints.parse(devices=devices)
    assert str(err.value).startswith(message)


def test_describe_names_the_devices_and_how_many_of_them() -> None:
    assert Constraints.parse(devices="2").describe() == "device 2"
    assert Constraints.parse(devices="0,3", count=2).describe() == "devices 0,3"
    assert Constraints.parse(devices="0,3", count=1).describe() == "1 of devices 0,3"
    assert Constraints.parse(devices=[2]).devices == ("2",)
