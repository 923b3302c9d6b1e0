"""Tenants: callers named by the socket they came through, not by their uid (issue 40).

Notebooks in containers all run as the same uid (``jovyan``, 1000), often in their own user
namespace: ``SO_PEERCRED`` cannot tell two hub users apart. A *tenant* is a name the admin gives
the broker (``autogpu broker tenant add alice``, or ``"tenants"`` in the rules file) together with
its own socket; a connection accepted on that socket *is* that tenant, whatever its uid.

**The model.** A :class:`Tenant` has a name (Unix user name rules: :data:`NAME_FORM`), groups
(for the rules file's group limits and reserved devices; a tenant's groups are the ones given
here, never a host user's) and an optional device limit (``None``: the rules that name it or its
groups, else the default). At most :data:`MAX_TENANTS` tenants, :data:`MAX_GROUPS` groups each.

**The table.** Tenants added on the command line live in ``tenants.json`` in the broker's state
directory (root's, mode 0700): written whole to a fresh file and renamed over the old one
(mode 0600, ``fsync``-ed), under a lock file so that two ``tenant add`` at once (a hub spawning
many servers) never lose each other's entry. A table that is not root's, is a symlink, is too big
or is not the expected JSON is refused with one line naming the file. Tenants in the rules file
(:func:`parse_rules`, called by ``BrokerConfig.load_rules``) are fixed: the command line can
neither change nor remove them.

**The sockets.** Each tenant's socket is ``<root>/<name>/broker.sock`` (the default socket's
file name), under a *socket root* (:data:`DEFAULT_SOCKET_ROOT`) that is root's with mode 0700:
no host user can traverse it, so only a container given the tenant's directory (bind-mounted at
the default socket's directory, ``/run/autogpu``) reaches that socket. The tenant's directory is
root's, mode 0755 (the container's user must traverse it) and is made when the tenant is added,
so that a spawner can mount it before the broker listens there; the directory is mounted, never
the socket file, so that a socket made later (a broker restart) appears in the container.
:func:`listen_tenant` makes the listening socket with :func:`autogpu_jupyter.brokerd.net.listen`
(mode from ``bind``, unsafe directories refused); :func:`remove_tenant_dir` removes only a socket
and the empty directory, through directory descriptors (never following a link).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.brokerd import net
from autogpu_jupyter.brokerd.identity import Account
from autogpu_jupyter.core.leasing.brokerclient import DEFAULT_SOCKET

__all__ = [
    "DEFAULT_SOCKET_ROOT",
    "DEFAULT_STATE_DIR",
    "MAX_GROUPS",
    "MAIN_SOCKET",
    "MAX_TENANTS",
    "NAME_FORM",
    "SOCKET_NAME",
    "TABLE_FILE",
    "Tenant",
    "TenantError",
    "add_tenant",
    "ensure_socket_root",
    "ensure_tenant_dir",
    "listen_tenant",
    "load_table",
    "parse_rules",
    "removed_refusal",
    "remove_tenant",
    "remove_tenant_dir",
    "tenant_dir",
    "tenant_socket",
    "validate_name",
]

#: The accepted form of a tenant (and group) name, as Unix user names: said in every refusal.
NAME_FORM = "^[a-z_][a-z0-9_-]{0,31}$"
_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
#: Names a tenant may not take: they would read as the host's administrator or the broker's
#: bucket of unknown uids in every view.
RESERVED_NAMES = frozenset({"root", "unknown"})
MAX_TENANTS = 1024
MAX_GROUPS = 32
#: The largest per-tenant device limit accepted (a typo such as 10000 is refused).
MAX_DEVICES_LIMIT = 4096
#: The table file in the broker's state directory, and the most bytes read from it.
TABLE_FILE = "tenants.json"
_LOCK_FILE = "tenants.lock"
MAX_TABLE_BYTES = 1024 * 1024
DEFAULT_STATE_DIR = "/var/lib/autogpu-broker"
#: Where the tenants' socket directories live: root's, mode 0700.
DEFAULT_SOCKET_ROOT = "/run/autogpu-tenants"
#: A tenant's socket has the default socket's file name: its directory is mounted at the
#: default socket's directory in the container, where every client looks first.
SOCKET_NAME = os.path.basename(DEFAULT_SOCKET)
#: The directory a tenant's socket directory is mounted at in its container.
CONTAINER_SOCKET_DIR = os.path.dirname(DEFAULT_SOCKET)
#: The socket's path inside a tenant's container: the default socket, where every client looks.
CONTAINER_SOCKET = DEFAULT_SOCKET
#: The broker's main socket on the host (the default one), told of changes to the tenants.
MAIN_SOCKET = DEFAULT_SOCKET


class TenantError(ValueError):
    """Bad input or an unsafe file: the message is one line naming the value and the accepted
    form. ``usage`` is true for bad input (the command line exits 2), false otherwise."""

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage


def validate_name(name: object, what: str = "tenant name") -> str:
    """``name`` when it is a valid tenant (or group) name, else :class:`TenantError`."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        shown = repr(name)[:60] if isinstance(name, str) else type(name).__name__
        raise TenantError(
            f"{what} {shown} is not accepted: expected {NAME_FORM} (as a Unix user name: a "
            "lower-case letter or _, then up to 31 of a-z 0-9 _ -)"
        )
    if what == "tenant name" and name in RESERVED_NAMES:
        raise TenantError(
            f"tenant name {name!r} is reserved (it would read as "
            f"{'the host admin' if name == 'root' else 'the unknown uids'}): choose another "
            f"name of the form {NAME_FORM}"
        )
    return name


