"""The HIP too-late check's decisions on a prepared memory map and descriptor folder (the real
runtime path, with the fake HIP, is in tests/processes/test_amd_host.py)."""

from __future__ import annotations

import _ctypes
import ctypes
import os
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import cudastate
from autogpu_jupyter.core.cudastate import (
    CudaState,
    hip_state,
    hip_too_late_message,
    kfd_open,
    mapped_rocm,
)

HIP = "/opt/rocm-6.4.1/lib/libamdhip64.so.6.4.60401"
HSA = "/opt/rocm-6.4.1/lib/libhsa-runtime64.so.1.15.60401"


def maps(tmp_path: Path, *paths: str) -> str:
    lines = [f"7f00000{i}000-7f00000{i}fff r-xp 00000000 08:01 {100 + i} {p}"
             for i, p in enumerate(paths)]
    lines.append("7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]")
    f = tmp_path / "maps"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def fds(tmp_path: Path, *targets: str) -> str:
    d = tmp_path / "fd"
    d.mkdir()
    for i, t in enumerate(targets):
        os.symlink(t, d / str(i + 3))
    return str(d)


def test_an_open_dev_kfd_means_rocr_has_initialised(tmp_path: Path) -> None:
    fd_dir = fds(tmp_path, "/dev/null", "/dev/kfd", "socket:[1234]")
    assert kfd_open(fd_dir)
    state = hip_state(maps(tmp_path), fd_dir)
    assert (state.initialized, state.evidence) == (
        True, "this process holds /dev/kfd open: the ROCr runtime has initialised")


