"""Survivors of the full mutation run (issue 22) in core/: the cluster cache's background refresh,
the overload alternative's constraints (the kernel's own lease), the sampler's seeding from the
server's history, the refusal a closed broker left in the socket, the encoded length of lease
fields, the table narrowing and the waiting line's smoothed load. All in process, no timing:
a concurrent change of the sampler is made from inside ``seed`` by the series mapping itself."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core import overload, session
from autogpu_jupyter.core.cluster import ClusterCache
from autogpu_jupyter.core.decision import served_waiters
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import brokerclient
from autogpu_jupyter.core.leasing.directory import Registry
from autogpu_jupyter.core.leasing.records import _encoded_len
from autogpu_jupyter.core.overload import Alternative
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import METRICS, Sampler, _seed_num
from autogpu_jupyter.core.tables import Column, narrow
from autogpu_jupyter.core.units import parse_size
from tests.unit.test_cluster_cache import URL, Background, Clock, Fetches
from tests.unit.test_decision import dev, empty, ticket_rec
from tests.unit.test_overload import ENV_VARS, U0, U1, _gpu, _snap

GiB = 1024**3

# ---- core.cluster: ClusterCache._refresh ----------------------------------------------------


def test_a_failed_background_refresh_is_logged_with_its_url_and_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Caught: the record's format or either argument lost, reworded or the key's timeout
    named instead of its URL."""
    clock, fetch, background = Clock(), Fetches(interval_s=10.0), Background()
    cache = ClusterCache(background, fetch=fetch, clock=clock)
    cache.get(URL, 5.0)
    clock.now += 6.0
    fetch.fail = RuntimeError("connection refused")
    cache.get(URL, 5.0)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.core.cluster")
    background.run()
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("autogpu_jupyter.core.cluster", logging.DEBUG,
         f"cluster view refresh from {URL} failed: connection refused"),
    ]


def test_a_refresh_fetches_under_the_gate_of_its_own_key() -> None:
    """A caller that needs the same view waits on that gate (and shares the result). Caught:
    the gate kept under ``None``."""
    clock, fetch, background = Clock(), Fetches(interval_s=10.0), Background()
    cache = ClusterCache(background, fetch=fetch, clock=clock)
    key = (URL, 5.0)
    held: list[bool] = []

    def watched(url: str, timeout_s: float) -> Any:
        held.append(cache._fetching[key].locked())
        return fetch(url, timeout_s)

    cache._fetch = watched
    cache.get(URL, 5.0)
    clock.now += 6.0
    cache.get(URL, 5.0)
    background.run()
    assert held == [True, True]
    assert set(cache._fetching) == {key}


def test_a_refresh_of_a_key_never_fetched_before_stores_its_view() -> None:
    """Caught: the gate made ``None`` (no lock: the refresh failed, nothing stored)."""
    clock, fetch = Clock(), Fetches(interval_s=10.0)
    cache = ClusterCache(fetch=fetch, clock=clock)
    cache._refresh((URL, 5.0))
    assert fetch.calls == 1
    assert cache.get(URL, 5.0).view.timestamp_s == 1.0  # the refreshed one, not fetched again
    assert fetch.calls == 1


# ---- core.overload: _own_lease and best_alternative -----------------------------------------


class _Store:
    """A lease store's ``list_leases``, counting the reads."""

    def __init__(self, records: list[Any]) -> None:
        self.records = records
        self.reads = 0

    def list_leases(self) -> list[Any]:
        self.reads += 1
        return self.records


_A = SimpleNamespace(lease_id="aaaa")
_B = SimpleNamespace(lease_id="bbbb")
_NONE_ID = SimpleNamespace(lease_id=None)


def test_own_lease_is_the_picks_lease_else_the_stores_record_by_id() -> None:
    held = SimpleNamespace(lease=SimpleNamespace(record="the held record"), lease_id="bbbb")
    store = _Store([_NONE_ID, _A, _B])
    assert overload._own_lease(held, store) == "the held record"
    assert store.reads == 0
    provisioned = SimpleNamespace(lease=None, lease_id="bbbb")
    assert overload._own_lease(provisioned, store) is _B
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id="aaaa"), store) is _A
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id="cccc"), store) is None
    assert store.reads == 3
    assert overload._own_lease(provisioned, None) is None


