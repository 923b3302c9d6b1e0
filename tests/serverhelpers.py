"""Shared set-ups of the tests that run Jupyter servers as real Unix users (one helper for all).

A *shared host* is what an admin sets up for several users on one machine (docs/jupyterhub.md):
the fake ``libnvidia-ml.so.1`` and its scenario where everyone can read them, an autogpu
kernelspec in a prefix of its own, run by Debian's ``/usr/bin/python3`` (the venv's interpreter
lives under ``/root``, mode 0700, which other users cannot execute; Debian's has the same ABI, so
servers and kernels run it with the venv's ``site-packages`` on ``PYTHONPATH``).

Used by ``tests/multiuser/`` (two users' servers, a JupyterHub, the broker between them) and
``tests/cluster/test_slurm.py`` (batchspawner).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.fakenvml import FakeNvml
from tests.leasehelpers import SYSTEM_PYTHON, free_port

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "Hub", "UserServer", "chp", "json_request", "shared_host"]


def json_request(url: str, token: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    """One JSON request with a token; (status, decoded body) also for HTTP errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"token {token}",
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


def shared_host(
    area: Path,
    fake_nvml_library: Path,
    fleet: dict[str, Any],
    *,
    spec: str,
    options: dict[str, Any],
    server_config: str | None = None,
) -> dict[str, str]:
    """Set up a shared host in ``area`` (see the module docstring); the environment its users'
    servers and kernels run with.

    Parameters
    ----------
    fleet
        The fake driver's devices (the simulated fleet schema).
    spec, options
        The kernelspec's name and its pick options (``kernelspec.install``).
    server_config
        A ``jupyter_server_config.py`` for every server (``JUPYTER_CONFIG_PATH``), if any.
    """
    from autogpu_jupyter import kernelspec

    libdir = area / "lib"
    libdir.mkdir()
    # The build is mode 0711, which dlopen cannot map for another user: a readable copy.
    shutil.copy(fake_nvml_library, libdir / "libnvidia-ml.so.1")
    os.chmod(libdir / "libnvidia-ml.so.1", 0o755)
    fake = FakeNvml(area / "fake")
    fake.write(fleet)
    os.chmod(area / "fake", 0o755)
    os.chmod(fake.scenario_path, 0o644)
    prefix = area / "prefix"
    kernelspec.install(spec, "Python 3 (autogpu)", options, prefix=str(prefix),
                       python=SYSTEM_PYTHON)
    readable = [prefix, *prefix.rglob("*")]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{REPO}",
        "LD_LIBRARY_PATH": str(libdir),
        "FAKE_NVML_SCENARIO": str(fake.scenario_path),
        "AUTOGPU_REGISTRY_DIR": str(area / "registry"),
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
    }
    if server_config is not None:
        etc = area / "etc" / "jupyter"
        etc.mkdir(parents=True)
        (etc / "jupyter_server_config.py").write_text(server_config)
        readable += [area / "etc", etc, *etc.iterdir()]
        env["JUPYTER_CONFIG_PATH"] = str(etc)
    for p in readable:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return env


def chp() -> str | None:
    """``configurable-http-proxy``: next to this venv's python (scripts/setup.sh), or on PATH."""
    here = Path(sys.executable).parent / "configurable-http-proxy"
    return str(here) if here.exists() else shutil.which("configurable-http-proxy")


class UserServer:
    """One user's ``jupyter server`` (token auth, own HOME) started with ``runuser``."""

    def __init__(self, user: str, area: Path, env: dict[str, str]) -> None:
        import pwd

        pw = pwd.getpwnam(user)
        self.user = user
        self.home = area / "home" / user
        self.home.mkdir(parents=True)
        (self.home / ".jupyter").mkdir()
        cfg = self.home / ".jupyter" / "jupyter_server_config.json"
        cfg.write_text(json.dumps(
            {"ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}}}
        ))
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
        return json_request(self.url(*parts), self.token, method, body)

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

    def start_session(self, name: str, kernel: str) -> dict[str, Any]:
        code, body = self.request("POST", "api", "sessions", body={
            "path": f"{name}.ipynb", "type": "notebook", "name": "", "kernel": {"name": kernel}})
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


#: What every test hub has: loopback addresses, the proxy, a database in the test's area, a
#: shared password, and a service token with admin scopes (the test drives the hub's REST API).
#: A test appends its spawner's lines (format fields in braces, literal braces doubled).
HUB_CONFIG = '''\
c = get_config()  # noqa: F821
c.JupyterHub.bind_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.JupyterHub.db_url = "sqlite:///{area}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{area}/jupyterhub_cookie_secret"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = {password!r}
c.Authenticator.allowed_users = {users!r}
c.JupyterHub.services = [{{"name": "autogpu-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{
    "name": "autogpu-test",
    "scopes": ["admin:users", "admin:servers", "access:servers"],
    "services": ["autogpu-test"],
}}]
'''


class Hub:
    """A ``jupyterhub`` process (root) with its proxy, for ``users``.

    ``spawner_config`` holds the spawner's lines (see :data:`HUB_CONFIG`); its format fields may
    use ``python`` and ``environment`` besides the hub's own, and ``fields`` adds more.
    """

    def __init__(
        self,
        area: Path,
        *,
        users: set[str],
        environment: dict[str, str],
        chp: str,
        spawner_config: str,
        hub_env: dict[str, str] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        self.area = area
        self.token = secrets.token_hex(16)
        self.proxy_port = free_port()
        self.hub_port = free_port()
        config = area / "jupyterhub_config.py"
        config.write_text((HUB_CONFIG + spawner_config).format(
            proxy_port=self.proxy_port, hub_port=self.hub_port, api_port=free_port(), chp=chp,
            area=area, password=secrets.token_hex(8), users=users, token=self.token,
            python=SYSTEM_PYTHON, environment=environment, **(fields or {}),
        ))
        self.log_path = area / "jupyterhub.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        venv_bin = str(Path(sys.executable).parent)
        env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(area), "LANG": "C.UTF-8",
               **(hub_env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=area, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.proxy_port}{path}"

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return json_request(self.url(f"/hub/api{path}"), self.token, method, body)

    def wait_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the hub exited:\n{self.log()}")
            try:
                if self.api("GET", "/")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"the hub did not start:\n{self.log()}")

    def start_server(self, user: str, timeout_s: float = 60.0) -> None:
        code, body = self.api("POST", f"/users/{user}/server")
        assert code in (201, 202), (code, body, self.log())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code, model = self.api("GET", f"/users/{user}")
            assert code == 200, (code, model)
            server = (model.get("servers") or {}).get("")
            if server and server.get("ready"):
                return
            if not model.get("pending") and not server:
                raise AssertionError(f"{user}'s server failed to start:\n{self.log()}")
            time.sleep(0.3)
        raise AssertionError(f"{user}'s server did not become ready:\n{self.log()}")

    def user_api(self, user: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """The single-user server's REST API, through the proxy, with the service's token."""
        return json_request(self.url(f"/user/{user}/api{path}"), self.token, method, body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # the hub stops its servers and its proxy
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
