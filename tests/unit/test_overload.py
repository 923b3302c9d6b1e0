"""Fast unit tests of the overload warning (``core.overload``): plain snapshots and sampler
history in, the exact warning text, the alternative it names and the once-only notice out."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from autogpu_jupyter.core import overload, session
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.overload import Alternative, Overload, Thresholds
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import METRICS, DeviceSeries, Sampler
from autogpu_jupyter.core.units import Size, parse_size
from tests.leasehelpers import uuid_of

GiB = 1024**3
U0, U1, U2, U3 = (uuid_of(i) for i in range(4))
MIG0, MIG1 = "MIG-aaaa0000-0000", "MIG-aaaa0001-0000"
ME = 77
TH = Thresholds(util_pct=90, window_s=20, memory_pct=95)
HINT = "restart the kernel and run %gpu pick"
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID", "AUTOGPU_PROVISIONED",
    "AUTOGPU_GRANT_CVD", "AUTOGPU_USE_LEASES", "AUTOGPU_BROKER_SOCKET", "AUTOGPU_SIMULATE",
)


@pytest.fixture(autouse=True)
def _clean(registry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    session.release()
    overload.reset_pending()
    overload.set_move_hint(None)
    yield
    session.release()
    overload.reset_pending()
    overload.set_move_hint(None)


def _gpu(
    index: int, uuid: str, *, used_gib: float = 1, util: float | None = 2.0,
    procs: tuple[ProcessSnapshot, ...] = (), total_gib: int = 80, **kw: object,
) -> DeviceSnapshot:
    return DeviceSnapshot(
        index=index, uuid=uuid, name="A100", memory_total_bytes=total_gib * GiB,
        memory_used_bytes=int(used_gib * GiB), memory_free_bytes=int((total_gib - used_gib) * GiB),
        utilization_pct=util, processes=procs, **kw,  # type: ignore[arg-type]
    )


BOB = ProcessSnapshot(pid=4242, used_memory_bytes=60 * GiB, user="bob")


def _snap(a: DeviceSnapshot | None = None, *others: DeviceSnapshot,
          t: float = 100.0) -> FleetSnapshot:
    """GPU 0 (``a``: by default 60 GiB of bob's, 97 % busy), GPU 1 idle with 79 GiB free,
    GPU 2 lost (or ``others``)."""
    if a is None:
        a = _gpu(0, U0, used_gib=60, util=97.0, procs=(BOB,))
    rest = others or (
        _gpu(1, U1),
        DeviceSnapshot(index=2, uuid=U2, name="A100", available=False, error="GPU is lost",
                       processes=None),
    )
    return FleetSnapshot(devices=(a, *rest), timestamp_s=t, backend="test")


def _series(uuid: str, points: list[tuple[float, float]]) -> DeviceSeries:
    values = np.full((len(points), len(METRICS)), np.nan)
    values[:, METRICS.index("utilization_pct")] = [u for _, u in points]
    return DeviceSeries(uuid, np.array([t for t, _ in points], dtype=float), values)


def _history(utils_a: list[float], step: float = 10.0) -> dict[str, DeviceSeries]:
    """GPU 0's utilisation, one sample every ``step`` s, the newest at t=100."""
    n = len(utils_a)
    return {U0: _series(U0, [(100.0 - (n - 1 - i) * step, u) for i, u in enumerate(utils_a)]),
            U1: _series(U1, [(100.0, 2.0)])}


# ---- the move hint and the thresholds -------------------------------------------------------


def test_the_move_hint_can_be_set_and_restored() -> None:
    assert overload.move_hint() == HINT
    overload.set_move_hint("run %gpu move")
    assert overload.move_hint() == "run %gpu move"
    overload.set_move_hint("")
    assert overload.move_hint() == HINT
    overload.set_move_hint("x")
    overload.set_move_hint(None)
    assert overload.move_hint() == HINT


def test_thresholds_default_to_the_configuration() -> None:
    assert Thresholds() == Thresholds(util_pct=90.0, window_s=30.0, memory_pct=95.0)
    assert Thresholds.from_config() == Thresholds(90.0, 30.0, 95.0)
    cfg = SimpleNamespace(overload_util_pct=80, overload_window_s="12", overload_memory_pct=50)
    got = Thresholds.from_config(cfg)
    assert got == Thresholds(80.0, 12.0, 50.0)
    assert [type(v) for v in (got.util_pct, got.window_s, got.memory_pct)] == [float] * 3


# ---- the warning in words -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alt", "text"),
    [
        (Alternative(U1, "GPU 1", 79 * GiB, 2.4), "GPU 1 (79.0 GiB free, 2% busy)"),
        (Alternative(U1, "GPU 1 MIG 0", None, None), "GPU 1 MIG 0 (? free, ? busy)"),
        (Alternative(U1, "GPU 3", 512, 99.6), "GPU 3 (512 B free, 100% busy)"),
    ],
)
def test_an_alternative_in_words(alt: Alternative, text: str) -> None:
    assert alt.describe() == text


