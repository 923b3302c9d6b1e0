"""The server extension's answers (``server.payloads``) built in this process: the real
``AutoGPUServer`` state (its sampler over a simulated fleet file, a real lease registry), this
server's kernels as :class:`tests.payloadhelpers.Kernels`. The same answers through a real Jupyter
server are ``tests/server/test_rest.py``; these are the fast checks of what they may reveal and
what they say.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter.core.cluster import ClusterCache, ClusterDevice, ClusterHost, ClusterView
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import SampleError, Sampler
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseStoreError,
    NoDeviceFitsError,
    NVMLUnavailableError,
    UsageErrorBase,
)
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
        data = payloads.devices_payload(state.context())
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
        data = payloads.holders_payload(state.context(), kernels, {})
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
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    sessions = {"k-1": {"path": "mine.ipynb"}, "k-2": {"path": "private/plans.ipynb"}}
    with shared_registry() as registry, server_state(fleet_file, registry, monkeypatch) as state, \
            other_users_lease(registry, B, "k-2", command="python x.py --password=swordfish"):
        with DirectoryStore(str(registry), record_commands=True).locked() as txn:
            assert txn is not None
            mine = txn.create(devices=[A], requested_bytes=4 * GiB,
                              requester=Requester(kernel_id="k-1", command="python mine.py"))
        try:
            data = payloads.holders_payload(state.context(), kernels, sessions)
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
        assert payloads.devices_payload(state.context())["errors"] == []
        good = json.loads(fleet_file.read_text())
        bad = json.loads(fleet_file.read_text())
        bad["devices"][1]["memory_total"] = "lots"
        fleet_file.write_text(json.dumps(bad))
        assert sampler.sample_now() is None
        data = payloads.devices_payload(state.context())
        (error,) = data["errors"]
        assert error.startswith(f"fleet file {str(fleet_file)!r}, device 1 ({B}) memory_total: "
                                "invalid size 'lots'")
        assert [d["uuid"] for d in data["devices"]] == [A, B]  # the last good sweep
        assert payloads.history_payload(state.context(), None)["errors"] == [error]
        fleet_file.write_text(json.dumps(good))
        assert sampler.sample_now() is not None
        assert payloads.devices_payload(state.context())["errors"] == []
        assert payloads.history_payload(state.context(), None)["errors"] == []


def test_the_cluster_answer_names_no_best_host_when_nothing_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: ``best`` set to the first host of the ranking without checking that it fits;
    (issue 22, seed 54) the second host's fit checked instead (no best when only one fits)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with recorded_prometheus() as url, server_state(fleet_file, tmp_path / "registry",
                                                    monkeypatch) as state:
        monkeypatch.setenv("AUTOGPU_PROMETHEUS_URL", url)
        fits = payloads.cluster_payload(state.context(), Constraints.parse(min_free="10G"))
        one = payloads.cluster_payload(state.context(), Constraints.parse(min_free="40G"))
        none = payloads.cluster_payload(state.context(), Constraints.parse(min_free="500G"))
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
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[B], requested_bytes=60 * GiB,
                               requester=Requester(kernel_id="k-1"))
        try:
            want = Constraints.parse(min_free="30G")
            own = payloads.select_payload(state.context(), want, ignore_kernel_id="k-1")
            other = payloads.select_payload(state.context(), want, ignore_kernel_id="k-2")
            plain = payloads.select_payload(state.context(), want)
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
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    monkeypatch.setenv("AUTOGPU_MAX_LEASES_PER_USER", "1")
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    registry = tmp_path / "registry"
    with server_state(fleet_file, registry, monkeypatch) as state:
        with DirectoryStore(str(registry)).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[A], requested_bytes=GiB,
                               requester=Requester(kernel_id="k-1"))
        try:
            before = sorted(registry.rglob("*"))
            answer = payloads.select_payload(state.context(), Constraints.parse(min_free="30G"))
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
        full = payloads.history_payload(state.context(), None)
        newer = payloads.history_payload(state.context(), stamps[1])
        last = payloads.history_payload(state.context(), stamps[3])
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
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 8, 70))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        free = payloads.holders_payload(state.context(), kernels, {})
        # another kernel books 70 of GPU 1's 80 GiB: GPU 2's 40 GiB free is the better device
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[B], requested_bytes=70 * GiB,
                               requester=Requester(kernel_id="k-9"))
        try:
            booked = payloads.holders_payload(state.context(), kernels, {})
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
        data = payloads.holders_payload(state.context(), kernels, {})
    assert overload_of(data) == (CROWDED, None)


def test_a_listing_ranks_each_overloaded_kernels_question_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1 holds GPUs 0 and 1, both filled by bob: its warning names each and the same better
    device (GPU 2), asked through the one decision pipeline once for the whole listing, not
    once per overloaded device (and never for k-2, which holds no GPU). Counted at
    ``core.decision.decide``, the pipeline's ranking step."""
    from autogpu_jupyter.core import decision

    def full(uuid: str, pid: int) -> dict[str, Any]:
        return {"uuid": uuid, "name": "NVIDIA A100", "memory_total": 80 * GiB,
                "memory_used": 78 * GiB, "utilization_pct": 10, "processes": [
                    {"pid": kernels.pid("k-1"), "used_memory": 8 * GiB, "user": ME},
                    {"pid": pid, "used_memory": 70 * GiB, "user": "bob"}]}

    spare = {"uuid": C, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
             "utilization_pct": 0}
    fleet_file = write_fleet(tmp_path / "fleet.json", [full(A, 51002), full(B, 51003), spare])
    ranked: list[Constraints] = []
    decide = decision.decide

    def counting(context: decision.Context, constraints: Constraints) -> decision.Decision:
        ranked.append(constraints)
        return decide(context, constraints)

    monkeypatch.setattr(decision, "decide", counting)
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state.context(), kernels, {})
        assert len(ranked) == 1  # one listing, one overloaded kernel: one ranking
        payloads.holders_payload(state.context(), kernels, {})
        assert len(ranked) == 2  # the next listing asks again (nothing kept between requests)
    overload, better = overload_of(data)
    assert better == {"uuid": C, "label": "GPU 2"}
    assert overload == (
        "GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 1 other process. Better "
        "now: GPU 2. GPU 1 (this kernel's GPU) is overloaded: memory 98% full, 1 other "
        "process. Better now: GPU 2.")
    assert overload_of(data, "k-2") == (None, None)


