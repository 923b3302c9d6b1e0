"""The Python API (``autogpu_jupyter.pick / status / set_visible_devices / release``) in this
process, over the fake ``libnvidia-ml.so.1`` through the real pynvml binding."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import autogpu_jupyter as ag
from autogpu_jupyter import api
from autogpu_jupyter.config import AutoGPU, default_settings
from autogpu_jupyter.core import session
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.errors import (
    DeviceBoundError,
    NoDeviceFitsError,
    TooLateError,
    UsageErrorBase,
)
from tests.fakenvml import FakeNvml, fleet_4x, fleet_mig
from tests.leasehelpers import forget_backends

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


def test_pick_returns_devices_and_sets_env(host: Path) -> None:
    # least loaded first: GPU 0 (3 % util) then GPU 2 (the L4 at 12 %), not GPU 1 (97 % util)
    chosen = ag.pick(min_free="10G", count=2)
    assert [d.uuid for d in chosen] == [U[0], U[2]]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{U[0]},{U[2]}"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert ag.current().uuids == (U[0], U[2])  # type: ignore[union-attr]
    (lease,) = DirectoryStore(str(host)).list_leases()
    assert lease.device_uuids == (U[0], U[2]) and lease.pid == os.getpid()


def test_repick_replaces_own_lease_and_does_not_count_it(host: Path) -> None:
    ag.pick(min_free="70G")
    # 77.5 GiB free on GPU 0; our own 70 GiB booking must not make it look like 7.5 GiB
    assert [d.uuid for d in ag.pick(min_free="70G", exclusive=True)] == [U[0]]
    (lease,) = DirectoryStore(str(host)).list_leases()
    assert lease.exclusive and lease.device_uuids == (U[0],)


def test_failed_pick_keeps_previous_choice_and_env(host: Path) -> None:
    ag.pick(exclude="0")
    with pytest.raises(NoDeviceFitsError) as info:
        ag.pick(min_free="200G")
    assert str(info.value).splitlines()[0] == "no device fits (min free 200.0 GiB):"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[2]
    assert len(DirectoryStore(str(host)).list_leases()) == 1


def test_a_provisioned_kernel_whose_device_is_gone_is_told_so(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOGPU_PICKED", f"GPU-gone,{U[0]}")
    with pytest.raises(DeviceBoundError) as info:
        ag.pick(min_free="1G")
    assert str(info.value) == (
        "this kernel was started on GPU-gone, GPU 0 by the autogpu kernelspec and can use only "
        "that (its CUDA_VISIBLE_DEVICES was set before it started), and GPU-gone, GPU 0 does not "
        "meet min free 1.0 GiB (GPU-gone: not among this host's devices now); no other device "
        "fits either right now (%gpu pick --dry-run shows why). No second lease was taken."
    )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_dry_run_changes_nothing(host: Path) -> None:
    assert [d.uuid for d in ag.pick(dry_run=True)] == [U[0]]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert ag.current() is None
    assert DirectoryStore(str(host)).list_leases() == []


def test_set_visible_devices_validates_and_writes_uuids(host: Path) -> None:
    assert ag.set_visible_devices([2, "GPU-a1000001"]) == [U[2], U[1]]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{U[2]},{U[1]}"
    assert ag.set_visible_devices("3") == [U[3]]
    with pytest.raises(UsageErrorBase) as info:
        ag.set_visible_devices([7])
    assert str(info.value) == (
        "unknown device id '7': expected an NVML index (0, 1, 2, 3) or a (unique) UUID"
    )
    with pytest.raises(UsageErrorBase) as info:
        ag.set_visible_devices("0,,1")
    assert str(info.value).startswith("invalid device list '0,,1': expected NVML indices or UUIDs")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[3]


def test_set_visible_devices_after_cuda_started_refuses_and_changes_nothing(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA reads CUDA_VISIBLE_DEVICES once: setting it later would silently do nothing, so the
    API refuses as a pick does (with ``force``, it sets it and says it was too late). Caught:
    the too-late check dropped from set_visible_devices."""
    from autogpu_jupyter.core.cudastate import CudaState

    ag.set_visible_devices([3])
    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))
    with pytest.raises(TooLateError) as info:
        ag.set_visible_devices([2])
    assert str(info.value).startswith(
        "CUDA is already initialised in this kernel (cuInit has run (test)). "
        "CUDA_VISIBLE_DEVICES is read once, when CUDA initialises, so changing it now has no "
        "effect; nothing was changed."
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[3]
    assert ag.set_visible_devices([2], force=True) == [U[2]]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[2]


def test_set_visible_devices_one_mig_only(host: Path, fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_mig())
    with pytest.raises(UsageErrorBase) as info:
        ag.set_visible_devices(["0:0", "0:1"])
    assert str(info.value) == "a process can use only one MIG device"
    assert ag.set_visible_devices(["0:1"]) == ["MIG-22222222-aaaa-5bbb-8ccc-000000000002"]


def test_status_frame_marks_this_process(host: Path) -> None:
    ag.pick(exclude="0")  # GPU 2 (12 % util) is the least loaded of GPUs 1-3
    df = ag.status()
    assert list(df["gpu"]) == ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]
    assert list(df[""]) == ["", "", "▶", ""]
    assert list(df["mem free"]) == ["77.5 GiB", "39.5 GiB", "21.1 GiB", "10.1 GiB"]
    assert list(df["util %"]) == [3.0, 97.0, 12.0, 80.0]
    assert df.loc[2, "holders"].startswith("this kernel")  # the lease of this process
    # One holder model: the other processes NVML lists are holders too (no user: not in /proc).
    assert list(df["holders"])[:2] == ["pid 1000000 (2.0 GiB used)", "pid 1000001 (40.0 GiB used)"]
    assert df.attrs["simulated"] is False


