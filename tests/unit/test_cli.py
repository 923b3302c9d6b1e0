"""The ``autogpu`` command through its entry point (``cli.main``) in this process: exit codes,
what it shows to whom. A simulated fleet file and a real lease registry; ``autogpu hosts`` asks
a loopback server replaying a recorded Prometheus. The same commands as real processes are in
``tests/processes/test_cli.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.cli import main
from tests.leasehelpers import AsUser
from tests.payloadhelpers import GiB, recorded_prometheus, shared_registry, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
SECRET = "python train.py --token=hunter2"


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Two simulated GPUs and a private registry; returns the registry."""
    from autogpu_jupyter.core import backends

    fleet = write_fleet(tmp_path / "fleet.json", [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0,
         "processes": [{"pid": 61001, "used_memory": GiB, "user": "bob", "command": SECRET}]},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 40 * GiB,
         "utilization_pct": 50},
    ])
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID",
                 "AUTOGPU_PROMETHEUS_URL", "AUTOGPU_BROKER_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    backends._cache.clear()
    yield tmp_path / "registry"
    backends._cache.clear()


def cli(*args: str) -> tuple[int, str, str]:
    """``autogpu ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


# ---- autogpu run ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "code"),
    [("exit 0", 0), ("exit 7", 7), ("kill -TERM $$", 128 + 15), ("kill -KILL $$", 128 + 9),
     ("kill -HUP $$", 128 + 1)],
)
def test_run_exits_with_the_commands_code_and_128_plus_a_signal(
    host: Path, script: str, code: int, hangups: Any
) -> None:
    """A command killed by signal N exits 128 + N, as a shell reports it. Caught: 128 - N (a
    negative return code subtracted twice)."""
    from autogpu_jupyter.core.leasing import Registry

    hangups(signal.SIG_DFL)  # as in a terminal (the runner may be under nohup)
    got, _out, err = cli("run", "--", "sh", "-c", script)
    assert got == code, err
    assert err.startswith(f"GPU 0 NVIDIA A100 {A}: 80.0 GiB free, util 0%\n")
    assert Registry(str(host)).list_leases() == []  # the lease ended with the command


@pytest.fixture
def hangups() -> Iterator[Any]:
    """Set this process's SIGHUP disposition for one test; the old one comes back after."""
    old = signal.getsignal(signal.SIGHUP)
    yield lambda how: signal.signal(signal.SIGHUP, how)
    signal.signal(signal.SIGHUP, old)


def test_run_under_nohup_leaves_the_command_immune_to_hangups(host: Path, hangups: Any) -> None:
    """``nohup autogpu run -- CMD``: CMD inherits the ignored SIGHUP, as nohup promises (the
    hangup that autogpu forwards is ignored too)."""
    hangups(signal.SIG_IGN)
    got, _out, err = cli("run", "--", "sh", "-c", "kill -HUP $$; exit 5")
    assert got == 5, err


def test_run_without_a_command_is_a_usage_error(host: Path) -> None:
    assert cli("run") == (
        2, "", "autogpu: error: run needs a command: autogpu run [options] -- CMD ARGS\n")
    assert cli("run", "--") == (
        2, "", "autogpu: error: run needs a command: autogpu run [options] -- CMD ARGS\n")


# ---- who sees which command lines ----------------------------------------------------------


def _lease_with_command(registry: Path) -> Any:
    from autogpu_jupyter.core.leasing import Registry, Requester

    with Registry(str(registry), record_commands=True).locked() as txn:
        assert txn is not None
        return txn.create(devices=[A], requested_bytes=GiB,
                          requester=Requester(kernel_id="k-1", command=SECRET))


def _as_nobody(*args: str) -> tuple[int, str, str]:
    """``autogpu ARGS`` run as user nobody (a forked child of this root process)."""
    pw = pwd.getpwnam("nobody")
    child = AsUser(pw.pw_uid, pw.pw_gid, cli, *args)
    got = child.result()
    assert child.stop() == 0
    assert isinstance(got, tuple), got
    return got


def _shown(out: str, key: str = "") -> list[str | None]:
    data = json.loads(out)
    leases = data[key] if key else data
    return [lease["command"] for lease in leases]


