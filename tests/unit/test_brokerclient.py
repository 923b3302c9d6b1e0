"""Fast tests of the broker client (core.leasing.brokerclient) in this process: against the real
broker (autogpu_jupyter.broker, served on a thread of the test process over a real Unix socket), and
against tiny scripted socket peers for what a real broker never does (a lost connection, a
malformed or oversized reply, a socket served by another uid). Root only where a second uid is
needed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig
from autogpu_jupyter.brokerd import net
from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.leasing import Requester, brokerclient, wire
from autogpu_jupyter.core.leasing.brokerclient import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    BrokerStore,
    broker_fix,
    from_wire,
    lease_events,
)
from autogpu_jupyter.core.leasing.directory import ScanResult
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseLimitError,
    LeaseStoreError,
    LeaseStoreUnreachableError,
    LeaseStoreUntrustedError,
    NoDeviceFitsError,
    UsageErrorBase,
)

GiB = 1024**3
ROOT = os.geteuid() == 0
#: What a pick sends first: the pick lock, with the booking view by process.
BEGIN = {"op": "begin", "view": "pids"}
HOST = socket.gethostname()


# ---- a real broker on a thread of this process --------------------------------------------


class ThreadBroker:
    """``autogpu_jupyter.broker.Broker`` served by an asyncio loop on a thread (as ``serve``
    does, without its signal handlers), on a Unix socket at ``path``."""

    def __init__(self, path: str, **config: Any) -> None:
        self.path = path
        self.config = BrokerConfig(socket_path=path, **config)
        self.loop = asyncio.new_event_loop()
        self.broker = Broker(self.config)
        # No GPU library here: the broker cannot see the fleet, so the made-up ids of these
        # tests are checked by the record schema only (tests/processes checks the fleet).
        self.broker.fleet.backend = _NoFleet()
        started = threading.Event()

        async def listen() -> None:
            self.listener = net.Listener(net.listen(path), self.broker.accepted)

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(listen())
            started.set()
            self.loop.run_forever()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def crash(self) -> None:
        """Stop as a killed broker does: its journal stays as it was, every connection drops."""

        def down() -> None:
            self.broker.stopping = True
            self.listener.close()
            for conn in list(self.broker.connections.conns):
                if conn.writer is not None:
                    conn.writer.abort()
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(down)
        self.thread.join(10)


class _NoFleet:
    """A backend that cannot see any GPU (as a broker on a host without the NVML library)."""

    def snapshot(self) -> Any:
        raise AutoGPUError("no GPU library here")


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="agb-", dir="/tmp"))
    yield path
    for p in sorted(path.rglob("*"), reverse=True):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink()
    path.rmdir()


@pytest.fixture(scope="module")
def broker(short_dir: Path) -> Iterator[ThreadBroker]:
    """One broker for the module: at most 3 devices and 3 tickets per user, command lines
    recorded. Every test uses devices of its own and gives back what it leased."""
    b = ThreadBroker(str(short_dir / "b.sock"), max_devices_per_user=3, max_tickets_per_user=3,
                     record_commands=True)
    yield b
    b.crash()


@pytest.fixture
def reg(broker: ThreadBroker) -> BrokerStore:
    return BrokerStore(broker.path, connect_timeout_s=2.0)


def wait_until(pred: Any) -> None:
    """Poll ``pred`` (what the broker does on another thread) for up to 10 s."""
    deadline = time.monotonic() + 10
    while not pred():
        assert time.monotonic() < deadline, "the broker never got there"
        time.sleep(0.005)


def ids(records: list[LeaseRecord]) -> list[str]:
    return [r.lease_id for r in records]


def fix(path: str) -> str:
    return (
        "ask the admin to start it (systemctl enable --now autogpu-broker.socket, or "
        f"`autogpu broker --socket {path}`), or to set c.AutoGPU.broker_fallback = 'registry'"
    )


# ---- scripted peers: a tiny real socket server ----------------------------------------------


class Peer:
    """A Unix-socket server that serves one scripted list per connection, in order. Each item
    reads one request line and answers it: a dict as one JSON line, bytes as they are, DROP:
    close without a reply. CLOSE closes at once, without reading. After the last item the peer
    waits for the client to close its end (``client_closed``: one bool per connection).
    ``requests`` is every request line it read, decoded, in order."""

    def __init__(self, path: str, script: list[list[Any]], *, listen_as: int | None = None):
        self.path = path
        self.script = [list(s) for s in script]
        self.requests: list[Any] = []
        self.protos: list[Any] = []  # the protocol version each request said it speaks
        self.client_closed: list[bool] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        if listen_as is not None:
            # The peer credentials of a Unix socket are the listener's at listen() time.
            os.seteuid(listen_as)
            try:
                self.sock.listen(8)
            finally:
                os.seteuid(0)
        else:
            self.sock.listen(8)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        for items in self.script:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                self._talk(conn, items)

    def _talk(self, conn: socket.socket, items: list[Any]) -> None:
        buf = b""
        for item in items:
            if item is CLOSE:
                return
            while b"\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            line, _, buf = buf.partition(b"\n")
            request = json.loads(line)
            self.protos.append(request.pop("proto", None))
            self.requests.append(request)
            if item is DROP:
                return
            if isinstance(item, dict):
                item = json.dumps({"proto": PROTOCOL, **item}).encode() + b"\n"
            conn.sendall(item)
        try:
            while conn.recv(65536):
                pass
            self.client_closed.append(True)
        except OSError:
            self.client_closed.append(False)

    def close(self) -> None:
        """Stop accepting; wait for the conversations to end."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)
        self.sock.close()


DROP = object()
CLOSE = object()


