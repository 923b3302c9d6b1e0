"""The one admission (core.leasing.admission): who may take which devices, or a place in the
waiting line, and the words of every refusal; exact values, no store, no processes. The same
rules through both real stores are in tests/processes/test_lease_store_contract.py."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.admission import Applicant, Quota
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.errors import LeaseLimitError, NoDeviceFitsError, UsageErrorBase

ANN = Applicant(1001, "ann", frozenset({"ann", "ml"}))
BO = Applicant(1002, "bo", frozenset({"bo"}))
ROOT = Applicant(0, "root")
HINT = "Release one first (%gpu release, or end the kernel / autogpu run holding it)."


def lease(
    devices: tuple[str, ...], *, who: Applicant = BO, exclusive: bool = False, lid: str = "a" * 32
) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lid, kind="lease", device_uuids=devices,
        device_requested_bytes=tuple(None for _ in devices), exclusive=exclusive,
        user=who.user, uid=who.uid, host="h", pid=42, created_s=100.0,
        notebook_path=f"{who.user}.ipynb",
    )


def ticket(
    seq: int | None = 1, *, who: Applicant = BO, count: Any = 1, created_s: float = 100.0,
    lid: str = "b" * 32, **cons: Any,
) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lid, kind="ticket", device_uuids=(), device_requested_bytes=(), exclusive=False,
        user=who.user, uid=who.uid, host="h", pid=43, created_s=created_s, seq=seq,
        constraints={"count": count, "exclude": [], "allowed_uuids": None, **cons},
    )


def request(count: int = 1, **over: Any) -> dict[str, Any]:
    return {"min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None,
            "count": count, "exclude": [], "exclusive": False, "allowed_uuids": None, **over}


# ---- leases ---------------------------------------------------------------------------------


def test_a_free_device_is_admitted() -> None:
    admission.admit_lease([lease(("G1",))], applicant=ANN, devices=["G0"], exclusive=True,
                          quota=Quota())


def test_a_device_held_exclusively_is_refused_naming_its_holders() -> None:
    held = [lease(("G0", "G1"), exclusive=True), lease(("G0",), who=ANN, lid="c" * 32)]
    with pytest.raises(NoDeviceFitsError) as err:
        admission.admit_lease(held, applicant=ANN, devices=["G1", "G0"], exclusive=False,
                              quota=Quota())
    assert str(err.value) == "no device free: G1 is held exclusively by bo: bo.ipynb"


def test_exclusive_wanted_on_a_held_device_is_refused_naming_every_holder() -> None:
    held = [lease(("G0",)), lease(("G0",), who=ANN, lid="c" * 32)]
    admission.admit_lease(held, applicant=ANN, devices=["G0"], exclusive=False, quota=Quota())
    with pytest.raises(NoDeviceFitsError) as err:
        admission.admit_lease(held, applicant=ANN, devices=["G0"], exclusive=True, quota=Quota())
    assert str(err.value) == (
        "no device free: exclusive wanted but G0 is held by bo: bo.ipynb, ann: ann.ipynb"
    )


def test_a_reserved_device_goes_to_members_and_root_only() -> None:
    reserved = {"G0": ["ml", "ops"], "G1": ["ops"]}
    for who in (ANN, ROOT):
        admission.admit_lease([], applicant=who, devices=["G0"], exclusive=False, quota=Quota(),
                              reserved=reserved)
    with pytest.raises(NoDeviceFitsError) as err:
        admission.admit_lease([], applicant=BO, devices=["G2", "G0"], exclusive=False,
                              quota=Quota(), reserved=reserved)
    assert str(err.value) == "no device free: G0 is reserved for group(s) ml, ops by the admin"


# ---- physical GPUs decide (issue 39): a MIG device belongs to its parent ----------------------

#: GPU G1 in MIG mode, with MIG devices M0 and M1; G0 a plain GPU.
PARENTS = {"M0": "G1", "M1": "G1"}


def refusal(leases: list[LeaseRecord], device: str, exclusive: bool = False,
            who: Applicant = ANN, **kw: Any) -> str | None:
    """What the admission says to ``who`` for a lease on ``device`` (``None``: admitted)."""
    try:
        admission.admit_lease(leases, applicant=who, devices=[device], exclusive=exclusive,
                              quota=Quota(), parents=PARENTS, **kw)
    except NoDeviceFitsError as err:
        return str(err)
    return None


def test_a_lease_held_exclusively_keeps_its_whole_physical_gpu_off() -> None:
    """Break 4: an exclusive lease on MIG device M0 keeps its parent G1 and its sibling M1
    off, and one on G1 keeps both MIG devices off; a plain GPU beside them is free. Without
    the fleet's MIG layout each id is judged alone (as before). Seen failing: all granted."""
    on_m0 = [lease(("M0",), exclusive=True)]
    for exclusive in (False, True):
        assert refusal(on_m0, "G1", exclusive) == (
            "no device free: G1: its MIG device M0 is held exclusively by bo: bo.ipynb")
        assert refusal(on_m0, "M1", exclusive) == (
            "no device free: M1: its sibling MIG device M0 is held exclusively by bo: bo.ipynb")
        assert refusal(on_m0, "G0", exclusive) is None
    on_g1 = [lease(("G0", "G1"), exclusive=True)]
    assert refusal(on_g1, "M1") == (
        "no device free: M1: its parent G1 is held exclusively by bo: bo.ipynb")
    admission.admit_lease(on_m0, applicant=ANN, devices=["M1"], exclusive=True, quota=Quota())


