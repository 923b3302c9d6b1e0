"""Fast unit tests of move requests (``core.moves``): planning a move over the simulated backend,
the request file in a private runtime directory, and what a restart honours (exact messages,
exact JSON, no kernels or servers)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from autogpu_jupyter.core import moves, session
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError, UsageErrorBase
from tests.leasehelpers import forget_backends, uuid_of

GiB = 1024**3
U0, U1, U2, U3, U4 = (uuid_of(i) for i in range(5))
MIG0, MIG1 = "MIG-aaaa0000-0000", "MIG-aaaa0001-0000"
A100 = "NVIDIA A100-SXM4-80GB"
LOSES = (
    "Restarting loses the kernel's state (variables, imports, data in memory): save what you "
    "need first."
)
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID", "AUTOGPU_PROVISIONED",
    "AUTOGPU_GRANT_CVD", "AUTOGPU_MOVE_FILE", "AUTOGPU_PICK_OPTIONS", "AUTOGPU_SIMULATE",
)


def _fleet() -> dict[str, Any]:
    """GPU 0: 70 GiB free; GPU 1: 10 GiB free, half busy; GPU 2: an idle L4; GPU 3: MIG on,
    two 10 GiB MIG devices; GPU 4: lost."""
    gpu: dict[str, Any] = {"memory_total": "80GiB", "processes": []}
    return {"devices": [
        {**gpu, "uuid": U0, "name": A100, "memory_used": "10GiB", "utilization_pct": 5},
        {**gpu, "uuid": U1, "name": A100, "memory_used": "70GiB", "utilization_pct": 50},
        {**gpu, "uuid": U2, "name": "NVIDIA L4", "memory_total": "24GiB", "memory_used": 0,
         "utilization_pct": 0},
        {"uuid": U3, "name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "memory_used": 0,
         "mig_devices": [
             {"uuid": MIG0, "profile": "1g.10gb", "memory_total": "10GiB"},
             {"uuid": MIG1, "profile": "1g.10gb", "memory_total": "10GiB"},
         ]},
        {"uuid": U4, "name": A100, "lost": True},
    ]}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    session.release()
    yield
    session.release()


@pytest.fixture
def fleet_path(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet()))
    return path


@pytest.fixture
def backend(fleet_path: Path) -> SimulatedBackend:
    return SimulatedBackend(str(fleet_path))


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    """A private Jupyter runtime directory (mode 0700, this user's)."""
    path = tmp_path / "runtime"
    path.mkdir(mode=0o700)
    return path


def _plan(backend: SimulatedBackend, target: str, current: list[str] | None = None,
          constraints: Constraints | None = None, **kw: Any) -> moves.MovePlan:
    return moves.plan_move(
        target, current_uuids=[U0] if current is None else current,
        constraints=constraints or Constraints(), backend=backend, environ=kw.pop("environ", {}),
        **kw,
    )


def _usage(backend: SimulatedBackend, target: str, **kw: Any) -> str:
    with pytest.raises(UsageErrorBase) as err:
        _plan(backend, target, **kw)
    assert not isinstance(err.value, NoDeviceFitsError)
    return str(err.value)


# ---- the request and the plan ---------------------------------------------------------------


def test_a_request_and_a_plan_as_json() -> None:
    named = moves.MoveRequest("k-1", (U1,), (U0,), 12.5, "magic")
    best = moves.MoveRequest(None, (), (U0, U2), 3.0, "server")
    assert (named.best, best.best) == (False, True)
    assert named.to_dict() == {
        "kernel_id": "k-1", "target_uuids": [U1], "from_uuids": [U0], "requested_s": 12.5,
        "source": "magic",
    }
    dev = DeviceSnapshot(index=1, uuid=U1, name="A100")
    plan = moves.MovePlan(request=best, target=(dev,), message="m")
    assert plan.to_dict() == {"request": best.to_dict(), "target": [dev.to_dict()], "message": "m"}


@pytest.mark.parametrize("kernel_id", ["abc", "a.b_c-1", "K" * 128, "0"])
def test_the_move_file_of_a_kernel_is_named_by_its_id(tmp_path: Path, kernel_id: str) -> None:
    assert moves.move_file_for(str(tmp_path), kernel_id) == (
        tmp_path / f"autogpu-move-{kernel_id}.json"
    )


@pytest.mark.parametrize("kernel_id", ["", "../etc", "a b", "K" * 129, "id/x", "x\n"])
def test_a_kernel_id_that_is_not_a_plain_name_is_refused(tmp_path: Path, kernel_id: str) -> None:
    with pytest.raises(UsageErrorBase) as err:
        moves.move_file_for(tmp_path, kernel_id)
    assert str(err.value) == (
        f"invalid kernel id {kernel_id!r}: expected letters, digits and '-'"
    )


# ---- reading request files ------------------------------------------------------------------


def _write(path: Path, payload: Any) -> Path:
    path.write_bytes(payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    return path


GOOD = {"kernel_id": "k1", "target_uuids": [U1], "from_uuids": [U0], "requested_s": 7,
        "source": "server"}


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        (GOOD, moves.MoveRequest("k1", (U1,), (U0,), 7.0, "server")),
        ({"requested_s": 1.5}, moves.MoveRequest(None, (), (), 1.5, "")),
        ({**GOOD, "kernel_id": None, "source": "s" * 32},
         moves.MoveRequest(None, (U1,), (U0,), 7.0, "s" * 32)),
        ({**GOOD, "target_uuids": ["G" * 128], "from_uuids": ["MIG-1/2:3._x"] + ["x"] * 63},
         moves.MoveRequest("k1", ("G" * 128,), ("MIG-1/2:3._x",) + ("x",) * 63, 7.0, "server")),
    ],
)
def test_a_well_formed_request_file_is_read(
    tmp_path: Path, payload: dict[str, Any], want: moves.MoveRequest
) -> None:
    got = moves.read_move(_write(tmp_path / "m.json", payload))
    assert got == want
    assert type(got.requested_s) is float  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ([1, 2], "not an object"),
        ({**GOOD, "target_uuids": U1}, "bad device list"),
        ({**GOOD, "from_uuids": "x"}, "bad device list"),
        ({**GOOD, "target_uuids": ["G"] * 65}, "bad device list"),
        ({**GOOD, "from_uuids": ["G"] * 65}, "bad device list"),
        ({**GOOD, "target_uuids": [7]}, "bad device list"),
        ({**GOOD, "from_uuids": ["-GPU"]}, "bad device list"),
        ({**GOOD, "from_uuids": ["G" * 129]}, "bad device list"),
        ({**GOOD, "target_uuids": ["GPU 1"]}, "bad device list"),
        ({**GOOD, "target_uuids": ["GPU-1\n"]}, "bad device list"),
        ({**GOOD, "kernel_id": "k1\n"}, "bad kernel id"),
        ({**GOOD, "kernel_id": 5}, "bad kernel id"),
        ({**GOOD, "kernel_id": "../x"}, "bad kernel id"),
        ({**GOOD, "requested_s": "7"}, "bad time"),
        ({**GOOD, "requested_s": True}, "bad time"),
        ({"kernel_id": "k1"}, "bad time"),
        ({**GOOD, "source": 3}, "bad source"),
        ({**GOOD, "source": "s" * 33}, "bad source"),
        # the reason is Python's own (json's, the codec's): only that one is given is pinned
        (b"{not json", None),
        (b"\xff\xfe", None),
    ],
)
def test_a_malformed_request_file_is_ignored_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, payload: Any, why: str | None
) -> None:
    path = _write(tmp_path / "m.json", payload)
    with caplog.at_level(logging.WARNING, logger="autogpu_jupyter.core.moves"):
        assert moves.read_move(path) is None
    if why is not None:
        assert caplog.messages == [f"ignoring malformed move request {path}: {why}"]
    else:
        (said,) = caplog.messages
        head = f"ignoring malformed move request {path}: "
        assert said.startswith(head) and said[len(head):].strip()


