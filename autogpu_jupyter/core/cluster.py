"""The cluster as a Prometheus server holds it: every host's GPUs, their load, who holds them.

autogpu builds no aggregator (design section 4): each host's ``autogpu_*`` series (from a Jupyter
server's ``/metrics`` or ``autogpu exporter``) and NVIDIA's DCGM exporter series are scraped by
Prometheus, and this module reads them back through Prometheus's HTTP API (stdlib ``urllib``
only, so the CLI and the server extension share it) with a few instant queries:

* ``{__name__=~"autogpu_gpu_.*|autogpu_lease_info"}``;
* the DCGM exporter fields ``DCGM_FI_DEV_GPU_UTIL`` (percent), ``DCGM_FI_DEV_FB_USED`` and
  ``DCGM_FI_DEV_FB_FREE`` (MiB), ``DCGM_FI_DEV_GPU_TEMP``, ``DCGM_FI_DEV_POWER_USAGE`` and, on MIG,
  ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (0..1) where ``DCGM_FI_DEV_GPU_UTIL`` is not supported;
  in the same query, AMD's device metrics exporter's ``gpu_gfx_activity`` (percent),
  ``gpu_used_vram`` and ``gpu_total_vram`` (MB as amd-smi counts them: MiB),
  ``gpu_junction_temperature`` (else ``gpu_edge_temperature``) and ``gpu_package_power`` (else
  ``gpu_power_usage``), labelled ``hostname``, ``gpu_id``, ``gpu_uuid`` (when enabled),
  ``gpu_partition_id``, ``card_series`` / ``card_model``;
* ``timestamp(...)`` of the memory series (when Prometheus last scraped each device), ``up``,
  the last hostname each target reported within :data:`LOOKBACK` (so a host that went down is
  still named), and ``/api/v1/targets`` for each target's scrape interval.

A device is keyed by its UUID (an AMD exporter series without ``gpu_uuid``: by host and
``gpu_id``): where a host exports both, autogpu's series win over the vendor exporter's (they
know the leases). Hosts are grouped by the ``hostname`` label (DCGM: ``Hostname``, renamed
``hostname`` in 2026; both are read), else the target's ``instance``.

Host state: ``down`` when every target of the host has ``up == 0``; ``stale`` when its newest
sample is older than two scrape intervals; else ``ok``. Only ``ok`` hosts are ranked.

:func:`rank_hosts` ranks hosts with the one decision pipeline (:func:`core.decision.decide`:
the local pick's :func:`core.policy.rank` and :func:`core.policy.select`) over
:class:`DeviceSnapshot` built from the series, bookings from
``autogpu_gpu_memory_booked_bytes`` and ``autogpu_gpu_leases``): the best host is the one whose
chosen device(s) have the best policy key, so a local pick on that host chooses the same device
(same data: the exporter's latest sweep).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autogpu_jupyter.core.decision import Context, decide
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot
from autogpu_jupyter.core.policy import Booking, Candidate, Constraints
from autogpu_jupyter.core.visibility import Allocation
from autogpu_jupyter.errors import AutoGPUError, UsageErrorBase

__all__ = [
    "ClusterError",
    "ClusterDevice",
    "ClusterHost",
    "ClusterCache",
    "ClusterView",
    "HostChoice",
    "PrometheusClient",
    "check_url",
    "fetch_cluster",
    "rank_hosts",
    "LOOKBACK",
]

log = logging.getLogger(__name__)

MiB = 1024**2
#: How far back the names of targets that went down are looked up.
LOOKBACK = "1h"
#: Scrape interval assumed where Prometheus's targets API does not say (its own default).
DEFAULT_SCRAPE_INTERVAL_S = 60.0
#: A scrape interval a target reports is clamped to this range (``99...9h`` is not a wait).
MIN_SCRAPE_INTERVAL_S = 0.01
MAX_SCRAPE_INTERVAL_S = 3600.0
#: The most bytes of one Prometheus answer that are read, and series of one query that are
#: used: the view is for a cluster of people's GPU hosts, not for any series a target exports.
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_SERIES = 20000

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


class ClusterError(AutoGPUError):
    """Prometheus cannot be asked (unreachable, an error answer)."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash, if it is an ``http(s)://host[:port][/path]`` URL.

    Raises
    ------
    UsageErrorBase
        Naming the value and the accepted form.
    """
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageErrorBase(
            f"invalid Prometheus URL {url!r}: expected http://HOST:PORT or https://HOST/PATH, "
            "e.g. http://prometheus.example.org:9090"
        )
    return url.strip().rstrip("/")


@dataclass(frozen=True, slots=True)
class Sample:
    """One series of an instant query: its labels and value (``timestamp_s`` = evaluation)."""

    labels: Mapping[str, str]
    value: float
    timestamp_s: float


@dataclass(frozen=True, slots=True)
class Rejected:
    """A sample skipped because its value is not a finite number (``+Inf``, ``NaN``, ``1e400``,
    a malformed ``value``): reported per host, never used."""

    labels: Mapping[str, str]
    why: str

    def text(self) -> str:
        return f"{str(self.labels.get('__name__', '?'))[:60]} {self.why}"


@dataclass(frozen=True, slots=True)
class RangeSeries:
    """One series of a range query: its labels and ``(timestamp_s, value)`` points."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]