def test_exclusive_wanted_needs_the_whole_physical_gpu_unused() -> None:
    """An exclusive lease is refused where any lease uses the physical GPU (parent, sibling,
    MIG device), naming the device and its holder; shared leases on siblings go together."""
    on_m0 = [lease(("M0",))]
    assert refusal(on_m0, "M1", exclusive=True) == (
        "no device free: exclusive wanted but M1: its sibling MIG device M0 is held by bo: "
        "bo.ipynb")
    assert refusal(on_m0, "G1", exclusive=True) == (
        "no device free: exclusive wanted but G1: its MIG device M0 is held by bo: bo.ipynb")
    assert refusal([lease(("G1",))], "M0", exclusive=True) == (
        "no device free: exclusive wanted but M0: its parent G1 is held by bo: bo.ipynb")
    assert refusal(on_m0, "M1") is None
    assert refusal(on_m0, "G1") is None


def test_a_reservation_covers_its_physical_gpu() -> None:
    """Break 3: a reserved GPU's MIG devices are reserved with it, and a reserved MIG device
    reserves its parent (not its siblings); members and root pass. Seen failing: the MIG
    devices of a reserved GPU were admitted for a non-member."""
    on_gpu = {"G1": ["ml"]}
    for mig in ("M0", "M1", "G1"):
        assert refusal([], mig, who=BO, reserved=on_gpu) == (
            f"no device free: {mig} is reserved for group(s) ml by the admin")
        assert refusal([], mig, who=ANN, reserved=on_gpu) is None
        assert refusal([], mig, who=ROOT, reserved=on_gpu) is None
    on_slice = {"M1": ["ops"]}
    assert refusal([], "M0", who=BO, reserved=on_slice) is None
    assert refusal([], "G1", who=BO, reserved=on_slice) == (
        "no device free: G1 is reserved for group(s) ops by the admin")
    both = {"G1": ["ml"], "M1": ["ops"]}
    assert admission.reserved_away(both, BO, PARENTS) == {
        "G1": ("ml", "ops"), "M0": ("ml",), "M1": ("ml", "ops")}
    assert admission.reserved_away(both, ANN, PARENTS) == {"G1": ("ops",), "M1": ("ops",)}
    assert admission.reserved_away(both, BO) == {"G1": ("ml",), "M1": ("ops",)}


