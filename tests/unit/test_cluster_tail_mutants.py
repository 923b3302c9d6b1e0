"""Survivors of the full mutation run (issue 22) in core.cluster's tail (``_finite``, the folds,
``_skipped_by_host``, ``_snapshot``, ``fetch_cluster``, ``PrometheusClient._series``, ``query``,
``scrape_intervals``) and a few beside it (``get_backend``'s cache key, ``Registry``'s ticket
bound, ``Sampler.stop``'s wait). All in process: Prometheus's answers are handed to the client's
``_get``, the backend cache is a fresh dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import backends
from autogpu_jupyter.core.cluster import (
    _AUTOGPU_QUERY,
    _DCGM_QUERY,
    MAX_SERIES,
    ClusterError,
    PrometheusClient,
    Rejected,
    Sample,
    _Acc,
    _finite,
    _fold_autogpu,
    _fold_dcgm,
    _skipped_by_host,
    _snapshot,
    fetch_cluster,
)
from autogpu_jupyter.core.leasing.directory import Registry
from autogpu_jupyter.core.sampler import Sampler

URL = "http://prometheus.example:9090"


def _client(answers: dict[str, Any]) -> PrometheusClient:
    """A client whose ``_get`` answers ``answers[query]`` (a vector result list), or, for the
    targets API, ``answers["targets"]``."""
    client = PrometheusClient(URL)

    def get(path: str, params: dict[str, str]) -> object:
        if path == "/api/v1/targets":
            return answers.get("targets", {"activeTargets": []})
        return {"resultType": "vector", "result": answers.get(params["query"], [])}

    client._get = get  # type: ignore[method-assign,assignment]
    return client


def _item(value: str, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [100.0, value]}


# ---- _finite ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, None, [1], {"a": 1}])
def test_a_value_that_is_no_number_or_text_is_not_a_number(raw: Any) -> None:
    with pytest.raises(TypeError) as err:
        _finite(raw)
    assert str(err.value) == "not a number"


def test_a_non_finite_value_names_its_first_20_characters() -> None:
    raw = "0" * 21 + "1e999"
    with pytest.raises(ValueError) as err:
        _finite(raw)
    assert str(err.value) == f"non-finite value {'0' * 20}"
    assert _finite("1.5") == 1.5
    assert _finite(2) == 2.0


# ---- the folds ---------------------------------------------------------------------------------


def test_an_autogpu_series_without_name_or_index_is_folded_under_empty_ones() -> None:
    acc: dict[str, _Acc] = {}
    _fold_autogpu([Sample({"uuid": "GPU-a", "hostname": "h"}, 3.0, 1.0)], acc)
    assert acc == {"GPU-a": _Acc("h", None, "GPU-a", "", "", "autogpu", {"": 3.0}, [])}


def test_a_dcgm_series_without_name_or_gpu_is_folded_under_empty_ones() -> None:
    acc: dict[str, _Acc] = {}
    _fold_dcgm([
        Sample({"UUID": "GPU-a", "hostname": "h"}, 3.0, 1.0),
        Sample({"UUID": "GPU-b", "hostname": "h", "gpu": "2",
                "__name__": "DCGM_FI_DEV_FB_USED"}, 4.0, 1.0),
    ], acc)
    assert acc == {
        "GPU-a": _Acc("h", None, "GPU-a", "", "", "dcgm", {"": 3.0}, []),
        "GPU-b": _Acc("h", None, "GPU-b", "2", "", "dcgm", {"DCGM_FI_DEV_FB_USED": 4.0}, []),
    }


# ---- _skipped_by_host ----------------------------------------------------------------------------


def test_a_skipped_sample_is_named_by_its_targets_host_else_by_its_labels() -> None:
    rejected = [
        Rejected({"__name__": "a", "instance": "10.0.0.1:9400"}, "= NaN"),
        Rejected({"__name__": "b", "instance": "10.0.0.2:9400"}, "= NaN"),
        Rejected({"__name__": "c"}, "= NaN"),
        Rejected({"__name__": "d", "hostname": "named"}, "= NaN"),
    ]
    host_of = {"10.0.0.1:9400": "gpu-1", "": "no-instance"}
    assert _skipped_by_host(rejected, host_of) == {
        "gpu-1": ["a = NaN"],
        "10.0.0.2": ["b = NaN"],
        "no-instance": ["c = NaN", "d = NaN"],
    }
    assert _skipped_by_host(rejected[1:2], {}) == {"10.0.0.2": ["b = NaN"]}


# ---- _snapshot -------------------------------------------------------------------------------


def test_an_amd_device_is_seen_at_the_given_moment() -> None:
    dev = _Acc("h", None, "h/gpu-0", "0", "MI300X", "amd", {"gpu_used_vram": 1.0})
    assert _snapshot(dev, 123.5).snapshot.timestamp_s == 123.5


# ---- fetch_cluster ---------------------------------------------------------------------------


def test_a_gpu_sorts_before_a_mig_device_of_the_same_index_by_uuid_and_notes_join() -> None:
    """A host's devices sort by index, MIG index (none and 0 alike) and UUID; a host with a
    note and skipped samples keeps both."""
    client = _client({
        _DCGM_QUERY: [
            _item("5", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-b", GPU_I_ID="0", gpu="0",
                  hostname="h"),
            _item("6", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-a", gpu="0", hostname="h"),
            _item("NaN", __name__="DCGM_FI_DEV_FB_FREE", UUID="GPU-a", gpu="0", hostname="h"),
        ],
        _AUTOGPU_QUERY: [],
    })
    view = fetch_cluster(client, now_s=1000.0)
    (host,) = view.hosts
    assert [d.snapshot.uuid for d in host.devices] == ["GPU-a", "GPU-b/0"]
    assert host.state == "stale"
    assert host.note == "no samples; 1 sample(s) skipped (not finite numbers)"


# ---- PrometheusClient._series and query ----------------------------------------------------


def test_exactly_max_series_are_read() -> None:
    client = _client({"m": [{} for _ in range(MAX_SERIES)]})
    assert client.query("m") == []
    assert len(client.rejected) == MAX_SERIES
    assert client.rejected[0] == Rejected({}, "has no [time, value] pair")


def test_more_than_max_series_are_refused_with_the_query_cut_at_80() -> None:
    expr = "".join(chr(ord("a") + i % 26) for i in range(100))
    client = _client({expr: [{} for _ in range(MAX_SERIES + 1)]})
    with pytest.raises(ClusterError) as err:
        client.query(expr)
    assert str(err.value) == (
        f"Prometheus at {URL} answered {MAX_SERIES + 1} series to {expr[:80]!r}, more than the "
        f"{MAX_SERIES} the cluster view reads: scrape fewer targets into this Prometheus, or "
        "point c.AutoGPU.prometheus_url at one that holds only the GPU hosts"
    )


def test_series_that_are_not_objects_are_read_as_empty_ones() -> None:
    client = _client({"m": [[1, 2], "x", _item("1", __name__="m")]})
    assert client.query("m") == [Sample({"__name__": "m"}, 1.0, 100.0)]
    assert [r.text() for r in client.rejected] == [
        "? has no [time, value] pair", "? has no [time, value] pair"]


def test_an_answer_without_a_result_list_names_the_query() -> None:
    client = PrometheusClient(URL)
    client._get = lambda path, params: {  # type: ignore[method-assign]
        "resultType": "vector", "result": "nope"}
    with pytest.raises(ClusterError) as err:
        client.query("up")
    assert str(err.value) == f"Prometheus at {URL}: 'up' gave no result list"


# ---- scrape_intervals ------------------------------------------------------------------------


def test_a_target_that_is_not_an_object_is_skipped_not_the_rest() -> None:
    client = _client({"targets": {"activeTargets": [
        "junk", {"labels": {"instance": "a:1"}, "scrapeInterval": "30s"}]}})
    assert client.scrape_intervals() == {"a:1": 30.0}


# ---- get_backend -----------------------------------------------------------------------------


@pytest.mark.parametrize(("vendor", "key"), [("nvml", ""), ("amdsmi", "amdsmi:")])
def test_each_vendor_backend_is_kept_under_its_own_key(
    monkeypatch: pytest.MonkeyPatch, vendor: str, key: str
) -> None:
    nvml, amd = object(), object()
    cache: dict[Any, Any] = {"": nvml, "amdsmi:": amd}
    monkeypatch.setattr(backends, "_cache", cache)
    monkeypatch.setenv(backends.BACKEND_ENV, vendor)
    assert backends.get_backend("") is cache[key]
    assert cache == {"": nvml, "amdsmi:": amd}


# ---- Registry and Sampler ------------------------------------------------------------------


@pytest.mark.parametrize(("given", "kept"), [(0, 0), (-3, 0), (2, 2)])
def test_the_ticket_bound_is_kept_at_zero_or_more(tmp_path: Path, given: int, kept: int) -> None:
    assert Registry(tmp_path, max_tickets_per_user=given).max_tickets_per_user == kept


def test_stop_waits_five_seconds_for_the_thread_by_default() -> None:
    joined: list[float | None] = []

    class Thread:
        def join(self, timeout: float | None = None) -> None:
            joined.append(timeout)

    sampler = Sampler()
    sampler._thread = Thread()  # type: ignore[assignment]
    sampler.stop()
    assert joined == [5.0]


def test_a_dcgm_mig_devices_parent_is_its_whole_uuid_label() -> None:
    """The key is ``UUID/GPU_I_ID``: a UUID label with a ``/`` in it stays whole as the parent
    (it was cut at its first ``/``; found by the ``rpartition`` mutant)."""
    acc: dict[str, _Acc] = {}
    _fold_dcgm([
        Sample({"__name__": "DCGM_FI_DEV_FB_USED", "UUID": "GPU-a/b", "GPU_I_ID": "1",
                "gpu": "0", "hostname": "h"}, 1.0, 1.0),
        Sample({"__name__": "DCGM_FI_DEV_FB_USED", "UUID": "GPU-c", "GPU_I_ID": "2",
                "gpu": "1", "hostname": "h"}, 1.0, 1.0),
    ], acc)
    snaps = [_snapshot(dev, 1.0).snapshot for dev in acc.values()]
    assert [(s.uuid, s.parent_uuid, s.mig_index) for s in snaps] == [
        ("GPU-a/b/1", "GPU-a/b", 1), ("GPU-c/2", "GPU-c", 2)]