def test_release_restores_env(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    ag.pick()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[2]
    old = ag.release()
    assert old is not None and old.uuids == (U[2],)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_DEVICE_ORDER" not in os.environ
    assert DirectoryStore(str(host)).list_leases() == []
    assert ag.release() is None


def test_a_mig_devices_own_lease_keeps_a_pick_off_it(
    host: Path, fake_nvml: FakeNvml
) -> None:
    """Issue 22: another holder's lease booking 5 GiB of MIG device 0:1 keeps this pick off it,
    though its parent GPU has no lease at all; the busier MIG device 0:0 is chosen. Caught: a
    MIG device ranked (or its bookings folded) under its parent's UUID. Issue 39: held
    exclusively, it keeps the pick off the sibling too (one physical GPU), as worded."""
    from autogpu_jupyter.core.leasing import Requester

    fake_nvml.write(fleet_mig())
    mig0, mig1 = (m["uuid"] for m in fleet_mig()["devices"][0]["mig_devices"])
    with DirectoryStore(str(host)).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[mig1], requested_bytes=5 * 1024**3,
                          requester=Requester(kernel_id="another"))
    try:
        # GPU 1, the idle plain A100, is left out: only the two MIG devices compete
        assert [d.uuid for d in ag.pick(min_free="5G", exclude="1", dry_run=True)] == [mig0]
        assert [d.uuid for d in ag.pick(min_free="5G", exclude="1")] == [mig0]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == mig0
    finally:
        held.release()
    with DirectoryStore(str(host)).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[mig1], exclusive=True, requester=Requester(kernel_id="another"))
    try:
        with pytest.raises(NoDeviceFitsError) as info:
            ag.pick(min_free="5G", exclude="1", dry_run=True)
        assert (
            "GPU 0 MIG 0 (NVIDIA A100-SXM4-80GB MIG 3g.40gb): dropped: 29.5 GiB free >= 5.0 GiB "
            "wanted; utilisation unknown: ranked by memory and leases; its sibling MIG device "
            "GPU 0 MIG 1 is held exclusively by another lease"
        ) in str(info.value)
    finally:
        held.release()


