"""The server extension's answers (``server.payloads``) built in this process: the real
``AutoGPUServer`` state (its sampler over a simulated fleet file, a real lease registry), this
server's kernels as :class:`tests.payloadhelpers.Kernels`. The same answers through a real Jupyter
server are ``tests/server/test_rest.py``; these are the fast checks of what they may reveal and
what they say.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import UsageErrorBase
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import current_user
from tests.payloadhelpers import (
    GiB,
    Kernels,
    other_users_lease,
    recorded_prometheus,
    server_state,
    shared_registry,
    write_fleet,
)

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
ME = current_user()


def fleet(processes: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 30 * GiB,
         "utilization_pct": 40, "processes": processes or []},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0},
    ]


#: Three GPU processes: the server user's, bob's, and one whose owner is unknown (NVML lists a
#: pid that /proc here cannot name: another container, or gone).
PROCESSES = [
    {"pid": 51001, "used_memory": 10 * GiB, "user": ME, "command": "python mine.py"},
    {"pid": 51002, "used_memory": 10 * GiB, "user": "bob", "command": "python bob.py --key=b"},
    {"pid": 51003, "used_memory": 10 * GiB, "command": "python who.py --token=hunter2"},
]


@pytest.fixture
def kernels() -> Iterator[Kernels]:
    k = Kernels("k-1", "k-2")
    yield k
    k.close()


def commands(items: list[dict[str, Any]]) -> dict[int, str | None]:
    return {p["pid"]: p["command"] for p in items if p.get("pid") in (51001, 51002, 51003)}


# ---- what an answer may reveal: other users' command lines ---------------------------------


@pytest.mark.parametrize("expose", [False, True])
def test_devices_show_only_the_server_users_command_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expose: bool
) -> None:
    """Caught: a process whose owner is unknown treated as the server user's (its command line
    sent); the ``expose_commands`` check dropped."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet(PROCESSES))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      expose_commands=expose) as state:
        data = payloads.devices_payload(state)
    (gpu_a,) = [d for d in data["devices"] if d["uuid"] == A]
    assert commands(gpu_a["processes"]) == {
        51001: "python mine.py",
        51002: "python bob.py --key=b" if expose else None,
        51003: "python who.py --token=hunter2" if expose else None,
    }


def test_holders_show_only_the_server_users_command_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet(PROCESSES))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
    procs = [h for h in data["holders"] if h["kind"] == "process"]
    assert commands(procs) == {51001: "python mine.py", 51002: None, 51003: None}
    assert {h["pid"]: h["user"] for h in procs} == {51001: ME, 51002: "bob", 51003: None}
    assert data["user"] == ME


