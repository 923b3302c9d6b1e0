"""The trusted lease broker (issue 11) against real Unix users, with the broker a real root process.

Users A and B (``useradd``; the tests run as root) run the real ``autogpu`` command (``runuser``)
or speak raw JSON on the broker's socket from a forked child that dropped to their uid. What
they see -- exit codes, the one line of an error, what ``autogpu leases`` shows -- is asserted,
and the broker's own ``autogpu broker status`` says what it holds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL, BrokerStore
from tests.brokerhelpers import Area, BrokerProc, raw_call, wire
from tests.leasehelpers import AsUser, as_user, ensure_user, shared_area, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

USER_A = "agtest-alice"
USER_B = "agtest-bob"


@pytest.fixture(scope="module")
def users() -> dict[str, tuple[int, int]]:
    return {"a": ensure_user(USER_A), "b": ensure_user(USER_B)}


@pytest.fixture
def area(users: dict[str, tuple[int, int]]) -> Iterator[Area]:
    with shared_area("autogpu-broker") as root:
        yield Area(root)


@pytest.fixture
def broker(area: Area) -> Iterator[BrokerProc]:
    # A ticket that could be served lapses after --ticket-grace (5 s by default): these tests
    # look at waiting tickets for longer than that with CLI runs as other users (seconds each
    # on a loaded host); the lapse itself is tested in test_broker_attacks.py and
    # tests/processes/test_broker_bounds.py.
    proc = BrokerProc(area.root, "--max-devices-per-user", "2", "--ticket-grace", "120",
                      env={"AUTOGPU_RECORD_COMMANDS": "1", "AUTOGPU_SIMULATE": str(area.fleet)})
    try:
        yield proc
    finally:
        proc.stop()


def _leases(st: dict[str, Any]) -> list[dict[str, Any]]:
    return list(st["leases"])


def _kill_group(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout


# ---- what a user does on the raw socket (run in a forked child as that user) --------------------


def _raw(path: str, *messages: Any) -> list[Any]:
    lines = [m if isinstance(m, bytes) else wire(m) for m in messages]
    return raw_call(path, *lines)


def _raw_hold(path: str, *messages: Any) -> Any:
    """Like :func:`_raw`, but keeps the connection (and what it holds) open in the child."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    replies = []
    f = s.makefile("rb")
    for m in messages:
        s.sendall(wire(m))
        replies.append(json.loads(f.readline()))
    _HELD.append((s, f))
    return replies


_HELD: list[Any] = []


# ---- a lease is a connection ---------------------------------------------------------------------


def test_sigkill_of_the_holder_frees_its_lease_and_commands_stay_private(
    area: Area, broker: BrokerProc
) -> None:
    holder = area.run_held(USER_A, "run", "--", "sleep", "60")
    try:
        st = broker.wait_for(lambda s: len(_leases(s)) == 1)
        assert st["per_user"] == {USER_A: {"leases": 1, "devices": 1, "tickets": 0}}
        # Root sees A's command line; B's `autogpu leases --json` shows A's lease without it.
        mine = BrokerStore(str(area.socket)).list_leases()
        assert mine[0].user == USER_A and "sleep 60" in (mine[0].command or "")
        seen = area.cli(USER_B, "leases", "--json")
        _no_traceback(seen)
        rows = json.loads(seen.stdout)
        assert [(r["user"], r["command"]) for r in rows] == [(USER_A, None)]
        assert "sleep" not in seen.stdout
    finally:
        _kill_group(holder)
    # SIGKILL: no cleanup step ran anywhere; the kernel closed the socket, the broker freed it.
    broker.wait_for(lambda s: _leases(s) == [], timeout=5)
    # ... and the shared-directory registry was never used.
    assert not area.registry.exists() or not any(area.registry.rglob("*.lease"))


def test_a_lease_passed_to_the_command_lives_as_long_as_the_command(
    area: Area, broker: BrokerProc
) -> None:
    # `autogpu run` hands the lease's socket to CMD (pass_fds): killing only the wrapper keeps it.
    holder = area.run_held(USER_A, "run", "--", "sleep", "60")
    try:
        broker.wait_for(lambda s: len(_leases(s)) == 1)
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text()
        wrapper = int(children.split()[0])
        os.kill(wrapper, signal.SIGKILL)
        time.sleep(1.0)
        assert len(_leases(broker.status())) == 1
    finally:
        _kill_group(holder)
    broker.wait_for(lambda s: _leases(s) == [], timeout=5)


