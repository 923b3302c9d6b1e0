"""core.picker in detail, against the simulated backend and a real lease registry in tmp:
what a pick returns, the messages of every refusal, the waiting line, and failing closed."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.devices import FleetSnapshot
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import explain_drops, pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import (
    LeaseStoreUntrustedError,
    NoDeviceFitsError,
    NoDeviceGrantedError,
    UsageErrorBase,
)
from tests.leasehelpers import fleet, uuid_of

GiB = 1024**3
ENV_OF = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def backend_for(tmp_path: Path, spec: dict[str, Any], name: str = "fleet.json") -> SimulatedBackend:
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return SimulatedBackend(str(path))


@pytest.fixture
def two(tmp_path: Path) -> SimulatedBackend:
    return backend_for(tmp_path, fleet(2))


@pytest.fixture
def registry(registry_dir: Path) -> DirectoryStore:
    return DirectoryStore(registry_dir)


@pytest.fixture
def broken_registry(tmp_path: Path) -> DirectoryStore:
    """A registry that cannot be used: its parent directory does not exist."""
    return DirectoryStore(tmp_path / "missing" / "registry")


def live(registry: DirectoryStore) -> list[tuple[str, tuple[str, ...]]]:
    return [(r.kind, r.device_uuids) for r in registry.list_leases(include_tickets=True)]


# ------------------------------------------------------------------------- PickResult


def test_a_pick_returns_the_choice_the_ranking_the_env_and_its_lease(
    two: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir, record_commands=True)
    holder = Requester(
        pid=os.getpid(), kernel_id="k-1", notebook_path="a.ipynb", command="python x", kind="kernel"
    )
    want = Constraints(min_free=parse_size("10G"))
    t0 = time.monotonic()
    result = pick(PickOptions(want), backend=two, environ={}, store=registry, requester=holder)
    took = time.monotonic() - t0
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert [c.device.uuid for c in result.candidates] == [uuid_of(0), uuid_of(1)]
    assert result.env == {"CUDA_VISIBLE_DEVICES": uuid_of(0), **ENV_OF}
    assert result.constraints is want
    assert (result.dry_run, result.kept, result.previous, result.lease_note) == (
        False, False, None, None,
    )
    assert 0.0 <= result.waited_s <= took
    assert result.snapshot.simulated is True
    assert result.runner_up is result.candidates[1]
    assert result.candidate(uuid_of(1)) is result.candidates[1]
    assert result.candidate("GPU-nope") is None
    assert result.lease is not None
    rec = result.lease.record
    assert (rec.kind, rec.device_uuids, rec.device_requested_bytes, rec.exclusive) == (
        "lease", (uuid_of(0),), (10 * GiB,), False,
    )
    assert (rec.pid, rec.kernel_id, rec.notebook_path, rec.holder_kind) == (
        os.getpid(), "k-1", "a.ipynb", "kernel",
    )
    d = result.to_dict()
    assert d == {
        "chosen": [result.chosen[0].to_dict()],
        "candidates": [c.to_dict() for c in result.candidates],
        "constraints": want.to_json(),
        "constraints_text": "min free 10.0 GiB",
        "env": {"CUDA_VISIBLE_DEVICES": uuid_of(0), **ENV_OF},
        "allocation": result.allocation.describe(),
        "simulated": True,
        "lease": rec.to_dict(redact_command=False),
        "lease_note": None,
        "dry_run": False,
        "kept": False,
    }
    assert d["lease"]["command"] == "python x"  # this process's own lease: not redacted
    assert live(registry) == [("lease", (uuid_of(0),))]
    result.lease.release()


def test_a_default_holder_is_this_process(two: SimulatedBackend, registry: DirectoryStore) -> None:
    result = pick(PickOptions(Constraints()), backend=two, environ={}, store=registry)
    assert result.lease is not None
    rec = result.lease.record
    assert (rec.pid, rec.holder_kind, rec.kernel_id, rec.device_requested_bytes) == (
        os.getpid(), "process", None, (None,),
    )
    assert Requester() == Requester(pid=os.getpid(), kind="process")
    assert result.to_dict()["lease"] == rec.to_dict(redact_command=False)
    result.lease.release()


def test_two_devices_book_each_its_own_share_and_an_exclusive_lease_says_so(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    spec = fleet(2)
    spec["devices"][1]["memory_total"] = "40G"
    backend = backend_for(tmp_path, spec)
    want = Constraints(min_free=parse_size("25%"), count=2, exclusive=True)
    result = pick(PickOptions(want), backend=backend, environ={}, store=registry)
    assert result.lease is not None
    rec = result.lease.record
    assert rec.device_uuids == (uuid_of(0), uuid_of(1))
    assert rec.device_requested_bytes == (20 * GiB, 10 * GiB)
    assert rec.exclusive is True
    assert result.env == {"CUDA_VISIBLE_DEVICES": f"{uuid_of(0)},{uuid_of(1)}", **ENV_OF}
    assert result.runner_up is None
    result.lease.release()


def test_a_pick_without_a_registry_takes_no_lease_but_sets_the_env(
    two: SimulatedBackend,
) -> None:
    result = pick(PickOptions(Constraints(exclusive=True, count=1), 5), backend=two, environ={})
    assert (result.lease, result.lease_note) == (None, None)
    assert result.env == {"CUDA_VISIBLE_DEVICES": uuid_of(0), **ENV_OF}


def test_explain_drops_says_why_each_device_fits_or_not(tmp_path: Path) -> None:
    spec = fleet(3)
    spec["devices"][2]["memory_used"] = "75G"
    spec["devices"][1]["utilization_pct"] = 90
    backend = backend_for(tmp_path, spec)
    with pytest.raises(NoDeviceFitsError) as info:
        pick(
            PickOptions(Constraints.parse(min_free="10G", max_util="50", count=2)),
            backend=backend,
            environ={},
        )
    cands = info.value.candidates
    assert explain_drops(cands) == (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): fits: 80.0 GiB free >= 10.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100-SXM4-80GB): dropped: 80.0 GiB free >= 10.0 GiB wanted; "
        "utilisation 90% > max 50%\n"
        "  GPU 2 (NVIDIA A100-SXM4-80GB): dropped: only 5.0 GiB free < 10.0 GiB wanted"
    )
    assert str(info.value) == (
        "only 1 device(s) fit, 2 wanted (min free 10.0 GiB, max util 50%, 2 devices):\n"
        + explain_drops(cands)
    )
    assert explain_drops([]) == ""
    assert explain_drops([c for c in cands if c.eligible]) == (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): fits: 80.0 GiB free >= 10.0 GiB wanted"
    )


def test_a_device_that_fits_without_a_reason_says_ok(two: SimulatedBackend) -> None:
    result = pick(PickOptions(Constraints()), backend=two, environ={}, dry_run=True)
    assert (result.to_dict()["lease"], result.to_dict()["dry_run"]) == (None, True)
    assert explain_drops(result.candidates) == (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): fits: ok\n  GPU 1 (NVIDIA A100-SXM4-80GB): fits: ok"
    )


# ----------------------------------------------------------------------- refusals, in words


def test_nothing_fits_without_waiting_says_so_and_keeps_the_ranking(
    two: SimulatedBackend,
) -> None:
    slept: list[float] = []
    with pytest.raises(NoDeviceFitsError) as info:
        pick(
            PickOptions(Constraints.parse(min_free="90G")),
            backend=two,
            environ={},
            sleep=slept.append,
        )
    assert str(info.value) == (
        "no device fits (min free 90.0 GiB):\n"
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: only 80.0 GiB free < 90.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100-SXM4-80GB): dropped: only 80.0 GiB free < 90.0 GiB wanted"
    )
    assert [c.device.uuid for c in info.value.candidates] == [uuid_of(0), uuid_of(1)]
    assert slept == []
    # A negative wait is no wait.
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(min_free="90G"), -5), backend=two, environ={},
             sleep=slept.append)
    assert str(info.value) == (
        "no device fits (min free 90.0 GiB):\n" + explain_drops(info.value.candidates)
    )
    assert slept == []


@pytest.mark.parametrize(
    ("exclude", "message"),
    [
        ((" ",), "invalid --exclude: empty device id; expected NVML indices or UUIDs, e.g. 0,2 "
                 "or GPU-5a1"),
        (("7",), "unknown device id '7' in --exclude; expected an NVML index (0, 1, 1:0, 1:1) "
                 "or a UUID"),
        (("0", "GPU-zzzzzz"), "unknown device id 'GPU-zzzzzz' in --exclude; expected an NVML "
                              "index (0, 1, 1:0, 1:1) or a UUID"),
    ],
)
def test_an_unknown_or_empty_excluded_id_is_refused_naming_the_known_ones(
    tmp_path: Path, exclude: tuple[str, ...], message: str
) -> None:
    spec = fleet(2)
    spec["devices"][1]["mig_devices"] = [
        {"uuid": "MIG-aaaaaaaa-0000", "memory_total": "10G", "profile": "1g.10gb"},
        {"uuid": "MIG-bbbbbbbb-0000", "memory_total": "10G", "profile": "1g.10gb"},
    ]
    with pytest.raises(UsageErrorBase) as info:
        pick(
            PickOptions(Constraints(exclude=exclude)),
            backend=backend_for(tmp_path, spec),
            environ={},
        )
    assert str(info.value) == message


def test_known_excluded_ids_pass_and_a_bad_count_is_refused(two: SimulatedBackend) -> None:
    result = pick(
        PickOptions(Constraints(exclude=("0", uuid_of(0)))), backend=two, environ={}, dry_run=True
    )
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    for bad in (0, -1):
        with pytest.raises(UsageErrorBase) as info:
            pick(PickOptions(Constraints(count=bad)), backend=two, environ={}, dry_run=True)
        assert str(info.value) == f"invalid count {bad!r}: expected a whole number >= 1"


def test_no_gpu_on_the_host_or_none_granted(tmp_path: Path, two: SimulatedBackend) -> None:
    empty = backend_for(tmp_path, {"devices": []}, "empty.json")
    with pytest.raises(NoDeviceGrantedError) as info:
        pick(PickOptions(Constraints()), backend=empty, environ={})
    assert str(info.value) == "no GPU on this host: simulated lists no devices"
    with pytest.raises(NoDeviceGrantedError) as info:
        pick(PickOptions(Constraints()), backend=two, environ={"CUDA_VISIBLE_DEVICES": ""})
    assert str(info.value) == (
        "no GPU granted to this process: CUDA_VISIBLE_DEVICES='' grants no GPU to this process "
        "(CUDA_VISIBLE_DEVICES is set but empty: CUDA shows no GPU)"
    )


class NoDevices:
    """A backend whose snapshot lists no device, only the errors that hid them."""

    def __init__(self, *errors: str) -> None:
        self.errors = errors

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(devices=(), timestamp_s=0.0, backend="nvml", errors=self.errors)


def test_no_gpu_on_the_host_names_the_errors_that_hid_them() -> None:
    with pytest.raises(NoDeviceGrantedError) as info:
        pick(
            PickOptions(Constraints()),
            backend=NoDevices("GPU 0: lost", "GPU 1: no permission"),
            environ={},
        )
    assert str(info.value) == (
        "no GPU on this host: nvml lists no devices (GPU 0: lost; GPU 1: no permission)"
    )


def test_an_allocation_bounds_the_choice(two: SimulatedBackend) -> None:
    result = pick(PickOptions(Constraints()), backend=two, environ={"CUDA_VISIBLE_DEVICES": "1"})
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    assert result.allocation.uuids == (uuid_of(1),)


def test_the_environment_defaults_to_this_process(
    two: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    result = pick(PickOptions(Constraints()), backend=two)
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]


# ------------------------------------------------------------- an unusable lease registry


def test_the_backend_defaults_to_the_configured_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "configured.json"
    path.write_text(json.dumps(fleet(2)))
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
    result = pick(PickOptions(Constraints()), environ={})
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert result.snapshot.simulated is True


def test_the_ranking_uses_the_smoothed_load_given_or_asked_for_at_each_try(
    two: SimulatedBackend,
) -> None:
    busy_0 = {uuid_of(0): 80.0, uuid_of(1): 5.0}
    result = pick(PickOptions(Constraints()), backend=two, environ={}, smoothed_util=busy_0)
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    asked: list[int] = []

    def now() -> dict[str, float | None]:
        asked.append(1)
        return busy_0

    result = pick(PickOptions(Constraints()), backend=two, environ={}, smoothed_util=now)
    assert [d.uuid for d in result.chosen] == [uuid_of(1)] and asked == [1]
    assert [c.smoothed_util_pct for c in result.candidates] == [5.0, 80.0]


def test_an_exclusive_gpu_the_holder_already_uses_is_no_obstacle(tmp_path: Path) -> None:
    spec = fleet(1)
    spec["devices"][0]["compute_mode"] = "EXCLUSIVE_PROCESS"
    spec["devices"][0]["processes"] = [{"pid": os.getpid(), "used_memory": "1G"}]
    backend = backend_for(tmp_path, spec)
    result = pick(
        PickOptions(Constraints()), backend=backend, environ={}
    )  # the holder is this process
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    with pytest.raises(NoDeviceFitsError) as info:
        pick(
            PickOptions(Constraints()), backend=backend, environ={},
            requester=Requester(pid=os.getppid()),
        )
    assert "compute mode EXCLUSIVE_PROCESS and already used by 1 process(es)" in str(info.value)


def test_a_plain_pick_goes_on_without_a_lease_and_says_why(
    two: SimulatedBackend, broken_registry: DirectoryStore
) -> None:
    result = pick(PickOptions(Constraints()), backend=two, environ={}, store=broken_registry)
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert result.lease is None
    reason = broken_registry.unusable_reason
    assert reason is not None and reason.startswith(
        f"cannot create lease registry {broken_registry.path}: No such file or directory"
    )
    assert result.lease_note == f"{reason}: picked without a lease"
    assert result.env == {"CUDA_VISIBLE_DEVICES": uuid_of(0), **ENV_OF}


def test_a_dry_run_never_touches_the_registry_nor_fails_closed(
    two: SimulatedBackend, broken_registry: DirectoryStore
) -> None:
    result = pick(PickOptions(Constraints(exclusive=True), 5), backend=two, environ={},
                  store=broken_registry,
                  dry_run=True)
    assert (result.lease, result.lease_note, result.env, result.dry_run) == (None, None, {}, True)
    assert broken_registry.unusable_reason is None


@pytest.mark.parametrize(
    ("kwargs", "max_per_user", "what"),
    [
        ({"options": PickOptions(Constraints(exclusive=True))}, 0,
         "an exclusive pick (--exclusive)"),
        ({"options": PickOptions(Constraints(exclusive=True), 5)}, 3,
         "an exclusive pick (--exclusive)"),
        ({"options": PickOptions(Constraints(), 0.5)}, 3, "a pick that waits in line (--wait)"),
        ({"options": PickOptions(Constraints())}, 1,
         "a pick under the admin's max_devices_per_user quota"),
    ],
)
def test_a_promise_only_the_registry_keeps_fails_closed_when_it_is_unusable(
    two: SimulatedBackend, tmp_path: Path, kwargs: dict[str, Any], max_per_user: int, what: str
) -> None:
    broken = DirectoryStore(tmp_path / "missing" / "registry", max_devices_per_user=max_per_user)
    slept: list[float] = []
    with pytest.raises(LeaseStoreUntrustedError) as info:
        pick(backend=two, environ={}, store=broken, sleep=slept.append, **kwargs)
    assert str(info.value) == (
        f"refused {what} without a lease: {broken.unusable_reason}. Nothing was picked and the "
        "environment is unchanged; a plain pick (without --exclusive or --wait) still works, "
        "without a lease"
    )
    assert slept == []


def test_a_refused_lease_write_fails_an_exclusive_pick_but_not_a_plain_one(
    tmp_path: Path, registry: DirectoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="autogpu_jupyter.core.picker")
    # A device UUID that readers of the registry would reject: the lease is refused.
    spec = fleet(1)
    spec["devices"][0]["uuid"] = "GPU-has space"
    backend = backend_for(tmp_path, spec)
    refused = "lease record refused: readers would reject it (device_uuids: expected a list of "
    refused += "distinct device UUIDs)"
    plain = pick(PickOptions(Constraints()), backend=backend, environ={}, store=registry)
    assert plain.lease is None
    assert plain.lease_note == f"{refused}: picked without a lease"
    assert [d.uuid for d in plain.chosen] == ["GPU-has space"]
    assert [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "autogpu_jupyter.core.picker"] == [("INFO", f"no lease: {refused}")]
    with pytest.raises(LeaseStoreUntrustedError) as info:
        pick(PickOptions(Constraints(exclusive=True)), backend=backend, environ={}, store=registry)
    assert str(info.value) == (
        f"refused an exclusive pick (--exclusive) without a lease: {refused}. Nothing was picked "
        "and the environment is unchanged; a plain pick (without --exclusive or --wait) still "
        "works, without a lease"
    )
    assert live(registry) == []


class WarmingBackend(SimulatedBackend):
    """The simulated backend with NVML's ``warm_up`` hook: it records whether the registry lock
    was free when it ran (the picker warms up before it takes the lock)."""

    def __init__(self, source: str, registry_path: str) -> None:
        super().__init__(source)
        self.registry_path = registry_path
        self.lock_free_at_warm_up: list[bool] = []

    def warm_up(self) -> None:
        fd = os.open(self.registry_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.lock_free_at_warm_up.append(True)
        except BlockingIOError:
            self.lock_free_at_warm_up.append(False)
        finally:
            os.close(fd)


def test_a_backend_is_warmed_up_before_the_registry_lock_and_only_for_a_real_pick(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    os.makedirs(registry.path, exist_ok=True)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(1)))
    backend = WarmingBackend(str(path), registry.path)
    pick(PickOptions(Constraints()), backend=backend, environ={}, dry_run=True, store=registry)
    pick(PickOptions(Constraints()), backend=backend, environ={})
    assert backend.lock_free_at_warm_up == []
    result = pick(PickOptions(Constraints()), backend=backend, environ={}, store=registry)
    assert backend.lock_free_at_warm_up == [True]
    assert result.lease is not None
    result.lease.release()


# ------------------------------------------------------------------------ waiting in line


def test_a_waiting_pick_holds_one_ticket_while_it_waits_and_none_after(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    backend = backend_for(tmp_path, fleet(1))
    want = Constraints(min_free=parse_size("50G"))
    held = pick(PickOptions(want), backend=backend, environ={}, store=registry)
    assert held.lease is not None
    seen: list[list[tuple[str, tuple[str, ...]]]] = []
    tickets: list[dict[str, Any] | None] = []
    slept: list[float] = []
    progress: list[str] = []

    def sleep(s: float) -> None:
        slept.append(s)
        seen.append(live(registry))
        tickets.extend(
            r.constraints for r in registry.list_leases(include_tickets=True) if r.kind == "ticket"
        )
        if len(slept) == 2:
            assert held.lease is not None
            held.lease.release()

    result = pick(PickOptions(want, 30), backend=backend, environ={"CUDA_VISIBLE_DEVICES": "0"},
                  store=registry, sleep=sleep, on_progress=progress.append)
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert slept == [1.0, 1.0]
    assert seen == [[("lease", (uuid_of(0),)), ("ticket", ())]] * 2
    assert tickets[0] == {
        "min_free_bytes": 50 * GiB, "min_free_fraction": None, "max_util_pct": None,
        "count": 1, "exclude": [], "exclusive": False, "allowed_uuids": [uuid_of(0)],
    }
    assert len(progress) == 2
    pattern = (
        r"waiting for a device \(min free 50\.0 GiB\), [0-9.]+s of 30s; best now GPU 0: "
        r"only 30\.0 GiB free after 50\.0 GiB booked by leases < 50\.0 GiB wanted"
    )
    assert all(re.fullmatch(pattern, line) for line in progress), progress
    assert live(registry) == [("lease", (uuid_of(0),))]
    # The ticket was removed under the lock, not merely left behind unlocked.
    assert sorted(p.suffix for p in Path(registry.path).glob("*/*")) == [".lease"]
    assert result.lease is not None
    result.lease.release()


def test_an_exclusive_waiter_s_ticket_says_who_waits_and_for_what(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    backend = backend_for(tmp_path, fleet(1))
    held = pick(PickOptions(Constraints()), backend=backend, environ={}, store=registry)
    tickets: list[tuple[bool, str, str | None, bool]] = []

    def sleep(_s: float) -> None:
        tickets.extend(
            (
                r.exclusive,
                r.holder_kind,
                r.kernel_id,
                bool(r.constraints and r.constraints["exclusive"]),
            )
            for r in registry.list_leases(include_tickets=True)
            if r.kind == "ticket"
        )
        assert held.lease is not None
        held.lease.release()

    holder = Requester(kernel_id="kernel-7", kind="kernel")
    result = pick(PickOptions(Constraints(exclusive=True), 30), backend=backend, environ={},
                  store=registry, sleep=sleep, requester=holder)
    assert tickets == [(True, "kernel", "kernel-7", True)]
    assert result.lease is not None and result.lease.record.exclusive is True
    assert sorted(p.suffix for p in Path(registry.path).glob("*/*")) == [".lease"]
    result.lease.release()


def test_a_wait_sleeps_no_longer_than_the_time_left(two: SimulatedBackend) -> None:
    slept: list[float] = []
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(min_free="90G"), 0.2), backend=two, environ={},
             sleep=slept.append)
    assert len(slept) >= 1
    assert all(0.0 <= s <= 0.2 for s in slept)
    # the time since the pick began (0.2 s and what the last try took), in seconds
    assert re.match(r"no device fits \(min free 90\.0 GiB\) after waiting [0-9.]+s:\n",
                    str(info.value)), str(info.value)


def test_a_wait_without_a_registry_takes_no_ticket_and_still_reports_progress(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.json"
    spec = fleet(1)
    spec["devices"][0]["memory_used"] = "75G"
    spec["devices"][0]["utilization_pct"] = 90
    path.write_text(json.dumps(spec))
    progress: list[str] = []

    def sleep(_s: float) -> None:
        time.sleep(0.05)
        spec["devices"][0]["memory_used"] = 0
        spec["devices"][0]["utilization_pct"] = 0
        path.write_text(json.dumps(spec))
        os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 10**9))

    started = time.monotonic()
    result = pick(PickOptions(Constraints.parse(min_free="10G", max_util="50"), 30),
                  backend=SimulatedBackend(str(path)), environ={}, sleep=sleep,
                  on_progress=progress.append)
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert 0.05 <= result.waited_s <= time.monotonic() - started  # how long the pick waited
    assert len(progress) == 1
    assert progress[0].endswith(
        "s of 30s; best now GPU 0: only 5.0 GiB free < 10.0 GiB wanted; utilisation 90% > max 50%"
    )


def test_the_waiting_line_names_the_best_device_and_why_it_does_not_fit(tmp_path: Path) -> None:
    progress: list[str] = []
    calls = {"n": 0}
    path = tmp_path / "fleet.json"
    spec = fleet(1)
    spec["devices"][0]["memory_used"] = "80G"
    path.write_text(json.dumps(spec))

    def sleep(_s: float) -> None:
        calls["n"] += 1
        spec["devices"][0]["memory_used"] = 0
        path.write_text(json.dumps(spec))
        os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 10**9))

    pick(PickOptions(Constraints.parse(min_free="1G"), 60), backend=SimulatedBackend(str(path)),
         environ={}, sleep=sleep, on_progress=progress.append)
    assert calls["n"] == 1
    assert re.fullmatch(
        r"waiting for a device \(min free 1\.0 GiB\), [0-9.]+s of 1m; best now GPU 0: "
        r"only 0 B free < 1\.0 GiB wanted",
        progress[0],
    ), progress


def test_a_slow_pick_that_never_waited_in_line_says_it_did_not_wait(
    two: SimulatedBackend, registry: DirectoryStore
) -> None:
    """``waited_s`` is the time spent in line, not the pick's duration: a pick that fits at its
    first try waited 0 s however slow the machine (a loaded host printed "waited 1.1s in line"
    under picks that never queued). Caught: the whole pick's duration reported as a wait."""
    readings = iter(range(0, 10_000, 5))  # every reading of the pick's clock is 5 s later
    result = pick(PickOptions(Constraints.parse(), 60.0), backend=two, environ={},
                  store=registry, clock=lambda: float(next(readings)))
    try:
        assert result.chosen and result.waited_s == 0.0
    finally:
        assert result.lease is not None
        result.lease.release()


