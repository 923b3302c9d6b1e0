"""The broker's tenant sockets (issue 40): one listening socket per tenant, served while the
tenant exists.

Which tenants exist: the table in the state directory (``autogpu broker tenant add``) and the
rules file's ``"tenants"`` section, the rules file winning for a name in both. Each gets
``<socket root>/<name>/broker.sock`` (:func:`~autogpu_jupyter.brokerd.tenants.listen_tenant`);
a connection accepted there *is* that tenant (:meth:`Connections.accepted`).

:meth:`TenantSockets.reload` (SIGHUP, or root's ``reload`` op on the main socket, which
``autogpu broker tenant add|remove`` sends) reads both again: a new tenant gets its socket, a
changed one its new limit and groups (for its next connections; its device limit at once), a
removed one loses its socket and directory, and its connections (those waiting in the
listening socket's backlog included) are told :func:`~tenants.removed_refusal` and closed,
their leases and tickets ended; its orphans (taken back after a restart) end too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from autogpu_jupyter.brokerd import net
from autogpu_jupyter.brokerd import tenants as tenancy
from autogpu_jupyter.brokerd.connections import peer_credentials
from autogpu_jupyter.brokerd.identity import tenant_key

__all__ = ["TenantSockets"]

log = logging.getLogger("autogpu.broker")

#: What :meth:`TenantSockets.read` found: the table's tenants, the rules file's (``None``: none).
Read = tuple[dict[str, tenancy.Tenant], dict[str, tenancy.Tenant] | None]


class TenantSockets:
    """The listeners of the broker's tenants (see the module docstring)."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.config = broker.config
        self.tenants: dict[str, tenancy.Tenant] = {}
        self.listeners: dict[str, net.Listener] = {}
        self._reloading = asyncio.Lock()

    def read(self) -> Read:
        """The table's tenants and the rules file's (``None``: no rules file), as the files
        say now. It only reads (a state directory or rules file on a slow disk can take
        long): :meth:`reload_off_loop` runs it in a thread."""
        table = tenancy.load_table(self.config.state_dir) if self.config.state_dir else {}
        rules = tenancy.rules_tenants(self.config.rules_path) if self.config.rules_path else None
        return table, rules

    def reload(self, read: Read | None = None) -> dict[str, list[str]]:
        """Serve the tenants that exist now (as :meth:`read` finds them, or ``read``); what
        changed (``added``, ``removed``, ``updated``), by name. A table or rules file that
        cannot be read changes nothing (:class:`~tenants.TenantError`, one line)."""
        table, rules = self.read() if read is None else read
        if rules is not None:
            self.config.tenants = rules
        wanted = {**table, **self.config.tenants}  # the rules file's win
        root = self.config.tenant_socket_root
        changed: dict[str, list[str]] = {"added": [], "removed": [], "updated": []}
        for name in sorted(set(self.tenants) - set(wanted)):
            self.remove(name)
            changed["removed"].append(name)
        for name, tenant in sorted(wanted.items()):
            old = self.tenants.get(name)
            if name not in self.listeners:
                try:
                    sock = tenancy.listen_tenant(root, name)
                except (tenancy.TenantError, OSError, SystemExit) as err:
                    log.warning("tenant %s: no socket (%s)", name, err)
                    continue
                self.listeners[name] = net.Listener(sock, self._acceptor(name))
                changed["added"].append(name)
            elif old != tenant:
                changed["updated"].append(name)
            self.tenants[name] = tenant
        self.broker.book.tenants = self.tenants
        if any(changed.values()):
            log.info("tenants: %s", "; ".join(f"{k} {', '.join(v)}" for k, v in changed.items()
                                              if v))
        return changed

    async def reload_off_loop(self) -> dict[str, list[str]]:
        """:meth:`reload` with the files read in a thread: the broker goes on answering while
        they are read (SIGHUP, root's ``reload`` op); one reload at a time, in order."""
        async with self._reloading:
            return self.reload(await asyncio.to_thread(self.read))

    def _acceptor(self, name: str) -> Any:
        def accepted(sock: socket.socket) -> None:
            tenant = self.tenants.get(name)
            if tenant is None:
                self._refuse(sock, tenancy.removed_refusal(name))
                return
            self.broker.connections.accepted(sock, tenant=tenant)
        return accepted

    def remove(self, name: str) -> None:
        """Stop serving ``name``: its socket, its directory, its connections, its orphans."""
        self.tenants.pop(name, None)
        listener = self.listeners.pop(name, None)
        line = tenancy.removed_refusal(name)
        if listener is not None:
            self._drain(listener.sock, line)  # connections waiting in the backlog: told too
            listener.close()
        left = tenancy.remove_tenant_dir(self.config.tenant_socket_root, name)
        if left:
            log.warning("tenant %s removed: %s", name, left)
        key = tenant_key(name)
        book = self.broker.book
        for conn in [c for c in self.broker.connections.conns if c.key == key]:
            rec = conn.record
            if rec is not None:
                conn.record = None
            book.tell(conn, {"event": "revoked", "lease_id": getattr(rec, "lease_id", ""),
                             "kind": getattr(rec, "kind", "lease"), "message": line},
                      close=True)
        for lease_id in [i for i, o in book.orphans.items() if o.key == key]:
            book.forget_orphan(lease_id)

    def _refuse(self, sock: socket.socket, why: str) -> None:
        try:
            uid = peer_credentials(sock)[1]
        except OSError:
            uid = -1
        self.broker.connections.refuse(sock, uid, why)

    def _drain(self, sock: socket.socket, why: str) -> None:
        """Accept what waits in ``sock``'s backlog and tell each ``why``."""
        for _ in range(4096):
            try:
                conn, _addr = sock.accept()
            except OSError:
                return
            self._refuse(conn, why)

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()
