"""The server extension's shared state: configuration, the one sampler, the executor.

Every blocking call (NVML through the sampler's backend, the lease registry, ``/proc``) runs on
:attr:`AutoGPUServer.executor`, never on the IOLoop.
"""

from __future__ import annotations

import asyncio
import getpass
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from traitlets import Bool, Float, Int, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from autogpu_jupyter.config import AutoGPU, default_registry_dir
from autogpu_jupyter.core import ClusterCache, procfs, redact_command
from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core.leasing import LeaseStore, store_for
from autogpu_jupyter.errors import AutoGPUError

if TYPE_CHECKING:
    from autogpu_jupyter.core import FleetSnapshot, Sampler

__all__ = ["AutoGPUServer", "KernelSource", "ServerContext", "current_user"]

T = TypeVar("T")


def current_user() -> str:
    """The Unix user this server runs as (the owner of "our" leases and processes)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class KernelSource(Protocol):
    """What the payloads read of jupyter_server's ``MappingKernelManager``: the kernel ids and
    each kernel's manager (its ``provisioner``, ``execution_state``, ``last_activity``)."""

    def list_kernel_ids(self) -> Iterable[str]: ...

    def get_kernel(self, kernel_id: str) -> Any: ...  # jupyter_client's, untyped


def _no_store() -> LeaseStore | None:
    return None


@dataclass(frozen=True)
class ServerContext:
    """What a payload function may read of the server, made per request by
    :meth:`AutoGPUServer.context`: the sampler (``None`` if it cannot run) and the reason it
    cannot, the lease store's factory, the ``c.AutoGPU`` settings' factory, the cluster cache
    and the ``c.AutoGPUServer`` values the answers carry. Frozen: a payload never changes the
    server's state."""

    sampler: Sampler | None = None
    sampler_error: str | None = None
    #: The Unix user the server runs as (whose command lines are always shown).
    user: str = ""
    expose_commands: bool = False
    interval_s: float = 1.0
    history_s: float = 900.0
    max_history_points: int = 900
    smoothing_window_s: float = 30.0
    registry_dir: str = ""
    #: The lease store, read-only (``None``: leases off); may raise AutoGPUError / OSError.
    store: Callable[[], LeaseStore | None] = field(default=_no_store)
    #: The server's ``c.AutoGPU`` settings (made anew: a bad value raises here, where asked).
    settings: Callable[[], AutoGPU] = field(default=AutoGPU)
    cluster_cache: ClusterCache | None = None
    #: ``c.AutoGPUServer.cull_idle_gpu_kernels_s`` (0: no culling) and how long before the
    #: cull its warning starts (:meth:`AutoGPUServer.cull_warning_lead_s`; 0: no warning).
    cull_idle_gpu_kernels_s: float = 0.0
    cull_warning_lead_s: float = 0.0


