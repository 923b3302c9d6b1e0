"""The ``autogpu_*`` gauges (``metrics.AutoGPUCollector``) in this process: a simulated fleet's
snapshot and a real lease registry in, ``prometheus_client``'s own text exposition out, parsed
back with its parser and compared value by value. The same collector behind a real Jupyter
server's ``/metrics`` and ``autogpu exporter`` is ``tests/server/test_metrics.py``.
"""

from __future__ import annotations

import getpass
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from autogpu_jupyter import metrics
from autogpu_jupyter._version import __version__
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.decision import ticket_constraints
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.metrics import AutoGPUCollector, MetricsSource
from tests.payloadhelpers import GiB, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
LOST = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
MIG = "MIG-11111111-aaaa-5bbb-8ccc-000000000001"
HOST = "node-7"

FLEET = [
    {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 20 * GiB,
     "utilization_pct": 35, "temperature_c": 51, "power_w": 210.5},
    {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
     "mig_devices": [{"uuid": MIG, "profile": "3g.40gb", "memory_total": 40 * GiB,
                      "memory_used": 4 * GiB}]},
    {"uuid": LOST, "name": "NVIDIA L4", "lost": True},
]


def labels(uuid: str, index: str, model: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"hostname": HOST, "uuid": uuid, "index": index, "model": model}.items()))


LA, LB = labels(A, "0", "NVIDIA A100"), labels(B, "1", "NVIDIA A100")
LMIG = labels(MIG, "1:0", "NVIDIA A100 MIG 3g.40gb")
LLOST = labels(LOST, "2", "NVIDIA L4")


def scrape(fleet_file: Path, registry: DirectoryStore | None,
           details: bool = False) -> dict[Any, float]:
    """``(name, sorted labels) -> value`` of every ``autogpu_*`` sample one scrape exposes."""
    snap = SimulatedBackend(str(fleet_file)).snapshot()
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(MetricsSource(
        latest=lambda: snap, store=lambda: registry, hostname=HOST, lease_details=details)))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(prom).decode()):
        for s in fam.samples:
            if s.name.startswith("autogpu_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def of(got: dict[Any, float], name: str) -> dict[Any, float]:
    return {k[1]: v for k, v in got.items() if k[0] == name}


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return write_fleet(tmp_path / "fleet.json", FLEET)


def test_unknown_values_have_no_sample_and_a_lost_gpu_only_its_availability(
    fleet_file: Path,
) -> None:
    """Utilisation of a MIG device (and of a GPU in MIG mode) is unknown: no sample, never a
    made-up zero; a lost GPU says only that it is unavailable (and its lease counts)."""
    got = scrape(fleet_file, None)
    assert of(got, "autogpu_gpu_available") == {LA: 1.0, LB: 1.0, LMIG: 1.0, LLOST: 0.0}
    assert of(got, "autogpu_gpu_utilization_ratio") == {LA: 0.35}
    assert of(got, "autogpu_gpu_memory_used_bytes") == {LA: 20 * GiB, LB: 0.0, LMIG: 4 * GiB}
    assert of(got, "autogpu_gpu_memory_booked_bytes") == {LA: 0.0, LB: 0.0, LMIG: 0.0}
    assert of(got, "autogpu_gpu_leases") == {LA: 0.0, LB: 0.0, LMIG: 0.0, LLOST: 0.0}
    assert of(got, "autogpu_gpu_temperature_celsius")[LA] == 51.0
    assert LLOST not in of(got, "autogpu_gpu_temperature_celsius")
    assert of(got, "autogpu_host_info") == {
        (("backend", "simulated"), ("hostname", HOST), ("simulated", "true"),
         ("vendor", "nvidia"), ("version", "0.1.0")): 1.0}


def test_bookings_count_in_the_used_ratio_capped_at_one(fleet_file: Path, tmp_path: Path) -> None:
    """A lease booking 70 GiB on A (20 GiB in use): taken is (20 + 70) / 80, shown as 1 (full),
    never more. Caught: the booking left out of the ratio; the cap dropped."""
    registry = DirectoryStore(str(tmp_path / "registry"))
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A], requested_bytes=70 * GiB,
                           requester=Requester(kernel_id="k"))
        small = txn.create(devices=[MIG], requested_bytes=6 * GiB,
                           requester=Requester(kernel_id="m"))
    try:
        got = scrape(fleet_file, registry)
    finally:
        lease.release()
        small.release()
    assert of(got, "autogpu_gpu_memory_booked_bytes") == {LA: 70 * GiB, LB: 0.0, LMIG: 6 * GiB}
    assert of(got, "autogpu_gpu_memory_used_ratio") == {LA: 1.0, LB: 0.0, LMIG: 0.25}
    assert of(got, "autogpu_gpu_leases") == {LA: 1.0, LB: 0.0, LMIG: 1.0, LLOST: 0.0}


