"""Herd safety and restarts through the broker, with real picker processes and a real broker.

Each picker is its own Python process (``tests/leasehelpers.py --broker SOCKET``) released by
one start gate, as in tests/processes/test_herd.py; the broker is ``autogpu broker`` as a real
process.
"""

from __future__ import annotations

import collections
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokerhelpers import BrokerProc
from tests.leasehelpers import FleetEnv, Gate, Picker, finish_all, fleet, start_pickers, uuid_of


@pytest.fixture
def fleet_source(tmp_path: Path) -> FleetEnv:
    return FleetEnv(tmp_path)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProc]:
    root = tmp_path / "broker"
    (root / "run").mkdir(parents=True)
    # Four waiters of one user in one test: more places in line than the default two.
    proc = BrokerProc(root, env={"AUTOGPU_MAX_TICKETS_PER_USER": "4"})
    try:
        yield proc
    finally:
        proc.stop()


def _herd(n: int, args: list[str], env: dict[str, str], sock: Path,
          tmp_path: Path) -> tuple[list[Picker], list[dict[str, object]]]:
    gate = Gate(tmp_path / "gate")
    pickers = start_pickers(
        n, ["--broker", str(sock), "--gate", str(gate.path), "--hold", *args], env
    )
    gate.open()
    results = [p.result() for p in pickers]
    gate.close()
    return pickers, results


def test_32_simultaneous_pickers_on_4_gpus_get_8_each_through_the_broker(
    fleet_source: FleetEnv, broker: BrokerProc, tmp_path: Path
) -> None:
    fleet_source.write(fleet(4))
    pickers, results = _herd(32, [], fleet_source.env, broker.socket, tmp_path)
    try:
        assert [r["event"] for r in results] == ["picked"] * 32, results
        counts = collections.Counter(r["uuid"] for r in results)
        assert counts == {uuid_of(i): 8 for i in range(4)}
        assert all(r["lease_note"] is None for r in results)
        st = broker.status()
        assert len(st["leases"]) == 32
        assert {r["lease_id"] for r in st["leases"]} == {r["lease_id"] for r in results}
    finally:
        finish_all(pickers)
    broker.wait_for(lambda s: s["leases"] == [], timeout=5)


def test_8_exclusive_pickers_on_4_gpus_get_4_distinct_gpus_and_4_are_refused(
    fleet_source: FleetEnv, broker: BrokerProc, tmp_path: Path
) -> None:
    fleet_source.write(fleet(4))
    pickers, results = _herd(8, ["--exclusive"], fleet_source.env, broker.socket, tmp_path)
    try:
        picked = [r["uuid"] for r in results if r["event"] == "picked"]
        assert sorted(picked) == [uuid_of(i) for i in range(4)]
        errors = [r for r in results if r["event"] == "error"]
        assert len(errors) == 4 and all(e["type"] == "NoDeviceFitsError" for e in errors)
    finally:
        finish_all(pickers)


@pytest.mark.parametrize(
    ("how", "down_s"),
    [(signal.SIGKILL, 0.0), (signal.SIGTERM, 0.0), (signal.SIGKILL, 6.0)],
    ids=["crash", "stop", "crash-down-6s"],
)
def test_a_broker_restart_amid_16_leases_and_4_waiters_loses_and_doubles_nothing(
    fleet_source: FleetEnv, broker: BrokerProc, tmp_path: Path, how: signal.Signals,
    down_s: float,
) -> None:
    fleet_source.write(fleet(4))
    holders, results = _herd(16, [], fleet_source.env, broker.socket, tmp_path)
    waiters: list[Picker] = []
    try:
        assert collections.Counter(r["uuid"] for r in results) == {
            uuid_of(i): 4 for i in range(4)
        }
        waiters = start_pickers(
            4, ["--broker", str(broker.socket), "--exclusive", "--wait", "60", "--poll", "0.2",
                "--hold"], fleet_source.env,
        )
        for w in waiters:
            w.expect("waiting")
        before = broker.wait_for(lambda s: len(s["tickets"]) == 4)
        lease_ids = {r["lease_id"] for r in before["leases"]}
        ticket_ids = {r["lease_id"] for r in before["tickets"]}
        assert len(lease_ids) == 16

        # A crash (no clean shutdown, only the journal) or systemd's stop for an upgrade (the
        # connections it closes on the way out must not erase the journal); a broker down for
        # longer than a client tries to connect (5 s; a slow start on a loaded host): the
        # waiters keep their places (and their tickets' sockets) until their waits end.
        broker.kill(how)
        time.sleep(down_s)
        broker.start()

        after = broker.wait_for(lambda s: "orphans" in s)
        assert {r["lease_id"] for r in after["leases"]} == lease_ids  # none lost
        assert {r["lease_id"] for r in after["tickets"]} == ticket_ids  # the line kept
        assert after["orphans"] == 20
        # Nothing was handed out twice: no waiter got an exclusive device while leases hold.
        assert all(w.proc.poll() is None and len(w.events) == 2 for w in waiters)

        finish_all(holders)  # each releases its orphaned lease by id
        holders = []
        served = [w.result() for w in waiters]
        assert [s["event"] for s in served] == ["picked"] * 4, served
        assert sorted(s["uuid"] for s in served) == [uuid_of(i) for i in range(4)]
        st = broker.status()
        assert len(st["leases"]) == 4 and st["tickets"] == []
        assert all(r["exclusive"] for r in st["leases"])
    finally:
        finish_all([*holders, *waiters])
    broker.wait_for(lambda s: s["leases"] == [] and s["orphans"] == 0, timeout=5)


def test_socket_activation_the_broker_serves_the_inherited_socket(
    fleet_source: FleetEnv, tmp_path: Path
) -> None:
    """As systemd does: the socket is bound by the parent and passed as fd 3 with LISTEN_FDS
    and LISTEN_PID; the broker binds nothing of its own (its --socket path stays absent)."""
    import os
    import socket
    import subprocess
    import sys

    from autogpu_jupyter.core.leasing.brokerclient import BrokerStore
    from tests.brokerhelpers import REPO

    fleet_source.write(fleet(2))
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()

    def as_fd_3() -> None:
        os.dup2(fd, 3)
        os.set_inheritable(3, True)

    env = {**os.environ, "PYTHONPATH": str(REPO), "LISTEN_FDS": "1"}
    proc = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ exec "$0" "$@"', sys.executable, "-m", "autogpu_jupyter.cli",
         "broker", "--socket", str(tmp_path / "unused.sock"), "--state-dir", ""],
        env=env, preexec_fn=as_fd_3, pass_fds=tuple({fd, 3}), stderr=subprocess.PIPE,
    )
    try:
        listener.close()
        reg = BrokerStore(str(path), connect_timeout_s=10)
        with reg.locked() as txn:
            lease = txn.create(devices=[uuid_of(0)])
        assert [r.lease_id for r in reg.list_leases()] == [lease.record.lease_id]
        lease.release()
        assert reg.list_leases() == []
        assert not (tmp_path / "unused.sock").exists()
    finally:
        proc.terminate()
        proc.wait(10)