def test_a_request_of_exactly_the_size_limit_is_read_and_a_larger_one_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.dumps(GOOD).encode()
    at_limit = _write(tmp_path / "a.json", body + b" " * (4096 - len(body)))
    over = _write(tmp_path / "b.json", body + b" " * (4097 - len(body)))
    with caplog.at_level(logging.WARNING, logger="autogpu_jupyter.core.moves"):
        assert moves.read_move(at_limit) == moves.MoveRequest("k1", (U1,), (U0,), 7.0, "server")
        assert moves.read_move(over) is None
    assert caplog.messages == [f"ignoring move request {over}: larger than 4096 bytes"]


def test_what_is_not_a_regular_file_of_this_user_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "missing.json"
    link = tmp_path / "link.json"
    link.symlink_to(_write(tmp_path / "real.json", GOOD))
    directory = tmp_path / "dir.json"
    directory.mkdir()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    foreign = _write(tmp_path / "foreign.json", GOOD)
    os.chown(foreign, os.geteuid() + 4242, -1)
    with caplog.at_level(logging.WARNING, logger="autogpu_jupyter.core.moves"):
        for path in (missing, link, directory, fifo, foreign):
            assert moves.read_move(path) is None
    assert caplog.messages == [
        f"ignoring move request {link}: Too many levels of symbolic links",
        f"ignoring move request {directory}: not a regular file of this user",
        f"ignoring move request {fifo}: not a regular file of this user",
        f"ignoring move request {foreign}: not a regular file of this user",
    ]


