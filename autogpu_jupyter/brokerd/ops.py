"""The broker's protocol operations: one entry per op, each ``validate`` then ``execute``.

``validate`` checks the message's shape and what the connection may ask (no waiting, no
change); ``execute`` does it over the lease book (:mod:`autogpu_jupyter.brokerd.book`), the
pick lock and the fleet, and returns the reply. A refusal is a
:class:`~autogpu_jupyter.brokerd.book.BrokerRefusal` (one line back to the client). The table
:data:`OPS` names them in the protocol's order; the protocol itself is described in
:mod:`autogpu_jupyter.broker`. ``ctx`` is the broker: ``config``, ``host``, ``book``,
``lock``, ``fleet``, ``connections``, ``restorer``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from autogpu_jupyter._version import __version__
from autogpu_jupyter.brokerd import peers
from autogpu_jupyter.brokerd.book import BrokerRefusal
from autogpu_jupyter.brokerd.views import StateView, shown, view
from autogpu_jupyter.core import decision, options
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.records import (
    MAX_ID_LIST,
    MAX_SEQ,
    Invalid,
    LeaseRecord,
    capped_text,
    record_from_fields,
)
from autogpu_jupyter.core.leasing.wire import (
    HOLDER_KINDS,
    PAGE_BYTES,
    PAGE_RECORDS,
    PROTOCOL,
    VIEW_SHAPES,
    view_records,
)
from autogpu_jupyter.core.picker import explain_drops
from autogpu_jupyter.errors import AutoGPUError

__all__ = ["OLDER", "OPS", "Op", "RecordReply", "before", "older_reply"]

_STATUS_USERS = 256
_PICK_KEYS = (
    "min_free", "max_util", "count", "exclude", "exclusive", "model", "prefer", "devices"
)


class Op:
    """One protocol operation."""

    name = ""

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        """The message's arguments, checked (raises :class:`BrokerRefusal`); nothing changes."""
        return msg

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        raise NotImplementedError

    async def __call__(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.execute(ctx, conn, self.validate(ctx, conn, msg))


def _no_record(conn: Any) -> None:
    if conn.record is not None:
        raise BrokerRefusal(admission.ONE_PER_CONNECTION)


class RecordReply(dict):  # type: ignore[type-arg]
    """``{"ok": true, "record": <payload>}`` for a record just granted: sent as the bytes
    its journal line carries (:meth:`LeaseBook.encoded`), not encoded a second time."""

    def __init__(self, rec: LeaseRecord, encoded: bytes) -> None:
        super().__init__(ok=True, record=rec._payload())
        self.encoded = encoded


class Begin(Op):
    name = "begin"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        _no_record(conn)
        shape = msg.get("view", "rows")
        if shape not in VIEW_SHAPES:
            raise BrokerRefusal(
                f"view {str(shape)[:40]!r} is not one of {', '.join(VIEW_SHAPES)}",
                "UsageErrorBase",
            )
        return shape

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        await ctx.lock.acquire(conn)
        return {"ok": True, **view(ctx, conn, args),
                "max_devices_per_user": ctx.book.limit_for(conn)[0]}


class End(Op):
    name = "end"

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        ctx.lock.release(conn)
        return {"ok": True}


def holder_fields(ctx: Any, conn: Any, msg: Mapping[str, Any]) -> dict[str, Any]:
    holder = msg.get("holder") or {}
    if not isinstance(holder, dict):
        raise BrokerRefusal("holder: expected an object", "UsageErrorBase")
    kind = holder.get("kind") or "process"
    if kind not in HOLDER_KINDS:
        raise BrokerRefusal(
            f"holder.kind {str(kind)[:40]!r} is not one of {', '.join(HOLDER_KINDS)}",
            "UsageErrorBase",
        )
    return {
        "pid": conn.shown_pid,
        "kernel_id": _capped(holder, "kernel_id"),
        "notebook_path": _capped(holder, "notebook_path"),
        "command": _capped(holder, "command") if ctx.config.record_commands else None,
        "holder_kind": kind,
    }


def make_record(ctx: Any, conn: Any, kind: str, payload: dict[str, Any]) -> LeaseRecord:
    """A record built by the broker: identity from the kernel, the rest validated by the
    readers' own schema (what a forged field would break is refused here)."""
    base = {
        "version": 1,
        "kind": kind,
        "lease_id": secrets.token_hex(16),
        "exclusive": False,
        "user": capped_text(conn.user, "user") or str(conn.uid),
        "uid": conn.uid,
        "host": capped_text(ctx.host, "host") or "?",
        "created_s": time.time(),
    }
    base.update(payload)
    try:
        return record_from_fields(base, kind=kind, path=f"broker:{base['lease_id']}", live=True)
    except (Invalid, TypeError, ValueError) as err:
        raise BrokerRefusal(f"{kind} refused: {err}", "UsageErrorBase") from None


def _capped(holder: Mapping[str, Any], key: str) -> str | None:
    """A holder's free-text field as the record keeps it: at most ``FIELD_CAPS[key]`` encoded
    bytes (a longer one is cut, not refused: it only labels the lease)."""
    v = holder.get(key)
    return capped_text(v if isinstance(v, str) else None, key)


class Lease(Op):
    name = "lease"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        _no_record(conn)
        devices = msg.get("devices")
        if not isinstance(devices, list) or not devices or len(devices) > MAX_ID_LIST:
            raise BrokerRefusal("devices: expected a list of device UUIDs", "UsageErrorBase")
        return msg

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        msg = args
        devices = msg["devices"]
        await ctx.fleet.check_known(devices)
        booked = msg.get("requested_bytes")
        if booked is None:
            booked = [None] * len(devices)
        rec = make_record(ctx, conn, "lease", {
            "device_uuids": devices,
            "device_requested_bytes": booked,
            "exclusive": msg.get("exclusive", False),
            **holder_fields(ctx, conn, msg),
        })
        book = ctx.book
        replaced = book.replaced(conn, msg)
        book.check_lease(conn, rec, replaced)
        conn.holder_pids = list(ctx.restorer.holder_ids(conn)[1])  # before the record
        conn.record = rec  # BrokerRefusal when it cannot be journaled: replaced ones kept
        book.end_replaced(replaced)
        ctx.lock.release(conn)
        return RecordReply(rec, book.encoded(rec))


class Pick(Op):
    """Pick AND lease in one message: the broker ranks with its own snapshot and the one
    decision pipeline (``core.decision``) over its own state, then leases what it chose on
    this connection (the same checks as ``lease``). For clients that cannot run the engine
    (a raw socket, another language). No ``wait`` here: a waiting pick runs in the client."""

    name = "pick"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        _no_record(conn)
        values = msg.get("options") or {}
        if not isinstance(values, dict):
            raise BrokerRefusal("options: expected an object", "UsageErrorBase")
        try:
            return msg, options.parse(values, style="key", accept=_PICK_KEYS)
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), "UsageErrorBase") from None

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        msg, opts = args
        snap = await asyncio.get_running_loop().run_in_executor(None, ctx.fleet.snapshot)
        # From here to the lease nothing awaits: the decision and the lease see one state.
        context = decision.gather(snap, environ={}, store=StateView(ctx.book, conn))
        made = decision.decide(context, opts.constraints)
        if not made.chosen:
            raise BrokerRefusal(
                f"no device fits ({opts.constraints.describe()}):\n{explain_drops(made.ranked)}",
                "NoDeviceFitsError",
            )
        mf = opts.constraints.min_free
        reply = await OPS["lease"](ctx, conn, {
            "devices": [c.device.uuid for c in made.chosen],
            "requested_bytes": [
                None if mf is None else mf.resolve(c.device.memory_total_bytes)
                for c in made.chosen
            ],
            "exclusive": opts.constraints.exclusive,
            "holder": msg.get("holder"),
        })
        reply["labels"] = [c.device.label for c in made.chosen]
        return reply


