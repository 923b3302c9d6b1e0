"""The broker's journal (autogpu_jupyter.brokerd.journal): an append log in a real directory, read
back as the live entries; one line per change, compacted when long; torn and foreign lines
skipped; the first broker's journal.json read once. And who holds a socket: real sockets, real
processes, the kernel's sock_diag and /proc.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import peers
from autogpu_jupyter.brokerd.journal import Entry, Journal
from tests.leasehelpers import AsUser

REPO = Path(__file__).resolve().parents[2]


def entry(n: int, *, peer: int | None = None, size: int = 10) -> Entry:
    rec = json.dumps({"kind": "lease", "lease_id": f"{n:032x}", "pad": "x" * size})
    return Entry(f"{n:032x}", 1000 + n, rec, peer, [(100 + n, 5000 + n)])


def read_back(directory: Path, boot: str | None = None) -> dict[str, Entry]:
    """The live entries a broker restarted now would read from the log in ``directory``: a
    copy of the file replayed by a fresh journal (the one under test goes on appending to the
    original, uncompacted)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as copy:
        shutil.copy2(directory / jrnl.LOG_NAME, copy)
        again = Journal(copy, boot=boot)
        try:
            return again.load()
        finally:
            again.close()


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_changes_are_lines_and_a_new_journal_reads_the_live_ones(tmp_path: Path) -> None:
    j = Journal(str(tmp_path))
    assert j.load() == {}
    j.add(entry(1, peer=77))
    j.add(entry(2), seq=7)
    assert j.seq == 7
    j.set_pids(entry(2).lease_id, [(9, 99)])
    assert read_back(tmp_path)[entry(2).lease_id].pids == [(9, 99)]
    j.remove(entry(1).lease_id)
    j.remove("no-such-id")  # nothing to end: no line
    assert [sorted(d) for d in lines(tmp_path / "journal.log")] == [
        ["seq"], ["boot"], ["add", "peer", "pids", "record", "uid"],
        ["add", "peer", "pids", "record", "seq", "uid"], ["holders", "pids"], ["del"]]
    again = Journal(str(tmp_path))
    live = again.load()
    assert list(live) == [entry(2).lease_id]
    assert live[entry(2).lease_id].pids == [(9, 99)]
    assert live[entry(2).lease_id].uid == 1002
    assert again.seq == 7
    # loading compacts: only the live entry is left, behind the ticket counter and the boot
    assert [next(iter(d)) for d in lines(tmp_path / "journal.log")] == ["seq", "boot", "add"]
    assert lines(tmp_path / "journal.log")[1] == {"boot": jrnl.boot_id()}
    assert oct((tmp_path / "journal.log").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize(
    "e",
    [
        entry(1, peer=77),
        Entry("ab" * 16, 0, json.dumps({"notebook": "ü \\ \" \t 🙂", "x": None}), None, []),
        Entry("x\"y\\z\n", 2**40, '{"a":"\u2028\ud83d"}', 2**63 - 1,
              [(1, 2), (2**31, 2**60), (7, 0)]),
    ],
)
@pytest.mark.parametrize("seq", [None, 0, 41])
def test_a_line_written_by_hand_is_the_line_json_dumps_writes(e: Entry, seq: int | None) -> None:
    """The journal's lines are put together by hand (a grant's cost): byte for byte what
    ``json.dumps`` writes, whatever the record's text holds (quotes, backslashes, control and
    non-ASCII characters, a lone surrogate). Caught: a field left out, quoted by hand, in
    another order, or the newline lost."""
    doc = e.line() | ({} if seq is None else {"seq": seq})
    assert e.encoded(seq) == json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    assert json.loads(e.encoded(seq)) == json.loads(json.dumps(doc))


def test_the_live_size_counts_each_entry_once_as_it_changes(tmp_path: Path) -> None:
    """What decides compaction: the bytes of the live entries' lines. An entry written again
    (its holders changed) counts once, at its new size; an ended one not at all. Caught: the
    old size added instead of taken away, or looked up under another key (a log compacted
    too late, growing past four times the live state)."""
    j = Journal(str(tmp_path))
    j.load()
    first, again = entry(1), entry(1, peer=12345, size=300)
    j.add(first)
    j.add(entry(2))
    j.add(again)
    assert j.live_bytes == len(again.encoded()) + len(entry(2).encoded())
    j.remove(first.lease_id)
    j.remove(entry(2).lease_id)
    assert j.live_bytes == 0


def test_the_holders_and_end_lines_are_the_ones_json_dumps_writes(tmp_path: Path) -> None:
    j = Journal(str(tmp_path))
    j.load()
    odd = Entry('q"\\ü', 5, "{}", None, [])
    j.add(odd)
    j.set_pids(odd.lease_id, [(9, 99), (10, 2**40)])
    j.remove(odd.lease_id)
    raw = (tmp_path / "journal.log").read_bytes().splitlines(keepends=True)[-2:]
    assert raw == [
        json.dumps({"holders": odd.lease_id, "pids": [[9, 99], [10, 2**40]]},
                   separators=(",", ":")).encode() + b"\n",
        json.dumps({"del": odd.lease_id}, separators=(",", ":")).encode() + b"\n",
    ]


def test_a_change_is_in_the_file_for_any_reader_when_it_returns(tmp_path: Path) -> None:
    """Written with one ``write`` before the broker replies: a broker killed right after the
    reply leaves it in the file (no buffer of the process holds it)."""
    j = Journal(str(tmp_path))
    j.load()
    j.add(entry(1))
    assert entry(1).lease_id in (tmp_path / "journal.log").read_text()
    j.set_pids(entry(1).lease_id, [(3, 33)])
    assert lines(tmp_path / "journal.log")[-1] == {"holders": entry(1).lease_id, "pids": [[3, 33]]}
    j.remove(entry(1).lease_id)
    assert lines(tmp_path / "journal.log")[-1] == {"del": entry(1).lease_id}
    j.set_pids(entry(1).lease_id, [(1, 1)])  # not live: nothing written
    assert lines(tmp_path / "journal.log")[-1] == {"del": entry(1).lease_id}


def test_a_log_of_another_boot_is_dropped_whole_and_one_of_this_boot_kept(
    tmp_path: Path,
) -> None:
    """No lease outlives the boot: inodes and pids start again, so a stale entry could only
    keep a GPU booked for nobody."""
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1, peer=5))
    j.add(entry(2), seq=3)
    same = Journal(str(tmp_path), boot="boot-a")  # a restart in the same boot
    # each entry as it was added, the socket's peer inode with it (the holders are found by it)
    assert same.load() == {entry(1).lease_id: entry(1, peer=5), entry(2).lease_id: entry(2)}
    assert same.dropped == 0 and same.logged_boot == "boot-a"
    same.close()
    after = Journal(str(tmp_path), boot="boot-b")  # the host rebooted
    assert after.load() == {}
    assert (after.dropped, after.logged_boot) == (2, "boot-a")
    assert after.seq == 3  # the ticket counter goes on
    assert lines(tmp_path / "journal.log") == [{"seq": 3}, {"boot": "boot-b"}]
    after.close()
    assert Journal(str(tmp_path), boot="boot-b").load() == {}


