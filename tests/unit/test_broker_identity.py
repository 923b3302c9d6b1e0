"""Who a uid is to the broker (autogpu_jupyter.brokerd.identity): a passwd user is itself, a uid
in a subordinate range without a passwd entry is the range's owner, any other uid is the one
bucket of unknown uids. Real passwd and group databases; a subordinate-uid file of the test's.
"""

from __future__ import annotations

import grp
import os
import pwd
import threading
from pathlib import Path

import pytest

from autogpu_jupyter.brokerd import identity
from autogpu_jupyter.brokerd.identity import UNKNOWN_KEY, Account, Accounts

ROOT = pwd.getpwuid(0)
DAEMON = pwd.getpwnam("daemon")
BIN = pwd.getpwnam("bin")


def _unused_uid(start: int) -> int:
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


FREE = _unused_uid(300000)


def _groups(name: str, gid: int) -> frozenset[str]:
    gids = {gid, *os.getgrouplist(name, gid)}
    return frozenset(grp.getgrgid(g).gr_name for g in gids)


@pytest.fixture
def subuid(tmp_path: Path) -> Path:
    path = tmp_path / "subuid"
    path.write_text(f"daemon:{FREE}:100\n{BIN.pw_uid}:{FREE + 100}:10\n")
    return path


def test_a_passwd_user_is_itself_with_its_groups(subuid: Path) -> None:
    accounts = Accounts(str(subuid))
    assert accounts.account(0) == Account(0, "root", _groups("root", 0))
    got = accounts.account(DAEMON.pw_uid)
    assert got == Account(DAEMON.pw_uid, "daemon", _groups("daemon", DAEMON.pw_gid))
    assert not got.unknown


def test_a_subordinate_uid_is_its_owner_by_name_or_by_number(subuid: Path) -> None:
    accounts = Accounts(str(subuid))
    first = accounts.account(FREE)
    assert first == Account(DAEMON.pw_uid, "daemon", _groups("daemon", DAEMON.pw_gid),
                            f"subordinate uid {FREE} of daemon")
    assert accounts.account(FREE + 99).key == DAEMON.pw_uid  # the range's last uid
    assert accounts.account(FREE + 99).groups == first.groups
    by_number = accounts.account(FREE + 105)
    assert (by_number.key, by_number.name) == (BIN.pw_uid, "bin")
    assert by_number.via == f"subordinate uid {FREE + 105} of bin"


def test_other_unknown_uids_share_one_bucket(subuid: Path) -> None:
    accounts = Accounts(str(subuid))
    for uid in (FREE + 110, FREE - 1, 4_000_000_000):
        got = accounts.account(uid)
        assert got == Account(UNKNOWN_KEY, "unknown uids", frozenset(),
                              f"uid {uid} (no passwd entry)")
        assert got.unknown


def test_a_passwd_entry_wins_over_a_range_that_contains_it(tmp_path: Path) -> None:
    path = tmp_path / "subuid"
    path.write_text(f"bin:{DAEMON.pw_uid}:1\n")
    assert Accounts(str(path)).account(DAEMON.pw_uid).name == "daemon"


def test_a_range_whose_owner_has_no_passwd_entry_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "subuid"
    path.write_text(f"nosuchuser-ag:{FREE}:10\n{FREE + 50}:{FREE + 20}:10\n")
    accounts = Accounts(str(path))
    assert accounts.account(FREE + 1) == Account(
        UNKNOWN_KEY, "unknown uids", frozenset(),
        f"uid {FREE + 1} (subordinate of 'nosuchuser-ag', who has no passwd entry)")
    assert accounts.account(FREE + 21).key == UNKNOWN_KEY


