"""A fake NVIDIA driver for tests and benchmarks: ``libnvidia-ml.so.1`` built from ``fakenvml.c``.

The real ``pynvml`` binding (nvidia-ml-py) loads the fake exactly as it loads NVIDIA's library, so
everything above the C ABI is the real code path. What the fake "driver" shows is a scenario file
(``FAKE_NVML_SCENARIO``) that :class:`FakeNvml` writes from the same JSON schema as a simulated
fleet file (``autogpu_jupyter/core/backends/simulated.py``), plus a few keys only a driver has:

* device ``error``: ``"lost"`` / ``"gpu_is_lost"`` (same as ``lost: true``), ``"no_permission"``,
  ``"unknown"`` or an NVML error number: the handle lookup and every call on the device fail so;
* device ``utilization_supported: false``: utilisation reads NOT_SUPPORTED;
* device ``unsupported``: list of queries that read NOT_SUPPORTED (``util``, ``temp``, ``power``,
  ``power_limit`` (both limits), ``enforced_power_limit``, ``compute_mode``, ``memory``,
  ``processes``, ``mig_mode``, ``pci``, ``name``);
* device ``enforced_power_limit_w``: what ``nvmlDeviceGetEnforcedPowerLimit`` reads (default:
  ``power_limit_w``, the management limit); lower where another limit applies;
* device ``compute_mode`` may also be a number, one that NVML has no name for;
* device ``processes_outgrow: true``: the process list grows faster than any reader, every read of
  it answers INSUFFICIENT_SIZE;
* device ``reserved_memory``: driver-reserved bytes (v2 memory excludes them, v1 counts them used);
* device ``mig_supported`` (default: the name contains A100, A30, H100, H200 or B200),
  ``mig_enabled`` (default: ``mig_devices`` is not empty), ``mig_pending`` (the pending MIG mode,
  default ``mig_enabled``; they differ after ``nvidia-smi -mig 1`` until the GPU is reset),
  ``max_mig_devices`` (default 7), ``pci_device_id``;
* MIG device ``name`` (default ``"<parent name> MIG <profile>"``), ``processes`` and ``slot``
  (default: its place in the list; the slots no MIG device holds answer NOT_FOUND);
* process ``used_memory: None``: NVML's "not available";
* top level ``driver: "none"`` (nvmlInit returns DRIVER_NOT_LOADED), ``init_error`` (a name as for
  ``error``, or a number), ``memory_v2_error`` (``"version_mismatch"`` or a number),
  ``driver_version``.

The ``old`` and ``ancient`` builds (:data:`VARIANTS`) lack the calls those drivers lack; a test
process may bind pynvml to one of them (:meth:`FakeNvml.load_variant`).

Values that the fleet leaves out are derived as the simulated backend derives them (used memory
from the processes, temperature and power from utilisation), so one fleet reads the same through
both backends. The simulated backend's moving ``load`` is not supported: tests move load with
:meth:`FakeNvml.set`.

In the test process itself, :func:`preload_fake_nvml` loads the fake with ``RTLD_GLOBAL`` before
pynvml's ``CDLL("libnvidia-ml.so.1")``; glibc then resolves that soname to the loaded object
(``LD_LIBRARY_PATH`` set after interpreter start would not affect ``dlopen``). Subprocesses get
:attr:`FakeNvml.env`.
"""

from __future__ import annotations

import copy
import ctypes
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "BUILD_DIR",
    "SOURCE",
    "FakeNvml",
    "build_fake_nvml",
    "fleet_4x",
    "fleet_8x",
    "fleet_edge_cases",
    "fleet_mig",
    "preload_fake_nvml",
    "render_scenario",
]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakenvml.c"
BUILD_DIR = HERE / "build"
SONAME = "libnvidia-ml.so.1"
GiB = 1024**3
MiB = 1024**2

#: Library variants: extra compiler flags and the folder the library lands in.
VARIANTS: dict[str, tuple[tuple[str, ...], Path]] = {
    # a current driver: every call
    "default": ((), BUILD_DIR),
    # an R470-era driver: no _v3 process call, no nvmlDeviceGetMemoryInfo_v2 and no
    # nvmlDeviceGetTemperatureV
    "old": (("-DNO_V3", "-DNO_MEMORY_V2", "-DNO_TEMPERATURE_V"), BUILD_DIR / "old"),
    # an R450-era driver: only the v1 process call
    "ancient": (
        ("-DNO_V3", "-DNO_V2", "-DNO_MEMORY_V2", "-DNO_TEMPERATURE_V"), BUILD_DIR / "ancient"
    ),
}