def test_a_kernel_that_fills_its_gpu_itself_is_not_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1's own process holds 70 of the 78 GiB: the GPU is full because of k-1, not of others.
    Caught (mutation run, issue 22): the kernel's own GPU processes not counted as its own (its
    ``pid`` looked up under another key, or only processes of unknown memory counted)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", crowded(kernels, 70, 8))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        data = payloads.holders_payload(state.context(), kernels, {})
    assert overload_of(data) == (None, None)


def test_holders_are_dated_by_their_sweep_and_say_which_kernel_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """k-1 is in line for a GPU (a ``--wait`` pick's ticket of the server's user): the sidebar
    says so. The answer bears the time of the sweep it shows (the sampler's thread may add a
    sweep meanwhile: one of the sweeps taken). Caught (mutation run, issue 22): ``waiting`` or
    ``errors`` written under another key; the answer dated now instead of by its sweep."""
    from autogpu_jupyter.core.decision import ticket_constraints
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch, interval_s=600.0) as state:
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            ticket = txn.create_ticket(constraints=ticket_constraints(Constraints(), None),
                                       requester=Requester(kernel_id="k-1"))
        try:
            data = payloads.holders_payload(state.context(), kernels, {})
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
            data = payloads.holders_payload(state.context(), kernels, {})
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
        data = payloads.holders_payload(state.context(), kernels, {})
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
        answer = payloads.select_payload(state.context(), Constraints())
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
        plan = plan_or_request(state.context(), prov, "k-1", MoveBody("best", dry_run=True))
    assert [d.uuid for d in plan.target] == [C]


