"""The simulated backend: fleet files, built-in fleets, moving load, labelled simulated."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from autogpu_jupyter.core.backends import get_backend
from autogpu_jupyter.core.backends.simulated import SimulatedBackend, _demo, builtin_fleet
from autogpu_jupyter.errors import UsageErrorBase
from tests.leasehelpers import forget_backends

GiB = 1024**3

FLEET = {
    "driver_version": "550.54.15",
    "devices": [
        {
            "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000",
            "pci_bus_id": "00000000:07:00.0", "memory_total": "80GiB", "memory_used": "20GiB",
            "utilization_pct": 35, "temperature_c": 51, "power_w": 180.5, "power_limit_w": 400,
            "processes": [
                {"pid": 4242, "used_memory": "20GiB", "user": "alice", "command": "python t.py"}
            ],
        },
        {"name": "NVIDIA L4", "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000", "lost": True},
        {
            "name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-cccccccc-0000-0000-0000-000000000000",
            "memory_total": 42949672960, "memory_used": 0, "compute_mode": "PROHIBITED",
            "mig_devices": [{"uuid": "MIG-dddddddd", "memory_total": "10GiB", "memory_used": "1GiB",
                             "profile": "1g.10gb"}],
        },
    ],
}


def write(path: Path, fleet: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fleet))
    os.replace(tmp, path)


def test_fleet_file_exact_values(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write(path, FLEET)
    snap = SimulatedBackend(str(path), clock=lambda: 1000.0).snapshot()
    assert snap.simulated is True
    assert snap.backend == "simulated"
    assert snap.driver_version == "550.54.15"
    assert [d.label for d in snap.devices] == ["GPU 0", "GPU 1", "GPU 2", "GPU 2 MIG 0"]
    a = snap.devices[0]
    assert (a.memory_total_bytes, a.memory_used_bytes, a.memory_free_bytes) == (
        80 * GiB, 20 * GiB, 60 * GiB
    )
    assert (a.utilization_pct, a.temperature_c, a.power_w, a.power_limit_w) == (
        35.0, 51, 180.5, 400
    )
    assert a.processes[0].pid == 4242 and a.processes[0].user == "alice"
    assert a.processes[0].used_memory_bytes == 20 * GiB
    lost = snap.devices[1]
    assert (lost.available, lost.error, lost.processes) == (False, "GPU is lost", None)
    parent, mig = snap.devices[2], snap.devices[3]
    assert parent.mig_enabled is True and parent.utilization_pct is None
    assert parent.compute_mode == "PROHIBITED"
    assert (mig.is_mig, mig.parent_uuid, mig.mig_index) == (True, parent.uuid, 0)
    assert mig.memory_free_bytes == 9 * GiB
    assert mig.name == "NVIDIA A100-SXM4-40GB MIG 1g.10gb"
    assert mig.timestamp_s == 1000.0


def test_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write(path, FLEET)
    backend = SimulatedBackend(str(path))
    assert backend.snapshot().devices[0].utilization_pct == 35.0
    fleet = json.loads(json.dumps(FLEET))
    fleet["devices"][0]["utilization_pct"] = 99
    write(path, fleet)
    os.utime(path, ns=(1, 10**18))  # make sure the mtime differs even on coarse clocks
    assert backend.snapshot().devices[0].utilization_pct == 99.0


def test_builtin_demo_moves_over_time() -> None:
    backend = get_backend("demo-4x")
    assert backend.simulated
    a = SimulatedBackend("demo-4x", clock=lambda: 0.0).snapshot()
    b = SimulatedBackend("demo-4x", clock=lambda: 40.0).snapshot()
    assert [d.name for d in a.devices] == ["NVIDIA A100-SXM4-80GB"] * 2 + ["NVIDIA L4"] * 2
    assert [d.utilization_pct for d in a.devices] != [d.utilization_pct for d in b.devices]
    assert len({d.uuid for d in a.devices}) == 4


def test_snapshot_to_json_and_dataframe() -> None:
    snap = SimulatedBackend("demo-4x", clock=lambda: 5.0).snapshot()
    data = json.loads(snap.to_json())
    assert data["simulated"] is True
    assert [d["label"] for d in data["devices"]] == ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]
    from autogpu_jupyter.core.devices import FleetSnapshot

    assert FleetSnapshot.from_dict(data) == snap
    df = snap.to_dataframe()
    assert list(df["label"]) == ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]
    assert df.attrs["simulated"] is True
    assert int(df.iloc[0]["memory_total_bytes"]) == 80 * GiB


def test_bad_simulate_value_is_one_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageErrorBase) as info:
        SimulatedBackend("demo-99x")
    # A relative path depends on the process's directory (a kernel runs in its notebook's
    # folder): the message says where it looked.
    assert str(info.value) == (
        f"AUTOGPU_SIMULATE='demo-99x': not a fleet file (looked in {tmp_path}) and not a "
        "built-in fleet; expected an absolute path to a JSON fleet file or one of demo-4x, "
        "demo-8x, demo-amd"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(UsageErrorBase, match="is not valid JSON"):
        SimulatedBackend(str(bad)).snapshot()


#: Read a fleet file in a fresh interpreter and print its names (ASCII-escaped JSON), with the
#: encoding that interpreter's locale gives ``open()``.
READ_NAMES = """
import json, locale, sys
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
snap = SimulatedBackend(sys.argv[1]).snapshot()
print(json.dumps({"locale_encoding": locale.getpreferredencoding(False),
                  "names": [d.name for d in snap.devices]}))