def test_a_pick_served_after_waiting_in_line_says_how_long(tmp_path: Path) -> None:
    """The counterpart: a pick that slept in line at least once reports the time since it began."""
    spec = fleet(1)
    spec["devices"][0]["memory_used"] = 80 * 1024**3
    backend = backend_for(tmp_path, spec)
    path = tmp_path / "fleet.json"

    def free_it(_: float) -> None:  # the device frees up while the picker sleeps in line
        spec["devices"][0]["memory_used"] = 0
        path.write_text(json.dumps(spec))
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))

    result = pick(PickOptions(Constraints.parse(min_free="10G"), 30.0), backend=backend,
                  environ={}, sleep=free_it)
    assert result.chosen and result.waited_s > 0.0


# ------------------------------------------------------------------------- the lock's wait


class CountingBackend(SimulatedBackend):
    """The simulated fleet, counting its snapshots."""

    snapshots = 0

    def snapshot(self) -> FleetSnapshot:
        self.snapshots += 1
        return super().snapshot()


@pytest.mark.parametrize(("waited", "snapshots"), [(0.0, 1), (0.05, 1), (0.051, 2), (3.0, 2)])
def test_a_pick_reads_the_devices_again_only_after_a_long_wait_for_the_lock(
    tmp_path: Path, registry: DirectoryStore, monkeypatch: pytest.MonkeyPatch,
    waited: float, snapshots: int,
) -> None:
    """The devices are read while the pick lock is on its way (the broker's round trip);
    a pick that then waited behind others (over LOCK_WAIT_RESNAPSHOT_S) reads them again, one
    that did not keeps its one snapshot. Caught: the second read dropped (a waiting pick ranks
    on devices as they were before the lock's earlier holders used them), or made always (a
    snapshot per pick wasted)."""
    from autogpu_jupyter.core.leasing.directory import Transaction

    (tmp_path / "fleet.json").write_text(json.dumps(fleet(2)))
    backend = CountingBackend(str(tmp_path / "fleet.json"))
    monkeypatch.setattr(Transaction, "ready", lambda self: waited)
    result = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert result.lease is not None
    assert backend.snapshots == snapshots
    result.lease.release()


