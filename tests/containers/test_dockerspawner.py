"""JupyterHub with DockerSpawner and autogpu's pre_spawn_hook, against podman's Docker API
(issue 40).

A real ``jupyterhub`` (root) with the real ``configurable-http-proxy`` drives DockerSpawner,
which talks to ``podman system service`` (rootful, runc, the settings of
tests/containerhelpers.py) on a Unix socket of the test's. The image is made from this host's
files (``podman import`` of the harness's root filesystem: no registry is reachable); the
server runs as uid 1000 on podman's bridge network, with ``/usr``, the venv's ``site-packages``
and the checkout mounted read-only. ``c.Spawner.pre_spawn_hook`` is
``autogpu_jupyter.hub.pre_spawn_hook``: the hook adds the tenant to the table, tells the running
broker (which then listens on the tenant's socket), mounts the tenant's directory at
``/run/autogpu`` and sets the environment; then ``autogpu run`` in the user's container (a
terminal's command, ``podman exec``) holds a lease named by the tenant, and a kernel the server
starts has the same environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autogpu_jupyter.brokerd import tenants
from tests.brokerhelpers import Area, BrokerProc, broker_area
from tests.containerhelpers import build_rootfs, container_problem, podman_env
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import free_port
from tests.serverhelpers import Hub, chp

pytestmark = pytest.mark.skipif(container_problem() is not None or chp() is None,
                                reason=str(container_problem() or "configurable-http-proxy "
                                           "is missing (scripts/setup.sh)"))
pytest.importorskip("dockerspawner", reason="dockerspawner is missing (pyproject's test extra)")

REPO = Path(__file__).resolve().parents[2]
SITE = sysconfig.get_paths()["purelib"]
IMAGE = "localhost/autogpu-test-notebook:phase-a"

SPAWNER_CONFIG = '''
from autogpu_jupyter.hub import pre_spawn_hook
c.JupyterHub.hub_bind_url = "http://0.0.0.0:{hub_api_port}"
c.JupyterHub.spawner_class = "dockerspawner.DockerSpawner"
c.DockerSpawner.hub_connect_url = "http://{gateway}:{hub_api_port}"
c.DockerSpawner.image = {image!r}
c.DockerSpawner.pull_policy = "never"
c.DockerSpawner.remove = True
c.DockerSpawner.use_internal_ip = True
c.DockerSpawner.network_name = "podman"
c.DockerSpawner.cmd = ["/usr/bin/python3", "-m", "jupyterhub.singleuser"]
c.DockerSpawner.extra_create_kwargs = {{"user": "1000:100", "working_dir": "/tmp"}}
c.DockerSpawner.extra_host_config = {{"tmpfs": {{"/tmp": "rw,mode=1777"}}}}
c.DockerSpawner.volumes = {{
    path: {{"bind": path, "mode": "ro"}} for path in ("/usr", {site!r}, {repo!r}, {shared!r})
}}
c.DockerSpawner.environment = {{
    "PATH": "/usr/bin:/bin", "HOME": "/tmp", "JUPYTER_RUNTIME_DIR": "/tmp/runtime",
    "PYTHONPATH": "{repo}:{site}", "AUTOGPU_SIMULATE": {fleet!r},
}}
c.Spawner.pre_spawn_hook = pre_spawn_hook(
    state_dir={state!r}, socket_root={socket_root!r}, broker_socket={broker_socket!r},
    max_devices=1,
)
c.Spawner.start_timeout = 90
c.Spawner.http_timeout = 90
'''


@contextlib.contextmanager
def podman_service(workdir: Path) -> Iterator[str]:
    """``podman system service`` on a socket of ``workdir``; its ``unix://`` URL."""
    sock = workdir / "podman.sock"
    with open(workdir / "podman-service.log", "wb") as log:
        proc = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{sock}"],
            stdout=log, stderr=log, env=podman_env(workdir), start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                (workdir / "podman-service.log").read_text())
            time.sleep(0.1)
        yield f"unix://{sock}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def podman(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check,
                          env=podman_env(workdir), timeout=120)