def _max_devices(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DEVICES_LIMIT:
        raise TenantError(
            f"tenant {name}: max_devices {str(value)[:40]!r} is not accepted: expected a whole "
            f"number from 0 to {MAX_DEVICES_LIMIT} (0: no limit), or none for the rules' limit"
        )
    return value


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its name, groups and device limit (``None``: the rules' limit for its name
    or groups, else the default; ``0``: no limit). ``source`` says where it was defined
    (``"table"``: the command line; ``"rules"``: the rules file)."""

    name: str
    groups: tuple[str, ...] = ()
    max_devices: int | None = None
    source: str = "table"

    @classmethod
    def make(cls, name: object, groups: object = (), max_devices: object = None,
             source: str = "table") -> Tenant:
        """A validated tenant (:class:`TenantError`, one line, on bad input)."""
        name = validate_name(name)
        if not isinstance(groups, (list, tuple)):
            raise TenantError(f"tenant {name}: groups must be a list of names of the form "
                              f"{NAME_FORM}, got {type(groups).__name__}")
        if len(groups) > MAX_GROUPS:
            raise TenantError(f"tenant {name}: {len(groups)} groups, at most {MAX_GROUPS}")
        names = tuple(sorted({validate_name(g, f"tenant {name}: group") for g in groups}))
        return cls(name, names, _max_devices(max_devices, name), source)

    def to_json(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "max_devices": self.max_devices}

    def account(self, key: int) -> Account:
        """The broker's account of a connection on this tenant's socket (``key``: the
        broker's choice, distinct from every uid and from the unknown bucket)."""
        return Account(key, self.name, frozenset(self.groups), f"tenant socket of {self.name}")

    def describe(self) -> str:
        groups = ", ".join(self.groups) or "none"
        limit = "the rules'" if self.max_devices is None else (
            "no limit" if self.max_devices == 0 else str(self.max_devices))
        return f"groups: {groups}; max devices: {limit}"


def _entries(doc: object, where: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not isinstance(doc, dict):
        raise TenantError(f"{where}: expected an object of tenants, got {type(doc).__name__}")
    if len(doc) > MAX_TENANTS:
        raise TenantError(f"{where}: {len(doc)} tenants, at most {MAX_TENANTS}")
    for name, value in doc.items():
        entry = {} if value is None else value
        if not isinstance(entry, dict):
            raise TenantError(f"{where}: tenant {str(name)[:40]!r}: expected an object such as "
                              '{"groups": ["students"], "max_devices": 1}')
        extra = set(entry) - {"groups", "max_devices"}
        if extra:
            raise TenantError(f"{where}: tenant {str(name)[:40]!r}: unknown key "
                              f"{sorted(extra)[0][:40]!r} (expected groups, max_devices)")
        yield name, entry


def parse_rules(doc: object) -> dict[str, Tenant]:
    """The ``"tenants"`` section of the rules file: ``{"alice": {"groups": ["students"],
    "max_devices": 1}, "bob": {}}``. Raises :class:`TenantError` (a ``ValueError``: the rules
    loader names the file) on any bad entry."""
    return {
        name: Tenant.make(name, entry.get("groups", []), entry.get("max_devices"), "rules")
        for name, entry in _entries(doc, "tenants")
    }


# -- the table in the state directory ----------------------------------------------------------


def _check_state_dir(state_dir: str, create: bool) -> int:
    """An ``O_DIRECTORY`` descriptor of the state directory, after checking it is ours and
    writable by nobody else (created 0700 when ``create`` and missing)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.makedirs(state_dir, mode=0o700)
    try:
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise TenantError(f"state directory {state_dir}: {err.strerror}: refused (expected a "
                          "directory of root's, mode 0700, not a link)", usage=False) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        os.close(fd)
        raise TenantError(
            f"state directory {state_dir} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: refused (expected uid {os.geteuid()}, mode 0700)",
            usage=False,
        )
    return fd


def load_table(state_dir: str = DEFAULT_STATE_DIR) -> dict[str, Tenant]:
    """The tenants added on the command line (``{}`` when there is no table yet)."""
    try:
        dfd = _check_state_dir(state_dir, create=False)
    except FileNotFoundError:
        return {}
    try:
        return _read_table(dfd, os.path.join(state_dir, TABLE_FILE))
    finally:
        os.close(dfd)


def _read_table(dfd: int, path: str) -> dict[str, Tenant]:
    try:
        fd = os.open(TABLE_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise TenantError(f"tenants table {path}: {err.strerror}: refused (expected a file of "
                          "root's, not a link)", usage=False) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise TenantError(f"tenants table {path} is not a plain file of uid "
                              f"{os.geteuid()}: refused", usage=False)
        if st.st_size > MAX_TABLE_BYTES:
            raise TenantError(f"tenants table {path} is {st.st_size} bytes, more than "
                              f"{MAX_TABLE_BYTES}: refused", usage=False)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_TABLE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise TenantError('expected {"version": 1, "tenants": {...}}')
        return {name: Tenant.make(name, entry.get("groups", []), entry.get("max_devices"))
                for name, entry in _entries(doc.get("tenants", {}), "tenants")}
    except (ValueError, TypeError) as err:  # TenantError is a ValueError
        raise TenantError(f"tenants table {path}: {err}", usage=False) from None


def _write_table(dfd: int, table: Mapping[str, Tenant]) -> None:
    """Replace the table whole: a fresh file (0600), fsync, rename, fsync of the directory."""
    doc = {"version": 1, "tenants": {n: table[n].to_json() for n in sorted(table)}}
    data = (json.dumps(doc, indent=1) + "\n").encode()
    tmp = f".{TABLE_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dfd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    os.rename(tmp, TABLE_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)


@contextlib.contextmanager
def _locked_table(state_dir: str) -> Iterator[tuple[int, dict[str, Tenant]]]:
    """The state directory's descriptor and its table, under the table's lock."""
    dfd = _check_state_dir(state_dir, create=True)
    try:
        lock = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield dfd, _read_table(dfd, os.path.join(state_dir, TABLE_FILE))
        finally:
            os.close(lock)
    finally:
        os.close(dfd)


def add_tenant(
    name: str, groups: tuple[str, ...] | list[str] = (), max_devices: int | None = None,
    *, state_dir: str = DEFAULT_STATE_DIR, socket_root: str = DEFAULT_SOCKET_ROOT,
    rules: Mapping[str, Tenant] | None = None,
) -> tuple[Tenant, str]:
    """Add ``name`` to the table, or update it (then ``"updated"``; ``"unchanged"`` when it is
    the same), and make its socket directory. Returns the tenant and what happened (``"added"``,
    ``"updated"``, ``"unchanged"``). A tenant of the rules file (``rules``) is never changed
    here (``"unchanged"`` when the request matches it, else :class:`TenantError`)."""
    tenant = Tenant.make(name, list(groups), max_devices)
    fixed = (rules or {}).get(tenant.name)
    if fixed is not None:
        if (fixed.groups, fixed.max_devices) != (tenant.groups, tenant.max_devices):
            raise TenantError(f"tenant {tenant.name} is defined in the rules file "
                              f"({fixed.describe()}): change it there", usage=False)
        ensure_tenant_dir(socket_root, tenant.name)
        return fixed, "unchanged"
    with _locked_table(state_dir) as (dfd, table):
        old = table.get(tenant.name)
        if old == tenant:
            what = "unchanged"
        else:
            if old is None and len(table) >= MAX_TENANTS:
                raise TenantError(f"the tenants table holds {len(table)} tenants, the most "
                                  f"allowed ({MAX_TENANTS}): remove one first", usage=False)
            table[tenant.name] = tenant
            _write_table(dfd, table)
            what = "added" if old is None else "updated"
    ensure_tenant_dir(socket_root, tenant.name)
    return tenant, what


def remove_tenant(
    name: str, *, state_dir: str = DEFAULT_STATE_DIR, socket_root: str = DEFAULT_SOCKET_ROOT,
    rules: Mapping[str, Tenant] | None = None,
) -> str:
    """Remove ``name`` from the table and its socket directory; a one-line note of what was
    left, if anything (``""`` otherwise). :class:`TenantError` when there is no such tenant or
    it is the rules file's."""
    validate_name(name)
    if name in (rules or {}):
        raise TenantError(f"tenant {name} is defined in the rules file: remove it there",
                          usage=False)
    with _locked_table(state_dir) as (dfd, table):
        if name not in table:
            known = ", ".join(sorted(table)[:20]) or "none"
            raise TenantError(f"no tenant {name!r} in the table (tenants: {known}; see "
                              "autogpu broker tenant list)", usage=False)
        del table[name]
        _write_table(dfd, table)
    return remove_tenant_dir(socket_root, name)


# -- the sockets -------------------------------------------------------------------------------


def tenant_dir(socket_root: str, name: str) -> str:
    """The directory of ``name``'s socket (bind-mounted at the default socket's directory)."""
    return os.path.join(socket_root, validate_name(name))


def tenant_socket(socket_root: str, name: str) -> str:
    """``name``'s socket on the host."""
    return os.path.join(tenant_dir(socket_root, name), SOCKET_NAME)


def ensure_socket_root(socket_root: str = DEFAULT_SOCKET_ROOT) -> None:
    """Make (mode 0700) or check the socket root: a real directory of ours that nobody else
    can traverse, under directories only root (or a sticky bit) controls. Raises
    :class:`TenantError`, one line naming the directory."""
    with contextlib.suppress(FileExistsError):
        old = os.umask(0o077)
        try:
            os.makedirs(socket_root, mode=0o700)
        finally:
            os.umask(old)
    st = os.lstat(socket_root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise TenantError(
            f"tenant socket root {socket_root} is a link, not a directory or not uid "
            f"{os.geteuid()}'s: refused (expected a directory of root's, mode 0700)", usage=False)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise TenantError(
            f"tenant socket root {socket_root} has mode {stat.S_IMODE(st.st_mode):04o}: refused "
            "(host users could reach the tenants' sockets); expected 0700 (chmod 700 it)",
            usage=False)
    try:
        net.check_socket_dir(socket_root)
    except SystemExit as err:
        raise TenantError(str(err).removeprefix("autogpu broker: "), usage=False) from None


def ensure_tenant_dir(socket_root: str, name: str) -> str:
    """Make (or check) ``name``'s socket directory: root's, mode 0755, inside the 0700 socket
    root. Returns its path."""
    ensure_socket_root(socket_root)
    path = tenant_dir(socket_root, name)
    with contextlib.suppress(FileExistsError):
        old = os.umask(0o022)
        try:
            os.mkdir(path, 0o755)
        finally:
            os.umask(old)
    st = os.lstat(path)
    if (stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) & 0o022):
        raise TenantError(
            f"tenant socket directory {path} is not a directory of uid {os.geteuid()} that only "
            "it can write: refused (remove it and add the tenant again)", usage=False)
    return path


def listen_tenant(socket_root: str, name: str, backlog: int = 1024) -> socket.socket:
    """The listening socket of ``name`` (for the broker): its directory made or checked, the
    socket made by :func:`autogpu_jupyter.brokerd.net.listen` (mode 0666 from ``bind``)."""
    ensure_tenant_dir(socket_root, name)
    return net.listen(tenant_socket(socket_root, name), backlog)


def remove_tenant_dir(socket_root: str, name: str) -> str:
    """Remove ``name``'s socket (only a socket) and its directory (only when empty then),
    through directory descriptors. Returns ``""``, or one line saying what was left."""
    path = tenant_dir(socket_root, name)
    try:
        rfd = os.open(socket_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    try:
        try:
            dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=rfd)
        except FileNotFoundError:
            return ""
        except OSError:
            return f"{path} is not a directory: left as it is"
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(SOCKET_NAME, dir_fd=dfd).st_mode):
                    os.unlink(SOCKET_NAME, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            os.rmdir(name, dir_fd=rfd)
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return f"{path} holds other files: left as it is"
            raise
        return ""
    finally:
        os.close(rfd)


def removed_refusal(name: str) -> str:
    """The one line a connection on the socket of a tenant that no longer exists gets."""
    return (f"tenant {name} was removed by the admin: this socket serves no leases any more "
            "(ask the admin to add the tenant again: autogpu broker tenant add)")


# -- ``autogpu broker tenant`` -----------------------------------------------------------------

DEFAULT_RULES = "/etc/autogpu/broker.json"


def rules_tenants(path: str) -> dict[str, Tenant]:
    """The tenants of the rules file at ``path`` (``{}`` when it does not exist)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise TenantError(f"rules file {path}: {err}", usage=False) from None
    if not isinstance(doc, dict):
        raise TenantError(f"rules file {path}: expected a JSON object", usage=False)
    try:
        return parse_rules(doc.get("tenants", {}))
    except TenantError as err:
        raise TenantError(f"rules file {path}: {err}", usage=False) from None