@pytest.mark.parametrize("lease_id", [None, ""])
def test_own_lease_without_a_lease_id_reads_no_store(lease_id: str | None) -> None:
    store = _Store([_NONE_ID, SimpleNamespace(lease_id="")])
    assert overload._own_lease(SimpleNamespace(lease=None, lease_id=lease_id), store) is None
    assert store.reads == 0


@pytest.fixture
def _kernel(registry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    session.release()
    yield Registry(registry_dir)
    session.release()


def _own(registry: Registry, device: str, gib: int) -> Any:
    with registry.locked() as txn:
        assert txn is not None
        return txn.create(devices=[device], requested_bytes=gib * GiB)


def _with_u1(used_gib: int) -> FleetSnapshot:
    return _snap(None, _gpu(1, U1, used_gib=used_gib))


def test_a_provisioned_kernels_alternative_needs_what_its_lease_books(
    _kernel: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease the provisioner took (70 GiB on GPU 0), read from the configured store by the
    id passed down: GPU 1 with 40 GiB free is no alternative, with 75 GiB it is. Caught: the
    kernel's constraints asked afresh when given, or never, or without its lease (``None``, no
    choice, no store)."""
    own = _own(_kernel, U0, 70)
    try:
        monkeypatch.setenv("AUTOGPU_PICKED", U0)
        monkeypatch.setenv("AUTOGPU_LEASE_ID", own.record.lease_id)
        assert overload.best_alternative(_with_u1(40), [U0]) is None
        assert overload.best_alternative(_with_u1(5), [U0]) == Alternative(
            U1, "GPU 1", 75 * GiB, 2.0)
        # constraints the caller gives are used as given
        assert overload.best_alternative(
            _with_u1(40), [U0], constraints=Constraints()) == Alternative(
            U1, "GPU 1", 40 * GiB, 2.0)
    finally:
        own.release()


@pytest.mark.parametrize("store", ["config", None])
def test_a_kernels_alternative_needs_what_its_held_lease_books(
    _kernel: Registry, monkeypatch: pytest.MonkeyPatch, store: str | None
) -> None:
    """A pick made in the kernel holds its lease (70 GiB): its record bounds the alternative,
    with the configured store or none. Caught: the held lease's record not looked up (``None``,
    a misspelt ``lease`` or ``record``)."""
    own = _own(_kernel, U0, 70)
    try:
        monkeypatch.setattr(session, "_current", session.Choice(uuids=(U0,), lease=own))
        assert overload.best_alternative(_with_u1(40), [U0], store=store) is None
        assert overload.best_alternative(_with_u1(5), [U0], store=store) == Alternative(
            U1, "GPU 1", 75 * GiB, 2.0)
    finally:
        own.release()


def test_without_a_lease_the_alternative_needs_the_picks_own_options(
    _kernel: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the pick's constraints dropped (``None``) or passed as the lease."""
    choice = session.Choice(uuids=(U0,), constraints=Constraints(min_free=parse_size("50G")))
    monkeypatch.setattr(session, "_current", choice)
    assert overload.best_alternative(_with_u1(40), [U0]) is None
    assert overload.best_alternative(_with_u1(20), [U0]) == Alternative(
        U1, "GPU 1", 60 * GiB, 2.0)


def test_the_processes_the_caller_names_are_the_kernels_own() -> None:
    """The server asks for its kernels: their PIDs, not its own, make an exclusive GPU theirs.
    Caught: ``self_pids`` ignored (this process's PID used)."""
    pid = os.getpid() + 1_000_000
    mine = ProcessSnapshot(pid=pid, used_memory_bytes=GiB)
    b = _gpu(1, U1, compute_mode="EXCLUSIVE_PROCESS", procs=(mine,))
    got = overload.best_alternative(_snap(None, b), [U0], store=None, self_pids=[pid])
    assert got is not None and got.uuid == U1
    assert overload.best_alternative(_snap(None, b), [U0], store=None) is None