def test_take_reads_and_removes_cancel_removes(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.json", GOOD)
    assert moves.take_move(path) == moves.MoveRequest("k1", (U1,), (U0,), 7.0, "server")
    assert not path.exists()
    assert moves.take_move(path) is None
    bad = _write(tmp_path / "bad.json", b"[]")
    assert moves.take_move(bad) is None
    assert not bad.exists()  # a malformed request does not outlive the restart either
    _write(path, GOOD)
    assert moves.cancel_move(path) is True
    assert not path.exists()
    assert moves.cancel_move(path) is False


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        ({**GOOD, "target_uuids": [U1, U2]},
         "move to GPU-00000001, GPU-00000002 pending: restart the kernel (Kernel > Restart "
         "Kernel) to move"),
        ({**GOOD, "target_uuids": []},
         "move to the best device pending: restart the kernel (Kernel > Restart Kernel) to move"),
    ],
)
def test_a_pending_move_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: dict[str, Any], text: str
) -> None:
    path = _write(tmp_path / "m.json", payload)
    assert moves.pending_move_text({"AUTOGPU_MOVE_FILE": f" {path} "}) == text
    monkeypatch.setenv("AUTOGPU_MOVE_FILE", str(path))
    assert moves.pending_move_text() == text


def test_no_pending_move_without_a_request(tmp_path: Path) -> None:
    assert moves.pending_move_text({}) is None
    assert moves.pending_move_text({"AUTOGPU_MOVE_FILE": "  "}) is None
    assert moves.pending_move_text({"AUTOGPU_MOVE_FILE": str(tmp_path / "none.json")}) is None
    assert moves.pending_move_text() is None


# ---- the kernel's view of the provisioner ---------------------------------------------------


@pytest.mark.parametrize(
    ("env", "cvd"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "2", "AUTOGPU_GRANT_CVD": "0,2"}, "2"),
        ({"AUTOGPU_PROVISIONED": "0", "CUDA_VISIBLE_DEVICES": "2", "AUTOGPU_GRANT_CVD": "0,2"},
         "2"),
        ({"AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": "2", "AUTOGPU_GRANT_CVD": "0,2"},
         "0,2"),
        ({"AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": "2"}, None),
        ({"AUTOGPU_PROVISIONED": "1"}, None),
        ({"AUTOGPU_PROVISIONED": "1", "AUTOGPU_GRANT_CVD": ""}, ""),
    ],
)
def test_the_grant_environment_is_the_provisioners(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cvd: str | None
) -> None:
    got = moves.grant_environ(env)
    assert got.get("CUDA_VISIBLE_DEVICES") == cvd
    assert {k: v for k, v in got.items() if k != "CUDA_VISIBLE_DEVICES"} == {
        k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"
    }
    assert got is not env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert moves.grant_environ().get("CUDA_VISIBLE_DEVICES") == cvd


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("", Constraints()),
        ("{not json", Constraints()),
        ('["min_free", "10G"]', Constraints()),
        ('{"min_free": "10G", "count": 2, "kernel_id": "k"}',
         Constraints(min_free=parse_size("10G"), count=2)),
        ('{"max_util": "50", "exclusive": true}', Constraints(max_util_pct=50, exclusive=True)),
        ('{"min_free": "lots", "count": 2}', Constraints()),
        # JSON rules, as the provisioner reads them: a number of bytes is no size there
        ('{"min_free": 10737418240, "count": 2}', Constraints()),
        ("null", Constraints()),
    ],
)
def test_the_kernels_pick_options_come_from_the_provisioner(
    monkeypatch: pytest.MonkeyPatch, raw: str, want: Constraints
) -> None:
    assert moves.kernel_constraints({"AUTOGPU_PICK_OPTIONS": raw}) == want
    monkeypatch.setenv("AUTOGPU_PICK_OPTIONS", raw)
    assert moves.kernel_constraints() == want


def test_a_kernel_without_pick_options_picks_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert moves.kernel_constraints({"CUDA_VISIBLE_DEVICES": "0"}) == Constraints()
    monkeypatch.delenv("AUTOGPU_PICK_OPTIONS", raising=False)
    assert moves.kernel_constraints() == Constraints()


# ---- planning a move ------------------------------------------------------------------------


def test_best_moves_to_the_device_the_one_decision_names(backend: SimulatedBackend) -> None:
    """GPU 0 still fits (70 GiB free, 5 %), but the decision names the idle GPU 2: "the best
    device", not "the best other device"."""
    before = time.time()
    plan = _plan(backend, " best ", kernel_id="k-7")
    after = time.time()
    assert plan.message == (
        f"The kernel will restart on GPU 2 (NVIDIA L4, 24.0 GiB free), the best device now. "
        f"{LOSES}"
    )
    assert [d.uuid for d in plan.target] == [U2]
    req = plan.request
    # the request names the device the plan showed: the restart goes where the dialog said
    assert (req.kernel_id, req.target_uuids, req.from_uuids, req.source) == (
        "k-7", (U2,), (U0,), "magic"
    )
    assert before <= req.requested_s <= after


