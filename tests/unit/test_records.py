"""The lease/ticket record format: what a reader accepts, refuses (and why), what a writer stores.

Pure functions over bytes: every case is (record -> exact record read, or exact refusal).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from autogpu_jupyter.core.leasing import records
from autogpu_jupyter.core.leasing.records import (
    Invalid,
    LeaseRecord,
    _encoded_len,
    capped_text,
    encode,
    field_text,
    parse_checked,
    parse_record,
    record_from_fields,
)

LID = "0123456789abcdef"
U0 = "GPU-aaaa"
U1 = "GPU-bbbb"


def lease_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "version": 1,
        "kind": "lease",
        "lease_id": LID,
        "device_uuids": [U0],
        "device_requested_bytes": [None],
        "exclusive": False,
        "user": "alice",
        "uid": 1000,
        "host": "h1",
        "pid": 42,
        "created_s": 12.5,
        "kernel_id": None,
        "notebook_path": None,
        "command": None,
        "holder_kind": "process",
    }
    d.update(over)
    return d


def constraints_dict(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "min_free_bytes": None,
        "min_free_fraction": None,
        "max_util_pct": None,
        "count": 1,
        "exclude": [],
        "exclusive": False,
        "allowed_uuids": None,
    }
    c.update(over)
    return c


def ticket_dict(**over: Any) -> dict[str, Any]:
    d = lease_dict(kind="ticket", device_uuids=[], device_requested_bytes=[], seq=3)
    d["constraints"] = constraints_dict()
    d.update(over)
    return d


def raw(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


def refusal(data: bytes, kind: str = "lease") -> str:
    with pytest.raises(Invalid) as err:
        parse_record(data, kind=kind, path="/p", live=True)
    return str(err.value)


def test_a_valid_lease_reads_back_every_field() -> None:
    data = raw(
        lease_dict(
            device_uuids=[U0, U1],
            device_requested_bytes=[5, None],
            exclusive=True,
            kernel_id="k" * 20,
            notebook_path="nb.ipynb",
            command="python\tx\x01",
            created_s=7,
        )
    )
    rec = parse_record(data, kind="lease", path="/r/x.lease", live=False)
    assert rec == LeaseRecord(
        lease_id=LID,
        kind="lease",
        device_uuids=(U0, U1),
        device_requested_bytes=(5, None),
        exclusive=True,
        user="alice",
        uid=1000,
        host="h1",
        pid=42,
        created_s=7.0,
        kernel_id="k" * 20,
        notebook_path="nb.ipynb",
        command="python?x?",
        holder_kind="process",
        seq=None,
        constraints=None,
        live=False,
        path="/r/x.lease",
    )
    assert type(rec.created_s) is float


def test_a_valid_ticket_reads_seq_and_constraints() -> None:
    cons = constraints_dict(
        min_free_bytes=10,
        min_free_fraction=0.5,
        max_util_pct=100,
        count=64,
        exclude=["x" * 128],
        exclusive=True,
        allowed_uuids=[U0],
    )
    rec = parse_record(
        raw(ticket_dict(seq=records.MAX_SEQ, constraints=cons)),
        kind="ticket",
        path="/t",
        live=True,
    )
    assert rec.kind == "ticket"
    assert rec.seq == 2**53 - 1
    assert rec.constraints == cons
    assert rec.device_uuids == ()


def test_optional_text_fields_may_be_missing() -> None:
    d = lease_dict()
    for key in ("kernel_id", "notebook_path", "command"):
        del d[key]
    rec = parse_record(raw(d), kind="lease", path="", live=True)
    assert (rec.kernel_id, rec.notebook_path, rec.command) == (None, None, None)


def test_boundary_values_are_accepted() -> None:
    d = lease_dict(
        lease_id="f" * 64,
        device_uuids=[f"G{i}" for i in range(64)],
        device_requested_bytes=[0] + [2**62 - 1] * 63,
        uid=0,
        pid=1,
        user="u" * 4096,
        holder_kind="h" * 32,
        host="",
    )
    d["device_uuids"][1] = "A" + "b" * 127
    rec = parse_record(raw(d), kind="lease", path="", live=True)
    assert rec.uid == 0
    assert rec.pid == 1
    assert len(rec.device_uuids) == 64
    assert rec.requested_bytes == 2**62 - 1
    big = parse_record(raw(lease_dict(uid=2**63 - 1)), kind="lease", path="", live=True)
    assert big.uid == 2**63 - 1


def test_constraint_boundaries_are_accepted() -> None:
    for cons in (
        constraints_dict(min_free_fraction=0, max_util_pct=0, min_free_bytes=0),
        constraints_dict(min_free_fraction=1, max_util_pct=100.0),
        constraints_dict(exclude=["G"] * 64, allowed_uuids=["G"] * 64),
    ):
        rec = parse_record(raw(ticket_dict(constraints=cons)), kind="ticket", path="", live=True)
        assert rec.constraints == cons
    rec = parse_record(raw(ticket_dict(seq=0)), kind="ticket", path="", live=True)
    assert rec.seq == 0


LEASE_REFUSALS = [
    (b"\xff{}", "not valid JSON (UnicodeDecodeError)"),
    (b"{", "not valid JSON (JSONDecodeError)"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON (RecursionError)"),
    (b"[1]", "not a JSON object"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"' + b"k" * 50 + b'": 1, "' + b"k" * 50 + b'": 2}', f"duplicate key {'k' * 40!r}"),
    (b'{"a": NaN}', "non-finite number NaN"),
    (b'{"a": -Infinity}', "non-finite number -Infinity"),
    (b'{"a": "\\ud800"}', "a lone surrogate (not valid Unicode text)"),
    (raw(lease_dict(z=1, y=2, x=3, w=4, v=5, u=6)), "unexpected keys ['u', 'v', 'w', 'x', 'y']"),
    (raw(lease_dict(seq=1)), "unexpected keys ['seq']"),
    (
        raw({k: v for k, v in lease_dict().items() if k not in ("pid", "host", "kernel_id")}),
        "missing keys ['host', 'pid']",
    ),
    (raw(lease_dict(version=2)), "unknown version 2"),
    (raw(lease_dict(version="v" * 30)), f"unknown version {'v' * 20}"),
    (raw(lease_dict(kind="ticket")), "kind 'ticket' in a lease file"),
    (raw(lease_dict(kind="t" * 30)), f"kind {'t' * 20!r} in a lease file"),
    (raw(lease_dict(lease_id=5)), "lease_id: expected a string of at most 4096 characters"),
    (raw(lease_dict(lease_id="0123456789ABCDEF")), "lease_id: expected 16-64 lowercase hex digits"),
    (raw(lease_dict(lease_id="0" * 15)), "lease_id: expected 16-64 lowercase hex digits"),
    (raw(lease_dict(lease_id="0" * 65)), "lease_id: expected 16-64 lowercase hex digits"),
    (raw(lease_dict(lease_id="x" + LID)), "lease_id: expected 16-64 lowercase hex digits"),
    (raw(lease_dict(lease_id=LID + "x")), "lease_id: expected 16-64 lowercase hex digits"),
    (
        raw(lease_dict(device_uuids="GPU-a")),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_uuids=[], device_requested_bytes=[])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(
            lease_dict(
                device_uuids=[f"G{i}" for i in range(65)], device_requested_bytes=[None] * 65
            )
        ),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_uuids=[U0, U0], device_requested_bytes=[None, None])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (raw(lease_dict(device_uuids=[1])), "device_uuids: expected a list of distinct device UUIDs"),
    (
        raw(lease_dict(device_uuids=["-GPU"])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_uuids=["G" * 129])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_uuids=["GPU a"])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_uuids=["GPU-a!"])),
        "device_uuids: expected a list of distinct device UUIDs",
    ),
    (
        raw(lease_dict(device_requested_bytes=None)),
        "device_requested_bytes: expected one entry per device",
    ),
    (
        raw(lease_dict(device_requested_bytes=[None, None])),
        "device_requested_bytes: expected one entry per device",
    ),
    (
        raw(lease_dict(device_requested_bytes=[-1])),
        "device_requested_bytes: expected byte counts or null",
    ),
    (
        raw(lease_dict(device_requested_bytes=[2**62])),
        "device_requested_bytes: expected byte counts or null",
    ),
    (
        raw(lease_dict(device_requested_bytes=[True])),
        "device_requested_bytes: expected byte counts or null",
    ),
    (
        raw(lease_dict(device_requested_bytes=[1.0])),
        "device_requested_bytes: expected byte counts or null",
    ),
    (raw(lease_dict(exclusive=1)), "exclusive: expected true or false"),
    (raw(lease_dict(created_s="1")), "created_s: expected a number"),
    (raw(lease_dict(created_s=True)), "created_s: expected a number"),
    (
        raw(lease_dict(created_s=1e400)).replace(b"Infinity", b"1e400"),
        "created_s: expected a number",
    ),
    (
        raw(lease_dict(holder_kind=None)),
        "holder_kind: expected a string of at most 4096 characters",
    ),
    (raw(lease_dict(holder_kind="h" * 33)), "holder_kind: too long"),
    (raw(lease_dict(command=7)), "command: expected a string of at most 4096 characters"),
    (raw(lease_dict(command="c" * 4097)), "command: expected a string of at most 4096 characters"),
    (raw(lease_dict(user="u" * 4097)), "user: expected a string of at most 4096 characters"),
    (raw(lease_dict(user="a\nb")), "user: control characters"),
    (raw(lease_dict(user="a\x7f")), "user: control characters"),
    (raw(lease_dict(user=None)), "user: expected a string of at most 4096 characters"),
    (raw(lease_dict(uid=-1)), "uid: expected an integer from 0 to 9223372036854775807"),
    (raw(lease_dict(uid=2**63)), "uid: expected an integer from 0 to 9223372036854775807"),
    (raw(lease_dict(uid=True)), "uid: expected an integer from 0 to 9223372036854775807"),
    (raw(lease_dict(uid=None)), "uid: expected an integer from 0 to 9223372036854775807"),
    (raw(lease_dict(uid="1")), "uid: expected an integer from 0 to 9223372036854775807"),
    (raw(lease_dict(host=1)), "host: expected a string of at most 4096 characters"),
    (raw(lease_dict(host="\x00")), "host: control characters"),
    (raw(lease_dict(pid=0)), "pid: expected an integer from 1 to 9223372036854775807"),
    (raw(lease_dict(kernel_id=3)), "kernel_id: expected a string of at most 4096 characters"),
    (raw(lease_dict(kernel_id="a\tb")), "kernel_id: control characters"),
    (
        raw(lease_dict(notebook_path=[])),
        "notebook_path: expected a string of at most 4096 characters",
    ),
    (raw(lease_dict(notebook_path="a\rb")), "notebook_path: control characters"),
]


@pytest.mark.parametrize(("data", "message"), LEASE_REFUSALS)
def test_a_lease_record_is_refused_with_its_reason(data: bytes, message: str) -> None:
    assert refusal(data) == message


CKEYS = (
    "['allowed_uuids', 'count', 'exclude', 'exclusive', 'max_util_pct', 'min_free_bytes', "
    "'min_free_fraction'] and optionally ['models', 'prefer']"
)
TICKET_REFUSALS = [
    (ticket_dict(kind="lease"), "kind 'lease' in a ticket file"),
    ({k: v for k, v in ticket_dict().items() if k != "seq"}, "missing keys ['seq']"),
    (ticket_dict(seq=-1), "seq: expected an integer from 0 to 9007199254740991"),
    (ticket_dict(seq=2**53), "seq: expected an integer from 0 to 9007199254740991"),
    (ticket_dict(seq=None), "seq: expected an integer from 0 to 9007199254740991"),
    (ticket_dict(constraints=[]), f"constraints: expected the keys {CKEYS}"),
    (
        ticket_dict(constraints={**constraints_dict(), "x": 1}),
        f"constraints: expected the keys {CKEYS}",
    ),
    (
        ticket_dict(constraints=constraints_dict(min_free_bytes=-1)),
        "min_free_bytes: expected an integer from 0 to 9223372036854775807",
    ),
    (
        ticket_dict(constraints=constraints_dict(min_free_fraction=1.5)),
        "constraints.min_free_fraction: expected a number in [0, 1] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(min_free_fraction=-0.1)),
        "constraints.min_free_fraction: expected a number in [0, 1] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(min_free_fraction=True)),
        "constraints.min_free_fraction: expected a number in [0, 1] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(min_free_fraction="0.5")),
        "constraints.min_free_fraction: expected a number in [0, 1] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(max_util_pct=101)),
        "constraints.max_util_pct: expected a number in [0, 100] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(max_util_pct=-1)),
        "constraints.max_util_pct: expected a number in [0, 100] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(max_util_pct=False)),
        "constraints.max_util_pct: expected a number in [0, 100] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(max_util_pct="5")),
        "constraints.max_util_pct: expected a number in [0, 100] or null",
    ),
    (
        ticket_dict(constraints=constraints_dict(count=0)),
        "count: expected an integer from 1 to 9223372036854775807",
    ),
    (
        ticket_dict(constraints=constraints_dict(count=None)),
        "count: expected an integer from 1 to 9223372036854775807",
    ),
    (ticket_dict(constraints=constraints_dict(count=65)), "constraints.count: too large"),
    (
        ticket_dict(constraints=constraints_dict(exclusive=None)),
        "constraints.exclusive: expected true or false",
    ),
    (
        ticket_dict(constraints=constraints_dict(exclude=None)),
        "constraints.exclude: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(exclude=["G"] * 65)),
        "constraints.exclude: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(exclude=["x" * 129])),
        "constraints.exclude: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(exclude=[1])),
        "constraints.exclude: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(exclude=["a\x1fb"])),
        "constraints.exclude: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(allowed_uuids="G")),
        "constraints.allowed_uuids: expected a short list of device ids",
    ),
    (
        ticket_dict(constraints=constraints_dict(allowed_uuids=["G"] * 65)),
        "constraints.allowed_uuids: expected a short list of device ids",
    ),
    *(
        (ticket_dict(constraints=constraints_dict(**{key: bad})),
         f"constraints.{key}: expected a short list of model names")
        for key in ("models", "prefer")
        for bad in ("A100", None, ["A100"] * 65, ["x" * 65], [""], [1], ["A\x1f100"])
    ),
]


@pytest.mark.parametrize(("d", "message"), TICKET_REFUSALS)
def test_a_ticket_record_is_refused_with_its_reason(d: dict[str, Any], message: str) -> None:
    assert refusal(raw(d), kind="ticket") == message


def test_a_ticket_keeps_its_models_and_preferences_and_reads_without_them() -> None:
    """Issue 39: a ticket's request keeps ``models`` and ``prefer``; a ticket written before
    (without them) still reads, as "any model"."""
    full = constraints_dict(models=["A100", "H100"], prefer=["H100"])
    rec = parse_record(raw(ticket_dict(constraints=full)), kind="ticket", path="", live=True)
    assert rec.constraints == full
    old = parse_record(raw(ticket_dict()), kind="ticket", path="", live=True)
    assert old.constraints == constraints_dict()


def test_a_ticket_needs_no_devices_but_a_lease_does() -> None:
    rec = parse_record(raw(ticket_dict()), kind="ticket", path="", live=True)
    assert rec.device_uuids == ()


# --- the record object -------------------------------------------------------------------------


def make(**over: Any) -> LeaseRecord:
    base: dict[str, Any] = dict(
        lease_id=LID,
        kind="lease",
        device_uuids=(U0, U1),
        device_requested_bytes=(None, None),
        exclusive=False,
        user="bob",
        uid=7,
        host="h",
        pid=99,
        created_s=1.5,
    )
    base.update(over)
    return LeaseRecord(**base)


@pytest.mark.parametrize(
    ("booked", "most", "on0", "on1"),
    [
        ((None, None), None, None, None),
        ((3, None), 3, 3, None),
        ((2, 9), 9, 2, 9),
        ((0, None), 0, 0, None),
    ],
)
def test_requested_bytes_is_the_largest_booking(booked, most, on0, on1) -> None:
    rec = make(device_requested_bytes=booked)
    assert rec.requested_bytes == most
    assert rec.requested_on(U0) == on0
    assert rec.requested_on(U1) == on1
    assert rec.requested_on("GPU-other") is None


@pytest.mark.parametrize(
    ("over", "text"),
    [
        ({"notebook_path": "a.ipynb", "kernel_id": "1a2b3c4d5e6f"}, "bob: a.ipynb"),
        ({"kernel_id": "1a2b3c4d5e6f"}, "bob: kernel 1a2b3c4d"),
        ({}, "bob: pid 99"),
    ],
)
def test_holder_text_names_the_notebook_then_kernel_then_pid(over, text) -> None:
    assert make(**over).holder_text() == text


def test_to_dict_hides_the_command_unless_asked() -> None:
    rec = make(
        device_requested_bytes=(4, None),
        command="python x",
        kernel_id="k",
        notebook_path="n",
        holder_kind="kernel",
        live=False,
        path="/p",
    )
    expected = {
        "lease_id": LID,
        "kind": "lease",
        "device_uuids": [U0, U1],
        "device_requested_bytes": [4, None],
        "requested_bytes": 4,
        "exclusive": False,
        "user": "bob",
        "uid": 7,
        "host": "h",
        "pid": 99,
        "created_s": 1.5,
        "kernel_id": "k",
        "notebook_path": "n",
        "command": None,
        "holder_kind": "kernel",
        "seq": None,
        "live": False,
        "path": "/p",
    }
    assert rec.to_dict() == expected
    assert rec.to_dict(redact_command=False) == {**expected, "command": "python x"}


def test_encode_writes_compact_json_of_the_schema_for_a_lease() -> None:
    rec = make(command="c", seq=5, constraints={"count": 1})
    assert encode(rec) == (
        b'{"version":1,"kind":"lease","lease_id":"0123456789abcdef",'
        b'"device_uuids":["GPU-aaaa","GPU-bbbb"],"device_requested_bytes":[null,null],'
        b'"exclusive":false,"user":"bob","uid":7,"host":"h","pid":99,"created_s":1.5,'
        b'"kernel_id":null,"notebook_path":null,"command":"c","holder_kind":"process"}'
    )


def test_encode_of_a_ticket_adds_seq_and_constraints_and_reads_back() -> None:
    rec = make(kind="ticket", seq=4, constraints=None, device_uuids=(), device_requested_bytes=())
    data = encode(rec)
    assert json.loads(data)["seq"] == 4
    assert json.loads(data)["constraints"] == {}
    cons = constraints_dict(count=2)
    rec2 = make(kind="ticket", seq=4, constraints=cons, device_uuids=(), device_requested_bytes=())
    back = parse_record(encode(rec2), kind="ticket", path="/t", live=True)
    assert back == replace_path(rec2, "/t")


def replace_path(rec: LeaseRecord, path: str) -> LeaseRecord:
    import dataclasses

    return dataclasses.replace(rec, path=path)


@pytest.mark.parametrize(
    ("value", "limit", "text"),
    [
        (None, 10, None),
        ("plain", 4096, "plain"),
        ("a\tb\x7fc", 4096, "a?b?c"),
        ("x\udcffy", 4096, "x\\udcffy"),
        ("abcdef", 3, "abc"),
        (12, 4096, "12"),
    ],
)
def test_field_text_is_what_every_reader_accepts(value, limit, text) -> None:
    assert field_text(value, limit) == text


def test_field_text_caps_at_the_readers_limit_by_default() -> None:
    assert field_text("y" * 5000) == "y" * 4096


@pytest.mark.parametrize(
    ("value", "field", "text"),
    [
        (None, "notebook_path", None),
        ("k" * 100, "kernel_id", "k" * 64),
        ("\U0001f600" * 100, "kernel_id", "\U0001f600" * 5),  # 12 escaped bytes each
        ("\u00e9" * 100, "kernel_id", "\u00e9" * 10),  # 6 each
        ('"' * 100, "kernel_id", '"' * 32),  # 2 each
        ("\\" * 100, "kernel_id", "\\" * 32),
        ("a" * 63 + "\u00e9", "kernel_id", "a" * 63),  # the 6 bytes would pass the cap
        ("a" * 58 + "\u00e9", "kernel_id", "a" * 58 + "\u00e9"),  # exactly 64
        ("n\tb" * 1000, "notebook_path", "n?b" * 341 + "n"),
        ("x\udcffy", "notebook_path", "x\\udcffy"),
    ],
)
def test_capped_text_cuts_at_the_fields_cap_in_encoded_bytes(value, field, text) -> None:
    got = capped_text(value, field)
    assert got == text
    if got is not None:
        assert len(json.dumps(got)) - 2 <= records.FIELD_CAPS[field]


def test_the_field_caps_are_named_for_every_free_text_field() -> None:
    assert records.FIELD_CAPS == {"notebook_path": 1024, "kernel_id": 64, "command": 1024,
                                  "user": 256, "host": 256, "holder_kind": 32}
    assert records.MAX_ID_LIST == 64


# --- ownership checks and the cache -----------------------------------------------------------


def checked(data: bytes, **over: Any) -> LeaseRecord:
    args: dict[str, Any] = dict(
        kind="lease", name=LID + ".lease", path="/r/a", dir_uid=1000, real_user="alice", live=True
    )
    args.update(over)
    return parse_checked(data, **args)


def checked_refusal(data: bytes, **over: Any) -> str:
    with pytest.raises(Invalid) as err:
        checked(data, **over)
    return str(err.value)


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    records._RECORD_CACHE.clear()


def test_parse_checked_accepts_a_record_owned_by_its_uid() -> None:
    rec = checked(raw(lease_dict()))
    assert (rec.uid, rec.path, rec.live) == (1000, "/r/a", True)


def test_a_record_claiming_another_uid_is_forged() -> None:
    assert checked_refusal(raw(lease_dict(uid=0))) == (
        "forged: record says uid 0, file owned by uid 1000"
    )


@pytest.mark.parametrize("name", [LID + ".ticket", "ffffffffffffffff.lease", LID])
def test_a_lease_file_named_for_another_id_is_forged(name: str) -> None:
    assert checked_refusal(raw(lease_dict()), name=name) == (
        "forged: file name does not match its lease id"
    )


def test_a_ticket_file_must_end_in_ticket() -> None:
    data = raw(ticket_dict())
    assert checked(data, kind="ticket", name=LID + ".ticket").seq == 3
    assert checked_refusal(data, kind="ticket", name=LID + ".lease") == (
        "forged: file name does not match its lease id"
    )


def test_a_record_naming_another_user_is_forged() -> None:
    data = raw(lease_dict(user="mallory" + "m" * 50))
    assert checked_refusal(data) == (
        f"forged: record says user {('mallory' + 'm' * 50)[:40]!r}, uid 1000 is alice"
    )


def test_a_uid_without_a_user_name_accepts_any_user_field() -> None:
    rec = checked(raw(lease_dict(user="whoever")), real_user="1000")
    assert rec.user == "whoever"


def test_a_cached_record_gets_this_reads_path_and_liveness() -> None:
    data = raw(lease_dict())
    first = checked(data, path="/one", live=True)
    assert len(records._RECORD_CACHE) == 1
    second = checked(data, path="/two", live=False)
    assert (first.path, first.live) == ("/one", True)
    assert (second.path, second.live) == ("/two", False)
    assert checked(data, path="/one", live=True) is first


def test_a_cached_record_is_still_checked_against_its_owner() -> None:
    data = raw(lease_dict())
    checked(data)
    assert checked_refusal(data, dir_uid=1001, real_user="bob") == (
        "forged: record says uid 1000, file owned by uid 1001"
    )


def test_refused_and_big_records_are_not_cached() -> None:
    checked_refusal(raw(lease_dict(uid=1)))
    assert records._RECORD_CACHE == {}
    big = lease_dict(command="c" * 3000)
    checked(raw(big))
    assert records._RECORD_CACHE == {}
    edge = lease_dict(command="")
    pad = records._RECORD_CACHE_ENTRY_MAX - len(raw(edge))
    edge["command"] = "c" * pad
    assert len(raw(edge)) == records._RECORD_CACHE_ENTRY_MAX
    checked(raw(edge))
    assert len(records._RECORD_CACHE) == 1


def test_the_cache_is_emptied_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "_RECORD_CACHE_MAX", 2)
    for pid in (1, 2):
        checked(raw(lease_dict(pid=pid)))
    assert len(records._RECORD_CACHE) == 2
    checked(raw(lease_dict(pid=3)))
    assert [k[0] for k in records._RECORD_CACHE] == [raw(lease_dict(pid=3))]


def test_a_record_one_byte_over_the_cache_entry_limit_is_not_cached() -> None:
    edge = lease_dict(command="")
    edge["command"] = "c" * (records._RECORD_CACHE_ENTRY_MAX + 1 - len(raw(edge)))
    assert len(raw(edge)) == 2049
    checked(raw(edge))
    assert records._RECORD_CACHE == {}


@pytest.mark.parametrize(("path", "live"), [("/two", True), ("/one", False)])
def test_a_cached_record_differing_only_in_path_or_liveness_is_updated(path, live) -> None:
    data = raw(lease_dict())
    checked(data, path="/one", live=True)
    again = checked(data, path=path, live=live)
    assert (again.path, again.live) == (path, live)


def test_a_record_with_fewer_bookings_than_devices_books_nothing_on_the_rest() -> None:
    rec = make(device_requested_bytes=(5,))
    assert rec.requested_on(U0) == 5
    assert rec.requested_on(U1) is None
    assert rec.requested_on("GPU-other") is None


def test_a_lone_surrogate_in_a_nested_value_is_refused() -> None:
    assert refusal(raw(lease_dict(user="x")).replace(b'"x"', b'"\\udc80"')) == (
        "a lone surrogate (not valid Unicode text)"
    )


@pytest.mark.parametrize(
    ("text", "limit", "cut"),
    [("abc", 2, "ab"), ("abc", 5, "abc"), ("\u00e9\u00e9", 11, "\u00e9"),
     ("\u00e9\u00e9", 12, "\u00e9\u00e9"), ('a"b', 2, "a"), ('a"b', 3, 'a"'), ("", 4, "")],
)
def test_cut_encoded_keeps_the_longest_start_that_fits(text: str, limit: int, cut: str) -> None:
    assert records.cut_encoded(text, limit) == cut


# ---- records a writer built (the broker): record_from_fields --------------------------------


def from_fields(d: dict[str, Any], kind: str = "lease") -> LeaseRecord:
    return record_from_fields(d, kind=kind, path="/p", live=True)


def from_fields_refusal(d: dict[str, Any], kind: str = "lease") -> str:
    with pytest.raises(Invalid) as err:
        from_fields(d, kind)
    return str(err.value)


@pytest.mark.parametrize(
    ("d", "kind"),
    [
        (lease_dict(), "lease"),
        (lease_dict(notebook_path="caf\u00e9 \U0001f600.ipynb", command="a\tb"), "lease"),
        (ticket_dict(constraints=constraints_dict(exclude=["GPU-\u00e9"])), "ticket"),
    ],
)
def test_a_built_record_is_the_record_its_bytes_parse_to(d: dict[str, Any], kind: str) -> None:
    assert from_fields(d, kind) == parse_record(raw(d), kind=kind, path="/p", live=True)


def _as_the_broker_reads(data: bytes) -> Any:
    """A message's JSON as the broker's reader takes it: NaN, repeated keys and lone
    surrogates all pass ``json.loads``."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