class Ticket(Op):
    """Join the waiting line, if the one admission admits the ticket
    (:func:`admission.admit_ticket`: tickets per user, the device quota with what the user
    waits for, reserved devices); ``ignore_ids`` / ``ignore_kernel`` name the caller's own
    leases a re-pick replaces, which do not count."""

    name = "ticket"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        _no_record(conn)
        return msg

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        msg = args
        book = ctx.book
        rec = make_record(ctx, conn, "ticket", {
            "device_uuids": [],
            "device_requested_bytes": [],
            "exclusive": msg.get("exclusive", False),
            "seq": min(book.seq + 1, MAX_SEQ),
            "constraints": msg.get("constraints"),
            **holder_fields(ctx, conn, msg),
        })
        rec = book.check_ticket(conn, rec, book.replaced(conn, msg))
        conn.holder_pids = list(ctx.restorer.holder_ids(conn)[1])  # before the record
        conn.record = rec
        book.seq = rec.seq or book.seq
        return RecordReply(rec, book.encoded(rec))


class SetPid(Op):
    name = "set_pid"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        pid = msg.get("pid")
        if conn.record is None:
            raise BrokerRefusal("set_pid: this connection holds no lease")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BrokerRefusal(f"set_pid: invalid pid {str(pid)[:40]!r}", "UsageErrorBase")
        # A tenant's pid is its container's: the host's process is found in the pid
        # namespace of the connecting process, never read as a host pid.
        host = peers.host_pid(pid, conn.pid) if conn.account.tenant else pid
        if not conn.root and (host is None or conn.uid not in peers.pid_uids(host)):
            raise BrokerRefusal(f"set_pid: pid {pid} is not a process of yours")
        return pid, host

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        pid, host = args
        conn.holder_pids = peers.proc_ids(host) or conn.holder_pids
        conn.record = replace(conn.record, pid=pid)  # journaled with its new holders
        return {"ok": True, "record": conn.record._payload()}


