"""The cluster view shared by every caller of a process: :class:`ClusterCache` asks Prometheus
at most once per half scrape interval and refreshes in the background, and :class:`CachedView`
keeps a view's dict and its rankings, made once each.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autogpu_jupyter.core.cluster.prometheus import DEFAULT_SCRAPE_INTERVAL_S, PrometheusClient
from autogpu_jupyter.core.cluster.ranking import HostChoice, rank_hosts
from autogpu_jupyter.core.cluster.series import ClusterView, fetch_cluster
from autogpu_jupyter.core.policy import Constraints

# The package's name, as before the cut: a logging set-up that names it keeps working.
log = logging.getLogger("autogpu_jupyter.core.cluster")


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