ERRORS = {
    "lost": 15,
    "gpu_is_lost": 15,
    "no_permission": 4,
    "driver_not_loaded": 9,
    "unknown": 999,
    "version_mismatch": 25,
    "not_supported": 3,
    "uninitialized": 1,
}
COMPUTE_MODE_NUMBERS = {
    "DEFAULT": 0, "EXCLUSIVE_THREAD": 1, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3,
}
UNSUPPORTED_NAMES = (
    "util", "temp", "power", "power_limit", "enforced_power_limit", "compute_mode", "memory",
    "processes", "mig_mode", "pci", "name",
)
MIG_MODELS = ("A100", "A30", "H100", "H200", "H20", "B200", "GB200")

_build_lock = threading.Lock()


def build_fake_nvml(variant: str = "default") -> Path:
    """Compile the fake library (when missing or older than its sources) and return its path.

    Parameters
    ----------
    variant
        ``"default"`` (a current driver), ``"old"`` (no ``_v3`` process call and no memory v2)
        or ``"ancient"`` (only the v1 process call).

    Returns
    -------
    Path
        ``tests/fakenvml/build[/<variant>]/libnvidia-ml.so.1``.
    """
    flags, folder = VARIANTS[variant]
    target = folder / SONAME
    newest_source = max(SOURCE.stat().st_mtime_ns, Path(__file__).stat().st_mtime_ns)
    with _build_lock:
        if target.exists() and target.stat().st_mtime_ns >= newest_source:
            return target
        folder.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent test runs never load a half-written file.
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run(
                ["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", "-Wall",
                 "-Wextra", "-Wno-unused-parameter", *flags, f"-Wl,-soname,{SONAME}",
                 "-o", tmp, str(SOURCE)],
                check=True, capture_output=True, text=True,
            )
            os.replace(tmp, target)
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"building the fake NVML failed:\n{err.stderr}") from err
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


_preloaded: ctypes.CDLL | None = None


def preload_fake_nvml() -> ctypes.CDLL:
    """Load the default fake into this process so that pynvml's ``CDLL`` finds it.

    Must run before pynvml loads a library; a process holds one ``libnvidia-ml.so.1`` for life.
    """
    global _preloaded
    if _preloaded is None:
        path = build_fake_nvml()
        _preloaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _preloaded.fakenvml_calls.restype = ctypes.c_ulong
        _preloaded.fakenvml_calls.argtypes = [ctypes.c_char_p]
        _preloaded.fakenvml_total_calls.restype = ctypes.c_ulong
    return _preloaded


def _error_code(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"not an NVML error: {value!r}")
    if isinstance(value, int):
        return value
    try:
        return ERRORS[str(value).lower()]
    except KeyError:
        raise ValueError(
            f"unknown NVML error {value!r}; expected one of {', '.join(ERRORS)} or a number"
        ) from None


def _bytes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    from autogpu_jupyter.core.units import parse_size

    return parse_size(value).resolve(None)


def _clean(text: Any) -> str:
    return " ".join(str(text).split())