def _overload(**kw: object) -> Overload:
    base: dict[str, object] = dict(
        uuid=U0, label="GPU 0", causes=("utilisation 96% for 20s (over 90%)",),
        other_process_count=1, other_memory_bytes=60 * GiB, users=("bob",),
        alternative=Alternative(U1, "GPU 1", 79 * GiB, 2.0), move="run %gpu move",
    )
    base.update(kw)
    return Overload(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "others"),
    [
        ({}, "1 other process holding 60.0 GiB (user bob)"),
        ({"other_process_count": 2, "users": ("bob", "carol")},
         "2 other processes holding 60.0 GiB (users bob, carol)"),
        ({"other_process_count": 0, "other_memory_bytes": None, "users": ()},
         "0 other processes"),
        ({"other_memory_bytes": 0, "users": ()}, "1 other process holding 0 B"),
    ],
)
def test_the_other_processes_in_words(kw: dict[str, object], others: str) -> None:
    assert _overload(**kw).others_text() == others


def test_the_warning_message_and_what_makes_it_the_same_warning() -> None:
    w = _overload(causes=("utilisation 96% for 20s (over 90%)", "memory 98% full (over 95%)"))
    assert w.message() == (
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 20s (over 90%); "
        "memory 98% full (over 95%), caused by 1 other process holding 60.0 GiB (user bob). "
        "Best alternative: move to GPU 1 (79.0 GiB free, 2% busy): run %gpu move."
    )
    assert w.key == (U0, "memory,utilisation")
    assert _overload().key == (U0, "utilisation")
    alone = _overload(alternative=None, users=(), other_memory_bytes=None)
    assert alone.message() == (
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 20s (over 90%), "
        "caused by 1 other process. Best alternative: no better device right now."
    )


# ---- this kernel's devices ------------------------------------------------------------------


def _fleet_devices() -> tuple[DeviceSnapshot, ...]:
    return (
        _gpu(0, U0), _gpu(1, U1), _gpu(2, U2),
        _gpu(3, U3, mig_enabled=True),
        _gpu(3, MIG0, is_mig=True, parent_uuid=U3, mig_index=0, total_gib=10),
        _gpu(3, MIG1, is_mig=True, parent_uuid=U3, mig_index=1, total_gib=10),
    )


@pytest.mark.parametrize(
    ("cvd", "uuids"),
    [
        (None, ()),
        ("", ()),
        ("1", (U1,)),
        (" 2 , 0", (U2, U0)),
        ("3", (U3,)),
        (U2, (U2,)),
        ("GPU-00000001", (U1,)),
        ("GPU-0000000", ()),
        ("MIG-aaaa0001", (MIG1,)),
        ("0,7,1", (U0,)),
        ("0,abc,1", (U0,)),
        ("1,GPU-0000000,0", (U1,)),
        ("+1,2gpu", (U1, U2)),  # CUDA reads the leading digits, like strtoul
        ("0,\u00b2", (U0,)),  # a superscript two is no index for CUDA (nor an error here)
        ("0,0", ()),  # a device listed twice: CUDA shows none
    ],
)
def test_the_kernels_devices_are_those_cuda_would_use(
    monkeypatch: pytest.MonkeyPatch, cvd: str | None, uuids: tuple[str, ...]
) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert overload.kernel_device_uuids(_fleet_devices(), env) == uuids
    if cvd is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert overload.kernel_device_uuids(_fleet_devices()) == uuids


