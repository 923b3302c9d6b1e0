"""``server.payloads``' select, holders and history answers, whole, in-process: the survivors
of the full mutation run (issue 22) in ``select_payload``, ``select_answer``,
``holders_payload``, ``history_payload``, ``parse_constraints`` and their helpers.

Most tests drive the payloads with a stand-in for the server's state (a real
:class:`~autogpu_jupyter.core.sampler.Sampler` fed snapshots at chosen times, no thread); the
holders tests use the real state of :func:`tests.payloadhelpers.server_state`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import SampleError, Sampler
from autogpu_jupyter.errors import (
    AutoGPUError,
    NoDeviceFitsError,
    NVMLUnavailableError,
    RegistryError,
    UsageErrorBase,
)
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import current_user
from tests.payloadhelpers import GiB, Kernels, server_state, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
C = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
#: Device uuids whose device order is the reverse of their sorted order.
LATE = "GPU-ffffffff-1111-2222-3333-444444444444"
EARLY = "GPU-00000000-1111-2222-3333-444444444444"
ME = current_user()


def device(index: int, uuid: str, used_gib: int = 0, util: float | None = 0.0, *,
           total_gib: int | None = 80) -> DeviceSnapshot:
    total = None if total_gib is None else total_gib * GiB
    return DeviceSnapshot(
        index=index, uuid=uuid, name="NVIDIA A100", memory_total_bytes=total,
        memory_used_bytes=used_gib * GiB,
        memory_free_bytes=None if total is None else total - used_gib * GiB,
        utilization_pct=util)


def fleet_at(t: float, *devices: DeviceSnapshot) -> FleetSnapshot:
    return FleetSnapshot(devices=devices, timestamp_s=t, backend="simulated", simulated=True)


#: GPU 0 30 of 80 GiB used at 40 %, GPU 1 empty and idle, swept at t = 100 s.
SNAP = fleet_at(100.0, device(0, A, 30, 40.0), device(1, B))


def sampler_of(*snaps: FleetSnapshot) -> Sampler:
    """A sampler that holds these sweeps (no thread, no backend)."""
    sampler = Sampler(interval_s=1.0, history_s=86400.0)
    for snap in snaps:
        sampler.add(snap, own=())
    return sampler


def state_of(sampler: Any, **traits: Any) -> Any:
    """The server's state as the payloads read it."""
    values: dict[str, Any] = {
        "interval_s": 1.0, "history_s": 900.0, "max_history_points": 100,
        "smoothing_window_s": 60.0, "sampler_error": None, "user": ME,
        "expose_commands": False, "registry_dir": "/srv/autogpu/registry", "parent": None,
        "registry": lambda: None, **traits}
    return SimpleNamespace(sampler=lambda: sampler, **values)


def failing(err: BaseException) -> Any:
    def raise_it(*_args: Any, **_kwargs: Any) -> Any:
        raise err
    return raise_it


def candidate(uuid: str, label: str, free_gib: int, util: float | None, *,
              reasons: tuple[str, ...] = (), leases: int = 0) -> dict[str, Any]:
    return {"uuid": uuid, "label": label, "name": "NVIDIA A100", "eligible": not reasons,
            "reasons": list(reasons), "effective_free_bytes": free_gib * GiB,
            "smoothed_util_pct": util, "lease_count": leases}


NO_CONSTRAINTS = {"count": 1, "exclude": [], "exclusive": False, "max_util_pct": None,
                  "min_free": None, "models": [], "prefer": [], "devices": []}


# ---- the small helpers ---------------------------------------------------------------------


def test_numbers_of_the_history_are_finite_or_none() -> None:
    """Caught: an infinite value kept (JSON has no infinity: the answer would not serialise);
    ``None`` turned into ``int(None)`` (a TypeError for every unknown memory reading)."""
    values = (None, "x", [1], float("nan"), float("inf"), -math.inf, "2.5", 3)
    assert [payloads._finite(v) for v in values] == [None, None, None, None, None, None, 2.5,
                                                     3.0]
    assert [payloads._int_or_none(v) for v in (None, float("nan"), 7.9, "12")] == [
        None, None, 7, 12]