def test_waiters_count_on_every_device_their_ticket_allows(
    fleet_file: Path, tmp_path: Path
) -> None:
    """One waiter may take any device; one only GPU B's, which a MIG device of B is part of.
    Caught: a MIG device not counted for a ticket that allows its parent."""
    registry = DirectoryStore(str(tmp_path / "registry"))
    anywhere = registry.take_ticket(constraints=ticket_constraints(None, None))
    on_b = registry.take_ticket(constraints=ticket_constraints(None, [B]))
    assert anywhere is not None and on_b is not None
    try:
        got = scrape(fleet_file, registry)
    finally:
        anywhere.release()
        on_b.release()
    assert of(got, "autogpu_gpu_waiters") == {LA: 1.0, LB: 2.0, LMIG: 2.0, LLOST: 1.0}


@pytest.mark.parametrize("details", [False, True])
def test_lease_info_names_notebooks_only_when_the_admin_asks(
    fleet_file: Path, tmp_path: Path, details: bool
) -> None:
    """Caught: kernel and notebook labels exposed without ``lease_details``."""
    registry = DirectoryStore(str(tmp_path / "registry"))
    with registry.locked() as txn:
        assert txn is not None
        leases = [txn.create(devices=[A], requester=Requester(kernel_id=f"k-{i}",
                                                         notebook_path="secret/plan.ipynb"))
                  for i in range(2)]
    try:
        got = scrape(fleet_file, registry, details=details)
    finally:
        for lease in leases:
            lease.release()
    base = {"hostname": HOST, "uuid": A, "index": "0", "model": "NVIDIA A100",
            "user": getpass.getuser()}
    if details:
        want = {tuple(sorted({**base, "kernel": f"k-{i}",
                              "notebook": "secret/plan.ipynb"}.items())): 1.0 for i in range(2)}
    else:  # two leases of one user on one device: one series, the value 2
        want = {tuple(sorted(base.items())): 2.0}
    assert of(got, "autogpu_lease_info") == want


@pytest.mark.parametrize(("backend", "vendor"), [("amdsmi", "amd"), ("nvml", "nvidia")])
def test_a_host_without_devices_is_labelled_by_its_backends_vendor(
    backend: str, vendor: str
) -> None:
    """No device to ask (every GPU hidden, none installed): the backend says the vendor.
    Caught (mutation run, issue 22): the comparison inverted (an AMD host labelled nvidia)."""
    from autogpu_jupyter.core.devices import FleetSnapshot

    snap = FleetSnapshot(devices=(), timestamp_s=1.0, backend=backend)
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(MetricsSource(
        latest=lambda: snap, store=lambda: None, hostname=HOST)))
    [info] = [s for fam in text_string_to_metric_families(generate_latest(prom).decode())
              for s in fam.samples if s.name == "autogpu_host_info"]
    assert (info.labels["backend"], info.labels["vendor"]) == (backend, vendor)