def test_set_visible_devices_never_widens_the_allocation(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler granted GPUs 2 and 3: naming GPU 0 is refused and nothing changes. Caught:
    the allocation check dropped (the process would see a GPU it was never given)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(UsageErrorBase) as info:
        ag.set_visible_devices([3, 0])
    assert str(info.value) == (
        "GPU 0 is outside this process's allocation (CUDA_VISIBLE_DEVICES='2,3' grants GPU 2, "
        "GPU 3)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and ag.current() is None
    assert ag.set_visible_devices([3]) == [U[3]]


def test_status_reads_the_devices_again_once_the_sampler_has_stopped(
    host: Path, fake_nvml: FakeNvml
) -> None:
    """A running sampler's latest sweep stands in for a read; a stopped one's is old news.
    Caught: the sampler used whether or not it still runs."""
    from autogpu_jupyter.core import sampler as sampler_mod

    s = sampler_mod.get_sampler(interval_s=60.0)
    try:
        assert s.latest() is not None or s.sample_now() is not None
        assert ag.status()["mem free"].iloc[0] == "77.5 GiB"
        s.stop()
        fake_nvml.set(0, memory_used=50 * GiB)
        assert ag.status()["mem free"].iloc[0] == "29.5 GiB"  # 80 - 50 - 0.5 reserved
    finally:
        sampler_mod.stop_sampler()


def test_the_holder_of_a_kernels_lease_names_the_kernel_and_its_notebook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside a Jupyter kernel (``-f .../kernel-<id>.json``, ``JPY_SESSION_NAME``): the lease
    says which kernel and notebook hold it (what other users and the sidebar see)."""
    kid = "5e6f7a8b-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
    monkeypatch.setattr("sys.argv", ["ipykernel_launcher.py", "-f",
                                     f"/run/user/1000/jupyter/runtime/kernel-{kid}.json"])
    monkeypatch.setenv("JPY_SESSION_NAME", "work/train.ipynb")
    from autogpu_jupyter.api import requester_for_this_process

    h = requester_for_this_process("api")
    assert (h.kernel_id, h.kind, h.notebook_path, h.pid) == (
        kid, "kernel", "work/train.ipynb", os.getpid())
    monkeypatch.setattr("sys.argv", ["train.py", "--kernel-x.json"])
    monkeypatch.delenv("JPY_SESSION_NAME")
    h = requester_for_this_process("cli")
    assert (h.kernel_id, h.kind, h.notebook_path, h.command) == (
        None, "cli", None, "train.py --kernel-x.json")


def test_a_repick_names_a_vanished_previous_device_by_its_uuid(
    host: Path, fake_nvml: FakeNvml
) -> None:
    """The re-pick's "previously GPU 0" line needs a label; a device that left the host (a
    reset, a MIG reconfiguration) has none now, so its UUID stands in. Caught (mutation run,
    issue 22): no stand-in, and the join of a missing label failed with a TypeError."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings

    assert [d.uuid for d in ag.pick(min_free="10G")] == [U[0]]
    fleet = fleet_4x()
    del fleet["devices"][0]
    fake_nvml.write(fleet)
    settings = default_settings()
    result, _warning = pick_result(pick_options(settings, {"min_free": "10G"}), settings=settings)
    assert result.previous == U[0]
    assert [d.uuid for d in result.chosen] == [U[2]]


def test_a_provisioned_kernel_whose_device_fits_keeps_it_with_the_whole_ranking(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel the autogpu kernelspec started on GPU 0 asks for what GPU 0 has: it keeps GPU 0,
    takes no second lease and sets nothing; the result still ranks every device (what the kept
    summary reads its free memory from). Caught (mutation run, issue 22): the kept result built
    without its chosen devices or without the ranking (a TypeError instead of the kept pick)."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings

    monkeypatch.setenv("AUTOGPU_PICKED", U[0])
    assert [d.uuid for d in ag.pick(min_free="10G")] == [U[0]]
    settings = default_settings()
    result, warning = pick_result(pick_options(settings, {"min_free": "10G"}), settings=settings)
    assert warning is None and result.kept
    assert [d.uuid for d in result.chosen] == [U[0]]
    assert [c.device.uuid for c in result.candidates] == [U[0], U[2], U[3], U[1]]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert DirectoryStore(str(host)).list_leases() == []


def test_a_dry_run_pick_result_has_no_warning(host: Path) -> None:
    """``pick_result`` answers ``(result, None)`` when there is nothing to warn about, as its
    type says. Caught: the dry run's warning answered as ``""``."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings

    settings = default_settings()
    result, warning = pick_result(pick_options(settings, {}), dry_run=True, settings=settings)
    assert warning is None
    assert [d.uuid for d in result.chosen] == [U[0]]


class _RunningSampler(Sampler):
    """A sampler that says it runs, without a thread: the sweeps a test adds are what the
    process's running sampler would hold."""

    @property
    def running(self) -> bool:
        return True


def _as_the_processs_sampler(monkeypatch: pytest.MonkeyPatch, s: object) -> None:
    """``s`` is what the public ``current_sampler()`` answers: the process's sampler."""
    from autogpu_jupyter.core import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "current_sampler", lambda: s)


def _util_ranked(uuid: str, **values: object) -> float | None:
    """The smoothed utilisation a dry-run pick ranked ``uuid`` by (what ``--dry-run`` shows)."""
    settings = default_settings()
    result, _warning = api.pick_result(api.pick_options(settings, values), dry_run=True,
                                       settings=settings)
    (candidate,) = [c for c in result.candidates if c.device.uuid == uuid]
    return candidate.smoothed_util_pct


def test_the_utilisation_a_pick_ranks_by_is_the_samplers_last_30_seconds(
    host: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The smoothed utilisation a pick ranks by is the mean of the last 30 s of the sampler's
    history, not of all of it; with no sampler running, the instant reading. Caught: the whole
    history averaged (an old burst would count)."""
    s = _RunningSampler(interval_s=1.0, history_s=900.0)
    for t, util in ((1000.0, 90.0), (1060.0, 20.0), (1080.0, 10.0)):
        dev = DeviceSnapshot(index=0, uuid=U[0], name="Fake", utilization_pct=util)
        s.add(FleetSnapshot(devices=(dev,), timestamp_s=t, backend="test"), own=())
    _as_the_processs_sampler(monkeypatch, s)
    assert _util_ranked(U[0]) == 15.0  # 1060 and 1080; not 1000 (40.0 with it)
    _as_the_processs_sampler(monkeypatch, None)
    assert _util_ranked(U[0]) == 3.0  # the instant reading


def test_a_process_without_ipython_names_no_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CLI process never imports IPython; without JPY_SESSION_NAME it runs no notebook.
    Caught (issue 22, seed 52): get_ipython() asked of the absent module (an AttributeError)."""
    import sys

    from autogpu_jupyter.api import notebook_of_this_process

    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert notebook_of_this_process() is None


def _cuda_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))