def test_the_kernels_devices_are_its_autogpu_choice_first(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    monkeypatch.setenv("AUTOGPU_PICKED", ",")  # a choice of nothing: the variable decides
    assert overload.kernel_device_uuids(_fleet_devices(), env) == (U0,)
    monkeypatch.setenv("AUTOGPU_PICKED", f"{U2},{U1}")
    assert overload.kernel_device_uuids(_fleet_devices(), env) == (U2, U1)


# ---- how long a device has been busy --------------------------------------------------------


#: No window to wait and no memory cause: any busy stretch is a warning that says its length.
NO_WINDOW = Thresholds(util_pct=90, window_s=0, memory_pct=100)


def _busy_causes(history: object) -> list[str]:
    """The causes of the warnings on GPU 0 (bob's load) for ``history``, without a window."""
    found = overload.detect(history, _snap(), [U0], [ME], NO_WINDOW)  # type: ignore[arg-type]
    return [c for w in found for c in w.causes]


@pytest.mark.parametrize(
    ("points", "want"),
    [
        ([(80.0, 95.0), (90.0, 96.0), (100.0, 97.0)], (20.0, 96.0)),
        ([(80.0, 50.0), (90.0, 95.0), (100.0, 97.0)], (10.0, 96.0)),
        ([(80.0, 95.0), (90.0, float("nan")), (100.0, 97.0)], (0.0, 97.0)),
        ([(90.0, 90.0), (100.0, 95.0)], (0.0, 95.0)),
        ([(60.0, 40.0), (70.0, 91.0), (80.0, 50.0), (90.0, 92.0), (100.0, 98.0)], (10.0, 95.0)),
        ([(90.0, 97.0), (100.0, 90.0)], None),
        ([(100.0, float("nan"))], None),
        ([], None),
    ],
)
def test_busy_for_is_the_last_stretch_above_the_threshold(
    points: list[tuple[float, float]], want: tuple[float, float] | None
) -> None:
    """The warning's "utilisation M% for Ts": T is the last unbroken stretch above the
    threshold up to the newest sample (unknown breaks it), M its mean; none when the newest
    sample is not above. Read from the sampler's arrays and from its long table alike."""
    causes = [] if want is None else [f"utilisation {want[1]:.0f}% for {want[0]:.0f}s (over 90%)"]
    assert _busy_causes({U0: _series(U0, points)}) == causes
    frame = pd.DataFrame(
        [{"timestamp_s": t, "uuid": U0, "utilization_pct": u} for t, u in points]
        + [{"timestamp_s": 100.0, "uuid": U1, "utilization_pct": 99.0}],
        columns=["timestamp_s", "uuid", "utilization_pct"],
    )
    assert _busy_causes(frame) == causes


def test_busy_for_a_device_without_history_is_nothing() -> None:
    assert _busy_causes({U1: _series(U1, [(100.0, 99.0)])}) == []
    frame = pd.DataFrame([{"timestamp_s": 100.0, "uuid": U1, "utilization_pct": 99.0}])
    assert _busy_causes(frame) == []


# ---- detection ------------------------------------------------------------------------------


def _detect(snap: FleetSnapshot | None, history: object | None = None, th: Thresholds = TH,
            kernel: tuple[str, ...] = (U0,), **kw: object) -> list[Overload]:
    hist = _history([50, 95, 96, 97]) if history is None else history
    return overload.detect(hist, snap, kernel, [ME], th, **kw)  # type: ignore[arg-type]


UTIL_WARNING = (
    "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 20s (over 90%), "
    "caused by 1 other process holding 60.0 GiB (user bob). Best alternative: move to GPU 1 "
    "(79.0 GiB free, 2% busy): restart the kernel and run %gpu pick."
)


def test_sustained_load_by_another_user_warns_with_the_best_alternative() -> None:
    (w,) = _detect(_snap())
    assert w.message() == UTIL_WARNING
    assert (w.uuid, w.label, w.other_process_count, w.other_memory_bytes, w.users) == (
        U0, "GPU 0", 1, 60 * GiB, ("bob",)
    )
    assert w.alternative == Alternative(U1, "GPU 1", 79 * GiB, 2.0)
    frame = pd.DataFrame([
        {"timestamp_s": t, "uuid": U0, "utilization_pct": u}
        for t, u in ((70.0, 50.0), (80.0, 95.0), (90.0, 96.0), (100.0, 97.0))
    ])
    assert [x.message() for x in _detect(_snap(), frame)] == [UTIL_WARNING]


def test_the_load_must_last_the_whole_window() -> None:
    th = Thresholds(util_pct=90, window_s=20.5, memory_pct=95)
    assert _detect(_snap(), th=th) == []
    assert _detect(_snap(), _history([50, 50, 96, 97])) == []


def test_the_hint_of_the_moment_or_the_callers_says_how_to_move() -> None:
    overload.set_move_hint("run %gpu move")
    (w,) = _detect(_snap())
    assert w.move == "run %gpu move"
    (w,) = _detect(_snap(), move="ask your admin")
    assert w.move == "ask your admin"


@pytest.mark.parametrize(
    "procs",
    [
        (ProcessSnapshot(pid=ME, used_memory_bytes=60 * GiB),),
        (),
    ],
)
def test_no_warning_for_the_kernels_own_load_or_a_device_without_processes(
    procs: tuple[ProcessSnapshot, ...],
) -> None:
    assert _detect(_snap(_gpu(0, U0, used_gib=79, util=97.0, procs=procs))) == []


def test_no_warning_without_a_snapshot_or_for_a_lost_or_unknown_device() -> None:
    assert _detect(None) == []
    lost = DeviceSnapshot(index=0, uuid=U0, name="A100", available=False, processes=(BOB,))
    assert _detect(_snap(lost)) == []
    assert _detect(_snap(), kernel=("GPU-gone",)) == []


@pytest.mark.parametrize(
    ("used_gib", "procs", "causes", "others"),
    [
        (78, (BOB,), ("memory 98% full (over 95%)",),
         "1 other process holding 60.0 GiB (user bob)"),
        (76, (BOB,), (), ""),
        (78, (ProcessSnapshot(pid=ME, used_memory_bytes=20 * GiB),
              ProcessSnapshot(pid=5, used_memory_bytes=None, user="carol"),
              ProcessSnapshot(pid=6, used_memory_bytes=None, user="bob")),
         ("memory 98% full (over 95%)",), "2 other processes (users bob, carol)"),
        (78, (ProcessSnapshot(pid=ME, used_memory_bytes=40 * GiB), BOB,
              ProcessSnapshot(pid=6, used_memory_bytes=None)),
         ("memory 98% full (over 95%)",), "2 other processes holding 60.0 GiB (user bob)"),
        (78, (ProcessSnapshot(pid=ME, used_memory_bytes=60 * GiB), BOB), (), ""),
        (78, (ProcessSnapshot(pid=ME, used_memory_bytes=70 * GiB),
              ProcessSnapshot(pid=ME, used_memory_bytes=None), BOB), (), ""),
    ],
)
def test_nearly_full_memory_warns_at_once_when_others_hold_more(
    used_gib: int, procs: tuple[ProcessSnapshot, ...], causes: tuple[str, ...], others: str
) -> None:
    calm = _history([5])
    got = _detect(_snap(_gpu(0, U0, used_gib=used_gib, util=5.0, procs=procs)), calm)
    assert [w.causes for w in got] == ([causes] if causes else [])
    assert [w.others_text() for w in got] == ([others] if others else [])


def test_memory_at_exactly_the_threshold_or_of_unknown_size_does_not_warn() -> None:
    calm = _history([5])
    th = Thresholds(util_pct=90, window_s=20, memory_pct=97.5)
    assert _detect(_snap(_gpu(0, U0, used_gib=78, util=5.0, procs=(BOB,))), calm, th) == []
    zero = DeviceSnapshot(index=0, uuid=U0, name="A100", memory_total_bytes=0,
                          memory_used_bytes=5, processes=(BOB,))
    unknown = DeviceSnapshot(index=0, uuid=U0, name="A100", memory_total_bytes=80 * GiB,
                             memory_used_bytes=None, processes=(BOB,))
    assert _detect(_snap(zero), calm) == []
    assert _detect(_snap(unknown), calm) == []


def test_both_causes_and_every_overloaded_device_of_the_kernel() -> None:
    carol = ProcessSnapshot(pid=9, used_memory_bytes=70 * GiB, user="carol")
    a = _gpu(0, U0, used_gib=78, util=97.0, procs=(BOB,))
    b = _gpu(1, U1, used_gib=77, util=3.0, procs=(carol,))
    c = _gpu(2, U2, used_gib=0, util=0.0)
    history = {**_history([95, 95, 96, 97]), U1: _series(U1, [(100.0, 3.0)])}
    got = _detect(_snap(a, b, c), history, kernel=(U0, U1, U2))
    assert [w.message() for w in got] == [
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 30s (over 90%); "
        "memory 98% full (over 95%), caused by 1 other process holding 60.0 GiB (user bob). "
        "Best alternative: no better device right now.",
        "autogpu: GPU 1 (this kernel's GPU) is overloaded: memory 96% full (over 95%), caused by "
        "1 other process holding 70.0 GiB (user carol). Best alternative: no better device right "
        "now.",
    ]
    assert [w.key for w in got] == [(U0, "memory,utilisation"), (U1, "memory")]


def test_devices_of_the_kernel_with_nothing_to_say_do_not_hide_the_next_one() -> None:
    # The kernel's devices in its order: lost, only its own process, calm others, overloaded.
    lost = DeviceSnapshot(index=1, uuid=U1, name="A100", available=False, processes=(BOB,))
    mine = ProcessSnapshot(pid=ME, used_memory_bytes=79 * GiB)
    own = _gpu(2, U2, used_gib=79, util=97.0, procs=(mine,))
    calm = _gpu(3, U3, used_gib=10, util=3.0, procs=(BOB,))
    busy = _gpu(0, U0, used_gib=78, util=5.0, procs=(BOB,))
    history = {u: _series(u, [(100.0, 3.0)]) for u in (U0, U1, U2, U3)}
    got = _detect(_snap(busy, lost, own, calm), history, kernel=(U1, U2, U3, U0))
    assert [(w.uuid, w.causes) for w in got] == [(U0, ("memory 98% full (over 95%)",))]


def test_an_own_process_of_unknown_memory_counts_as_holding_none() -> None:
    # Others hold one byte, this kernel an amount NVML cannot tell: the others hold more.
    procs = (ProcessSnapshot(pid=ME, used_memory_bytes=None),
             ProcessSnapshot(pid=5, used_memory_bytes=1, user="carol"))
    got = _detect(_snap(_gpu(0, U0, used_gib=78, util=5.0, procs=procs)), _history([5]))
    assert [w.causes for w in got] == [("memory 98% full (over 95%)",)]


def test_the_alternative_is_ranked_on_the_smoothed_load() -> None:
    b = _gpu(1, U1, util=2.0)
    c = _gpu(2, U2, util=10.0)
    (w,) = _detect(_snap(None, b, c), smoothed_util={U1: 50.0, U2: 10.0})
    assert w.alternative == Alternative(U2, "GPU 2", 79 * GiB, 10.0)


# ---- the alternative ------------------------------------------------------------------------


def test_the_alternative_counts_other_holders_bookings(registry_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    registry = DirectoryStore(registry_dir)
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[U1], requested_bytes=70 * GiB)
    try:
        snap = _snap()
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 9 * GiB, 2.0)
        assert overload.best_alternative(snap, [U0], store=None) == Alternative(
            U1, "GPU 1", 79 * GiB, 2.0)
        assert overload.best_alternative(snap, [U0], store=registry) == Alternative(
            U1, "GPU 1", 9 * GiB, 2.0)
        # the lease is this kernel's own: it does not count against the alternative
        monkeypatch.setenv("AUTOGPU_PICKED", U0)
        monkeypatch.setenv("AUTOGPU_LEASE_ID", lease.record.lease_id)
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 79 * GiB, 2.0)
        monkeypatch.setenv("AUTOGPU_LEASE_ID", "")
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 9 * GiB, 2.0)
        monkeypatch.setenv("AUTOGPU_USE_LEASES", "0")
        monkeypatch.setenv("AUTOGPU_LEASE_ID", lease.record.lease_id)
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 79 * GiB, 2.0)
        monkeypatch.delenv("AUTOGPU_PICKED")
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 79 * GiB, 2.0)
    finally:
        lease.release()