class Release(Op):
    name = "release"

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        lease_id = args.get("lease_id")
        if lease_id is None or (conn.record is not None and conn.record.lease_id == lease_id):
            conn.record = None
            return {"ok": True}
        orphan = ctx.book.orphans.get(lease_id) if isinstance(lease_id, str) else None
        if orphan is None or orphan.key != conn.key:
            raise BrokerRefusal(f"release: no lease {str(lease_id)[:64]!r} of yours is orphaned")
        ctx.book.forget_orphan(orphan.record.lease_id)
        return {"ok": True}


class Leases(Op):
    """One page of live records, oldest first: at most :data:`PAGE_RECORDS` records and
    :data:`PAGE_BYTES`; ``next`` is where the next page starts (``None``: the last)."""

    name = "leases"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        kinds = {"lease", "ticket"} if msg.get("tickets") else {"lease"}
        if msg.get("kind") in ("lease", "ticket"):
            kinds = {str(msg["kind"])}
        after = msg.get("after")
        if after is None:
            return kinds, None
        if (
            not isinstance(after, list) or len(after) != 2
            or not isinstance(after[0], (int, float)) or isinstance(after[0], bool)
            or not isinstance(after[1], str)
        ):
            raise BrokerRefusal("leases: after: expected [created_s, lease_id]",
                                "UsageErrorBase")
        return kinds, (float(after[0]), after[1])

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        kinds, cursor = args
        records = [(key, rec) for key, rec in ctx.book.live() if rec.kind in kinds]
        out: list[dict[str, Any]] = []
        size = 0
        nxt = None
        for key, rec in records:
            if cursor is not None and (rec.created_s, rec.lease_id) <= cursor:
                continue
            payload = shown(rec, conn.root or key == conn.key)
            size += len(json.dumps(payload))
            if out and (len(out) >= PAGE_RECORDS or size > PAGE_BYTES):
                last = out[-1]
                nxt = [last["created_s"], last["lease_id"]]
                break
            out.append(payload)
        reserved = ctx.book.reserved_reply(conn)  # a dry run ranks them out as a pick does
        return {"ok": True, "records": out, "next": nxt, "total": len(records),
                **({"reserved": reserved} if reserved else {})}


