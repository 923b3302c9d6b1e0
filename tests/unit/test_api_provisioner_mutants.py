"""What the mutation run of ``api.py`` and ``provisioner.py`` (issue 22) found untested, in this
process: the fit check of a kernel's own device (its grant, the other holders' leases, its own
lease hidden, the sampler's utilisation, its own processes), the refusal a provisioned kernel
gets, the choice ``set_visible_devices`` records, the status table's columns and types, and the
first line of a provisioner error. The fake ``libnvidia-ml.so.1`` through the real pynvml binding
and a private lease registry, or snapshots built by hand."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import autogpu_jupyter as ag
from autogpu_jupyter import api
from autogpu_jupyter.config import AutoGPU, default_settings
from autogpu_jupyter.core import session
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import Registry, Requester
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import DeviceBoundError, NoDeviceFitsError, UsageErrorBase
from tests.fakenvml import FakeNvml, fleet_4x

GiB = 1024**3
U = [d["uuid"] for d in fleet_4x()["devices"]]


@pytest.fixture
def host(fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake four-GPU host (GPU 0: 77.5 GiB free, 3 % busy; GPU 1: 39.5 GiB, 97 %; GPU 2:
    21.1 GiB, 12 %; GPU 3: 10.1 GiB, 80 %), no variable set, a private registry."""
    fake_nvml.write(fleet_4x())
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                 "AUTOGPU_LEASE_ID"):
        monkeypatch.delenv(name, raising=False)
    registry = tmp_path / "registry"
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(registry))
    yield registry
    session.release()


def _constraints(**values: object) -> Constraints:
    return api.pick_options(default_settings(), values).constraints


# -- read_snapshot ------------------------------------------------------------------------------


