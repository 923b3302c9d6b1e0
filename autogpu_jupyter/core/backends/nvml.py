"""Snapshots from NVIDIA's NVML through nvidia-ml-py (``import pynvml``).

This is the only module of autogpu that imports ``pynvml``, and it does so lazily, on the first
snapshot, so importing autogpu stays cheap. Decisions it follows (docs/design.md, decision 1):

* ``nvmlInit`` runs once per process, under a lock, on first use; autogpu never calls
  ``nvmlShutdown``: NVML counts inits per process and torch uses the same count, so an extra
  shutdown would break torch's own NVML use. If someone else's extra shutdown leaves NVML
  uninitialised, the next snapshot initialises it again.
* Per-field NOT_SUPPORTED (utilisation on MIG, power on some boards) becomes ``None``; a device
  whose handle or queries fail with GPU_IS_LOST or NO_PERMISSION is listed with
  ``available=False`` and ``error="GPU is lost"`` / ``"no permission"`` while the others are read
  as usual; no library or no loaded driver raises
  :class:`~autogpu_jupyter.errors.NVMLUnavailableError`.
* Memory comes from ``nvmlDeviceGetMemoryInfo_v2`` where the driver has it (it does not count the
  driver's reserved memory as used) and from v1 otherwise.
* Compute processes come from the ``_v3`` call, else ``_v2``, else v1, each read with its own
  struct layout (reading v1 entries with the v2 layout yields garbage PIDs). ``user`` is the owner
  of ``/proc/<pid>`` and ``command`` its ``cmdline``; both are ``None`` where ``/proc`` does not
  tell (another PID namespace, the process already gone).
* Handles and the identity of each GPU (UUID, name, PCI bus id) are cached per NVML index: on a
  real host the first handle of a GPU can take seconds. The cache is dropped when the device count
  changes or a query of that GPU fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
import warnings
from types import ModuleType
from typing import Any

from autogpu_jupyter.core import procfs
from autogpu_jupyter.core.devices import (
    COMPUTE_MODES,
    DeviceSnapshot,
    FleetSnapshot,
    ProcessSnapshot,
)
from autogpu_jupyter.errors import NVMLUnavailableError

__all__ = ["NvmlBackend", "binding_problem"]

logger = logging.getLogger(__name__)

#: What a user without a GPU can do instead (the demo's simulated fleet), said with the error.
_TRY_SIMULATED = "; to try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-4x (a simulated fleet)"

_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong: "usedGpuMemory unknown"
_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7
_PROCESS_BUFFER = 32  # entries read in one call; more means a second, sized call with as many
# again to spare (the list can grow between the two calls)



class _State:
    """This process's NVML state: the module once ``nvmlInit`` succeeded, the binding note."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None
        self.binding_note: str | None = None  # binding_problem() found at init ("" = none)


_state = _State()


class _ProcessInfoV1(ctypes.Structure):
    """``nvmlProcessInfo_v1_t``: what ``nvmlDeviceGetComputeRunningProcesses`` (no suffix) fills."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _ProcessInfoV2(ctypes.Structure):
    """``nvmlProcessInfo_v2_t``, also the layout of ``_v3``."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


def binding_problem(nv: ModuleType) -> str | None:
    """Describe a deprecated ``pynvml`` distribution shadowing nvidia-ml-py, or ``None``.

    The ``pynvml`` distribution (gpuopenanalytics) is deprecated; its old releases install a
    ``pynvml/`` package that shadows nvidia-ml-py's ``pynvml.py`` (pitfall 26).
    """
    where = getattr(nv, "__file__", None) or "?"
    found: list[str] = []
    site = os.path.dirname(where)
    if os.path.basename(where) == "__init__.py":
        found.append(f"'import pynvml' loads the package {site}")
        site = os.path.dirname(site)
    # The distribution's metadata sits next to the module it installed; one directory listing is
    # much cheaper than importlib.metadata's scan of every sys.path entry (paid once per process).
    try:
        names = os.listdir(site)
    except OSError:
        names = []
    for name in names:
        if name.lower().startswith("pynvml-") and name.endswith((".dist-info", ".egg-info")):
            version = name[len("pynvml-") :].rsplit(".", 1)[0].removesuffix(".dist")
            found.append(f"the deprecated 'pynvml' distribution {version} is installed")
            break
    if not found:
        return None
    return (
        "; ".join(found)
        + " instead of only nvidia-ml-py, which autogpu needs; fix: pip uninstall pynvml && "
        "pip install --force-reinstall nvidia-ml-py"
    )