def test_nothing_mapped_and_no_kfd_is_in_time(tmp_path: Path) -> None:
    state = hip_state(maps(tmp_path, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
                      fds(tmp_path, "/dev/null"))
    assert not state.initialized
    assert mapped_rocm(maps(tmp_path, HIP, HSA, HIP)) == [HIP, HSA]


def test_a_mapped_rocr_that_cannot_be_asked_counts_as_initialised(tmp_path: Path) -> None:
    # the paths are not loaded in this process: RTLD_NOLOAD fails, and that fails closed
    state = hip_state(maps(tmp_path, HIP, HSA), fds(tmp_path))
    assert state.initialized
    assert state.evidence.startswith(f"ROCr is mapped ({HSA}) but could not be asked (")
    assert state.evidence.endswith("; assuming HIP is initialised")
    only_hip = hip_state(maps(tmp_path, HIP), str(tmp_path / "fd"))
    assert only_hip.initialized and "without ROCr" in only_hip.evidence


def test_the_message_names_the_rocm_variables_and_the_fix(tmp_path: Path) -> None:
    state = hip_state(maps(tmp_path), fds(tmp_path, "/dev/kfd"))
    assert hip_too_late_message(state) == (
        "HIP (ROCm) is already initialised in this kernel (this process holds /dev/kfd open: "
        "the ROCr runtime has initialised). ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES are "
        "read once, when ROCm initialises, so changing them now has no effect; nothing was "
        "changed. Restart the kernel and run `%gpu pick` first, before anything uses the GPU "
        "(torch.cuda..., a tensor on the GPU), or start the notebook with the \"Python 3 "
        "(autogpu)\" kernel, which picks before the kernel starts.")


def test_kfd_is_looked_for_among_our_descriptors_only_where_the_host_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``/dev/kfd`` on the host: no descriptor can name it, so this process's descriptors
    are not listed (issue 26); where it exists, a descriptor open on it is found."""
    kfd = tmp_path / "kfd"
    monkeypatch.setattr(cudastate, "KFD_PATH", str(kfd))
    listed: list[str] = []
    real_listdir = os.listdir

    def counting_listdir(path: str) -> list[str]:
        listed.append(path)
        return real_listdir(path)

    monkeypatch.setattr(cudastate.os, "listdir", counting_listdir)
    assert kfd_open() is False
    assert listed == []
    kfd.write_bytes(b"")
    assert kfd_open() is False
    assert listed == ["/proc/self/fd"]
    fd = os.open(kfd, os.O_RDONLY)
    try:
        assert kfd_open() is True
    finally:
        os.close(fd)


def test_a_rocr_loaded_between_two_checks_is_seen(tmp_path: Path) -> None:
    """This process's map is remembered between checks while the linker loads nothing; a ROCr
    runtime loaded after a check is seen by the next one, and its unloading too."""
    assert mapped_rocm() == []
    assert hip_state().initialized is False
    d = tmp_path / "rocm"
    d.mkdir()
    src = d / "rocr.c"
    src.write_text(
        "int hsa_system_get_info(int attribute, void *value) { return 0x100B; }\n"
    )
    lib = d / "libhsa-runtime64.so.1"
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True)
    handle = ctypes.CDLL(str(lib))
    try:
        assert mapped_rocm() == [str(lib)]
        state = hip_state()
        assert (state.initialized, state.evidence) == (
            False,
            f"ROCr is mapped ({lib}) but hsa_system_get_info returned "
            "HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B): hsa_init has not run yet",
        )
    finally:
        # The check reopened it too (RTLD_NOLOAD adds a reference): close until it is unmapped.
        for _ in range(100):
            if str(lib) not in (mapped_rocm() or []):
                break
            _ctypes.dlclose(handle._handle)
    assert mapped_rocm() == []


# ---- asking ROCr, and the too-late message naming a framework ----
# What the ROCr check hands hsa_system_get_info (found by the mutation run of issue 22).
ROCR = "/opt/rocm/lib/libhsa-runtime64.so.1"
NOT_INITIALIZED = 0x100B
INVALID_ARGUMENT = 0x1001


class FakeRocr:
    """Stands for ``ctypes.CDLL`` and the ROCr it opens: ``hsa_system_get_info`` answers ``rc``
    to the one valid call, ``(0, byref(c_uint16))`` (anything else is an invalid argument), and
    every opening and call is recorded."""

    def __init__(self, rc: int) -> None:
        self.rc = rc
        self.opened: list[tuple[str, int | None]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.restype: Any = None

    def cdll(self, path: str, mode: int | None = None) -> Any:
        self.opened.append((path, mode))
        return types.SimpleNamespace(hsa_system_get_info=self)

    def __call__(self, *args: Any) -> int:
        self.calls.append(tuple(
            (type(a._obj).__name__, a._obj.value) if hasattr(a, "_obj") else a for a in args))
        if [type(a) for a in args] != [int, type(ctypes.byref(ctypes.c_int()))] or args[0]:
            return INVALID_ARGUMENT
        if self.rc == 0:
            args[1]._obj.value = 1
        return self.rc


@pytest.mark.parametrize(
    ("rc", "expected"),
    [
        (NOT_INITIALIZED, (False, f"ROCr is mapped ({ROCR}) but hsa_system_get_info returned "
                                  "HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B): hsa_init has not "
                                  "run yet")),
        (0, (True, f"hsa_system_get_info returned 0x0 from {ROCR}: ROCr (HIP) has started")),
        (0x1008, (True, f"hsa_system_get_info returned 0x1008 from {ROCR}: ROCr (HIP) has "
                        "started")),
    ],
)
def test_rocr_is_reopened_without_loading_and_asked_for_its_major_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, torch_hint: None, rc: int,
    expected: tuple[bool, str]
) -> None:
    """A mapped ROCr is asked, through the real check over a map that names it, and its answer
    is the verdict (the framework's hint after it)."""
    fake = FakeRocr(rc)
    monkeypatch.setattr(ctypes, "CDLL", fake.cdll)
    assert hip_state(maps(tmp_path, ROCR), fds(tmp_path)) == CudaState(
        expected[0], f"{expected[1]} ({HINT})", "torch")
    assert fake.opened == [(ROCR, os.RTLD_NOLOAD | os.RTLD_LAZY)]
    assert fake.calls == [(0, ("c_ushort", 0))]
    assert fake.restype is ctypes.c_int


def test_the_hip_message_names_the_framework_that_probably_started_it() -> None:
    state = CudaState(True, "hsa_system_get_info returned 0x0 from /x: ROCr (HIP) has started",
                      "torch")
    assert hip_too_late_message(state, "kernel 'k'") == (
        "HIP (ROCm) is already initialised in kernel 'k', probably by torch (hsa_system_get_info "
        "returned 0x0 from /x: ROCr (HIP) has started). ROCR_VISIBLE_DEVICES and "
        "HIP_VISIBLE_DEVICES are read once, when ROCm initialises, so changing them now has no "
        "effect; nothing was changed. Restart the kernel and run `%gpu pick` first, before "
        "importing torch or anything that uses the GPU, or start the notebook with the \"Python "
        "3 (autogpu)\" kernel, which picks before the kernel starts.")


# ---- every verdict with a framework imported (found by the mutation run of issue 22) ----
HINT = "torch.cuda.is_initialized() is True"


@pytest.fixture
def torch_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudastate, "_framework_hint", lambda: ("torch", HINT))


def test_an_open_kfd_names_the_framework_and_its_hint(torch_hint: None, tmp_path: Path) -> None:
    assert hip_state(maps(tmp_path), fds(tmp_path, "/dev/kfd")) == CudaState(
        True, f"this process holds /dev/kfd open: the ROCr runtime has initialised ({HINT})",
        "torch")


def test_an_unreadable_map_names_the_framework(torch_hint: None, tmp_path: Path) -> None:
    absent = str(tmp_path / "no-maps")
    assert hip_state(absent, fds(tmp_path)) == CudaState(
        False, f"cannot read {absent} (not Linux?): no sign of HIP", "torch")


def test_nothing_mapped_names_the_framework(torch_hint: None, tmp_path: Path) -> None:
    assert hip_state(maps(tmp_path, "/usr/lib/libc.so.6"), fds(tmp_path)) == CudaState(
        False, "no HIP or ROCr runtime mapped in this process: nothing has initialised HIP",
        "torch")


def test_hip_without_rocr_names_the_framework_and_its_hint(
    torch_hint: None, tmp_path: Path
) -> None:
    assert hip_state(maps(tmp_path, HIP), fds(tmp_path)) == CudaState(
        True, f"HIP is mapped ({HIP}) without ROCr, which cannot be asked; assuming HIP is "
        f"initialised ({HINT})", "torch")


# ---- the evidence, the descriptor and map readers (found by the mutation run of issue 22) ----
HINT_NOT_YET = "torch.cuda.is_initialized() is False"
HSA2 = HSA.replace("/opt/rocm-6.4.1/", "/opt/rocm-6.2.0/")


def test_every_rocr_s_evidence_is_joined_and_the_framework_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudastate, "_framework_hint", lambda: ("torch", HINT_NOT_YET))
    monkeypatch.setattr(cudastate, "_ask_rocr", lambda p: (False, f"not yet at {p}"))
    assert hip_state(maps(tmp_path, HSA, HSA2), fds(tmp_path)) == CudaState(
        False, f"not yet at {HSA}; not yet at {HSA2} ({HINT_NOT_YET})", "torch")


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


# pins the private memo: reading another process's map must not replace this process's, and
# only the memo shows which map it holds
def test_reading_another_map_leaves_this_process_s_remembered_map_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = {(1, 2, 3): ((), ())}
    monkeypatch.setattr(cudastate, "_maps_memo", mine)
    assert mapped_rocm(maps(tmp_path, HSA)) == [HSA]
    assert mine == {(1, 2, 3): ((), ())}