def bridge_gateway(workdir: Path) -> str:
    """The host's address on podman's default bridge (what a container reaches the hub at)."""
    out = podman(workdir, "network", "inspect", "podman").stdout
    return str(json.loads(out)[0]["subnets"][0]["gateway"])


def test_dockerspawner_with_the_hook_on_podman(tmp_path: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="autogpu-dockerspawner-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    stack = contextlib.ExitStack()
    try:
        rootfs = build_rootfs(work / "rootfs")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(work / "rootfs.tar"), "."],
                       check=True)
        podman(work, "import", "-q", str(work / "rootfs.tar"), IMAGE)
        stack.callback(podman, work, "rmi", "-f", IMAGE, check=False)
        docker_host = stack.enter_context(podman_service(work))
        root = stack.enter_context(broker_area(4))
        area = Area(root, 4)
        broker = BrokerProc(root, "--tenant-socket-root", str(work / "tenants"),
                            env={"AUTOGPU_SIMULATE": str(area.fleet)})
        stack.callback(broker.stop)
        hubdir = tmp_path / "hub"
        hubdir.mkdir()
        hub = Hub(
            hubdir, users={"alice"}, environment={}, chp=str(chp()),
            spawner_config=SPAWNER_CONFIG,
            hub_env={"DOCKER_HOST": docker_host,
                     "PYTHONPATH": os.pathsep.join(
                         [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                     "CONTAINERS_CONF": podman_env(work)["CONTAINERS_CONF"]},
            fields={"hub_api_port": free_port(), "gateway": bridge_gateway(work),
                    "image": IMAGE, "site": SITE, "repo": str(REPO), "shared": str(root),
                    "fleet": str(area.fleet), "state": str(broker.state),
                    "socket_root": str(work / "tenants"), "broker_socket": str(area.socket)},
        )
        stack.callback(hub.stop)
        hub.wait_up()
        hub.start_server("alice", timeout_s=120)

        # The hook ran: alice is a tenant, with her directory; the container has the socket
        # directory at /run/autogpu and the environment that sends every pick to the broker.
        assert tenants.load_table(str(broker.state))["alice"] == tenants.Tenant(
            "alice", (), 1)
        assert os.path.isdir(work / "tenants" / "alice")
        env = podman(work, "exec", "jupyter-alice", "/usr/bin/env").stdout.splitlines()
        assert "AUTOGPU_BROKER_SOCKET=/run/autogpu/broker.sock" in env
        assert "AUTOGPU_BROKER_FALLBACK=" in env
        assert podman(work, "exec", "jupyter-alice", "/usr/bin/id", "-u").stdout.strip() == "1000"

        # `autogpu run` in the container (as in a terminal of the server) holds a lease of the
        # host's broker while its command runs.
        held = subprocess.Popen(
            ["podman", "exec", "jupyter-alice", "/usr/bin/python3", "-m", "autogpu_jupyter.cli",
             "run", "--", "/usr/bin/sleep", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=podman_env(work),
            start_new_session=True,
        )
        stack.callback(_end, held)
        st = broker.wait_for(lambda s: len(s["leases"]) == 1, timeout=60)
        assert [(r["user"], r["uid"]) for r in st["leases"]] == [("alice", 1000)]

        # A kernel the single-user server starts inherits the same environment.
        code, kernel = hub.user_api("alice", "POST", "/kernels", {})
        assert code == 201, (code, kernel)
        pids = podman(work, "top", "jupyter-alice", "hpid,args").stdout.splitlines()
        kernel_pid = next(int(line.split()[0]) for line in pids if "ipykernel" in line)
        kernel_env = kernel_environ(kernel_pid, timeout_s=0.5)
        assert kernel_env["AUTOGPU_BROKER_SOCKET"] == "/run/autogpu/broker.sock"
    finally:
        stack.close()
        podman(work, "rm", "-f", "jupyter-alice", check=False)
        shutil.rmtree(work, ignore_errors=True)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