class AutoGPUServer(LoggingConfigurable):
    """Settings of the JupyterLab sidebar's server side (``c.AutoGPUServer.*``).

    One instance per server process, created by ``_load_jupyter_server_extension``; it owns the
    executor that runs every NVML and registry call off the IOLoop. Its ``log`` is the server's
    (``ServerApp.log``, its parent's): what it says reaches the server's log at its level.
    """

    interval_s = Float(
        1.0,
        help="Seconds between two NVML sweeps of the server's shared sampler (>= 0.1). NVML's "
        "utilisation is a 1/6-1 s average, so faster adds nothing. However many browser tabs poll, "
        "the server reads NVML at this rate only.",
    ).tag(config=True)

    @validate("interval_s")
    def _valid_interval(self, proposal: Any) -> float:
        """A rate the sampler can keep: a value that is not a number of seconds >= 0.1 is
        said once in the server's log and replaced (the sidebar's answers carry the rate
        used; an infinite one could not even be written as JSON)."""
        value = proposal["value"]
        if math.isfinite(value) and value >= 0.1:
            return float(value)
        used = 0.1 if math.isfinite(value) else 1.0
        self.log.warning(
            "autogpu: c.AutoGPUServer.interval_s = %r is not a number of seconds >= 0.1 "
            "(e.g. 1.0): %s s is used", value, used,
        )
        return used

    history_s = Float(
        900.0,
        help="Seconds of per-device history the sampler keeps in memory (a bounded ring buffer).",
    ).tag(config=True)
    max_history_points = Int(
        900,
        help="Most samples per device one /autogpu/api/v1/history answer contains (the newest "
        "are kept).",
    ).tag(config=True)
    smoothing_window_s = Float(
        30.0,
        help="Window (seconds) of the mean utilisation that the dry-run select ranks by, as the "
        "magic does when a sampler runs.",
    ).tag(config=True)
    expose_commands = Bool(
        False,
        help="Show other users' command lines (of their GPU processes and leases) in the "
        "sidebar. Off by default: command lines can contain secrets. The server user's own are "
        "always shown.",
    ).tag(config=True)
    registry_dir = Unicode(
        help="Lease registry to show holders from; defaults to c.AutoGPU.registry_dir / "
        "$AUTOGPU_REGISTRY_DIR / /var/tmp/autogpu. Empty string: show no leases."
    ).tag(config=True)
    cull_idle_gpu_kernels_s = Float(
        0.0,
        help="Shut down this server's kernels that hold a GPU (a live lease, a GPU process, or "
        "the autogpu kernelspec's pick) once they have been idle this many seconds; 0 (the "
        "default) never does. Uses jupyter_server's own idle culler: "
        "MappingKernelManager.cull_interval, cull_connected and cull_busy apply, and kernels "
        "without a GPU keep MappingKernelManager.cull_idle_timeout (0: never culled).",
    ).tag(config=True)
    cull_warning_s = Float(
        None,
        allow_none=True,
        help="With cull_idle_gpu_kernels_s set: how many seconds before an idle GPU kernel is "
        "shut down its notebook's user is warned (a JupyterLab / Notebook 7 notification naming "
        "the GPU and how to keep it: run a cell). None (the default): a tenth of "
        "cull_idle_gpu_kernels_s, at most 300; 0: no warning.",
    ).tag(config=True)

    @validate("cull_warning_s")
    def _valid_cull_warning(self, proposal: Any) -> float | None:
        """``None`` or a number of seconds >= 0; anything else is said once in the server's log
        and replaced by ``None`` (the default)."""
        value = proposal["value"]
        if value is None or (math.isfinite(value) and value >= 0):
            return value if value is None else float(value)
        self.log.warning(
            "autogpu: c.AutoGPUServer.cull_warning_s = %r is not None or a number of seconds "
            ">= 0 (e.g. 300): the default (a tenth of cull_idle_gpu_kernels_s, at most 300 s) "
            "is used", value,
        )
        return None

    def cull_warning_lead_s(self) -> float:
        """Seconds before the cull that the warning starts: :attr:`cull_warning_s`, or its
        default; 0 when culling is off or the warning is."""
        limit = float(self.cull_idle_gpu_kernels_s)
        if limit <= 0:
            return 0.0
        if self.cull_warning_s is None:
            return min(300.0, limit / 10)
        return min(float(self.cull_warning_s), limit)
    metrics = Bool(
        True,
        help="Register the autogpu_* gauges on jupyter_server's Prometheus registry (served at "
        "{base_url}/metrics, authenticated unless ServerApp.authenticate_prometheus = False). A "
        "scrape reads the shared sampler's latest sweep: it never calls NVML.",
    ).tag(config=True)
    metrics_lease_details = Bool(
        False,
        help="Add kernel and notebook labels to autogpu_lease_info. Off by default: notebook "
        "paths are other users' business, and each one is another series to store.",
    ).tag(config=True)
    metrics_hostname = Unicode(
        "",
        help="The hostname label of the autogpu_* series (default: this host's short name, as "
        "DCGM exporter's Hostname label).",
    ).tag(config=True)
    executor_threads = Int(
        4, help="Threads that run NVML, registry and /proc reads off the IOLoop."
    ).tag(config=True)

    @default("registry_dir")
    def _default_registry_dir(self) -> str:
        try:
            return AutoGPU(parent=self.parent).registry_dir
        except Exception:
            return default_registry_dir()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.user = current_user()
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, self.executor_threads), thread_name_prefix="autogpu-server"
        )
        self._sampler: Sampler | None = None
        self._sampler_error: str | None = None
        #: The cluster view every sidebar of this server shares (one Prometheus fetch per half
        #: scrape interval, refreshed on the executor).
        self.cluster_cache = ClusterCache(submit=self.executor.submit)
        self._lock = threading.Lock()
        self._settings: AutoGPU | None = None
        #: Kernels with a move in progress (touched on the IOLoop only): a second one is refused.
        self.moving: set[str] = set()
        #: The plan of each kernel's move recorded for its client's restart (``"restart":
        #: false``), until the client asks where the kernel runs now (IOLoop only; one per kernel).
        self.move_plans: dict[str, Any] = {}

    def context(self) -> ServerContext:
        """The typed view of this server that the payload functions read (one per request;
        starts the sampler if it has not started)."""
        sampler = self.sampler()
        return ServerContext(
            sampler=sampler,
            sampler_error=self._sampler_error,
            user=self.user,
            expose_commands=self.expose_commands,
            interval_s=self.interval_s,
            history_s=self.history_s,
            max_history_points=self.max_history_points,
            smoothing_window_s=self.smoothing_window_s,
            registry_dir=self.registry_dir,
            store=self.store,
            settings=lambda: AutoGPU(parent=self.parent),
            cluster_cache=self.cluster_cache,
            cull_idle_gpu_kernels_s=float(self.cull_idle_gpu_kernels_s or 0.0),
            cull_warning_lead_s=self.cull_warning_lead_s(),
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or join) the process's one sampler; errors are kept and reported, not raised."""
        self.sampler()

    def sampler(self) -> Sampler | None:
        """The process-wide sampler (``core.sampler.get_sampler()``), ``None`` if it cannot run."""
        with self._lock:
            if self._sampler is None:
                try:
                    self._sampler = sampler_mod.get_sampler(
                        interval_s=max(0.1, self.interval_s), history_s=max(1.0, self.history_s)
                    )
                except AutoGPUError as err:
                    self._sampler_error = str(err)
                    self.log.warning("autogpu: sampler unavailable: %s", err)
            return self._sampler

    @property
    def sampler_error(self) -> str | None:
        return self._sampler_error

    def store(self) -> LeaseStore | None:
        """The lease store (read-only use here), or ``None`` when leases are disabled.

        The one factory's answer (:func:`~autogpu_jupyter.core.leasing.store_for`) for the
        server's settings, with this extension's ``registry_dir``: the trusted broker when they
        select one (docs/admin-broker.md; holders and bookings then come from it, other users'
        command lines never leave it), else the shared directory.
        """
        if not self.registry_dir:
            return None
        return store_for(self._autogpu(), registry_dir=self.registry_dir, view=True)

    def registry(self, /) -> LeaseStore | None:
        """Deprecated for one release: the old name of :meth:`store`."""
        import warnings  # noqa: PLC0415

        warnings.warn("AutoGPUServer.registry() is deprecated and will be removed in the next "
                      "release; use AutoGPUServer.store()", DeprecationWarning, stacklevel=2)
        return self.store()

    def _autogpu(self) -> AutoGPU:
        """The server's ``c.AutoGPU`` settings (made once: the config does not change)."""
        with self._lock:
            if self._settings is None:
                try:
                    self._settings = AutoGPU(parent=self.parent)
                except Exception:  # a parent without config: the env defaults
                    self._settings = AutoGPU()
            return self._settings

    def latest(self) -> FleetSnapshot | None:
        """The sampler's latest sweep, if it started (no NVML call, no start, no wait)."""
        sampler = self._sampler
        return sampler.latest() if sampler is not None else None

    def labels(self) -> dict[str, str]:
        """UUID -> label ("GPU 2") from the sampler's latest sweep (no NVML call)."""
        snap = self.latest()
        return {d.uuid: d.label for d in snap.devices} if snap is not None else {}

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on the executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, func, *args)

    async def answer(self, func: Callable[..., T], *args: Any) -> T:
        """``func(self.context(), *args)`` on the executor: a payload function with this
        server's context (made there: making it may start the sampler, which may call NVML)."""
        return await self.run(lambda: func(self.context(), *args))

    def stop(self) -> None:
        self.executor.shutdown(wait=False)


