"""What the mutation run of ``server/payloads.py`` (issue 22) found untested in its kernel
answers, in this process: the overload notification of this server's kernels
(:func:`~autogpu_jupyter.server.payloads.kernel_overloads`: which GPUs a kernel holds, the
thresholds of the server's config, the sampler's history and smoothing, the better device asked
as the kernel asks it: its lease, its options, its own lease hidden, its own processes; how the
warning says to move), the kernels' rows of the holders answer (``kernel_infos``,
``kernel_sessions``, ``kernel_activity``, ``kernel_options``), the kernels that hold a GPU
(``gpu_kernel_ids``), a kernel's environment from ``/proc``, the wait for the first sweep and
the one-line repr of a request value. Snapshots, samplers and kernel managers built by hand."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import ServerContext
from tests.payloadhelpers import GiB
from tests.unit.test_payloads import CROWDED, A, B, C

D = "GPU-3d3d3d3d-1111-2222-3333-444444444444"
KERNEL_PID, OTHER_KERNEL_PID, BOB_PID = 7001, 7002, 51002


# ---- kernel_overloads ----------------------------------------------------------------------


def _dev(index: int, uuid: str, used_gib: int, procs: tuple[tuple[int, int, str], ...] = (),
         mode: str | None = None) -> DeviceSnapshot:
    return DeviceSnapshot(
        index=index, uuid=uuid, name="NVIDIA A100", memory_total_bytes=80 * GiB,
        memory_used_bytes=used_gib * GiB, memory_free_bytes=(80 - used_gib) * GiB,
        utilization_pct=0.0, compute_mode=mode,
        processes=tuple(ProcessSnapshot(pid, gib * GiB, user) for pid, gib, user in procs))


def fleet(*, b_used: int = 0, c_used: int = 40, b_mode: str | None = None,
          b_procs: tuple[tuple[int, int, str], ...] = ()) -> FleetSnapshot:
    """GPU 0 (A) 78 of 80 GiB full, bob's 70 GiB and the kernel k-1's 8 GiB (the warning
    ``CROWDED``); GPU 1 (B) empty, GPU 2 (C) half full; GPU 3 (D) crowded like A, by bob and
    kernel k-2's process."""
    return FleetSnapshot(devices=(
        _dev(0, A, 78, ((KERNEL_PID, 8, "me"), (BOB_PID, 70, "bob"))),
        _dev(1, B, b_used, b_procs, b_mode),
        _dev(2, C, c_used),
        _dev(3, D, 78, ((OTHER_KERNEL_PID, 8, "me"), (BOB_PID + 1, 70, "bob"))),
    ), timestamp_s=1000.0, backend="simulated", simulated=True)


class _Sampler:
    """The sampler's two reads the overload check makes, recorded."""

    def __init__(self, smoothed: dict[str, float | None] | None = None) -> None:
        self.asked: list[tuple[str, Any]] = []
        self.smoothed = smoothed if smoothed is not None else {}

    def history_series(self, since_s: float | None = None) -> dict[str, Any]:
        self.asked.append(("history_series", since_s))
        return {}  # no utilisation history: the memory alone decides

    def smoothed_util(self, window_s: float | None = None) -> dict[str, float | None]:
        self.asked.append(("smoothed_util", window_s))
        return self.smoothed


def _state(sampler: Any, *, parent: Any = None, registry: Any = None) -> Any:
    from autogpu_jupyter.config import AutoGPU

    return ServerContext(sampler=sampler, interval_s=2.0, store=registry or (lambda: None),
                         settings=lambda: AutoGPU(parent=parent))


def holder(kid: str, uuid: str = A, pid: int | None = KERNEL_PID, used: int | None = 8 * GiB,
           ours: bool = True) -> dict[str, Any]:
    return {"kind": "process", "uuid": uuid, "kernel_id": kid, "this_server": ours, "pid": pid,
            "used_memory_bytes": used}


