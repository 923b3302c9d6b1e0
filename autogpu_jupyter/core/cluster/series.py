"""Series folding: the answers of the cluster view's instant queries, folded into one
:class:`ClusterView` (each host's devices, their load and holders, the host's state).

The queries, the keying of devices and the host states are described in the package docstring
(:mod:`autogpu_jupyter.core.cluster`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autogpu_jupyter.core.cluster.prometheus import (
    DEFAULT_SCRAPE_INTERVAL_S,
    ClusterError,
    PrometheusClient,
    Rejected,
    Sample,
)
from autogpu_jupyter.core.devices import DeviceSnapshot

MiB = 1024**2
#: How far back the names of targets that went down are looked up.
LOOKBACK = "1h"

_AUTOGPU_QUERY = '{__name__=~"autogpu_gpu_.*|autogpu_lease_info"}'
_DCGM_FIELDS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
)
#: AMD's device metrics exporter (ROCm/device-metrics-exporter), asked with DCGM's fields.
_AMD_FIELDS = (
    "gpu_gfx_activity",
    "gpu_used_vram",
    "gpu_total_vram",
    "gpu_junction_temperature",
    "gpu_edge_temperature",
    "gpu_package_power",
    "gpu_power_usage",
)
_DCGM_QUERY = '{__name__=~"' + "|".join(_DCGM_FIELDS + _AMD_FIELDS) + '"}'
_SCRAPED_QUERY = 'timestamp({__name__=~"autogpu_host_info|DCGM_FI_DEV_FB_USED|gpu_used_vram"})'
#: The host of every target seen within LOOKBACK (also those down now) and, for autogpu's, the
#: time of its last sweep.
_NAMES_QUERIES = (
    f"max by (instance, hostname) (last_over_time(autogpu_sample_timestamp_seconds[{LOOKBACK}]))",
    "max by (instance, hostname, Hostname) "
    f'(last_over_time({{__name__=~"DCGM_FI_DEV_FB_USED|gpu_used_vram"}}[{LOOKBACK}]))',
)


@dataclass(frozen=True, slots=True)
class ClusterDevice:
    """One GPU of a host as Prometheus last saw it; ``source`` is ``autogpu``, ``dcgm`` or ``amd``
    (AMD's device metrics exporter)."""

    snapshot: DeviceSnapshot
    source: str
    booked_bytes: int = 0
    lease_count: int = 0
    waiters: int = 0
    holders: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = self.snapshot
        return {
            "uuid": d.uuid,
            "index": d.index,
            "mig_index": d.mig_index,
            "label": d.label,
            "name": d.name,
            "available": d.available,
            "source": self.source,
            "utilization_pct": d.utilization_pct,
            "memory_used_bytes": d.memory_used_bytes,
            "memory_total_bytes": d.memory_total_bytes,
            "memory_free_bytes": d.memory_free_bytes,
            "memory_booked_bytes": self.booked_bytes,
            "temperature_c": d.temperature_c,
            "power_w": d.power_w,
            "lease_count": self.lease_count,
            "waiters": self.waiters,
            "holders": list(self.holders),
        }


@dataclass(frozen=True, slots=True)
class ClusterHost:
    """One host: ``state`` is ``ok``, ``stale`` or ``down``; ``as_of_s`` its newest sample."""

    hostname: str
    instances: tuple[str, ...]
    state: str
    as_of_s: float | None
    scrape_interval_s: float
    devices: tuple[ClusterDevice, ...] = ()
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "instances": list(self.instances),
            "state": self.state,
            "as_of_s": self.as_of_s,
            "scrape_interval_s": self.scrape_interval_s,
            "note": self.note,
            "devices": [d.to_dict() for d in self.devices],
        }


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Every host Prometheus knows, at ``timestamp_s`` (the evaluation time of the queries)."""

    prometheus_url: str
    timestamp_s: float
    hosts: tuple[ClusterHost, ...]
    errors: tuple[str, ...] = field(default=())

    def host(self, hostname: str) -> ClusterHost | None:
        for h in self.hosts:
            if h.hostname == hostname:
                return h
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prometheus_url": self.prometheus_url,
            "timestamp_s": self.timestamp_s,
            "hosts": [h.to_dict() for h in self.hosts],
            "errors": list(self.errors),
        }


def _hostname(labels: Mapping[str, str]) -> str:
    for key in ("hostname", "Hostname"):
        if labels.get(key):
            return labels[key]
    inst = labels.get("instance")
    return inst.rsplit(":", 1)[0] if inst else "unknown"


def _int_label(value: str | None) -> int | None:
    if value is None or not value.isascii() or not value.isdecimal():
        return None
    return int(value)


@dataclass
class _Acc:
    """Series of one device being folded together."""

    host: str
    instance: str | None
    uuid: str
    index_label: str
    model: str
    source: str
    values: dict[str, float] = field(default_factory=dict)
    holders: list[str] = field(default_factory=list)


def _fold_autogpu(samples: Iterable[Sample], acc: dict[str, _Acc]) -> None:
    for s in samples:
        name = s.labels.get("__name__", "")  # the query selects by name: one has none if forged
        host = _hostname(s.labels)
        uuid = s.labels.get("uuid")
        if not uuid:
            continue
        dev = acc.setdefault(uuid, _Acc(host, s.labels.get("instance"), uuid,
                                        s.labels.get("index", ""), s.labels.get("model", ""),
                                        "autogpu"))
        if name == "autogpu_lease_info":
            who = s.labels.get("user", "?")
            where = s.labels.get("notebook") or ""
            dev.holders.append(f"{who}: {where}" if where else who)
        else:
            dev.values[name.removeprefix("autogpu_gpu_")] = s.value


def _fold_amd(s: Sample, acc: dict[str, _Acc]) -> None:
    """One AMD device metrics exporter sample: keyed by ``gpu_uuid``, else host and ``gpu_id``."""
    host = _hostname(s.labels)
    gpu = s.labels.get("gpu_id", "")
    key = s.labels.get("gpu_uuid") or f"{host}/gpu-{gpu}"
    model = s.labels.get("card_series") or s.labels.get("card_model", "")
    dev = acc.setdefault(key, _Acc(host, s.labels.get("instance"), key, gpu, model, "amd"))
    dev.values[s.labels["__name__"]] = s.value


def _fold_dcgm(samples: Iterable[Sample], acc: dict[str, _Acc]) -> None:
    for s in samples:
        if s.labels.get("__name__", "").startswith("gpu_"):
            _fold_amd(s, acc)
            continue
        uuid = s.labels.get("UUID")
        if not uuid:
            continue
        gi = s.labels.get("GPU_I_ID")
        key = f"{uuid}/{gi}" if gi else uuid
        gpu = s.labels.get("gpu", "")
        # a GPU autogpu exports keeps autogpu's entry (folded first); its snapshot reads only
        # autogpu's values, so DCGM's added here go unread
        dev = acc.setdefault(key, _Acc(_hostname(s.labels), s.labels.get("instance"), key,
                                       f"{gpu}:{gi}" if gi else gpu,
                                       s.labels.get("modelName", ""), "dcgm"))
        dev.values[s.labels.get("__name__", "")] = s.value


def _snapshot(dev: _Acc, now_s: float) -> ClusterDevice:
    v = dev.values
    gpu_s, _, mig_s = dev.index_label.partition(":")
    index = _int_label(gpu_s)
    mig_index = _int_label(mig_s)  # None without a MIG part ("")
    if dev.source == "autogpu":
        total = v.get("memory_total_bytes")
        used = v.get("memory_used_bytes")
        util = v.get("utilization_ratio")
        snap = DeviceSnapshot(
            index=-1 if index is None else index,
            uuid=dev.uuid,
            name=dev.model,
            memory_total_bytes=None if total is None else int(total),
            memory_used_bytes=None if used is None else int(used),
            memory_free_bytes=None if total is None or used is None else max(int(total - used), 0),
            utilization_pct=None if util is None else round(util * 100.0, 6),
            temperature_c=v.get("temperature_celsius"),
            power_w=v.get("power_watts"),
            is_mig=mig_index is not None,
            mig_index=mig_index,
            available=v.get("available", 1.0) == 1.0,
            error=None if v.get("available", 1.0) == 1.0 else "lost (exporter says unavailable)",
            timestamp_s=now_s,
        )
        return ClusterDevice(
            snap, dev.source,
            booked_bytes=int(v.get("memory_booked_bytes", 0.0)),
            lease_count=int(v.get("leases", 0.0)),
            waiters=int(v.get("waiters", 0.0)),
            holders=tuple(sorted(dev.holders)),
        )
    if dev.source == "amd":
        return _amd_snapshot(dev, index, now_s)
    used_mib = v.get("DCGM_FI_DEV_FB_USED")
    free_mib = v.get("DCGM_FI_DEV_FB_FREE")
    util_pct = v.get("DCGM_FI_DEV_GPU_UTIL")
    if util_pct is None and "DCGM_FI_PROF_GR_ENGINE_ACTIVE" in v:
        util_pct = v["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] * 100.0
    used_b = None if used_mib is None else int(used_mib * MiB)
    free_b = None if free_mib is None else int(free_mib * MiB)
    total_b = None if used_b is None or free_b is None else used_b + free_b
    # the GPU_I_ID after the last "/" (decimal, else no MIG index): a UUID label may hold one
    parent = dev.uuid.rpartition("/")[0] if mig_index is not None else None
    snap = DeviceSnapshot(
        index=-1 if index is None else index,
        uuid=dev.uuid,
        name=dev.model,
        memory_total_bytes=total_b,
        memory_used_bytes=used_b,
        memory_free_bytes=free_b,
        utilization_pct=None if util_pct is None else float(util_pct),
        temperature_c=v.get("DCGM_FI_DEV_GPU_TEMP"),
        power_w=v.get("DCGM_FI_DEV_POWER_USAGE"),
        is_mig=mig_index is not None,
        parent_uuid=parent,
        mig_index=mig_index,
        timestamp_s=now_s,
    )
    return ClusterDevice(snap, dev.source)


def _amd_snapshot(dev: _Acc, index: int | None, now_s: float) -> ClusterDevice:
    v = dev.values
    used_mib = v.get("gpu_used_vram")
    total_mib = v.get("gpu_total_vram")
    used_b = None if used_mib is None else int(used_mib * MiB)
    total_b = None if total_mib is None else int(total_mib * MiB)
    temp = v.get("gpu_junction_temperature", v.get("gpu_edge_temperature"))
    power = v.get("gpu_package_power", v.get("gpu_power_usage"))
    util = v.get("gpu_gfx_activity")
    snap = DeviceSnapshot(
        index=-1 if index is None else index,
        uuid=dev.uuid,
        name=dev.model,
        memory_total_bytes=total_b,
        memory_used_bytes=used_b,
        memory_free_bytes=None if used_b is None or total_b is None else max(total_b - used_b, 0),
        utilization_pct=None if util is None else float(util),
        temperature_c=temp,
        power_w=power,
        vendor="amd",
        timestamp_s=now_s,
    )
    return ClusterDevice(snap, dev.source)


def fetch_cluster(client: PrometheusClient, *, now_s: float | None = None) -> ClusterView:
    """Ask Prometheus for every host's GPUs (see the module docstring for the queries).

    Raises
    ------
    ClusterError
        Prometheus cannot be reached or answers an error.
    """
    at = time.time() if now_s is None else now_s
    auto = client.query(_AUTOGPU_QUERY, at)
    dcgm = client.query(_DCGM_QUERY, at)
    scraped = client.query(_SCRAPED_QUERY, at)
    up = client.query("up", at)
    last_sweep = client.query(_NAMES_QUERIES[0], at)
    names = last_sweep + client.query(_NAMES_QUERIES[1], at)
    errors: list[str] = []
    try:
        intervals = client.scrape_intervals()
    except ClusterError as err:
        intervals = {}
        errors.append(f"scrape intervals unknown ({err}); assuming "
                      f"{DEFAULT_SCRAPE_INTERVAL_S:g} s")

    acc: dict[str, _Acc] = {}
    _fold_autogpu(auto, acc)
    _fold_dcgm(dcgm, acc)

    # instance -> hostname, for every target (also those whose series went stale)
    host_of: dict[str, str] = {}
    for s in names:
        if s.labels.get("instance"):
            host_of[s.labels["instance"]] = _hostname(s.labels)
    for dev in acc.values():
        if dev.instance:
            host_of.setdefault(dev.instance, dev.host)
    newest: dict[str, float] = {}
    for s in scraped:
        host = host_of.get(s.labels.get("instance", ""), _hostname(s.labels))
        newest[host] = max(s.value, newest.get(host, s.value))

    instances = _instances_by_host(up, host_of, acc)

    by_host: dict[str, list[ClusterDevice]] = {}
    for dev in acc.values():
        by_host.setdefault(dev.host, []).append(_snapshot(dev, at))

    skipped = _skipped_by_host(client.rejected, host_of)
    for host, texts in sorted(skipped.items()):
        errors.append(f"{host}: {len(texts)} sample(s) skipped, not finite numbers "
                      f"(e.g. {texts[0]})")
    hosts: list[ClusterHost] = []
    for host in sorted(instances):
        targets = instances[host]
        interval = max(
            (intervals.get(i, DEFAULT_SCRAPE_INTERVAL_S) for i, _ in targets),
            default=DEFAULT_SCRAPE_INTERVAL_S,
        )
        as_of = newest.get(host)
        devices = sorted(
            by_host.get(host, []),
            key=lambda d: (d.snapshot.index, d.snapshot.mig_index or -1, d.snapshot.uuid),
        )
        state, note, as_of = _host_state(host, targets, as_of, at, interval, last_sweep)
        if host in skipped:
            bad = f"{len(skipped[host])} sample(s) skipped (not finite numbers)"
            note = f"{note}; {bad}" if note else bad
        hosts.append(ClusterHost(
            hostname=host,
            instances=tuple(sorted(i for i, _ in targets)),
            state=state,
            as_of_s=as_of,
            scrape_interval_s=interval,
            devices=tuple(devices) if state != "down" else (),
            note=note,
        ))
    return ClusterView(client.url, at, tuple(hosts), tuple(errors))


def _skipped_by_host(
    rejected: Sequence[Rejected], host_of: Mapping[str, str]
) -> dict[str, list[str]]:
    """The skipped samples' texts by host (a host is named as for its good samples)."""
    out: dict[str, list[str]] = {}
    for r in rejected:
        host = host_of.get(r.labels.get("instance", ""), _hostname(r.labels))
        out.setdefault(host, []).append(r.text())
    return out


