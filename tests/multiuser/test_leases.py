"""The registry between REAL Unix users: nobody removes, replaces or forges another's lease.

The tests create two system users (``useradd``; CI runs as root) and run each user's side in a
forked child that dropped to that uid (see ``tests.leasehelpers.AsUser`` for why fork, not
``runuser``). The registry lives under ``/var/tmp`` (pytest's ``tmp_path``, under
``/tmp/pytest-of-root``, is not traversable by other users), root-owned, mode 1777, as an admin
would make it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.leasing.records import MAX_RECORD_BYTES
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from tests.leasehelpers import AsUser, as_user, ensure_user, fleet, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root to create the test users (useradd) and setuid to them"
    ),
]

USER_A = "agtest-alice"
USER_B = "agtest-bob"


@pytest.fixture(scope="module")
def users() -> dict[str, tuple[int, int]]:
    return {"a": ensure_user(USER_A), "b": ensure_user(USER_B)}


@pytest.fixture
def area() -> Iterator[Path]:
    root = Path(f"/var/tmp/autogpu-test-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / "fleet.json").write_text(json.dumps(fleet(2)))
    os.chmod(root / "fleet.json", 0o644)
    reg = root / "registry"
    reg.mkdir()
    os.chmod(reg, 0o1777)  # as the admin doc says: install -d -m 1777 -o root
    try:
        yield root
    finally:
        shutil.rmtree(root)


# ---- what each user's process does (module-level: run in forked children) ---------------------


def _pick(area: Path, exclusive: bool = False) -> Any:
    backend = SimulatedBackend(str(area / "fleet.json"))
    result = pick(
        PickOptions(Constraints(exclusive=exclusive)),
        backend=backend,
        store=DirectoryStore(area / "registry"),
        requester=Requester(command="python secret.py"),
    )
    return result


def _attack(lease_path: str, a_dir: str) -> dict[str, str]:
    """Everything user B tries against A's lease; the errno name each attempt got."""
    out: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "succeeded"
        except OSError as err:
            out[name] = errno.errorcode[err.errno]

    attempt("unlink", lambda: os.unlink(lease_path))
    attempt("overwrite", lambda: open(lease_path, "w").close())
    attempt("rename", lambda: os.rename(lease_path, lease_path + ".gone"))
    attempt("create_in_a_dir", lambda: open(os.path.join(a_dir, "f" * 32 + ".lease"), "x").close())
    attempt("rename_a_dir", lambda: os.rename(a_dir, a_dir + "-gone"))
    attempt("rmdir_a_dir", lambda: os.rmdir(a_dir))
    attempt("chmod_a_dir", lambda: os.chmod(a_dir, 0o777))
    return out


def _record(uid: int, user: str, lease_id: str, **over: Any) -> dict[str, Any]:
    rec = {
        "version": 1, "kind": "lease", "lease_id": lease_id,
        "device_uuids": [uuid_of(1)], "device_requested_bytes": [70 * 1024**3],
        "exclusive": True, "user": user, "uid": uid, "host": "h", "pid": os.getpid(),
        "created_s": 1.0, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "kernel",
    }
    rec.update(over)
    return rec


def _plant_hostile(reg: str, a_uid: int) -> dict[str, Any]:
    """User B writes hostile files into its own directory, and holds them (they look live)."""
    import fcntl
    import pwd

    me = os.getuid()
    name = pwd.getpwuid(me).pw_name
    d = os.path.join(reg, str(me))
    os.mkdir(d, 0o755)
    held = []

    def put(fname: str, data: bytes) -> None:
        fd = os.open(os.path.join(d, fname), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        os.write(fd, data)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)

    ids = [secrets.token_hex(16) for _ in range(8)]
    put(ids[0] + ".lease", b"{" * (MAX_RECORD_BYTES + 10))  # huge
    put(ids[1] + ".lease", b'{"version": 1, "kind": "lease", ')  # truncated JSON
    put(ids[2] + ".lease", json.dumps(_record(a_uid, USER_A, ids[2])).encode())  # forged uid
    put(ids[3] + ".lease", json.dumps(_record(me, USER_A, ids[3])).encode())  # forged name
    put(ids[4] + ".lease", json.dumps(_record(me, name, ids[4], created_s=float("nan"))).encode())
    put(ids[5] + ".lease", json.dumps(_record(me, name, ids[5], extra="x")).encode())
    marker = os.path.join(reg, "..", "pwned")
    shell = f"$(touch {marker}); `touch {marker}`; rm -rf / ; echo \x1b[31m"
    put(ids[6] + ".lease", json.dumps(_record(
        me, name, ids[6], exclusive=False, device_requested_bytes=[None],
        notebook_path=f"; touch {marker} #.ipynb", command=shell, kernel_id="$(id)",
    )).encode())
    os.mkfifo(os.path.join(d, ids[7] + ".lease"))  # a FIFO: opening it must not block
    os.symlink("/etc/passwd", os.path.join(d, secrets.token_hex(16) + ".lease"))
    # A directory named for A's uid does not exist yet? B cannot fake one for another uid:
    os.mkdir(os.path.join(reg, "424242"), 0o755)
    return {"ids": ids, "marker": marker, "fds": len(held), "shell": shell, "_keep": held}