def test_a_ticket_may_not_name_a_mig_device_of_a_reserved_gpu() -> None:
    """A ticket naming a MIG device of a GPU reserved away is refused; one that does not is
    admitted with the reserved GPU excluded (the ranking's exclusion of a GPU covers its MIG
    devices)."""
    with pytest.raises(NoDeviceFitsError) as err:
        admission.admit_ticket([], [], applicant=BO, constraints=request(allowed_uuids=["M1"]),
                               quota=Quota(), reserved={"G1": ["ml"]}, parents=PARENTS)
    assert str(err.value) == "no device free: M1 is reserved for group(s) ml by the admin"
    got = admission.admit_ticket([], [], applicant=BO, constraints=request(), quota=Quota(),
                                 reserved={"G1": ["ml"]}, parents=PARENTS)
    assert got["exclude"] == ["G1"]


def test_the_device_quota_counts_distinct_devices_of_the_applicant_only() -> None:
    mine = [lease(("G0", "G1"), who=ANN), lease(("G0",), who=ANN, lid="c" * 32)]
    theirs = [lease(("G2", "G3"), lid="d" * 32)]
    quota = Quota(max_devices=3, source=" for ann", enforcer=" (enforced by the broker)")
    admission.admit_lease(mine + theirs, applicant=ANN, devices=["G1", "G2"], exclusive=False,
                          quota=quota)
    with pytest.raises(LeaseLimitError) as err:
        admission.admit_lease(mine + theirs, applicant=ANN, devices=["G2", "G3"], exclusive=False,
                              quota=quota)
    assert str(err.value) == (
        "ann already holds leases on 2 device(s) (G0, G1); taking 2 more would exceed "
        "max_devices_per_user = 3 set by the admin for ann (enforced by the broker). " + HINT
    )
    with pytest.raises(LeaseLimitError, match=r"on 0 device\(s\) \(none\); taking 2 more"):
        admission.admit_lease([], applicant=BO, devices=["G0", "G1"], exclusive=False,
                              quota=Quota(max_devices=1))


def test_a_quota_of_one_is_a_quota() -> None:
    with pytest.raises(LeaseLimitError, match="max_leases_per_user = 1"):
        admission.admit_lease([lease(("G0",), who=ANN)], applicant=ANN, devices=["G1"],
                              exclusive=False, quota=Quota(max_leases=1))
    with pytest.raises(LeaseLimitError, match="waiting for 2 more would exceed"):
        admission.admit_ticket([], [], applicant=ANN, constraints=request(2),
                               quota=Quota(max_devices=1))
    admission.admit_ticket([], [], applicant=ANN, constraints=request(1),
                           quota=Quota(max_devices=1))


def test_the_lease_quota_counts_leases_shared_or_not() -> None:
    mine = [lease(("G0",), who=ANN, lid=c * 32) for c in "cd"]
    admission.admit_lease(mine[:1], applicant=ANN, devices=["G0"], exclusive=False,
                          quota=Quota(max_devices=1, max_leases=2))
    with pytest.raises(LeaseLimitError) as err:
        admission.admit_lease([*mine, lease(("G0",))], applicant=ANN, devices=["G0"],
                              exclusive=False, quota=Quota(max_devices=1, max_leases=2))
    assert str(err.value) == (
        "ann already holds 2 lease(s); another would exceed max_leases_per_user = 2 set by the "
        "admin. " + HINT
    )


# ---- tickets --------------------------------------------------------------------------------


def test_a_ticket_is_admitted_as_asked_when_nothing_is_reserved() -> None:
    asked = request(2, allowed_uuids=["G0", "G1"])
    got = admission.admit_ticket([], [ticket()], applicant=ANN, constraints=asked, quota=Quota())
    assert got == asked and got is not asked


