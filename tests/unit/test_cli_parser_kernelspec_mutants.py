"""What the mutation run (issue 22) found unchecked in ``autogpu list``, ``autogpu pick`` (its
summary, its ``--dry-run`` ranking, its progress while waiting, its dry run), ``autogpu run``'s
lease holder, the CLI's terminal-safe streams and user name, and the parser (the kernelspec
command's list, remove and install refusals are in test_kernelspec.py). In-process: a simulated
fleet file and a private lease registry under ``tmp_path``; a backend that reports errors or
real (not simulated) devices is a stub handing out a simulated snapshot so edited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pwd
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import cli as cli_mod
from tests.payloadhelpers import GiB, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
C = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
SECRET = "python train.py --token=hunter2"
SIMULATED = "SIMULATED fleet (AUTOGPU_SIMULATE), not real GPUs"


def _gpu(uuid: str, used_gib: int, util: float | None, name: str = "NVIDIA A100") -> dict[str, Any]:
    return {"uuid": uuid, "name": name, "memory_total": 80 * GiB, "memory_used": used_gib * GiB,
            "utilization_pct": util}


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``fleet(devices)``: these simulated devices and a private registry; returns the registry.
    No terminal: the width is the CLI's fallback unless a test sets COLUMNS."""
    from autogpu_jupyter.core import backends

    def use(devices: list[dict[str, Any]]) -> Path:
        path = write_fleet(tmp_path / "fleet.json", devices)
        monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
        backends._cache.clear()
        return tmp_path / "registry"

    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID", "COLUMNS",
                 "LINES", "AUTOGPU_BROKER_SOCKET", "AUTOGPU_RECORD_COMMANDS"):
        monkeypatch.delenv(name, raising=False)

    def no_terminal(_fd: int) -> os.terminal_size:
        raise OSError(errno.ENOTTY, "not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    yield use
    backends._cache.clear()


def cli(*args: str) -> tuple[int, str, str]:
    """``autogpu ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_mod.main(list(args))
    return code, out.getvalue(), err.getvalue()


def _edited_backend(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    """The CLI's and the picker's backend: the simulated fleet's snapshot with ``changes``."""
    from autogpu_jupyter.core import picker
    from autogpu_jupyter.core.backends import get_backend

    real = get_backend()

    class Edited:
        def snapshot(self) -> Any:
            return dataclasses.replace(real.snapshot(), **changes)

    monkeypatch.setattr(cli_mod, "get_backend", Edited)
    monkeypatch.setattr(picker, "get_backend", Edited)


# ---- autogpu list ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("root", "me", "shown"),
    [(False, "owner", SECRET), (False, "alice", None), (True, "alice", SECRET)],
)
def test_list_json_shows_a_leases_command_to_its_owner_and_to_root_only(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, root: bool, me: str,
    shown: str | None,
) -> None:
    """``autogpu list --json`` lists the leases under "leases", each with its command line for
    its owner and for root, null for any other user; the whole output indented by two spaces,
    as every --json of the CLI. Caught: "leases" written as null or under another key; the
    command never redacted, redacted for the owner (the test inverted, or "or" made "and"), or
    shown to another user (the owner test inverted); the JSON on one line or indented by 3."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    registry = fleet([_gpu(A, 0, 0)])
    owner = pwd.getpwuid(os.geteuid()).pw_name
    monkeypatch.setattr(cli_mod, "_is_root", lambda: root)
    monkeypatch.setattr(cli_mod, "_me", lambda: owner if me == "owner" else me)
    with Registry(str(registry), record_commands=True).locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A], requested_bytes=GiB,
                           requester=Requester(kernel_id="k-1", command=SECRET))
    try:
        code, out, err = cli("list", "--json")
    finally:
        lease.release()
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert [(r["lease_id"], r["user"], r["command"]) for r in data["leases"]] == [
        (lease.record.lease_id, owner, shown)]
    assert out == json.dumps(data, indent=2) + "\n"


def test_list_of_a_host_without_devices_says_so_under_its_title(
    fleet: Callable[..., Path],
) -> None:
    """A host whose fleet lists no device: the title, then "(no devices)" instead of a table.
    Caught: that line printed as "None", upper-cased or altered."""
    fleet([])
    assert cli("list") == (0, f"0 device(s) via simulated — {SIMULATED}\n(no devices)\n", "")


def test_list_shows_the_table_then_a_note_for_each_backend_error(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every line of ``autogpu list`` on a host whose backend reported errors: the title, the
    table (one device a line), then one "note:" line per error, its terminal-steering
    characters spelled out. Caught: the table printed as "None" or its lines joined with
    something else than newlines; a note printed as "None" or its text as "None"."""
    fleet([_gpu(A, 0, 0), _gpu(B, 40, 50)])
    _edited_backend(monkeypatch, errors=("GPU 2 fell off the bus\x1b[2J", "nvml: Unknown Error"))
    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = cli("list")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"2 device(s) via simulated — {SIMULATED}",
        "gpu    name         uuid          util  memory used / total      free   temp  power  "
        "procs  holders",
        "GPU 0  NVIDIA A100  GPU-0a0a0a0a    0%       0 B / 80.0 GiB  80.0 GiB  32 °C      ?  "
        "    0  nobody",
        "GPU 1  NVIDIA A100  GPU-1b1b1b1b   50%  40.0 GiB / 80.0 GiB  40.0 GiB  54 °C      ?  "
        "    0  nobody",
        "note: GPU 2 fell off the bus\\x1b[2J",
        "note: nvml: Unknown Error",
    ]


