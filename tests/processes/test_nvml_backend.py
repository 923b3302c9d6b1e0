"""The NVML backend through the real pynvml binding over the fake ``libnvidia-ml.so.1``.

The checks that need a different library or no library at all run in subprocesses (a process holds
one ``libnvidia-ml.so.1`` for life), plus the threaded reader; the in-process scenarios are in
``tests/unit/test_nvml_backend.py`` (fast, in the mutation-test selection).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.nvml import NvmlBackend
from tests.fakenvml import FakeNvml, GiB, MiB, fleet_4x, fleet_8x

REPO = Path(__file__).resolve().parents[2]
ME = pwd.getpwuid(os.getuid()).pw_name


def run_python(code: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    full = dict(env)
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
        timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


SNAPSHOT_OR_ERROR = """
    import json, warnings
    from autogpu_jupyter.core.backends.nvml import NvmlBackend
    from autogpu_jupyter.errors import NVMLUnavailableError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            snap = NvmlBackend().snapshot()
        except NVMLUnavailableError as err:
            print(json.dumps({"error": str(err), "type": type(err).__name__}))
        else:
            out = snap.to_dict()
            out["warnings"] = [str(w.message) for w in caught]
            print(json.dumps(out))
"""


@pytest.fixture
def sleeper() -> Any:
    """A real process with a known command line, to stand in the fake driver's process list."""
    proc = subprocess.Popen(["sleep", "60"])
    # Hand it over once it has exec'd: before that, /proc shows our own command line.
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while cmdline.read_bytes() != b"sleep\x0060\x00" and time.monotonic() < deadline:
        time.sleep(0.005)
    yield proc
    proc.kill()
    proc.wait()


# ---- other hosts: separate processes ----------------------------------------------------------


def test_no_library_on_this_host(fake_nvml: FakeNvml) -> None:
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this host has a real libnvidia-ml")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    out = run_python(SNAPSHOT_OR_ERROR, env)
    assert out == {
        "error": "no NVIDIA driver on this host (libnvidia-ml.so.1 not found); to try autogpu "
        "without a GPU, set AUTOGPU_SIMULATE=demo-4x (a simulated fleet)",
        "type": "NVMLUnavailableError",
    }


def test_driver_not_loaded(fake_nvml: FakeNvml) -> None:
    fake_nvml.write({"driver": "none", "devices": fleet_4x()["devices"]})
    out = run_python(SNAPSHOT_OR_ERROR, fake_nvml.subprocess_env())
    assert out == {
        "error": "no NVIDIA driver on this host (NVML: Driver Not Loaded; the NVIDIA kernel "
        "module is not loaded); to try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-4x "
        "(a simulated fleet)",
        "type": "NVMLUnavailableError",
    }


def test_subprocess_sees_the_same_fleet(
    fake_nvml: FakeNvml, sleeper: subprocess.Popen[bytes]
) -> None:
    fleet = fleet_4x()
    fleet["devices"][3]["processes"] = [{"pid": sleeper.pid, "used_memory": 3 * GiB}]
    fake_nvml.write(fleet)
    out = run_python(SNAPSHOT_OR_ERROR, fake_nvml.subprocess_env())
    assert [d["uuid"][:12] for d in out["devices"]] == [
        "GPU-a1000000", "GPU-a1000001", "GPU-a1000004", "GPU-a1000005",
    ]
    assert out["devices"][3]["processes"] == [
        {"pid": sleeper.pid, "used_memory_bytes": 3 * GiB, "user": ME, "command": "sleep 60"},
    ]
    assert out["warnings"] == []


@pytest.mark.parametrize(
    ("variant", "call"),
    [("old", "nvmlDeviceGetComputeRunningProcesses_v2"),
     ("ancient", "nvmlDeviceGetComputeRunningProcesses")],
)
def test_old_driver_falls_back_without_garbage_pids(
    fake_nvml: FakeNvml, tmp_path: Path, variant: str, call: str
) -> None:
    old = FakeNvml(tmp_path / variant, variant=variant)
    fleet = fleet_4x()
    fleet["devices"][1]["processes"] = [
        {"pid": 31_337, "used_memory": 30 * GiB},
        {"pid": 31_338, "used_memory": 10 * GiB},
        {"pid": 31_339, "used_memory": None},
    ]
    old.write(fleet)
    code = """
        import json
        from autogpu_jupyter.core.backends.nvml import NvmlBackend
        b = NvmlBackend()
        snap = b.snapshot()
        d = snap.devices[1]
        print(json.dumps({"call": b._process_call[2], "used": d.memory_used_bytes,
                          "free": d.memory_free_bytes,
                          "procs": [[p.pid, p.used_memory_bytes] for p in d.processes]}))
    """
    out = run_python(code, old.subprocess_env())
    assert out == {
        "call": call,
        # no nvmlDeviceGetMemoryInfo_v2 on these drivers: v1 counts the 512 MiB reserved as used
        "used": 40 * GiB + 512 * MiB,
        "free": 40 * GiB - 512 * MiB,
        "procs": [[31_337, 30 * GiB], [31_338, 10 * GiB], [31_339, None]],
    }


