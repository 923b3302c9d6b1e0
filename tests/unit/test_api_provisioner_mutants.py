"""What the mutation run of ``api.py`` and ``provisioner.py`` (issue 22) found untested, in this
process. The API: the sampler a pick reads (only a running one, its 30-second mean), what
``pick_result`` passes on (force, progress lines, the sampler's mean) and records (forced), the
fit check of a kernel's own device (its grant, the other holders' leases, its own lease hidden,
the sampler's mean, its own processes), the refusal a provisioned kernel gets, the choice
``set_visible_devices`` records, and the status table's columns and types. The provisioner: the
whole environment a kernel starts with (a pick, CPU-only), the whole refusal of a "fail"
kernelspec, the runtime directory it makes, the arguments it keeps for itself, the lease around
a launch, cleanup before a restart, and the option refusals. The fake ``libnvidia-ml.so.1``
through the real pynvml binding with a private lease registry, ``test_provisioner``'s simulated
two-GPU server, or snapshots and leases built by hand."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import AsyncKernelManager

import autogpu_jupyter as ag
from autogpu_jupyter import api
from autogpu_jupyter.config import AutoGPU, default_settings
from autogpu_jupyter.core import session
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import Registry, Requester
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import DeviceBoundError, NoDeviceFitsError, UsageErrorBase
from tests.fakenvml import FakeNvml, fleet_4x
from tests.payloadhelpers import write_fleet
from tests.unit.test_provisioner import A, B, Host, fleet_file

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


# -- the sampler a pick reads, and pick_result ---------------------------------------------------


class _Sampler:
    """A stand-in for the process's sampler: running or not; its mean is the window asked."""

    def __init__(self, running: bool) -> None:
        self.running = running

    def smoothed_util(self, window_s: float) -> dict[str, float | None]:
        return {U[0]: window_s}


