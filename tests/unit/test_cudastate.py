"""core.cudastate in this very process: the real check against drivers loaded here.

Each "driver" is a private copy of the fake ``libcuda.so.1`` (tests/fakecuda), or a tiny library
compiled here, loaded under a name that is not ``libcuda.so*``: this process's own
``/proc/self/maps`` never shows it, so no other test sees CUDA "initialised". A maps file written
by the test names it through a ``libcuda.so.1`` symlink, and ``RTLD_NOLOAD`` finds the loaded copy
through that link (the same file). The one test that needs this process's real maps to show an
initialised driver unloads it again before it ends.
"""

from __future__ import annotations

import _ctypes
import ctypes
import itertools
import logging
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import cudastate, session
from autogpu_jupyter.core.cudastate import (
    CudaState,
    cuda_state,
    mapped_libcuda,
    mapped_rocm,
)
from autogpu_jupyter.errors import TooLateError
from tests.fakecuda import build_fake_cuda

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="cudastate reads /proc/self/maps (Linux only)"
)

_names = itertools.count()

#: A driver whose cuDeviceGetCount answers RC and sets the count to COUNT (unless COUNT < 0).
TINY_DRIVER = """
int cuDeviceGetCount(int *count) {
    if (COUNT >= 0) *count = COUNT;
    return RC;
}
"""
#: A library with a cuInit but no cuDeviceGetCount.
NO_COUNT = "int cuInit(unsigned int flags) { return (int)flags; }\n"