#: A GPU process of a user with a long name: the holders column (the one that wraps) then
#: wraps within the name, one character more or less showing where the width ends.
WORKER = {"pid": 61001, "used_memory": GiB, "user": "svc-imagenet-resnet50-sweep-worker-0017",
          "command": "python sweep.py"}


def test_list_not_on_a_terminal_fits_its_table_in_100_columns(
    fleet: Callable[..., Path],
) -> None:
    """Printed to a pipe or a file (no terminal, no COLUMNS), the table is sized for 100
    columns: the holders wrap at the 100th character. Caught: the fallback width 101 (the first
    line one character longer)."""
    fleet([{**_gpu(A, 0, 0), "processes": [WORKER]}])
    code, out, err = cli("list")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"1 device(s) via simulated — {SIMULATED}",
        "gpu    name         util  memory used / total      free   temp  procs  holders",
        "GPU 0  NVIDIA A100    0%       0 B / 80.0 GiB  80.0 GiB  32 °C      1  "
        "svc-imagenet-resnet50-sweep-w",
        " " * 71 + "orker-0017: pid 61001",
        " " * 71 + "(1.0 GiB used)",
    ]


def test_list_wraps_the_holders_within_the_terminals_width(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a 60-column terminal the table keeps to 60 columns: the columns it can do without are
    left out and a long holder wraps under its own column. Caught: the table written at the
    default 100 columns after narrowing for 60 (the holder on one long line)."""
    fleet([{**_gpu(A, 0, 0), "processes": [WORKER]}])
    monkeypatch.setenv("COLUMNS", "60")
    code, out, err = cli("list")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"1 device(s) via simulated — {SIMULATED}",
        "gpu    name         util      free  holders",
        "GPU 0  NVIDIA A100    0%  80.0 GiB  svc-imagenet-resnet50-sw",
        " " * 36 + "eep-worker-0017:",
        " " * 36 + "pid 61001 (1.0 GiB used)",  # never "pid" / "61001" (issue 41)
    ]


# ---- who runs it, and the streams it writes to -------------------------------------------------


def test_me_is_the_effective_users_name_else_the_uid_in_digits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name ``autogpu list --json`` compares owners with: the effective user's login name,
    or its uid as digits when no passwd entry names it (a container's arbitrary uid). Caught:
    the uid not handed to the passwd lookup (a TypeError); "None" for an unnamed uid."""
    from tests.unit.test_broker_identity import FREE

    assert cli_mod._me() == pwd.getpwuid(os.geteuid()).pw_name
    monkeypatch.setattr(os, "geteuid", lambda: FREE)
    assert cli_mod._me() == str(FREE)


def test_the_terminal_safe_stream_passes_everything_but_write_to_its_stream() -> None:
    """The stream ``main`` prints through spells out terminal-steering characters on write and
    hands every other attribute (flush, getvalue, encoding...) to the stream it wraps. Caught:
    the attribute looked up on None, under None, or not at all (a TypeError)."""
    inner = io.StringIO()
    safe = cli_mod._TerminalSafe(inner)
    assert safe.write("a\x9bb\u202ec\n") == 6
    assert safe.getvalue() == "a\\x9bb\\u202ec\n"
    assert safe.closed is False
    safe.close()
    assert inner.closed


# ---- autogpu pick and autogpu run ----------------------------------------------------------------


class _Flushes(io.StringIO):
    """A stream that records what it held at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())
        super().flush()


def test_a_waiting_pick_says_each_try_on_stderr_at_once_and_waits_as_a_cli(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``autogpu pick --wait 2s`` while nothing fits: one line per try on stderr, each flushed
    as it is written (a script reading stderr sees it while the pick waits), stdout left to the
    result; its place in line is a ticket held by a "cli". The clock and the sleep are the
    test's (two tries, no real wait). Caught: the progress printed as "None", empty, to stdout,
    or not flushed; no progress handed to the pick; the ticket's holder kind None or altered."""
    from autogpu_jupyter.core import picker
    from autogpu_jupyter.core.leasing import Registry

    registry = fleet([_gpu(A, 40, 0)])
    now = [0.0]
    in_line: list[list[tuple[str, str | None]]] = []

    def sleep(seconds: float) -> None:
        records = Registry(str(registry)).list_leases(include_tickets=True)
        in_line.append([(r.kind, r.holder_kind) for r in records])
        now[0] += seconds

    real = picker.pick
    monkeypatch.setattr(cli_mod, "pick", lambda options, **kw: real(
        options, sleep=sleep, clock=lambda: now[0], **kw))
    out, err = io.StringIO(), _Flushes()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_mod.main(["pick", "--min-free", "50G", "--wait", "2s"])
    assert (code, out.getvalue()) == (3, "")
    waiting = [
        f"waiting for a device (min free 50.0 GiB), {waited} of 2s; best now GPU 0: only "
        "40.0 GiB free < 50.0 GiB wanted\n" for waited in ("0s", "1s")]
    assert err.flushed == [waiting[0], waiting[0] + waiting[1]]
    assert err.getvalue() == waiting[0] + waiting[1] + (
        "autogpu: no device fits (min free 50.0 GiB) after waiting 2s:\n"
        "  GPU 0 (NVIDIA A100): dropped: only 40.0 GiB free < 50.0 GiB wanted\n")
    assert in_line == [[("ticket", "cli")], [("ticket", "cli")]]


def test_run_records_the_first_500_characters_of_the_command_in_its_lease(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Where the admin records command lines (AUTOGPU_RECORD_COMMANDS=1), ``autogpu run``'s
    lease holds the command it runs, quoted as a shell would read it and cut to 500 characters;
    the command copies its own lease file. Caught: the command left out of the holder (null),
    or cut to 501 characters."""
    registry = fleet([_gpu(A, 0, 0)])
    monkeypatch.setenv("AUTOGPU_RECORD_COMMANDS", "1")
    seen = tmp_path / "seen"
    cmd = ["sh", "-c", 'cat "$1"/*/*.lease > "$0"', str(seen), str(registry), "x" * 600]
    code, _out, err = cli("run", "--", *cmd)
    assert code == 0, err
    record = json.loads(seen.read_text())
    assert (record["holder_kind"], record["command"]) == ("cli", shlex.join(cmd)[:500])


def test_pick_takes_no_lease_and_says_it_was_a_dry_run(fleet: Callable[..., Path]) -> None:
    """``autogpu pick --json``: the pick ranks only (``"dry_run": true``, ``"lease": null``), as
    the command promises that no lease outlives it. Caught: the pick made a real one (dry_run
    None or left at its default False)."""
    fleet([_gpu(A, 0, 0)])
    code, out, err = cli("pick", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["dry_run"], data["lease"], data["lease_note"]) == (True, None, None)


def test_pick_of_a_device_of_unknown_load_asked_nothing_says_so(
    fleet: Callable[..., Path],
) -> None:
    """``autogpu pick`` with no option, on a device whose utilisation is unknown: "util ?" and
    "asked: any device" (not the policy's "no constraints"). Caught: the unknown load formatted
    as a number (a TypeError) or spelt otherwise; "any device" never used, upper-cased or
    altered."""
    fleet([_gpu(A, 0, None)])
    assert cli("pick") == (0, "\n".join([
        f"GPU 0 NVIDIA A100 {A}: 80.0 GiB free, util ?",
        "asked: any device",
        "note: SIMULATED fleet (AUTOGPU_SIMULATE)",
        f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={A}",
    ]) + "\n", "")


def test_pick_dry_run_ranks_what_fits_in_order_with_aligned_numbers(
    fleet: Callable[..., Path],
) -> None:
    """``autogpu pick --dry-run`` with no option, not on a terminal: "any device"; each device
    that fits ranked 1, 2, 3, the best "would pick", the others "fits", a verdict without a
    reason "ok"; an unknown load "?"; free memory, load and leases right-aligned; the verdict
    wrapping at 100 columns; the load it was ranked by and why the best won, as ``%gpu pick
    --dry-run`` says them (one ranking table, ``core.tables.ranking_lines``). Caught: every
    rank 1; every device "would pick"; "fits" or "ok" altered; the unknown load formatted as a
    number (a TypeError) or spelt otherwise; a number column left-aligned (align None, left out
    or altered: a ValueError); "any device" never used, altered, or compared with an altered
    "no constraints"; the fallback width 101."""
    fleet([_gpu(A, 0, 0, "T4 16GB"), _gpu(B, 40, None, "T4 16GB"), _gpu(C, 75, 90, "T4 16GB")])
    code, out, err = cli("pick", "--dry-run")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "autogpu [SIMULATED] dry run (any device): nothing changed",
        "  rank  device  name         free  util  load     leases  verdict",
        "  1     GPU 0   T4 16GB  80.0 GiB    0%  0% util       0  would pick: ok",
        "  2     GPU 1   T4 16GB  40.0 GiB     ?  50% mem       0  fits: utilisation unknown: "
        "ranked by",
        " " * 58 + "memory and leases",
        "  3     GPU 2   T4 16GB   5.0 GiB   90%  94% mem       0  fits: ok",
        "  why GPU 0 over GPU 1: lower load (0% util vs 50% mem)",
    ]


def test_pick_dry_run_on_real_devices_wraps_each_verdict_in_the_terminal(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``autogpu pick --dry-run --min-free 10G --max-util 50`` in an 80-column terminal on
    devices that are not simulated: no "[SIMULATED]"; a dropped device unranked ("-"); several
    reasons joined by "; "; the verdict wrapping under its own column within 80 columns.
    Caught: "[SIMULATED]" always shown, or the empty stand-in altered; the reasons' separator
    altered; the verdict not wrapping (wrap left out or False); the table written at the
    default 100 columns."""
    fleet([_gpu(A, 0, 0), _gpu(B, 40, None), _gpu(C, 75, 90)])
    _edited_backend(monkeypatch, simulated=False)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("pick", "--dry-run", "--min-free", "10G", "--max-util", "50")
    assert (code, err) == (0, "")
    under = " " * 62
    assert out.splitlines() == [
        "autogpu dry run (min free 10.0 GiB, max util 50%): nothing changed",
        "  rank  device  name             free  util  load     leases  verdict",
        "  1     GPU 0   NVIDIA A100  80.0 GiB    0%  0% util       0  would pick: 80.0 GiB",
        f"{under}free >= 10.0 GiB wanted",
        "  2     GPU 1   NVIDIA A100  40.0 GiB     ?  50% mem       0  fits: 40.0 GiB free >=",
        f"{under}10.0 GiB wanted;",
        f"{under}utilisation unknown",
        f"{under}(not supported here):",
        f"{under}not filtered on it",
        "  -     GPU 2   NVIDIA A100   5.0 GiB   90%  -             0  dropped: only 5.0 GiB",
        f"{under}free < 10.0 GiB wanted;",
        f"{under}utilisation 90% > max",
        f"{under}50%",
        "  why GPU 0 over GPU 1: lower load (0% util vs 50% mem)",
    ]


# ---- the parser: every command's help, defaults and value types --------------------------------

#: ``autogpu [COMMAND [ACTION]] --help`` of each command, its whitespace made single spaces (the
#: line breaks follow the terminal's width). This Python's prefix and interpreter are shown where
#: the kernelspec installer's defaults name them.
HELP = {
    '': (
        'usage: autogpu [-h] [--version] COMMAND ... Pick the least-loaded GPU that fits '
        '(NVIDIA, or AMD with ROCm), with leases so that simultaneous jobs never pile '
        'onto one card. Set AUTOGPU_SIMULATE=demo-4x to try it without a GPU. positional '
        'arguments: COMMAND list every device, its load and holders pick print the best '
        'device(s) for the constraints run run a command on the best device, holding a '
        'lease while it runs leases list the live leases on this host broker the trusted '
        "lease broker (root): serve, or show its status hosts rank the cluster's hosts "
        "for a pick, from Prometheus exporter serve this host's autogpu_* Prometheus "
        'metrics (hosts without Jupyter) kernelspec install / list / remove the "Python 3 '
        '(autogpu)" kernelspec options: -h, --help show this help message and exit '
        "--version show program's version number and exit exit codes: 0 ok (run: the "
        "command's own code), 1 other error, 2 usage error, 3 no device fits / no GPU "
        'granted, 4 no GPU driver (try AUTOGPU_SIMULATE=demo-4x), 5 too late: CUDA '
        'already initialised'
    ),
    'list': (
        'usage: autogpu list [-h] [--json] options: -h, --help show this help message and '
        'exit --json machine-readable output'
    ),
    'pick': (
        'usage: autogpu pick [-h] [--min-free SIZE] [--max-util PCT] [--count N] '
        '[--exclude IDS] [--exclusive] [--wait DURATION] [--model NAMES] [--prefer NAMES] '
        '[--devices IDS] [--dry-run] [--json | --export] [IDS] Print the best device(s). '
        "No lease outlives this command: use `autogpu run -- CMD` to hold one for CMD's "
        'lifetime. --export prints shell assignments for eval: eval "$(autogpu pick '
        '--min-free 10G --export)". positional arguments: IDS the devices to pick from, '
        'as --devices (e.g. 2 or 0,3) options: -h, --help show this help message and exit '
        '--min-free SIZE Free memory wanted per device: 10G / 10GiB (binary), 16GB '
        '(decimal) or 25% of the device. Default: AutoGPU.min_free. --max-util PCT Drop '
        'devices busier than this utilisation, 0-100. Default: AutoGPU.max_util. --count '
        'N How many devices (default 1; at most one MIG device). --exclude IDS NVML '
        'indices or UUIDs to avoid, comma separated: 0,2 or GPU-5a1b. --exclusive Take '
        'devices no other lease holds, and keep others off them. --wait DURATION Wait in '
        'line up to this long for a device to fit: 30s, 10m, 1h. Interrupt the kernel to '
        'cancel. --model NAMES Only devices whose model name contains one of these: A100 '
        'or H100,A100. Default: AutoGPU.model. --prefer NAMES Prefer these models, in '
        'this order, before load: L4,A100 (others after them). Default: AutoGPU.prefer '
        "(an admin's order). --devices IDS Only these devices, comma separated: 2, 0,3, a "
        'UUID or its start (GPU-5a1b), a MIG device (3:1). Default --count: how many are '
        'named. %gpu pick 2 / autogpu pick 2 say the same. --dry-run show the whole '
        'ranking with the reason each device was kept or dropped (as %gpu pick '
        '--dry-run); changes nothing --json machine-readable output --export print '
        '`export CUDA_DEVICE_ORDER=... CUDA_VISIBLE_DEVICES=...` for eval (holds no '
        'lease)'
    ),
    'run': (
        'usage: autogpu run [-h] [--min-free SIZE] [--max-util PCT] [--count N] '
        '[--exclude IDS] [--exclusive] [--wait DURATION] [--model NAMES] [--prefer NAMES] '
        '[--devices IDS] ... Pick, take a lease, run CMD with CUDA_VISIBLE_DEVICES set; '
        "the lease lasts exactly as long as CMD runs. Exits with CMD's exit code. Name "
        'the devices with --devices: autogpu run --devices 2 -- CMD. positional '
        'arguments: -- CMD ARGS the command to run options: -h, --help show this help '
        'message and exit --min-free SIZE Free memory wanted per device: 10G / 10GiB '
        '(binary), 16GB (decimal) or 25% of the device. Default: AutoGPU.min_free. '
        '--max-util PCT Drop devices busier than this utilisation, 0-100. Default: '
        'AutoGPU.max_util. --count N How many devices (default 1; at most one MIG '
        'device). --exclude IDS NVML indices or UUIDs to avoid, comma separated: 0,2 or '
        'GPU-5a1b. --exclusive Take devices no other lease holds, and keep others off '
        'them. --wait DURATION Wait in line up to this long for a device to fit: 30s, '
        '10m, 1h. Interrupt the kernel to cancel. --model NAMES Only devices whose model '
        'name contains one of these: A100 or H100,A100. Default: AutoGPU.model. --prefer '
        'NAMES Prefer these models, in this order, before load: L4,A100 (others after '
        "them). Default: AutoGPU.prefer (an admin's order). --devices IDS Only these "
        'devices, comma separated: 2, 0,3, a UUID or its start (GPU-5a1b), a MIG device '
        '(3:1). Default --count: how many are named. %gpu pick 2 / autogpu pick 2 say the '
        'same.'
    ),
    'leases': (
        'usage: autogpu leases [-h] [--json] [--prune] [--all] [--show-commands] options: -h, '
        '--help show this help message and exit --json machine-readable output --prune remove '
        "your own dead lease files --all with --prune, as root: remove every user's dead "
        "lease files --show-commands show other users' command lines (root only)"
    ),
    'broker': (
        'usage: autogpu broker [-h] [--socket PATH] [--foreground] [--state-dir DIR] '
        '[--max-devices-per-user N] [--max-leases-per-user N] [--max-tickets-per-user N] '
        '[--max-connections-per-user N] [--max-connections N] [--ticket-grace SECONDS] '
        '[--send-timeout SECONDS] [--subuid-file FILE] [--max-messages-per-s-per-user N] '
        '[--rules FILE] [--json] [{serve,status,tickets,revoke}] [lease_id] `autogpu broker` '
        'runs the lease broker in the foreground (systemd runs it through socket activation: '
        'see docs/admin-broker.md). `autogpu broker status` shows its leases, waiters and '
        'per-user counts; `autogpu broker tickets` lists the waiting line; `autogpu broker '
        'revoke ID` (root) ends a lease or a ticket; `autogpu broker tenant add|list|remove` '
        '(root) edits the tenants (docs/jupyterhub.md). positional arguments: '
        '{serve,status,tickets,revoke} default: serve lease_id the lease or ticket to revoke '
        'options: -h, --help show this help message and exit --socket PATH the Unix socket '
        '(default c.AutoGPU.broker_socket, else /run/autogpu/broker.sock) --foreground run in '
        'the foreground (the only mode; for containers and tests) --state-dir DIR root-only '
        "journal, so a restart keeps live leases (default /var/lib/autogpu-broker; '' for "
        'none) --max-devices-per-user N admin limit (default c.AutoGPU.max_devices_per_user) '
        '--max-leases-per-user N leases one user may hold at once, shared or not (default '
        'c.AutoGPU.max_leases_per_user; 0: no limit) --max-tickets-per-user N places in the '
        'waiting line one user may hold at once (default c.AutoGPU.max_tickets_per_user, 2; '
        '0: no waiting picks) --max-connections-per-user N connections one non-root user '
        '(with their subordinate uids) may hold (default 256) --max-connections N connections '
        'in all users together (default 0: 4096, or fewer if the descriptor limit is lower; '
        "the last 16 are root's) --ticket-grace SECONDS a ticket that could be served but is "
        'not taken within this many seconds loses its place (default 5) --send-timeout '
        'SECONDS a client that does not read a reply within this many seconds is dropped '
        '(default 10) --subuid-file FILE subordinate uid ranges: such a uid counts as its '
        'owner (default /etc/subuid) --max-messages-per-s-per-user N messages per second one '
        "non-root uid may send (default 500; past it that user's messages wait) --rules FILE "
        "the admin's rules (JSON: max_devices_per_user, per-user and per-group limits, "
        "devices reserved for groups); a file named here must exist ('' for none); default "
        '/etc/autogpu/broker.json, read when it exists '
        '--json status: machine-readable output'
    ),
    'hosts': (
        'usage: autogpu hosts [-h] [--prometheus URL] [--min-free SIZE] [--max-util PCT] '
        '[--count N] [--json | --best] Rank every host Prometheus scrapes (autogpu exporters, '
        "Jupyter servers' /metrics, DCGM exporters) with the policy of a local pick: the "
        'first host is where `autogpu pick` with the same options would find the best device. '
        'Use it to choose a node: srun --nodelist=$(autogpu hosts --min-free 10G --best) ... '
        'options: -h, --help show this help message and exit --prometheus URL Prometheus base '
        'URL (default: c.AutoGPU.prometheus_url / $AUTOGPU_PROMETHEUS_URL) --min-free SIZE '
        'Free memory wanted per device: 10G / 10GiB (binary), 16GB (decimal) or 25% of the '
        'device. Default: AutoGPU.min_free. --max-util PCT Drop devices busier than this '
        'utilisation, 0-100. Default: AutoGPU.max_util. --count N How many devices (default '
        '1; at most one MIG device). --json machine-readable output --best print only the '
        "best host's name"
    ),
    'exporter': (
        'usage: autogpu exporter [-h] [--host HOST] [--port PORT] [--interval SECONDS] '
        '[--hostname HOSTNAME] [--lease-details] Serve the autogpu_* gauges (the same as a '
        "Jupyter server's /metrics) at http://HOST:PORT/metrics, from one background sampler: "
        'a scrape reads its latest sweep and never calls NVML. options: -h, --help show this '
        'help message and exit --host HOST address to listen on (default 127.0.0.1; 0.0.0.0 '
        'for all) --port PORT port (default 9445) --interval SECONDS seconds between NVML '
        'sweeps (default c.AutoGPU.sample_interval_s) --hostname HOSTNAME the hostname label '
        "(default: this host's short name) --lease-details add kernel and notebook labels to "
        'autogpu_lease_info (off: privacy, series count)'
    ),
    'kernelspec': (
        'usage: autogpu kernelspec [-h] ACTION ... A kernelspec whose provisioner picks the '
        'GPU before the kernel starts; the lease lives exactly as long as the kernel process. '
        'positional arguments: ACTION install install an autogpu kernelspec list list the '
        'installed autogpu kernelspecs remove remove an autogpu kernelspec options: -h, '
        '--help show this help message and exit'
    ),
    'kernelspec install': (
        'usage: autogpu kernelspec install [-h] [--name NAME] [--display-name '
        'DISPLAY_NAME] [--min-free SIZE] [--max-util PCT] [--count N] [--exclusive] '
        '[--wait DURATION] [--model NAMES] [--prefer NAMES] [--devices IDS] '
        '[--on-no-device {cpu,fail}] [--user | --sys-prefix | --prefix DIR] [--python '
        'EXE] [--no-extension] options: -h, --help show this help message and exit --name '
        'NAME kernelspec name (default python3-autogpu) --display-name DISPLAY_NAME name '
        "shown in the launcher (default 'Python 3 (autogpu)') --min-free SIZE Free memory "
        'wanted per device: 10G / 10GiB (binary), 16GB (decimal) or 25% of the device. '
        'Default: AutoGPU.min_free. --max-util PCT Drop devices busier than this '
        'utilisation, 0-100. Default: AutoGPU.max_util. --count N How many devices '
        '(default 1; at most one MIG device). --exclusive Take devices no other lease '
        'holds, and keep others off them. --wait DURATION Wait in line up to this long '
        'for a device to fit: 30s, 10m, 1h. Interrupt the kernel to cancel. --model NAMES '
        'Only devices whose model name contains one of these: A100 or H100,A100. Default: '
        'AutoGPU.model. --prefer NAMES Prefer these models, in this order, before load: '
        "L4,A100 (others after them). Default: AutoGPU.prefer (an admin's order). "
        '--devices IDS Only these devices, comma separated: 2, 0,3, a UUID or its start '
        '(GPU-5a1b), a MIG device (3:1). Default --count: how many are named. %gpu pick 2 '
        '/ autogpu pick 2 say the same. --on-no-device {cpu,fail} nothing fits: start '
        'CPU-only with a note (cpu, default) or refuse to start (fail) --user install for '
        "this user only --sys-prefix install into this Python's prefix "
        f"({sys.prefix}) --prefix DIR "
        'install into DIR/share/jupyter/kernels --python EXE the Python that runs the '
        f'kernel (default {sys.executable}) --no-extension do not load the autogpu '
        'IPython extension (%gpu) in the kernel'
    ),
    'kernelspec list': (
        'usage: autogpu kernelspec list [-h] [--json] options: -h, --help show this help '
        'message and exit --json machine-readable output'
    ),
    'kernelspec remove': (
        'usage: autogpu kernelspec remove [-h] name positional arguments: name the kernelspec '
        'name options: -h, --help show this help message and exit'
    ),
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_every_commands_help_says_what_it_does_takes_and_defaults_to(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Each command's whole help: usage (the placeholders, the choices, which flags exclude
    each other, what takes a value), description, every argument's help and the exit codes.
    Caught (issue 22): a help text, description, epilog, metavar or choice dropped, upper-cased
    or altered; a switch made to take a value; a mutually exclusive group lost."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as done:
        cli_mod.main([*command.split(), "--help"])
    assert done.value.code == 0
    out, err = capsys.readouterr()
    assert (" ".join(out.split()), err) == (HELP[command], "")


def test_version_names_the_program_and_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    """Caught: the version line altered."""
    from autogpu_jupyter._version import __version__

    with pytest.raises(SystemExit) as done:
        cli_mod.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr() == (f"autogpu {__version__}\n", "")


#: What each command reads when given nothing but its name (its defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "list": {"json": False},
    "pick": {"min_free": None, "max_util": None, "count": None, "exclude": None,
             "exclusive": None, "wait": None, "model": None, "prefer": None, "devices": None,
             "ids": None, "dry_run": False, "json": False, "export": False},
    "run": {"min_free": None, "max_util": None, "count": None, "exclude": None,
            "exclusive": None, "wait": None, "model": None, "prefer": None, "devices": None,
            "cmd": []},
    "leases": {"json": False, "prune": False, "all": False, "show_commands": False},
    "broker": {"action": "serve", "lease_id": None, "socket": None, "foreground": False,
               "state_dir": "/var/lib/autogpu-broker", "max_devices_per_user": None,
               "max_leases_per_user": None, "max_tickets_per_user": None,
               "max_connections_per_user": 256, "max_connections": 0, "ticket_grace": 5.0,
               "send_timeout": 10.0, "subuid_file": "/etc/subuid",
               "max_messages_per_s_per_user": 500.0, "rules": None,
               "json": False},
    "hosts": {"prometheus": None, "min_free": None, "max_util": None, "count": None,
              "json": False, "best": False},
    "exporter": {"host": "127.0.0.1", "port": 9445, "interval": None, "hostname": "",
                 "lease_details": False},
}


@pytest.mark.parametrize("command", sorted(DEFAULTS))
def test_each_command_starts_from_its_documented_defaults(command: str) -> None:
    """``autogpu COMMAND`` with no option reads exactly these values (the defaults its help
    promises: the broker's limits, timers and files, the exporter's address and port), and an
    error in it names the command's own usage (the subparsers kept for that). Caught (issue 22):
    a default dropped or altered (256, 0, 5, 10, 500, a path, the address, the port); a switch
    defaulting to None; the broker's handler or the subparsers lost."""
    args = cli_mod.build_parser().parse_args([command])
    seen = vars(args)
    assert seen.pop("command") == command
    assert sorted(seen.pop("_subparsers")) == [
        "broker", "exporter", "hosts", "kernelspec", "leases", "list", "pick", "run"]
    assert seen.pop("handler", None) is (cli_mod._cmd_broker if command == "broker" else None)
    assert seen == DEFAULTS[command]


def test_numeric_flags_are_read_as_numbers_and_switches_as_true() -> None:
    """The broker's and the exporter's numeric flags arrive as int or float (the limits through
    the same check as ``_limit_arg``), every switch as True. Caught (issue 22): a type dropped
    (the number left a string), int and float swapped; a switch's action lost."""
    parse = cli_mod.build_parser().parse_args
    broker = vars(parse([
        "broker", "revoke", "abc", "--socket", "/s", "--foreground", "--state-dir", "",
        "--max-devices-per-user", "3", "--max-leases-per-user", "4",
        "--max-tickets-per-user", "0", "--max-connections-per-user", "9",
        "--max-connections", "99", "--ticket-grace", "2.5", "--send-timeout", "0.5",
        "--subuid-file", "/u", "--max-messages-per-s-per-user", "7.5", "--rules", "/r",
        "--json"]))
    del broker["_subparsers"]
    assert broker == {
        "command": "broker", "action": "revoke", "lease_id": "abc", "socket": "/s",
        "foreground": True, "state_dir": "", "max_devices_per_user": 3,
        "max_leases_per_user": 4, "max_tickets_per_user": 0, "max_connections_per_user": 9,
        "max_connections": 99, "ticket_grace": 2.5, "send_timeout": 0.5, "subuid_file": "/u",
        "max_messages_per_s_per_user": 7.5, "rules": "/r", "json": True,
        "handler": cli_mod._cmd_broker}
    assert [type(broker[k]) for k in ("max_devices_per_user", "max_connections_per_user",
                                       "max_connections", "ticket_grace", "send_timeout",
                                       "max_messages_per_s_per_user")] == [
        int, int, int, float, float, float]
    exporter = vars(parse(["exporter", "--host", "0.0.0.0", "--port", "80", "--interval", "2",
                           "--hostname", "n1", "--lease-details"]))
    assert {k: exporter[k] for k in ("host", "port", "interval", "hostname", "lease_details")} == {
        "host": "0.0.0.0", "port": 80, "interval": 2.0, "hostname": "n1", "lease_details": True}
    assert (type(exporter["port"]), type(exporter["interval"])) == (int, float)
    for argv, key in ((["list", "--json"], "json"), (["pick", "--dry-run"], "dry_run"),
                      (["pick", "--export"], "export"), (["leases", "--prune"], "prune"),
                      (["leases", "--all"], "all"), (["leases", "--show-commands"],
                                                     "show_commands"),
                      (["hosts", "--best"], "best"), (["hosts", "--json"], "json")):
        assert getattr(parse(argv), key) is True, argv


# ---- main: errors, interrupts, the streams and a closed pipe -----------------------------------


def test_an_unknown_option_is_named_with_the_commands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Unknown options after a command: exit 2, one line naming that command and every
    unknown option, space separated; before any command, the top-level program (issue 41: no
    usage dump before it). Caught: the options joined otherwise; the top-level program for a
    command's error."""
    for argv, prog in (
        (["pick", "--bogus", "--worse"], "autogpu pick"),
        (["--bogus", "--worse"], "autogpu"),
    ):
        with pytest.raises(SystemExit) as done:
            cli_mod.main(argv)
        assert done.value.code == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"{prog}: error: unrecognized arguments: --bogus --worse\n"


def test_no_command_prints_the_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """``autogpu`` alone: the help on stdout, exit 2 (a usage error). Caught: another code."""
    assert cli_mod.main([]) == 2
    out, err = capsys.readouterr()
    assert (out.splitlines()[0], err) == ("usage: autogpu [-h] [--version] COMMAND ...", "")


def test_a_run_that_fits_nowhere_suggests_wait_as_a_pick_does(fleet: Callable[..., Path]) -> None:
    """``autogpu run`` without --wait when nothing fits: exit 3, the reason, then the hint to
    wait in line (as for ``autogpu pick``). Caught: the hint given for pick only."""
    fleet([_gpu(A, 40, 0)])
    assert cli("run", "--min-free", "50G", "--", "true") == (3, "", (
        "autogpu: no device fits (min free 50.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 40.0 GiB free < 50.0 GiB wanted\n"
        "nothing picked; to wait in line until a device fits, add --wait DURATION "
        "(e.g. --wait 10m)\n"))


def test_an_interrupted_command_says_cancelled_and_exits_130(
    fleet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C during a command: one line, "autogpu: cancelled", exit 130 (128 + SIGINT), no
    traceback. Caught: the line or the code altered."""
    fleet([_gpu(A, 0, 0)])

    def interrupted(_args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_mod, "_cmd_list", interrupted)
    assert cli("list") == (130, "", "autogpu: cancelled\n")


def test_main_spells_out_terminal_controls_and_gives_the_streams_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a command runs, what it prints to stdout and stderr has its terminal-steering
    characters spelled out (another user's text must not drive the terminal); after it, the
    streams are the caller's again. Caught: a stream left unwrapped or not given back."""
    def shout(_args: Any) -> int:
        print("out\x9b2J")
        print("err\u202e", file=sys.stderr)
        return 0

    monkeypatch.setattr(cli_mod, "_cmd_list", shout)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli_mod.main(["list"]) == 0
        assert (sys.stdout, sys.stderr) == (out, err)
    assert (out.getvalue(), err.getvalue()) == ("out\\x9b2J\n", "err\\u202e\n")


def test_a_reader_that_left_ends_the_command_quietly_with_141(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """``autogpu leases | head``: when the reader leaves (a BrokenPipeError), main returns
    128 + SIGPIPE and points stdout's descriptor at /dev/null, still open for writing, so the
    final flush at exit writes nowhere instead of failing again. Caught: another code; the
    descriptor left pointing at the pipe (here: the file), or at /dev/null opened read-only."""
    def reader_left(_args: Any) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(cli_mod, "_cmd_list", reader_left)
    path = tmp_path / "stdout"
    with open(path, "w", encoding="utf-8") as stdout:
        with contextlib.redirect_stdout(stdout):
            assert cli_mod.main(["list"]) == 128 + signal.SIGPIPE
        assert os.write(stdout.fileno(), b"late") == 4
    assert path.read_bytes() == b""
