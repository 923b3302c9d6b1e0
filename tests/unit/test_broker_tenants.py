"""The tenants of the broker (issue 40, brokerd/tenants.py): names, the table in the state
directory, the rules file's section, the socket directories.

Everything here is what another program or the admin observes: the table file (its JSON, its
mode), the directories and sockets on disk and their modes, one-line refusals.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig, BrokerRefusal, Conn, Orphan
from autogpu_jupyter.brokerd import ops as ops_mod
from autogpu_jupyter.brokerd import tenants
from autogpu_jupyter.brokerd.identity import UNKNOWN_KEY, Account, tenant_key
from autogpu_jupyter.brokerd.tenants import NAME_FORM, Tenant, TenantError
from tests.brokerhelpers import REPO, Area, BrokerProc, RawConn, broker_area


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[str, str]:
    """A state directory and a socket root that do not exist yet (root's tmp_path is 0700)."""
    return str(tmp_path / "state"), str(tmp_path / "tenant-sockets")


@pytest.mark.parametrize("name", ["alice", "_svc", "a", "jupyter-bob", "u_1-x", "a" * 32])
def test_names_of_the_unix_user_form_are_accepted(name: str) -> None:
    assert tenants.validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "Alice", "1abc", "-x", "a" * 33, "al ice", "al/ice", "..", "ali\nce", "é"],
)
def test_bad_names_get_one_line_naming_the_value_and_the_form(name: str) -> None:
    with pytest.raises(TenantError) as err:
        tenants.validate_name(name)
    message = str(err.value)
    assert "\n" not in message
    assert repr(name)[:60] in message
    assert NAME_FORM in message


@pytest.mark.parametrize("name", ["root", "unknown"])
def test_names_that_read_as_the_admin_or_the_unknown_bucket_are_reserved(name: str) -> None:
    with pytest.raises(TenantError, match=f"{name!r} is reserved"):
        tenants.validate_name(name)


def test_a_tenant_has_sorted_unique_valid_groups_and_a_bounded_limit() -> None:
    t = Tenant.make("alice", ["ml", "students", "ml"], 2)
    assert (t.name, t.groups, t.max_devices) == ("alice", ("ml", "students"), 2)
    assert t.account(-7).name == "alice"
    assert t.account(-7).groups == frozenset({"ml", "students"})
    with pytest.raises(TenantError, match=r"tenant alice: group 'ML' is not accepted"):
        Tenant.make("alice", ["ML"])
    with pytest.raises(TenantError, match="at most 32"):
        Tenant.make("alice", [f"g{i}" for i in range(33)])
    for bad in (-1, 4097, True, 1.5, "2"):
        with pytest.raises(TenantError, match=r"max_devices .* expected a whole number"):
            Tenant.make("alice", [], bad)


def test_the_rules_file_section_is_read_by_the_broker_config(tmp_path: Path) -> None:
    rules = tmp_path / "broker.json"
    rules.write_text(json.dumps({
        "max_devices_per_user": 2,
        "tenants": {"alice": {"groups": ["ml"], "max_devices": 1}, "bob": {}, "carol": None},
    }))
    config = BrokerConfig()
    config.load_rules(str(rules))
    assert config.tenants == {
        "alice": Tenant("alice", ("ml",), 1, "rules"),
        "bob": Tenant("bob", (), None, "rules"),
        "carol": Tenant("carol", (), None, "rules"),
    }
    assert config.max_devices_per_user == 2


@pytest.mark.parametrize(("section", "says"), [
    ({"Bob": {}}, "tenant name 'Bob' is not accepted"),
    ({"bob": {"max_devices": -2}}, "max_devices '-2' is not accepted"),
    ({"bob": {"gpus": 1}}, "unknown key 'gpus'"),
    ({"bob": ["ml"]}, "expected an object such as"),
    (["bob"], "expected an object of tenants"),
])
def test_a_bad_rules_section_stops_the_broker_with_one_line_naming_the_file(
    tmp_path: Path, section: object, says: str,
) -> None:
    rules = tmp_path / "broker.json"
    rules.write_text(json.dumps({"tenants": section}))
    with pytest.raises(SystemExit) as err:
        BrokerConfig().load_rules(str(rules))
    message = str(err.value)
    assert message.startswith(f"autogpu broker: rules file {rules}: ")
    assert says in message
    assert "\n" not in message