@pytest.fixture
def peer_path(short_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    path = short_dir / f"p{abs(hash(request.node.nodeid)) % 10**8}.sock"
    yield str(path)
    path.unlink(missing_ok=True)


def payload(lease_id: str, **over: Any) -> dict[str, Any]:
    """A record's payload as the broker sends it."""
    d: dict[str, Any] = {
        "version": 1, "kind": "lease", "lease_id": lease_id, "device_uuids": ["GPU-p"],
        "device_requested_bytes": [None], "exclusive": False, "user": "root", "uid": 0,
        "host": "h", "pid": 10, "created_s": 100.0, "kernel_id": None, "notebook_path": None,
        "command": None, "holder_kind": "process",
    }
    d.update(over)
    return d


# ---- leases through the real broker -------------------------------------------------------


def test_a_lease_through_the_broker_carries_the_holder_and_ends_on_release(
    reg: BrokerStore, broker: ThreadBroker
) -> None:
    holder = Requester(pid=1, kernel_id="k-1234567890", notebook_path="nb/train.ipynb",
                    command="python train.py", kind="kernel")
    with reg.locked() as txn:
        assert [r for r in txn.live_leases() if "GPU-a1" in r.device_uuids] == []
        lease = txn.create(devices=["GPU-a1", "GPU-a2"], requested_bytes=5 * GiB, requester=holder)
        assert txn.live_leases()[-1] == lease.record
    rec = lease.record
    assert rec == LeaseRecord(
        lease_id=rec.lease_id, kind="lease", device_uuids=("GPU-a1", "GPU-a2"),
        device_requested_bytes=(5 * GiB, 5 * GiB), exclusive=False, user=reg.user,
        uid=os.geteuid(), host=HOST, pid=os.getpid(), created_s=rec.created_s,
        kernel_id="k-1234567890", notebook_path="nb/train.ipynb", command="python train.py",
        holder_kind="kernel", seq=None, constraints=None, live=True,
        path=f"{broker.path}#{rec.lease_id}",
    )
    assert len(rec.lease_id) == 32
    assert lease.path == rec.path
    assert lease.held
    assert repr(lease) == f"<BrokerLease {rec.lease_id} GPU-a1,GPU-a2 held>"
    assert rec in reg.list_leases()
    # The lease is the connection: a blocking socket, ready to hand to a child (pass_fds).
    assert os.get_blocking(lease.fileno())
    lease.release()
    assert not lease.held
    assert repr(lease) == f"<BrokerLease {rec.lease_id} GPU-a1,GPU-a2 released>"
    assert rec.lease_id not in ids(reg.list_leases())
    with pytest.raises(ValueError, match=f"^lease {rec.lease_id} was released$"):
        lease.fileno()
    with pytest.raises(ValueError, match=f"^lease {rec.lease_id} was released$"):
        lease.set_pid(os.getpid())
    lease.release()  # idempotent
    assert not lease.held


@pytest.mark.parametrize(
    ("requested", "booked"),
    [
        (None, (None, None)),
        (7, (7, 7)),
        ([3 * GiB, None], (3 * GiB, None)),
        ((None, 4), (None, 4)),
    ],
)
def test_requested_bytes_are_booked_per_device(
    reg: BrokerStore, requested: Any, booked: tuple[int | None, ...]
) -> None:
    dev = DeviceSnapshot(index=0, uuid="GPU-b1", name="L4")
    with reg.locked() as txn, txn.create(
        devices=[dev, "GPU-b2"], requested_bytes=requested
    ) as lease:
        assert lease.record.device_uuids == ("GPU-b1", "GPU-b2")
        assert lease.record.device_requested_bytes == booked
        assert lease.record.holder_kind == "process"
        assert lease.record.pid == os.getpid()
    assert not lease.held
    assert "GPU-b1" not in {u for r in reg.list_leases() for u in r.device_uuids}


def test_a_transaction_makes_one_lease_and_needs_a_device(reg: BrokerStore) -> None:
    with reg.locked() as txn:
        with pytest.raises(ValueError, match=r"^a lease needs at least one device$"):
            txn.create(devices=[])
        with txn.create(devices=["GPU-c1"]):
            with pytest.raises(
                LeaseStoreError, match=r"^this broker transaction already made its lease$"
            ):
                txn.create(devices=["GPU-c2"])


def test_an_exclusive_lease_and_the_quota_are_refused_with_the_brokers_words(
    reg: BrokerStore,
) -> None:
    with reg.locked() as txn:
        first = txn.create(devices=["GPU-d1"], exclusive=True,
                           requester=Requester(notebook_path="own.ipynb"))
    try:
        with reg.locked() as txn:
            assert first.record.exclusive is True
            with pytest.raises(NoDeviceFitsError) as err:
                txn.create(devices=["GPU-d1"])
            assert str(err.value) == (
                f"lease broker: no device free: GPU-d1 is held exclusively by {reg.user}: own.ipynb"
            )
        with reg.locked() as txn, pytest.raises(LeaseLimitError) as err2:
            txn.create(devices=["GPU-d2", "GPU-d3", "GPU-d4"])
        assert str(err2.value).startswith(
            f"lease broker: {reg.user} already holds leases on 1 device(s) (GPU-d1); taking 3 "
            "more would exceed max_devices_per_user = 3 set by the admin (enforced by the broker)."
        )
        with reg.locked() as txn, pytest.raises(UsageErrorBase) as err3:
            txn.create(devices=[f"GPU-{i}" for i in range(65)])
        assert str(err3.value) == "lease broker: devices: expected a list of device UUIDs"
    finally:
        first.release()


def test_a_repick_replaces_only_the_hidden_lease(reg: BrokerStore) -> None:
    with reg.locked() as txn:
        old = txn.create(
            devices=["GPU-e1"], exclusive=True, requester=Requester(kernel_id="kern-e")
        )
    with reg.locked() as txn:
        other = txn.create(devices=["GPU-e2"], requester=Requester(kernel_id="kern-f"))
    try:
        by_id = reg.hiding(lease_ids=[old.record.lease_id, "no-such-id"])
        by_kernel = reg.hiding(kernel_id="kern-e")
        for view in (by_id, by_kernel):
            shown = ids(view.list_leases())
            assert old.record.lease_id not in shown
            assert other.record.lease_id in shown
        # The registry itself still sees both; the views are copies.
        assert {old.record.lease_id, other.record.lease_id} <= set(ids(reg.list_leases()))
        # Hiding by id leaves the leases of kernels alone, and the reverse.
        assert other.record.lease_id in ids(reg.hiding(lease_ids=["x"]).list_leases())
        with reg.locked() as txn, pytest.raises(NoDeviceFitsError):
            txn.create(devices=["GPU-e1"], exclusive=True)
        with by_kernel.locked() as txn:
            assert old.record.lease_id not in ids(txn.live_leases())
            new = txn.create(devices=["GPU-e1"], exclusive=True)
        with new:
            shown = ids(reg.list_leases())
            assert old.record.lease_id not in shown  # ended by the broker, not only hidden
            assert new.record.lease_id in shown
        with by_id.locked() as txn, txn.create(devices=["GPU-e3"]) as third:
            assert third.record.device_uuids == ("GPU-e3",)
    finally:
        old.release()
        other.release()


def test_set_pid_names_the_process_that_uses_the_lease(reg: BrokerStore) -> None:
    with reg.locked() as txn, txn.create(devices=["GPU-f1"]) as lease:
        lease.set_pid(os.getppid())
        assert lease.record.pid == os.getppid()
        assert lease.record.path.startswith(f"{reg.path}#")
        (rec,) = [r for r in reg.list_leases() if r.lease_id == lease.record.lease_id]
        assert rec.pid == os.getppid()
        assert rec == lease.record


def constraints(**over: Any) -> dict[str, Any]:
    """A ticket's constraints as the picker writes them."""
    c: dict[str, Any] = {
        "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
        "exclude": [], "exclusive": False, "allowed_uuids": None,
    }
    c.update(over)
    return c


def test_tickets_join_the_line_in_order(reg: BrokerStore, broker: ThreadBroker) -> None:
    t1 = reg.take_ticket(
        constraints=constraints(min_free_bytes=GiB), requester=Requester(kernel_id="kt")
    )
    with reg.locked() as txn:
        t2 = txn.create_ticket(constraints=constraints(exclude=["GPU-x"]), exclusive=True)
        t3 = txn.create_ticket(
            constraints=constraints(), requester=Requester(notebook_path="t3.ipynb")
        )
        assert t1.record in txn.live_tickets()  # what the lock's holder saw: not t2 yet
    try:
        assert t1.record.kind == "ticket"
        assert t1.record.constraints == constraints(min_free_bytes=GiB)
        assert t1.record.kernel_id == "kt"
        assert t1.record.exclusive is False
        assert t2.record.exclusive is True
        assert t2.record.constraints == constraints(exclude=["GPU-x"])
        assert (t3.record.exclusive, t3.record.notebook_path) == (False, "t3.ipynb")
        assert t3.record.seq == t2.record.seq + 1
        assert t2.record.seq == t1.record.seq + 1
        assert t1.record.lease_id not in ids(reg.list_leases())
        assert t1.record.lease_id in ids(reg.list_leases(include_tickets=True))
        leases, tickets = reg.live_records()
        assert t1.record not in leases
        assert [t for t in tickets if t in (t1.record, t2.record)] == [t1.record, t2.record]
        assert reg.scan() == ScanResult(live=reg.list_leases(include_tickets=True))
        assert t1.record in reg.scan().live
    finally:
        t1.release()
        t2.release()
        t3.release()
    assert t1.record.lease_id not in ids(reg.list_leases(include_tickets=True))


def test_a_ticket_the_broker_refuses_raises_its_error(reg: BrokerStore) -> None:
    with pytest.raises(UsageErrorBase) as err:
        reg.take_ticket(constraints=constraints(count=0))
    assert str(err.value) == (
        "lease broker: ticket refused: count: expected an integer from 1 to 9223372036854775807"
    )


def test_a_ticket_whose_constraint_holds_a_lone_surrogate_is_refused(
    reg: BrokerStore,
) -> None:
    # "\udc80" travels as the JSON escape; the broker's reader decodes it to a lone surrogate,
    # which no journal line or reply could carry: the record's schema refuses it.
    with pytest.raises(UsageErrorBase) as err:
        reg.take_ticket(constraints=constraints(exclude=["GPU-\udc80"]))
    assert str(err.value) == (
        "lease broker: ticket refused: a lone surrogate (not valid Unicode text)"
    )
    assert reg.list_tickets() == []


def test_status_and_revoke_as_root(reg: BrokerStore) -> None:
    if not ROOT:
        pytest.skip("revoking needs root")
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-g1"], requester=Requester(notebook_path="rev.ipynb"))
    st = reg.status()
    assert st["ok"] is True
    assert lease.record.lease_id in [r["lease_id"] for r in st["leases"]]
    assert st["per_user"][reg.user]["leases"] >= 1
    assert reg.revoke(lease.record.lease_id) == f"{reg.user}: rev.ipynb"
    events = lease_events(lease.fileno())
    assert events == [
        f"your GPU lease {lease.record.lease_id} was revoked by the admin: this kernel no longer "
        "holds it; others may now be given its GPU"
    ]
    with pytest.raises(UsageErrorBase,
                       match=r"^lease broker: revoke: no live lease or ticket 'nope'$"):
        reg.revoke("nope")
    lease.release()  # the broker closed it: nothing to send, nothing raised
    assert lease.record.lease_id not in ids(reg.list_leases())


def test_a_copy_of_the_lease_socket_keeps_the_lease_after_detach(reg: BrokerStore) -> None:
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-h1"])
    lease_id = lease.record.lease_id
    copy_fd = os.dup(lease.fileno())
    lease.detach()
    assert not lease.held
    lease.detach()
    assert lease_id in ids(reg.list_leases())
    os.close(copy_fd)
    wait_until(lambda: lease_id not in ids(reg.list_leases()))


def test_a_lease_whose_socket_was_closed_behind_its_back_releases_quietly(
    reg: BrokerStore,
) -> None:
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-m1"])
    os.close(lease.fileno())  # as a kernel may close AUTOGPU_LEASE_FD
    lease.release()
    assert not lease.held
    wait_until(lambda: lease.record.lease_id not in ids(reg.list_leases()))


def test_a_lease_whose_socket_was_closed_behind_its_back_detaches_quietly(
    reg: BrokerStore,
) -> None:
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-m2"])
    fd = lease.fileno()
    os.close(fd)
    with pytest.raises(OSError):
        os.fstat(fd)
    lease.detach()
    assert not lease.held
    wait_until(lambda: lease.record.lease_id not in ids(reg.list_leases()))


def test_a_release_in_a_forked_child_leaves_the_parents_lease(reg: BrokerStore) -> None:
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-i1"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with the broker's thread
            pid = os.fork()
        if pid == 0:  # the child: release only closes its copy
            try:
                lease.release()
                os._exit(0 if not lease.held else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lease.held
        assert lease.record.lease_id in ids(reg.list_leases())
    finally:
        lease.release()
    assert lease.record.lease_id not in ids(reg.list_leases())


def test_a_lease_dropped_without_release_closes_its_socket_and_ends(reg: BrokerStore) -> None:
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-j1"])
    lease_id = lease.record.lease_id
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del lease
        gc.collect()
    assert [str(w.message) for w in seen if w.category is ResourceWarning] == []
    wait_until(lambda: lease_id not in ids(reg.list_leases()))


def test_the_pick_lock_is_asked_for_at_once_and_waited_for_when_the_view_is_needed(
    reg: BrokerStore, broker: ThreadBroker
) -> None:
    """``locked()`` sends ``begin`` and returns (the pick reads its devices meanwhile); the
    wait for the lock is the view's, and ``ready`` says how long it was. Caught: a transaction
    that reads no answer (a view without the lock), or ``ready`` that does not say it waited
    (a pick that waited in line would rank on devices read before the wait)."""
    first_cm = reg.locked()
    first = first_cm.__enter__()
    assert first.ready() >= 0.0
    assert first.ready() == 0.0  # held: nothing more to wait for
    other = BrokerStore(broker.path, lock_timeout_s=10.0)
    second_cm = other.locked()
    start = time.monotonic()
    second = second_cm.__enter__()  # the lock is held by `first`, yet this returns at once
    assert time.monotonic() - start < 1.0
    timer = threading.Timer(0.3, first_cm.__exit__, (None, None, None))
    timer.start()
    try:
        waited = second.ready()
        assert waited >= 0.2  # it waited for `first` to give the lock back
        assert second.live_leases() == []
        assert second.ready() == 0.0
    finally:
        timer.join()
        second_cm.__exit__(None, None, None)


def test_a_transaction_without_a_lease_gives_the_pick_lock_back(
    reg: BrokerStore, broker: ThreadBroker
) -> None:
    impatient = BrokerStore(broker.path, lock_timeout_s=0.05)
    with pytest.raises(RuntimeError, match=r"^boom$"), reg.locked():
        raise RuntimeError("boom")
    with reg.locked() as held:
        held.ready()  # the lock is asked for at locked() and waited for here
        with pytest.raises(LeaseStoreUntrustedError) as err, impatient.locked() as txn:
            txn.live_leases()  # the view needs the lock: its wait times out
        assert str(err.value) == (
            f"the lease broker at {broker.path} did not give its pick lock within 0.05 s (it "
            "is busy, or other picks hold it): nothing was picked; try again"
        )
    with BrokerStore(broker.path, lock_timeout_s=1.0).locked() as txn:
        assert isinstance(txn.live_leases(), list)


def test_a_broker_restart_keeps_the_lease_and_release_frees_it_by_id(short_dir: Path) -> None:
    path = str(short_dir / "r.sock")
    state = short_dir / "r-state"
    first = ThreadBroker(path, state_dir=str(state))
    reg = BrokerStore(path)
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-k1"])
    # journaled before the reply: in the file the moment the client holds the lease
    assert lease.record.lease_id in (state / "journal.log").read_text()
    first.crash()
    second = ThreadBroker(path, state_dir=str(state))
    try:
        assert ids(reg.list_leases()) == [lease.record.lease_id]  # an orphan, still held
        lease.release()  # the old connection is gone: released by id on the new broker
        assert not lease.held
        assert reg.list_leases() == []
        assert reg.status()["orphans"] == 0
    finally:
        second.crash()


def test_a_broker_started_in_another_boot_drops_the_journal_it_finds(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal of an earlier boot is dropped whole, even when a socket inode it names is
    held again (inodes restart at each boot): the lease would be kept for nobody."""
    from autogpu_jupyter.brokerd import journal as jrnl

    path = str(short_dir / "boot.sock")
    state = short_dir / "boot-state"
    first = ThreadBroker(path, state_dir=str(state))
    reg = BrokerStore(path)
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-k1"])
    first.crash()
    other = short_dir / "boot_id"
    other.write_text("00000000-0000-4000-8000-000000000000\n")
    monkeypatch.setattr(jrnl, "BOOT_ID_PATH", str(other))
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        second = ThreadBroker(path, state_dir=str(state))
    try:
        assert lease.fileno() >= 0  # its socket is still open here, yet
        assert reg.list_leases() == []
        assert reg.status()["orphans"] == 0
        assert "earlier boot" in caplog.text and "1 lease(s)" in caplog.text
    finally:
        lease.detach()
        second.crash()


# ---- the registry object ------------------------------------------------------------------


def test_a_registry_names_its_socket_and_its_user(tmp_path: Path) -> None:
    import pwd

    reg = BrokerStore("/nowhere/b.sock")
    assert repr(reg) == "BrokerStore('/nowhere/b.sock')"
    assert reg.path == "/nowhere/b.sock"
    assert reg.lock_timeout_s == 10.0
    assert reg.connect_timeout_s == 5.0
    assert reg.max_devices_per_user == 0
    assert reg.record_commands is False
    assert reg.uid == os.geteuid()
    assert reg.user == pwd.getpwuid(os.geteuid()).pw_name
    assert reg.unusable_reason is None
    assert reg.prune() == []
    assert reg.prune(all_users=True) == []
    other = BrokerStore("/x", lock_timeout_s=3.0, connect_timeout_s=0.5)
    assert (other.lock_timeout_s, other.connect_timeout_s) == (3.0, 0.5)


def test_a_uid_without_a_name_is_the_user_by_number() -> None:
    if not ROOT:
        pytest.skip("needs root to take an unnamed uid")
    import pwd

    uid = next(u for u in range(54321, 60000) if not _has_name(u, pwd))
    os.seteuid(uid)
    try:
        reg = BrokerStore("/x")
    finally:
        os.seteuid(0)
    assert (reg.uid, reg.user) == (uid, str(uid))


def _has_name(uid: int, pwd: Any) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


@pytest.mark.parametrize(
    ("err", "why"),
    [
        (FileNotFoundError(2, "No such file or directory"), "No such file or directory"),
        (ConnectionError("the broker closed the connection"), "the broker closed the connection"),
        (TimeoutError("timed out"), "timed out"),
        (OSError(), "OSError"),
        (ValueError(), "ValueError"),
    ],
)
def test_why_a_broker_was_lost_is_said_in_words(err: BaseException, why: str) -> None:
    assert brokerclient._why(err) == why


def test_broker_fix_names_the_socket() -> None:
    assert broker_fix("/run/x.sock") == fix("/run/x.sock")
    # the broker's own default (the unit tests point the clients' at a path of their own)
    from autogpu_jupyter.broker import BrokerConfig

    assert BrokerConfig().socket_path == "/run/autogpu/broker.sock"


# ---- an unreachable or untrusted broker ---------------------------------------------------


def test_a_missing_socket_fails_closed_with_the_admins_fix(peer_path: str) -> None:
    reg = BrokerStore(peer_path, connect_timeout_s=0)
    want = (
        f"the lease broker at {peer_path} cannot be reached (No such file or directory): "
        f"nothing was picked; {fix(peer_path)}"
    )
    for attempt in (reg.check, reg.list_leases, reg.status, lambda: reg.revoke("x"),
                    lambda: reg.take_ticket(constraints={})):
        with pytest.raises(LeaseStoreUntrustedError) as err:
            attempt()
        assert str(err.value) == want
    with pytest.raises(LeaseStoreUntrustedError) as err, reg.locked():
        pass
    assert str(err.value) == want
    assert reg.live_records() == ([], [])


def test_a_socket_nobody_serves_is_refused(peer_path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(peer_path)
    s.close()
    with pytest.raises(LeaseStoreUntrustedError) as err:
        BrokerStore(peer_path, connect_timeout_s=-3).check()
    assert str(err.value) == (
        f"the lease broker at {peer_path} cannot be reached (Connection refused): nothing was "
        f"picked; {fix(peer_path)}"
    )


class FakeClock:
    """The clock of brokerclient: sleeping moves it on at once (and may start a broker)."""

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
            self.on_sleep()


@pytest.mark.parametrize(
    ("timeout", "sleeps"),
    [
        (-1.0, []),
        (0.0, []),
        (0.05, [0.05]),
        (0.3, [0.05, 0.1]),
        (2.0, [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]),
    ],
)
def test_connecting_retries_with_backoff_until_the_timeout(
    peer_path: str, monkeypatch: pytest.MonkeyPatch, timeout: float, sleeps: list[float]
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(brokerclient, "time", clock)
    with pytest.raises(LeaseStoreUntrustedError, match="cannot be reached"):
        BrokerStore(peer_path, connect_timeout_s=timeout).check()
    assert clock.sleeps == pytest.approx(sleeps)


def test_a_broker_that_comes_back_while_retrying_is_reached(
    peer_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    peers: list[Peer] = []
    clock = FakeClock(lambda: peers or peers.append(Peer(peer_path, [[]])))
    monkeypatch.setattr(brokerclient, "time", clock)
    BrokerStore(peer_path, connect_timeout_s=1.0).check()
    assert clock.sleeps == [0.05]
    peers[0].close()
    assert peers[0].client_closed == [True]  # check() closed its connection


@pytest.mark.parametrize("uid", [1, 65534, 3_000_000_000])
def test_a_broker_served_by_another_user_is_refused(peer_path: str, uid: int) -> None:
    if not ROOT:
        pytest.skip("needs root to listen as another uid")
    peer = Peer(peer_path, [[]], listen_as=uid)
    with pytest.raises(LeaseStoreUntrustedError) as err:
        BrokerStore(peer_path, connect_timeout_s=5).check()
    assert str(err.value) == (
        f"the lease broker at {peer_path} runs as uid {uid}, not root: refused (another user "
        f"could hand out fake leases); {fix(peer_path)}"
    )
    peer.close()
    assert peer.client_closed == [True]  # at once, while the error is still held


# ---- replies a real broker never sends ----------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ([DROP], "the broker closed the connection"),
        ([b"[1, 2]\n"], "reply is not an object"),
        ([b"not json\n"], "Expecting value: line 1 column 1 (char 0)"),
        ([b'{"ok": true', CLOSE], "the broker closed the connection"),
    ],
)
def test_a_lost_or_garbled_reply_fails_closed(peer_path: str, reply: Any, why: str) -> None:
    peer = Peer(peer_path, [reply])
    with pytest.raises(LeaseStoreUntrustedError) as err:
        BrokerStore(peer_path).status()
    assert str(err.value) == f"lost the lease broker at {peer_path} ({why}); {fix(peer_path)}"
    peer.close()
    assert peer.requests == [{"op": "status"}]


def test_a_reply_just_under_the_limit_is_read_and_one_over_it_is_refused_as_such(
    peer_path: str,
) -> None:
    head = f'{{"ok": true, "proto": {PROTOCOL}, "revoked": ""}}\n'
    big = "y" * (MAX_REPLY_BYTES - len(head))
    line = json.dumps({"ok": True, "proto": PROTOCOL, "revoked": big}).encode() + b"\n"
    assert len(line) == MAX_REPLY_BYTES
    peer = Peer(peer_path, [[line], [b"x" + line, CLOSE]])
    reg = BrokerStore(peer_path)
    assert reg.revoke("a") == big
    with pytest.raises(LeaseStoreError) as err:
        reg.revoke("b")
    assert type(err.value) is LeaseStoreError  # not "lost the broker": it is there
    assert str(err.value) == (
        f"the lease broker at {peer_path} sent a reply to 'revoke' longer than "
        f"{MAX_REPLY_BYTES} bytes: refused (the broker and this autogpu disagree on the "
        "protocol's caps, or the broker has a bug; it is not down)"
    )
    peer.close()


@pytest.mark.parametrize(
    ("reply", "theirs"),
    [
        (b'{"ok": true, "revoked": "x"}\n', "an older protocol (no version)"),
        (b'{"ok": true, "proto": 1, "revoked": "x"}\n', "protocol 1"),
        (b'{"ok": true, "proto": "2", "revoked": "x"}\n', "protocol '2'"),
        # an older broker's refusal (of anything) is still an older broker, not its words
        (b'{"ok": false, "type": "RegistryError", "error": "no"}\n',
         "an older protocol (no version)"),
    ],
)
def test_a_broker_of_another_protocol_is_refused_with_one_line(
    peer_path: str, reply: bytes, theirs: str
) -> None:
    peer = Peer(peer_path, [[reply]])
    with pytest.raises(LeaseStoreUntrustedError) as err:
        BrokerStore(peer_path).revoke("a")
    assert str(err.value) == (
        f"the lease broker at {peer_path} speaks {theirs}, this autogpu speaks protocol "
        f"{PROTOCOL}: the broker and this environment come from different autogpu versions; "
        "nothing was picked; ask the admin to run the same autogpu version for both"
    )
    peer.close()
    assert peer.protos == [PROTOCOL]


def test_a_broker_that_refuses_our_protocol_is_quoted(peer_path: str) -> None:
    refusal = {"ok": False, "type": "RegistryUntrustedError", "proto": PROTOCOL + 1,
               "error": "this autogpu speaks protocol 2, the lease broker speaks protocol 3"}
    peer = Peer(peer_path, [[json.dumps(refusal).encode() + b"\n"]])
    with pytest.raises(LeaseStoreUntrustedError) as err:
        BrokerStore(peer_path).revoke("a")
    assert str(err.value) == (
        f"lease broker at {peer_path}: this autogpu speaks protocol 2, the lease broker speaks "
        "protocol 3"
    )
    peer.close()


@pytest.mark.parametrize(
    ("reply", "cls", "message"),
    [
        ({"ok": False, "type": "LeaseLimitError", "error": "quota"}, LeaseLimitError,
         "lease broker: quota"),
        ({"ok": False, "type": "NoDeviceFitsError", "error": "busy"}, NoDeviceFitsError,
         "lease broker: busy"),
        ({"ok": False, "type": "UsageErrorBase", "error": "bad"}, UsageErrorBase,
         "lease broker: bad"),
        ({"ok": False, "type": "KeyError", "error": "odd"}, LeaseStoreError, "lease broker: odd"),
        ({"ok": False}, LeaseStoreError, "lease broker: refused"),
        ({"error": "no ok"}, LeaseStoreError, "lease broker: no ok"),
    ],
)
def test_a_refusal_raises_the_error_the_broker_names(
    peer_path: str, reply: dict[str, Any], cls: type[AutoGPUError], message: str
) -> None:
    peer = Peer(peer_path, [[reply]])
    with pytest.raises(AutoGPUError) as err:
        BrokerStore(peer_path).revoke("L1")
    assert type(err.value) is cls
    assert str(err.value) == message
    peer.close()
    assert peer.requests == [{"op": "revoke", "lease_id": "L1"}]


@pytest.mark.parametrize("refusal", [True, False])
def test_a_connection_refused_before_the_request_is_sent_says_the_brokers_words(
    peer_path: str, monkeypatch: pytest.MonkeyPatch, refusal: bool
) -> None:
    """A broker at its connection caps answers and closes before it reads: the request then
    meets a broken pipe, and the refusal waiting in the socket is what the user reads."""
    words = "too many connections for bob (max_connections_per_user = 4)"
    line = json.dumps({"ok": False, "type": "LeaseLimitError", "error": words,
                       "proto": PROTOCOL}).encode() + b"\n"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(peer_path)
    listener.listen(1)
    closed = threading.Event()

    def refuse() -> None:
        conn, _ = listener.accept()
        if refusal:
            conn.sendall(line)
        conn.close()
        closed.set()

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    real_connect = brokerclient._connect

    def connect_then_wait(path: str, timeout_s: float) -> socket.socket:
        sock = real_connect(path, timeout_s)
        assert closed.wait(10)  # the request goes out only after the broker closed
        return sock

    monkeypatch.setattr(brokerclient, "_connect", connect_then_wait)
    try:
        with pytest.raises(AutoGPUError) as err:
            BrokerStore(peer_path).status()
    finally:
        thread.join(10)
        listener.close()
    if refusal:
        assert type(err.value) is LeaseLimitError
        assert str(err.value) == f"lease broker: {words}"
    else:  # nothing left behind: the lost broker, said as before
        assert type(err.value) is LeaseStoreUnreachableError
        assert str(err.value) == (
            f"lost the lease broker at {peer_path} (Broken pipe); {fix(peer_path)}")


def test_unasked_events_are_kept_and_the_reply_read(peer_path: str) -> None:
    events = b'{"event": "replaced", "message": "m"}\n{"event": "other"}\n'
    reply = json.dumps({"ok": True, "revoked": "bob: nb", "proto": PROTOCOL}).encode()
    peer = Peer(peer_path, [[events + reply + b"\n"]])
    assert BrokerStore(peer_path).revoke("z") == "bob: nb"
    peer.close()
    assert peer.requests == [{"op": "revoke", "lease_id": "z"}]


def test_revoke_answers_the_holders_text_or_nothing(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True, "revoked": 42}], [{"ok": True}]])
    reg = BrokerStore(peer_path)
    assert reg.revoke("a") == "42"
    assert reg.revoke("b") == ""
    peer.close()


def test_revoke_record_says_whether_a_lease_or_a_ticket_was_revoked(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True, "kind": "ticket", "revoked": "bob: a.ipynb"}],
                            [{"ok": True}]])
    reg = BrokerStore(peer_path)
    assert reg.revoke_record("T1") == ("ticket", "bob: a.ipynb")
    assert reg.revoke_record("L1") == ("lease", "")  # an older broker says no kind: a lease
    peer.close()


def test_status_reads_every_page_and_splits_leases_from_tickets(peer_path: str) -> None:
    """The per-user rows, then the records page by page on the same connection; the protocol
    is checked on the connection's first reply only (the last page here names none)."""
    peer = Peer(peer_path, [[
        {"ok": True, "per_user": {"bob": {"leases": 1}}},
        {"ok": True, "records": [payload("L1")], "next": "L1"},
        {"ok": True, "records": [payload("T1", kind="ticket")], "proto": None},
    ]])
    st = BrokerStore(peer_path).status()
    assert (st["per_user"], [r["lease_id"] for r in st["leases"]],
            [r["lease_id"] for r in st["tickets"]]) == ({"bob": {"leases": 1}}, ["L1"], ["T1"])
    peer.close()
    assert peer.requests == [
        {"op": "status"},
        {"op": "leases", "tickets": True, "after": None},
        {"op": "leases", "tickets": True, "after": "L1"},
    ]


def test_a_list_stops_at_its_cap_of_records(
    peer_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(brokerclient, "MAX_LIST_RECORDS", 2)
    pages = [{"ok": True, "records": [payload(f"L{i}")], "next": f"L{i}"} for i in range(3)]
    peer = Peer(peer_path, [pages])
    assert ids(BrokerStore(peer_path).list_leases()) == ["L0", "L1"]
    peer.close()
    assert [r["after"] for r in peer.requests] == [None, "L0"]  # no third page asked for


def test_the_waiting_line_names_the_broker_it_came_from(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True, "records": [payload("T1", kind="ticket")]}]])
    assert [t.path for t in BrokerStore(peer_path).list_tickets()] == [f"{peer_path}#T1"]
    peer.close()


def test_a_pick_locks_answer_over_the_cap_is_refused_naming_begin(peer_path: str) -> None:
    peer = Peer(peer_path, [[b"x" * (MAX_REPLY_BYTES + 1) + b"\n"]])
    with pytest.raises(LeaseStoreError) as err, BrokerStore(peer_path).locked() as txn:
        txn.ready()
    assert type(err.value) is LeaseStoreError
    assert str(err.value).startswith(f"the lease broker at {peer_path} sent a reply to 'begin' ")
    peer.close()


@pytest.mark.parametrize("how", ["call", "receive", "send"])
def test_a_broker_that_does_not_answer_or_read_in_time_is_named_with_the_request(
    short_dir: Path, how: str
) -> None:
    """A broker that accepted but never answers (or never reads what is sent): the error
    names the request, fail closed. Nobody accepts on this socket; the kernel queues the
    connection."""
    path = str(short_dir / f"mute-{how}.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)
    conn = brokerclient._Conn(path, 1.0)
    try:
        with pytest.raises(LeaseStoreUnreachableError) as err:
            if how == "call":
                conn.call({"op": "status"}, timeout_s=0.05)
            elif how == "receive":
                conn.receive("status", timeout_s=0.05)
            else:  # far more than the socket's buffer: the send blocks
                conn.send({"op": "status", "pad": "x" * 8_000_000}, timeout_s=0.05)
        assert str(err.value) == (
            f"the lease broker at {path} did not give an answer to 'status' within 0.05 s (it "
            "is busy, or other picks hold it): nothing was picked; try again"
        )
    finally:
        conn.close()
        mute.close()
        os.unlink(path)


def test_a_pick_lock_lost_once_is_asked_again_on_a_fresh_connection(peer_path: str) -> None:
    """The view of the second answer is the one read, whole: own leases, the booking rows of
    others, the admin's reservations and the line (each named by this broker's path)."""
    begin = {"ok": True, "own": [payload("L1")], "tickets": [payload("T1", kind="ticket")],
             "devices": [{"uuid": "GPU-q", "rows": [[True, 7, None, "bob", "b.ipynb"]]}],
             "reserved": {"GPU-r": ["ml"]}}
    peer = Peer(peer_path, [[DROP], [begin, {"ok": True, "record": payload("L2")}]])
    reg = BrokerStore(peer_path)
    with reg.locked() as txn:
        assert 0.0 <= txn.ready() < reg.lock_timeout_s  # the seconds it waited, both tries
        view = txn.live_leases()
        assert [(r.device_uuids, r.user, r.exclusive) for r in view] == [
            (("GPU-p",), "root", False), (("GPU-q",), "bob", True),
            (("GPU-r",), "reserved for ml", True),
        ]
        assert [r.path for r in view[:2]] == [f"{peer_path}#L1", f"{peer_path}#{view[1].lease_id}"]
        assert ids(txn.live_tickets()) == ["T1"]
        lease = txn.create(devices=["GPU-p"], requester=Requester(pid=5, kernel_id="k",
                                                            notebook_path="n", command="c"))
    assert lease.record.lease_id == "L2"
    assert lease.record.path == f"{peer_path}#L2"
    lease.detach()
    peer.close()
    assert peer.requests == [
        BEGIN,
        BEGIN,
        {"op": "lease", "devices": ["GPU-p"], "requested_bytes": [None], "exclusive": False,
         "holder": {"kernel_id": "k", "notebook_path": "n", "command": "c", "kind": "process"},
         "ignore_ids": [], "ignore_kernel": None},
    ]


@pytest.mark.parametrize("lost", [1, 2])
def test_a_pick_lock_whose_request_could_not_be_sent_is_asked_on_a_fresh_connection(
    peer_path: str, monkeypatch: pytest.MonkeyPatch, lost: int
) -> None:
    """The broker went away between connect and ``begin`` (a restart): the request is sent
    once more on a new connection; a second loss fails closed, neither connection left open."""
    begin = {"ok": True, "own": [], "devices": [], "tickets": []}
    peer = Peer(peer_path, [[CLOSE], [begin] if lost == 1 else [CLOSE]])
    sent: list[Any] = []
    real = brokerclient._Conn._send_line

    def send_line(self: Any, msg: Any) -> None:
        sent.append(msg)
        if len(sent) <= lost:
            raise BrokenPipeError(32, "Broken pipe")
        real(self, msg)

    monkeypatch.setattr(brokerclient._Conn, "_send_line", send_line)
    reg = BrokerStore(peer_path, connect_timeout_s=2.0)
    if lost == 1:
        with reg.locked() as txn:
            assert txn.live_leases() == []
    else:
        with pytest.raises(LeaseStoreUnreachableError, match=r"\(Broken pipe\)"), reg.locked():
            pass
    peer.close()
    assert sent == [BEGIN] * 2
    assert peer.requests == ([BEGIN] if lost == 1 else [])
    assert peer.client_closed == ([True] if lost == 1 else [])


def test_a_pick_lock_lost_twice_fails_closed(peer_path: str) -> None:
    peer = Peer(peer_path, [[DROP], [DROP]])
    with pytest.raises(LeaseStoreUnreachableError) as err, BrokerStore(peer_path).locked() as txn:
        try:
            txn.ready()  # the lock is asked for at locked(), its answer read here
        finally:  # nothing is asked again on a transaction that lost its broker
            with pytest.raises(LeaseStoreError, match=r"^this broker transaction is closed$"):
                txn.live_leases()
    assert str(err.value) == (
        f"lost the lease broker at {peer_path} (the broker closed the connection); "
        f"{fix(peer_path)}"
    )
    peer.close()
    assert peer.requests == [BEGIN, BEGIN]


@pytest.mark.parametrize("part", ["devices", "reserved"])
def test_a_bad_booking_view_in_the_pick_locks_answer_names_the_broker(
    peer_path: str, part: str
) -> None:
    begin = {"ok": True, "own": [], "devices": [], "tickets": [], part: ["GPU-r"]}
    peer = Peer(peer_path, [[begin]])
    with pytest.raises(LeaseStoreError) as err, BrokerStore(peer_path).locked() as txn:
        txn.ready()
    assert str(err.value).startswith(f"lease broker at {peer_path} sent a bad booking view: ")
    peer.close()


@pytest.mark.parametrize("device", [
    {"uuid": "GPU-a", "more": ["leases", 3]},  # folded leases that are not an object
    {"uuid": "GPU-a", "pids": [[7, 1, float("inf"), False]]},  # JSON's Infinity for bytes
    {"uuid": "GPU-a", "rows": [[False, float("-inf"), None, "bob", ""]]},
    {"uuid": "GPU-a", "more": {"leases": 1, "booked": float("inf")}},
])
def test_a_booking_view_of_the_wrong_shape_or_an_infinite_number_is_one_line(
    peer_path: str, device: dict[str, Any]
) -> None:
    """A broker is trusted, but what it sends is only JSON: a view whose folded leases are not
    an object, or whose numbers are JSON's ``Infinity``, is refused in one line naming the
    broker (never a traceback in the user's kernel; issue 39)."""
    begin = {"ok": True, "own": [], "devices": [device], "tickets": []}
    peer = Peer(peer_path, [[begin]])
    with pytest.raises(LeaseStoreError) as err, BrokerStore(peer_path).locked() as txn:
        txn.ready()
    assert str(err.value).startswith(f"lease broker at {peer_path} sent a bad booking view: ")
    assert "\n" not in str(err.value)
    peer.close()


def test_a_record_with_an_infinite_number_is_one_line(peer_path: str) -> None:
    rec = payload("B1")
    rec["uid"] = float("inf")
    peer = Peer(peer_path, [[{"ok": True, "records": [rec]}]])
    with pytest.raises(LeaseStoreError) as err:
        BrokerStore(peer_path).list_leases()
    assert str(err.value) == (
        f"lease broker at {peer_path} sent a bad record: cannot convert float infinity to integer")
    peer.close()


def test_a_refused_pick_lock_is_not_asked_again(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": False, "error": "no", "type": "UsageErrorBase"}]])
    with pytest.raises(UsageErrorBase, match=r"^lease broker: no$"), BrokerStore(
        peer_path
    ).locked() as txn:
        txn.ready()
    peer.close()
    assert peer.requests == [BEGIN]


def test_the_lease_request_names_what_a_repick_replaces(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True}, {"ok": True, "record": payload("N1")}]])
    view = BrokerStore(peer_path).hiding(lease_ids=["b", "c", "a"], kernel_id="kk")
    with view.locked() as txn:
        assert txn.live_leases() == [] and txn.live_tickets() == []
        txn.create(devices=["GPU-1", "GPU-2"], requested_bytes=[1, None], exclusive=True).detach()
    peer.close()
    assert peer.requests[1] == {
        "op": "lease", "devices": ["GPU-1", "GPU-2"], "requested_bytes": [1, None],
        "exclusive": True, "holder": {"kind": "process"}, "ignore_ids": ["a", "b", "c"],
        "ignore_kernel": "kk",
    }


