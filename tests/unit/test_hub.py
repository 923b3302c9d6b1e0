"""autogpu_jupyter.hub: the pre_spawn_hook for DockerSpawner and KubeSpawner (issue 40).

The spawners are plain objects with the attributes the real ones have (DockerSpawner:
``volumes`` a dict, ``environment``, ``extra_host_config``; KubeSpawner: ``volumes`` and
``volume_mounts`` lists, ``environment``); what is checked is what the spawner would hand to
Docker or Kubernetes, and the tenants table and directories the hook made.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import hub
from autogpu_jupyter.brokerd import tenants
from autogpu_jupyter.brokerd.tenants import TenantError

REPO = Path(__file__).resolve().parents[2]


class Group:
    def __init__(self, name: str) -> None:
        self.name = name


class User:
    def __init__(self, name: str, groups: tuple[str, ...] = ()) -> None:
        self.name = name
        self.groups = [Group(g) for g in groups]


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)

    warning = info


class DockerSpawner:
    def __init__(self, user: User) -> None:
        self.user = user
        self.volumes: dict[str, Any] = {"/srv/data": {"bind": "/data", "mode": "ro"}}
        self.environment: dict[str, str] = {"TZ": "UTC"}
        self.extra_host_config: dict[str, Any] = {}
        self.log = Log()


class KubeSpawner:
    def __init__(self, user: User) -> None:
        self.user = user
        self.volumes: list[dict[str, Any]] = [{"name": "home", "emptyDir": {}}]
        self.volume_mounts: list[dict[str, Any]] = [{"name": "home", "mountPath": "/home"}]
        self.environment: dict[str, str] = {}
        self.log = Log()


@pytest.fixture
def where(tmp_path: Path) -> dict[str, str]:
    return {"state_dir": str(tmp_path / "state"), "socket_root": str(tmp_path / "sockets"),
            "broker_socket": str(tmp_path / "no-broker.sock")}


def test_docker_the_tenant_is_added_and_its_directory_mounted_read_only(
    where: dict[str, str],
) -> None:
    spawner = DockerSpawner(User("alice", ("ml", "Bad Group")))
    hub.pre_spawn_hook(max_devices=1, **where)(spawner)
    table = json.loads(Path(where["state_dir"], "tenants.json").read_text())
    assert table["tenants"] == {"alice": {"groups": ["ml"], "max_devices": 1}}
    alice = os.path.join(where["socket_root"], "alice")
    assert stat.S_IMODE(os.stat(alice).st_mode) == 0o755
    assert spawner.volumes == {
        "/srv/data": {"bind": "/data", "mode": "ro"},
        alice: {"bind": "/run/autogpu", "mode": "ro"},
    }
    assert spawner.environment == {
        "TZ": "UTC", "AUTOGPU_BROKER_SOCKET": "/run/autogpu/broker.sock",
        "AUTOGPU_BROKER_FALLBACK": "",
    }
    assert spawner.log.lines[-1] == (
        f"autogpu: alice is tenant alice; {alice} mounted at /run/autogpu; the broker is not "
        f"running at {where['broker_socket']}: it serves the tenants when it starts")


def test_a_second_spawn_reuses_the_tenant_and_never_keeps_another_tenants_mount(
    where: dict[str, str],
) -> None:
    spawner = DockerSpawner(User("alice"))
    hook = hub.pre_spawn_hook(**where)
    hook(spawner)
    hook(spawner)
    assert list(tenants.load_table(where["state_dir"])) == ["alice"]
    spawner.user = User("bob")  # a spawner object handed to another user: only bob's mount
    hook(spawner)
    binds = [v["bind"] for v in spawner.volumes.values()]
    assert binds.count("/run/autogpu") == 1
    assert os.path.join(where["socket_root"], "bob") in spawner.volumes


def test_kubernetes_a_hostpath_volume_and_a_read_only_mount(where: dict[str, str]) -> None:
    spawner = KubeSpawner(User("bob"))
    hook = hub.pre_spawn_hook(add=False, groups=["students"], **where)
    hook(spawner)
    hook(spawner)  # idempotent
    bob = os.path.join(where["socket_root"], "bob")
    assert spawner.volumes == [
        {"name": "home", "emptyDir": {}},
        {"name": "autogpu-broker", "hostPath": {"path": bob, "type": "Directory"}},
    ]
    assert spawner.volume_mounts == [
        {"name": "home", "mountPath": "/home"},
        {"name": "autogpu-broker", "mountPath": "/run/autogpu", "readOnly": True},
    ]
    assert spawner.environment["AUTOGPU_BROKER_SOCKET"] == "/run/autogpu/broker.sock"
    assert not os.path.exists(where["state_dir"])  # add=False: the rules file's tenants


@pytest.mark.parametrize(("user", "tenant"), [
    ("alice", "alice"),
    ("Alice@Example.org", "u-alice-example-org-"),
    ("root", "u-root-"),
    ("12345", "u-12345-"),
    ("名前", "u-"),
])
def test_hub_names_that_are_not_tenant_names_get_a_distinct_valid_one(
    user: str, tenant: str,
) -> None:
    name = hub.tenant_name(user)
    assert tenants.validate_name(name) == name
    assert name == tenant if tenant == user else name.startswith(tenant)
    assert hub.tenant_name(user) == name  # the same user, the same tenant, every spawn
    assert hub.tenant_name(user.upper() + "x") != name


def test_the_command_form_runs_the_real_cli(where: dict[str, str]) -> None:
    """``add=[...]`` runs ``autogpu broker tenant add`` (as a hub that is not root would, through
    sudo); its one-line refusal is the spawn's error, and nothing is mounted then."""
    cmd = ["env", f"PYTHONPATH={REPO}", sys.executable, "-m", "autogpu_jupyter.cli", "broker",
           "tenant"]
    spawner = DockerSpawner(User("carol", ("staff",)))
    if os.geteuid() == 0:
        hub.pre_spawn_hook(add=cmd, max_devices=2, **where)(spawner)
        assert tenants.load_table(where["state_dir"])["carol"] == tenants.Tenant(
            "carol", ("staff",), 2)
    failing = DockerSpawner(User("erin"))
    refuse = [sys.executable, "-c", "import sys; sys.exit('autogpu: broker tenant add needs "
              "root'); "]
    with pytest.raises(RuntimeError, match=r"^autogpu: adding tenant erin failed: autogpu: "
                       "broker tenant add needs root$"):
        hub.pre_spawn_hook(add=refuse, **where)(failing)
    assert failing.volumes == {"/srv/data": {"bind": "/data", "mode": "ro"}}
    assert "AUTOGPU_BROKER_SOCKET" not in failing.environment


