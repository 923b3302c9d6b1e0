"""Shared-host safety in one process and through the CLI: what needs no second user.

* the writer only reports a lease that its readers accept: a short write on a nearly full disk
  (reproduced with ``RLIMIT_FSIZE``, which cuts a write exactly as ENOSPC does) is refused;
* a registry lock held by another process costs a timed-out pick no thread and no descriptor;
* ``autogpu`` reads ``--min-free -5G`` and ``--max-util ''`` as the bad values they are, and
  ``autogpu leases | head`` ends quietly;
* a property test (hypothesis) of the registry reader: any bytes in any file or directory name
  and any record contents never raise out of a scan, never hide a lease our writer wrote, and our
  writer never reports a lease that readers reject, whatever the holder's fields hold.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import LeaseStoreError, LeaseStoreUntrustedError
from tests.leasehelpers import fleet, uuid_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fleet_path(tmp_path: Path) -> str:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(2)))
    return str(path)


@pytest.fixture
def backend(fleet_path: str) -> SimulatedBackend:
    return SimulatedBackend(fleet_path)


def _in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child (for process-wide limits); its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            out = json.dumps(fn(*args)).encode()
            os.write(w, out)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def _pick_on_a_full_disk(reg: str, fleet_path: str, exclusive: bool) -> dict[str, Any]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    registry = DirectoryStore(reg)
    registry.check()
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    holder = Requester(notebook_path="n" * 4000 + ".ipynb")  # a record of about 4.3 KB
    try:
        result = pick(
            PickOptions(Constraints(exclusive=exclusive)),
            backend=SimulatedBackend(fleet_path),
            store=registry,
            requester=holder,
        )
    except LeaseStoreUntrustedError as err:
        return {"error": str(err)}
    return {"lease": result.lease is not None, "note": result.lease_note}


def test_a_short_write_is_no_lease(tmp_path: Path, fleet_path: str) -> None:
    """Item 3c: the 4.3 KB record was cut to 4096 bytes and the pick said "lease held"."""
    reg = tmp_path / "registry"
    plain = _in_child(_pick_on_a_full_disk, str(reg), fleet_path, False)
    assert plain == {
        "lease": False,
        "note": f"cannot write lease {reg}/{os.geteuid()}/" + plain["note"].split("/")[-1],
    }
    assert plain["note"].endswith(": File too large: picked without a lease")
    exclusive = _in_child(_pick_on_a_full_disk, str(reg), fleet_path, True)
    assert exclusive["error"].startswith(
        "refused an exclusive pick (--exclusive) without a lease: cannot write lease "
    )
    scan = DirectoryStore(reg).scan()
    assert (scan.live, scan.dead, scan.ignored) == ([], [], [])
    assert os.listdir(reg / str(os.geteuid())) == []  # no partial record, no temp file


def test_a_stuck_registry_lock_leaks_no_thread_and_no_fd(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    """Item 4a: every timed-out attempt left a thread blocked in flock() and its descriptor."""
    import fcntl

    reg = tmp_path / "registry"
    registry = DirectoryStore(reg, lock_timeout_s=0.05)
    registry.check()
    blocker = os.open(reg, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(blocker, fcntl.LOCK_EX)
    try:
        pick(PickOptions(Constraints()), backend=backend, store=registry)  # warm imports and caches
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            result = pick(PickOptions(Constraints()), backend=backend, store=registry)
            assert result.lease is None and "stayed locked" in (result.lease_note or "")
            with pytest.raises(LeaseStoreUntrustedError):
                pick(PickOptions(Constraints(exclusive=True)), backend=backend, store=registry)
        assert threading.active_count() == threads
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        os.close(blocker)


def _cli(env: dict[str, str], *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        **kw,
    )


@pytest.fixture
def cli_env(tmp_path: Path, fleet_path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
    env.update(
        AUTOGPU_SIMULATE=fleet_path,
        AUTOGPU_REGISTRY_DIR=str(tmp_path / "registry"),
        PYTHONPATH=str(REPO),
    )
    return env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-free", "-5G"], "autogpu: invalid size '-5G': must not be negative; expected"),
        (["--max-util", ""], "autogpu: invalid --max-util '': empty; expected a number from 0"),
        (["--wait", ""], "autogpu: invalid --wait '': empty; expected seconds"),
        (["--min-free", "9" * 400 + "G"], f"autogpu: invalid size '{'9' * 39}…99999999G': too"),
        (["--wait", "9" * 400 + "h"], f"autogpu: invalid duration '{'9' * 39}…99999999h': too"),
    ],
)
def test_bad_values_name_themselves(cli_env: dict[str, str], args: list[str], message: str) -> None:
    """Item 12 (and 7): argparse said "expected one argument"; '' meant "no limit"."""
    for command in (["pick", *args], ["run", *args, "--", "true"]):
        out = _cli(cli_env, *command)
        assert out.returncode == 2, out
        assert out.stderr.startswith(message), out.stderr
        assert out.stderr.count("\n") == 1  # one line, no usage block, no traceback


def test_leases_into_a_closed_pipe_ends_quietly(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Item 12: ``autogpu leases | head -1`` ended with a BrokenPipeError traceback."""
    registry = DirectoryStore(tmp_path / "registry")
    held = []
    for i in range(400):
        with registry.locked() as txn:
            assert txn is not None
            held.append(
                txn.create(
                    devices=[uuid_of(i % 2)],
                    requester=Requester(notebook_path=f"project/{'deep/' * 20}notebook-{i}.ipynb"),
                )
            )
    try:
        proc = subprocess.run(
            f"{sys.executable} -m autogpu_jupyter.cli leases | head -1",
            shell=True,
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.stdout.count("\n") == 1 and "notebook-" in proc.stdout
        assert proc.stderr == ""
    finally:
        for lease in held:
            lease.release()


# ---- the property test of the registry reader and writer --------------------------------------

_names = st.binary(min_size=1, max_size=40).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b"..")
)
_junk = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(
            st.sampled_from(
                [
                    "version",
                    "kind",
                    "lease_id",
                    "device_uuids",
                    "uid",
                    "user",
                    "seq",
                    "pid",
                    "created_s",
                    "notebook_path",
                    "exclusive",
                    "x",
                ]
            ),
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(),
                st.floats(allow_nan=False),
                st.text(max_size=20),
                st.lists(st.text(max_size=8), max_size=3),
            ),
            max_size=12,
        ),
    ),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    top_names=st.lists(_names, max_size=4),
    user_entries=st.lists(st.tuples(_names, _junk), max_size=6),
    notebook=st.one_of(st.none(), st.text(max_size=5000)),
    kernel=st.one_of(st.none(), st.text(max_size=200)),
)
def test_registry_reader_and_writer_agree_whatever_the_registry_holds(
    tmp_path_factory: pytest.TempPathFactory,
    top_names: list[bytes],
    user_entries: list[tuple[bytes, bytes]],
    notebook: str | None,
    kernel: str | None,
) -> None:
    reg = tmp_path_factory.mktemp("fuzz") / "registry"
    registry = DirectoryStore(reg)
    registry.check()
    top = os.fsencode(reg)
    mine = top + b"/" + str(os.geteuid()).encode()
    os.makedirs(mine, mode=0o755, exist_ok=True)
    for name in top_names:
        path = top + b"/" + name
        if not os.path.lexists(path):
            os.mkdir(path, 0o755)
    for name, data in user_entries:
        path = mine + b"/" + name
        if not os.path.lexists(path):
            with open(path, "wb") as f:
                f.write(data)
    holder = Requester(notebook_path=notebook, kernel_id=kernel, kind="kernel")
    try:
        with registry.locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[uuid_of(0)], requested_bytes=1024, requester=holder)
    except LeaseStoreError as err:  # refused at the writer: never reported held
        assert "readers would reject it" in str(err) or "too large" in str(err)
        lease = None
    scan = registry.scan()  # never raises, whatever the names and contents
    for path, why in scan.ignored:
        path.encode("utf-8")  # printable: no lone surrogates reach a message
        why.encode("utf-8")
    if lease is not None:
        live = [r for r in scan.live if r.lease_id == lease.record.lease_id]
        assert len(live) == 1, (scan.ignored, lease)
        assert live[0].notebook_path == lease.record.notebook_path
        lease.release()