# ---- core.decision.served_waiters -----------------------------------------------------------


def test_served_waiters_rank_on_the_smoothed_utilisation() -> None:
    """Caught: the smoothed utilisation not passed on (``None``)."""
    devices = [dev(0, util=0.0), dev(1, util=0.0)]
    t = ticket_rec(1, {})
    assert served_waiters(devices, empty(devices), [t]) == {t.lease_id: ("GPU-0",)}
    assert served_waiters(devices, empty(devices), [t], smoothed_util={"GPU-0": 90.0}) == {
        t.lease_id: ("GPU-1",)}


# ---- core.sampler: _seed_num and Sampler.seed -----------------------------------------------

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"


def _dev(uuid: str, index: int, util: float = 1.0) -> DeviceSnapshot:
    return DeviceSnapshot(index=index, uuid=uuid, name="Fake", utilization_pct=util,
                          memory_used_bytes=0, memory_free_bytes=8 * GiB,
                          memory_total_bytes=8 * GiB)


def _add(s: Sampler, t: float, *uuids: str) -> None:
    s.add(FleetSnapshot(devices=tuple(_dev(u, i) for i, u in enumerate(uuids or (A,))),
                        timestamp_s=t, backend="test"), own=())


@pytest.mark.parametrize(
    ("value", "number"),
    [(3, 3.0), (2.5, 2.5), (math.inf, None), (-math.inf, None), (math.nan, None),
     (True, None), ("4", None), (None, None)],
)
def test_seed_num_keeps_finite_numbers_only(value: object, number: float | None) -> None:
    got = _seed_num(value)
    assert (None if math.isnan(got) else got) == number


def _rows(s: Sampler, uuid: str) -> list[tuple[float, list[float | None]]]:
    series = s.history_series()[uuid]
    return [(t, [None if math.isnan(v) else v for v in row])
            for t, row in zip(series.timestamps_s.tolist(), series.values.tolist(), strict=True)]


def test_seed_fills_every_metric_it_knows_and_marks_a_sample_available() -> None:
    """Whole rows: utilisation, memory used, free (total less used) and total, nothing for
    temperature, power and own memory, ``available`` 1.0 where the utilisation or the memory
    is known. Caught: a device not in the sampler ending the seeding (``break``), the lengths
    of the three lists not all bounding a device's samples, two devices at one timestamp each
    given a row of their own (the first's values lost), ``available`` never, always, inverted,
    2.0 or needing both values, an infinite utilisation kept."""
    s = Sampler(interval_s=1, history_s=100)
    _add(s, 1000.0, A, B, C)
    added = s.seed({
        "GPU-unknown": ([990.0], [5.0], [0], None),
        # A: more values than timestamps; B: fewer utilisations; C: fewer memory values
        A: ([990.0, 991.0, 992.0, 993.0], [10.0, None, None, math.inf, 1.0],
            [GiB, 2 * GiB, None, None, 0], 8 * GiB),
        B: ([990.0, 991.0], [20.0], [3 * GiB, 0], 8 * GiB),
        C: ([990.0, 994.0], [30.0, 31.0], [0], None),
    })
    assert added == 4
    n = None
    assert _rows(s, A)[:4] == [
        (990.0, [10.0, GiB, 7 * GiB, 8 * GiB, n, n, n, 1.0]),
        (991.0, [n, 2 * GiB, 6 * GiB, 8 * GiB, n, n, n, 1.0]),
        (992.0, [n, n, n, 8 * GiB, n, n, n, n]),
        (993.0, [n, n, n, 8 * GiB, n, n, n, n]),
    ]
    assert _rows(s, B)[:2] == [
        (990.0, [20.0, 3 * GiB, 5 * GiB, 8 * GiB, n, n, n, 1.0]),
        (991.0, [n] * len(METRICS)),
    ]
    assert _rows(s, C)[0] == (990.0, [30.0, 0.0, n, n, n, n, n, 1.0])
    assert [t for t, _ in _rows(s, C)] == [990.0, 991.0, 992.0, 993.0, 1000.0]