def test_only_the_kernels_own_lease_is_hidden_from_the_alternative(
    registry_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = DirectoryStore(registry_dir)
    with registry.locked() as txn:
        assert txn is not None
        own = txn.create(devices=[U1], requested_bytes=50 * GiB)
        other = txn.create(devices=[U1], requested_bytes=20 * GiB)
    try:
        snap = _snap()
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 9 * GiB, 2.0)
        monkeypatch.setenv("AUTOGPU_PICKED", U0)
        monkeypatch.setenv("AUTOGPU_LEASE_ID", own.record.lease_id)
        # 79 GiB free less the other lease's 20 GiB: that booking still counts
        assert overload.best_alternative(snap, [U0]) == Alternative(U1, "GPU 1", 59 * GiB, 2.0)
    finally:
        other.release()
        own.release()


def test_the_alternative_fits_the_kernels_own_options(tmp_path: Path) -> None:
    snap = _snap(None, _gpu(1, U1, used_gib=40), _gpu(2, U2, used_gib=70))
    assert overload.best_alternative(snap, [U0], store=None) == Alternative(
        U1, "GPU 1", 40 * GiB, 2.0)
    big = Constraints(min_free=parse_size("50G"))
    assert overload.best_alternative(snap, [U0], store=None, constraints=big) is None
    # the kernel's pick was made with --min-free 50G: the same options bound its alternative
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"devices": [
        {"uuid": U0, "name": "A100", "memory_total": "80GiB", "memory_used": 0,
         "utilization_pct": 0}]}))
    env: dict[str, str] = {}
    result = pick(PickOptions(big), backend=SimulatedBackend(str(fleet)), environ=env, dry_run=True)
    session.apply(result, environ=env)
    assert overload.best_alternative(snap, [U0], store=None) is None
    session.release(environ=env)
    assert overload.best_alternative(snap, [U0], store=None) is not None