def test_only_a_running_sampler_is_the_processs_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's sampler is used while it runs; a stopped one, or none, is no sampler; its
    mean is over the last 30 seconds. Caught: the sampler never looked up, a running one
    ignored, the window changed."""
    from autogpu_jupyter.core import sampler as sampler_mod

    running, stopped = _Sampler(True), _Sampler(False)
    for current, want in ((running, running), (stopped, None), (None, None)):
        monkeypatch.setattr(sampler_mod, "current_sampler", lambda c=current: c)
        assert api._running_sampler() is want
    monkeypatch.setattr(sampler_mod, "current_sampler", lambda: running)
    assert api._smoothed_util() == {U[0]: 30.0}


def _cuda_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))


def test_pick_result_is_not_forced_unless_asked(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After CUDA started, ``pick_result`` without ``force`` refuses (the settings refuse by
    default). Caught: ``force`` on by default."""
    from autogpu_jupyter.errors import TooLateError

    _cuda_started(monkeypatch)
    settings = default_settings()
    with pytest.raises(TooLateError):
        api.pick_result(api.pick_options(settings, {}), settings=settings)
    assert ag.current() is None and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_pick_records_whether_it_was_forced(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pick made in time is recorded as not forced; one made after CUDA started (the settings
    allowing it) as forced. Caught: ``forced`` not passed on, or read the wrong way round."""
    settings = AutoGPU(refuse_when_initialized=False)
    api.pick_result(api.pick_options(settings, {}), settings=settings)
    choice = ag.current()
    assert choice is not None and choice.forced is False
    _cuda_started(monkeypatch)
    api.pick_result(api.pick_options(settings, {}), settings=settings)
    choice = ag.current()
    assert choice is not None and choice.forced is True


def test_pick_result_ranks_by_the_samplers_mean(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 0 reads 3 % busy now, but the sampler's mean is 90 %: a pick for at most 50 % leaves
    it out and takes GPU 2. Caught: the pick made without the sampler's mean."""
    monkeypatch.setattr(api, "_smoothed_util", lambda: {U[0]: 90.0})
    settings = default_settings()
    result, _warning = api.pick_result(
        api.pick_options(settings, {"max_util": 50}), dry_run=True, settings=settings)
    assert [d.uuid for d in result.chosen] == [U[2]]


def test_pick_result_passes_the_waiting_lines_on(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pick waiting in line tells its caller each try (what ``%gpu pick --wait`` prints).
    Here a pretend clock: 200 GiB never fits, the pick waits 2 s in two tries. Caught: the
    caller's ``on_progress`` not passed on to the picker."""
    import functools

    from autogpu_jupyter.core import picker

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(api, "_pick", functools.partial(
        picker.pick, sleep=sleep, clock=lambda: now[0]))
    said: list[str] = []
    settings = default_settings()
    with pytest.raises(NoDeviceFitsError):
        api.pick_result(api.pick_options(settings, {"min_free": "200G", "wait": "2s"}),
                        settings=settings, on_progress=said.append)
    assert said == [
        f"waiting for a device (min free 200.0 GiB), {t} of 2s; best now GPU 0: only 77.5 GiB "
        "free < 200.0 GiB wanted"
        for t in ("0s", "1s")
    ]


def test_a_processs_lease_holder_is_the_api_and_its_command_line_at_most_500_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside a kernel the holder kind is "api" by default; the command line recorded is cut
    at 500 characters (and is None when there is none). Caught: the default kind misspelt, the
    cut moved."""
    monkeypatch.setattr("sys.argv", ["train.py", "x" * 600])
    who = api.requester_for_this_process()
    assert (who.kind, who.kernel_id) == ("api", None)
    assert who.command == "train.py " + "x" * 491
    monkeypatch.setattr("sys.argv", [])
    assert api.requester_for_this_process().command is None


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


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    """test_provisioner's host: two simulated A100s (A: 70 GiB free, B: 40 GiB), a private
    registry, runtime directory and kernelspec folder."""
    h = Host(tmp_path, monkeypatch)
    yield h
    h.close()


def _started_with(env: dict[str, str]) -> dict[str, str]:
    """What the provisioner set or changed in the kernel's environment."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def test_a_kernel_is_started_with_exactly_the_picks_variables(server: Host) -> None:
    """The whole of what a start adds to the kernel's environment, and nothing else: the pick
    (device order, devices, picked UUIDs), its lease and descriptor, the (empty) ROCm grant,
    that it was provisioned, its options and its move file; the notes and grant a server
    inherited from a kernel of its own are dropped. The provisioner's attributes say the same.
    Caught: any of those values altered or left out, an inherited note or grant passed on."""
    server.install("agp", min_free="10G")
    km, kwargs = server.pre_start("agp", AUTOGPU_PICK_NOTE="stale", AUTOGPU_GRANT_CVD="0")
    (lease,) = server.registry.list_leases()
    fd = kwargs["pass_fds"][-1]
    move_file = str(server.tmp / "runtime" / f"autogpu-move-{km.kernel_id}.json")
    assert _started_with(kwargs["env"]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": A,
        "AUTOGPU_PICKED": A,
        "AUTOGPU_LEASE_ID": lease.lease_id,
        "AUTOGPU_LEASE_FD": str(fd),
        "AUTOGPU_GRANT_ROCM": "{}",
        "AUTOGPU_PROVISIONED": "1",
        "AUTOGPU_PICK_OPTIONS": '{"min_free": "10G", "max_util": null, "count": 1, '
                                '"exclusive": false}',
        "AUTOGPU_MOVE_FILE": move_file,
    }
    assert "AUTOGPU_PICK_NOTE" not in kwargs["env"] and "AUTOGPU_GRANT_CVD" not in kwargs["env"]
    assert kwargs["pass_fds"] == (fd,)
    prov = km.provisioner
    assert (prov.autogpu_picked, prov.autogpu_constraints.describe(), prov.autogpu_note,
            prov.autogpu_lease_id, prov.autogpu_move_file) == (
        (A,), "min free 10.0 GiB", None, lease.lease_id, move_file)


def test_a_cpu_only_kernel_is_started_with_exactly_the_hiding_variables(server: Host) -> None:
    """Nothing fits: the start adds every GPU hidden (empty CUDA and ROCr lists, in PCI order),
    no picked device, the note, and no lease; the provisioner keeps the note and no pick.
    Caught: a hiding variable or the note altered, a lease variable set without a lease."""
    server.install("big", min_free="75G")
    km, kwargs = server.pre_start("big")
    note = (
        'no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES="") because no device '
        "fits (min free 75.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 70.0 GiB free < 75.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted"
    )
    assert _started_with(kwargs["env"]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "ROCR_VISIBLE_DEVICES": "",
        "AUTOGPU_PICKED": "",
        "AUTOGPU_PICK_NOTE": note,
        "AUTOGPU_GRANT_ROCM": "{}",
        "AUTOGPU_PROVISIONED": "1",
        "AUTOGPU_PICK_OPTIONS": '{"min_free": "75G", "max_util": null, "count": 1, '
                                '"exclusive": false}',
        "AUTOGPU_MOVE_FILE": str(server.tmp / "runtime" / f"autogpu-move-{km.kernel_id}.json"),
    }
    assert "pass_fds" not in kwargs
    prov = km.provisioner
    assert (prov.autogpu_picked, prov.autogpu_note, prov.autogpu_lease_id) == ((), note, None)


def test_a_two_device_kernel_is_told_both_uuids_and_the_log_names_both_devices(
    server: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel is told its UUIDs joined by ","; the server's log line names both devices
    (label and UUID) joined by ", ". Caught: either joined by another separator."""
    logger = logging.getLogger("autogpu-test-kernels")
    server.install("two", count=2)
    km = AsyncKernelManager(kernel_name="two", log=logger)
    server.managers.append(km)
    with caplog.at_level(logging.INFO, logger="autogpu-test-kernels"):
        _km, kwargs = server.pre_start("two", km=km)
    assert kwargs["env"]["AUTOGPU_PICKED"] == f"{A},{B}"
    assert km.provisioner.autogpu_picked == (A, B)
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"] == [
        f"autogpu: kernel {km.kernel_id} gets GPU 0 {A}, GPU 1 {B} (2 devices)"]


def test_a_move_made_without_a_lease_says_both_in_its_note(
    server: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move to B is honoured while the registry cannot be used: the note says both, the
    move's first, joined by "; ". Caught: the pick's own note dropped when a lease note
    follows."""
    from autogpu_jupyter.core import moves

    server.install("agp", min_free="10G")
    km, _kwargs = server.pre_start("agp")
    prov = km.provisioner
    moves.request_move(prov.autogpu_move_file, B, current_uuids=(A,),
                       constraints=prov.autogpu_constraints, kernel_id=km.kernel_id)
    blocker = server.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(blocker / "registry"))
    _km, kwargs = server.pre_start("agp", km=km)
    assert kwargs["env"]["AUTOGPU_PICKED"] == B
    assert kwargs["env"]["AUTOGPU_PICK_NOTE"] == (
        "moved at your request: the kernel's state was lost; cannot use lease registry "
        f"{blocker}/registry: Not a directory; ask the admin to create it (install -d -m 1777 "
        f"-o root {blocker}/registry) or set AUTOGPU_REGISTRY_DIR / c.AutoGPU.registry_dir: "
        "picked without a lease"
    )


def test_a_refused_start_is_logged_as_the_error_it_raises(
    server: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing fits a "fail" kernelspec: the server's log gets the refusal's own text, once.
    Caught: the log call's argument or format changed (None, a bare "%s", other words)."""
    logger = logging.getLogger("autogpu-test-kernels")
    server.install("strict", min_free="75G", on_no_device="fail")
    km = AsyncKernelManager(kernel_name="strict", log=logger)
    server.managers.append(km)
    with caplog.at_level(logging.ERROR, logger="autogpu-test-kernels"), \
            pytest.raises(NoDeviceFitsError) as info:
        server.pre_start("strict", km=km)
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"] == [
        str(info.value)]


def test_a_kernels_lease_names_the_notebook_of_the_kernels_session(
    server: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jupyter_server names the notebook in the kernel's environment (``JPY_SESSION_NAME``),
    not in its own: the kernel's lease names it. Caught: the lease taken without a notebook,
    or with the server's own (none)."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("AUTOGPU_SERVER_ROOT", raising=False)
    server.install("agp", min_free="10G")
    server.pre_start("agp", JPY_SESSION_NAME="work/train.ipynb")
    (lease,) = server.registry.list_leases()
    assert lease.notebook_path == "work/train.ipynb"


def test_a_fail_kernelspec_refuses_with_the_whole_reason(server: Host) -> None:
    """``on_no_device="fail"`` and nothing fits: the refusal is the pick's reason in full, then
    what to do, and no "waited" part (the kernelspec did not wait). Caught: the message's words
    altered, or a "waited" part added without a wait."""
    server.install("strict", min_free="75G", on_no_device="fail")
    with pytest.raises(NoDeviceFitsError) as info:
        server.pre_start("strict")
    assert str(info.value) == (
        "autogpu: kernel not started: no device fits (min free 75.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 70.0 GiB free < 75.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted. The kernelspec "
        'says on_no_device="fail"; try again later, or use a kernelspec with other options.'
    )


def test_the_servers_min_free_is_the_one_the_kernel_is_told_when_the_kernelspec_has_none(
    server: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The options the kernel is told name the server's min_free where the kernelspec has none,
    and null where neither has one. Caught: the server's setting not read, or read the wrong
    way (null in place of it, or "" in place of null)."""
    server.install("agp")
    _km, kwargs = server.pre_start("agp")
    assert json.loads(kwargs["env"]["AUTOGPU_PICK_OPTIONS"])["min_free"] is None
    monkeypatch.setenv("AUTOGPU_MIN_FREE", "10G")
    _km, kwargs = server.pre_start("agp")
    assert json.loads(kwargs["env"]["AUTOGPU_PICK_OPTIONS"])["min_free"] == "10G"


def test_a_missing_runtime_directory_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's runtime directory, where move requests are written, is created mode 0700
    when it does not exist yet. Caught: it created with another mode."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    runtime = tmp_path / "not-yet" / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    old = os.umask(0o022)
    try:
        assert AutoGPUProvisioner(kernel_id="k-1")._move_file() == str(
            runtime / "autogpu-move-k-1.json")
    finally:
        os.umask(old)
    assert runtime.stat().st_mode & 0o777 == 0o700


def test_a_kernel_without_a_move_file_is_still_given_its_device(
    server: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime directory cannot be made (a file is in the way): moves are off, no move
    request is looked for, and the kernel starts on its device all the same, told no move
    file. Caught: a move request looked for with no file (a TypeError stopping the start)."""
    blocker = server.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(blocker / "runtime"))
    server.install("agp", min_free="10G")
    km, kwargs = server.pre_start("agp")
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == (A, A)
    assert "AUTOGPU_MOVE_FILE" not in env and km.provisioner.autogpu_move_file is None


def _pick_for_kernel(
    previous: tuple[str, ...], config: dict[str, Any], environ: dict[str, str],
    move_file: str | None = None,
) -> tuple[Any, str | None]:
    """What ``_pick_blocking`` picks for kernel k-1 that last had ``previous``, in a kernel
    environment of the server's plus ``environ``."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner, validate_options

    prov = AutoGPUProvisioner(kernel_id="k-1")
    prov.autogpu_picked = previous
    return prov._pick_blocking(validate_options(config), {**os.environ, **environ},
                               Requester(kernel_id="k-1", kind="kernel"), move_file)


C = "GPU-3c3c3c3c-1111-2222-3333-444444444444"


def test_a_restart_asking_fewer_devices_than_it_had_picks_as_usual(server: Host) -> None:
    """The kernel had A and B; its kernelspec now asks for one device: the restart does not
    stay within A and B, it takes the best of all (C, the emptiest). Caught: the "same
    devices" step taken whenever there was a previous pick, whatever the count."""
    fleet = write_fleet(server.tmp / "three.json", [
        {"uuid": u, "name": "NVIDIA A100", "memory_total": 80 * GiB,
         "memory_used": used * GiB, "utilization_pct": 0}
        for u, used in ((A, 40), (B, 40), (C, 0))
    ])
    result, note = _pick_for_kernel((A, B), {"count": 1}, {"AUTOGPU_SIMULATE": str(fleet)})
    try:
        assert [d.uuid for d in result.chosen] == [C] and note is None
    finally:
        result.lease.release()


def test_a_restart_stays_within_the_kernels_grant_and_leases_as_the_kernel(
    server: Host,
) -> None:
    """The kernel had B, but its environment now grants only A: the restart does not stay on
    B (outside the grant), it picks A; a restart that stays leases as the kernel. Caught: the
    "same devices" step made without the kernel's environment (B kept, outside the grant) or
    without the kernel as requester (a lease no kernel is named in)."""
    result, note = _pick_for_kernel((B,), {"min_free": "10G"}, {"CUDA_VISIBLE_DEVICES": A})
    try:
        assert [d.uuid for d in result.chosen] == [A] and note is None
    finally:
        result.lease.release()
    result, note = _pick_for_kernel((B,), {"min_free": "10G"}, {})
    try:
        assert [d.uuid for d in result.chosen] == [B] and note is None
        assert (result.lease.record.kernel_id, result.lease.record.holder_kind) == (
            "k-1", "kernel")
    finally:
        result.lease.release()


def test_an_honoured_move_picks_from_the_kernels_devices_and_says_so(server: Host) -> None:
    """A move to B is requested; the kernel's environment sees a fleet where B fits (the
    server's own has B full): the move is made, and the note says the kernel's state was lost.
    Caught: the move's pick made without the kernel's backend (the server's fleet read, the
    move refused)."""
    from autogpu_jupyter.core import moves
    from autogpu_jupyter.core.backends import get_backend
    from autogpu_jupyter.provisioner import validate_options

    servers = fleet_file(server.fleet, used_a=10, used_b=79)  # the server's: B full
    os.utime(servers, ns=(1, 2 * 10**18))
    kernels = fleet_file(server.tmp / "kernels-fleet.json")  # A 10 GiB used, B 40
    move_file = str(server.tmp / "runtime" / "autogpu-move-k-1.json")
    moves.request_move(move_file, B, current_uuids=(A,),
                       constraints=validate_options({"min_free": "10G"}).constraints,
                       kernel_id="k-1", backend=get_backend(str(kernels)))
    result, note = _pick_for_kernel((A,), {"min_free": "10G"},
                                    {"AUTOGPU_SIMULATE": str(kernels)}, move_file)
    try:
        assert [d.uuid for d in result.chosen] == [B]
        assert note == "moved at your request: the kernel's state was lost"
    finally:
        result.lease.release()


def test_the_provisioners_own_arguments_are_not_taken_for_kernelspec_options() -> None:
    """What jupyter_client and traitlets pass a provisioner (kernel id, kernelspec, parent,
    config, log) are not kernelspec options; anything else is. Caught: one of those names
    misspelt (then refused as an unknown option, or lost for the provisioner)."""
    from traitlets.config import Config

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    log = logging.getLogger("autogpu-test-kernels")
    config = Config()
    prov = AutoGPUProvisioner(kernel_id="k-1", kernel_spec=None, parent=None, config=config,
                              log=log, min_free="10G")
    assert prov._options_raw == {"min_free": "10G"}
    assert (prov.kernel_id, prov.log) == ("k-1", log)


class _Handed:
    """A stand-in lease that records what was done with it."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def set_pid(self, pid: int) -> None:
        self.calls.append(("set_pid", pid))

    def detach(self) -> None:
        self.calls.append("detach")

    def release(self) -> None:
        self.calls.append("release")


def test_a_launched_kernels_pid_is_recorded_and_our_copy_of_its_lease_detached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the launch the kernel's pid goes into its lease, then our copy is detached (never
    released: the kernel holds the lock). Caught: the pid not recorded, or the lease released."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    async def launched(self: Any, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        self.pid = 4242
        return {"launched": cmd}

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", launched)
    prov = AutoGPUProvisioner(kernel_id="k-1")
    lease = _Handed()
    prov._lease = lease  # type: ignore[assignment]
    assert asyncio.run(prov.launch_kernel(["python"])) == {"launched": ["python"]}
    assert lease.calls == [("set_pid", 4242), "detach"] and prov._lease is None


def test_a_kernel_that_fails_to_launch_gives_its_lease_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No kernel started: nobody will hold the lease, so it is released (its file removed),
    and the launch's error goes on. Caught: the lease only detached (left to be pruned)."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    async def failed(self: Any, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        raise OSError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", failed)
    prov = AutoGPUProvisioner(kernel_id="k-1")
    lease = _Handed()
    prov._lease = lease  # type: ignore[assignment]
    with pytest.raises(OSError, match="No such file or directory"):
        asyncio.run(prov.launch_kernel(["no-such-python"]))
    assert lease.calls == ["release"] and prov._lease is None


def test_dropping_a_lease_detaches_it_unless_told_to_unlink() -> None:
    """The provisioner's own copy of a lease is detached by default (a restart: the old kernel
    still holds it) and released only when told. Caught: the two ways swapped."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1")
    first, second = _Handed(), _Handed()
    prov._lease = first  # type: ignore[assignment]
    prov._drop_lease()
    prov._lease = second  # type: ignore[assignment]
    prov._drop_lease(unlink=True)
    assert (first.calls, second.calls, prov._lease) == (["detach"], ["release"], None)


def test_a_restarts_cleanup_keeps_the_move_request_and_a_shutdowns_cancels_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move request waits for the kernel's restart: the cleanup before a restart keeps it,
    the cleanup of a shutdown (the default) removes it; either way our copy of the lease is
    released and jupyter_client's own cleanup is told whether it is a restart. Caught: the
    restart flag read the wrong way round, on by default, or not passed on; the lease only
    detached."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    told: list[object] = []

    async def cleaned(self: Any, restart: bool = False) -> None:
        told.append(restart)

    monkeypatch.setattr(LocalProvisioner, "cleanup", cleaned)
    request = tmp_path / "autogpu-move-k-1.json"
    request.write_text("{}")
    prov = AutoGPUProvisioner(kernel_id="k-1")
    prov.autogpu_move_file = str(request)
    lease = _Handed()
    prov._lease = lease  # type: ignore[assignment]
    asyncio.run(prov.cleanup(restart=True))
    assert request.exists() and lease.calls == ["release"] and prov._lease is None
    asyncio.run(prov.cleanup())
    assert not request.exists()
    assert told == [True, False]


def test_an_unknown_kernelspec_option_is_refused_with_every_accepted_name() -> None:
    """The refusal of an unknown option lists the accepted ones, joined by ", ". Caught: the
    list joined by another separator."""
    from autogpu_jupyter.provisioner import validate_options

    with pytest.raises(UsageErrorBase) as info:
        validate_options({"min_fre": "10G", "zz": 1}, spec="gpu-big")
    assert str(info.value) == (
        "autogpu: kernelspec 'gpu-big' has a bad option in metadata.kernel_provisioner.config: "
        "min_fre='10G': unknown option; accepted: min_free, max_util, count, exclusive, wait, "
        "model, prefer, devices, on_no_device. Fix it with `autogpu kernelspec install "
        "--name gpu-big "
        "[--min-free 10G] [--max-util 50] [--count 1] [--exclusive] [--wait 10m] "
        "[--on-no-device cpu|fail]`."
    )


def test_an_on_no_device_that_is_no_string_is_refused() -> None:
    """``on_no_device`` must be one of the two words; a number is refused as a bad option (not
    a crash). Caught: the type check joined to the word check by "and" (an AttributeError)."""
    from autogpu_jupyter.provisioner import validate_options

    with pytest.raises(UsageErrorBase) as info:
        validate_options({"on_no_device": 1})
    assert str(info.value).startswith(
        "autogpu: the kernelspec has a bad option in metadata.kernel_provisioner.config: "
        'on_no_device=1: expected "cpu" (start without a GPU) or "fail". Fix it with')
