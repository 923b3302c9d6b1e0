"""The lease store contract: the same cases, the same answers, from every holder of lease state.

Every test runs three times: against the shared directory
(``core.leasing.directory.DirectoryStore``), against the client of a real ``autogpu broker``
process (``core.leasing.brokerclient``), and
against the broker's lease book in memory behind the same transaction interface
(``brokerd.bookstore.BookStore``: the broker's own ops, no socket), all configured with the same
rules (2 devices, 3 leases and 2 tickets per user). What the broker's own
view of its state decides (its one-message ``pick``) is checked against the same waiting line.
The words of each refusal are the one admission module's; only the broker's client adds
"lease broker: " and the broker " (enforced by the broker)".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig
from autogpu_jupyter.brokerd.bookstore import BookLease, BookStore
from autogpu_jupyter.core import decision
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import (
    BrokerStore,
    DirectoryStore,
    HeldLease,
    LeaseStore,
    Requester,
)
from autogpu_jupyter.core.leasing.admission import ticket_text
from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import LeaseLimitError, NoDeviceFitsError
from tests.brokerhelpers import REPO, BrokerProc
from tests.leasehelpers import fleet, uuid_of

RULES = {"AUTOGPU_MAX_LEASES_PER_USER": "3", "AUTOGPU_MAX_TICKETS_PER_USER": "2"}
G = [uuid_of(i) for i in range(4)]


class Contract:
    """One store under test, and how its refusals are worded."""

    def __init__(self, kind: str, store: LeaseStore, fleet_file: Path) -> None:
        self.kind = kind
        self.store = store
        self.fleet_file = fleet_file

    def said(self, text: str, quota: bool = False) -> str:
        """``text`` as this store's refusal says it."""
        if self.kind == "directory":
            return text
        if quota:
            text = text.replace(" set by the admin.", " set by the admin (enforced by the broker).")
        return text if self.kind == "book" else f"lease broker: {text}"

    def lease(self, *devices: str, exclusive: bool = False, **who: Any) -> HeldLease:
        with self.store.locked() as txn:
            assert txn is not None
            return txn.create(devices=list(devices), exclusive=exclusive,
                              requester=Requester(**who) if who else None)

    def ticket(self, count: int = 1, exclusive: bool = False, **over: Any) -> HeldLease:
        held = self.store.take_ticket(
            constraints=decision.ticket_constraints(
                Constraints(count=count, exclusive=exclusive), over.pop("allowed", None)
            ),
            exclusive=exclusive,
        )
        assert held is not None
        return held

    def live_ids(self) -> set[str]:
        return {r.lease_id for r in self.store.list_leases(include_tickets=True)}

    def wait_gone(self, lease_id: str) -> None:
        """Until ``lease_id`` is no longer live (the broker frees on EOF, asynchronously)."""
        deadline = time.monotonic() + 15
        while lease_id in self.live_ids():
            assert time.monotonic() < deadline, f"{lease_id} never ended"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def area(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contract")
    (root / "fleet.json").write_text(json.dumps(fleet(4)))
    return root


@pytest.fixture(scope="module")
def broker_proc(area: Path) -> Iterator[BrokerProc]:
    root = area / "broker"
    (root / "run").mkdir(parents=True)
    proc = BrokerProc(root, "--max-devices-per-user", "2", "--rules", "",
                      env={**RULES, "AUTOGPU_SIMULATE": str(area / "fleet.json")})
    yield proc
    proc.stop()


@pytest.fixture(params=["directory", "broker", "book"])
def contract(
    request: pytest.FixtureRequest, tmp_path: Path, area: Path
) -> Iterator[Contract]:
    if request.param == "directory":
        store: LeaseStore = DirectoryStore(tmp_path / "registry", max_devices_per_user=2,
                                     max_leases_per_user=3, max_tickets_per_user=2)
    elif request.param == "book":
        broker = Broker(BrokerConfig(socket_path=str(tmp_path / "none.sock"),
                                     max_devices_per_user=2, max_leases_per_user=3,
                                     max_tickets_per_user=2))
        broker.fleet.backend = SimulatedBackend(str(area / "fleet.json"))
        store = BookStore(broker)
    else:
        proc: BrokerProc = request.getfixturevalue("broker_proc")
        store = BrokerStore(str(proc.socket), connect_timeout_s=5.0)
    c = Contract(request.param, store, area / "fleet.json")
    before = c.live_ids()
    yield c
    assert c.live_ids() == before, "a test left a lease or ticket behind"


# ---- exclusivity and quotas -------------------------------------------------------------------


def test_an_exclusive_lease_keeps_every_other_lease_off(contract: Contract) -> None:
    me = contract.store.user
    with contract.lease(G[0], exclusive=True, notebook_path="own.ipynb"):
        with pytest.raises(NoDeviceFitsError) as err:
            contract.lease(G[0])
        assert str(err.value) == contract.said(
            f"no device free: {G[0]} is held exclusively by {me}: own.ipynb"
        )
    with contract.lease(G[0], notebook_path="a.ipynb"):
        with pytest.raises(NoDeviceFitsError) as err:
            contract.lease(G[0], exclusive=True)
        assert str(err.value) == contract.said(
            f"no device free: exclusive wanted but {G[0]} is held by {me}: a.ipynb"
        )
        with contract.lease(G[0]) as shared:
            assert shared.record.device_uuids == (G[0],)


def test_the_quota_counts_distinct_devices_and_leases(contract: Contract) -> None:
    me = contract.store.user
    with contract.lease(G[0]), contract.lease(G[0]), contract.lease(G[1]):
        with pytest.raises(LeaseLimitError) as err:
            contract.lease(G[2])
        assert str(err.value) == contract.said(
            f"{me} already holds leases on 2 device(s) ({G[0]}, {G[1]}); taking 1 more would "
            "exceed max_devices_per_user = 2 set by the admin. Release one first (%gpu release, "
            "or end the kernel / autogpu run holding it).",
            quota=True,
        )
        with pytest.raises(LeaseLimitError) as err:
            contract.lease(G[1])  # no new device, but a fourth lease
        assert str(err.value) == contract.said(
            f"{me} already holds 3 lease(s); another would exceed max_leases_per_user = 3 set "
            "by the admin. Release one first (%gpu release, or end the kernel / autogpu run "
            "holding it).",
            quota=True,
        )


# ---- tickets are admitted like leases ---------------------------------------------------------


def test_a_user_holds_at_most_two_tickets(contract: Contract) -> None:
    me = contract.store.user
    with contract.ticket(), contract.ticket():
        with pytest.raises(LeaseLimitError) as err:
            contract.ticket()
        assert str(err.value) == contract.said(
            f"{me} already waits in line with 2 ticket(s); another would exceed "
            "max_tickets_per_user = 2 set by the admin. Wait for one of them to be served, or "
            "cancel it (interrupt the waiting pick).",
            quota=True,
        )
    with contract.ticket():  # a place given back is a place to take again
        pass


def test_a_ticket_counts_the_devices_it_waits_for_against_the_quota(contract: Contract) -> None:
    me = contract.store.user
    with contract.lease(G[0]):
        with pytest.raises(LeaseLimitError) as err:
            contract.ticket(count=2)
        assert str(err.value) == contract.said(
            f"{me} holds leases on 1 device(s) and waits in line for 0 more; waiting for 2 more "
            "would exceed max_devices_per_user = 2 set by the admin. Release one first (%gpu "
            "release, or end the kernel / autogpu run holding it).",
            quota=True,
        )
        with contract.ticket(count=1):
            pass
    # A re-pick waits in line for the lease it replaces: that lease does not count.
    with contract.lease(G[0]) as old:
        view = contract.store.hiding(lease_ids=[old.record.lease_id])
        held = view.take_ticket(constraints=decision.ticket_constraints(Constraints(count=2), None))
        assert held is not None
        held.release()


def test_the_waiting_line_is_served_in_arrival_order(contract: Contract) -> None:
    with contract.ticket(exclusive=True) as first:
        with contract.store.locked() as txn:
            assert txn is not None
            second = txn.create_ticket(
                constraints=decision.ticket_constraints(Constraints(), [G[2]]),
                requester=Requester(kernel_id="k2"),
            )
        try:
            leases, line = contract.store.live_records()
            mine = [t for t in line if t.lease_id in (first.record.lease_id,
                                                      second.record.lease_id)]
            assert [t.lease_id for t in mine] == [first.record.lease_id, second.record.lease_id]
            assert second.record.seq == first.record.seq + 1  # type: ignore[operator]
            assert second.record.kernel_id == "k2"
            assert second.record.constraints["allowed_uuids"] == [G[2]]  # type: ignore[index]
            assert [r for r in leases if r.kind != "lease"] == []
        finally:
            second.release()


def test_a_device_a_waiting_ticket_takes_names_the_ticket(contract: Contract) -> None:
    """Decided by the one pipeline over the store: the waiter's device, in its words."""
    snap = SimulatedBackend(str(contract.fleet_file), clock=lambda: 0.0).snapshot()
    with contract.ticket(exclusive=True, allowed=[G[3]]) as waiting:
        made = decision.decide(decision.gather(snap, environ={}, store=contract.store),
                               Constraints())
        assert made.candidate(G[3]).reasons == (  # type: ignore[union-attr]
            f"reserved for {ticket_text(waiting.record)}",
        )
        assert G[3] not in [c.device.uuid for c in made.chosen]


def test_a_ticket_keeps_its_model_and_reserves_nothing_of_another(contract: Contract) -> None:
    """Issue 39: a waiter's ticket keeps ``models`` and ``prefer``, in both stores; a waiter for
    a model this host does not have holds back none of its GPUs. Seen failing: the ticket was
    stored without them and reserved a GPU as if any model would do."""
    snap = SimulatedBackend(str(contract.fleet_file), clock=lambda: 0.0).snapshot()
    wanted = Constraints(exclusive=True, models=("L4",), prefer=("L4", "T4"))
    held = contract.store.take_ticket(
        constraints=decision.ticket_constraints(wanted, None), exclusive=True
    )
    assert held is not None
    with held as waiting:
        (stored,) = [t for t in contract.store.live_records()[1]
                     if t.lease_id == waiting.record.lease_id]
        assert (stored.constraints or {}).get("models") == ["L4"]
        assert (stored.constraints or {}).get("prefer") == ["L4", "T4"]
        made = decision.decide(decision.gather(snap, environ={}, store=contract.store),
                               Constraints(count=4, exclusive=True))
        assert sorted(c.device.uuid for c in made.chosen) == G


# ---- hiding, release, set_pid, a holder's death -----------------------------------------------


def test_a_view_hides_only_the_callers_own_leases(contract: Contract) -> None:
    with contract.lease(G[0], exclusive=True, kernel_id="kern-a") as a:
        hidden = contract.store.hiding(lease_ids=[a.record.lease_id])
        assert a.record.lease_id not in {r.lease_id for r in hidden.list_leases()}
        assert a.record.lease_id not in {r.lease_id for r in hidden.live_records()[0]}
        assert a.record.lease_id in {r.lease_id for r in contract.store.list_leases()}
        by_kernel = contract.store.hiding(kernel_id="kern-a")
        with by_kernel.locked() as txn:
            assert txn is not None
            assert a.record.lease_id not in {r.lease_id for r in txn.live_leases()}
            again = txn.create(devices=[G[0]], exclusive=True)  # a re-pick of its own device
        again.release()


def test_release_ends_a_lease_at_once_and_twice_is_harmless(contract: Contract) -> None:
    lease = contract.lease(G[1])
    assert lease.held and lease.record.lease_id in contract.live_ids()
    lease.release()
    assert not lease.held and lease.record.lease_id not in contract.live_ids()
    lease.release()
    with pytest.raises(ValueError, match="was released"):
        lease.fileno()


def test_set_pid_names_the_process_that_uses_the_device(contract: Contract) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        with contract.lease(G[1]) as lease:
            lease.set_pid(child.pid)
            assert lease.record.pid == child.pid
            listed = {r.lease_id: r.pid for r in contract.store.list_leases()}
            assert listed[lease.record.lease_id] == child.pid
    finally:
        child.kill()
        child.wait()


_HOLD = """
import sys, time
from autogpu_jupyter.core.leasing import BrokerStore, DirectoryStore
store = BrokerStore(sys.argv[2]) if sys.argv[1] == "broker" else DirectoryStore(sys.argv[2])
with store.locked() as txn:
    lease = txn.create(devices=[sys.argv[3]])
print(lease.record.lease_id, flush=True)
time.sleep(120)
"""


def test_a_killed_holder_frees_its_lease_with_no_cleanup(contract: Contract) -> None:
    if isinstance(contract.store, BookStore):  # in memory: its holder hangs up
        held = contract.lease(G[2])
        assert isinstance(held, BookLease) and held.record.lease_id in contract.live_ids()
        contract.store.hang_up(held)
        contract.wait_gone(held.record.lease_id)
        with contract.lease(G[2], exclusive=True):
            pass
        return
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD, contract.kind, contract.store.path, G[2]],
        stdout=subprocess.PIPE, text=True, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        lease_id = child.stdout.readline().strip()
        assert lease_id in contract.live_ids()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    contract.wait_gone(lease_id)
    with contract.lease(G[2], exclusive=True):  # and nothing is left on its device
        pass