#: The refusals of LEASE_REFUSALS that a dict of fields can carry too: not the bytes that are no
#: JSON object, nor a repeated key (no dict can repeat one).
BUILT_LEASE_REFUSALS = [
    (data, message) for data, message in LEASE_REFUSALS
    if isinstance(_as_the_broker_reads(data), dict) and not message.startswith("duplicate key")
]


def test_only_the_bytes_only_refusals_are_left_out_of_the_built_ones() -> None:
    assert [m for d, m in LEASE_REFUSALS if (d, m) not in BUILT_LEASE_REFUSALS] == [
        "not valid JSON (UnicodeDecodeError)", "not valid JSON (JSONDecodeError)",
        "not valid JSON (RecursionError)", "not a JSON object", "duplicate key 'a'",
        f"duplicate key {'k' * 40!r}"]


@pytest.mark.parametrize(("data", "message"), BUILT_LEASE_REFUSALS)
def test_a_built_lease_is_refused_where_its_bytes_are(data: bytes, message: str) -> None:
    from_fields_refusal(_as_the_broker_reads(data))


@pytest.mark.parametrize(("d", "message"), TICKET_REFUSALS)
def test_a_built_ticket_is_refused_with_the_same_reason(d: dict[str, Any], message: str) -> None:
    assert from_fields_refusal(d, "ticket") == message