def test_add_update_and_remove_write_a_root_only_table(dirs: tuple[str, str]) -> None:
    state, root = dirs
    assert tenants.load_table(state) == {}
    _t, what = tenants.add_tenant("alice", ["ml"], 2, state_dir=state, socket_root=root)
    assert what == "added"
    assert tenants.add_tenant("alice", ["ml"], 2, state_dir=state, socket_root=root)[1] == (
        "unchanged")
    assert tenants.add_tenant("alice", [], None, state_dir=state, socket_root=root)[1] == "updated"
    tenants.add_tenant("bob", state_dir=state, socket_root=root)
    table = Path(state) / tenants.TABLE_FILE
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(table.stat().st_mode) == 0o600
    assert json.loads(table.read_text()) == {"version": 1, "tenants": {
        "alice": {"groups": [], "max_devices": None},
        "bob": {"groups": [], "max_devices": None},
    }}
    assert sorted(tenants.load_table(state)) == ["alice", "bob"]
    assert tenants.remove_tenant("alice", state_dir=state, socket_root=root) == ""
    assert sorted(tenants.load_table(state)) == ["bob"]
    assert not os.path.exists(os.path.join(root, "alice"))
    with pytest.raises(TenantError, match=r"no tenant 'alice' in the table \(tenants: bob;"):
        tenants.remove_tenant("alice", state_dir=state, socket_root=root)


def test_the_table_is_bounded(dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    state, root = dirs
    monkeypatch.setattr(tenants, "MAX_TENANTS", 3)
    for name in ("a", "b", "c"):
        tenants.add_tenant(name, state_dir=state, socket_root=root)
    with pytest.raises(TenantError, match=r"holds 3 tenants, the most allowed \(3\)"):
        tenants.add_tenant("d", state_dir=state, socket_root=root)
    assert tenants.add_tenant("c", ["g"], state_dir=state, socket_root=root)[1] == "updated"
    assert sorted(tenants.load_table(state)) == ["a", "b", "c"]


def _add(args: tuple[str, str, str]) -> str:
    name, state, root = args
    return tenants.add_tenant(name, state_dir=state, socket_root=root)[1]


def test_adds_at_once_from_many_processes_lose_no_tenant(dirs: tuple[str, str]) -> None:
    """A hub spawning many servers at once adds their tenants at once: each write keeps the
    others' entries (the table's lock)."""
    state, root = dirs
    names = [f"user{i}" for i in range(24)]
    with multiprocessing.get_context("fork").Pool(8) as pool:
        assert pool.map(_add, [(n, state, root) for n in names]) == ["added"] * len(names)
    assert sorted(tenants.load_table(state)) == sorted(names)
    assert sorted(os.listdir(root)) == sorted(names)


def test_a_table_that_is_a_link_or_not_json_is_refused_in_one_line(
    dirs: tuple[str, str], tmp_path: Path,
) -> None:
    state, root = dirs
    tenants.add_tenant("alice", state_dir=state, socket_root=root)
    table = Path(state) / tenants.TABLE_FILE
    table.write_text("{not json")
    with pytest.raises(TenantError, match=f"tenants table {table}: ") as err:
        tenants.load_table(state)
    assert "\n" not in str(err.value)
    table.unlink()
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps({"version": 1, "tenants": {"mallory": {}}}))
    table.symlink_to(other)
    with pytest.raises(TenantError, match="refused"):
        tenants.load_table(state)
    with pytest.raises(TenantError, match="refused"):
        tenants.add_tenant("bob", state_dir=state, socket_root=root)
    assert json.loads(other.read_text()) == {"version": 1, "tenants": {"mallory": {}}}


def test_a_state_directory_others_can_write_is_refused(dirs: tuple[str, str]) -> None:
    state, root = dirs
    os.makedirs(state)
    os.chmod(state, 0o777)
    with pytest.raises(TenantError, match=r"mode 0777: refused"):
        tenants.add_tenant("alice", state_dir=state, socket_root=root)
    assert os.listdir(state) == []


def test_rules_file_tenants_are_not_changed_or_removed_from_the_command_line(
    dirs: tuple[str, str],
) -> None:
    state, root = dirs
    rules = {"alice": Tenant("alice", ("ml",), 1, "rules")}
    assert tenants.add_tenant("alice", ["ml"], 1, state_dir=state, socket_root=root,
                              rules=rules)[1] == "unchanged"
    assert os.path.isdir(os.path.join(root, "alice"))
    with pytest.raises(TenantError, match="defined in the rules file"):
        tenants.add_tenant("alice", [], 3, state_dir=state, socket_root=root, rules=rules)
    with pytest.raises(TenantError, match="defined in the rules file: remove it there"):
        tenants.remove_tenant("alice", state_dir=state, socket_root=root, rules=rules)
    assert tenants.load_table(state) == {}