def test_a_logged_boot_is_read_as_its_first_128_characters(tmp_path: Path) -> None:
    """A boot id is at most 128 characters (:func:`boot_id` reads no more): a longer head is
    cut there, so it names the boot of its first 128. Caught: the cut made at 129 (this
    boot's log taken for another's, its leases dropped)."""
    boot = "b" * 128
    (tmp_path / "journal.log").write_text(
        json.dumps({"seq": 2}) + "\n" + json.dumps({"boot": boot + "-and-more"}) + "\n"
        + json.dumps(entry(1).line()) + "\n"
    )
    j = Journal(str(tmp_path), boot=boot)
    assert list(j.load()) == [entry(1).lease_id]
    assert (j.dropped, j.logged_boot) == (0, boot)
    j.close()


def test_a_log_without_a_boot_head_is_read_by_pids_as_before(tmp_path: Path) -> None:
    """A log written by an earlier broker (no head) names no boot: nothing is dropped for it,
    and where the kernel names no boot, no log is."""
    (tmp_path / "journal.log").write_text(
        json.dumps({"seq": 4}) + "\n" + json.dumps(entry(1).line()) + "\n"
    )
    j = Journal(str(tmp_path), boot="boot-b")
    assert list(j.load()) == [entry(1).lease_id]
    assert j.dropped == 0
    j.close()
    nowhere = Journal(str(tmp_path / "x"), boot=None)
    (tmp_path / "x").mkdir()
    nowhere.boot = None  # the kernel did not say
    assert nowhere.load() == {}
    assert lines(tmp_path / "x" / "journal.log") == [{"seq": 0}]


def test_the_boot_id_is_the_kernels(tmp_path: Path) -> None:
    here = jrnl.boot_id()
    assert here is not None and len(here) == 36 and here.count("-") == 4
    assert here == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (tmp_path / "id").write_text("  abc \n")
    assert jrnl.boot_id(str(tmp_path / "id")) == "abc"
    (tmp_path / "empty").write_text("")
    assert jrnl.boot_id(str(tmp_path / "empty")) is None
    assert jrnl.boot_id(str(tmp_path / "missing")) is None


