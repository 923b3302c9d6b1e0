"""A broker restart takes back the leases of holders in any namespace (issue 39, break 1), and an
orphan ends as soon as its holder does (break 6), with the broker a real root process.

A holder here is a real process started under ``unshare`` (util-linux): its own network
namespace (``-rn``: what a container, or one user's ``unshare -rn python3 ...``, does), its own
pid namespace too, or only its own user namespace. It connects, takes an exclusive lease, hands
the socket to a child and exits (as ``autogpu run``'s wrapper does when SIGKILLed): after that
only the socket names the holder. A second, ordinary holder connects after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.brokerhelpers import BrokerProc, RawConn, broker_area, wire
from tests.leasehelpers import uuid_of

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare's namespaces"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
]

#: A holder: a child connects and leases, hands the socket to a grandchild and exits; the
#: first process stays (it is pid 1 of a pid namespace) but holds nothing.
HOLDER = r"""
import json, os, socket, sys, time
path, line = sys.argv[1], sys.argv[2].encode()
child = os.fork()
if child == 0:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    f = s.makefile("rb")
    s.sendall(line)
    reply = f.readline()
    if os.fork() == 0:
        os.write(1, reply)
        time.sleep(600)
    os._exit(0)
os.waitpid(child, 0)
time.sleep(600)
"""


@pytest.fixture
def area() -> Iterator[Path]:
    with broker_area() as root:
        yield root


def _holder(broker: BrokerProc, device: int, *unshare: str) -> subprocess.Popen[bytes]:
    line = wire({"op": "lease", "devices": [uuid_of(device)], "exclusive": True})
    cmd = [sys.executable, "-c", HOLDER, str(broker.socket), line.decode()]
    if unshare:
        cmd = ["unshare", *unshare, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    reply = json.loads(proc.stdout.readline())
    assert reply["ok"] is True, reply
    return proc


def _lease(broker: BrokerProc, device: int) -> Any:
    with RawConn(broker.socket) as c:
        return c.call({"op": "lease", "devices": [uuid_of(device)], "exclusive": True})


@pytest.mark.parametrize("unshare", [
    pytest.param(("-r", "-n"), id="user+net"),
    pytest.param(("-r", "-n", "-p", "-f"), id="user+net+pid"),
    pytest.param(("-r",), id="user"),
])
def test_a_restart_takes_back_the_leases_of_holders_in_other_namespaces(
    area: Path, unshare: tuple[str, ...],
) -> None:
    """Caught: one holder in its own network namespace switched the broker's peer lookup off
    for the rest of its life, and the restarted broker took back none of the two leases
    ("0 lease(s) taken back"), so their GPUs went to the next exclusive lease."""
    broker = BrokerProc(area, env={"AUTOGPU_SIMULATE": str(area / "fleet.json")})
    holders: list[subprocess.Popen[bytes]] = []
    try:
        holders.append(_holder(broker, 0, *unshare))
        holders.append(_holder(broker, 1))
        broker.restart()
        st = broker.status()
        assert sorted(r["device_uuids"][0] for r in st["leases"]) == [uuid_of(0), uuid_of(1)]
        assert st["orphans"] == 2
        assert "2 lease(s)/ticket(s) taken back" in broker.log.read_text()
        for device in (0, 1):
            got = _lease(broker, device)
            assert got["ok"] is False and "exclusive" in got["error"], got
        # The namespaced holder ends: its orphan ends with it, and its GPU is free again.
        os.killpg(holders[0].pid, signal.SIGKILL)
        holders[0].wait(10)
        broker.wait_for(lambda s: len(s["leases"]) == 1, timeout=10)
        assert _lease(broker, 0)["ok"] is True
        assert _lease(broker, 1)["ok"] is False
    finally:
        for h in holders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
            h.wait(10)
        broker.stop()