def test_a_pick_on_an_amd_host_sets_the_rocm_variables(tmp_path: Path) -> None:
    """The environment of the result is written for the vendor of the devices picked: on AMD
    ROCR_VISIBLE_DEVICES names the host's device, and the runtimes' own variables count from 0."""
    backend = backend_for(tmp_path, {"vendor": "amd", **fleet(2)})
    result = pick(PickOptions(Constraints.parse(exclude="0")), backend=backend, environ={})
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    assert result.env["ROCR_VISIBLE_DEVICES"] == "1"  # the device of the host, by its index
    assert result.env["HIP_VISIBLE_DEVICES"] == result.env["CUDA_VISIBLE_DEVICES"] == "0"


# ---- named devices, and what no wait can help (issue 41) ---------------------------------------


def test_a_waiting_pick_of_a_named_device_is_served_only_from_it(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    """The ticket of `pick 1 --wait` lets other pickers see that only GPU 1 would serve it (its
    allowed UUIDs), and the pick takes GPU 1 once it frees, never the idle GPU 0."""
    spec = fleet(2)
    backend = backend_for(tmp_path, spec)
    held = pick(PickOptions(Constraints(devices=("1",), exclusive=True)), backend=backend,
                environ={}, store=registry)
    tickets: list[dict[str, Any] | None] = []

    def sleep(_s: float) -> None:
        tickets.extend(
            r.constraints for r in registry.list_leases(include_tickets=True) if r.kind == "ticket"
        )
        assert held.lease is not None
        held.lease.release()

    result = pick(PickOptions(Constraints.parse(devices="1", exclusive=True), 30),
                  backend=backend, environ={}, store=registry, sleep=sleep)
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    assert tickets[0] is not None and tickets[0]["allowed_uuids"] == [uuid_of(1)]


def test_a_pick_nothing_could_ever_fit_is_refused_at_once_without_a_ticket(
    two: SimulatedBackend, registry: DirectoryStore
) -> None:
    """Every device ruled out by the request itself: no ticket, no sleep, the error says no wait
    helps (the front ends then suggest no --wait)."""
    slept: list[float] = []
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(exclude="0,1"), 600), backend=two, environ={},
             store=registry, sleep=slept.append)
    assert slept == []
    assert live(registry) == []
    assert info.value.waitable is False
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(min_free="90G")), backend=two, environ={})
    assert info.value.waitable is True