class Drivers:
    """Loads driver copies into this process and writes maps files naming them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.fake = build_fake_cuda()
        self.handles: list[ctypes.CDLL] = []

    def _place(self, real: Path) -> str:
        """A ``libcuda.so.1`` symlink to ``real`` in a directory of its own."""
        d = self.tmp / f"drv{next(_names)}"
        d.mkdir()
        link = d / "libcuda.so.1"
        link.symlink_to(real)
        return str(link)

    def fake_copy(self, *, init: bool = False, loaded: bool = True) -> str:
        real = self.tmp / f"fakedriver-{next(_names)}.so"
        shutil.copy(self.fake, real)
        if loaded:
            lib = ctypes.CDLL(str(real))
            self.handles.append(lib)
            if init:
                lib.cuInit(0)
        return self._place(real)

    def compiled(self, source: str) -> str:
        real = self.tmp / f"tinydriver-{next(_names)}.so"
        src = real.with_suffix(".c")
        src.write_text(source)
        subprocess.run(
            [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(real), str(src)],
            check=True, capture_output=True,
        )
        self.handles.append(ctypes.CDLL(str(real)))
        return self._place(real)

    def tiny(self, rc: int, count: int) -> str:
        return self.compiled(f"#define RC {rc}\n#define COUNT {count}\n{TINY_DRIVER}")

    def maps(self, *paths: str) -> str:
        out = self.tmp / f"maps{next(_names)}"
        out.write_text(
            "".join(f"7f{i:02x}0000-7f{i:02x}1000 r-xp 00000000 08:01 {i} {p}\n"
                    for i, p in enumerate(paths)),
            encoding="utf-8",
        )
        return str(out)


@pytest.fixture
def drivers(tmp_path: Path) -> Drivers:
    return Drivers(tmp_path)


@pytest.fixture
def no_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torch", "jax", "cupy", "tensorflow"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def state(maps: str) -> tuple[bool, str, str | None]:
    s = cuda_state(maps)
    return s.initialized, s.evidence, s.framework


# ----------------------------------------------------------------- what the driver answers


def test_a_loaded_driver_before_cuinit_is_not_initialised(
    drivers: Drivers, no_framework: None
) -> None:
    lib = drivers.fake_copy()
    assert state(drivers.maps(lib)) == (
        False,
        f"libcuda is mapped ({lib}) but cuDeviceGetCount returned CUDA_ERROR_NOT_INITIALIZED (3): "
        "cuInit has not run yet",
        None,
    )


def test_a_loaded_driver_after_cuinit_is_initialised_and_counts_devices(
    drivers: Drivers, no_framework: None
) -> None:
    lib = drivers.fake_copy(init=True)
    assert state(drivers.maps(lib)) == (
        True,
        f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {lib}: cuInit has run",
        None,
    )


def test_cuinit_without_a_visible_device_still_counts(
    drivers: Drivers, no_framework: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    lib = drivers.fake_copy(init=True)
    assert state(drivers.maps(lib)) == (
        True,
        f"cuDeviceGetCount returned CUDA_ERROR_NO_DEVICE (100) from {lib}: cuInit has run",
        None,
    )


@pytest.mark.parametrize(
    ("rc", "count", "evidence"),
    [
        (2, 5, "cuDeviceGetCount returned CUDA_ERROR_OUT_OF_MEMORY (2) from {lib}: cuInit has run"),
        (4, 5, "cuDeviceGetCount returned CUDA_ERROR_DEINITIALIZED (4) from {lib}: cuInit has run"),
        (42, 5, "cuDeviceGetCount returned an unknown CUresult (42) from {lib}: cuInit has run"),
        (0, 7, "cuDeviceGetCount returned CUDA_SUCCESS (0, 7 device(s)) from {lib}: "
               "cuInit has run"),
        # A driver that does not fill in the count: the -1 it was given shows.
        (0, -1, "cuDeviceGetCount returned CUDA_SUCCESS (0, -1 device(s)) from {lib}: "
                "cuInit has run"),
    ],
)
def test_any_answer_but_not_initialised_means_cuinit_ran(
    drivers: Drivers, no_framework: None, rc: int, count: int, evidence: str
) -> None:
    lib = drivers.tiny(rc, count)
    assert state(drivers.maps(lib)) == (True, evidence.format(lib=lib), None)


def test_a_mapped_library_without_cudevicegetcount_counts_as_initialised(
    drivers: Drivers, no_framework: None
) -> None:
    lib = drivers.compiled(NO_COUNT)
    assert state(drivers.maps(lib)) == (
        True,
        f"libcuda is mapped ({lib}) but has no cuDeviceGetCount; assuming CUDA is initialised",
        None,
    )


def test_a_mapped_library_that_is_not_loaded_is_never_loaded_by_the_check(
    drivers: Drivers, no_framework: None
) -> None:
    lib = drivers.fake_copy(loaded=False)
    initialized, evidence, _ = state(drivers.maps(lib))
    assert initialized is True
    assert evidence.startswith(
        f"libcuda is mapped ({lib}) but could not be reopened with RTLD_NOLOAD ("
    )
    assert evidence.endswith("); assuming CUDA is initialised")
    real = os.path.realpath(lib)
    with open("/proc/self/maps", encoding="utf-8") as fh:
        assert real not in fh.read()


def test_several_drivers_one_initialised_decides_and_only_its_evidence_is_given(
    drivers: Drivers, no_framework: None
) -> None:
    fresh1, fresh2 = drivers.fake_copy(), drivers.fake_copy()
    ran1, ran2 = drivers.fake_copy(init=True), drivers.fake_copy(init=True)
    assert state(drivers.maps(fresh1, ran1, fresh2, ran2)) == (
        True,
        f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {ran1}: cuInit has run; "
        f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {ran2}: cuInit has run",
        None,
    )
    assert state(drivers.maps(fresh1, fresh2)) == (
        False,
        f"libcuda is mapped ({fresh1}) but cuDeviceGetCount returned CUDA_ERROR_NOT_INITIALIZED "
        f"(3): cuInit has not run yet; libcuda is mapped ({fresh2}) but cuDeviceGetCount "
        "returned CUDA_ERROR_NOT_INITIALIZED (3): cuInit has not run yet",
        None,
    )


# ------------------------------------------------------------------- the framework hint


def torch_stub(is_initialized: object) -> types.ModuleType:
    mod = types.ModuleType("torch")
    mod.cuda = types.SimpleNamespace(is_initialized=is_initialized)  # type: ignore[attr-defined]
    return mod


def boom() -> bool:
    raise RuntimeError("no driver")


@pytest.mark.parametrize(
    ("modules", "framework", "hint"),
    [
        ({"torch": torch_stub(lambda: True)}, "torch", "torch.cuda.is_initialized() is True"),
        ({"torch": torch_stub(lambda: 0)}, "torch", "torch.cuda.is_initialized() is False"),
        ({"torch": torch_stub(boom)}, "torch", "torch.cuda.is_initialized() failed: no driver"),
        ({"torch": torch_stub("not callable")}, "torch", None),
        ({"torch": types.ModuleType("torch")}, "torch", None),
        ({"jax": types.ModuleType("jax"), "torch": torch_stub(lambda: True)}, "torch",
         "torch.cuda.is_initialized() is True"),
        ({"cupy": types.ModuleType("cupy"), "jax": types.ModuleType("jax")}, "jax", None),
        ({"tensorflow": types.ModuleType("tensorflow"), "cupy": types.ModuleType("cupy")},
         "cupy", None),
        ({"tensorflow": types.ModuleType("tensorflow")}, "tensorflow", None),
    ],
)
def test_an_imported_framework_is_named_and_torch_s_flag_is_a_hint(
    drivers: Drivers, no_framework: None, monkeypatch: pytest.MonkeyPatch,
    modules: dict[str, types.ModuleType], framework: str, hint: str | None,
) -> None:
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    lib = drivers.fake_copy(init=True)
    base = f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {lib}: cuInit has run"
    assert state(drivers.maps(lib)) == (
        True, base + (f" ({hint})" if hint else ""), framework,
    )
    # Nothing mapped: the framework is named, its flag is not worth a word.
    assert state(drivers.maps()) == (
        False, "no libcuda mapped in this process: nothing has called cuInit", framework,
    )
    missing = str(drivers.tmp / "no-maps")
    assert state(missing) == (
        False,
        f"cannot read {missing} (not Linux?): no sign of CUDA" + (f"; {hint}" if hint else ""),
        framework,
    )


# ------------------------------------------------------------------ reading the maps file


def test_mapped_libcuda_keeps_first_mapped_order_paths_with_spaces_and_skips_short_lines(
    tmp_path: Path,
) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/my drivers/libcuda.so.1\n"
        "7f01-7f02 r-xp 00000000 08:01 2   /usr/lib/libcuda.so.1  \n"
        "7f02-7f03 r--p 00000000 08:01 1 /opt/my drivers/libcuda.so.1\n"
        "libcuda.so.1\n"
        "7f03-7f04 r-xp 00000000 08:01 3\n"
        "7f04-7f05 r-xp 00000000 08:01 4 /lib/libcuda.so (deleted)\n",
        encoding="utf-8",
    )
    assert mapped_libcuda(str(maps)) == [
        "/opt/my drivers/libcuda.so.1",
        "/usr/lib/libcuda.so.1",
        "/lib/libcuda.so",
    ]


def test_mapped_libcuda_tolerates_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_bytes(b"7f00-7f01 r-xp 00000000 08:01 1 /opt/\xff/libcuda.so.1\n")
    assert mapped_libcuda(str(maps)) == ["/opt/\ufffd/libcuda.so.1"]


def test_this_process_has_no_driver_mapped_without_one(no_framework: None) -> None:
    assert mapped_libcuda() == []
    assert cuda_state() == CudaState(
        False, "no libcuda mapped in this process: nothing has called cuInit", None
    )


def test_an_unreadable_maps_file_is_logged_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.core.cudastate")
    missing = str(tmp_path / "nope")
    assert mapped_libcuda(missing) is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", f"cannot read {missing}: [Errno 2] No such file or directory: {missing!r}")
    ]


# ---------------------------------------------- session: refusing a pick after cuInit


@pytest.fixture
def initialised_here(tmp_path: Path, no_framework: None) -> Iterator[Callable[[], str]]:
    """Makes CUDA initialised in THIS process (a copy of the fake driver named libcuda.so.1,
    loaded, cuInit called); unloads it again at the end, so that no later test sees it."""
    loaded: list[tuple[str, ctypes.CDLL]] = []

    def load() -> str:
        d = tmp_path / "driver"
        d.mkdir()
        path = str(d / "libcuda.so.1")
        shutil.copy(build_fake_cuda(), path)
        lib = ctypes.CDLL(path)
        loaded.append((path, lib))
        assert lib.cuInit(0) == 0
        return path

    yield load
    for path, lib in loaded:
        # The check reopened it too (RTLD_NOLOAD adds a reference): close until it is unmapped.
        for _ in range(100):
            if path not in (mapped_libcuda() or []):
                break
            _ctypes.dlclose(lib._handle)
        assert path not in (mapped_libcuda() or [])


def test_a_pick_after_cuinit_is_refused_unless_forced(
    initialised_here: Callable[[], str],
) -> None:
    assert session.check_not_too_late(force=False) is None
    assert session.check_not_too_late(force=True) is None
    path = initialised_here()
    state_now = cuda_state()
    assert state_now == CudaState(
        True,
        f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {path}: cuInit has run",
        None,
    )
    message = (
        "CUDA is already initialised in this kernel (" + state_now.evidence + "). "
        "CUDA_VISIBLE_DEVICES is read once, when CUDA initialises, so changing it now has no "
        "effect; nothing was changed. Restart the kernel and run `%gpu pick` first, before "
        "importing torch, jax, cupy, tensorflow or anything that uses CUDA, or start the notebook "
        'with the "Python 3 (autogpu)" kernel, which picks before the kernel starts.'
    )
    with pytest.raises(TooLateError) as info:
        session.check_not_too_late(force=False)
    assert str(info.value) == message
    assert session.check_not_too_late(force=True) == "--force: " + message


# ---------------------------------------- this process's map, remembered between checks


def test_a_driver_loaded_between_two_checks_is_seen_and_its_unloading_too(
    initialised_here: Callable[[], str],
) -> None:
    """The map is remembered while the linker loads nothing (issue 26); a driver loaded after
    a check that found none is seen by the next check (the fixture's teardown unloads it and
    checks that the next check sees it gone)."""
    assert mapped_libcuda() == []
    assert cuda_state().initialized is False  # remembered from here on
    path = initialised_here()
    assert mapped_libcuda() == [path]
    assert cuda_state().initialized is True


def test_this_process_s_map_is_read_again_only_after_a_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_framework: None
) -> None:
    """The map is remembered while the linker's count of loads and unloads stands still: a load
    and an unload each make the next check read it again (a counter that read only the loads,
    lost its callback or answered other than plain numbers fails here)."""
    reads: list[str] = []
    real_open = open

    def counting_open(path: str, *args: object, **kwargs: object) -> object:
        reads.append(path)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(cudastate, "open", counting_open, raising=False)
    mapped_libcuda()
    reads.clear()
    for _ in range(3):
        assert mapped_libcuda() == []
        assert mapped_rocm() == []
    assert reads == []
    # Any new shared object (not a driver here) makes the next check read the map again.
    lib = tmp_path / f"libunrelated{next(_names)}.so"
    src = tmp_path / "unrelated.c"
    src.write_text("int autogpu_unrelated(void) { return 1; }\n")
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True)
    handle = ctypes.CDLL(str(lib))
    assert mapped_libcuda() == []
    assert reads == ["/proc/self/maps"]
    _ctypes.dlclose(handle._handle)
    mapped_rocm()
    assert reads == ["/proc/self/maps"] * 2
    # A map other than this process's (a test's) is read every time.
    other = tmp_path / "maps"
    other.write_text("")
    mapped_libcuda(str(other))
    mapped_libcuda(str(other))
    assert reads[2:] == [str(other)] * 2


def no_libc(name: str | None) -> Any:
    raise OSError("no C library")


@pytest.mark.parametrize("libc", [
    pytest.param(lambda name: types.SimpleNamespace(), id="no-dl_iterate_phdr"),
    pytest.param(no_libc, id="no-libc"),
    pytest.param(None, id="not-linux"),
])
def test_without_the_linker_s_count_the_map_is_read_every_time(
    monkeypatch: pytest.MonkeyPatch, libc: Any
) -> None:
    """Where the C library lacks ``dl_iterate_phdr`` (or the system is not Linux), every check
    reads the map (found by the mutation run of issue 22). A reasoned private seam: the counter
    is built once, at import, from this process's own C library, which no test can swap; so a
    counter is built here under the swapped library and put in its place. That the real one
    counts every load and unload is seen above (the map read again after each)."""
    if libc is None:
        monkeypatch.setattr(sys, "platform", "darwin")
    else:
        monkeypatch.setattr(sys, "platform", "linux")
        monkeypatch.setattr(ctypes, "CDLL", libc)
    counter = cudastate._LoadCount()
    monkeypatch.undo()
    reads: list[str] = []
    real_open = open

    def counting_open(path: str, *args: object, **kwargs: object) -> object:
        reads.append(path)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(cudastate, "open", counting_open, raising=False)
    monkeypatch.setattr(cudastate, "_load_count", counter)
    mapped_libcuda()
    mapped_libcuda()
    mapped_rocm()
    assert reads == ["/proc/self/maps"] * 3


# ---- the load counter's reading of the linker's struct ----
# Found by the mutation run of issue 22.
def test_a_linker_that_reports_no_counts_gives_none() -> None:
    """A reasoned private seam, like the two below: this process's real linker always reports
    its counts in a whole struct, so a linker that reports none, or a struct cut short, can
    only be handed to the counter itself."""
    count = cudastate._LoadCount()
    count._iterate = lambda callback, data: 0  # type: ignore[assignment]
    assert count() is None


END = cudastate._DlPhdrInfo.dlpi_subs.offset + cudastate._DlPhdrInfo.dlpi_subs.size


@pytest.mark.parametrize(("size", "seen"), [(END, (7, 2)), (END + 8, (7, 2)), (END - 1, None)])
def test_the_counts_are_read_only_from_a_struct_that_reaches_them(
    size: int, seen: tuple[int, int] | None
) -> None:
    """A reasoned private seam, as above: the struct is handed to the counter's callback."""
    count = cudastate._LoadCount()
    count._seen.count = None
    info = ctypes.pointer(cudastate._DlPhdrInfo(dlpi_adds=7, dlpi_subs=2))
    assert count._first(info, size, None) == 1  # 1: stop after the first object
    assert count._seen.count == seen
