"""Prometheus metrics of one host: ``autogpu_*`` gauges computed at scrape time.

A :class:`AutoGPUCollector` reads the latest sweep of a sampler and the lease registry's live
leases and tickets; a scrape never calls NVML (``benchmarks/metrics.py`` measures it). The server
extension registers one on ``prometheus_client``'s global ``REGISTRY``, the registry jupyter_server
serves at ``{base_url}/metrics`` (authenticated unless ``ServerApp.authenticate_prometheus =
False``); ``autogpu exporter`` serves one on its own port for hosts without Jupyter.

Series (every device series has the labels ``hostname``, ``uuid``, ``index`` and ``model``, so they
join with DCGM exporter's ``Hostname``/``UUID`` and nvitop-exporter's; ``index`` is the NVML index,
``3:1`` for MIG device 1 of GPU 3):

``autogpu_gpu_available``                 1, or 0 for a lost / unreadable device
``autogpu_gpu_utilization_ratio``         share of the last sample period a kernel ran, 0..1
``autogpu_gpu_memory_used_bytes``         memory in use (NVML)
``autogpu_gpu_memory_total_bytes``        memory of the device
``autogpu_gpu_memory_booked_bytes``       memory booked by live leases, not yet in use
``autogpu_gpu_memory_used_ratio``         (used + booked) / total, 0..1: what a pick counts as taken
``autogpu_gpu_temperature_celsius``       core temperature
``autogpu_gpu_power_watts``               board power draw
``autogpu_gpu_leases``                    live leases holding the device
``autogpu_gpu_waiters``                   live tickets (waiting picks) that may take the device
``autogpu_lease_info``                    1 per (lease, device): ``user`` (+ ``kernel``,
                                          ``notebook`` only when lease details are enabled)
``autogpu_host_info``                     1: ``hostname``, ``backend``, ``simulated``, ``version``,
                                          ``vendor`` (``nvidia`` / ``amd``: one vendor per host)
``autogpu_sample_timestamp_seconds``      Unix time of the sweep the values come from

An unknown value (NOT_SUPPORTED, a lost device) has no sample: absent, never a made-up zero.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from autogpu_jupyter._version import __version__
from autogpu_jupyter.core import bookings_for, is_reservation
from autogpu_jupyter.errors import AutoGPUError

if TYPE_CHECKING:
    from autogpu_jupyter.core import DeviceSnapshot, FleetSnapshot
    from autogpu_jupyter.core.leasing import LeaseRecord, LeaseStore

log = logging.getLogger(__name__)

__all__ = ["AutoGPUCollector", "MetricsSource", "DEVICE_LABELS", "install", "uninstall"]

#: Labels of every per-device series, in order.
DEVICE_LABELS: tuple[str, ...] = ("hostname", "uuid", "index", "model")


@dataclass
class MetricsSource:
    """Where a collector reads from: no call here may touch NVML.

    Parameters
    ----------
    latest
        The sampler's latest sweep (``Sampler.latest``), ``None`` before the first one.
    store
        The lease store (read without lock), or ``None`` when leases are off.
    hostname
        The ``hostname`` label (default: this host's short name, as DCGM exporter's ``Hostname``).
    lease_details
        Add ``kernel`` and ``notebook`` labels to ``autogpu_lease_info`` (off by default: one
        series per notebook path, and paths are other users' business).
    """

    latest: Callable[[], FleetSnapshot | None]
    store: Callable[[], LeaseStore | None]
    hostname: str = ""
    lease_details: bool = False

    def __post_init__(self) -> None:
        if not self.hostname:
            self.hostname = socket.gethostname().split(".")[0]


def _vendor(snap: FleetSnapshot | None) -> str:
    """The host's GPU vendor (``nvidia`` / ``amd``), ``none`` before the first sweep."""
    if snap is None:
        return "none"
    if snap.devices:
        return snap.devices[0].vendor
    return "amd" if snap.backend == "amdsmi" else "nvidia"


def _index(dev: DeviceSnapshot) -> str:
    return f"{dev.index}:{dev.mig_index}" if dev.is_mig else str(dev.index)


class AutoGPUCollector(Collector):
    """A ``prometheus_client`` collector of the ``autogpu_*`` series (see the module docstring).

    The lease registry is read at most once per sampler sweep (cached by the sweep's timestamp),
    so scraping faster than the sampler costs neither NVML calls nor registry scans.
    """

    def __init__(self, source: MetricsSource) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._cache_ts: float | None = None
        self._cache: tuple[list[LeaseRecord], list[LeaseRecord]] = ([], [])

    def describe(self) -> list[Any]:
        # Declared empty so that registering never runs collect() (no sample may exist yet).
        return []

    def _records(self, snap_ts: float) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        with self._lock:
            if self._cache_ts == snap_ts:
                return self._cache
            leases: list[LeaseRecord] = []
            tickets: list[LeaseRecord] = []
            registry = self.source.store()
            if registry is not None:
                try:
                    leases, tickets = registry.live_records()
                    # the admin's reservations a broker shows for ranking are no leases
                    leases = [r for r in leases if not is_reservation(r)]
                except (AutoGPUError, OSError) as err:
                    log.debug("metrics without leases: %s", err)
            self._cache_ts, self._cache = snap_ts, (leases, tickets)
            return self._cache

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.source.latest()
        host = self.source.hostname
        info = GaugeMetricFamily(
            "autogpu_host_info",
            "This exporter's host: backend (nvml / amdsmi / simulated), GPU vendor and autogpu "
            "version.",
            labels=["hostname", "backend", "simulated", "version", "vendor"],
        )
        info.add_metric(
            [host, snap.backend if snap else "none", str(bool(snap and snap.simulated)).lower(),
             __version__, _vendor(snap)],
            1.0,
        )
        yield info
        if snap is None:
            return
        stamp = GaugeMetricFamily(
            "autogpu_sample_timestamp_seconds",
            "Unix time of the sampler sweep these values come from.",
            labels=["hostname"],
        )
        stamp.add_metric([host], snap.timestamp_s)
        yield stamp
        leases, tickets = self._records(snap.timestamp_s)
        yield from self._device_families(snap.devices, leases, tickets)
        yield self._lease_family(snap.devices, leases)

    def _device_families(
        self,
        devices: Sequence[DeviceSnapshot],
        leases: Sequence[LeaseRecord],
        tickets: Sequence[LeaseRecord],
    ) -> Iterator[GaugeMetricFamily]:
        labels = list(DEVICE_LABELS)

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        available = family("autogpu_gpu_available", "1 if the device is readable, 0 if lost.")
        util = family("autogpu_gpu_utilization_ratio",
                      "Share of the last sample period in which a kernel ran (0..1).")
        used = family("autogpu_gpu_memory_used_bytes", "GPU memory in use.")
        total = family("autogpu_gpu_memory_total_bytes", "GPU memory of the device.")
        booked = family("autogpu_gpu_memory_booked_bytes",
                        "GPU memory booked by live autogpu leases and not yet in use.")
        ratio = family("autogpu_gpu_memory_used_ratio",
                       "(Memory used + booked) / total (0..1), what a pick counts as taken.")
        temp = family("autogpu_gpu_temperature_celsius", "GPU core temperature.")
        power = family("autogpu_gpu_power_watts", "Board power draw.")
        nleases = family("autogpu_gpu_leases", "Live autogpu leases holding the device.")
        waiters = family("autogpu_gpu_waiters",
                         "Live autogpu tickets (waiting picks) that may take the device.")
        bookings = bookings_for(devices, leases)
        host = self.source.hostname
        for dev in devices:
            lv = [host, dev.uuid, _index(dev), dev.name]
            available.add_metric(lv, 1.0 if dev.available else 0.0)
            b = bookings[dev.uuid]
            nleases.add_metric(lv, float(b.lease_count))
            waiters.add_metric(lv, float(sum(1 for t in tickets if _ticket_allows(t, dev))))
            if not dev.available:
                continue
            if dev.utilization_pct is not None:
                util.add_metric(lv, dev.utilization_pct / 100.0)
            for fam, value in (
                (used, dev.memory_used_bytes),
                (total, dev.memory_total_bytes),
                (temp, dev.temperature_c),
                (power, dev.power_w),
            ):
                if value is not None:
                    fam.add_metric(lv, float(value))
            booked.add_metric(lv, float(b.booked_bytes))
            if dev.memory_total_bytes and dev.memory_used_bytes is not None:
                share = (dev.memory_used_bytes + b.booked_bytes) / dev.memory_total_bytes
                ratio.add_metric(lv, min(share, 1.0))
        yield from (available, util, used, total, booked, ratio, temp, power, nleases, waiters)

    def _lease_family(
        self, devices: Sequence[DeviceSnapshot], leases: Sequence[LeaseRecord]
    ) -> GaugeMetricFamily:
        details = self.source.lease_details
        names = [*DEVICE_LABELS, "user"] + (["kernel", "notebook"] if details else [])
        fam = GaugeMetricFamily(
            "autogpu_lease_info", "1 per live autogpu lease and device it holds.", labels=names
        )
        by_uuid = {d.uuid: d for d in devices}
        # Two leases of one user on one device are one series with the value 2.
        counts: dict[tuple[str, ...], int] = {}
        for rec in leases:
            for uuid in rec.device_uuids:
                dev = by_uuid.get(uuid)
                lv = [self.source.hostname, uuid, _index(dev) if dev else "",
                      dev.name if dev else "", rec.user]
                if details:
                    lv += [rec.kernel_id or "", rec.notebook_path or ""]
                counts[tuple(lv)] = counts.get(tuple(lv), 0) + 1
        for key, n in counts.items():
            fam.add_metric(list(key), float(n))
        return fam


def _ticket_allows(ticket: LeaseRecord, dev: DeviceSnapshot) -> bool:
    allowed = (ticket.constraints or {}).get("allowed_uuids")
    return allowed is None or dev.uuid in allowed or dev.parent_uuid in allowed


# One collector per process on the global registry (jupyter_server serves that one); a second
# server extension instance in the same process (tests) re-points it instead of registering twice.
_installed: AutoGPUCollector | None = None
_install_lock = threading.Lock()


def install(source: MetricsSource, registry: Any = None) -> AutoGPUCollector:
    """Register (once per process) the collector on ``registry`` (default: the global
    ``prometheus_client.REGISTRY``) reading from ``source``; returns it."""
    global _installed
    target = REGISTRY if registry is None else registry
    with _install_lock:
        if _installed is None:
            _installed = AutoGPUCollector(source)
            target.register(_installed)
        else:
            _installed.source = source
            _installed._cache_ts = None
        return _installed


def uninstall(registry: Any = None) -> None:
    """Unregister the process's collector (no error when none is registered)."""
    global _installed
    target = REGISTRY if registry is None else registry
    with _install_lock:
        if _installed is not None:
            target.unregister(_installed)
            _installed = None