def test_a_rejected_file_fixed_in_place_is_read_again(tmp_path: Path) -> None:
    """Rejected entries nobody holds are remembered (junk costs a look-up per scan); a held file
    that fails is read again every scan, so one fixed in place (a lease rewritten while a scan
    read it half-written) counts as soon as it is whole."""
    import fcntl
    import secrets
    import time as _time

    registry = DirectoryStore(tmp_path / "registry")
    registry.check()
    d = tmp_path / "registry" / str(os.geteuid())
    d.mkdir(mode=0o755)
    lease_id = secrets.token_hex(16)
    good = json.dumps({
        "version": 1, "kind": "lease", "lease_id": lease_id, "device_uuids": [uuid_of(0)],
        "device_requested_bytes": [None], "exclusive": False, "user": registry.user,
        "uid": os.geteuid(), "host": "h", "pid": os.getpid(), "created_s": 1.0,
        "kernel_id": None, "notebook_path": None, "command": None, "holder_kind": "process",
    }).encode()
    fd = os.open(d / f"{lease_id}.lease", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.write(fd, b"x" * len(good))  # same size as the good record, not JSON
        assert registry.scan().ignored[0][1].startswith("malformed: not valid JSON")
        assert registry.scan().ignored[0][1].startswith("malformed: not valid JSON")  # cached
        _time.sleep(0.01)
        os.pwrite(fd, good, 0)
        (rec,) = registry.scan().live
        assert rec.lease_id == lease_id
    finally:
        os.close(fd)