def _render_device(
    lines: list[str], spec: dict[str, Any], *, mig_of: dict[str, Any] | None
) -> None:
    name = spec.get("name")
    if mig_of is not None and name is None:
        name = f"{mig_of.get('name', 'Simulated GPU')} MIG {spec.get('profile', '')}".strip()
    lines.append("mig" if mig_of is not None else "gpu")
    lines.append(f"uuid {_clean(spec['uuid'])}")
    lines.append(f"name {_clean(name if name is not None else 'Simulated GPU')}")
    pci = spec.get("pci_bus_id") or (mig_of or {}).get("pci_bus_id") or "00000000:00:00.0"
    lines.append(f"pci {_clean(pci)}")
    lines.append(f"pci_device_id {int(spec.get('pci_device_id', 0x20B210DE))}")
    unsupported = set(spec.get("unsupported", ()))
    bad = unsupported - set(UNSUPPORTED_NAMES)
    if bad:
        raise ValueError(f"unknown unsupported query {sorted(bad)}; expected {UNSUPPORTED_NAMES}")

    error = spec.get("error")
    if spec.get("lost"):
        error = error or "lost"
    if error is not None:
        lines.append(f"error {_error_code(error)}")

    total = _bytes(spec.get("memory_total"))
    used = _bytes(spec.get("memory_used"))
    procs = spec.get("processes") or []
    if used is None:
        used = sum(_bytes(p.get("used_memory")) or 0 for p in procs)
    if total is None:
        unsupported.add("memory")
    lines.append(f"mem_total {total or 0}")
    lines.append(f"mem_used {used}")
    lines.append(f"mem_reserved {_bytes(spec.get('reserved_memory')) or 0}")

    mig_devices = spec.get("mig_devices") or []
    util = spec.get("utilization_pct")
    if mig_of is not None or mig_devices or util is None or not spec.get(
        "utilization_supported", True
    ):
        # NVML has no utilisation for MIG devices nor for a GPU in MIG mode.
        unsupported.add("util")
        util = None
    lines.append(f"util_gpu {round(float(util or 0))}")
    lines.append(f"util_mem {round(float(spec.get('memory_utilization_pct') or 0))}")

    temp = spec.get("temperature_c")
    raw_util = spec.get("utilization_pct")
    if temp is None and raw_util is not None and mig_of is None:
        temp = round(32 + 0.45 * float(raw_util))
    limit = spec.get("power_limit_w")
    power = spec.get("power_w")
    if power is None and limit is not None and raw_util is not None and mig_of is None:
        power = round(float(limit) * (0.15 + 0.8 * float(raw_util) / 100.0), 1)
    if temp is None or mig_of is not None:
        unsupported.add("temp")
    if power is None or mig_of is not None:
        unsupported.add("power")
    if limit is None or mig_of is not None:
        unsupported.add("power_limit")
    lines.append(f"temp {round(float(temp or 0))}")
    lines.append(f"power_mw {round(float(power or 0) * 1000)}")
    lines.append(f"power_limit_mw {round(float(limit or 0) * 1000)}")
    enforced = spec.get("enforced_power_limit_w")
    if enforced is not None:
        lines.append(f"enforced_limit_mw {round(float(enforced) * 1000)}")

    mode = spec.get("compute_mode", "DEFAULT") if mig_of is None else mig_of.get(
        "compute_mode", "DEFAULT"
    )
    if mode is None:
        unsupported.add("compute_mode")
    elif isinstance(mode, int):
        lines.append(f"compute_mode {mode}")
    else:
        try:
            lines.append(f"compute_mode {COMPUTE_MODE_NUMBERS[str(mode).upper()]}")
        except KeyError:
            raise ValueError(
                f"unknown compute_mode {mode!r}; expected one of {', '.join(COMPUTE_MODE_NUMBERS)}"
            ) from None

    if mig_of is None:
        mig_supported = spec.get(
            "mig_supported", any(m in str(spec.get("name", "")) for m in MIG_MODELS)
        )
        mig_enabled = spec.get("mig_enabled", bool(mig_devices))
        if not mig_supported and not mig_enabled:
            unsupported.add("mig_mode")
        lines.append(f"mig_mode {1 if mig_enabled else 0}")
        lines.append(f"mig_pending {1 if spec.get('mig_pending', mig_enabled) else 0}")
        lines.append(f"max_mig {int(spec.get('max_mig_devices', 7))}")

    if mig_of is not None and "slot" in spec:
        lines.append(f"slot {int(spec['slot'])}")
    if spec.get("processes_outgrow"):
        lines.append("procs_outgrow 1")
    if unsupported:
        lines.append("unsupported " + ",".join(sorted(unsupported)))
    for p in procs:
        pm = _bytes(p.get("used_memory"))
        if pm is None and "memory_share" in p and "used_memory" not in p:
            pm = int(used * float(p["memory_share"]))
        lines.append(f"proc {int(p['pid'])} {-1 if pm is None else pm}")

    if mig_of is None:
        for m in mig_devices:
            _render_device(lines, m, mig_of=spec)