def test_leases_show_commands_only_for_root(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``leases --show-commands`` shows command lines to root only; anyone else gets them
    redacted, their own included. Caught: the root check dropped from ``--show-commands``. As
    root this runs the command also as user nobody (a real other user)."""
    with shared_registry() as registry:
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(registry))
        # the fleet where user nobody can read it too
        fleet = registry.parent / "fleet.json"
        fleet.write_bytes(Path(os.environ["AUTOGPU_SIMULATE"]).read_bytes())
        fleet.chmod(0o644)
        monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet))
        lease = _lease_with_command(registry)
        try:
            code, out, _ = cli("leases", "--json")
            assert code == 0 and _shown(out) == [None]
            code, out, _ = cli("leases", "--json", "--show-commands")
            assert code == 0
            assert _shown(out) == [SECRET if os.geteuid() == 0 else None]
            if os.geteuid() == 0:
                code, out, err = _as_nobody("leases", "--json", "--show-commands")
                assert code == 0, err
                assert _shown(out) == [None]
                code, out, err = _as_nobody("list", "--json")
                assert code == 0, err
                assert _shown(out, "leases") == [None]
                (gpu_a, _b) = json.loads(out)["devices"]
                assert [p["command"] for p in gpu_a["processes"]] == [None]  # bob's
        finally:
            lease.release()


def _own_lease_then(registry: Path, *args: str) -> tuple[int, str, str]:
    """Take a lease with a command line, run ``autogpu ARGS``, release the lease."""
    lease = _lease_with_command(registry)
    try:
        return cli(*args)
    finally:
        lease.release()


def test_list_shows_the_users_own_command_lines(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user sees their own leases' command lines (root sees every one). As root this runs as
    user nobody, whose own lease it is. Caught: ``list --json`` showing lease commands to root
    only."""
    with shared_registry() as registry:
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(registry))
        fleet = registry.parent / "fleet.json"
        fleet.write_bytes(Path(os.environ["AUTOGPU_SIMULATE"]).read_bytes())
        fleet.chmod(0o644)
        monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet))
        if os.geteuid() == 0:
            pw = pwd.getpwnam("nobody")
            child = AsUser(pw.pw_uid, pw.pw_gid, _own_lease_then, registry, "list", "--json")
            code, out, err = child.result()
            assert child.stop() == 0
        else:
            code, out, err = _own_lease_then(registry, "list", "--json")
    assert code == 0, err
    assert _shown(out, "leases") == [SECRET]
    (gpu_a, _b) = json.loads(out)["devices"]
    assert [p["command"] for p in gpu_a["processes"]] == [None]  # bob's


def test_prune_all_needs_root(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caught: the root check of ``leases --prune --all`` dropped (a user removing every
    user's dead lease files)."""
    assert cli("leases", "--all") == (2, "", "autogpu: error: --all goes with --prune\n")
    if os.geteuid() == 0:
        with shared_registry() as registry:
            monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(registry))
            code, out, err = _as_nobody("leases", "--prune", "--all")
        assert (code, out, err) == (2, "", "autogpu: error: --prune --all needs root\n")
    else:
        assert cli("leases", "--prune", "--all") == (
            2, "", "autogpu: error: --prune --all needs root\n")


# ---- autogpu hosts -------------------------------------------------------------------------


def test_hosts_exit_3_when_no_host_fits_in_every_format(host: Path) -> None:
    """Caught: ``hosts --json`` exiting 0 when no host fits (a script reads the code)."""
    with recorded_prometheus() as url:
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "10G", "--json")
        assert (code, err) == (0, "")
        data = json.loads(out)
        assert data["best"] == "gpu-b" and data["hosts"][0]["fits"] is True
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "500G", "--json")
        assert (code, err) == (3, "")
        data = json.loads(out)
        assert data["best"] is None and [h["fits"] for h in data["hosts"]] == [False] * 4
        assert cli("hosts", "--prometheus", url, "--min-free", "10G", "--best") == (
            0, "gpu-b\n", "")
        assert cli("hosts", "--prometheus", url, "--min-free", "500G", "--best") == (
            3, "", "autogpu: no host has a device for min free 500.0 GiB\n")
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "500G")
        assert (code, err) == (3, "")
        assert out.splitlines()[1:] == [
            "  1. dgx-d                ok    nothing fits",
            "  2. gpu-a                ok    nothing fits",
            "  3. gpu-b                ok    nothing fits",
            "  4. gpu-c                ok    nothing fits",
        ]
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "10G")
        assert (code, err) == (0, "")
        assert out.splitlines()[1] == (
            "  1. gpu-b                ok    GPU 2 NVIDIA L4 (22.0 GiB free, util 30%)")


def test_hosts_without_a_prometheus_says_how_to_name_one(host: Path) -> None:
    assert cli("hosts") == (
        2, "", "autogpu: no Prometheus to ask: pass --prometheus http://HOST:9090, or set "
        "c.AutoGPU.prometheus_url or $AUTOGPU_PROMETHEUS_URL\n")


def test_host_and_model_names_from_prometheus_are_shown_as_text(host: Path) -> None:
    """A hostname is another machine's text: an invisible character (a zero-width space that
    makes ``gpu-b`` look like another host) is spelled out. Caught: the CLI's own escaping of
    hostnames dropped (the terminal filter spells out control characters only)."""
    with recorded_prometheus(rename={"gpu-b": "gpu\u200b-b"}) as url:
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "10G")
    assert (code, err) == (0, "")
    assert out.splitlines()[1] == (
        "  1. gpu\\u200b-b          ok    GPU 2 NVIDIA L4 (22.0 GiB free, util 30%)")
    assert "\u200b" not in out


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_the_exporter_refuses_a_port_out_of_range(host: Path, port: str) -> None:
    """Caught: the port's bounds off by one."""
    assert cli("exporter", "--port", port) == (
        2, "", f"autogpu: invalid --port {port}: expected 1-65535, e.g. 9445\n")


