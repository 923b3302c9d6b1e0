"""``autogpu broker tenant add|list|remove`` in-process (``brokerd.tenantcli.main`` with argv, as
``autogpu broker tenant`` calls it): what the admin reads on stdout and stderr, the exit code,
and the tenants table other programs (the broker) read. The real command, its modes and a second
real user are ``tests/processes/test_broker_tenants_cli.py``; this file is the fast one, reached
by the mutation run (issue 42: the seed-71 sample found ``tenantcli`` reached by no fast test).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from autogpu_jupyter.brokerd import tenantcli
from autogpu_jupyter.brokerd.tenants import DEFAULT_SOCKET_ROOT

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the tenants table is root's")


def run(area: Path, *args: str, where: bool = True) -> tuple[int, str, str]:
    """``autogpu broker tenant ARGS`` on the area's state directory, socket root, rules and a
    socket no broker listens on: (exit code, stdout, stderr)."""
    extra = ["--state-dir", str(area / "state"), "--socket-root", str(area / "sockets"),
             "--rules", str(area / "broker.json"), "--socket", str(area / "no-broker.sock")
             ] if where else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tenantcli.main([*args, *extra])
        except SystemExit as ex:  # argparse's own exits (--help, a bad argument)
            code = int(ex.code or 0)
    return code, out.getvalue(), err.getvalue()


@root_only
def test_add_list_remove_print_what_was_done_and_write_the_table(tmp_path: Path) -> None:
    (tmp_path / "broker.json").write_text(json.dumps({"tenants": {"carol": {"groups": ["x"]}}}))
    code, out, err = run(tmp_path, "add", "alice", "--group", "ml", "--max-devices", "1")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"tenant alice added (groups: ml; max devices: 1); its socket directory "
        f"{tmp_path}/sockets/alice is mounted at /run/autogpu in its container",
        f"the broker is not running at {tmp_path}/no-broker.sock: it serves the tenants when it "
        "starts",
    ]
    assert (tmp_path / "sockets" / "alice").is_dir()
    table = json.loads((tmp_path / "state" / "tenants.json").read_text())
    assert table["tenants"] == {"alice": {"groups": ["ml"], "max_devices": 1}}

    code, out, _ = run(tmp_path, "list")
    assert code == 0
    assert out.splitlines() == [
        "tenants: 2",
        f"  alice  groups: ml; max devices: 1  (table)  {tmp_path}/sockets/alice/broker.sock",
        f"  carol  groups: x; max devices: the rules'  (rules)  "
        f"{tmp_path}/sockets/carol/broker.sock",
    ]
    code, out, _ = run(tmp_path, "list", "--json")
    assert code == 0
    assert json.loads(out) == [
        {"name": "alice", "groups": ["ml"], "max_devices": 1, "source": "table",
         "socket": f"{tmp_path}/sockets/alice/broker.sock"},
        {"name": "carol", "groups": ["x"], "max_devices": None, "source": "rules",
         "socket": f"{tmp_path}/sockets/carol/broker.sock"},
    ]

    code, out, err = run(tmp_path, "remove", "alice")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "tenant alice removed",
        f"the broker is not running at {tmp_path}/no-broker.sock: it serves the tenants when it "
        "starts",
    ]
    assert json.loads((tmp_path / "state" / "tenants.json").read_text())["tenants"] == {}
    assert not (tmp_path / "sockets" / "alice").exists()
    code, out, err = run(tmp_path, "remove", "alice")
    assert (code, out) == (1, "")
    assert err == "autogpu: no tenant 'alice' in the table (tenants: none; see autogpu broker " \
        "tenant list)\n"


@root_only
def test_list_without_a_socket_root_names_the_default_sockets(tmp_path: Path) -> None:
    (tmp_path / "broker.json").write_text(json.dumps({"tenants": {"carol": {}}}))
    code, out, _ = run(tmp_path, "list", "--state-dir", str(tmp_path / "state"), "--rules",
                       str(tmp_path / "broker.json"), where=False)
    assert code == 0
    assert out.splitlines()[1].endswith(f"  {DEFAULT_SOCKET_ROOT}/carol/broker.sock")


def test_no_action_is_the_usage_and_one_line_exit_2(tmp_path: Path) -> None:
    code, out, err = run(tmp_path, where=False)
    assert (code, out) == (2, "")
    assert err.splitlines()[0].startswith("usage: autogpu broker tenant ")
    assert err.splitlines()[-1] == "autogpu broker tenant: error: expected add, list or remove"


@pytest.mark.parametrize(("args", "says"), [
    (["add", "Alice"], "autogpu: tenant name 'Alice' is not accepted: expected "
     "^[a-z_][a-z0-9_-]{0,31}$"),
    (["remove", "a b"], "autogpu: tenant name 'a b' is not accepted"),
    (["list", "--json", "yes"], "autogpu broker tenant: error: unrecognized arguments: yes "
     "(see autogpu broker tenant --help)"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, args: list[str], says: str,
) -> None:
    code, out, err = run(tmp_path, *args)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith(says), err
    assert not (tmp_path / "state").exists() and not (tmp_path / "sockets").exists()


def test_help_names_the_name_form_and_every_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps at the terminal's width
    code, out, _ = run(tmp_path, "--help", where=False)
    assert code == 0
    assert "Names: ^[a-z_][a-z0-9_-]{0,31}$. See docs/jupyterhub.md." in " ".join(out.split())
    code, out, _ = run(tmp_path, "add", "--help", where=False)
    flat = " ".join(out.split())
    assert code == 0
    for said in ("--state-dir DIR the broker's state directory (default /var/lib/autogpu-broker)",
                 f"--socket-root DIR where the tenants' socket directories live (default "
                 f"{DEFAULT_SOCKET_ROOT}, root's, mode 0700)",
                 "--socket PATH the running broker's main socket"):
        assert said in flat, flat


@root_only
def test_another_user_is_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    """Run as uid 65534 (this process's effective uid for the call, so that the call is seen
    by the mutation run's map of which test reaches which function; a forked child's is not)."""
    os.seteuid(65534)
    try:
        code, out, err = run(tmp_path, "add", "mallory")
    finally:
        os.seteuid(0)
    assert (code, out) == (1, "")
    assert err == (f"autogpu: broker tenant add needs root: the tenants table in {tmp_path}/state "
                   "and the socket directories are root's (run it with sudo)\n")
    assert not (tmp_path / "state").exists()
