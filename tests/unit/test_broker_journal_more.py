"""More of the broker's journal (autogpu_jupyter.brokerd.journal), in-process: the boot id's
reading; a journal changed before any load, closed and reopened, or handed a log that is not its
own; compaction's temporary file; lines the kernel writes in pieces; the exact warnings for the
lines and first-journal entries it skips; holder lists (missing, too long); the recorded holders
and the /proc scan going on past a process or descriptor that fails; and the sock_diag answer's
attributes walked by their (unsigned, padded) lengths.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import peers
from autogpu_jupyter.brokerd.journal import Entry, Journal
from tests.unit.test_broker_journal import entry, lines


def fds_on(path: Path) -> list[int]:
    """This process's descriptors open on ``path``, as /proc shows them to any reader."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                found.append(int(name))
        except OSError:  # the descriptor of the listing itself, gone already
            continue
    return found


#: A character Python's repr writes as ten (``\U000e0001``): 20 of them make an error message
#: of more than 200 characters out of ``_int``'s 20-character excerpt.
TAG = "\U000e0001"
LONG_INT_ERROR = "expected an integer, got '" + "\\U000e0001" * 20 + "'"


def test_a_boot_id_is_read_as_ascii_and_as_its_first_128_characters(tmp_path: Path) -> None:
    """The kernel's boot id is an ASCII UUID: a file of other text names no boot (no log is
    dropped for it), and no more than 128 characters are read. Caught: the file decoded by the
    locale (or without saying), so non-ASCII text was taken for a boot id; the whole file read,
    or 129 characters."""
    (tmp_path / "long").write_text("a" * 128 + "b" * 72 + "\n")
    assert jrnl.boot_id(str(tmp_path / "long")) == "a" * 128
    (tmp_path / "accented").write_bytes("b\u00f6\u00f6t-id\n".encode())
    assert jrnl.boot_id(str(tmp_path / "accented")) is None


def test_a_journal_changed_before_any_load_starts_from_nothing_and_makes_its_log_private(
    tmp_path: Path,
) -> None:
    """The first change of a journal never loaded opens (creates) the log itself: mode 0600
    whatever the umask, its live size and byte count starting from 0. Caught: the log created
    without a mode (0777 less the umask) or 0601; the live size starting at 1 or ``None``, the
    sizes table ``None``, the byte count taken as ``None`` at open."""
    old = os.umask(0)
    try:
        j = Journal(str(tmp_path), boot="boot-a")
        first = entry(1)
        j.add(first)
    finally:
        os.umask(old)
    path = tmp_path / "journal.log"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert (j.live_bytes, j.size_bytes) == (len(first.encoded()), len(first.encoded()))
    j.add(entry(2))
    j.remove(first.lease_id)
    assert j.live_bytes == len(entry(2).encoded())
    assert j.size_bytes == path.stat().st_size
    j.close()
    assert Journal(str(tmp_path)).load() == {entry(2).lease_id: entry(2)}


def test_a_closed_journal_opens_its_log_again_at_the_next_change(tmp_path: Path) -> None:
    """``close`` leaves the journal usable: the next change opens the log again and is written
    there. Caught: the descriptor left as ``None`` (the next change raised) or as 1 (the line
    written to standard output, not the log)."""
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1))
    j.close()
    j.add(entry(2))
    path = tmp_path / "journal.log"
    assert [d.get("add") for d in lines(path)] == [None, None, entry(1).lease_id,
                                                    entry(2).lease_id]
    assert j.size_bytes == path.stat().st_size
    j.close()


def test_closing_a_journal_whose_descriptor_is_already_gone_is_quiet(tmp_path: Path) -> None:
    """A descriptor closed already (EBADF) is not an error at close, and the journal still
    opens its log again at the next change. Caught: the OSError no longer suppressed."""
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    (fd,) = fds_on(tmp_path / "journal.log")
    os.close(fd)
    j.close()
    j.add(entry(1))
    assert lines(tmp_path / "journal.log")[-1] == entry(1).line()
    j.close()


