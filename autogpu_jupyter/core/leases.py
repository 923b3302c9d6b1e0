"""Compatibility names: the lease registry now lives in :mod:`core.records` (the record format),
:mod:`core.registry` (the shared directory and its locking) and :mod:`core.decision` (what leases
and waiters mean for a pick). Import from those; this module re-exports them for older code."""

from __future__ import annotations

from autogpu_jupyter.core.decision import bookings_for
from autogpu_jupyter.core.records import (
    LEASE_SUFFIX,
    MAX_RECORD_BYTES,
    MAX_SEQ,
    TICKET_SUFFIX,
    LeaseRecord,
)
from autogpu_jupyter.core.registry import (
    MAX_FILES_PER_USER,
    Lease,
    Registry,
    ScanResult,
    Ticket,
    Transaction,
)

__all__ = [
    "LEASE_SUFFIX",
    "MAX_FILES_PER_USER",
    "MAX_RECORD_BYTES",
    "MAX_SEQ",
    "TICKET_SUFFIX",
    "Lease",
    "LeaseRecord",
    "Registry",
    "ScanResult",
    "Ticket",
    "Transaction",
    "bookings_for",
]