def render_scenario(fleet: dict[str, Any]) -> str:
    """The scenario text the C library reads, for a fleet in the simulated-fleet JSON schema."""
    lines = ["# fake NVML scenario (tests/fakenvml); written by FakeNvml.write"]
    driver = fleet.get("driver")
    if driver is not None and str(driver).lower() == "none":
        lines.append("driver none")
    else:
        lines.append(f"driver {_clean(fleet.get('driver_version', '550.54.15'))}")
    if fleet.get("init_error") is not None:
        lines.append(f"init_error {_error_code(fleet['init_error'])}")
    if fleet.get("memory_v2_error") is not None:
        lines.append(f"mem_v2_error {_error_code(fleet['memory_v2_error'])}")
    for spec in fleet.get("devices", []):
        _render_device(lines, spec, mig_of=None)
    lines.append("end")
    return "\n".join(lines) + "\n"


class FakeNvml:
    """One fake host: a scenario file plus the environment that points NVML users at it.

    Parameters
    ----------
    directory
        Where the scenario file lives (a test's ``tmp_path``).
    variant
        Which library subprocesses load (see :func:`build_fake_nvml`). The test process itself
        always has the default one (:func:`preload_fake_nvml`).
    """

    def __init__(self, directory: str | os.PathLike[str], variant: str = "default") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.variant = variant
        self.library = build_fake_nvml(variant)
        self.scenario_path = self.directory / "fake-nvml-scenario.txt"
        self.fleet: dict[str, Any] = {"devices": []}
        self._last_mtime_ns = 0

    @property
    def env(self) -> dict[str, str]:
        """Environment entries a subprocess needs to see this fake host."""
        ld = os.environ.get("LD_LIBRARY_PATH", "")
        path = str(self.library.parent) + (os.pathsep + ld if ld else "")
        return {"LD_LIBRARY_PATH": path, "FAKE_NVML_SCENARIO": str(self.scenario_path)}

    def subprocess_env(self, **extra: str) -> dict[str, str]:
        """``os.environ`` plus :attr:`env` plus ``extra``: ready for ``subprocess.run(env=...)``."""
        env = dict(os.environ)
        env.update(self.env)
        env.update(extra)
        return env

    def write(self, fleet: dict[str, Any]) -> None:
        """Make the fake driver show ``fleet`` (atomically: readers see the old or the new one)."""
        text = render_scenario(fleet)
        self.fleet = copy.deepcopy(fleet)
        fd, tmp = tempfile.mkstemp(prefix=".scenario-", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            # File times are coarse (a clock tick); make every write visibly newer so the library
            # notices two writes within one tick even if the inode number gets reused.
            stamp = max(time.time_ns(), self._last_mtime_ns + 1_000_000)
            self._last_mtime_ns = stamp
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, self.scenario_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def set(self, index: int, **fields: Any) -> None:
        """Change fields of GPU ``index`` (e.g. ``utilization_pct=90, memory_used=40 * GiB``)."""
        fleet = copy.deepcopy(self.fleet)
        fleet["devices"][index].update(fields)
        self.write(fleet)

    def set_mig(self, index: int, mig_index: int, **fields: Any) -> None:
        """Change fields of MIG device ``mig_index`` of GPU ``index``."""
        fleet = copy.deepcopy(self.fleet)
        fleet["devices"][index]["mig_devices"][mig_index].update(fields)
        self.write(fleet)

    def set_driver(self, **fields: Any) -> None:
        """Change top-level keys (``driver="none"``, ``driver_version=...``, ``init_error=...``)."""
        fleet = copy.deepcopy(self.fleet)
        fleet.update(fields)
        self.write(fleet)

    @staticmethod
    def load_variant(variant: str) -> ctypes.CDLL:
        """Load the ``old`` or ``ancient`` build into this process, beside the preloaded one.

        A copy loaded by its path is a library of its own (its own init count and call counters);
        binding pynvml to it (``pynvml.nvmlLib``) makes this process a host with that driver.
        """
        lib = ctypes.CDLL(str(build_fake_nvml(variant)))
        lib.fakenvml_calls.restype = ctypes.c_ulong
        lib.fakenvml_calls.argtypes = [ctypes.c_char_p]
        return lib

    # ---- in-process introspection (the preloaded library only) ----
    @staticmethod
    def calls(name: str) -> int:
        """How often this process called the NVML function ``name`` (e.g. ``nvmlDeviceGetUUID``)."""
        return int(preload_fake_nvml().fakenvml_calls(name.encode()))

    @staticmethod
    def reset_calls() -> None:
        """Zero the call counters of this process."""
        preload_fake_nvml().fakenvml_reset_calls()


# ---- ready-made fleets ----
def _uuid(i: int, model: str) -> str:
    return f"GPU-{0xA1000000 + i:08x}-{model}-4{i:03x}-8{i:03x}-{0xF00D0000 + i:012x}"


def fleet_8x(*, processes: bool = True) -> dict[str, Any]:
    """Eight GPUs of two models (4 x A100-SXM4-80GB, 4 x L4), varied load, a few processes."""
    devices: list[dict[str, Any]] = []
    for i in range(8):
        a100 = i < 4
        total = 80 * GiB if a100 else 23034 * MiB
        used_gib = [2, 40, 0, 70, 1, 12, 0, 20][i]
        used = min(used_gib * GiB, total - GiB)
        dev: dict[str, Any] = {
            "name": "NVIDIA A100-SXM4-80GB" if a100 else "NVIDIA L4",
            "uuid": _uuid(i, "a100" if a100 else "l4ff"),
            "pci_bus_id": f"00000000:{0x07 + 0x10 * i:02X}:00.0",
            "pci_device_id": 0x20B210DE if a100 else 0x27B810DE,
            "memory_total": total,
            "memory_used": used,
            "reserved_memory": 512 * MiB if a100 else 428 * MiB,
            "utilization_pct": [3, 97, 0, 55, 12, 80, 0, 33][i],
            "memory_utilization_pct": [1, 60, 0, 30, 4, 41, 0, 10][i],
            "power_limit_w": 400.0 if a100 else 72.0,
            "compute_mode": "DEFAULT",
            "processes": [],
        }
        if processes and used_gib:
            dev["processes"] = [{"pid": 1_000_000 + i, "used_memory": used}]
        devices.append(dev)
    return {"driver_version": "550.54.15", "devices": devices}


def fleet_4x() -> dict[str, Any]:
    """Four idle-ish GPUs: two A100-80GB and two L4 (the first four of a smaller 8x)."""
    fleet = fleet_8x()
    fleet["devices"] = [fleet["devices"][i] for i in (0, 1, 4, 5)]
    return fleet


def fleet_mig() -> dict[str, Any]:
    """One A100 in MIG mode with two MIG devices (3g.40gb + 1g.10gb) and one plain A100."""
    return {
        "driver_version": "550.54.15",
        "devices": [
            {
                "name": "NVIDIA A100-SXM4-80GB",
                "uuid": "GPU-0a0a0a0a-1111-2222-3333-444444444444",
                "pci_bus_id": "00000000:07:00.0",
                "memory_total": 80 * GiB,
                "memory_used": 11 * GiB,
                "temperature_c": 41,
                "power_w": 88.5,
                "power_limit_w": 400.0,
                "compute_mode": "DEFAULT",
                "mig_devices": [
                    {"uuid": "MIG-11111111-aaaa-5bbb-8ccc-000000000001", "profile": "3g.40gb",
                     "memory_total": 40 * GiB - 512 * MiB, "memory_used": 10 * GiB,
                     "processes": [{"pid": 2_000_001, "used_memory": 10 * GiB}]},
                    {"uuid": "MIG-22222222-aaaa-5bbb-8ccc-000000000002", "profile": "1g.10gb",
                     "memory_total": 9856 * MiB, "memory_used": 0},
                ],
            },
            {
                "name": "NVIDIA A100-SXM4-80GB",
                "uuid": "GPU-0b0b0b0b-1111-2222-3333-444444444444",
                "pci_bus_id": "00000000:0F:00.0",
                "memory_total": 80 * GiB,
                "memory_used": 0,
                "utilization_pct": 0,
                "memory_utilization_pct": 0,
                "temperature_c": 30,
                "power_w": 55.0,
                "power_limit_w": 400.0,
            },
        ],
    }


def fleet_edge_cases() -> dict[str, Any]:
    """Five GPUs: healthy, lost, no permission, utilisation NOT_SUPPORTED, PROHIBITED."""
    fleet = fleet_8x(processes=False)
    devs = fleet["devices"]
    devs[1]["lost"] = True
    devs[2]["error"] = "no_permission"
    devs[3]["utilization_supported"] = False
    devs[4]["compute_mode"] = "PROHIBITED"
    fleet["devices"] = devs[:5]
    return fleet