def test_a_log_owned_by_another_user_is_refused_by_its_path_and_not_kept_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regular file that is not the broker's (another owner) is not appended to: the error
    names the path, the descriptor is closed, the file untouched. Caught: the check made
    "neither a file nor ours" (a regular file of another user accepted), the error's words
    lost."""
    path = tmp_path / "journal.log"
    path.write_text("")
    real = os.geteuid()
    monkeypatch.setattr(jrnl.os, "geteuid", lambda: real + 1)
    open_fds = sorted(os.listdir("/proc/self/fd"))
    j = Journal(str(tmp_path), boot="boot-a")
    with pytest.raises(OSError) as err:
        j.add(entry(1))
    assert str(err.value) == f"{path} is not a file of ours"
    assert (fds_on(path), sorted(os.listdir("/proc/self/fd"))) == ([], open_fds)
    assert path.read_text() == ""


def test_a_compaction_overwrites_a_temporary_file_left_by_a_crash(tmp_path: Path) -> None:
    """A broker killed mid-compaction leaves ``journal.log.tmp``: the next compaction writes
    that file from its start (truncated), renames it over the log, and leaves nothing else
    behind. Caught: the temporary file named otherwise (the leftover stayed), or opened
    without O_TRUNC (the leftover's tail after the new log)."""
    (tmp_path / "journal.log.tmp").write_bytes(b"x" * 5000)
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    assert sorted(os.listdir(tmp_path)) == ["journal.log"]
    assert lines(tmp_path / "journal.log") == [{"seq": 0}, {"boot": "boot-a"}]
    j.close()


def test_a_compaction_does_not_follow_a_link_at_its_temporary_file(tmp_path: Path) -> None:
    """The temporary file is opened with O_NOFOLLOW: a link there is refused (ELOOP), its
    target not written. Caught: O_NOFOLLOW lost from the flags (``&`` for ``|``)."""
    target = tmp_path / "elsewhere"
    target.write_text("")
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    j.add(entry(1))
    (tmp_path / "journal.log.tmp").symlink_to(target)
    with pytest.raises(OSError) as err:
        j.compact()
    assert err.value.errno == errno.ELOOP
    assert target.read_text() == ""
    j.close()


def test_a_line_the_kernel_takes_in_pieces_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.write`` may take less than it is given: the rest is written after it, for a change
    and for a compaction alike. Caught: the loop stopping after the first write."""
    j = Journal(str(tmp_path), boot="boot-a")
    j.load()
    real_write = os.write
    with monkeypatch.context() as m:
        m.setattr(jrnl.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
        j.add(entry(1))
        j.compact()
        j.add(entry(2))
    assert lines(tmp_path / "journal.log") == [
        {"seq": 0}, {"boot": "boot-a"}, entry(1).line(), entry(2).line()]
    j.close()


def test_syncing_a_directory_refuses_a_path_that_is_not_one(tmp_path: Path) -> None:
    """The directory's entry is synced through a descriptor opened with O_DIRECTORY: a file
    there is refused. Caught: O_DIRECTORY lost (``&`` for ``|``: the file opened and synced)."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        jrnl._fsync_dir(str(tmp_path / "f"))
    jrnl._fsync_dir(str(tmp_path))


def test_a_line_of_exactly_the_longest_length_is_read(tmp_path: Path) -> None:
    """A line of :data:`MAX_LINE_BYTES` (its newline included) is the longest kept; one byte
    more is skipped. Caught: ``>=`` for ``>`` (a line at the bound dropped)."""
    def sized(n: int, total: int) -> Entry:
        bare = Entry(f"{n:032x}", 1, "", None, [])
        return Entry(bare.lease_id, 1, "x" * (total - len(bare.encoded())), None, [])

    at, past = sized(1, jrnl.MAX_LINE_BYTES), sized(2, jrnl.MAX_LINE_BYTES + 1)
    assert (len(at.encoded()), len(past.encoded())) == (jrnl.MAX_LINE_BYTES,
                                                       jrnl.MAX_LINE_BYTES + 1)
    (tmp_path / "journal.log").write_bytes(at.encoded() + past.encoded())
    j = Journal(str(tmp_path), boot="boot-a")
    assert j.load() == {at.lease_id: at}
    j.close()


def test_each_skipped_line_is_warned_with_its_number_and_its_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A line that is not an object, of no known kind, with a uid that is not an integer or
    holders that are not a list, is skipped with a warning saying which line and why (the
    value in question cut to 20 characters, the whole reason to 200). The end of a lease the
    log does not know is no error. Caught: the reasons' words changed or lost, the value cut
    at 21, the reason at 201, the end of an unknown lease warned as a KeyError."""
    docs: list[Any] = [
        {"seq": 1},
        [1],
        {"what": 1},
        {"add": "a", "uid": "abcdefghijklmnopqrstuvwxyz", "record": "{}"},
        {"add": "b", "uid": 5, "record": "{}", "pids": 7},
        {"add": "c", "uid": TAG * 25, "record": "{}"},
        {"del": "nobody"},
    ]
    (tmp_path / "journal.log").write_text("".join(json.dumps(d) + "\n" for d in docs))
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        j = Journal(str(tmp_path), boot="boot-a")
        assert j.load() == {}
    assert [r.getMessage() for r in caplog.records] == [
        "journal line 2 skipped: not an object",
        "journal line 3 skipped: unknown line",
        "journal line 4 skipped: expected an integer, got 'abcdefghijklmnopqrst'",
        "journal line 5 skipped: pids: expected a list",
        "journal line 6 skipped: " + LONG_INT_ERROR[:200],
    ]
    assert len(LONG_INT_ERROR) > 201
    j.close()


def test_holder_lists_missing_are_empty_and_long_ones_keep_their_first_64(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease or a holders line without ``pids`` means no holders (not an error); a list of
    more than 64 keeps its first 64. Caught: the missing list's default dropped (the line
    skipped: a lease lost, or its old holders kept), the cut made at 65."""
    rec = entry(1).record
    many = [[n, 10 * n] for n in range(1, 71)]
    docs: list[Any] = [
        {"add": "a", "uid": 1001, "record": rec, "peer": 5},
        {"add": "b", "uid": 1002, "record": rec, "peer": None, "pids": [[1, 2]]},
        {"holders": "b"},
        {"add": "c", "uid": 1003, "record": rec, "peer": None, "pids": many},
    ]
    (tmp_path / "journal.log").write_text("".join(json.dumps(d) + "\n" for d in docs))
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        j = Journal(str(tmp_path), boot="boot-a")
        live = j.load()
    assert live == {
        "a": Entry("a", 1001, rec, 5, []),
        "b": Entry("b", 1002, rec, None, []),
        "c": Entry("c", 1003, rec, None, [(n, 10 * n) for n in range(1, 65)]),
    }
    assert caplog.records == []
    j.close()


def test_the_first_brokers_journal_is_warned_about_exactly_when_unreadable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreadable ``journal.json`` is warned about with its path and the reason; an entry
    of it that cannot be read, with the reason cut to 200 characters. Caught: the path, the
    reason or the words of either warning lost or changed, the cut made at 201."""
    legacy = tmp_path / "journal.json"
    legacy.write_text("{broken")
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        assert Journal(str(tmp_path), boot="boot-a").load() == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"journal {legacy} unreadable (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)): starting empty"
    ]
    caplog.clear()
    (tmp_path / "journal.log").unlink()
    legacy.write_text(json.dumps({"seq": 3, "entries": [
        {"uid": 1, "pids": []},
        {"uid": TAG * 25, "record": entry(1).record, "pids": []},
        {"uid": 1004, "record": entry(4).record, "pids": [[104, 5004]]},
    ]}))
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        assert list(Journal(str(tmp_path), boot="boot-a").load()) == [entry(4).lease_id]
    assert [r.getMessage() for r in caplog.records] == [
        "journal entry skipped: 'record'",
        "journal entry skipped: " + LONG_INT_ERROR[:200],
    ]


def test_the_first_brokers_journal_is_read_as_json_bytes_byte_order_mark_and_all(
    tmp_path: Path,
) -> None:
    """``journal.json`` is read as bytes and handed to ``json.loads``, which finds the text's
    encoding itself (a UTF-8 byte-order mark included), whatever the locale. Caught: the file
    opened as text (the mark made it unreadable: its leases lost)."""
    doc = {"seq": 2, "entries": [{"uid": 1004, "record": entry(4).record, "pids": []}]}
    (tmp_path / "journal.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(doc).encode())
    j = Journal(str(tmp_path), boot="boot-a")
    assert (list(j.load()), j.seq) == ([entry(4).lease_id], 2)
    j.close()


def test_a_recorded_holder_of_another_start_time_is_passed_over_not_the_end_of_the_list() -> None:
    """A recorded pid whose start time differs (a reused pid) is nobody, and the holders
    recorded after it are still checked. Caught: the check stopping at the first stale pid
    (``break`` for ``continue``: the live holders after it lost)."""
    me = os.getpid()
    start = jrnl.start_time(me)
    assert start is not None
    assert peers.holders_alive([(me, start + 1), (me, start)], None, 0) == [(me, start)]


def test_the_socket_scan_goes_on_past_a_process_or_descriptor_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process whose descriptors cannot be listed (gone, or not ours to see), or one
    descriptor that cannot be read (closed meanwhile), is passed over: the descriptors and
    processes after it are still looked at. Caught: the scan stopping there (``break`` for
    ``continue``, at either place)."""
    real_listdir, real_readlink = os.listdir, os.readlink

    def listdir(path: Any = ".") -> list[str]:
        if path == "/proc":
            return ["101", "102"]
        if path == "/proc/101/fd":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        if path == "/proc/102/fd":
            return ["0", "5"]
        return real_listdir(path)

    def readlink(path: Any, *a: Any, **k: Any) -> str:
        if str(path) == "/proc/102/fd/0":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if str(path) == "/proc/102/fd/5":
            return "socket:[777]"
        return real_readlink(path, *a, **k)

    monkeypatch.setattr(jrnl.os, "listdir", listdir)
    monkeypatch.setattr(jrnl.os, "readlink", readlink)
    monkeypatch.setattr(peers, "start_time", lambda pid: 5555)
    assert peers.scan_socket_holders([777]) == {777: [(102, 5555)]}


def _answer(attrs: bytes, length: int | None = None) -> bytes:
    """A sock_diag answer: nlmsghdr (its length ``length``, default the whole), a zeroed
    unix_diag_msg, then ``attrs``."""
    body = b"\0" * 16 + attrs
    return struct.pack("=IHHII", 16 + len(body) if length is None else length, 20, 0, 0,
                       0) + body


def _attr(kind: int, payload: bytes, alen: int | None = None) -> bytes:
    """One netlink attribute: its header (length ``alen``, default the true one), its payload,
    padded to 4 bytes."""
    n = 4 + len(payload) if alen is None else alen
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-len(payload) % 4)