def test_socket_directories_are_reachable_only_through_the_mount(dirs: tuple[str, str]) -> None:
    """The root is 0700 (no host user traverses it); the tenant's directory is 0755 (the
    container's user, given it as a mount, does); its socket is 0666 and carries the default
    socket's file name."""
    _state, root = dirs
    path = tenants.ensure_tenant_dir(root, "alice")
    assert path == os.path.join(root, "alice")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    sock = tenants.listen_tenant(root, "alice")
    try:
        where = tenants.tenant_socket(root, "alice")
        assert os.path.basename(where) == "broker.sock"
        assert stat.S_ISSOCK(os.stat(where).st_mode)
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o666
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(where)
    finally:
        sock.close()
    assert tenants.remove_tenant_dir(root, "alice") == ""
    assert os.listdir(root) == []
    assert tenants.remove_tenant_dir(root, "alice") == ""  # nothing left to remove


def test_a_socket_root_others_can_reach_or_a_linked_tenant_dir_is_refused(
    dirs: tuple[str, str], tmp_path: Path,
) -> None:
    _state, root = dirs
    os.makedirs(root, mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(TenantError, match=r"mode 0755: refused .*expected 0700"):
        tenants.ensure_tenant_dir(root, "alice")
    os.chmod(root, 0o700)
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, os.path.join(root, "alice"))
    with pytest.raises(TenantError, match="refused"):
        tenants.listen_tenant(root, "alice")
    assert list(target.iterdir()) == []


def test_removal_leaves_what_it_did_not_make(dirs: tuple[str, str]) -> None:
    _state, root = dirs
    path = tenants.ensure_tenant_dir(root, "alice")
    Path(path, "broker.sock").write_text("not a socket")
    assert tenants.remove_tenant_dir(root, "alice") == f"{path} holds other files: left as it is"
    assert Path(path, "broker.sock").read_text() == "not a socket"


def test_the_refusal_of_a_removed_tenants_socket_is_one_line() -> None:
    line = tenants.removed_refusal("alice")
    assert "\n" not in line
    assert line.startswith("tenant alice was removed by the admin")


# -- phase B: a connection on a tenant's socket is that tenant ---------------------------------
#
# In-process first (a ``Broker`` with connections made as its accept makes them), then a real
# broker process with its tenant sockets.


def _broker(**config: Any) -> Broker:
    return Broker(BrokerConfig(socket_path="/nonexistent/b.sock", **config))


def _on_socket_of(b: Broker, tenant: Tenant, uid: int = 1000) -> Conn:
    """A connection of ``uid`` accepted on ``tenant``'s socket (a socketpair through the
    broker's own accept)."""
    async def accept() -> Conn:
        ours, theirs = socket.socketpair()
        _KEEP.append(theirs)
        before = set(b.connections.conns)
        b.connections.accepted(ours, tenant=tenant)
        (conn,) = set(b.connections.conns) - before
        conn.uid = uid  # a socketpair's peer is this (root) process: as a container's uid
        return conn
    return asyncio.run(accept())


_KEEP: list[socket.socket] = []


def _lease(b: Broker, conn: Conn, device: str, command: str | None = None) -> None:
    conn.record = ops_mod.make_record(b, conn, "lease", {
        "device_uuids": [device], "device_requested_bytes": [None], "exclusive": False,
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": command,
        "holder_kind": "process",
    })


def _root(b: Broker) -> Conn:
    return Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))


def test_two_tenants_of_one_uid_are_two_people() -> None:
    """alice and bob, both uid 1000: each lease is named by its tenant, each sees only its own
    command line (root on the main socket sees both), neither may release the other's
    orphan. Caught before phase B: the viewer compared by uid (bob saw alice's command)."""
    b = _broker(record_commands=True)
    alice = _on_socket_of(b, Tenant.make("alice"))
    bob = _on_socket_of(b, Tenant.make("bob"))
    _lease(b, alice, "GPU-t1", command="python train.py --token=s3cret")
    _lease(b, bob, "GPU-t2", command="python eval.py")

    def commands(viewer: Conn) -> dict[str, str | None]:
        got = asyncio.run(b.run_op("leases", viewer, {"op": "leases"}))
        return {r["user"]: r["command"] for r in got["records"]}

    assert commands(alice) == {"alice": "python train.py --token=s3cret", "bob": None}
    assert commands(bob) == {"alice": None, "bob": "python eval.py"}
    assert commands(_root(b)) == {"alice": "python train.py --token=s3cret",
                                  "bob": "python eval.py"}
    rec = alice.record
    assert rec is not None
    alice.record = None
    b.book.adopt(Orphan(1000, rec, [], key=tenant_key("alice")))
    with pytest.raises(BrokerRefusal, match="of yours is orphaned"):
        asyncio.run(b.run_op("release", bob, {"op": "release", "lease_id": rec.lease_id}))
    assert asyncio.run(b.run_op("release", alice, {"op": "release",
                                                   "lease_id": rec.lease_id})) == {"ok": True}


