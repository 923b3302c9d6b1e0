"""Which lease store? One answer for every front end (magics, API, CLI, provisioner, server,
exporter, overload notice): :func:`store_for`.

* ``use_leases`` off: no store (picks go without leases).
* ``broker_socket`` set to a path, or left empty while the default socket
  (:data:`~autogpu_jupyter.core.leasing.brokerclient.DEFAULT_SOCKET`) exists: the trusted broker.
  A broker that cannot be reached fails a pick closed, unless the admin set
  ``broker_fallback = "registry"``: then the shared directory is used instead (checked on every
  call, so a broker that comes back is used again).
* otherwise the shared directory ``registry_dir`` (empty: no store).

"Off" is spelled one way for the broker socket (:data:`OFF`, any case): ``off``, ``none``,
``0``, ``false``.

The store is resolved once per process for a given set of the settings it depends on
(:func:`store_for` is on the pick's path); changed settings give a new one. Each call returns
its own copy of the resolved store: what one pick records on it (``unusable_reason``, a hidden
lease) never leaks into another's.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from autogpu_jupyter.core.leasing import brokerclient
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from autogpu_jupyter.core.leasing.store import LeaseStore
from autogpu_jupyter.errors import LeaseStoreError

__all__ = ["OFF", "StoreSettings", "configured_socket", "store_for"]

log = logging.getLogger(__name__)

#: How a setting says "no broker" (compared case-insensitively, blanks stripped).
OFF = frozenset({"off", "none", "0", "false"})


class StoreSettings(Protocol):
    """The settings a store depends on (``autogpu_jupyter.config.AutoGPU`` has them)."""

    use_leases: bool
    registry_dir: str
    broker_socket: str
    broker_fallback: str
    max_devices_per_user: int
    max_leases_per_user: int
    max_tickets_per_user: int
    record_commands: bool
    registry_lock_timeout_s: float


def configured_socket(settings: StoreSettings) -> str | None:
    """The broker socket the settings name: a path, ``""`` (not set: the default socket if it
    exists), or ``None`` (switched off)."""
    configured = str(settings.broker_socket or "").strip()
    if configured.lower() in OFF:
        return None
    return configured


_lock = threading.Lock()
_resolved: dict[tuple[object, ...], LeaseStore] = {}
_MAX_RESOLVED = 64  # settings a long-lived server cycles through: bounded all the same


def store_for(
    settings: StoreSettings, *, registry_dir: str | None = None, view: bool = False
) -> LeaseStore | None:
    """The lease store ``settings`` select, or ``None`` when leases are off.

    Parameters
    ----------
    settings
        An ``AutoGPU`` configuration (or anything with the :class:`StoreSettings` fields).
    registry_dir
        A directory that wins over ``settings.registry_dir`` (the server's own setting).
    view
        For a view of the host's leases (the server's sidebar): shown even where this process
        takes none itself (``use_leases`` off).
    """
    if not (settings.use_leases or view):
        return None
    socket = configured_socket(settings)
    directory = settings.registry_dir if registry_dir is None else registry_dir
    if socket is not None:
        path = socket or brokerclient.DEFAULT_SOCKET
        if socket or os.path.exists(path):
            timeout = max(float(settings.registry_lock_timeout_s), 1.0)
            broker = _resolve(
                (brokerclient.BrokerStore, path, timeout),
                lambda: brokerclient.BrokerStore(path, lock_timeout_s=timeout),
            )
            if str(settings.broker_fallback).strip().lower() != "registry":
                return broker
            try:
                broker.check()
                return broker
            except LeaseStoreError as err:
                log.warning("%s; using the shared-directory registry (broker_fallback)", err)
    if not directory:
        return None
    rules = (
        int(settings.max_devices_per_user),
        int(settings.max_leases_per_user),
        int(settings.max_tickets_per_user),
        bool(settings.record_commands),
        float(settings.registry_lock_timeout_s),
    )

    def make() -> DirectoryStore:
        devices, leases, tickets, commands, timeout = rules
        return DirectoryStore(
            directory,
            max_devices_per_user=devices,
            max_leases_per_user=leases,
            max_tickets_per_user=tickets,
            record_commands=commands,
            lock_timeout_s=timeout,
        )

    # The absolute path is the key: a relative directory follows the working directory, as a
    # DirectoryStore made at this moment would.
    return _resolve((DirectoryStore, os.path.abspath(directory), *rules), make)


def _resolve(key: tuple[object, ...], make: Callable[[], LeaseStore]) -> LeaseStore:
    """The store for ``key``, made once; each caller gets its own copy (see the module
    docstring)."""
    with _lock:
        store = _resolved.get(key)
        if store is None:
            if len(_resolved) >= _MAX_RESOLVED:
                _resolved.clear()
            store = _resolved[key] = make()
    return copy.copy(store)
