"""The broker's answers that show its state, in-process: a pick's booking view (``begin``: the
caller's own leases, other people's per device, the waiting line), the ``leases`` pages and
their cursor, the ``status`` counts, the live records it keeps once per change, and the small
helpers that shape them (a holder's fields, the view's rows of one device, ``_short``).

A ``Broker`` object with connections made by hand (no socket, no journal), as in
test_broker_rules.py. Each test was seen failing with the bugs named in its docstring planted
by hand (issue 22: survivors of the broker's full mutation run).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerRefusal, Conn
from autogpu_jupyter.brokerd import connections as conn_mod
from autogpu_jupyter.brokerd import ops as ops_mod
from autogpu_jupyter.brokerd import views as views_mod
from autogpu_jupyter.core.leasing.records import encode
from tests.unit.test_broker_rules import broker, person, run

GIB = 1 << 30

CONSTRAINTS = {"min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None,
               "count": 1, "exclude": [], "exclusive": False, "allowed_uuids": None}


def held(b: Broker, conn: Conn, kind: str, *, created_s: float, seq: int = 0,
         devices: tuple[tuple[str, int | None], ...] = (), exclusive: bool = False,
         notebook: str | None = None, command: str | None = None) -> Any:
    """``conn`` holds a lease or ticket made at ``created_s`` (as the ops leave it); the
    record."""
    fields: dict[str, Any] = {
        "device_uuids": [d for d, _ in devices],
        "device_requested_bytes": [n for _, n in devices],
        "exclusive": exclusive, "pid": conn.pid, "kernel_id": None,
        "notebook_path": notebook, "command": command, "holder_kind": "process",
    }
    if kind == "ticket":
        fields.update(seq=seq, constraints=CONSTRAINTS)
    conn.record = replace(ops_mod.make_record(b, conn, kind, fields), created_s=created_s)
    return conn.record


def wire(rec: Any) -> dict[str, Any]:
    """A record as the broker sends and stores it (its encoded bytes, read back)."""
    return json.loads(encode(rec))


def view(b: Broker, conn: Conn) -> dict[str, Any]:
    """What ``begin`` answers ``conn`` (the lock is given back at once)."""
    got = run(b.run_op("begin", conn, {"op": "begin"}))
    b.lock.release(conn)
    return got


# ---- the booking view of a pick --------------------------------------------------------------


def test_the_booking_view_shows_the_persons_own_leases_in_full_and_only_others_per_device(
) -> None:
    """``own`` holds the caller's person's leases with their command line (not its tickets, not
    other people's); ``devices`` holds only other people's leases, one entry per device, each
    with its own rows; no waiter: no ticket shown and none left out. Caught: the own leases
    shown with their command hidden, other people's leases counted as own (``or``, ``!=``),
    the kind compared to anything but "lease" (own tickets or nothing shown), the caller's own
    leases shown per device beside other people's, the devices' rows cached under one key for
    every device (the second device showed the first's rows), and the keys "own" and
    "tickets_not_shown" misspelt."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker()
    me = person(b, 1001)
    mine = held(b, me, "lease", created_s=10.0, devices=(("GPU-m", None),), command="python x")
    b.fleet.backend = SimulatedBackend("demo-4x")
    b.fleet.snapshot()  # four free devices: a ticket taken now is dormant (in no line)
    ticket = held(b, person(b, 1001), "ticket", created_s=11.0, seq=1)
    assert b.book.dormant_tickets() == {ticket.lease_id}
    held(b, person(b, 1002), "lease", created_s=12.0, devices=(("GPU-b", 2 * GIB),),
         notebook="b.ipynb")
    held(b, person(b, 1003), "lease", created_s=13.0, devices=(("GPU-a", GIB),),
         exclusive=True)
    got = view(b, person(b, 1001))
    assert got == {
        "ok": True,
        "own": [wire(mine)],
        "devices": [
            {"uuid": "GPU-a", "rows": [[True, me.pid, GIB, "user1003", f"pid {me.pid}"]],
             "more": {"leases": 0, "exclusive": False, "booked": 0}},
            {"uuid": "GPU-b", "rows": [[False, me.pid, 2 * GIB, "user1002", "b.ipynb"]],
             "more": {"leases": 0, "exclusive": False, "booked": 0}},
        ],
        "tickets": [],
        "tickets_not_shown": 0,
        "reserved": {},
        "max_devices_per_user": 0,
    }
    assert got["own"][0]["command"] == "python x"


def test_the_booking_view_shows_the_waiters_in_line_order_without_their_command_lines() -> None:
    """The line of waiters comes in serving order (arrival number first, not creation time)
    and without command lines, the caller's own ticket's too. Caught: the line left unsorted
    by its key (a TypeError), the command line kept for the caller's own ticket."""
    b = broker()
    me = person(b, 1001)
    first = held(b, person(b, 1002), "ticket", created_s=30.0, seq=1, command="b")
    second = held(b, me, "ticket", created_s=20.0, seq=2, command="mine")
    third = held(b, person(b, 1003), "ticket", created_s=10.0, seq=3, command="c")
    got = view(b, person(b, 1001))
    assert got["tickets"] == [wire(replace(r, command=None))
                              for r in (first, second, third)]
    assert got["tickets_not_shown"] == 0
    assert second.command == "mine"


def three_waiters(b: Broker) -> list[dict[str, Any]]:
    """Three waiters of three people; their payloads as the view shows them, in line order."""
    recs = [held(b, person(b, 1002 + i), "ticket", created_s=10.0 + i, seq=i + 1)
            for i in range(3)]
    return [wire(r) for r in recs]


def test_the_booking_view_shows_waiters_up_to_exactly_its_bytes_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waiters are shown while their JSON sums to at most VIEW_TICKET_BYTES: two of exactly
    that many bytes fit, the third is counted as not shown. Caught: the byte count started at
    1 or compared with ``>=`` (one waiter short), kept only the last waiter's size or
    subtracted (every waiter shown), and the count of those left out added instead of
    subtracted."""
    b = broker()
    shown = three_waiters(b)
    monkeypatch.setattr(views_mod, "VIEW_TICKET_BYTES",
                        len(json.dumps(shown[0])) + len(json.dumps(shown[1])))
    got = view(b, person(b, 1001))
    assert (got["tickets"], got["tickets_not_shown"]) == (shown[:2], 1)


def test_the_booking_view_shows_at_most_view_tickets_waiters_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most VIEW_TICKETS waiters, whatever their bytes. Caught: the cap compared with
    ``>`` (one waiter too many), the two caps joined with ``and`` (the count alone never
    stopped the line), and ``return`` for ``break`` (the view was None: the pick failed)."""
    b = broker()
    shown = three_waiters(b)
    monkeypatch.setattr(views_mod, "VIEW_TICKETS", 2)
    got = view(b, person(b, 1001))
    assert (got["tickets"], got["tickets_not_shown"]) == (shown[:2], 1)


def test_the_rows_of_a_device_are_kept_while_its_leases_stay_the_same() -> None:
    """A second pick on an unchanged state gets the very rows the first computed. Caught: the
    cache never read (looked up under no key, or not at all: the rows computed again)."""
    b = broker()
    held(b, person(b, 1002), "lease", created_s=1.0, devices=(("GPU-a", GIB),))
    me = person(b, 1001)
    first = view(b, me)["devices"][0]
    assert view(b, me)["devices"][0] is first


def test_the_rows_cache_holds_its_size_and_is_cleared_past_it() -> None:
    """Caught: the cache cleared only past one more entry (``>``: it grew one too many), or
    never (it grows with every person and device)."""
    b = broker()
    held(b, person(b, 1002), "lease", created_s=1.0, devices=(("GPU-a", GIB),))
    size = b.ops_cache.SIZE
    b.ops_cache.current = {(f"GPU-old{i}", None): (0, {}) for i in range(size - 1)}
    view(b, person(b, 1001))
    assert len(b.ops_cache.current) == size
    held(b, person(b, 1003), "lease", created_s=2.0, devices=(("GPU-b", GIB),))
    view(b, person(b, 1001))
    assert set(b.ops_cache.current) == {("GPU-b", None, "rows")}


def test_a_devices_rows_put_a_booked_lease_before_an_unbooked_one_and_fold_none_as_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of two shared leases the one that books a byte ranks before an older one that books
    nothing; the leases folded into ``more`` book 0 bytes when they ask none; the place a
    holder is named at is all that follows the user's ": " (a notebook named with ": " kept
    whole). Caught: an unbooked lease ranked as booking 1 byte (it stayed first), the folded
    unbooked leases summed as 1 byte each, the place cut at the last ": "."""
    monkeypatch.setattr(views_mod, "VIEW_ROWS_PER_DEVICE", 2)
    b = broker()
    recs = [
        held(b, person(b, 1002), "lease", created_s=1.0, devices=(("GPU-a", None),),
             notebook="a: b.ipynb"),
        held(b, person(b, 1003), "lease", created_s=2.0, devices=(("GPU-a", 1),)),
        held(b, person(b, 1004), "lease", created_s=3.0, devices=(("GPU-a", None),)),
        held(b, person(b, 1005), "lease", created_s=4.0, devices=(("GPU-a", None),)),
    ]
    assert views_mod.device_rows("GPU-a", recs) == {
        "uuid": "GPU-a",
        "rows": [[False, recs[1].pid, 1, "user1003", f"pid {recs[1].pid}"],
                 [False, recs[0].pid, None, "user1002", "a: b.ipynb"]],
        "more": {"leases": 2, "exclusive": False, "booked": 0},
    }


# ---- the leases pages ------------------------------------------------------------------------


def test_a_leases_page_holds_exactly_page_records_and_points_at_its_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page of PAGE_RECORDS records, its ``next`` the last one's (created_s, id), and the
    total of all. Caught: the cap compared with ``>`` (one record too many), ``next`` taken
    from the page's second record (the third came again on the next page), the key "total"
    misspelt."""
    monkeypatch.setattr(ops_mod, "PAGE_RECORDS", 3)
    b = broker()
    recs = [held(b, person(b, 1001 + i), "lease", created_s=1.0 + i,
                 devices=((f"GPU-{i}", None),)) for i in range(4)]
    page = run(b.run_op("leases", person(b, 0, name="root"), {"op": "leases"}))
    assert page == {"ok": True, "records": [wire(r) for r in recs[:3]],
                    "next": [3.0, recs[2].lease_id], "total": 4}


def test_a_leases_request_for_one_kind_gets_only_that_kind_even_with_tickets_asked() -> None:
    """Caught: the kind "lease" misspelt (a request for leases with ``tickets`` got the
    tickets too)."""
    b = broker()
    rec = held(b, person(b, 1001), "lease", created_s=1.0, devices=(("GPU-a", None),))
    held(b, person(b, 1002), "ticket", created_s=2.0, seq=1)
    page = run(b.run_op("leases", person(b, 0, name="root"),
                           {"op": "leases", "kind": "lease", "tickets": True}))
    assert page == {"ok": True, "records": [wire(rec)], "next": None, "total": 1}


@pytest.mark.parametrize(
    "after", [[1.0, "a", "b"], [1.0], "1.0", ["1", "x"], [True, "x"], [1.0, 5]])
def test_a_leases_cursor_that_is_not_a_time_and_an_id_is_a_usage_error_in_those_words(
    after: Any,
) -> None:
    """Caught: the checks joined with ``and`` where each alone refuses (a cursor of three
    items, a time written as a string, a boolean time or an id that is not a string taken
    on), the refusal's text or kind dropped, misspelt or in other case."""
    b = broker()
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("leases", person(b, 1001), {"op": "leases", "after": after}))
    assert (str(err.value), err.value.kind) == (
        "leases: after: expected [created_s, lease_id]", "UsageErrorBase")