@pytest.mark.parametrize(
    ("env", "alt"),
    [
        ({}, U1),
        ({"CUDA_VISIBLE_DEVICES": "0"}, U1),  # the kernel's own narrowing: not a grant
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, U2),
        ({"CUDA_VISIBLE_DEVICES": "99"}, None),
        ({"AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": U0, "AUTOGPU_GRANT_CVD": "2,0"},
         U2),
        ({"AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": "2"}, U1),
    ],
)
def test_the_alternative_lies_in_the_grant_the_kernel_started_with(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], alt: str | None
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    snap = _snap(None, _gpu(1, U1, util=2.0), _gpu(2, U2, util=30.0))
    got = overload.best_alternative(snap, [U0], store=None)
    assert (got.uuid if got is not None else None) == alt
    # an explicit environment is taken as it is
    explicit = overload.best_alternative(snap, [U0], store=None,
                                         environ={"CUDA_VISIBLE_DEVICES": "0,2"})
    assert explicit is not None and explicit.uuid == U2


def test_after_a_pick_the_alternative_lies_in_the_grant_from_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the grant, e.g. a scheduler's
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"devices": [
        {"uuid": U0, "name": "A100", "memory_total": "80GiB", "memory_used": 0,
         "utilization_pct": 0}]}))
    result = pick(
        PickOptions(Constraints()), backend=SimulatedBackend(str(fleet)), environ={}
    )  # no lease
    session.apply(result)  # this process now has CUDA_VISIBLE_DEVICES=U0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U0
    snap = _snap(None, _gpu(1, U1, util=30.0), _gpu(2, U2, util=2.0))
    # GPU 2 is idler but outside the grant the kernel started with
    got = overload.best_alternative(snap, [U0], store=None)
    assert got == Alternative(U1, "GPU 1", 79 * GiB, 30.0)


def test_the_alternative_is_never_on_the_kernels_physical_gpu() -> None:
    devices = _fleet_devices()
    weak = _gpu(1, U1, used_gib=75, util=50.0)
    snap = FleetSnapshot(devices=(weak, *devices[3:]), timestamp_s=1.0, backend="test")
    on_gpu_1 = Alternative(U1, "GPU 1", 5 * GiB, 50.0)
    # a sibling MIG device shares the kernel's GPU: the weaker GPU 1 is the alternative
    assert overload.best_alternative(snap, [MIG0], store=None) == on_gpu_1
    assert overload.best_alternative(snap, [U3], store=None) == on_gpu_1
    assert overload.best_alternative(snap, [U1], store=None) == Alternative(
        MIG0, "GPU 3 MIG 0", 9 * GiB, 2.0)


