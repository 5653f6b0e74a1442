"""The prefill role: sender rooms, decode peers, posting chunks, the metadata row last, quiesce.

A decode rank says HELLO once (its table, pool regions, metadata slots and the byte routes this
rank writes to it), then ROOM per request (destination pages and metadata slot). Once a room has
both its sender (prefill admitted the request) and a decode rank's ROOM, that rank is told
ACCEPTED, which starts its transfer clock; a ROOM whose sender is not created within the
queue bound (prefill's queue; ``TransportConfig.queue_s``) fails with QUEUE_TIMEOUT, as does a
sender no decode rank sent its destination in that time (decode's queue). A sender
posts each queued chunk to every decode rank it writes to as soon as that rank's destination is
known and, on a GPU, the work that writes its pages has run; after ``finish`` and once its data
writes completed it writes the metadata row (the rank that is the row's writer) or sends a
completion notice, so the row is the commit record (docs/ARCHITECTURE.md, "Transfer
lifecycle"). Runs on the engine's progress thread, under its lock.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .backend import DONE, ERR, PROC, Xfer
from .buffers import BufferTable, MetadataRow, TableMismatch, check_pair
from .handles import (TERMINAL, Failure, KVPoll, KVSender, Room, TransferError,
                      TransferErrorCode)
from .mapping import Segment, page_runs, segment_descs
from .messages import (PROTOCOL_VERSION, Abort, Accepted, Fail, Hello, HelloAck, Message,
                       MetaSlotRegion, Notif, Quiesced, RemoteRegion, RoomDestination)

if TYPE_CHECKING:
    from .engine import TransferEngine

log = logging.getLogger("glm53.transport")

Code = TransferErrorCode
_MAX_DONE = 100000  # retired rooms remembered, to refuse a late ROOM for them


@dataclass
class Chunk:
    src: np.ndarray  # source page ids
    start: int  # index of the first page in the request's destination pages
    posted: set[int] = field(default_factory=set)  # decode ranks it was posted to
    # GPU pools: an event recorded after the work that writes these pages was queued (None:
    # ready). The writes copy on the transfer library's own streams, so they wait for it here.
    ready: Any = None

    def is_ready(self) -> bool:
        if self.ready is not None and self.ready.query():
            self.ready = None
        return self.ready is None


@dataclass
class Destination:
    """Where one decode rank wants a room written (its ROOM message, and where it came from)."""

    drank: int
    inst: str
    dtp: int
    pages: np.ndarray
    slot: int
    ep: str


@dataclass
class DecodePeer:
    """A decode rank after a good HELLO."""

    inst: str
    drank: int
    dtp: int
    ep: str
    agent: str
    regions: dict[str, RemoteRegion]
    meta: MetaSlotRegion
    routes: list[Segment]  # what this rank writes to it; may be empty
    writer: bool  # this rank writes its metadata row


@dataclass
class PendingRoom:
    """Destinations that arrived before the room's sender was created."""

    t0: float
    dst: dict[int, Destination] = field(default_factory=dict)


@dataclass
class EarlyAbort:
    """An ABORT that arrived before the room's sender: it fails the sender on creation."""

    t: float
    failure: Failure


@dataclass
class Outcome:
    state: KVPoll
    error: str
    code: Optional[TransferErrorCode]


@dataclass
class SenderRoom:
    room: Room
    decode_instance: Optional[str]
    created: float
    state: KVPoll = KVPoll.BOOTSTRAPPING
    error: str = ""
    error_code: Optional[TransferErrorCode] = None
    failing: bool = False
    quiesce_deadline: float = 0.0
    deadline: float = 0.0
    dtp: int = 0
    dinst: str = ""
    dst: dict[int, Destination] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    next_start: int = 0
    finishing: bool = False
    row: Optional[MetadataRow] = None
    inflight: list[Xfer] = field(default_factory=list)
    sent: collections.Counter = field(default_factory=collections.Counter)  # drank -> posted
    fin_sent: set[int] = field(default_factory=set)
    meta_x: dict[int, Xfer] = field(default_factory=dict)
    staging: int = -1  # our metadata slot holding the row while it is written
    abort_req: Optional[Failure] = None
    adopted: bool = False
    stats: dict = field(default_factory=lambda: {"xfers": 0, "descs": 0, "bytes": 0})