def _init() -> Any:
    """``pynvml`` with NVML initialised (once per process). Raises NVMLUnavailableError."""
    if _state.module is not None:
        return _state.module
    with _state.lock:
        if _state.module is not None:
            return _state.module
        try:
            import pynvml  # noqa: PLC0415 (the binding loads the driver: on the first snapshot)
        except ImportError as err:
            raise NVMLUnavailableError(
                f"cannot import pynvml ({err}); install nvidia-ml-py: pip install nvidia-ml-py"
            ) from err
        nv: Any = pynvml
        try:
            nv.nvmlInit()
        except nv.NVMLError_LibraryNotFound as err:
            raise NVMLUnavailableError(
                "no NVIDIA driver on this host (libnvidia-ml.so.1 not found)" + _TRY_SIMULATED
            ) from err
        except nv.NVMLError_DriverNotLoaded as err:
            raise NVMLUnavailableError(
                "no NVIDIA driver on this host (NVML: Driver Not Loaded; the NVIDIA kernel "
                "module is not loaded)" + _TRY_SIMULATED
            ) from err
        except nv.NVMLError_NoPermission as err:
            raise NVMLUnavailableError(
                "NVML cannot be used on this host (no permission to open the NVIDIA devices)"
            ) from err
        except nv.NVMLError_LibRmVersionMismatch as err:
            raise NVMLUnavailableError(
                "NVML cannot be used on this host (the NVML library and the loaded driver have "
                "different versions; reload the driver or reboot)"
            ) from err
        except nv.NVMLError as err:
            raise NVMLUnavailableError(
                f"NVML cannot be used on this host (nvmlInit: {err})"
            ) from err
        if _state.binding_note is None:
            _state.binding_note = binding_problem(nv) or ""
            if _state.binding_note:  # once per process
                # At this line: the callers of snapshot() are autogpu's own, never the user's code.
                warnings.warn(_state.binding_note)  # noqa: B028
        _state.module = nv
        return nv


def _reset_init() -> None:
    """Forget that NVML is initialised (someone else's extra nvmlShutdown dropped the count)."""
    with _state.lock:
        _state.module = None


def _device_error(nv: ModuleType, err: Exception) -> str:
    if isinstance(err, nv.NVMLError_GpuIsLost):
        return "GPU is lost"
    if isinstance(err, nv.NVMLError_NoPermission):
        return "no permission"
    return f"NVML error: {err}"