class PrometheusClient:
    """Instant queries against Prometheus's HTTP API (``/api/v1/query``), with a timeout.

    Parameters
    ----------
    url
        Base URL of the Prometheus server, e.g. ``http://127.0.0.1:9090``.
    timeout_s
        Per request; a slower answer raises :class:`ClusterError`.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = check_url(url)
        self.timeout_s = timeout_s
        #: Samples skipped by :meth:`query` and :meth:`query_range` (bad values), in order.
        self.rejected: list[Rejected] = []

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        full = f"{self.url}{path}?{urllib.parse.urlencode(params)}"  # every call has parameters
        try:
            with urllib.request.urlopen(full, timeout=self.timeout_s) as resp:  # noqa: S310
                body = resp.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as err:
            detail = err.read(2000).decode(errors="replace")  # UTF-8
            with contextlib.suppress(ValueError, AttributeError):  # not Prometheus's JSON
                detail = str(json.loads(detail).get("error", detail))
            raise ClusterError(
                f"Prometheus at {self.url} answered {err.code} to {path}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ClusterError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        if len(body) > MAX_BODY_BYTES:
            raise ClusterError(
                f"Prometheus at {self.url} answered {path} ({params.get('query', '')[:80]}) with "
                f"more than {MAX_BODY_BYTES // (1024 * 1024)} MiB: the cluster view reads no "
                "more; scrape fewer targets into this Prometheus, or point "
                "c.AutoGPU.prometheus_url at one that holds only the GPU hosts"
            )
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise ClusterError(f"Prometheus at {self.url} answered {path} with non-JSON") from None
        if not isinstance(data, dict) or data.get("status") != "success":
            raise ClusterError(f"Prometheus at {self.url}: {path} failed: {data!r:.300}")
        return data.get("data")

    def query(self, expr: str, at_s: float | None = None) -> list[Sample]:
        """Evaluate ``expr`` at ``at_s`` (default now); vector results only."""
        params = {"query": expr}
        if at_s is not None:
            params["time"] = f"{at_s:.3f}"
        data = self._get("/api/v1/query", params)
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise ClusterError(f"Prometheus: {expr!r} did not give an instant vector")
        out: list[Sample] = []
        for item in self._series(expr, data):
            labels = _labels(item)
            try:
                ts, raw = item["value"]
            except (KeyError, TypeError, ValueError):
                self.rejected.append(Rejected(labels, "has no [time, value] pair"))
                continue
            try:
                value, when = _finite(raw), _finite(ts)
            except (TypeError, ValueError):
                self.rejected.append(Rejected(labels, f"= {_short(raw)}"))
                continue
            out.append(Sample(labels, value, when))
        return out

    def _series(self, expr: str, data: Mapping[str, Any]) -> list[Any]:
        result = data.get("result", [])
        if not isinstance(result, list):
            raise ClusterError(f"Prometheus at {self.url}: {expr!r} gave no result list")
        if len(result) > MAX_SERIES:
            raise ClusterError(
                f"Prometheus at {self.url} answered {len(result)} series to {expr[:80]!r}, more "
                f"than the {MAX_SERIES} the cluster view reads: scrape fewer targets into this "
                "Prometheus, or point c.AutoGPU.prometheus_url at one that holds only the GPU "
                "hosts"
            )
        return [item if isinstance(item, dict) else {} for item in result]

    def query_range(
        self, expr: str, start_s: float, end_s: float, step_s: float
    ) -> list[RangeSeries]:
        """Evaluate ``expr`` every ``step_s`` from ``start_s`` to ``end_s`` (matrix results)."""
        data = self._get("/api/v1/query_range", {
            "query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}",
            "step": f"{step_s:.3f}",
        })
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise ClusterError(f"Prometheus: {expr!r} did not give a range vector")
        out: list[RangeSeries] = []
        for item in self._series(expr, data):
            labels = _labels(item)
            values = item.get("values")
            points = []
            bad = 0
            for pair in values if isinstance(values, list) else [None]:
                try:
                    t, v = pair  # type: ignore[misc]
                    points.append((_finite(t), _finite(v)))
                except (TypeError, ValueError):
                    bad += 1
            if bad:
                self.rejected.append(Rejected(labels, f"has {bad} point(s) that are not finite"))
            out.append(RangeSeries(labels, tuple(points)))
        return out

    def scrape_intervals(self) -> dict[str, float]:
        """``instance`` -> scrape interval in seconds, from ``/api/v1/targets`` (active ones)."""
        data = self._get("/api/v1/targets", {"state": "active"})
        targets = data.get("activeTargets") if isinstance(data, dict) else None
        out: dict[str, float] = {}
        for target in targets if isinstance(targets, list) else []:
            if not isinstance(target, dict):
                continue
            labels = target.get("labels")
            inst = str(labels.get("instance", "") if isinstance(labels, dict) else "")
            # none given: "None", not a duration either
            out[inst] = _clamp_interval(_duration_s(str(target.get("scrapeInterval"))))
        return out


def _clamp_interval(seconds: float | None) -> float:
    """A target's scrape interval, within [MIN_SCRAPE_INTERVAL_S, MAX_SCRAPE_INTERVAL_S]
    (unknown: :data:`DEFAULT_SCRAPE_INTERVAL_S`)."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return DEFAULT_SCRAPE_INTERVAL_S
    return min(max(seconds, MIN_SCRAPE_INTERVAL_S), MAX_SCRAPE_INTERVAL_S)