def test_a_sock_diag_answer_without_attributes_names_no_peer() -> None:
    """An answer that ends with its unix_diag_msg (no attribute at all) names no peer, and is
    no error (an error would mark sock_diag broken for good). Caught: the loop's bound
    ``off - 4 <= end`` (a header read past the answer: struct.error)."""
    assert peers._parse_peer(_answer(b"")) is None


def test_the_peer_is_found_after_other_attributes_by_their_padded_lengths() -> None:
    """The attributes before the peer are stepped over by their lengths rounded up to 4: an
    RQLEN (12), a name of 2 bytes (6, padded to 8), an empty ICONS (4); the peer's inode is
    unsigned. Caught: an attribute of length 4 taken for the end (``<= 4``, ``< 5``); the step
    ``=`` or ``-=`` for ``+=``, rounded with ``| ~3``, ``& 3``, ``& ~4``, from ``alen - 3`` or
    ``alen + 4``; the inode read signed (2**32 - 1 became -1)."""
    attrs = (_attr(4, struct.pack("=II", 0, 0)) + _attr(0, b"/s") + _attr(3, b"")
             + _attr(2, struct.pack("=I", 0xFFFFFFFF)))
    assert peers._parse_peer(_answer(attrs)) == 0xFFFFFFFF


def test_an_attributes_length_is_unsigned() -> None:
    """An attribute's 16-bit length is unsigned: a peer attribute whose length has its top bit
    set still names the peer its four bytes hold (the payload is there). Caught: the length
    read signed (negative, so taken for the end of the attributes)."""
    attrs = _attr(2, struct.pack("=I", 4242), alen=0x8008)
    assert peers._parse_peer(_answer(attrs)) == 4242
