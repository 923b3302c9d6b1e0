"""Helpers for the broker tests: the broker as a real process, and a shared area its users read.

The broker runs as root (``python -m autogpu_jupyter.cli broker``) on a socket under a fresh
directory in ``/var/tmp`` (other users must reach it: ``/tmp`` of pytest is under a 0700 dir);
its journal lives in a root-only state directory beside it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from tests.leasehelpers import cli_as, fleet

REPO = Path(__file__).resolve().parent.parent


class BrokerProc:
    """``autogpu broker`` as a real root process; ``restart()`` keeps its state directory."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.root = root
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
                stdout=log, stderr=log, env=env, cwd=str(REPO),
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