# ---- status ----------------------------------------------------------------------------------


def test_status_past_its_users_ranks_ties_by_name_and_sums_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past _STATUS_USERS people, the largest come first and people of the same size by name;
    the rest are summed in one row. Caught: ties ranked by their counts (dicts compared: a
    TypeError)."""
    monkeypatch.setattr(ops_mod, "_STATUS_USERS", 2)
    b = broker()
    for i, name in enumerate(["dora", "bo", "cy", "al"]):
        held(b, person(b, 1001 + i, name=name), "lease", created_s=1.0 + i,
             devices=((f"GPU-{i}", None),))
    per_user = run(b.run_op("status", person(b, 0, name="root"), {"op": "status"}))["per_user"]
    one = {"leases": 1, "devices": 1, "tickets": 0}
    assert per_user == {"al": one, "bo": one,
                        "(2 more users)": {"leases": 2, "devices": 2, "tickets": 0}}
    assert list(per_user) == ["al", "bo", "(2 more users)"]


# ---- the live records and the helpers --------------------------------------------------------


def test_the_live_records_are_computed_once_per_change_of_the_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The book's index orders the live records once per change, however often a pick reads
    them. Caught: the cache's version compared with its list (never equal: every read sorted
    the records again)."""
    b = broker()
    ordered = b.book.index.ordered
    sorts: list[int] = []
    monkeypatch.setattr(b.book.index, "ordered", lambda: sorts.append(1) or ordered())
    held(b, person(b, 1001), "lease", created_s=1.0, devices=(("GPU-a", None),))
    first = b.book.live()
    assert b.book.live() == first and len(sorts) == 1
    held(b, person(b, 1002), "lease", created_s=2.0, devices=(("GPU-b", None),))
    assert len(b.book.live()) == 2 and len(sorts) == 2