def test_a_user_holds_at_most_max_tickets() -> None:
    mine = [ticket(1, who=ANN, lid="c" * 32), ticket(2, who=ANN, lid="d" * 32)]
    others = [ticket(3, lid="e" * 32)]
    admission.admit_ticket([], mine[:1] + others, applicant=ANN, constraints=request(),
                           quota=Quota())
    with pytest.raises(LeaseLimitError) as err:
        admission.admit_ticket([], mine + others, applicant=ANN, constraints=request(),
                               quota=Quota(source=" for ann"))
    assert str(err.value) == (
        "ann already waits in line with 2 ticket(s); another would exceed "
        "max_tickets_per_user = 2 set by the admin for ann. Wait for one of them to be served, "
        "or cancel it (interrupt the waiting pick)."
    )
    with pytest.raises(LeaseLimitError, match="max_tickets_per_user = 0"):
        admission.admit_ticket([], [], applicant=ANN, constraints=request(),
                               quota=Quota(max_tickets=0))


def test_a_ticket_counts_what_it_waits_for_against_the_device_quota() -> None:
    held = [lease(("G0",), who=ANN), lease(("G1", "G2"), lid="c" * 32)]
    waiting = [ticket(1, who=ANN, count=2, lid="d" * 32), ticket(2, count=4, lid="e" * 32)]
    quota = Quota(max_devices=4)
    admission.admit_ticket(held, waiting, applicant=ANN, constraints=request(1), quota=quota)
    with pytest.raises(LeaseLimitError) as err:
        admission.admit_ticket(held, waiting, applicant=ANN, constraints=request(2), quota=quota)
    assert str(err.value) == (
        "ann holds leases on 1 device(s) and waits in line for 2 more; waiting for 2 more would "
        "exceed max_devices_per_user = 4 set by the admin. " + HINT
    )
    with pytest.raises(LeaseLimitError, match="waiting for 5 more would exceed"):
        admission.admit_ticket([], [], applicant=BO, constraints=request(5),
                               quota=Quota(max_devices=4))


def test_a_ticket_may_not_name_a_device_reserved_away_and_is_never_served_from_one() -> None:
    reserved = {"G0": ["ml"], "G3": ["ops"]}
    with pytest.raises(NoDeviceFitsError) as err:
        admission.admit_ticket([], [], applicant=BO, constraints=request(allowed_uuids=["G1",
                               "G3"]), quota=Quota(), reserved=reserved)
    assert str(err.value) == "no device free: G3 is reserved for group(s) ops by the admin"
    got = admission.admit_ticket([], [], applicant=BO, constraints=request(exclude=["G3", "G9"]),
                                 quota=Quota(), reserved=reserved)
    assert got["exclude"] == ["G3", "G9", "G0"]
    member = admission.admit_ticket([], [], applicant=ANN, constraints=request(), quota=Quota(),
                                    reserved=reserved)
    assert member["exclude"] == ["G3"]
    bare = admission.admit_ticket([], [], applicant=BO, constraints={"count": 1}, quota=Quota(),
                                  reserved=reserved)
    assert bare == {"count": 1, "exclude": ["G0", "G3"]}
    root = admission.admit_ticket([], [], applicant=ROOT, constraints=request(
        allowed_uuids=["G0", "G3"]), quota=Quota(), reserved=reserved)
    assert root["exclude"] == [] and root["allowed_uuids"] == ["G0", "G3"]


def test_a_ticket_whose_exclusions_would_outgrow_a_record_is_refused() -> None:
    reserved = {f"G{i}": ["ops"] for i in range(60)}
    asked = request(exclude=[f"X{i}" for i in range(5)])
    with pytest.raises(UsageErrorBase) as err:
        admission.admit_ticket([], [], applicant=BO, constraints=asked, quota=Quota(),
                               reserved=reserved)
    assert str(err.value) == (
        "ticket refused: more than 64 devices to exclude (with the 60 the admin reserved for "
        "other groups)"
    )
    asked = request(exclude=[f"X{i}" for i in range(4)])
    got = admission.admit_ticket([], [], applicant=BO, constraints=asked, quota=Quota(),
                                 reserved=reserved)
    assert len(got["exclude"]) == 64