def test_every_family_says_what_it_measures_in_its_help_text(fleet_file: Path) -> None:
    """The ``# HELP`` line of each series, word for word (Prometheus and Grafana show it as the
    series' description). Caught (issue 22): help texts upper-cased or wrapped in junk."""
    snap = SimulatedBackend(str(fleet_file)).snapshot()
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(MetricsSource(
        latest=lambda: snap, store=lambda: None, hostname=HOST)))
    helps = {fam.name: fam.documentation
             for fam in text_string_to_metric_families(generate_latest(prom).decode())}
    assert helps == {
        "autogpu_host_info": "This exporter's host: backend (nvml / amdsmi / simulated), GPU "
                             "vendor and autogpu version.",
        "autogpu_sample_timestamp_seconds": "Unix time of the sampler sweep these values come "
                                            "from.",
        "autogpu_gpu_available": "1 if the device is readable, 0 if lost.",
        "autogpu_gpu_utilization_ratio": "Share of the last sample period in which a kernel ran "
                                         "(0..1).",
        "autogpu_gpu_memory_used_bytes": "GPU memory in use.",
        "autogpu_gpu_memory_total_bytes": "GPU memory of the device.",
        "autogpu_gpu_memory_booked_bytes": "GPU memory booked by live autogpu leases and not yet "
                                           "in use.",
        "autogpu_gpu_memory_used_ratio": "(Memory used + booked) / total (0..1), what a pick "
                                         "counts as taken.",
        "autogpu_gpu_temperature_celsius": "GPU core temperature.",
        "autogpu_gpu_power_watts": "Board power draw.",
        "autogpu_gpu_leases": "Live autogpu leases holding the device.",
        "autogpu_gpu_waiters": "Live autogpu tickets (waiting picks) that may take the device.",
        "autogpu_lease_info": "1 per live autogpu lease and device it holds.",
    }


class _BrokenRegistry:
    """A lease store whose scan fails (a registry directory gone, a broker lost)."""

    def live_records(self) -> Any:
        raise OSError("registry directory gone")


def test_an_unreadable_registry_is_logged_and_scraped_without_leases(
    fleet_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The device series are still served, every lease count 0, and the reason is in the debug
    log. Caught (issue 22): the log line's text dropped (a record saying only "None")."""
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.metrics"):
        got = scrape(fleet_file, _BrokenRegistry())  # type: ignore[arg-type]
    assert of(got, "autogpu_gpu_leases") == {LA: 0.0, LB: 0.0, LMIG: 0.0, LLOST: 0.0}
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("autogpu_jupyter.metrics", "metrics without leases: registry directory gone")]


class _ReservingRegistry:
    """What the broker's client reads without the lock since issue 39: the live leases, and the
    devices the admin reserved away from this user as pseudo-leases (for ranking)."""

    def live_records(self) -> Any:
        from autogpu_jupyter.core.leasing.admission import reservation

        return [reservation(A, ["ml"], "h"), reservation(MIG, ["ml"], "h")], []


def test_a_reservation_is_no_lease_in_the_gauges(fleet_file: Path) -> None:
    """A device reserved for a group shows no lease, no lease info. Caught: a reservation
    counted as a live lease of root on the device."""
    got = scrape(fleet_file, _ReservingRegistry())  # type: ignore[arg-type]
    assert of(got, "autogpu_gpu_leases") == {LA: 0.0, LB: 0.0, LMIG: 0.0, LLOST: 0.0}
    assert of(got, "autogpu_lease_info") == {}