def test_the_ticket_and_list_requests(peer_path: str) -> None:
    ticket = payload("T1", kind="ticket", seq=3, constraints={"count": 1})
    peer = Peer(peer_path, [
        [{"ok": True, "record": ticket}],
        [{"ok": True, "records": []}],
        [{"ok": True, "records": []}],
        [{"ok": True, "records": []}],
    ])
    reg = BrokerStore(peer_path)
    t = reg.take_ticket(constraints={"count": 1}, requester=Requester(kind="api", kernel_id="q"))
    assert (t.record.kind, t.record.seq, t.record.constraints) == ("ticket", 3, {"count": 1})
    t.detach()
    assert reg.list_leases() == []
    assert reg.scan() == ScanResult()
    assert reg.live_records() == ([], [])
    peer.close()
    assert peer.requests == [
        {"op": "ticket", "constraints": {"count": 1}, "exclusive": False,
         "holder": {"kernel_id": "q", "notebook_path": None, "command": None, "kind": "api"},
         "ignore_ids": [], "ignore_kernel": None},
        {"op": "leases", "tickets": False, "after": None},
        {"op": "leases", "tickets": True, "after": None},
        {"op": "leases", "tickets": True, "after": None},
    ]


def test_a_bad_ticket_reply_closes_its_connection(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True, "record": {"kind": "ticket"}}]])
    with pytest.raises(LeaseStoreError) as err:
        BrokerStore(peer_path).take_ticket(constraints={})
    assert str(err.value) == f"lease broker at {peer_path} sent a bad record: 'lease_id'"
    peer.close()
    assert peer.client_closed == [True]  # at once, while the error is still held