class SenderSide:
    """The prefill state machine of one engine."""

    def __init__(self, engine: "TransferEngine"):
        self.e = engine
        self.rooms: dict[tuple, SenderRoom] = {}
        self.pending: dict[tuple, PendingRoom] = {}
        self.done: collections.OrderedDict[tuple, Outcome] = collections.OrderedDict()
        self.peers: dict[tuple, DecodePeer] = {}  # (decode instance, decode rank) -> peer
        self.early_aborts: dict[tuple, EarlyAbort] = {}

    # -- handle calls ---------------------------------------------------------------------
    def create(self, room: Room, decode_instance: Optional[str]) -> KVSender:
        e = self.e
        with e._lock:
            now = time.monotonic()
            # Decode sends its destination once it admitted the room: a queue wait (queue_s).
            st = SenderRoom(room, decode_instance, now, deadline=now + e.cfg.queue_s)
            h = KVSender(e, st)
            if room.key in self.rooms or room.key in self.done:
                st.state = KVPoll.FAILED
                st.error, st.error_code = f"duplicate sender for {room}", Code.DUPLICATE
                return h
            self.rooms[room.key] = st
        e._wake()
        return h

    def queue_chunk(self, st: SenderRoom, src: np.ndarray, start: Optional[int], ready: Any = None) -> bool:
        """Under the lock. False: the room already failed (nothing to send)."""
        if st.failing or st.abort_req is not None or st.state == KVPoll.FAILED:
            return False
        if st.finishing:
            raise TransferError(f"room {st.room}: send_pages after finish", Code.INVALID)
        s = st.next_start if start is None else int(start)
        if s < 0:
            raise ValueError("start must be >= 0")
        if src.size and (src.min() < 0 or any(src.max() >= p.num_pages
                                              for p in self.e._pools.values() if p.spec.item_bytes)):
            raise ValueError("source page id out of range")
        st.chunks.append(Chunk(src, s, ready=ready))
        st.next_start = s + src.size
        return True

    def finish(self, st: SenderRoom, row: Optional[MetadataRow]) -> bool:
        """Under the lock. False: the room already failed."""
        if st.failing or st.abort_req is not None or st.state == KVPoll.FAILED:
            return False
        if st.finishing:
            raise TransferError(f"room {st.room}: finish called twice", Code.INVALID)
        if row is not None:  # fail now, in the caller, if the row does not fit a slot
            row.encode(self.e.cfg.meta_slot_bytes, st.room.id, st.room.generation)
        st.row, st.finishing = row, True
        return True

    # -- for the core ---------------------------------------------------------------------
    def active(self) -> bool:
        return bool(self.rooms or self.pending)

    def has_rooms(self) -> bool:
        return bool(self.rooms)

    def on_message(self, ep: str, msg: Message, now: float) -> bool:
        if isinstance(msg, Hello):
            self._on_hello(ep, msg)
        elif isinstance(msg, RoomDestination):
            self._on_room(ep, msg, now)
        elif isinstance(msg, Abort):
            self._on_abort(ep, msg)
        else:
            return False
        return True

    def on_notif(self, n: Notif) -> bool:
        return False  # notifications go to decode; one here is stale

    def step(self, now: float) -> None:
        for st in list(self.rooms.values()):
            self._step_room(st, now)
        timeout = self.e.cfg.queue_s  # a ROOM with no sender yet: the request is in prefill's queue
        for key, ab in list(self.early_aborts.items()):
            if now - ab.t > timeout:
                del self.early_aborts[key]
        for key, p in list(self.pending.items()):
            if now - p.t0 > timeout:
                del self.pending[key]
                for dest in p.dst.values():
                    self.e._send(dest.ep, self._fail_msg(
                        Room(*key), Code.QUEUE_TIMEOUT,
                        f"not admitted by prefill within {timeout:g}s (queued)", True))

    def watched(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for st in self.rooms.values():
            if st.state != KVPoll.BOOTSTRAPPING or st.dst:
                for dest in st.dst.values():
                    out.setdefault(dest.ep, []).append(st)
        return out

    def peer_dead(self, ep: str, rooms: list) -> None:
        for key, p in list(self.peers.items()):
            if p.ep == ep:
                for st in rooms:
                    self._fail(st, Code.PEER_DEAD, f"decode rank {p.drank} at {ep} unresponsive")
                for st in rooms:  # a dead target cannot take writes: stop waiting on them
                    for x in st.inflight + list(st.meta_x.values()):
                        if x.peer == p.agent:
                            self.e._backend.abort(x)
                del self.peers[key]
                self.e._backend.remove_peer(p.agent)

    def fail_all(self, failure: Failure) -> None:
        for st in list(self.rooms.values()):
            self._fail(st, failure.code, failure.reason)

    def abort_all(self, failure: Failure) -> None:
        for st in self.rooms.values():
            if st.abort_req is None:
                st.abort_req = failure

    # -- control messages -----------------------------------------------------------------
    def _fail_msg(self, room: Room, code: TransferErrorCode, reason: str, quiesced: bool) -> Fail:
        return Fail(room, self.e.pp_rank, self.e.tp_rank, reason, quiesced, code)

    def _on_hello(self, ep: str, h: Hello) -> None:
        e = self.e
        key = (h.inst, h.drank)
        try:
            if h.version != PROTOCOL_VERSION:
                raise TableMismatch("version", f"protocol {h.version} != {PROTOCOL_VERSION}")
            dtable = BufferTable.from_wire(h.table)
            mine = e.table
            for spec in mine.buffers:
                if spec.name not in dtable:
                    raise TableMismatch("name", f"buffer '{spec.name}' not on decode")
                check_pair(spec, dtable[spec.name], e.tp_size, h.dtp,
                           f"pp {e.pp_rank} tp {e.tp_rank}: ")
            for seg in h.routes:
                if seg.buffer not in mine or mine[seg.buffer].item_bytes != seg.src_item:
                    raise TableMismatch("layers", f"route for '{seg.buffer}' does not fit this "
                                        "rank's page item")
                if seg.src_off + seg.length > seg.src_item or dtable[seg.buffer].item_bytes != \
                        seg.dst_item or seg.dst_off + seg.length > seg.dst_item:
                    raise TableMismatch("layers", f"route for '{seg.buffer}' out of bounds")
            old = self.peers.get(key)
            if old is not None and old.agent != h.agent:
                e._backend.remove_peer(old.agent)
            agent = e._backend.add_peer(h.agent_md) if (
                old is None or old.agent != h.agent) else old.agent
            self.peers[key] = DecodePeer(h.inst, h.drank, h.dtp, ep, agent, dict(h.regions),
                                         h.meta, list(h.routes), h.writer)
            e._send(ep, HelloAck(True, e.pp_rank, e.tp_rank, h.addr))
        except TableMismatch as x:
            e._send(ep, HelloAck(False, e.pp_rank, e.tp_rank, h.addr, x.field, str(x),
                                 Code.TABLE_MISMATCH))
        except Exception as x:
            log.exception("HELLO from %s", ep)
            e._send(ep, HelloAck(False, e.pp_rank, e.tp_rank, h.addr, "", repr(x), Code.INTERNAL))

    def _supersede(self, room: Room) -> None:
        for key, st in list(self.rooms.items()):
            if key[0] == room.id and key[1] < room.generation and not st.failing:
                self._fail(st, Code.SUPERSEDED, f"superseded by generation {room.generation}")
        for key in [k for k in self.pending if k[0] == room.id and k[1] < room.generation]:
            p = self.pending.pop(key)
            for dest in p.dst.values():
                self.e._send(dest.ep, self._fail_msg(Room(*key), Code.SUPERSEDED, "superseded",
                                                     True))

    def _on_room(self, ep: str, m: RoomDestination, now: float) -> None:
        e, room = self.e, m.room
        peer = self.peers.get((m.inst, m.drank))
        if peer is None or peer.ep != ep:
            e._send(ep, self._fail_msg(room, Code.INVALID, "ROOM before a successful HELLO", True))
            return
        dest = Destination(m.drank, m.inst, m.dtp, m.pages, m.slot, ep)
        if room.key in self.done:
            out = self.done[room.key]
            e._send(ep, self._fail_msg(room, out.code or Code.DUPLICATE,
                                       f"room already {out.state.name.lower()} on prefill"
                                       + (f": {out.error}" if out.error else ""), True))
            return
        newer = [k for k in list(self.rooms) + list(self.pending)
                 if k[0] == room.id and k[1] > room.generation]
        if newer:
            e._send(ep, self._fail_msg(room, Code.SUPERSEDED,
                                       f"stale generation (have {newer[0][1]})", True))
            return
        self._supersede(room)
        st = self.rooms.get(room.key)
        if st is None:
            self.pending.setdefault(room.key, PendingRoom(now)).dst[m.drank] = dest
        else:
            self._add_dst(st, dest)

    def _add_dst(self, st: SenderRoom, dest: Destination) -> None:
        e = self.e
        if st.failing or st.state in TERMINAL:
            e._send(dest.ep, self._fail_msg(st.room, st.error_code or Code.DUPLICATE,
                                            st.error or "sender finished", True))
            return
        refusal = None
        if st.decode_instance and dest.inst != st.decode_instance:
            refusal = (f"ROOM from decode instance {dest.inst!r}, expected "
                       f"{st.decode_instance!r}")
        elif st.dst and (dest.inst != st.dinst or dest.dtp != st.dtp):
            refusal = "ROOM messages from inconsistent decode instances"
        if refusal:
            self._fail(st, Code.INVALID, refusal)
            e._send(dest.ep, self._fail_msg(st.room, st.error_code, st.error, True))
            return
        peer = self.peers[(dest.inst, dest.drank)]
        pages = dest.pages
        for seg in peer.routes:
            n = peer.regions[seg.buffer].num_pages
            if pages.size and (pages.min() < 0 or pages.max() >= n):
                st.dst[dest.drank] = dest
                self._fail(st, Code.INVALID, f"destination page out of range for '{seg.buffer}'")
                return
        st.dinst, st.dtp = dest.inst, dest.dtp
        st.dst[dest.drank] = dest
        # The sender exists, so prefill admitted the room: decode's transfer clock starts now.
        e._send(dest.ep, Accepted(st.room, e.pp_rank, e.tp_rank))

    def _on_abort(self, ep: str, m: Abort) -> None:
        e, room = self.e, m.room
        reason = f"aborted by decode rank {m.drank}: {m.reason}"
        st = self.rooms.get(room.key)
        if st is not None:
            self._fail(st, m.code, reason)
            return
        self.pending.pop(room.key, None)
        if room.key not in self.done:  # the sender may not exist yet: fail it on creation
            self.early_aborts[room.key] = EarlyAbort(time.monotonic(), Failure(m.code, reason))
        e._send(ep, Quiesced(room, e.pp_rank, e.tp_rank))

    # -- the room's state machine ---------------------------------------------------------
    def _my_receivers(self, st: SenderRoom) -> list[int]:
        out = []
        for d in sorted(st.dst):
            p = self.peers.get((st.dinst, d))
            if p is not None and (p.routes or p.writer):
                out.append(d)
        return out

    def _step_room(self, st: SenderRoom, now: float) -> None:
        e = self.e
        b = e._backend
        if not st.adopted:
            st.adopted = True
            self._supersede(st.room)
            pend = self.pending.pop(st.room.key, None)
            if pend:
                for dest in pend.dst.values():
                    self._add_dst(st, dest)
            ab = self.early_aborts.pop(st.room.key, None)
            if ab is not None and st.abort_req is None:
                st.abort_req = ab.failure
        if st.abort_req is not None and not st.failing:
            self._fail(st, st.abort_req.code, st.abort_req.reason)
        for x in st.inflight:
            b.poll(x)
        for x in st.meta_x.values():
            b.poll(x)
        if st.failing:
            for x in st.inflight + list(st.meta_x.values()):
                if x.handle is not None and x.state == PROC:
                    b.abort(x)
            st.inflight = [x for x in st.inflight if x.handle is not None]
            alive = [x for x in st.meta_x.values() if x.handle is not None]
            if (not st.inflight and not alive) or now > st.quiesce_deadline:
                if st.inflight or alive:
                    log.warning("%s: room %s: transfers still in flight after quiesce timeout",
                                e.name, st.room)
                self._retire(st, KVPoll.FAILED)
                for dest in st.dst.values():
                    e._send(dest.ep, Quiesced(st.room, e.pp_rank, e.tp_rank))
            return
        errs = [x for x in st.inflight + list(st.meta_x.values()) if x.state == ERR]
        if errs:
            self._fail(st, Code.BACKEND, f"transfer error: {errs[0].error}")
            return
        st.inflight = [x for x in st.inflight if x.state == PROC]
        if st.state == KVPoll.BOOTSTRAPPING:
            if st.dtp and len(st.dst) == st.dtp:
                st.state = KVPoll.WAITING_FOR_INPUT
                st.deadline = now + e.cfg.transfer_timeout_s
            elif now > st.deadline:
                if st.dst:
                    self._fail(st, Code.BOOTSTRAP_TIMEOUT, f"bootstrap timeout: destination info "
                               f"from {len(st.dst)}/{st.dtp or '?'} decode ranks")
                else:  # decode has not admitted the room (its queue) or never will
                    self._fail(st, Code.QUEUE_TIMEOUT, f"no decode rank sent its destination within "
                               f"{e.cfg.queue_s:g}s (queued on decode)")
                return
            else:
                return
        if now > st.deadline:
            self._fail(st, Code.TRANSFER_TIMEOUT, "transfer timeout")
            return
        recv = self._my_receivers(st)
        for c in st.chunks:
            if not c.is_ready():
                return  # its pages are still being computed; later chunks are queued after it
            for d in recv:
                if d in c.posted:
                    continue
                if not self._post_chunk(st, c, d):
                    return
                c.posted.add(d)
        if not st.finishing or st.inflight:
            return
        # The data landed: commit with the row (its writer) or a completion notice.
        for d in recv:
            if d in st.fin_sent:
                continue
            peer = self.peers[(st.dinst, d)]
            if peer.writer:
                x = st.meta_x.get(d)
                if x is None:
                    if st.row is None:
                        self._fail(st, Code.INVALID, "this rank writes the metadata row: "
                                   "finish(row) needs the row")
                        return
                    self._post_meta(st, d, peer)
                elif x.state == DONE:
                    st.fin_sent.add(d)
            else:
                msg = Notif("F", st.room, e.pp_rank, e.tp_rank, st.sent[d]).encode()
                if not b.send_notif(peer.agent, msg):
                    self._fail(st, Code.BACKEND, f"completion to decode rank {d} failed")
                    return
                st.fin_sent.add(d)
        if all(d in st.fin_sent for d in recv):
            self._retire(st, KVPoll.SUCCESS)

    def _post_chunk(self, st: SenderRoom, c: Chunk, d: int) -> bool:
        e = self.e
        pages = st.dst[d].pages
        n = c.src.size
        if c.start + n > pages.size:
            self._fail(st, Code.INVALID, f"chunk [{c.start}, {c.start + n}) beyond the "
                       f"{pages.size} destination pages")
            return False
        peer = self.peers[(st.dinst, d)]
        if not peer.routes or n == 0:
            return True
        runs = page_runs(c.src, pages[c.start:c.start + n])
        # One transfer per (memory kind, device) on each side: a transfer names one memory
        # type per side, and each group's descriptors carry one device id.
        groups: dict[tuple, list] = {}
        for seg in peer.routes:
            lreg = e._pools[seg.buffer].region
            r = peer.regions[seg.buffer]
            sa, da, ln = segment_descs(seg, runs, lreg.addr, r.addr)
            groups.setdefault((lreg.mem, lreg.device, r.mem, r.device), []).append((sa, da, ln))
        for (lmem, ldev, rmem, rdev), parts in groups.items():
            sa = np.concatenate([p[0] for p in parts])
            da = np.concatenate([p[1] for p in parts])
            ln = np.concatenate([p[2] for p in parts])
            src = np.stack([sa, ln, np.full_like(ln, ldev)], axis=1)
            dst = np.stack([da, ln, np.full_like(ln, rdev)], axis=1)
            st.sent[d] += 1
            x = e._backend.post_write(peer.agent, src, lmem, dst, rmem,
                                      Notif("D", st.room, e.pp_rank, e.tp_rank,
                                            st.sent[d]).encode())
            st.stats["xfers"] += 1
            st.stats["descs"] += int(src.shape[0])
            st.stats["bytes"] += int(ln.sum())
            st.inflight.append(x)
            if x.state == ERR:
                self._fail(st, Code.BACKEND, f"transfer error: {x.error}")
                return False
        if st.state == KVPoll.WAITING_FOR_INPUT:
            st.state = KVPoll.TRANSFERRING
        return True

    def _post_meta(self, st: SenderRoom, d: int, peer: DecodePeer) -> None:
        e = self.e
        S = e.cfg.meta_slot_bytes
        slots = e._slots
        if st.staging < 0:
            slot = slots.alloc()
            if slot is None:
                return  # retry next iteration; bounded by the transfer deadline
            st.staging = slot
        raw = st.row.encode(S, st.room.id, st.room.generation)
        ln = min(S, peer.meta.slot_bytes, (len(raw) + 63) // 64 * 64)
        staged = slots.view(st.staging)
        staged[:] = 0
        staged[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        slot = st.dst[d].slot
        m = peer.meta
        if not 0 <= slot < m.nslots:
            self._fail(st, Code.INVALID, f"metadata slot {slot} out of range")
            return
        src = np.array([[slots.addr(st.staging), ln, 0]], dtype=np.uint64)
        dst = np.array([[m.addr + slot * m.slot_bytes, ln, m.device]], dtype=np.uint64)
        x = e._backend.post_write(peer.agent, src, "DRAM", dst, m.mem,
                                  Notif("F", st.room, e.pp_rank, e.tp_rank, st.sent[d],
                                        True).encode())
        st.meta_x[d] = x
        st.stats["xfers"] += 1

    def _fail(self, st: SenderRoom, code: TransferErrorCode, reason: str) -> None:
        if st.failing or st.state in TERMINAL:
            return
        st.failing, st.error, st.error_code = True, reason, code
        st.quiesce_deadline = time.monotonic() + self.e.cfg.quiesce_timeout_s
        log.info("%s: room %s failed: %s", self.e.name, st.room, reason)
        busy = any(x.handle is not None for x in st.inflight + list(st.meta_x.values()))
        for dest in st.dst.values():
            self.e._send(dest.ep, self._fail_msg(st.room, code, reason, not busy))

    def _retire(self, st: SenderRoom, state: KVPoll) -> None:
        if st.staging >= 0:
            self.e._slots.release(st.staging)
            st.staging = -1
        self.rooms.pop(st.room.key, None)
        self.done[st.room.key] = Outcome(state, st.error, st.error_code)
        while len(self.done) > _MAX_DONE:
            self.done.popitem(last=False)
        st.state = state