def _labels(item: Mapping[str, Any]) -> dict[str, str]:
    metric = item.get("metric")
    if not isinstance(metric, dict):
        return {}
    return {str(k): str(v) for k, v in metric.items()}


def _finite(raw: Any) -> float:
    """A sample's value (Prometheus sends numbers as strings): finite, else ``ValueError``."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise TypeError("not a number")
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"non-finite value {str(raw)[:20]}")
    return value


def _short(raw: Any) -> str:
    text = raw if isinstance(raw, str) else json.dumps(raw, default=str)
    return text if len(text) <= 24 else text[:21] + "..."


def _duration_s(text: str) -> float | None:
    """Prometheus's ``1m30s`` / ``500ms`` / ``15s`` durations in seconds (``None``: unknown)."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    total, num = 0.0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            num += ch
            i += 1
            continue
        unit = text[i : i + 2] if text[i : i + 2] == "ms" else ch
        if unit not in units or not num:
            return None
        try:
            total += float(num) * units[unit]
        except ValueError:  # "1.2.3s"
            return None
        num = ""
        i += len(unit)
    return total if text and not num else None


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


@dataclass(frozen=True, slots=True)
class HostChoice:
    """The policy's answer for one host: the device(s) a pick there would choose, if any fit."""

    host: ClusterHost
    chosen: tuple[Candidate, ...]
    candidates: tuple[Candidate, ...]

    @property
    def fits(self) -> bool:
        return bool(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.host.hostname,
            "state": self.host.state,
            "as_of_s": self.host.as_of_s,
            "fits": self.fits,
            "chosen": [c.to_dict() for c in self.chosen],
            "candidates": [c.to_dict() for c in self.candidates],
            "note": self.host.note,
        }


def rank_hosts(view: ClusterView, constraints: Constraints) -> list[HostChoice]:
    """Hosts best first, by the policy a local pick uses (see the module docstring).

    Each ``ok`` host's devices go through :func:`decision.decide` with the bookings Prometheus
    holds; hosts whose selection fits come first, ordered by the policy key of the worst device
    they would give (for one device: its key) less the key's UUID tie-break, then by hostname;
    then hosts where nothing fits, stale and down hosts (never chosen), by hostname.
    """
    fitting: list[HostChoice] = []
    rest: list[HostChoice] = []
    for host in view.hosts:
        if host.state != "ok":
            rest.append(HostChoice(host, (), ()))
            continue
        snaps = tuple(d.snapshot for d in host.devices)
        # The one decision pipeline over what Prometheus holds: no allocation bounds a host
        # seen from outside (its scheduler grants inside it), the bookings are its exporter's.
        context = Context(
            snapshot=FleetSnapshot(snaps, view.timestamp_s, "prometheus"),
            allocation=Allocation(source=None, raw=None, uuids=None),
            bookings={
                d.snapshot.uuid: Booking(d.snapshot.uuid, d.lease_count, d.booked_bytes)
                for d in host.devices
            },
        )
        decision = decide(context, constraints)
        choice = HostChoice(host, decision.chosen, decision.ranked)
        (fitting if choice.fits else rest).append(choice)
    # The worst chosen device's key less its last term (the UUID, a local pick's tie-break
    # between devices), then the hostname: equally loaded hosts go by name.
    fitting.sort(key=lambda c: (max(x.key[:-1] for x in c.chosen), c.host.hostname))
    order = {"ok": 0, "stale": 1, "down": 2}
    rest.sort(key=lambda c: (order.get(c.host.state, len(order)), c.host.hostname))
    return fitting + rest


