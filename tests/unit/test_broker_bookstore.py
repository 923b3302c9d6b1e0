"""The broker's lease book in memory as a lease store (``brokerd.bookstore.BookStore``), in-process.

The lease-store contract (``tests/processes/test_lease_store_contract.py``) runs every case
against the directory, the broker's client over a real broker process, and the book. The book
needs no process, so its share of the contract runs here too, with the fast tests (issue 42: the
seed-71 mutation sample found ``bookstore`` reached by no fast test): the contract's own cases,
imported, with a fixture that gives the book alone (the same rules: 2 devices, 3 leases and 2
tickets per user). Only the broker's one-message ``pick`` over its socket stays in the process
file. Below them, what the book adds of its own: a holder's words as the broker lists them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig
from autogpu_jupyter.brokerd.bookstore import BookStore
from autogpu_jupyter.core import decision
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing import Requester
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import NoDeviceFitsError
from tests.leasehelpers import fleet
from tests.processes.test_lease_store_contract import (
    Contract,
    G,
)
from tests.processes.test_lease_store_contract import (
    test_a_device_a_waiting_ticket_takes_names_the_ticket as test_a_device_a_waiting_ticket_takes_names_the_ticket,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_a_killed_holder_frees_its_lease_with_no_cleanup as test_a_killed_holder_frees_its_lease_with_no_cleanup,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_a_ticket_counts_the_devices_it_waits_for_against_the_quota as test_a_ticket_counts_the_devices_it_waits_for_against_the_quota,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_a_ticket_keeps_its_model_and_reserves_nothing_of_another as test_a_ticket_keeps_its_model_and_reserves_nothing_of_another,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_a_user_holds_at_most_two_tickets as test_a_user_holds_at_most_two_tickets,
)
from tests.processes.test_lease_store_contract import (
    test_a_view_hides_only_the_callers_own_leases as test_a_view_hides_only_the_callers_own_leases,
)
from tests.processes.test_lease_store_contract import (
    test_an_exclusive_lease_keeps_every_other_lease_off as test_an_exclusive_lease_keeps_every_other_lease_off,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_release_ends_a_lease_at_once_and_twice_is_harmless as test_release_ends_a_lease_at_once_and_twice_is_harmless,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_set_pid_names_the_process_that_uses_the_device as test_set_pid_names_the_process_that_uses_the_device,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_the_quota_counts_distinct_devices_and_leases as test_the_quota_counts_distinct_devices_and_leases,  # noqa: E501
)
from tests.processes.test_lease_store_contract import (
    test_the_waiting_line_is_served_in_arrival_order as test_the_waiting_line_is_served_in_arrival_order,  # noqa: E501
)


def book(tmp_path: Path, **config: Any) -> Contract:
    """The book of a broker over a 4-GPU fleet, under the contract's rules."""
    (tmp_path / "fleet.json").write_text(json.dumps(fleet(4)))
    broker = Broker(BrokerConfig(socket_path=str(tmp_path / "none.sock"),
                                 max_devices_per_user=2, max_leases_per_user=3,
                                 max_tickets_per_user=2, **config))
    broker.fleet.backend = SimulatedBackend(str(tmp_path / "fleet.json"))
    return Contract("book", BookStore(broker), tmp_path / "fleet.json")


@pytest.fixture
def contract(tmp_path: Path) -> Iterator[Contract]:
    """The book alone (the contract's own fixture gives three stores)."""
    c = book(tmp_path)
    yield c
    assert c.live_ids() == set(), "a test left a lease or ticket behind"


def test_the_book_lists_each_holder_as_its_requester_named_it(tmp_path: Path) -> None:
    contract = book(tmp_path, record_commands=True)
    store = contract.store
    assert isinstance(store, BookStore)
    with contract.lease(G[0], exclusive=True, kernel_id="k1", notebook_path="train.ipynb",
                        command="python train.py", kind="kernel") as held:
        (listed,) = store.list_leases()
        assert (listed.lease_id, listed.kernel_id, listed.notebook_path, listed.command) == (
            held.record.lease_id, "k1", "train.ipynb", "python train.py")
        assert [r.lease_id for r in store.scan().live] == [held.record.lease_id]
        with pytest.raises(NoDeviceFitsError) as err:
            contract.lease(G[0])
        assert str(err.value) == (f"no device free: {G[0]} is held exclusively by "
                                  f"{store.user}: train.ipynb")
    assert store.list_leases() == [] and store.scan().live == []


def test_a_lease_is_shared_unless_asked_and_a_ticket_keeps_its_wish_and_its_requester(
    contract: Contract,
) -> None:
    """What a caller of the store's interface leaves out or asks is what the book records: a
    lease made without ``exclusive`` is shared (a second one on its device is granted); a
    ticket asked exclusive, for a kernel, is listed so, among the tickets only; the store
    names itself ``book:``. Mutation run of 2026-12-07 (seed 71) found these unpinned."""
    store = contract.store
    assert store.path == "book:"
    with store.locked() as txn:
        assert txn is not None
        first = txn.create(devices=[G[1]])
    with first, contract.lease(G[1]) as second:
        assert not first.record.exclusive and not second.record.exclusive
        held = store.take_ticket(constraints=decision.ticket_constraints(Constraints(), None),
                                 exclusive=True,
                                 requester=Requester(kernel_id="k9", notebook_path="w.ipynb"))
        assert held is not None
        with held as waiting:
            assert {r.lease_id for r in store.list_leases()} == {
                first.record.lease_id, second.record.lease_id}
            (ticket,) = [r for r in store.list_leases(include_tickets=True)
                         if r.kind == "ticket"]
            assert (ticket.lease_id, ticket.exclusive, ticket.kernel_id, ticket.notebook_path) \
                == (waiting.record.lease_id, True, "k9", "w.ipynb")
