"""The broker's wire: the protocol both sides speak, and the shapes of what it carries.

The constants here are the protocol's version and caps (the broker imports them: both sides
agree); the functions turn the broker's JSON into the port's records (a record's payload, the
compact booking view of ``begin``, the reserved devices), a requester into its ``holder``
message, and the events the broker sends unasked on a lease connection into one line each. None
of them opens a connection: :mod:`~autogpu_jupyter.core.leasing.brokerclient` talks, this module
reads and writes what is said.
"""

from __future__ import annotations

import json
import os
import select
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from autogpu_jupyter.core.leasing.admission import reservation
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.store import Requester
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseLimitError,
    LeaseStoreError,
    LeaseStoreUntrustedError,
    NoDeviceFitsError,
    UsageErrorBase,
)

__all__ = [
    "ERRORS",
    "HOLDER_KINDS",
    "MAX_LIST_RECORDS",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PAGE_BYTES",
    "PAGE_RECORDS",
    "PROTOCOL",
    "VIEW_BY_PID",
    "VIEW_ROWS_PER_DEVICE",
    "VIEW_SHAPES",
    "VIEW_TICKETS",
    "VIEW_TICKET_BYTES",
    "WIRE_STORE_ERROR",
    "WIRE_UNTRUSTED",
    "wire_kind",
    "from_wire",
    "holder_msg",
    "lease_events",
    "reservations",
    "version_mismatch",
    "view_records",
    "wire_records",
]


#: The version of the protocol, in every request and reply (``"proto"``): a broker and a
#: client of different versions refuse each other with one line naming both.
PROTOCOL = 2
#: The longest request line the broker reads (a longer one closes that connection).
MAX_REQUEST_BYTES = 64 * 1024
#: The longest reply line the broker sends and a client reads. Replies are bounded by
#: construction (a compact booking view, pages of records, counts), never by other users'
#: records: a reply past this is a bug, reported as such.
MAX_REPLY_BYTES = 1024 * 1024
#: One page of ``leases``: at most this many records, and this many bytes of them.
PAGE_RECORDS = 256
PAGE_BYTES = 256 * 1024
#: What a client reads of ``leases`` in all (pages of the broker): a list of every lease on
#: the host is for people, and no host has this many.
MAX_LIST_RECORDS = 16384
#: The booking view of ``begin``: rows per device (the rest folded into one), waiting tickets.
VIEW_ROWS_PER_DEVICE = 16
VIEW_TICKETS = 64
#: What a client asks ``begin`` for (``"view"``) to get each device's leases by process
#: (``pids``: fewer, shorter rows, no names) instead of the ``rows`` an older client reads.
VIEW_BY_PID = "pids"
VIEW_SHAPES = ("rows", VIEW_BY_PID)
VIEW_TICKET_BYTES = 256 * 1024
#: Who may hold a lease (``holder.kind``), as the picker's requester says.
HOLDER_KINDS = ("process", "kernel", "cli", "provisioner", "api")
#: The wire spells the store's errors as every earlier release did: the Python classes were
#: renamed (``LeaseStoreError``, ``LeaseStoreUntrustedError``, ``LeaseStoreUnreachableError``),
#: the reply's ``type`` was not, so a broker and clients one release apart read each other.
WIRE_STORE_ERROR = "RegistryError"
WIRE_UNTRUSTED = "RegistryUntrustedError"
_WIRE_KIND = {
    "LeaseStoreError": WIRE_STORE_ERROR,
    "LeaseStoreUntrustedError": WIRE_UNTRUSTED,
    "LeaseStoreUnreachableError": "RegistryUnreachableError",
}


def wire_kind(err: BaseException) -> str:
    """The reply's ``type`` for a refusal raised as ``err`` (its class's name on the wire)."""
    name = type(err).__name__
    return _WIRE_KIND.get(name, name)


#: The refusals a client raises as their own errors (by the reply's ``type``); any other is a
#: :class:`~autogpu_jupyter.errors.LeaseStoreError`.
ERRORS: dict[str, type[AutoGPUError]] = {
    "LeaseLimitError": LeaseLimitError,
    "NoDeviceFitsError": NoDeviceFitsError,
    "UsageErrorBase": UsageErrorBase,
    # a lease the broker cannot record (its disk full): the pick fails closed, even a plain one
    WIRE_UNTRUSTED: LeaseStoreUntrustedError,
}


def version_mismatch(path: str, reply: Mapping[str, Any]) -> str:
    """The line for a first reply (from the broker at ``path``) of another protocol version."""
    theirs = reply.get("proto")
    if reply.get("ok") is False and reply.get("type") == WIRE_UNTRUSTED:
        return f"lease broker at {path}: {reply.get('error')}"  # it refused us: its words
    spoken = "an older protocol (no version)" if theirs is None else f"protocol {theirs!r:.20}"
    return (
        f"the lease broker at {path} speaks {spoken}, this autogpu speaks protocol {PROTOCOL}: "
        "the broker and this environment come from different autogpu versions; nothing was "
        "picked; ask the admin to run the same autogpu version for both"
    )