def warning(causes: tuple[str, ...], others: int, better: str | None) -> Any:
    return SimpleNamespace(label="GPU 0", causes=causes, other_process_count=others,
                           alternative=None if better is None else SimpleNamespace(label=better))


@pytest.mark.parametrize(("w", "text"), [
    (warning(("memory 98% full (over 95%)", "util 99%"), 1, None),
     "GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 1 other process."),
    (warning((), 2, "GPU 1"),
     "GPU 0 (this kernel's GPU) is overloaded: busy, 2 other processes. Better now: GPU 1."),
    (warning(("util 99% for 60 s",), 0, None),
     "GPU 0 (this kernel's GPU) is overloaded: util 99% for 60 s, 0 other processes."),
])
def test_an_overload_is_one_short_sentence(w: Any, text: str) -> None:
    """Caught: the plural's "es" altered or never written; a warning without causes read at
    its first cause (an IndexError) or called "BUSY"."""
    assert payloads._overload_summary(w) == text


def test_a_read_failure_at_the_time_of_the_newest_sweep_is_current() -> None:
    """A failure stamped the same second as the newest good sweep is not healed by it (no sweep
    came after it). Caught: the comparison made strict (the failure hidden)."""
    latest = SimpleNamespace(timestamp_s=5.0)
    for when, current in ((5.0, True), (4.0, False), (6.0, True)):
        sampler = SimpleNamespace(errors=(SampleError(when, "read failed"),),
                                  latest=lambda: latest)
        state = state_of(sampler, sampler_error="backend gone")
        assert payloads._sampler_errors(state) == (
            ["backend gone", "read failed"] if current else ["backend gone"])


def test_lease_records_leave_tickets_out_unless_asked() -> None:
    """Caught: tickets listed by default (``gpu_kernel_ids`` would count a kernel waiting in
    line as holding a GPU)."""
    asked: list[bool] = []

    def list_leases(include_tickets: bool) -> list[str]:
        asked.append(include_tickets)
        return ["record"]

    state = state_of(None, registry=lambda: SimpleNamespace(list_leases=list_leases))
    assert payloads._lease_records(state) == (["record"], [])
    assert payloads._lease_records(state, include_tickets=True) == (["record"], [])
    assert asked == [False, True]


@pytest.mark.parametrize(("err", "message"), [
    (PermissionError(13, "Permission denied", "/srv/autogpu/registry"),
     "lease registry '/srv/autogpu/registry': Permission denied"),
    (OSError("disk gone"), "lease registry '/srv/autogpu/registry': disk gone"),
    (RegistryError("registry is world-writable"), "lease registry: registry is world-writable"),
])
def test_an_unreadable_registry_is_named_with_the_reason(err: Exception, message: str) -> None:
    """Caught: the OS error's own words replaced by its repr-like text (``[Errno 13] ...``) or
    by ``None`` when it has none."""
    state = state_of(None, registry=failing(err))
    assert payloads._lease_records(state) == ([], [message])


# ---- parse_constraints ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [{"wait": "5s"}, {"wait": None}, {"min_free": "1G",
                                                                    "wait": 0}])
def test_select_takes_no_wait_and_names_its_parameters_as_json_keys(params: dict[str, Any]
                                                                    ) -> None:
    """A dry run never waits: ``wait`` is an unknown parameter of ``select``, and the accepted
    ones are named as the request writes them. Caught: every pick option accepted (``wait``
    too); the names given as the magic's flags (``--min-free``)."""
    with pytest.raises(UsageErrorBase) as info:
        payloads.parse_constraints(params)
    assert str(info.value) == ("unknown parameter 'wait'; accepted: count, devices, exclude, "
                               "exclusive, kernel_id, max_util, min_free, model, prefer")


@pytest.mark.parametrize(("params", "message"), [
    ({"min_free": 1024}, 'invalid min_free=1024: expected a string such as "10G"'),
    ({"count": True}, "invalid count True: expected a whole number >= 1"),
    ({"count": "zero"}, "invalid count 'zero': expected a whole number >= 1, e.g. 2"),
])
def test_select_constraints_are_checked_as_json_values(params: dict[str, Any],
                                                       message: str) -> None:
    """In JSON a bare number of bytes is ambiguous ("10" of what?): a string is asked for.
    Caught: the values checked as the magic's (flag style: 1024 taken as 1 KiB, a boolean as a
    count, the message naming ``--count``)."""
    got = payloads.parse_constraints({"min_free": "10G", "count": 2, "kernel_id": "k-1"})
    assert got == Constraints.parse(min_free="10G", count=2)
    with pytest.raises(UsageErrorBase) as info:
        payloads.parse_constraints(params)
    assert str(info.value) == message