@dataclass(frozen=True, slots=True)
class CachedView:
    """A view as :class:`ClusterCache` keeps it: its dict (the server's answer) made once, and
    its rankings by constraints, made once each."""

    view: ClusterView
    as_dict: dict[str, Any]
    fetched_at: float
    fresh_s: float
    stale_s: float
    rankings: dict[str, list[HostChoice]] = field(default_factory=dict)

    def ranking(self, constraints: Constraints) -> list[HostChoice]:
        """:func:`rank_hosts` of this view for ``constraints`` (remembered: 16 at most)."""
        key = json.dumps(constraints.to_json(), sort_keys=True)
        ranked = self.rankings.get(key)
        if ranked is None:
            ranked = rank_hosts(self.view, constraints)
            if len(self.rankings) >= 16:
                self.rankings.clear()
            self.rankings[key] = ranked
        return ranked


class ClusterCache:
    """One cluster view shared by every caller in a process (the server's sidebars), asked of
    Prometheus at most once per half scrape interval.

    Prometheus holds nothing newer than each target's last scrape, so a view is *fresh* for
    half the shortest scrape interval of its hosts (clamped to 0.5-30 s): every request in that
    time gets it as is. Up to two intervals (1-120 s; older, the view itself would call its
    hosts stale) it is still served while one background refresh (``submit``) asks Prometheus
    again, so a sidebar that polls every 5 s never waits on Prometheus; older, or without
    ``submit``, the caller waits for a new one. One fetch per Prometheus at a time: callers
    that need one while it runs wait for it and share it. A failed fetch is never kept (the
    next caller asks again, and its error reaches the caller that waited).

    Parameters
    ----------
    submit
        Runs a function in the background (an executor's ``submit``); ``None``: never.
    fetch
        How a view is read (:func:`fetch_cluster` over a :class:`PrometheusClient`).
    clock
        Monotonic seconds.
    """

    MAX_ENTRIES = 8

    def __init__(
        self,
        submit: Callable[[Callable[[], None]], object] | None = None,
        *,
        fetch: Callable[[str, float], ClusterView] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._submit = submit
        self._fetch = fetch or (lambda url, t: fetch_cluster(PrometheusClient(url, t)))
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, float], CachedView] = {}
        self._fetching: dict[tuple[str, float], threading.Lock] = {}
        self._refreshing: set[tuple[str, float]] = set()

    def get(self, url: str, timeout_s: float) -> CachedView:
        """The view of the Prometheus at ``url``: kept, or fetched now (see the class
        docstring). Raises what :func:`fetch_cluster` raises."""
        key = (url, float(timeout_s))
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                age = now - entry.fetched_at
                if age < entry.fresh_s:
                    return entry
                if age < entry.stale_s and self._submit is not None:
                    if key in self._refreshing:
                        return entry
                    self._refreshing.add(key)
                    try:
                        self._submit(lambda: self._refresh(key))
                    except RuntimeError:  # the executor is shutting down: fetch here instead
                        self._refreshing.discard(key)
                    else:
                        return entry
            gate = self._fetching.setdefault(key, threading.Lock())
        with gate:
            with self._lock:  # fetched by another caller while we waited for the gate?
                entry = self._entries.get(key)
                if entry is not None and self._clock() - entry.fetched_at < entry.fresh_s:
                    return entry
            return self._store(key, self._fetch(*key))

    def _refresh(self, key: tuple[str, float]) -> None:
        try:
            with self._lock:
                gate = self._fetching.setdefault(key, threading.Lock())
            with gate:
                self._store(key, self._fetch(*key))
        except Exception as err:  # kept for the next caller to ask again; it then says why
            log.debug("cluster view refresh from %s failed: %s", key[0], err)
        finally:
            with self._lock:
                self._refreshing.discard(key)

    def _store(self, key: tuple[str, float], view: ClusterView) -> CachedView:
        interval = min((h.scrape_interval_s for h in view.hosts),
                       default=DEFAULT_SCRAPE_INTERVAL_S)
        entry = CachedView(
            view=view,
            as_dict=view.to_dict(),
            fetched_at=self._clock(),
            fresh_s=min(max(interval / 2.0, 0.5), 30.0),
            stale_s=min(max(2.0 * interval, 1.0), 120.0),
        )
        with self._lock:
            if key not in self._entries and len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = entry
        return entry


