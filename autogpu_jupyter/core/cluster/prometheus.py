"""The Prometheus client of the cluster view: instant and range queries and the targets' scrape
intervals over Prometheus's HTTP API, stdlib ``urllib`` only, bounded in bytes and series.

Every answer is checked before it is used: a sample whose value is not a finite number is
skipped and kept in :attr:`PrometheusClient.rejected` (the view reports it per host); an answer
that is not Prometheus's JSON, too large or not of the expected type raises
:class:`ClusterError` naming the server and the query.
"""

from __future__ import annotations

import contextlib
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.errors import AutoGPUError, UsageErrorBase

#: Scrape interval assumed where Prometheus's targets API does not say (its own default).
DEFAULT_SCRAPE_INTERVAL_S = 60.0
#: A scrape interval a target reports is clamped to this range (``99...9h`` is not a wait).
MIN_SCRAPE_INTERVAL_S = 0.01
MAX_SCRAPE_INTERVAL_S = 3600.0
#: The most bytes of one Prometheus answer that are read, and series of one query that are
#: used: the view is for a cluster of people's GPU hosts, not for any series a target exports.
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_SERIES = 20000


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