def test_each_change_costs_one_line_and_the_log_stays_bounded(tmp_path: Path) -> None:
    j = Journal(str(tmp_path))
    j.load()
    for n in range(100):
        j.add(entry(n, size=1000))
    live = j.size_bytes
    path = tmp_path / "journal.log"
    largest = 0
    for n in range(100, 2100):
        before = path.stat().st_size
        j.add(entry(n, size=1000))
        grew = path.stat().st_size - before
        assert grew in range(1000, 1200) or grew < 0  # one line, or a compaction
        j.remove(entry(n).lease_id)
        largest = max(largest, path.stat().st_size)
    assert largest <= max(jrnl.COMPACT_MIN_BYTES, 4 * live) + 1200  # at its largest too
    # and no sooner: a compaction rewrites every live record, so it waits for 4x their size
    # (here past COMPACT_MIN_BYTES), measured against the live entries whatever came and went
    assert 4 * live > jrnl.COMPACT_MIN_BYTES and largest >= 4 * live - 1200
    assert len(Journal(str(tmp_path)).load()) == 100


def test_the_log_is_compacted_past_its_bound_not_at_it(tmp_path: Path) -> None:
    j = Journal(str(tmp_path))
    j.load()
    j.add(entry(1))  # a small live state: the bound is COMPACT_MIN_BYTES
    while j.size_bytes < jrnl.COMPACT_MIN_BYTES - 8000:
        churn = entry(2, size=2000)
        j.add(churn)
        j.remove(churn.lease_id)
    gap = jrnl.COMPACT_MIN_BYTES - j.size_bytes
    exact = entry(3, size=gap - len(entry(3, size=0).encoded()))
    assert len(exact.encoded()) == gap
    j.add(exact)
    assert j.size_bytes == jrnl.COMPACT_MIN_BYTES  # at the bound: appended, not rewritten
    j.add(entry(4))
    assert j.size_bytes < 16 * 1024  # past it: rewritten as the live entries
    assert sorted(Journal(str(tmp_path)).load()) == sorted(e.lease_id for e in
                                                           (entry(1), exact, entry(4)))


def test_a_journal_on_descriptor_0_keeps_it(tmp_path: Path) -> None:
    """A broker started with its stdin closed gets descriptor 0 for its journal: kept, not
    taken for "not open" and opened again on every change (a descriptor lost per grant)."""
    saved = os.dup(0)
    try:
        os.close(0)
        j = Journal(str(tmp_path))
        j.load()
        log_path = str(tmp_path / jrnl.LOG_NAME)
        assert os.readlink("/proc/self/fd/0") == log_path  # as /proc shows the broker's fds
        open_fds = len(os.listdir("/proc/self/fd"))
        for n in range(20):
            j.add(entry(n))
        assert os.readlink("/proc/self/fd/0") == log_path
        assert len(os.listdir("/proc/self/fd")) == open_fds
        j.close()
        with pytest.raises(OSError):  # closed with the journal, not left open
            os.fstat(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    assert len(Journal(str(tmp_path)).load()) == 20


def test_torn_foreign_and_oversized_lines_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = json.dumps(entry(1).line())
    (tmp_path / "journal.log").write_text(
        '{"seq": 3}\n'
        + good + "\n"
        + "not json\n"
        + "[1, 2]\n"
        + '{"what": 1}\n'
        + '{"add": "x", "uid": "root", "record": "{}"}\n'
        + '{"add": "y", "uid": 5, "record": "{}", "pids": [[1]]}\n'
        + '{"add": "z", "uid": 5, "record": "{}", "pids": "1"}\n'
        + '{"seq": "9"}\n'
        + '{"holders": "nobody", "pids": [[1, 2]]}\n'
        + json.dumps({"add": "big", "uid": 1, "record": "x" * jrnl.MAX_LINE_BYTES}) + "\n"
        + json.dumps(entry(2).line())  # torn: no newline
    )
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        j = Journal(str(tmp_path))
        live = j.load()
    assert list(live) == [entry(1).lease_id]
    assert j.seq == 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        *(f"journal line {n} skipped" for n in (3, 4, 5, 6, 7, 8, 9)),
        "journal line 11 skipped (torn or too long)",
        "journal line 12 skipped (torn or too long)",
    ]


def test_the_first_brokers_journal_json_is_read_once(tmp_path: Path) -> None:
    rec = entry(4).record
    (tmp_path / "journal.json").write_text(json.dumps({"seq": 12, "entries": [
        {"uid": 1004, "record": rec, "pids": [[104, 5004]]},
        {"uid": 1, "record": "not a record", "pids": []},
        {"uid": 1, "pids": []},
    ]}))
    j = Journal(str(tmp_path))
    live = j.load()
    assert list(live) == [entry(4).lease_id]
    assert (live[entry(4).lease_id].uid, live[entry(4).lease_id].pids, j.seq) == (
        1004, [(104, 5004)], 12)
    assert not (tmp_path / "journal.json").exists()
    assert list(Journal(str(tmp_path)).load()) == [entry(4).lease_id]
    (tmp_path / "journal.log").unlink()
    (tmp_path / "journal.json").write_text("{broken")
    assert Journal(str(tmp_path)).load() == {}