def test_uid_0_on_a_tenant_socket_is_the_tenant_not_root() -> None:
    """A container running as root is still only its tenant: no revoke, no reload, no other
    tenant's command line."""
    b = _broker(record_commands=True)
    bob = _on_socket_of(b, Tenant.make("bob"))
    _lease(b, bob, "GPU-t2", command="python eval.py")
    mallory = _on_socket_of(b, Tenant.make("alice"), uid=0)
    assert bob.record is not None
    with pytest.raises(BrokerRefusal, match=r"^revoke needs root$"):
        asyncio.run(b.run_op("revoke", mallory, {"op": "revoke",
                                                 "lease_id": bob.record.lease_id}))
    with pytest.raises(BrokerRefusal, match=r"^reload needs root$"):
        asyncio.run(b.run_op("reload", mallory, {"op": "reload"}))
    got = asyncio.run(b.run_op("leases", mallory, {"op": "leases"}))
    assert [r["command"] for r in got["records"]] == [None]


@pytest.mark.parametrize(("tenant", "rules", "limit"), [
    (Tenant.make("alice", ["students"], 3), {"users": {"alice": 2}, "groups": {"students": 1}},
     3),
    (Tenant.make("alice", ["students"]), {"users": {"alice": 2}, "groups": {"students": 1}}, 2),
    (Tenant.make("alice", ["students"]), {"groups": {"students": 1}}, 1),
    (Tenant.make("alice", ["students"]), {}, 4),
])
def test_a_tenants_limit_is_its_own_then_its_names_then_its_groups_then_the_default(
    tenant: Tenant, rules: dict[str, Any], limit: int,
) -> None:
    b = _broker(max_devices_per_user=4, user_limits=rules.get("users", {}),
                group_limits=rules.get("groups", {}))
    b.book.tenants = {"alice": tenant}
    conn = _on_socket_of(b, tenant)

    async def begin() -> dict[str, Any]:
        reply = await b.run_op("begin", conn, {"op": "begin"})
        await b.run_op("end", conn, {"op": "end"})
        return reply

    assert asyncio.run(begin())["max_devices_per_user"] == limit


def test_tenant_keys_are_stable_distinct_and_never_a_uid() -> None:
    names = ["a", "b", "alice", "bob", "_", "a" * 32, "z" * 32]
    keys = [tenant_key(n) for n in names]
    assert len(set(keys)) == len(keys)
    assert all(k < UNKNOWN_KEY for k in keys)
    assert tenant_key("alice") == tenant_key("alice")


@pytest.fixture
def tenant_broker(tmp_path: Path) -> Iterator[tuple[BrokerProc, Path, Path]]:
    """A real broker serving the rules file's alice (1 device) and bob, on 4 simulated GPUs."""
    sockets = tmp_path / "tenant-sockets"
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"tenants": {"alice": {"max_devices": 1}, "bob": {}}}))
    with broker_area(4) as root:
        area = Area(root, 4)
        broker = BrokerProc(root, "--tenant-socket-root", str(sockets), "--rules", str(rules),
                            env={"AUTOGPU_SIMULATE": str(area.fleet)})
        try:
            yield broker, sockets, root
        finally:
            broker.stop()


def _pick(path: Path) -> tuple[RawConn, Any]:
    conn = RawConn(path)
    return conn, conn.call({"op": "pick", "options": {}})


