"""A JupyterHub ``pre_spawn_hook`` that gives each hub user's container its tenant of the host's
broker (issue 40; docs/jupyterhub.md, section (d)).

In ``jupyterhub_config.py``::

    from autogpu_jupyter.hub import pre_spawn_hook
    c.Spawner.pre_spawn_hook = pre_spawn_hook(max_devices=1)

Before each server starts, the hook

1. names the hub user's tenant (:func:`tenant_name`: the user name when it is a valid tenant name,
   else a name derived from it that no other user gets);
2. adds the tenant, or reuses it, with ``groups`` and ``max_devices`` (``add``: in this process,
   the hub running as root on the broker's host; or a command such as ``["sudo", "-n",
   "autogpu", "broker", "tenant"]``; or ``False`` where the tenants come from the broker's rules
   file, as on Kubernetes);
3. mounts the tenant's socket directory (on the host, under the root-only socket root) read-only
   at the default socket's directory (``/run/autogpu``) in the container: DockerSpawner's
   ``volumes``, KubeSpawner's ``volumes`` (a ``hostPath``) and ``volume_mounts``;
4. sets :func:`container_environment` in ``spawner.environment``, so that the single-user server
   (the sidebar), its kernels and ``autogpu`` in a terminal all lease through that socket and
   fail closed when it cannot be reached (never a registry of the container's own).

This module imports nothing from JupyterHub, DockerSpawner or KubeSpawner: it reads and sets the
spawner's attributes only (``user.name``, ``user.groups``, ``volumes``, ``volume_mounts``,
``environment``, ``extra_host_config``, ``log``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from autogpu_jupyter.brokerd import tenants
from autogpu_jupyter.brokerd.tenantcli import tell_broker

__all__ = ["VOLUME_NAME", "container_environment", "pre_spawn_hook", "tenant_name"]

log = logging.getLogger("autogpu.hub")

#: The name of the volume the hook adds to a KubeSpawner pod.
VOLUME_NAME = "autogpu-broker"
_SAFE = re.compile(r"[^a-z0-9_-]+")


def tenant_name(user: str) -> str:
    """The tenant of hub user ``user``: the name itself when it is a valid tenant name
    (:data:`autogpu_jupyter.brokerd.tenants.NAME_FORM`, not reserved); else ``u-`` and a
    readable part of it and eight hex digits of its SHA-256, so that two hub users never share
    a tenant (``Alice@example.org`` -> ``u-alice-example-org-1b2c3d4e``)."""
    try:
        return tenants.validate_name(user)
    except tenants.TenantError:
        pass
    digest = hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    readable = _SAFE.sub("-", user.lower()).strip("-")[:21].rstrip("-")
    return f"u-{readable}-{digest}" if readable else f"u-{digest}"


def container_environment(socket_path: str = tenants.CONTAINER_SOCKET) -> dict[str, str]:
    """What a container needs to lease through the broker socket mounted at ``socket_path``:
    every pick goes through it (``AUTOGPU_BROKER_SOCKET``: set, so a pick fails closed when the
    broker cannot be reached) and never falls back to a directory registry of the container's
    own, which no other container would see (``AUTOGPU_BROKER_FALLBACK`` empty)."""
    return {"AUTOGPU_BROKER_SOCKET": socket_path, "AUTOGPU_BROKER_FALLBACK": ""}


def _hub_groups(spawner: Any) -> list[str]:
    """The hub groups of the spawner's user that are valid tenant group names."""
    names = []
    for group in getattr(spawner.user, "groups", None) or []:
        name = getattr(group, "name", group)
        if isinstance(name, str):
            try:
                names.append(tenants.validate_name(name, "group"))
            except tenants.TenantError:
                log.warning("autogpu: hub group %r is not a valid tenant group name (%s): not "
                            "given to the tenant", name[:60], tenants.NAME_FORM)
    return names