def test_best_on_the_best_device_already_says_so_and_moves_nowhere(
    backend: SimulatedBackend,
) -> None:
    """The ping-pong of issue 41: a kernel on the device the decision names was moved to "the
    best other device", and from there back. It is told it is on the best device already."""
    assert _usage(backend, "best", current=[U2]) == (
        "the kernel is already on the best device: GPU 2 (NVIDIA L4, 24.0 GiB free); nothing to "
        "move"
    )
    # the same for its own options: within min free 30G, GPU 0 is the best device
    assert _usage(backend, "--best", current=[U0],
                  constraints=Constraints(min_free=parse_size("30G"))) == (
        f"the kernel is already on the best device: GPU 0 ({A100}, 70.0 GiB free); nothing to "
        "move"
    )
    # and nothing was planned from the kernel either
    assert moves.best_move_target(backend.snapshot(), [U2], Constraints(), environ={}) == ()
    assert [d.uuid for d in moves.best_move_target(
        backend.snapshot(), [U0], Constraints(), environ={})] == [U2]


def test_best_among_identical_idle_gpus_stays_where_it_is(tmp_path: Path) -> None:
    """Two identical idle GPUs rank apart only by their UUIDs: neither is better, so a kernel
    on the second is on the best device (a move would only invite the next one)."""
    gpu: dict[str, Any] = {"name": A100, "memory_total": "80GiB", "memory_used": 0,
                           "utilization_pct": 0, "processes": []}
    path = tmp_path / "twins.json"
    path.write_text(json.dumps({"devices": [{**gpu, "uuid": U0}, {**gpu, "uuid": U1}]}))
    twins = SimulatedBackend(str(path))
    assert _usage(twins, "best", current=[U1]) == (
        f"the kernel is already on the best device: GPU 1 ({A100}, 80.0 GiB free); nothing to "
        "move"
    )
    assert moves.best_move_target(twins.snapshot(), [U1], Constraints(), environ={}) == ()


def test_best_other_only_for_a_device_that_no_longer_fits(backend: SimulatedBackend) -> None:
    """Excluded by the kernel's own options, too full for them, or gone: then "the best other
    device" (the current one is left out)."""
    plan = _plan(backend, "--BEST", current=[U2, "GPU-gone"], constraints=Constraints(
        exclude=("3:0", "3:1", "2"), min_free=parse_size("5G")), source="server")
    assert plan.message == (
        f"The kernel will restart on GPU 0 (NVIDIA A100-SXM4-80GB, 70.0 GiB free), the best "
        f"other device now. {LOSES}"
    )
    assert plan.request.from_uuids == (U2, "GPU-gone")
    assert plan.request.source == "server"
    # GPU 1 holds only 10 GiB free: too full for 20G
    plan = _plan(backend, "best", current=[U1], constraints=Constraints(
        min_free=parse_size("20G")))
    assert plan.message == (
        f"The kernel will restart on GPU 2 (NVIDIA L4, 24.0 GiB free), the best other device "
        f"now. {LOSES}"
    )
    # a kernel with no device (CPU only) may move to the best device, whatever it is
    plan = _plan(backend, "best", current=[])
    assert [d.uuid for d in plan.target] == [U2]
    assert "the best device now" in plan.message


def test_best_counts_other_holders_bookings_and_the_smoothed_load(
    backend: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[U2], requested_bytes=20 * GiB)
    twenty = Constraints(min_free=parse_size("20G"))
    try:
        plan = _plan(backend, "best", current=[U1], store=registry, constraints=twenty)
        assert [d.uuid for d in plan.target] == [U0]
    finally:
        lease.release()
    assert [d.uuid for d in _plan(backend, "best", current=[U1], constraints=twenty).target] == [
        U2
    ]
    # GPU 2 is busy on average though idle right now: GPU 0 is better
    plan = _plan(backend, "best", current=[U1], constraints=twenty, smoothed_util={U2: 99.0})
    assert [d.uuid for d in plan.target] == [U0]


def test_best_with_nothing_better_says_why_each_device_was_dropped(
    backend: SimulatedBackend,
) -> None:
    cons = Constraints(min_free=parse_size("30G"), exclude=("0",))
    with pytest.raises(NoDeviceFitsError) as err:
        _plan(backend, "best", current=[U0, U1], constraints=cons)
    assert str(err.value) == (
        "no better device to move to (min free 30.0 GiB, excluding 0; the current one excluded):\n"
        f"  GPU 0 ({A100}): dropped: excluded by --exclude 0; 70.0 GiB free >= 30.0 GiB wanted\n"
        f"  GPU 1 ({A100}): dropped: excluded by --exclude {U1}; only 10.0 GiB free < 30.0 GiB "
        "wanted\n"
        "  GPU 2 (NVIDIA L4): dropped: only 24.0 GiB free < 30.0 GiB wanted\n"
        "  GPU 3 (NVIDIA A100-SXM4-40GB): dropped: MIG mode is on: use one of its 2 MIG devices "
        "instead; 40.0 GiB free >= 30.0 GiB wanted; utilisation unknown: ranked by memory and "
        "leases\n"
        "  GPU 3 MIG 0 (NVIDIA A100-SXM4-40GB MIG 1g.10gb): dropped: only 10.0 GiB free < 30.0 GiB "
        "wanted; utilisation unknown: ranked by memory and leases\n"
        "  GPU 3 MIG 1 (NVIDIA A100-SXM4-40GB MIG 1g.10gb): dropped: only 10.0 GiB free < 30.0 GiB "
        "wanted; utilisation unknown: ranked by memory and leases\n"
        f"  GPU 4 ({A100}): dropped: unavailable: GPU is lost"
    )
    assert [c.device.uuid for c in err.value.candidates] == [U0, U1, U2, U3, MIG0, MIG1, U4]