def test_another_users_lease_is_never_one_of_our_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """nobody's lease names our kernel k-2 (kernel ids are no secret): it is shown as theirs,
    not joined with our kernel or its notebook, and its command line stays hidden; our own lease
    naming k-1 is ours."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    sessions = {"k-1": {"path": "mine.ipynb"}, "k-2": {"path": "private/plans.ipynb"}}
    with shared_registry() as registry, server_state(fleet_file, registry, monkeypatch) as state, \
            other_users_lease(registry, B, "k-2", command="python x.py --password=swordfish"):
        with Registry(str(registry), record_commands=True).locked() as txn:
            assert txn is not None
            mine = txn.create(devices=[A], requested_bytes=4 * GiB,
                              requester=Requester(kernel_id="k-1", command="python mine.py"))
        try:
            data = payloads.holders_payload(state, kernels, sessions)
        finally:
            mine.release()
    leases = {h["uuid"]: h for h in data["holders"] if h["kind"] == "lease"}
    assert {u: (h["user"], h["kernel_id"], h["this_server"], h["notebook_path"], h["command"])
            for u, h in leases.items()} == {
        A: (ME, "k-1", True, "mine.ipynb", "python mine.py"),
        B: ("nobody", "k-2", False, None, None),
    }


# ---- what an answer says: current errors, the best host -----------------------------------


def test_a_read_failure_is_reported_until_a_newer_sweep_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure newer than the newest good sweep is current; once a sweep succeeds after it,
    it is healed. Caught: the comparison of the two times inverted (the clock moves here)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        sampler = state.sampler()
        assert payloads.devices_payload(state)["errors"] == []
        good = json.loads(fleet_file.read_text())
        bad = json.loads(fleet_file.read_text())
        bad["devices"][1]["memory_total"] = "lots"
        fleet_file.write_text(json.dumps(bad))
        assert sampler.sample_now() is None
        data = payloads.devices_payload(state)
        (error,) = data["errors"]
        assert error.startswith(f"fleet file {str(fleet_file)!r}, device 1 ({B}) memory_total: "
                                "invalid size 'lots'")
        assert [d["uuid"] for d in data["devices"]] == [A, B]  # the last good sweep
        assert payloads.history_payload(state, None)["errors"] == [error]
        fleet_file.write_text(json.dumps(good))
        assert sampler.sample_now() is not None
        assert payloads.devices_payload(state)["errors"] == []
        assert payloads.history_payload(state, None)["errors"] == []


def test_the_cluster_answer_names_no_best_host_when_nothing_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: ``best`` set to the first host of the ranking without checking that it fits;
    (issue 22, seed 54) the second host's fit checked instead (no best when only one fits)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with recorded_prometheus() as url, server_state(fleet_file, tmp_path / "registry",
                                                    monkeypatch) as state:
        monkeypatch.setenv("AUTOGPU_PROMETHEUS_URL", url)
        fits = payloads.cluster_payload(state, Constraints.parse(min_free="10G"))
        one = payloads.cluster_payload(state, Constraints.parse(min_free="40G"))
        none = payloads.cluster_payload(state, Constraints.parse(min_free="500G"))
    assert fits["configured"] is True and fits["best"] == "gpu-b"
    assert fits["ranking"][0]["hostname"] == "gpu-b" and fits["ranking"][0]["fits"] is True
    # only gpu-c has a GPU with 40 GiB free
    assert one["best"] == "gpu-c"
    assert [(r["hostname"], r["fits"]) for r in one["ranking"]] == [
        ("gpu-c", True), ("dgx-d", False), ("gpu-a", False), ("gpu-b", False)]
    assert none["best"] is None
    assert [r["fits"] for r in none["ranking"]] == [False] * 4
    assert none["constraints_text"] == "min free 500.0 GiB"


# ---- a notebook's recommendation leaves out its own lease, and only its own ----------------


def test_select_hides_the_kernels_own_lease_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel k-1 holds GPU B with a 60 GiB booking: its recommendation must not count that
    booking against B (B stays best for it), and nobody else's lease is hidden."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        with Registry(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[B], requested_bytes=60 * GiB,
                               requester=Requester(kernel_id="k-1"))
        try:
            want = Constraints.parse(min_free="30G")
            own = payloads.select_payload(state, want, ignore_kernel_id="k-1")
            other = payloads.select_payload(state, want, ignore_kernel_id="k-2")
            plain = payloads.select_payload(state, want)
        finally:
            lease.release()
    assert [c["uuid"] for c in own["chosen"]] == [B]
    (b_own,) = [c for c in own["candidates"] if c["uuid"] == B]
    assert (b_own["effective_free_bytes"], b_own["lease_count"]) == (80 * GiB, 0)
    for answer in (other, plain):
        assert [c["uuid"] for c in answer["chosen"]] == [A]
        (b,) = [c for c in answer["candidates"] if c["uuid"] == B]
        assert (b["eligible"], b["effective_free_bytes"], b["lease_count"]) == (
            False, 20 * GiB, 1)
    assert own["message"] is None and own["constraints_text"] == "min free 30.0 GiB"


def test_select_is_a_dry_run_that_takes_no_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recommendation leases nothing: a user at the admin's lease quota still gets one, and
    the registry holds only the leases it held before. Caught (issue 22, seed 54): the pick made
    for real (past the quota an error; else a lease file left behind at each request)."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    monkeypatch.setenv("AUTOGPU_MAX_LEASES_PER_USER", "1")
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    registry = tmp_path / "registry"
    with server_state(fleet_file, registry, monkeypatch) as state:
        with Registry(str(registry)).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[A], requested_bytes=GiB,
                               requester=Requester(kernel_id="k-1"))
        try:
            before = sorted(registry.rglob("*"))
            answer = payloads.select_payload(state, Constraints.parse(min_free="30G"))
            after = sorted(registry.rglob("*"))
        finally:
            lease.release()
    assert (answer["chosen"], answer["message"]) == (
        [{"uuid": B, "label": "GPU 1", "name": "NVIDIA A100"}], None)
    assert after == before


# ---- history: what the sidebar's chart asks for -------------------------------------------


def test_history_since_a_time_is_strictly_newer_and_keeps_the_newest_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidebar passes its last timestamp: it gets only newer points (never its last one
    again), at most ``max_history_points`` per device, the newest. Caught: ``since`` made
    inclusive; the oldest points kept instead of the newest."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch, interval_s=600.0,
                      history_s=86400.0, max_history_points=2) as state:
        sampler = state.sampler()
        stamps = [sampler.latest().timestamp_s]
        for _ in range(3):
            snap = sampler.sample_now()
            stamps.append(snap.timestamp_s)
        assert stamps == sorted(set(stamps))  # four sweeps, one after the other
        full = payloads.history_payload(state, None)
        newer = payloads.history_payload(state, stamps[1])
        last = payloads.history_payload(state, stamps[3])
    assert [s["uuid"] for s in full["series"]] == [A, B]
    assert [s["timestamp_s"] for s in full["series"]] == [stamps[2:], stamps[2:]]
    assert full["series"][0]["memory_used_bytes"] == [30 * GiB, 30 * GiB]
    assert (full["since_s"], full["until_s"]) == (None, stamps[3])
    assert [s["timestamp_s"] for s in newer["series"]] == [stamps[2:], stamps[2:]]
    assert (newer["since_s"], newer["until_s"]) == (stamps[1], stamps[3])
    assert (last["series"], last["until_s"]) == ([], stamps[3])
    # the sidebar draws its time axis with these (interval, window), whatever the series
    for answer in (full, newer, last):
        assert (answer["interval_s"], answer["history_s"]) == (600.0, 86400.0)


def test_kernel_ids_are_checked_before_they_name_a_file(tmp_path: Path) -> None:
    """``kernel_id`` reaches file names (move requests): only Jupyter's id characters, whole.
    Caught: the pattern's end anchor dropped (``k1/../x`` accepted)."""
    assert payloads.parse_kernel_id(None) is None and payloads.parse_kernel_id("") is None
    assert payloads.parse_kernel_id("5e6f7a8b-1c2d-4e5f-8a9b-0c1d2e3f4a5b") == (
        "5e6f7a8b-1c2d-4e5f-8a9b-0c1d2e3f4a5b")
    for bad in ("k1/../x", "../k1", "k1\n", "a" * 129, 7, ["k1"]):
        with pytest.raises(UsageErrorBase) as info:
            payloads.parse_kernel_id(bad)
        assert str(info.value).startswith(f"invalid kernel_id {bad!r}: expected a kernel id ")


