"""The lease store: where a host's leases and waiting line live, and who may take what.

* :mod:`.store` -- the port: :class:`LeaseStore`, :class:`StoreTransaction`, :class:`HeldLease`,
  the read side :class:`RecordView` and the :class:`Requester` a lease is for;
* :mod:`.admission` -- the one set of rules (exclusivity, quotas, reserved groups, tickets, the
  waiting-line order) and their messages, for every store and the broker;
* :mod:`.records` -- the record format (writer and readers);
* :mod:`.directory` -- the shared-directory store (:class:`DirectoryStore`);
* :mod:`.brokerclient` -- the trusted broker's client (:class:`BrokerStore`);
* :mod:`.wire` -- the broker's protocol (version, caps) and the shapes it carries, for both sides;
* :mod:`.factory` -- :func:`store_for`, which store the settings select;
* :mod:`.admin` -- what only the broker can do (its status, waiting line, revokes and the events
  on a lease connection): :func:`broker_socket`, :func:`broker_at`, :func:`status_records`,
  :func:`lease_events`;
* :mod:`.safefs` -- the hardened filesystem calls under the shared directory.

Front ends ask :func:`store_for` and code against the port (what differs between stores is a
capability of the port, e.g. :attr:`LeaseStore.leaves_dead_entries`), and reach the broker's own
abilities through :mod:`.admin`; only the factory, the admin module and the tests name a store
class. The port, the records and the admission load with this package; the stores and
the factory (sockets, ``flock``, ``secrets``) when first named, so that the ranking, which words
its reasons with the admission's phrases, does not bring them along.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.store import (
    HeldLease,
    LeaseStore,
    RecordView,
    Requester,
    ScanResult,
    StoreTransaction,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core.leasing.admin import (
        broker_at,
        broker_socket,
        lease_events,
        status_records,
    )
    from autogpu_jupyter.core.leasing.brokerclient import BrokerStore
    from autogpu_jupyter.core.leasing.directory import DirectoryStore
    from autogpu_jupyter.core.leasing.factory import store_for

__all__ = [
    "BrokerStore",
    "HeldLease",
    "LeaseRecord",
    "LeaseStore",
    "RecordView",
    "DirectoryStore",
    "Requester",
    "ScanResult",
    "StoreTransaction",
    "store_for",
    # the broker's own abilities (core.leasing.admin)
    "broker_at",
    "broker_socket",
    "lease_events",
    "status_records",
]

_ADMIN = frozenset({"broker_at", "broker_socket", "lease_events", "status_records"})


def __getattr__(name: str) -> Any:
    # The stores and the factory load when first named (see the module docstring).
    if name == "DirectoryStore":
        from autogpu_jupyter.core.leasing.directory import DirectoryStore  # noqa: PLC0415

        return DirectoryStore
    if name == "BrokerStore":
        from autogpu_jupyter.core.leasing.brokerclient import BrokerStore  # noqa: PLC0415

        return BrokerStore
    if name == "store_for":
        from autogpu_jupyter.core.leasing.factory import store_for  # noqa: PLC0415

        return store_for
    if name in _ADMIN:
        from autogpu_jupyter.core.leasing import admin  # noqa: PLC0415

        return getattr(admin, name)
    from autogpu_jupyter._renamed import old_name  # noqa: PLC0415

    return old_name(__name__, name)  # the names before the renames, or AttributeError