"""


def test_a_fleet_file_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """A fleet file is UTF-8 under ``LC_ALL=C`` too. Python turns its UTF-8 mode on by itself
    under the C locale (PEP 540), which hides the locale's own ASCII; ``PYTHONUTF8=0`` (a host
    that sets it, or ``-X utf8=0``) shows it. Kills the mutants that open the file with the
    locale's encoding (``encoding=None`` or no encoding), which tests/mutation_equivalent.txt
    judged equivalent because C "is UTF-8 here". A fresh interpreter: the locale is read at
    start-up."""
    import locale
    import subprocess

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"devices": [
        {"uuid": "GPU-e0", "name": "NVIDIA RTX 6000 Ada (Büro, 東京)", "memory_total": "48G"}]},
        ensure_ascii=False), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", READ_NAMES, str(path)], capture_output=True,
                          text=True, encoding="utf-8", env=env, cwd=root, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "locale_encoding": "ANSI_X3.4-1968",  # the test can tell: this locale is ASCII
        "names": ["NVIDIA RTX 6000 Ada (Büro, 東京)"],
    }
    # The same in this process, its LC_CTYPE switched to C for the read: mutmut runs only the
    # tests that reach a function in its own process, and a child under the C locale cannot
    # even decode mutmut's mutant name (non-ASCII) from its environment. Python's UTF-8 mode,
    # when on, makes every locale UTF-8 here: only the child above can tell then.
    if not sys.flags.utf8_mode:
        before = locale.setlocale(locale.LC_CTYPE)
        try:
            locale.setlocale(locale.LC_CTYPE, "C")
            assert locale.getpreferredencoding(False) == "ANSI_X3.4-1968"
            here = [d.name for d in SimulatedBackend(str(path)).snapshot().devices]
        finally:
            locale.setlocale(locale.LC_CTYPE, before)
        assert here == ["NVIDIA RTX 6000 Ada (Büro, 東京)"]


def test_a_fleet_file_that_cannot_be_read_is_one_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not UTF-8, or gone before its first read: one message naming the file, never a traceback
    (``autogpu list`` showed a UnicodeDecodeError's). Once read, a file being replaced keeps
    the last good fleet."""
    from autogpu_jupyter.cli import main

    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"devices": [{"uuid": "GPU-l", "name": "B\xfcro GPU"}]}')
    with pytest.raises(UsageErrorBase) as info:
        SimulatedBackend(str(latin1)).snapshot()
    assert str(info.value) == (
        f"fleet file {str(latin1)!r} cannot be read: not UTF-8 (invalid start byte); expected a "
        "JSON fleet file (UTF-8) this user can read")
    gone = tmp_path / "gone.json"
    gone.write_text(json.dumps(FLEET))
    backend = SimulatedBackend(str(gone))
    gone.unlink()
    with pytest.raises(UsageErrorBase, match=r"cannot be read: No such file or directory;"):
        backend.snapshot()
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(latin1))
    forget_backends()
    try:
        assert main(["list"]) == 2
    finally:
        forget_backends()
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"autogpu: fleet file {str(latin1)!r} cannot be read: not UTF-8 "
                              "(invalid start byte); expected a JSON fleet file (UTF-8) this "
                              "user can read\n")
    # read once, then cut mid-character by a writer: the last good fleet
    write(gone, FLEET)
    backend = SimulatedBackend(str(gone))
    assert len(backend.snapshot().devices) == 4
    gone.write_bytes(json.dumps(FLEET).encode()[:-3] + b"\xc3")
    assert len(backend.snapshot().devices) == 4