# ---- autogpu broker serve: the admin's limits --------------------------------------------------


def _served_config(monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """The BrokerConfig ``autogpu broker serve ARGS`` would serve with (the daemon not started)."""
    from autogpu_jupyter import broker

    seen: list[Any] = []
    monkeypatch.setattr(broker, "main", lambda config: seen.append(config) or 0)
    code, _, err = cli("broker", "serve", "--socket", "/nonexistent/broker.sock", *args)
    assert code == 0 and len(seen) == 1, err
    return seen[0]


def test_the_brokers_lease_and_ticket_limits_come_from_config_the_rules_file_and_flags(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_leases_per_user and max_tickets_per_user: the AutoGPU setting, else the rules file,
    else the flag, each winning over the one before (as max_devices_per_user)."""
    monkeypatch.setenv("AUTOGPU_MAX_TICKETS_PER_USER", "3")
    rules = tmp_path / "rules.json"
    config = _served_config(monkeypatch, "--rules", "")
    assert (config.max_leases_per_user, config.max_tickets_per_user) == (0, 3)
    rules.write_text(json.dumps({"max_leases_per_user": 4, "max_tickets_per_user": 1}))
    config = _served_config(monkeypatch, "--rules", str(rules))
    assert (config.max_leases_per_user, config.max_tickets_per_user) == (4, 1)
    config = _served_config(monkeypatch, "--rules", str(rules), "--max-leases-per-user", "6",
                            "--max-tickets-per-user", "0")
    assert (config.max_leases_per_user, config.max_tickets_per_user) == (6, 0)


def test_the_brokers_timing_flags_reach_its_config(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: a flag parsed but not handed to the broker (its default then applies silently)."""
    config = _served_config(monkeypatch)
    assert (config.ticket_grace_s, config.send_timeout_s) == (5.0, 10.0)
    config = _served_config(monkeypatch, "--ticket-grace", "9", "--send-timeout", "2.5",
                            "--max-connections", "100", "--subuid-file", "/dev/null")
    assert (config.ticket_grace_s, config.send_timeout_s, config.max_connections,
            config.subuid_path) == (9.0, 2.5, 100, "/dev/null")


def test_the_brokers_per_user_rate_and_connection_flags_reach_its_config(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-connections-per-user and --max-messages-per-s-per-user (a number, fractions
    allowed) are what the broker serves with; left out, 256 connections and 500 messages a
    second. Caught (seed 54): the connection flag not handed to the broker (None); the rate
    read as text ("2.5", which the broker's arithmetic cannot use)."""
    config = _served_config(monkeypatch)
    assert (config.max_connections_per_user, config.messages_per_s_per_user) == (256, 500.0)
    config = _served_config(monkeypatch, "--max-connections-per-user", "3",
                            "--max-messages-per-s-per-user", "2.5")
    assert (config.max_connections_per_user, config.messages_per_s_per_user) == (3, 2.5)


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_broker_limit_flag_is_one_line_naming_it(
    host: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["broker", "serve", "--max-tickets-per-user", value])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.splitlines()[-1] == (
        f"autogpu broker: error: argument --max-tickets-per-user: {value!r}: expected a whole "
        "number >= 0"
    )


def test_the_broker_help_names_its_folder_argument(capsys: pytest.CaptureFixture[str]) -> None:
    """Caught (mutation run, issue 22): the --state-dir placeholder lower-cased (every other
    placeholder of the CLI is upper case, as argparse writes its own)."""
    with pytest.raises(SystemExit) as done:
        main(["broker", "--help"])
    assert done.value.code == 0
    assert "--state-dir DIR" in capsys.readouterr().out


def test_the_help_names_the_commands_in_one_placeholder(capsys: pytest.CaptureFixture[str]) -> None:
    """The usage line says COMMAND (the commands are listed below it), not every command's name
    in braces."""
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: autogpu [-h] [--version] COMMAND ...\n")


def test_pick_dry_run_ranks_every_device_and_changes_nothing(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autogpu pick --dry-run``: one line saying nothing changed, then every device with its
    rank (or "-" when dropped), free memory, util, the load it was ranked by, leases and verdict,
    then why the best won (as ``%gpu pick --dry-run`` says it); no lease taken. Caught
    by nothing in-process before (the ranking's text was only seen by the slow CLI tests)."""
    from autogpu_jupyter.core.leasing import Registry

    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = cli("pick", "--dry-run", "--min-free", "50G")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "autogpu [SIMULATED] dry run (min free 50.0 GiB): nothing changed"
    assert [ln.split() for ln in lines[1:]] == [
        ["rank", "device", "name", "free", "util", "load", "leases", "verdict"],
        ["1", "GPU", "0", "NVIDIA", "A100", "80.0", "GiB", "0%", "0%", "util", "0", "would",
         "pick:", "80.0", "GiB", "free", ">=", "50.0", "GiB", "wanted"],
        ["-", "GPU", "1", "NVIDIA", "A100", "40.0", "GiB", "50%", "-", "0", "dropped:", "only",
         "40.0", "GiB", "free", "<", "50.0", "GiB", "wanted"],
        ["why", "GPU", "0:", "the", "only", "device", "that", "fits"],
    ]
    assert Registry(str(host)).list_leases() == []
    # nothing fits: exit 3, as the pick would, with each device's reason
    code, out, err = cli("pick", "--dry-run", "--min-free", "90G")
    assert (code, out) == (3, "")
    assert err.splitlines() == [
        "autogpu: no device fits (min free 90.0 GiB):",
        "  GPU 0 (NVIDIA A100): dropped: only 80.0 GiB free < 90.0 GiB wanted",
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 90.0 GiB wanted",
        "nothing picked; to wait in line until a device fits, add --wait DURATION (e.g. --wait "
        "10m)",
    ]


# ---- mutation run (issue 22): what each command shows ------------------------------------------


def test_list_titles_a_simulated_fleet_after_its_device_count(host: Path) -> None:
    """``autogpu list`` says how many devices, from which backend, and that they are simulated.
    Caught: the simulated note replacing the title instead of following it."""
    code, out, err = cli("list")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == (
        "2 device(s) via simulated — SIMULATED fleet (AUTOGPU_SIMULATE), not real GPUs")


def test_list_with_an_unreadable_registry_notes_it_on_stderr(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry that is a symlink is refused: ``autogpu list`` still shows the devices (stdout
    stays the table a script parses) and says why the leases are missing on stderr. Caught: the
    note printed to stdout."""
    real = host.parent / "real-registry"
    real.mkdir(mode=0o1777)
    link = host.parent / "link-registry"
    link.symlink_to(real)
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(link))
    code, out, err = cli("list")
    assert code == 0
    assert out.splitlines()[0].startswith("2 device(s) via simulated")
    assert "lease registry" not in out
    assert err == (
        f"note: lease registry not readable: lease registry {link} is a symlink: refused "
        "(another user could redirect leases elsewhere); the admin should make it a real "
        "directory, mode 1777\n")


def test_leases_with_none_live_says_where_it_looked(host: Path) -> None:
    """Caught: the line naming the registry replaced by ``None``."""
    assert cli("leases") == (0, f"no live leases in {host}\n", "")


def test_run_hands_the_command_its_lease_id_and_records_a_cli_holder(
    host: Path, tmp_path: Path
) -> None:
    """The command run sees AUTOGPU_LEASE_ID, the id of the lease file it holds, and that lease
    says a CLI took it (holder_kind "cli", as ``autogpu leases`` and the panel read it). Caught:
    the lease test inverted (no AUTOGPU_LEASE_ID for a leased command, a crash without a lease);
    the holder kind written "CLI"."""
    seen = tmp_path / "seen"
    script = 'printf %s "$AUTOGPU_LEASE_ID" > "$0.id"; cat "$1"/*/*.lease > "$0"'
    code, _out, err = cli("run", "--", "sh", "-c", script, str(seen), str(host))
    assert code == 0, err
    record = json.loads(seen.read_text())
    assert (seen.parent / "seen.id").read_text() == record["lease_id"]
    assert len(record["lease_id"]) == 32
    assert record["holder_kind"] == "cli"
    assert record["device_uuids"] == [A]


_HELP_LINES = {
    "": ["leases list the live leases on this host"],
    "pick": [
        'Print the best device(s). No lease outlives this command: use `autogpu run -- CMD` to '
        'hold one for CMD\'s lifetime. --export prints shell assignments for eval: eval '
        '"$(autogpu pick --min-free 10G --export)".',
        "--dry-run show the whole ranking with the reason each device was kept or dropped (as "
        "%gpu pick --dry-run); changes nothing",
        "--json machine-readable output",
    ],
    "run": [
        "Pick, take a lease, run CMD with CUDA_VISIBLE_DEVICES set; the lease lasts exactly as "
        "long as CMD runs. Exits with CMD's exit code.",
    ],
    "leases": [
        "--show-commands show other users' command lines (root only)",
        "--all with --prune, as root: remove every user's dead lease files",
    ],
    "broker": [
        "--socket PATH the Unix socket (default c.AutoGPU.broker_socket, else "
        "/run/autogpu/broker.sock)",
        "--max-connections N connections in all users together",
        "--subuid-file FILE subordinate uid ranges: such a uid counts as its owner (default "
        "/etc/subuid)",
        "--max-devices-per-user N admin limit (default c.AutoGPU.max_devices_per_user)",
        "--max-tickets-per-user N places in the waiting line one user may hold at once (default "
        "c.AutoGPU.max_tickets_per_user, 2; 0: no waiting picks)",
        "--max-messages-per-s-per-user N messages per second one non-root uid may send "
        "(default 500; past it that user's messages wait)",
    ],
    "exporter": [
        "--host HOST address to listen on (default 127.0.0.1; 0.0.0.0 for all)",
        "--port PORT port (default 9445)",
    ],
}


@pytest.mark.parametrize("command", sorted(_HELP_LINES))
def test_the_help_explains_the_admins_flags(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each flag's help says what it sets and its default (compared with the help's line breaks
    and indents made single spaces; "" is ``autogpu --help``). Caught: a help text or a
    description dropped or altered, a placeholder lower-cased."""
    with pytest.raises(SystemExit) as done:
        main([*command.split(), "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for line in _HELP_LINES[command]:
        assert line in text


def test_the_broker_reads_subordinate_uids_from_etc_subuid_by_default(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the --subuid-file default misspelt (then no subordinate uid counts as its owner,
    and a user's containers escape the per-user limits)."""
    assert _served_config(monkeypatch).subuid_path == "/etc/subuid"


# ---- autogpu broker status | tickets against a real broker ----------------------------------


@pytest.fixture
def thread_broker() -> Iterator[Any]:
    """A real broker (as test_brokerclient.py runs it) on a thread of this process, at most 3
    devices per user, on a short socket path."""
    from tests.unit.test_brokerclient import ThreadBroker

    short = tempfile.mkdtemp(prefix="agc-", dir="/tmp")
    b = ThreadBroker(os.path.join(short, "b.sock"), max_devices_per_user=3)
    try:
        yield b
    finally:
        b.crash()
        shutil.rmtree(short, ignore_errors=True)


def test_broker_status_and_tickets_show_the_leases_waiters_and_per_user_counts(
    host: Path, thread_broker: Any
) -> None:
    """``autogpu broker status``: the broker's counts, each lease and waiter, per user how many
    leases on how many devices and places in line; ``autogpu broker tickets``: the line. Caught:
    the status or the ticket list not handed to the printer (a crash), a per-user count read
    under the wrong key."""
    from autogpu_jupyter.core.leasing import Requester
    from autogpu_jupyter.core.leasing.brokerclient import BrokerRegistry
    from tests.unit.test_brokerclient import constraints

    path = thread_broker.path
    me = pwd.getpwuid(os.geteuid()).pw_name
    pid = os.getpid()
    assert cli("broker", "status", "--socket", path) == (0, (
        f"broker {path} (pid {pid}): 1 connection(s), max_devices_per_user 3, 0 lease(s) kept "
        "from a restart\nleases: 0\nwaiters: 0\nper user:\n"), "")
    assert cli("broker", "tickets", "--socket", path) == (0, "waiting tickets: 0\n", "")
    reg = BrokerRegistry(path, connect_timeout_s=2.0)
    with reg.locked() as txn:
        lease = txn.create(devices=["GPU-a1", "GPU-a2"], requested_bytes=GiB,
                           requester=Requester(kernel_id="k-1"))
    ticket = reg.take_ticket(constraints=constraints(count=1), exclusive=True,
                             requester=Requester(notebook_path="t.ipynb"))
    try:
        lid, tid = lease.record.lease_id, ticket.record.lease_id
        since = time.strftime("%H:%M:%S", time.localtime(ticket.record.created_s))
        assert cli("broker", "status", "--socket", path) == (0, (
            f"broker {path} (pid {pid}): 3 connection(s), max_devices_per_user 3, 0 lease(s) "
            "kept from a restart\n"
            "leases: 1\n"
            f"  {lid[:12]}  GPU-a1,GPU-a2  {me}: kernel k-1\n"
            "waiters: 1\n"
            f"  ticket 1  {me}: t.ipynb\n"
            "per user:\n"
            f"  {me}: 1 lease(s) on 2 device(s), 1 waiting\n"), "")
        assert cli("broker", "tickets", "--socket", path) == (0, (
            "waiting tickets: 1\n"
            f"  ticket 1  {tid}  1 GPU(s) exclusive, since {since}  {me}: t.ipynb\n"), "")
    finally:
        lease.release()
        ticket.release()


# ---- mutation run (issue 22, seed 52): what each command shows ---------------------------------


def test_list_json_hides_another_users_process_command_from_a_user(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autogpu list --json`` run by a user (not root): another user's GPU process keeps its
    pid and user, its command line is null. In-process (the check as user nobody runs in a
    forked child). Caught: the redacted command written under another key (the real command
    line left in "command")."""
    from autogpu_jupyter import cli as cli_mod

    monkeypatch.setattr(cli_mod, "_is_root", lambda: False)
    monkeypatch.setattr(cli_mod, "_me", lambda: "alice")
    code, out, err = cli("list", "--json")
    assert (code, err) == (0, "")
    (gpu_a, _b) = json.loads(out)["devices"]
    assert [(p["pid"], p["user"], p["command"]) for p in gpu_a["processes"]] == [
        (61001, "bob", None)]
    assert SECRET not in out


def test_pick_says_the_device_and_the_variables_it_would_set(host: Path) -> None:
    """``autogpu pick`` (no lease): the device, what was asked, the runner-up, then one line of
    the variables ``eval "$(autogpu pick --export)"`` would set. Caught: the "set:" line's
    joining broken (a TypeError instead of the line)."""
    code, out, err = cli("pick", "--min-free", "10G")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"GPU 0 NVIDIA A100 {A}: 80.0 GiB free, util 0%",
        "asked: min free 10.0 GiB",
        "runner-up: GPU 1 (40.0 GiB free)",
        "note: SIMULATED fleet (AUTOGPU_SIMULATE)",
        f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={A}",
    ]


def test_leases_lists_each_lease_with_its_booking_and_holder(host: Path) -> None:
    """``autogpu leases``: one line per lease, user, pid, devices, what it books ("-": nothing),
    "exclusive", then its kernel (its id's first 8 characters, as every view words a holder,
    core/words.py) or notebook; no trailing blank when it has neither. Caught: the
    booking shown as "?" (the bytes not handed to format_bytes); the line's end stripped on the
    wrong side (a trailing space)."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    me, pid = pwd.getpwuid(os.geteuid()).pw_name, os.getpid()
    reg = Registry(str(host))
    with reg.locked() as txn:
        assert txn is not None
        booked = txn.create(devices=[A], requested_bytes=GiB,
                            requester=Requester(kernel_id="1a2b3c4d-5e6f-7081"))
        bare = txn.create(devices=[B], exclusive=True, requester=Requester())
    try:
        code, out, err = cli("leases")
    finally:
        booked.release()
        bare.release()
    assert (code, err) == (0, "")
    assert sorted(out.splitlines()) == sorted([
        f"{me:<12} pid {pid:<8} {A} booked 1.0 GiB kernel 1a2b3c4d",
        f"{me:<12} pid {pid:<8} {B} booked - exclusive",
    ])


def test_hosts_shows_a_question_mark_for_an_unknown_load(host: Path) -> None:
    """A device whose exporter sends no utilisation is still chosen (it fits), its load shown as
    "?" (never a made-up number). Caught: the unknown load spelt otherwise."""
    no_util = "GPU-bbbb0002-0000-0000-0000-000000000002"

    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        from tests.unit.test_cluster import AUTOGPU_Q

        results[AUTOGPU_Q][:] = [
            r for r in results[AUTOGPU_Q]
            if not (r["metric"]["__name__"] == "autogpu_gpu_utilization_ratio"
                    and r["metric"].get("uuid") == no_util)]

    with recorded_prometheus(edit=edit) as url:
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "10G")
    assert (code, err) == (0, "")
    assert "  1. gpu-b                ok    GPU 2 NVIDIA L4 (22.0 GiB free, util ?)" in (
        out.splitlines())


def test_broker_status_json_gives_the_counts_then_the_leases_then_the_tickets(
    host: Path, thread_broker: Any
) -> None:
    """``autogpu broker status --json``: the broker's own fields (less its "ok"), then the
    leases, then the tickets, as records. Caught: the raw "tickets" list not left out of the
    copied fields (it then came before the leases)."""
    code, out, err = cli("broker", "status", "--json", "--socket", thread_broker.path)
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert list(data)[:3] == ["leases_total", "tickets_total", "per_user"]
    assert list(data)[-2:] == ["leases", "tickets"] and "ok" not in data
    assert (data["leases"], data["tickets"], data["pid"]) == ([], [], os.getpid())
    # indented by two spaces, as every --json of the CLI (caught, seed 54: three)
    assert out == json.dumps(data, indent=2) + "\n"


def test_broker_status_of_a_broker_that_leaves_counts_out_says_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A status reply without "connections", "orphans" or a limit (another version's broker)
    reads as 0 connections, no limit, 0 kept. Caught: the missing connection count shown as
    "None"."""
    from autogpu_jupyter.cli import _print_broker_status

    assert _print_broker_status({"ok": True, "pid": 7}, "/run/b.sock", as_json=False) == 0
    assert capsys.readouterr().out == (
        "broker /run/b.sock (pid 7): 0 connection(s), max_devices_per_user none, 0 lease(s) kept "
        "from a restart\nleases: 0\nwaiters: 0\nper user:\n")


def test_broker_tickets_without_constraints_read_as_one_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ticket record that came without its constraints (``from_wire`` makes them None) is
    shown asking for 1 GPU, the picker's default count. Caught: the default count "None"."""
    from autogpu_jupyter.cli import _print_broker_tickets
    from autogpu_jupyter.core.leasing.brokerclient import from_wire

    ticket = from_wire({
        "lease_id": "t" * 32, "kind": "ticket", "device_uuids": [],
        "device_requested_bytes": [], "exclusive": False, "user": "bob", "uid": 1001,
        "host": "node-7", "pid": 4242, "created_s": 1.0e9, "notebook_path": "t.ipynb",
        "seq": 3,
    }, "/run/b.sock")
    assert ticket.constraints is None
    assert _print_broker_tickets([ticket], as_json=False) == 0
    since = time.strftime("%H:%M:%S", time.localtime(1.0e9))
    assert capsys.readouterr().out == (
        "waiting tickets: 1\n"
        f"  ticket 3  {'t' * 32}  1 GPU(s), since {since}  bob: t.ipynb\n")


def test_broker_tickets_show_how_many_gpus_each_ticket_asks_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ticket waiting for 2 GPUs says so. Caught (seed 54): the count looked up under another
    key (every ticket shown asking for 1)."""
    from autogpu_jupyter.cli import _print_broker_tickets
    from autogpu_jupyter.core.leasing.brokerclient import from_wire

    ticket = from_wire({
        "lease_id": "t" * 32, "kind": "ticket", "device_uuids": [],
        "device_requested_bytes": [], "exclusive": True, "user": "bob", "uid": 1001,
        "host": "node-7", "pid": 4242, "created_s": 1.0e9, "notebook_path": "t.ipynb",
        "seq": 4, "constraints": {"count": 2, "min_free_bytes": GiB},
    }, "/run/b.sock")
    assert _print_broker_tickets([ticket], as_json=False) == 0
    since = time.strftime("%H:%M:%S", time.localtime(1.0e9))
    assert capsys.readouterr().out == (
        "waiting tickets: 1\n"
        f"  ticket 4  {'t' * 32}  2 GPU(s) exclusive, since {since}  bob: t.ipynb\n")


def test_list_json_shows_a_users_own_process_command(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autogpu list --json`` run by bob (not root) shows the command line of bob's own GPU
    process. Caught: the process's command dropped from the redaction call (null for everyone
    but root)."""
    from autogpu_jupyter import cli as cli_mod

    monkeypatch.setattr(cli_mod, "_is_root", lambda: False)
    monkeypatch.setattr(cli_mod, "_me", lambda: "bob")
    code, out, err = cli("list", "--json")
    assert (code, err) == (0, "")
    (gpu_a, _b) = json.loads(out)["devices"]
    assert [(p["pid"], p["user"], p["command"]) for p in gpu_a["processes"]] == [
        (61001, "bob", SECRET)]


def test_list_json_shows_root_every_users_process_command(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autogpu list --json`` run by root shows another user's GPU process command line (root
    may see every process anyway). Caught (seed 54): root's right not handed to the redaction
    (root shown null, as any user)."""
    from autogpu_jupyter import cli as cli_mod

    monkeypatch.setattr(cli_mod, "_is_root", lambda: True)
    monkeypatch.setattr(cli_mod, "_me", lambda: "root")
    code, out, err = cli("list", "--json")
    assert (code, err) == (0, "")
    (gpu_a, _b) = json.loads(out)["devices"]
    assert [(p["pid"], p["user"], p["command"]) for p in gpu_a["processes"]] == [
        (61001, "bob", SECRET)]


def test_pick_json_gives_the_variables_it_would_set(host: Path) -> None:
    """``autogpu pick --json`` carries the environment a pick sets under "env". Caught: "env"
    written as null."""
    code, out, err = cli("pick", "--json", "--min-free", "10G")
    assert (code, err) == (0, "")
    assert json.loads(out)["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": A}


def test_a_pick_that_fails_suggests_wait_only_when_none_was_given(host: Path) -> None:
    """Nothing fits: without --wait the error is followed by the hint to add one; with --wait
    (even 0) there is no hint. Caught: the --wait lookup misspelt (the hint always shown)."""
    code, _out, err = cli("pick", "--min-free", "100G")
    assert code == 3
    assert err.splitlines()[-1] == (
        "nothing picked; to wait in line until a device fits, add --wait DURATION "
        "(e.g. --wait 10m)")
    code, _out, err = cli("pick", "--min-free", "100G", "--wait", "0")
    assert code == 3
    assert err.startswith("autogpu: no device fits (min free 100.0 GiB):")
    assert "--wait" not in err


@pytest.mark.parametrize("args", [["--wait", "1m"], ["--exclusive"], ["--exclude", "0"]])
def test_hosts_refuses_the_pick_options_it_cannot_rank_by(
    host: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``autogpu hosts`` takes --min-free, --max-util and --count only; another pick option is
    an unrecognized argument (exit 2), not silently ignored. Caught: hosts given every pick
    option."""
    with pytest.raises(SystemExit) as done:
        main(["hosts", *args])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"autogpu hosts: error: unrecognized arguments: {' '.join(args)}"


def test_main_without_arguments_reads_the_command_line(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main()`` (the console script) runs the command after the program name in sys.argv.
    Caught: the first argument skipped as well (`autogpu leases --json` read as `--json`)."""
    monkeypatch.setattr("sys.argv", ["autogpu", "leases", "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main()
    assert code == 0
    assert json.loads(out.getvalue()) == []


# ---- naming GPUs (issue 41) --------------------------------------------------------------------


def test_pick_names_a_device_by_index_and_the_pipeline_picks_it(host: Path) -> None:
    """``autogpu pick 1``: the busier GPU 1, because it was named (the ranking would take GPU 0)."""
    code, out, err = cli("pick", "1")
    assert (code, err) == (0, "")
    assert out.splitlines()[0].startswith(f"GPU 1 NVIDIA A100 {B}: ")
    assert "asked: device 1" in out
    assert out.splitlines()[-1] == f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={B}"
    # by --devices and by UUID prefix: the same device
    assert cli("pick", "--devices", "1")[1] == out
    assert cli("pick", "GPU-1b1b1b")[1] == out.replace("device 1", "device GPU-1b1b1b")


def test_pick_of_two_named_devices_takes_both_unless_count_says_fewer(host: Path) -> None:
    code, out, _err = cli("pick", "0,1", "--json")
    assert code == 0
    assert [d["uuid"] for d in json.loads(out)["chosen"]] == [A, B]
    code, out, _err = cli("pick", "1,0", "--count", "1", "--json")
    assert [d["uuid"] for d in json.loads(out)["chosen"]] == [A]  # the better of the two
    code, _out, err = cli("pick", "0,1", "--count", "3")
    assert (code, err) == (
        2, "autogpu: invalid --count '3': more than the 2 device(s) named (0,1); expected at most "
        "2\n")


def test_a_named_device_that_does_not_fit_is_one_line_naming_it_and_why(host: Path) -> None:
    """The named GPU's own reason, in one line (the others are not named: no news), then the
    hint to wait: its memory may free up."""
    code, _out, err = cli("pick", "1", "--min-free", "50G")
    assert code == 3
    assert err.splitlines() == [
        "autogpu: GPU 1 does not fit (device 1, min free 50.0 GiB): only 40.0 GiB free < 50.0 GiB "
        "wanted",
        "nothing picked; to wait in line until a device fits, add --wait DURATION "
        "(e.g. --wait 10m)",
    ]


@pytest.mark.parametrize("ident", ["7", "GPU-ffffff", "0,9"])
def test_a_named_device_that_does_not_exist_is_one_usage_line(host: Path, ident: str) -> None:
    code, out, err = cli("pick", ident)
    bad = ident.split(",")[-1]
    assert (code, out) == (2, "")
    assert err == (
        f"autogpu: no device {bad!r} on this host; name devices by index (0, 1) or by UUID or "
        "its first 6 or more characters (e.g. GPU-0a0a0a0a)\n")


def test_devices_named_twice_and_run_with_positional_ids_are_usage_errors(host: Path) -> None:
    code, _out, err = cli("pick", "0", "--devices", "1")
    assert (code, err) == (
        2, "autogpu: devices named twice ('0' and --devices '1'): name them once, e.g. pick 0,3 "
        "or pick --devices 0,3\n")
    # `run 1 -- CMD` would run a command named "1": refused, with the form that works
    code, _out, err = cli("run", "1", "--", "true")
    assert (code, err) == (
        2, "autogpu: error: run takes its devices as --devices: autogpu run --devices 1 "
        "[options] -- CMD ARGS\n")


def test_run_on_a_named_device(host: Path) -> None:
    out = tempfile.mktemp()
    code, _o, _e = cli("run", "--devices", "1", "--", "sh", "-c",
                       f'echo "$CUDA_VISIBLE_DEVICES" > {out}')
    assert code == 0
    assert Path(out).read_text().strip() == B
    os.unlink(out)


def test_a_usage_error_is_one_line_without_the_usage_dump(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["pick", "--bogus", "1"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "autogpu pick: error: unrecognized arguments: --bogus\n"


@pytest.mark.parametrize(
    "args", [["--exclude", "0,1"], ["--model", "H100"], ["--devices", "0", "--exclude", "0"]]
)
def test_nothing_could_ever_fit_the_users_own_restrictions_so_no_wait_is_suggested(
    host: Path, args: list[str]
) -> None:
    """Caught (issue 41): `autogpu pick --exclude 0,1,2,3` suggested --wait, which can never
    help."""
    code, _out, err = cli("pick", *args)
    assert code == 3
    assert err.startswith("autogpu: ")
    assert "--wait" not in err
    assert "nothing picked" not in err