def test_the_alternative_reports_the_smoothed_load_else_the_current_one() -> None:
    snap = _snap(None, _gpu(1, U1, util=2.0))
    assert overload.best_alternative(snap, [U0], {U1: 40.0}, store=None) == Alternative(
        U1, "GPU 1", 79 * GiB, 40.0)
    assert overload.best_alternative(snap, [U0], {U1: None}, store=None) == Alternative(
        U1, "GPU 1", 79 * GiB, 2.0)


def test_an_exclusive_gpu_this_process_already_uses_may_be_the_alternative() -> None:
    mine = ProcessSnapshot(pid=os.getpid(), used_memory_bytes=GiB)
    b = _gpu(1, U1, compute_mode="EXCLUSIVE_PROCESS", procs=(mine,))
    got = overload.best_alternative(_snap(None, b), [U0], store=None)
    assert got is not None and got.uuid == U1


# ---- from the sampler, and the once-only notice ---------------------------------------------


def _sampler(points: list[tuple[float, float]], *, interval_s: float = 1.0,
             b_util: float = 2.0) -> Sampler:
    """A sampler (never started) whose history has GPU 0 at ``points`` (time, utilisation)."""
    s = Sampler(interval_s=interval_s, history_s=900.0)
    for t, util in points:
        a = _gpu(0, U0, used_gib=60, util=util, procs=(BOB,))
        s.add(_snap(a, _gpu(1, U1, util=b_util), t=t), own=[ME])
    return s


def test_detect_from_the_sampler_reads_the_window_and_a_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    th = Thresholds(util_pct=90, window_s=30, memory_pct=99)
    # 33 s back (30 s and three 1 s intervals) is in reach; 34 s back is not
    s = _sampler([(66.0, 50.0), (67.0, 95.0), (100.0, 97.0)])
    (w,) = overload.detect_from_sampler(s, th, [U0])
    assert w.causes == ("utilisation 96% for 33s (over 90%)",)
    s = _sampler([(66.0, 95.0), (67.0, 95.0), (100.0, 97.0)])
    (w,) = overload.detect_from_sampler(s, th, [U0])
    assert w.causes == ("utilisation 96% for 33s (over 90%)",)
    # at least 1 s of history, however short the window
    th0 = Thresholds(util_pct=90, window_s=0, memory_pct=99)
    s = _sampler([(98.0, 95.0), (99.0, 95.0), (100.0, 97.0)], interval_s=0.1)
    (w,) = overload.detect_from_sampler(s, th0, [U0])
    assert w.causes == ("utilisation 96% for 1s (over 90%)",)
    assert overload.detect_from_sampler(s, th0, []) == []
    # the kernel's devices by default; none picked: nothing to say
    assert overload.detect_from_sampler(s, th0) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert len(overload.detect_from_sampler(s, th0)) == 1
    assert overload.detect_from_sampler(Sampler(), th0, [U0]) == []


def test_detect_from_the_sampler_ranks_the_alternative_on_the_last_minute() -> None:
    th = Thresholds(util_pct=90, window_s=0, memory_pct=99)
    s = Sampler(interval_s=1.0, history_s=900.0)
    for t, b_util in ((39.0, 100.0), (40.0, 40.0), (100.0, 20.0)):
        a = _gpu(0, U0, used_gib=60, util=97.0, procs=(BOB,))
        s.add(_snap(a, _gpu(1, U1, util=b_util), t=t), own=[ME])
    (w,) = overload.detect_from_sampler(s, th, [U0])
    assert w.alternative == Alternative(U1, "GPU 1", 79 * GiB, 30.0)
    # the sampler's own PIDs are the kernel's: its own load is no warning
    s.add(_snap(_gpu(0, U0, used_gib=60, util=97.0, procs=(BOB,)), t=101.0), own=[BOB.pid])
    assert overload.detect_from_sampler(s, th, [U0]) == []


def test_the_warning_is_announced_once_and_again_when_it_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert overload.pending_warning(TH) is None  # no sampler running
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    s = _sampler([(70.0, 95.0), (80.0, 95.0), (90.0, 96.0), (100.0, 97.0)])
    monkeypatch.setattr(overload, "current_sampler", lambda: s)  # the running one
    text = (
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 30s (over 90%), "
        "caused by 1 other process holding 60.0 GiB (user bob). Best alternative: move to GPU 1 "
        "(79.0 GiB free, 2% busy): restart the kernel and run %gpu pick."
    )
    assert overload.pending_warning() == text  # the configured thresholds: 90 % for 30 s
    assert overload.pending_warning() is None
    overload.reset_pending()
    assert overload.pending_warning() == text
    s.add(_snap(_gpu(0, U0, used_gib=60, util=5.0, procs=(BOB,)), _gpu(1, U1), t=110.0),
          own=[ME])
    assert overload.pending_warning(TH) is None
    for t in (120.0, 130.0, 140.0):
        s.add(_snap(t=t), own=[ME])
    assert overload.pending_warning(TH) == text.replace("96% for 30s", "97% for 20s")
    assert overload.pending_warning(TH) is None


