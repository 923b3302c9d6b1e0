"""Survivors of the full mutation run (issue 22) in core.cluster and core.cudastate.hip_state:
how a rejected sample's value and name are shortened, the range query's bad points, the cache's
per-constraints rankings and per-Prometheus entries (their bounds, the key each gate and refresh
is kept under), and every verdict of the HIP too-late check with a framework imported. All in
process: Prometheus's answers are handed to the client's ``_get``, the cache gets a fake fetch
and clock."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import cudastate
from autogpu_jupyter.core.cluster import (
    CachedView,
    ClusterCache,
    ClusterError,
    ClusterHost,
    ClusterView,
    PrometheusClient,
    RangeSeries,
    Rejected,
    _short,
    rank_hosts,
)
from autogpu_jupyter.core.cudastate import CudaState, hip_state
from autogpu_jupyter.core.policy import Constraints
from tests.unit.test_cluster_cache import URL, Background, Clock, Fetches
from tests.unit.test_hip_state import HIP, fds, maps

# ---- core.cluster: _short and Rejected.text ------------------------------------------------


@pytest.mark.parametrize(("raw", "text"), [
    ("a" * 24, "a" * 24),  # 24 characters are kept whole
    ("0123456789" * 2 + "abcde", "0123456789" * 2 + "a..."),  # 25: 21 and "..."
    ("0123456789" * 5, "0123456789" * 2 + "0..."),
    ([1, "x"], '[1, "x"]'),  # not a string: its JSON
    (complex(1, 2), '"(1+2j)"'),  # not JSON: its str, as a JSON string
    ({"v": list(range(20))}, '{"v": [0, 1, 2, 3, 4,...'),
])
def test_a_rejected_value_is_shown_as_json_in_24_characters_at_most(raw: Any, text: str) -> None:
    """Caught: the bound moved (< 24, <= 25), the cut at 22, "..." reworded or subtracted, the
    JSON of None or of nothing, no ``default=str``, the raw value kept as is."""
    assert _short(raw) == text


def test_a_rejected_sample_of_an_instant_query_names_its_short_value() -> None:
    client = PrometheusClient("http://prometheus.example:9090")
    long = "not a number, " * 3
    client._get = lambda path, params: {  # type: ignore[method-assign]
        "resultType": "vector", "result": [
            {"metric": {"__name__": "m"}, "value": [1.0, long]},
            {"metric": {"__name__": "n"}, "value": [1.0, [1, "x"]]},
        ]}
    assert client.query("m") == []
    assert [r.text() for r in client.rejected] == [f"m = {long[:21]}...", 'n = [1, "x"]']


def test_a_rejected_series_name_is_cut_at_60_characters() -> None:
    name = "".join(chr(ord("a") + i % 26) for i in range(70))
    assert Rejected({"__name__": name}, "= NaN").text() == f"{name[:60]} = NaN"
    assert Rejected({}, "= NaN").text() == "? = NaN"


# ---- core.cluster: PrometheusClient.query_range --------------------------------------------


def _ranged(data: object) -> tuple[PrometheusClient, list[tuple[str, dict[str, str]]]]:
    client = PrometheusClient("http://prometheus.example:9090")
    asked: list[tuple[str, dict[str, str]]] = []

    def get(path: str, params: dict[str, str]) -> object:
        asked.append((path, dict(params)))
        return data

    client._get = get  # type: ignore[method-assign,assignment]
    return client, asked


def test_range_points_that_are_not_finite_are_counted_per_series() -> None:
    """Caught: the count set to 1 rather than added to; a series without a ``values`` list
    walked over anyway (it is one bad point)."""
    client, asked = _ranged({"resultType": "matrix", "result": [
        {"metric": {"__name__": "u", "hostname": "a"},
         "values": [[0, "1"], [15, "NaN"], [30, "x"], [45, "+Inf"], [60, "0.5"]]},
        {"metric": {"__name__": "v"}},
        {"metric": {"__name__": "w"}, "values": "12"},
        {"metric": {"__name__": "z"}, "values": [[0, "2"]]},
    ]})
    assert client.query_range("u", 0.0, 60.0, 15.0) == [
        RangeSeries({"__name__": "u", "hostname": "a"}, ((0.0, 1.0), (60.0, 0.5))),
        RangeSeries({"__name__": "v"}, ()),
        RangeSeries({"__name__": "w"}, ()),
        RangeSeries({"__name__": "z"}, ((0.0, 2.0),)),
    ]
    assert [r.text() for r in client.rejected] == [
        "u has 3 point(s) that are not finite",
        "v has 1 point(s) that are not finite",
        "w has 1 point(s) that are not finite",
    ]
    assert asked == [("/api/v1/query_range",
                      {"query": "u", "start": "0.000", "end": "60.000", "step": "15.000"})]


def test_a_range_answer_without_a_result_list_names_the_query() -> None:
    """Caught: the query not handed on to the series check (the message said ``None``)."""
    client, _ = _ranged({"resultType": "matrix", "result": "nope"})
    with pytest.raises(ClusterError) as err:
        client.query_range("up", 0.0, 60.0, 15.0)
    assert str(err.value) == (
        "Prometheus at http://prometheus.example:9090: 'up' gave no result list")


# ---- core.cluster: CachedView.ranking ------------------------------------------------------


def _cached() -> CachedView:
    view = ClusterView(URL, 1.0, ())
    return CachedView(view, view.to_dict(), 0.0, 5.0, 20.0)


def test_rankings_are_remembered_under_their_sorted_json_sixteen_at_most() -> None:
    """Caught: the key not sorted (``sort_keys`` False, None or left out); the 17th ranking
    kept, or the bound at 17."""
    cached = _cached()
    wants = [Constraints.parse(count=n) for n in range(1, 18)]
    rankings = [cached.ranking(c) for c in wants[:16]]
    assert list(cached.rankings) == [json.dumps(c.to_json(), sort_keys=True) for c in wants[:16]]
    assert next(iter(cached.rankings)) == (
        '{"count": 1, "devices": [], "exclude": [], "exclusive": false, "max_util_pct": null, '
        '"min_free": null, "models": [], "prefer": []}')
    assert all(cached.ranking(c) is r for c, r in zip(wants, rankings, strict=False))
    assert rankings[0] == rank_hosts(cached.view, wants[0])
    last = cached.ranking(wants[16])  # the 17th: the 16 before it are forgotten
    assert list(cached.rankings.values()) == [last]
    assert cached.ranking(wants[0]) is not rankings[0]
    assert len(cached.rankings) == 2


# ---- core.cluster: ClusterCache.get and _store ---------------------------------------------


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


# ---- core.cudastate: hip_state -------------------------------------------------------------

HINT = "torch.cuda.is_initialized() is True"


@pytest.fixture
def torch_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudastate, "_framework_hint", lambda: ("torch", HINT))


def test_an_open_kfd_names_the_framework_and_its_hint(torch_hint: None, tmp_path: Path) -> None:
    assert hip_state(maps(tmp_path), fds(tmp_path, "/dev/kfd")) == CudaState(
        True, f"this process holds /dev/kfd open: the ROCr runtime has initialised ({HINT})",
        "torch")


def test_an_unreadable_map_names_the_framework(torch_hint: None, tmp_path: Path) -> None:
    absent = str(tmp_path / "no-maps")
    assert hip_state(absent, fds(tmp_path)) == CudaState(
        False, f"cannot read {absent} (not Linux?): no sign of HIP", "torch")


def test_nothing_mapped_names_the_framework(torch_hint: None, tmp_path: Path) -> None:
    assert hip_state(maps(tmp_path, "/usr/lib/libc.so.6"), fds(tmp_path)) == CudaState(
        False, "no HIP or ROCr runtime mapped in this process: nothing has initialised HIP",
        "torch")


def test_hip_without_rocr_names_the_framework_and_its_hint(
    torch_hint: None, tmp_path: Path
) -> None:
    assert hip_state(maps(tmp_path, HIP), fds(tmp_path)) == CudaState(
        True, f"HIP is mapped ({HIP}) without ROCr, which cannot be asked; assuming HIP is "
        f"initialised ({HINT})", "torch")
