"""Two REAL Unix users, each running a Jupyter server, start autogpu kernels at the same time.

As on a single multi-GPU host (docs/jupyterhub.md, case a): one shared registry under ``/var/tmp``
(root-owned, mode 1777), one kernelspec with the provisioner, the fake ``libnvidia-ml.so.1``
showing four GPUs. The kernels ask for ``exclusive``: four kernels get four different GPUs, the
fifth starts CPU-only with a note, and each user's ``autogpu leases`` / ``/autogpu/holders`` shows
the other's holders without command lines.

Why ``/usr/bin/python3``: the venv's interpreter is a symlink into ``/root/.pyenv`` and ``/root``
is mode 0700, so other users cannot execute it. Debian's ``/usr/bin/python3`` is the same 3.11
ABI, so the servers and kernels run it with the venv's ``site-packages`` on ``PYTHONPATH``; the fake
library is copied to a world-readable place (the build is mode 0711, which ``dlopen`` cannot map).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leases import Registry
from tests.fakenvml import FakeNvml
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import (
    SYSTEM_PYTHON,
    cli_as,
    ensure_user,
    fleet,
    free_port,
    shared_area,
    uuid_of,
)

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users (useradd) "
                       "and run their servers (runuser)"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

REPO = Path(__file__).resolve().parent.parent
USERS = ("agtest-alice", "agtest-bob")


class Server:
    """One user's ``jupyter server`` (token auth, own HOME) started with ``runuser``."""

    def __init__(self, user: str, area: Path, env: dict[str, str]) -> None:
        import pwd

        pw = pwd.getpwnam(user)
        self.user = user
        self.home = area / "home" / user
        self.home.mkdir(parents=True)
        (self.home / ".jupyter").mkdir()
        (self.home / ".jupyter" / "jupyter_server_config.json").write_text(json.dumps(
            {"ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}}}
        ))
        cfg = self.home / ".jupyter" / "jupyter_server_config.json"
        for p in (self.home, self.home / ".jupyter", cfg):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(self.home, 0o700)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        full = dict(env, HOME=str(self.home), USER=user, LOGNAME=user,
                    JUPYTER_CONFIG_DIR=str(self.home / ".jupyter"))
        args = [
            "runuser", "-u", user, "--", "env", "-i",
            *(f"{k}={v}" for k, v in full.items()),
            SYSTEM_PYTHON, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", "--ServerApp.open_browser=False",
            f"--ServerApp.root_dir={self.home}",
        ]
        self.log_path = area / f"{user}.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def url(self, *parts: str) -> str:
        return f"http://127.0.0.1:{self.port}/" + "/".join(parts)

    def request(self, method: str, *parts: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(*parts), data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except json.JSONDecodeError:
                return err.code, raw.decode(errors="replace")

    def wait_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.user}'s server exited:\n{self.log_path.read_text()}")
            try:
                if self.request("GET", "api", "status")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.user}'s server did not start:\n{self.log_path.read_text()}")

    def start_session(self, name: str) -> dict[str, Any]:
        code, body = self.request("POST", "api", "sessions", body={
            "path": f"{name}.ipynb", "type": "notebook", "name": "", "kernel": {"name": "agp"}})
        assert code == 201, (code, body)
        return dict(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            # A clean shutdown stops this user's kernels too (they run in their own sessions).
            try:
                self.request("POST", "api", "shutdown")
            except (urllib.error.URLError, ConnectionError):
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture
def area() -> Iterator[Path]:
    with shared_area("autogpu-mu") as root:
        yield root


def test_two_users_two_servers_share_four_gpus_without_double_booking(
    area: Path, fake_nvml_library: Path
) -> None:
    for u in USERS:
        ensure_user(u)
    # The fake driver, readable by everyone.
    libdir = area / "lib"
    libdir.mkdir()
    shutil.copy(fake_nvml_library, libdir / "libnvidia-ml.so.1")
    os.chmod(libdir / "libnvidia-ml.so.1", 0o755)
    fake = FakeNvml(area / "fake")
    fake.write(fleet(4))
    os.chmod(area / "fake", 0o755)
    os.chmod(fake.scenario_path, 0o644)
    # One kernelspec for the host, run by the system Python.
    prefix = area / "prefix"
    kernelspec.install("agp", "Python 3 (autogpu)", {"exclusive": True, "min_free": "10G"},
                       prefix=str(prefix), python=SYSTEM_PYTHON)
    for p in [prefix, *prefix.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    site = sysconfig.get_paths()["purelib"]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{site}:{REPO}",
        "LD_LIBRARY_PATH": str(libdir),
        "FAKE_NVML_SCENARIO": str(fake.scenario_path),
        "AUTOGPU_REGISTRY_DIR": str(area / "registry"),
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
    }
    servers = {u: Server(u, area, env) for u in USERS}
    try:
        for s in servers.values():
            s.wait_up()
        alice, bob = (servers[u] for u in USERS)
        # Both users open two notebooks each, all at the same time.
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(s.start_session, f"nb{i}") for s in (alice, bob) for i in (1, 2)]
            sessions = [f.result() for f in futures]
        leases = Registry(str(area / "registry")).list_leases()
        assert sorted(r.user for r in leases) == sorted([*USERS, *USERS])
        devices = sorted(u for r in leases for u in r.device_uuids)
        assert devices == [uuid_of(i) for i in range(4)]  # exclusive: never two on one GPU
        kernel_ids = {s["kernel"]["id"] for s in sessions}
        assert {r.kernel_id for r in leases} == kernel_ids
        for r in leases:
            assert kernel_environ(r.pid)["CUDA_VISIBLE_DEVICES"] == r.device_uuids[0]
            assert r.command is None
        # A fifth kernel: nothing is free any more, so it starts CPU-only and says why.
        fifth = alice.start_session("nb5")
        assert len(Registry(str(area / "registry")).list_leases()) == 4
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        fifth_env = None
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if fifth["kernel"]["id"].encode() in cmdline:
                fifth_env = kernel_environ(pid)
        assert fifth_env is not None
        assert fifth_env["CUDA_VISIBLE_DEVICES"] == ""
        assert fifth_env["AUTOGPU_PICK_NOTE"].startswith("no device fits: kernel started CPU-only")
        # Each user sees the other's holders, without command lines.
        cli_env = dict(env, HOME="/nonexistent")
        for me, other in ((USERS[0], USERS[1]), (USERS[1], USERS[0])):
            out = cli_as(me, cli_env, "leases", "--json")
            assert out.returncode == 0, out.stderr
            listed = json.loads(out.stdout)
            theirs = [d for d in listed if d["user"] == other]
            assert len(theirs) == 2
            assert all(d["command"] is None and d["kernel_id"] in kernel_ids for d in theirs)
            text = cli_as(me, cli_env, "leases")
            assert sum(line.startswith(other) for line in text.stdout.splitlines()) == 2
        code, holders = alice.request("GET", "autogpu", "holders")
        if code == 200:
            rows = json.dumps(holders)
            assert USERS[1] in rows
            assert '"command": "' not in rows
        else:  # the sidebar's endpoint is optional here; say so in the log
            print(f"/autogpu/holders not available ({code}); checked the CLI only")
    finally:
        for s in servers.values():
            s.stop()
    # Servers stopped their kernels: every lease is gone.
    assert Registry(str(area / "registry")).list_leases() == []
