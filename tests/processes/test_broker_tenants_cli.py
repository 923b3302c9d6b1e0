"""``autogpu broker tenant add|list|remove`` as the real command (issue 40, phase A).

The command edits the tenants table in the broker's state directory and makes or removes each
tenant's socket directory under a root-only socket root. The test runs the command as root and
as a real other user (who is refused in one line), reads what the admin reads (its output, the
table, ``--json``) and checks that a host user cannot reach a tenant's socket: the socket root
lies in ``/var/tmp`` (not pytest's own 0700 directory, which would hide the root's own mode).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from autogpu_jupyter.brokerd import tenants
from tests.leasehelpers import AsUser, cli_as, ensure_user

REPO = Path(__file__).resolve().parents[2]
USER = "agtest-tenant"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the table is root's and "
                               "a second, real user is created)")


@pytest.fixture
def area() -> Iterator[Path]:
    root = Path(f"/var/tmp/autogpu-tenants-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tenant(area: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``autogpu broker tenant ARGS`` as root, on the area's state directory and socket root."""
    where = ["--state-dir", str(area / "state"), "--socket-root", str(area / "sockets"),
             "--rules", str(area / "broker.json"), "--socket", str(area / "no-broker.sock")
             ] if args else []
    return subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "tenant", *args, *where],
        capture_output=True, text=True, check=False, cwd=str(REPO), timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@root_only
def test_add_list_remove_as_the_admin_sees_them(area: Path) -> None:
    (area / "broker.json").write_text(json.dumps({"tenants": {"carol": {"groups": ["staff"]}}}))
    out = tenant(area, "add", "alice", "--group", "ml", "--group", "students",
                 "--max-devices", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"tenant alice added (groups: ml, students; max devices: 1); its socket directory "
        f"{area}/sockets/alice is mounted at /run/autogpu in its container",
        f"the broker is not running at {area}/no-broker.sock: it serves the tenants when it "
        "starts"]
    assert tenant(area, "add", "alice", "--group", "ml", "--group", "students",
                  "--max-devices", "1").stdout.startswith("tenant alice unchanged")
    assert tenant(area, "add", "bob").stdout.startswith(
        "tenant bob added (groups: none; max devices: the rules')")

    listed = tenant(area, "list")
    assert listed.returncode == 0
    assert listed.stdout.splitlines() == [
        "tenants: 3",
        f"  alice  groups: ml, students; max devices: 1  (table)  "
        f"{area}/sockets/alice/broker.sock",
        f"  bob  groups: none; max devices: the rules'  (table)  {area}/sockets/bob/broker.sock",
        f"  carol  groups: staff; max devices: the rules'  (rules)  "
        f"{area}/sockets/carol/broker.sock",
    ]
    rows = json.loads(tenant(area, "list", "--json").stdout)
    assert [(r["name"], r["groups"], r["max_devices"], r["source"]) for r in rows] == [
        ("alice", ["ml", "students"], 1, "table"),
        ("bob", [], None, "table"),
        ("carol", ["staff"], None, "rules"),
    ]
    assert json.loads((area / "state" / "tenants.json").read_text())["tenants"]["alice"] == {
        "groups": ["ml", "students"], "max_devices": 1}

    gone = tenant(area, "remove", "alice")
    assert (gone.returncode, gone.stdout.splitlines()[0]) == (0, "tenant alice removed")
    assert sorted(os.listdir(area / "sockets")) == ["bob"]
    again = tenant(area, "remove", "alice")
    assert again.returncode == 1
    assert again.stderr.strip() == ("autogpu: no tenant 'alice' in the table (tenants: bob; see "
                                    "autogpu broker tenant list)")
    fixed = tenant(area, "remove", "carol")
    assert fixed.returncode == 1
    assert fixed.stderr.strip() == ("autogpu: tenant carol is defined in the rules file: remove "
                                    "it there")


@pytest.mark.parametrize(("args", "says"), [
    (["add", "Alice"], "autogpu: tenant name 'Alice' is not accepted: expected "
     "^[a-z_][a-z0-9_-]{0,31}$"),
    (["add", "root"], "autogpu: tenant name 'root' is reserved"),
    (["add", "alice", "--group", "ML"], "autogpu: tenant name 'alice'"),
    (["add", "alice", "--max-devices", "-1"], "autogpu: tenant alice: max_devices '-1' is not "
     "accepted"),
    (["remove", "a b"], "autogpu: tenant name 'a b' is not accepted"),
    (["frobnicate"], "autogpu broker tenant: error: argument ACTION: invalid choice"),
    ([], "autogpu broker tenant: error: expected add, list or remove"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(
    area: Path, args: list[str], says: str,
) -> None:
    if args[:3] == ["add", "alice", "--group"]:
        says = "autogpu: tenant alice: group 'ML' is not accepted"
    out = tenant(area, *args)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(says), out.stderr
    assert "Traceback" not in out.stderr
    assert not (area / "state").exists()
    assert not (area / "sockets").exists()


@root_only
def test_a_host_user_is_refused_in_one_line_and_cannot_reach_a_tenants_socket(
    area: Path,
) -> None:
    ensure_user(USER)
    assert tenant(area, "add", "alice").returncode == 0
    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{REPO}"}
    out = cli_as(USER, env, "broker", "tenant", "add", "mallory", "--state-dir",
                 str(area / "state"), "--socket-root", str(area / "sockets"))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"autogpu: broker tenant add needs root: the tenants table in {area}/state and the "
        "socket directories are root's (run it with sudo)")
    assert tenants.load_table(str(area / "state")).keys() == {"alice"}

    # The broker (phase B) listens there; a host user is stopped by the 0700 socket root.
    listening = tenants.listen_tenant(str(area / "sockets"), "alice")
    try:
        uid, gid = ensure_user(USER)
        path = tenants.tenant_socket(str(area / "sockets"), "alice")
        assert AsUser(uid, gid, _connect, path).result() == "PermissionError"
        assert _connect(path) == "connected"  # root (the broker's side) reaches it
    finally:
        listening.close()


def _connect(path: str) -> str:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
    except OSError as err:
        return type(err).__name__
    return "connected"
