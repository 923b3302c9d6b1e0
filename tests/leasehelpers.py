"""Helpers for the lease tests: fleets, a start gate, and a picker process.

Run as a script, this is one real picker process (what a kernel does when it runs ``%gpu pick``)::

    python tests/leasehelpers.py --registry DIR | --broker SOCKET [--gate FILE] [--exclusive]
        [--min-free 10G] [--wait 30] [--poll 0.5] [--hold] [--kernel-id ID] [--max-tickets N]

It prints one JSON line per event on stdout: ``{"event": "ready"}`` once imported (then it
blocks on the gate, a shared ``flock`` the test holds exclusively: releasing it lets every
picker go at the same instant), ``{"event": "waiting"}`` when it joined the waiting line,
``{"event": "picked", ...}`` or ``{"event": "error", ...}``. With ``--hold`` it keeps its lease
until its stdin closes (the test ends it), like a kernel that keeps running.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3


def fleet(n: int, total: str = "80G", used_bytes: int = 0) -> dict[str, Any]:
    """``n`` identical idle GPUs, in the fleet file format (simulated backend and fake NVML)."""
    return {
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}",
                "name": "NVIDIA A100-SXM4-80GB",
                "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
                "memory_total": total,
                "memory_used": used_bytes,
                "utilization_pct": 0,
                "processes": [],
            }
            for i in range(n)
        ],
    }


def forget_backends() -> None:
    """Forget the backends this process keeps (one per fleet name, one per vendor library).

    A reasoned private seam: a real process reads a fleet file or opens the vendor library
    once, under its name, and a change of fleet means a new process (a new kernel, a new
    ``autogpu`` run). A test that rewrites a fleet under the same name, or switches vendor, in
    this process needs the same fresh start, and no public input gives it; this is the one
    place the tests reach into the backends' cache.
    """
    from autogpu_jupyter.core import backends

    backends._cache.clear()


def uuid_of(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


class Gate:
    """A start gate for processes: they block on ``LOCK_SH`` while the test holds ``LOCK_EX``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def open(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


class Picker:
    """One picker process (``python tests/leasehelpers.py ...``) and its JSON events."""

    def __init__(self, args: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            cwd=str(ROOT),
        )
        self.events: list[dict[str, Any]] = []

    def next_event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"picker {self.proc.pid} ended without an event: {err[-2000:]}")
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    def expect(self, name: str) -> dict[str, Any]:
        event = self.next_event()
        assert event["event"] == name, event
        return event

    def result(self) -> dict[str, Any]:
        """The pick's outcome event (``picked`` or ``error``)."""
        while True:
            event = self.next_event()
            if event["event"] in ("picked", "error"):
                return event

    def finish(self, timeout: float = 30) -> int:
        """Let a holding picker exit (closing its stdin ends its lease) and reap it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        rc = self.proc.wait(timeout)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return rc


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
    env.update(extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_pickers(n: int, args: Sequence[str], env: dict[str, str]) -> list[Picker]:
    pickers = [Picker(args, env) for _ in range(n)]
    for p in pickers:
        p.expect("ready")
    return pickers


def finish_all(pickers: Sequence[Picker]) -> None:
    for p in pickers:
        if p.proc.poll() is None and p.proc.stdin is not None:
            p.proc.stdin.close()
    for p in pickers:
        p.finish()


def lease_files(registry: Path) -> Iterator[Path]:
    yield from sorted(registry.glob("*/*.lease"))


# ----------------------------------------------------------------------------------------------
# The picker process


def _emit(out: IO[str], **event: Any) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry")
    ap.add_argument("--broker", help="lease through the broker on this socket instead")
    ap.add_argument("--gate")
    ap.add_argument("--exclusive", action="store_true")
    ap.add_argument("--min-free")
    ap.add_argument("--wait", type=float, default=0.0)
    ap.add_argument("--poll", type=float)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--kernel-id")
    ap.add_argument("--max-tickets", type=int, default=2, help="the registry's tickets per user")
    a = ap.parse_args(argv)

    from autogpu_jupyter.core import picker
    from autogpu_jupyter.core.leasing import DirectoryStore
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.errors import AutoGPUError

    if a.poll is not None:
        picker.POLL_INTERVAL_S = a.poll
    out = sys.stdout
    registry: Any
    if a.broker:
        from autogpu_jupyter.core.leasing.brokerclient import BrokerStore

        registry = BrokerStore(a.broker, lock_timeout_s=60.0)
    else:
        registry = DirectoryStore(a.registry, max_tickets_per_user=a.max_tickets)
    constraints = Constraints.parse(min_free=a.min_free, exclusive=a.exclusive)
    _emit(out, event="ready", pid=os.getpid())
    if a.gate:
        fd = os.open(a.gate, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # blocks until the test opens the gate
        os.close(fd)
    waiting = []

    def progress(msg: str) -> None:
        if not waiting:
            waiting.append(msg)
            _emit(out, event="waiting", message=msg)

    start = time.perf_counter()
    try:
        result = picker.pick(
            PickOptions(constraints, a.wait),
            store=registry,
            requester=picker.Requester(
                kernel_id=a.kernel_id, kind="kernel" if a.kernel_id else "cli"
            ),
            on_progress=progress,
        )
    except AutoGPUError as err:
        _emit(out, event="error", type=type(err).__name__, message=str(err))
        return 0
    latency = time.perf_counter() - start
    _emit(
        out,
        event="picked",
        uuid=result.chosen[0].uuid,
        uuids=[d.uuid for d in result.chosen],
        lease_id=None if result.lease is None else result.lease.record.lease_id,
        lease_path=None if result.lease is None else result.lease.path,
        lease_note=result.lease_note,
        latency_s=latency,
    )
    if a.hold:
        sys.stdin.read()  # until the test closes our stdin (or kills us)
    if result.lease is not None:
        result.lease.release()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())


# ----------------------------------------------------------------------------------------------
# Where the pickers read their GPUs from


class FleetEnv:
    """A fleet the picker processes read: the fake ``libnvidia-ml.so.1`` when the ``fake_nvml``
    fixture and the NVML backend exist, else the simulated backend (``AUTOGPU_SIMULATE``)."""

    def __init__(self, tmp_path: Path, fake_nvml: Any = None) -> None:
        self.fake = fake_nvml
        self.kind = "fake-nvml" if fake_nvml is not None else "simulated"
        self._file = tmp_path / "fleet.json"

    def write(self, spec: dict[str, Any]) -> None:
        if self.fake is not None:
            self.fake.write(spec)
        else:
            tmp = self._file.with_suffix(".tmp")
            tmp.write_text(json.dumps(spec))
            os.replace(tmp, self._file)

    @property
    def env(self) -> dict[str, str]:
        if self.fake is not None:
            return child_env(dict(self.fake.env))
        return child_env({"AUTOGPU_SIMULATE": str(self._file)})

    def backend(self) -> Any:
        """A backend for in-process picks (a fresh one: the process-wide cache is not used)."""
        if self.fake is not None:
            from autogpu_jupyter.core.backends.nvml import NvmlBackend

            return NvmlBackend()
        from autogpu_jupyter.core.backends.simulated import SimulatedBackend

        return SimulatedBackend(str(self._file))


# ----------------------------------------------------------------------------------------------
# Real Unix users (the tests run as root: CI does)


def ensure_user(name: str) -> tuple[int, int]:
    """Create system user ``name`` (no home, no login shell) unless it exists; (uid, gid)."""
    import pwd

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             "--user-group", name],
            check=True, capture_output=True,
        )
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


class AsUser:
    """Run ``fn(*args)`` in a forked child that dropped to ``uid``/``gid`` (setgroups, setgid,
    setuid: a real other user, not root with a different name).

    Forking (not ``runuser python ...``) because the interpreter of this venv lives under
    ``/root`` (mode 0700), which another user cannot execute; the forked child already has
    every module it needs loaded. ``result()`` is ``fn``'s return value, or ``("raised", type
    name, message)``. With ``hold=True`` the child stays alive (holding what ``fn`` returned,
    e.g. a lease) until ``stop()``.
    """

    #: The control pipes of children still holding: a later child must not inherit them, or the
    #: earlier child would never see its pipe close (and never exit).
    _held_ctl: ClassVar[set[int]] = set()

    def __init__(self, uid: int, gid: int, fn: Any, *args: Any, hold: bool = False) -> None:
        import pickle

        r_out, w_out = os.pipe()
        r_ctl, w_ctl = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 0
            try:
                for fd in AsUser._held_ctl:
                    os.close(fd)
                os.close(r_out)
                os.close(w_ctl)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                value = None
                try:
                    value = fn(*args)
                    out: Any = _summary(value)
                except Exception as err:
                    out = ("raised", type(err).__name__, str(err))
                payload = pickle.dumps(out)
                os.write(w_out, len(payload).to_bytes(8, "big") + payload)
                os.close(w_out)
                if hold:
                    while os.read(r_ctl, 1):
                        pass
                del value
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w_out)
        os.close(r_ctl)
        AsUser._held_ctl.add(w_ctl)
        self.pid = pid
        self._r = r_out
        self._ctl = w_ctl
        self._result: Any = None
        self._have = False

    def result(self) -> Any:
        import pickle

        if not self._have:
            head = _read_exact(self._r, 8)
            self._result = pickle.loads(_read_exact(self._r, int.from_bytes(head, "big")))
            self._have = True
        return self._result

    def stop(self) -> int:
        self.result()
        AsUser._held_ctl.discard(self._ctl)
        os.close(self._ctl)
        os.close(self._r)
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


def _summary(value: Any) -> Any:
    """What crosses back from a user's child: a pick result or lease as a plain dict."""
    if hasattr(value, "chosen") and hasattr(value, "lease_note"):  # a PickResult
        lease = value.lease
        return {
            "uuid": value.chosen[0].uuid,
            "lease_id": None if lease is None else lease.record.lease_id,
            "path": None if lease is None else lease.path,
            "lease_note": value.lease_note,
        }
    rec = getattr(value, "record", None)
    if rec is not None:
        return {"lease_id": rec.lease_id, "path": rec.path}
    return value


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise AssertionError("the child ended without a result")
        buf += chunk
    return buf