def test_a_named_device_the_kernel_may_use(backend: SimulatedBackend) -> None:
    plan = _plan(backend, "1", kernel_id="k-1", constraints=Constraints(exclude=("1",)),
                 smoothed_util={U1: 99.0})
    assert plan.message == (
        f"The kernel will restart on GPU 1 (NVIDIA A100-SXM4-80GB, 10.0 GiB free), the requested "
        f"device now. {LOSES}"
    )
    req = plan.request
    assert (req.kernel_id, req.target_uuids, req.from_uuids, req.source) == (
        "k-1", (U1,), (U0,), "magic"
    )
    assert [d.uuid for d in plan.target] == [U1]
    assert [d.uuid for d in _plan(backend, "3:1", current=[]).target] == [MIG1]


def test_named_devices_for_a_two_device_kernel(backend: SimulatedBackend) -> None:
    plan = _plan(backend, f" 2 , {U0[:14]}", current=[U0, U1], constraints=Constraints(count=2))
    assert plan.message == (
        "The kernel will restart on GPU 2 (NVIDIA L4, 24.0 GiB free), GPU 0 "
        f"(NVIDIA A100-SXM4-80GB, 70.0 GiB free), the requested device now. {LOSES}"
    )
    assert plan.request.target_uuids == (U2, U0)


@pytest.mark.parametrize(
    ("target", "kw", "message"),
    [
        ("9", {}, "unknown device '9' for a move: expected an NVML index (0, 1, 2, 3, 4), a "
         "(unique) UUID, or --best"),
        ("GPU-0000000", {}, "unknown device 'GPU-0000000' for a move: expected an NVML index "
         "(0, 1, 2, 3, 4), a (unique) UUID, or --best"),
        ("1,", {}, "unknown device '' for a move: expected an NVML index (0, 1, 2, 3, 4), a "
         "(unique) UUID, or --best"),
        ("1,2", {}, "this kernel uses 1 device(s); name as many for the move (got 2: '1,2'), or "
         "use --best"),
        ("1, 1", {"constraints": Constraints(count=2)}, "this kernel uses 2 device(s); name as "
         "many for the move (got 1: '1, 1'), or use --best"),
        ("1", {"environ": {"CUDA_VISIBLE_DEVICES": "0,2"}}, "GPU 1 is outside this server's GPU "
         "grant (CUDA_VISIBLE_DEVICES='0,2' grants GPU 0, GPU 2)"),
        ("0", {}, "the kernel already runs on GPU 0"),
        ("1,0", {"current": [U0, U1], "constraints": Constraints(count=2)},
         "the kernel already runs on GPU 1, GPU 0"),
        ("2", {"constraints": Constraints(min_free=parse_size("30G"))}, "GPU 2 does not fit this "
         "kernel's options (min free 30.0 GiB): only 24.0 GiB free < 30.0 GiB wanted"),
        ("4", {}, "GPU 4 does not fit this kernel's options (no constraints): unavailable: GPU is "
         "lost"),
        ("3", {}, "GPU 3 does not fit this kernel's options (no constraints): MIG mode is on: use "
         "one of its 2 MIG devices instead; utilisation unknown: ranked by memory and leases"),
    ],
)
def test_a_move_that_cannot_be_done_says_why(
    backend: SimulatedBackend, target: str, kw: dict[str, Any], message: str
) -> None:
    assert _usage(backend, target, **kw) == message


def test_a_move_to_part_of_the_current_devices_is_a_move(backend: SimulatedBackend) -> None:
    plan = _plan(backend, "0,2", current=[U0, U1], constraints=Constraints(count=2))
    assert plan.request.target_uuids == (U0, U2)


