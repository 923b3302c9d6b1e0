"""The lease stores' names before issue 42's renames still work for one release, with a warning.

Code written against ``Registry``, ``BrokerRegistry``, ``RegistryError`` (and its two
subclasses) or the server state's ``registry()`` keeps running; each old name warns once per use
with a :class:`DeprecationWarning` that names the new one, and is the very same object.
"""

from __future__ import annotations

import importlib

import pytest

from autogpu_jupyter._renamed import RENAMED

PAIRS = [(module, old, new) for module, names in RENAMED.items() for old, new in names.items()]


@pytest.mark.parametrize(("module", "old", "new"), PAIRS, ids=[f"{m}.{o}" for m, o, _ in PAIRS])
def test_an_old_name_is_the_new_object_and_warns_naming_it(module: str, old: str, new: str) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .* use {module}\.{new}$"):
        got = getattr(mod, old)
    assert got is getattr(mod, new)


def test_the_old_names_import_as_before() -> None:
    with pytest.warns(DeprecationWarning):
        from autogpu_jupyter.core.leasing import Registry
    with pytest.warns(DeprecationWarning):
        from autogpu_jupyter.errors import RegistryError
    from autogpu_jupyter.core.leasing import DirectoryStore
    from autogpu_jupyter.errors import LeaseStoreError

    assert Registry is DirectoryStore
    with pytest.raises(RegistryError):  # an old `except RegistryError` still catches
        raise LeaseStoreError("x")


def test_a_name_that_never_existed_is_still_an_attribute_error() -> None:
    import autogpu_jupyter.errors as errors

    with pytest.raises(AttributeError, match="no attribute 'RegistryErrorr'"):
        errors.RegistryErrorr


def test_the_server_states_old_store_method_warns_and_answers_the_same() -> None:
    from autogpu_jupyter.server.state import AutoGPUServer

    state = AutoGPUServer(registry_dir="")
    with pytest.warns(DeprecationWarning, match=r"use AutoGPUServer\.store\(\)"):
        assert state.registry() is None
    assert state.store() is None
