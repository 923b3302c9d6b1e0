"""Which lease store the settings select (core.leasing.factory.store_for): one answer for every
front end, one spelling of "off", resolved once per set of settings."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core.leasing import (
    BrokerStore,
    DirectoryStore,
    brokerclient,
    factory,
    store_for,
)


@pytest.fixture(autouse=True)
def _no_default_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(brokerclient, "DEFAULT_SOCKET", str(tmp_path / "default.sock"))


def test_settings_select_no_store_the_directory_or_a_broker(tmp_path: Path) -> None:
    d = str(tmp_path / "registry")
    assert store_for(AutoGPU(use_leases=False, registry_dir=d)) is None
    assert store_for(AutoGPU(registry_dir="", broker_socket="")) is None
    reg = store_for(AutoGPU(registry_dir=d, broker_socket="", max_devices_per_user=3,
                            max_leases_per_user=5, max_tickets_per_user=1,
                            record_commands=True, registry_lock_timeout_s=2.5))
    assert isinstance(reg, DirectoryStore)
    assert (reg.path, reg.quota.max_devices, reg.quota.max_leases, reg.quota.max_tickets,
            reg.record_commands, reg.lock_timeout_s) == (d, 3, 5, 1, True, 2.5)
    for off in ("off", " OFF ", "none", "0", "false", "False"):
        assert isinstance(store_for(AutoGPU(registry_dir=d, broker_socket=off)), DirectoryStore)
        assert factory.configured_socket(AutoGPU(broker_socket=off)) is None
    sock = str(tmp_path / "broker.sock")
    broker = store_for(AutoGPU(registry_dir=d, broker_socket=f" {sock} ",
                               registry_lock_timeout_s=0.2))
    assert isinstance(broker, BrokerStore)
    assert (broker.path, broker.lock_timeout_s) == (sock, 1.0)  # at least a second
    broker = store_for(AutoGPU(broker_socket=sock, registry_lock_timeout_s=30))
    assert isinstance(broker, BrokerStore) and broker.lock_timeout_s == 30.0
    # The default socket counts only when it exists.
    Path(brokerclient.DEFAULT_SOCKET).touch()
    broker = store_for(AutoGPU(registry_dir=d, broker_socket=""))
    assert isinstance(broker, BrokerStore)
    assert broker.path == brokerclient.DEFAULT_SOCKET


def test_a_relative_directory_follows_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = AutoGPU(registry_dir="reg", broker_socket="")
    for where in ("a", "b", "a"):
        (tmp_path / where).mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / where)
        store = store_for(settings)
        assert store is not None and store.path == str(tmp_path / where / "reg")


def test_a_view_shows_the_hosts_leases_even_where_this_process_takes_none(
    tmp_path: Path,
) -> None:
    d = str(tmp_path / "registry")
    off = AutoGPU(use_leases=False, registry_dir=d, broker_socket="")
    assert store_for(off) is None
    view = store_for(off, view=True)
    assert isinstance(view, DirectoryStore) and view.path == d
    other = store_for(off, registry_dir=str(tmp_path / "other"), view=True)
    assert isinstance(other, DirectoryStore) and other.path == str(tmp_path / "other")
    assert store_for(off, registry_dir="", view=True) is None


def test_a_store_is_made_once_per_settings_and_each_caller_gets_its_own_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    real = DirectoryStore.__init__

    def counting(self: DirectoryStore, *args: object, **kw: object) -> None:
        made.append(str(args[0]))
        real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(DirectoryStore, "__init__", counting)
    monkeypatch.setattr(factory, "_resolved", {})
    settings = AutoGPU(registry_dir=str(tmp_path / "a"), broker_socket="")
    first = store_for(settings)
    second = store_for(settings)
    assert first is not None and second is not None and first is not second
    assert made == [str(tmp_path / "a")]
    first.unusable_reason = "what one pick saw"
    assert second.unusable_reason is None  # never leaks into another caller's copy
    settings.max_devices_per_user = 2  # a setting it depends on changed: a new store
    third = store_for(settings)
    assert isinstance(third, DirectoryStore) and third.max_devices_per_user == 2
    assert made == [str(tmp_path / "a")] * 2
    monkeypatch.setattr(factory, "_MAX_RESOLVED", 2)
    store_for(AutoGPU(registry_dir=str(tmp_path / "b"), broker_socket=""))  # bounded: cleared
    assert len(factory._resolved) == 1


def test_an_unreachable_broker_falls_back_only_when_the_admin_allows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = str(tmp_path / "broker.sock")
    d = str(tmp_path / "registry")
    strict = store_for(AutoGPU(registry_dir=d, broker_socket=sock, broker_fallback=""))
    assert isinstance(strict, BrokerStore)  # fails closed at its first use
    # The client retries its connection for seconds: a clock that moves only when slept.
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    with caplog.at_level(logging.WARNING, logger="autogpu_jupyter.core.leasing.factory"):
        fallback = store_for(
            AutoGPU(registry_dir=d, broker_socket=sock, broker_fallback=" Registry ")
        )
    assert isinstance(fallback, DirectoryStore) and fallback.path == d
    assert caplog.messages[-1] == (
        f"the lease broker at {sock} cannot be reached (No such file or directory): nothing was "
        f"picked; ask the admin to start it (systemctl enable --now autogpu-broker.socket, or "
        f"`autogpu broker --socket {sock}`), or to set c.AutoGPU.broker_fallback = 'registry'; "
        "using the shared-directory registry (broker_fallback)"
    )


def test_a_reachable_broker_is_used_even_with_the_fallback_set(tmp_path: Path) -> None:
    sock = str(tmp_path / "broker.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock)
    server.listen(1)
    try:
        broker = store_for(AutoGPU(registry_dir=str(tmp_path / "registry"),
                                   broker_socket=sock, broker_fallback="registry"))
    finally:
        server.close()
    assert isinstance(broker, BrokerStore) and broker.path == sock


def test_the_package_names_its_stores_and_factory_and_nothing_else() -> None:
    """``core.leasing`` loads each store and the factory when first named; any other name is
    the usual AttributeError, naming it."""
    from autogpu_jupyter.core import leasing
    from autogpu_jupyter.core.leasing import brokerclient, directory, factory

    assert leasing.DirectoryStore is directory.DirectoryStore
    assert leasing.BrokerStore is brokerclient.BrokerStore
    assert leasing.store_for is factory.store_for
    with pytest.raises(AttributeError) as err:
        leasing.Brokerregistry
    assert str(err.value) == (
        "module 'autogpu_jupyter.core.leasing' has no attribute 'Brokerregistry'")