def pre_spawn_hook(
    *,
    groups: Iterable[str] | Callable[[Any], Iterable[str]] | None = None,
    max_devices: int | None = None,
    name: Callable[[str], str] = tenant_name,
    add: bool | Sequence[str] | Callable[[str, list[str], int | None], object] = True,
    state_dir: str = tenants.DEFAULT_STATE_DIR,
    socket_root: str = tenants.DEFAULT_SOCKET_ROOT,
    socket_dir: str | Callable[[str], str] | None = None,
    broker_socket: str = tenants.MAIN_SOCKET,
) -> Callable[[Any], None]:
    """A ``c.Spawner.pre_spawn_hook`` for DockerSpawner and KubeSpawner (module docstring).

    Parameters
    ----------
    groups
        The tenant's groups (for the rules file's group limits and reserved devices): a list, or
        a function of the spawner; default: the user's hub groups with valid names.
    max_devices
        The tenant's device limit (``None``: the rules' limit for its name or groups).
    name
        Hub user name -> tenant name (default :func:`tenant_name`).
    add
        ``True``: add or update the tenant in this process (the hub is root on the broker's
        host; ``state_dir`` and ``socket_root`` are the broker's); a list: the command that does
        it (``add NAME --state-dir .. --socket-root .. [--group G]... [--max-devices N]`` is
        appended: e.g. ``["sudo", "-n", "autogpu", "broker", "tenant"]``); a function ``(name,
        groups, max_devices)``; ``False``: the tenants are the rules file's (Kubernetes).
    socket_dir
        The host directory mounted at the default socket's directory (a path, or a function of
        the tenant name); default: the tenant's directory under ``socket_root``.
    broker_socket
        The running broker's main socket: with ``add=True``, a tenant added or changed is
        served at once (``autogpu broker tenant add`` tells it the same way).

    The hook raises (JupyterHub then shows the spawn as failed, with the message) when the
    tenant cannot be added: a container without its socket would fail every pick anyway.
    """
    if max_devices is not None:
        tenants.Tenant.make("checked", [], max_devices)  # a bad limit stops the hub's start

    def hook(spawner: Any) -> None:
        tenant = name(str(spawner.user.name))
        if callable(groups):
            wanted = list(groups(spawner))
        else:
            wanted = list(groups) if groups is not None else _hub_groups(spawner)
        checked = tenants.Tenant.make(tenant, wanted, max_devices)
        told = _add(checked, add, state_dir, socket_root, broker_socket)
        if socket_dir is None:
            host_dir = tenants.tenant_dir(socket_root, checked.name)
        else:
            host_dir = socket_dir(checked.name) if callable(socket_dir) else socket_dir
        _mount(spawner, host_dir, checked.name)
        spawner.environment = {**(getattr(spawner, "environment", None) or {}),
                               **container_environment()}
        logger = getattr(spawner, "log", log)
        logger.info("autogpu: %s is tenant %s; %s mounted at %s%s", spawner.user.name,
                    checked.name, host_dir, tenants.CONTAINER_SOCKET_DIR,
                    f"; {told}" if told else "")

    return hook


def _add(tenant: tenants.Tenant, add: Any, state_dir: str, socket_root: str,
         broker_socket: str) -> str:
    """Add ``tenant``; what the broker said, when this process told it (else ``""``)."""
    if add is False:
        return ""
    if add is True:
        _, what = tenants.add_tenant(tenant.name, tenant.groups, tenant.max_devices,
                                     state_dir=state_dir, socket_root=socket_root)
        return "" if what == "unchanged" else tell_broker(broker_socket)
    if callable(add):
        add(tenant.name, list(tenant.groups), tenant.max_devices)
        return ""
    cmd = [*add, "add", tenant.name, "--state-dir", state_dir, "--socket-root", socket_root]
    for group in tenant.groups:
        cmd += ["--group", group]
    if tenant.max_devices is not None:
        cmd += ["--max-devices", str(tenant.max_devices)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"autogpu: adding tenant {tenant.name} failed: {why}")
    return ""


def _mount(spawner: Any, host_dir: str, tenant: str) -> None:
    """The read-only mount of ``host_dir`` at the default socket's directory: KubeSpawner
    (``volume_mounts`` present) as a ``hostPath`` volume, DockerSpawner as a bind."""
    target = tenants.CONTAINER_SOCKET_DIR
    if hasattr(spawner, "volume_mounts"):
        volume = {"name": VOLUME_NAME, "hostPath": {"path": host_dir, "type": "Directory"}}
        mount = {"name": VOLUME_NAME, "mountPath": target, "readOnly": True}
        spawner.volumes = [*(v for v in spawner.volumes or [] if v.get("name") != VOLUME_NAME),
                           volume]
        spawner.volume_mounts = [
            *(m for m in spawner.volume_mounts or []
              if m.get("name") != VOLUME_NAME and m.get("mountPath") != target),
            mount,
        ]
        return
    volumes = dict(spawner.volumes or {})
    for source, where in list(volumes.items()):
        bind = where.get("bind") if isinstance(where, dict) else where
        if bind == target and source != host_dir:
            del volumes[source]  # another tenant's directory (a reused spawner object)
    volumes[host_dir] = {"bind": target, "mode": "ro"}
    spawner.volumes = volumes
    extra = getattr(spawner, "extra_host_config", None) or {}
    if extra.get("privileged") or extra.get("pid_mode") == "host":
        getattr(spawner, "log", log).warning(
            "autogpu: %s's container is privileged or shares the host's pids: it can reach "
            "other tenants' sockets (docs/jupyterhub.md, threat model)", tenant)
