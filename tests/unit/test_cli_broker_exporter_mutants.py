"""``autogpu exporter`` and ``autogpu broker`` through the CLI's entry point, in this process
(mutation run, issue 22): what ``broker serve`` hands the daemon (the daemon not started), what
``broker status | tickets | revoke`` ask the broker and print (a stand-in broker client), and how
the exporter is wired (a stand-in HTTP server, sampler, signals and wait; its registry scraped
with ``prometheus_client``'s own text exposition). The same commands against a real broker are
in ``test_cli.py``; as real processes in ``tests/processes/``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autogpu_jupyter import cli as cli_mod
from autogpu_jupyter._version import __version__
from autogpu_jupyter.cli import _print_broker_status, main
from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import Registry, Requester, brokerclient
from tests.payloadhelpers import GiB, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
_SETTINGS_ENV = ("AUTOGPU_BROKER_SOCKET", "AUTOGPU_MAX_DEVICES_PER_USER",
                 "AUTOGPU_MAX_LEASES_PER_USER", "AUTOGPU_MAX_TICKETS_PER_USER",
                 "AUTOGPU_RECORD_COMMANDS", "AUTOGPU_SAMPLE_INTERVAL", "AUTOGPU_USE_LEASES",
                 "AUTOGPU_BROKER_FALLBACK")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AutoGPU setting from the environment, a private registry; returns tmp_path."""
    for name in _SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    return tmp_path


def cli(*args: str, stderr: io.StringIO | None = None) -> tuple[int, str, str]:
    """``autogpu ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), stderr or io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


# ---- autogpu broker serve: what the daemon is started with -------------------------------------


def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> Any:
    """The BrokerConfig ``autogpu broker serve ARGS`` starts the daemon with (not started; no
    rules file unless ARGS name one)."""
    from autogpu_jupyter import broker

    seen: list[Any] = []
    monkeypatch.setattr(broker, "main", lambda config: seen.append(config) or 0)
    code, _, err = cli("broker", "serve", "--rules", "", *args)
    assert (code, err, len(seen)) == (0, "", 1)
    return seen[0]


def test_broker_serve_listens_on_the_flag_else_the_configured_socket_else_the_default(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--socket wins; without it, c.AutoGPU.broker_socket ($AUTOGPU_BROKER_SOCKET); set to
    "off" (any case) or not set, the default socket. Caught: the path not handed to the daemon
    (None, or the default whatever the flag said); the settings not handed to the socket lookup
    (a crash); "or the default" made "and the default" (the default in place of the configured
    path, and "" when none is configured)."""
    assert served(monkeypatch, env, "--socket", "/srv/a/broker.sock").socket_path == (
        "/srv/a/broker.sock")
    assert served(monkeypatch, env).socket_path == brokerclient.DEFAULT_SOCKET
    monkeypatch.setenv("AUTOGPU_BROKER_SOCKET", "/srv/b/broker.sock")
    assert served(monkeypatch, env).socket_path == "/srv/b/broker.sock"
    monkeypatch.setenv("AUTOGPU_BROKER_SOCKET", "OFF")
    assert served(monkeypatch, env).socket_path == brokerclient.DEFAULT_SOCKET


