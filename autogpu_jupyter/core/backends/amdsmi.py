"""Snapshots from AMD's amdsmi library (``libamd_smi.so``) through AMD's ``amdsmi`` binding.

This is the only module of autogpu that imports ``amdsmi``. It mirrors the NVML backend
(:mod:`autogpu_jupyter.core.backends.nvml`) and follows the same decisions, plus what the binding
itself forces:

* ``amdsmi`` ctypes-loads ``libamd_smi.so`` while it is imported; where the library is missing it
  prints two lines to stdout and raises ``KeyError: 'libamd_smi.so'``. The import is therefore
  lazy (first snapshot), guarded (KeyError / OSError / AttributeError, the last for a library
  that lacks a symbol the binding binds) and silenced (its prints never reach a notebook), and a
  failed import is remembered for the life of the process (no retry every sampler tick). A
  missing library is one line: ``no AMD GPU driver on this host (libamd_smi.so not found)``, as
  NVML's is.
* ``amdsmi_init`` runs once per process, under a lock; autogpu never calls
  ``amdsmi_shut_down`` (torch's ROCm build uses the same library in the same process). Should
  someone else shut it down (``AMDSMI_STATUS_NOT_INIT``), the next snapshot initialises it again.
* Identity is amd-smi's UUID (what ``amd-smi list`` prints and AMD's device metrics exporter
  labels ``gpu_uuid``). ``index`` is ROCr's enumeration index (the binding's ``hip_id``: the
  device's place among the KFD GPU nodes), which is what ``ROCR_VISIBLE_DEVICES`` and
  ``HIP_VISIBLE_DEVICES`` indices mean; ``runtime_uuid`` is ROCr's ``GPU-<16 hex>`` spelling of
  KFD's unique id (``hip_uuid``), which those variables also accept
  (:mod:`autogpu_jupyter.core.visibility`).
* Memory is VRAM (``amdsmi_get_gpu_memory_total/usage``, bytes); utilisation is the GFX engine's
  activity, memory utilisation the memory controller's (UMC); temperature the hotspot
  (junction) sensor, else the edge sensor; power the current socket power, else the average
  one; the power limit the power cap (reported in microwatts). The binding's ``"N/A"`` and
  NOT_SUPPORTED become ``None``.
* Compute partitions (MI300X CPX/DPX/QPX; memory NPS1/NPS4): amdsmi lists each partition as a
  processor of its own, and so does ROCr (each is a GPU to HIP, with its own index, and a process
  may use several). Each is therefore a device here, named with its mode
  (``AMD Instinct MI300X (CPX 3, NPS4)``), with its own memory and processes. As with MIG
  devices, what the hardware measures per socket only (GFX activity, temperature, power) is
  ``None`` on a partition: amdsmi does not report it per partition.
* A device whose queries fail is listed with ``available=False`` and an error, the others as
  usual; no library, no loaded driver or no permission raise
  :class:`~autogpu_jupyter.errors.NVMLUnavailableError` (the "no GPU library" error of every
  backend).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import threading
import time
from typing import Any

from autogpu_jupyter.core import procfs
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.errors import NVMLUnavailableError

__all__ = ["AmdSmiBackend", "library_present", "LIBRARY"]

logger = logging.getLogger(__name__)

LIBRARY = "libamd_smi.so"
_TRY_SIMULATED = "; to try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-amd (a simulated fleet)"

# amdsmi status codes that matter here (amdsmi_wrapper.AMDSMI_STATUS_*)
_NOT_SUPPORTED = 2
_NOT_YET_IMPLEMENTED = 3
_NO_PERM = 10
_OUT_OF_RESOURCES = 15
_NOT_INIT = 32
_DRIVER_NOT_LOADED = 34
_INSUFFICIENT_SIZE = 41
_PROCESS_BUFFER = 32  # entries read in one call; more means a second call with room to spare
_NA = "N/A"
_SPX = "SPX"


def library_candidates(environ: dict[str, str] | None = None) -> list[str]:
    """Where the ``amdsmi`` binding looks for ``libamd_smi.so``, in its order (its
    ``find_smi_library``): ``$ROCM_HOME/lib`` or ``$ROCM_PATH/lib``, the dynamic linker's search
    (``LD_LIBRARY_PATH``, ``ld.so.conf``), then ``$ROCM_PATH/lib`` or ``/opt/rocm/lib``."""
    env = os.environ if environ is None else environ
    out: list[str] = []
    root = env.get("ROCM_HOME", env.get("ROCM_PATH"))
    if root:
        out.append(os.path.join(root, "lib", LIBRARY))
    out.append(LIBRARY)
    out.append(os.path.join(env.get("ROCM_PATH", "/opt/rocm"), "lib", LIBRARY))
    return out


def library_present() -> bool:
    """Whether ``libamd_smi.so`` can be loaded where the binding looks for it (loading it is what
    the binding's import does anyway; nothing is initialised)."""
    for location in library_candidates():
        try:
            ctypes.CDLL(location)
        except OSError:
            continue
        return True
    return False


class _State:
    """This process's amdsmi: the module once ``amdsmi_init`` succeeded, or why it cannot be."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None
        self.import_error: str | None = None


_state = _State()


def _import() -> Any:
    """``import amdsmi``, silenced and guarded (see the module docstring). Lock held."""
    if _state.import_error is not None:
        raise NVMLUnavailableError(_state.import_error)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):
            import amdsmi  # noqa: PLC0415 (it loads libamd_smi.so: guarded, on first use)
    except ModuleNotFoundError as err:
        _state.import_error = (
            f"cannot import amdsmi ({err}); install AMD's binding: "
            "pip install 'autogpu-jupyter[amd]'"
        )
    except KeyError:  # the binding's own way of saying "no libamd_smi.so"
        logger.debug("amdsmi import printed: %s", sink.getvalue().strip())
        _state.import_error = (
            f"no AMD GPU driver on this host ({LIBRARY} not found)" + _TRY_SIMULATED
        )
    except (OSError, AttributeError, ImportError) as err:
        logger.debug("amdsmi import printed: %s", sink.getvalue().strip())
        _state.import_error = (
            f"the amdsmi binding cannot use this host's {LIBRARY} ({type(err).__name__}: {err}); "
            "install the amdsmi release that matches the installed ROCm"
        )
    else:
        return amdsmi
    raise NVMLUnavailableError(_state.import_error)


def _init() -> Any:
    """``amdsmi`` with the library initialised (once per process). Raises NVMLUnavailableError."""
    if _state.module is not None:
        return _state.module
    with _state.lock:
        if _state.module is not None:
            return _state.module
        sm = _import()
        try:
            sm.amdsmi_init(sm.AmdSmiInitFlags.INIT_AMD_GPUS)
        except sm.AmdSmiLibraryException as err:
            code = err.get_error_code()
            if code == _DRIVER_NOT_LOADED:
                why = "no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded)"
                raise NVMLUnavailableError(why + _TRY_SIMULATED) from err
            if code == _NO_PERM:
                raise NVMLUnavailableError(
                    "amdsmi cannot be used on this host (no permission to open the AMD GPU "
                    "devices: join the 'render' and 'video' groups)"
                ) from err
            raise NVMLUnavailableError(
                f"amdsmi cannot be used on this host (amdsmi_init: {err.get_error_info()})"
            ) from err
        except sm.AmdSmiException as err:
            raise NVMLUnavailableError(f"amdsmi cannot be used on this host ({err})") from err
        _state.module = sm
        return sm


def _reset_init() -> None:
    with _state.lock:
        _state.module = None


def _code(sm: Any, err: Exception) -> int | None:
    return err.get_error_code() if isinstance(err, sm.AmdSmiLibraryException) else None


def _optional(sm: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` where amdsmi does not support it (here or on this device)."""
    try:
        return fn(*args)
    except sm.AmdSmiLibraryException as err:
        if err.get_error_code() in (_NOT_SUPPORTED, _NOT_YET_IMPLEMENTED):
            return None
        raise


def _number(value: Any) -> float | None:
    """A reading of the binding, or ``None`` for its ``"N/A"`` (and anything not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _Identity:
    """What does not change while the driver is loaded: cached per processor position."""

    __slots__ = ("bus_id", "index", "name", "partition", "runtime_uuid", "uuid")

    def __init__(self, uuid: str, name: str, bus_id: str | None, index: int,
                 runtime_uuid: str | None, partition: tuple[str, str, int] | None) -> None:
        self.uuid = uuid
        self.name = name
        self.bus_id = bus_id
        self.index = index
        self.runtime_uuid = runtime_uuid
        self.partition = partition  # (compute mode, memory mode, partition id) when not SPX


class AmdSmiBackend:
    """Snapshots of every AMD GPU (and compute partition) this process can see, through amdsmi.

    Thread-safe: a lock serialises snapshots of one instance. Construction is free; the library
    is loaded and initialised by the first :meth:`snapshot`.
    """

    name = "amdsmi"
    simulated = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: int | None = None
        self._identity: dict[int, _Identity] = {}
        self._driver_version: str | None = None

    def warm_up(self) -> None:
        """Load and initialise amdsmi now (the picker calls this before the registry lock).

        Once amdsmi is initialised and every device's identity is known, this reads nothing:
        a pick then takes one snapshot per attempt, the one under the lock.
        """
        count = self._count  # read without the lock: a wrong answer costs one extra snapshot
        if _state.module is not None and count is not None and len(self._identity) >= count:
            return
        with contextlib.suppress(NVMLUnavailableError):
            self.snapshot()

    def snapshot(self) -> FleetSnapshot:
        """Read every device now.

        Returns
        -------
        FleetSnapshot
            Devices in amdsmi's order (sockets, then their processors).

        Raises
        ------
        NVMLUnavailableError
            No ``libamd_smi.so``, no loaded amdgpu driver, or amdsmi refuses to initialise.
        """
        sm = _init()
        with self._lock:
            try:
                return self._snapshot(sm)
            except sm.AmdSmiLibraryException as err:
                if err.get_error_code() == _NOT_INIT:
                    logger.warning("amdsmi was shut down behind our back; initialising it again")
                    self._identity.clear()
                    _reset_init()
                    sm = _init()
                    try:
                        return self._snapshot(sm)
                    except sm.AmdSmiLibraryException as again:
                        raise NVMLUnavailableError(
                            f"amdsmi stopped working in this process ({again.get_error_info()})"
                        ) from again
                if err.get_error_code() == _DRIVER_NOT_LOADED:
                    self._identity.clear()
                    raise NVMLUnavailableError(
                        "no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded)"
                    ) from err
                raise NVMLUnavailableError(
                    f"amdsmi cannot list the GPUs ({err.get_error_info()})"
                ) from err

    # ---- internals (self._lock held) ----
    def _snapshot(self, sm: Any) -> FleetSnapshot:
        now = time.time()
        handles = sm.amdsmi_get_processor_handles()
        if len(handles) != self._count:
            self._identity.clear()
            self._count = len(handles)
        if self._driver_version is None and handles:
            info = _optional(sm, sm.amdsmi_get_gpu_driver_info, handles[0])
            version = None if info is None else info.get("driver_version")
            self._driver_version = None if version in (None, _NA) else str(version)
        devices = [self._read(sm, position, h) for position, h in enumerate(handles)]
        return FleetSnapshot(
            devices=tuple(devices),
            timestamp_s=now,
            backend=self.name,
            driver_version=self._driver_version,
        )

    def _read(self, sm: Any, position: int, handle: Any) -> DeviceSnapshot:
        try:
            ident = self._identity.get(position)
            if ident is None:
                ident = self._read_identity(sm, position, handle)
                self._identity[position] = ident
            memory = self._memory(sm, handle)
            processes = self._processes(sm, handle)
            socket_values: tuple[float | None, ...] = (None, None, None, None, None)
            if ident.partition is None:
                socket_values = self._socket_values(sm, handle)
        except sm.AmdSmiLibraryException as err:
            if err.get_error_code() in (_NOT_INIT, _DRIVER_NOT_LOADED):
                raise
            known = self._identity.pop(position, None)
            logger.debug("AMD GPU %d unavailable: %s", position, err)
            return DeviceSnapshot(
                index=position if known is None else known.index,
                uuid=f"unknown-{position}" if known is None else known.uuid,
                name="unknown" if known is None else known.name,
                pci_bus_id=None if known is None else known.bus_id,
                processes=None, available=False,
                error="no permission" if err.get_error_code() == _NO_PERM
                else f"amdsmi error: {err.get_error_info(detailed=False)}",
                vendor="amd", timestamp_s=time.time(),
            )
        util, memory_util, temperature, power, limit = socket_values
        total, used = memory
        return DeviceSnapshot(
            index=ident.index,
            uuid=ident.uuid,
            name=ident.name,
            pci_bus_id=ident.bus_id,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=None if total is None or used is None else max(total - used, 0),
            utilization_pct=util,
            memory_utilization_pct=memory_util,
            temperature_c=temperature,
            power_w=power,
            power_limit_w=limit,
            compute_mode=None,  # AMD GPUs have no compute modes
            mig_enabled=False,
            processes=processes,
            vendor="amd",
            runtime_uuid=ident.runtime_uuid,
            timestamp_s=time.time(),
        )

    @staticmethod
    def _read_identity(sm: Any, position: int, handle: Any) -> _Identity:
        uuid = str(sm.amdsmi_get_gpu_device_uuid(handle))
        asic = _optional(sm, sm.amdsmi_get_gpu_asic_info, handle) or {}
        name = str(asic.get("market_name") or "AMD GPU")
        if name == _NA:
            name = "AMD GPU"
        bus_id = _optional(sm, sm.amdsmi_get_gpu_device_bdf, handle)
        enum = _optional(sm, sm.amdsmi_get_gpu_enumeration_info, handle) or {}
        hip_id = enum.get("hip_id")
        index = hip_id if isinstance(hip_id, int) and not isinstance(hip_id, bool) else position
        runtime_uuid = _runtime_uuid(enum.get("hip_uuid"), asic.get("asic_serial"))
        compute = _optional(sm, sm.amdsmi_get_gpu_compute_partition, handle)
        partition = None
        if compute and compute not in (_SPX, _NA):
            memory_mode = _optional(sm, sm.amdsmi_get_gpu_memory_partition, handle) or ""
            kfd = _optional(sm, sm.amdsmi_get_gpu_kfd_info, handle) or {}
            pid = kfd.get("current_partition_id")
            part = pid if isinstance(pid, int) and not isinstance(pid, bool) else 0
            partition = (str(compute), str(memory_mode), part)
            mode = f"{compute} {part}"
            if memory_mode not in ("", _NA):
                mode += f", {memory_mode}"
            name = f"{name} ({mode})"
        return _Identity(uuid, name, None if bus_id is None else str(bus_id), index,
                         runtime_uuid, partition)

    @staticmethod
    def _memory(sm: Any, handle: Any) -> tuple[int | None, int | None]:
        vram = sm.AmdSmiMemoryType.VRAM
        total = _optional(sm, sm.amdsmi_get_gpu_memory_total, handle, vram)
        used = _optional(sm, sm.amdsmi_get_gpu_memory_usage, handle, vram)
        return (None if total is None else int(total)), (None if used is None else int(used))

    @staticmethod
    def _socket_values(
        sm: Any, handle: Any
    ) -> tuple[float | None, float | None, float | None, float | None, float | None]:
        activity = _optional(sm, sm.amdsmi_get_gpu_activity, handle) or {}
        util = _number(activity.get("gfx_activity"))
        memory_util = _number(activity.get("umc_activity"))
        current = sm.AmdSmiTemperatureMetric.CURRENT
        temperature = None
        for sensor in (sm.AmdSmiTemperatureType.HOTSPOT, sm.AmdSmiTemperatureType.EDGE):
            temperature = _number(_optional(sm, sm.amdsmi_get_temp_metric, handle, sensor, current))
            if temperature is not None:
                break
        power_info = _optional(sm, sm.amdsmi_get_power_info, handle) or {}
        power = _number(power_info.get("current_socket_power"))
        if power is None:
            power = _number(power_info.get("average_socket_power"))
        cap = _optional(sm, sm.amdsmi_get_power_cap_info, handle) or {}
        cap_uw = _number(cap.get("power_cap"))
        limit = None if not cap_uw else cap_uw / 1_000_000.0
        return util, memory_util, temperature, power, limit

    @staticmethod
    def _processes(sm: Any, handle: Any) -> tuple[ProcessSnapshot, ...] | None:
        # The binding's amdsmi_get_gpu_process_list allocates room for 1,024 processes (about
        # 600 KB) at every call, which is most of a snapshot's cost: call the library through
        # the binding's own ctypes function with room for what is there, growing it when the
        # library says the list is longer (it may grow between two calls).
        w = sm.amdsmi_wrapper
        size = _PROCESS_BUFFER
        for _attempt in range(4):
            buffer = (w.amdsmi_proc_info_t * size)()
            count = ctypes.c_uint32(size)
            rc = int(w.amdsmi_get_gpu_process_list(handle, ctypes.byref(count), buffer))
            if rc == 0:
                break
            if rc in (_NOT_SUPPORTED, _NOT_YET_IMPLEMENTED):
                return None
            if rc not in (_OUT_OF_RESOURCES, _INSUFFICIENT_SIZE):
                raise sm.AmdSmiLibraryException(rc)
            size = max(count.value, size) + _PROCESS_BUFFER
        else:
            return None
        out = []
        for entry in buffer[: min(count.value, size)]:
            pid = int(entry.pid)
            if pid <= 0:
                continue
            out.append(ProcessSnapshot(
                pid=pid, used_memory_bytes=int(entry.memory_usage.vram_mem),
                user=procfs.user_of(pid), command=procfs.command_of(pid),
            ))
        return tuple(out)


def _runtime_uuid(hip_uuid: Any, asic_serial: Any) -> str | None:
    """ROCr's ``GPU-<16 hex>`` for a device: the binding's ``hip_uuid``, else derived from the
    ASIC serial (the same KFD unique id, ``0x…``); ``None`` when neither is known."""
    if isinstance(hip_uuid, str) and hip_uuid.startswith("GPU-") and len(hip_uuid) > 4:
        digits = hip_uuid[4:].lower()
        if all(c in "0123456789abcdef" for c in digits) and int(digits, 16) != 0:
            return "GPU-" + digits.zfill(16)
    if isinstance(asic_serial, str) and asic_serial not in ("", _NA):
        try:
            value = int(asic_serial, 16)
        except ValueError:
            return None
        if 0 < value < 2**64 - 1:
            return f"GPU-{value:016x}"
    return None