# ---- select_answer -------------------------------------------------------------------------


def test_the_select_answer_whole() -> None:
    """Caught: any key of the answer or of a candidate misspelt (``notes``, ``allocation``,
    ``name``, ``reasons``, ``smoothed_util_pct``); no notes given answered as ``null``."""
    assert payloads.select_answer(SNAP, Constraints(), None, environ={}) == {
        "constraints": NO_CONSTRAINTS, "constraints_text": "no constraints",
        "simulated": True, "timestamp_s": 100.0, "notes": [],
        "chosen": [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}],
        "candidates": [candidate(B, "GPU 1", 80, 0.0), candidate(A, "GPU 0", 50, 40.0)],
        "allocation": "no GPU restriction (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES and "
                      "SLURM_*_GPUS set no limit): every GPU is granted",
        "message": None,
    }


def test_the_select_answer_when_nothing_fits_whole() -> None:
    answer = payloads.select_answer(SNAP, Constraints.parse(min_free="500G"), None, environ={},
                                    notes=["lease registry unusable"])
    assert {k: v for k, v in answer.items() if k != "constraints"} == {
        "constraints_text": "min free 500.0 GiB", "simulated": True, "timestamp_s": 100.0,
        "notes": ["lease registry unusable"], "chosen": [],
        "candidates": [
            candidate(A, "GPU 0", 50, 40.0, reasons=("only 50.0 GiB free < 500.0 GiB wanted",)),
            candidate(B, "GPU 1", 80, 0.0, reasons=("only 80.0 GiB free < 500.0 GiB wanted",))],
        "message": "no device fits (min free 500.0 GiB):",
    }


def test_the_select_answer_when_the_server_is_granted_no_gpu_whole() -> None:
    """Caught: ``chosen``, ``candidates`` or ``message`` misspelt, or the message lost, in the
    answer of a server whose own allocation grants no GPU."""
    answer = payloads.select_answer(SNAP, Constraints(), None,
                                    environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert answer == {
        "constraints": NO_CONSTRAINTS, "constraints_text": "no constraints", "simulated": True,
        "timestamp_s": 100.0, "notes": [], "chosen": [], "candidates": [],
        "message": "no GPU granted to this process: CUDA_VISIBLE_DEVICES='-1' grants no GPU to "
                   "this process (CUDA_VISIBLE_DEVICES='-1' hides every GPU from CUDA)",
    }


def test_select_answer_keeps_the_notes_it_is_given() -> None:
    """Caught: the caller's notes replaced by an empty list (the registry's trouble unsaid)."""
    notes = ["lease registry unusable, bookings not counted: no flock"]
    answer = payloads.select_answer(SNAP, Constraints(), None, notes=notes, environ={})
    assert answer["notes"] is notes and notes == [
        "lease registry unusable, bookings not counted: no flock"]


def test_select_answer_without_a_registry_hides_nothing() -> None:
    """A kernel's own lease is hidden only where there is a registry. Caught: ``hiding`` asked
    of no registry (an AttributeError for a server without one)."""
    answer = payloads.select_answer(SNAP, Constraints(), None, ignore_kernel_id="k-1",
                                    environ={})
    assert answer["chosen"] == [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}]


def test_select_answer_ranks_on_the_smoothed_load() -> None:
    """GPU 1 reads idle now but was busy over the window: ``--max-util 50`` keeps off it.
    Caught: the smoothed load not passed to the pick (the instant reading decided)."""
    answer = payloads.select_answer(SNAP, Constraints.parse(max_util="50"), None,
                                    smoothed={A: 20.0, B: 90.0}, environ={})
    assert answer["chosen"] == [{"uuid": A, "label": "GPU 0", "name": "NVIDIA A100"}]
    assert [(c["uuid"], c["eligible"], c["smoothed_util_pct"]) for c in answer["candidates"]] \
        == [(A, True, 20.0), (B, False, 90.0)]