def test_the_broker_serves_each_tenant_on_its_socket_and_keeps_it_over_a_restart(
    tenant_broker: tuple[BrokerProc, Path, Path],
) -> None:
    broker, sockets, _root_dir = tenant_broker
    assert stat.S_IMODE(os.stat(sockets).st_mode) == 0o700
    held, got = _pick(sockets / "alice" / "broker.sock")
    assert got["ok"] is True and got["record"]["user"] == "alice", got
    second, refused = _pick(sockets / "alice" / "broker.sock")
    assert refused["ok"] is False and "\n" not in refused["error"]
    assert "for tenant alice" in refused["error"], refused
    second.close()
    bob, got_b = _pick(sockets / "bob" / "broker.sock")
    assert got_b["record"]["user"] == "bob"
    assert got_b["record"]["device_uuids"] != got["record"]["device_uuids"]
    st = broker.status()
    assert {u: r["leases"] for u, r in st["per_user"].items()} == {"alice": 1, "bob": 1}

    broker.restart()  # kill -9, start: the holders' sockets are still open
    st = broker.wait_for(lambda s: s["orphans"] == 2)
    assert {u: r["leases"] for u, r in st["per_user"].items()} == {"alice": 1, "bob": 1}
    # the orphan is alice's: bob may not release it, alice (a new connection) may
    with RawConn(sockets / "bob" / "broker.sock") as other:
        no = other.call({"op": "release", "lease_id": got["record"]["lease_id"]})
        assert no["ok"] is False and "of yours" in no["error"]
    with RawConn(sockets / "alice" / "broker.sock") as again:
        assert again.call({"op": "release", "lease_id": got["record"]["lease_id"]})["ok"]
    held.close()
    bob.close()
    broker.wait_for(lambda s: s["leases_total"] == 0)


def test_adding_and_removing_a_tenant_is_served_without_a_restart(
    tenant_broker: tuple[BrokerProc, Path, Path], tmp_path: Path,
) -> None:
    broker, sockets, _root_dir = tenant_broker
    state = broker.state

    def tenant_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "tenant", *args,
             "--state-dir", str(state), "--socket-root", str(sockets),
             "--rules", str(tmp_path / "rules.json"), "--socket", str(broker.socket)],
            capture_output=True, text=True, cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    added = tenant_cli("add", "carol", "--max-devices", "2")
    assert added.returncode == 0, added.stderr
    assert added.stdout.splitlines()[-1] == f"the broker at {broker.socket} serves the change"
    holder, got = _pick(sockets / "carol" / "broker.sock")
    assert got["record"]["user"] == "carol"
    removed = tenant_cli("remove", "carol")
    assert removed.returncode == 0, removed.stderr
    notice = holder.read()
    assert notice["event"] == "revoked"
    assert notice["message"] == tenants.removed_refusal("carol")
    assert holder.read() is None  # then closed
    assert not (sockets / "carol").exists()
    broker.wait_for(lambda s: s["leases_total"] == 0)


def test_the_tenant_cli_says_in_one_line_when_no_broker_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "tenant", "add", "dave",
         "--state-dir", str(tmp_path / "state"), "--socket-root", str(tmp_path / "socks"),
         "--rules", str(tmp_path / "none.json"), "--socket", str(tmp_path / "no.sock")],
        capture_output=True, text=True, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (
        f"the broker is not running at {tmp_path / 'no.sock'}: it serves the tenants when it "
        "starts")


def test_a_tenants_set_pid_names_a_pid_of_its_own_pid_namespace() -> None:
    """A kernel in a container sends its container pid: the broker finds that process in the
    pid namespace of the connecting process, never reads the number as a host pid. Caught with
    the number read as a host pid: a host process of the same uid, which the container cannot
    see, was accepted."""
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "60"])
    try:
        host = 0
        for _ in range(100):  # the forked sleep: pid 1 of the new namespace
            children = Path(f"/proc/{inner.pid}/task/{inner.pid}/children").read_text().split()
            if children and "sleep" in Path(f"/proc/{children[0]}/cmdline").read_text():
                host = int(children[0])
                break
            time.sleep(0.05)
        assert host
        b = _broker()
        conn = _on_socket_of(b, Tenant.make("alice"), uid=0)
        conn.pid = host  # as SO_PEERCRED names the container's process
        _lease(b, conn, "GPU-t1")
        got = asyncio.run(b.run_op("set_pid", conn, {"op": "set_pid", "pid": 1}))
        assert got["record"]["pid"] == 1
        outside = os.getpid()  # a host process the container's namespace does not hold
        with pytest.raises(BrokerRefusal, match=f"pid {outside} is not a process of yours"):
            asyncio.run(b.run_op("set_pid", conn, {"op": "set_pid", "pid": outside}))
    finally:
        inner.kill()
        inner.wait()


def test_a_tenant_the_hub_hook_adds_is_served_at_once(
    tenant_broker: tuple[BrokerProc, Path, Path],
) -> None:
    """``autogpu_jupyter.hub``'s hook adds the hub user's tenant and tells the running broker:
    the container it mounts the directory into finds a socket there."""
    from autogpu_jupyter import hub

    broker, sockets, _root_dir = tenant_broker

    class Spawner:
        def __init__(self) -> None:
            self.user = type("User", (), {"name": "dave", "groups": []})()
            self.volumes: dict[str, Any] = {}
            self.environment: dict[str, str] = {}

    hub.pre_spawn_hook(state_dir=str(broker.state), socket_root=str(sockets),
                       broker_socket=str(broker.socket))(Spawner())
    holder, got = _pick(sockets / "dave" / "broker.sock")
    assert got["ok"] is True and got["record"]["user"] == "dave", got
    holder.close()


