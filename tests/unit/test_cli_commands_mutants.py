"""``autogpu pick``, ``run`` and ``leases`` in this process, to the exact text (mutation run,
issue 22): what ``pick --export`` / ``--json`` print, what ``run`` hands its command (the lease's
descriptor, the variables, forwarded signals) and says on stderr, what ``leases`` says when
leases are off, when it prunes, and how it lists a lease; what ``hosts`` prints (header, hosts,
a down host, errors, ``--json``, ``--best``), its defaults and timeout, and how it shows another
machine's name.

The simulated fleet (two GPUs) and private registry are those of ``tests/unit/test_cli.py``
(its ``host`` fixture); ``run`` starts a stand-in for ``subprocess.Popen`` where the test must
see what it was handed while it "runs".
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from autogpu_jupyter import cli as cli_mod
from autogpu_jupyter.core import decision
from autogpu_jupyter.core.leasing import BrokerRegistry, Registry, Requester
from autogpu_jupyter.errors import AutoGPUError
from tests.payloadhelpers import GiB, recorded_prometheus
from tests.unit.test_cli import A, B, cli
from tests.unit.test_cli import host as _cli_host  # noqa: F401 (the fixture, by this name)

SUMMARY = (
    f"GPU 0 NVIDIA A100 {A}: 80.0 GiB free, util 0%\n"
    "asked: any device\n"
    "runner-up: GPU 1 (40.0 GiB free)\n"
    "note: SIMULATED fleet (AUTOGPU_SIMULATE)\n"
)
ME = pwd.getpwuid(os.geteuid()).pw_name


@pytest.fixture
def registry(request: pytest.FixtureRequest) -> Path:
    """The fleet and registry of ``tests/unit/test_cli.py``'s ``host``; returns the registry."""
    return request.getfixturevalue("_cli_host")


def _dead(lease: Any) -> str:
    """Close a held lease's descriptor without removing its file (its holder was SIGKILLed)."""
    os.close(lease._fd)
    lease._fd = None
    return str(lease.path)


# ---- autogpu leases ------------------------------------------------------------------------