def test_a_fleet_stopped_at_an_instant_shows_what_the_moving_fleet_shows_then(
    tmp_path: Path,
) -> None:
    """The README's samples run on demo-4x stopped at one instant (``fleet_at``): every
    snapshot of the stopped fleet is the moving fleet's snapshot at that instant."""
    from autogpu_jupyter.core.backends.simulated import builtin_fleet, fleet_at

    at = 1_000_000.0
    moving = SimulatedBackend("demo-4x", clock=lambda: at).snapshot()
    path = tmp_path / "stopped.json"
    path.write_text(json.dumps(fleet_at(builtin_fleet("demo-4x"), at)))
    for later in (at, at + 45.0, at + 3600.0):
        stopped = SimulatedBackend(str(path), clock=lambda t=later: t).snapshot()
        assert [(d.uuid, d.utilization_pct, d.memory_used_bytes, d.memory_free_bytes)
                for d in stopped.devices] == [
            (d.uuid, d.utilization_pct, d.memory_used_bytes, d.memory_free_bytes)
            for d in moving.devices]
        assert [[(p.pid, p.used_memory_bytes) for p in d.processes or ()]
                for d in stopped.devices] == [
            [(p.pid, p.used_memory_bytes) for p in d.processes or ()] for d in moving.devices]
    # the moving fleet itself is left as it was (the caller's copy is not changed)
    assert "load" in builtin_fleet("demo-4x")["devices"][0]
    fleet = builtin_fleet("demo-4x")
    fleet_at(fleet, at)
    assert "load" in fleet["devices"][0]


# ---- the simulated AMD fleet, device by device (found by the mutation run of issue 22) ----
#: What ``demo-amd`` changes in ``demo-8x``'s devices, GPU by GPU.
AMD_DEVICES = [
    (name, f"5aff74a{1 + i}-0000-1000-800{i}-d3a0a3d0000{i}", f"GPU-4d0a3d000000000{i}",
     f"0000:{pci}:00.0", mem, watts)
    for i, (name, pci, mem, watts) in enumerate(
        [("AMD Instinct MI300X", pci, 192 * GiB, 750.0) for pci in ("05", "25", "45", "65")]
        + [("AMD Instinct MI210", pci, 64 * GiB, 300.0) for pci in ("85", "a5", "c5", "e5")]
    )
]


def test_the_simulated_amd_fleet_is_demo_8x_with_mi300x_and_mi210_in_its_places() -> None:
    devices = _demo(4, 4)["devices"]
    for dev, (name, uuid, runtime_uuid, pci, mem, watts) in zip(devices, AMD_DEVICES):
        dev.update(name=name, uuid=uuid, runtime_uuid=runtime_uuid, pci_bus_id=pci,
                   memory_total=mem, power_limit_w=watts)
    assert builtin_fleet("demo-amd") == {
        "vendor": "amd", "driver_version": "6.10.5 (simulated)", "devices": devices}
    assert AMD_DEVICES[0][1] == "5aff74a1-0000-1000-8000-d3a0a3d00000"
    assert AMD_DEVICES[7][1:4] == ("5aff74a8-0000-1000-8007-d3a0a3d00007",
                                   "GPU-4d0a3d0000000007", "0000:e5:00.0")


# ---- an AMD fleet's compute modes (found by the mutation run of issue 22) ----
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