def test_deprecated_pynvml_package_is_reported_once(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    import pynvml

    # What an old `pip install pynvml` leaves: a pynvml/ package and its dist-info, first on
    # the path.
    shadow = tmp_path / "site"
    (shadow / "pynvml").mkdir(parents=True)
    (shadow / "pynvml" / "__init__.py").write_text(textwrap.dedent(f"""
        import importlib.util as _u
        import sys as _sys
        _spec = _u.spec_from_file_location("pynvml.nvml", {pynvml.__file__!r})
        nvml = _u.module_from_spec(_spec)
        _sys.modules["pynvml.nvml"] = nvml
        _spec.loader.exec_module(nvml)
        globals().update({{k: v for k, v in vars(nvml).items() if not k.startswith("__")}})
    """))
    dist = shadow / "pynvml-11.5.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pynvml\nVersion: 11.5.0\n")
    fake_nvml.write(fleet_4x())
    code = SNAPSHOT_OR_ERROR + """
    second = NvmlBackend().snapshot()
    print(json.dumps({"errors": out["errors"], "second": list(second.errors),
                      "warnings": out["warnings"], "devices": len(out["devices"])}))
    """
    out = run_python(code, fake_nvml.subprocess_env(PYTHONPATH=str(shadow)))
    expected = (
        f"'import pynvml' loads the package {shadow / 'pynvml'}; the deprecated 'pynvml' "
        "distribution 11.5.0 is installed instead of only nvidia-ml-py, which autogpu needs; "
        "fix: pip uninstall pynvml && pip install --force-reinstall nvidia-ml-py"
    )
    assert out == {"errors": [expected], "second": [expected], "warnings": [expected], "devices": 4}


def test_importing_the_backend_does_not_import_pynvml() -> None:
    out = run_python(
        """
        import json, sys
        import autogpu_jupyter.core.backends.nvml
        print(json.dumps({"pynvml": "pynvml" in sys.modules}))
        """,
        dict(os.environ),
    )
    assert out == {"pynvml": False}


def test_snapshots_from_threads_while_the_load_moves(fake_nvml: FakeNvml) -> None:
    import threading

    fake_nvml.write(fleet_8x())
    backend = NvmlBackend()
    seen: list[set[float | None]] = [set() for _ in range(4)]
    failures: list[BaseException] = []
    stop = threading.Event()

    def reader(slot: int) -> None:
        try:
            while not stop.is_set():
                snap = backend.snapshot()
                assert len(snap.devices) == 8
                seen[slot].add(snap.devices[2].utilization_pct)
        except BaseException as err:  # reported below, with the thread's failure
            failures.append(err)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    import time

    give_up = time.monotonic() + 60  # a guard against hanging, not a timing assertion
    for util in (10, 20, 30, 40):
        fake_nvml.set(2, utilization_pct=util)
        while not all(float(util) in s for s in seen) and not failures:
            if time.monotonic() > give_up:
                break
            time.sleep(0.001)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert failures == []
    assert all({10.0, 20.0, 30.0, 40.0} <= s <= {0.0, 10.0, 20.0, 30.0, 40.0} for s in seen)


def test_works_after_gpustat_replaced_the_memory_call(fake_nvml: FakeNvml) -> None:
    """gpustat replaces ``pynvml.nvmlDeviceGetMemoryInfo`` at import with a function that takes
    no ``version``; a kernel that imports gpustat must still read memory."""
    # find_spec, not importorskip: importing gpustat here would replace the memory call in
    # this process too, under the in-process tests of tests/unit/test_nvml_backend.py that run
    # later.
    if importlib.util.find_spec("gpustat") is None:
        pytest.skip("gpustat is not installed")
    fake_nvml.write(fleet_4x())
    out = run_python(
        "import gpustat\n" + textwrap.dedent(SNAPSHOT_OR_ERROR), fake_nvml.subprocess_env()
    )
    assert len(out["devices"]) == 4
    assert out["devices"][0]["memory_total_bytes"] == 80 * GiB