def test_seed_with_room_for_one_keeps_the_newest_older_sample() -> None:
    """A timestamp equal to the oldest sample's takes no room. Caught: ``t <= oldest`` (the
    room taken by it), and room for one counted as none (before and after reading)."""
    s = Sampler(interval_s=1, history_s=5)  # 6 slots
    for t in (100.0, 101.0, 102.0, 103.0, 104.0):
        _add(s, t)
    assert s.seed({A: ([97.0, 98.0, 99.0, 100.0], [7.0] * 4, [0] * 4, None)}) == 1
    assert s.history_series()[A].timestamps_s.tolist() == [99.0, 100.0, 101.0, 102.0, 103.0,
                                                           104.0]


class _Moving(dict[str, Any]):
    """Series whose reading first changes the sampler: what another thread may do between
    ``seed``'s two looks at the buffer."""

    def __init__(self, data: dict[str, Any], meanwhile: Callable[[], None]) -> None:
        super().__init__(data)
        self._meanwhile = meanwhile

    def items(self) -> Any:
        self._meanwhile()
        return super().items()


# interval 10 s, 50 s of history: 6 slots. The series: 60..95, all within the history.
_OLDER = {A: ([60.0, 70.0, 80.0, 90.0, 95.0], [1.0] * 5, [0] * 5, None)}


def _seeded(samples: list[float], meanwhile: Callable[[Sampler], None]) -> tuple[int, list[float]]:
    s = Sampler(interval_s=10, history_s=50)
    for t in samples:
        _add(s, t)
    added = s.seed(_Moving(_OLDER, lambda: meanwhile(s)))
    return added, s.history_series()[A].timestamps_s.tolist()


@pytest.mark.parametrize(
    ("samples", "meanwhile", "added", "stamps"),
    [
        # another seed put 90 first: only what is older than it, within the room left (3)
        ([100.0, 110.0], lambda s: s.seed({A: ([90.0], [1.0], [0], None)}), 2,
         [70.0, 80.0, 90.0, 100.0, 110.0]),
        # a new sample took one slot: the newest three, the newest sample kept
        ([100.0, 110.0], lambda s: _add(s, 120.0), 3, [80.0, 90.0, 95.0, 100.0, 110.0, 120.0]),
        # new samples filled the buffer: nothing
        ([100.0, 110.0], lambda s: [_add(s, t) for t in (120.0, 130.0, 140.0, 150.0)], 0,
         [100.0, 110.0, 120.0, 130.0, 140.0, 150.0]),
        # a full buffer when first looked at: nothing, though the history grew meanwhile
        ([100.0, 101.0, 102.0, 103.0, 104.0, 105.0], lambda s: s.set_history(100), 0,
         [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]),
    ],
)
def test_seed_keeps_to_the_buffer_as_it_is_when_it_adds(
    samples: list[float], meanwhile: Callable[[Sampler], None], added: int, stamps: list[float]
) -> None:
    """Caught: ``t <= first`` (a timestamp twice), the room counted as capacity plus samples
    (before or after reading: too many kept, the newest sample pushed out), no room taken
    for some (``or True``, ``>= 0``: the newest samples pushed out)."""
    assert _seeded(samples, meanwhile) == (added, stamps)


def test_seed_adds_nothing_when_the_devices_changed_meanwhile() -> None:
    """Caught: the check ``or`` made ``and``, and 1 returned instead of 0."""

    def meanwhile(s: Sampler) -> None:
        for t in range(101, 107):
            _add(s, float(t), A, B)  # the (A,) samples all pushed out
        s.set_history(100)  # and room again

    assert _seeded([100.0], meanwhile) == (0, [float(t) for t in range(101, 107)])


# ---- core.leasing.brokerclient: _Conn._left_behind ------------------------------------------

_MAX = brokerclient._MAX_LINE
_REFUSAL = {"ok": False, "error": "too many connections"}
_LINE = json.dumps(_REFUSAL).encode() + b"\n"