class NvmlBackend:
    """Snapshots of every NVIDIA device (and MIG device) this process can see, through NVML.

    Thread-safe: a lock serialises snapshots of one instance. Construction is free; NVML is
    initialised by the first :meth:`snapshot`.
    """

    name = "nvml"
    simulated = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: int | None = None
        self._handles: dict[int, Any] = {}
        self._identity: dict[int, tuple[str, str, str | None]] = {}  # uuid, name, pci bus id
        self._driver_version: str | None = None
        self._unusable: set[str] = set()  # newer NVML calls found missing here, never tried again
        self._process_call: tuple[Any, type[ctypes.Structure], str] | None = None

    # ---- public ----
    def warm_up(self) -> None:
        """Initialise NVML and open the device handles now (the picker calls this before it takes
        the registry lock, so that NVML's one-time start-up does not hold up other pickers).

        Once NVML is initialised and every GPU's handle and identity are cached, this reads
        nothing: a pick then takes one snapshot per attempt, the one under the lock (which also
        notices a changed device count and opens new handles there).
        """
        if self._warm():
            return
        with contextlib.suppress(NVMLUnavailableError):  # the locked snapshot reports it
            self.snapshot()

    def _warm(self) -> bool:
        """Whether a snapshot now would find NVML initialised and every handle open (read
        without the lock: a wrong answer costs one extra snapshot, nothing else)."""
        count = self._count
        return (
            _state.module is not None
            and count is not None
            and len(self._handles) >= count
            and len(self._identity) >= count
        )

    def snapshot(self) -> FleetSnapshot:
        """Read every device now.

        Returns
        -------
        FleetSnapshot
            Physical GPUs in NVML index order, each followed by its MIG devices.

        Raises
        ------
        NVMLUnavailableError
            No NVML library, no loaded driver, or NVML refuses to initialise.
        """
        nv = _init()
        with self._lock:
            try:
                return self._snapshot(nv)
            except nv.NVMLError_Uninitialized:
                # Someone shut NVML down behind our back: initialise again, once.
                logger.warning("NVML was shut down behind our back; initialising it again")
                self._forget_all()
                _reset_init()
                nv = _init()
                try:
                    return self._snapshot(nv)
                except (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded) as err:
                    raise NVMLUnavailableError(
                        f"NVML stopped working in this process ({err})"
                    ) from err
            except nv.NVMLError_DriverNotLoaded as err:
                self._forget_all()
                raise NVMLUnavailableError(
                    "no NVIDIA driver on this host (NVML: Driver Not Loaded)"
                ) from err

    # ---- internals (self._lock held) ----
    def _forget_all(self) -> None:
        self._handles.clear()
        self._identity.clear()

    def _snapshot(self, nv: ModuleType) -> FleetSnapshot:
        now = time.time()
        if self._driver_version is None:
            self._driver_version = self._driver(nv)
        count = nv.nvmlDeviceGetCount()
        if count != self._count:
            self._forget_all()
            self._count = count
        devices: list[DeviceSnapshot] = []
        for index in range(count):
            devices.extend(self._read_gpu(nv, index))
        return FleetSnapshot(
            devices=tuple(devices),
            timestamp_s=now,
            backend=self.name,
            driver_version=self._driver_version,
            errors=(_state.binding_note,) if _state.binding_note else (),
        )

    @staticmethod
    def _driver(nv: ModuleType) -> str | None:
        try:
            version = nv.nvmlSystemGetDriverVersion()
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return None
        return str(version)  # nvidia-ml-py decodes the C string

    def _read_gpu(self, nv: ModuleType, index: int) -> list[DeviceSnapshot]:
        fatal = (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded)
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                self._handles[index] = handle
            identity = self._identity.get(index)
            if identity is None:
                identity = self._read_identity(nv, handle)
                self._identity[index] = identity
            uuid, name, bus_id = identity
            memory = self._memory(nv, handle)
            util = _optional(nv, nv.nvmlDeviceGetUtilizationRates, handle)
            temperature = self._temperature(nv, handle)
            power_mw = _optional(nv, nv.nvmlDeviceGetPowerUsage, handle)
            limit_mw = self._power_limit(nv, handle)
            mode = _optional(nv, nv.nvmlDeviceGetComputeMode, handle)
            mig_mode = _optional(nv, nv.nvmlDeviceGetMigMode, handle)
            processes = self._processes(nv, handle)
            mig_enabled = bool(mig_mode is not None and mig_mode[0])
            migs = self._mig_handles(nv, handle) if mig_enabled else []
        except fatal:
            raise
        except nv.NVMLError as err:
            self._handles.pop(index, None)
            known = self._identity.pop(index, None)
            logger.debug("GPU %d unavailable: %s", index, err)
            uuid, name, bus_id = known or (f"unknown-{index}", "unknown", None)
            return [
                DeviceSnapshot(
                    index=index, uuid=uuid, name=name, pci_bus_id=bus_id, processes=None,
                    available=False, error=_device_error(nv, err), timestamp_s=time.time(),
                )
            ]
        compute_mode = None if mode is None else COMPUTE_MODES.get(int(mode), str(mode))
        total, used, free = memory if memory is not None else (None, None, None)
        parent = DeviceSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus_id,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_pct=None if util is None else float(util.gpu),
            memory_utilization_pct=None if util is None else float(util.memory),
            temperature_c=None if temperature is None else float(temperature),
            power_w=None if power_mw is None else power_mw / 1000.0,
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            compute_mode=compute_mode,
            # NOT_SUPPORTED here means the GPU cannot do MIG: MIG is off, not unknown.
            mig_enabled=mig_enabled,
            processes=processes,
            timestamp_s=time.time(),
        )
        out = [parent]
        for mig_index, mig_handle in migs:
            out.append(self._read_mig(nv, parent, mig_index, mig_handle))
        return out

    def _read_mig(
        self, nv: ModuleType, parent: DeviceSnapshot, mig_index: int, handle: Any
    ) -> DeviceSnapshot:
        try:
            uuid = str(nv.nvmlDeviceGetUUID(handle))
            name = str(_optional(nv, nv.nvmlDeviceGetName, handle) or f"{parent.name} MIG")
            memory = self._memory(nv, handle)
            processes = self._processes(nv, handle)
        except (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded):
            raise
        except nv.NVMLError as err:
            return DeviceSnapshot(
                index=parent.index, uuid=f"{parent.uuid}/mig-{mig_index}",
                name=f"{parent.name} MIG",
                pci_bus_id=parent.pci_bus_id, mig_enabled=True, is_mig=True,
                parent_uuid=parent.uuid, mig_index=mig_index, processes=None, available=False,
                error=_device_error(nv, err), timestamp_s=time.time(),
            )
        total, used, free = memory if memory is not None else (None, None, None)
        # NVML has no utilisation, temperature or power per MIG device: None (unknown).
        return DeviceSnapshot(
            index=parent.index,
            uuid=uuid,
            name=name,
            pci_bus_id=parent.pci_bus_id,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            compute_mode=parent.compute_mode,
            mig_enabled=True,
            is_mig=True,
            parent_uuid=parent.uuid,
            mig_index=mig_index,
            processes=processes,
            timestamp_s=time.time(),
        )

    @staticmethod
    def _read_identity(nv: ModuleType, handle: Any) -> tuple[str, str, str | None]:
        # nvidia-ml-py hands C strings (the bus id in its structure too) over as str.
        uuid = str(nv.nvmlDeviceGetUUID(handle))
        name = _optional(nv, nv.nvmlDeviceGetName, handle)
        pci = _optional(nv, nv.nvmlDeviceGetPciInfo_v3, handle)
        bus_id = None if pci is None else str(pci.busId)
        return uuid, "unknown" if name is None else str(name), bus_id

    def _memory(self, nv: ModuleType, handle: Any) -> tuple[int, int, int] | None:
        if "nvmlDeviceGetMemoryInfo_v2" not in self._unusable:
            try:  # nvidia-ml-py >= 12.535 (our minimum) has nvmlMemory_v2
                mem = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_ArgumentVersionMismatch):
                logger.debug("nvmlDeviceGetMemoryInfo_v2 unavailable: using v1")
                self._unusable.add("nvmlDeviceGetMemoryInfo_v2")
            except nv.NVMLError_NotSupported:
                return None
            except TypeError:
                # Another library replaced pynvml's function by one without ``version``
                # (gpustat does, at import): use what it offers, the v1 call signature.
                logger.debug("pynvml.nvmlDeviceGetMemoryInfo was replaced: using its v1 form")
                self._unusable.add("nvmlDeviceGetMemoryInfo_v2")
            else:
                return int(mem.total), int(mem.used), int(mem.free)
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return None
        return int(mem.total), int(mem.used), int(mem.free)

    def _temperature(self, nv: ModuleType, handle: Any) -> int | None:
        # nvmlDeviceGetTemperatureV needs a newer binding than our minimum and a recent driver
        if "nvmlDeviceGetTemperatureV" not in self._unusable and hasattr(
            nv, "nvmlDeviceGetTemperatureV"
        ):
            try:
                value = nv.nvmlDeviceGetTemperatureV(handle, nv.NVML_TEMPERATURE_GPU)
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_ArgumentVersionMismatch):
                logger.debug("nvmlDeviceGetTemperatureV unavailable: using the older call")
                self._unusable.add("nvmlDeviceGetTemperatureV")
            except nv.NVMLError_NotSupported:
                return None
            else:
                return int(value)
        value = _optional(nv, nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        return None if value is None else int(value)

    @staticmethod
    def _power_limit(nv: ModuleType, handle: Any) -> int | None:
        value = _optional(nv, nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        if value is None:
            value = _optional(nv, nv.nvmlDeviceGetPowerManagementLimit, handle)
        return None if value is None else int(value)

    @staticmethod
    def _mig_handles(nv: ModuleType, handle: Any) -> list[tuple[int, Any]]:
        count = _optional(nv, nv.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        found = []
        for slot in range(count):
            try:
                found.append((slot, nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))
            except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument):
                continue  # an empty slot
        return found

    def _process_function(self, nv: ModuleType) -> tuple[Any, type[ctypes.Structure], str]:
        if self._process_call is None:
            for name, layout in (
                ("nvmlDeviceGetComputeRunningProcesses_v3", _ProcessInfoV2),
                ("nvmlDeviceGetComputeRunningProcesses_v2", _ProcessInfoV2),  # R470-era
            ):
                try:
                    self._process_call = (nv._nvmlGetFunctionPointer(name), layout, name)
                    break
                except nv.NVMLError_FunctionNotFound:
                    continue
            else:
                # R450-era; every NVML has this call (else FunctionNotFound reaches the caller)
                name = "nvmlDeviceGetComputeRunningProcesses"
                self._process_call = (nv._nvmlGetFunctionPointer(name), _ProcessInfoV1, name)
            if not name.endswith("_v3"):
                logger.info("old NVIDIA driver: reading processes with %s", name)
        return self._process_call

    def _processes(self, nv: ModuleType, handle: Any) -> tuple[ProcessSnapshot, ...] | None:
        try:
            fn, layout, _ = self._process_function(nv)
        except nv.NVMLError_FunctionNotFound:
            return None
        size = _PROCESS_BUFFER
        for _attempt in range(4):
            # The list can grow between a sizing call and the read: retry with room to spare.
            buffer = (layout * size)()
            count = ctypes.c_uint(size)
            ret = fn(handle, ctypes.byref(count), buffer)
            if ret == _NVML_SUCCESS:
                break
            if ret != _NVML_ERROR_INSUFFICIENT_SIZE:
                err = nv.NVMLError(ret)
                if isinstance(err, nv.NVMLError_NotSupported):
                    return None
                raise err
            size = count.value + _PROCESS_BUFFER
        else:
            return None
        out = []
        for entry in buffer[: min(count.value, size)]:
            pid = int(entry.pid)
            if pid <= 0:
                continue
            used = int(entry.usedGpuMemory)
            out.append(ProcessSnapshot(
                pid=pid, used_memory_bytes=None if used == _NOT_AVAILABLE else used,
                user=procfs.user_of(pid), command=procfs.command_of(pid),
            ))
        return tuple(out)


def _optional(nv: ModuleType, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` where NVML does not support it (on this device or driver)."""
    try:
        return fn(*args)
    except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
        return None
