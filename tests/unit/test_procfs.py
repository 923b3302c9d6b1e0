"""What /proc says about a process (core.procfs): parent, start time, uids, owner, and the
holders of an flock, read from this host's real /proc and from files written to look like it."""

from __future__ import annotations

import fcntl
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from autogpu_jupyter.core import procfs

GONE = 2**22 + 7  # above pid_max: no such process


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _st(tmp_path: Path) -> os.stat_result:
    f = tmp_path / "locked"
    f.write_text("")
    return os.stat(f)


def test_flock_holders_are_read_from_proc_locks_by_device_and_inode(tmp_path: Path) -> None:
    st = _st(tmp_path)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: FLOCK  ADVISORY  WRITE 4242 {key} 0 EOF\n"
        f"2: POSIX  ADVISORY  WRITE 5151 {key} 0 EOF\n"  # a POSIX lock, not an flock
        f"3: FLOCK  ADVISORY  READ  6161 {key}0 0 EOF\n"  # another inode
        f"4: FLOCK  ADVISORY  READ  7171 {key} 0 EOF\n"
        "5: FLOCK  ADVISORY\n"
        f"6: FLOCK  ADVISORY  WRITE 8181 {key}\n"
    )
    assert procfs.flock_holders(st, str(locks)) == [4242, 7171, 8181]
    locks.write_text(f"1: FLOCK  ADVISORY  WRITE 4242 {key} 0 EOF\n"
                     f"2: FLOCK  ADVISORY  WRITE x {key} 0 EOF\n")
    assert procfs.flock_holders(st, str(locks)) is None  # cannot tell: unknown
    assert procfs.flock_holders(st, str(tmp_path / "missing")) is None
    assert procfs.flock_holders(st, os.devnull) == []


def test_the_real_proc_locks_names_this_process_as_the_holder(tmp_path: Path) -> None:
    st = _st(tmp_path)
    assert procfs.flock_holders(st) == []
    fd = os.open(tmp_path / "locked", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert procfs.flock_holders(st) == [os.getpid()]
    finally:
        os.close(fd)
    assert procfs.flock_holders(st) == []


def test_a_process_uids_are_read_from_proc() -> None:
    assert procfs.uids(os.getpid()) == {os.getuid(), os.geteuid()}
    assert procfs.uids(GONE) is None
    assert procfs.uids(0) is None  # /proc has no pid 0


def test_a_process_parent_start_time_and_owner(child: subprocess.Popen[bytes]) -> None:
    assert procfs.ppid(child.pid) == os.getpid()
    assert procfs.ppid(os.getpid()) == os.getppid()
    started = procfs.start_time(child.pid)
    assert started is not None and started >= procfs.start_time(os.getpid())  # type: ignore[operator]
    assert procfs.start_time(child.pid) == started  # the same process, the same answer
    assert procfs.owner_uid(child.pid) == os.geteuid()
    for ask in (procfs.ppid, procfs.start_time, procfs.owner_uid, procfs.command_of):
        assert ask(GONE) is None


def test_the_owner_of_a_process_by_name_from_the_proc_it_is_told(tmp_path: Path) -> None:
    fake = tmp_path / "proc"
    (fake / "77").mkdir(parents=True)
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert procfs.owner_uid(77, str(fake)) == os.geteuid()
    assert procfs.user_of(77, str(fake)) == me
    assert procfs.user_of(78, str(fake)) is None


def test_a_command_name_with_parentheses_and_spaces_is_split_from_the_right(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "proc"
    (fake / "77").mkdir(parents=True)
    rest = " ".join(str(n) for n in range(3, 53))  # fields 3..52: state, ppid=4, ..., 22 = 22
    (fake / "77" / "stat").write_text(f"77 (a ) b (c) {rest}\n")
    assert procfs.ppid(77, str(fake)) == 4
    assert procfs.start_time(77, str(fake)) == 22
    (fake / "77" / "stat").write_text("77 (short) S\n")
    assert (procfs.ppid(77, str(fake)), procfs.start_time(77, str(fake))) == (None, None)
    (fake / "77" / "stat").write_text("77 (bad) S x\n")
    assert procfs.ppid(77, str(fake)) is None
