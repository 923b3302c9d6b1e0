"""Survivors of the full mutation run (issue 22) in the server's ``cluster`` answers and
``parse_json_object``, the ``autogpu_*`` gauges (``metrics``) and the package's own
``__init__`` (its lazy attributes and Jupyter entry points): whole answers, whole expositions and
exact messages, in this process. Each test was seen failing with its mutants planted by hand.

The ``cluster`` answer is built over a real :class:`~autogpu_jupyter.core.cluster.ClusterCache`
whose fetch returns a fixed view (no Prometheus); the gauges over a hand-made sweep.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from traitlets.config import Config, Configurable

import autogpu_jupyter
from autogpu_jupyter import metrics
from autogpu_jupyter._version import __version__
from autogpu_jupyter.core.cluster import ClusterCache, ClusterDevice, ClusterHost, ClusterView
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import AutoGPUError, UsageErrorBase
from autogpu_jupyter.metrics import AutoGPUCollector, MetricsSource
from autogpu_jupyter.server import payloads

GiB = 1024**3
URL = "http://prometheus.example.org:9090"
A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
C = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
D = "GPU-3d3d3d3d-1111-2222-3333-444444444444"


# ---- server.payloads: cluster_payload, cluster_history_payload ---------------------------------


def _state(monkeypatch: pytest.MonkeyPatch, url: str | None, view: Any = None,
           calls: list[tuple[str, float]] | None = None) -> Any:
    """What the cluster answers read of ``AutoGPUServer``: its config parent and its cluster
    cache (a real one whose fetch returns ``view``, or raises it when it is an exception)."""
    monkeypatch.delenv("AUTOGPU_PROMETHEUS_URL", raising=False)
    config = Config()
    if url is not None:
        config.AutoGPU.prometheus_url = url
    config.AutoGPU.prometheus_timeout_s = 2.5

    def fetch(u: str, timeout_s: float) -> ClusterView:
        if calls is not None:
            calls.append((u, timeout_s))
        if isinstance(view, Exception):
            raise view
        return view

    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.server.state import ServerContext

    parent = Configurable(config=config)
    return ServerContext(settings=lambda: AutoGPU(parent=parent),
                         cluster_cache=ClusterCache(fetch=fetch))


def _view() -> ClusterView:
    """Host gpu-a: one A100, 20 of 80 GiB in use; host gpu-b: down."""
    dev = DeviceSnapshot(index=0, uuid=A, name="NVIDIA A100", memory_total_bytes=80 * GiB,
                         memory_used_bytes=20 * GiB, memory_free_bytes=60 * GiB,
                         utilization_pct=10.0)
    up = ClusterHost(hostname="gpu-a", instances=("gpu-a:9100",), state="ok", as_of_s=99.0,
                     scrape_interval_s=60.0, devices=(ClusterDevice(dev, "autogpu"),))
    down = ClusterHost(hostname="gpu-b", instances=("gpu-b:9100",), state="down", as_of_s=None,
                       scrape_interval_s=60.0)
    return ClusterView(prometheus_url=URL, timestamp_s=100.0, hosts=(up, down))


def _timed(answer: dict[str, Any], before: float) -> dict[str, Any]:
    """``answer`` less its ``timestamp_s``, checked to be the time it was made."""
    assert before <= answer.pop("timestamp_s") <= time.time()
    return answer


def test_an_unconfigured_cluster_answer_is_empty_with_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``prometheus_url``: the whole answer, every key the sidebar reads present.
    Caught: a key misspelt (``timestamp_s``, ``constraints``, ``errors``,
    ``prometheus_url``), the empty URL given as "" instead of null."""
    cons = Constraints.parse(min_free="10G")
    before = time.time()
    answer = payloads.cluster_payload(_state(monkeypatch, None), cons)
    assert _timed(answer, before) == {
        "configured": False, "prometheus_url": None, "constraints": cons.to_json(),
        "constraints_text": "min free 10.0 GiB", "hosts": [], "ranking": [], "best": None,
        "errors": []}


def test_the_cluster_answer_ranks_the_hosts_prometheus_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole answer over a view: the view's own keys, the ranking with each chosen device's
    uuid, label and effective free memory, the best host. Caught: those keys misspelt (the
    sidebar showed no device), a key of the base answer left beside the view's."""
    calls: list[tuple[str, float]] = []
    cons = Constraints.parse(min_free="10G")
    view = _view()
    answer = payloads.cluster_payload(_state(monkeypatch, URL, view, calls), cons)
    assert calls == [(URL, 2.5)]
    assert answer == {
        "configured": True, "prometheus_url": URL, "timestamp_s": 100.0,
        "constraints": cons.to_json(), "constraints_text": "min free 10.0 GiB",
        "hosts": [h.to_dict() for h in view.hosts], "errors": [],
        "ranking": [
            {"hostname": "gpu-a", "fits": True,
             "chosen": [{"uuid": A, "label": "GPU 0", "effective_free_bytes": 60 * GiB}]},
            {"hostname": "gpu-b", "fits": False, "chosen": []},
        ],
        "best": "gpu-a",
    }