def test_sighup_serves_the_rules_files_tenants_as_they_are_now(
    tenant_broker: tuple[BrokerProc, Path, Path], tmp_path: Path,
) -> None:
    """The rules file edited (erin added, bob removed) and the broker sent SIGHUP: erin's
    socket is served, bob's holder is told in one line and bob's socket is gone."""
    import signal

    broker, sockets, _root_dir = tenant_broker
    held, got = _pick(sockets / "bob" / "broker.sock")
    assert got["record"]["user"] == "bob"
    (tmp_path / "rules.json").write_text(json.dumps({"tenants": {"alice": {}, "erin": {}}}))
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)
    notice = held.read()
    assert notice["message"] == tenants.removed_refusal("bob")
    for _ in range(200):  # the same reload then listens for erin
        if (sockets / "erin" / "broker.sock").exists():
            break
        time.sleep(0.05)
    assert not (sockets / "bob").exists()
    erin, mine = _pick(sockets / "erin" / "broker.sock")
    assert mine["record"]["user"] == "erin"
    erin.close()


def test_the_broker_answers_while_a_reload_waits_for_its_rules_file(tmp_path: Path) -> None:
    """A reload (root's ``reload`` op, as SIGHUP) reads the tenants table and the rules file
    off the event loop: while that read waits (the rules file is a FIFO nobody has written
    yet, as a file on a hung network disk), root's ``status`` is answered; once the file
    comes, the reload answers what it added. Caught (issue 39): the files read on the loop
    (no other op was answered until the read ended: the writer below never got its turn)."""
    fifo = str(tmp_path / "broker.json")
    os.mkfifo(fifo, 0o600)
    b = _broker(rules_path=fifo, tenant_socket_root=str(tmp_path / "sockets"))
    root = _root(b)

    def unblock() -> None:  # if the loop is stuck in the read: end it, so the test fails
        with open(fifo, "w", encoding="utf-8") as f:
            f.write("{}")

    guard = threading.Timer(5.0, unblock)

    async def main() -> tuple[bool, Any, Any]:
        reload = asyncio.create_task(b.run_op("reload", root, {"op": "reload"}))
        guard.start()
        for _ in range(1000):  # a writer can open the FIFO once the reload's read has it open
            try:
                wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                await asyncio.sleep(0.01)
        else:
            pytest.fail("the reload's read never waited on the rules file while the loop ran")
        guard.cancel()
        status = await b.run_op("status", root, {"op": "status"})
        reading = not reload.done()
        os.write(wfd, json.dumps({"tenants": {"alice": {}}}).encode())
        os.close(wfd)
        return reading, status["connections"], await reload

    try:
        reading, connections, got = asyncio.run(main())
    finally:
        guard.cancel()
        b.tenant_sockets.close()
    assert (reading, connections) == (True, 0)
    assert got == {"ok": True, "added": ["alice"], "removed": [], "updated": []}


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_bad_tenant_name_is_told_the_form_in_words_too() -> None:
    """Mutation run of 2026-12-07 found the plain-words half of the refusal unpinned (only the
    value and the pattern were): the admin reads both."""
    with pytest.raises(TenantError) as err:
        tenants.validate_name("Alice")
    assert str(err.value) == (
        f"tenant name 'Alice' is not accepted: expected {NAME_FORM} (as a Unix user name: a "
        "lower-case letter or _, then up to 31 of a-z 0-9 _ -)")


def test_a_reload_says_who_was_added_updated_and_removed_and_serves_them(
    dirs: tuple[str, str],
) -> None:
    """Mutation run of 2026-12-07 found the broker's ``reload`` answer (brokerd/tenantd.py)
    unpinned in this process (only a broker process, sent SIGHUP, was tested): root's reload
    names each tenant added, updated and removed, under those keys, and a connection to an
    added tenant's socket is that tenant's."""
    state, root = dirs

    async def go() -> list[dict[str, Any]]:
        b = _broker(state_dir=state, tenant_socket_root=root,
                    tenants={"alice": Tenant.make("alice"), "bob": Tenant.make("bob")})
        admin = Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))
        got = [await b.run_op("reload", admin, {"op": "reload"})]
        b.config.tenants = {"alice": Tenant.make("alice", groups=["ml"]),
                            "erin": Tenant.make("erin")}
        got.append(await b.run_op("reload", admin, {"op": "reload"}))
        before = set(b.connections.conns)
        client = socket.socket(socket.AF_UNIX)
        _KEEP.append(client)
        client.connect(os.path.join(root, "erin", "broker.sock"))
        for _ in range(200):
            new = set(b.connections.conns) - before
            if new:
                (conn,) = new
                got.append({"tenant": conn.account.tenant, "name": conn.account.name})
                break
            await asyncio.sleep(0.01)
        for listener in b.tenant_sockets.listeners.values():
            listener.close()
        return got

    first, second, accepted = asyncio.run(go())
    assert first == {"ok": True, "added": ["alice", "bob"], "removed": [], "updated": []}
    assert second == {"ok": True, "added": ["erin"], "removed": ["bob"], "updated": ["alice"]}
    assert accepted == {"tenant": True, "name": "erin"}