def test_bad_lines_are_skipped_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "subuid"
    path.write_text(
        "# a comment\n\n"
        f"daemon:{FREE}\n"  # no count
        f"daemon:x:10\n"
        f"daemon:{FREE}:0\n"
        f":{FREE}:10\n"
        f"daemon:-5:10\n"
        f"daemon:{FREE}:10:extra\n"
        f"bin:{FREE + 10}:5\n"
    )
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        accounts = Accounts(str(path))
        assert accounts.account(FREE + 12).name == "bin"
        assert accounts.account(FREE).key == UNKNOWN_KEY
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} line {n} is not NAME:FIRST:COUNT: skipped" for n in (3, 4, 5, 6, 7, 8)]


def test_a_missing_file_maps_nothing(tmp_path: Path) -> None:
    assert Accounts(str(tmp_path / "none")).account(FREE).key == UNKNOWN_KEY


def test_the_file_is_read_again_when_it_changes(
    subuid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(identity.time, "monotonic", lambda: clock[0])
    accounts = Accounts(str(subuid))
    assert accounts.account(FREE).name == "daemon"
    subuid.write_text(f"bin:{FREE}:1\n")
    os.utime(subuid, ns=(1, 1))  # a new stamp, whatever the clock's resolution
    clock[0] += 0.5  # checked at most once a second: the old answer (cached) stands
    assert accounts.account(FREE).name == "daemon"
    clock[0] += 1.0
    assert accounts.account(FREE).name == "bin"
    clock[0] += 2.0
    subuid.unlink()
    assert accounts.account(FREE).key == UNKNOWN_KEY


def test_lookups_are_cached_briefly_and_the_cache_is_bounded(
    subuid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(identity.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(identity, "_CACHE_MAX", 3)
    calls: list[int] = []
    real = pwd.getpwuid

    def counting(uid: int) -> pwd.struct_passwd:
        calls.append(uid)
        return real(uid)

    monkeypatch.setattr(identity.pwd, "getpwuid", counting)
    accounts = Accounts(str(subuid))
    accounts.account(0)
    accounts.account(0)
    assert calls == [0]
    clock[0] += identity._CACHE_TTL_S
    accounts.account(0)
    assert calls == [0, 0]
    for uid in range(FREE, FREE + 5):
        accounts.account(uid)
    assert accounts.cached <= 3


def test_an_owner_name_without_passwd_entry_is_named_by_its_first_32_characters(
    tmp_path: Path,
) -> None:
    """Caught: the name cut at 33 characters (the message's bound changed)."""
    owner = "n" * 30 + "abcdefghij"  # 40 characters, no such user
    path = tmp_path / "subuid"
    path.write_text(f"{owner}:{FREE}:10\n")
    got = Accounts(str(path)).account(FREE + 3)
    assert got.via == (
        f"uid {FREE + 3} (subordinate of {'n' * 30 + 'ab'!r}, who has no passwd entry)")


def test_a_line_that_is_not_utf8_is_read_with_replacement_characters(tmp_path: Path) -> None:
    """A subuid file with bytes that are not UTF-8 (a name in another encoding): its line is
    read with U+FFFD in their place and the other lines still count. Caught: the decoding's
    error handler misspelled (every such file raised, and no uid was mapped)."""
    path = tmp_path / "subuid"
    path.write_bytes(b"caf\xe9:%d:10\nbin:%d:5\n" % (FREE, FREE + 10))
    accounts = Accounts(str(path))
    assert accounts.account(FREE + 1).via == (
        f"uid {FREE + 1} (subordinate of 'caf\ufffd', who has no passwd entry)")
    assert accounts.account(FREE + 12).name == "bin"


def test_a_range_may_start_at_uid_0(tmp_path: Path) -> None:
    """Only a negative first uid is a bad line; 0 is a start like any other. Caught: ``first
    < 0`` made ``first < 1`` (a range from 0 skipped as a bad line)."""
    path = tmp_path / "subuid"
    path.write_text("bin:0:10\n")
    assert identity._read_ranges(str(path)) == [(0, 9, "bin")]


def test_a_subuid_file_past_its_bound_is_read_from_its_start_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The start is read up to the bound, its cut last line skipped as a bad line. Caught:
    the warning's text replaced by ``None`` (the line could not be formatted)."""
    first = f"bin:{FREE}:10\n"
    bound = len(first) + 3  # the second line cut to "dae"
    monkeypatch.setattr(identity, "_MAX_SUBUID_BYTES", bound)
    path = tmp_path / "subuid"
    path.write_text(first + f"daemon:{FREE + 10}:10\n")
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        assert identity._read_ranges(str(path)) == [(FREE, FREE + 9, "bin")]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} is larger than {bound} bytes: read its start only",
        f"{path} line 2 is not NAME:FIRST:COUNT: skipped"]


def test_a_subuid_pipe_is_read_one_byte_past_the_bound_and_no_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte past the bound says the file is larger; no more is waited for: a pipe whose
    writer gave that much and stays open is done with (the reader gone when it writes again),
    not waited on. Caught: two bytes past the bound read (the broker blocked on the pipe)."""
    bound = 16
    monkeypatch.setattr(identity, "_MAX_SUBUID_BYTES", bound)
    path = tmp_path / "subuid"
    os.mkfifo(path)
    read_done = threading.Event()
    late: list[BaseException | None] = []

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, f"bin:{FREE}:10\n".encode().ljust(bound + 1, b"#"))
            read_done.wait(10)  # a bound on the test's run only if the reader waits on
            try:
                os.write(fd, b"x")
                late.append(None)
            except BrokenPipeError as err:
                late.append(err)
        finally:
            os.close(fd)

    t = threading.Thread(target=writer, daemon=True)  # not left blocked if no reader came
    t.start()
    try:
        assert identity._read_ranges(str(path)) == [(FREE, FREE + 9, "bin")]
    finally:
        read_done.set()
        t.join(10)
    assert len(late) == 1 and isinstance(late[0], BrokenPipeError)


def _unused_gid(start: int) -> int:
    gid = start
    while True:
        try:
            grp.getgrgid(gid)
        except KeyError:
            return gid
        gid += 1


def test_a_gid_without_a_group_entry_is_named_by_its_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A primary gid in passwd that the group database does not know (an LDAP user's, say)
    counts as a group named by its number (a group limit or reservation may name it so).
    Caught: every such gid named ``None``."""
    gid = _unused_gid(300000)
    root = pwd.getpwuid(0)
    entry = pwd.struct_passwd((root.pw_name, root.pw_passwd, 0, gid, root.pw_gecos,
                               root.pw_dir, root.pw_shell))
    monkeypatch.setattr(identity.pwd, "getpwuid", lambda uid: entry)
    got = Accounts("/nonexistent/subuid").account(0)
    others = {grp.getgrgid(g).gr_name for g in os.getgrouplist("root", gid) if g != gid}
    assert got.groups == frozenset({str(gid), *others})


def test_an_unreadable_subuid_file_maps_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A subordinate id file that cannot be read (here: a directory) maps no uid, and the log
    names the file and the error. Caught: the error replaced by ``None`` or dropped from the
    warning, and the warning's text dropped (the line could not be formatted)."""
    path = tmp_path / "subuid"
    path.mkdir()
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        assert identity._read_ranges(str(path)) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot read {path} ([Errno 21] Is a directory: '{path}'): "
        "no subordinate uids are mapped"]


@pytest.mark.parametrize("error", [KeyError("nobody"), OSError("no groups")])
def test_a_user_whose_group_list_cannot_be_read_keeps_the_primary_group(
    monkeypatch: pytest.MonkeyPatch, error: Exception,
) -> None:
    """``os.getgrouplist`` failing (an account gone, a broken NSS) leaves the primary group
    only. Caught: the exceptions suppressed replaced by ``None`` (every such failure became
    a TypeError and the connection was lost)."""
    gid = _unused_gid(300000)

    def fail(user: str, group: int) -> list[int]:
        raise error

    monkeypatch.setattr(identity.os, "getgrouplist", fail)
    assert identity._group_names("nobody-here", gid) == frozenset({str(gid)})