def test_a_move_to_best_keeps_off_another_kernels_exclusive_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1 is the emptiest, but another kernel of this server holds it exclusively (a lease in
    the registry the sidebar shows): the move plans GPU 2. Caught (issue 22, seed 54): the
    registry left out of the move's plan (the other holders' leases not counted, GPU 1
    planned)."""
    from types import SimpleNamespace

    from autogpu_jupyter.core.leasing import DirectoryStore, Requester
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
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            theirs = txn.create(devices=[B], exclusive=True,
                                requester=Requester(kernel_id="k-2"))
        try:
            plan = plan_or_request(state.context(), prov, "k-1", MoveBody("best", dry_run=True))
        finally:
            theirs.release()
    assert [d.uuid for d in plan.target] == [C]


# ---- the cluster answers over a real ClusterCache whose fetch returns a fixed view ----
# Found by the mutation run of issue 22.
GiB = 1024**3
URL = "http://prometheus.example.org:9090"
D = "GPU-3d3d3d3d-1111-2222-3333-444444444444"


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


# ---- a request's JSON body (found by the mutation run of issue 22) ----
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


# ---- the kernels' answers, found by the mutation run of issue 22 ----
# The overload notification of this server's kernels (kernel_overloads: which GPUs a kernel holds,
# the thresholds of the server's config, the sampler's history and smoothing, the better device
# asked as the kernel asks it; how the warning says to move), the kernels' rows of the holders
# answer, the kernels that hold a GPU, a kernel's environment from /proc, the wait for the first
# sweep and the one-line repr of a request value. Snapshots, samplers and kernel managers built
# by hand.
KERNEL_PID, OTHER_KERNEL_PID, BOB_PID = 7001, 7002, 51002


def _dev(index: int, uuid: str, used_gib: int, procs: tuple[tuple[int, int, str], ...] = (),
         mode: str | None = None) -> DeviceSnapshot:
    return DeviceSnapshot(
        index=index, uuid=uuid, name="NVIDIA A100", memory_total_bytes=80 * GiB,
        memory_used_bytes=used_gib * GiB, memory_free_bytes=(80 - used_gib) * GiB,
        utilization_pct=0.0, compute_mode=mode,
        processes=tuple(ProcessSnapshot(pid, gib * GiB, user) for pid, gib, user in procs))


def overload_fleet(*, b_used: int = 0, c_used: int = 40, b_mode: str | None = None,
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


def _overload_state(sampler: Any, *, parent: Any = None, registry: Any = None) -> Any:
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.server.state import ServerContext

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
        overload_fleet() if snap == "fleet" else snap, records, options, {"k-1": {}, "k-2": {}})


def test_no_sweep_or_no_sampler_is_no_warning_and_no_work() -> None:
    """Caught: with no sweep yet the sampler's history still read (and thresholds, registry);
    with no sampler the check went on (an AttributeError: the holders answer failed)."""
    sampler = _Sampler()
    assert overloads(_overload_state(sampler), snap=None) == {}
    assert sampler.asked == []
    assert overloads(_overload_state(None)) == {}
    assert overloads(_overload_state(sampler), kernels=[]) == {}


def test_only_this_servers_kernels_with_a_pid_and_memory_are_held() -> None:
    """Another server's kernel k-x (listed first) on the same GPU is not warned and does not stop
    the look at ours; a holder row of k-1 without a pid is not one of its processes (no
    ``int(None)``). Caught: the ``this_server`` check made an "and"; the first foreign holder
    ending the loop; the pid check made an "or"."""
    holders = [holder("k-x", pid=None, used=None, ours=False),  # its lease: no process
               holder("k-1", pid=None), holder("k-1")]
    assert overloads(_overload_state(_Sampler()), holders=holders) == TO_B


def test_a_kernels_pick_counts_as_held_once() -> None:
    """k-1's provisioner picked GPU 0 and no process of it is there yet: bob's fill is still its
    overload; a pick that a process also holds is one device, not two warnings. Caught: the
    picked UUIDs read under another key, not at all, added under another kernel, as ``None``,
    or only when already held."""
    picked = [{"kernel_id": "k-1", "movable": False, "picked_uuids": [A]}]
    only_bob = [holder("k-x", pid=BOB_PID, used=70 * GiB, ours=False)]
    pick_only = overloads(_overload_state(_Sampler()), kernels=picked, holders=only_bob)
    assert pick_only == {"k-1": ("GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 2 "
                                 "other processes. Better now: GPU 1.",
                                 {"uuid": B, "label": "GPU 1"})}
    assert overloads(_overload_state(_Sampler()), kernels=picked) == TO_B


def test_the_thresholds_and_windows_come_from_the_servers_config() -> None:
    """``c.AutoGPU.overload_memory_pct = 99``: 98% full is no overload; the history read covers
    the configured window plus three sweeps, the better device ranked over a minute. Caught:
    the config's parent dropped (the defaults), the history window mis-summed, the smoothing
    window altered."""
    parent = Configurable(config=Config(
        {"AutoGPU": {"overload_memory_pct": 99.0, "overload_window_s": 100.0}}))
    sampler = _Sampler()
    assert overloads(_overload_state(sampler, parent=parent)) == {}
    assert sampler.asked == [("history_series", 106.0), ("smoothed_util", 60.0)]


def test_a_bad_threshold_in_the_config_means_the_defaults() -> None:
    """``c.AutoGPU.overload_util_pct = "high"``: traitlets refuses it (a ``TraitError``, neither a
    ValueError nor a TypeError). Bug found (mutation run, issue 22): it escaped, and the holders
    answer failed for every kernel that held a GPU; now the defaults are used. Also caught: no
    thresholds at all in that case."""
    parent = Configurable(config=Config({"AutoGPU": {"overload_util_pct": "high"}}))
    sampler = _Sampler()
    assert overloads(_overload_state(sampler, parent=parent)) == TO_B
    assert sampler.asked[0] == ("history_series", 36.0)


def test_the_better_device_is_ranked_by_the_smoothed_load() -> None:
    """k-1 asked ``--max-util 50``; GPU 1 reads idle now but averaged 100% over the minute: GPU 2
    is the better device. Caught: the sampler's smoothed load not passed to the question."""
    sampler = _Sampler({B: 100.0, C: 0.0})
    got = overloads(_overload_state(sampler), options={"k-1": Constraints.parse(max_util="50")})
    assert got == {"k-1": (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})}


