"""The shared-directory lease registry in one process, entry by entry: what a scan reports for
each kind of file another user could plant, the exact refusals (fail closed), the negative
cache, pruning, the lock's poll schedule, and the settings that select a registry.

Real files, real directories owned by real uids (the tests run as root, as CI does, so a
directory can be given to ``nobody``) and real ``flock``s. Only OS-level failures that cannot be
produced otherwise (``EIO``, ``ENOLCK``, a short write) are injected, for one path or descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import logging
import os
import pwd
import random
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import procfs
from autogpu_jupyter.core.leasing import Requester, records, safefs
from autogpu_jupyter.core.leasing import directory as regmod
from autogpu_jupyter.core.leasing.directory import (
    MAX_FILES_PER_USER,
    DirectoryStore,
    Lease,
    ScanResult,
    Ticket,
)
from autogpu_jupyter.core.leasing.records import MAX_RECORD_BYTES, MAX_SEQ, LeaseRecord
from autogpu_jupyter.errors import LeaseLimitError, LeaseStoreError, NoDeviceFitsError
from tests.leasehelpers import GiB, uuid_of

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
NOBODY = 65534
ME = os.geteuid()
ME_NAME = pwd.getpwuid(ME).pw_name

#: A waiter's constraints in the record schema (what decision.ticket_constraints writes).
CONSTRAINTS = {
    "min_free_bytes": None,
    "min_free_fraction": None,
    "max_util_pct": None,
    "count": 1,
    "exclude": [],
    "exclusive": False,
    "allowed_uuids": None,
}


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    """The negative cache and the record cache are per process: no test sees another's."""
    safefs.REJECTED.clear()
    records._RECORD_CACHE.clear()
    yield
    safefs.REJECTED.clear()
    records._RECORD_CACHE.clear()


@pytest.fixture
def reg(tmp_path: Path) -> DirectoryStore:
    registry = DirectoryStore(tmp_path / "registry")
    registry.check()
    return registry


def _payload(lease_id: str, *, uid: int = ME, user: str = ME_NAME, kind: str = "lease",
             **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "version": 1, "kind": kind, "lease_id": lease_id,
        "device_uuids": [uuid_of(0)] if kind == "lease" else [],
        "device_requested_bytes": [GiB] if kind == "lease" else [],
        "exclusive": False, "user": user, "uid": uid, "host": "h", "pid": 4242,
        "created_s": 1.5, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process",
    }
    if kind == "ticket":
        d.update(seq=1, constraints=dict(CONSTRAINTS))
    d.update(kw)
    return d


def _user_dir(reg: DirectoryStore, uid: int = ME, mode: int = 0o755) -> Path:
    d = Path(reg.path) / str(uid)
    d.mkdir(exist_ok=True)
    os.chmod(d, mode)
    if os.stat(d).st_uid != uid:
        os.chown(d, uid, -1)
    return d


def _plant(reg: DirectoryStore, name: str, data: bytes | str, *, uid: int = ME,
           owner: int | None = None) -> Path:
    """A file ``name`` in uid's directory, as that user (or ``owner``) would write it."""
    d = _user_dir(reg, uid)
    path = d / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, 0o644)
    own = uid if owner is None else owner
    if os.stat(path).st_uid != own:
        os.chown(path, own, -1)
    return path


def _plant_record(reg: DirectoryStore, *, uid: int = ME, user: str = ME_NAME, kind: str = "lease",
                  lease_id: str | None = None, **kw: Any) -> tuple[Path, str]:
    lease_id = lease_id or secrets.token_hex(16)
    suffix = ".ticket" if kind == "ticket" else ".lease"
    data = json.dumps(_payload(lease_id, uid=uid, user=user, kind=kind, **kw))
    return _plant(reg, lease_id + suffix, data, uid=uid), lease_id


class _Held:
    """Another open file description holding ``flock(LOCK_EX)`` on ``path`` (a live holder)."""

    def __init__(self, path: Path | str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def close(self) -> None:
        os.close(self.fd)


def _lease(reg: DirectoryStore, uuid: str = uuid_of(0), **kw: Any) -> Lease:
    with reg.locked() as txn:
        assert txn is not None
        return txn.create(devices=[uuid], **kw)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ---- what a scan reports ------------------------------------------------------------------


def test_a_scan_reports_each_kind_of_junk_with_why_in_name_order(reg: DirectoryStore) -> None:
    top = Path(reg.path)
    (top / "notes").mkdir()
    (top / "12345678901").mkdir()  # 11 digits: longer than any uid
    (top / "4000000001").mkdir()  # 10 digits: a uid, and this one is not its owner's
    (top / "\u00b9").mkdir()  # '¹' is decimal to str.isdecimal(), not a uid
    (top / "1001").symlink_to(top / "notes")
    (top / "1002").write_text("a file")
    mine = _user_dir(reg)
    (mine / "README").write_text("hi")
    (mine / "sub.lease").mkdir()
    (mine / "link.lease").symlink_to(mine / "README")
    os.mkfifo(mine / "pipe.ticket")
    (mine / "bad.lease").write_text("{not json")
    (mine / ".abc.tmp").write_text("half")  # a writer between create and rename: not junk
    scan = reg.scan()
    assert scan.live == [] and scan.dead == []
    p = reg.path
    # Directories in name order (ours, "0", first); entries of one directory in any order.
    assert sorted(scan.ignored[:5]) == sorted([
        (f"{p}/{ME}/README", "not a lease or ticket file"),
        (f"{p}/{ME}/sub.lease", "not a regular file"),
        (f"{p}/{ME}/link.lease", "a symlink"),
        (f"{p}/{ME}/pipe.ticket", "not a regular file"),
        (f"{p}/{ME}/bad.lease", "malformed: not valid JSON (JSONDecodeError)"),
    ])
    assert scan.ignored[5:] == [
        (f"{p}/1001", "unreadable user directory: a symlink or not a directory"),
        (f"{p}/1002", "unreadable user directory: a symlink or not a directory"),
        (f"{p}/12345678901", "not a user directory (name is not a uid)"),
        (f"{p}/4000000001", f"forged: owned by uid {ME}, named for uid 4000000001"),
        (f"{p}/notes", "not a user directory (name is not a uid)"),
        (f"{p}/\u00b9", "not a user directory (name is not a uid)"),
    ]
    assert scan.keep_ignored is True


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_user_directory_not_owned_by_its_uid_or_writable_by_others_is_not_read(
    reg: DirectoryStore,
) -> None:
    forged = Path(reg.path) / "1003"  # root's, named for uid 1003
    forged.mkdir(mode=0o755)
    _plant_record(reg, uid=NOBODY, user=pwd.getpwuid(NOBODY).pw_name)
    os.chmod(Path(reg.path) / str(NOBODY), 0o775)  # group-writable: anyone in it could plant
    _plant_record(reg)  # ours, unheld: dead
    _plant_record(reg, uid=7, user=safefs.user_name(7))  # read after the refused ones
    scan = reg.scan()
    p = reg.path
    assert scan.ignored == [
        (f"{p}/1003", "forged: owned by uid 0, named for uid 1003"),
        (f"{p}/{NOBODY}", "writable by others: its leases are untrusted"),
    ]
    assert [r.uid for r in scan.dead] == [ME, 7]
    os.chmod(Path(reg.path) / str(NOBODY), 0o757)  # world-writable, the same
    assert reg.scan().ignored[1] == (
        f"{p}/{NOBODY}", "writable by others: its leases are untrusted"
    )
    os.chmod(Path(reg.path) / str(NOBODY), 0o755)
    assert sorted(r.uid for r in reg.scan().dead) == [ME, 7, NOBODY]


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_lease_file_owned_by_another_uid_is_ignored_as_forged(reg: DirectoryStore) -> None:
    path, _ = _plant_record(reg)
    os.chown(path, NOBODY, -1)
    assert reg.scan().ignored == [
        (str(path), f"forged: owned by uid {NOBODY} in the directory of uid {ME}")
    ]
    assert reg.list_leases() == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"uid": 1234}, f"forged: record says uid 1234, file owned by uid {ME}"),
        ({"user": "mallory"}, f"forged: record says user 'mallory', uid {ME} is {ME_NAME}"),
        ({"lease_id": "ab" * 16}, "forged: file name does not match its lease id"),
        ({"pid": 0}, "malformed: pid: expected an integer from 1 to 9223372036854775807"),
        ({"version": 2}, "malformed: unknown version 2"),
    ],
)
def test_a_record_that_lies_about_its_owner_or_fails_the_schema_is_ignored(
    reg: DirectoryStore, change: dict[str, Any], why: str
) -> None:
    lease_id = secrets.token_hex(16)
    record = _payload(lease_id)
    record.update(change)
    path = _plant(reg, lease_id + ".lease", json.dumps(record))
    holder = _Held(path)  # held or not, a bad record never counts
    try:
        scan = reg.scan()
    finally:
        holder.close()
    assert (scan.live, scan.dead, scan.ignored) == ([], [], [(str(path), why)])


def test_a_record_of_exactly_the_size_cap_is_read_and_one_byte_more_is_not(
    reg: DirectoryStore,
) -> None:
    path, lease_id = _plant_record(reg)
    body = path.read_bytes()
    assert body.endswith(b"}")
    # JSON allows the padding; inside the object, so its last byte is the closing brace
    path.write_bytes(body[:-1] + b" " * (MAX_RECORD_BYTES - len(body)) + b"}")
    (rec,) = reg.scan().dead
    assert rec.lease_id == lease_id
    path.write_bytes(body + b" " * (MAX_RECORD_BYTES + 1 - len(body)))
    assert reg.scan().ignored == [(str(path), f"larger than {MAX_RECORD_BYTES} bytes")]