@pytest.mark.parametrize(
    ("d", "kind"),
    [
        (lease_dict(notebook_path="nb\udc80.ipynb"), "lease"),
        (lease_dict(user="\ud800"), "lease"),
        (ticket_dict(constraints=constraints_dict(exclude=["GPU-\udfff"])), "ticket"),
        (ticket_dict(constraints=constraints_dict(allowed_uuids=["ok", "x\ud83d"])), "ticket"),
    ],
)
def test_a_built_record_with_a_lone_surrogate_is_refused(d: dict[str, Any], kind: str) -> None:
    assert from_fields_refusal(d, kind) == "a lone surrogate (not valid Unicode text)"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_free_fraction", float("nan"),
         "constraints.min_free_fraction: expected a number in [0, 1] or null"),
        ("min_free_fraction", float("inf"),
         "constraints.min_free_fraction: expected a number in [0, 1] or null"),
        ("max_util_pct", float("nan"),
         "constraints.max_util_pct: expected a number in [0, 100] or null"),
        ("max_util_pct", float("-inf"),
         "constraints.max_util_pct: expected a number in [0, 100] or null"),
    ],
)
def test_a_built_ticket_with_a_non_finite_limit_is_refused(
    field: str, value: float, message: str
) -> None:
    d = ticket_dict(constraints=constraints_dict(**{field: value}))
    assert from_fields_refusal(d, "ticket") == message