def test_leases_when_leases_are_off_says_so_and_how(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With leases off there is no registry to list: one line naming the setting. Caught: the
    line replaced by ``None``, wrapped in other text, lower- or upper-cased."""
    monkeypatch.setenv("AUTOGPU_USE_LEASES", "0")
    assert cli("leases") == (
        0, "leases are off (AutoGPU.use_leases = False or no registry_dir)\n", "")


def test_prune_as_a_user_removes_their_dead_files_and_lists_each(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``leases --prune`` (no --all) needs no root: it removes the user's dead lease and ticket
    files, one line each (the devices, or "ticket" for a ticket that has none; the holder; the
    path), keeps the live one, and a second prune says there is nothing left. Caught: the root
    check made ``--all or not root`` (every user refused); the removed list dropped or its test
    inverted (the "no dead lease files" line); the header or a file's line replaced by
    ``None``; a lease's devices replaced by its kind or joined by another separator; the
    broker's "nothing to prune" said for a registry."""
    monkeypatch.setattr(cli_mod, "_is_root", lambda: False)
    reg = Registry(str(registry))
    with reg.locked() as txn:
        assert txn is not None
        live = txn.create(devices=[A], requester=Requester())
        two = txn.create(devices=[A, B], requester=Requester(kernel_id="0123456789abcdef"))
        ticket = txn.create_ticket(constraints=decision.ticket_constraints(None, None),
                                   requester=Requester(notebook_path="work/wait.ipynb"))
    pid = os.getpid()
    two_path, ticket_path = _dead(two), _dead(ticket)
    try:
        code, out, err = cli("leases", "--prune")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == "removed 2 dead lease file(s):"
        assert sorted(lines[1:]) == sorted([
            f"  {A},{B}  {ME}: kernel 01234567  ({two_path})",
            f"  ticket  {ME}: work/wait.ipynb  ({ticket_path})",
        ])
        assert [r.lease_id for r in reg.list_leases()] == [live.record.lease_id]
        assert live.record.pid == pid
        assert cli("leases", "--prune") == (0, f"no dead lease files in {registry}\n", "")
    finally:
        live.release()


def test_prune_all_as_root_asks_the_store_for_every_users_files(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``leases --prune --all`` (root) hands ``all_users=True`` to the store, and plain
    ``--prune`` hands False. Caught: the flag not passed on (``all_users=None``: root's --all
    removing only root's own files)."""
    asked: list[Any] = []

    def prune(self: Registry, all_users: bool = False) -> list[Any]:
        asked.append(all_users)
        return []

    monkeypatch.setattr(cli_mod, "_is_root", lambda: True)
    monkeypatch.setattr(Registry, "prune", prune)
    assert cli("leases", "--prune", "--all") == (0, f"no dead lease files in {registry}\n", "")
    assert cli("leases", "--prune") == (0, f"no dead lease files in {registry}\n", "")
    assert asked == [True, False]


def test_prune_with_a_broker_says_the_broker_frees_leases_itself(
    registry: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through the lease broker there are never dead files: ``--prune`` says why, naming the
    broker's socket. Caught: the broker test inverted (the registry's "no dead lease files in
    SOCKET" instead); the line replaced by ``None``; its end wrapped in other text or
    upper-cased."""
    sock = str(tmp_path / "broker.sock")
    monkeypatch.setattr(cli_mod, "store_for", lambda _settings: BrokerRegistry(sock))
    assert cli("leases", "--prune") == (
        0, f"nothing to prune: the lease broker at {sock} frees a lease the moment its "
        "holder's connection closes\n", "")


def test_leases_json_is_indented_by_two(registry: Path) -> None:
    """``leases --json`` is a list of the leases, indented by two spaces as every ``--json`` of
    autogpu is. Caught: the indent dropped (one line) or made 3."""
    reg = Registry(str(registry))
    with reg.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A], requested_bytes=GiB, requester=Requester(kernel_id="k-1"))
    try:
        code, out, err = cli("leases", "--json")
    finally:
        lease.release()
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert [d["lease_id"] for d in data] == [lease.record.lease_id]
    assert out == json.dumps(data, indent=2) + "\n"
    assert out.splitlines()[:3] == ["[", "  {", f'    "lease_id": "{lease.record.lease_id}",']


def test_leases_lists_a_lease_on_two_devices_with_its_notebook(registry: Path) -> None:
    """A lease on two devices shows both, joined by a comma, and ends with the holder's
    notebook (which wins over its kernel). Caught: the notebook key misspelt (the kernel shown
    instead); the devices joined by another separator."""
    reg = Registry(str(registry))
    with reg.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[A, B], requester=Requester(
            kernel_id="k-1", notebook_path="work/train.ipynb"))
    try:
        code, out, err = cli("leases")
    finally:
        lease.release()
    assert (code, err) == (0, "")
    assert out == f"{ME:<12} pid {os.getpid():<8} {A},{B} booked - work/train.ipynb\n"


# ---- autogpu pick --------------------------------------------------------------------------


def test_pick_export_prints_one_export_per_variable(registry: Path) -> None:
    """``pick --export`` prints shell assignments for eval, one ``export K=V;`` per variable,
    separated by one space. Caught: the line replaced by ``None``; the assignments joined by
    other text; the values not given to shlex.quote (a TypeError)."""
    assert cli("pick", "--export", "--count", "2") == (
        0, f"export CUDA_DEVICE_ORDER=PCI_BUS_ID; export CUDA_VISIBLE_DEVICES={A},{B};\n", "")


def test_pick_dry_run_with_json_or_export_prints_those_not_the_ranking(registry: Path) -> None:
    """``--dry-run`` with ``--json`` or ``--export`` prints the JSON (indented by two, saying
    dry_run) or the assignments, not the ranking table. Caught: ``--export or --json`` made
    ``and`` (the ranking printed for either); the JSON's indent dropped or made 3."""
    code, out, err = cli("pick", "--dry-run", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["dry_run"], data["lease"], [d["uuid"] for d in data["chosen"]]) == (
        True, None, [A])
    assert data["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": A}
    assert out == json.dumps(data, indent=2) + "\n"
    assert out.splitlines()[:2] == ["{", '  "chosen": [']
    assert cli("pick", "--dry-run", "--export") == (
        0, f"export CUDA_DEVICE_ORDER=PCI_BUS_ID; export CUDA_VISIBLE_DEVICES={A};\n", "")


def test_pick_export_on_amd_devices_writes_the_rocm_variables(
    registry: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On AMD devices ``pick --export`` sets ROCR_VISIBLE_DEVICES to the host's device and the
    runtimes' own variables counting from 0 (the snapshot's devices say the vendor). Caught: the
    snapshot's devices not handed to visible_env (CUDA's variables, with a UUID ROCm ignores)."""
    from autogpu_jupyter.core import backends
    from tests.leasehelpers import fleet

    amd = tmp_path / "amd.json"
    amd.write_text(json.dumps({"vendor": "amd", **fleet(2)}))
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(amd))
    backends._cache.clear()
    assert cli("pick", "--export", "--exclude", "0") == (
        0, "export ROCR_VISIBLE_DEVICES=1; export HIP_VISIBLE_DEVICES=0; "
        "export CUDA_VISIBLE_DEVICES=0; export GPU_DEVICE_ORDINAL=0;\n", "")


# ---- autogpu run ---------------------------------------------------------------------------


class _Child:
    """A stand-in for ``subprocess.Popen``: while it "runs" (``wait``) it notes what it was
    handed, what the registry holds, and sends this process SIGINT, SIGTERM and SIGHUP through
    the handlers ``autogpu run`` installed; it exits with ``code``."""

    code = 0

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None,
                 pass_fds: Sequence[int] = ()) -> None:
        self.cmd, self.env, self.pass_fds = list(cmd), dict(env or {}), tuple(pass_fds)
        self.sent: list[Any] = []
        self.open_files: list[str] = []
        self.leases: list[Any] = []
        _Child.made.append(self)

    made: ClassVar[list[_Child]] = []

    def wait(self) -> int:
        self.open_files = [os.readlink(f"/proc/self/fd/{fd}") for fd in self.pass_fds]
        with contextlib.suppress(AutoGPUError):  # a refused registry: no leases to see
            self.leases = Registry(os.environ["AUTOGPU_REGISTRY_DIR"]).list_leases()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.getsignal(sig)(sig, None)  # type: ignore[operator]
        return self.code

    def send_signal(self, signum: Any) -> None:
        self.sent.append(signum)


@pytest.fixture
def child(monkeypatch: pytest.MonkeyPatch) -> type[_Child]:
    """``autogpu run`` starts a :class:`_Child` instead of a process."""
    monkeypatch.setattr(_Child, "made", [])
    monkeypatch.setattr(cli_mod, "subprocess", types.SimpleNamespace(Popen=_Child))
    return _Child


def test_run_hands_the_command_its_lease_descriptor_and_forwards_signals(
    registry: Path, monkeypatch: pytest.MonkeyPatch, child: type[_Child]
) -> None:
    """``autogpu run --count 2 -- CMD``: CMD (without the ``--``) gets the lease file's
    descriptor (so the lease lives as long as CMD), AUTOGPU_PICKED naming both devices joined by
    a comma, and every SIGINT, SIGTERM and SIGHUP that reaches autogpu while it runs; the lease
    records CMD's command line (the admin opted in); afterwards the lease is released (its file
    gone) and the signal handlers are what they were. Caught: the descriptor not passed
    (``pass_fds`` dropped, the lease test made always-true or inverted); the command line not
    kept for the lease record; the devices joined by other text; a signal swallowed or
    forwarded as ``None``; the lease released only when there is none."""
    monkeypatch.setenv("AUTOGPU_RECORD_COMMANDS", "1")
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    code, out, err = cli("run", "--count", "2", "--", "python", "-c", "print(1)")
    assert (code, out) == (0, ""), err
    (ran,) = child.made
    (lease,) = ran.leases
    assert ran.cmd == ["python", "-c", "print(1)"]
    assert lease.command == "python -c 'print(1)'"
    assert ran.open_files == [lease.path]
    assert (ran.env["AUTOGPU_PICKED"], ran.env["AUTOGPU_LEASE_ID"]) == (f"{A},{B}", lease.lease_id)
    assert ran.sent == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == before
    assert os.listdir(registry / str(os.geteuid())) == []


def test_run_without_a_usable_registry_runs_the_command_and_notes_why_on_stderr(
    registry: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, child: type[_Child]
) -> None:
    """A registry that is a symlink is refused: ``autogpu run`` still runs CMD, without a lease
    (no descriptor to pass, nothing to release), and says why on stderr, after the summary.
    Caught: the note replaced by ``None``, by an empty line, or printed to stdout; a crash
    where there is no lease (its descriptor asked for, the lease test made always-false or
    inverted; the release done only when there is no lease)."""
    real = tmp_path / "real-registry"
    real.mkdir(mode=0o1777)
    link = tmp_path / "link-registry"
    link.symlink_to(real)
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(link))
    monkeypatch.setattr(_Child, "code", 4)
    assert cli("run", "--", "true") == (4, "", SUMMARY + (
        f"note: lease registry {link} is a symlink: refused (another user could redirect "
        "leases elsewhere); the admin should make it a real directory, mode 1777: picked "
        "without a lease\n"))
    (ran,) = child.made
    assert (ran.pass_fds, "AUTOGPU_LEASE_ID" in ran.env) == ((), False)
    assert ran.env["AUTOGPU_PICKED"] == A


def test_run_with_leases_off_runs_the_command_without_one(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With leases off, ``autogpu run`` runs CMD (a real process) and exits with its code.
    Caught: a crash where there is no lease (its descriptor asked for, or released)."""
    monkeypatch.setenv("AUTOGPU_USE_LEASES", "0")
    assert cli("run", "--", "sh", "-c", "exit 6") == (6, "", SUMMARY)


def test_run_of_a_missing_command_exits_127_naming_it(registry: Path) -> None:
    """A command that does not exist: exit 127 (as a shell), and one line on stderr, after the
    summary, naming the command (not its first argument). Caught: the line replaced by
    ``None``, by an empty line, or printed to stdout; the argument named instead; exit 128."""
    missing = str(registry.parent / "no-such-command")
    assert cli("run", "--", missing, "--its-argument") == (127, "", SUMMARY + (
        f"autogpu: error: command not found: {missing!r}\n"))


# ---- autogpu hosts -------------------------------------------------------------------------


def test_hosts_shows_a_printable_hostname_as_it_is_backslash_included(registry: Path) -> None:
    """Only characters a terminal would not print are spelled out: a printable name, even one
    with a backslash, is shown as it is (not doubled, as repr would). Caught: every character
    passed through repr (a backslash shown as two)."""
    with recorded_prometheus(rename={"gpu-b": "gpu\\b"}) as url:
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "10G")
    assert (code, err) == (0, "")
    assert out.splitlines()[1] == (
        "  1. gpu\\b                ok    GPU 2 NVIDIA L4 (22.0 GiB free, util 30%)")


def test_run_of_a_command_that_cannot_start_leaves_no_lease_file(registry: Path) -> None:
    """A command that is missing, or not executable, never ran: its lease ends there and then,
    its file removed (not left behind as a dead lease for ``leases --prune``); a command that
    exists but cannot be executed (no x bit, a directory) exits 126 as in a shell, with one line
    naming it and why, not a traceback. Caught: the lease of a command that failed to start left
    in the registry (closed by the garbage collector, its file kept); a PermissionError's
    traceback for a file without an x bit."""
    missing = str(registry.parent / "no-such-command")
    assert cli("run", "--", missing)[0] == 127
    assert os.listdir(registry / str(os.geteuid())) == []
    plain = registry.parent / "not-executable"
    plain.write_text("exit 0\n")
    plain.chmod(0o644)
    assert cli("run", "--", str(plain), "--its-argument") == (126, "", SUMMARY + (
        f"autogpu: error: cannot run {str(plain)!r}: Permission denied\n"))
    assert os.listdir(registry / str(os.geteuid())) == []
    assert cli("run", "--", str(registry.parent)) == (126, "", SUMMARY + (
        f"autogpu: error: cannot run {str(registry.parent)!r}: Permission denied\n"))
    assert os.listdir(registry / str(os.geteuid())) == []


def _nan_utilisation_on_gpu_a(results: dict[str, list[dict[str, Any]]]) -> None:
    """A recording edit: gpu-a's GPU 0 reports its utilisation as NaN (a sample skipped)."""
    from tests.unit.test_cluster import AUTOGPU_Q

    (sample,) = [r for r in results[AUTOGPU_Q]
                 if r["metric"]["__name__"] == "autogpu_gpu_utilization_ratio"
                 and r["metric"]["uuid"] == "GPU-aaaa0000-0000-0000-0000-000000000000"]
    sample["value"][1] = "NaN"


def test_hosts_names_its_source_and_ask_then_each_host_and_a_down_ones_reason(
    registry: Path,
) -> None:
    """``autogpu hosts``: a header (how many hosts, which Prometheus, what was asked), one line
    per host (the devices it would pick, "nothing fits", or why it is not up); it exits 0 when
    the first host fits, even if the second does not. Caught: the header replaced by ``None``;
    a down host's line replaced by ``None``, its reason by an empty text (or a crash); the exit
    code read from the second host."""
    with recorded_prometheus("gpu-a-down") as url:
        assert cli("hosts", "--prometheus", url, "--min-free", "39G") == (0, (
            f"4 host(s) from {url}; for min free 39.0 GiB:\n"
            "  1. gpu-c                ok    GPU 1 NVIDIA H100 80GB HBM3 (40.0 GiB free, util 0%)\n"
            "  2. dgx-d                ok    nothing fits\n"
            "  3. gpu-b                ok    nothing fits\n"
            "  4. gpu-a                down  exporter down (up == 0)\n"), "")
        assert cli("hosts", "--prometheus", url, "--min-free", "39G", "--best") == (
            0, "gpu-c\n", "")


def test_hosts_json_gives_the_source_time_ask_best_hosts_and_errors(registry: Path) -> None:
    """``hosts --json``: the Prometheus asked, when, the constraints, the best host (the first,
    when it fits: the second need not), every host, and the view's errors, in that order,
    indented by two; exit 0. Caught: a key misspelt or upper-cased; the best host or the exit
    code read from the second host; the indent dropped or made 3."""
    with recorded_prometheus("all-up", edit=_nan_utilisation_on_gpu_a) as url:
        code, out, err = cli("hosts", "--prometheus", url, "--min-free", "39G", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert out == json.dumps(data, indent=2) + "\n"
    assert list(data) == ["prometheus_url", "timestamp_s", "constraints", "best", "hosts",
                          "errors"]
    assert (data["prometheus_url"], data["best"]) == (url, "gpu-c")
    assert isinstance(data["timestamp_s"], float)
    assert data["constraints"] == {
        "min_free": {"bytes": 39 * GiB, "fraction": None, "text": "39G"}, "max_util_pct": None,
        "count": 1, "exclude": [], "exclusive": False, "models": [], "prefer": [], "devices": []}
    assert [(h["hostname"], h["fits"]) for h in data["hosts"]] == [
        ("gpu-c", True), ("dgx-d", False), ("gpu-a", False), ("gpu-b", False)]
    assert data["errors"] == [
        "gpu-a: 1 sample(s) skipped, not finite numbers (e.g. autogpu_gpu_utilization_ratio = "
        "NaN)"]


def test_hosts_lists_several_devices_of_a_host_and_then_the_views_errors(
    registry: Path,
) -> None:
    """With ``--count 2`` a host's line names both devices, separated by ", "; after the hosts,
    each error of the view is one "note:" line. Caught: the devices joined by other text; the
    error lines replaced by ``None``."""
    with recorded_prometheus("all-up", edit=_nan_utilisation_on_gpu_a) as url:
        code, out, err = cli("hosts", "--prometheus", url, "--count", "2")
    assert (code, err) == (0, "")
    assert out.splitlines()[1:] == [
        "  1. gpu-b                ok    GPU 2 NVIDIA L4 (22.0 GiB free, util 30%), GPU 0 NVIDIA "
        "L4 (20.0 GiB free, util 50%)",
        "  2. gpu-c                ok    GPU 1 NVIDIA H100 80GB HBM3 (40.0 GiB free, util 0%), "
        "GPU 0 NVIDIA H100 80GB HBM3 (40.0 GiB free, util 20%)",
        "  3. gpu-a                ok    GPU 0 NVIDIA A100-SXM4-80GB (20.0 GiB free, util ?), "
        "GPU 1 NVIDIA A100-SXM4-80GB (5.0 GiB free, util 10%)",
        "  4. dgx-d                ok    nothing fits",
        "note: gpu-a: 1 sample(s) skipped, not finite numbers (e.g. "
        "autogpu_gpu_utilization_ratio = NaN)",
    ]


def test_hosts_takes_the_configured_pick_defaults_under_its_own_flags(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$AUTOGPU_MIN_FREE`` (the settings' min_free) is the default of ``hosts --min-free``;
    the flag wins over it. Caught: the settings' defaults dropped, or only those hosts cannot
    rank by kept."""
    monkeypatch.setenv("AUTOGPU_MIN_FREE", "39G")
    with recorded_prometheus("all-up") as url:
        assert cli("hosts", "--prometheus", url, "--best") == (0, "gpu-c\n", "")
        assert cli("hosts", "--prometheus", url, "--best", "--min-free", "10G") == (
            0, "gpu-b\n", "")
        code, out, _err = cli("hosts", "--prometheus", url)
    assert (code, out.splitlines()[0]) == (0, f"4 host(s) from {url}; for min free 39.0 GiB:")


def test_hosts_asks_prometheus_with_the_settings_timeout(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request to Prometheus may take ``prometheus_timeout_s`` (5 s), never forever.
    Caught: the timeout handed over as ``None`` (urllib's "wait forever")."""
    clients: list[Any] = []
    real = cli_mod.PrometheusClient

    def client(*args: Any, **kwargs: Any) -> Any:
        clients.append(real(*args, **kwargs))
        return clients[-1]

    monkeypatch.setattr(cli_mod, "PrometheusClient", client)
    with recorded_prometheus("all-up") as url:
        assert cli("hosts", "--prometheus", url, "--best")[:2] == (0, "gpu-b\n")
    assert [(c.url, c.timeout_s) for c in clients] == [(url, 5.0)]


def test_run_of_a_command_the_system_refuses_without_a_reason_names_the_error_kind(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError that carries no text (``strerror`` None: raised bare by a wrapper or a
    sandbox) still gives one line naming the command and the kind of error, exit 126, and no
    lease left behind. Caught: the kind of ``None`` (``NoneType``) named instead of the
    error's."""

    def refuse(*_a: object, **_k: object) -> None:
        raise OSError

    monkeypatch.setattr(cli_mod, "subprocess", types.SimpleNamespace(Popen=refuse))
    assert cli("run", "--", "train") == (126, "", SUMMARY + (
        "autogpu: error: cannot run 'train': OSError\n"))
    assert os.listdir(registry / str(os.geteuid())) == []
