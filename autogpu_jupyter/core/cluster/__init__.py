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

The package's rooms, lowest first (each imports only those above it in this list):

* :mod:`~autogpu_jupyter.core.cluster.prometheus`: the HTTP client (:class:`PrometheusClient`),
  bounded answers, bad samples set aside;
* :mod:`~autogpu_jupyter.core.cluster.series`: the queries' answers folded into a
  :class:`ClusterView` (:func:`fetch_cluster`);
* :mod:`~autogpu_jupyter.core.cluster.ranking`: :func:`rank_hosts`;
* :mod:`~autogpu_jupyter.core.cluster.cache`: :class:`ClusterCache`, the view shared by a
  process;
* :mod:`~autogpu_jupyter.core.cluster.history`: :func:`fetch_history`, each host's load over time.

Every public name is importable from the package as before the cut.
"""

from __future__ import annotations

from autogpu_jupyter.core.cluster.cache import CachedView, ClusterCache
from autogpu_jupyter.core.cluster.history import (
    MAX_HISTORY_S,
    HostHistory,
    check_history_s,
    fetch_history,
)
from autogpu_jupyter.core.cluster.prometheus import (
    DEFAULT_SCRAPE_INTERVAL_S,
    MAX_BODY_BYTES,
    MAX_SCRAPE_INTERVAL_S,
    MAX_SERIES,
    MIN_SCRAPE_INTERVAL_S,
    ClusterError,
    PrometheusClient,
    RangeSeries,
    Rejected,
    Sample,
    check_url,
)
from autogpu_jupyter.core.cluster.ranking import HostChoice, rank_hosts
from autogpu_jupyter.core.cluster.series import (
    LOOKBACK,
    ClusterDevice,
    ClusterHost,
    ClusterView,
    MiB,
    fetch_cluster,
)

__all__ = [
    "ClusterError",
    "ClusterDevice",
    "ClusterHost",
    "ClusterCache",
    "ClusterView",
    "CachedView",
    "HostChoice",
    "HostHistory",
    "PrometheusClient",
    "RangeSeries",
    "Rejected",
    "Sample",
    "check_history_s",
    "check_url",
    "fetch_cluster",
    "fetch_history",
    "rank_hosts",
    "DEFAULT_SCRAPE_INTERVAL_S",
    "LOOKBACK",
    "MAX_BODY_BYTES",
    "MAX_HISTORY_S",
    "MAX_SCRAPE_INTERVAL_S",
    "MAX_SERIES",
    "MIN_SCRAPE_INTERVAL_S",
    "MiB",
]