def test_a_first_journal_without_a_sequence_number_starts_from_0(tmp_path: Path) -> None:
    rec = entry(4).record
    (tmp_path / "journal.json").write_text(json.dumps({"entries": [
        {"uid": 1004, "record": rec, "pids": []}]}))
    j = Journal(str(tmp_path))
    assert list(j.load()) == [entry(4).lease_id]
    assert j.seq == 0


def test_a_process_that_is_gone_holds_no_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        ino = os.fstat(a.fileno()).st_ino
        assert peers.holds_socket(os.getpid(), ino) is True
        assert peers.holds_socket(2**22 + 12345, ino) is False  # no such pid: no /proc entry


def test_a_log_that_is_not_a_file_of_ours_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "journal.log").symlink_to(target)
    with pytest.raises(OSError):
        Journal(str(tmp_path)).load()
    # nor is it followed when the first change opens the log (no load before it)
    with pytest.raises(OSError):
        Journal(str(tmp_path)).add(entry(1))
    assert target.read_text() == ""


# ---- processes and sockets ---------------------------------------------------------------------


def test_the_peer_of_a_unix_socket_is_the_other_end() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino
        assert peers.peer_inode(b) == os.fstat(a.fileno()).st_ino


@pytest.fixture
def fresh_diag(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No kept sock_diag socket yet, sock_diag not marked broken (both restored after)."""
    peers._close_diag()
    monkeypatch.setattr(peers, "_diag_broken", False)
    yield
    peers._close_diag()


def diag_sockets() -> set[int]:
    """The inodes of this process's sock_diag (netlink family 4) sockets, as /proc shows
    them to any reader."""
    with open("/proc/self/net/netlink", encoding="ascii") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    diag = {int(cols[9]) for cols in rows if cols[1] == "4"}
    mine = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor of the listing itself, gone already
            continue
        if link.startswith("socket:["):
            mine.add(int(link[len("socket:["):-1]))
    return mine & diag


def test_the_kept_sock_diag_socket_answers_each_socket_in_turn(fresh_diag: None) -> None:
    """One sock_diag socket is opened at the first question and kept for every other one.
    Caught: a socket opened per question (another descriptor each time, or another socket)."""
    pairs = [socket.socketpair(socket.AF_UNIX) for _ in range(4)]
    try:
        assert diag_sockets() == set()
        peers.peer_inode(pairs[0][0])
        kept = diag_sockets()
        for a, b in pairs + pairs[::-1]:
            assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino
        assert len(kept) == 1 and diag_sockets() == kept  # one socket, kept
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_the_sequence_numbers_wrap_inside_32_bits_and_never_reach_0(
    fresh_diag: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        for start, seen in ((1, [2, 3]), (0xFFFFFFFE, [0xFFFFFFFF, 1])):
            monkeypatch.setattr(peers, "_diag_seq", start)
            got = []
            for _ in seen:
                assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino
                got.append(peers._diag_seq)
            assert got == seen


def test_a_connection_already_closed_has_no_peer_and_breaks_nothing(
    fresh_diag: None, caplog: pytest.LogCaptureFixture
) -> None:
    gone, other = socket.socketpair(socket.AF_UNIX)
    gone.close()
    other.close()
    with caplog.at_level(logging.WARNING):
        assert peers.peer_inode(gone) is None
    assert caplog.records == []
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino  # sock_diag still asked


def test_a_kernel_without_sock_diag_is_said_once_and_not_asked_again(
    fresh_diag: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(peers, "_NETLINK_SOCK_DIAG", 4095)  # no such netlink family
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b, caplog.at_level(logging.WARNING, logger=peers.log.name):
        assert peers.peer_inode(a) is None
        assert diag_sockets() == set()
        monkeypatch.setattr(peers, "_NETLINK_SOCK_DIAG", 4)  # would work now: not tried again
        assert peers.peer_inode(a) is None
        assert diag_sockets() == set()
    assert [r.getMessage() for r in caplog.records] == [
        "the kernel does not tell the peers of Unix sockets (sock_diag: [Errno 93] Protocol "
        "not supported): after a restart, leases are kept by the pids that took them"
    ]


def _peer_found_as_this_user() -> Any:
    peers._close_diag()  # this user's own sock_diag socket, as a broker not run as root has
    peers._diag_broken = False
    c, d = socket.socketpair(socket.AF_UNIX)
    with c, d:
        return [peers.peer_inode(c) == os.fstat(d.fileno()).st_ino, peers._diag_broken]


def test_the_kept_sock_diag_socket_closes_with_the_process() -> None:
    """A process that asked for a peer (the broker, a test run) ends without a
    ``ResourceWarning: unclosed <socket ... family=16 ...>`` for the kept netlink socket."""
    code = (
        "import socket\n"
        "from autogpu_jupyter.brokerd import journal\n"
        "a, b = socket.socketpair(socket.AF_UNIX)\n"
        "print(journal.peer_inode(a) == __import__('os').fstat(b.fileno()).st_ino)\n"
        "a.close(); b.close()\n"
    )
    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (out.returncode, out.stdout, out.stderr) == (0, "True\n", "")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_broker_not_run_as_root_is_told_the_peers_too(fresh_diag: None) -> None:
    """sock_diag answers any user's request sent to the kernel alone. Caught: the request sent
    to a multicast group as well (only root may send there: a broker run as another user had
    every peer unknown)."""
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino
    nobody = pwd.getpwnam("nobody")
    child = AsUser(nobody.pw_uid, nobody.pw_gid, _peer_found_as_this_user)
    try:
        assert child.result() == [True, False]
    finally:
        child.stop()


def test_a_stale_sock_diag_answer_is_skipped_by_its_sequence_number(fresh_diag: None) -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    c, d = socket.socketpair(socket.AF_UNIX)
    with a, b, c, d:
        peers.peer_inode(a)  # the kept socket exists
        assert peers._diag is not None
        # An answer left over (a request whose reply was never read): about socket c.
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF,
                          os.fstat(c.fileno()).st_ino, 4, 0xFFFFFFFF, 0xFFFFFFFF)
        peers._diag.sendto(struct.pack("=IHHII", 16 + len(req), 20, 1, 0xFFFFFFF0, 0) + req,
                          (0, 0))
        assert peers.peer_inode(a) == os.fstat(b.fileno()).st_ino


def test_start_time_and_proc_ids_of_a_process() -> None:
    me = jrnl.start_time(os.getpid())
    assert isinstance(me, int) and me > 0
    assert jrnl.proc_ids(os.getpid()) == [(os.getpid(), me)]
    assert jrnl.start_time(2**22 + 12345) is None
    assert jrnl.proc_ids(2**22 + 12345) == []
    assert os.getuid() in jrnl.pid_uids(os.getpid())
    assert jrnl.pid_uids(2**22 + 12345) == set()


def test_holders_are_found_by_the_socket_they_hold_and_checked_by_start_time() -> None:
    """A child that inherited one end of a socket pair holds it; the parent closes its copy:
    the scan finds the child only, and a pid whose start time differs is nobody."""
    a, b = socket.socketpair(socket.AF_UNIX)
    b.set_inheritable(True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             pass_fds=(b.fileno(),))
    try:
        ino = os.fstat(b.fileno()).st_ino
        b.close()
        deadline = time.monotonic() + 10
        while jrnl.start_time(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        start = jrnl.start_time(child.pid)
        assert start is not None
        assert peers.scan_socket_holders([ino]) == {ino: [(child.pid, start)]}
        assert peers.scan_socket_holders([]) == {}
        assert peers.holds_socket(child.pid, ino)
        assert not peers.holds_socket(os.getpid(), ino)
        assert peers.holders_alive([(child.pid, start)], ino, 12345) == [(child.pid, start)]
        assert peers.holders_alive([(child.pid, start + 1)], ino, 0) == []  # a reused pid
        assert peers.holders_alive([(os.getpid(), jrnl.start_time(os.getpid()) or 0)], ino,
                                  0) == []  # runs, but does not hold it
        # without an inode: the pid, its start time and its uid (root: any)
        uid = os.getuid()
        assert peers.holders_alive([(child.pid, start)], None, uid) == [(child.pid, start)]
        assert peers.holders_alive([(child.pid, start)], None, uid + 4242) == (
            [(child.pid, start)] if uid + 4242 == 0 else [])
    finally:
        child.kill()
        child.wait()
        a.close()
    assert peers.scan_socket_holders([ino]) == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_without_an_inode_a_holder_is_kept_by_its_users_uid_or_by_root() -> None:
    """Where sock_diag named no peer, a recorded holder that still runs is kept for the
    lease's own uid (a user who is not root) or for root, and not for another uid. Caught:
    ``uid == 0 or uid in pid_uids(pid)`` made ``and`` (every user's lease lost its holders)."""
    nobody = pwd.getpwnam("nobody")
    child = AsUser(nobody.pw_uid, nobody.pw_gid, int, hold=True)
    try:
        assert child.result() == 0
        start = jrnl.start_time(child.pid)
        assert start is not None
        held = [(child.pid, start)]
        assert peers.holders_alive(held, None, nobody.pw_uid) == held
        assert peers.holders_alive(held, None, 0) == held
        assert peers.holders_alive(held, None, nobody.pw_uid - 1) == []
    finally:
        child.stop()


def test_a_first_journal_without_entries_starts_empty_with_its_sequence(tmp_path: Path) -> None:
    """Caught: the default of a missing ``entries`` dropped (loading such a journal raised and
    the broker could not start)."""
    (tmp_path / "journal.json").write_text(json.dumps({"seq": 7}))
    j = Journal(str(tmp_path))
    assert (j.load(), j.seq) == ({}, 7)
    assert not (tmp_path / "journal.json").exists()


def test_a_sock_diag_answer_is_read_up_to_its_bytes_whatever_its_length_says() -> None:
    """The header's length is unsigned and bounded by the bytes there: a length past them (up
    to 2**32 - 1) still finds the peer in what was read. Caught: the header read as signed
    (a length of 2**31 or more became negative and the peer was never found)."""
    body = b"\0" * 16 + struct.pack("=HHI", 8, 2, 4242)  # unix_diag_msg, then UNIX_DIAG_PEER
    for length in (16 + len(body), 2**31, 2**32 - 1):
        data = struct.pack("=IHHII", length, 20, 0, 0, 0) + body
        assert peers._parse_peer(data) == 4242, length


def test_a_truncated_sock_diag_peer_attribute_gives_no_peer() -> None:
    """A peer attribute whose four bytes of payload are not all there (the answer cut short, or
    the attribute's own length under 8) names no peer, rather than reading past the answer or
    failing with ``struct.error``. Caught (issue 22, seed 53): only the attribute's header was
    checked to fit."""
    diag = b"\0" * 16  # unix_diag_msg
    cut = diag + struct.pack("=HH", 8, 2)  # UNIX_DIAG_PEER's header, its payload missing
    short = diag + struct.pack("=HHI", 4, 2, 4242)  # an attribute that says it has no payload
    for body, length in ((cut, 16 + len(cut)), (cut + struct.pack("=I", 4242), 16 + len(cut)),
                         (short, 16 + len(short))):
        data = struct.pack("=IHHII", length, 20, 0, 0, 0) + body
        assert peers._parse_peer(data) is None, (body, length)


def test_a_journal_not_yet_opened_counts_no_bytes_then_its_files(tmp_path: Path) -> None:
    """``size_bytes`` is a count from the start: 0 before the log is opened, the file's size
    once it is. Caught: the count starting as ``None``."""
    j = Journal(str(tmp_path), boot="boot-a")
    assert j.size_bytes == 0
    j.load()
    assert j.size_bytes == (tmp_path / "journal.log").stat().st_size > 0
    j.close()


def test_a_sock_diag_error_answer_raises_with_the_kernels_error_number() -> None:
    """An NLMSG_ERROR answer carries the negative errno after its 16-byte header: the error
    says that number. Caught: the errno read from offset 0 (the message length said instead)."""
    data = struct.pack("=IHHIIi", 36, 2, 0, 0, 0, -13) + b"\0" * 16  # nlmsgerr: errno, request
    with pytest.raises(ValueError, match=r"^error 13$"):
        peers._parse_peer(data)


def test_a_holder_that_vanished_mid_scan_is_skipped_and_the_scan_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that holds the socket but is gone before its start time is read is nobody;
    the processes after it are still looked at. Caught: the scan stopped at the first such
    process (later holders were missed and their orphan dropped)."""
    real_listdir, real_readlink = os.listdir, os.readlink

    def listdir(path: Any = ".") -> list[str]:
        if path == "/proc":
            return ["101", "self", "102"]
        if path in ("/proc/101/fd", "/proc/102/fd"):
            return ["0", "5"]
        return real_listdir(path)

    def readlink(path: Any, *a: Any, **k: Any) -> str:
        if str(path).startswith(("/proc/101/fd/", "/proc/102/fd/")):
            return "socket:[777]" if str(path).endswith("/5") else "/dev/null"
        return real_readlink(path, *a, **k)

    monkeypatch.setattr(jrnl.os, "listdir", listdir)
    monkeypatch.setattr(jrnl.os, "readlink", readlink)
    monkeypatch.setattr(peers, "start_time", lambda pid: None if pid == 101 else 5555)
    assert peers.scan_socket_holders([777, 888]) == {777: [(102, 5555)]}


# ---- a disk that fills up ----------------------------------------------------------------------


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """No file of this process may grow past ``limit`` bytes (``RLIMIT_FSIZE``): the kernel
    writes a line that crosses it in part and fails the next write (``EFBIG``), as a full disk
    does (``ENOSPC``). ``SIGXFSZ`` ignored meanwhile (it would end the process)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_change_that_cannot_be_written_leaves_nothing_of_itself_and_is_refused(
    tmp_path: Path,
) -> None:
    """A grant the disk has no room for: the piece the kernel wrote is cut off again, the
    journal raises its own error (naming the cause and the directory) and keeps its entries as
    they were, and the next change, once there is room, is read back after a restart. Caught
    (issue 39): the torn piece left in the file swallowed the next line, so a lease granted
    after the disk had room again was lost at the restart."""
    log_path = tmp_path / "journal.log"
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1))
    good = log_path.read_bytes()
    with file_size_limit(len(good) + 10), pytest.raises(OSError) as err:
        j.add(entry(2, size=100), seq=9)
    assert log_path.read_bytes() == good  # not a byte of it
    assert list(read_back(tmp_path, boot="boot-a")) == [entry(1).lease_id]
    assert isinstance(err.value, jrnl.NotRecorded)
    assert str(err.value) == f"file too large in {tmp_path}"
    assert err.value.errno == errno.EFBIG
    assert err.value.refusal("lease") == (
        f"cannot record the lease: file too large in {tmp_path} (the broker's state "
        "directory); the lease was not granted")
    j.compact()  # what the journal holds, written whole: the refused change is not in it
    assert lines(log_path)[0] == {"seq": 0}
    assert list(read_back(tmp_path, boot="boot-a")) == [entry(1).lease_id]
    j.add(entry(3))
    assert list(Journal(str(tmp_path), boot="boot-a").load()) == [
        entry(1).lease_id, entry(3).lease_id]