# ---- the broker's own view: its one-message pick ----------------------------------------------


def _raw_pick(path: str, options: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    msg = {"op": "pick", "options": options, "proto": PROTOCOL}
    sock.sendall(json.dumps(msg).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "the broker closed the connection"
        data += chunk
    return sock, json.loads(data)


def test_the_brokers_view_serves_the_same_line_and_admission(broker_proc: BrokerProc) -> None:
    path = str(broker_proc.socket)
    c = Contract("broker", BrokerStore(path, connect_timeout_s=5.0), Path())
    before = c.live_ids()
    held: list[socket.socket] = []
    # A ticket that a device could serve at once reserves nothing at the broker (it is dormant:
    # one ticket must not block every GPU); one that waits does. So the fleet is full first
    # (the broker's sweep reads it every second), the ticket waits for 10 GiB, then the fleet
    # is free again: the ticket reserves until it is taken or its grace (5 s) ends.
    fleet_file = broker_proc.root.parent / "fleet.json"
    free = fleet_file.read_text()
    fleet_file.write_text(json.dumps(fleet(4, used_bytes=80 * 1024**3)))
    time.sleep(1.5)
    wanted = Constraints(count=2, exclusive=True, min_free=parse_size("10G"))
    ticket = c.store.take_ticket(
        constraints=decision.ticket_constraints(wanted, None), exclusive=True
    )
    assert ticket is not None
    fleet_file.write_text(free)
    with ticket as waiting:
        sock, reply = _raw_pick(path, {"count": 3})
        held.append(sock)
        assert (reply["ok"], reply["type"]) == (False, "NoDeviceFitsError")
        named = f"dropped: reserved for {ticket_text(waiting.record)}"
        assert [G[i] for i in range(4) if f"GPU {i} " in "".join(
            line for line in reply["error"].splitlines() if named in line)] == [G[0], G[1]]
        sock, reply = _raw_pick(path, {"count": 1, "exclusive": True})
        held.append(sock)
        assert reply["ok"] is True, reply
        assert reply["record"]["device_uuids"] == [G[2]]  # the waiter's two are not given
    # The waiter gone, its devices are free again; the quota holds as for a lease.
    sock, reply = _raw_pick(path, {"count": 1, "exclusive": True})
    held.append(sock)
    assert reply["ok"] is True and reply["record"]["device_uuids"] == [G[0]], reply
    sock, reply = _raw_pick(path, {"count": 1})
    held.append(sock)
    assert (reply["ok"], reply["type"]) == (False, "LeaseLimitError")
    assert reply["error"].startswith(
        f"{c.store.user} already holds leases on 2 device(s) ({G[0]}, {G[2]}); taking 1 more "
        "would exceed max_devices_per_user = 2 set by the admin (enforced by the broker)"
    )
    for s in held:
        s.close()
    deadline = time.monotonic() + 15
    while c.live_ids() != before:  # the broker frees each lease when its connection closes
        assert time.monotonic() < deadline, "the broker kept a lease of a closed connection"
        time.sleep(0.02)