def test_live_and_dead_records_and_every_field_read_back(reg: DirectoryStore) -> None:
    live_path, live_id = _plant_record(
        reg, kernel_id="k-1", notebook_path="a.ipynb", command="python\tx", holder_kind="kernel",
        exclusive=True, created_s=7,
    )
    dead_path, dead_id = _plant_record(reg, kind="ticket", seq=3)
    held = _Held(live_path)
    try:
        scan = reg.scan()
    finally:
        held.close()
    assert scan.ignored == []
    (live,) = scan.live
    (dead,) = scan.dead
    assert live == LeaseRecord(
        lease_id=live_id, kind="lease", device_uuids=(uuid_of(0),), device_requested_bytes=(GiB,),
        exclusive=True, user=ME_NAME, uid=ME, host="h", pid=4242, created_s=7.0,
        kernel_id="k-1", notebook_path="a.ipynb", command="python?x", holder_kind="kernel",
        seq=None, constraints=None, live=True, path=str(live_path),
    )
    assert (dead.lease_id, dead.kind, dead.seq, dead.live, dead.path) == (
        dead_id, "ticket", 3, False, str(dead_path)
    )
    assert dead.constraints == CONSTRAINTS


def test_a_scan_looks_each_users_name_up_once(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        _plant_record(reg)
    looked_up: list[int] = []
    real_getpwuid = pwd.getpwuid

    def getpwuid(uid: int) -> Any:  # NSS: with LDAP, one network round trip per call
        looked_up.append(uid)
        return real_getpwuid(uid)

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    assert len(reg.scan().dead) == 3
    assert looked_up == [ME]


def test_a_lock_that_cannot_be_tested_counts_as_held_and_says_why(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, lease_id = _plant_record(reg)  # nobody holds it: dead, if that could be told
    real_flock = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH | fcntl.LOCK_NB:  # the liveness test (lock table full, NFS)
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
        assert [r.lease_id for r in reg.scan().live] == [lease_id]
    assert caplog.messages == [
        f"cannot test lease liveness: [Errno {errno.ENOLCK}] {os.strerror(errno.ENOLCK)}"
    ]


def test_an_entry_with_an_undecodable_name_is_reported_printable(reg: DirectoryStore) -> None:
    mine = os.fsencode(_user_dir(reg))
    with open(mine + b"/x\xff.lease", "wb") as f:
        f.write(b"{}")
    with open(mine + b"/junk\xfe", "wb") as f:
        f.write(b"")
    top = os.fsencode(reg.path)
    os.mkdir(top + b"/u\xfd")
    p = reg.path
    assert sorted(reg.scan().ignored) == sorted([
        (f"{p}/u\\xfd", "not a user directory (name is not a uid)"),
        (f"{p}/{ME}/junk\\xfe", "not a lease or ticket file"),
        (f"{p}/{ME}/x\\xff.lease", "malformed: missing keys " + str(sorted(
            records._LEASE_KEYS - {"kernel_id", "notebook_path", "command"}))),
    ])


def test_only_lease_and_ticket_suffixes_name_records(reg: DirectoryStore) -> None:
    for name in ("a.leases", "a.lease.bak", "lease", "a.tickets", "a.ticket~"):
        _plant(reg, name, "{}")
    assert sorted(why for _, why in reg.scan().ignored) == ["not a lease or ticket file"] * 5
    lease = _lease(reg)  # and the two suffixes that do: each file read as its kind
    with reg.locked() as txn:
        assert txn is not None
        ticket = txn.create_ticket(constraints=CONSTRAINTS)
    try:
        assert sorted(r.kind for r in reg.scan().live) == ["lease", "ticket"]
        assert sorted(Path(r.path).suffix for r in reg.scan().live) == [".lease", ".ticket"]
    finally:
        lease.release()
        ticket.release()


def test_a_flood_of_files_in_one_directory_is_cut_at_the_cap(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cap is scaled down (4097 files take seconds to create on a busy host); the message
    # names the real cap, which the admin sees.
    assert MAX_FILES_PER_USER == 4096
    monkeypatch.setattr(regmod, "MAX_FILES_PER_USER", 3)
    mine = _user_dir(reg)
    for name in ("d", "c", "b", "a"):
        (mine / name).touch()
    ignored = reg.scan().ignored
    assert ignored[0] == (f"{mine}", "more than 3 entries; rest skipped")
    assert sorted(ignored[1:]) == [(f"{mine}/{n}", "not a lease or ticket file") for n in "abc"]
    (mine / "a").unlink()  # exactly at the cap: all read, nothing said
    ignored = reg.scan().ignored
    assert sorted(ignored) == [(f"{mine}/{n}", "not a lease or ticket file") for n in "bcd"]


# ---- leases and tickets this process holds ------------------------------------------------


def test_a_lease_records_its_holder_and_a_command_only_when_the_admin_opted_in(
    tmp_path: Path,
) -> None:
    holder = Requester(pid=31337, kernel_id="k\t1", notebook_path="n.ipynb", command="python y",
                    kind="kernel")
    quiet = DirectoryStore(tmp_path / "registry")
    lease = _lease(quiet, requested_bytes=None, requester=holder)
    rec = lease.record
    assert (rec.pid, rec.kernel_id, rec.notebook_path, rec.command, rec.holder_kind) == (
        31337, "k?1", "n.ipynb", None, "kernel"
    )
    assert (rec.kind, rec.uid, rec.user, rec.host, rec.live, rec.seq, rec.constraints) == (
        "lease", ME, ME_NAME, socket.gethostname(), True, None, None
    )
    assert rec.device_requested_bytes == (None,)
    assert rec.path == f"{quiet.path}/{ME}/{rec.lease_id}.lease"
    assert len(rec.lease_id) == 32 and int(rec.lease_id, 16) >= 0
    assert time.time() - 60 < rec.created_s <= time.time()
    on_disk = json.loads(Path(rec.path).read_text())
    assert on_disk["command"] is None and on_disk["pid"] == 31337
    assert stat.S_IMODE(os.stat(rec.path).st_mode) == 0o644
    assert os.listdir(Path(quiet.path) / str(ME)) == [f"{rec.lease_id}.lease"]  # no .tmp left
    lease.release()
    told = DirectoryStore(tmp_path / "registry", record_commands=1)  # type: ignore[arg-type]
    assert told.record_commands is True
    lease = _lease(told, requested_bytes=[5], requester=holder)
    assert lease.record.command == "python y"
    assert lease.record.device_requested_bytes == (5,)
    lease.release()
    plain = _lease(quiet)  # no holder: this process
    assert (plain.record.pid, plain.record.holder_kind, plain.record.kernel_id,
            plain.record.notebook_path) == (os.getpid(), "process", None, None)
    plain.release()


def test_a_lease_caps_the_holder_kind_and_names_an_unnamed_host_and_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "")
    reg = DirectoryStore(tmp_path / "registry")
    lease = _lease(reg, requester=Requester(kind="k" * 40))
    assert (lease.record.host, lease.record.holder_kind) == ("?", "k" * 32)
    lease.release()
    lease = _lease(reg, requester=Requester(kind=""))
    assert lease.record.holder_kind == "process"
    lease.release()


_FIXED_ID = "ab" * 16


def test_a_lease_never_writes_through_a_temporary_name_planted_before_it(
    reg: DirectoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secrets, "token_hex", lambda n: _FIXED_ID)  # as if the ids collided
    mine = _user_dir(reg)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (mine / f".{_FIXED_ID}.tmp").symlink_to(target)
    with pytest.raises(LeaseStoreError) as err:
        _lease(reg)
    assert str(err.value) == f"cannot write a lease in {mine}: File exists"
    assert target.read_text() == "keep"
    (mine / f".{_FIXED_ID}.tmp").unlink()
    (mine / f".{_FIXED_ID}.tmp").write_text("")
    with pytest.raises(LeaseStoreError, match="File exists"):
        _lease(reg)


@pytest.mark.parametrize("change", ["linked", "given away"])
def test_a_new_lease_file_changed_before_it_is_written_is_refused(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    if change == "given away" and os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    monkeypatch.setattr(secrets, "token_hex", lambda n: _FIXED_ID)
    mine = _user_dir(reg)
    tmp = mine / f".{_FIXED_ID}.tmp"
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp):  # right after its creation
            if change == "linked":
                os.link(tmp, mine / "extra")
            else:
                os.fchown(fd, NOBODY, -1)
        return real_fstat(fd)

    with reg.locked() as txn:
        assert txn is not None
        monkeypatch.setattr(os, "fstat", fstat)
        with pytest.raises(LeaseStoreError) as err:
            txn.create(devices=[uuid_of(0)])
        monkeypatch.undo()
    assert str(err.value) == f"lease file {mine}/{_FIXED_ID}.lease is not ours after creation"
    assert os.listdir(mine) == (["extra"] if change == "linked" else [])


def test_a_lease_object_says_whether_it_is_held_and_ends_cleanly(reg: DirectoryStore) -> None:
    before = _open_fds()
    lease = _lease(reg, requested_bytes=GiB)
    assert lease.held and lease.path == lease.record.path
    assert repr(lease) == f"<Lease {lease.record.lease_id} {uuid_of(0)} held>"
    fd = lease.fileno()
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    with lease as same:
        assert same is lease
    assert not lease.held and not os.path.exists(lease.path)
    assert repr(lease) == f"<Lease {lease.record.lease_id} {uuid_of(0)} released>"
    with pytest.raises(ValueError, match=f"^lease {lease.record.lease_id} was released$"):
        lease.fileno()
    with pytest.raises(ValueError, match=f"^lease {lease.record.lease_id} was released$"):
        lease.set_pid(1)
    lease.detach()  # nothing left to close
    assert _open_fds() == before
    two = _lease(reg, requested_bytes=[GiB], uuid=uuid_of(1))
    assert two.record.device_requested_bytes == (GiB,)
    two.release()


def test_a_two_device_lease_lists_both_in_its_repr(reg: DirectoryStore) -> None:
    with reg.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[uuid_of(0), uuid_of(1)], requested_bytes=[1, None])
    assert repr(lease) == f"<Lease {lease.record.lease_id} {uuid_of(0)},{uuid_of(1)} held>"
    assert lease.record.device_requested_bytes == (1, None)
    lease.release()


def test_a_dropped_lease_object_closes_its_descriptor_and_the_lease_ends(
        reg: DirectoryStore) -> None:
    before = _open_fds()
    lease = _lease(reg)
    path = lease.path
    assert _open_fds() != before
    del lease
    assert _open_fds() == before
    assert [r.path for r in reg.scan().dead] == [path]  # left for the next prune


def test_a_released_lease_whose_file_was_replaced_leaves_the_new_file(reg: DirectoryStore) -> None:
    lease = _lease(reg)
    path = Path(lease.path)
    path.unlink()
    path.write_text("someone else's now")
    lease.release()
    assert path.read_text() == "someone else's now"
    again = _lease(reg)
    Path(again.path).unlink()  # already gone: release is quiet
    again.release()
    third = _lease(reg)
    (Path(reg.path) / str(ME)).rename(Path(reg.path) / "moved")  # our directory is gone
    third.release()
    moved = sorted(os.listdir(Path(reg.path) / "moved"))
    assert moved == sorted([path.name, Path(third.path).name])
    assert not (Path(reg.path) / str(ME)).exists()  # not created again to remove nothing


def test_a_released_lease_whose_name_now_links_to_it_leaves_the_link(reg: DirectoryStore) -> None:
    lease = _lease(reg)
    path = Path(lease.path)
    path.rename(path.with_suffix(".old"))
    path.symlink_to(path.with_suffix(".old"))  # the name no longer is the lease's inode
    lease.release()
    assert path.is_symlink() and path.with_suffix(".old").exists()


def test_a_released_lease_whose_directory_became_a_link_says_why_it_stays(
    reg: DirectoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    lease = _lease(reg)
    mine = Path(reg.path) / str(ME)
    mine.rename(Path(reg.path) / "moved")
    mine.symlink_to(Path(reg.path) / "moved")
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
        lease.release()
    assert not lease.held
    assert caplog.messages == [
        f"cannot remove lease {Path(lease.path).name}: {mine} is a symlink or not a directory "
        "(planted by another user?): refused; nothing was written. Ask the admin to remove it"
    ]
    assert os.listdir(Path(reg.path) / "moved") == [Path(lease.path).name]


def test_a_dropped_lease_whose_descriptor_was_closed_elsewhere_is_quiet(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    lease = _lease(reg)
    os.close(lease.fileno())  # e.g. a library that closes every descriptor before exec
    del lease
    gc.collect()
    assert unraisable == []


def test_a_released_lease_in_a_vanished_registry_is_just_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    lease = _lease(reg)
    os.rename(tmp_path / "registry", tmp_path / "gone")
    before = _open_fds()
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
        lease.release()
    assert caplog.messages == [
        f"cannot reopen registry to remove {Path(lease.path).name}: [Errno {errno.ENOENT}] "
        f"{os.strerror(errno.ENOENT)}: '{reg.path}'"
    ]
    assert not lease.held
    assert len(_open_fds()) == len(before) - 1
    assert os.listdir(tmp_path / "gone" / str(ME)) == [Path(lease.path).name]


def test_set_pid_rewrites_a_longer_or_shorter_pid_in_place(reg: DirectoryStore) -> None:
    lease = _lease(reg, requester=Requester(pid=123456789))
    inode = os.stat(lease.path).st_ino
    lease.set_pid(7)
    assert json.loads(Path(lease.path).read_text())["pid"] == 7  # cut: no stale digits left
    assert os.stat(lease.path).st_ino == inode
    (rec,) = reg.list_leases()
    assert (rec.pid, rec.live) == (7, True)
    lease.set_pid("99")  # type: ignore[arg-type]
    assert lease.record.pid == 99
    lease.release()


def test_set_pid_when_the_registry_became_unusable_keeps_the_old_record(
    tmp_path: Path,
) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    lease = _lease(reg, requester=Requester(pid=55))
    os.chmod(tmp_path / "registry", 0o777)  # no sticky bit: refused
    lease.set_pid(66)
    assert lease.record.pid == 55
    assert reg.unusable_reason is not None and "without the sticky bit" in reg.unusable_reason
    os.chmod(tmp_path / "registry", 0o1777)
    assert json.loads(Path(lease.path).read_text())["pid"] == 55
    lease.release()


def test_set_pid_continues_a_short_write(
        reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = _lease(reg, requester=Requester(pid=5))
    real = os.pwrite
    calls: list[int] = []

    def short_pwrite(fd: int, data: bytes, offset: int) -> int:
        calls.append(offset)
        return real(fd, bytes(data[:7]), offset)  # a nearly full disk: 7 bytes at a time

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    lease.set_pid(123)
    monkeypatch.undo()
    data = Path(lease.path).read_bytes()
    assert json.loads(data)["pid"] == 123
    assert calls == list(range(0, len(data), 7))
    lease.release()


def test_set_pid_on_a_full_disk_fails_as_no_space_and_keeps_the_record(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _lease(reg, requester=Requester(pid=5))
    before = Path(lease.path).read_bytes()
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError) as err:
        lease.set_pid(123)
    monkeypatch.undo()
    assert (err.value.errno, err.value.strerror) == (
        errno.ENOSPC, "no space left on device (short write)"
    )
    assert Path(lease.path).read_bytes() == before and lease.record.pid == 5
    lease.release()


def test_a_write_that_makes_no_progress_fails_as_no_space(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(LeaseStoreError) as err, reg.locked() as txn:
        assert txn is not None
        txn.create(devices=[uuid_of(0)])
    monkeypatch.undo()
    assert str(err.value).startswith(f"cannot write lease {reg.path}/{ME}/")
    assert str(err.value).endswith(".lease: no space left on device (short write)")
    assert os.listdir(Path(reg.path) / str(ME)) == []  # the temporary file is gone too


def test_write_all_continues_short_writes_at_the_right_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDWR)
    real_write, real_pwrite = os.write, os.pwrite
    monkeypatch.setattr(os, "write", lambda f, d: real_write(f, bytes(d[:2])))
    monkeypatch.setattr(os, "pwrite", lambda f, d, o: real_pwrite(f, bytes(d[:3]), o))
    try:
        safefs.write_all(fd, b"abcde")
        safefs.write_all(fd, b"WXYZ", offset=3)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert path.read_bytes() == b"abcWXYZ789"


# ---- a transaction: what a pick may write -------------------------------------------------


def test_a_lease_needs_devices_and_one_booking_per_device(reg: DirectoryStore) -> None:
    with reg.locked() as txn:
        assert txn is not None
        with pytest.raises(ValueError) as err:
            txn.create(devices=[])
        assert str(err.value) == "a lease needs at least one device"
        with pytest.raises(ValueError) as err:
            txn.create(devices=[uuid_of(0), uuid_of(1)], requested_bytes=[GiB])
        assert str(err.value) == "requested_bytes: one value per device expected"
        lease = txn.create(devices=[uuid_of(0), uuid_of(1)], requested_bytes=3)
    assert lease.record.device_requested_bytes == (3, 3)
    assert os.listdir(Path(reg.path) / str(ME)) == [Path(lease.path).name]
    lease.release()


def test_exclusive_leases_refuse_with_who_holds_the_device(reg: DirectoryStore) -> None:
    shared = _lease(reg, requester=Requester(pid=11, notebook_path="a.ipynb"))
    other = _lease(reg, uuid=uuid_of(1), exclusive=True,
                   requester=Requester(pid=12, kernel_id="abcdefgh12"))
    with reg.locked() as txn:
        assert txn is not None
        with pytest.raises(NoDeviceFitsError) as err:
            txn.create(devices=[uuid_of(0)], exclusive=True)
        assert str(err.value) == (
            f"no device free: exclusive wanted but {uuid_of(0)} is held by {ME_NAME}: a.ipynb"
        )
        with pytest.raises(NoDeviceFitsError) as err:
            txn.create(devices=[uuid_of(2), uuid_of(1)])
        assert str(err.value) == (
            f"no device free: {uuid_of(1)} is held exclusively by {ME_NAME}: kernel abcdefgh"
        )
        # A lease the transaction itself just wrote counts against the next one.
        third = txn.create(devices=[uuid_of(2)], exclusive=True)
        with pytest.raises(NoDeviceFitsError, match="is held exclusively by"):
            txn.create(devices=[uuid_of(2)])
    assert len(reg.list_leases()) == 3
    for lease in (shared, other, third):
        lease.release()


def test_exclusivity_follows_the_physical_gpu_with_the_fleets_mig_layout(
        reg: DirectoryStore) -> None:
    """Issue 39: the directory's admission judges a MIG device with its parent and siblings,
    by the MIG layout the pick passes (``parents``) or, where the devices are snapshots, by
    theirs; without either, each id is a GPU of its own."""
    from autogpu_jupyter.core.devices import DeviceSnapshot

    parents = {"MIG-a": "GPU-p", "MIG-b": "GPU-p"}
    held = _lease(reg, uuid="MIG-a", exclusive=True,
                  requester=Requester(pid=12, notebook_path="a.ipynb"))
    try:
        with reg.locked() as txn:
            assert txn is not None
            with pytest.raises(NoDeviceFitsError) as err:
                txn.create(devices=["GPU-p"], parents=parents)
            assert str(err.value) == (
                f"no device free: GPU-p: its MIG device MIG-a is held exclusively by "
                f"{ME_NAME}: a.ipynb"
            )
            with pytest.raises(NoDeviceFitsError, match="its sibling MIG device MIG-a is held"):
                txn.create(devices=["MIG-b"], parents=parents)
            alone = txn.create(devices=["MIG-b"])
        alone.release()
    finally:
        held.release()
    on_parent = _lease(reg, uuid="GPU-p", exclusive=True, requester=Requester(pid=12))
    try:
        with reg.locked() as txn:
            assert txn is not None
            mig = DeviceSnapshot(index=0, uuid="MIG-b", name="A100 MIG 1g.10gb", is_mig=True,
                                 parent_uuid="GPU-p", mig_index=1)
            with pytest.raises(NoDeviceFitsError) as err:
                txn.create(devices=[mig])
            assert str(err.value) == (
                f"no device free: MIG-b: its parent GPU-p is held exclusively by {ME_NAME}: pid 12"
            )
    finally:
        on_parent.release()


def test_every_exclusive_holder_of_a_device_is_named(reg: DirectoryStore) -> None:
    helds = []
    for lease_id, path in (("a" * 32, "a.ipynb"), ("b" * 32, "b.ipynb")):
        planted, _ = _plant_record(reg, lease_id=lease_id, exclusive=True, notebook_path=path,
                                   created_s=1.0 if path == "a.ipynb" else 2.0)
        helds.append(_Held(planted))
    try:
        with reg.locked() as txn:
            assert txn is not None
            with pytest.raises(NoDeviceFitsError) as err:
                txn.create(devices=[uuid_of(0)])
    finally:
        for h in helds:
            h.close()
    named = str(err.value).removeprefix(f"no device free: {uuid_of(0)} is held exclusively by ")
    assert sorted(named.split(", ")) == [f"{ME_NAME}: a.ipynb", f"{ME_NAME}: b.ipynb"]


def test_two_holders_of_one_device_are_both_named(reg: DirectoryStore) -> None:
    a = _lease(reg, requester=Requester(pid=21))
    b = _lease(reg, requester=Requester(pid=22))
    with reg.locked() as txn:
        assert txn is not None
        with pytest.raises(NoDeviceFitsError) as err:
            txn.create(devices=[uuid_of(0)], exclusive=True)
    names = {f"{ME_NAME}: pid 21", f"{ME_NAME}: pid 22"}
    prefix = f"no device free: exclusive wanted but {uuid_of(0)} is held by "
    assert str(err.value).startswith(prefix)
    assert set(str(err.value)[len(prefix):].split(", ")) == names
    a.release()
    b.release()


def test_the_device_limit_counts_distinct_devices_of_this_user(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "registry", max_devices_per_user=2)
    a = _lease(reg)
    b = _lease(reg)  # the same device again: still one
    with reg.locked() as txn:
        assert txn is not None
        c = txn.create(devices=[uuid_of(1)])
        with pytest.raises(LeaseLimitError) as err:
            txn.create(devices=[uuid_of(0), uuid_of(2), uuid_of(3)])
    assert str(err.value) == (
        f"{ME_NAME} already holds leases on 2 device(s) ({uuid_of(0)}, {uuid_of(1)}); taking 2 "
        "more would exceed max_devices_per_user = 2 set by the admin. Release one first "
        "(%gpu release, or end the kernel / autogpu run holding it)."
    )
    for lease in (a, b, c):
        lease.release()
    one = DirectoryStore(tmp_path / "registry", max_devices_per_user=1)
    with one.locked() as txn:
        assert txn is not None
        with pytest.raises(LeaseLimitError) as err:
            txn.create(devices=[uuid_of(0), uuid_of(1)])
    assert str(err.value).startswith(f"{ME_NAME} already holds leases on 0 device(s) (none); "
                                     "taking 2 more would exceed max_devices_per_user = 1")
    assert DirectoryStore(tmp_path / "registry", max_devices_per_user=-3).max_devices_per_user == 0
    assert DirectoryStore(tmp_path / "registry", max_devices_per_user="2").max_devices_per_user == 2  # type: ignore[arg-type]


@pytest.mark.multiuser
@ROOT_ONLY
def test_the_device_limit_ignores_other_users_leases(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "registry", max_devices_per_user=1)
    reg.check()
    path, _ = _plant_record(reg, uid=NOBODY, user=pwd.getpwuid(NOBODY).pw_name)
    held = _Held(path)
    try:
        lease = _lease(reg, uuid=uuid_of(3))
    finally:
        held.close()
    assert lease.record.device_uuids == (uuid_of(3),)
    lease.release()


def test_a_transaction_reads_the_registry_once(reg: DirectoryStore) -> None:
    with reg.locked() as txn:
        assert txn is not None
        first = txn.scan()
        late = _plant_record(reg)[0]  # appears after the transaction's scan
        assert txn.scan() is first
        assert txn.live_leases() == []
    assert [r.path for r in reg.scan().dead] == [str(late)]


def test_a_ticket_past_the_admission_rules_is_refused_and_nothing_written(
        reg: DirectoryStore) -> None:
    reg.max_devices_per_user = 2
    first = reg.take_ticket(constraints={**CONSTRAINTS, "count": 1})
    second = reg.take_ticket(constraints={**CONSTRAINTS, "count": 1})
    assert first is not None and second is not None
    try:
        with pytest.raises(LeaseLimitError, match="max_tickets_per_user = 2"):
            reg.take_ticket(constraints=CONSTRAINTS)
        second.release()
        with pytest.raises(LeaseLimitError, match="waits in line for 1 more; waiting for 2"):
            reg.take_ticket(constraints={**CONSTRAINTS, "count": 2})
        assert [r.lease_id for r in reg.list_leases(include_tickets=True)] == [
            first.record.lease_id
        ]
        assert sorted(os.listdir(Path(reg.path) / str(ME))) == [
            first.record.lease_id + ".ticket"
        ]
    finally:
        first.release()


def test_tickets_line_up_by_arrival_and_a_new_one_goes_last(reg: DirectoryStore) -> None:
    reg.max_tickets_per_user = 5  # the four planted tickets are ours too
    ids = {}
    helds = []
    for name, seq, created in (("c", 5, 1.0), ("a", 2, 9.0), ("b", 5, 0.5), ("d", 5, 0.5)):
        lease_id = name * 32
        path, _ = _plant_record(reg, kind="ticket", lease_id=lease_id, seq=seq, created_s=created)
        helds.append(_Held(path))
        ids[lease_id] = name
    try:
        with reg.locked() as txn:
            assert txn is not None
            assert [ids[r.lease_id] for r in txn.live_tickets()] == ["a", "b", "d", "c"]
            ticket = txn.create_ticket(constraints=CONSTRAINTS, exclusive=True,
                                       requester=Requester(pid=77, kind="cli"))
            assert txn.live_tickets()[-1].lease_id == ticket.record.lease_id
            assert txn.live_leases() == []
        leases, line = reg.live_records()
        assert leases == []
        assert [ids.get(r.lease_id, "new") for r in line] == ["a", "b", "d", "c", "new"]
    finally:
        for h in helds:
            h.close()
    rec = ticket.record
    assert isinstance(ticket, Ticket)
    assert (rec.kind, rec.seq, rec.exclusive, rec.pid, rec.holder_kind, rec.device_uuids) == (
        "ticket", 6, True, 77, "cli", ()
    )
    assert rec.constraints == CONSTRAINTS
    assert rec.path == f"{reg.path}/{ME}/{rec.lease_id}.ticket"
    assert repr(ticket) == f"<Ticket {rec.lease_id}  held>"
    assert [r.lease_id for r in reg.list_leases(include_tickets=True)] == [rec.lease_id]
    assert reg.list_leases() == []
    ticket.release()


def test_the_first_ticket_is_number_one_and_none_passes_the_largest(reg: DirectoryStore) -> None:
    first = reg.take_ticket(constraints=CONSTRAINTS)
    assert first is not None and first.record.seq == 1
    assert (first.record.exclusive, first.record.holder_kind) == (False, "process")
    first.release()
    path, _ = _plant_record(reg, kind="ticket", seq=MAX_SEQ)
    held = _Held(path)
    try:
        top = reg.take_ticket(constraints=CONSTRAINTS, exclusive=True)
    finally:
        held.close()
    assert top is not None and top.record.seq == MAX_SEQ and top.record.exclusive
    top.release()


def test_a_ticket_after_one_numbered_zero_is_number_one_and_not_exclusive_unless_asked(
    reg: DirectoryStore,
) -> None:
    path, _ = _plant_record(reg, kind="ticket", seq=0)  # readers accept 0; our writer starts at 1
    held = _Held(path)
    try:
        with reg.locked() as txn:
            assert txn is not None
            ticket = txn.create_ticket(constraints=CONSTRAINTS)
    finally:
        held.close()
    assert (ticket.record.seq, ticket.record.exclusive) == (1, False)
    ticket.release()
    # Served by number before time: 0 comes before an older 1.
    one, _ = _plant_record(reg, kind="ticket", seq=1, created_s=0.5)
    helds = [_Held(path), _Held(one)]
    try:
        assert [r.seq for r in reg.live_records()[1]] == [0, 1]
    finally:
        for h in helds:
            h.close()


def test_a_ticket_readers_would_reject_is_refused_at_the_writer(reg: DirectoryStore) -> None:
    with pytest.raises(LeaseStoreError) as err:
        reg.take_ticket(constraints={"count": 1})
    assert str(err.value) == (
        "lease record refused: readers would reject it (constraints: expected the keys "
        f"{sorted(CONSTRAINTS)} and optionally ['models', 'prefer'])"
    )
    assert os.listdir(Path(reg.path) / str(ME)) == []


def test_a_record_of_exactly_the_size_cap_is_written(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)  # a fixed-width created_s
    kernel = "\U0001f600" * 4096  # 12 bytes each once escaped in JSON; 4096: the field's cap
    probe = _lease(reg, requester=Requester(pid=5, kernel_id=kernel, notebook_path="x"))
    need = 1 + MAX_RECORD_BYTES - os.path.getsize(probe.path)
    probe.release()
    wide = (need - 100) // 12
    fits = "\U0001f600" * wide + "x" * (need - 12 * wide)
    lease = _lease(reg, requester=Requester(pid=5, kernel_id=kernel, notebook_path=fits))
    assert os.path.getsize(lease.path) == MAX_RECORD_BYTES
    lease.release()
    with pytest.raises(LeaseStoreError, match="too large"):
        _lease(reg, requester=Requester(pid=5, kernel_id=kernel, notebook_path=fits + "x"))


def test_a_record_too_large_for_readers_is_refused_at_the_writer(reg: DirectoryStore) -> None:
    huge = "\U0001f600" * 4096  # 12 bytes each once escaped in JSON
    with pytest.raises(LeaseStoreError, match=r"^lease record too large \(a very long command or "
                       r"path\?\)$"):
        _lease(reg, requester=Requester(kernel_id=huge, notebook_path=huge))
    assert os.listdir(Path(reg.path) / str(ME)) == []


def test_take_ticket_on_an_unusable_registry_is_none(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    reg = DirectoryStore(tmp_path / "file" / "registry")
    assert reg.take_ticket(constraints=CONSTRAINTS) is None
    assert reg.unusable_reason == (
        f"cannot use lease registry {reg.path}: Not a directory; ask the admin to create it "
        f"(install -d -m 1777 -o root {reg.path}) or set AUTOGPU_REGISTRY_DIR / "
        "c.AutoGPU.registry_dir"
    )


def test_a_lease_that_cannot_be_created_says_where(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def failing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if str(path).endswith(".tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(LeaseStoreError) as err:
        _lease(reg)
    monkeypatch.undo()
    assert str(err.value) == f"cannot write a lease in {reg.path}/{ME}: Input/output error"


def test_a_lease_whose_rename_fails_leaves_nothing_behind(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _open_fds()

    def no_rename(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "rename", no_rename)
    with pytest.raises(LeaseStoreError) as err:
        _lease(reg)
    assert str(err.value).startswith(f"cannot write lease {reg.path}/{ME}/")
    assert str(err.value).endswith(".lease: Input/output error")
    assert os.listdir(Path(reg.path) / str(ME)) == []
    assert _open_fds() == before

    def interrupted(*a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _lease(reg)
    assert os.listdir(Path(reg.path) / str(ME)) == []
    assert _open_fds() == before

    def no_unlink(*a: Any, **kw: Any) -> None:  # nor can the temporary file be removed
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "unlink", no_unlink)
    with pytest.raises(KeyboardInterrupt):
        _lease(reg)
    monkeypatch.setattr(os, "rename", no_rename)
    with pytest.raises(LeaseStoreError) as err:
        _lease(reg)
    assert str(err.value).endswith(".lease: Input/output error")  # the cause, not the cleanup's
    monkeypatch.undo()
    assert len(os.listdir(Path(reg.path) / str(ME))) == 2  # the two temporaries left
    assert _open_fds() == before


# ---- the registry directory and its lock --------------------------------------------------


def test_a_new_registry_is_created_1777_and_a_missing_one_is_not_read(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    assert repr(reg) == f"DirectoryStore({str(tmp_path / 'registry')!r})"
    assert reg.list_leases() == []
    assert reg.live_records() == ([], [])
    with pytest.raises(LeaseStoreError) as err:
        reg.scan()
    assert str(err.value) == f"lease registry {tmp_path}/registry does not exist"
    assert not (tmp_path / "registry").exists()
    reg.check()
    assert stat.S_IMODE(os.stat(tmp_path / "registry").st_mode) == 0o1777
    assert os.listdir(tmp_path / "registry") == []
    assert reg.scan() == ScanResult()
    relative = DirectoryStore(os.path.relpath(tmp_path / "registry"))
    assert relative.path == str(tmp_path / "registry")


def test_a_new_registry_is_logged_and_made_1777_whatever_the_umask(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = os.umask(0o277)  # mkdir(0700) gives 0500
    try:
        with caplog.at_level(logging.INFO, logger="autogpu_jupyter.core.leasing.directory"):
            DirectoryStore(tmp_path / "registry").check()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "registry").st_mode) == 0o1777
    assert caplog.messages == [f"created lease registry {tmp_path}/registry (mode 1777)"]


def test_a_registry_owned_by_root_serves_every_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by root needs root")
    d = Path(tempfile.mkdtemp(dir="/tmp"))  # tmp_path's parents are root's, 0700
    try:
        os.chmod(d, 0o755)
        (d / "registry").mkdir()
        os.chmod(d / "registry", 0o1777)
        os.seteuid(NOBODY)  # in this process; the saved uid stays root
        try:
            reg = DirectoryStore(d / "registry")
            reg.check()
            lease = _lease(reg)
            assert Path(lease.path).parent == d / "registry" / str(NOBODY)
            lease.release()
        finally:
            os.seteuid(0)
    finally:
        shutil.rmtree(d)


def test_an_existing_private_registry_is_used_as_it_is(tmp_path: Path) -> None:
    d = tmp_path / "registry"
    d.mkdir(mode=0o700)
    reg = DirectoryStore(d)
    lease = _lease(reg)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700  # an admin's choice: left alone
    lease.release()


def test_a_registry_whose_parent_is_missing_cannot_be_created(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "no" / "registry")
    with pytest.raises(LeaseStoreError) as err:
        reg.check()
    assert str(err.value) == (
        f"cannot create lease registry {reg.path}: No such file or directory; ask the admin to "
        f"create it (install -d -m 1777 -o root {reg.path}) or set AUTOGPU_REGISTRY_DIR / "
        "c.AutoGPU.registry_dir"
    )


@pytest.mark.parametrize(
    ("make", "what"),
    [
        ("file", "not a directory"),
        ("link-to-file", "a symlink"),
        ("link-to-dir", "a symlink"),
    ],
)
def test_a_registry_path_that_is_not_a_real_directory_is_refused(
    tmp_path: Path, make: str, what: str
) -> None:
    path = tmp_path / "registry"
    (tmp_path / "f").write_text("")
    (tmp_path / "d").mkdir(mode=0o1777)
    if make == "file":
        path.write_text("")
    else:
        path.symlink_to(tmp_path / ("f" if make == "link-to-file" else "d"))
    reg = DirectoryStore(path)
    expected = (
        f"lease registry {path} is {what}: refused (another user could redirect leases "
        "elsewhere); the admin should make it a real directory, mode 1777"
    )
    for call in (reg.check, reg.scan, reg.list_leases, lambda: reg.prune()):
        with pytest.raises(LeaseStoreError) as err:
            call()
        assert str(err.value) == expected
    assert reg.live_records() == ([], [])


@pytest.mark.parametrize(
    ("mode", "refused"),
    [(0o777, True), (0o775, True), (0o757, True), (0o1777, False), (0o1775, False),
     (0o755, False), (0o700, False)],
)
def test_a_registry_writable_by_others_needs_the_sticky_bit(
    tmp_path: Path, mode: int, refused: bool
) -> None:
    d = tmp_path / "registry"
    d.mkdir()
    os.chmod(d, mode)
    reg = DirectoryStore(d)
    if refused:
        with pytest.raises(LeaseStoreError) as err:
            reg.check()
        assert str(err.value) == (
            f"lease registry {d} is writable by others without the sticky bit (mode {mode:04o}): "
            "any user could delete or replace other users' leases, so it is refused. "
            f"Fix: chmod 1777 {d}"
        )
    else:
        reg.check()
        assert reg.scan().ignored == []


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_registry_owned_by_another_user_is_refused_with_the_fix(tmp_path: Path) -> None:
    d = tmp_path / "registry"
    d.mkdir(mode=0o1777)
    os.chown(d, NOBODY, -1)
    reg = DirectoryStore(d)
    with reg.locked() as txn:
        assert txn is None
    name = pwd.getpwuid(NOBODY).pw_name
    assert reg.unusable_reason == (
        f"lease registry {d} is owned by {name} (uid {NOBODY}), not by root or you: its owner "
        "could hide or replace other users' leases, so it is refused. Ask the admin to create "
        f"it as root (install -d -m 1777 -o root {d}), or set AUTOGPU_REGISTRY_DIR to another "
        "directory"
    )
    assert os.listdir(d) == []
    assert safefs.describe_owner(4_000_000_000) == "4000000000 (uid 4000000000)"
    assert safefs.describe_owner(0) == "root (uid 0)"


def test_our_user_directory_is_made_0755_and_its_mode_repaired(reg: DirectoryStore) -> None:
    before = _open_fds()
    with reg.locked() as txn:
        assert txn is not None
    mine = Path(reg.path) / str(ME)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755
    os.chmod(mine, 0o700)
    with reg.locked() as txn:
        assert txn is not None and reg.unusable_reason is None
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755
    assert _open_fds() == before


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_user_directory_planted_as_a_symlink_or_file_means_no_lease(
    reg: DirectoryStore, planted: str, tmp_path: Path
) -> None:
    mine = Path(reg.path) / str(ME)
    (tmp_path / "elsewhere").mkdir()
    if planted == "symlink":
        mine.symlink_to(tmp_path / "elsewhere")
    else:
        mine.write_text("")
    before = _open_fds()
    with reg.locked() as txn:
        assert txn is None
    assert _open_fds() == before
    assert reg.unusable_reason == (
        f"{mine} is a symlink or not a directory (planted by another user?): refused; nothing "
        "was written. Ask the admin to remove it"
    )
    assert os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_user_directory_precreated_by_another_uid_is_refused(reg: DirectoryStore) -> None:
    mine = Path(reg.path) / str(ME)
    mine.mkdir(mode=0o755)
    os.chown(mine, NOBODY, -1)
    with reg.locked() as txn:
        assert txn is None
    name = pwd.getpwuid(NOBODY).pw_name
    assert reg.unusable_reason == (
        f"{mine} is owned by {name} (uid {NOBODY}), not by you: someone created your lease "
        f"directory before you did, so it is refused. Ask the admin to remove it (rm -r {mine})"
    )


@pytest.mark.parametrize("step", ["mkdir", "open-new", "open-existing"])
def test_a_user_directory_that_fails_to_open_or_create_says_so(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    mine = Path(reg.path) / str(ME)
    if step == "open-existing":
        mine.mkdir(mode=0o755)
    real_open, real_mkdir = os.open, os.mkdir
    opened = []

    def failing_mkdir(path: Any, *a: Any, **kw: Any) -> None:
        if step == "mkdir" and path == str(ME):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_mkdir(path, *a, **kw)

    def failing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if path == str(ME):
            opened.append(path)
            if step == "open-existing" or (step == "open-new" and len(opened) == 2):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "mkdir", failing_mkdir)
    monkeypatch.setattr(os, "open", failing_open)
    with reg.locked() as txn:
        assert txn is None
    monkeypatch.undo()
    if step == "mkdir":
        assert reg.unusable_reason == (
            f"cannot create {mine} in the lease registry: Input/output error"
        )
    else:
        assert reg.unusable_reason == f"cannot open {mine}: Input/output error"


def test_a_user_directory_created_meanwhile_by_us_is_used(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir

    def racing_mkdir(path: Any, *a: Any, **kw: Any) -> None:
        real_mkdir(path, *a, **kw)  # another of our processes got there first
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    lease = _lease(reg)
    monkeypatch.undo()
    assert lease.held and reg.unusable_reason is None
    lease.release()


def test_a_registry_created_meanwhile_by_another_process_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir
    d = tmp_path / "registry"

    def racing_mkdir(path: Any, *a: Any, **kw: Any) -> None:
        if str(path) == str(d):
            real_mkdir(path, 0o1777)
            os.chmod(path, 0o1777)
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
        real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    DirectoryStore(d).check()
    monkeypatch.undo()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777


def test_a_registry_that_vanishes_while_created_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "registry"

    def racing_mkdir(path: Any, *a: Any, **kw: Any) -> None:
        (tmp_path / "x").write_text("")
        os.symlink(tmp_path / "x", path)  # planted between our two steps
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(LeaseStoreError) as err:
        DirectoryStore(d).check()
    monkeypatch.undo()
    assert str(err.value).startswith(f"lease registry {d} is a symlink: refused")


def test_a_failed_pick_transaction_reports_why_and_a_working_one_clears_it(
    tmp_path: Path,
) -> None:
    d = tmp_path / "registry"
    d.mkdir()
    os.chmod(d, 0o777)
    reg = DirectoryStore(d)
    before = _open_fds()
    with reg.locked() as txn:
        assert txn is None
    assert reg.unusable_reason is not None
    assert reg.unusable_reason.startswith(f"lease registry {d} is writable by others")
    os.chmod(d, 0o1777)
    with reg.locked() as txn:
        assert txn is not None
        assert txn.store is reg
        assert reg.unusable_reason is None
    assert _open_fds() == before


class _FakeClock:
    """``time.monotonic`` / ``time.sleep`` that only move when slept (no real waiting)."""

    def __init__(self, on_sleep: Any = None) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    c = _FakeClock()
    monkeypatch.setattr(time, "monotonic", c.monotonic)
    monkeypatch.setattr(time, "sleep", c.sleep)
    monkeypatch.setattr(random, "random", lambda: 0.25)  # jitter factor 0.5 + 0.25
    return c


def test_a_busy_registry_lock_is_polled_doubling_to_20ms_until_the_timeout(
    tmp_path: Path, clock: _FakeClock
) -> None:
    d = tmp_path / "registry"
    reg = DirectoryStore(d, lock_timeout_s=0.125)
    reg.check()
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with reg.locked() as txn:
            assert txn is None
    finally:
        os.close(holder)
    # 0.2 ms doubling, capped at 20 ms, each times the jitter (0.75 here): 19.05 ms, then
    # 15 ms steps; the last sleep ends at the deadline, not past it.
    delays = [0.0002 * 2**i for i in range(7)] + [0.02] * 7
    expected = [0.75 * x for x in delays] + [0.00095]
    assert clock.sleeps == pytest.approx(expected)
    assert reg.unusable_reason == (
        f"lease registry {d} stayed locked by another process for more than 0.125 s (the admin "
        f"can find the holder with `lslocks | grep {d}` and stop it)"
    )


def test_the_registry_lock_is_waited_for_ten_seconds_by_default(
    tmp_path: Path, clock: _FakeClock
) -> None:
    d = tmp_path / "registry"
    reg = DirectoryStore(d)
    reg.check()
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with reg.locked() as txn:
            assert txn is None
    finally:
        os.close(holder)
    assert sum(clock.sleeps) == pytest.approx(10.0)
    assert reg.unusable_reason is not None
    assert "stayed locked by another process for more than 10 s" in reg.unusable_reason


def test_a_registry_lock_freed_while_polling_is_taken(tmp_path: Path, clock: _FakeClock) -> None:
    d = tmp_path / "registry"
    reg = DirectoryStore(d, lock_timeout_s=5)
    reg.check()
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    clock.on_sleep = lambda n: os.close(holder) if n == 3 else None
    with reg.locked() as txn:
        assert txn is not None
    assert clock.sleeps == pytest.approx([0.00015, 0.0003, 0.0006])


def test_a_zero_or_negative_timeout_tries_the_lock_once(tmp_path: Path, clock: _FakeClock) -> None:
    d = tmp_path / "registry"
    DirectoryStore(d).check()
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert safefs.flock_wait(fd, -1.0) is False
        assert safefs.flock_wait(fd, 0.0) is False
        assert clock.sleeps == []
        os.close(holder)
        assert safefs.flock_wait(fd, 0.0) is True
    finally:
        os.close(fd)


@pytest.mark.parametrize("when", ["first try", "while polling"])
def test_a_registry_lock_that_cannot_be_taken_blames_the_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: _FakeClock, when: str
) -> None:
    d = tmp_path / "registry"
    reg = DirectoryStore(d)
    reg.check()
    real = fcntl.flock
    calls = []

    def flock(fd: int, op: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and op & fcntl.LOCK_EX:
            calls.append(op)
            if when == "first try" or len(calls) > 1:
                raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
            raise BlockingIOError(errno.EAGAIN, "busy")
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    before = _open_fds()
    with reg.locked() as txn:
        assert txn is None
    assert _open_fds() == before
    assert reg.unusable_reason == (
        f"cannot lock lease registry {d}: No locks available (a filesystem without flock, e.g. "
        "some NFS mounts? Use a local AUTOGPU_REGISTRY_DIR)"
    )
    assert len(calls) == (1 if when == "first try" else 2)


def test_check_takes_no_lock_and_reports_a_filesystem_without_locks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "registry"
    reg = DirectoryStore(d)
    reg.check()
    before = _open_fds()
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        reg.check()  # a pick in progress elsewhere: the registry is fine
    finally:
        os.close(holder)
    assert _open_fds() == before
    real = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(LeaseStoreError) as err:
        reg.check()
    assert str(err.value) == f"cannot lock lease registry {d}: No locks available"
    monkeypatch.undo()
    # check() left nothing locked: an exclusive lock is free at once.
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


# ---- listing for status surfaces and ranking ------------------------------------------------


def test_list_leases_is_oldest_first_then_by_id(reg: DirectoryStore) -> None:
    helds = []
    for lease_id, created in (("c" * 32, 5.0), ("b" * 32, 2.0), ("a" * 32, 5.0)):
        path, _ = _plant_record(reg, lease_id=lease_id, created_s=created)
        helds.append(_Held(path))
    try:
        assert [r.lease_id[0] for r in reg.list_leases()] == ["b", "a", "c"]
        leases, line = reg.live_records()
        assert sorted(r.lease_id[0] for r in leases) == ["a", "b", "c"] and line == []
        hidden = reg.hiding(lease_ids=["a" * 32])
        assert [r.lease_id[0] for r in hidden.list_leases()] == ["b", "c"]
        assert sorted(r.lease_id[0] for r in hidden.live_records()[0]) == ["b", "c"]
    finally:
        for h in helds:
            h.close()
    assert reg.list_leases() == []


def test_a_hiding_view_is_a_copy_and_hides_by_kernel_only_when_asked(reg: DirectoryStore) -> None:
    a = _lease(reg, requester=Requester(kernel_id="k-a"))
    b = _lease(reg, requester=Requester(kernel_id=None))
    by_kernel = reg.hiding(kernel_id="k-a")
    assert by_kernel is not reg and by_kernel.path == reg.path
    # the store itself still hides nothing
    assert {r.lease_id for r in reg.list_leases()} == {a.record.lease_id, b.record.lease_id}
    assert [r.lease_id for r in by_kernel.list_leases()] == [b.record.lease_id]
    nothing = reg.hiding(lease_ids=["f" * 32])
    assert {r.lease_id for r in nothing.list_leases()} == {a.record.lease_id, b.record.lease_id}
    with by_kernel.locked() as txn:
        assert txn is not None
        assert [r.lease_id for r in txn.live_leases()] == [b.record.lease_id]
    a.release()
    b.release()


@pytest.mark.multiuser
@ROOT_ONLY
def test_live_records_of_an_unsafe_registry_are_empty(tmp_path: Path) -> None:
    d = tmp_path / "registry"
    d.mkdir(mode=0o1777)
    os.chown(d, NOBODY, -1)
    assert DirectoryStore(d).live_records() == ([], [])
    with pytest.raises(LeaseStoreError, match="is owned by"):
        DirectoryStore(d).list_leases()


def test_a_missing_registry_reads_as_empty_for_ranking_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
        assert reg.live_records() == ([], [])
    assert caplog.messages == [
        f"ranking without the registry: lease registry {reg.path} does not exist"
    ]
    assert os.listdir(tmp_path) == []


def test_a_registry_that_cannot_be_listed_reads_as_empty_for_ranking(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _plant_record(reg)

    def no_listdir(fd: Any) -> list[str]:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "listdir", no_listdir)
    with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
        assert reg.live_records() == ([], [])
    assert caplog.messages == [
        f"ranking without the registry: cannot list lease registry {reg.path}: "
        "Input/output error"
    ]
    with pytest.raises(LeaseStoreError) as err:
        reg.scan()
    assert str(err.value) == f"cannot list lease registry {reg.path}: Input/output error"


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_user_directory_that_cannot_be_listed_or_opened_is_reported(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant_record(reg)
    (Path(reg.path) / "1005").mkdir(mode=0o755)
    os.chown(Path(reg.path) / "1005", 1005, -1)
    real_open = os.open

    def failing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if path == "1005":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, flags, *a, **kw)

    def no_scandir(fd: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "open", failing_open)
    monkeypatch.setattr(os, "scandir", no_scandir)
    assert reg.scan().ignored == [
        (f"{reg.path}/{ME}", "cannot list: Input/output error"),
        (f"{reg.path}/1005", "unreadable user directory: Input/output error"),
    ]


def test_a_lease_file_that_cannot_be_opened_or_read_is_reported(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _plant_record(reg)
    real_open = os.open

    def failing_open(p: Any, flags: int, *a: Any, **kw: Any) -> int:
        if p == path.name:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    assert reg.scan().ignored == [(str(path), "unreadable: Input/output error")]
    monkeypatch.setattr(os, "open", real_open)

    def failing_read(fd: int, n: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "read", failing_read)
    assert reg.scan().ignored == [(str(path), "unreadable: Input/output error")]
    monkeypatch.undo()
    assert len(reg.scan().dead) == 1  # nothing about a failed read is remembered


# ---- the negative cache ---------------------------------------------------------------------


def test_unheld_junk_is_remembered_by_inode_and_a_new_file_is_read_again(
        reg: DirectoryStore) -> None:
    path = _plant(reg, "a" * 32 + ".lease", "{not json")
    why = "malformed: not valid JSON (JSONDecodeError)"
    assert reg.scan().ignored == [(str(path), why)]
    good = json.dumps(_payload("a" * 32)).encode()
    with open(path, "r+b") as f:  # fixed in place, same inode: an owner hiding their own lease
        f.write(good)
    assert reg.scan().ignored == [(str(path), why)]
    assert list(safefs.REJECTED.values()) == [why]
    fresh = path.with_name(".new.tmp")
    fresh.write_bytes(good)
    fresh.rename(path)  # a new file (a new inode, as our writer makes): read
    assert [r.lease_id for r in reg.scan().dead] == ["a" * 32]


def test_a_held_file_that_fails_is_never_remembered(reg: DirectoryStore) -> None:
    path = _plant(reg, "a" * 32 + ".lease", "{not json")
    held = _Held(path)
    try:
        assert reg.scan().ignored[0][1] == "malformed: not valid JSON (JSONDecodeError)"
        assert safefs.REJECTED == {}
        path.write_bytes(json.dumps(_payload("a" * 32)).encode())
        assert [r.lease_id for r in reg.scan().live] == ["a" * 32]
    finally:
        held.close()


@pytest.mark.multiuser
@ROOT_ONLY
def test_forged_and_oversized_files_are_remembered_too(reg: DirectoryStore) -> None:
    forged, _ = _plant_record(reg)
    os.chown(forged, NOBODY, -1)
    big = _plant(reg, "b" * 32 + ".lease", b" " * (MAX_RECORD_BYTES + 1))
    scan = reg.scan()
    assert sorted(scan.ignored) == sorted([
        (str(forged), f"forged: owned by uid {NOBODY} in the directory of uid {ME}"),
        (str(big), f"larger than {MAX_RECORD_BYTES} bytes"),
    ])
    assert sorted(safefs.REJECTED.values()) == sorted(why for _, why in scan.ignored)
    assert {k[:2] for k in safefs.REJECTED} == {(ME, forged.name), (ME, big.name)}
    assert {k[2] for k in safefs.REJECTED} == {os.stat(forged).st_ino, os.stat(big).st_ino}


def test_the_negative_cache_is_bounded(reg: DirectoryStore) -> None:
    for i in range(safefs.REJECTED_MAX - 1):
        safefs.REJECTED[(999, str(i), i)] = "x"
    _plant(reg, "a" * 32 + ".lease", "[]")
    reg.scan()
    assert len(safefs.REJECTED) == safefs.REJECTED_MAX  # one more fits
    _plant(reg, "b" * 32 + ".lease", "[]")
    safefs.REJECTED.pop((ME, "a" * 32 + ".lease", os.stat(
        Path(reg.path) / str(ME) / ("a" * 32 + ".lease")).st_ino))
    safefs.REJECTED[(999, "extra", 0)] = "x"
    reg.scan()  # full: cleared, then the new entries remembered
    assert sorted(k[1] for k in safefs.REJECTED) == ["a" * 32 + ".lease", "b" * 32 + ".lease"]
    assert set(safefs.REJECTED.values()) == {"malformed: not a JSON object"}


def test_an_entry_replaced_between_listing_and_reading_is_not_remembered(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _plant(reg, "a" * 32 + ".lease", "[]")
    real_scandir = os.scandir

    def scandir_then_replace(fd: Any) -> Any:
        it = real_scandir(fd)
        entries = list(it)
        it.close()
        fresh = path.with_name(".x.tmp")
        fresh.write_text("[]")
        fresh.rename(path)  # a new inode under the listed name

        class It:
            def __enter__(self) -> list[Any]:
                return entries

            def __exit__(self, *a: Any) -> None:
                pass

        return It()

    monkeypatch.setattr(os, "scandir", scandir_then_replace)
    assert reg.scan().ignored == [(str(path), "malformed: not a JSON object")]
    assert safefs.REJECTED == {}


# ---- pruning --------------------------------------------------------------------------------


def test_prune_removes_our_dead_files_and_old_temporaries_only(reg: DirectoryStore) -> None:
    live = _lease(reg)
    dead_path, dead_id = _plant_record(reg)
    _, ticket_id = _plant_record(reg, kind="ticket")
    mine = Path(reg.path) / str(ME)
    old_tmp = mine / ".old.tmp"
    old_tmp.write_text("")
    os.utime(old_tmp, (time.time() - 120, time.time() - 120))
    fresh_tmp = mine / ".fresh.tmp"
    fresh_tmp.write_text("")
    os.utime(fresh_tmp, (time.time() - 30, time.time() - 30))
    held_tmp = mine / ".held.tmp"
    held_tmp.write_text("")
    os.utime(held_tmp, (time.time() - 120, time.time() - 120))
    held = _Held(held_tmp)
    other_tmp = mine / "old.tmp"  # not ours to prune: junk
    other_tmp.write_text("")
    os.utime(other_tmp, (time.time() - 120, time.time() - 120))
    try:
        reg.scan()  # a plain scan prunes nothing
        assert old_tmp.exists() and dead_path.exists()
        removed = reg.prune()
    finally:
        held.close()
    assert sorted(r.lease_id for r in removed) == sorted([dead_id, ticket_id])
    assert sorted(os.listdir(mine)) == sorted(
        [".fresh.tmp", ".held.tmp", "old.tmp", Path(live.path).name]
    )
    assert reg.prune() == []
    live.release()


def test_prune_never_opens_a_fifo_or_a_link_and_says_why_it_keeps_a_held_file(
    reg: DirectoryStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mine = Path(reg.path) / str(ME)
    _lease(reg).release()  # our directory exists
    old = time.time() - 120
    fifo = mine / ".fifo.tmp"  # opened without O_NONBLOCK, a FIFO would hang the prune
    os.mkfifo(fifo)
    os.utime(fifo, (old, old))
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = mine / ".link.tmp"
    link.symlink_to(target)
    os.utime(link, (old, old), follow_symlinks=False)
    held_tmp = mine / ".held.tmp"
    held_tmp.write_text("")
    os.utime(held_tmp, (old, old))
    holders = [_Held(held_tmp), _Held(target)]
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(reg.prune()), daemon=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
            worker.start()
            worker.join(10)
            hung = worker.is_alive()
            if hung:  # let the blocked open return before failing
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                worker.join(5)
    finally:
        for h in holders:
            h.close()
    assert not hung and done == [[]]
    assert sorted(os.listdir(mine)) == [".held.tmp", ".link.tmp"]  # the FIFO went, the link stays
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "not removing .held.tmp: [Errno 11] Resource temporarily unavailable"
    ]


@pytest.mark.parametrize(("age", "kept"), [(60.0, True), (60.25, False)])
def test_a_temporary_file_is_pruned_once_older_than_a_minute(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch, age: float, kept: bool
) -> None:
    mine = Path(reg.path) / str(ME)
    _lease(reg).release()
    tmp = mine / ".w.tmp"
    tmp.write_text("")
    os.utime(tmp, (1_000_000, 1_000_000))
    monkeypatch.setattr(time, "time", lambda: 1_000_000 + age)
    reg.prune()
    monkeypatch.undo()
    assert tmp.exists() is kept


def test_a_pick_removes_our_own_dead_files_but_not_others(reg: DirectoryStore) -> None:
    dead_path, _ = _plant_record(reg)
    with reg.locked() as txn:
        assert txn is not None
        scan = txn.scan()
        assert [r.path for r in scan.dead] == [str(dead_path)]
        assert scan.keep_ignored is False
    assert not dead_path.exists()


def test_prune_of_a_missing_registry_says_so_and_creates_nothing(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    with pytest.raises(LeaseStoreError) as err:
        reg.prune()
    assert str(err.value) == f"lease registry {reg.path} does not exist"
    assert os.listdir(tmp_path) == []


def test_prune_reports_only_the_files_it_could_remove(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = _lease(reg)
    stuck, _ = _plant_record(reg)
    gone, gone_id = _plant_record(reg)
    real_unlink = os.unlink

    def unlink(path: Any, *, dir_fd: int | None = None) -> None:
        if path == stuck.name:  # e.g. an immutable file (chattr +i): even root cannot remove it
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    assert [r.lease_id for r in reg.prune()] == [gone_id]
    monkeypatch.undo()
    assert stuck.exists() and not gone.exists()
    live.release()


def test_pruning_every_users_files_is_refused_to_a_user_other_than_root(tmp_path: Path) -> None:
    """In this process: as root, the effective uid is ``nobody``'s for the call (the saved uid
    stays root, so it comes back)."""
    path = tmp_path / "registry"
    DirectoryStore(path).check()
    dead, _ = _plant_record(DirectoryStore(path))
    as_root = os.geteuid() == 0
    if as_root:
        os.seteuid(NOBODY)
    try:
        with pytest.raises(LeaseStoreError) as err:
            DirectoryStore(path).prune(all_users=True)
    finally:
        if as_root:
            os.seteuid(0)
    assert str(err.value) == "pruning every user's dead leases needs root (--all)"
    assert dead.exists()


@pytest.mark.multiuser
@ROOT_ONLY
def test_prune_all_removes_every_users_dead_files(tmp_path: Path) -> None:
    reg = DirectoryStore(tmp_path / "registry")
    reg.check()
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, their_id = _plant_record(reg, uid=NOBODY, user=nobody)
    ours, our_id = _plant_record(reg)
    # A pick's own scan leaves other users' files alone.
    with reg.locked() as txn:
        assert txn is not None
        txn.scan()
    assert theirs.exists() and not ours.exists()
    ours, our_id = _plant_record(reg)
    assert [r.lease_id for r in reg.prune()] == [our_id]  # only ours
    assert theirs.exists()
    assert [r.lease_id for r in reg.prune(all_users=True)] == [their_id]
    assert not theirs.exists()


@pytest.mark.multiuser
@ROOT_ONLY
def test_prune_all_needs_root(tmp_path: Path) -> None:
    from tests.leasehelpers import as_user

    d = tmp_path / "registry"
    DirectoryStore(d).check()
    os.chmod(tmp_path, 0o755)

    def prune_all(path: str) -> Any:
        try:
            return DirectoryStore(path).prune(all_users=True)
        except LeaseStoreError as err:
            return str(err)

    assert as_user(NOBODY, NOBODY, prune_all, str(d)) == (
        "pruning every user's dead leases needs root (--all)"
    )


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_lease_kept_alive_only_by_another_users_lock_is_pruned(
    reg: DirectoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, their_id = _plant_record(reg, uid=NOBODY, user=nobody)
    ours, _ = _plant_record(reg)
    on_theirs = _Held(theirs)  # root (not nobody) holds nobody's lease: kept looking alive
    on_ours = _Held(ours)  # held by our own uid: really alive
    try:
        assert [r.lease_id for r in reg.scan().live if r.uid == NOBODY] == [their_id]
        assert reg.prune() == []  # not ours to judge
        with caplog.at_level(logging.INFO, logger="autogpu_jupyter.core.leasing.directory"):
            removed = reg.prune(all_users=True)
        assert [(r.lease_id, r.live) for r in removed] == [(their_id, True)]
        assert not theirs.exists() and ours.exists()
    finally:
        on_theirs.close()
        on_ours.close()
    assert caplog.messages == [f"removed {theirs}: its lock is held only by other users' processes"]


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_lease_held_by_a_process_whose_real_uid_is_its_owner_is_kept(reg: DirectoryStore) -> None:
    """The owner's process counts by any of its uids: real ``nobody``, effective root (as a
    setuid helper the owner ran)."""
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, _ = _plant_record(reg, uid=NOBODY, user=nobody)
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            f"os.setresuid({NOBODY}, 0, 0)\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        ), str(theirs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == b"ready\n"
        assert procfs.uids(holder.pid) == {NOBODY, 0}
        assert reg.prune(all_users=True) == []
        assert theirs.exists()
    finally:
        holder.stdin.close()
        holder.wait(10)


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_held_lease_swapped_for_a_fifo_or_a_link_is_neither_waited_on_nor_followed(
    reg: DirectoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A prune's removal of another user's held lease, whose file that user swapped for a FIFO or
    a link after the scan, neither blocks on the FIFO nor follows the link.

    A reasoned private seam: the swap has to land between the prune's scan and its removal; the
    removal step (``_remove_if_held_by_others``) is run by itself so that the swap can be made in
    between."""
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, their_id = _plant_record(reg, uid=NOBODY, user=nobody)
    held = _Held(theirs)  # root (not nobody) holds nobody's lease: it would be pruned
    moved = theirs.with_suffix(".old")
    results: list[bool] = []

    def remove() -> None:
        top = os.open(reg.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            results.append(reg._remove_if_held_by_others(top, rec))
        finally:
            os.close(top)

    try:
        rec = next(r for r in reg.scan().live if r.lease_id == their_id)
        theirs.rename(moved)  # nobody puts a FIFO in its place: a blocking open would hang
        os.mkfifo(theirs)
        os.chown(theirs, NOBODY, -1)
        worker = threading.Thread(target=remove, daemon=True)
        with caplog.at_level(logging.DEBUG, logger="autogpu_jupyter.core.leasing.directory"):
            worker.start()
            worker.join(10)
            hung = worker.is_alive()
            if hung:  # let the blocked open return before failing
                os.close(os.open(theirs, os.O_WRONLY | os.O_NONBLOCK))
                worker.join(5)
            assert not hung
            theirs.unlink()  # then a link to the held file: not followed
            theirs.symlink_to(moved)
            os.chown(theirs, NOBODY, -1, follow_symlinks=False)
            remove()
    finally:
        held.close()
    assert results == [False, False]
    assert theirs.is_symlink() and moved.exists()
    assert caplog.messages == [
        f"not removing {rec.path}: [Errno {errno.ELOOP}] {os.strerror(errno.ELOOP)}: "
        f"'{theirs.name}'"
    ]


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_held_lease_swapped_between_its_check_and_its_removal_is_left_alone(
    reg: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held lease whose file is swapped for a link right after the removal step opened it is
    left alone.

    A reasoned private seam: the swap has to land inside the removal step (after its open); the
    step is run by itself, with ``os.fstat`` as the moment of the swap."""
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, their_id = _plant_record(reg, uid=NOBODY, user=nobody)
    held = _Held(theirs)  # root (not nobody) holds nobody's lease: it would be pruned
    ino = os.stat(theirs).st_ino
    moved = theirs.with_suffix(".old")
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if st.st_ino == ino and not moved.exists():
            # Right after our open, nobody moves the file away and leaves a link to it.
            theirs.rename(moved)
            theirs.symlink_to(moved)
        return st

    top = os.open(reg.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rec = next(r for r in reg.scan().live if r.lease_id == their_id)
        monkeypatch.setattr(os, "fstat", fstat)
        assert reg._remove_if_held_by_others(top, rec) is False
        monkeypatch.undo()
    finally:
        os.close(top)
        held.close()
    assert theirs.is_symlink() and moved.exists()


@pytest.mark.multiuser
@ROOT_ONLY
def test_a_held_lease_replaced_or_gone_before_its_check_is_left_alone(reg: DirectoryStore) -> None:
    """A held record replaced by a new file, removed, or naming a user who is gone, between the
    prune's scan and its removal, is left alone; a ticket is removed by its own name.

    A reasoned private seam: each change has to land between the prune's scan and its removal; the
    removal step is run by itself after each."""
    nobody = pwd.getpwuid(NOBODY).pw_name
    theirs, their_id = _plant_record(reg, uid=NOBODY, user=nobody)
    ticket, ticket_id = _plant_record(reg, uid=NOBODY, user=nobody, kind="ticket")
    held = [_Held(theirs), _Held(ticket)]
    try:
        rec = next(r for r in reg.scan().live if r.lease_id == their_id)
        tic = next(r for r in reg.scan().live if r.lease_id == ticket_id)
        top = os.open(reg.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert reg._remove_if_held_by_others(top, tic) is True  # by its .ticket name
            assert not ticket.exists()
            data = theirs.read_bytes()
            theirs.rename(theirs.with_suffix(".old"))
            theirs.write_bytes(data)
            os.chown(theirs, NOBODY, -1)  # a new inode, nobody's, not held: not this one
            assert reg._remove_if_held_by_others(top, rec) is False
            theirs.unlink()
            assert reg._remove_if_held_by_others(top, rec) is False
            gone = LeaseRecord(**{**_rec_fields(rec), "uid": 4242})
            assert reg._remove_if_held_by_others(top, gone) is False
        finally:
            os.close(top)
    finally:
        for h in held:
            h.close()


def _rec_fields(rec: LeaseRecord) -> dict[str, Any]:
    return {f: getattr(rec, f) for f in LeaseRecord.__dataclass_fields__}


# ---- who holds a lock, per /proc ------------------------------------------------------------


def _st(tmp_path: Path) -> os.stat_result:
    f = tmp_path / "locked"
    f.write_text("")
    return os.stat(f)


def test_a_lease_locked_only_by_another_users_process_counts_as_held_by_others(
    tmp_path: Path,
) -> None:
    st = _st(tmp_path)
    held = _Held(tmp_path / "locked")
    try:
        assert safefs.held_only_by_others(st, ME) is False
        assert safefs.held_only_by_others(st, ME + 1) is True
    finally:
        held.close()
    assert safefs.held_only_by_others(st, ME + 1) is False  # nobody holds it


# ---- names as shown ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shown"),
    [("plain", "plain"), ("é", "é"), (os.fsdecode(b"x\xff"), "x\\xff"), ("", "")],
)
def test_entry_names_are_shown_printable(name: str, shown: str) -> None:
    assert safefs.shown(name) == shown


def test_a_uid_without_a_name_is_shown_as_its_number() -> None:
    assert safefs.user_name(0) == "root"
    assert safefs.user_name(4_000_000_001) == "4000000001"


# ---- the ticket bound (found by the mutation run of issue 22) ----
@pytest.mark.parametrize(("given", "kept"), [(0, 0), (-3, 0), (2, 2)])
def test_the_ticket_bound_is_kept_at_zero_or_more(tmp_path: Path, given: int, kept: int) -> None:
    assert DirectoryStore(tmp_path, max_tickets_per_user=given).max_tickets_per_user == kept


# ---- the transaction's default wait (found by the mutation run of issue 22) ----
def test_a_directory_transaction_has_no_lock_to_wait_for(tmp_path: Path) -> None:
    with DirectoryStore(tmp_path / "registry").locked() as txn:
        assert txn is not None
        assert txn.ready() == 0.0