def redact(user: str | None, command: str | None, me: str, expose: bool) -> str | None:
    """``command`` unless it belongs to another user and the admin did not expose commands."""
    return redact_command(user, command, me, expose)


def now_s() -> float:
    return time.time()


def kernel_pid_map(kernel_manager: KernelSource) -> dict[int, str]:
    """PID of each of this server's running kernels -> kernel id (from their provisioners)."""
    pids: dict[int, str] = {}
    for kid in list(kernel_manager.list_kernel_ids()):
        try:
            km = kernel_manager.get_kernel(kid)
        except KeyError:
            continue
        provisioner = getattr(km, "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        if pid is None:  # older jupyter_client: the Popen object
            proc = getattr(provisioner, "process", None) or getattr(km, "kernel", None)
            pid = getattr(proc, "pid", None)
        if isinstance(pid, int):
            pids[pid] = kid
    return pids


def owning_kernel(pid: int, kernel_pids: Mapping[int, str], proc_root: str = "/proc",
                  max_depth: int = 64) -> str | None:
    """The kernel id whose process is ``pid`` or one of its ancestors (``None`` if none is).

    NVML reports host PIDs; inside a container they do not resolve here and map to ``None``.
    """
    seen = 0
    current: int | None = pid
    while current is not None and current > 1 and seen < max_depth:
        if current in kernel_pids:
            return kernel_pids[current]
        current = procfs.ppid(current, proc_root)
        seen += 1
    return None