def wire_records(items: Iterable[Any], path: str) -> list[LeaseRecord]:
    """Records from the broker's payloads (the record format's fields). The broker built and
    checked them with the readers' schema; here they are only typed, not re-validated (a pick
    reads every live record under the pick lock: 128 strict parses would cost ~10 ms)."""
    out = []
    for item in items:
        try:
            out.append(from_wire(item, path))
        except (KeyError, TypeError, ValueError, OverflowError) as err:  # Infinity: Overflow
            raise LeaseStoreError(f"lease broker at {path} sent a bad record: {err}") from None
    return out


def from_wire(d: Mapping[str, Any], path: str) -> LeaseRecord:
    """One record from its payload dict (see :meth:`LeaseRecord._payload`)."""
    lease_id = str(d["lease_id"])
    constraints = d.get("constraints")
    return LeaseRecord(
        lease_id=lease_id,
        kind=str(d["kind"]),
        device_uuids=tuple(str(u) for u in d["device_uuids"]),
        device_requested_bytes=tuple(
            None if b is None else int(b) for b in d["device_requested_bytes"]
        ),
        exclusive=bool(d["exclusive"]),
        user=str(d["user"]),
        uid=int(d["uid"]),
        host=str(d["host"]),
        pid=int(d["pid"]),
        created_s=float(d["created_s"]),
        kernel_id=_opt(d.get("kernel_id")),
        notebook_path=_opt(d.get("notebook_path")),
        command=_opt(d.get("command")),
        holder_kind=str(d.get("holder_kind") or "process"),
        seq=None if d.get("seq") is None else int(d["seq"]),
        constraints=dict(constraints) if isinstance(constraints, Mapping) else None,
        path=f"{path}#{lease_id}",
    )


def view_records(devices: Iterable[Any], path: str) -> list[LeaseRecord]:
    """Other users' leases as the booking view of ``begin`` gives them (see the broker's
    ``brokerd/views.py``), records :func:`core.decision.bookings_for` counts, books and excludes
    by exactly as it would the full records:

    * a device's ``rows`` (the view a client gets unless it asks for :data:`VIEW_BY_PID`): one
      record per row, its lease as it is;
    * its ``pids`` (``[pid, leases, booked, exclusive]``): a process's leases on the device
      together, as one record of that pid booking them all and one alike record (booking
      nothing) per lease past the first. A lease's booking stops counting when NVML lists its
      pid on the device, so the leases of one pid book together or not at all: the same sum;
    * ``more``: as many records as leases folded there, the first booking all of theirs. Their
      pids are not sent, so those bookings are always counted: a pick may see a device fuller
      than it is, never emptier.

    The records given once per lease are one record, given again in a row (a pick with 10,000
    leases makes no 10,000 records; ``bookings_for`` reads a run once)."""
    out: list[LeaseRecord] = []
    at = f"{path}#"
    try:
        for dev in devices:
            uuid = (str(dev["uuid"]),)  # every record of the device names this one tuple
            left = MAX_LIST_RECORDS  # what one device may make us count
            for exclusive, pid, booked, user, where in dev.get("rows") or ():
                out.append(_view_record(at, len(out), uuid, bool(exclusive), int(pid),
                                        None if booked is None else int(booked),
                                        str(user), str(where) or None))
                left -= 1
            groups = [(int(pid), int(n), int(booked or 0), bool(exclusive))
                      for pid, n, booked, exclusive in dev.get("pids") or ()]
            more = dev.get("more") or {}
            if not isinstance(more, Mapping):
                raise TypeError(f"folded leases of {type(more).__name__} (not an object)")
            folded = int(more.get("leases", 0))
            groups.append((0, folded, int(more.get("booked") or 0), bool(more.get("exclusive"))))
            alike = 0
            for pid, leases, booked, exclusive in groups:
                n = min(leases, left)
                if n > 0:
                    left -= n
                    alike += n - 1
                    out.append(_view_record(at, len(out), uuid, exclusive, pid, booked,
                                            "others", None))
            if alike:  # the others book nothing and are alike: one record, counted each
                rest = _view_record(at, len(out), uuid, False, 0, None, "others", None)
                out += [rest] * alike
    except (KeyError, TypeError, ValueError, OverflowError) as err:  # JSON's Infinity: Overflow
        raise LeaseStoreError(f"lease broker at {path} sent a bad booking view: {err}") from None
    return out


