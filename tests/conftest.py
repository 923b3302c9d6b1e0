"""Shared fixtures. Fixtures of one test module belong in that module."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakeamdsmi import FakeAmdSmi, preload_fake_amdsmi
from tests.fakenvml import FakeNvml, build_fake_nvml, preload_fake_nvml
from tests.leasehelpers import forget_backends

pytest_plugins = ["pytest_jupyter.jupyter_server"]

#: The folder a test lives in says how it runs; each folder's marker is added to its tests, so
#: ``-m`` selections and the CI rule below also hold for a test whose author forgot the marker.
_FOLDER_MARKERS = {
    "browser": ("browser", "slow"),
    "multiuser": ("multiuser",),
    "containers": ("containers", "slow"),
    "cluster": ("cluster", "slow"),
    "gpu": ("gpu",),
    "packaging": ("slow",),
}


def _folder_markers(path: object) -> tuple[str, ...]:
    """The markers of the folder of ``tests/`` that ``path`` lies in."""
    try:
        folder = Path(str(path)).resolve().relative_to(Path(__file__).resolve().parent).parts[0]
    except (ValueError, IndexError):
        return ()
    return _FOLDER_MARKERS.get(folder, ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in _folder_markers(item.path):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _ci_forbids(report: pytest.TestReport | pytest.CollectReport) -> bool:
    """A skip that CI turns into a failure: any skip (``skip``/``skipif`` markers, a runtime
    ``pytest.skip`` such as a root-only test's), but not an expected failure (``xfail``, which
    pytest also reports as skipped: it states a known bug, it hides no behaviour)."""
    return bool(report.skipped and _in_ci() and not hasattr(report, "wasxfail"))


def _fail_instead(report: pytest.TestReport | pytest.CollectReport) -> None:
    where, why = "", report.longrepr
    if isinstance(why, tuple) and len(why) == 3:  # a skip's (path, line, "Skipped: reason")
        where, why = f" ({why[0]}:{why[1]})", why[2]
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, where it must run: {why}{where}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI (``CI=true``) no test may skip, except a ``gpu`` test on a machine without a GPU:
    CI installs Chromium, Prometheus and Slurm and runs as root, so any other skip (a root-only
    test on a non-root runner, a missing tool) means a broken set-up, and it fails instead of
    hiding the behaviour the test promises. (A ``gpu`` test fails instead of skipping wherever
    ``AUTOGPU_EXPECT_GPU=1`` says a GPU is expected: see tests/gpu/.)"""
    outcome = yield
    report = outcome.get_result()
    if _ci_forbids(report) and item.get_closest_marker("gpu") is None:
        _fail_instead(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """The same rule for a whole module skipped while it is collected (a module-level
    ``pytest.skip(..., allow_module_level=True)`` or ``pytest.importorskip``): its tests never
    become items, so the rule above never sees them. Only ``tests/gpu/`` may do that in CI; a
    collection error stops the run, as it should."""
    outcome = yield
    report = outcome.get_result()
    if _ci_forbids(report) and "gpu" not in _folder_markers(collector.path):
        _fail_instead(report)


@pytest.fixture(autouse=True)
def _no_server_cull_settings_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A Jupyter server started in this process with GPU culling on tells the kernels it starts
    through this process's environment (``AUTOGPU_SERVER_CULL_*``, for the notice under their
    first GPU cell); a later test that starts kernels with ``os.environ`` must not inherit it.
    Each test starts without them, and whatever a server set is undone after it."""
    for name in ("AUTOGPU_SERVER_CULL_IDLE_S", "AUTOGPU_SERVER_CULL_WARNING_S"):
        monkeypatch.setenv(name, "")  # recorded as absent: undone to absent after the test
        monkeypatch.delenv(name)
    yield


@pytest.fixture(autouse=True)
def _package_logging_as_found() -> Iterator[None]:
    """A Jupyter server started in this process (pytest-jupyter) routes the ``autogpu_jupyter``
    loggers to its log at its level (``server.route_logs_to``); undo that after each test, so
    that no later test sees records at a level it did not ask for."""
    package = logging.getLogger("autogpu_jupyter")
    handlers, level = list(package.handlers), package.level
    yield
    package.handlers[:] = handlers
    package.setLevel(level)


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    """The fake ``libnvidia-ml.so.1``, built once per session and loaded into this process."""
    path = build_fake_nvml()
    for variant in ("old", "ancient"):
        build_fake_nvml(variant)
    preload_fake_nvml()
    return path


@pytest.fixture
def fake_nvml(
    fake_nvml_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    """A fake NVIDIA host seen through the real pynvml binding, in this process and subprocesses.

    ``.write(fleet)`` takes the simulated fleet schema; ``.env`` is what a subprocess needs.
    Starts with no devices. Shared backends are dropped before and after, so no test sees
    another test's cached GPUs.
    """
    fake = FakeNvml(tmp_path / "fake-nvml")
    fake.write({"devices": []})
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(fake.scenario_path))
    monkeypatch.delenv("AUTOGPU_SIMULATE", raising=False)
    forget_backends()
    yield fake
    forget_backends()


@pytest.fixture
def fake_amdsmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAmdSmi]:
    """A fake AMD host seen through the real ``amdsmi`` binding over the fake ``libamd_smi.so``
    (``tests/fakeamdsmi``), in this process (``AUTOGPU_BACKEND=amdsmi``) and in subprocesses
    (``.env`` / ``.subprocess_env()``: only the AMD fake on the library path, so automatic
    detection finds amdsmi). Starts with no devices; shared backends are dropped around it."""
    preload_fake_amdsmi()
    fake = FakeAmdSmi(tmp_path / "fake-amdsmi")
    fake.write({"devices": []})
    monkeypatch.setenv("FAKE_AMDSMI_SCENARIO", str(fake.scenario_path))
    monkeypatch.setenv("AUTOGPU_BACKEND", "amdsmi")
    monkeypatch.delenv("AUTOGPU_SIMULATE", raising=False)
    forget_backends()
    yield fake
    forget_backends()


@pytest.fixture
def registry_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lease registry for this test, named by ``AUTOGPU_REGISTRY_DIR``."""
    path = tmp_path / "registry"
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(path))
    return path