# ---- moves: the request body and the answer ------------------------------------------------


@pytest.mark.parametrize(
    ("body", "target", "dry_run"),
    [(b'{"target": "best"}', "best", False), (b'{"target": "--best", "dry_run": true}', "best",
                                              True),
     (b'{"target": 2}', "2", False), (b'{"target": " GPU-5a1b "}', "GPU-5a1b", False),
     (b'{"target": 0}', "0", False)],  # GPU 0 is a device like any other
)
def test_a_move_body_accepted(body: bytes, target: str, dry_run: bool) -> None:
    from autogpu_jupyter.server.moving import parse_move_body

    got = parse_move_body(body)
    assert (got.target, got.dry_run) == (target, dry_run)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"target": -1}', 'invalid target -1: expected "best", an NVML index such as "2", '
                            "or a GPU UUID"),
        (b'{"target": true}', "invalid target True: expected "),
        (b'{"target": "  "}', "invalid target '  ': expected "),
        (b'{"target": "best", "dry_run": "false"}',
         "invalid dry_run 'false': expected true or false"),
        (b'{"target": "best", "now": 1}', "unknown parameter 'now'; accepted: target, dry_run"),
    ],
)
def test_a_move_body_refused_with_the_accepted_forms(body: bytes, message: str) -> None:
    """Caught: a negative index or a boolean accepted as a device; a string "false" taken as a
    dry run's true (a move that silently does nothing), or any value as a real move."""
    from autogpu_jupyter.server.moving import parse_move_body

    with pytest.raises(UsageErrorBase) as info:
        parse_move_body(body)
    assert str(info.value).startswith(message)


