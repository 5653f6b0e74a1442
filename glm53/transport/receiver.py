"""The decode role: bootstrap to a prefill instance's ranks, destinations, notifications, the
done check and failures.

Per prefill instance (by bootstrap address): QUERY the bootstrap server until the topology is
complete, check the ranks' tables against ours, plan the byte routes and say HELLO to every
rank. Per room: once connected and given pages, send ROOM to every prefill rank and wait for
prefill to admit the room (ACCEPTED, or its first data notice; the queue wait is bounded by
``TransportConfig.queue_s`` and fails as QUEUE_TIMEOUT), then, within the transfer timeout from that moment, count the data notices
of each expected sender; the room succeeds when every sender's completion arrived,
its announced transfer count matches, and the metadata row written last checks (room id,
generation, crc). A failed room reports FAILED only once no prefill rank can still write into
its pages (docs/ARCHITECTURE.md, "Transfer lifecycle"). Runs on the engine's progress thread,
under its lock, except the handle calls at the top.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import zmq

from .buffers import BufferTable, MetadataRow, TableMismatch
from .handles import (TERMINAL, Failure, KVPoll, KVReceiver, Room, TransferError,
                      TransferErrorCode)
from .mapping import TransferPlan, plan_transfers
from .messages import (PROTOCOL_VERSION, Abort, Accepted, Fail, Hello, HelloAck, Message, Notif,
                       Ping, Query, Quiesced, RemoteRegion, RoomDestination, Topology,
                       decode_message, unpack)

if TYPE_CHECKING:
    from .engine import TransferEngine

log = logging.getLogger("glm53.transport")

Code = TransferErrorCode
RankKey = tuple  # (pp, tp) of a prefill rank


@dataclass
class PrefillRank:
    pp: int
    tp: int
    ep: str
    agent: str
    hello: str = "none"  # none | sent | ok | failed


@dataclass
class PrefillInstance:
    """One prefill instance, by bootstrap address."""

    addr: str
    sock: Any  # DEALER to its bootstrap server
    state: str = "query"  # query | ready | failed
    error: str = ""
    error_field: str = ""  # for a table mismatch: the field
    error_code: Optional[TransferErrorCode] = None
    last_query: float = 0.0
    instance: str = ""
    pp_size: int = 0
    tp_size: int = 0
    plan: Optional[TransferPlan] = None
    want_until: float = 0.0  # keep querying until then (connect())
    probe_until: float = 0.0  # quiet ranks pinged: re-query unless they answer by then
    ranks: dict[RankKey, PrefillRank] = field(default_factory=dict)

    def connected(self) -> bool:
        return self.state == "ready" and all(r.hello == "ok" for r in self.ranks.values())

    def fail(self, code: TransferErrorCode, error: str, error_field: str = "") -> None:
        self.state, self.error_code, self.error, self.error_field = "failed", code, error, \
            error_field


@dataclass
class ReceiverRoom:
    room: Room
    addr: str  # the prefill instance's bootstrap address
    created: float
    state: KVPoll = KVPoll.BOOTSTRAPPING
    error: str = ""
    error_code: Optional[TransferErrorCode] = None
    error_field: str = ""
    failing: bool = False
    quiesce_deadline: float = 0.0
    deadline: float = 0.0
    # When prefill admitted the room (0: not yet). Before it the deadline bounds prefill's queue
    # (bootstrap timeout), after it the transfer (transfer timeout).
    accepted: float = 0.0
    pages: Optional[np.ndarray] = None
    slot: int = -1
    own_slot: bool = False
    room_sent: dict[RankKey, str] = field(default_factory=dict)  # told where to write -> ep
    expected: list[RankKey] = field(default_factory=list)  # senders that write into us
    ndata: collections.Counter = field(default_factory=collections.Counter)
    fin: dict[RankKey, Notif] = field(default_factory=dict)  # completions
    quiesced: set[RankKey] = field(default_factory=set)
    row: Optional[MetadataRow] = None
    abort_req: Optional[Failure] = None


class ReceiverSide:
    """The decode state machine of one engine."""

    def __init__(self, engine: "TransferEngine"):
        self.e = engine
        self.rooms: dict[tuple, ReceiverRoom] = {}
        self.instances: dict[str, PrefillInstance] = {}
        self.want: set[str] = set()  # bootstrap addresses to (re)connect to
        self.want_until: dict[str, float] = {}

    # -- handle and engine API calls (caller threads) -------------------------------------
    def create(self, room: Room, addr: str, dst_pages, meta_slot: Optional[int]) -> KVReceiver:
        e = self.e
        with e._lock:
            if room.key in self.rooms:
                raise TransferError(f"duplicate live receiver for {room}", Code.DUPLICATE)
            now = time.monotonic()
            rt = ReceiverRoom(room, addr, now, deadline=now + e.cfg.bootstrap_timeout_s)
            self.rooms[room.key] = rt
            self.want.add(addr)
            h = KVReceiver(e, rt)
        if dst_pages is not None:
            try:
                self.set_destination(rt, dst_pages, meta_slot)
            except (TransferError, ValueError):
                with e._lock:  # nothing was sent for this room yet: forget it entirely
                    self.rooms.pop(room.key, None)
                raise
        e._wake()
        return h

    def connect(self, addr: str, timeout: Optional[float]) -> None:
        e = self.e
        deadline = time.monotonic() + (timeout or e.cfg.bootstrap_timeout_s)
        with e._lock:
            self.want.add(addr)
            self.want_until[addr] = deadline
        e._wake()
        while time.monotonic() < deadline:
            with e._lock:
                inst = self.instances.get(addr)
                if inst is not None and addr not in self.want:
                    if inst.state == "failed":
                        if inst.error_field:
                            raise TableMismatch(inst.error_field, inst.error)
                        raise TransferError(inst.error, inst.error_code)
                    if inst.connected():
                        return
            time.sleep(0.005)
        raise TimeoutError(f"prefill instance at {addr}: not connected after "
                           f"{timeout or e.cfg.bootstrap_timeout_s}s")

    def set_destination(self, rt: ReceiverRoom, pages, meta_slot: Optional[int]) -> None:
        e = self.e
        p = np.asarray(pages, dtype=np.int64).reshape(-1).copy()
        with e._lock:
            if rt.pages is not None:
                raise TransferError(f"room {rt.room}: destination already set", Code.INVALID)
            if rt.failing or rt.state in TERMINAL:
                raise TransferError(f"room {rt.room}: receiver already failed", Code.INVALID)
            for n, pool in e._pools.items():
                if pool.spec.item_bytes and p.size and (p.min() < 0 or p.max() >= pool.num_pages):
                    raise ValueError(f"destination page out of range for pool '{n}'")
            if meta_slot is None:
                slot = e._slots.alloc()
                if slot is None:
                    raise TransferError("no free metadata slot", Code.SLOTS_EXHAUSTED)
                rt.slot, rt.own_slot = slot, True
            else:
                if not 0 <= meta_slot < e.cfg.meta_slots:
                    raise ValueError("metadata slot out of range")
                rt.slot = int(meta_slot)
            e._slots.view(rt.slot)[:] = 0  # no stale row can match
            rt.pages = p
        e._wake()

    # -- for the core ---------------------------------------------------------------------
    def active(self) -> bool:
        return bool(self.rooms)

    def has_rooms(self) -> bool:
        return bool(self.rooms)

    def on_message(self, ep: str, msg: Message, now: float) -> bool:
        if isinstance(msg, HelloAck):
            self._on_hello_ack(msg)
        elif isinstance(msg, Accepted):
            rt = self.rooms.get(msg.room.key)
            if rt is not None and (msg.pp, msg.tp) in rt.room_sent:
                self._start_transfer_clock(rt, now)
        elif isinstance(msg, (Fail, Quiesced)):
            self._on_fail(msg)
        else:
            return False
        return True

    def poll_bootstrap(self, now: float) -> None:
        """Connect to wanted instances: (re)query their bootstrap servers, read topologies."""
        for addr in list(self.want):
            inst = self.instances.get(addr)
            if inst is None or (inst.state == "failed" and not inst.error_field):
                inst = self._new_instance(addr)
            inst.want_until = max(inst.want_until, self.want_until.pop(addr, 0.0))
            self.want.discard(addr)
        waiting = {rt.addr for rt in self.rooms.values()
                   if rt.state == KVPoll.BOOTSTRAPPING and not rt.failing}
        for addr, inst in self.instances.items():
            while True:
                try:
                    msg = decode_message(unpack(inst.sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
                if isinstance(msg, Topology) and inst.state == "query" and msg.complete:
                    self._on_topology(inst, msg)
            if inst.state == "query" and (addr in waiting or now < inst.want_until) and \
                    now - inst.last_query > self.e.cfg.query_retry_s:
                inst.last_query = now
                try:
                    inst.sock.send(Query().encode(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def on_notif(self, n: Notif) -> bool:
        rt = self.rooms.get(n.room.key)
        k = (n.pp, n.tp)
        if rt is None or rt.failing or rt.state in TERMINAL or k not in rt.expected:
            return False
        if n.kind == "D":
            # Data can only come from an admitted sender; ACCEPTED travels on another channel.
            self._start_transfer_clock(rt, time.monotonic())
            rt.ndata[k] += 1
            if rt.state == KVPoll.WAITING_FOR_INPUT:
                rt.state = KVPoll.TRANSFERRING
        elif n.kind == "F":
            rt.fin[k] = n
            self._check_done(rt)
        return True

    def step(self, now: float) -> None:
        for rt in list(self.rooms.values()):
            self._step_room(rt, now)

    def watched(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for rt in self.rooms.values():
            for k, ep in rt.room_sent.items():
                if k not in rt.quiesced:
                    out.setdefault(ep, []).append(rt)
        return out

    def peer_dead(self, ep: str, rooms: list) -> None:
        for rt in rooms:
            for k, e in rt.room_sent.items():
                if e == ep:
                    rt.quiesced.add(k)  # a dead process writes nothing more
            self._fail(rt, Code.PEER_DEAD, f"prefill rank at {ep} unresponsive")
        for addr, inst in list(self.instances.items()):
            if any(r.ep == ep for r in inst.ranks.values()):
                self._new_instance(addr)  # re-query: the rank may come back elsewhere

    def fail_all(self, failure: Failure) -> None:
        for rt in list(self.rooms.values()):
            self._fail(rt, failure.code, failure.reason)

    def abort_all(self, failure: Failure) -> None:
        for rt in self.rooms.values():
            if rt.abort_req is None:
                rt.abort_req = failure

    # -- bootstrap ------------------------------------------------------------------------
    def _new_instance(self, addr: str) -> PrefillInstance:
        old = self.instances.get(addr)
        if old is not None:
            self.e._close_polled(old.sock)
        inst = self.instances[addr] = PrefillInstance(addr, self.e._dealer_to(addr, register=True))
        return inst

    def _on_topology(self, inst: PrefillInstance, msg: Topology) -> None:
        e = self.e
        try:
            if msg.version != PROTOCOL_VERSION:
                raise TableMismatch("version", f"protocol {msg.version} != {PROTOCOL_VERSION}")
            pp, tp = msg.pp_size, msg.tp_size
            ranks = {(r.pp, r.tp): r for r in msg.ranks}
            stages = []
            for s in range(pp):
                t0 = BufferTable.from_wire(ranks[(s, 0)].table)
                for t in range(1, tp):
                    if BufferTable.from_wire(ranks[(s, t)].table) != t0:
                        raise TableMismatch("tp", f"stage {s}: TP ranks 0 and {t} differ")
                stages.append(t0)
            plan = plan_transfers(stages, tp, e.table, e.tp_size)
        except TableMismatch as x:
            inst.fail(Code.TABLE_MISMATCH, str(x), x.field)
            return
        inst.instance, inst.pp_size, inst.tp_size, inst.plan = msg.instance, pp, tp, plan
        inst.ranks = {k: PrefillRank(k[0], k[1], r.ep, r.agent) for k, r in ranks.items()}
        inst.state = "ready"
        self._fail_restarted(inst)
        regions = {n: RemoteRegion(p.region.addr, p.spec.item_bytes, p.num_pages, p.region.mem,
                                   p.region.device) for n, p in e._pools.items()}
        meta = e._slots.region()
        for (s, t), r in inst.ranks.items():
            r.hello = "sent"
            e._send(r.ep, Hello(PROTOCOL_VERSION, e.instance, e.tp_rank, inst.addr, e.tp_size,
                                e._backend.name, e._backend.metadata(), e.table.to_wire(),
                                regions, meta, plan.segments(s, t, e.tp_rank),
                                plan.meta_writer[e.tp_rank] == (s, t)))

    def _fail_restarted(self, inst: PrefillInstance) -> None:
        """A fresh topology whose ranks are not those a room sent its ROOM to: the instance
        restarted, and those ranks' process is gone (nothing of theirs can land any more). Fail
        such rooms now, quiesced, rather than at peer liveness or the quiesce timeout."""
        live = {r.ep for r in inst.ranks.values()}
        for rt in list(self.rooms.values()):
            if rt.addr != inst.addr or rt.failing or rt.state in TERMINAL:
                continue
            gone = [k for k, ep in rt.room_sent.items() if ep not in live]
            if gone:
                rt.quiesced.update(gone)
                self._fail(rt, Code.PEER_DEAD, f"prefill instance at {inst.addr} restarted; the ranks this "
                           "room was sent to are gone")

    def _on_hello_ack(self, m: HelloAck) -> None:
        inst = self.instances.get(m.addr)
        if inst is None or inst.state != "ready":
            return
        r = inst.ranks.get((m.pp, m.tp))
        if r is None:
            return
        if m.ok:
            r.hello = "ok"
        else:
            r.hello = "failed"
            inst.fail(m.code, m.error, m.field)

    # -- rooms ----------------------------------------------------------------------------
    def _step_room(self, rt: ReceiverRoom, now: float) -> None:
        e = self.e
        if rt.abort_req is not None and not rt.failing:
            self._fail(rt, rt.abort_req.code, rt.abort_req.reason)
        if rt.failing:
            need = {k for k in rt.room_sent if k in rt.expected} - rt.quiesced
            if not need or now > rt.quiesce_deadline:
                if need:
                    log.warning("%s: room %s: no quiesce ack from %s; freeing after timeout",
                                e.name, rt.room, sorted(need))
                self._retire(rt, KVPoll.FAILED)
            return
        inst = self.instances.get(rt.addr)
        if rt.state == KVPoll.BOOTSTRAPPING:
            if inst is None:
                inst = self._new_instance(rt.addr)
            if inst.state == "failed":
                rt.error_field = inst.error_field
                self._fail(rt, inst.error_code, inst.error)
                return
            if not inst.connected():
                if now > rt.deadline:
                    self._fail(rt, Code.BOOTSTRAP_TIMEOUT, f"bootstrap timeout: prefill instance "
                               f"at {rt.addr} not connected")
                return
            if rt.pages is None:
                return  # the caller has not allocated yet: its wait, not ours
            if not self._answering(inst, now):
                return
            rt.expected = inst.plan.senders_for(e.tp_rank)
            msg = RoomDestination(rt.room, e.instance, e.tp_size, e.tp_rank, rt.pages, rt.slot)
            for k, r in inst.ranks.items():
                e._send(r.ep, msg)
                rt.room_sent[k] = r.ep
            rt.state = KVPoll.WAITING_FOR_INPUT
            # Prefill's queue: it fails a ROOM it has no sender for after the same bound. A
            # queue wait, never a transfer fault (queue_s: the servers' queue bound and more).
            rt.deadline = now + e.cfg.queue_s
            return
        if now > rt.deadline:
            if not rt.accepted:
                self._fail(rt, Code.QUEUE_TIMEOUT, f"queue timeout: prefill instance at "
                           f"{rt.addr} did not admit the room within "
                           f"{e.cfg.queue_s:g}s (queued)")
            else:
                self._fail(rt, Code.TRANSFER_TIMEOUT, "transfer timeout: completion not received "
                           f"from {sorted(set(rt.expected) - set(rt.fin))}")
            return
        self._check_done(rt)

    def _answering(self, inst: PrefillInstance, now: float) -> bool:
        """Whether `inst`'s ranks were heard from recently enough to send them a ROOM. A prefill
        instance that restarted keeps its bootstrap address but not its ranks' endpoints: a ROOM
        sent to the old ones would wait for peer liveness to give up (peer_timeout_s). So the
        ranks of an instance that has been quiet are pinged first, and the instance is queried
        afresh if they do not answer within two heartbeat intervals."""
        e = self.e
        quiet_after = 2 * e.cfg.heartbeat_interval_s
        quiet = [r.ep for r in inst.ranks.values() if now - e._seen.get(r.ep, 0.0) > quiet_after]
        if not quiet:
            inst.probe_until = 0.0
            return True
        if not inst.probe_until:
            inst.probe_until = now + quiet_after
            for ep in quiet:
                e._send(ep, Ping())
        elif now > inst.probe_until:
            log.info("%s: prefill ranks %s at %s silent for %.1fs; querying its bootstrap server "
                     "again", e.name, quiet, inst.addr, quiet_after)
            self._new_instance(inst.addr)
        return False

    def _start_transfer_clock(self, rt: ReceiverRoom, now: float) -> None:
        if rt.accepted or rt.failing or rt.state in TERMINAL:
            return
        rt.accepted = now
        rt.deadline = now + self.e.cfg.transfer_timeout_s

    def _check_done(self, rt: ReceiverRoom) -> None:
        if rt.failing or rt.state in TERMINAL:
            return
        for k in rt.expected:
            if k not in rt.fin:
                return
            n = rt.fin[k].n
            if rt.ndata[k] < n:
                return
            if rt.ndata[k] > n:
                self._fail(rt, Code.INTEGRITY, f"sender {k} announced {n} transfers, "
                           f"{rt.ndata[k]} seen")
                return
        e = self.e
        inst = self.instances.get(rt.addr)
        writer = inst.plan.meta_writer[e.tp_rank] if inst and inst.plan else None
        if writer is None or writer not in rt.fin or not rt.fin[writer].meta:
            self._fail(rt, Code.INTEGRITY, "metadata row not written by its writer")
            return
        try:
            rt.row = MetadataRow.decode(e._slots.view(rt.slot), rt.room.id, rt.room.generation)
        except ValueError as x:
            self._fail(rt, Code.INTEGRITY, f"metadata check failed: {x}")
            return
        rt.quiesced |= set(rt.expected)
        self._retire(rt, KVPoll.SUCCESS)

    def _on_fail(self, m: Fail | Quiesced) -> None:
        rt = self.rooms.get(m.room.key)
        if rt is None:
            return
        k = (m.pp, m.tp)
        if isinstance(m, Quiesced) or m.quiesced:
            rt.quiesced.add(k)
        if isinstance(m, Fail):
            self._fail(rt, m.code, f"prefill rank pp={k[0]} tp={k[1]}: {m.reason}")

    def _fail(self, rt: ReceiverRoom, code: TransferErrorCode, reason: str) -> None:
        if rt.failing or rt.state in TERMINAL:
            return
        e = self.e
        rt.failing, rt.error, rt.error_code = True, reason, code
        rt.quiesce_deadline = time.monotonic() + e.cfg.quiesce_timeout_s
        log.info("%s: room %s failed: %s", e.name, rt.room, reason)
        msg = Abort(rt.room, e.tp_rank, reason, code)
        for k, ep in rt.room_sent.items():
            if k not in rt.quiesced:
                e._send(ep, msg)
        if not rt.room_sent:
            # Nothing was told where to write, so nothing can land; still tell the prefill
            # ranks (if known) so that their sender fails now rather than at its timeout.
            inst = self.instances.get(rt.addr)
            if inst is not None and inst.state == "ready":
                for r in inst.ranks.values():
                    e._send(r.ep, msg)
            self._retire(rt, KVPoll.FAILED)

    def _retire(self, rt: ReceiverRoom, state: KVPoll) -> None:
        if rt.own_slot and rt.slot >= 0:
            self.e._slots.release(rt.slot)
            rt.own_slot = False
        self.rooms.pop(rt.room.key, None)
        rt.state = state