@pytest.mark.parametrize("ranking", [None, ["not", "a", "tuple"]])
def test_a_no_fit_without_a_ranking_lists_no_candidates(
    monkeypatch: pytest.MonkeyPatch, ranking: Any
) -> None:
    """A ``NoDeviceFitsError`` may carry anything as its candidates (``object``): only a tuple
    of candidates is listed. Caught: whatever it carries read as candidates."""
    monkeypatch.setattr(payloads, "pick", failing(NoDeviceFitsError(
        "no device free: GPU 1 is held exclusively\nby bob", candidates=ranking)))
    answer = payloads.select_answer(SNAP, Constraints(), None, environ={})
    assert (answer["chosen"], answer["candidates"], answer["message"]) == (
        [], [], "no device free: GPU 1 is held exclusively")


# ---- select_payload ------------------------------------------------------------------------


def test_select_before_any_sweep_says_why() -> None:
    """Caught: the message lost, altered, or its reasons joined otherwise."""
    with pytest.raises(NVMLUnavailableError) as info:
        payloads.select_payload(state_of(None), Constraints())
    assert str(info.value) == "no GPU data: the sampler has no sample yet"
    failed = SimpleNamespace(latest=lambda: None, errors=(SampleError(5.0, "read failed"),))
    with pytest.raises(NVMLUnavailableError) as info:
        payloads.select_payload(state_of(failed, sampler_error="backend gone"), Constraints())
    assert str(info.value) == "no GPU data: backend gone; read failed"


def test_select_ranks_on_the_load_over_the_servers_smoothing_window() -> None:
    """GPU 1 was fully busy until t = 100 s and idle at 130 s: over a 60 s window its load is
    50 % (``--max-util 40`` keeps off it), over a 10 s window 0 %. Caught: the smoothed load
    left out (the instant reading decided), or asked over the whole history."""
    busy = [fleet_at(t, device(0, A, 30, 20.0), device(1, B, 0, 100.0)) for t in (0.0, 100.0)]
    idle = fleet_at(130.0, device(0, A, 30, 20.0), device(1, B, 0, 0.0))
    sampler = sampler_of(*busy, idle)
    want = Constraints.parse(max_util="40")
    wide = payloads.select_payload(state_of(sampler, smoothing_window_s=60.0), want, environ={})
    narrow = payloads.select_payload(state_of(sampler, smoothing_window_s=10.0), want,
                                     environ={})
    assert [(c["uuid"], c["eligible"], c["smoothed_util_pct"]) for c in wide["candidates"]] \
        == [(A, True, 20.0), (B, False, 50.0)]
    assert [c["uuid"] for c in narrow["chosen"]] == [B]
    assert {c["uuid"]: c["smoothed_util_pct"] for c in narrow["candidates"]} == {A: 20.0, B: 0.0}


def test_select_with_a_sampler_that_does_not_smooth() -> None:
    """A sampler without ``smoothed_util`` (an older one): the instant reading ranks. Caught: it
    asked all the same (an AttributeError)."""
    plain = SimpleNamespace(latest=lambda: SNAP, errors=())
    answer = payloads.select_payload(state_of(plain), Constraints(), environ={})
    assert answer["chosen"] == [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}]


def test_select_with_an_unusable_registry_answers_with_a_note() -> None:
    """Caught: the note lost, written as ``null``, or no list to write it to; the failed
    registry passed on as a store (an AttributeError, the select answered 500)."""
    state = state_of(sampler_of(SNAP), registry=failing(RegistryError("no flock on /nfs")))
    answer = payloads.select_payload(state, Constraints(), ignore_kernel_id="k-1", environ={})
    assert answer["notes"] == ["lease registry unusable, bookings not counted: no flock on /nfs"]
    assert answer["chosen"] == [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}]