def test_only_a_kernel_started_by_the_autogpu_provisioner_can_move() -> None:
    """Caught: a provisioner without a move file (moves unavailable) taken as movable."""
    from types import SimpleNamespace

    from autogpu_jupyter.server.moving import is_movable

    def prov(move_file: str | None) -> SimpleNamespace:
        return SimpleNamespace(autogpu_picked=(A,), autogpu_constraints=None, autogpu_note=None,
                               autogpu_lease_id=None, autogpu_move_file=move_file)

    assert is_movable(prov("/run/user/0/jupyter/autogpu-move-k1.json")) is True
    assert is_movable(prov(None)) is False
    assert is_movable(SimpleNamespace(pid=1)) is False and is_movable(None) is False


def test_the_move_answer_says_where_the_kernel_runs_now() -> None:
    """Caught: "restarted on the planned GPU" said when the provisioner picked another GPU, or
    none (a CPU-only restart)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.server.moving import result_payload

    b = DeviceSnapshot(index=1, uuid=B, name="NVIDIA A100")
    plan = SimpleNamespace(target=(b,), message="Move to GPU 1 (80.0 GiB free)")

    def prov(picked: tuple[str, ...], note: str | None) -> SimpleNamespace:
        return SimpleNamespace(autogpu_picked=picked, autogpu_constraints=None, autogpu_note=note,
                               autogpu_lease_id=None, autogpu_move_file="/m")

    there = result_payload(plan, prov((B,), None), dry_run=False, labels={A: "GPU 0"})
    assert (there["message"], there["picked"], there["target_labels"]) == (
        "The kernel restarted on GPU 1; its state (variables) was lost.", [B], ["GPU 1"])
    elsewhere = result_payload(plan, prov((A,), "GPU 1 filled up"), dry_run=False,
                               labels={A: "GPU 0"})
    assert elsewhere["message"] == (
        "The kernel restarted on GPU 0, not on GPU 1 as planned: GPU 1 filled up. Its state "
        "(variables) was lost.")
    cpu = result_payload(plan, prov((), "no device fits"), dry_run=False)
    assert cpu["message"] == (
        "The kernel restarted on no GPU, not on GPU 1 as planned: no device fits. Its state "
        "(variables) was lost.")
    planned = result_payload(plan, prov((A,), None), dry_run=True)
    assert (planned["message"], planned["picked"]) == ("Move to GPU 1 (80.0 GiB free)", None)


def test_the_move_answer_after_a_restart_that_left_no_autogpu_provisioner() -> None:
    """After the restart the kernel manager may hand back a provisioner that is not autogpu's
    (a kernelspec changed in between): nothing was picked, nothing is noted. Caught (mutation
    run, issue 22): its state read as an autogpu provisioner's (an AttributeError, a 500)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.server.moving import result_payload

    b = DeviceSnapshot(index=1, uuid=B, name="NVIDIA A100")
    plan = SimpleNamespace(target=(b,), message="Move to GPU 1 (80.0 GiB free)")
    for provisioner in (None, SimpleNamespace(pid=4242)):
        answer = result_payload(plan, provisioner, dry_run=False)
        assert (answer["message"], answer["picked"], answer["note"]) == (
            "The kernel restarted on no GPU, not on GPU 1 as planned. Its state (variables) "
            "was lost.", [], None)


# ---- holders: the kernels' overload notification and their wait for a GPU ------------------

C = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
#: The notification of kernel k-1 on a GPU 0 that bob's process fills (see ``crowded``).
CROWDED = "GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 1 other process."