def test_records_are_sorted_and_our_hidden_ones_left_out(peer_path: str) -> None:
    me = os.geteuid()
    other = me + 1000
    records = [
        payload("L3", created_s=5.0, uid=me),
        payload("L2", created_s=1.0, uid=other, kernel_id="kk"),
        payload("L1", created_s=5.0, uid=me, kernel_id="kk"),
        payload("L0", created_s=9.0, uid=other),
        payload("L4", created_s=2.0, uid=me, kernel_id=None),
        payload("T2", kind="ticket", seq=2, created_s=1.0),
        payload("T1", kind="ticket", seq=None, created_s=8.0),
        payload("T3", kind="ticket", seq=2, created_s=0.5),
        payload("T0", kind="ticket", seq=2, created_s=0.5),
        payload("T5", kind="ticket", seq=1, created_s=0.1),
    ]
    # begin: our own leases in full, others' as booking rows (see the view test below)
    begin = {"ok": True, "own": [records[0], records[2], records[4]], "devices": [
        {"uuid": "GPU-p", "rows": [[False, 10, None, "bob", "x.ipynb"]],
         "more": {"leases": 1, "exclusive": False, "booked": 0}}], "tickets": records[5:]}
    peer = Peer(peer_path, [
        [{"ok": True, "records": records[:5]}],
        [{"ok": True, "records": records[:5]}],
        [{"ok": True, "records": records}],
        [begin],
        [begin],
    ])
    reg = BrokerStore(peer_path)
    assert ids(reg.list_leases()) == ["L2", "L4", "L1", "L3", "L0"]
    view = reg.hiding(lease_ids=["L3", "L0"], kernel_id="kk")
    assert ids(view.list_leases()) == ["L2", "L4", "L0"]  # never another user's
    leases, tickets = reg.live_records()
    assert ids(leases) == ["L2", "L4", "L1", "L3", "L0"]
    assert ids(tickets) == ["T1", "T5", "T0", "T3", "T2"]
    rows = ["view" + "0" * 28, "view" + "0" * 27 + "1"]
    with reg.hiding(lease_ids=["L4"]).locked() as txn:
        assert ids(txn.live_leases()) == ["L3", "L1", *rows]
        assert ids(txn.live_tickets()) == ["T1", "T5", "T0", "T3", "T2"]
        assert (ids(reg.live_records(txn)[0]), ids(reg.live_records(txn)[1])) == (
            ["L3", "L1", *rows], ["T1", "T5", "T0", "T3", "T2"])
    with reg.hiding(kernel_id="kk").locked() as txn:
        assert ids(txn.live_leases()) == ["L3", "L4", *rows]
    peer.close()