def test_an_end_that_cannot_be_written_is_written_with_the_next_change(tmp_path: Path) -> None:
    """The end of a lease (its holder gone) and its new holders cannot be refused: with the
    disk full they are kept, and written before the next change that fits. Caught: the write's
    error raised out of the end of a connection (the broker's callback that closes the
    socket), leaving the client hanging."""
    log_path = tmp_path / "journal.log"
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1))
    j.add(entry(2))
    good = log_path.read_bytes()
    with file_size_limit(len(good) + 3):
        j.set_pids(entry(2).lease_id, [(7, 70)])
        j.remove(entry(1).lease_id)
    assert log_path.read_bytes() == good
    j.add(entry(3))
    j.compact()  # what the journal holds, written whole: entry 1 ended, entry 2's new holders
    again = Journal(str(tmp_path), boot="boot-a").load()
    assert list(again) == [entry(2).lease_id, entry(3).lease_id]
    assert again[entry(2).lease_id].pids == [(7, 70)]


def test_whole_lines_written_after_a_torn_piece_are_all_read(tmp_path: Path) -> None:
    """A piece of a line the kernel wrote and nobody cut back (a crash mid-write, the disk
    full), then whole lines after it on the same line of the file: each whole one is read, the
    piece skipped (a top-level ``{"`` only ever starts a line). Caught (issue 39): the whole
    line after the piece was skipped with it: a live exclusive lease lost at a restart."""
    one, two, three = entry(1), entry(2), entry(3)
    torn = two.encoded()[:37]
    (tmp_path / "journal.log").write_bytes(
        b'{"seq":4}\n{"boot":"boot-a"}\n' + one.encoded()
        + torn + three.encoded()  # the piece, then a whole line
        + b'{"del":' + json.dumps(one.lease_id).encode() + b"}"  # whole but for its newline
        + b'{"holders":' + json.dumps(three.lease_id).encode() + b',"pids":[[5,6]]}\n'
        + two.encoded()[:20]  # a torn last line
    )
    live = Journal(str(tmp_path), boot="boot-a").load()
    assert list(live) == [three.lease_id]
    assert live[three.lease_id].pids == [(5, 6)]


