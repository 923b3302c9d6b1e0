"""core.cluster.ClusterCache: one cluster view shared by every sidebar of a server, asked of
Prometheus at most once per half scrape interval (issue 26). A fake fetch and clock; no timing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from autogpu_jupyter.core.cluster import (
    CachedView,
    ClusterCache,
    ClusterHost,
    ClusterView,
    rank_hosts,
)
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import AutoGPUError

URL = "http://prometheus.example:9090"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fetches:
    """A fake fetch_cluster: each call gives a new view (its number in ``timestamp_s``)."""

    def __init__(self, interval_s: float | None = 10.0) -> None:
        self.calls = 0
        self.interval_s = interval_s
        self.fail: Exception | None = None

    def __call__(self, url: str, timeout_s: float) -> ClusterView:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        hosts = () if self.interval_s is None else (
            ClusterHost("a", ("a:9100",), "ok", 0.0, self.interval_s),
            ClusterHost("b", ("b:9100",), "ok", 0.0, self.interval_s * 3),
        )
        return ClusterView(url, float(self.calls), hosts)


class Background:
    """An executor's submit that runs nothing until told."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []

    def __call__(self, fn: Callable[[], None]) -> None:
        self.queued.append(fn)

    def run(self) -> None:
        queued, self.queued = self.queued, []
        for fn in queued:
            fn()


def test_a_view_is_shared_while_fresh_and_each_ranking_is_made_once() -> None:
    clock, fetch = Clock(), Fetches(interval_s=10.0)
    cache = ClusterCache(fetch=fetch, clock=clock)
    first = cache.get(URL, 5.0)
    assert (first.fresh_s, first.stale_s) == (5.0, 20.0)  # the shortest host's interval
    clock.now += 4.9
    assert cache.get(URL, 5.0) is first
    assert fetch.calls == 1
    assert first.as_dict == first.view.to_dict()
    ten = Constraints.parse(min_free="10G")
    assert first.ranking(ten) is first.ranking(Constraints.parse(min_free="10G"))
    assert first.ranking(ten) is not first.ranking(Constraints.parse(min_free="20G"))
    assert cache.get(URL, 1.0) is not first  # another timeout is another client: asked anew
    assert fetch.calls == 2


def test_past_half_an_interval_it_is_served_while_one_refresh_runs_in_the_background() -> None:
    """Up to two scrape intervals old; older, the caller waits for a new view."""
    clock, fetch, background = Clock(), Fetches(interval_s=10.0), Background()
    cache = ClusterCache(background, fetch=fetch, clock=clock)
    first = cache.get(URL, 5.0)
    clock.now += 6.0
    assert cache.get(URL, 5.0) is first
    assert cache.get(URL, 5.0) is first
    assert (fetch.calls, len(background.queued)) == (1, 1)  # one refresh, however many asked
    background.run()
    second = cache.get(URL, 5.0)
    assert second is not first and second.view.timestamp_s == 2.0
    clock.now += 19.9
    assert cache.get(URL, 5.0) is second
    background.queued.clear()
    clock.now += 0.1  # two intervals old: the caller waits for a new view
    third = cache.get(URL, 5.0)
    assert third.view.timestamp_s == 3.0 and background.queued == []