# ---- the waiting line and its words -----------------------------------------------------------


def test_waiters_are_served_by_arrival_then_creation_time_then_id() -> None:
    line = [ticket(5, created_s=1.0, lid="c" * 32), ticket(2, created_s=9.0, lid="a" * 32),
            ticket(5, created_s=0.5, lid="d" * 32), ticket(5, created_s=0.5, lid="b" * 32),
            ticket(None, created_s=50.0, lid="e" * 32)]
    assert [t.lease_id[0] for t in admission.in_line(line)] == ["e", "a", "b", "d", "c"]
    assert admission.line_key(line[0]) == (5, 1.0, "c" * 32)


@pytest.mark.parametrize(
    ("count", "words"),
    [(1, "1 GPU"), (4, "4 GPUs"), (0, "1 GPU"), (True, "1 GPU"), ("4", "1 GPU"), (None, "1 GPU")],
)
def test_a_waiting_ticket_is_named_with_its_user_size_and_time(count: Any, words: str) -> None:
    t = ticket(count=count, created_s=1_700_000_000.0)
    since = time.strftime("%H:%M", time.localtime(1_700_000_000.0))
    assert admission.ticket_text(t) == f"bo's waiting ticket ({words}, since {since})"
    bare = dataclasses.replace(t, constraints=None)
    assert admission.ticket_count(bare) == 1


def test_a_ticket_from_the_far_future_is_named_without_its_time() -> None:
    assert admission.ticket_text(ticket(created_s=1e300)).endswith("(1 GPU, since ?)")


def test_why_a_device_is_exclusive_in_words() -> None:
    reserved = admission.reservation("G0", ["ml", "ops"], "h")
    assert admission.is_reservation(reserved)
    assert reserved == LeaseRecord(
        lease_id="f" * 32, kind="lease", device_uuids=("G0",), device_requested_bytes=(None,),
        exclusive=True, user="reserved for ml,ops", uid=0, host="h", pid=1, created_s=0.0,
        holder_kind="reserved", path="broker:reserved",
    )
    many = admission.reservation("G0", [f"group{i:03d}" for i in range(40)], "h")
    assert len(many.user) == 200 and many.user.startswith("reserved for group000,group001")
    assert admission.exclusive_phrase(reserved) == "reserved for group(s) ml, ops by the admin"
    t = ticket(created_s=1_700_000_000.0)
    assert admission.exclusive_phrase(t) == f"reserved for {admission.ticket_text(t)}"
    assert admission.exclusive_phrase(lease(("G0",), exclusive=True)) == (
        "held exclusively by another lease"
    )
    # Only root's reservation pseudo-lease reads as one: a user's look-alike is a lease.
    forged = dataclasses.replace(reserved, uid=1002)
    assert not admission.is_reservation(forged)
    assert admission.exclusive_phrase(forged) == "held exclusively by another lease"
    assert not admission.is_reservation(dataclasses.replace(reserved, lease_id="c" * 32))
    assert not admission.is_reservation(dataclasses.replace(reserved, holder_kind="kernel"))


def test_reserved_away_is_what_the_applicant_may_not_use() -> None:
    reserved = {"G1": ["ops"], "G0": ["ml"]}
    assert admission.reserved_away(reserved, BO) == {"G0": ("ml",), "G1": ("ops",)}
    assert list(admission.reserved_away(reserved, BO)) == ["G0", "G1"]
    assert admission.reserved_away(reserved, ANN) == {"G1": ("ops",)}
    assert admission.reserved_away(reserved, ROOT) == {}
    assert ROOT.root and not ANN.root
