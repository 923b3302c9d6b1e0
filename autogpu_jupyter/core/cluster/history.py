"""Each host's GPU load over time, from Prometheus range queries (the sidebar's cluster
history): autogpu's series where a host exports them, else DCGM's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.core.cluster.prometheus import PrometheusClient
from autogpu_jupyter.core.cluster.series import _hostname
from autogpu_jupyter.errors import UsageErrorBase

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
