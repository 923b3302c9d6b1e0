"""Helpers for the broker tests: the broker as a real process, and a shared area its users read.

The broker runs as root (``python -m autogpu_jupyter.cli broker``) on a socket under a fresh
directory in ``/var/tmp`` (other users must reach it: ``/tmp`` of pytest is under a 0700 dir);
its journal lives in a root-only state directory beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL
from tests.leasehelpers import cli_as, fleet

REPO = Path(__file__).resolve().parent.parent


class BrokerProc:
    """``autogpu broker`` as a real root process; ``restart()`` keeps its state directory."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None,
                 preexec: Any = None) -> None:
        self.root = root
        self.preexec = preexec
        self.socket = root / "run" / "broker.sock"
        self.state = root / "state"
        self.args = list(args)
        self.env = dict(env or {})
        self.log = root / "broker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
        env.update(self.env)
        env["PYTHONPATH"] = str(REPO)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--foreground",
                 "--socket", str(self.socket), "--state-dir", str(self.state), *self.args],
                stdout=log, stderr=log, env=env, cwd=str(REPO), preexec_fn=self.preexec,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"broker exited: {self.log.read_text()[-2000:]}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("broker did not start listening")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(10)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        self.kill(sig)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)

    def status(self) -> dict[str, Any]:
        """``autogpu broker status --json`` as root."""
        out = subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "status", "--json",
             "--socket", str(self.socket)],
            capture_output=True, text=True, check=True, cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        data: dict[str, Any] = json.loads(out.stdout)
        return data

    def wait_for(self, pred: Any, timeout: float = 15.0) -> dict[str, Any]:
        """Poll ``status()`` until ``pred(status)`` holds; the status that satisfied it."""
        deadline = time.monotonic() + timeout
        st = self.status()
        while not pred(st):
            if time.monotonic() > deadline:
                raise AssertionError(f"broker status never matched: {json.dumps(st)[:3000]}")
            time.sleep(0.1)
            st = self.status()
        return st