def test_uninstall_takes_the_collector_off_the_registry_it_was_installed_on(
    fleet_file: Path,
) -> None:
    """``install(source, registry)`` then ``uninstall(registry)``: the gauges leave that
    registry (and a later install registers afresh). Caught (issue 22): uninstall always
    unregistering from prometheus_client's global REGISTRY (a KeyError there, the collector
    left on the given one)."""
    from autogpu_jupyter import metrics

    snap = SimulatedBackend(str(fleet_file)).snapshot()
    source = MetricsSource(latest=lambda: snap, store=lambda: None, hostname=HOST)
    prom = CollectorRegistry(auto_describe=False)
    metrics.uninstall()
    try:
        metrics.install(source, prom)
        assert b"autogpu_gpu_available" in generate_latest(prom)
        metrics.uninstall(prom)
        assert b"autogpu_" not in generate_latest(prom)
        metrics.uninstall(prom)  # none registered now: no error
        metrics.install(source, prom)
        assert b"autogpu_gpu_available" in generate_latest(prom)
    finally:
        metrics.uninstall(prom)


def test_a_second_install_reads_the_new_source_afresh(fleet_file: Path) -> None:
    """A second server extension in the process re-points the one collector: its scrape names
    the new source's host. Caught (issue 22, seed 53): the re-pointed source left None (every
    scrape then fails)."""
    from autogpu_jupyter import metrics

    snap = SimulatedBackend(str(fleet_file)).snapshot()
    first = MetricsSource(latest=lambda: snap, store=lambda: None, hostname="node-1")
    second = MetricsSource(latest=lambda: snap, store=lambda: None, hostname="node-2")
    prom = CollectorRegistry(auto_describe=False)
    metrics.uninstall()
    try:
        one = metrics.install(first, prom)
        assert metrics.install(second, prom) is one
        text = generate_latest(prom).decode()
    finally:
        metrics.uninstall(prom)
    assert 'hostname="node-2"' in text and 'hostname="node-1"' not in text


def test_a_lease_on_a_device_the_sweep_lacks_is_still_listed(
    fleet_file: Path, tmp_path: Path
) -> None:
    """A lease naming a device this sweep does not show (unplugged, hidden): its series has an
    empty index and model. Caught (issue 22, seed 53): the index asked of the missing device
    (the scrape fails with AttributeError)."""
    gone = "GPU-9d9d9d9d-1111-2222-3333-444444444444"
    registry = DirectoryStore(str(tmp_path / "registry"))
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[gone], requester=Requester(kernel_id="k"))
    try:
        got = scrape(fleet_file, registry)
    finally:
        lease.release()
    assert of(got, "autogpu_lease_info") == {tuple(sorted(
        {"hostname": HOST, "uuid": gone, "index": "", "model": "",
         "user": getpass.getuser()}.items())): 1.0}


def test_a_lease_without_a_kernel_has_an_empty_kernel_label(
    fleet_file: Path, tmp_path: Path
) -> None:
    """With ``lease_details``, a lease taken outside a kernel (a script) has kernel="" and
    notebook="". Caught (issue 22, seed 53): a made-up kernel name for it."""
    registry = DirectoryStore(str(tmp_path / "registry"))
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A], requester=Requester())
    try:
        got = scrape(fleet_file, registry, details=True)
    finally:
        lease.release()
    assert of(got, "autogpu_lease_info") == {tuple(sorted(
        {"hostname": HOST, "uuid": A, "index": "0", "model": "NVIDIA A100",
         "user": getpass.getuser(), "kernel": "", "notebook": ""}.items())): 1.0}


# ---- whole expositions over a hand-made sweep (found by the mutation run of issue 22) ----
TS = 1_700_000_000.0
C = LOST
D = "GPU-3d3d3d3d-1111-2222-3333-444444444444"


def _samples(snap: FleetSnapshot, hostname: str = HOST) -> dict[tuple[str, tuple[Any, ...]], float]:
    """``(name, sorted labels) -> value`` of every sample one scrape exposes."""
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(MetricsSource(
        latest=lambda: snap, store=lambda: None, hostname=hostname)))
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
    assert MetricsSource(latest=lambda: None, store=lambda: None).hostname == short
    assert MetricsSource(latest=lambda: None, store=lambda: None,
                         hostname="given").hostname == "given"