def test_a_ticket_past_the_tickets_per_user_counts_the_persons_tickets_held_elsewhere() -> None:
    """A person waiting on one connection may not wait on a second past
    ``max_tickets_per_user = 1``. Caught: the live tickets misspelt as another kind (no ticket
    counted: the second was admitted)."""
    b = broker(max_tickets_per_user=1)
    held(b, person(b, 1001), "ticket", created_s=1.0, seq=1)
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("ticket", conn, {"op": "ticket", "constraints": CONSTRAINTS}))
    assert (str(err.value), err.value.kind) == (
        "user1001 already waits in line with 1 ticket(s); another would exceed "
        "max_tickets_per_user = 1 set by the admin (enforced by the broker). Wait for one of "
        "them to be served, or cancel it (interrupt the waiting pick).",
        "LeaseLimitError")
    assert conn.record is None


def test_a_device_reserved_away_is_a_pseudo_lease_of_this_host() -> None:
    """Caught: the pseudo-lease made with no host."""
    b = broker(reserved={"GPU-r": ["ml"]})
    [rec] = b.book.reserved_away(person(b, 1001))
    assert (rec.device_uuids, rec.exclusive, rec.host) == (("GPU-r",), True, b.host)


def test_a_holders_fields_keep_text_fields_only_when_text_and_name_a_long_kind_by_40_chars(
) -> None:
    """A holder's kernel id that is not a string is not kept (nor spelt out); an unknown kind
    is named by its first 40 characters. Caught: any value written out as text, the kind
    cut at 41 characters."""
    b = broker()
    conn = person(b, 1001)
    assert ops_mod.holder_fields(b, conn, {"holder": {"kernel_id": 123, "notebook_path": "n.ipynb",
                                              "kind": "kernel"}}) == {
        "pid": conn.pid, "kernel_id": None, "notebook_path": "n.ipynb", "command": None,
        "holder_kind": "kernel"}
    with pytest.raises(BrokerRefusal) as err:
        ops_mod.holder_fields(b, conn, {"holder": {"kind": "k" * 39 + "XYZ"}})
    assert str(err.value) == (
        f"holder.kind '{'k' * 39}X' is not one of process, kernel, cli, provisioner, api")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("x" * 38, '"' + "x" * 38 + '"'),  # 40 characters: kept
        ("x" * 39, '"' + "x" * 36 + "..."),  # 41: cut to 37 and "..."
        (None, "null"),
    ],
)
def test_a_value_named_in_a_message_is_cut_past_40_characters(value: Any, shown: str) -> None:
    """Caught: the cut made at 40 characters already or only past 41, at 38 characters, with
    another mark than "..." (or a TypeError), and never."""
    assert conn_mod._short(value) == shown


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_devices_rows_change_when_a_lease_on_it_is_added() -> None:
    """Mutation run of 2026-12-07 found the rows cache's freshness unpinned (its key read with
    no stamp, or the stamp looked up under no device: the first rows were shown for ever): a
    pick after another person's new lease on the same device shows that lease."""
    b = broker()
    held(b, person(b, 1002), "lease", created_s=1.0, devices=(("GPU-a", GIB),))
    me = person(b, 1001)
    assert [r[3] for r in view(b, me)["devices"][0]["rows"]] == ["user1002"]
    held(b, person(b, 1003), "lease", created_s=2.0, devices=(("GPU-a", 2 * GIB),))
    assert [r[3] for r in view(b, me)["devices"][0]["rows"]] == ["user1003", "user1002"]


