"""The ``autogpu`` command: the same engine as the magics, for shells and scripts.

Exit codes (:data:`EXIT_CODES`, printed by ``--help`` and listed in docs/usage.md): 0 ok, 1 any
other error, 2 usage error, 3 no device fits / no GPU granted, 4 no GPU driver, 5 too late
(CUDA initialised). ``autogpu run`` exits with the command's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from autogpu_jupyter import kernelspec
from autogpu_jupyter._version import __version__
from autogpu_jupyter.api import pick_options, requester_for_this_process, status_frame
from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core import (
    PICK_OPTIONS,
    PickResult,
    PrometheusClient,
    contract,
    fetch_cluster,
    format_bytes,
    get_backend,
    holder_where,
    join_negative_values,
    parse_options,
    pick,
    rank_hosts,
    ranking_lines,
    redact_command,
    status_table,
    terminal_safe,
    visible_env,
)
from autogpu_jupyter.core import add_pick_arguments as add_arguments
from autogpu_jupyter.core import cell_text as visible
from autogpu_jupyter.core import current_session as current
from autogpu_jupyter.core import narrow_table as narrow
from autogpu_jupyter.core import option_defaults_from as defaults_from
from autogpu_jupyter.core import options_from_namespace as from_namespace
from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core import table_text as to_text
from autogpu_jupyter.core.leasing import (
    Requester,
    broker_at,
    broker_socket,
    status_records,
    store_for,
)
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError, UsageErrorBase

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NO_DEVICE, EXIT_NO_DRIVER = 0, 1, 2, 3, 4

#: Every exit code, as ``--help`` prints it (docs/usage.md's table says the same).
EXIT_CODES = (
    "exit codes: 0 ok (run: the command's own code), 1 other error, 2 usage error, "
    "3 no device fits / no GPU granted, 4 no GPU driver (try AUTOGPU_SIMULATE=demo-4x), "
    "5 too late: CUDA already initialised"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # one line: what is wrong and where the usage is (no four-line usage dump)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_pick_options(p: argparse.ArgumentParser) -> None:
    add_arguments(p)


#: The pick options ``autogpu hosts`` ranks hosts by (a host has no leases to be exclusive of,
#: and nothing waits).
HOSTS_OPTIONS = ("min_free", "max_util", "count")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autogpu",
        description="Pick the least-loaded GPU that fits (NVIDIA, or AMD with ROCm), with leases "
        "so that simultaneous jobs never pile onto one card. Set AUTOGPU_SIMULATE=demo-4x to try "
        "it without a GPU.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"autogpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p_list = sub.add_parser("list", help="every device, its load and holders")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")

    p_pick = sub.add_parser(
        "pick",
        help="print the best device(s) for the constraints",
        description="Print the best device(s). No lease outlives this command: use "
        "`autogpu run -- CMD` to hold one for CMD's lifetime. --export prints shell "
        'assignments for eval: eval "$(autogpu pick --min-free 10G --export)".',
    )
    add_arguments(p_pick, positional=True)
    p_pick.add_argument(
        "--dry-run",
        action="store_true",
        help="show the whole ranking with the reason each device was kept or dropped "
        "(as %%gpu pick --dry-run); changes nothing",
    )
    fmt = p_pick.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output")
    fmt.add_argument(
        "--export",
        action="store_true",
        help="print `export CUDA_DEVICE_ORDER=... CUDA_VISIBLE_DEVICES=...` for eval "
        "(holds no lease)",
    )

    p_run = sub.add_parser(
        "run",
        help="run a command on the best device, holding a lease while it runs",
        description="Pick, take a lease, run CMD with CUDA_VISIBLE_DEVICES set; the lease lasts "
        "exactly as long as CMD runs. Exits with CMD's exit code. Name the devices with "
        "--devices: autogpu run --devices 2 -- CMD.",
    )
    _add_pick_options(p_run)
    p_run.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run"
    )

    p_leases = sub.add_parser("leases", help="list the live leases on this host")
    p_leases.add_argument("--json", action="store_true", help="machine-readable output")
    p_leases.add_argument("--prune", action="store_true", help="remove your own dead lease files")
    p_leases.add_argument(
        "--all",
        action="store_true",
        help="with --prune, as root: remove every user's dead lease files",
    )
    p_leases.add_argument(
        "--show-commands", action="store_true", help="show other users' command lines (root only)"
    )

    p_broker = sub.add_parser(
        "broker",
        help="the trusted lease broker (root): serve, or show its status",
        description="`autogpu broker` runs the lease broker in the foreground (systemd runs it "
        "through socket activation: see docs/admin-broker.md). `autogpu broker status` shows "
        "its leases, waiters and per-user counts; `autogpu broker tickets` lists the waiting "
        "line; `autogpu broker revoke ID` (root) ends a lease or a ticket; `autogpu broker tenant "
        "add|list|remove` (root) edits the tenants (docs/jupyterhub.md).",
    )
    p_broker.add_argument("action", nargs="?", default="serve",
                          choices=["serve", "status", "tickets", "revoke"],
                          help="default: serve")
    p_broker.add_argument("lease_id", nargs="?", help="the lease or ticket to revoke")
    p_broker.add_argument("--socket", metavar="PATH", default=None,
                          help="the Unix socket (default c.AutoGPU.broker_socket, else "
                          "/run/autogpu/broker.sock)")
    p_broker.add_argument("--foreground", action="store_true",
                          help="run in the foreground (the only mode; for containers and tests)")
    p_broker.add_argument("--state-dir", metavar="DIR", default="/var/lib/autogpu-broker",
                          help="root-only journal, so a restart keeps live leases "
                          "(default /var/lib/autogpu-broker; '' for none)")
    p_broker.add_argument("--max-devices-per-user", type=int, default=None, metavar="N",
                          help="admin limit (default c.AutoGPU.max_devices_per_user)")
    p_broker.add_argument("--max-leases-per-user", type=_limit_arg, default=None, metavar="N",
                          help="leases one user may hold at once, shared or not (default "
                          "c.AutoGPU.max_leases_per_user; 0: no limit)")
    p_broker.add_argument("--max-tickets-per-user", type=_limit_arg, default=None, metavar="N",
                          help="places in the waiting line one user may hold at once (default "
                          "c.AutoGPU.max_tickets_per_user, 2; 0: no waiting picks)")
    p_broker.add_argument("--max-connections-per-user", type=int, default=256, metavar="N",
                          help="connections one non-root user (with their subordinate uids) "
                          "may hold (default 256)")
    p_broker.add_argument("--max-connections", type=int, default=0, metavar="N",
                          help="connections in all users together (default 0: 4096, or fewer "
                          "if the descriptor limit is lower; the last 16 are root's)")
    p_broker.add_argument("--ticket-grace", type=float, default=5.0, metavar="SECONDS",
                          help="a ticket that could be served but is not taken within this "
                          "many seconds loses its place (default 5)")
    p_broker.add_argument("--send-timeout", type=float, default=10.0, metavar="SECONDS",
                          help="a client that does not read a reply within this many seconds "
                          "is dropped (default 10)")
    p_broker.add_argument("--subuid-file", metavar="FILE", default="/etc/subuid",
                          help="subordinate uid ranges: such a uid counts as its owner "
                          "(default /etc/subuid)")
    p_broker.add_argument("--max-messages-per-s-per-user", type=float, default=500.0,
                          metavar="N", help="messages per second one non-root uid may send "
                          "(default 500; past it that user's messages wait)")
    p_broker.add_argument("--tenant-socket-root", metavar="DIR",
                          default="/run/autogpu-tenants",
                          help="where the tenants' sockets are made, one directory each "
                          "(root's, mode 0700; default /run/autogpu-tenants)")
    p_broker.add_argument("--rules", metavar="FILE", default=None,
                          help="the admin's rules (JSON: max_devices_per_user, per-user and "
                          "per-group limits, devices reserved for groups); a file named here "
                          "must exist ('' for none); default /etc/autogpu/broker.json, read "
                          "when it exists")
    p_broker.add_argument("--json", action="store_true", help="status: machine-readable output")
    p_broker.set_defaults(handler=_cmd_broker)

    p_hosts = sub.add_parser(
        "hosts",
        help="rank the cluster's hosts for a pick, from Prometheus",
        description="Rank every host Prometheus scrapes (autogpu exporters, Jupyter servers' "
        "/metrics, DCGM exporters) with the policy of a local pick: the first host is where "
        "`autogpu pick` with the same options would find the best device. Use it to choose a "
        "node: srun --nodelist=$(autogpu hosts --min-free 10G --best) ...",
    )
    p_hosts.add_argument(
        "--prometheus", metavar="URL",
        help="Prometheus base URL (default: c.AutoGPU.prometheus_url / $AUTOGPU_PROMETHEUS_URL)",
    )
    add_arguments(p_hosts, skip=[o.key for o in PICK_OPTIONS if o.key not in HOSTS_OPTIONS])
    hfmt = p_hosts.add_mutually_exclusive_group()
    hfmt.add_argument("--json", action="store_true", help="machine-readable output")
    hfmt.add_argument("--best", action="store_true", help="print only the best host's name")

    p_exp = sub.add_parser(
        "exporter",
        help="serve this host's autogpu_* Prometheus metrics (hosts without Jupyter)",
        description="Serve the autogpu_* gauges (the same as a Jupyter server's /metrics) at "
        "http://HOST:PORT/metrics, from one background sampler: a scrape reads its latest sweep "
        "and never calls NVML.",
    )
    p_exp.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p_exp.add_argument("--port", type=int, default=9445, help="port (default 9445)")
    p_exp.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                       help="seconds between NVML sweeps (default c.AutoGPU.sample_interval_s)")
    p_exp.add_argument("--hostname", default="",
                       help="the hostname label (default: this host's short name)")
    p_exp.add_argument(
        "--lease-details", action="store_true",
        help="add kernel and notebook labels to autogpu_lease_info (off: privacy, series count)",
    )

    # An error in `autogpu pick ...` shows pick's usage, not the top-level one (see main()).
    parser.set_defaults(_subparsers=sub.choices)
    kernelspec.add_cli(sub)
    return parser


def _settings() -> AutoGPU:
    return AutoGPU()


def _cmd_list(args: argparse.Namespace) -> int:
    snap = get_backend().snapshot()
    leases = _leases_or_empty()
    if args.json:
        data = snap.to_dict()
        me, root = _me(), _is_root()
        for dev in data.get("devices", []):
            for proc in dev.get("processes") or []:
                proc["command"] = redact_command(proc.get("user"), proc.get("command"), me, root)
        data["leases"] = [
            lease.to_dict(redact_command=not (root or lease.user == me)) for lease in leases
        ]
        print(json.dumps(data, indent=2))
        return EXIT_OK
    df = status_frame(snap, current(), leases)
    title = f"{len(snap.devices)} device(s) via {snap.backend}"
    if snap.simulated:
        title += " — SIMULATED fleet (AUTOGPU_SIMULATE), not real GPUs"
    print(visible(title))
    if len(df):
        # the table of %gpu status, sized for this terminal (columns it can do without are
        # left out of a narrow one); no "▶" column: a shell has no device of its own
        columns, rows, _ = status_table(df)
        columns, rows = columns[1:], [r[1:] for r in rows]
        width = shutil.get_terminal_size((100, 24)).columns
        print("\n".join(to_text(*narrow(columns, rows, width), width=width)))
    else:
        print("(no devices)")
    for err in snap.errors:
        print(f"note: {visible(err)}")
    return EXIT_OK


def _is_root() -> bool:
    return os.geteuid() == 0


def _me() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _leases_or_empty() -> list[Any]:
    reg = store_for(_settings())
    if reg is None:
        return []
    try:
        return list(reg.list_leases())
    except AutoGPUError as err:
        print(f"note: lease registry not readable: {err}", file=sys.stderr)
        return []


def _pick(args: argparse.Namespace, *, take_lease: bool) -> PickResult:
    settings = _settings()
    opts = pick_options(settings, from_namespace(args))

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    requester = requester_for_this_process("cli")
    if take_lease and args.cmd:
        requester = Requester(pid=requester.pid, kind="cli", command=shlex.join(args.cmd)[:500])
    return pick(
        opts,
        store=store_for(settings),
        requester=requester,
        dry_run=not take_lease,
        on_progress=progress,
        visible_ids=settings.visible_ids,
    )


def _summary(result: PickResult) -> str:
    lines = []
    for d in result.chosen:
        util = "?" if d.utilization_pct is None else f"{d.utilization_pct:.0f}%"
        lines.append(
            f"{d.label} {d.name} {d.uuid}: {format_bytes(d.memory_free_bytes)} free, util {util}"
        )
    asked = result.constraints.describe()
    lines.append(f"asked: {'any device' if asked == 'no constraints' else asked}")
    ru = result.runner_up
    if ru is not None:
        lines.append(f"runner-up: {ru.device.label} ({format_bytes(ru.effective_free_bytes)} free)")
    if result.snapshot.simulated:
        lines.append("note: SIMULATED fleet (AUTOGPU_SIMULATE)")
    return "\n".join(lines)


def _ranking(result: PickResult) -> list[str]:
    """``pick --dry-run``: every device, its rank or why it was dropped (as ``%gpu pick
    --dry-run`` says it)."""
    return ranking_lines(result, width=shutil.get_terminal_size((100, 24)).columns)


#: What ``autogpu run 2 -- CMD`` puts before ``--``: device ids, not a command.
_IDS_WORD = re.compile(r"[0-9]+(?::[0-9]+)?(?:,[0-9]+(?::[0-9]+)?)*")


def _cmd_pick(args: argparse.Namespace) -> int:
    result = _pick(args, take_lease=False)
    env = visible_env(
        [d.uuid for d in result.chosen], result.snapshot.devices, _settings().visible_ids
    )
    if args.dry_run and not (args.export or args.json):
        print("\n".join(_ranking(result)))
        return EXIT_OK
    if args.export:
        print(" ".join(f"export {k}={shlex.quote(v)};" for k, v in env.items()))
        return EXIT_OK
    if args.json:
        data = result.to_dict()
        data["env"] = env
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(_summary(result))
    print("set: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(
            "autogpu: error: run needs a command: autogpu run [options] -- CMD ARGS",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if "--" in cmd and _IDS_WORD.fullmatch(cmd[0]):
        ids = cmd[0]
        print(
            f"autogpu: error: run takes its devices as --devices: autogpu run --devices {ids} "
            "[options] -- CMD ARGS",
            file=sys.stderr,
        )
        return EXIT_USAGE
    args.cmd = cmd
    result = _pick(args, take_lease=True)
    env = dict(os.environ)
    env.update(result.env)
    if result.lease is not None:
        env[contract.LEASE_ENV] = result.lease.record.lease_id
    env[contract.PICKED_ENV] = ",".join(d.uuid for d in result.chosen)
    print(_summary(result), file=sys.stderr)
    if result.lease_note:
        print(f"note: {result.lease_note}", file=sys.stderr)
    # The lease's file descriptor is passed to CMD, so the flock lives exactly as long as CMD
    # (and we) hold it: if this wrapper is killed, CMD still holds its lease.
    pass_fds = () if result.lease is None else (result.lease.fileno(),)
    try:
        proc = subprocess.Popen(cmd, env=env, pass_fds=pass_fds)
    except OSError as err:
        if result.lease is not None:  # CMD never ran: its lease ends now, not as a dead file
            result.lease.release()
        if isinstance(err, FileNotFoundError):
            print(f"autogpu: error: command not found: {cmd[0]!r}", file=sys.stderr)
            return 127
        # As a shell does: found, but not executable (no x bit, a directory, a bad format).
        why = err.strerror or type(err).__name__
        print(f"autogpu: error: cannot run {cmd[0]!r}: {why}", file=sys.stderr)
        return 126
    forward = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, lambda signum, _f: proc.send_signal(signum)) for s in forward}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if result.lease is not None:
            result.lease.release()
    return code if code >= 0 else 128 - code


def _cmd_leases(args: argparse.Namespace) -> int:
    reg = store_for(_settings())
    if reg is None:
        print("leases are off (AutoGPU.use_leases = False or no registry_dir)")
        return EXIT_OK
    if args.all and not args.prune:
        print("autogpu: error: --all goes with --prune", file=sys.stderr)
        return EXIT_USAGE
    if args.prune:
        if args.all and not _is_root():
            print("autogpu: error: --prune --all needs root", file=sys.stderr)
            return EXIT_USAGE
        removed = reg.prune(all_users=args.all)
        if not removed and not reg.leaves_dead_entries:
            print(f"nothing to prune: the lease broker at {reg.path} frees a lease the moment its "
                  "holder's connection closes")
            return EXIT_OK
        if not removed:
            print(f"no dead lease files in {reg.path}")
            return EXIT_OK
        print(f"removed {len(removed)} dead lease file(s):")
        for rec in removed:
            print(f"  {','.join(rec.device_uuids) or rec.kind}  {rec.holder_text()}  ({rec.path})")
        return EXIT_OK
    leases = list(reg.list_leases())
    show_cmd = args.show_commands and _is_root()
    if args.json:
        print(
            json.dumps([lease.to_dict(redact_command=not show_cmd) for lease in leases], indent=2)
        )
        return EXIT_OK
    if not leases:
        print(f"no live leases in {reg.path}")
        return EXIT_OK
    for lease in leases:
        d = lease.to_dict(redact_command=not show_cmd)
        where = holder_where(d.get("notebook_path"), d.get("kernel_id"), None)
        booked = format_bytes(d["requested_bytes"]) if d.get("requested_bytes") else "-"
        print(
            f"{d['user']:<12} pid {d['pid']:<8} {','.join(d['device_uuids'])} booked {booked}"
            f"{' exclusive' if d.get('exclusive') else ''} {where}".rstrip()
        )
    return EXIT_OK


def _cmd_hosts(args: argparse.Namespace) -> int:
    settings = _settings()
    url = args.prometheus or settings.prometheus_url
    if not url:
        raise UsageErrorBase(
            "no Prometheus to ask: pass --prometheus http://HOST:9090, or set "
            "c.AutoGPU.prometheus_url or $AUTOGPU_PROMETHEUS_URL"
        )
    defaults = {k: v for k, v in defaults_from(settings).items() if k in HOSTS_OPTIONS}
    given = {k: v for k, v in from_namespace(args).items() if k in HOSTS_OPTIONS}
    constraints = parse_options(given, defaults=defaults, accept=HOSTS_OPTIONS).constraints
    view = fetch_cluster(PrometheusClient(url, settings.prometheus_timeout_s))
    choices = rank_hosts(view, constraints)
    if args.json:
        print(json.dumps({
            "prometheus_url": view.prometheus_url,
            "timestamp_s": view.timestamp_s,
            "constraints": constraints.to_json(),
            "best": choices[0].host.hostname if choices and choices[0].fits else None,
            "hosts": [c.to_dict() for c in choices],
            "errors": list(view.errors),
        }, indent=2))
        return EXIT_OK if choices and choices[0].fits else EXIT_NO_DEVICE
    if args.best:
        if not choices or not choices[0].fits:
            raise NoDeviceFitsError(f"no host has a device for {constraints.describe()}")
        print(choices[0].host.hostname)
        return EXIT_OK
    print(f"{len(view.hosts)} host(s) from {view.prometheus_url}; for {constraints.describe()}:")
    for i, c in enumerate(choices, 1):
        head = f"{i:>3}. {_safe(c.host.hostname):<20} {c.host.state:<5}"
        if c.fits:
            devs = ", ".join(
                f"{_safe(x.device.label)} {_safe(x.device.name)} "
                f"({format_bytes(x.effective_free_bytes)} free, util "
                f"{'?' if x.smoothed_util_pct is None else f'{x.smoothed_util_pct:.0f}%'})"
                for x in c.chosen
            )
            print(f"{head} {devs}")
        elif c.host.state != "ok":
            print(f"{head} {_safe(c.host.note or '')}")
        else:
            print(f"{head} nothing fits")
    for err in view.errors:
        print(f"note: {err}")
    return EXIT_OK if choices and choices[0].fits else EXIT_NO_DEVICE


def _safe(text: str) -> str:
    """Hostnames and model names come from other machines: no terminal control characters."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _cmd_exporter(args: argparse.Namespace) -> int:
    # prometheus_client and the collector: only the exporter needs them (the other commands
    # start faster without).
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

    from autogpu_jupyter.metrics import AutoGPUCollector, MetricsSource  # noqa: PLC0415

    if not 0 < args.port < 65536:
        raise UsageErrorBase(f"invalid --port {args.port}: expected 1-65535, e.g. 9445")
    settings = _settings()
    interval = settings.sample_interval_s if args.interval is None else args.interval
    sampler = sampler_mod.get_sampler(interval_s=interval)
    registry = store_for(settings)
    source = MetricsSource(latest=sampler.latest, store=lambda: registry,
                           hostname=args.hostname, lease_details=args.lease_details)
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(source))
    try:
        server, _thread = start_http_server(args.port, addr=args.host, registry=prom)
    except OSError as err:
        raise UsageErrorBase(
            f"cannot listen on {args.host}:{args.port}: {err.strerror or err}"
        ) from None
    print(
        f"autogpu exporter: http://{args.host}:{args.port}/metrics (hostname "
        f"{source.hostname!r}, sampling every {sampler.interval_s:g} s)",
        file=sys.stderr, flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    stop.wait()
    server.shutdown()
    sampler_mod.stop_sampler()
    return EXIT_OK


def _broker_socket(args: argparse.Namespace, settings: AutoGPU) -> str:
    """The socket ``autogpu broker`` serves or asks: ``--socket``, else the configured one
    (any spelling of "off" counts as not configured), else the default."""
    return broker_socket(settings, args.socket)


def _limit_arg(text: str) -> int:
    """A per-user limit on the command line: a whole number >= 0 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}: expected a whole number >= 0"
        )
    return value


def _cmd_broker(args: argparse.Namespace) -> int:
    settings = _settings()
    path = _broker_socket(args, settings)
    if args.action == "serve":
        # The one place that may: `autogpu broker` is how the daemon is started (by systemd too);
        # the daemon's asyncio server is loaded by that command only.
        from autogpu_jupyter import broker  # noqa: TID251, PLC0415

        limit = args.max_devices_per_user
        config = broker.BrokerConfig(
            socket_path=path,
            state_dir=args.state_dir or None,
            max_devices_per_user=settings.max_devices_per_user if limit is None else limit,
            max_leases_per_user=settings.max_leases_per_user,
            max_tickets_per_user=settings.max_tickets_per_user,
            max_connections_per_user=args.max_connections_per_user,
            max_connections=args.max_connections,
            ticket_grace_s=args.ticket_grace,
            send_timeout_s=args.send_timeout,
            subuid_path=args.subuid_file,
            messages_per_s_per_user=args.max_messages_per_s_per_user,
            record_commands=settings.record_commands,
            tenant_socket_root=args.tenant_socket_root,
        )
        from autogpu_jupyter.brokerd import startup  # noqa: PLC0415

        rules = startup.rules_to_read(args.rules)
        if rules:
            config.load_rules(rules)
            if limit is not None:  # the command line wins over the file
                config.max_devices_per_user = limit
        if args.max_leases_per_user is not None:
            config.max_leases_per_user = args.max_leases_per_user
        if args.max_tickets_per_user is not None:
            config.max_tickets_per_user = args.max_tickets_per_user
        return broker.main(config)
    reg = broker_at(path, connect_timeout_s=1.0)
    if args.action == "revoke":
        if not args.lease_id:
            print("autogpu: error: broker revoke needs a LEASE_ID or ticket id (see autogpu "
                  "broker status)", file=sys.stderr)
            return EXIT_USAGE
        kind, holder = reg.revoke_record(args.lease_id)
        print(f"revoked {kind} {args.lease_id} ({holder})")
        return EXIT_OK
    if args.action == "tickets":
        return _print_broker_tickets(reg.list_tickets(), args.json)
    return _print_broker_status(reg.status(), path, args.json)


def _print_broker_tickets(tickets: list[Any], as_json: bool) -> int:
    """``autogpu broker tickets``: the waiting line, oldest first."""
    if as_json:
        print(json.dumps([t.to_dict() | {"constraints": dict(t.constraints or {})}
                          for t in tickets], indent=2))
        return EXIT_OK
    print(f"waiting tickets: {len(tickets)}")
    for t in tickets:
        since = time.strftime("%H:%M:%S", time.localtime(t.created_s))
        c = t.constraints or {}
        ask = f"{c.get('count', 1)} GPU(s)" + (" exclusive" if t.exclusive else "")
        print(f"  ticket {t.seq}  {t.lease_id}  {ask}, since {since}  {t.holder_text()}")
    return EXIT_OK


def _print_broker_status(st: dict[str, Any], path: str, as_json: bool) -> int:
    recs = status_records(st, path)
    if as_json:
        out = {k: v for k, v in st.items() if k not in ("leases", "tickets", "ok")}
        out["leases"] = [r.to_dict() for r in recs if r.kind == "lease"]
        out["tickets"] = [r.to_dict() for r in recs if r.kind == "ticket"]
        print(json.dumps(out, indent=2))
        return EXIT_OK
    limit = st.get("max_devices_per_user") or "none"
    print(f"broker {path} (pid {st.get('pid')}): {st.get('connections', 0)} connection(s), "
          f"max_devices_per_user {limit}, {st.get('orphans', 0)} lease(s) kept from a restart")
    leases = [r for r in recs if r.kind == "lease"]
    tickets = [r for r in recs if r.kind == "ticket"]
    print(f"leases: {len(leases)}")
    for r in leases:
        excl = " exclusive" if r.exclusive else ""
        print(f"  {r.lease_id[:12]}  {','.join(r.device_uuids)}{excl}  {r.holder_text()}")
    print(f"waiters: {len(tickets)}")
    for r in tickets:
        print(f"  ticket {r.seq}  {r.holder_text()}")
    print("per user:")
    for user, row in sorted(st.get("per_user", {}).items()):
        print(f"  {user}: {row['leases']} lease(s) on {row['devices']} device(s), "
              f"{row['tickets']} waiting")
    return EXIT_OK


class _TerminalSafe:
    """A text stream that spells out terminal-steering characters (C1, bidi, lone surrogates)
    before they reach the terminal: lease records and process names are other users' text."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(terminal_safe(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``autogpu``; returns the exit code."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _TerminalSafe(out), _TerminalSafe(err)
    try:
        return _main(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    except BrokenPipeError:
        # `autogpu leases | head`: the reader left. Point stdout at /dev/null so the final flush
        # at exit does not raise again, and end quietly as other command-line tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    finally:
        sys.stdout, sys.stderr = out, err


def _main(argv: list[str]) -> int:
    if argv[:2] == ["broker", "tenant"]:
        # `autogpu broker tenant add|list|remove` (root): the tenants table (issue 40) has its
        # own parser beside the broker's state it edits; it loads no server or daemon.
        from autogpu_jupyter.brokerd import tenantcli  # noqa: PLC0415

        return tenantcli.main(argv[2:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports unknown options from the top-level parser; name the subcommand's.
        sub = getattr(args, "_subparsers", {}).get(args.command) if args.command else None
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    handlers = {"list": _cmd_list, "pick": _cmd_pick, "run": _cmd_run, "leases": _cmd_leases,
                "hosts": _cmd_hosts, "exporter": _cmd_exporter}
    handler = handlers.get(args.command) or getattr(args, "handler", None)
    try:
        return int(handler(args))  # type: ignore[misc]
    except NoDeviceFitsError as err:
        print(f"autogpu: {err}", file=sys.stderr)
        if (
            args.command in ("pick", "run")
            and getattr(args, "wait", None) is None
            and getattr(err, "waitable", True)
        ):
            print("nothing picked; to wait in line until a device fits, add --wait DURATION "
                  "(e.g. --wait 10m)", file=sys.stderr)
        return err.exit_code
    except AutoGPUError as err:
        print(f"autogpu: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("autogpu: cancelled", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