K1 = [{"kernel_id": "k-1", "movable": False, "picked_uuids": []}]
TO_B = {"k-1": (f"{CROWDED} Better now: GPU 1.", {"uuid": B, "label": "GPU 1"})}


def overloads(state: Any, *, kernels: Any = None, holders: Any = None, snap: Any = "fleet",
              records: Any = (), options: Any = None) -> Any:
    return payloads.kernel_overloads(
        state, K1 if kernels is None else kernels, [holder("k-1")] if holders is None else holders,
        fleet() if snap == "fleet" else snap, records, options, {"k-1": {}, "k-2": {}})


def test_no_sweep_or_no_sampler_is_no_warning_and_no_work() -> None:
    """Caught: with no sweep yet the sampler's history still read (and thresholds, registry);
    with no sampler the check went on (an AttributeError: the holders answer failed)."""
    sampler = _Sampler()
    assert overloads(_state(sampler), snap=None) == {}
    assert sampler.asked == []
    assert overloads(_state(None)) == {}
    assert overloads(_state(sampler), kernels=[]) == {}


def test_only_this_servers_kernels_with_a_pid_and_memory_are_held() -> None:
    """Another server's kernel k-x (listed first) on the same GPU is not warned and does not stop
    the look at ours; a holder row of k-1 without a pid is not one of its processes (no
    ``int(None)``). Caught: the ``this_server`` check made an "and"; the first foreign holder
    ending the loop; the pid check made an "or"."""
    holders = [holder("k-x", pid=None, used=None, ours=False),  # its lease: no process
               holder("k-1", pid=None), holder("k-1")]
    assert overloads(_state(_Sampler()), holders=holders) == TO_B


def test_a_kernels_pick_counts_as_held_once() -> None:
    """k-1's provisioner picked GPU 0 and no process of it is there yet: bob's fill is still its
    overload; a pick that a process also holds is one device, not two warnings. Caught: the
    picked UUIDs read under another key, not at all, added under another kernel, as ``None``,
    or only when already held."""
    picked = [{"kernel_id": "k-1", "movable": False, "picked_uuids": [A]}]
    only_bob = [holder("k-x", pid=BOB_PID, used=70 * GiB, ours=False)]
    pick_only = overloads(_state(_Sampler()), kernels=picked, holders=only_bob)
    assert pick_only == {"k-1": ("GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 2 "
                                 "other processes. Better now: GPU 1.",
                                 {"uuid": B, "label": "GPU 1"})}
    assert overloads(_state(_Sampler()), kernels=picked) == TO_B


def test_the_thresholds_and_windows_come_from_the_servers_config() -> None:
    """``c.AutoGPU.overload_memory_pct = 99``: 98% full is no overload; the history read covers
    the configured window plus three sweeps, the better device ranked over a minute. Caught:
    the config's parent dropped (the defaults), the history window mis-summed, the smoothing
    window altered."""
    parent = Configurable(config=Config(
        {"AutoGPU": {"overload_memory_pct": 99.0, "overload_window_s": 100.0}}))
    sampler = _Sampler()
    assert overloads(_state(sampler, parent=parent)) == {}
    assert sampler.asked == [("history_series", 106.0), ("smoothed_util", 60.0)]


def test_a_bad_threshold_in_the_config_means_the_defaults() -> None:
    """``c.AutoGPU.overload_util_pct = "high"``: traitlets refuses it (a ``TraitError``, neither a
    ValueError nor a TypeError). Bug found (mutation run, issue 22): it escaped, and the holders
    answer failed for every kernel that held a GPU; now the defaults are used. Also caught: no
    thresholds at all in that case."""
    parent = Configurable(config=Config({"AutoGPU": {"overload_util_pct": "high"}}))
    sampler = _Sampler()
    assert overloads(_state(sampler, parent=parent)) == TO_B
    assert sampler.asked[0] == ("history_series", 36.0)