def _instances_by_host(
    up: Sequence[Sample], host_of: Mapping[str, str], acc: Mapping[str, _Acc]
) -> dict[str, list[tuple[str, bool]]]:
    """Each host's scrape targets and whether they are up (targets with GPU series only)."""
    instances: dict[str, list[tuple[str, bool]]] = {}
    for s in up:
        inst = s.labels.get("instance", "")
        known = host_of.get(inst)
        if known is None:
            continue  # a target that never exported GPU series (Prometheus itself, ...)
        instances.setdefault(known, []).append((inst, s.value == 1.0))
    for dev in acc.values():
        instances.setdefault(dev.host, [])
    return instances


def _host_state(
    host: str,
    targets: Sequence[tuple[str, bool]],
    as_of: float | None,
    at: float,
    interval: float,
    last_sweep: Sequence[Sample],
) -> tuple[str, str | None, float | None]:
    """``ok``, ``stale`` (newest sample older than two scrape intervals) or ``down``
    (``up == 0``), with a note and the "as of" time."""
    if targets and not any(ok for _, ok in targets):
        newest = max((s.value for s in last_sweep if _hostname(s.labels) == host), default=as_of)
        return "down", "exporter down (up == 0)", newest
    if as_of is None:
        return "stale", "no samples", None
    if at - as_of > 2 * interval:
        return "stale", f"newest sample {at - as_of:.0f} s old (> 2 scrape intervals)", as_of
    return "ok", None, as_of