def test_read_snapshot_takes_the_running_samplers_latest_sweep(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a sampler runs, its latest sweep is the snapshot (no second read of the devices);
    a sampler with no sweep yet leaves the read to the backend. Caught: the sampler never asked,
    or its sweep never used (the devices read again every time)."""

    class Running:
        def __init__(self, latest: FleetSnapshot | None) -> None:
            self._latest = latest

        def latest(self) -> FleetSnapshot | None:
            return self._latest

    sweep = FleetSnapshot(
        devices=(DeviceSnapshot(index=0, uuid=U[0], name="Swept"),), timestamp_s=1.0,
        backend="sampler",
    )
    monkeypatch.setattr(api, "_running_sampler", lambda: Running(sweep))
    assert api.read_snapshot() is sweep
    monkeypatch.setattr(api, "_running_sampler", lambda: Running(None))
    assert [d.uuid for d in api.read_snapshot().devices] == U


# -- current_fit: the one decision over this process's own device(s) ------------------------------


def test_the_fit_check_ranks_within_the_grant_as_it_was_before_the_pick(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler granted GPUs 2 and 3; a pick narrowed CUDA_VISIBLE_DEVICES to GPU 2. The fit
    check still sees both granted GPUs (the environment as it was before autogpu changed it), so
    two devices can be chosen. Caught: the check bounded by the narrowed variable (the current
    environment, or none given), which leaves GPU 3 outside the allocation."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [d.uuid for d in ag.pick()] == [U[2]]
    mine = ag.current()
    assert mine is not None
    made, failing = api.current_fit(mine, _constraints(count=2), default_settings())
    assert failing == []
    assert [c.device.uuid for c in made.chosen] == [U[2], U[3]]
    assert made.context.allocation.describe() == (
        "CUDA_VISIBLE_DEVICES='2,3' grants GPU 2, GPU 3")


def test_the_fit_check_counts_another_holders_exclusive_lease(host: Path) -> None:
    """Another kernel holds GPU 0 exclusively; this process's GPU 0 then does not fit an
    exclusive pick, and the check says why. Caught: the check made without the lease store
    (no other lease seen)."""
    with Registry(str(host)).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[U[0]], exclusive=True,
                          requester=Requester(kernel_id="another", kind="kernel"))
    try:
        mine = session.Choice(uuids=(U[0],))
        made, failing = api.current_fit(mine, _constraints(), default_settings())
        assert failing == ["GPU 0: held exclusively by another lease"]
        assert [c.device.uuid for c in made.chosen] == [U[2]]
    finally:
        held.release()


def test_the_fit_check_does_not_count_this_processs_own_lease(host: Path) -> None:
    """This process booked 70 GiB of GPU 0 (77.5 GiB free); asking the same again fits: its own
    booking is not taken away from its own device. Caught: the check's store not hiding this
    process's lease (GPU 0 would seem to have 7.5 GiB left)."""
    assert [d.uuid for d in ag.pick(min_free="70G")] == [U[0]]
    mine = ag.current()
    assert mine is not None and mine.lease_id is not None
    made, failing = api.current_fit(mine, _constraints(min_free="70G"), default_settings())
    assert failing == []
    assert made.candidate(U[0]).effective_free_bytes == 77.5 * GiB  # type: ignore[union-attr]


def test_the_fit_check_judges_utilisation_by_the_samplers_mean(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1 reads 97 % busy now, but the sampler's 30-second mean is 10 %: it meets max util
    50 %. Caught: the check made without the sampler's mean (the instant reading judged)."""
    monkeypatch.setattr(api, "_smoothed_util", lambda: {U[1]: 10.0})
    mine = session.Choice(uuids=(U[1],))
    made, failing = api.current_fit(mine, _constraints(max_util=50), default_settings())
    assert failing == []
    assert made.candidate(U[1]).smoothed_util_pct == 10.0  # type: ignore[union-attr]


def test_the_fit_check_does_not_count_this_process_as_another_user_of_an_exclusive_gpu(
    host: Path, fake_nvml: FakeNvml
) -> None:
    """GPU 0 is in EXCLUSIVE_PROCESS mode and the one process on it is this one: it still fits
    this process. Caught: the check made without this process's pid (its own context would
    count as another process's)."""
    fake_nvml.set(0, compute_mode="EXCLUSIVE_PROCESS",
                  processes=[{"pid": os.getpid(), "used_memory": 2 * GiB}])
    mine = session.Choice(uuids=(U[0],))
    made, failing = api.current_fit(mine, _constraints(), default_settings())
    assert failing == []
    assert made.candidate(U[0]).eligible  # type: ignore[union-attr]


# -- _keep_provisioned: %gpu pick in a kernel the kernelspec started ------------------------------


def test_a_provisioned_kernel_with_two_unfitting_devices_lists_both_and_both_moves(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernelspec gave this kernel GPUs 1 and 3 (97 % and 80 % busy); asked for two devices
    at most 50 % busy, the error names each one's reason, joined by "; ", and both devices that
    would fit, joined by ", ". Caught: either list joined by another separator."""
    monkeypatch.setenv("AUTOGPU_PICKED", f"{U[1]},{U[3]}")
    with pytest.raises(DeviceBoundError) as info:
        ag.pick(max_util=50, count=2)
    assert str(info.value) == (
        "this kernel was started on GPU 1, GPU 3 by the autogpu kernelspec and can use only that "
        "(its CUDA_VISIBLE_DEVICES was set before it started), and GPU 1, GPU 3 does not meet "
        "max util 50%, 2 devices (GPU 1: utilisation 97% > max 50%; GPU 3: utilisation 80% > "
        "max 50%); GPU 0, GPU 2 would fit: move there with %gpu move 0, 2 (restarts the kernel; "
        "its variables are lost). No second lease was taken."
    )


def test_a_kept_provisioned_pick_says_which_allocation_it_was_checked_in(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept result carries the allocation its device was judged in, as every pick result
    does (its JSON form names it). Caught: the kept result built without it (None)."""
    monkeypatch.setenv("AUTOGPU_PICKED", U[0])
    settings = default_settings()
    result, _warning = api.pick_result(api.pick_options(settings, {}), settings=settings)
    assert result.kept
    assert result.to_dict()["allocation"] == (
        "no GPU restriction (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES and SLURM_*_GPUS set "
        "no limit): every GPU is granted"
    )


# -- set_visible_devices ------------------------------------------------------------------------


def test_set_visible_devices_refuses_an_empty_id_with_the_whole_message(host: Path) -> None:
    """An empty entry (or an empty list) is refused with the message whole, its example
    included. Caught: the example's text changed (its case, or other words around it)."""
    for given, shown in (("0,,1", "'0,,1'"), ([], "[]")):
        with pytest.raises(UsageErrorBase) as info:
            ag.set_visible_devices(given)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"invalid device list {shown}: expected NVML indices or UUIDs, e.g. [0, 2] or "
            "'GPU-5a1b'"
        )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_set_visible_devices_records_how_many_devices_and_whether_it_was_forced(
    host: Path,
) -> None:
    """The choice ``set_visible_devices`` records says how many devices it made visible (its
    constraints) and whether it was forced. Caught: the count left out (None) and ``force``
    not passed on (every choice recorded as not forced, or as None)."""
    ag.set_visible_devices([2, 3])
    choice = ag.current()
    assert choice is not None and choice.constraints is not None
    assert (choice.constraints.count, choice.constraints_text) == (2, "2 devices")
    assert choice.forced is False
    ag.set_visible_devices([1], force=True)
    choice = ag.current()
    assert choice is not None and choice.constraints is not None
    assert (choice.constraints.count, choice.constraints_text) == (1, "no constraints")
    assert choice.forced is True


# -- status and status_frame -------------------------------------------------------------------


def test_status_reads_the_leases_of_the_settings_it_is_given(
    host: Path, tmp_path: Path, fake_nvml: FakeNvml
) -> None:
    """``status(settings=...)`` lists the leases of that configuration's registry, not of the
    default one. Caught: the settings given not passed on (the default registry read)."""
    fake_nvml.set(3, processes=[])
    other = tmp_path / "other-registry"
    with Registry(str(other)).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[U[3]], requester=Requester(kernel_id="k-other", kind="kernel"))
    try:
        assert list(ag.status()["holders"])[3] == ""
        df = ag.status(settings=AutoGPU(registry_dir=str(other)))
        assert df.loc[3, "holders"] == "this kernel"  # the lease this test holds
    finally:
        held.release()


def _frame(*devices: DeviceSnapshot) -> object:
    snap = FleetSnapshot(devices=devices, timestamp_s=1.0, backend="test")
    return api.status_frame(snap, None, [])


def test_status_frame_fills_memory_used_state_and_every_holder() -> None:
    """Used memory is shown in its column; a device NVML cannot read says so with its error;
    two processes on one device are both holders, joined by ", ". Caught: the "mem used" key
    misspelt or its value not read, every device shown "ok", the holders joined by another
    separator."""
    ok = DeviceSnapshot(
        index=0, uuid=U[0], name="Fake", memory_total_bytes=80 * GiB,
        memory_used_bytes=5 * GiB, memory_free_bytes=75 * GiB,
        processes=(ProcessSnapshot(pid=1_000_000, used_memory_bytes=1 * GiB),
                   ProcessSnapshot(pid=1_000_001, used_memory_bytes=4 * GiB)),
    )
    lost = DeviceSnapshot(index=1, uuid=U[1], name="Fake", available=False, error="GPU is lost",
                          processes=None)
    df = _frame(ok, lost)
    assert list(df["mem used"]) == ["5.0 GiB", "?"]  # type: ignore[index]
    assert list(df["state"]) == ["ok", "unavailable: GPU is lost"]  # type: ignore[index]
    assert list(df["holders"]) == [  # type: ignore[index]
        "pid 1000000 (1.0 GiB used), pid 1000001 (4.0 GiB used)", ""]


def test_status_frame_keeps_whole_number_columns_whole_when_a_device_is_unknown() -> None:
    """Temperature and process count are whole numbers (rounded) with <NA> where a device does
    not tell (no process list, no temperature): the nullable Int64 type. Caught: either column
    left out of the conversion (floats, NaN) or converted to another type (int64 cannot hold
    <NA>), and a device without a process list read as one with none (a TypeError)."""
    import pandas as pd

    told = DeviceSnapshot(index=0, uuid=U[0], name="Fake", temperature_c=41.6,
                          processes=(ProcessSnapshot(pid=1_000_000),))
    untold = DeviceSnapshot(index=1, uuid=U[1], name="Fake", temperature_c=None, processes=None)
    df = _frame(told, untold)
    for col in ("temp °C", "procs"):
        assert str(df[col].dtype) == "Int64"  # type: ignore[index]
    assert df["temp °C"].tolist() == [42, pd.NA]  # type: ignore[index]
    assert df["procs"].tolist() == [1, pd.NA]  # type: ignore[index]


def test_status_frame_of_a_host_without_devices_still_names_every_column() -> None:
    """A host whose GPUs all vanished: the table is empty but has every column, in order.
    Caught: the columns not named (an empty table with no columns)."""
    df = _frame()
    assert len(df) == 0  # type: ignore[arg-type]
    assert list(df.columns) == [  # type: ignore[attr-defined]
        "", "gpu", "name", "uuid", "util %", "mem used", "mem total", "mem free", "temp °C",
        "power W", "procs", "holders", "state",
    ]


# -- provisioner -------------------------------------------------------------------------------


def test_the_first_line_of_an_error_without_text_is_its_type() -> None:
    """The note of a move that could not be honoured quotes the first line of the error; an
    error with no text is named by its type. Caught: the text's first line taken even when
    there is none (an IndexError), and the type's name taken from None ("NoneType")."""
    from autogpu_jupyter.provisioner import _first_line

    assert _first_line(NoDeviceFitsError("")) == "NoDeviceFitsError"
    assert _first_line(NoDeviceFitsError("no device fits\n  GPU 0: busy")) == "no device fits"