def test_the_booking_view_gives_the_decision_what_the_records_would() -> None:
    """Rows are leases as they are; ``more`` is as many leases, the first booking all of
    theirs (their pids unknown, so counted even where NVML lists one: never less)."""
    from autogpu_jupyter.core.decision import bookings_for

    devices = [
        {"uuid": "GPU-a", "rows": [[True, 7, 5 * GiB, "bob", "train.ipynb"],
                                   [False, 8, None, "eve", ""]],
         "more": {"leases": 3, "exclusive": False, "booked": 2 * GiB}},
        {"uuid": "GPU-b", "rows": [], "more": {"leases": 1, "exclusive": True, "booked": 0}},
    ]
    recs = wire.view_records(devices, "/s")
    assert [(r.device_uuids, r.exclusive, r.pid, r.device_requested_bytes, r.user,
             r.notebook_path) for r in recs] == [
        (("GPU-a",), True, 7, (5 * GiB,), "bob", "train.ipynb"),
        (("GPU-a",), False, 8, (None,), "eve", None),
        (("GPU-a",), False, 0, (2 * GiB,), "others", None),
        (("GPU-a",), False, 0, (None,), "others", None),
        (("GPU-a",), False, 0, (None,), "others", None),
        (("GPU-b",), True, 0, (0,), "others", None),
    ]
    # the folded leases past a device's first are alike (they book nothing): one record,
    # given once per lease (a pick with 10,000 leases makes no 10,000 records; issue 39)
    assert recs[3] is recs[4] and len({r.lease_id for r in recs}) == 5
    assert all(r.uid == -1 for r in recs)
    assert recs[0].holder_text() == "bob: train.ipynb"
    snaps = [DeviceSnapshot(index=i, uuid=u, name="x") for i, u in enumerate(("GPU-a", "GPU-b"))]
    got = bookings_for(snaps, recs)
    assert (got["GPU-a"].lease_count, got["GPU-a"].booked_bytes, got["GPU-a"].exclusive) == (
        5, 7 * GiB, True)
    assert (got["GPU-b"].lease_count, got["GPU-b"].exclusive) == (1, True)
    with pytest.raises(LeaseStoreError, match="sent a bad booking view"):
        wire.view_records([{"uuid": "GPU-a", "rows": [[True]]}], "/s")
    # made up for the view: no host, no age, each named by the broker it came from
    assert {(r.host, r.created_s) for r in recs} == {("", 0.0)}
    assert [r.path for r in recs] == [f"/s#{r.lease_id}" for r in recs]