def test_a_new_cause_on_the_same_device_is_announced_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    carol = ProcessSnapshot(pid=9, used_memory_bytes=70 * GiB, user="carol")
    s = Sampler(interval_s=1.0, history_s=900.0)
    for t in (70.0, 80.0, 90.0, 100.0):
        busy = _gpu(1, U1, used_gib=10, util=97.0, procs=(carol,))
        s.add(_snap(None, busy, _gpu(2, U2), t=t), own=[ME])
    monkeypatch.setattr(overload, "current_sampler", lambda: s)  # the running one
    first = overload.pending_warning(TH)
    assert first is not None and first.splitlines() == [
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 97% for 20s (over 90%), "
        "caused by 1 other process holding 60.0 GiB (user bob). Best alternative: move to GPU 2 "
        "(79.0 GiB free, 2% busy): restart the kernel and run %gpu pick.",
        "autogpu: GPU 1 (this kernel's GPU) is overloaded: utilisation 97% for 20s (over 90%), "
        "caused by 1 other process holding 70.0 GiB (user carol). Best alternative: move to "
        "GPU 2 (79.0 GiB free, 2% busy): restart the kernel and run %gpu pick.",
    ]
    s.add(_snap(_gpu(0, U0, used_gib=78, util=97.0, procs=(BOB,)),
                _gpu(1, U1, used_gib=10, util=97.0, procs=(carol,)), _gpu(2, U2), t=110.0),
          own=[ME])
    second = overload.pending_warning(TH)
    assert second == (
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 97% for 20s (over 90%); "
        "memory 98% full (over 95%), caused by 1 other process holding 60.0 GiB (user bob). "
        "Best alternative: move to GPU 2 (79.0 GiB free, 2% busy): restart the kernel and run "
        "%gpu pick."
    )


# ---- one "better GPU" answer, wherever it is asked -------------------------------------------


def test_the_alternative_is_judged_by_the_kernels_lease_as_the_server_judges_it(
    registry_dir: Path,
) -> None:
    """The kernel's warning and the server's notification ask the same question: the memory
    the kernel's own lease books, as many devices, the same exclusivity; the pick's --exclude
    is no part of it (a pick from the sidebar excludes every other GPU)."""
    from autogpu_jupyter.core.leasing.records import LeaseRecord

    record = LeaseRecord(
        lease_id="a" * 32, kind="lease", device_uuids=(U0,),
        device_requested_bytes=(30 * GiB,), exclusive=True, user="me", uid=0, host="h",
        pid=1, created_s=0.0,
    )
    assert overload.alternative_constraints(record) == Constraints(
        min_free=Size(bytes=30 * GiB), count=1, exclusive=True)
    # the lease wins over the options the kernel remembers (which the server cannot know)
    picked = Constraints(exclude=("1", "2"), max_util_pct=10.0)
    assert overload.alternative_constraints(record, picked).exclude == ()
    assert overload.alternative_constraints(record, picked).max_util_pct is None
    # no lease (leases off): the kernel's options, less --exclude
    assert overload.alternative_constraints(None, picked) == Constraints(max_util_pct=10.0)
    assert overload.alternative_constraints(None) == Constraints()
    unbooked = LeaseRecord(
        lease_id="b" * 32, kind="lease", device_uuids=(U0, U1),
        device_requested_bytes=(None, None), exclusive=False, user="me", uid=0, host="h",
        pid=1, created_s=0.0,
    )
    assert overload.alternative_constraints(unbooked) == Constraints(count=2)


def test_a_pick_that_excluded_every_other_gpu_still_gets_a_better_one(tmp_path: Path) -> None:
    """The sidebar's pick leaves every other GPU out: its warning must not say "no better
    device right now" when GPU 1 is idle (the notification and the sidebar name GPU 1)."""
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"devices": [
        {"uuid": U0, "name": "A100", "memory_total": "80GiB", "memory_used": 0,
         "utilization_pct": 0},
        {"uuid": U1, "name": "A100", "memory_total": "80GiB", "memory_used": 0,
         "utilization_pct": 0}]}))
    result = pick(PickOptions(Constraints(exclude=(U1,))), backend=SimulatedBackend(str(fleet)),
                  environ={}, dry_run=True)
    env: dict[str, str] = {}
    session.apply(result, environ=env, source="sidebar")
    snap = _snap(None, _gpu(1, U1))
    got = overload.best_alternative(snap, [U0], store=None)
    assert got is not None and got.uuid == U1
    session.release(environ=env)


# ---- the better device's constraints: the kernel's own lease ----
# Found by the mutation run of issue 22.
class _Store:
    """A lease store's ``list_leases``, counting the reads."""

    def __init__(self, records: list[Any]) -> None:
        self.records = records
        self.reads = 0

    def list_leases(self) -> list[Any]:
        self.reads += 1
        return self.records


_A = SimpleNamespace(lease_id="aaaa")
_B = SimpleNamespace(lease_id="bbbb")
_NONE_ID = SimpleNamespace(lease_id=None)