def test_a_cluster_answer_prometheus_refused_names_the_url_and_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: ``prometheus_url`` null (``url and None``) when Prometheus cannot be asked."""
    cons = Constraints()
    err = AutoGPUError(f"cannot reach Prometheus at {URL}: refused")
    before = time.time()
    answer = payloads.cluster_payload(_state(monkeypatch, URL, err), cons)
    assert _timed(answer, before) == {
        "configured": True, "prometheus_url": URL, "constraints": cons.to_json(),
        "constraints_text": cons.describe(), "hosts": [], "ranking": [], "best": None,
        "errors": [str(err)]}


def test_an_unconfigured_cluster_history_is_empty_with_a_null_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: the empty URL given as "" instead of null (``url and None``)."""
    answer = payloads.cluster_history_payload(_state(monkeypatch, None), 600.0)
    assert answer == {"configured": False, "prometheus_url": None, "seconds": 600.0,
                      "step_s": None, "hosts": [], "errors": []}


def test_a_cluster_history_prometheus_refused_names_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Prometheus port nothing listens on: the URL is in the answer (``url and None`` made it
    null) and the reason in ``errors``."""
    with socket.socket() as s:  # a port just freed: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    answer = payloads.cluster_history_payload(_state(monkeypatch, url), 600.0)
    (error,) = answer.pop("errors")
    assert error.startswith(f"cannot reach Prometheus at {url}")
    assert answer == {"configured": True, "prometheus_url": url, "seconds": 600.0,
                      "step_s": None, "hosts": []}


# ---- server.payloads: parse_json_object ---------------------------------------------------------

EX = '{"target": "best"}'
LIMIT = payloads.MAX_BODY_BYTES


def _object_of_size(n: int) -> bytes:
    body = b'{"pad": "' + b"x" * (n - 11) + b'"}'
    assert len(body) == n
    return body


@pytest.mark.parametrize(("body", "want"), [
    (None, {}), (b"", {}), (b'{"a": 1}', {"a": 1}),
    (_object_of_size(LIMIT), {"pad": "x" * (LIMIT - 11)}),
])
def test_a_json_body_accepted(body: bytes | None, want: dict[str, Any]) -> None:
    """No body is an empty object; a body of exactly the limit is accepted. Caught: the
    default body junk (not JSON), the limit itself refused (``>=``)."""
    assert payloads.parse_json_object(body, EX) == want


@pytest.mark.parametrize(("body", "message"), [
    (_object_of_size(LIMIT + 1),
     f"request body too large ({LIMIT + 1} bytes, at most {LIMIT}); expected a small JSON object "
     f"such as {EX}"),
    (b"[" * 50000,
     f"request body nested too deeply; expected a flat JSON object such as {EX}"),
])
def test_a_json_body_refused_says_why(body: bytes, message: str) -> None:
    """Caught: the messages dropped (a 400 saying only "None")."""
    with pytest.raises(UsageErrorBase) as info:
        payloads.parse_json_object(body, EX)
    assert str(info.value) == message


# ---- metrics ----------------------------------------------------------------------------------

HOST = "node-7"
TS = 1_700_000_000.0


def _samples(snap: FleetSnapshot, hostname: str = HOST) -> dict[tuple[str, tuple[Any, ...]], float]:
    """``(name, sorted labels) -> value`` of every sample one scrape exposes."""
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(MetricsSource(
        latest=lambda: snap, registry=lambda: None, hostname=hostname)))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(prom).decode())
            for s in fam.samples}


def _dev(index: int, uuid: str, **kw: Any) -> DeviceSnapshot:
    return DeviceSnapshot(index=index, uuid=uuid, name="NVIDIA A100", **kw)


def test_a_whole_scrape_of_a_sweep_with_a_lost_first_gpu_and_unknown_memory() -> None:
    """GPU 0 lost, GPU 1 with its memory in use unknown, GPU 2 with its total unknown, GPU 3
    known: every sample of the scrape. Caught: the lost GPU ending the loop (``break``: the
    GPUs after it unlisted), the used ratio computed with one of the two unknown (``or``: a
    TypeError, the scrape failed), the sweep's timestamp without its ``hostname`` label (or
    under another label name)."""
    snap = FleetSnapshot(devices=(
        _dev(0, A, available=False),
        _dev(1, B, memory_total_bytes=80 * GiB, utilization_pct=50.0, temperature_c=40.0),
        _dev(2, C, memory_used_bytes=GiB),
        _dev(3, D, memory_total_bytes=40 * GiB, memory_used_bytes=10 * GiB, power_w=100.0),
    ), timestamp_s=TS, backend="nvml")

    def lab(uuid: str, index: int) -> tuple[Any, ...]:
        return tuple(sorted({"hostname": HOST, "uuid": uuid, "index": str(index),
                             "model": "NVIDIA A100"}.items()))

    la, lb, lc, ld = lab(A, 0), lab(B, 1), lab(C, 2), lab(D, 3)
    every = {la: 0.0, lb: 0.0, lc: 0.0, ld: 0.0}
    want: dict[tuple[str, tuple[Any, ...]], float] = {
        ("autogpu_host_info", (("backend", "nvml"), ("hostname", HOST), ("simulated", "false"),
                               ("vendor", "nvidia"), ("version", __version__))): 1.0,
        ("autogpu_sample_timestamp_seconds", (("hostname", HOST),)): TS,
    }
    for name, values in {
        "autogpu_gpu_available": {la: 0.0, lb: 1.0, lc: 1.0, ld: 1.0},
        "autogpu_gpu_utilization_ratio": {lb: 0.5},
        "autogpu_gpu_memory_used_bytes": {lc: float(GiB), ld: 10.0 * GiB},
        "autogpu_gpu_memory_total_bytes": {lb: 80.0 * GiB, ld: 40.0 * GiB},
        "autogpu_gpu_memory_booked_bytes": {lb: 0.0, lc: 0.0, ld: 0.0},
        "autogpu_gpu_memory_used_ratio": {ld: 0.25},
        "autogpu_gpu_temperature_celsius": {lb: 40.0},
        "autogpu_gpu_power_watts": {ld: 100.0},
        "autogpu_gpu_leases": every,
        "autogpu_gpu_waiters": every,
    }.items():
        want.update({(name, k): v for k, v in values.items()})
    assert _samples(snap) == want


def test_a_host_of_one_amd_gpu_is_labelled_amd() -> None:
    """The vendor is the first device's. Caught: the second device's asked (an IndexError on a
    host of one GPU: the scrape failed)."""
    snap = FleetSnapshot(devices=(_dev(0, A, vendor="amd"),), timestamp_s=TS, backend="amdsmi")
    [info] = [k[1] for k in _samples(snap) if k[0] == "autogpu_host_info"]
    assert dict(info)["vendor"] == "amd"


@pytest.mark.parametrize(("name", "short"), [
    ("gpu-node-3.cluster.example.org", "gpu-node-3"), ("gpu-node-3", "gpu-node-3")])
def test_the_default_hostname_label_is_the_short_host_name(
    monkeypatch: pytest.MonkeyPatch, name: str, short: str
) -> None:
    """As DCGM exporter's ``Hostname``: the host name up to its first dot. Caught: the whole
    name kept (split on whitespace, or on a junk separator)."""
    monkeypatch.setattr(metrics.socket, "gethostname", lambda: name)
    assert MetricsSource(latest=lambda: None, registry=lambda: None).hostname == short
    assert MetricsSource(latest=lambda: None, registry=lambda: None,
                         hostname="given").hostname == "given"


# ---- the package's __init__ -------------------------------------------------------------------


def test_the_package_gives_panel_lazily_and_refuses_other_names() -> None:
    """``autogpu_jupyter.Panel`` is the widget class; any other unknown name an AttributeError
    that names it. Caught: the name compared inverted or misspelt (``Panel`` refused, an unknown
    name given the Panel), the message dropped (``None``)."""
    from autogpu_jupyter.widgets.panel import Panel

    assert autogpu_jupyter.Panel is Panel
    with pytest.raises(AttributeError) as info:
        autogpu_jupyter.no_such_thing
    assert str(info.value) == "module 'autogpu_jupyter' has no attribute 'no_such_thing'"


def test_the_widgets_package_refuses_other_names_by_name() -> None:
    """Caught: the message dropped (``None``)."""
    import autogpu_jupyter.widgets

    with pytest.raises(AttributeError) as info:
        autogpu_jupyter.widgets.no_such_thing
    assert str(info.value) == "module 'autogpu_jupyter.widgets' has no attribute 'no_such_thing'"


def test_the_lab_extension_is_installed_from_the_packages_labextension_folder() -> None:
    """JupyterLab copies ``<package>/labextension`` to ``labextensions/autogpu-jupyter`` (the
    name in package.json). Caught: keys or values changed."""
    assert autogpu_jupyter._jupyter_labextension_paths() == [
        {"src": "labextension", "dest": "autogpu-jupyter"}]


def test_the_server_extension_entry_point_passes_the_server_app_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: ``None`` passed on instead of the ServerApp."""
    import autogpu_jupyter.server

    got: list[Any] = []
    monkeypatch.setattr(autogpu_jupyter.server, "_load_jupyter_server_extension", got.append)
    app = object()
    assert autogpu_jupyter._load_jupyter_server_extension(app) is None
    assert got == [app]