def test_without_a_backend_or_environment_the_process_own_are_used(
    fleet_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    forget_backends()
    try:
        plan = moves.plan_move("best", current_uuids=[U1], constraints=Constraints())
        assert [d.uuid for d in plan.target] == [U0]  # within the grant 0,1: GPU 2 is not
    finally:
        forget_backends()


# ---- recording a move -----------------------------------------------------------------------


def test_request_move_records_the_plan_privately(
    backend: SimulatedBackend, runtime: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = moves.move_file_for(runtime, "k-9")
    path.write_text("an older request")
    with caplog.at_level(logging.INFO, logger="autogpu_jupyter.core.moves"):
        plan = moves.request_move(
            path, "2", current_uuids=[U0], constraints=Constraints(), kernel_id="k-9",
            backend=backend, environ={}, smoothed_util={U2: 1.0},
        )
    assert plan.request.source == "server"
    assert json.loads(path.read_text()) == plan.request.to_dict()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(runtime)) == ["autogpu-move-k-9.json"]
    assert moves.read_move(path) == plan.request
    assert caplog.messages == [f"move requested for kernel k-9: {plan.message}"]


def test_request_move_counts_other_holders_bookings_and_the_smoothed_load(
    backend: SimulatedBackend, runtime: Path, registry_dir: Path
) -> None:
    path = moves.move_file_for(runtime, "k-9")
    twenty = Constraints(min_free=parse_size("20G"))
    registry = DirectoryStore(registry_dir)
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[U2], requested_bytes=20 * GiB)
    try:
        plan = moves.request_move(path, "best", current_uuids=[U1], constraints=twenty,
                                  backend=backend, environ={}, store=registry)
    finally:
        lease.release()
    assert [d.uuid for d in plan.target] == [U0]
    # GPU 2 is busy on average though idle right now: GPU 0 is better
    plan = moves.request_move(path, "best", current_uuids=[U1], constraints=twenty,
                              backend=backend, environ={}, smoothed_util={U2: 99.0})
    assert [d.uuid for d in plan.target] == [U0]
    assert moves.read_move(path) == plan.request