def test_select_for_an_autogpu_kernel_ranks_within_its_grant(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """An autogpu kernel on GPU 2 was picked within the server's grant of GPUs 1 and 2: its
    recommendation ranks both (GPU 1 the emptier), not only the one it holds. Caught: the
    kernel's environment taken as is (its own pick as the whole grant)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    snap = fleet_at(100.0, device(0, A, 0), device(1, B, 10), device(2, C, 60))
    kernel = {"AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": C,
              "AUTOGPU_GRANT_CVD": f"{B},{C}"}
    answer = payloads.select_payload(state_of(sampler_of(snap)), Constraints(), environ=kernel)
    assert answer["chosen"] == [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}]
    assert [c["uuid"] for c in answer["candidates"] if c["eligible"]] == [B, C]


# ---- history_payload -----------------------------------------------------------------------


def empty_history(since_s: float | None, errors: list[str]) -> dict[str, Any]:
    return {"interval_s": 2.0, "history_s": 600.0, "since_s": since_s, "until_s": since_s,
            "series": [], "errors": errors}


def test_history_without_a_sampler_or_a_sample_whole() -> None:
    """Caught: ``until_s`` or ``series`` misspelt in the answer before any sample."""
    traits = {"interval_s": 2.0, "history_s": 600.0, "sampler_error": "no NVML"}
    assert payloads.history_payload(state_of(None, **traits), 7.5) == empty_history(
        7.5, ["no NVML"])
    assert payloads.history_payload(state_of(sampler_of(), **traits), None) == empty_history(
        None, ["no NVML"])


def test_history_of_one_sample_whole() -> None:
    """Caught: a history of one row answered as empty; unknown readings not ``null``."""
    snap = fleet_at(100.0, device(0, A, 30, None))
    state = state_of(sampler_of(snap), interval_s=2.0, history_s=600.0)
    assert payloads.history_payload(state, None) == {
        "interval_s": 2.0, "history_s": 600.0, "since_s": None, "until_s": 100.0,
        "series": [{"uuid": A, "timestamp_s": [100.0], "utilization_pct": [None],
                    "memory_used_bytes": [30 * GiB], "memory_total_bytes": 80 * GiB}],
        "errors": [],
    }


def test_history_series_in_device_order_each_capped_to_its_newest_points() -> None:
    """LATE (GPU 0) and EARLY (GPU 1, its total memory unknown) at t = 100 s, then LATE alone at
    101 s. One point per series: the newest. Caught: the series sorted by uuid, two points kept
    where one is asked, an unknown total read (an IndexError), the end of the answer taken from
    the last series rather than the newest point."""
    first = fleet_at(100.0, device(0, LATE, 10, 5.0), device(1, EARLY, 20, 7.0, total_gib=None))
    second = fleet_at(101.0, device(0, LATE, 11, 6.0))
    state = state_of(sampler_of(first, second), max_history_points=1)
    answer = payloads.history_payload(state, None)
    assert answer["series"] == [
        {"uuid": LATE, "timestamp_s": [101.0], "utilization_pct": [6.0],
         "memory_used_bytes": [11 * GiB], "memory_total_bytes": 80 * GiB},
        {"uuid": EARLY, "timestamp_s": [100.0], "utilization_pct": [7.0],
         "memory_used_bytes": [20 * GiB], "memory_total_bytes": None},
    ]
    assert answer["until_s"] == 101.0
    # max_history_points 0 still answers the newest point
    assert [s["timestamp_s"] for s in payloads.history_payload(
        state_of(sampler_of(first, second), max_history_points=0), None)["series"]] == [
        [101.0], [100.0]]


def test_history_ends_at_the_first_of_two_equal_newest_points() -> None:
    """Two series that end at the same time (-0.0 and 0.0 compare equal): the answer's end is
    the first one's. Caught: a later series' equal end taken (``>=``)."""
    state = state_of(sampler_of(fleet_at(-0.0, device(0, A)), fleet_at(0.0, device(1, B))))
    until = payloads.history_payload(state, None)["until_s"]
    assert until == 0.0 and math.copysign(1.0, until) == -1.0


def test_history_since_asks_the_sampler_only_for_the_window_since_then() -> None:
    """The window is relative to the newest sample: since - one interval. After the clock
    stepped back (a sweep at 300 s, then 98.5 s and 100 s) a client that last saw 250 s gets no
    point: the old one ahead of the clock is not in the window. Caught: the window left out,
    widened (``latest + since``, at least 1 s instead of 0), or computed only without a latest
    sample; in a plain history, the sampler asked for everything."""
    sweeps = [fleet_at(t, device(0, A)) for t in (300.0, 98.5, 100.0)]
    state = state_of(sampler_of(*sweeps), interval_s=1.0)
    assert payloads.history_payload(state, 250.0) == {
        **empty_history(250.0, []), "interval_s": 1.0, "history_s": 900.0}

    sampler = sampler_of(*[fleet_at(float(t), device(0, A)) for t in range(100, 111)])
    asked: list[float | None] = []
    frame = sampler.history_frame

    def history_frame(since_s: float | None = None) -> Any:
        asked.append(since_s)
        return frame(since_s)

    sampler.history_frame = history_frame  # type: ignore[method-assign]
    state = state_of(sampler, interval_s=1.0)
    (series,) = payloads.history_payload(state, 105.0)["series"]
    assert series["timestamp_s"] == [106.0, 107.0, 108.0, 109.0, 110.0]
    assert payloads.history_payload(state, 200.0)["series"] == []  # a client ahead of us
    assert asked == [6.0, 1.0]


# ---- holders_payload -----------------------------------------------------------------------


@pytest.fixture
def kernels() -> Iterator[Kernels]:
    k = Kernels("k-1", "k-2")
    yield k
    k.close()


def test_holders_without_kernels_or_a_sample_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with no kernel manager before its first sweep; the registry fails. Caught: the
    kernel manager's kernels asked of ``None``; the answer dated or marked simulated from a
    sweep there is none of; the registry's error left out, or listed as ``null``."""
    state = state_of(None, sampler_error="no NVML",
                     registry=failing(AutoGPUError("registry is world-writable")))
    before = time.time()
    answer = payloads.holders_payload(state, None, {})
    assert before <= answer.pop("timestamp_s") <= time.time()
    assert answer == {"simulated": False, "user": ME, "holders": [], "kernels": [],
                      "errors": ["no NVML", "lease registry: registry is world-writable"]}


def fleet(kernels: Kernels) -> list[dict[str, Any]]:
    """GPU 0 with k-1's process and bob's, GPU 1 empty."""
    return [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 30 * GiB,
         "utilization_pct": 10, "processes": [
             {"pid": kernels.pid("k-1"), "used_memory": 8 * GiB, "user": ME,
              "command": "python -m ipykernel_launcher"},
             {"pid": 51002, "used_memory": 10 * GiB, "user": "bob",
              "command": "python bob.py --key=b"}]},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0},
    ]