def test_without_a_background_a_view_past_half_an_interval_is_fetched_at_once() -> None:
    clock, fetch = Clock(), Fetches(interval_s=2.0)
    cache = ClusterCache(fetch=fetch, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 1.0
    assert cache.get(URL, 5.0).view.timestamp_s == 2.0


@pytest.mark.parametrize(
    ("interval", "fresh", "stale"),
    [(None, 30.0, 120.0), (0.2, 0.5, 1.0), (600.0, 30.0, 120.0), (15.0, 7.5, 30.0)],
)
def test_how_long_a_view_is_kept_follows_the_scrape_interval_within_bounds(
    interval: float | None, fresh: float, stale: float
) -> None:
    entry = ClusterCache(fetch=Fetches(interval_s=interval), clock=Clock()).get(URL, 5.0)
    assert (entry.fresh_s, entry.stale_s) == (fresh, stale)


def test_a_failed_fetch_is_never_kept() -> None:
    clock, fetch, background = Clock(), Fetches(), Background()
    cache = ClusterCache(background, fetch=fetch, clock=clock)
    fetch.fail = AutoGPUError("Prometheus at x cannot be reached")
    with pytest.raises(AutoGPUError, match="cannot be reached"):
        cache.get(URL, 5.0)
    with pytest.raises(AutoGPUError, match="cannot be reached"):
        cache.get(URL, 5.0)
    assert fetch.calls == 2
    fetch.fail = None
    good = cache.get(URL, 5.0)
    clock.now += 6.0
    fetch.fail = AutoGPUError("down")
    assert cache.get(URL, 5.0) is good
    background.run()  # the refresh failed: the good view stays until a whole interval
    assert cache.get(URL, 5.0) is good
    assert len(background.queued) == 1  # and a later caller may start another refresh
    clock.now += 14.0
    with pytest.raises(AutoGPUError, match="down"):
        cache.get(URL, 5.0)


def test_callers_that_need_a_view_while_one_is_fetched_wait_for_it_and_share_it() -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow(url: str, timeout_s: float) -> ClusterView:
        calls.append(1)
        started.set()
        assert release.wait(30)
        return ClusterView(url, float(len(calls)), ())

    cache = ClusterCache(fetch=slow, clock=Clock())
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get(URL, 5.0)))
               for _ in range(4)]
    threads[0].start()
    assert started.wait(30)
    for t in threads[1:]:
        t.start()
    release.set()
    for t in threads:
        t.join(30)
    assert len(calls) == 1
    assert len(got) == 4 and all(g is got[0] for g in got)


def test_a_background_that_refuses_work_makes_the_caller_fetch() -> None:
    """A server shutting down refuses new work on its executor: the view is then fetched by the
    caller, never left to grow old."""
    clock, fetch = Clock(), Fetches(interval_s=10.0)

    def closed(fn: Callable[[], None]) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    cache = ClusterCache(closed, fetch=fetch, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 6.0
    assert cache.get(URL, 5.0).view.timestamp_s == 2.0


# ---- per-constraints rankings and per-Prometheus entries ----
# Their bounds, the key each gate and refresh is kept under (found by the mutation run of
# issue 22).
def _cached() -> CachedView:
    view = ClusterView(URL, 1.0, ())
    return CachedView(view, view.to_dict(), 0.0, 5.0, 20.0)


def test_rankings_are_remembered_per_constraints_sixteen_at_most() -> None:
    """A view ranks each set of constraints once (the same ranking is answered again, equal
    constraints made anew included), sixteen sets at most: the 17th forgets the 16 before it.
    Caught: the 17th ranking kept, or the bound at 17. (That the key is the constraints' JSON
    with sorted keys is no answer anyone sees: equal constraints write the same JSON.)"""
    cached = _cached()
    wants = [Constraints.parse(count=n) for n in range(1, 18)]
    rankings = [cached.ranking(c) for c in wants[:16]]
    assert all(cached.ranking(c) is r for c, r in zip(wants, rankings, strict=False))
    assert cached.ranking(Constraints.parse(count=1)) is rankings[0]
    assert rankings[0] == rank_hosts(cached.view, wants[0])
    last = cached.ranking(wants[16])  # the 17th: the 16 before it are forgotten
    assert cached.ranking(wants[16]) is last
    assert all(cached.ranking(c) is not r for c, r in zip(wants[1:], rankings[1:], strict=False))
    assert cached.ranking(wants[0]) is not rankings[0]


def test_views_of_several_prometheus_are_kept_side_by_side_eight_at_most() -> None:
    """Caught: a new key clearing the others at once; the bound at 9 (``>``), or only a key
    already kept clearing them (a view fetched anew in place then forgot the other 7, and a
    9th grew the cache past 8)."""
    clock, asked = Clock(), []

    def fetch(url: str, timeout_s: float) -> ClusterView:
        asked.append(timeout_s)
        interval = 2.0 if timeout_s == 8.0 else 10.0  # the 8th is fresh for 1 s, the rest 5 s
        return ClusterView(url, float(len(asked)),
                           (ClusterHost("a", ("a:9100",), "ok", 0.0, interval),))

    cache = ClusterCache(fetch=fetch, clock=clock)
    first = [cache.get(URL, float(t)) for t in range(1, 9)]
    assert all(cache.get(URL, float(t)) is v for t, v in zip(range(1, 9), first, strict=True))
    clock.now += 1.5
    eighth = cache.get(URL, 8.0)  # fetched anew, in place: the other 7 stay
    assert eighth is not first[7]
    assert all(cache.get(URL, float(t)) is v for t, v in zip(range(1, 8), first[:7], strict=True))
    ninth = cache.get(URL, 9.0)  # a 9th: the 8 kept are forgotten
    assert cache.get(URL, 9.0) is ninth
    assert cache.get(URL, 1.0) is not first[0]
    assert asked == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 8.0, 9.0, 1.0]