def test_a_restart_on_a_full_disk_keeps_this_boots_log_and_cuts_its_torn_tail(
    tmp_path: Path,
) -> None:
    """A broker restarted while the disk is still full cannot compact (the snapshot needs
    room): a log of this boot is kept as it is, its torn last line cut off, and appended to
    once there is room. Caught: the broker refused to start ("journal unusable")."""
    log_path = tmp_path / "journal.log"
    head = b'{"seq":4}\n{"boot":"boot-a"}\n' + entry(1).encoded()
    log_path.write_bytes(head + entry(2).encoded()[:30])
    j = Journal(str(tmp_path), boot="boot-a")
    with file_size_limit(20):
        assert list(j.load()) == [entry(1).lease_id]
    assert log_path.read_bytes() == head
    assert not (tmp_path / "journal.log.tmp").exists()
    j.add(entry(3))
    assert list(Journal(str(tmp_path), boot="boot-a").load()) == [
        entry(1).lease_id, entry(3).lease_id]
    # A log of another boot must be rewritten (its entries are dropped): that cannot wait.
    with file_size_limit(20), pytest.raises(OSError):
        Journal(str(tmp_path), boot="boot-b").load()


def test_a_compaction_that_cannot_be_written_leaves_the_log_whole_and_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Past its bound the log is rewritten as a snapshot; where the snapshot cannot be written
    (here its temporary path is taken by a directory), the change is not refused, the log
    appended to stays whole, and the next try waits until the log has grown as much again.
    Caught: the snapshot's error raised out of a change that was written."""
    log_path = tmp_path / "journal.log"
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1))
    (tmp_path / "journal.log.tmp").mkdir()
    big = entry(2, size=jrnl.COMPACT_MIN_BYTES)
    with caplog.at_level("WARNING"):
        j.add(big)
        j.remove(big.lease_id)  # past the bound, four times the live entries: compact
        for n in range(3, 8):  # not tried again for each change
            j.add(entry(n))
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"journal {log_path} not compacted"]
    assert log_path.stat().st_size > jrnl.COMPACT_MIN_BYTES
    (tmp_path / "journal.log.tmp").rmdir()
    while log_path.stat().st_size > jrnl.COMPACT_MIN_BYTES:  # grown as much again: compacted
        j.add(big)
        j.remove(big.lease_id)
    assert list(Journal(str(tmp_path), boot="boot-a").load()) == [
        entry(n).lease_id for n in (1, 3, 4, 5, 6, 7)]


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_tenants_lease_written_with_its_sequence_number_keeps_both_after_a_restart(
    tmp_path: Path,
) -> None:
    """Mutation run of 2026-12-07 found the journal line of a lease that came through a tenant's
    socket unpinned with a sequence number beside it: the tenant (its lease is taken back by
    that tenant after a restart) and the number (tickets after a restart go on from it) must
    both be read back."""
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    one = entry(1)
    one.tenant = "lab-a"
    j.add(one, seq=9)
    again = Journal(str(tmp_path), boot="boot-a")
    live = again.load()
    assert live[one.lease_id].tenant == "lab-a"
    assert again.seq == 9