def test_holders_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       kernels: Kernels) -> None:
    """Our lease on GPU 0 naming k-2, exclusive; a lease of ours on GPU 1 naming kernel k-9 (not
    this server's) that claims k-1's pid, a process on GPU 0 only. Commands exposed; a session
    without a kernel id. Caught: ``exclusive`` or ``created_s`` misspelt, ``created_s`` never
    given; the admin's ``expose_commands`` dropped; a lease counted as a wait (the ticket test
    loosened); a lease claiming a pid joined to the kernel that runs it on another device; a
    notebook looked up for a holder that is not ours."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet(kernels))
    sessions: dict[Any, dict[str, Any]] = {
        "k-2": {"path": "two.ipynb"}, None: {"path": "stray.ipynb"}}
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      expose_commands=True) as state:
        with Registry(str(tmp_path / "registry"), record_commands=True).locked() as txn:
            assert txn is not None
            ours = txn.create(devices=[A], requested_bytes=4 * GiB, exclusive=True,
                              requester=Requester(kernel_id="k-2", command="python two.py"))
            claim = txn.create(devices=[B], requested_bytes=GiB,
                               requester=Requester(pid=kernels.pid("k-1"), kernel_id="k-9"))
        try:
            data = payloads.holders_payload(state, kernels, sessions)
        finally:
            ours.release()
            claim.release()
    holders = {(h["uuid"], h["pid"], h["kind"]): h for h in data["holders"]}
    k1 = kernels.pid("k-1")
    base = {"user": ME, "booked_bytes": None, "exclusive": False, "created_s": None}
    assert holders == {
        (A, k1, "process"): {
            **base, "kind": "process", "uuid": A, "label": "GPU 0", "pid": k1,
            "kernel_id": "k-1", "this_server": True, "notebook_path": None,
            "used_memory_bytes": 8 * GiB, "command": "python -m ipykernel_launcher"},
        (A, 51002, "process"): {
            **base, "kind": "process", "uuid": A, "label": "GPU 0", "user": "bob", "pid": 51002,
            "kernel_id": None, "this_server": False, "notebook_path": None,
            "used_memory_bytes": 10 * GiB, "command": "python bob.py --key=b"},
        (A, ours.record.pid, "lease"): {
            **base, "kind": "lease", "uuid": A, "label": "GPU 0", "pid": ours.record.pid,
            "kernel_id": "k-2", "this_server": True, "notebook_path": "two.ipynb",
            "booked_bytes": 4 * GiB, "used_memory_bytes": None, "exclusive": True,
            "created_s": ours.record.created_s, "command": "python two.py"},
        (B, k1, "lease"): {
            **base, "kind": "lease", "uuid": B, "label": "GPU 1", "pid": k1,
            "kernel_id": "k-9", "this_server": False, "notebook_path": None,
            "booked_bytes": GiB, "used_memory_bytes": None,
            "created_s": claim.record.created_s, "command": None},
    }
    assert {k["kernel_id"]: k["waiting"] for k in data["kernels"]} == {"k-1": False,
                                                                      "k-2": False}


def test_a_kernel_known_only_by_id_owns_its_lease(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose process the kernel manager does not show (no pid yet): our lease naming it
    is still this server's. Caught: only kernels with a known pid counted as ours."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    kernels = Kernels("k-1")
    kernels.provisioners["k-1"] = SimpleNamespace(pid=None)
    try:
        fleet_file = write_fleet(tmp_path / "fleet.json", fleet(kernels)[1:])
        with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
            with Registry(str(tmp_path / "registry")).locked() as txn:
                assert txn is not None
                lease = txn.create(devices=[B], requester=Requester(kernel_id="k-1"))
            try:
                data = payloads.holders_payload(state, kernels, {"k-1": {"path": "one.ipynb"}})
            finally:
                lease.release()
    finally:
        kernels.close()
    (holder,) = data["holders"]
    assert (holder["kernel_id"], holder["this_server"], holder["notebook_path"]) == (
        "k-1", True, "one.ipynb")


def test_a_process_of_a_kernel_with_an_empty_id_keeps_that_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel id is what the kernel manager says, even an empty one. Caught: the kernel of
    each pid not passed to the holder join (the holder's own kernel id lost)."""
    kernels = Kernels("", "k-1")
    try:
        fleet_file = write_fleet(tmp_path / "fleet.json", [{
            "uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB,
            "memory_used": 8 * GiB, "utilization_pct": 0, "processes": [
                {"pid": kernels.pid(""), "used_memory": 8 * GiB, "user": ME}]}])
        with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
            data = payloads.holders_payload(state, kernels, {})
    finally:
        kernels.close()
    (holder,) = data["holders"]
    assert (holder["kernel_id"], holder["this_server"]) == ("", True)


def test_select_restricted_to_named_devices_answers_for_them_only() -> None:
    """``select?devices=0`` (issue 41): the REST dry run names GPU 0, the busier one, because it
    was named; a device that is not there is a usage error naming it."""
    answer = payloads.select_answer(
        SNAP, payloads.parse_constraints({"devices": "0"}), None, environ={})
    assert answer["chosen"] == [{"uuid": A, "label": "GPU 0", "name": "NVIDIA A100"}]
    assert answer["constraints_text"] == "device 0"
    assert answer["candidates"][1]["reasons"] == ["not named (only 0 asked for)"]
    answer = payloads.select_answer(
        SNAP, payloads.parse_constraints({"devices": [0], "min_free": "60G"}), None, environ={})
    assert answer["message"] == (
        "GPU 0 does not fit (device 0, min free 60.0 GiB): only 50.0 GiB free < 60.0 GiB wanted")
    with pytest.raises(UsageErrorBase) as info:
        payloads.select_answer(SNAP, payloads.parse_constraints({"devices": "5"}), None,
                               environ={})
    assert str(info.value).startswith("no device '5' on this host; name devices by index (0, 1)")