class Status(Op):
    """Counts only (the records come page by page from ``leases``): per person, at most
    :data:`_STATUS_USERS` rows, the largest first; the rest summed in one row."""

    name = "status"

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        per_user: dict[str, dict[str, int]] = {}
        leases = tickets = 0
        for key, rec in ctx.book.live():
            name = rec.user or str(key)
            row = per_user.setdefault(name, {"leases": 0, "devices": 0, "tickets": 0})
            if rec.kind == "lease":
                leases += 1
                row["leases"] += 1
                row["devices"] += len(rec.device_uuids)
            else:
                tickets += 1
                row["tickets"] += 1
        if len(per_user) > _STATUS_USERS:
            ranked = sorted(per_user.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
            rest = {"leases": 0, "devices": 0, "tickets": 0}
            for _name, row in ranked[_STATUS_USERS:]:
                for k in rest:
                    rest[k] += row[k]
            per_user = dict(ranked[:_STATUS_USERS])
            per_user[f"({len(ranked) - _STATUS_USERS} more users)"] = rest
        journal = ctx.restorer.journal
        return {
            "ok": True,
            "leases_total": leases,
            "tickets_total": tickets,
            "per_user": per_user,
            "orphans": len(ctx.book.orphans),
            "connections": len(ctx.connections.conns),
            "max_connections": ctx.connections.conn_cap,
            "waiting_for_lock": len(ctx.lock.waiting),
            "max_devices_per_user": ctx.config.max_devices_per_user,
            "tickets_lapsed": ctx.book.lapsed,
            "messages_paced": ctx.connections.paced,
            "journal_bytes": None if journal is None else journal.size_bytes,
            "uptime_s": time.time() - ctx.started,
            "pid": os.getpid(),
            "version": __version__,
        }


class Revoke(Op):
    name = "revoke"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        if not conn.root:
            raise BrokerRefusal("revoke needs root")
        return msg.get("lease_id")

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        rec = ctx.book.revoke(args)
        if rec is None:
            raise BrokerRefusal(
                f"revoke: no live lease or ticket {str(args)[:64]!r}", "UsageErrorBase"
            )
        return {"ok": True, "revoked": rec.holder_text(), "kind": rec.kind}


class Reload(Op):
    """Root only, on the main socket: read the tenants again (``autogpu broker tenant add``
    and ``remove`` send it); what changed, by name."""

    name = "reload"

    def validate(self, ctx: Any, conn: Any, msg: dict[str, Any]) -> Any:
        if not conn.root:
            raise BrokerRefusal("reload needs root")
        return msg

    async def execute(self, ctx: Any, conn: Any, args: Any) -> dict[str, Any]:
        try:
            return {"ok": True, **await ctx.tenant_sockets.reload_off_loop()}
        except (ValueError, OSError) as err:  # TenantError is a ValueError
            raise BrokerRefusal(f"reload: {err}") from None


async def before(ctx: Any, conn: Any, op: str) -> None:
    """What comes before an op of a connection, whoever serves it: a ticket is a turn in the
    waiting line (a person joins it at most so often, :meth:`LeaseBook.may_join`) and is
    judged by a snapshot at most a second old (whether it waits at all)."""
    if op == "ticket":
        ctx.book.may_join(conn)
        await ctx.fleet.fresh_snapshot()


#: The protocol's operations by name, in the order the protocol lists them.
OPS: dict[str, Op] = {
    op.name: op
    for op in (Begin(), End(), Lease(), Pick(), Ticket(), SetPid(), Release(), Leases(),
               Status(), Revoke(), Reload())
}


#: The protocol before :data:`PROTOCOL` (autogpu before 0.2: messages without ``"proto"``).
#: Its clients are served too, their replies in the shapes they read (:func:`older_reply`),
#: so the broker and users' environments need not be upgraded on the same day.
OLDER = PROTOCOL - 1


async def older_reply(ctx: Any, conn: Any, op: str, reply: dict[str, Any]) -> dict[str, Any]:
    """``reply`` as a client of protocol :data:`OLDER` reads it. That protocol's ``begin``
    answered every live lease as a record (``leases``) beside the waiting ``tickets``, and
    ``status`` carried the records too; everything else has the same shape. The records it
    gets are the booking view's, turned back into records as the current client does (a
    device's folded leases as one record that books them all): bounded as the view is."""
    if reply.get("ok") is not True:
        return reply
    if op == "begin":
        devices = [{**d, "more": {**d["more"], "leases": min(1, d["more"]["leases"])}}
                   for d in reply["devices"]]
        others = [r._payload() for r in view_records(devices, "broker")]
        away = [r._payload() for r in ctx.book.reserved_away(conn)]
        return {**reply, "leases": reply["own"] + others + away}
    if op == "status":
        page = await OPS["leases"](ctx, conn, {"op": "leases", "tickets": True})
        return {**reply,
                "leases": [r for r in page["records"] if r["kind"] == "lease"],
                "tickets": [r for r in page["records"] if r["kind"] == "ticket"]}
    return reply