def as_user(uid: int, gid: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` run as ``uid``; its (picklable) return value."""
    child = AsUser(uid, gid, fn, *args)
    value = child.result()
    child.stop()
    return value


# ---- several users' processes on one host (servers, kernels, the CLI) -------------------------

#: Other users cannot execute the venv's interpreter (it links into root's pyenv, under a 0700
#: /root); Debian's python3 has the same ABI, so their processes run it with the venv's
#: site-packages on PYTHONPATH.
SYSTEM_PYTHON = "/usr/bin/python3"


def system_python_problem() -> str | None:
    """Why SYSTEM_PYTHON cannot stand in for this venv's interpreter, or ``None``."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} missing"
    out = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True, check=False).stdout.strip()
    if out != str(tuple(sys.version_info[:2])):
        return f"{SYSTEM_PYTHON} is {out}, not this venv's {sys.version_info[:2]} (ABI differs)"
    return None


@contextlib.contextmanager
def shared_area(prefix: str) -> Iterator[Path]:
    """A directory every test user can read, with a registry made as docs/jupyterhub.md says
    (``install -d -m 1777``); removed afterwards. Skips when SYSTEM_PYTHON cannot be used."""
    import pytest

    why = system_python_problem()
    if why:
        pytest.skip(why)
    root = Path(f"/var/tmp/{prefix}-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    reg = root / "registry"
    reg.mkdir()
    os.chmod(reg, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cli_as(user: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``autogpu ARGS`` run as ``user`` with exactly ``env``."""
    return subprocess.run(
        ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
         SYSTEM_PYTHON, "-m", "autogpu_jupyter.cli", *args],
        capture_output=True, text=True, check=False, timeout=60,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
