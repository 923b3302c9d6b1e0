"""Fast tests of the holder model (core.holders) and the kernel contract (core.contract): every
field of every holder a device lists, exactly, and what a provisioned kernel reads from its own
environment."""

from __future__ import annotations

from typing import Any

import pytest

from autogpu_jupyter.core.contract import KernelContract
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.holders import Holder, holders_by_device, holders_text
from autogpu_jupyter.core.leasing.records import LeaseRecord

GiB = 1024**3


def lease(lease_id: str, uuids: tuple[str, ...], pid: int, **over: Any) -> LeaseRecord:
    fields: dict[str, Any] = dict(
        lease_id=lease_id, kind="lease", device_uuids=uuids,
        device_requested_bytes=tuple(2 * GiB for _ in uuids), exclusive=False, user="alice",
        uid=1000, host="h", pid=pid, created_s=1.0,
    )
    fields.update(over)
    return LeaseRecord(**fields)


def test_every_holder_of_every_device_field_by_field() -> None:
    gpu0 = DeviceSnapshot(index=0, uuid="GPU-0", name="L4", processes=(
        ProcessSnapshot(pid=10, used_memory_bytes=3 * GiB, user="alice"),
        ProcessSnapshot(pid=40, used_memory_bytes=GiB, user="dave"),
        ProcessSnapshot(pid=50, used_memory_bytes=None, user="erin"),
    ))
    gpu1 = DeviceSnapshot(index=1, uuid="GPU-1", name="L4", processes=None)
    snap = FleetSnapshot(devices=(gpu0, gpu1), timestamp_s=1.0, backend="test")
    leases = [
        lease("a" * 32, ("GPU-0", "GPU-1"), 10, kernel_id="k-alice", notebook_path="a.ipynb"),
        lease("b" * 32, ("GPU-1",), 77, user="bob", exclusive=True,
              device_requested_bytes=(None,)),
    ]
    by = holders_by_device(
        snap, iter(leases), own_pids=(77, 50), kernel_of_pid={40: "k-dave", 50: ""},
        notebook_of_kernel={"k-dave": "d.ipynb", "": "ghost.ipynb"},
    )
    assert by == {
        "GPU-0": [
            Holder(uuid="GPU-0", user="alice", pid=10, kernel_id="k-alice",
                   notebook_path="a.ipynb", booked_bytes=2 * GiB, used_memory_bytes=3 * GiB,
                   lease_id="a" * 32, exclusive=False, mine=False),
            Holder(uuid="GPU-0", user="dave", pid=40, kernel_id="k-dave",
                   notebook_path="d.ipynb", used_memory_bytes=GiB),
            # A kernel id that is empty names no notebook.
            Holder(uuid="GPU-0", user="erin", pid=50, kernel_id="", notebook_path=None,
                   used_memory_bytes=None, mine=True),
        ],
        "GPU-1": [
            Holder(uuid="GPU-1", user="alice", pid=10, kernel_id="k-alice",
                   notebook_path="a.ipynb", booked_bytes=2 * GiB, used_memory_bytes=None,
                   lease_id="a" * 32),
            Holder(uuid="GPU-1", user="bob", pid=77, booked_bytes=None, lease_id="b" * 32,
                   exclusive=True, mine=True),
        ],
    }
    for h in by["GPU-0"] + by["GPU-1"]:
        assert type(h.mine) is bool
    assert [h.kind for h in by["GPU-0"]] == ["lease+process", "process", "process"]
    assert [h.text() for h in by["GPU-1"]] == [
        "alice: a.ipynb (2.0 GiB booked)",
        "this kernel (exclusive)",
    ]
    assert holders_text(by["GPU-1"]) == "alice: a.ipynb (2.0 GiB booked), this kernel (exclusive)"
    assert holders_text(by["GPU-0"]) == (
        "alice: a.ipynb (2.0 GiB booked, 3.0 GiB used), dave: d.ipynb (1.0 GiB used), this kernel"
    )
    assert holders_text([]) == "nobody"


def test_no_devices_no_holders_and_no_leases_only_processes() -> None:
    assert holders_by_device(FleetSnapshot(devices=(), timestamp_s=0, backend="t"), []) == {}
    gpu = DeviceSnapshot(index=0, uuid="GPU-9", name="L4",
                         processes=(ProcessSnapshot(pid=5, user=None),))
    snap = FleetSnapshot(devices=(gpu,), timestamp_s=0, backend="t")
    (only,) = holders_by_device(snap, [lease("c" * 32, ("GPU-8",), 5)])["GPU-9"]
    assert only == Holder(uuid="GPU-9", user=None, pid=5)
    assert (only.kind, only.text()) == ("process", "pid 5")


# ---- core.contract ------------------------------------------------------------------------


def test_a_kernel_reads_its_contract_from_its_own_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("AUTOGPU_GRANT_CVD", "AUTOGPU_MOVE_FILE", "AUTOGPU_PICK_NOTE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOGPU_PROVISIONED", "1")
    monkeypatch.setenv("AUTOGPU_PICKED", "GPU-7")
    monkeypatch.setenv("AUTOGPU_LEASE_ID", "lid")
    monkeypatch.setenv("AUTOGPU_PICK_OPTIONS", '{"count": 1}')
    c = KernelContract.read()
    assert c == KernelContract(
        provisioned=True, picked=("GPU-7",), lease_id="lid", note=None, options={"count": 1},
        grant_cvd=None, move_file=None,
    )


@pytest.mark.parametrize(
    ("over", "who"),
    [
        ({"notebook_path": "work/train.ipynb", "kernel_id": "1a2b3c4d5e6f"},
         "alice: work/train.ipynb"),
        ({"kernel_id": "1a2b3c4d5e6f"}, "alice: kernel 1a2b3c4d"),
        ({}, "alice: pid 77"),
    ],
)
def test_a_lease_holder_is_worded_alike_by_the_holder_and_the_lease_record(
    over: dict[str, Any], who: str
) -> None:
    """Issue 42, "words once": ``%gpu status``/``autogpu list`` (``Holder``) and the lease
    store's refusals and the broker (``LeaseRecord.holder_text``) word one holder the same."""
    rec = lease("L1", ("GPU-0",), 77, **over)
    snap = FleetSnapshot(
        timestamp_s=1.0, backend="simulated",
        devices=(DeviceSnapshot(index=0, uuid="GPU-0", name="L4"),),
    )
    (holder,) = holders_by_device(snap, [rec])["GPU-0"]
    assert holder.who() == rec.holder_text() == who
    assert holder.text() == f"{who} (2.0 GiB booked)"
    exclusive = lease("L2", ("GPU-0",), 77, exclusive=True, **over)
    (holder,) = holders_by_device(snap, [exclusive])["GPU-0"]
    assert holder.memory() == "2.0 GiB booked, exclusive"