def test_a_waiter_that_gave_up_leaves_the_line_shown_to_others() -> None:
    """Mutation run of 2026-12-07 found the book's index of tickets unpinned at a ticket's end
    (the ended ticket was kept as a waiter): a pick after another person gave up waiting shows
    no waiter."""
    b = broker()
    waiter = person(b, 1002)
    held(b, waiter, "ticket", created_s=1.0, seq=1)
    me = person(b, 1001)
    assert len(view(b, me)["tickets"]) == 1
    waiter.record = None  # given up
    got = view(b, me)
    assert (got["tickets"], got["tickets_not_shown"]) == ([], 0)


def test_a_devices_rows_follow_each_lease_that_ends_on_it() -> None:
    """Mutation run of 2026-12-07 found the device's stamp at a lease's end unpinned (set to
    no version, the rows of the next end were taken for current): each end on the device
    shows in the next pick's rows."""
    b = broker()
    me = person(b, 1001)
    others = [person(b, 1002 + i) for i in range(3)]
    for i, other in enumerate(others):
        held(b, other, "lease", created_s=1.0 + i, devices=(("GPU-a", None),))

    def users() -> list[str]:
        return [r[3] for d in view(b, me)["devices"] for r in d["rows"]]

    assert users() == ["user1002", "user1003", "user1004"]
    others[2].record = None
    assert users() == ["user1002", "user1003"]
    others[1].record = None
    assert users() == ["user1002"]