class Area:
    """A directory every test user reads: the fleet file, the broker's socket, a registry
    directory that the broker mode must leave untouched."""

    def __init__(self, root: Path, n_gpus: int = 4) -> None:
        self.root = root
        self.fleet = root / "fleet.json"
        self.registry = root / "registry"
        (root / "run").mkdir(mode=0o755, exist_ok=True)
        os.chmod(root / "run", 0o755)
        self.write_fleet(fleet(n_gpus))

    def write_fleet(self, spec: dict[str, Any]) -> None:
        tmp = self.root / "fleet.tmp"
        tmp.write_text(json.dumps(spec))
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.fleet)

    @property
    def socket(self) -> Path:
        return self.root / "run" / "broker.sock"

    def env(self, **extra: str) -> dict[str, str]:
        site = sysconfig.get_paths()["purelib"]
        return {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{site}:{REPO}",
            "AUTOGPU_SIMULATE": str(self.fleet),
            "AUTOGPU_REGISTRY_DIR": str(self.registry),
            "AUTOGPU_BROKER_SOCKET": str(self.socket),
            **extra,
        }

    def cli(self, user: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return cli_as(user, self.env(**extra), *args)

    def run_held(self, user: str, *args: str, **extra: str) -> subprocess.Popen[str]:
        """``autogpu ARGS`` as ``user``, left running (its own session, to kill it whole)."""
        from tests.leasehelpers import SYSTEM_PYTHON

        env = self.env(**extra)
        return subprocess.Popen(
            ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
             SYSTEM_PYTHON, "-m", "autogpu_jupyter.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )


def wire(msg: dict[str, Any]) -> bytes:
    """One request line as a current client sends it (with the protocol version)."""
    return json.dumps({"proto": PROTOCOL, **msg}).encode() + b"\n"


class RawConn:
    """One raw connection to a broker: send lines, read reply lines (``None`` at EOF)."""

    def __init__(self, path: str | Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.timeout = timeout
        self._buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, msg: dict[str, Any]) -> Any:
        """Send ``msg`` (with the protocol version); the next line back, decoded."""
        self.send(wire(msg))
        return self.read()

    def read_raw(self, timeout: float | None = None) -> bytes:
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        while b"\n" not in self._buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return b""
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def read(self, timeout: float | None = None) -> Any:
        try:
            line = self.read_raw(timeout)
        except ConnectionResetError:
            return None
        return json.loads(line) if line else None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def broker_area(n_gpus: int = 4) -> Iterator[Path]:
    """A directory other uids can reach (``/var/tmp``, not pytest's 0700 one) with a fleet
    file and a root-only ``run/`` for the socket; removed afterwards."""
    root = Path(f"/var/tmp/autogpu-broker-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / "run").mkdir(mode=0o755)
    os.chmod(root / "run", 0o755)
    spec = root / "fleet.json"
    spec.write_text(json.dumps(fleet(n_gpus)))
    os.chmod(spec, 0o644)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SubuidAgent:
    """tests/subuid_agent.py run by ``user`` inside ``unshare --map-auto --map-root-user``:
    ``uids`` children acting as the user's subordinate uids (see that script)."""

    def __init__(self, user: str, socket_path: str | Path, uids: int, action: str,
                 *args: str) -> None:
        from tests.leasehelpers import SYSTEM_PYTHON

        self.uids = uids
        self.proc = subprocess.Popen(
            ["runuser", "-u", user, "--", "unshare", "--map-auto", "--map-root-user",
             SYSTEM_PYTHON, str(REPO / "tests" / "subuid_agent.py"), str(socket_path),
             str(uids), action, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self._buf = b""

    def results(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """One result per subordinate uid (``{"uid": n, "result": ...}``), as they come."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # raw reads: a buffered line would hide from select
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(out) < self.uids:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                out.append(json.loads(line))
            if len(out) >= self.uids:
                break
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"the agent gave {len(out)} of {self.uids} results")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the agent ended early: {err[-2000:]}")
            self._buf += chunk
        return out

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def raw_call(path: str, *lines: bytes, timeout: float = 10.0) -> list[Any]:
    """Send raw lines on one connection, each after the reply to the one before; every reply
    (decoded JSON), then ``"closed"`` if the broker closed the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        replies: list[Any] = []
        buf = b""
        closed = False
        for line in lines:
            try:
                s.sendall(line)
            except OSError:
                break
            buf, closed = _read_reply(s, buf, replies)
            if closed:
                break
        s.settimeout(0.5)
        while not closed:
            seen = len(replies)
            buf, closed = _read_reply(s, buf, replies)
            if len(replies) == seen:
                break
        return replies + (["closed"] if closed else [])


def _read_reply(s: socket.socket, buf: bytes, replies: list[Any]) -> tuple[bytes, bool]:
    """Read one reply line into ``replies``; (rest of the buffer, whether the peer closed)."""
    try:
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return buf, True
            buf += chunk
    except TimeoutError:
        return buf, False
    except OSError:
        return buf, True
    one, _, buf = buf.partition(b"\n")
    replies.append(json.loads(one))
    return buf, False


def _subid_ranges() -> list[tuple[str, int, int]]:
    """Every ``name:first:count`` line of ``/etc/subuid`` and ``/etc/subgid``."""
    return _ranges_of("/etc/subuid") + _ranges_of("/etc/subgid")


def free_subid_first(count: int = 65536, above: int = 200000) -> int:
    """The first id of ``count`` ids from ``above`` on that no line of ``/etc/subuid`` or
    ``/etc/subgid`` covers and no passwd user or group has: a shared host's files hold other
    people's ranges (a fixed first id may be someone's already)."""
    import grp
    import pwd

    taken = [(first, first + n - 1) for _name, first, n in _subid_ranges()]
    taken += [(p.pw_uid, p.pw_uid) for p in pwd.getpwall()]
    taken += [(g.gr_gid, g.gr_gid) for g in grp.getgrall()]
    first = above
    while True:
        last = first + count - 1
        clash = [hi for lo, hi in taken if lo <= last and hi >= first]
        if not clash:
            return first
        first = max(clash) + 1


def ensure_subids(user: str, count: int = 65536) -> tuple[int, int]:
    """Give ``user`` subordinate uids and gids (one free range, the same numbers in both
    files) unless they have ranges already; (first, count) of their ``/etc/subgid`` range."""
    mine = {path: [(f, n) for name, f, n in _ranges_of(path) if name == user]
            for path in ("/etc/subuid", "/etc/subgid")}
    if not mine["/etc/subuid"] or not mine["/etc/subgid"]:
        first = free_subid_first(count)
        for path, flag in (("/etc/subuid", "--add-subuids"), ("/etc/subgid", "--add-subgids")):
            if not mine[path]:
                subprocess.run(["usermod", flag, f"{first}-{first + count - 1}", user],
                               check=True, capture_output=True)
        mine["/etc/subgid"] = [(f, n) for name, f, n in _ranges_of("/etc/subgid")
                               if name == user]
    return mine["/etc/subgid"][0]


def _ranges_of(path: str) -> list[tuple[str, int, int]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for ln in Path(path).read_text().splitlines():
            parts = ln.strip().split(":")
            if len(parts) == 3 and parts[1].isdecimal() and parts[2].isdecimal():
                out.append((parts[0], int(parts[1]), int(parts[2])))
    return out