def test_a_restart_on_a_full_disk_says_which_log_it_appends_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Mutation run of 2026-12-07 found the warning of a restart that cannot compact unpinned:
    the admin reading the broker's log is told which file is kept as it is."""
    log_path = tmp_path / "journal.log"
    log_path.write_bytes(b'{"seq":4}\n{"boot":"boot-a"}\n' + entry(1).encoded())
    with caplog.at_level("WARNING"), file_size_limit(20):
        Journal(str(tmp_path), boot="boot-a").load()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"journal {log_path} not compacted at start"]


def test_a_socket_is_found_in_the_brokers_own_namespace_and_a_closed_one_nowhere() -> None:
    """Mutation run of 2026-12-07 found ``peers.find_socket`` unpinned in this process (only the
    multi-user tests asked it, across namespaces): a live socket of this namespace is found
    here; a closed one is in no namespace, the holders' own (the same as ours) asked once."""
    ours, theirs = socket.socketpair()
    try:
        ino = os.fstat(theirs.fileno()).st_ino
        assert peers.find_socket(ino) == peers.OWN_NS
        assert peers.find_socket(ino, [os.getpid()]) == peers.OWN_NS
    finally:
        ours.close()
        theirs.close()
    assert peers.find_socket(ino, [os.getpid(), os.getpid()]) is None


_CONNECT_FROM_OWN_NETNS = """
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
print(os.fstat(s.fileno()).st_ino, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace")
def test_the_peer_of_a_client_in_another_network_namespace_is_found_there(
    tmp_path: Path,
) -> None:
    """A client in its own network namespace (``unshare --net``, as a container) connects
    through the socket's path: ``peers.peer_inode`` of the accepted connection names the
    client's socket, asked in the client's namespace, and asked again (its ``sock_diag``
    socket kept) gives the same. Mutation run of 2026-12-07 (seed 71) found the other
    namespace's question unreached by the fast tests."""
    import shutil

    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed"
    path = str(tmp_path / "b.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        child = subprocess.Popen([unshare, "--net", sys.executable, "-c",
                                  _CONNECT_FROM_OWN_NETNS, path],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            theirs = int(child.stdout.readline())
            assert os.stat(f"/proc/{child.pid}/ns/net").st_ino != os.stat(
                "/proc/self/ns/net").st_ino
            conn, _ = listener.accept()
            with conn:
                assert peers.peer_inode(conn) == theirs
                assert peers.peer_inode(conn) == theirs
        finally:
            child.kill()
            child.wait(10)