def test_broker_serve_keeps_its_journal_in_the_state_dir_and_none_for_an_empty_one(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--state-dir DIR is where the journal lives (default /var/lib/autogpu-broker); '' means
    no journal (None). Caught: the state dir not handed to the daemon, or always None (a
    restart then loses every live lease)."""
    assert served(monkeypatch, env).state_dir == "/var/lib/autogpu-broker"
    assert served(monkeypatch, env, "--state-dir", "/srv/state").state_dir == "/srv/state"
    assert served(monkeypatch, env, "--state-dir", "").state_dir is None


def test_broker_serve_takes_the_device_limit_from_the_flag_else_the_setting(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-devices-per-user N (0 included: no limit) wins over c.AutoGPU.max_devices_per_user
    ($AUTOGPU_MAX_DEVICES_PER_USER); left out, the setting applies. Caught: the flag ignored;
    the limit not handed to the daemon (None, or its default 0); the "flag given?" test
    inverted, or made always true or always false."""
    assert served(monkeypatch, env).max_devices_per_user == 0
    monkeypatch.setenv("AUTOGPU_MAX_DEVICES_PER_USER", "3")
    assert served(monkeypatch, env).max_devices_per_user == 3
    assert served(monkeypatch, env, "--max-devices-per-user", "5").max_devices_per_user == 5
    assert served(monkeypatch, env, "--max-devices-per-user", "0").max_devices_per_user == 0


def test_broker_serve_device_limit_flag_wins_over_the_rules_file(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rules file's max_devices_per_user wins over the setting, the flag over the file.
    Caught: the "flag given?" test after reading the rules inverted (the file's limit then
    replaced by None, and the flag's lost); the flag's value replaced by None."""
    rules = env / "rules.json"
    rules.write_text(json.dumps({"max_devices_per_user": 4}))
    monkeypatch.setenv("AUTOGPU_MAX_DEVICES_PER_USER", "3")
    assert served(monkeypatch, env, "--rules", str(rules)).max_devices_per_user == 4
    assert served(monkeypatch, env, "--rules", str(rules),
                  "--max-devices-per-user", "6").max_devices_per_user == 6


def test_broker_serve_takes_the_lease_limit_and_command_recording_from_the_settings(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c.AutoGPU.max_leases_per_user and record_commands ($AUTOGPU_MAX_LEASES_PER_USER,
    $AUTOGPU_RECORD_COMMANDS) reach the daemon; not set: no lease limit, no command lines kept.
    Caught: either not handed to the daemon (its defaults 0 and False apply silently), or
    record_commands handed as None."""
    config = served(monkeypatch, env)
    assert (config.max_leases_per_user, config.record_commands) == (0, False)
    assert config.record_commands is False
    monkeypatch.setenv("AUTOGPU_MAX_LEASES_PER_USER", "4")
    monkeypatch.setenv("AUTOGPU_RECORD_COMMANDS", "1")
    config = served(monkeypatch, env)
    assert (config.max_leases_per_user, config.record_commands) == (4, True)


def test_a_broker_limit_flag_quotes_at_most_40_characters_of_a_bad_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A long bad value is cut to its first 40 characters in the one-line error. Caught: 41."""
    with pytest.raises(SystemExit) as exited:
        main(["broker", "serve", "--max-leases-per-user", "x" * 50])
    out, err = capsys.readouterr()
    assert (exited.value.code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"autogpu broker: error: argument --max-leases-per-user: {'x' * 40!r}: expected a whole "
        "number >= 0")


# ---- autogpu broker status | tickets | revoke: a stand-in broker client ------------------------


class _Broker:
    """Stands in for BrokerRegistry: records how it was made and what it was asked."""

    def __init__(self) -> None:
        self.made: list[tuple[str, dict[str, Any]]] = []
        self.revoked: list[str] = []
        self.tickets: list[Any] = []
        self.status_reply: dict[str, Any] = {"ok": True, "pid": 7}

    def __call__(self, path: str, **kwargs: Any) -> _Broker:
        self.made.append((path, kwargs))
        return self

    def revoke_record(self, lease_id: str) -> tuple[str, str]:
        self.revoked.append(lease_id)
        return "ticket", "bob: t.ipynb"

    def list_tickets(self) -> list[Any]:
        return self.tickets

    def status(self) -> dict[str, Any]:
        return self.status_reply


@pytest.fixture
def broker_client(env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Broker]:
    fake = _Broker()
    monkeypatch.setattr(brokerclient, "BrokerRegistry", fake)
    yield fake


def test_broker_revoke_ends_the_named_record_and_says_which_and_whose(
    broker_client: _Broker,
) -> None:
    """``autogpu broker revoke ID`` asks the broker at --socket (giving up connecting after one
    second) to end ID and prints what it was and whose. Caught: the "revoke" action misspelt
    (the status shown instead); the ID tested inverted (the usage error for a given ID); the ID
    not sent (None); the answer not read or not printed ("None"); the connect timeout changed
    (2 s, or the client's default 5 s)."""
    assert cli("broker", "revoke", "t" * 32, "--socket", "/srv/b.sock") == (
        0, f"revoked ticket {'t' * 32} (bob: t.ipynb)\n", "")
    assert broker_client.revoked == ["t" * 32]
    assert broker_client.made == [("/srv/b.sock", {"connect_timeout_s": 1.0})]


def test_broker_revoke_without_an_id_is_a_usage_error_that_says_what_to_give(
    broker_client: _Broker,
) -> None:
    """No ID: exit 2, one line on stderr saying what to give and where to find it, nothing
    revoked. Caught: the message dropped, empty, altered (case, words) or sent to stdout."""
    assert cli("broker", "revoke", "--socket", "/srv/b.sock") == (
        2, "", "autogpu: error: broker revoke needs a LEASE_ID or ticket id (see autogpu broker "
        "status)\n")
    assert broker_client.revoked == []


def _wire(kind: str, lease_id: str, **extra: Any) -> dict[str, Any]:
    """A record as the broker sends it (see ``LeaseRecord._payload``)."""
    return {"lease_id": lease_id, "kind": kind, "device_uuids": [A] if kind == "lease" else [],
            "device_requested_bytes": [GiB] if kind == "lease" else [], "exclusive": True,
            "user": "bob", "uid": 1001, "host": "node-7", "pid": 4242, "created_s": 1.0e9,
            "kernel_id": "k-1" if kind == "lease" else None, "notebook_path": None,
            "holder_kind": "kernel", **extra}


def _as_json(kind: str, lease_id: str, path: str, seq: int | None) -> dict[str, Any]:
    """What ``--json`` shows of ``_wire(kind, lease_id)`` read from the broker at ``path``."""
    lease = kind == "lease"
    return {"lease_id": lease_id, "kind": kind, "device_uuids": [A] if lease else [],
            "device_requested_bytes": [GiB] if lease else [],
            "requested_bytes": GiB if lease else None, "exclusive": True, "user": "bob",
            "uid": 1001, "host": "node-7", "pid": 4242, "created_s": 1.0e9,
            "kernel_id": "k-1" if lease else None, "notebook_path": None, "command": None,
            "holder_kind": "kernel", "seq": seq, "live": True, "path": f"{path}#{lease_id}"}


def test_broker_tickets_json_gives_each_ticket_with_its_constraints(
    broker_client: _Broker,
) -> None:
    """``autogpu broker tickets --json``: each ticket's record plus its constraints ({} for one
    that came without), indented by two spaces as every --json of the CLI. Caught: --json not
    handed to the printer (the text shown); the list or the text not printed ("null", "None");
    the constraints key misspelt, or made None; the record and constraints joined with "&" (a
    crash); the indent changed or dropped."""
    from autogpu_jupyter.core.leasing.brokerclient import from_wire

    broker_client.tickets = [
        from_wire(_wire("ticket", "t" * 32, seq=1), "/srv/b.sock"),
        from_wire(_wire("ticket", "u" * 32, seq=2, constraints={"count": 2}), "/srv/b.sock"),
    ]
    want = [_as_json("ticket", "t" * 32, "/srv/b.sock", 1) | {"constraints": {}},
            _as_json("ticket", "u" * 32, "/srv/b.sock", 2) | {"constraints": {"count": 2}}]
    assert cli("broker", "tickets", "--json", "--socket", "/srv/b.sock") == (
        0, json.dumps(want, indent=2) + "\n", "")


def test_broker_status_json_puts_the_brokers_fields_first_then_the_leases_then_the_tickets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Whatever order the broker's reply has, ``--json`` gives its own fields (less "ok") first,
    then "leases" (the leases only), then "tickets" (the tickets only), each record with its
    path at the socket. Caught: the raw "leases" list not left out of the copied fields (it
    then came first); the lease and ticket filters inverted or misspelt (a ticket among the
    leases, or an empty list); the records read without the socket path ("None#...")."""
    st = {"leases": [_wire("lease", "a" * 32)], "ok": True, "pid": 7, "connections": 2,
          "tickets": [_wire("ticket", "t" * 32, seq=1)]}
    assert _print_broker_status(st, "/run/b.sock", as_json=True) == 0
    want = {"pid": 7, "connections": 2,
            "leases": [_as_json("lease", "a" * 32, "/run/b.sock", None)],
            "tickets": [_as_json("ticket", "t" * 32, "/run/b.sock", 1)]}
    assert capsys.readouterr().out == json.dumps(want, indent=2) + "\n"


def test_broker_status_says_how_many_leases_were_kept_and_which_are_exclusive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The head line counts the leases kept from a restart ("orphans"); an exclusive lease says
    " exclusive" after its devices. Caught: the orphans read under another key (always 0); the
    exclusive mark never shown, or spelt otherwise."""
    st = {"ok": True, "pid": 7, "connections": 1, "max_devices_per_user": 2, "orphans": 3,
          "leases": [_wire("lease", "a" * 32)], "tickets": []}
    assert _print_broker_status(st, "/run/b.sock", as_json=False) == 0
    assert capsys.readouterr().out == (
        "broker /run/b.sock (pid 7): 1 connection(s), max_devices_per_user 2, 3 lease(s) kept "
        "from a restart\n"
        "leases: 1\n"
        f"  {'a' * 12}  {A} exclusive  bob: kernel k-1\n"
        "waiters: 0\n"
        "per user:\n")


# ---- autogpu exporter: a stand-in server, sampler, signals and wait -----------------------------


class _Stderr(io.StringIO):
    """stderr that remembers what had been flushed when."""

    flushed = ""

    def flush(self) -> None:
        self.flushed = self.getvalue()


class _Exporter:
    """What one ``autogpu exporter`` run did with the stand-ins."""

    def __init__(self) -> None:
        self.intervals: list[Any] = []
        self.servers: list[dict[str, Any]] = []
        self.handlers: list[tuple[Any, Any]] = []
        self.stopped_by: list[Any] = []
        self.flushed_before_wait = ""
        self.ended: list[str] = []


def run_exporter(monkeypatch: pytest.MonkeyPatch, fleet: Path, *args: str,
                 listen_error: OSError | None = None) -> tuple[tuple[int, str, str], _Exporter]:
    """``autogpu exporter ARGS``: the sampler's latest sweep is ``fleet``'s; the wait ends when
    the handler registered for each signal is fired (SIGTERM, then SIGINT)."""
    seen = _Exporter()
    snap = SimulatedBackend(str(fleet)).snapshot()
    stderr = _Stderr()

    def get_sampler(interval_s: float | None = None) -> Any:
        seen.intervals.append(interval_s)
        return SimpleNamespace(latest=lambda: snap, interval_s=interval_s)

    class Server:
        def shutdown(self) -> None:
            seen.ended.append("server")

    def start_http_server(port: int, addr: str = "0.0.0.0",
                          registry: Any = prometheus_client.REGISTRY) -> Any:
        if listen_error is not None:
            raise listen_error
        seen.servers.append({"port": port, "addr": addr, "registry": registry})
        return Server(), None

    class Event:
        def __init__(self) -> None:
            self.is_set = False

        def set(self) -> None:
            self.is_set = True

        def wait(self) -> bool:
            seen.flushed_before_wait = stderr.flushed
            for sig, handler in seen.handlers:
                self.is_set = False
                handler(sig, None)
                if self.is_set:
                    seen.stopped_by.append(sig)
            return True

    monkeypatch.setattr(sampler_mod, "get_sampler", get_sampler)
    monkeypatch.setattr(sampler_mod, "stop_sampler", lambda: seen.ended.append("sampler"))
    monkeypatch.setattr(prometheus_client, "start_http_server", start_http_server)
    monkeypatch.setattr(cli_mod, "threading", SimpleNamespace(Event=Event))
    monkeypatch.setattr(cli_mod, "signal", SimpleNamespace(
        SIGTERM=signal.SIGTERM, SIGINT=signal.SIGINT,
        signal=lambda sig, handler: seen.handlers.append((sig, handler))))
    return cli("exporter", *args, stderr=stderr), seen


def scrape(registry: Any) -> dict[str, list[dict[str, str]]]:
    """Each ``autogpu_*`` series name -> its samples' labels with the value as "value"."""
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(
            prometheus_client.generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name.startswith("autogpu_"):
                out.setdefault(s.name, []).append({**s.labels, "value": str(s.value)})
    return out


@pytest.fixture
def fleet(env: Path) -> Path:
    return write_fleet(env / "fleet.json", [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0},
    ])


def test_the_exporter_serves_the_host_and_lease_series_until_a_signal_then_stops(
    env: Path, fleet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``autogpu exporter --host H --port 1 --hostname N --lease-details --interval 2.5``:
    listens on H:1 with its own registry, whose scrape gives the sampler's sweep under hostname
    N and the registry's lease with its kernel label; says where, flushed before it waits; a
    SIGTERM or a SIGINT ends the wait, then the server and the sampler stop. Caught: port 1
    refused (the lower bound off by one); the port, address or registry not handed to the
    server (the global registry, all interfaces); the sampler, its sweep, the lease store, the
    hostname, the lease details or the collector's source not handed on (a crash, no lease,
    another hostname, no kernel label); --interval ignored; the banner dropped, sent to stdout
    or not flushed; a signal handler not registered, registered for no signal, or not ending
    the wait."""
    with Registry(str(env / "registry")).locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A], requester=Requester(kernel_id="k-1"))
    try:
        (code, out, err), seen = run_exporter(
            monkeypatch, fleet, "--host", "10.0.0.5", "--port", "1", "--hostname", "node-7",
            "--lease-details", "--interval", "2.5")
        assert (code, out) == (0, "")
        banner = ("autogpu exporter: http://10.0.0.5:1/metrics (hostname 'node-7', sampling "
                  "every 2.5 s)\n")
        assert (err, seen.flushed_before_wait) == (banner, banner)
        assert seen.intervals == [2.5]
        [server] = seen.servers
        assert (server["port"], server["addr"]) == (1, "10.0.0.5")
        assert isinstance(server["registry"], prometheus_client.CollectorRegistry)
        assert server["registry"] is not prometheus_client.REGISTRY
        got = scrape(server["registry"])
    finally:
        lease.release()
    snap = SimulatedBackend(str(fleet)).snapshot()
    assert got["autogpu_host_info"] == [{
        "hostname": "node-7", "backend": snap.backend, "simulated": "true",
        "version": __version__, "vendor": "nvidia", "value": "1.0"}]
    assert got["autogpu_lease_info"] == [{
        "hostname": "node-7", "uuid": A, "index": "0", "model": "NVIDIA A100",
        "user": lease.record.user, "kernel": "k-1", "notebook": "", "value": "1.0"}]
    assert [s[0] for s in seen.handlers] == [signal.SIGTERM, signal.SIGINT]
    assert seen.stopped_by == [signal.SIGTERM, signal.SIGINT]
    assert seen.ended == ["server", "sampler"]


def test_the_exporter_samples_at_the_configured_interval_without_the_flag(
    env: Path, fleet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --interval, c.AutoGPU.sample_interval_s ($AUTOGPU_SAMPLE_INTERVAL); the default
    port 9445 and address 127.0.0.1. Caught: the interval test inverted or made always false
    (None handed to the sampler), or the setting never used."""
    monkeypatch.setenv("AUTOGPU_SAMPLE_INTERVAL", "4")
    (code, _out, err), seen = run_exporter(monkeypatch, fleet, "--hostname", "n")
    assert (code, seen.intervals) == (0, [4.0])
    assert err == (
        "autogpu exporter: http://127.0.0.1:9445/metrics (hostname 'n', sampling every 4 s)\n")
    assert [(s["port"], s["addr"]) for s in seen.servers] == [(9445, "127.0.0.1")]


@pytest.mark.parametrize(
    ("error", "why"),
    [(OSError(errno.EADDRINUSE, "Address already in use"), "Address already in use"),
     (OSError("no such interface"), "no such interface")],
)
def test_the_exporter_that_cannot_listen_says_where_and_why(
    env: Path, fleet: Path, monkeypatch: pytest.MonkeyPatch, error: OSError, why: str
) -> None:
    """A port taken or an address not on this host: a usage error naming the address and the
    system's reason (the error itself when it has no strerror). Caught: the message dropped
    ("None"); "strerror or error" made "and" ("[Errno 98] ..." or "None")."""
    (code, out, err), seen = run_exporter(monkeypatch, fleet, "--port", "9446",
                                          listen_error=error)
    assert (code, out, err) == (2, "", f"autogpu: cannot listen on 127.0.0.1:9446: {why}\n")
    assert seen.handlers == []