def _scan_as(reg: str) -> dict[str, Any]:
    scan = DirectoryStore(reg).scan()
    return {
        "live": [(r.user, r.lease_id, r.to_dict(redact_command=True)) for r in scan.live],
        "ignored": [(os.path.basename(p), why) for p, why in scan.ignored],
    }


# ---- the tests ---------------------------------------------------------------------------------


def test_user_b_cannot_remove_replace_rename_or_forge_a_lease(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    reg = area / "registry"
    alice = AsUser(a_uid, a_gid, _pick, area, True, hold=True)
    try:
        lease = alice.result()
        path = Path(lease["path"])
        assert path.parent == reg / str(a_uid)
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (a_uid, 0o644)
        a_dir = reg / str(a_uid)
        assert (a_dir.stat().st_uid, stat.S_IMODE(a_dir.stat().st_mode)) == (a_uid, 0o755)

        attempts = as_user(b_uid, b_gid, _attack, str(path), str(a_dir))
        assert attempts == {
            "unlink": "EACCES",
            "overwrite": "EACCES",
            "rename": "EACCES",
            "create_in_a_dir": "EACCES",
            "rename_a_dir": "EPERM",  # sticky top directory: only the owner may rename
            "rmdir_a_dir": "EPERM",
            "chmod_a_dir": "EPERM",
        }
        # A's lease is intact and live, and B's exclusive pick avoids A's device.
        (rec,) = DirectoryStore(reg).list_leases()
        assert (rec.lease_id, rec.user, rec.uid) == (lease["lease_id"], USER_A, a_uid)
        assert rec.live
        bobs = as_user(b_uid, b_gid, _pick, area, True)
        assert bobs["uuid"] == uuid_of(1) and bobs["lease_note"] is None
        assert bobs["uuid"] != lease["uuid"]
        # B's child ended, so B's lease ended with it; A's is the only live one.
        assert [r.user for r in DirectoryStore(reg).list_leases()] == [USER_A]
        assert json.loads(path.read_text())["uid"] == a_uid
    finally:
        assert alice.stop() == 0
    # A's process ended: its lease went with it, and only A's own code removed the file.
    assert DirectoryStore(reg).list_leases() == []


def test_symlink_planted_by_b_where_a_would_write_is_refused(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    reg = area / "registry"
    trap = area / "trap"
    trap.mkdir(mode=0o777)
    os.chmod(trap, 0o777)
    os.chown(trap, b_uid, b_gid)

    def plant() -> None:
        os.symlink(str(trap), str(reg / str(a_uid)))

    as_user(b_uid, b_gid, plant)
    got = as_user(a_uid, a_gid, _pick, area)
    assert got["lease_id"] is None
    assert got["lease_note"] == (
        f"{reg}/{a_uid} is a symlink or not a directory (planted by another user?): "
        "refused; nothing was written. Ask the admin to remove it: picked without a lease"
    )
    assert list(trap.iterdir()) == []  # nothing written outside the registry
    assert os.path.islink(reg / str(a_uid))


def test_directory_precreated_by_b_for_a_is_refused(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    reg = area / "registry"
    as_user(b_uid, b_gid, os.mkdir, str(reg / str(a_uid)), 0o777)
    got = as_user(a_uid, a_gid, _pick, area)
    assert got["lease_id"] is None
    assert got["lease_note"] == (
        f"{reg}/{a_uid} is owned by {USER_B} (uid {b_uid}), not by you: someone "
        "created your lease directory before you did, so it is refused. Ask the admin to remove "
        f"it (rm -r {reg}/{a_uid}): picked without a lease"
    )


def test_hostile_lease_files_are_ignored_safely(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    b_uid, b_gid = users["b"]
    reg = area / "registry"
    bob = AsUser(b_uid, b_gid, _plant_hostile, str(reg), a_uid, hold=True)
    try:
        planted = bob.result()
        ids = planted["ids"]
        seen = as_user(a_uid, a_gid, _scan_as, str(reg))
        ignored = dict(seen["ignored"])
        assert ignored[ids[0] + ".lease"] == f"larger than {MAX_RECORD_BYTES} bytes"
        assert ignored[ids[1] + ".lease"] == "malformed: not valid JSON (JSONDecodeError)"
        assert ignored[ids[2] + ".lease"] == (
            f"forged: record says uid {a_uid}, file owned by uid {b_uid}"
        )
        assert ignored[ids[3] + ".lease"] == (
            f"forged: record says user '{USER_A}', uid {b_uid} is {USER_B}"
        )
        assert ignored[ids[4] + ".lease"] == "malformed: non-finite number NaN"
        assert ignored[ids[5] + ".lease"] == "malformed: unexpected keys ['extra']"
        assert ignored[ids[7] + ".lease"] == "not a regular file"
        symlinks = [k for k, v in ignored.items() if v == "a symlink"]
        assert len(symlinks) == 1
        assert ignored["424242"] == f"forged: owned by uid {b_uid}, named for uid 424242"
        # The one well-formed record is B's real (held) lease: plain data, command hidden.
        (live,) = seen["live"]
        assert live[0] == USER_B and live[1] == ids[6]
        assert live[2]["command"] is None
        assert live[2]["kernel_id"] == "$(id)"
        assert live[2]["notebook_path"].startswith("; touch ")
        # A's exclusive pick works: the forged exclusive leases on GPU 1 were ignored, and B's
        # real shared one holds GPU 1, so GPU 0 is A's.
        mine = as_user(a_uid, a_gid, _pick, area, True)
        assert mine["uuid"] == uuid_of(0) and mine["lease_note"] is None
        assert mine["path"].startswith(f"{reg}/{a_uid}/")
        assert not os.path.exists(planted["marker"])  # no shell ever ran the fields
    finally:
        assert bob.stop() == 0


def test_registry_made_world_writable_without_sticky_bit_is_refused_for_users(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    reg = area / "registry"
    os.chmod(reg, 0o777)
    got = as_user(a_uid, a_gid, _pick, area)
    assert got["lease_id"] is None
    assert got["lease_note"] == (
        f"lease registry {reg} is writable by others without the sticky bit "
        "(mode 0777): any user could delete or replace other users' leases, so it is refused. "
        f"Fix: chmod 1777 {reg}: picked without a lease"
    )
    assert list(reg.iterdir()) == []


def test_registry_owned_by_another_user_is_refused_and_unwritable_one_gives_no_lease(
    users: dict[str, tuple[int, int]], area: Path
) -> None:
    a_uid, a_gid = users["a"]
    b_uid, _ = users["b"]
    reg = area / "registry"
    os.chown(reg, b_uid, -1)
    got = as_user(a_uid, a_gid, _pick, area)
    assert got["lease_id"] is None
    assert got["lease_note"] == (
        f"lease registry {reg} is owned by {USER_B} (uid {b_uid}), not by root or "
        "you: its owner could hide or replace other users' leases, so it is refused. Ask the "
        f"admin to create it as root (install -d -m 1777 -o root {reg}), or set "
        "AUTOGPU_REGISTRY_DIR to another directory: picked without a lease"
    )
    os.chown(reg, 0, -1)
    os.chmod(reg, 0o755)  # root's, not writable by A: A cannot make its directory
    got = as_user(a_uid, a_gid, _pick, area)
    assert got["lease_id"] is None
    assert got["lease_note"] == (
        f"cannot create {reg}/{a_uid} in the lease registry: Permission denied: "
        "picked without a lease"
    )