def test_a_refused_background_refresh_lets_the_next_caller_start_one() -> None:
    """Caught: the key left marked as refreshing when the executor refused the work (every
    later caller then got the old view and no refresh was ever started again)."""
    clock, fetch, queue = Clock(), Fetches(interval_s=10.0), Background()
    refuse = iter([True])  # refuse once, then queue

    def submit(fn: Callable[[], None]) -> None:
        if next(refuse, False):
            raise RuntimeError("cannot schedule new futures after shutdown")
        queue(fn)

    cache = ClusterCache(submit, fetch=fetch, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 6.0
    second = cache.get(URL, 5.0)  # refused: fetched here
    assert (second.view.timestamp_s, fetch.calls) == (2.0, 2)
    clock.now += 6.0
    assert cache.get(URL, 5.0) is second
    assert len(queue.queued) == 1  # this time in the background
    queue.run()
    assert cache.get(URL, 5.0).view.timestamp_s == 3.0


def test_fetches_from_two_prometheus_do_not_wait_for_each_other() -> None:
    """Caught: every fetch under one gate (kept under ``None``, not under its own key)."""
    slow_url = "http://slow.example:9090"
    started, release = threading.Event(), threading.Event()

    def fetch(url: str, timeout_s: float) -> ClusterView:
        if url == slow_url:
            started.set()
            assert release.wait(30)
        return ClusterView(url, 1.0, ())

    cache = ClusterCache(fetch=fetch, clock=Clock())
    got: list[CachedView] = []
    done = threading.Event()

    def other() -> None:
        got.append(cache.get(URL, 5.0))
        done.set()

    slow = threading.Thread(target=cache.get, args=(slow_url, 5.0), daemon=True)
    slow.start()
    try:
        assert started.wait(30)
        fast = threading.Thread(target=other, daemon=True)
        fast.start()
        assert done.wait(5), "a fetch from another Prometheus waited for the slow one"
        assert got[0].view.prometheus_url == URL
    finally:
        release.set()
        slow.join(30)


# ---- the background refresh (found by the mutation run of issue 22) ----
def test_a_failed_background_refresh_is_logged_with_its_url_and_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Caught: the record's format or either argument lost, reworded or the key's timeout
    named instead of its URL."""
    clock, fetch, background = Clock(), Fetches(interval_s=10.0), Background()
    cache = ClusterCache(background, fetch=fetch, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 6.0
    fetch.fail = RuntimeError("connection refused")
    cache.get(URL, 5.0)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.core.cluster")
    background.run()
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("autogpu_jupyter.core.cluster", logging.DEBUG,
         f"cluster view refresh from {URL} failed: connection refused"),
    ]


def test_a_refresh_fetches_under_the_gate_of_its_own_key() -> None:
    """A caller that needs the same view waits on that gate (and shares the result). Caught:
    the gate kept under ``None``.

    A reasoned private seam: the gate (``_fetching``) is looked at while the fetch runs; what
    it does, make a second caller wait, shows only as a race between threads."""
    clock, fetch, background = Clock(), Fetches(interval_s=10.0), Background()
    key = (URL, 5.0)
    held: list[bool] = []

    def watched(url: str, timeout_s: float) -> Any:
        held.append(cache._fetching[key].locked())
        return fetch(url, timeout_s)

    cache = ClusterCache(background, fetch=watched, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 6.0
    cache.get(URL, 5.0)
    background.run()
    assert held == [True, True]
    assert set(cache._fetching) == {key}


def test_a_refresh_of_a_key_never_fetched_before_stores_its_view() -> None:
    """Caught: the gate made ``None`` (no lock: the refresh failed, nothing stored).

    A reasoned private seam: a background refresh (``_refresh``) of a key no caller fetched
    first is what a refresh racing the cache's bound meets; no public call starts one."""
    clock, fetch = Clock(), Fetches(interval_s=10.0)
    cache = ClusterCache(fetch=fetch, clock=clock)
    cache._refresh((URL, 5.0))
    assert fetch.calls == 1
    assert cache.get(URL, 5.0).view.timestamp_s == 1.0  # the refreshed one, not fetched again
    assert fetch.calls == 1
