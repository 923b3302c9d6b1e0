"""Shared-host safety: what another local user can do to everyone's autogpu, tried for real.

Each test reproduces one attack of the safety issue as a real second Unix user (``useradd``; CI
runs as root): user B plants names, holds locks, writes records or keeps a dead lease alive in
the shared registry, and user A (or root) then runs the real ``autogpu`` command as that user
(``runuser``) and sees what a person would see: the exit code and the one line of output.
Before the fixes each of these crashed, blinded or double-booked A; see docs/admin-registry.md
for the threat model they pin down.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.decision import ticket_constraints
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.leasing.records import MAX_SEQ
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from tests.leasehelpers import AsUser, as_user, cli_as, ensure_user, fleet, shared_area, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

REPO = Path(__file__).resolve().parents[2]
USER_A = "agtest-alice"
USER_B = "agtest-bob"


@pytest.fixture(scope="module")
def users() -> dict[str, tuple[int, int]]:
    return {"a": ensure_user(USER_A), "b": ensure_user(USER_B)}


class Area:
    """A shared directory: the registry (1777, root's) and a fleet file everyone reads."""

    def __init__(self, root: Path, n_gpus: int = 2) -> None:
        self.root = root
        self.registry = root / "registry"
        self.fleet = root / "fleet.json"
        self.write_fleet(fleet(n_gpus))

    def write_fleet(self, spec: dict[str, Any]) -> None:
        tmp = self.root / "fleet.tmp"
        tmp.write_text(json.dumps(spec))
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.fleet)

    def env(self, **extra: str) -> dict[str, str]:
        site = sysconfig.get_paths()["purelib"]
        return {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{site}:{REPO}",
            "AUTOGPU_SIMULATE": str(self.fleet),
            "AUTOGPU_REGISTRY_DIR": str(self.registry),
            "AUTOGPU_REGISTRY_LOCK_TIMEOUT": "0.5",
            **extra,
        }

    def cli(self, user: str, *args: str, **extra: str) -> Any:
        return cli_as(user, self.env(**extra), *args)

    def backend(self) -> SimulatedBackend:
        return SimulatedBackend(str(self.fleet))


@pytest.fixture
def area(users: dict[str, tuple[int, int]]) -> Iterator[Area]:
    with shared_area("autogpu-safety") as root:
        yield Area(root)


def _no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout


# ---- what user B does (module level: run in forked children that dropped to B's uid) -----------


def _mkdir(path: str) -> str:
    os.mkdir(path, 0o755)
    return path