#: Longest history one request may ask for (30 days).
MAX_HISTORY_S = 30 * 86400.0

_HISTORY_QUERIES = (
    # autogpu hosts: mean utilisation and memory taken over the host's GPUs
    ("autogpu", "avg by (hostname) (autogpu_gpu_utilization_ratio)",
     "avg by (hostname) (autogpu_gpu_memory_used_ratio)"),
    # DCGM hosts: GPU_UTIL (percent) or, on MIG, GR_ENGINE_ACTIVE (ratio); FB used / (used + free)
    ("dcgm",
     "avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL / 100 or DCGM_FI_PROF_GR_ENGINE_ACTIVE)",
     "avg by (Hostname) (DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE))"),
)


@dataclass(frozen=True, slots=True)
class HostHistory:
    """A host's mean GPU load over time: utilisation and memory taken in percent (``None``:
    no sample at that step)."""

    hostname: str
    source: str
    timestamps_s: tuple[float, ...]
    utilization_pct: tuple[float | None, ...]
    memory_used_pct: tuple[float | None, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "source": self.source,
            "timestamps_s": list(self.timestamps_s),
            "utilization_pct": list(self.utilization_pct),
            "memory_used_pct": list(self.memory_used_pct),
        }


def check_history_s(value: object) -> float:
    """A history length in seconds from user input (a number of seconds > 0, at most 30 days).

    Raises
    ------
    UsageErrorBase
        Naming the value and the accepted range.
    """
    try:
        seconds = float(str(value))
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_HISTORY_S:
        raise UsageErrorBase(
            f"invalid history length {value!r}: expected seconds, more than 0 and at most "
            f"{MAX_HISTORY_S:.0f} (30 days), e.g. 86400 for a day"
        )
    return seconds


def fetch_history(
    client: PrometheusClient, seconds: float, *, points: int = 120, now_s: float | None = None
) -> tuple[float, list[HostHistory]]:
    """Each host's mean GPU utilisation and memory taken over the last ``seconds``, from
    Prometheus range queries at ``points`` steps (autogpu's series win over DCGM's per host).

    Returns
    -------
    (step_s, histories)
        The step of the series, and one :class:`HostHistory` per host, by hostname.
    """
    end = time.time() if now_s is None else now_s
    # Prometheus answers at start + k * step, to the millisecond: build the same grid
    step = round(max(seconds / max(points, 1), 1.0), 3)
    start = round(end - seconds, 3)
    # in whole milliseconds, as Prometheus counts (126 s // 1.05 s in floats is 119, not 120)
    grid = [start + i * step for i in range(round(seconds * 1000) // round(step * 1000) + 1)]
    found: dict[str, HostHistory] = {}
    for source, util_expr, mem_expr in _HISTORY_QUERIES:
        by_host: dict[str, dict[str, dict[int, float]]] = {}  # host, kind, time in ms
        for kind, expr in (("util", util_expr), ("mem", mem_expr)):
            for series in client.query_range(expr, start, end, step):
                host = _hostname(series.labels)
                by_host.setdefault(host, {}).setdefault(kind, {}).update(
                    {round(t * 1000): v for t, v in series.points}
                )
        for host, kinds in by_host.items():
            if host in found:
                continue  # autogpu's series (asked first) win
            util = kinds.get("util", {})
            mem = kinds.get("mem", {})

            def pct(values: Mapping[int, float], t: float) -> float | None:
                v = values.get(round(t * 1000))
                return None if v is None or not math.isfinite(v) else round(100.0 * v, 6)

            found[host] = HostHistory(
                hostname=host,
                source=source,
                timestamps_s=tuple(grid),
                utilization_pct=tuple(pct(util, t) for t in grid),
                memory_used_pct=tuple(pct(mem, t) for t in grid),
            )
    return step, [found[h] for h in sorted(found)]