def test_the_better_device_is_ranked_by_the_smoothed_load() -> None:
    """k-1 asked ``--max-util 50``; GPU 1 reads idle now but averaged 100% over the minute: GPU 2
    is the better device. Caught: the sampler's smoothed load not passed to the question."""
    sampler = _Sampler({B: 100.0, C: 0.0})
    got = overloads(_state(sampler), options={"k-1": Constraints.parse(max_util="50")})
    assert got == {"k-1": (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})}


def test_the_kernels_own_processes_do_not_occupy_an_exclusive_gpu() -> None:
    """GPU 1 is EXCLUSIVE_PROCESS and k-1's own process is on it: it is still k-1's better
    device. Caught: the kernel's pids not passed (this process's pid used: GPU 1 "occupied")."""
    snap = fleet(b_used=1, b_mode="EXCLUSIVE_PROCESS", b_procs=((KERNEL_PID, 1, "me"),))
    assert overloads(_state(_Sampler()), snap=snap) == TO_B


def test_the_better_device_offers_what_the_kernels_own_lease_books() -> None:
    """k-1's lease (of this server's uid) books 50 GiB: neither GPU 1 (45 GiB free) nor GPU 2
    fits, so no better device. Another user's lease naming k-1 (booking nothing) is not it.
    Caught: the lease not looked up, or by another uid, or not passed on."""
    records = [
        SimpleNamespace(kernel_id="k-1", uid=os.geteuid() + 1, device_requested_bytes=(0,),
                        device_uuids=(A,), exclusive=False),
        SimpleNamespace(kernel_id="k-1", uid=os.geteuid(), device_requested_bytes=(50 * GiB,),
                        device_uuids=(A,), exclusive=False),
    ]
    got = overloads(_state(_Sampler()), snap=fleet(b_used=35), records=records)
    assert got == {"k-1": (CROWDED, None)}


@pytest.mark.parametrize("failure", [None, OSError(13, "Permission denied")])
def test_without_a_usable_registry_the_better_device_is_still_named(
        failure: OSError | None) -> None:
    """Caught: a registry that is ``None`` or failed to open still asked for its view (an
    AttributeError: the holders answer failed)."""
    def registry() -> Any:
        if failure is not None:
            raise failure
        return None

    assert overloads(_state(_Sampler(), registry=registry)) == TO_B