def test_a_pick_after_cuda_started_refuses_unless_the_settings_allow_it(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``refuse_when_initialized`` (on by default) refuses a pick once CUDA has started; off,
    the pick is made and says it was too late. Caught (issue 22, seed 52): the setting read the
    wrong way round (a too-late pick made by default, refused when allowed)."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import AutoGPU

    _cuda_started(monkeypatch)
    with pytest.raises(TooLateError):
        ag.pick()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and ag.current() is None
    settings = AutoGPU(refuse_when_initialized=False)
    result, warning = pick_result(pick_options(settings, {}), settings=settings)
    assert [d.uuid for d in result.chosen] == [U[0]]
    assert warning is not None and warning.startswith(
        "--force: CUDA is already initialised in this kernel (cuInit has run (test)).")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[0]


def test_a_forced_pick_logs_its_too_late_warning(
    host: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``ag.pick(force=True)`` after CUDA started logs the warning as a WARNING record, its text
    whole. Caught (issue 22, seed 52): the record logged with no format (its message broken)."""

    _cuda_started(monkeypatch)
    caplog.set_level(logging.WARNING, logger="autogpu_jupyter.api")
    assert [d.uuid for d in ag.pick(force=True)] == [U[0]]
    (message,) = [r.getMessage() for r in caplog.records if r.name == "autogpu_jupyter.api"]
    assert message.startswith(
        "--force: CUDA is already initialised in this kernel (cuInit has run (test)).")


def test_a_provisioned_kernel_whose_device_does_not_fit_is_told_why_and_where_to_move(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernelspec gave this kernel GPU 1 (39.5 GiB free); it asks for 50 GiB: the error names
    GPU 1's reason and the ``%gpu move`` line that would fit. Caught (issue 22, seed 52): the
    reason left out (a TypeError joining it) and the move line written ``%gpu move GPU 0``."""
    monkeypatch.setenv("AUTOGPU_PICKED", U[1])
    with pytest.raises(DeviceBoundError) as info:
        ag.pick(min_free="50G")
    assert str(info.value) == (
        "this kernel was started on GPU 1 by the autogpu kernelspec and can use only that (its "
        "CUDA_VISIBLE_DEVICES was set before it started), and GPU 1 does not meet min free "
        "50.0 GiB (GPU 1: only 39.5 GiB free < 50.0 GiB wanted); GPU 0 would fit: move there "
        "with %gpu move 0 (restarts the kernel; its variables are lost). No second lease was "
        "taken."
    )
    assert DirectoryStore(str(host)).list_leases() == []


def test_set_visible_devices_is_recorded_as_the_apis_choice(host: Path) -> None:
    """The choice says it came from the API (what ``%gpu status`` words as
    "autogpu_jupyter.pick"). Caught (issue 22, seed 52): the choice recorded without its source."""
    ag.set_visible_devices([3])
    choice = ag.current()
    assert choice is not None and choice.source == "api" and choice.uuids == (U[3],)


def test_status_counts_each_devices_processes(host: Path, fake_nvml: FakeNvml) -> None:
    """One process on each of GPUs 0-2, none left on GPU 3. Caught (issue 22, seed 52): the
    procs column always empty."""
    fake_nvml.set(3, processes=[])
    assert list(ag.status()["procs"]) == [1, 1, 1, 0]


def test_a_kept_provisioned_pick_carries_the_constraints_it_was_checked_against(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept result says what it met (the kept summary reads it: "it meets min free 10.0
    GiB"). Caught (issue 22, seed 53): the kept result built without its constraints (None)."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings
    from autogpu_jupyter.magics import format_pick

    monkeypatch.setenv("AUTOGPU_PICKED", U[0])
    settings = default_settings()
    result, _warning = pick_result(pick_options(settings, {"min_free": "10G"}), settings=settings)
    assert result.kept and result.constraints.describe() == "min free 10.0 GiB"
    assert format_pick(result).splitlines()[1].endswith(
        "it meets min free 10.0 GiB, so nothing changed (no second lease)")


def test_a_provisioned_device_failing_two_ways_lists_both_reasons(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1 (39.5 GiB free, 97 % busy) asked for 50 GiB and at most 50 % util: both reasons,
    joined by "; ". Caught (issue 22, seed 53): the reasons joined by another separator."""
    monkeypatch.setenv("AUTOGPU_PICKED", U[1])
    with pytest.raises(DeviceBoundError) as info:
        ag.pick(min_free="50G", max_util=50)
    assert "(GPU 1: only 39.5 GiB free < 50.0 GiB wanted; utilisation 97% > max 50%);" in str(
        info.value)


def test_a_dry_run_pick_result_takes_no_lease_and_sets_nothing(host: Path) -> None:
    """``pick_result(dry_run=True)`` only ranks: no lease taken, no variables in the result.
    Caught (issue 22, seed 53): the dry run not passed on to the picker (a lease taken)."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings

    settings = default_settings()
    result, _warning = pick_result(pick_options(settings, {}), dry_run=True, settings=settings)
    assert result.dry_run and result.lease is None and result.env == {}
    assert DirectoryStore(str(host)).list_leases() == []


def test_a_magics_lease_is_a_kernels(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``%gpu pick`` (source "magic") takes its lease as a kernel even where the command line
    names no kernel file. Caught (issue 22, seed 53): the holder kind misspelt for the magic."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings

    monkeypatch.setattr("sys.argv", ["ipython"])
    settings = default_settings()
    pick_result(pick_options(settings, {}), settings=settings, source="magic")
    (lease,) = DirectoryStore(str(host)).list_leases()
    assert lease.holder_kind == "kernel"
    session.release()
    pick_result(pick_options(settings, {}), settings=settings)
    (lease,) = DirectoryStore(str(host)).list_leases()
    assert lease.holder_kind == "api"


def test_status_names_every_column_with_its_values() -> None:
    """The short UUID, total memory, temperature and power columns are filled under their
    documented names. Caught (issue 22, seeds 53 and 54): a row key misspelt ("power w",
    "MEM TOTAL"), its column left empty."""
    from autogpu_jupyter.api import status_frame
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

    dev = DeviceSnapshot(index=0, uuid=U[0], name="Fake", temperature_c=41.0, power_w=72.5,
                         memory_total_bytes=80 * GiB)
    df = status_frame(FleetSnapshot(devices=(dev,), timestamp_s=1.0, backend="test"), None, [])
    assert list(df.columns) == [
        "", "gpu", "name", "uuid", "util %", "mem used", "mem total", "mem free", "temp °C",
        "power W", "procs", "holders", "state",
    ]
    row = df.iloc[0]
    assert (row["uuid"], row["temp °C"], row["power W"]) == ("GPU-a1000000", 41, 72.5)
    assert row["mem total"] == "80.0 GiB"


def test_an_unreadable_lease_store_leaves_status_without_leases_and_logs_why(
    host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The registry path is a file (not a directory of leases): ``status()`` still answers, with
    no lease among the holders, and a DEBUG record says why. Caught (issue 22, seed 54): the
    record logged without its format (its message broken)."""

    host.write_text("not a directory")
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.api")
    df = ag.status()
    assert list(df["holders"])[:2] == ["pid 1000000 (2.0 GiB used)", "pid 1000001 (40.0 GiB used)"]
    (message,) = [r.getMessage() for r in caplog.records if r.name == "autogpu_jupyter.api"]
    assert message == (
        f"lease store unreadable: lease registry {host} is not a directory: refused (another "
        "user could redirect leases elsewhere); the admin should make it a real directory, "
        "mode 1777"
    )


def test_a_repick_from_two_devices_names_both_it_had(host: Path) -> None:
    """The "you had ..." of a re-pick lists every device the kernel had, as labels joined by
    ", ". Caught (issue 22, seed 54): the labels joined by another separator."""
    from autogpu_jupyter.api import pick_options, pick_result
    from autogpu_jupyter.config import default_settings
    from autogpu_jupyter.magics import format_pick

    assert [d.uuid for d in ag.pick(min_free="10G", count=2)] == [U[0], U[2]]
    settings = default_settings()
    result, _warning = pick_result(pick_options(settings, {"min_free": "10G"}), settings=settings)
    assert result.previous == "GPU 0, GPU 2"
    assert "  you had GPU 0, GPU 2; now GPU 0 (one lease: the old one was released)" in (
        format_pick(result).splitlines())


def test_set_visible_devices_on_an_amd_host_writes_the_rocm_variables(
    monkeypatch: pytest.MonkeyPatch, registry_dir: Path
) -> None:
    """On an AMD host the devices named are made visible to ROCm: ROCR_VISIBLE_DEVICES names the
    host's device, HIP and CUDA count from 0. Caught (issue 22, seed 54): the snapshot's devices
    not passed on (CUDA_VISIBLE_DEVICES set to the UUID, ROCm left seeing every GPU)."""
    from autogpu_jupyter.core.visibility import ROCM_VARS

    for name in ("CUDA_DEVICE_ORDER", "AUTOGPU_PICKED", *ROCM_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-amd")
    forget_backends()
    try:
        (uuid,) = ag.set_visible_devices([1])
        assert os.environ["ROCR_VISIBLE_DEVICES"].startswith("GPU-")
        assert os.environ["ROCR_VISIBLE_DEVICES"] != uuid
        assert os.environ["HIP_VISIBLE_DEVICES"] == os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    finally:
        session.release()
        forget_backends()


def test_status_frame_takes_held_leases_as_well_as_their_records(host: Path) -> None:
    """``status_frame`` accepts the leases a caller holds (``HeldLease``) as it accepts lease
    records: the holder is named either way. Caught (issue 22, seed 54): the held lease's record
    never read (the lease missing from its device's holders)."""
    from autogpu_jupyter.api import read_snapshot, status_frame
    from autogpu_jupyter.core.leasing import Requester

    with DirectoryStore(str(host)).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[U[3]], requester=Requester(kernel_id="k-held", kind="kernel"))
    try:
        snap = read_snapshot()
        by_record = status_frame(snap, None, [held.record])
        by_held = status_frame(snap, None, [held])
        assert by_held.loc[3, "holders"] == by_record.loc[3, "holders"]
        assert "k-held" in by_held.loc[3, "holders"]
    finally:
        held.release()


# ---- found by the mutation run of issue 22 ----
# The sampler a pick reads (only a running one, its 30-second mean), what pick_result passes on
# (force, progress lines, the sampler's mean) and records (forced), the fit check of a kernel's own
# device (its grant, the other holders' leases, its own lease hidden, the sampler's mean, its own
# processes), the refusal a provisioned kernel gets, the choice set_visible_devices records, and
# the status table's columns and types.
def _constraints(**values: object) -> Constraints:
    return api.pick_options(default_settings(), values).constraints


def test_read_snapshot_takes_the_running_samplers_latest_sweep(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a sampler runs, its latest sweep is the snapshot (no second read of the devices);
    a sampler with no sweep yet leaves the read to the backend. Caught: the sampler never asked,
    or its sweep never used (the devices read again every time)."""

    class Running:
        def __init__(self, latest: FleetSnapshot | None) -> None:
            self._latest = latest

        running = True

        def latest(self) -> FleetSnapshot | None:
            return self._latest

    sweep = FleetSnapshot(
        devices=(DeviceSnapshot(index=0, uuid=U[0], name="Swept"),), timestamp_s=1.0,
        backend="sampler",
    )
    _as_the_processs_sampler(monkeypatch, Running(sweep))
    assert api.read_snapshot() is sweep
    _as_the_processs_sampler(monkeypatch, Running(None))
    assert [d.uuid for d in api.read_snapshot().devices] == U


class _Sampler:
    """A stand-in for the process's sampler: running or not; its mean is the window asked, its
    latest sweep one GPU named "Swept"."""

    def __init__(self, running: bool) -> None:
        self.running = running

    def smoothed_util(self, window_s: float) -> dict[str, float | None]:
        return {U[0]: window_s}

    def latest(self) -> FleetSnapshot:
        return FleetSnapshot(devices=(DeviceSnapshot(index=0, uuid=U[0], name="Swept"),),
                             timestamp_s=1.0, backend="sampler")


def test_only_a_running_sampler_is_the_processs_sampler(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's sampler is used while it runs (its sweep is the snapshot, its mean ranks a
    pick); a stopped one, or none, is no sampler (the devices are read, their instant utilisation
    ranks); its mean is
    over the last 30 seconds. Caught: the sampler never looked up, a running one ignored, the
    window changed."""
    for current, used in ((_Sampler(True), True), (_Sampler(False), False), (None, False)):
        _as_the_processs_sampler(monkeypatch, current)
        names = [d.name for d in api.read_snapshot().devices]
        assert (names == ["Swept"]) is used
        assert _util_ranked(U[0]) == (30.0 if used else 3.0)


class _MeanSampler:
    """A running sampler with no sweep yet (the devices are read) and this mean."""

    running = True

    def __init__(self, mean: dict[str, float | None]) -> None:
        self.mean = mean

    def latest(self) -> None:
        return None

    def smoothed_util(self, window_s: float) -> dict[str, float | None]:
        return self.mean


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
    _as_the_processs_sampler(monkeypatch, _MeanSampler({U[0]: 90.0}))
    settings = default_settings()
    result, _warning = api.pick_result(
        api.pick_options(settings, {"max_util": 50}), dry_run=True, settings=settings)
    assert [d.uuid for d in result.chosen] == [U[2]]


def test_pick_result_passes_the_waiting_lines_on(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pick waiting in line tells its caller each try (what ``%gpu pick --wait`` prints).
    Here a pretend clock: 200 GiB never fits, the pick waits 2 s in two tries. Caught: the
    caller's ``on_progress`` not passed on to the picker.

    A reasoned private seam: the picker's clock and sleep are replaced through ``api._pick``
    (the one door to the picker), since no public input sets a pick's clock and a real wait
    would make this a timed test."""
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
    with DirectoryStore(str(host)).locked() as txn:
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
    _as_the_processs_sampler(monkeypatch, _MeanSampler({U[1]: 10.0}))
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


def test_status_reads_the_leases_of_the_settings_it_is_given(
    host: Path, tmp_path: Path, fake_nvml: FakeNvml
) -> None:
    """``status(settings=...)`` lists the leases of that configuration's registry, not of the
    default one. Caught: the settings given not passed on (the default registry read)."""
    fake_nvml.set(3, processes=[])
    other = tmp_path / "other-registry"
    with DirectoryStore(str(other)).locked() as txn:
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


def test_pick_names_devices_as_the_magic_does(host: Path) -> None:
    """``ag.pick(devices=...)`` (issue 41): GPU 1 although it is the busiest, because it was
    named; two named: both."""
    assert [d.uuid for d in ag.pick(devices=1)] == [U[1]]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[1]
    assert {d.uuid for d in ag.pick(devices="3,2")} == {U[2], U[3]}
    with pytest.raises(UsageErrorBase) as err:
        ag.pick(devices="9")
    assert str(err.value).startswith("no device '9' on this host; name devices by index")