class _Sock:
    """A socket with chunks waiting; reading past them times out (a broker still there)."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.sizes: list[int] = []

    def recv(self, size: int) -> bytes:
        self.sizes.append(size)
        if not self.chunks:
            raise TimeoutError("timed out")
        return self.chunks.pop(0)


def _left(*chunks: bytes) -> tuple[dict[str, Any] | None, int]:
    conn = object.__new__(brokerclient._Conn)
    conn.path = "/run/broker.sock"
    conn.sock = _Sock(*chunks)  # type: ignore[assignment]
    conn._buf = b""
    got = conn._left_behind()
    sizes = conn.sock.sizes  # type: ignore[attr-defined]
    assert set(sizes) <= {65536}
    return got, len(sizes)


_PREFIX = b'{"ok": false, "error": "'


@pytest.mark.parametrize(
    ("chunks", "got", "reads"),
    [
        # a whole line: no waiting for more (it would time out)
        ((_LINE,), _REFUSAL, 1),
        # in two pieces
        ((_LINE[:10], _LINE[10:]), _REFUSAL, 2),
        # the first line only, whatever follows
        ((_LINE + b'{"ok": true}\n',), _REFUSAL, 1),
        # no line end before the broker closed: no whole refusal
        ((_LINE[:-1], b""), None, 2),
        # exactly the longest line without its end: one more read
        ((_PREFIX + b"x" * (_MAX - len(_PREFIX)), b'"}\n'),
         {"ok": False, "error": "x" * (_MAX - len(_PREFIX))}, 2),
        # longer: no more reads
        ((_PREFIX + b"x" * (_MAX + 1 - len(_PREFIX)), b'"}\n'), None, 1),
    ],
)
def test_the_refusal_left_behind_is_one_whole_first_line(
    chunks: tuple[bytes, ...], got: dict[str, Any] | None, reads: int
) -> None:
    """Caught: reading on after a line end (``or``, a misspelt separator: it waited and timed
    out), ``< _MAX_LINE``, 65537 bytes a read, a chunk replacing the buffer, a line without its
    end parsed, the last line taken (``rpartition``) or no line split at all."""
    assert _left(*chunks) == (got, reads)


# ---- core.leasing.records._encoded_len ------------------------------------------------------


@pytest.mark.parametrize(
    "ch", ["a", "X", "~", '"', "\\", "\x80", "\xff", "\u20ac", "\uffff", "\U00010000",
           "\U00010001", "\U0010ffff"],
)
def test_encoded_len_is_the_length_json_dumps_writes(ch: str) -> None:
    """Caught: ``X`` counted as an escaped character, U+0080 and U+10000 on the wrong side."""
    assert _encoded_len(ch) == len(json.dumps(ch)) - 2


# ---- core.tables: _fits and narrow ----------------------------------------------------------

_NAME_ID = [Column("name"), Column("id", drop=1)]
_ROWS = [("abcd", "12345")]  # 4 + 2 + 5 = 11 characters


@pytest.mark.parametrize(
    ("width", "indent", "kept"),
    [(11, None, 2), (10, None, 1), (13, "  ", 2), (12, "  ", 1)],
)
def test_narrow_keeps_a_column_that_fits_exactly(
    width: int, indent: str | None, kept: int
) -> None:
    """No wrap column: nothing more than the cells and one gap between columns. Caught: the
    wrap column's 24 (or 1) counted without one, ``<`` for ``<=``, a gap too many, an indent
    by default, and no wrap column raising ``StopIteration``."""
    kw = {} if indent is None else {"indent": indent}
    cols, rows = narrow(_NAME_ID, _ROWS, width, **kw)
    assert (cols, rows) == (_NAME_ID[:kept], [_ROWS[0][:kept]])


def test_narrow_counts_the_wrap_column_at_24() -> None:
    cols = [Column("name"), Column("why", wrap=True), Column("id", drop=1)]
    rows = [("abcd", "w" * 40, "12345")]
    assert narrow(cols, rows, 4 + 24 + 5 + 4)[0] == cols
    assert narrow(cols, rows, 4 + 24 + 5 + 3)[0] == cols[:2]
