"""Every in-process test runs as if no broker were installed on this host.

The lease store takes the broker's default socket (``/run/autogpu/broker.sock``) whenever that
path exists (``core/leasing/factory.py``): on a host that runs a broker, or where a stale socket
was left, every test that picks through a shared-directory registry would otherwise talk to that
broker. The CLI's ``autogpu broker`` commands read the same default (through
``core/leasing/admin.py``). Tests of the default socket point it at their own path
(``test_store_factory.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_broker_of_the_host(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from autogpu_jupyter.core.leasing import brokerclient

    absent = str(Path(tmp_path_factory.getbasetemp()) / "no-broker-here.sock")
    monkeypatch.setattr(brokerclient, "DEFAULT_SOCKET", absent)
