"""The pick orchestration: waiting, and what a wait ranks on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import DirectoryStore
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import LeaseStoreUnreachableError, NoDeviceFitsError
from tests.leasehelpers import fleet, uuid_of

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def write(path: Path, used_gib: int) -> None:
    fleet = {"devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": u, "memory_total": "80GiB",
         "memory_used": f"{used_gib}GiB", "utilization_pct": 0} for u in (A, B)
    ]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fleet))
    os.replace(tmp, path)
    os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 10**9))


def test_a_wait_ranks_on_the_load_of_now_not_of_when_it_started(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write(path, used_gib=70)  # nothing fits 70 GiB yet
    current = {A: 97.0, B: 0.0}
    progress: list[str] = []

    def sampler_mean() -> dict[str, float | None]:
        return dict(current)

    def sleep(_s: float) -> None:
        # While the pick waits, the load swaps and memory frees on both GPUs.
        current.update({A: 0.0, B: 95.0})
        write(path, used_gib=0)

    result = pick(
        PickOptions(Constraints(min_free=parse_size("70G")), 30),
        backend=SimulatedBackend(str(path)),
        environ={},
        sleep=sleep,
        smoothed_util=sampler_mean,
        on_progress=progress.append,
    )
    assert [d.uuid for d in result.chosen] == [A]
    assert result.candidate(A).smoothed_util_pct == 0.0  # type: ignore[union-attr]
    assert len(progress) == 1 and progress[0].startswith("waiting for a device (min free 70.0 GiB)")


# ------------------------------------------------- a pick against a real lease registry


@pytest.fixture
def two_gpus(tmp_path: Path) -> SimulatedBackend:
    path = tmp_path / "two.json"
    path.write_text(json.dumps(fleet(2)))
    return SimulatedBackend(str(path))


@pytest.fixture
def one_gpu(tmp_path: Path) -> SimulatedBackend:
    path = tmp_path / "one.json"
    path.write_text(json.dumps(fleet(1)))
    return SimulatedBackend(str(path))


def test_a_dry_run_gives_nothing_to_apply_and_takes_no_lease(
    two_gpus: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    result = pick(
        PickOptions(Constraints()), backend=two_gpus, environ={}, store=registry, dry_run=True
    )
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert (result.env, result.lease, result.dry_run) == ({}, None, True)
    assert registry.list_leases(include_tickets=True) == []


def test_memory_booked_by_a_lease_sends_the_next_pick_elsewhere(
    two_gpus: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    want = Constraints.parse(min_free="50G")
    first = pick(PickOptions(want), backend=two_gpus, environ={}, store=registry)
    second = pick(PickOptions(want), backend=two_gpus, environ={}, store=registry)
    assert [d.uuid for d in first.chosen] == [uuid_of(0)]
    assert [d.uuid for d in second.chosen] == [uuid_of(1)]
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(want), backend=two_gpus, environ={}, store=registry)
    assert [c.reasons for c in info.value.candidates] == [
        ("only 30.0 GiB free after 50.0 GiB booked by leases < 50.0 GiB wanted",),
        ("only 30.0 GiB free after 50.0 GiB booked by leases < 50.0 GiB wanted",),
    ]
    for result in (first, second):
        assert result.lease is not None
        result.lease.release()


def test_a_wait_that_times_out_leaves_no_ticket_in_line(
    one_gpu: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    want = Constraints.parse(min_free="50G")
    held = pick(PickOptions(want), backend=one_gpu, environ={}, store=registry)
    assert held.lease is not None
    # The traceback keeps the waiting pick's frame alive, as a notebook keeps its last error.
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(want, 0.05), backend=one_gpu, environ={}, store=registry)
    assert str(info.value).startswith("no device fits (min free 50.0 GiB) after waiting ")
    assert [r.kind for r in registry.list_leases(include_tickets=True)] == ["lease"]
    held.lease.release()
    # Nobody waits any more: the next pick gets the freed GPU at once.
    after = pick(PickOptions(want), backend=one_gpu, environ={}, store=registry)
    assert [d.uuid for d in after.chosen] == [uuid_of(0)]
    assert after.lease is not None
    after.lease.release()


def test_a_waiter_for_one_model_leaves_the_other_models_to_others(
    tmp_path: Path, registry_dir: Path
) -> None:
    """Issue 39: a waiting ticket keeps its whole request. Alice's exclusive pick for an A100
    waits (the only A100 is held); meanwhile another pick (any model) gets the idle L4, which
    her ticket does not want; when the A100 frees, she gets it. Seen failing: the ticket was
    stored without its model, read back as "any model", and reserved the L4 for her (the
    other pick was refused)."""
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": A, "memory_total": "80GiB",
         "memory_used": 0, "utilization_pct": 0},
        {"name": "NVIDIA L4", "uuid": B, "memory_total": "24GiB", "memory_used": 0,
         "utilization_pct": 0},
    ]}))
    backend = SimulatedBackend(str(path))
    registry = DirectoryStore(registry_dir)
    a100 = Constraints(exclusive=True, models=("A100",))
    holder = pick(PickOptions(a100), backend=backend, environ={}, store=registry)
    assert holder.lease is not None
    others = []

    def sleep(_s: float) -> None:  # while alice waits in line
        if not others:
            others.append(pick(PickOptions(Constraints()), backend=backend, environ={},
                               store=registry))
            assert holder.lease is not None
            holder.lease.release()

    waited = pick(PickOptions(a100, 30), backend=backend, environ={}, store=registry,
                  sleep=sleep)
    assert [d.uuid for d in others[0].chosen] == [B]
    assert [d.uuid for d in waited.chosen] == [A]
    for result in (waited, *others):
        assert result.lease is not None
        result.lease.release()


class _LostOnTries:
    """The directory registry, its lock lost (as a restarting broker's is) on the tries named:
    what :class:`~autogpu_jupyter.core.leasing.brokerclient.BrokerStore` raises then."""

    def __init__(self, inner: DirectoryStore, lost_on: set[int]) -> None:
        self.inner = inner
        self.lost_on = lost_on
        self.tries = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def locked(self) -> object:
        self.tries += 1
        if self.tries in self.lost_on:
            raise LeaseStoreUnreachableError("lost the lease broker at /run/b.sock (refused)")
        return self.inner.locked()


def test_a_broker_lost_while_waiting_in_line_keeps_the_place_and_tries_again(
    one_gpu: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    want = Constraints.parse(min_free="50G")
    held = pick(PickOptions(want), backend=one_gpu, environ={}, store=registry)
    assert held.lease is not None
    store = _LostOnTries(registry, lost_on={2, 3})  # the broker restarts after we joined the line
    now = [0.0]
    progress: list[str] = []
    line: list[list[str]] = []

    def sleep(s: float) -> None:
        now[0] += s
        line.append([r.kind for r in registry.list_leases(include_tickets=True)])
        if store.tries == 3:  # back, and the job that held the GPU ended
            held.lease.release()  # type: ignore[union-attr]

    result = pick(PickOptions(want, 30), backend=one_gpu, environ={}, store=store,  # type: ignore[arg-type]
                  sleep=sleep, clock=lambda: now[0], on_progress=progress.append)
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert store.tries == 4
    # The ticket stayed in line through both lost tries, and was let go with the lease taken.
    assert line == [["lease", "ticket"]] * 3
    assert progress[1:] == [
        "lost the lease broker at /run/b.sock (refused) (still in line: trying again for 29s)",
        "lost the lease broker at /run/b.sock (refused) (still in line: trying again for 28s)",
    ]
    assert [r.kind for r in registry.list_leases(include_tickets=True)] == ["lease"]
    assert result.lease is not None
    result.lease.release()


@pytest.mark.parametrize("lost_on", [{1}, {2, 3, 4}], ids=["before-the-line", "past-the-wait"])
def test_a_broker_lost_before_the_line_or_to_the_end_of_the_wait_fails_closed(
    one_gpu: SimulatedBackend, registry_dir: Path, lost_on: set[int]
) -> None:
    registry = DirectoryStore(registry_dir)
    want = Constraints.parse(min_free="50G")
    held = pick(PickOptions(want), backend=one_gpu, environ={}, store=registry)
    assert held.lease is not None
    store = _LostOnTries(registry, lost_on=lost_on)
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    with pytest.raises(LeaseStoreUnreachableError, match="lost the lease broker"):
        pick(PickOptions(want, 2.5), backend=one_gpu, environ={}, store=store,  # type: ignore[arg-type]
             sleep=sleep, clock=lambda: now[0])
    assert store.tries == max(lost_on)  # once at once; else each second until the wait ended
    assert slept == ([] if lost_on == {1} else [1.0, 1.0, 0.5])  # never past the wait's end
    assert [r.kind for r in registry.list_leases(include_tickets=True)] == ["lease"]  # no ticket
    held.lease.release()