def test_own_lease_is_the_picks_lease_else_the_stores_record_by_id() -> None:
    """The lease that bounds the better device: the pick's own (the store not read), else the
    store's record of the id the provisioner passed down, else none. What it does to the
    alternative is seen through ``best_alternative`` below.

    A reasoned private seam: that a held lease costs no store read, and that an id the store
    does not list is no lease, change no alternative a user sees (the answer is the same either
    way); they are checked on the lookup itself."""
    held = SimpleNamespace(lease=SimpleNamespace(record="the held record"), lease_id="bbbb")
    store = _Store([_NONE_ID, _A, _B])
    assert overload._own_lease(held, store) == "the held record"
    assert store.reads == 0
    provisioned = SimpleNamespace(lease=None, lease_id="bbbb")
    assert overload._own_lease(provisioned, store) is _B
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id="aaaa"), store) is _A
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id="cccc"), store) is None
    assert store.reads == 3
    assert overload._own_lease(provisioned, None) is None


@pytest.mark.parametrize("lease_id", [None, ""])
def test_own_lease_without_a_lease_id_reads_no_store(lease_id: str | None) -> None:
    """A reasoned private seam, as above: no store read without a lease id is a cost, not an
    answer."""
    store = _Store([_NONE_ID, SimpleNamespace(lease_id="")])
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id=lease_id), store) is None
    assert store.reads == 0


@pytest.fixture
def _kernel(registry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DirectoryStore]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    session.release()
    yield DirectoryStore(registry_dir)
    session.release()


def _own(registry: DirectoryStore, device: str, gib: int) -> Any:
    with registry.locked() as txn:
        assert txn is not None
        return txn.create(devices=[device], requested_bytes=gib * GiB)


def _with_u1(used_gib: int) -> FleetSnapshot:
    return _snap(None, _gpu(1, U1, used_gib=used_gib))


def test_a_provisioned_kernels_alternative_needs_what_its_lease_books(
    _kernel: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease the provisioner took (70 GiB on GPU 0), read from the configured store by the
    id passed down: GPU 1 with 40 GiB free is no alternative, with 75 GiB it is. Caught: the
    kernel's constraints asked afresh when given, or never, or without its lease (``None``, no
    choice, no store)."""
    own = _own(_kernel, U0, 70)
    try:
        monkeypatch.setenv("AUTOGPU_PICKED", U0)
        monkeypatch.setenv("AUTOGPU_LEASE_ID", own.record.lease_id)
        assert overload.best_alternative(_with_u1(40), [U0]) is None
        assert overload.best_alternative(_with_u1(5), [U0]) == Alternative(
            U1, "GPU 1", 75 * GiB, 2.0)
        # constraints the caller gives are used as given
        assert overload.best_alternative(
            _with_u1(40), [U0], constraints=Constraints()) == Alternative(
            U1, "GPU 1", 40 * GiB, 2.0)
    finally:
        own.release()


@pytest.mark.parametrize("store", ["config", None])
def test_a_kernels_alternative_needs_what_its_held_lease_books(
    _kernel: DirectoryStore, monkeypatch: pytest.MonkeyPatch, store: str | None
) -> None:
    """A pick made in the kernel holds its lease (70 GiB): its record bounds the alternative,
    with the configured store or none. Caught: the held lease's record not looked up (``None``,
    a misspelt ``lease`` or ``record``)."""
    own = _own(_kernel, U0, 70)
    try:
        choice = session.Choice(uuids=(U0,), lease=own)
        monkeypatch.setattr(session, "current", lambda: choice)
        assert overload.best_alternative(_with_u1(40), [U0], store=store) is None
        assert overload.best_alternative(_with_u1(5), [U0], store=store) == Alternative(
            U1, "GPU 1", 75 * GiB, 2.0)
    finally:
        own.release()


def test_without_a_lease_the_alternative_needs_the_picks_own_options(
    _kernel: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the pick's constraints dropped (``None``) or passed as the lease."""
    choice = session.Choice(uuids=(U0,), constraints=Constraints(min_free=parse_size("50G")))
    monkeypatch.setattr(session, "current", lambda: choice)
    assert overload.best_alternative(_with_u1(40), [U0]) is None
    assert overload.best_alternative(_with_u1(20), [U0]) == Alternative(
        U1, "GPU 1", 60 * GiB, 2.0)


def test_the_processes_the_caller_names_are_the_kernels_own() -> None:
    """The server asks for its kernels: their PIDs, not its own, make an exclusive GPU theirs.
    Caught: ``self_pids`` ignored (this process's PID used)."""
    pid = os.getpid() + 1_000_000
    mine = ProcessSnapshot(pid=pid, used_memory_bytes=GiB)
    b = _gpu(1, U1, compute_mode="EXCLUSIVE_PROCESS", procs=(mine,))
    got = overload.best_alternative(_snap(None, b), [U0], store=None, self_pids=[pid])
    assert got is not None and got.uuid == U1
    assert overload.best_alternative(_snap(None, b), [U0], store=None) is None