def crowded(kernels: Kernels, own_gib: int, others_gib: int, *,
            spare: bool = True) -> list[dict[str, Any]]:
    """GPU 0 78 of 80 GiB full: kernel k-1's process holds ``own_gib``, bob's ``others_gib``;
    with ``spare``, GPU 1 idle and empty and GPU 2 half full. One sweep: no utilisation stretch
    is long enough to count, only the memory."""
    devices = [{"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB,
                "memory_used": 78 * GiB, "utilization_pct": 10, "processes": [
                    {"pid": kernels.pid("k-1"), "used_memory": own_gib * GiB, "user": ME,
                     "command": "python -m ipykernel_launcher"},
                    {"pid": 51002, "used_memory": others_gib * GiB, "user": "bob",
                     "command": "python bob.py"}]}]
    if spare:
        devices += [
            {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
             "utilization_pct": 0},
            {"uuid": C, "name": "NVIDIA A100", "memory_total": 80 * GiB,
             "memory_used": 40 * GiB, "utilization_pct": 0},
        ]
    return devices


def overload_of(data: dict[str, Any], kid: str = "k-1") -> tuple[Any, Any]:
    (info,) = [k for k in data["kernels"] if k["kernel_id"] == kid]
    return info["overload"], info["better"]


def test_a_kernel_whose_gpu_others_fill_is_told_where_to_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """Caught (mutation run, issue 22): no snapshot passed to the detection (never a warning);
    the cause replaced by "busy"; the registry left out of the better device's question (a GPU
    another kernel's lease books named as free)."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 8, 70))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        free = payloads.holders_payload(state, kernels, {})
        # another kernel books 70 of GPU 1's 80 GiB: GPU 2's 40 GiB free is the better device
        with Registry(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[B], requested_bytes=70 * GiB,
                               requester=Requester(kernel_id="k-9"))
        try:
            booked = payloads.holders_payload(state, kernels, {})
        finally:
            lease.release()
    assert overload_of(free) == (f"{CROWDED} Better now: GPU 1.", {"uuid": B, "label": "GPU 1"})
    assert overload_of(booked) == (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})
    assert overload_of(free, "k-2") == (None, None)  # k-2 holds no GPU


def test_an_overload_with_no_better_device_names_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """Caught (mutation run, issue 22): the better device read when there is none (the whole
    holders answer failed)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 8, 70, spare=False))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
    assert overload_of(data) == (CROWDED, None)


def test_a_kernel_that_fills_its_gpu_itself_is_not_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1's own process holds 70 of the 78 GiB: the GPU is full because of k-1, not of others.
    Caught (mutation run, issue 22): the kernel's own GPU processes not counted as its own (its
    ``pid`` looked up under another key, or only processes of unknown memory counted)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 70, 8))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
    assert overload_of(data) == (None, None)


def test_holders_are_dated_by_their_sweep_and_say_which_kernel_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1 is in line for a GPU (a ``--wait`` pick's ticket of the server's user): the sidebar
    says so. The answer bears the time of the sweep it shows (the sampler's thread may add a
    sweep meanwhile: one of the sweeps taken). Caught (mutation run, issue 22): ``waiting`` or
    ``errors`` written under another key; the answer dated now instead of by its sweep."""
    from autogpu_jupyter.core.decision import ticket_constraints
    from autogpu_jupyter.core.leasing import Registry, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch, interval_s=600.0) as state:
        with Registry(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            ticket = txn.create_ticket(constraints=ticket_constraints(Constraints(), None),
                                       requester=Requester(kernel_id="k-1"))
        try:
            data = payloads.holders_payload(state, kernels, {})
        finally:
            ticket.release()
        swept = set(state.sampler().history_frame()["timestamp_s"])
    assert {k["kernel_id"]: k["waiting"] for k in data["kernels"]} == {"k-1": True, "k-2": False}
    assert data["timestamp_s"] in swept
    assert (data["simulated"], data["errors"]) == (True, [])


def kernels_started_with(environs: dict[str, dict[str, str]]) -> Kernels:
    """This server's kernels, each a process started with this environment added to ours."""
    import os
    import subprocess
    from types import SimpleNamespace

    k = Kernels()
    k.procs = {n: subprocess.Popen(["sleep", "300"], env={**os.environ, **extra})
               for n, extra in environs.items()}
    k.provisioners = {n: SimpleNamespace(pid=p.pid) for n, p in k.procs.items()}
    # Popen returns once the child's exec has closed its close-on-exec pipe, which the kernel
    # does before it lays out the new environment: /proc/<pid>/environ may read empty for a
    # moment. Wait for what each process was started with (a condition, not a time).
    for n, extra in environs.items():
        deadline = time.monotonic() + 10
        while not extra.items() <= (payloads.process_environ(k.procs[n].pid) or {}).items():
            assert time.monotonic() < deadline, f"{n}'s environment never showed {extra}"
            time.sleep(0.001)
    return k


