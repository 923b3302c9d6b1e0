"""The names the lease stores had before 0.x, kept one release as deprecated aliases.

The design calls the holder of lease state a *lease store*; until this release the code called
the shared-directory store ``Registry``, the broker's client ``BrokerRegistry`` and their errors
``RegistryError`` (and two subclasses). Each module that defines a renamed object answers its old
name through :func:`old_name` with a :class:`DeprecationWarning` naming the new one, so code
written against the old names keeps working for one release. User-facing settings
(``registry_dir``, ``AUTOGPU_REGISTRY_DIR``, ``broker_fallback = "registry"``) are not renamed.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: module -> {old name: new name}
RENAMED: dict[str, dict[str, str]] = {
    "autogpu_jupyter.errors": {
        "RegistryError": "LeaseStoreError",
        "RegistryUntrustedError": "LeaseStoreUntrustedError",
        "RegistryUnreachableError": "LeaseStoreUnreachableError",
    },
    "autogpu_jupyter.core.leasing.directory": {"Registry": "DirectoryStore"},
    "autogpu_jupyter.core.leasing.brokerclient": {"BrokerRegistry": "BrokerStore"},
    "autogpu_jupyter.core.leasing": {
        "Registry": "DirectoryStore",
        "BrokerRegistry": "BrokerStore",
    },
}


def old_name(module: str, name: str) -> Any:
    """The object ``module`` now calls by a new name, for its old ``name``, with a warning.

    Raises :class:`AttributeError` (as a module's ``__getattr__`` must) for any other name.
    """
    new = RENAMED.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} is deprecated and will be removed in the next release; "
        f"use {module}.{new}",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), new)