def test_a_built_lease_with_a_non_finite_time_is_refused() -> None:
    assert from_fields_refusal(lease_dict(created_s=float("nan"))) == "created_s: expected a number"


def test_parse_record_still_checks_every_string_of_a_record_with_escapes() -> None:
    # The fast path skips the Unicode check only where no \u escape could make a surrogate.
    ok = raw(lease_dict(notebook_path="caf\u00e9"))
    assert b"\\u00e9" in ok
    assert parse_record(ok, kind="lease", path="/p", live=True).notebook_path == "caf\u00e9"
    bad = raw(lease_dict(notebook_path="\u00e9\udc80"))
    assert refusal(bad) == "a lone surrogate (not valid Unicode text)"


# ---- the encoded length of lease fields (found by the mutation run of issue 22) ----
# _encoded_len itself: a field's cap is met within a few characters of it whichever way one
# escaped character is counted, so no record's refusal tells these mutants apart.
@pytest.mark.parametrize(
    "ch", ["a", "X", "~", '"', "\\", "\x80", "\xff", "\u20ac", "\uffff", "\U00010000",
           "\U00010001", "\U0010ffff"],
)
def test_encoded_len_is_the_length_json_dumps_writes(ch: str) -> None:
    """Caught: ``X`` counted as an escaped character, U+0080 and U+10000 on the wrong side."""
    assert _encoded_len(ch) == len(json.dumps(ch)) - 2