def test_set_pid_takes_the_record_the_broker_sends_back(peer_path: str) -> None:
    peer = Peer(peer_path, [[
        {"ok": True},
        {"ok": True, "record": payload("S1")},
        {"ok": True, "record": payload("S1", pid=4242)},
        {"ok": True},
    ]])
    with BrokerStore(peer_path).locked() as txn:
        lease = txn.create(devices=["GPU-p"])
    lease.set_pid(4242)
    assert lease.record.pid == 4242
    assert lease.record.path == f"{peer_path}#S1"
    lease.release()
    peer.close()
    assert peer.requests[2:] == [{"op": "set_pid", "pid": 4242}, {"op": "release"}]


def test_a_release_the_broker_lost_is_sent_again_by_id(peer_path: str) -> None:
    peer = Peer(peer_path, [
        [{"ok": True}, {"ok": True, "record": payload("O1")}, DROP],
        [{"ok": False, "error": "no lease 'O1' of yours is orphaned"}],
    ])
    with BrokerStore(peer_path).locked() as txn:
        lease = txn.create(devices=["GPU-p"])
    lease.release()  # the refusal of the second try is not raised
    assert not lease.held
    peer.close()
    assert peer.requests[2:] == [{"op": "release"}, {"op": "release", "lease_id": "O1"}]


def test_a_ticket_whose_release_was_lost_is_released_by_id(peer_path: str) -> None:
    ticket = payload("T9", kind="ticket", seq=1, constraints={})
    peer = Peer(peer_path, [[{"ok": True, "record": ticket}, DROP], [{"ok": True}]])
    t = BrokerStore(peer_path).take_ticket(constraints={})
    t.release()
    peer.close()
    assert peer.requests[1:] == [{"op": "release"}, {"op": "release", "lease_id": "T9"}]


def test_a_reply_without_records_lists_none(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True}]])
    assert BrokerStore(peer_path).list_leases() == []
    peer.close()