def test_the_better_device_counts_other_leases_and_hides_the_kernels_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry_dir: Path) -> None:
    """k-1 (``--min-free 30G``) has its own lease on GPU 2 (30 of its 40 free GiB), another
    kernel books 70 GiB of GPU 1: GPU 2 is the better device. Caught: the kernel's own lease not
    hidden (nothing fits); the server's registry not passed (the config's, empty: GPU 1)."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    monkeypatch.delenv("AUTOGPU_BROKER_SOCKET", raising=False)
    leases = tmp_path / "leases"
    with Registry(str(leases)).locked() as txn:
        assert txn is not None
        theirs = txn.create(devices=[B], requested_bytes=70 * GiB,
                            requester=Requester(kernel_id="k-9"))
        own = txn.create(devices=[C], requested_bytes=30 * GiB,
                         requester=Requester(kernel_id="k-1"))
    try:
        got = overloads(_state(_Sampler(), registry=lambda: Registry(str(leases))),
                        options={"k-1": Constraints.parse(min_free="30G")})
    finally:
        theirs.release()
        own.release()
    assert got == {"k-1": (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})}


def test_two_overloaded_gpus_make_one_notification_of_two_sentences() -> None:
    """Caught: the sentences joined by another separator."""
    holders = [holder("k-1"), holder("k-1", uuid=D, pid=OTHER_KERNEL_PID)]
    assert overloads(_state(_Sampler()), holders=holders) == {"k-1": (
        f"{CROWDED} Better now: GPU 1. GPU 3 (this kernel's GPU) is overloaded: memory 98% "
        "full, 1 other process. Better now: GPU 1.", {"uuid": B, "label": "GPU 1"})}


# ---- the kernels' rows: kernel_infos, kernel_options, gpu_kernel_ids -----------------------


class _Id(str):
    """A kernel id whose place in a set is its given hash (set order fixed, whatever the seed)."""

    def __new__(cls, text: str, slot: int) -> _Id:
        self = super().__new__(cls, text)
        self.slot = slot
        return self

    def __hash__(self) -> int:
        return self.slot

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


class _Manager:
    """A kernel manager: ``None`` is a kernel gone between the listing and the lookup."""

    def __init__(self, kernels: dict[str, Any]) -> None:
        self.kernels = kernels

    def list_kernel_ids(self) -> list[str]:
        return list(self.kernels)

    def get_kernel(self, kid: str) -> Any:
        if self.kernels[kid] is None:
            raise KeyError(kid)
        return self.kernels[kid]


def _prov(move_file: str | None, picked: tuple[str, ...] = (A,),
          constraints: Constraints | None = None, note: str | None = None) -> Any:
    return SimpleNamespace(autogpu_picked=picked, autogpu_constraints=constraints,
                           autogpu_note=note, autogpu_lease_id=None, autogpu_move_file=move_file)


WANT = Constraints.parse(min_free="10G")


def manager(gone_first: Any = "k-gone") -> _Manager:
    busy = {"execution_state": "busy", "last_activity": None}
    return _Manager({
        gone_first: None,
        "k-move": SimpleNamespace(provisioner=_prov("/m", constraints=WANT, note="GPU 1 filled"),
                                  **busy),
        "k-fixed": SimpleNamespace(provisioner=_prov(None, constraints=WANT, note="kept"), **busy),
        "k-plain": SimpleNamespace(provisioner=_prov("/m", picked=()), **busy),
        "k-old": SimpleNamespace(**busy),  # no provisioner attribute (an older jupyter_client)
    })


def test_each_kernels_row_says_what_only_a_movable_kernel_has() -> None:
    """A kernel gone since the listing is skipped (not the end of the list); a movable kernel
    shows its pick, options and note; a kernel not movable (no move file) shows none of them,
    even where its provisioner has them. Caught: the row's keys misspelt; the options or note
    never shown, or shown for a kernel that cannot move; the picked UUIDs of any kernel shown."""
    row = {"notebook_path": None, "execution_state": "busy", "idle_s": None,
           "allowed_uuids": None, "overload": None, "better": None, "waiting": False}
    assert payloads.kernel_infos(manager(), {"k-move": {"path": "a.ipynb"}}) == [
        {**row, "kernel_id": "k-move", "notebook_path": "a.ipynb", "movable": True,
         "picked_uuids": [A], "constraints_text": "min free 10.0 GiB", "note": "GPU 1 filled"},
        {**row, "kernel_id": "k-fixed", "movable": False, "picked_uuids": [],
         "constraints_text": None, "note": None},
        {**row, "kernel_id": "k-plain", "movable": True, "picked_uuids": [],
         "constraints_text": None, "note": None},
        {**row, "kernel_id": "k-old", "movable": False, "picked_uuids": [],
         "constraints_text": None, "note": None},
    ]


def test_the_pick_options_are_those_of_the_autogpu_kernels() -> None:
    """Caught: a gone kernel ending the loop; a kernel without a ``provisioner`` attribute read
    without a default (AttributeError)."""
    assert payloads.kernel_options(manager()) == {"k-move": WANT, "k-fixed": WANT}
    assert payloads.kernel_options(None) == {}


def test_the_kernels_that_hold_a_gpu_by_their_pick() -> None:
    """Their provisioner's pick: a gone kernel (first in the set) and one without a
    ``provisioner`` attribute are skipped, not the end. Caught: ``break`` for the gone kernel;
    the attribute read without a default."""
    got = payloads.gpu_kernel_ids(_state(None), manager(gone_first=_Id("k-gone", 0)))
    assert sorted(got) == ["k-fixed", "k-move"]
    # the same set whatever the order: k-gone's slot 0 comes first in the set
    assert next(iter({_Id("k-gone", 0), _Id("k-move", 1)})) == "k-gone"


def test_the_sessions_name_each_kernels_notebook() -> None:
    """Caught: a session's ``name`` or ``type`` read or written under another key."""
    class Sessions:
        async def list_sessions(self) -> list[dict[str, Any]]:
            return [{"kernel": {"id": "k-1"}, "path": "a.ipynb", "name": "a", "type": "notebook"},
                    {"kernel": None, "path": "b.ipynb", "name": "b", "type": "console"},
                    {"kernel": {"id": "k-2"}, "path": "c.py", "type": "console"}]

    assert asyncio.run(payloads.kernel_sessions(Sessions())) == {
        "k-1": {"path": "a.ipynb", "name": "a", "type": "notebook"},
        "k-2": {"path": "c.py", "name": None, "type": "console"},
    }
    assert asyncio.run(payloads.kernel_sessions(None)) == {}


