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
import contextlib
import json
import logging
import os
from dataclasses import replace
from typing import Any

from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import peers
from autogpu_jupyter.brokerd.book import BrokerRefusal, LeaseBook, Orphan
from autogpu_jupyter.brokerd.identity import tenant_key
from autogpu_jupyter.core.leasing.records import Invalid, LeaseRecord, parse_record
from autogpu_jupyter.core.leasing.wire import WIRE_UNTRUSTED

__all__ = ["Restorer"]

log = logging.getLogger("autogpu.broker")

#: Orphans whose socket one reaper round asks about (the rest in the next rounds, in turn).
POLLS_PER_ROUND = 256


class Restorer:
    """The journal of the broker (``None`` without a state directory) and its orphans."""

    def __init__(self, broker: Any, journal: jrnl.Journal | None) -> None:
        self.broker = broker
        self.book: LeaseBook = broker.book
        self.journal = journal
        self.book.on_change = self.record_changed
        self.book.on_forget = self._forgotten
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[str, dict[int, int]] = {}  # orphan -> {holder pid: its pidfd}
        self._unsettled: set[str] = set()  # orphans whose holders a scan must find
        self._cursor = 0  # where the next round's socket checks start

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
        encoded = self.book.encoded(new).decode()
        tenant = conn.user if conn.account.tenant else None
        try:
            if began:
                peer = self.holder_ids(conn)[0]
                journal.add(jrnl.Entry(new.lease_id, conn.uid, encoded, peer,
                                       list(conn.holder_pids), tenant), seq=new.seq)
            else:  # the same lease, changed (set_pid): the new record and its holders
                known = journal.entries.get(new.lease_id)
                peer = None if known is None else known.peer
                journal.add(jrnl.Entry(new.lease_id, conn.uid, encoded, peer,
                                       list(conn.holder_pids), tenant))
        except jrnl.NotRecorded as err:  # not in the journal: the book undoes the change
            raise BrokerRefusal(err.refusal(new.kind, began), WIRE_UNTRUSTED) from None

    def _forgotten(self, lease_id: str) -> None:
        self._unwatch(lease_id)
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
                peer = peers.peer_inode(conn.writer.sock)
            conn.ids = (peer, peers.proc_ids(conn.pid))
        ids: tuple[int | None, list[tuple[int, int]]] = conn.ids
        return ids

    # -- reading ----------------------------------------------------------------------------

    def load(self) -> None:
        """Replay the journal: every entry whose socket still exists (one ``sock_diag`` dump
        for the broker's own namespace, a request in another's), or, without a socket, whose
        recorded holders still run, becomes an orphan. Nothing here reads a process's
        descriptors: the holders of a socket whose recorded ones are gone are found later, off
        the event loop (:meth:`settle`)."""
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
        namespaces: dict[int, int] | None = None
        here = _own_sockets() if any(e.peer for e in entries.values()) else set()
        starts: dict[int, int | None] = {}  # pid -> its start time (read once per pid)
        kept = 0
        for e in entries.values():
            try:
                kind = json.loads(e.record)["kind"]
                rec = parse_record(e.record.encode(), kind=kind, path=f"broker:{e.lease_id}",
                                   live=True)
            except (Invalid, KeyError, TypeError, ValueError) as err:
                log.warning("journal entry skipped: %s", err)
                journal.remove(e.lease_id)
                continue
            netns = None
            if e.peer:
                for p, _ in e.pids:
                    if p not in starts:
                        starts[p] = peers.start_time(p)
                pids = [(p, t) for p, t in e.pids if starts[p] == t]
                try:
                    netns = (peers.OWN_NS if e.peer in here
                             else peers.find_socket(e.peer, [p for p, _ in pids]))
                    if netns is None:  # not where its holders are: anywhere on the host?
                        if namespaces is None:
                            namespaces = peers.host_namespaces()
                        netns = peers.find_socket(e.peer, (), namespaces)
                    alive = netns is not None
                except OSError:  # the kernel cannot tell: held while a holder is found
                    alive = True
            else:
                pids = peers.holders_alive(e.pids, None, e.uid)
                alive = bool(pids)
            if not alive:
                journal.remove(e.lease_id)
                continue
            if rec.path != f"broker:{rec.lease_id}":
                rec = replace(rec, path=f"broker:{rec.lease_id}")
            key = (tenant_key(e.tenant) if e.tenant is not None
                   else self.broker.accounts.account(e.uid).key)
            book.adopt(Orphan(e.uid, rec, pids, key, e.peer, netns))
            if pids != e.pids:  # a line only for holders that changed
                journal.set_pids(rec.lease_id, pids)
            kept += 1
        if journal.dropped:
            log.warning("restart: the journal was of an earlier boot (%s): its %d lease(s)/"
                        "ticket(s) ended with that boot and are dropped",
                        journal.logged_boot, journal.dropped)
        log.info("restart: %d lease(s)/ticket(s) taken back from the journal", kept)

    # -- liveness ---------------------------------------------------------------------------

    async def settle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the holders of orphans not watched yet (a ``pidfd`` each, on the loop: it
        becomes readable when that process ends; a pid is taken only with its recorded start
        time); find, by one scan of ``/proc`` off the loop, the holders of orphans whose
        socket exists but whose known holders are all gone (a child the socket was handed to);
        free the orphans that nobody holds."""
        if self._loop is not loop:  # a new loop: what was watched on another is not
            self._unwatch_all()
            self._loop = loop
        book = self.book
        unsettled: list[Orphan] = []
        for o in list(book.orphans.values()):
            lease_id = o.record.lease_id
            if lease_id in self._watched:
                if lease_id in self._unsettled:
                    unsettled.append(o)
                continue
            o.holder_pids = [(p, t) for p, t in o.holder_pids if peers.start_time(p) == t]
            self._watched[lease_id] = {}
            for pid, start in o.holder_pids:
                self._watch(loop, lease_id, pid, start)
            if o.peer and not o.holder_pids:
                if self._located(o) is False:
                    book.forget_orphan(lease_id)
                else:
                    unsettled.append(o)
            elif not o.peer and not o.holder_pids:
                book.forget_orphan(lease_id)
        self._unsettled.clear()
        if not unsettled:
            return
        wanted = [o.peer for o in unsettled if o.peer]
        held = await loop.run_in_executor(None, peers.scan_socket_holders, wanted)
        for o in unsettled:
            lease_id = o.record.lease_id
            pids = held.get(o.peer, []) if o.peer else []
            if lease_id not in book.orphans:
                continue
            if pids:
                o.holder_pids = pids
                if self.journal is not None:
                    self.journal.set_pids(lease_id, pids)
                for pid, start in pids:
                    self._watch(loop, lease_id, pid, start)
            elif o.netns is None:  # held by nobody, and no sock_diag to say otherwise
                book.forget_orphan(lease_id)

    def _located(self, o: Orphan) -> bool | None:
        """Whether ``o``'s socket still exists (found again where it moved from a namespace
        no longer kept); ``None`` where the kernel cannot tell."""
        assert o.peer is not None
        try:
            if o.netns is not None:
                with contextlib.suppress(OSError):
                    return peers.socket_exists(o.peer, o.netns)
            o.netns = peers.find_socket(o.peer, [p for p, _ in o.holder_pids])
        except OSError:
            return None
        return o.netns is not None

    def _watch(self, loop: asyncio.AbstractEventLoop, lease_id: str, pid: int,
               start: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone already (the next check sees it)
        if peers.start_time(pid) != start:  # the pid was reused before it was opened
            os.close(fd)
            return
        self._watched.setdefault(lease_id, {})[pid] = fd
        loop.add_reader(fd, self._exited, lease_id, pid)

    def _exited(self, lease_id: str, pid: int) -> None:
        """A watched holder ended: the orphan loses it, and ends at once when its socket is
        gone (or, without a socket, when it has no holder left)."""
        fd = self._watched.get(lease_id, {}).pop(pid, None)
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)
            os.close(fd)
        o = self.book.orphans.get(lease_id)
        if o is None:
            return
        o.holder_pids = [(p, t) for p, t in o.holder_pids if p != pid]
        if self.journal is not None and not self.broker.stopping:
            self.journal.set_pids(lease_id, o.holder_pids)
        if o.peer:
            gone = self._located(o) is False
            if not gone and not o.holder_pids:
                self._unsettled.add(lease_id)  # a child may hold it: found next round
        else:
            gone = not o.holder_pids
        if gone:
            self.book.forget_orphan(lease_id)

    def _unwatch(self, lease_id: str) -> None:
        for fd in self._watched.pop(lease_id, {}).values():
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)
        self._unsettled.discard(lease_id)

    def _unwatch_all(self) -> None:
        for lease_id in list(self._watched):
            self._unwatch(lease_id)

    # -- the reaper -------------------------------------------------------------------------

    async def reap_orphans(self) -> None:
        """Every second: free orphans nobody holds any more, and let servable tickets that
        were not turned into leases lapse."""
        loop = asyncio.get_running_loop()
        lock = self.broker.lock
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.reap(loop)
                await self.lapse_round(loop)
            except Exception:  # the reaper must outlive any one bad round
                log.exception("orphan and ticket check failed")
            if lock.waiting and lock.lock_holder is None:
                lock.grant_next()

    async def lapse_round(self, loop: asyncio.AbstractEventLoop) -> None:
        """With a fresh snapshot, the book's tickets lapse or start to wait
        (:meth:`LeaseBook.lapse_tickets`)."""
        book = self.book
        if not book.line():
            book.servable_since.clear()
            return
        try:
            snap = await loop.run_in_executor(None, self.broker.fleet.snapshot)
        except Exception as err:  # no fleet to judge by: no ticket lapses
            log.debug("no snapshot for the ticket check: %s", err)
            return
        book.lapse_tickets(snap)

    async def reap(self, loop: asyncio.AbstractEventLoop) -> None:
        """One round: :meth:`settle`, then at most :data:`POLLS_PER_ROUND` orphans, in turn,
        asked whether their socket still exists (a holder may close it and live on): one
        ``sock_diag`` dump for those of the broker's namespace, one request for each other;
        nothing per descriptor."""
        await self.settle(loop)
        orphans = [o for o in self.book.orphans.values() if o.peer]
        if not orphans:
            return
        start = self._cursor % len(orphans)
        turn = (orphans[start:] + orphans[:start])[:POLLS_PER_ROUND]
        self._cursor = start + len(turn)
        # one dump off the loop for the sockets of the broker's namespace (each asked on its
        # own costs the kernel a walk of every socket); empty: it failed, each is asked
        here = await loop.run_in_executor(None, _own_sockets)
        for o in turn:
            if here and o.netns == peers.OWN_NS:
                gone = o.peer not in here
            else:
                gone = self._located(o) is False
            if gone and o.record.lease_id in self.book.orphans:
                self.book.forget_orphan(o.record.lease_id)


def _own_sockets() -> set[int]:
    """The Unix sockets of the broker's namespace (:func:`peers.unix_inodes`); none where the
    kernel cannot tell (each entry is then asked for on its own, as before)."""
    try:
        return peers.unix_inodes()
    except OSError as err:
        log.debug("no sock_diag dump: %s", err)
        return set()