def test_a_tenant_waiting_on_one_socket_may_not_wait_on_another_past_its_ticket_cap() -> None:
    """Mutation run of 2026-12-07 found the tenant's own tickets unpinned in the admission of a
    ticket (their uid, the container's, not read as the tenant's): a tenant with a ticket may
    not take a second past ``max_tickets_per_user = 1``, whatever uid its container runs as."""
    from tests.unit.test_broker_views import CONSTRAINTS

    b = _broker(max_tickets_per_user=1)
    alice = Tenant.make("alice")
    first = _on_socket_of(b, alice, uid=1000)
    first.record = ops_mod.make_record(b, first, "ticket", {
        "device_uuids": [], "device_requested_bytes": [], "exclusive": False,
        "pid": first.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process", "seq": 1, "constraints": CONSTRAINTS})
    second = _on_socket_of(b, alice, uid=1000)
    with pytest.raises(BrokerRefusal) as err:
        asyncio.run(b.run_op("ticket", second, {"op": "ticket", "constraints": CONSTRAINTS}))
    assert err.value.kind == "LeaseLimitError"
    assert str(err.value).startswith("alice already waits in line with 1 ticket(s)")
    assert second.record is None


def test_a_table_that_cannot_be_written_leaves_the_old_one_and_no_piece(
    dirs: tuple[str, str],
) -> None:
    """Mutation run of 2026-12-07 found the clean-up of a table write that fails unpinned (the
    temporary file's removal): on a full disk the add fails with the disk's error, the table
    read is the old one, and no partial file is left beside it."""
    from tests.unit.test_broker_journal import file_size_limit

    state, root = dirs
    tenants.add_tenant("alice", state_dir=state, socket_root=root)
    before = sorted(os.listdir(state))
    with file_size_limit(10), pytest.raises(OSError):
        tenants.add_tenant("bob", ["ml"], 2, state_dir=state, socket_root=root)
    assert sorted(os.listdir(state)) == before
    assert sorted(tenants.load_table(state)) == ["alice"]


def test_a_tenant_removed_by_a_reload_tells_its_idle_and_its_waiting_connections(
    dirs: tuple[str, str],
) -> None:
    """Mutation run of 2026-12-07 found a removal's words to the tenant's connections unpinned
    in this process (brokerd/tenantd.py ``remove``): a connection that holds nothing is sent
    the revocation (kind "lease", no lease id) and closed; one still waiting in the socket's
    backlog is answered with the same line and closed."""
    state, root = dirs
    line = tenants.removed_refusal("bob")

    async def read_all(sock: socket.socket) -> bytes:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        got = b""
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            if not chunk:
                return got
            got += chunk

    async def go() -> tuple[bytes, bytes]:
        b = _broker(state_dir=state, tenant_socket_root=root,
                    tenants={"bob": Tenant.make("bob")})
        admin = Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))
        await b.run_op("reload", admin, {"op": "reload"})
        path = os.path.join(root, "bob", "broker.sock")
        idle = socket.socket(socket.AF_UNIX)
        _KEEP.append(idle)
        idle.connect(path)
        for _ in range(200):  # accepted by the broker's loop
            if b.connections.conns:
                break
            await asyncio.sleep(0.01)
        assert b.connections.conns
        waiting = socket.socket(socket.AF_UNIX)
        _KEEP.append(waiting)
        waiting.connect(path)  # no await before the removal: still in the backlog
        # the removal a reload makes once it has read the files (the reload reads them off the
        # loop, which would accept the second connection meanwhile): made here at once
        b.tenant_sockets.remove("bob")
        return await read_all(idle), await read_all(waiting)

    told_idle, told_waiting = asyncio.run(go())
    assert [json.loads(x) for x in told_idle.splitlines()] == [
        {"event": "revoked", "lease_id": "", "kind": "lease", "message": line}]
    assert json.loads(told_waiting)["error"] == line