class TimeoutSpy:
    """The timeouts the client sets on its sockets, in order (this thread's only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[float | None] = []
        real = socket.socket.settimeout
        me = threading.current_thread()

        def settimeout(sock: socket.socket, value: float | None) -> None:
            if threading.current_thread() is me:
                self.seen.append(value)
            real(sock, value)

        monkeypatch.setattr(socket.socket, "settimeout", settimeout)


def test_how_long_each_request_waits_for_the_broker(
    peer_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = Peer(peer_path, [
        [{"ok": True}, {"ok": True, "record": payload("Q1")},
         {"ok": True, "record": payload("Q1", pid=9)}, DROP],
        [{"ok": True}],
        [{"ok": True, "records": []}],
    ])
    spy = TimeoutSpy(monkeypatch)
    reg = BrokerStore(peer_path, lock_timeout_s=7.5)
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-p"])
    lease.set_pid(9)
    lease.release()
    reg.list_leases()
    peer.close()
    # begin: the lock timeout (its send, then its answer, read when the view is needed);
    # lease: 30 s; set_pid: 10 s; release (and by id): 5 s; each call leaves its socket
    # blocking again.
    assert spy.seen == [7.5, None, 7.5, None, 30.0, None, 10.0, None, 5.0, None, 5.0, None,
                        30.0, None]


def test_lease_events_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    import select

    timeouts: list[float] = []
    real = select.select

    def spy(r: Any, w: Any, x: Any, timeout: float) -> Any:
        timeouts.append(timeout)
        return real(r, w, x, timeout)

    monkeypatch.setattr(select, "select", spy)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert lease_events(ours.fileno()) == []
    assert timeouts == [0]


def test_a_release_with_no_broker_left_is_quiet(peer_path: str) -> None:
    peer = Peer(peer_path, [[{"ok": True}, {"ok": True, "record": payload("O2")}, CLOSE]])
    reg = BrokerStore(peer_path, connect_timeout_s=0)
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-p"])
    peer.close()
    os.unlink(peer_path)
    lease.release()
    assert not lease.held


# ---- records from the wire ----------------------------------------------------------------


def test_from_wire_types_every_field() -> None:
    d = payload("W1", kind="ticket", device_uuids=["GPU-x", 7], device_requested_bytes=["5", None],
                exclusive=1, user="alice", uid="1001", host="node", pid="77", created_s="3.5",
                kernel_id=12, notebook_path="a.ipynb", command="run", holder_kind="api",
                seq="4", constraints={"count": 1})
    assert from_wire(d, "/s") == LeaseRecord(
        lease_id="W1", kind="ticket", device_uuids=("GPU-x", "7"),
        device_requested_bytes=(5, None), exclusive=True, user="alice", uid=1001, host="node",
        pid=77, created_s=3.5, kernel_id="12", notebook_path="a.ipynb", command="run",
        holder_kind="api", seq=4, constraints={"count": 1}, live=True, path="/s#W1",
    )


@pytest.mark.parametrize(
    ("over", "field", "value"),
    [
        ({"kernel_id": None}, "kernel_id", None),
        ({"notebook_path": None}, "notebook_path", None),
        ({"command": None}, "command", None),
        ({"command": 5}, "command", "5"),
        ({"holder_kind": None}, "holder_kind", "process"),
        ({"holder_kind": ""}, "holder_kind", "process"),
        ({"holder_kind": "kernel"}, "holder_kind", "kernel"),
        ({"seq": None}, "seq", None),
        ({"seq": 0}, "seq", 0),
        ({"constraints": ["count"]}, "constraints", None),
        ({"constraints": None}, "constraints", None),
        ({"constraints": {}}, "constraints", {}),
        ({"exclusive": 0}, "exclusive", False),
    ],
)
def test_from_wire_optional_fields(over: dict[str, Any], field: str, value: Any) -> None:
    rec = from_wire(payload("W2", **over), "/s")
    assert getattr(rec, field) == value
    assert rec.live is True
    assert rec.path == "/s#W2"


def test_from_wire_leaves_out_fields_a_lease_lacks() -> None:
    d = payload("W3")
    for key in ("kernel_id", "notebook_path", "command", "holder_kind"):
        del d[key]
    rec = from_wire(d, "/s")
    assert (rec.kernel_id, rec.notebook_path, rec.command, rec.holder_kind, rec.seq,
            rec.constraints) == (None, None, None, "process", None, None)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"kind": None}, "'kind'"),
        ({"pid": "x"}, "invalid literal for int() with base 10: 'x'"),
        ({"device_uuids": None}, "'NoneType' object is not iterable"),
        ({"created_s": "soon"}, "could not convert string to float: 'soon'"),
    ],
)
def test_a_bad_record_from_the_broker_is_an_error(
    peer_path: str, bad: dict[str, Any], why: str
) -> None:
    rec = payload("B1")
    for key, value in bad.items():
        if value is None and key == "kind":
            del rec[key]
        else:
            rec[key] = value
    peer = Peer(peer_path, [[{"ok": True, "records": [payload("B0"), rec]}]])
    with pytest.raises(LeaseStoreError) as err:
        BrokerStore(peer_path).list_leases()
    assert str(err.value) == f"lease broker at {peer_path} sent a bad record: {why}"
    peer.close()


# ---- events on a lease connection ---------------------------------------------------------


def _revoked(lease_id: str) -> str:
    return (
        f"your GPU lease {lease_id} was revoked by the admin: this kernel no longer holds it; "
        "others may now be given its GPU"
    )


@pytest.mark.parametrize(
    ("sent", "events"),
    [
        (b"", []),
        (b'{"event": "revoked", "lease_id": "abc"}\n', [_revoked("abc")]),
        (b'{"event": "revoked", "lease_id": "' + b"a" * 40 + b'"}\n', [_revoked("a" * 32)]),
        (b'{"event": "revoked"}\n', [_revoked("")]),
        (b'{"event": "revoked", "lease_id": 7}\n{"event": "revoked", "lease_id": "b"}\n',
         [_revoked("7"), _revoked("b")]),
        (b'junk\n{"event": "replaced"}\n["revoked"]\n{"lease_id": "c"}\n', []),
        (b'junk\n{"event": "revoked", "lease_id": "d"}', [_revoked("d")]),
        (b'{"event": "ticket_lapsed", "lease_id": "' + b"e" * 40 + b'", "message": "x"}\n',
         [f"your place in the GPU waiting line (ticket {'e' * 32}) lapsed: a device was free "
          "for it but no lease was taken; pick again to wait again"]),
    ],
)
def test_lease_events_says_what_the_broker_sent(sent: bytes, events: list[str]) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if sent:
            theirs.sendall(sent)
        assert lease_events(ours.fileno()) == events
        assert lease_events(ours.fileno()) == []  # read once


def test_lease_events_reads_64_kib_at_a_time() -> None:
    junk = b"x" * 65535 + b"\n"
    event = b'{"event": "revoked", "lease_id": "late"}\n'
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(junk + event)
        assert lease_events(ours.fileno()) == []
        assert lease_events(ours.fileno()) == [_revoked("late")]


def test_lease_events_says_when_the_broker_closed_the_lease() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        theirs.close()
        assert lease_events(ours.fileno()) == [
            "the lease broker closed this kernel's lease connection: a broker that restarted "
            "keeps the lease while this kernel runs (`autogpu leases` shows it); else the lease "
            "has ended"
        ]


def test_lease_events_of_a_pipe_or_a_closed_fd_are_none() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b'{"event": "revoked", "lease_id": "p"}\n')
        assert lease_events(r) == []  # not a socket: a lease file's descriptor, say
    finally:
        os.close(r)
        os.close(w)
    assert lease_events(999_999) == []  # not open


def test_the_booking_views_reservations_are_the_admissions_pseudo_leases() -> None:
    """The devices the admin reserved away from the caller come apart in the booking view, so
    the client ranks them out as the admission words them ("reserved for group(s) ml by the
    admin"), not as "held exclusively by another lease" (a plain row would say that)."""
    from autogpu_jupyter.core.leasing import admission

    got = wire.reservations({"GPU-r1": ["ml", "staff"]}, "/b.sock")
    assert [(r.device_uuids, r.exclusive, admission.is_reservation(r)) for r in got] == [
        (("GPU-r1",), True, True)]
    assert admission.exclusive_phrase(got[0]) == "reserved for group(s) ml, staff by the admin"
    assert wire.reservations(None, "/b.sock") == []
    many = wire.reservations({"GPU-r2": ["g"] * 70}, "/b.sock")
    assert many[0].user == "reserved for " + ",".join(["g"] * 64)  # at most 64 groups named
    assert many[0].host == ""
    with pytest.raises(LeaseStoreError, match="sent a bad booking view"):
        wire.reservations(["GPU-r1"], "/b.sock")


# ---- the broker's own checks, in this process (the tests here run as root) ----------------


def _person(broker: Broker, uid: int) -> Any:
    from autogpu_jupyter.broker import Conn
    from autogpu_jupyter.brokerd.identity import Account

    return Conn(broker, uid, uid, os.getpid(), Account(uid, f"user{uid}", frozenset()))


def test_a_barred_person_waits_out_the_bar_and_others_join_the_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: the bar's comparison inverted (every person never barred was refused a place in
    the line, the barred one let in): only the real-users tests saw it, root being exempt."""
    import types

    from autogpu_jupyter.broker import LINE_BAR_S, BrokerRefusal
    from autogpu_jupyter.brokerd import book as book_mod
    from tests.unit.test_broker_rules import ticket_record

    now = [1000.0]  # the book's clock, moved by hand
    monkeypatch.setattr(book_mod, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], time=time.time))
    b = Broker(BrokerConfig(socket_path="/nonexistent/b.sock"))
    alice, bob = _person(b, 1001), _person(b, 1002)
    b.book.may_join(alice)  # nobody barred: both join
    b.book.may_join(bob)
    b.book.bar_from_line(alice.key, ticket_record(b, alice))  # as a lapse of alice's ticket
    now[0] += LINE_BAR_S - 1.0
    with pytest.raises(BrokerRefusal, match=r"^user1001 left a place in the waiting line"):
        b.book.may_join(alice)
    b.book.may_join(bob)  # one person's bar is nobody else's
    now[0] += 1.0  # the bar is over
    b.book.may_join(alice)


def test_root_may_name_any_users_process_as_a_leases_holder(reg: BrokerStore) -> None:
    """``set_pid``: a user may name only a process of theirs; root (the provisioner of a root
    server) any process. Caught: the root exemption inverted (root refused another user's
    kernel process, the check skipped for everyone else)."""
    child = subprocess.Popen(["sleep", "30"], user="nobody")
    try:
        with reg.locked() as txn:
            lease = txn.create(devices=["GPU-sp1"])
        try:
            lease.set_pid(child.pid)
            assert lease.record.pid == child.pid
        finally:
            lease.release()
    finally:
        child.kill()
        child.wait()


# ---- tickets that lapse ----------------------------------------------------------------------


GPU_L = "GPU-1a000000-0000-4000-8000-00000000000a"


def _one_gpu(path: Path, used_gib: int) -> Path:
    path.write_text(json.dumps({"driver_version": "550.54.15", "devices": [
        {"uuid": GPU_L, "name": "NVIDIA A100", "memory_total": 80 * 2**30,
         "memory_used": used_gib * 2**30, "utilization_pct": 0}]}))
    return path


@pytest.mark.parametrize(("used_gib", "lapses"), [(0, True), (75, False)])
def test_a_ticket_the_broker_could_serve_but_that_is_not_taken_lapses(
    short_dir: Path, used_gib: int, lapses: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A place in the line is for waiting: a ticket for which a device is free, not turned
    into a lease within ``ticket_grace_s``, loses its place (its holder is told, its connection
    closed); one for which nothing is free keeps it. Caught: neither was run by a fast test
    before (the broker's line check ran only in the slow multi-user tests)."""
    from autogpu_jupyter.core import decision
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    fleet = _one_gpu(short_dir / f"fleet-{used_gib}.json", used_gib)
    caplog.set_level(logging.INFO, logger="autogpu")
    tb = ThreadBroker(str(short_dir / f"lapse-{used_gib}.sock"), ticket_grace_s=0.0)
    tb.broker.fleet.backend = SimulatedBackend(str(fleet))
    reg = BrokerStore(tb.path, connect_timeout_s=2.0)
    try:
        wanted = Constraints(min_free=parse_size("10G"))
        ticket = reg.take_ticket(constraints=decision.ticket_constraints(wanted, [GPU_L]))
        assert ids(reg.list_tickets()) == [ticket.record.lease_id]
        asyncio.run_coroutine_threadsafe(
            tb.broker.restorer.lapse_round(tb.loop), tb.loop).result(10)
        fd = ticket.fileno()
        if lapses:
            wait_until(lambda: reg.list_tickets() == [])
            wait_until(lambda: bool(select.select([fd], [], [], 0)[0]))
            told = [json.loads(line) for line in os.read(fd, 65536).splitlines()]
            assert [(e["event"], e["lease_id"], e["message"]) for e in told] == [(
                "ticket_lapsed", ticket.record.lease_id,
                "your place in the waiting line (ticket 1) lapsed: a device was free for it "
                "for 0 s but no lease was taken",
            )]
            assert os.read(fd, 65536) == b""  # then closed
            assert tb.broker.book.lapsed == 1
            assert (f"ticket 1 of {reg.user} lapsed: it could be served for 0 s but was not "
                    "taken") in [r.getMessage() for r in caplog.records]
        else:
            assert ids(reg.list_tickets()) == [ticket.record.lease_id]
            assert select.select([fd], [], [], 0)[0] == []  # told nothing, still open
            assert tb.broker.book.lapsed == 0
        ticket.release()
    finally:
        tb.crash()


