"""The broker on a state filesystem that fills up (issue 39, break 5): a real ``autogpu broker``
process whose state directory is a real, small tmpfs (mounted here: the tests run as root; CI
runs as root), filled by a file until the kernel answers ``ENOSPC``.

What a user observes: a lease the broker cannot write to its journal is refused at once with one
line naming the cause (not a client left hanging on an open socket), a plain pick through the
broker fails closed with that line (no pick without the lease it asked for), grants resume when
there is room again, and a ``kill -9`` and restart takes back every lease still held (the torn
piece of the failed write does not swallow the next line): an exclusive lease's device is not
given to another user. A broker killed while the disk is still full starts again and takes its
leases back too; a re-pick refused for want of room keeps the lease it would have replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.brokerhelpers import BrokerProc, RawConn, broker_area
from tests.leasehelpers import as_user, uuid_of

REPO = Path(__file__).resolve().parents[2]
#: Well short of the clients' own 30 s timeout: a reply later than this is a hang.
REPLY_TIMEOUT_S = 25.0
NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def area() -> Iterator[Path]:
    with broker_area() as root:
        yield root


@pytest.fixture
def small_state(area: Path) -> Iterator[Path]:
    """The broker's state directory as a 256 KiB tmpfs of its own, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    state = area / "state"
    state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700",
                    "autogpu-test-state", str(state)], check=True, capture_output=True)
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False, capture_output=True)


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem has no room (``ENOSPC``)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                return filler
    finally:
        os.close(fd)


TICKET = {"op": "ticket", "exclusive": False, "constraints": {
    "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
    "exclude": [], "exclusive": False, "allowed_uuids": [uuid_of(2)]}}


def lease(conn: RawConn, device: str, exclusive: bool = False) -> Any:
    """A lease whose journal line is no longer than the plain pick's below (the same kind of
    holder, and no booking where the pick books 1 GiB): one refused means the pick's is too."""
    return conn.call({"op": "lease", "devices": [device], "exclusive": exclusive,
                      "holder": {"kind": "cli"}})


def _lease_as_other(path: str, device: str) -> Any:
    with RawConn(path) as c:
        return lease(c, device)


def test_a_full_state_disk_refuses_grants_in_one_line_and_a_restart_loses_no_lease(
    area: Path, small_state: Path,
) -> None:
    broker = BrokerProc(area, env={"AUTOGPU_SIMULATE": str(area / "fleet.json")})
    held: list[RawConn] = []
    try:
        mine = RawConn(broker.socket, timeout=REPLY_TIMEOUT_S)
        held.append(mine)
        mine_id = lease(mine, uuid_of(3))["record"]["lease_id"]
        filler = fill(small_state)
        # The journal's last page may still have room for a line or two: lease until the disk
        # is really full for the next line (a few at most).
        granted, refused = [mine_id], None
        for _ in range(20):
            c = RawConn(broker.socket, timeout=REPLY_TIMEOUT_S)
            held.append(c)
            reply = lease(c, uuid_of(1))  # a hang fails here, with the client's timeout
            if not reply["ok"]:
                refused = (c, reply)
                break
            granted.append(reply["record"]["lease_id"])
        assert refused is not None, "the broker granted 20 leases on a full disk"
        conn, reply = refused
        assert reply["type"] == "RegistryUntrustedError", reply
        assert reply["error"] == (
            f"cannot record the lease: no space left on device in {small_state} (the broker's "
            "state directory); the lease was not granted"), reply
        assert [r["lease_id"] for r in broker.status()["leases"]] == granted  # none half-made
        with RawConn(broker.socket, timeout=REPLY_TIMEOUT_S) as waiter:  # a place in line too
            reply = waiter.call(TICKET)
        assert reply["error"] == (
            f"cannot record the ticket: no space left on device in {small_state} (the broker's "
            "state directory); the ticket was not granted"), reply

        # A plain pick through the broker asked for a lease and was refused: it fails closed,
        # in one line, and sets nothing up (no pick "without a lease").
        env = {**os.environ, "AUTOGPU_SIMULATE": str(area / "fleet.json"),
               "AUTOGPU_BROKER_SOCKET": str(broker.socket), "PYTHONPATH": str(REPO)}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        pick = subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "run", "--min-free", "1G", "--",
             "sh", "-c", "echo ran with $CUDA_VISIBLE_DEVICES"],
            env=env, capture_output=True, text=True, timeout=REPLY_TIMEOUT_S,
        )
        assert pick.returncode == 3, (pick.stdout, pick.stderr)
        assert "ran with" not in pick.stdout
        assert "Traceback" not in pick.stderr
        assert pick.stderr.strip().count("\n") == 0, pick.stderr
        assert (f"cannot record the lease: no space left on device in {small_state}"
                in pick.stderr), pick.stderr
        assert "without a lease" not in pick.stderr

        # kill -9 while the disk is still full: the broker starts again (it cannot compact its
        # journal, it appends to it as it is) and takes back every lease held; still refuses.
        broker.restart()
        assert sorted(r["lease_id"] for r in broker.status()["leases"]) == sorted(granted)
        conn = RawConn(broker.socket, timeout=REPLY_TIMEOUT_S)
        held.append(conn)
        assert lease(conn, uuid_of(1))["type"] == "RegistryUntrustedError"
        # A re-pick refused so keeps the lease it would have replaced.
        with RawConn(broker.socket, timeout=REPLY_TIMEOUT_S) as repick:
            reply = repick.call({"op": "lease", "devices": [uuid_of(2)], "ignore_ids": [mine_id],
                                 "holder": {"kind": "cli"}})
        assert reply["type"] == "RegistryUntrustedError", reply
        assert sorted(r["lease_id"] for r in broker.status()["leases"]) == sorted(granted)

        # Room again: the same connection is granted, and an exclusive lease too.
        filler.unlink()
        again = lease(conn, uuid_of(1))
        assert again["ok"], again
        granted.append(again["record"]["lease_id"])
        excl = RawConn(broker.socket, timeout=REPLY_TIMEOUT_S)
        held.append(excl)
        reply = lease(excl, uuid_of(0), exclusive=True)
        assert reply["ok"], reply
        granted.append(reply["record"]["lease_id"])

        # kill -9 and restart: every lease still held is taken back, the exclusive one kept.
        broker.restart()
        st = broker.status()
        assert sorted(r["lease_id"] for r in st["leases"]) == sorted(granted), st["leases"]
        other = as_user(NOBODY.pw_uid, NOBODY.pw_gid, _lease_as_other, str(broker.socket),
                        uuid_of(0))
        assert other["ok"] is False, other
        assert other["error"].startswith(f"no device free: {uuid_of(0)} is held exclusively by "
                                         "root"), other
    finally:
        for c in held:
            with contextlib.suppress(OSError):
                c.close()
        broker.stop()
