"""The lease store: where a host's leases and waiting line live, and who may take what.

* :mod:`.store` -- the port: :class:`LeaseStore`, :class:`StoreTransaction`, :class:`HeldLease`,
  the read side :class:`RecordView` and the :class:`Requester` a lease is for;
* :mod:`.admission` -- the one set of rules (exclusivity, quotas, reserved groups, tickets, the
  waiting-line order) and their messages, for every store and the broker;
* :mod:`.records` -- the record format (writer and readers);
* :mod:`.directory` -- the shared-directory store (:class:`Registry`);
* :mod:`.brokerclient` -- the trusted broker's client (:class:`BrokerRegistry`);
* :mod:`.factory` -- :func:`store_for`, which store the settings select.

Front ends ask :func:`store_for` and code against the port; only the factory and the tests name
a store class. The port, the records and the admission load with this package; the stores and
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
    from autogpu_jupyter.core.leasing.brokerclient import BrokerRegistry
    from autogpu_jupyter.core.leasing.directory import Registry
    from autogpu_jupyter.core.leasing.factory import store_for

__all__ = [
    "BrokerRegistry",
    "HeldLease",
    "LeaseRecord",
    "LeaseStore",
    "RecordView",
    "Registry",
    "Requester",
    "ScanResult",
    "StoreTransaction",
    "store_for",
]


def __getattr__(name: str) -> Any:
    # The stores and the factory load when first named (see the module docstring).
    if name == "Registry":
        from autogpu_jupyter.core.leasing.directory import Registry  # noqa: PLC0415

        return Registry
    if name == "BrokerRegistry":
        from autogpu_jupyter.core.leasing.brokerclient import BrokerRegistry  # noqa: PLC0415

        return BrokerRegistry
    if name == "store_for":
        from autogpu_jupyter.core.leasing.factory import store_for  # noqa: PLC0415

        return store_for
    raise AttributeError(f"module 'autogpu_jupyter.core.leasing' has no attribute {name!r}")