def test_named_devices_that_do_not_fit_are_one_line_each_named_with_why(tmp_path: Path) -> None:
    spec = fleet(3)
    spec["devices"][1]["memory_used"] = "75G"
    spec["devices"][2]["utilization_pct"] = 95
    backend = backend_for(tmp_path, spec)
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(devices="1,2", count=2, min_free="10G", max_util="50")),
             backend=backend, environ={})
    assert str(info.value) == (
        "GPU 1, GPU 2 do not fit (devices 1,2, min free 10.0 GiB, max util 50%): GPU 1: only "
        "5.0 GiB free < 10.0 GiB wanted; GPU 2: 80.0 GiB free >= 10.0 GiB wanted; utilisation 95% "
        "> max 50%")
    with pytest.raises(NoDeviceFitsError) as info:
        pick(PickOptions(Constraints.parse(devices="0,1", count=2, min_free="10G")),
             backend=backend, environ={})
    assert str(info.value) == (
        "only 1 of GPU 0, GPU 1 fit(s), 2 wanted (devices 0,1, min free 10.0 GiB): GPU 1: only "
        "5.0 GiB free < 10.0 GiB wanted")


def test_a_named_device_that_is_not_there_names_the_value_and_the_forms(
    two: SimulatedBackend,
) -> None:
    with pytest.raises(UsageErrorBase) as info:
        pick(PickOptions(Constraints.parse(devices="0,GPU-99999999")), backend=two, environ={})
    assert str(info.value) == (
        "no device 'GPU-99999999' on this host; name devices by index (0, 1) or by UUID or its "
        "first 6 or more characters (e.g. GPU-00000000)")


def test_index_ids_refuse_a_mig_device_before_any_lease(
    tmp_path: Path, registry: DirectoryStore
) -> None:
    """``c.AutoGPU.visible_ids = "index"`` (issue 41) on a MIG device: one line, and no lease
    left behind (the refusal comes before the lease is written)."""
    from tests.fakenvml import fleet_mig

    backend = backend_for(tmp_path, fleet_mig())
    mig = next(d for d in backend.snapshot().devices if d.is_mig)
    with pytest.raises(UsageErrorBase) as info:
        pick(PickOptions(Constraints(devices=(mig.uuid,))), backend=backend, environ={},
             store=registry, visible_ids="index")
    assert str(info.value).startswith(f"visible_ids = 'index' cannot select {mig.label}: ")
    assert live(registry) == []
    whole = next(d for d in backend.snapshot().devices if not d.is_mig and not d.mig_enabled)
    result = pick(PickOptions(Constraints(devices=(whole.uuid,))), backend=backend, environ={},
                  store=registry, visible_ids="index")
    assert result.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                          "CUDA_VISIBLE_DEVICES": str(whole.index)}
    assert live(registry) == [("lease", (whole.uuid,))]
