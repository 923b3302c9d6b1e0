"""What survives a restart of the broker: the journal written as the book changes, replayed at
start, and the orphans it gives back, held while their holders live.

Every change of a connection's record is journaled (:mod:`autogpu_jupyter.brokerd.journal`)
before the reply that announces it, with what names its holder after a restart: the inode of
the client's end of the socket and the holder processes as (pid, start time). A restarted
broker takes back each journaled lease or ticket whose holder still lives as an *orphan*
(:class:`autogpu_jupyter.brokerd.book.Orphan`), held until no process holds it any more; the
reaper frees the orphans whose holders are gone and lets servable tickets lapse.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pwd
from dataclasses import replace
from typing import Any

from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd.book import LeaseBook, Orphan
from autogpu_jupyter.core.leasing.records import Invalid, LeaseRecord, parse_record

__all__ = ["Restorer"]

log = logging.getLogger("autogpu.broker")


class Restorer:
    """The journal of the broker (``None`` without a state directory) and its orphans."""

    def __init__(self, broker: Any, journal: jrnl.Journal | None) -> None:
        self.broker = broker
        self.book: LeaseBook = broker.book
        self.journal = journal
        self.book.on_change = self.record_changed
        self.book.on_forget = self._forgotten

    # -- writing ----------------------------------------------------------------------------

    def _writing(self) -> jrnl.Journal | None:
        """The journal, unless there is none or the broker is stopping (the next broker takes
        the leases of connections closed by the shutdown back)."""
        return None if self.broker.stopping else self.journal

    def record_changed(self, conn: Any, old: LeaseRecord | None,
                       new: LeaseRecord | None) -> None:
        """A connection's record was set: the journal gets the change."""
        journal = self._writing()
        if journal is None:
            return
        ended = old is not None and (new is None or new.lease_id != old.lease_id)
        began = new is not None and (old is None or new.lease_id != old.lease_id)
        if ended:
            assert old is not None
            journal.remove(old.lease_id)
        if new is None:
            return
        encoded = self.book._encoded(new).decode()
        if began:
            peer = self.holder_ids(conn)[0]
            journal.add(jrnl.Entry(new.lease_id, conn.uid, encoded, peer,
                                   list(conn.holder_pids)), seq=new.seq)
        else:  # the same lease, changed (set_pid): the new record and its holders
            known = journal.entries.get(new.lease_id)
            peer = None if known is None else known.peer
            journal.add(jrnl.Entry(new.lease_id, conn.uid, encoded, peer,
                                   list(conn.holder_pids)))

    def _forgotten(self, lease_id: str) -> None:
        journal = self._writing()
        if journal is not None:
            journal.remove(lease_id)

    def holder_ids(self, conn: Any) -> tuple[int | None, list[tuple[int, int]]]:
        """``conn``'s peer socket inode (``None`` without a journal: only the journal needs
        it) and its connecting process as ``[(pid, start time)]``, read from the kernel once
        per connection."""
        if conn.ids is None:
            peer = None
            if self.journal is not None and conn.writer is not None:
                peer = jrnl.peer_inode(conn.writer.sock)
            conn.ids = (peer, jrnl.proc_ids(conn.pid))
        ids: tuple[int | None, list[tuple[int, int]]] = conn.ids
        return ids

    _holder_ids = holder_ids

    # -- reading ----------------------------------------------------------------------------

    def load(self) -> None:
        """Replay the journal: every entry whose holder still lives becomes an orphan."""
        journal = self.journal
        assert journal is not None
        try:
            entries = journal.load()
        except OSError as err:
            raise SystemExit(
                f"autogpu broker: journal in {journal.directory} unusable ({err})"
            ) from None
        book = self.book
        book.seq = journal.seq
        held = jrnl.scan_socket_holders(e.peer for e in entries.values() if e.peer)
        kept = 0
        for e in entries.values():
            try:
                kind = json.loads(e.record)["kind"]
                rec = parse_record(e.record.encode(), kind=kind, path="", live=True)
            except (Invalid, KeyError, TypeError, ValueError) as err:
                log.warning("journal entry skipped: %s", err)
                journal.remove(e.lease_id)
                continue
            pids = held.get(e.peer, []) if e.peer else jrnl.holders_alive(e.pids, None, e.uid)
            if not pids:
                journal.remove(e.lease_id)
                continue
            rec = replace(rec, path=f"broker:{rec.lease_id}")
            key = self.broker.accounts.account(e.uid, _primary_gid(e.uid)).key
            book.adopt(Orphan(e.uid, rec, pids, key, e.peer))
            journal.set_pids(rec.lease_id, pids)
            kept += 1
        if journal.dropped:
            log.warning("restart: the journal was of an earlier boot (%s): its %d lease(s)/"
                        "ticket(s) ended with that boot and are dropped",
                        journal.logged_boot, journal.dropped)
        log.info("restart: %d lease(s)/ticket(s) taken back from the journal", kept)

    # -- the reaper -------------------------------------------------------------------------

    async def reap_orphans(self) -> None:
        """Every second: free orphans nobody holds any more, and let servable tickets that
        were not turned into leases lapse."""
        loop = asyncio.get_running_loop()
        lock = self.broker.lock
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._reap(loop)
                await self._lapse_tickets(loop)
            except Exception:  # the reaper must outlive any one bad round
                log.exception("orphan and ticket check failed")
            if lock.waiting and lock.lock_holder is None:
                lock.grant_next()

    async def _lapse_tickets(self, loop: asyncio.AbstractEventLoop) -> None:
        """With a fresh snapshot, the book's tickets lapse or start to wait
        (:meth:`LeaseBook.lapse_tickets`)."""
        book = self.book
        if not book._line():
            book.servable_since.clear()
            return
        try:
            snap = await loop.run_in_executor(None, self.broker.fleet._snapshot)
        except Exception as err:  # no fleet to judge by: no ticket lapses
            log.debug("no snapshot for the ticket check: %s", err)
            return
        book.lapse_tickets(snap)

    async def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        book = self.book
        lost: list[Orphan] = []
        for o in list(book.orphans.values()):
            alive = jrnl.holders_alive(o.holder_pids, o.peer, o.uid)
            if alive:
                o.holder_pids = alive
            else:
                lost.append(o)
        if not lost:
            return
        # Every known holder is gone; a child it forked may still hold the socket: one scan.
        peers = [o.peer for o in lost if o.peer]
        held = await loop.run_in_executor(None, jrnl.scan_socket_holders, peers) if peers else {}
        for o in lost:
            pids = held.get(o.peer, []) if o.peer else []
            if pids and o.record.lease_id in book.orphans:
                o.holder_pids = pids
                if self.journal is not None:
                    self.journal.set_pids(o.record.lease_id, pids)
            else:
                book.forget_orphan(o.record.lease_id)


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except (KeyError, OverflowError):
        return uid
