"""Survivors of the full mutation run in core/ (issue 22): the simulated AMD fleet's compute
mode, the notebook path without a server root, the HIP check's evidence and framework, the
descriptor and map readers, the linker's load counter, the waiting line's own ticket, the store
transaction's default wait, the sampler's remembered smoothing and the HIP too-late message."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import cudastate, sampler, session
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.contract import SERVER_ROOT_ENV, SESSION_NAME_ENV, notebook_path
from autogpu_jupyter.core.cudastate import (
    CudaState,
    hip_state,
    hip_too_late_message,
    kfd_open,
    mapped_rocm,
)
from autogpu_jupyter.core.decision import reserve_for_waiters
from autogpu_jupyter.core.leasing.directory import Registry
from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.errors import TooLateError
from tests.unit.test_decision import dev, empty, ticket_rec
from tests.unit.test_hip_state import HSA, fds, maps
from tests.unit.test_sampler import B, _add

# ---- core.backends.simulated: SimulatedBackend.snapshot ---------------------------------------


def test_an_amd_fleet_s_devices_have_the_compute_mode_the_file_gives_else_none(
    tmp_path: Path,
) -> None:
    """AMD GPUs have no compute modes: a device of an AMD fleet file has the one its entry
    names, else none (not NVML's ``DEFAULT``)."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"vendor": "amd", "devices": [
        {"uuid": "u0", "runtime_uuid": "GPU-r0", "compute_mode": "EXCLUSIVE_PROCESS"},
        {"uuid": "u1"},
    ]}))
    snap = SimulatedBackend(str(path), clock=lambda: 5.0).snapshot()
    assert [(d.uuid, d.vendor, d.runtime_uuid, d.compute_mode) for d in snap.devices] == [
        ("u0", "amd", "GPU-r0", "EXCLUSIVE_PROCESS"), ("u1", "amd", None, None)]


# ---- core.contract.notebook_path --------------------------------------------------------------


def test_an_absolute_notebook_path_without_a_server_root_is_kept_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the server's root, an absolute path is not made relative to anything (not to
    the current directory, nor to a made-up root under it)."""
    monkeypatch.chdir(tmp_path)
    nb = str(tmp_path / "XXXX" / "nb.ipynb")
    assert notebook_path({SESSION_NAME_ENV: nb}) == nb
    assert notebook_path({SESSION_NAME_ENV: nb, SERVER_ROOT_ENV: "  "}) == nb
    assert notebook_path({SESSION_NAME_ENV: nb, SERVER_ROOT_ENV: str(tmp_path)}) == os.path.join(
        "XXXX", "nb.ipynb")


# ---- core.cudastate ---------------------------------------------------------------------------

HINT = "torch.cuda.is_initialized() is False"
HSA2 = HSA.replace("/opt/rocm-6.4.1/", "/opt/rocm-6.2.0/")


def test_every_rocr_s_evidence_is_joined_and_the_framework_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudastate, "_framework_hint", lambda: ("torch", HINT))
    monkeypatch.setattr(cudastate, "_ask_rocr", lambda p: (False, f"not yet at {p}"))
    assert hip_state(maps(tmp_path, HSA, HSA2), fds(tmp_path)) == CudaState(
        False, f"not yet at {HSA}; not yet at {HSA2} ({HINT})", "torch")


def test_a_descriptor_folder_that_cannot_be_listed_holds_no_kfd(tmp_path: Path) -> None:
    assert kfd_open(str(tmp_path / "absent")) is False


def test_a_descriptor_that_is_no_link_does_not_stop_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Path(fds(tmp_path, "/dev/kfd"))  # "3"
    (d / "0").write_text("")  # readlink fails on it (EINVAL), listed first
    real = os.listdir
    monkeypatch.setattr(cudastate.os, "listdir", lambda p: sorted(real(p)))
    assert kfd_open(str(d)) is True


def test_an_unreadable_map_has_no_rocm_runtimes(tmp_path: Path) -> None:
    assert mapped_rocm(str(tmp_path / "no-maps")) is None


def test_reading_another_map_leaves_this_process_s_remembered_map_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = {(1, 2, 3): ((), ())}
    monkeypatch.setattr(cudastate, "_maps_memo", mine)
    assert mapped_rocm(maps(tmp_path, HSA)) == [HSA]
    assert mine == {(1, 2, 3): ((), ())}


def test_a_linker_that_reports_no_counts_gives_none() -> None:
    count = cudastate._LoadCount()
    count._iterate = lambda callback, data: 0  # type: ignore[assignment]
    assert count() is None


END = cudastate._DlPhdrInfo.dlpi_subs.offset + cudastate._DlPhdrInfo.dlpi_subs.size


@pytest.mark.parametrize(("size", "seen"), [(END, (7, 2)), (END + 8, (7, 2)), (END - 1, None)])
def test_the_counts_are_read_only_from_a_struct_that_reaches_them(
    size: int, seen: tuple[int, int] | None
) -> None:
    count = cudastate._LoadCount()
    count._seen.count = None
    info = ctypes.pointer(cudastate._DlPhdrInfo(dlpi_adds=7, dlpi_subs=2))
    assert count._first(info, size, None) == 1  # 1: stop after the first object
    assert count._seen.count == seen


# ---- core.decision._serve_waiters -------------------------------------------------------------


def test_our_own_ticket_without_a_seq_is_not_served_before_us() -> None:
    devices = [dev(0)]
    mine_rec = dataclasses.replace(ticket_rec(0, {}, lid="f" * 16), seq=None)

    class Mine:
        record = mine_rec

    out = reserve_for_waiters(devices, empty(devices), [mine_rec], ticket=Mine())  # type: ignore[arg-type]
    assert out == empty(devices)


# ---- core.leasing.store.StoreTransaction.ready ------------------------------------------------


def test_a_directory_transaction_has_no_lock_to_wait_for(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry").locked() as txn:
        assert txn is not None
        assert txn.ready() == 0.0


# ---- core.sampler.Sampler.smoothed_util -------------------------------------------------------


def test_the_smoothed_utilisation_is_computed_once_per_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    real = sampler.mean_util

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(sampler, "mean_util", counting)
    s = Sampler()
    _add(s, 100.0, B)
    _add(s, 101.0, B)
    first = s.smoothed_util(60.0)
    assert first == {B: 1.0} and len(calls) == 1
    assert s.smoothed_util(60.0) == first and len(calls) == 1
    assert s.smoothed_util(30.0) == first and len(calls) == 2
    _add(s, 102.0, B)
    assert s.smoothed_util(30.0) == first and len(calls) == 3


# ---- core.session.check_not_too_late ----------------------------------------------------------


def test_a_pick_after_hip_started_is_refused_with_the_hip_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rocm = CudaState(True, "this process holds /dev/kfd open", "torch")
    monkeypatch.setattr(session, "cuda_state", lambda: CudaState(False, "no libcuda"))
    monkeypatch.setattr(session, "hip_state", lambda: rocm)
    message = hip_too_late_message(rocm)
    assert message.startswith("HIP (ROCm) is already initialised in this kernel, probably by "
                              "torch (this process holds /dev/kfd open). ")
    with pytest.raises(TooLateError) as info:
        session.check_not_too_late(force=False)
    assert str(info.value) == message
    assert session.check_not_too_late(force=True) == "--force: " + message