# ---- quotas and identity -------------------------------------------------------------------------


def test_a_user_cannot_exceed_max_devices_per_user_by_cli_or_raw_socket(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    held = [area.run_held(USER_B, "run", "--", "sleep", "60") for _ in range(2)]
    try:
        broker.wait_for(lambda s: s["per_user"].get(USER_B, {}).get("devices") == 2)
        # The CLI: a third device is refused, exit 3, one line naming the admin's limit.
        third = area.cli(USER_B, "run", "--", "true")
        _no_traceback(third)
        assert third.returncode == 3, third.stderr
        assert "max_devices_per_user = 2" in third.stderr
        assert "enforced by the broker" in third.stderr
        # Raw socket, no pick lock, forged identity fields: still B, still refused.
        uid, gid = users["b"]
        free = [uuid_of(i) for i in range(4)]
        replies = as_user(uid, gid, _raw, str(area.socket), {
            "op": "lease", "devices": free[:4], "uid": 0, "user": "root",
            "holder": {"kind": "cli", "uid": 0, "user": "root", "pid": 1},
        })
        assert replies[0]["ok"] is False and replies[0]["type"] == "LeaseLimitError", replies
        assert f"{USER_B} already holds leases on 2 device(s)" in replies[0]["error"]
        # "Replacing" another user's lease (what a re-pick says of its own) ends nothing:
        # A's lease still holds against B's exclusive ask.
        a_holds = area.run_held(USER_A, "run", "--", "sleep", "60")
        held.append(a_holds)
        st = broker.wait_for(lambda s: USER_A in s["per_user"])
        a_lease = next(r for r in st["leases"] if r["user"] == USER_A)
        replies = as_user(uid, gid, _raw, str(area.socket), {
            "op": "lease", "devices": a_lease["device_uuids"], "exclusive": True,
            "ignore_ids": [a_lease["lease_id"]], "ignore_kernel": None,
        })
        assert replies[0]["type"] == "NoDeviceFitsError", replies
        # Replacing its own leases (a re-pick) ends them: it can never add to the quota.
        st = broker.status()
        own = [r["lease_id"] for r in st["leases"] if r["user"] == USER_B]
        replies = as_user(uid, gid, _raw, str(area.socket), {
            "op": "lease", "devices": free[2:4], "ignore_ids": own,
        })
        assert replies[0]["ok"] is True, replies  # ended with the child's connection
        st = broker.wait_for(lambda s: USER_B not in s["per_user"])
        assert [r["user"] for r in st["leases"]] == [USER_A]
        # A is not limited by B's leases.
        other = area.cli(USER_A, "run", "--", "true")
        assert other.returncode == 0, other.stderr
    finally:
        for p in held:
            _kill_group(p)


def test_forged_identity_fields_are_ignored_peer_credentials_win(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["b"]
    child = AsUser(uid, gid, _raw_hold, str(area.socket), {
        "op": "lease", "devices": [uuid_of(0)], "exclusive": True,
        "uid": 0, "user": "root", "pid": 1, "lease_id": "0" * 32,
        "holder": {"kind": "kernel", "notebook_path": "x\tb\u202e.ipynb", "pid": 1, "uid": 0},
    }, hold=True)
    try:
        reply = child.result()[0]
        assert reply["ok"] is True, reply
        rec = reply["record"]
        assert (rec["uid"], rec["user"], rec["pid"]) == (uid, USER_B, child.pid)
        assert rec["lease_id"] != "0" * 32
        assert "\t" not in rec["notebook_path"]
        # B's exclusive lease holds against root's pick of that device, through the broker.
        st = broker.status()
        assert [(r["user"], r["uid"], r["exclusive"]) for r in st["leases"]] == [
            (USER_B, uid, True)
        ]
        pick = area.cli(USER_A, "run", "--exclude", "1,2,3", "--", "true")
        assert pick.returncode == 3, pick.stdout + pick.stderr
        # B cannot release or revoke what is not B's.
        replies = as_user(users["a"][0], users["a"][1], _raw, str(area.socket),
                          {"op": "release", "lease_id": rec["lease_id"]},
                          {"op": "revoke", "lease_id": rec["lease_id"]})
        assert [r["ok"] for r in replies[:2]] == [False, False], replies
        assert "revoke needs root" in replies[1]["error"]
        assert len(broker.status()["leases"]) == 1
    finally:
        child.stop()
    broker.wait_for(lambda s: _leases(s) == [], timeout=5)


def test_oversized_or_malformed_messages_close_only_that_connection(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["b"]
    keeper = AsUser(uid, gid, _raw_hold, str(area.socket),
                    {"op": "lease", "devices": [uuid_of(1)]}, hold=True)
    try:
        assert keeper.result()[0]["ok"] is True
        path = str(area.socket)
        big = as_user(uid, gid, _raw, path, b'{"op": "status", "x": "' + b"a" * 100_000 + b'"}\n')
        assert big[-1] == "closed"
        assert any("longer than 65536 bytes" in r.get("error", "") for r in big[:-1]), big
        junk = as_user(uid, gid, _raw, path, b"not json\n", {"op": "status"})
        assert junk == [{"ok": False, "error": "malformed message (not JSON): connection closed",
                         "type": "RegistryError", "proto": PROTOCOL}, "closed"]
        deep = as_user(uid, gid, _raw, path, b"[" * 60_000 + b"\n")
        assert deep[-1] == "closed" and "malformed" in deep[0]["error"]
        unknown = as_user(uid, gid, _raw, path, {"op": "become_root"})
        assert unknown[-1] == "closed"
        bad = as_user(uid, gid, _raw, path, {"op": "lease", "devices": ["../../etc"]},
                      {"op": "lease", "devices": [uuid_of(2)], "requested_bytes": [-1]})
        assert [r["ok"] for r in bad] == [False, False], bad
        # The other connection still holds its lease, and everyone else still picks.
        st = broker.status()
        assert [r["device_uuids"] for r in st["leases"]] == [[uuid_of(1)]]
        ok = area.cli(USER_A, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
    finally:
        keeper.stop()


def test_a_user_holding_the_pick_lock_or_flooding_connections_does_not_stop_others(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["b"]
    hog = AsUser(uid, gid, _flood, str(area.socket), 300, hold=True)
    try:
        opened, refused, begun = hog.result()
        assert opened == 256 and refused == 44 and begun
        start = time.monotonic()
        ok = area.cli(USER_A, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
        assert time.monotonic() - start < 15
    finally:
        hog.stop()


def _flood(path: str, n: int) -> tuple[int, int, bool]:
    """Open ``n`` connections (kept), take the pick lock on the first and never end it."""
    import socket

    opened = refused = 0
    begun = False
    for i in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(path)
        if i == 0:
            s.sendall(wire({"op": "begin"}))
            begun = b'"ok": true' in s.makefile("rb").readline()
        else:
            try:
                s.sendall(wire({"op": "status"}))
                data = s.makefile("rb").readline()
            except OSError:  # refused and closed before our message arrived
                data = b"too many connections"
            if b"too many connections" in data:
                refused += 1
            else:
                opened += 1
        _HELD.append(s)
    return opened + 1, refused, begun


# ---- failure modes and the admin -----------------------------------------------------------------


def test_broker_down_fails_closed_with_the_admins_fix_or_falls_back_when_allowed(
    area: Area, users: dict[str, tuple[int, int]]
) -> None:
    res = area.cli(USER_A, "run", "--", "true")
    _no_traceback(res)
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"the lease broker at {area.socket} cannot be reached" in lines[0]
    assert "systemctl enable --now autogpu-broker.socket" in lines[0]
    assert "broker_fallback" in lines[0]
    assert not any(area.registry.rglob("*.lease"))  # failed closed: no lease anywhere
    fb = area.cli(USER_A, "run", "--", "sh", "-c", f"ls {area.registry}/*/*.lease",
                  AUTOGPU_BROKER_FALLBACK="registry")
    assert fb.returncode == 0, fb.stderr
    assert ".lease" in fb.stdout


def test_root_revokes_a_lease_and_other_users_cannot(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["a"]
    child = AsUser(uid, gid, _hold_and_listen, str(area.socket), hold=True)
    try:
        lease_id = broker.wait_for(lambda s: len(_leases(s)) == 1)["leases"][0]["lease_id"]
        res = area.cli("root", "broker", "revoke", lease_id, "--socket", str(area.socket))
        assert res.returncode == 0, res.stderr
        assert f"revoked lease {lease_id} ({USER_A}: pid" in res.stdout
        assert broker.status()["leases"] == []
        refused = area.cli(USER_B, "broker", "revoke", lease_id)
        assert refused.returncode != 0 and "revoke needs root" in refused.stderr
    finally:
        child.stop()


def _hold_and_listen(path: str) -> Any:
    from autogpu_jupyter.core.leasing.brokerclient import BrokerStore

    reg = BrokerStore(path)
    with reg.locked() as txn:
        lease = txn.create(devices=[uuid_of(0)])
    _HELD.append(lease)
    return lease.record.lease_id


def test_broker_status_shows_leases_waiters_and_per_user_counts(
    area: Area, broker: BrokerProc
) -> None:
    a = area.run_held(USER_A, "run", "--exclusive", "--exclude", "1,2,3", "--", "sleep", "60")
    try:
        broker.wait_for(lambda s: len(_leases(s)) == 1)
        over = area.cli(USER_B, "run", "--count", "3", "--", "true")  # past the quota of 2
        assert over.returncode == 3 and "max_devices_per_user = 2" in over.stderr, over.stderr
        waiter = area.run_held(USER_B, "run", "--exclusive", "--exclude", "1,2,3", "--wait", "60",
                               "--", "true")
        broker.wait_for(lambda s: len(s["tickets"]) == 1)
        res = area.cli(USER_B, "broker", "status")
        assert res.returncode == 0, res.stderr
        assert "leases: 1" in res.stdout and "waiters: 1" in res.stdout, res.stdout
        assert f"{USER_A}: 1 lease(s) on 1 device(s), 0 waiting" in res.stdout
        assert f"{USER_B}: 0 lease(s) on 0 device(s), 1 waiting" in res.stdout
        assert "exclusive" in res.stdout and "sleep" not in res.stdout
    finally:
        _kill_group(a)
    # A's exclusive lease gone: the waiter is served, runs, and its lease ends with it.
    _out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
    assert uuid_of(0) in err
    broker.wait_for(lambda s: s["leases"] == [] and s["tickets"] == [], timeout=5)


def _api_and_magic_picks(sock: str, fleet_file: str, held_elsewhere: bool) -> dict[str, Any]:
    """As the user: ``ag.pick()`` and ``%gpu pick`` in one process, through the broker."""
    import contextlib
    import io

    os.environ.update({"AUTOGPU_BROKER_SOCKET": sock, "AUTOGPU_SIMULATE": fleet_file})
    for var in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_REGISTRY_DIR"):
        os.environ.pop(var, None)
    from autogpu_jupyter.core import backends

    backends._cache.clear()
    import autogpu_jupyter as ag
    from autogpu_jupyter.errors import AutoGPUError

    out: dict[str, Any] = {}

    def api(**kw: Any) -> str:
        try:
            return ",".join(d.uuid for d in ag.pick(**kw))
        except AutoGPUError as err:
            return f"{type(err).__name__}: {err}"

    if held_elsewhere:
        out["api"] = api()
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        cfg = Config()
        cfg.HistoryManager.hist_file = ":memory:"
        sh = InteractiveShell.instance(config=cfg)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            sh.run_cell("%load_ext autogpu")
            sh.run_cell("%gpu pick")
        out["magic"] = buf.getvalue()
        return out
    out["two"] = api(count=2)
    out["again"] = api(count=2)  # a re-pick replaces its own lease: still 2 devices
    out["three"] = api(count=3)
    return out


def test_the_quota_holds_for_the_api_and_the_magic_too(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    # The forked child runs as B, who cannot read this venv's files (under /root): everything the
    # API and the magics import is imported here first.
    import IPython.core.interactiveshell  # noqa: F401
    from IPython.testing.globalipapp import start_ipython  # noqa: F401

    import autogpu_jupyter.api
    import autogpu_jupyter.magics  # noqa: F401
    from autogpu_jupyter.core.backends import simulated  # noqa: F401

    uid, gid = users["b"]
    held = [area.run_held(USER_B, "run", "--", "sleep", "60") for _ in range(2)]
    try:
        broker.wait_for(lambda s: s["per_user"].get(USER_B, {}).get("devices") == 2)
        seen = as_user(uid, gid, _api_and_magic_picks, str(area.socket), str(area.fleet), True)
        assert seen["api"].startswith("LeaseLimitError: lease broker: "), seen
        assert "max_devices_per_user = 2" in seen["api"]
        assert "max_devices_per_user = 2" in seen["magic"], seen["magic"]
        assert "Traceback" not in seen["magic"]
    finally:
        for p in held:
            _kill_group(p)
    broker.wait_for(lambda s: s["leases"] == [], timeout=5)
    seen = as_user(uid, gid, _api_and_magic_picks, str(area.socket), str(area.fleet), False)
    assert len(seen["two"].split(",")) == 2, seen
    assert len(seen["again"].split(",")) == 2, seen
    assert "max_devices_per_user = 2" in seen["three"], seen
    broker.wait_for(lambda s: s["leases"] == [], timeout=5)


def test_the_brokers_own_pick_ranks_spreads_and_keeps_the_quota(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """``{"op": "pick"}``: the broker ranks with its own snapshot (core.decision over its own
    state) and leases in one message -- the route of a client that cannot run the engine."""
    uid, gid = users["b"]
    pick = {"op": "pick", "options": {"min_free": "10G"}, "holder": {"kind": "cli"}}
    first = AsUser(uid, gid, _raw_hold, str(area.socket), pick, hold=True)
    second = AsUser(uid, gid, _raw_hold, str(area.socket), pick, hold=True)
    try:
        a, b = first.result()[0], second.result()[0]
        assert a["ok"] and b["ok"], (a, b)
        assert a["record"]["device_uuids"] != b["record"]["device_uuids"]  # spread by leases
        assert a["record"]["device_requested_bytes"] == [10 * 1024**3]
        assert a["record"]["user"] == USER_B
        third = as_user(uid, gid, _raw, str(area.socket), pick)
        assert third[0]["type"] == "LeaseLimitError", third
        bad = as_user(uid, gid, _raw, str(area.socket),
                      {"op": "pick", "options": {"min_free": "lots"}},
                      {"op": "pick", "options": {"wait": "1h"}})
        assert bad[0]["type"] == "UsageErrorBase" and "invalid size 'lots'" in bad[0]["error"]
        assert bad[1]["type"] == "UsageErrorBase" and "wait" in bad[1]["error"], bad
        # The client's view agrees: B's two leases, on the devices the broker chose.
        st = broker.status()
        assert sorted(d for r in st["leases"] for d in r["device_uuids"]) == sorted(
            [*a["record"]["device_uuids"], *b["record"]["device_uuids"]]
        )
    finally:
        first.stop()
        second.stop()
    broker.wait_for(lambda s: s["leases"] == [], timeout=5)


def test_forged_tickets_and_planted_registry_junk_change_nothing(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """The safety issue's registry attacks have no target: the broker numbers tickets itself,
    and nothing planted in the shared directory is read."""
    uid, gid = users["b"]
    a_uid, a_gid = users["a"]
    # Junk where the shared-directory registry would look (a non-ASCII digit, a forged
    # directory for A): no pick reads it any more.
    (area.registry / "\u00b9").mkdir()
    (area.registry / str(a_uid)).mkdir()
    forged = {"op": "ticket", "seq": 0, "lease_id": "0" * 32,
              "constraints": {"min_free_bytes": None, "min_free_fraction": None,
                              "max_util_pct": None, "count": 1, "exclude": [],
                              "exclusive": True, "allowed_uuids": [uuid_of(0)]}}
    # GPU 0 is taken by A (for more than a moment), so B's tickets wait for it: a ticket taken
    # while its device is free, or held by a lease of a moment ago, reserves nothing (a waiter
    # waits for a job to end, not for another pick). A's lease, not B's: B's own would count
    # against B's quota with the two tickets.
    holder = AsUser(a_uid, a_gid, _raw_hold, str(area.socket),
                    {"op": "lease", "devices": [uuid_of(0)], "exclusive": True}, hold=True)
    assert holder.result()[0]["ok"]
    time.sleep(2.5)  # past the broker's SETTLED_S (2 s): the holder's lease now makes B wait
    first = AsUser(uid, gid, _raw_hold, str(area.socket), forged, hold=True)
    one = first.result()[0]  # before the second arrives: their order is the line's order
    second = AsUser(uid, gid, _raw_hold, str(area.socket), forged, hold=True)
    try:
        two = second.result()[0]
        assert one["ok"] and two["ok"], (one, two)
        assert [one["record"]["seq"], two["record"]["seq"]] == [1, 2]  # the broker's numbers
        assert one["record"]["lease_id"] != "0" * 32
        holder.stop()
        # GPU 0 is free now; B's older waiter is served first (FIFO): GPU 0 is reserved for it
        # (exclusively, as its ticket asks), so A's pick of GPU 0 is refused while B waits,
        # naming B's ticket.
        res = area.cli(USER_A, "run", "--exclude", "1,2,3", "--", "true")
        assert res.returncode == 3, res.stderr
        assert (
            f"GPU 0 (NVIDIA A100-SXM4-80GB): dropped: reserved for {USER_B}'s waiting ticket "
            "(1 GPU, since "
        ) in res.stderr
    finally:
        first.stop()
        second.stop()
    broker.wait_for(lambda s: s["tickets"] == [], timeout=5)
    ok = area.cli(USER_A, "run", "--exclude", "1,2,3", "--", "true")
    assert ok.returncode == 0, ok.stderr
    assert not any(area.registry.rglob("*.lease"))


def _flood_messages(path: str, n: int) -> float:
    """Send ``n`` status requests at once on one connection; seconds until all are answered."""
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        start = time.monotonic()
        s.sendall(wire({"op": "status"}) * n)
        f = s.makefile("rb")
        for _ in range(n):
            assert json.loads(f.readline())["ok"] is True
        return time.monotonic() - start


def test_a_user_flooding_messages_is_slowed_alone(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["b"]
    # 3,000 messages: a burst of 500, then 5 s of pacing at 500 a second, so that A's whole
    # `autogpu run` fits inside B's flood even on a loaded machine (1,500 messages, 2 s of
    # pacing, lost that race once when 8 other jobs shared the 2 cores).
    flood = AsUser(uid, gid, _flood_messages, str(area.socket), 3000)
    start = time.monotonic()
    ok = area.cli(USER_A, "run", "--", "true")  # while B floods
    a_took = time.monotonic() - start
    b_took = flood.result()
    flood.stop()
    assert ok.returncode == 0, ok.stderr
    assert b_took >= 4.5, b_took  # 500 messages a second for B, after a burst of 500
    # A's whole `autogpu run` (interpreter start included) ended while B's flood was still
    # being paced: B's messages wait, A's do not.
    assert a_took < b_took, (a_took, b_took)


def test_the_admins_rules_file_per_user_and_per_group_limits_and_reserved_devices(
    area: Area, users: dict[str, tuple[int, int]]
) -> None:
    """One rules file: alice may hold 3 devices, members of bob's group 1, and GPU 3 is
    reserved for alice's group: bob's picks never get it (ranked out, not refused after)."""
    import grp

    a_group = grp.getgrgid(users["a"][1]).gr_name
    b_group = grp.getgrgid(users["b"][1]).gr_name
    rules = area.root / "rules.json"
    rules.write_text(json.dumps({
        "max_devices_per_user": 2,
        "users": {USER_A: 3},
        "groups": {b_group: 1},
        "reserved": {uuid_of(3): [a_group]},
    }))
    proc = BrokerProc(area.root, "--rules", str(rules),
                      env={"AUTOGPU_SIMULATE": str(area.fleet)})
    held: list[Any] = []
    try:
        # bob: one device (his group's limit), never GPU 3 (reserved), by any route.
        held.append(area.run_held(USER_B, "run", "--", "sleep", "60"))
        st = proc.wait_for(lambda s: len(s["leases"]) == 1)
        assert st["leases"][0]["device_uuids"] != [uuid_of(3)]
        second = area.cli(USER_B, "run", "--", "true")
        assert second.returncode == 3
        assert f"max_devices_per_user = 1 set by the admin for group {b_group}" in second.stderr
        only_3 = area.cli(USER_B, "run", "--exclude", "0,1,2", "--", "true")
        assert only_3.returncode == 3, only_3.stderr
        assert (
            f"GPU 3 (NVIDIA A100-SXM4-80GB): dropped: reserved for group(s) {a_group} by the admin"
        ) in only_3.stderr
        uid, gid = users["b"]
        raw = as_user(uid, gid, _raw, str(area.socket),
                      {"op": "lease", "devices": [uuid_of(3)]})
        assert f"reserved for group(s) {a_group}" in raw[0]["error"], raw
        # ... and no ticket of bob's may wait for it (issue 20: a ticket took reserved devices)
        ticket = {"op": "ticket", "constraints": {**_TICKET, "allowed_uuids": [uuid_of(3)]}}
        raw = as_user(uid, gid, _raw, str(area.socket), ticket)
        assert (raw[0]["ok"], raw[0]["type"]) == (False, "NoDeviceFitsError"), raw
        assert raw[0]["error"] == (
            f"no device free: {uuid_of(3)} is reserved for group(s) {a_group} by the admin"
        )
        # alice: three devices (her own limit wins over the default of 2), GPU 3 included.
        held += [area.run_held(USER_A, "run", "--exclusive", "--", "sleep", "60")
                 for _ in range(3)]
        st = proc.wait_for(lambda s: s["per_user"].get(USER_A, {}).get("devices") == 3)
        alices = {d for r in st["leases"] if r["user"] == USER_A for d in r["device_uuids"]}
        assert uuid_of(3) in alices
        fourth = area.cli(USER_A, "run", "--", "true")
        assert fourth.returncode == 3
        assert f"max_devices_per_user = 3 set by the admin for {USER_A}" in fourth.stderr
    finally:
        for p in held:
            _kill_group(p)
        proc.stop()


_TICKET = {"min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
           "exclude": [], "exclusive": True, "allowed_uuids": None}


def test_one_users_tickets_cannot_block_every_gpu(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """Issue 20, attack 1: one exclusive ticket for 4 GPUs on an open socket blocked every pick on
    the host. Tickets are admitted like leases now: against bob's quota (2 devices), at most two
    per user, and a device a waiting ticket takes names the ticket."""
    uid, gid = users["b"]
    everything = as_user(uid, gid, _raw, str(area.socket),
                         {"op": "ticket", "constraints": {**_TICKET, "count": 4}})
    assert (everything[0]["ok"], everything[0]["type"]) == (False, "LeaseLimitError"), everything
    assert everything[0]["error"] == (
        f"{USER_B} holds leases on 0 device(s) and waits in line for 0 more; waiting for 4 more "
        "would exceed max_devices_per_user = 2 set by the admin (enforced by the broker). Release "
        "one first (%gpu release, or end the kernel / autogpu run holding it)."
    )
    # Bob's tickets wait for GPU 0 and GPU 1 while alice's settled leases hold them: a ticket
    # that a device could serve at once reserves nothing (it is dormant), one that waits does.
    a_uid, a_gid = users["a"]
    holds = [AsUser(a_uid, a_gid, _raw_hold, str(area.socket),
                    {"op": "lease", "devices": [uuid_of(i)], "exclusive": True}, hold=True)
             for i in (0, 1)]
    assert [h.result()[0]["ok"] for h in holds] == [True, True]
    time.sleep(2.5)  # past the broker's SETTLED_S (2 s): only settled leases make a ticket wait
    waiters = [
        AsUser(uid, gid, _raw_hold, str(area.socket),
               {"op": "ticket", "constraints": {**_TICKET, "allowed_uuids": [uuid_of(i)]}},
               hold=True)
        for i in (0, 1)
    ]
    one = {"op": "ticket", "constraints": _TICKET}
    try:
        assert [w.result()[0]["ok"] for w in waiters] == [True, True]
        while holds:  # GPU 0 and GPU 1 free now: bob's waiting tickets reserve them
            holds.pop().stop()
        third = as_user(uid, gid, _raw, str(area.socket), one)
        assert third[0]["type"] == "LeaseLimitError" and third[0]["error"].startswith(
            f"{USER_B} already waits in line with 2 ticket(s); another would exceed "
            "max_tickets_per_user = 2"
        ), third
        st = broker.wait_for(lambda s: len(s["tickets"]) == 2)
        assert st["per_user"][USER_B]["tickets"] == 2
        # alice still gets a GPU: the two waiters keep GPU 0 and GPU 1, not the host.
        ok = area.cli(USER_A, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
        blocked = area.cli(USER_A, "run", "--exclude", "2,3", "--", "true")
        assert blocked.returncode == 3, blocked.stderr
        for i in (0, 1):
            assert (
                f"GPU {i} (NVIDIA A100-SXM4-80GB): dropped: reserved for {USER_B}'s waiting "
                "ticket (1 GPU, since "
            ) in blocked.stderr, blocked.stderr
        assert "another lease" not in blocked.stderr
    finally:
        for w in [*waiters, *holds]:
            w.stop()
    broker.wait_for(lambda s: s["tickets"] == [], timeout=10)


def test_a_bad_rules_file_stops_the_broker_with_one_line(area: Area) -> None:
    rules = area.root / "rules.json"
    rules.write_text(json.dumps({"users": {USER_A: -1}}))
    res = area.cli("root", "broker", "--rules", str(rules), "--socket",
                   str(area.root / "run" / "x.sock"), "--state-dir", "")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"autogpu broker: rules file {rules}: -1 is not a whole number >= 0; expected e.g. "
        '{"max_devices_per_user": 2, "users": {"alice": 4}, "groups": {"students": 1}, '
        '"reserved": {"GPU-...": ["ml"]}}'
    ]


def _fuzz(path: str, seed: int, n: int) -> list[str]:
    """``n`` hostile messages, each on its own connection; the broker's first line back."""
    import random

    rnd = random.Random(seed)
    values: list[Any] = [None, True, -1, 0, 2**64, 1e308, "", "x" * 5000, "\ud800", [], {},
                         [1, "a"], {"a": [{}]}, "GPU-00000000-aaaa-bbbb-cccc-000000000000",
                         "../../etc/passwd", "\u202e\x9b", 3.5]
    ops = ["begin", "end", "lease", "ticket", "set_pid", "release", "leases", "status",
           "revoke", "pick", "nope", 7, None]
    keys = ["devices", "requested_bytes", "exclusive", "holder", "pid", "lease_id", "options",
            "constraints", "ignore_ids", "ignore_kernel", "uid", "user", "seq", "tickets"]
    out = []
    for _ in range(n):
        msg = {"op": rnd.choice(ops)}
        for k in rnd.sample(keys, rnd.randint(0, 5)):
            msg[k] = rnd.choice(values)
        try:
            line = wire(msg)
        except UnicodeEncodeError:
            line = b'{"op": "status", "x": "\\ud800"}\n'
        out.append(_one_reply(path, line))
    return out


def _one_reply(path: str, line: bytes) -> str:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(line)
        try:
            return s.makefile("rb").readline().decode()[:200] or "closed"
        except TimeoutError:
            return "no reply"  # e.g. a "begin" waiting for the lock


def test_hostile_messages_never_take_the_broker_down(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["b"]
    keeper = AsUser(uid, gid, _raw_hold, str(area.socket),
                    {"op": "lease", "devices": [uuid_of(2)]}, hold=True)
    try:
        assert keeper.result()[0]["ok"] is True
        seen = as_user(uid, gid, _fuzz, str(area.socket), 11, 300)
        assert len(seen) == 300 and "no reply" not in seen
        assert broker.proc is not None and broker.proc.poll() is None
        st = broker.status()
        # Whatever was granted to the fuzzer ended with its connections; the keeper's stays.
        assert [r["device_uuids"] for r in st["leases"]] == [[uuid_of(2)]]
        ok = area.cli(USER_A, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
    finally:
        keeper.stop()