def test_a_kernels_activity_against_the_clock_and_odd_values() -> None:
    """Idle since 30 s ago by the real clock; a ``last_activity`` that is no time and an
    ``execution_state`` that is no text are unknown. Caught: the clock not read when no time is
    given (a TypeError); the timestamp check made an "and" (an AttributeError); any state
    passed on."""
    last = datetime.now(timezone.utc) - timedelta(seconds=30)
    state, idle_s = payloads.kernel_activity(
        SimpleNamespace(execution_state="idle", last_activity=last))
    assert state == "idle" and idle_s is not None and 29.5 <= idle_s <= 31.0
    assert payloads.kernel_activity(
        SimpleNamespace(execution_state="idle", last_activity="a while ago")) == ("idle", None)
    assert payloads.kernel_activity(SimpleNamespace(execution_state=3)) == (None, None)


# ---- a kernel's environment, the first sweep, a value in a message -------------------------


def test_a_process_environment_is_read_up_to_one_mib_and_split_at_the_first_equals(
        tmp_path: Path) -> None:
    """Caught: the read not bounded to 1 MiB (or to 2 MiB); the name split at the last "="."""
    (tmp_path / "42").mkdir()
    big = b"B" * (3 << 19)  # 1.5 MiB
    (tmp_path / "42" / "environ").write_bytes(b"OPTS=a=b\0BIG=" + big + b"\0LAST=1\0")
    env = payloads.process_environ(42, proc_root=str(tmp_path))
    cut = (1 << 20) - len(b"OPTS=a=b\0BIG=")
    assert env == {"OPTS": "a=b", "BIG": "B" * cut}


def test_a_zero_wait_for_the_first_sweep_does_not_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait's end is exclusive: at its deadline no further poll. Caught: ``<=``."""
    slept: list[float] = []
    monkeypatch.setattr(payloads, "FIRST_SAMPLE_WAIT_S", 0.0)
    monkeypatch.setattr(payloads, "time", SimpleNamespace(
        monotonic=lambda: 5.0 + sum(slept), sleep=slept.append))
    sampler = SimpleNamespace(errors=[], latest=lambda: None)
    assert payloads.latest_snapshot(ServerContext(sampler=sampler)) is None
    assert slept == []


def test_a_repr_of_exactly_the_limit_is_not_cut() -> None:
    """Caught: ``<`` for ``<=`` (a 60-character value cut)."""
    assert payloads.short_repr("x" * 58) == repr("x" * 58)
    assert payloads.short_repr("x" * 59) == "'" + "x" * 47 + "…" + "x" * 9 + "'"


def test_the_latest_sweeps_backend_is_named_as_the_sweep_says() -> None:
    """``select`` picks on a backend standing for the sampler's sweep: its ``name`` and
    ``simulated`` are the sweep's. Caught: either left ``None``."""
    for simulated in (True, False):
        snap = FleetSnapshot(devices=(), timestamp_s=1.0, backend="nvml", simulated=simulated)
        backend = payloads._LatestBackend(snap)
        assert (backend.name, backend.simulated, backend.snapshot()) == ("nvml", simulated, snap)