def _hold_flock(path: str) -> int:
    """Open ``path`` read-only and hold ``flock(LOCK_EX)`` on it (kept while the child lives)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _plant_record(reg: str, kind: str, fields: dict[str, Any], raw: str | None = None) -> str:
    """Write a record under B's own directory, held like a live one; returns its path."""
    registry = DirectoryStore(reg)
    registry.check()
    uid = os.geteuid()
    d = os.path.join(reg, str(uid))
    os.makedirs(d, mode=0o755, exist_ok=True)
    lease_id = secrets.token_hex(16)
    record = {
        "version": 1,
        "kind": kind,
        "lease_id": lease_id,
        "device_uuids": [uuid_of(0)],
        "device_requested_bytes": [None],
        "exclusive": False,
        "user": registry.user,
        "uid": uid,
        "host": "h",
        "pid": os.getpid(),
        "created_s": time.time(),
        "kernel_id": None,
        "notebook_path": None,
        "command": None,
        "holder_kind": "process",
        **fields,
    }
    data = (raw if raw is not None else json.dumps(record)).replace("@ID@", lease_id)
    path = os.path.join(d, f"{lease_id}.{kind}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, data.encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path


@contextlib.contextmanager
def planted_lease(
    prefix: str, n_gpus: int, device: int, notebook_path: str
) -> Iterator[tuple[Path, Path]]:
    """A shared area (fleet file, registry) where user ``agtest-bob`` holds a live lease of
    1 GiB on GPU ``device`` whose notebook path is ``notebook_path``; yields (fleet, registry)."""
    b_uid, b_gid = ensure_user(USER_B)
    with shared_area(prefix) as root:
        fleet_path = root / "fleet.json"
        fleet_path.write_text(json.dumps(fleet(n_gpus)))
        os.chmod(fleet_path, 0o644)
        registry = root / "registry"
        DirectoryStore(registry).check()
        planted = AsUser(b_uid, b_gid, _plant_record, str(registry), "lease",
                         {"notebook_path": notebook_path, "device_uuids": [uuid_of(device)],
                          "device_requested_bytes": [1024**3]}, hold=True)
        try:
            assert str(planted.result()).startswith(str(registry))
            yield fleet_path, registry
        finally:
            planted.stop()


def _pick_and_die(reg: str, fleet_path: str) -> str:
    """Take an exclusive lease, then die by SIGKILL (no cleanup): a crashed kernel."""
    result = pick(
        PickOptions(Constraints(exclusive=True)),
        backend=SimulatedBackend(fleet_path),
        store=DirectoryStore(reg),
    )
    assert result.lease is not None
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


# ---- the attacks -------------------------------------------------------------------------------


def test_a_planted_superscript_directory_crashes_nobody(area: Area, users: Any) -> None:
    """Item 2: ``mkdir "$REGISTRY/¹"`` (isdigit() is true, int() fails) by another user."""
    area.cli(USER_A, "leases")  # creates the registry as an admin-less host would
    b_uid, b_gid = users["b"]
    as_user(b_uid, b_gid, _mkdir, str(area.registry / "¹"))
    as_user(b_uid, b_gid, _mkdir, str(area.registry / "٣"))  # Arabic-Indic three: int() == 3
    as_user(b_uid, b_gid, _mkdir, os.fsdecode(bytes(area.registry) + b"/\xff\xfe"))

    listed = area.cli(USER_A, "leases")
    assert (listed.returncode, listed.stdout) == (0, f"no live leases in {area.registry}\n")
    ran = area.cli(USER_A, "run", "--exclusive", "--", "true")
    assert ran.returncode == 0, ran.stderr
    assert "without a lease" not in ran.stderr  # a real lease, nothing to report
    for proc in (
        listed,
        ran,
        area.cli(USER_A, "list"),
        area.cli(USER_A, "leases", "--prune"),
        area.cli("root", "leases", "--prune", "--all"),
    ):
        assert proc.returncode == 0, proc.stderr
        _no_traceback(proc)
    scan = DirectoryStore(area.registry).scan()
    ignored = {os.path.basename(p): why for p, why in scan.ignored}
    assert ignored["¹"] == "not a user directory (name is not a uid)"
    assert ignored["٣"] == "not a user directory (name is not a uid)"
    assert ignored["\\xff\\xfe"] == "not a user directory (name is not a uid)"


def test_a_registry_lock_held_by_another_user_fails_exclusive_picks_closed(
    area: Area, users: Any
) -> None:
    """Item 4a: ``flock -x`` on the registry by user B: exclusive and waiting picks fail
    (exit 3, one line with the cause and the admin's fix); a plain one runs and says so."""
    area.cli(USER_A, "leases")
    b_uid, b_gid = users["b"]
    holder = AsUser(b_uid, b_gid, _hold_flock, str(area.registry), hold=True)
    try:
        assert isinstance(holder.result(), int)
        promises = {
            "--exclusive": "an exclusive pick (--exclusive)",
            "--wait": "a pick that waits in line (--wait)",
        }
        for extra in (["--exclusive"], ["--wait", "5s"]):
            proc = area.cli(USER_A, "run", *extra, "--", "true")
            assert proc.returncode == 3, proc.stderr
            want = (
                f"autogpu: refused {promises[extra[0]]} "
                f"without a lease: lease registry {area.registry} stayed locked by another "
                f"process for more than 0.5 s (the admin can find the holder with `lslocks | "
                f"grep {area.registry}` and stop it). Nothing was picked and the environment is "
                "unchanged; a plain pick (without --exclusive or --wait) still works, without a "
                "lease\n"
            )
            assert proc.stderr == want
        quota = area.cli(USER_A, "run", "--", "true", AUTOGPU_MAX_DEVICES_PER_USER="1")
        assert quota.returncode == 3
        assert quota.stderr.startswith(
            "autogpu: refused a pick under the admin's max_devices_per_user quota without a lease"
        )
        plain = area.cli(USER_A, "run", "--", "true")
        assert plain.returncode == 0
        notes = [line for line in plain.stderr.splitlines() if "lease" in line]
        assert notes == [  # said once (it was printed twice: a log warning and the note)
            f"note: lease registry {area.registry} stayed locked by another process for more "
            f"than 0.5 s (the admin can find the holder with `lslocks | grep {area.registry}` "
            "and stop it): picked without a lease"
        ]
    finally:
        holder.stop()
    assert area.cli(USER_A, "run", "--exclusive", "--", "true").returncode == 0


def test_a_directory_planted_under_the_victims_uid_fails_closed(area: Area, users: Any) -> None:
    """Item 4b: B creates ``<registry>/<A's uid>`` before A's first pick."""
    area.cli("root", "leases")
    a_uid, _ = users["a"]
    b_uid, b_gid = users["b"]
    as_user(b_uid, b_gid, _mkdir, str(area.registry / str(a_uid)))
    where = area.registry / str(a_uid)
    proc = area.cli(USER_A, "run", "--exclusive", "--", "true")
    assert proc.returncode == 3
    assert proc.stderr == (
        f"autogpu: refused an exclusive pick (--exclusive) without a lease: {where} is owned by "
        f"{USER_B} (uid {b_uid}), not by you: someone created your lease directory before you "
        f"did, so it is refused. Ask the admin to remove it (rm -r {where}). Nothing was picked "
        "and the environment is unchanged; a plain pick (without --exclusive or --wait) still "
        "works, without a lease\n"
    )
    plain = area.cli(USER_A, "run", "--", "true")
    assert plain.returncode == 0
    assert plain.stderr.splitlines()[-1].startswith(f"note: {where} is owned by {USER_B}")


def test_records_readers_reject_never_count_and_never_crash_status(area: Area, users: Any) -> None:
    """Items 3b and 5: B's ticket at seq 2**63-1 or MAX_SEQ, and B's lease whose notebook path
    holds a lone surrogate: A's status keeps working and A's own tickets stay readable (FIFO)."""
    area.write_fleet(fleet(1))
    area.cli(USER_A, "leases")
    b_uid, b_gid = users["b"]
    reg = str(area.registry)
    held = [
        AsUser(
            b_uid,
            b_gid,
            _plant_record,
            reg,
            "lease",
            {},
            '{"version": 1, "kind": "lease", "lease_id": "@ID@", "device_uuids": ["'
            + uuid_of(0)
            + '"], "device_requested_bytes": [null], "exclusive": true, '
            '"user": "' + USER_B + f'", "uid": {b_uid}, "host": "h", "pid": 1, '
            '"created_s": 1.0, "kernel_id": null, "notebook_path": "x\\ud800y.ipynb", '
            '"command": null, "holder_kind": "process"}',
            hold=True,
        ),
    ]
    try:
        assert str(held[0].result()).startswith(reg)
        for args in (("leases",), ("list",), ("leases", "--json"), ("list", "--json")):
            proc = area.cli(USER_A, *args)
            assert proc.returncode == 0, proc.stderr
            _no_traceback(proc)
        # The malformed "exclusive" record on the only GPU does not block A's exclusive pick.
        got = area.cli(USER_A, "run", "--exclusive", "--", "true")
        assert got.returncode == 0, got.stderr
        held += [
            AsUser(
                b_uid,
                b_gid,
                _plant_record,
                reg,
                "ticket",
                {
                    "device_uuids": [],
                    "device_requested_bytes": [],
                    "seq": 2**63 - 1,
                    "constraints": _constraints(),
                },
                hold=True,
            ),
            AsUser(
                b_uid,
                b_gid,
                _plant_record,
                reg,
                "ticket",
                {
                    "device_uuids": [],
                    "device_requested_bytes": [],
                    "seq": MAX_SEQ,
                    "constraints": _constraints(),
                },
                hold=True,
            ),
        ]
        for h in held:
            assert str(h.result()).startswith(reg)
        # Two of A's tickets after B's: readable, in arrival order, B's MAX_SEQ one first.
        registry = DirectoryStore(reg)
        first = registry.take_ticket(constraints=ticket_constraints(None, None))
        second = registry.take_ticket(constraints=ticket_constraints(None, None))
        assert first is not None and second is not None
        tickets = [t for t in registry.scan().live if t.kind == "ticket"]
        order = sorted(tickets, key=lambda r: (r.seq or 0, r.created_s, r.lease_id))
        assert [t.lease_id for t in order][-2:] == [first.record.lease_id, second.record.lease_id]
        assert first.record.seq == second.record.seq == MAX_SEQ
        ignored = sorted(why for _, why in registry.scan().ignored)
        assert ignored == [
            "malformed: a lone surrogate (not valid Unicode text)",
            f"malformed: seq: expected an integer from 0 to {MAX_SEQ}",
        ]
        first.release()
        second.release()
    finally:
        for h in held:
            h.stop()


def _constraints() -> dict[str, Any]:
    return {
        "min_free_bytes": None,
        "min_free_fraction": None,
        "max_util_pct": None,
        "count": 1,
        "exclude": [],
        "exclusive": False,
        "allowed_uuids": None,
    }


@pytest.mark.parametrize("who", ["owner", "root"])
def test_prune_frees_a_dead_lease_that_another_user_keeps_locked(
    area: Area, users: Any, who: str
) -> None:
    """Item 6: A's exclusive lease, A SIGKILLed, B holds ``flock`` on A's file: the GPU stayed
    blocked and ``--prune`` removed nothing. The owner's prune and root's ``--all`` free it."""
    area.write_fleet(fleet(1))
    area.cli("root", "leases")
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    dying = AsUser(a_uid, a_gid, _pick_and_die, str(area.registry), str(area.fleet))
    _, status = os.waitpid(dying.pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    (rec,) = DirectoryStore(area.registry).scan().dead
    dead = rec.path
    keeper = AsUser(b_uid, b_gid, _hold_flock, dead, hold=True)
    try:
        assert isinstance(keeper.result(), int)
        blocked = area.cli(USER_A, "run", "--exclusive", "--", "true")
        assert blocked.returncode == 3
        assert "exclusive wanted but 1 lease(s) hold it" in blocked.stderr
        proc = (
            area.cli(USER_A, "leases", "--prune")
            if who == "owner"
            else area.cli("root", "leases", "--prune", "--all")
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (
            f"removed 1 dead lease file(s):\n  {uuid_of(0)}  {USER_A}: pid {rec.pid}  ({dead})\n"
        )
        assert not os.path.exists(dead)
        again = area.cli(USER_A, "run", "--exclusive", "--", "true")
        assert again.returncode == 0, again.stderr
    finally:
        keeper.stop()


def test_a_live_lease_of_its_owner_survives_prune(area: Area, users: Any) -> None:
    """The other side of item 6: a lease its owner's process holds (the lock's holder runs as
    the lease's uid) is never pruned, by the owner or by root."""
    area.cli("root", "leases")
    a_uid, a_gid = users["a"]
    owner = AsUser(a_uid, a_gid, _pick_lease, str(area.registry), str(area.fleet), hold=True)
    try:
        path = owner.result()["path"]
        for proc in (area.cli("root", "leases", "--prune", "--all"),
                     area.cli(USER_A, "leases", "--prune")):
            assert proc.stdout == f"no dead lease files in {area.registry}\n"
        assert os.path.exists(path)
    finally:
        owner.stop()


def _pick_lease(reg: str, fleet_path: str) -> Any:
    return pick(
        PickOptions(Constraints()), backend=SimulatedBackend(fleet_path), store=DirectoryStore(reg)
    )


def test_other_users_command_lines_do_not_leak(area: Area, users: Any) -> None:
    """Item 10: no command line in a world-readable lease file unless the admin opts in, and
    ``autogpu list --json`` hides other users' process command lines."""
    spec = fleet(2)
    spec["devices"][0]["processes"] = [
        {
            "pid": 4242,
            "user": USER_A,
            "command": "python train.py --token=s3cret",
            "used_memory": "1G",
        }
    ]
    area.write_fleet(spec)
    area.cli("root", "leases")
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    holder = AsUser(
        a_uid, a_gid, _pick_with_command, str(area.registry), str(area.fleet), False, hold=True
    )
    try:
        path = holder.result()["path"]
        seen = as_user(b_uid, b_gid, _read, path)
        assert json.loads(seen)["command"] is None
        assert "s3cret" not in seen
        as_b = json.loads(area.cli(USER_B, "list", "--json").stdout)
        assert as_b["devices"][0]["processes"][0]["command"] is None
        assert all(lease["command"] is None for lease in as_b["leases"])
        as_a = json.loads(area.cli(USER_A, "list", "--json").stdout)
        assert as_a["devices"][0]["processes"][0]["command"] == "python train.py --token=s3cret"
    finally:
        holder.stop()
    opted_in = AsUser(
        a_uid, a_gid, _pick_with_command, str(area.registry), str(area.fleet), True, hold=True
    )
    try:
        path = opted_in.result()["path"]
        assert json.loads(as_user(b_uid, b_gid, _read, path))["command"] == "python secret.py"
    finally:
        opted_in.stop()


def _pick_with_command(reg: str, fleet_path: str, record: bool) -> Any:
    return pick(
        PickOptions(Constraints()),
        backend=SimulatedBackend(fleet_path),
        store=DirectoryStore(reg, record_commands=record),
        requester=Requester(command="python secret.py", notebook_path="n.ipynb"),
    )


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_control_and_bidi_characters_from_others_are_spelled_out(area: Area, users: Any) -> None:
    """Item 11 (terminals): a C1 CSI (U+009B) and a right-to-left override (U+202E) in another
    user's notebook path print spelled out, never raw."""
    area.cli("root", "leases")
    b_uid, b_gid = users["b"]
    keeper = AsUser(
        b_uid,
        b_gid,
        _plant_record,
        str(area.registry),
        "lease",
        {"notebook_path": "a\u009b2Jb\u202egpj.ipynb", "device_requested_bytes": [0]},
        hold=True,
    )
    try:
        keeper.result()
        proc = area.cli(USER_A, "leases")
        assert proc.returncode == 0
        assert "\u009b" not in proc.stdout and "\u202e" not in proc.stdout
        assert "a\\x9b2Jb\\u202egpj.ipynb" in proc.stdout
    finally:
        keeper.stop()