def test_a_reserved_or_bad_tenant_name_stops_the_spawn(where: dict[str, str]) -> None:
    spawner = DockerSpawner(User("mallory"))
    with pytest.raises(TenantError, match="'root' is reserved"):
        hub.pre_spawn_hook(name=lambda user: "root", **where)(spawner)
    assert "AUTOGPU_BROKER_SOCKET" not in spawner.environment


def test_a_bad_limit_stops_the_hub_at_configuration() -> None:
    with pytest.raises(TenantError, match="max_devices '-1' is not accepted"):
        hub.pre_spawn_hook(max_devices=-1)


def test_a_privileged_container_is_warned_about(where: dict[str, str]) -> None:
    spawner = DockerSpawner(User("dave"))
    spawner.extra_host_config = {"pid_mode": "host"}
    hub.pre_spawn_hook(**where)(spawner)
    assert any("shares the host's pids" in line for line in spawner.log.lines)


def test_the_module_imports_no_hub_or_spawner() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, autogpu_jupyter.hub; print(sorted(m for m in "
         "sys.modules if m.split('.')[0] in ('jupyterhub', 'dockerspawner', 'kubespawner', "
         "'docker', 'kubernetes', 'tornado', 'IPython')))"],
        capture_output=True, text=True, check=True, cwd=str(REPO),
    )
    assert out.stdout.strip() == "[]"