def test_a_removed_tenants_directory_that_holds_other_files_is_left_and_the_admin_told(
    dirs: tuple[str, str], caplog: pytest.LogCaptureFixture,
) -> None:
    """A tenant removed by a reload whose socket directory holds a file the broker did not make:
    its socket is removed, the directory and that file are left, and the log says so, naming the
    tenant and the directory. Mutation run of 2026-12-07 (seed 71) found that warning unpinned
    (``brokerd/tenantd.py`` ``remove``: logged without the tenant's name, or with its name as
    the format)."""
    import logging

    state, root = dirs

    async def go() -> None:
        b = _broker(state_dir=state, tenant_socket_root=root,
                    tenants={"bob": Tenant.make("bob")})
        admin = Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))
        await b.run_op("reload", admin, {"op": "reload"})
        Path(root, "bob", "notes.txt").write_text("the container's\n")
        b.config.tenants = {}
        with caplog.at_level(logging.WARNING, logger="autogpu_jupyter"):
            assert (await b.run_op("reload", admin, {"op": "reload"}))["removed"] == ["bob"]

    asyncio.run(go())
    assert sorted(os.listdir(os.path.join(root, "bob"))) == ["notes.txt"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"tenant bob removed: {root}/bob holds other files: left as it is"]


def test_a_tenant_whose_socket_cannot_be_made_is_skipped_and_said_the_others_served(
    dirs: tuple[str, str], caplog: pytest.LogCaptureFixture,
) -> None:
    """At a reload, a tenant whose socket directory is not one the broker may use (here a
    plain file in its place) gets no socket and one warning naming it and why; the tenants
    after it are served all the same, and the reload's answer names only those. Mutation run
    of 2026-12-07 (seed 71, brokerd/tenantd.py ``reload``) found that warning and the going on
    past a tenant without a socket unpinned."""
    import logging

    state, root = dirs
    tenants.ensure_socket_root(root)
    Path(root, "alice").write_text("not a directory\n")

    async def go() -> dict[str, Any]:
        b = _broker(state_dir=state, tenant_socket_root=root,
                    tenants={"alice": Tenant.make("alice"), "bob": Tenant.make("bob")})
        admin = Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))
        try:
            with caplog.at_level(logging.WARNING, logger="autogpu_jupyter"):
                return await b.run_op("reload", admin, {"op": "reload"})
        finally:
            b.tenant_sockets.close()

    reply = asyncio.run(go())
    assert (reply["added"], reply["removed"], reply["updated"]) == (["bob"], [], [])
    assert os.path.exists(tenants.tenant_socket(root, "bob"))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"tenant alice: no socket (tenant socket directory {root}/alice is not a directory of "
        f"uid {os.geteuid()} that only it can write: refused (remove it and add the tenant "
        "again))"]


def test_a_removed_tenants_connection_that_holds_a_lease_is_told_its_lease_is_revoked(
    dirs: tuple[str, str],
) -> None:
    """A tenant removed by a reload while one of its connections holds a lease: that
    connection is told the revocation with its lease's id and kind, then closed, and the
    lease ends. Mutation run of 2026-12-07 (seed 71) found the lease's id in that line
    unpinned (only a connection that held nothing was checked)."""
    state, root = dirs
    line = tenants.removed_refusal("bob")

    async def go() -> tuple[str, bytes, set[str]]:
        b = _broker(state_dir=state, tenant_socket_root=root,
                    tenants={"bob": Tenant.make("bob")})
        admin = _root(b)
        await b.run_op("reload", admin, {"op": "reload"})
        ours, theirs = socket.socketpair()
        _KEEP.append(theirs)
        before = set(b.connections.conns)
        b.connections.accepted(ours, tenant=Tenant.make("bob"))
        (conn,) = set(b.connections.conns) - before
        _lease(b, conn, "GPU-rv1")
        assert conn.record is not None
        lease_id = conn.record.lease_id
        b.config.tenants = {}
        assert (await b.run_op("reload", admin, {"op": "reload"}))["removed"] == ["bob"]
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)
        got = b""
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(theirs, 65536), 10)
            if not chunk:
                break
            got += chunk
        live = {r.lease_id for _, r in b.book.live()}
        return lease_id, got, live

    lease_id, told, live = asyncio.run(go())
    assert [json.loads(x) for x in told.splitlines()] == [
        {"event": "revoked", "lease_id": lease_id, "kind": "lease", "message": line}]
    assert lease_id not in live
