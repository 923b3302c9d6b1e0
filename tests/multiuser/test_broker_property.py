"""A property test of the broker: random leases, tickets, releases, closes and restarts from
several uids against a real root broker process (hypothesis, stateful).

Four agents, each a forked process that ``setuid``s to its uid and holds its connections:
``nobody``; ``daemon``; the first subordinate uid of ``daemon`` (``--subuid-file``: the same person
as ``daemon``); and a uid that is nobody's (the shared bucket of unknown uids). The broker runs with
``--max-devices-per-user 2`` (the unknown bucket: 1) on 4 simulated GPUs. After every step, from
the broker's own status:

* no device is held exclusively by one lease and held by another at the same time;
* no person holds leases on more devices than their limit;
* the live leases and tickets are exactly those the model says are held (granted, and whose
  connection or orphan has not ended);
* a restart (SIGKILL, then a new broker on the same journal) keeps exactly the same live set.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from autogpu_jupyter.core.leasing.brokerclient import BrokerStore
from tests.brokerhelpers import BrokerProc, broker_area, wire
from tests.leasehelpers import uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids"),
]

SUB_FIRST = 420000
UNKNOWN_UID = 431234
LIMIT = {"nobody": 2, "daemon": 2, "unknown uids": 1}


class Agent:
    """A forked process as ``uid``: opens connections and speaks on them when told (one JSON
    command per line on a pipe, one JSON answer back)."""

    def __init__(self, name: str, uid: int, gid: int, path: str) -> None:
        self.name = name
        c_r, c_w = os.pipe()
        a_r, a_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.close(c_w)
                os.close(a_r)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                _agent_loop(path, os.fdopen(c_r, "rb"), os.fdopen(a_w, "wb", buffering=0))
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(c_r)
        os.close(a_w)
        self._cmd = os.fdopen(c_w, "wb", buffering=0)
        self._ans = os.fdopen(a_r, "rb")

    def do(self, **cmd: Any) -> Any:
        self._cmd.write(json.dumps(cmd).encode() + b"\n")
        line = self._ans.readline()
        assert line, f"agent {self.name} ended"
        return json.loads(line)

    def stop(self) -> None:
        self._cmd.close()
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self._ans.close()


def _agent_loop(path: str, cmds: Any, out: Any) -> None:
    conns: dict[int, socket.socket] = {}
    n = 0
    for raw in cmds:
        cmd = json.loads(raw)
        answer: Any = None
        if cmd["do"] in ("lease", "ticket"):
            n += 1
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(20)
            s.connect(path)
            msg: dict[str, Any] = {"op": cmd["do"], "exclusive": cmd["exclusive"]}
            if cmd["do"] == "lease":
                msg["devices"] = cmd["devices"]
            else:
                msg["constraints"] = {
                    "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None,
                    "count": cmd["count"], "exclude": [], "exclusive": cmd["exclusive"],
                    "allowed_uuids": None}
            try:
                s.sendall(wire(msg))
            except OSError:  # refused at once (a connection cap): its one line is still there
                pass
            reply = json.loads(s.makefile("rb").readline() or b"{}")
            if reply.get("ok"):
                conns[n] = s
                answer = {"conn": n, "id": reply["record"]["lease_id"]}
            else:
                s.close()
                answer = {"refused": reply.get("type"), "error": reply.get("error")}
        elif cmd["do"] == "close":
            conns.pop(cmd["conn"]).close()
            answer = {}
        elif cmd["do"] == "release":  # on its own connection; by id after a restart
            s = conns[cmd["conn"]]
            try:
                s.sendall(wire({"op": "release"}))
                reply = json.loads(s.makefile("rb").readline() or b"{}")
            except OSError:
                reply = {}
            if not reply.get("ok"):
                with socket.socket(socket.AF_UNIX) as t:
                    t.settimeout(20)
                    t.connect(path)
                    t.sendall(wire({"op": "release", "lease_id": cmd["id"]}))
                    reply = json.loads(t.makefile("rb").readline())
            conns.pop(cmd["conn"]).close()
            answer = {"ok": bool(reply.get("ok"))}
        out.write(json.dumps(answer).encode() + b"\n")


def _uids() -> dict[str, tuple[int, int]]:
    nobody = pwd.getpwnam("nobody")
    daemon = pwd.getpwnam("daemon")
    return {
        "nobody": (nobody.pw_uid, nobody.pw_gid),
        "daemon": (daemon.pw_uid, daemon.pw_gid),
        "daemon-sub": (SUB_FIRST, SUB_FIRST),
        "unknown": (UNKNOWN_UID, UNKNOWN_UID),
    }


PERSON = {"nobody": "nobody", "daemon": "daemon", "daemon-sub": "daemon", "unknown": "unknown uids"}


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    with broker_area() as root:
        (root / "subuid").write_text(f"daemon:{SUB_FIRST}:65536\n")
        rules = root / "rules.json"
        rules.write_text(json.dumps({"unknown_uids": {"max_devices": 1}}))
        broker = BrokerProc(root, "--max-devices-per-user", "2", "--ticket-grace", "3600",
                            "--subuid-file", str(root / "subuid"), "--rules", str(rules),
                            env={"AUTOGPU_SIMULATE": str(root / "fleet.json")})
        try:
            yield {"root": root, "broker": broker}
        finally:
            broker.stop()


class BrokerMachine(RuleBasedStateMachine):
    world: dict[str, Any]

    def __init__(self) -> None:
        super().__init__()
        self.broker: BrokerProc = self.world["broker"]
        self.reg = BrokerStore(str(self.broker.socket), connect_timeout_s=20)
        self.agents = {name: Agent(name, uid, gid, str(self.broker.socket))
                       for name, (uid, gid) in _uids().items()}
        self.held: dict[str, tuple[str, int, str]] = {}  # lease id -> (agent, conn, kind)

    @initialize()
    def start_clean(self) -> None:
        self._wait_live(set())

    # ---- what the users do ---------------------------------------------------------------

    @rule(agent=st.sampled_from(sorted(PERSON)),
          devices=st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
          exclusive=st.booleans())
    def lease(self, agent: str, devices: list[int], exclusive: bool) -> None:
        got = self.agents[agent].do(do="lease", devices=[uuid_of(i) for i in devices],
                                    exclusive=exclusive)
        if "id" in got:
            self.held[got["id"]] = (agent, got["conn"], "lease")
        else:
            assert _expected_refusal(got), got

    @rule(agent=st.sampled_from(sorted(PERSON)), count=st.integers(1, 4),
          exclusive=st.booleans())
    def ticket(self, agent: str, count: int, exclusive: bool) -> None:
        got = self.agents[agent].do(do="ticket", count=count, exclusive=exclusive)
        if "id" in got:
            self.held[got["id"]] = (agent, got["conn"], "ticket")
        else:  # the line's own rate limit, or (later) tickets admitted like leases
            assert _expected_refusal(got), got

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.held)))
        agent, conn, _ = self.held.pop(lease_id)
        self.agents[agent].do(do="close", conn=conn)
        self._wait_live(set(self.held))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.held)))
        agent, conn, _ = self.held.pop(lease_id)
        assert self.agents[agent].do(do="release", conn=conn, id=lease_id) == {"ok": True}
        self._wait_live(set(self.held))

    @rule()
    def restart(self) -> None:
        before = self._live()
        self.broker.restart()
        after = self._live()
        assert after == before  # nothing lost, nothing doubled, nothing kept that had ended

    # ---- what must hold after every step -----------------------------------------------------

    @invariant()
    def rules_hold(self) -> None:
        st_ = self.reg.status()
        by_device: dict[str, list[dict[str, Any]]] = {}
        per_person: dict[str, set[str]] = {}
        for r in st_["leases"]:
            for d in r["device_uuids"]:
                by_device.setdefault(d, []).append(r)
            per_person.setdefault(r["user"], set()).update(r["device_uuids"])
        for d, recs in by_device.items():
            if any(r["exclusive"] for r in recs):
                assert len(recs) == 1, (d, recs)  # held exclusively, and by nobody else
        for person, devs in per_person.items():
            assert len(devs) <= LIMIT[person], (person, devs)
        assert {r["lease_id"] for r in st_["leases"] + st_["tickets"]} == set(self.held)

    def _live(self) -> set[str]:
        st_ = self.reg.status()
        return {r["lease_id"] for r in st_["leases"] + st_["tickets"]}

    def _wait_live(self, want: set[str]) -> None:
        """The broker frees a closed lease when it reads the EOF (at once), an orphan's when
        its reaper sees no holder left (within about a second)."""
        deadline = time.monotonic() + 10
        live = self._live()
        while live != want and time.monotonic() < deadline:
            time.sleep(0.05)
            live = self._live()
        assert live == want

    def teardown(self) -> None:
        for a in self.agents.values():
            a.stop()
        self.held.clear()
        self._wait_live(set())


def _expected_refusal(got: dict[str, Any]) -> bool:
    """The refusals a sequence may meet: a device taken, a limit reached (the quota, the
    waiting line's rate, the unknown uids' few connections)."""
    if got.get("refused") in ("NoDeviceFitsError", "LeaseLimitError"):
        return True
    return got.get("refused") == "RegistryError" and "too many connections" in got["error"]


def test_random_sequences_from_several_uids_keep_the_rules(world: dict[str, Any]) -> None:
    BrokerMachine.world = world
    run_state_machine_as_test(BrokerMachine, settings=settings(
        max_examples=12, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))