def test_the_better_device_stays_within_the_kernels_own_grant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """k-1 started under a scheduler's grant of GPUs 0 and 2 (its CUDA_VISIBLE_DEVICES, read
    from its process): the empty GPU 1 is outside it, GPU 2 is the better device. Caught
    (mutation run, issue 22, seed 52): the kernel's environment passed where its own devices
    belong, so the grant asked was the server's (GPU 1 named, a device the kernel cannot use)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the server itself has none
    kernels = kernels_started_with({"k-1": {"CUDA_VISIBLE_DEVICES": f"{A},{C}"}})
    try:
        fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 8, 70))
        with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
            data = payloads.holders_payload(state, kernels, {})
    finally:
        kernels.close()
    assert overload_of(data) == (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})


def test_the_better_device_keeps_the_kernels_own_pick_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1 was picked with ``--models H100`` (its provisioner's options, no lease): the better
    device is the H100 GPU 2, not the emptier A100 GPU 1. Caught (mutation run, issue 22, seed
    52): the kernel's options left out of the question (any device named, as for a plain
    pick)."""
    from types import SimpleNamespace

    devices = crowded(kernels, 8, 70)
    devices[2]["name"] = "NVIDIA H100"
    kernels.provisioners["k-1"] = SimpleNamespace(
        pid=kernels.pid("k-1"), autogpu_picked=(), autogpu_constraints=Constraints(
            models=("H100",)), autogpu_note=None, autogpu_lease_id=None, autogpu_move_file=None)
    fleet_file = write_fleet(tmp_path / "fleet.json", devices)
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
    assert overload_of(data) == (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})


def test_a_kernels_environment_is_read_from_its_own_process() -> None:
    """``select?kernel_id=`` bounds the answer by that kernel's environment: the one its process
    started with, found by its id. Caught (mutation run, issue 22, seed 52): the process looked
    up under another key (no environment ever found: the server's grant used instead)."""
    both = kernels_started_with(
        {"k-1": {"AUTOGPU_TEST_MARK": "first"}, "k-2": {"AUTOGPU_TEST_MARK": "second"}})
    try:
        env_1 = payloads.kernel_environ(both, "k-1")
        env_2 = payloads.kernel_environ(both, "k-2")
        assert payloads.kernel_environ(both, "k-3") is None
        assert payloads.kernel_environ(both, None) is None
        assert payloads.kernel_environ(None, "k-1") is None
    finally:
        both.close()
    assert env_1 is not None and env_1["AUTOGPU_TEST_MARK"] == "first"
    assert env_2 is not None and env_2["AUTOGPU_TEST_MARK"] == "second"