def test_the_kernels_own_processes_do_not_occupy_an_exclusive_gpu() -> None:
    """GPU 1 is EXCLUSIVE_PROCESS and k-1's own process is on it: it is still k-1's better
    device. Caught: the kernel's pids not passed (this process's pid used: GPU 1 "occupied")."""
    snap = overload_fleet(b_used=1, b_mode="EXCLUSIVE_PROCESS", b_procs=((KERNEL_PID, 1, "me"),))
    assert overloads(_overload_state(_Sampler()), snap=snap) == TO_B


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
    got = overloads(_overload_state(_Sampler()), snap=overload_fleet(b_used=35), records=records)
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

    assert overloads(_overload_state(_Sampler(), registry=registry)) == TO_B


def test_the_better_device_counts_other_leases_and_hides_the_kernels_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry_dir: Path) -> None:
    """k-1 (``--min-free 30G``) has its own lease on GPU 2 (30 of its 40 free GiB), another
    kernel books 70 GiB of GPU 1: GPU 2 is the better device. Caught: the kernel's own lease not
    hidden (nothing fits); the server's registry not passed (the config's, empty: GPU 1)."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    monkeypatch.delenv("AUTOGPU_BROKER_SOCKET", raising=False)
    leases = tmp_path / "leases"
    with DirectoryStore(str(leases)).locked() as txn:
        assert txn is not None
        theirs = txn.create(devices=[B], requested_bytes=70 * GiB,
                            requester=Requester(kernel_id="k-9"))
        own = txn.create(devices=[C], requested_bytes=30 * GiB,
                         requester=Requester(kernel_id="k-1"))
    try:
        got = overloads(_overload_state(_Sampler(), registry=lambda: DirectoryStore(str(leases))),
                        options={"k-1": Constraints.parse(min_free="30G")})
    finally:
        theirs.release()
        own.release()
    assert got == {"k-1": (f"{CROWDED} Better now: GPU 2.", {"uuid": C, "label": "GPU 2"})}


def test_two_overloaded_gpus_make_one_notification_of_two_sentences() -> None:
    """Caught: the sentences joined by another separator."""
    holders = [holder("k-1"), holder("k-1", uuid=D, pid=OTHER_KERNEL_PID)]
    assert overloads(_overload_state(_Sampler()), holders=holders) == {"k-1": (
        f"{CROWDED} Better now: GPU 1. GPU 3 (this kernel's GPU) is overloaded: memory 98% "
        "full, 1 other process. Better now: GPU 1.", {"uuid": B, "label": "GPU 1"})}


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
           "allowed_uuids": None, "overload": None, "better": None, "waiting": False,
           "best_move": None, "cull_warning": None}
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
    got = payloads.gpu_kernel_ids(_overload_state(None), manager(gone_first=_Id("k-gone", 0)))
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
    from autogpu_jupyter.server.state import ServerContext

    assert payloads.latest_snapshot(ServerContext(sampler=sampler)) is None  # type: ignore[arg-type]
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


# ---- the select, holders and history answers, found by the mutation run of issue 22 ----
# Whole answers of select_payload, select_answer, holders_payload, history_payload,
# parse_constraints and their helpers. Most drive the payloads with a stand-in for the server's
# state (a real Sampler fed snapshots at chosen times, no thread); the holders tests use the real
# state of tests.payloadhelpers.server_state.
#: Device uuids whose device order is the reverse of their sorted order.
LATE = "GPU-ffffffff-1111-2222-3333-444444444444"


EARLY = "GPU-00000000-1111-2222-3333-444444444444"


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
    """The server's context as the payloads read it (``registry``: the store's factory,
    ``parent``: the config the ``c.AutoGPU`` settings read)."""
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.server.state import ServerContext

    parent = traits.pop("parent", None)
    values: dict[str, Any] = {
        "interval_s": 1.0, "history_s": 900.0, "max_history_points": 100,
        "smoothing_window_s": 60.0, "sampler_error": None, "user": ME,
        "expose_commands": False, "registry_dir": "/srv/autogpu/registry",
        "store": traits.pop("registry", lambda: None),
        "settings": lambda: AutoGPU(parent=parent), **traits}
    return ServerContext(sampler=sampler, **values)


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


def test_numbers_of_the_history_are_finite_or_none() -> None:
    """``GET history``'s numbers: an unknown or infinite reading is null, a memory reading a
    whole number. Caught: an infinite value kept (JSON has no infinity: the answer would not
    serialise); ``None`` turned into ``int(None)`` (a TypeError for every unknown memory
    reading)."""
    import pandas as pd

    nan, inf = float("nan"), math.inf
    frame = pd.DataFrame({
        "uuid": ["GPU-a"] * 5, "timestamp_s": [1.0, 2.0, 3.0, 4.0, 5.0],
        "utilization_pct": [None, nan, inf, -inf, 2.5],
        "memory_used_bytes": [None, nan, 7.9, 12.0, 3.0], "memory_total_bytes": [80.0] * 5})
    sampler = SimpleNamespace(errors=(), latest=lambda: SimpleNamespace(timestamp_s=5.0),
                              history_frame=lambda since_s=None: frame)
    answer = payloads.history_payload(state_of(sampler), None)
    (series,) = answer["series"]
    assert series["utilization_pct"] == [None, None, None, None, 2.5]
    assert series["memory_used_bytes"] == [None, None, 7, 12, 3]
    assert series["memory_total_bytes"] == 80
    json.dumps(answer, allow_nan=False)  # what the server sends: strict JSON


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
    import pandas as pd

    latest = SimpleNamespace(timestamp_s=5.0)
    for when, current in ((5.0, True), (4.0, False), (6.0, True)):
        sampler = SimpleNamespace(errors=(SampleError(when, "read failed"),),
                                  latest=lambda: latest,
                                  history_frame=lambda since_s=None: pd.DataFrame())
        state = state_of(sampler, sampler_error="backend gone")
        assert payloads.history_payload(state, None)["errors"] == (
            ["backend gone", "read failed"] if current else ["backend gone"])


def test_lease_records_leave_tickets_out_unless_asked() -> None:
    """A kernel of this server waiting in line (its ticket, of this server's uid) is no kernel
    holding a GPU: the culler's list leaves it out, while the holders' listing asks for the
    tickets. Caught: tickets listed by default (``gpu_kernel_ids`` would count a kernel waiting
    in line as holding a GPU)."""
    asked: list[bool] = []
    ticket = SimpleNamespace(kind="ticket", kernel_id="k-1", uid=os.geteuid())

    def list_leases(include_tickets: bool) -> list[Any]:
        asked.append(include_tickets)
        return [ticket] if include_tickets else []

    def no_kernel(kid: str) -> Any:
        raise KeyError(kid)

    kernels = SimpleNamespace(list_kernel_ids=lambda: ["k-1"], get_kernel=no_kernel)
    state = state_of(None, registry=lambda: SimpleNamespace(list_leases=list_leases))
    assert payloads.gpu_kernel_ids(state, kernels) == set()
    payloads.holders_payload(state, None, {})
    assert asked == [False, True]


@pytest.mark.parametrize(("err", "message"), [
    (PermissionError(13, "Permission denied", "/srv/autogpu/registry"),
     "lease registry '/srv/autogpu/registry': Permission denied"),
    (OSError("disk gone"), "lease registry '/srv/autogpu/registry': disk gone"),
    (LeaseStoreError("registry is world-writable"), "lease registry: registry is world-writable"),
])
def test_an_unreadable_registry_is_named_with_the_reason(err: Exception, message: str) -> None:
    """Caught: the OS error's own words replaced by its repr-like text (``[Errno 13] ...``) or
    by ``None`` when it has none."""
    state = state_of(None, registry=failing(err))
    assert payloads.holders_payload(state, None, {})["errors"] == [message]


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
    state = state_of(sampler_of(SNAP), registry=failing(LeaseStoreError("no flock on /nfs")))
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


def holders_fleet(kernels: Kernels) -> list[dict[str, Any]]:
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
    notebook looked up for a holder that is not ours. Each holder comes with its words as
    every view says them (``where``, ``memory_text``: core/words.py), the sidebar's text."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", holders_fleet(kernels))
    sessions: dict[Any, dict[str, Any]] = {
        "k-2": {"path": "two.ipynb"}, None: {"path": "stray.ipynb"}}
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      expose_commands=True) as state:
        with DirectoryStore(str(tmp_path / "registry"), record_commands=True).locked() as txn:
            assert txn is not None
            ours = txn.create(devices=[A], requested_bytes=4 * GiB, exclusive=True,
                              requester=Requester(kernel_id="k-2", command="python two.py"))
            claim = txn.create(devices=[B], requested_bytes=GiB,
                               requester=Requester(pid=kernels.pid("k-1"), kernel_id="k-9"))
        try:
            data = payloads.holders_payload(state.context(), kernels, sessions)
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
            "used_memory_bytes": 8 * GiB, "command": "python -m ipykernel_launcher",
            "where": "kernel k-1", "memory_text": "8.0 GiB used"},
        (A, 51002, "process"): {
            **base, "kind": "process", "uuid": A, "label": "GPU 0", "user": "bob", "pid": 51002,
            "kernel_id": None, "this_server": False, "notebook_path": None,
            "used_memory_bytes": 10 * GiB, "command": "python bob.py --key=b",
            "where": "pid 51002", "memory_text": "10.0 GiB used"},
        (A, ours.record.pid, "lease"): {
            **base, "kind": "lease", "uuid": A, "label": "GPU 0", "pid": ours.record.pid,
            "kernel_id": "k-2", "this_server": True, "notebook_path": "two.ipynb",
            "booked_bytes": 4 * GiB, "used_memory_bytes": None, "exclusive": True,
            "created_s": ours.record.created_s, "command": "python two.py",
            "where": "two.ipynb", "memory_text": "4.0 GiB booked, exclusive"},
        (B, k1, "lease"): {
            **base, "kind": "lease", "uuid": B, "label": "GPU 1", "pid": k1,
            "kernel_id": "k-9", "this_server": False, "notebook_path": None,
            "booked_bytes": GiB, "used_memory_bytes": None,
            "created_s": claim.record.created_s, "command": None,
            "where": "kernel k-9", "memory_text": "1.0 GiB booked"},
    }
    assert {k["kernel_id"]: k["waiting"] for k in data["kernels"]} == {"k-1": False,
                                                                      "k-2": False}


def test_a_kernel_known_only_by_id_owns_its_lease(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose process the kernel manager does not show (no pid yet): our lease naming it
    is still this server's. Caught: only kernels with a known pid counted as ours."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    kernels = Kernels("k-1")
    kernels.provisioners["k-1"] = SimpleNamespace(pid=None)
    try:
        fleet_file = write_fleet(tmp_path / "fleet.json", holders_fleet(kernels)[1:])
        with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
            with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
                assert txn is not None
                lease = txn.create(devices=[B], requester=Requester(kernel_id="k-1"))
            try:
                data = payloads.holders_payload(
                    state.context(), kernels, {"k-1": {"path": "one.ipynb"}})
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
            data = payloads.holders_payload(state.context(), kernels, {})
    finally:
        kernels.close()
    (holder,) = data["holders"]
    assert (holder["kernel_id"], holder["this_server"]) == ("", True)


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
        data = payloads.holders_payload(state.context(), kernels, {})
        from autogpu_jupyter.server.moving import MoveBody, plan_or_request

        plan = plan_or_request(state.context(), kernels.provisioners["k-1"], "k-1",
                               MoveBody("best", dry_run=True))
        with pytest.raises(UsageErrorBase) as err:
            plan_or_request(state.context(), kernels.provisioners["k-2"], "k-2",
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
        data = payloads.holders_payload(state.context(), kernels, {})
    assert overload_of(data)[1] == {"uuid": B, "label": "GPU 1"}
    assert best_move_of(data, "k-1") == {"target": B, "uuids": [B], "labels": ["GPU 1"]}
    assert best_move_of(data, "k-2") is None  # not an autogpu kernel: it cannot move


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


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_the_best_gpu_offered_keeps_off_another_kernels_exclusive_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """Mutation run of 2026-12-07 found the lease store left out of the holders answer's "Move
    to best GPU" offer unnoticed (server/kernels.py; only the move plan itself was pinned): GPU 1
    is the emptiest but another kernel holds it exclusively, so the offer, like the plan, is
    GPU 2."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _movable(kernels, "k-1", (A,), tmp_path)
    devices = fleet()
    devices[0]["memory_used"] = 60 * GiB  # the kernel's GPU 0: 20 GiB free, GPU 2 has 40
    devices.append({"uuid": C, "name": "NVIDIA A100", "memory_total": 80 * GiB,
                    "memory_used": 40 * GiB, "utilization_pct": 0})
    fleet_file = write_fleet(tmp_path / "fleet.json", devices)
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            theirs = txn.create(devices=[B], exclusive=True,
                                requester=Requester(kernel_id="k-2"))
        try:
            data = payloads.holders_payload(state.context(), kernels, {})
        finally:
            theirs.release()
    assert best_move_of(data, "k-1") == {"target": "best", "uuids": [C], "labels": ["GPU 2"]}