def reservations(reserved: Any, path: str) -> list[LeaseRecord]:
    """The devices the admin reserved away from us, as the broker's view names them (UUID ->
    groups): the admission's pseudo-leases, so a ranking words them as the directory would
    ("reserved for group(s) ml by the admin"), not as another lease."""
    if reserved is None:
        return []
    try:
        items = list(reserved.items())[:MAX_LIST_RECORDS]
        return [reservation(str(uuid), [str(g) for g in groups][:64], "")
                for uuid, groups in items]
    except (AttributeError, TypeError) as err:
        raise LeaseStoreError(f"lease broker at {path} sent a bad booking view: {err}") from None


#: The fields of a record in the order :class:`LeaseRecord` declares them (a record of the
#: view sets every one: a field added there and not here stops the import, never leaves one
#: unset).
_FIELDS = ("lease_id", "kind", "device_uuids", "device_requested_bytes", "exclusive", "user",
           "uid", "host", "pid", "created_s", "kernel_id", "notebook_path", "command",
           "holder_kind", "seq", "constraints", "live", "path")
if getattr(LeaseRecord, "__slots__", ()) != _FIELDS:
    raise ImportError(f"wire's booking view sets {_FIELDS}, a LeaseRecord has "
                      f"{getattr(LeaseRecord, '__slots__', ())}")


def _view_record_maker() -> Callable[..., LeaseRecord]:
    new = object.__new__
    (s_id, s_kind, s_uuids, s_bytes, s_exclusive, s_user, s_uid, s_host, s_pid, s_created,
     s_kernel, s_where, s_command, s_holder, s_seq, s_constraints, s_live, s_path) = (
        getattr(LeaseRecord, name).__set__ for name in _FIELDS)  # each slot's own setter

    def view_record(at: str, n: int, uuid: tuple[str], exclusive: bool, pid: int,
                    booked: int | None, user: str, where: str | None) -> LeaseRecord:
        lease_id = f"view{n:028x}"
        rec = new(LeaseRecord)
        s_id(rec, lease_id)
        s_kind(rec, "lease")
        s_uuids(rec, uuid)
        s_bytes(rec, (booked,))
        s_exclusive(rec, exclusive)
        s_user(rec, user)
        s_uid(rec, -1)
        s_host(rec, "")
        s_pid(rec, pid)
        s_created(rec, 0.0)
        s_kernel(rec, None)
        s_where(rec, where)
        s_command(rec, None)
        s_holder(rec, "process")
        s_seq(rec, None)
        s_constraints(rec, None)
        s_live(rec, True)
        s_path(rec, at + lease_id)
        return rec

    return view_record


#: ``_view_record(at, n, uuid, exclusive, pid, booked, user, where)``: one record of the booking
#: view, of values :func:`view_records` typed (and so checked) already, set slot by slot without
#: the dataclass's ``__init__`` (704 records per pick at host scale, a third of a pick's time;
#: issue 39). Equal to ``LeaseRecord(lease_id=f"view{n:028x}", kind="lease",
#: device_uuids=uuid, device_requested_bytes=(booked,), exclusive=exclusive, user=user, uid=-1,
#: host="", pid=pid, created_s=0.0, notebook_path=where, path=at + lease_id)``
#: (tests/unit/test_broker_view_pids.py compares them over random views).
_view_record = _view_record_maker()


def _opt(v: Any) -> str | None:
    return None if v is None else str(v)


def holder_msg(requester: Requester | None) -> dict[str, Any]:
    if requester is None:
        return {"kind": "process"}
    return {
        "kernel_id": requester.kernel_id,
        "notebook_path": requester.notebook_path,
        "command": requester.command,
        "kind": requester.kind,
    }


def lease_events(fd: int) -> list[str]:
    """Messages the broker sent, unasked, on a lease connection this process holds (``fd``):
    ``lease ... revoked by the admin``, a place in the waiting line that lapsed; also when the
    broker closed it. Never blocks; an fd
    that is not a socket (a lease file of the shared-directory registry) has none.

    Returns
    -------
    list of str
        One line per event, for the notebook user; empty when nothing happened.
    """
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return []
        readable, _, _ = select.select([fd], [], [], 0)
        if not readable:
            return []
        data = os.read(fd, 65536)
    except OSError:
        return []
    if not data:
        return ["the lease broker closed this kernel's lease connection: a broker that "
                "restarted keeps the lease while this kernel runs (`autogpu leases` shows it); "
                "else the lease has ended"]
    out = []
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("event") == "revoked":
            out.append(
                f"your GPU lease {str(event.get('lease_id', ''))[:32]} was revoked by the admin: "
                "this kernel no longer holds it; others may now be given its GPU"
            )
        elif event.get("event") == "ticket_lapsed":
            out.append(
                f"your place in the GPU waiting line (ticket "
                f"{str(event.get('lease_id', ''))[:32]}) lapsed: a device was free for it but "
                "no lease was taken; pick again to wait again"
            )
    return out