def test_an_environment_with_bytes_that_are_not_utf8_is_still_read(tmp_path: Path) -> None:
    """A process may be started with any bytes in its variables' names and values (``env`` of
    a shell, a C program): they are read with U+FFFD for what is not UTF-8, the rest as is.
    Caught (issue 22, seed 54): the names decoded strictly (UnicodeDecodeError: the select of
    that kernel failed)."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "environ").write_bytes(
        b"PATH=/usr/bin\0\xffODD=v\xfe\0NO_EQUALS_SIGN\0EMPTY=\0")
    assert payloads.process_environ(4242, proc_root=str(tmp_path)) == {
        "PATH": "/usr/bin", "\ufffdODD": "v\ufffd", "EMPTY": ""}
    assert payloads.process_environ(4243, proc_root=str(tmp_path)) is None
    assert payloads.process_environ(None, proc_root=str(tmp_path)) is None


def test_select_answers_from_the_sweep_the_sidebar_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The devices changed after the sampler's sweep (GPU 1 filled, GPU 0 emptied): ``select``
    ranks the sweep the sidebar shows (GPU 1 the emptier), it reads no device itself. Caught
    (mutation run, issue 22, seed 52): the sweep's backend not passed to the pick (a fresh read
    of the devices, an NVML call per request, an answer that disagrees with the table)."""
    import os

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch, interval_s=600.0) as state:
        swept = state.sampler().latest()
        now = [dict(d) for d in fleet()]
        now[0]["memory_used"], now[1]["memory_used"] = 0, 70 * GiB
        write_fleet(fleet_file, now)
        stat = os.stat(fleet_file)
        os.utime(fleet_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # seen as changed
        answer = payloads.select_payload(state, Constraints())
        assert state.sampler().latest() is swept  # no sweep in between
    assert [c["uuid"] for c in answer["chosen"]] == [B]
    assert {c["uuid"]: c["effective_free_bytes"] for c in answer["candidates"]} == {
        A: 50 * GiB, B: 80 * GiB}
    # the sidebar marks a simulated fleet as such (seed 53: the key misspelt "SIMULATED")
    assert (answer["simulated"], answer["timestamp_s"]) == (True, swept.timestamp_s)


def test_a_pending_move_of_two_devices_names_both() -> None:
    """Caught (mutation run, issue 22, seed 52): the target labels joined by another separator
    (the sidebar's "waits for the restart" line garbled for a two-device kernel)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.server.moving import pending_payload

    plan = SimpleNamespace(
        target=(DeviceSnapshot(index=0, uuid=A, name="NVIDIA A100"),
                DeviceSnapshot(index=1, uuid=B, name="NVIDIA A100")),
        message="Move to GPU 0, GPU 1")
    assert pending_payload(plan) == {
        "dry_run": False, "pending": True, "plan": "Move to GPU 0, GPU 1", "target": [A, B],
        "target_labels": ["GPU 0", "GPU 1"],
        "message": "The move to GPU 0, GPU 1 waits for the kernel's restart.",
        "picked": None, "note": None}


def test_the_move_answer_names_an_unknown_device_by_its_uuid() -> None:
    """The provisioner picked a device no sweep labelled (it appeared after the last sweep): the
    answer names it by its UUID. Caught (mutation run, issue 22, seed 52): the label lookup
    without the UUID as fallback (a TypeError joining ``None``: the move answered 500)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.server.moving import result_payload

    plan = SimpleNamespace(target=(DeviceSnapshot(index=1, uuid=B, name="NVIDIA A100"),),
                           message="Move to GPU 1")
    prov = SimpleNamespace(autogpu_picked=(C,), autogpu_constraints=None, autogpu_note=None,
                           autogpu_lease_id=None, autogpu_move_file="/m")
    answer = result_payload(plan, prov, dry_run=False, labels={A: "GPU 0"})
    assert answer["message"] == (
        f"The kernel restarted on {C}, not on GPU 1 as planned. Its state (variables) was lost.")


def test_a_move_to_best_counts_the_load_over_the_smoothing_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1 was fully busy in the sampler's sweeps and reads idle only now: a kernel asking
    ``--max-util 50`` is not moved onto it (GPU 2 is the plan), as its own pick would judge.
    Caught (mutation run, issue 22, seed 52): the sampler's smoothed load left out of the move's
    plan (the instant reading decided, GPU 1 planned)."""
    import os
    from types import SimpleNamespace

    from autogpu_jupyter.server.moving import MoveBody, plan_or_request

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = fleet()
    devices[0]["memory_used"] = 60 * GiB  # the kernel's GPU 0: 20 GiB free, GPU 2 has 40
    devices[1]["utilization_pct"] = 100
    devices.append({"uuid": C, "name": "NVIDIA A100", "memory_total": 80 * GiB,
                    "memory_used": 40 * GiB, "utilization_pct": 0})
    fleet_file = write_fleet(tmp_path / "fleet.json", devices)
    prov = SimpleNamespace(autogpu_picked=(A,), autogpu_constraints=Constraints.parse(
        max_util="50"), autogpu_note=None, autogpu_lease_id=None,
        autogpu_move_file=str(tmp_path / "move-k-1.json"))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch, interval_s=600.0) as state:
        devices[1]["utilization_pct"] = 0  # idle at this instant
        write_fleet(fleet_file, devices)
        stat = os.stat(fleet_file)
        os.utime(fleet_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # seen as changed
        plan = plan_or_request(state, prov, "k-1", MoveBody("best", dry_run=True))
    assert [d.uuid for d in plan.target] == [C]


def test_a_move_to_best_keeps_off_another_kernels_exclusive_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1 is the emptiest, but another kernel of this server holds it exclusively (a lease in
    the registry the sidebar shows): the move plans GPU 2. Caught (issue 22, seed 54): the
    registry left out of the move's plan (the other holders' leases not counted, GPU 1
    planned)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.leasing import Registry, Requester
    from autogpu_jupyter.server.moving import MoveBody, plan_or_request

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = fleet()
    devices[0]["memory_used"] = 60 * GiB  # the kernel's GPU 0: 20 GiB free, GPU 2 has 40
    devices.append({"uuid": C, "name": "NVIDIA A100", "memory_total": 80 * GiB,
                    "memory_used": 40 * GiB, "utilization_pct": 0})
    fleet_file = write_fleet(tmp_path / "fleet.json", devices)
    prov = SimpleNamespace(autogpu_picked=(A,), autogpu_constraints=Constraints.parse(),
                           autogpu_note=None, autogpu_lease_id=None,
                           autogpu_move_file=str(tmp_path / "move-k-1.json"))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        with Registry(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            theirs = txn.create(devices=[B], exclusive=True,
                                requester=Requester(kernel_id="k-2"))
        try:
            plan = plan_or_request(state, prov, "k-1", MoveBody("best", dry_run=True))
        finally:
            theirs.release()
    assert [d.uuid for d in plan.target] == [C]


# ---- holders: where "Move to best GPU" would go (issue 41) -----------------------------------


def _movable(kernels: Kernels, kid: str, picked: tuple[str, ...], tmp_path: Path,
             constraints: Constraints | None = None) -> None:
    """Kernel ``kid`` as the autogpu provisioner started it, on ``picked``."""
    from types import SimpleNamespace

    kernels.provisioners[kid] = SimpleNamespace(
        pid=kernels.pid(kid), autogpu_picked=picked,
        autogpu_constraints=constraints or Constraints(), autogpu_note=None,
        autogpu_lease_id=None, autogpu_move_file=str(tmp_path / f"autogpu-move-{kid}.json"))


def best_move_of(data: dict[str, Any], kid: str) -> Any:
    (info,) = [k for k in data["kernels"] if k["kernel_id"] == kid]
    return info["best_move"]


def test_a_move_to_the_best_gpu_is_offered_only_off_the_best_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """The ping-pong of issue 41: the sidebar offered "Move to best GPU" on the best GPU's own
    card. The holders answer names, per movable kernel, where the move plan for "best" goes:
    k-1 on the busier GPU 0 is offered the idle GPU 1; k-2, on GPU 1, nothing."""
    _movable(kernels, "k-1", (A,), tmp_path)
    _movable(kernels, "k-2", (B,), tmp_path)
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
        from autogpu_jupyter.server.moving import MoveBody, plan_or_request

        plan = plan_or_request(state, kernels.provisioners["k-1"], "k-1",
                               MoveBody("best", dry_run=True))
        with pytest.raises(UsageErrorBase) as err:
            plan_or_request(state, kernels.provisioners["k-2"], "k-2",
                            MoveBody("best", dry_run=True))
    assert best_move_of(data, "k-1") == {"target": "best", "uuids": [B], "labels": ["GPU 1"]}
    assert [d.uuid for d in plan.target] == [B]  # the plan goes where the offer said
    assert best_move_of(data, "k-2") is None
    assert str(err.value) == (
        "the kernel is already on the best device: GPU 1 (NVIDIA A100, 80.0 GiB free); nothing "
        "to move")


def test_an_overloaded_kernel_is_offered_the_better_device_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """Overloaded, the offer is the overload's better device (the warning's and the
    notification's), named: the sidebar's button moves there, whatever "best" ranks."""
    _movable(kernels, "k-1", (A,), tmp_path)
    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 8, 70))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state, kernels, {})
    assert overload_of(data)[1] == {"uuid": B, "label": "GPU 1"}
    assert best_move_of(data, "k-1") == {"target": B, "uuids": [B], "labels": ["GPU 1"]}
    assert best_move_of(data, "k-2") is None  # not an autogpu kernel: it cannot move
