"""What only the lease broker can do, for the front ends that administer it or listen to it.

The port (:mod:`~autogpu_jupyter.core.leasing.store`) is what every store does; a few abilities
exist only where a daemon holds the leases: its status, its waiting line as it serves it, revoking
a lease, and the events it sends unasked on a lease connection. They live here, so that besides
the factory this is the one module a front end reaches the broker client through:

* :func:`broker_socket` -- the socket ``autogpu broker`` serves or asks;
* :func:`broker_at` -- the broker at a socket, to ask its ``status()``, ``list_tickets()`` or
  ``revoke_record()`` (an ``autogpu broker`` subcommand asks once, with a short connect timeout);
* :func:`status_records` -- the leases and tickets of a ``status()`` answer, as records;
* :func:`lease_events` -- what the broker said on a lease connection this process holds (a
  revoke); nothing for a lease file of the shared directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autogpu_jupyter.core.leasing import brokerclient
from autogpu_jupyter.core.leasing.factory import StoreSettings, configured_socket
from autogpu_jupyter.core.leasing.records import LeaseRecord

__all__ = ["BrokerAdmin", "broker_at", "broker_socket", "lease_events", "status_records"]

#: The broker, as its administrator's commands see it (the broker client's store).
BrokerAdmin = brokerclient.BrokerStore


def broker_socket(settings: StoreSettings, given: str | None = None) -> str:
    """The broker's socket: ``given`` (e.g. ``--socket``), else the configured one (any
    spelling of "off" counts as not configured), else the default."""
    return given or configured_socket(settings) or brokerclient.DEFAULT_SOCKET


def broker_at(path: str, connect_timeout_s: float = 1.0) -> BrokerAdmin:
    """The broker at socket ``path``; nothing is asked until a method is called."""
    return brokerclient.BrokerStore(path, connect_timeout_s=connect_timeout_s)


def status_records(status: Mapping[str, Any], path: str) -> list[LeaseRecord]:
    """The leases, then the tickets, of the broker's ``status()`` answer (from ``path``)."""
    items = [*status.get("leases", []), *status.get("tickets", [])]
    return [brokerclient.from_wire(item, path) for item in items]


def lease_events(fd: int) -> list[str]:
    """Messages the broker sent, unasked, on the lease connection ``fd`` (one line each, for
    the notebook user); empty when nothing happened or ``fd`` is not a broker connection."""
    return brokerclient.lease_events(fd)