def test_move_from_a_kernel_without_a_device_counts_other_holders_bookings(
    backend: SimulatedBackend, runtime: Path, registry_dir: Path
) -> None:
    env = _kernel_env(runtime, AUTOGPU_PICK_OPTIONS='{"min_free": "20G"}')
    del env["AUTOGPU_PICKED"], env["CUDA_VISIBLE_DEVICES"]  # a kernel started on no device
    plan = moves.request_move_from_kernel("best", environ=env, backend=backend)
    assert plan.request == moves.MoveRequest("k-3", (U2,), (), ANY, "magic")
    assert [d.uuid for d in plan.target] == [U2]
    registry = DirectoryStore(registry_dir)
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[U2], requested_bytes=20 * GiB)
    try:
        plan = moves.request_move_from_kernel("best", environ=env, backend=backend,
                                              store=registry)
    finally:
        lease.release()
    assert [d.uuid for d in plan.target] == [U0]


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o722])
def test_a_request_is_never_written_into_a_shared_directory(
    backend: SimulatedBackend, tmp_path: Path, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(AutoGPUError) as err:
        moves.request_move(shared / "m.json", "1", current_uuids=[U0],
                           constraints=Constraints(), backend=backend, environ={})
    assert str(err.value) == (
        f"refusing to write a move request into {shared}: it is not a private directory of this "
        "user (expected the Jupyter runtime directory, mode 0700)"
    )
    assert os.listdir(shared) == []


def test_a_request_is_never_written_into_another_users_directory(
    backend: SimulatedBackend, tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, os.geteuid() + 4242, -1)
    with pytest.raises(AutoGPUError) as err:
        moves.request_move(theirs / "m.json", "1", current_uuids=[U0],
                           constraints=Constraints(), backend=backend, environ={})
    assert str(err.value).startswith(f"refusing to write a move request into {theirs}: ")


def test_a_request_that_cannot_be_put_in_place_leaves_no_temporary_file(
    backend: SimulatedBackend, runtime: Path
) -> None:
    path = runtime / "m.json"
    path.mkdir()
    (path / "keep").write_text("")
    with pytest.raises(OSError):
        moves.request_move(path, "1", current_uuids=[U0], constraints=Constraints(),
                           backend=backend, environ={})
    assert sorted(os.listdir(runtime)) == ["m.json"]


def test_a_temporary_file_planted_in_advance_is_never_written_through(
    backend: SimulatedBackend, runtime: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (runtime / f".m.json.{os.getpid()}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        moves.request_move(runtime / "m.json", "1", current_uuids=[U0],
                           constraints=Constraints(), backend=backend, environ={})
    assert victim.read_text() == "untouched"
    assert not (runtime / "m.json").exists()


def test_a_request_under_a_path_that_is_not_a_directory_fails_naming_it(
    backend: SimulatedBackend, runtime: Path
) -> None:
    parent = runtime / "file"
    parent.write_text("")
    with pytest.raises(NotADirectoryError) as err:
        moves.request_move(parent / "m.json", "1", current_uuids=[U0],
                           constraints=Constraints(), backend=backend, environ={})
    assert err.value.filename == str(parent)
    assert sorted(os.listdir(runtime)) == ["file"]


def _kernel_env(runtime: Path, **extra: str) -> dict[str, str]:
    env = {
        "AUTOGPU_PROVISIONED": "1",
        "AUTOGPU_MOVE_FILE": str(runtime / "autogpu-move-k-3.json"),
        "AUTOGPU_PICKED": U0,
        "CUDA_VISIBLE_DEVICES": U0,
    }
    env.update(extra)
    return env


RESTART = " Restart the kernel now (Kernel > Restart Kernel) to move; until then nothing changes."


def test_move_from_a_provisioned_kernel_within_the_servers_grant(
    backend: SimulatedBackend, runtime: Path
) -> None:
    env = _kernel_env(runtime, AUTOGPU_PICK_OPTIONS='{"min_free": "5G"}', AUTOGPU_GRANT_CVD="0,1",
                      AUTOGPU_PICKED=U1, CUDA_VISIBLE_DEVICES=U1)
    plan = moves.request_move_from_kernel("best", environ=env, backend=backend)
    assert plan.message == (
        "The kernel will restart on GPU 0 (NVIDIA A100-SXM4-80GB, 70.0 GiB free), the best "
        f"device now. {LOSES}{RESTART}"
    )
    req = plan.request
    assert (req.kernel_id, req.target_uuids, req.from_uuids, req.source) == (
        "k-3", (U0,), (U1,), "magic"
    )
    assert moves.read_move(runtime / "autogpu-move-k-3.json") == req


def test_move_from_a_kernel_keeps_its_options_and_all_its_devices(
    backend: SimulatedBackend, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _kernel_env(runtime, AUTOGPU_PICK_OPTIONS='{"min_free": "20G", "count": 2}',
                      AUTOGPU_PICKED=f"{U0},,{U1}")
    with pytest.raises(UsageErrorBase) as err:
        moves.request_move_from_kernel("2", environ=env, backend=backend)
    assert str(err.value) == (
        "this kernel uses 2 device(s); name as many for the move (got 1: '2'), or use --best"
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plan = moves.request_move_from_kernel("0, 2", backend=backend)
    assert plan.request.from_uuids == (U0, U1)
    assert plan.request.target_uuids == (U0, U2)


def test_a_move_file_not_named_for_a_kernel_records_no_kernel_id(
    backend: SimulatedBackend, runtime: Path
) -> None:
    env = _kernel_env(runtime, AUTOGPU_MOVE_FILE=str(runtime / "autogpu-move-bad id.json"))
    plan = moves.request_move_from_kernel("1", environ=env, backend=backend)
    assert plan.request.kernel_id is None
    assert moves.read_move(runtime / "autogpu-move-bad id.json") == plan.request


NOT_PROVISIONED = (
    "%gpu move needs a kernel started with the autogpu kernelspec (its provisioner picks at each "
    "restart). Install one with `autogpu kernelspec install` and choose \"Python 3 (autogpu)\" as "
    "this notebook's kernel; here, `%gpu pick` in a fresh kernel does the same."
)


@pytest.mark.parametrize(
    "drop",
    [{"AUTOGPU_PROVISIONED": "0"}, {"AUTOGPU_MOVE_FILE": " "}, {"AUTOGPU_MOVE_FILE": ""},
     {"AUTOGPU_MOVE_FILE": "-"}],
)
def test_move_from_a_kernel_the_provisioner_did_not_start_is_refused(
    backend: SimulatedBackend, runtime: Path, drop: dict[str, str]
) -> None:
    env = {k: v for k, v in _kernel_env(runtime, **drop).items() if v != "-"}
    with pytest.raises(UsageErrorBase) as err:
        moves.request_move_from_kernel("best", environ=env, backend=backend)
    assert str(err.value) == NOT_PROVISIONED
    assert os.listdir(runtime) == []


# ---- what a restart honours -----------------------------------------------------------------


def test_a_named_target_excludes_every_other_device(backend: SimulatedBackend) -> None:
    devices = backend.snapshot().devices
    base = Constraints(min_free=parse_size("1G"), exclude=("4",))
    req = moves.MoveRequest("k", (U1,), (U0,), 1.0, "server")
    cons, note = moves.move_constraints(req, base, devices)
    assert cons == Constraints(min_free=parse_size("1G"),
                               exclude=("4", U0, U2, U3, MIG0, MIG1, U4))
    assert note == "moved at your request"


def test_a_named_target_is_not_bound_by_the_devices_the_kernelspec_named(
    backend: SimulatedBackend,
) -> None:
    """A kernelspec with ``"devices": "0"`` (issue 41), moved by its user to GPU 1: the move
    names its own target; moving to the best other device keeps the kernelspec's devices."""
    devices = backend.snapshot().devices
    req = moves.MoveRequest("k", (U1,), (U0,), 1.0, "server")
    cons, _ = moves.move_constraints(req, Constraints(devices=("0",)), devices)
    assert cons.devices == ()
    best = moves.MoveRequest(None, (), (U0,), 1.0, "magic")
    cons, _ = moves.move_constraints(best, Constraints(devices=("0", "1"), count=1), devices)
    assert cons.devices == ("0", "1")


def test_a_named_mig_device_keeps_its_parent_and_a_named_gpu_its_mig_devices(
    backend: SimulatedBackend,
) -> None:
    devices = backend.snapshot().devices
    cons, _ = moves.move_constraints(
        moves.MoveRequest("k", (MIG1,), (U0,), 1.0, "server"), Constraints(), devices)
    assert cons.exclude == (U0, U1, U2, MIG0, U4)
    cons, _ = moves.move_constraints(
        moves.MoveRequest("k", (U3,), (U0,), 1.0, "server"), Constraints(), devices)
    assert cons.exclude == (U0, U1, U2, U4)


def test_best_excludes_the_devices_moved_away_from_that_still_exist(
    backend: SimulatedBackend,
) -> None:
    req = moves.MoveRequest(None, (), (U2, "GPU-gone", MIG0), 1.0, "magic")
    cons, note = moves.move_constraints(req, Constraints(exclude=("1",), count=2),
                                        backend.snapshot().devices)
    assert cons == Constraints(exclude=("1", U2, MIG0), count=2)
    assert note == "moved to the best other device at your request"


# ---- an AMD host's grant --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recorded", "rocr", "hip"),
    [
        # the server had ROCR_VISIBLE_DEVICES=0,1,2,3: the kernel's pick (2) no longer bounds
        ('{"ROCR_VISIBLE_DEVICES": "0,1,2,3"}', "0,1,2,3", None),
        ('{"ROCR_VISIBLE_DEVICES": "1,2", "HIP_VISIBLE_DEVICES": "0,1"}', "1,2", "0,1"),
        ("{}", None, None),  # the server had none: the whole host
        # not recorded (an older provisioner) or malformed: the kernel's own stay and bound
        (None, "2", "0"),
        ("[1, 2]", "2", "0"),
        ('{"ROCR_VISIBLE_DEVICES": 3}', "2", "0"),
        ('{"PATH": "/tmp"}', "2", "0"),
        ("{not json", "2", "0"),
    ],
)
def test_a_provisioned_amd_kernels_grant_is_the_servers_rocm_variables(
    recorded: str | None, rocr: str | None, hip: str | None
) -> None:
    """Caught: a move planned in a provisioned kernel on an AMD host was bounded by the
    kernel's own narrowed ROCm variables (only the CUDA grant was recorded), so it was refused."""
    env = {"AUTOGPU_PROVISIONED": "1", "ROCR_VISIBLE_DEVICES": "2", "HIP_VISIBLE_DEVICES": "0",
           "CUDA_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0"}
    if recorded is not None:
        env["AUTOGPU_GRANT_ROCM"] = recorded
    got = moves.grant_environ(env)
    assert (got.get("ROCR_VISIBLE_DEVICES"), got.get("HIP_VISIBLE_DEVICES")) == (rocr, hip)
    assert "CUDA_VISIBLE_DEVICES" not in got  # no AUTOGPU_GRANT_CVD: the server had none
    if recorded is None or rocr == "2":
        assert got["GPU_DEVICE_ORDINAL"] == "0"
    else:
        assert "GPU_DEVICE_ORDINAL" not in got


def test_a_move_in_a_provisioned_amd_kernel_plans_within_the_servers_grant() -> None:
    """On demo-amd, a kernel the provisioner put on one GPU (its ROCm variables name it) moves
    to another GPU the server's grant allows, and never outside it."""
    amd = SimulatedBackend("demo-amd")
    devices = amd.snapshot().devices
    here, there, outside = devices[0], devices[1], devices[2]
    kernel_env = {
        "AUTOGPU_PROVISIONED": "1",
        "ROCR_VISIBLE_DEVICES": str(here.index),
        "HIP_VISIBLE_DEVICES": "0",
        "AUTOGPU_GRANT_ROCM": json.dumps(
            {"ROCR_VISIBLE_DEVICES": f"{here.index},{there.index}"}),
    }
    plan = _plan(amd, there.uuid, current=[here.uuid], environ=moves.grant_environ(kernel_env))
    assert [d.uuid for d in plan.target] == [there.uuid]
    with pytest.raises(AutoGPUError):  # outside the server's grant: refused, never widened
        _plan(amd, outside.uuid, current=[here.uuid], environ=moves.grant_environ(kernel_env))
    del kernel_env["AUTOGPU_GRANT_ROCM"]  # not recorded: the kernel's own variable bounds
    with pytest.raises(AutoGPUError):
        _plan(amd, there.uuid, current=[here.uuid], environ=moves.grant_environ(kernel_env))