@pytest.mark.skipif(not ROOT, reason="needs root to act as another user")
def test_a_pick_through_the_broker_ranks_on_the_view_given_under_its_lock(tmp_path: Path) -> None:
    """A user outside a reserved device's groups is ranked off it by the view ``begin`` answers
    under the pick lock. Caught: a pick that ranks on an unlocked read of the leases (which has
    no reservations) chose the reserved GPU, and the broker refused its lease."""
    import pwd

    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from tests.leasehelpers import fleet, uuid_of

    nobody = pwd.getpwnam("nobody")
    spec = tmp_path / "two.json"
    spec.write_text(json.dumps(fleet(2)))
    snap = SimulatedBackend(str(spec)).snapshot()  # read as root: nobody cannot enter tmp_path

    class Fixed:
        def snapshot(self) -> Any:
            return snap

    where = Path(tempfile.mkdtemp(prefix="agr-", dir="/tmp"))
    where.chmod(0o755)  # nobody must reach the socket
    b = ThreadBroker(str(where / "r.sock"), reserved={uuid_of(0): ["autogpu-test-nogroup"]})
    try:
        os.seteuid(nobody.pw_uid)  # the broker reads the caller from its socket: nobody
        try:
            result = pick(PickOptions(Constraints()), backend=Fixed(), environ={},  # type: ignore[arg-type]
                          store=BrokerStore(b.path, connect_timeout_s=2.0))
        finally:
            os.seteuid(0)
        assert [d.uuid for d in result.chosen] == [uuid_of(1)]
        assert result.lease is not None and result.lease_note is None
        assert result.candidate(uuid_of(0)).reasons == (  # type: ignore[union-attr]
            "reserved for group(s) autogpu-test-nogroup by the admin",)
        result.lease.release()
    finally:
        b.crash()
        (where / "r.sock").unlink(missing_ok=True)
        where.rmdir()


# ---- the refusal a closed broker left in the socket (found by the mutation run of issue 22) ----
# _Conn._left_behind over a stand-in socket: the number of reads it makes (its wait) has no other
# reading short of timing it.
_MAX = brokerclient._MAX_LINE
_REFUSAL = {"ok": False, "error": "too many connections"}
_LINE = json.dumps(_REFUSAL).encode() + b"\n"


class _Sock:
    """A socket with chunks waiting; reading past them times out (a broker still there)."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.sizes: list[int] = []

    def recv(self, size: int) -> bytes:
        self.sizes.append(size)
        if not self.chunks:
            raise TimeoutError("timed out")
        return self.chunks.pop(0)


def _left(*chunks: bytes) -> tuple[dict[str, Any] | None, int]:
    conn = object.__new__(brokerclient._Conn)
    conn.path = "/run/broker.sock"
    conn.sock = _Sock(*chunks)  # type: ignore[assignment]
    conn._buf = b""
    got = conn._left_behind()
    sizes = conn.sock.sizes  # type: ignore[attr-defined]
    assert set(sizes) <= {65536}
    return got, len(sizes)


_PREFIX = b'{"ok": false, "error": "'


@pytest.mark.parametrize(
    ("chunks", "got", "reads"),
    [
        # a whole line: no waiting for more (it would time out)
        ((_LINE,), _REFUSAL, 1),
        # in two pieces
        ((_LINE[:10], _LINE[10:]), _REFUSAL, 2),
        # the first line only, whatever follows
        ((_LINE + b'{"ok": true}\n',), _REFUSAL, 1),
        # no line end before the broker closed: no whole refusal
        ((_LINE[:-1], b""), None, 2),
        # exactly the longest line without its end: one more read
        ((_PREFIX + b"x" * (_MAX - len(_PREFIX)), b'"}\n'),
         {"ok": False, "error": "x" * (_MAX - len(_PREFIX))}, 2),
        # longer: no more reads
        ((_PREFIX + b"x" * (_MAX + 1 - len(_PREFIX)), b'"}\n'), None, 1),
    ],
)
def test_the_refusal_left_behind_is_one_whole_first_line(
    chunks: tuple[bytes, ...], got: dict[str, Any] | None, reads: int
) -> None:
    """Caught: reading on after a line end (``or``, a misspelt separator: it waited and timed
    out), ``< _MAX_LINE``, 65537 bytes a read, a chunk replacing the buffer, a line without its
    end parsed, the last line taken (``rpartition``) or no line split at all."""
    assert _left(*chunks) == (got, reads)


def test_the_wire_spells_the_store_errors_as_the_previous_release_did() -> None:
    """Issue 42 renamed the error classes (``LeaseStoreError`` ...), not the wire: a refusal's
    ``type`` is still ``RegistryError`` / ``RegistryUntrustedError``, so a client of the previous
    release still fails closed on a broker that cannot record its lease, and a client of this one
    reads a previous broker's refusals as its own errors."""
    from autogpu_jupyter.core.leasing import wire
    from autogpu_jupyter.errors import (
        LeaseLimitError,
        LeaseStoreError,
        LeaseStoreUnreachableError,
        LeaseStoreUntrustedError,
    )

    assert wire.wire_kind(LeaseStoreError("x")) == "RegistryError"
    assert wire.wire_kind(LeaseStoreUntrustedError("x")) == "RegistryUntrustedError"
    assert wire.wire_kind(LeaseStoreUnreachableError("x")) == "RegistryUnreachableError"
    assert wire.wire_kind(LeaseLimitError("x")) == "LeaseLimitError"
    assert wire.ERRORS["RegistryUntrustedError"] is LeaseStoreUntrustedError
    assert "LeaseStoreUntrustedError" not in wire.ERRORS
