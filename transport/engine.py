"""Per-rank transfer engine, KV senders (prefill) and receivers (decode). See ``__init__``.

One ``TransferEngine`` per rank owns the NIXL agent, the registered pools, a metadata-slot
region, the ZMQ control socket and one progress thread. All NIXL and ZMQ calls happen on that
thread; ``KVSender`` / ``KVReceiver`` methods only record intent under the engine lock and wake
the thread, so they never block. Every wait the thread performs is bounded by a configured
timeout (bootstrap, transfer, peer liveness, quiesce).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np
import zmq

from .backend import DONE, ERR, PROC, MemRegion, NixlBackend, TransferBackend
from .bootstrap import PROTOCOL_VERSION, pack, unpack
from .buffers import (BufferSpec, BufferTable, MetadataRow, TableMismatch, check_pair)
from .mapping import Segment, TransferPlan, page_runs, plan_transfers, segment_descs

log = logging.getLogger("glm53.transport")


class KVPoll(enum.IntEnum):
    """Transfer state, as in DESIGN §4.5. ``FAILED`` and ``SUCCESS`` are terminal, and are only
    reported once the pages involved are safe to free (no write of this room can still land)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)


@dataclass(frozen=True)
class Room:
    """A request's transfer identity: ``id`` (u64, assigned by the router) and ``generation``
    (u32, bumped on every retry of the same id). Writes and notices of another generation are
    never accepted for this room."""

    id: int
    generation: int = 0

    def __post_init__(self):
        if not (0 <= self.id < 2 ** 64 and 0 <= self.generation < 2 ** 32):
            raise ValueError(f"room id must be u64 and generation u32, got {self}")

    @property
    def key(self) -> tuple[int, int]:
        return (self.id, self.generation)


@dataclass
class TransportConfig:
    """Timeouts in seconds; all bounded. ``transfer_timeout_s`` runs to the commit from the
    moment a side enters WaitingForInput: for a sender, when it has every decode rank's
    destination; for a receiver, when it has sent its destination to the prefill ranks, so on
    decode it also covers the request's queueing and prefill compute. ``peer_timeout_s`` fails
    rooms whose peer sent nothing (not even a heartbeat) for that long."""

    bootstrap_timeout_s: float = 60.0
    transfer_timeout_s: float = 300.0
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 10.0
    quiesce_timeout_s: float = 10.0
    query_retry_s: float = 0.2
    host: str = "127.0.0.1"
    meta_slots: int = 1024
    meta_slot_bytes: int = 1024
    num_threads: int = 0  # NIXL UCX backend worker threads (0: NIXL default)
    # NIXL's UCX progress thread busy-polls a core even when idle. Off, this engine's loop
    # progresses UCX (it polls notifications every 1 ms while a room is live), which is what a
    # host shared by several instances wants; on, for dedicated hosts chasing tcp throughput.
    progress_thread: bool = False


class TransferError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------
# Internal per-room state
# ------------------------------------------------------------------------------------------

@dataclass
class _Chunk:
    src: np.ndarray
    start: int
    posted: set = field(default_factory=set)


@dataclass
class _SenderSt:
    room: Room
    decode_instance: Optional[str]
    created: float
    state: KVPoll = KVPoll.BOOTSTRAPPING
    error: str = ""
    failing: bool = False
    fail_notified: bool = False
    quiesce_deadline: float = 0.0
    deadline: float = 0.0
    dtp: int = 0
    dinst: str = ""
    dst: dict = field(default_factory=dict)  # drank -> (pages, slot, ep)
    chunks: list = field(default_factory=list)
    next_start: int = 0
    finishing: bool = False
    row: Optional[MetadataRow] = None
    inflight: list = field(default_factory=list)
    sent: dict = field(default_factory=collections.Counter)  # drank -> data xfers posted
    fin_sent: set = field(default_factory=set)
    meta_x: dict = field(default_factory=dict)  # drank -> Xfer
    staging: int = -1
    abort_req: str = ""
    adopted: bool = False
    stats: dict = field(default_factory=lambda: {"xfers": 0, "descs": 0, "bytes": 0})


@dataclass
class _ReceiverSt:
    room: Room
    addr: str
    created: float
    state: KVPoll = KVPoll.BOOTSTRAPPING
    error: str = ""
    error_field: str = ""
    failing: bool = False
    quiesce_deadline: float = 0.0
    deadline: float = 0.0
    pages: Optional[np.ndarray] = None
    slot: int = -1
    own_slot: bool = False
    room_sent: dict = field(default_factory=dict)  # (pp,tp) -> ep
    expected: list = field(default_factory=list)
    ndata: dict = field(default_factory=collections.Counter)
    fin: dict = field(default_factory=dict)  # (pp,tp) -> (n, has_meta)
    quiesced: set = field(default_factory=set)
    row: Optional[MetadataRow] = None
    abort_req: str = ""


@dataclass
class _PRank:  # decode's view of one prefill rank
    pp: int
    tp: int
    ep: str
    agent: str
    hello: str = "none"  # none | sent | ok | failed


@dataclass
class _PInst:  # decode's view of one prefill instance (by bootstrap address)
    addr: str
    sock: Any
    state: str = "query"  # query | ready | failed
    error: str = ""
    error_field: str = ""
    last_query: float = 0.0
    instance: str = ""
    pp_size: int = 0
    tp_size: int = 0
    plan: Optional[TransferPlan] = None
    want_until: float = 0.0  # keep querying until then (connect())
    ranks: dict = field(default_factory=dict)  # (pp,tp) -> _PRank

    def connected(self) -> bool:
        return self.state == "ready" and all(r.hello == "ok" for r in self.ranks.values())


@dataclass
class _DPeer:  # prefill's view of one decode rank
    inst: str
    drank: int
    dtp: int
    ep: str
    agent: str
    regions: dict  # name -> (addr, item, num_pages, mem, dev)
    meta: tuple  # (addr, slot_bytes, nslots, mem, dev)
    routes: list  # [Segment]
    writer: bool


# ------------------------------------------------------------------------------------------
# Public handles
# ------------------------------------------------------------------------------------------

class _RoomHandle:
    """What both ends of a room share: its state, error, abort and a bounded wait."""

    _abort_reason = ""

    def __init__(self, engine: "TransferEngine", st):
        self._e, self._st = engine, st

    @property
    def room(self) -> Room:
        return self._st.room

    def poll(self) -> KVPoll:
        return self._st.state

    @property
    def error(self) -> str:
        return self._st.error

    def abort(self, reason: str = "") -> None:
        """Fail the room on both sides. ``poll()`` reports FAILED once no write of this room
        can still land (sender: none in flight, so source pages may be freed; receiver: every
        prefill rank that could write acknowledged, died, or the quiesce timeout passed)."""
        with self._e._lock:
            if not self._st.abort_req:
                self._st.abort_req = reason or self._abort_reason
        self._e._wake()

    def wait(self, timeout: float) -> KVPoll:
        """Poll until terminal or ``timeout`` (tests, tools)."""
        return _wait(self.poll, timeout)


class KVSender(_RoomHandle):
    """Prefill side of one room on one rank. Create with ``TransferEngine.create_sender``."""

    _abort_reason = "aborted by prefill"

    def send_pages(self, src_pages, start: Optional[int] = None) -> None:
        """Queue one completed chunk: ``src_pages`` (this rank's page ids, in request order)
        go to the destination pages ``dst_pages[start : start + len(src_pages)]`` of every
        decode rank this rank writes to. ``start`` defaults to where the previous chunk
        ended. May be called before decode's destination info arrived (writes are posted when
        it does). A no-op once the room failed. Chunks must cover whole pages except the
        request's last page; re-sending a page is allowed (it is overwritten)."""
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1).copy()
        with self._e._lock:
            st = self._st
            if st.failing or st.abort_req or st.state == KVPoll.FAILED:
                return  # the room already failed: nothing to send (poll() says so)
            if st.finishing:
                raise TransferError(f"room {st.room}: send_pages after finish")
            s = st.next_start if start is None else int(start)
            if s < 0:
                raise ValueError("start must be >= 0")
            self._e._check_src_pages(src)
            st.chunks.append(_Chunk(src, s))
            st.next_start = s + src.size
        self._e._wake()

    def finish(self, row: Optional[MetadataRow] = None) -> None:
        """Declare the last chunk sent. On the last PP stage pass the metadata ``row`` (first
        token ids, counts, payload): it is written after this rank's data, as the commit
        record. Other stages pass nothing."""
        with self._e._lock:
            st = self._st
            if st.failing or st.abort_req or st.state == KVPoll.FAILED:
                return
            if st.finishing:
                raise TransferError(f"room {st.room}: finish called twice")
            if row is not None:
                row.encode(self._e.cfg.meta_slot_bytes, st.room.id, st.room.generation)
            st.row, st.finishing = row, True
        self._e._wake()

    @property
    def stats(self) -> dict:
        """Transfers posted, descriptors and bytes written by this sender."""
        return dict(self._st.stats)


class KVReceiver(_RoomHandle):
    """Decode side of one room on one rank. Create with ``TransferEngine.create_receiver``."""

    _abort_reason = "aborted by decode"

    def set_destination(self, pages, meta_slot: Optional[int] = None) -> None:
        """Hand over the destination page ids (request order; the caller allocated them, ideally
        as few contiguous runs) and optionally a metadata slot (else the engine picks one).
        Once the prefill instance is connected, the ranks are told where to write."""
        self._e._set_destination(self._st, pages, meta_slot)

    @property
    def error_field(self) -> str:
        """For a buffer-table mismatch: the field that differs."""
        return self._st.error_field

    def metadata(self) -> MetadataRow:
        """The checked metadata row (room id and generation match). Only after SUCCESS."""
        if self._st.state != KVPoll.SUCCESS or self._st.row is None:
            raise TransferError(f"room {self._st.room}: no metadata (state {self._st.state.name})")
        return self._st.row


def _wait(poll, timeout: float) -> KVPoll:
    deadline = time.monotonic() + timeout
    s = poll()
    while s not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.002)
        s = poll()
    return s


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------

def _notif(kind: str, room: Room, pp: int, tp: int, n: int = 0, meta: int = 0) -> bytes:
    return msgpack.packb(["g53", kind, room.id, room.generation, pp, tp, n, meta])


class TransferEngine:
    """One per rank. ``role`` is ``"prefill"`` or ``"decode"``; decode runs PP 1.

    Lifecycle: construct, ``register_pool`` each pool, ``start(bootstrap_addr)``, create
    senders / receivers per request, ``close()`` at shutdown (fails live rooms, deregisters
    memory, releases the agent)."""

    def __init__(self, role: str, instance: str, tp_size: int = 1, tp_rank: int = 0,
                 pp_size: int = 1, pp_rank: int = 0, config: Optional[TransportConfig] = None,
                 backend: Optional[TransferBackend] = None):
        if role not in ("prefill", "decode"):
            raise ValueError("role must be 'prefill' or 'decode'")
        if role == "decode" and pp_size != 1:
            raise ValueError("decode instances run PP 1")
        self.role, self.instance = role, instance
        self.tp_size, self.tp_rank, self.pp_size, self.pp_rank = tp_size, tp_rank, pp_size, pp_rank
        self.cfg = config or TransportConfig()
        self.name = f"{role}-{instance}-pp{pp_rank}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"
        self._backend: Optional[TransferBackend] = backend
        self._pools: dict[str, tuple[BufferSpec, MemRegion]] = {}
        self._lock = threading.RLock()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        port = self._router.bind_to_random_port(f"tcp://{self.cfg.host}")
        self.endpoint = f"tcp://{self.cfg.host}:{port}"
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._dealers: dict[str, Any] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_pull, zmq.POLLIN)
        self._seen: dict[str, float] = {}
        self._watch: dict[str, float] = {}  # ep -> last ping sent
        self._last_hb = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.started = False
        self.stale_notifs = 0
        self.error = ""
        # prefill
        self._senders: dict[tuple, _SenderSt] = {}
        self._pending: dict[tuple, dict] = {}
        self._done: collections.OrderedDict = collections.OrderedDict()
        self._dpeers: dict[tuple, _DPeer] = {}
        self._aborted: dict[tuple, tuple] = {}  # room key -> (time, reason), before a sender
        self._boot_sock = None
        self._registered = False
        self._reg_error = ""
        # decode
        self._receivers: dict[tuple, _ReceiverSt] = {}
        self._pinsts: dict[str, _PInst] = {}
        self._want: set[str] = set()
        self._want_until: dict[str, float] = {}
        self._reg_t = 0.0
        self._meta_arr: Optional[np.ndarray] = None
        self._free_slots: list[int] = []

    # -- setup ----------------------------------------------------------------------------
    def register_pool(self, name: str, pool: Any, layers, total_heads: Optional[int] = None,
                      spec: Optional[BufferSpec] = None) -> BufferSpec:
        """Register one page-major pool (torch tensor on CPU/GPU, numpy array, or MemRegion
        with an explicit ``spec``). Replicated pools are ``[num_pages, n_layers, page_size,
        ...]``; head-sharded ones ``[num_pages, heads_local, n_layers, page_size, head_dim]``
        with ``total_heads``. Returns the derived ``BufferSpec``."""
        if self.started:
            raise TransferError("register pools before start()")
        if spec is None:
            spec = BufferSpec.for_tensor(name, pool, layers, total_heads=total_heads)
        reg = MemRegion.of(pool)
        if spec.item_bytes and reg.nbytes % spec.item_bytes:
            raise ValueError(f"pool {name}: {reg.nbytes} B is not a whole number of "
                             f"{spec.item_bytes} B page items")
        self._pools[name] = (spec, reg)
        return spec

    @property
    def table(self) -> BufferTable:
        return BufferTable(tuple(s for s, _ in self._pools.values()))

    def num_pages(self, name: str) -> int:
        spec, reg = self._pools[name]
        return reg.nbytes // spec.item_bytes if spec.item_bytes else 0

    def start(self, bootstrap_addr: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Register memory and start the progress thread. A prefill rank registers with the
        bootstrap server at ``bootstrap_addr`` and waits (bounded by ``timeout``, default the
        bootstrap timeout) for the acknowledgement."""
        if self.started:
            return
        if self._backend is None:
            self._backend = NixlBackend(self.name, self.cfg.num_threads, self.cfg.progress_thread)
        S = self.cfg.meta_slot_bytes
        self._meta_arr = np.zeros(self.cfg.meta_slots * S, dtype=np.uint8)
        self._free_slots = list(range(self.cfg.meta_slots - 1, -1, -1))
        regions = [r for _, r in self._pools.values() if r.nbytes] + [MemRegion.of(self._meta_arr)]
        self._backend.register(regions)
        self.started = True
        if self.role == "prefill":
            if not bootstrap_addr:
                raise ValueError("a prefill rank needs the bootstrap server address")
            self._boot_sock = self._dealer_to(bootstrap_addr, register=True)
            self._register_msg = {
                "t": "REGISTER", "v": PROTOCOL_VERSION, "instance": self.instance,
                "pp": self.pp_rank, "tp": self.tp_rank, "pp_size": self.pp_size,
                "tp_size": self.tp_size, "ep": self.endpoint, "agent": self._backend.name,
                "agent_md": self._backend.metadata(), "table": self.table.to_wire()}
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-{self.name}", daemon=True)
        self._thread.start()
        if self.role == "prefill":
            deadline = time.monotonic() + (timeout or self.cfg.bootstrap_timeout_s)
            while not self._registered and time.monotonic() < deadline and not self._reg_error:
                time.sleep(0.005)
            if self._reg_error:
                raise TransferError(f"bootstrap registration refused: {self._reg_error}")
            if not self._registered:
                raise TimeoutError(f"bootstrap server {bootstrap_addr} did not answer")

    def close(self) -> None:
        """Fail live rooms (notifying peers), stop the thread, deregister memory."""
        if not self.started:
            self._ctx.destroy(0)
            return
        with self._lock:
            for st in list(self._senders.values()):
                st.abort_req = st.abort_req or "engine closed"
            for rt in list(self._receivers.values()):
                rt.abort_req = rt.abort_req or "engine closed"
        self._wake()
        deadline = time.monotonic() + min(self.cfg.quiesce_timeout_s, 2.0)
        while time.monotonic() < deadline and (self._senders or self._receivers):
            time.sleep(0.005)
        self._stop.set()
        self._wake()
        if self._thread:
            self._thread.join(timeout=5)
        if self._boot_sock is not None:
            try:
                self._boot_sock.send(pack({"t": "UNREGISTER", "pp": self.pp_rank,
                                           "tp": self.tp_rank}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._backend is not None:
            self._backend.close()
        self._ctx.destroy(0)
        self.started = False

    # -- decode API -----------------------------------------------------------------------
    def create_receiver(self, room: Room, bootstrap_addr: str, dst_pages=None,
                        meta_slot: Optional[int] = None) -> KVReceiver:
        """Decode: a receiver for ``room`` fed by the prefill instance whose bootstrap server is
        at ``bootstrap_addr``. Pass ``dst_pages`` now or later via ``set_destination``."""
        self._need("decode")
        with self._lock:
            if room.key in self._receivers:
                raise TransferError(f"duplicate live receiver for {room}")
            now = time.monotonic()
            rt = _ReceiverSt(room, bootstrap_addr, now,
                             deadline=now + self.cfg.bootstrap_timeout_s)
            self._receivers[room.key] = rt
            self._want.add(bootstrap_addr)
            h = KVReceiver(self, rt)
        if dst_pages is not None:
            try:
                self._set_destination(rt, dst_pages, meta_slot)
            except (TransferError, ValueError):
                with self._lock:  # nothing was sent for this room yet: forget it entirely
                    self._receivers.pop(room.key, None)
                raise
        self._wake()
        return h

    def connect(self, bootstrap_addr: str, timeout: Optional[float] = None) -> None:
        """Decode: connect to a prefill instance ahead of the first request (topology, table
        check, HELLO to every rank). Raises ``TableMismatch`` naming the field, or
        ``TimeoutError``."""
        self._need("decode")
        deadline = time.monotonic() + (timeout or self.cfg.bootstrap_timeout_s)
        with self._lock:
            self._want.add(bootstrap_addr)
            self._want_until[bootstrap_addr] = deadline
        self._wake()
        while time.monotonic() < deadline:
            with self._lock:
                inst = self._pinsts.get(bootstrap_addr)
                if inst is not None and bootstrap_addr not in self._want:
                    if inst.state == "failed":
                        if inst.error_field:
                            raise TableMismatch(inst.error_field, inst.error)
                        raise TransferError(inst.error)
                    if inst.connected():
                        return
            time.sleep(0.005)
        raise TimeoutError(f"prefill instance at {bootstrap_addr}: not connected after "
                           f"{timeout or self.cfg.bootstrap_timeout_s}s")

    # -- prefill API ----------------------------------------------------------------------
    def create_sender(self, room: Room, decode_instance: Optional[str] = None) -> KVSender:
        """Prefill: a sender for ``room``. The decode ranks tell it where to write (their ROOM
        messages may arrive before or after this call). ``decode_instance``, if given, is
        checked against the decode ranks that show up."""
        self._need("prefill")
        with self._lock:
            now = time.monotonic()
            st = _SenderSt(room, decode_instance, now, deadline=now + self.cfg.bootstrap_timeout_s)
            h = KVSender(self, st)
            if room.key in self._senders or room.key in self._done:
                st.state, st.error = KVPoll.FAILED, f"duplicate sender for {room}"
                return h
            self._senders[room.key] = st
        self._wake()
        return h

    # -- internals: helpers ---------------------------------------------------------------
    def _need(self, role: str) -> None:
        if self.role != role:
            raise TransferError(f"this is a {self.role} engine")
        if not self.started:
            raise TransferError("engine not started")

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _dealer_to(self, ep: str, register: bool = False):
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10000)
        if not register:
            s.setsockopt(zmq.IDENTITY, self.endpoint.encode())
        s.connect(ep)
        if register:
            self._poller.register(s, zmq.POLLIN)
        return s

    def _send(self, ep: str, msg: dict) -> None:
        s = self._dealers.get(ep)
        if s is None:
            s = self._dealers[ep] = self._dealer_to(ep)
        try:
            s.send(pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            log.debug("%s: drop %s to %s", self.name, msg.get("t"), ep)

    def _check_src_pages(self, src: np.ndarray) -> None:
        if src.size and (src.min() < 0 or any(src.max() >= self.num_pages(n)
                                              for n, (s, _) in self._pools.items() if s.item_bytes)):
            raise ValueError("source page id out of range")

    def _new_pinst(self, addr: str) -> _PInst:
        old = self._pinsts.get(addr)
        if old is not None:
            self._poller.unregister(old.sock)
            old.sock.close(0)
        inst = self._pinsts[addr] = _PInst(addr, self._dealer_to(addr, register=True))
        return inst

    # -- the progress thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            active = bool(self._senders or self._receivers or self._pending)
            try:
                ready = dict(self._poller.poll(1 if active else 20))
            except zmq.ZMQError:
                break
            try:
                with self._lock:
                    self._step(ready)
            except Exception as e:  # never die silently: fail what is live and keep serving
                log.exception("%s: progress loop error", self.name)
                self.error = f"{type(e).__name__}: {e}"
                with self._lock:
                    for st in list(self._senders.values()):
                        self._fail_sender(st, f"internal error: {self.error}")
                    for rt in list(self._receivers.values()):
                        self._fail_receiver(rt, f"internal error: {self.error}")

    def _step(self, ready: dict) -> None:
        now = time.monotonic()
        if self._wake_pull in ready:
            while True:
                try:
                    self._wake_pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        for _ in range(10000):
            try:
                ident, raw = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            ep = ident.decode()
            self._seen[ep] = now
            try:
                self._on_msg(ep, unpack(raw), now)
            except Exception:
                log.exception("%s: bad control message from %s", self.name, ep)
        if self.role == "prefill":
            self._poll_boot_prefill(now)
        else:
            self._poll_boot_decode(now)
        for agent, msgs in self._backend.notifications().items():
            for m in msgs:
                self._on_notif(m)
        if self.role == "prefill":
            for st in list(self._senders.values()):
                self._step_sender(st, now)
            for key, (t0, _) in list(self._aborted.items()):
                if now - t0 > self.cfg.bootstrap_timeout_s:
                    del self._aborted[key]
            for key, p in list(self._pending.items()):
                if now - p["t0"] > self.cfg.bootstrap_timeout_s:
                    del self._pending[key]
                    for drank, info in p["dst"].items():
                        self._send(info[2], self._fail_msg(Room(*key), "no sender created "
                                   "before the bootstrap timeout", True))
        else:
            for rt in list(self._receivers.values()):
                self._step_receiver(rt, now)
        self._heartbeat(now)

    # -- control messages -----------------------------------------------------------------
    def _on_msg(self, ep: str, m: dict, now: float) -> None:
        t = m.get("t")
        if t == "PING":
            self._send(ep, {"t": "PONG"})
        elif t == "PONG":
            pass
        elif t == "HELLO":
            self._on_hello(ep, m)
        elif t == "ROOM":
            self._on_room(ep, m, now)
        elif t == "ABORT":
            self._on_abort(ep, m)
        elif t == "HELLO_ACK":
            self._on_hello_ack(m)
        elif t in ("FAIL", "QUIESCED"):
            self._on_fail(m)
        else:
            log.warning("%s: unknown message %r from %s", self.name, t, ep)

    def _fail_msg(self, room: Room, reason: str, quiesced: bool) -> dict:
        return {"t": "FAIL", "room": room.id, "gen": room.generation, "pp": self.pp_rank,
                "tp": self.tp_rank, "reason": reason, "quiesced": quiesced}

    # prefill side ------------------------------------------------------------------------
    def _poll_boot_prefill(self, now: float) -> None:
        s = self._boot_sock
        if s is None:
            return
        while True:
            try:
                m = unpack(s.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if m.get("t") == "REGISTERED":
                if m["ok"]:
                    self._registered = True
                else:
                    self._reg_error = m["error"]
        if not self._registered and not self._reg_error and now - self._reg_t > 0.2:
            self._reg_t = now
            s.send(pack(self._register_msg), zmq.NOBLOCK)

    def _on_hello(self, ep: str, m: dict) -> None:
        key = (m["inst"], m["drank"])
        try:
            if m.get("v") != PROTOCOL_VERSION:
                raise TableMismatch("version", f"protocol {m.get('v')} != {PROTOCOL_VERSION}")
            dtable = BufferTable.from_wire(m["table"])
            mine = self.table
            for spec in mine.buffers:
                if spec.name not in dtable:
                    raise TableMismatch("name", f"buffer '{spec.name}' not on decode")
                check_pair(spec, dtable[spec.name], self.tp_size, m["dtp"],
                           f"pp {self.pp_rank} tp {self.tp_rank}: ")
            routes = [Segment.from_wire(w) for w in m["routes"]]
            for seg in routes:
                if seg.buffer not in mine or mine[seg.buffer].item_bytes != seg.src_item:
                    raise TableMismatch("layers", f"route for '{seg.buffer}' does not fit this "
                                        "rank's page item")
                if seg.src_off + seg.length > seg.src_item or dtable[seg.buffer].item_bytes != \
                        seg.dst_item or seg.dst_off + seg.length > seg.dst_item:
                    raise TableMismatch("layers", f"route for '{seg.buffer}' out of bounds")
            old = self._dpeers.get(key)
            if old is not None and old.agent != m["agent"]:
                self._backend.remove_peer(old.agent)
            agent = self._backend.add_peer(m["agent_md"]) if (
                old is None or old.agent != m["agent"]) else old.agent
            self._dpeers[key] = _DPeer(m["inst"], m["drank"], m["dtp"], ep, agent,
                                       {k: tuple(v) for k, v in m["regions"].items()},
                                       tuple(m["meta"]), routes, bool(m["writer"]))
            self._send(ep, {"t": "HELLO_ACK", "ok": True, "pp": self.pp_rank, "tp": self.tp_rank,
                            "addr": m["addr"]})
        except TableMismatch as e:
            self._send(ep, {"t": "HELLO_ACK", "ok": False, "field": e.field, "error": str(e),
                            "pp": self.pp_rank, "tp": self.tp_rank, "addr": m["addr"]})
        except Exception as e:
            log.exception("HELLO from %s", ep)
            self._send(ep, {"t": "HELLO_ACK", "ok": False, "field": "", "error": repr(e),
                            "pp": self.pp_rank, "tp": self.tp_rank, "addr": m["addr"]})

    def _supersede(self, room: Room) -> None:
        for key, st in list(self._senders.items()):
            if key[0] == room.id and key[1] < room.generation and not st.failing:
                self._fail_sender(st, f"superseded by generation {room.generation}")
        for key in [k for k in self._pending if k[0] == room.id and k[1] < room.generation]:
            p = self._pending.pop(key)
            for info in p["dst"].values():
                self._send(info[2], self._fail_msg(Room(*key), "superseded", True))

    def _on_room(self, ep: str, m: dict, now: float) -> None:
        room = Room(m["room"], m["gen"])
        peer = self._dpeers.get((m["inst"], m["drank"]))
        if peer is None or peer.ep != ep:
            self._send(ep, self._fail_msg(room, "ROOM before a successful HELLO", True))
            return
        pages = np.frombuffer(m["pages"], dtype=np.int64)
        info = (pages, int(m["slot"]), ep, m["inst"], int(m["dtp"]))
        if room.key in self._done:
            state, err = self._done[room.key]
            self._send(ep, self._fail_msg(room, f"room already {state.name.lower()} on prefill"
                                          + (f": {err}" if err else ""), True))
            return
        newer = [k for k in list(self._senders) + list(self._pending)
                 if k[0] == room.id and k[1] > room.generation]
        if newer:
            self._send(ep, self._fail_msg(room, f"stale generation (have {newer[0][1]})", True))
            return
        self._supersede(room)
        st = self._senders.get(room.key)
        if st is None:
            p = self._pending.setdefault(room.key, {"t0": now, "dst": {}})
            p["dst"][int(m["drank"])] = info
        else:
            self._add_dst(st, int(m["drank"]), info)

    def _add_dst(self, st: _SenderSt, drank: int, info: tuple) -> None:
        pages, slot, ep, inst, dtp = info
        if st.failing or st.state in TERMINAL:
            self._send(ep, self._fail_msg(st.room, st.error or "sender finished", True))
            return
        if st.decode_instance and inst != st.decode_instance:
            self._fail_sender(st, f"ROOM from decode instance {inst!r}, expected "
                              f"{st.decode_instance!r}")
            self._send(ep, self._fail_msg(st.room, st.error, True))
            return
        if st.dst and (inst != st.dinst or dtp != st.dtp):
            self._fail_sender(st, "ROOM messages from inconsistent decode instances")
            self._send(ep, self._fail_msg(st.room, st.error, True))
            return
        peer = self._dpeers[(inst, drank)]
        for seg in peer.routes:
            n = peer.regions[seg.buffer][2]
            if pages.size and (pages.min() < 0 or pages.max() >= n):
                st.dst[drank] = (pages, slot, ep)
                self._fail_sender(st, f"destination page out of range for '{seg.buffer}'")
                return
        st.dinst, st.dtp = inst, dtp
        st.dst[drank] = (pages, slot, ep)

    def _on_abort(self, ep: str, m: dict) -> None:
        room = Room(m["room"], m["gen"])
        st = self._senders.get(room.key)
        if st is not None:
            self._fail_sender(st, f"aborted by decode rank {m.get('drank')}: {m.get('reason')}")
            return
        self._pending.pop(room.key, None)
        if room.key not in self._done:  # the sender may not exist yet: fail it on creation
            self._aborted[room.key] = (time.monotonic(), f"aborted by decode rank "
                                       f"{m.get('drank')}: {m.get('reason')}")
        self._send(ep, {"t": "QUIESCED", "room": room.id, "gen": room.generation,
                        "pp": self.pp_rank, "tp": self.tp_rank})

    def _my_receivers(self, st: _SenderSt) -> list[int]:
        out = []
        for d in sorted(st.dst):
            p = self._dpeers.get((st.dinst, d))
            if p is not None and (p.routes or p.writer):
                out.append(d)
        return out

    def _step_sender(self, st: _SenderSt, now: float) -> None:
        b = self._backend
        if not st.adopted:
            st.adopted = True
            self._supersede(st.room)
            pend = self._pending.pop(st.room.key, None)
            if pend:
                for drank, info in pend["dst"].items():
                    self._add_dst(st, drank, info)
            ab = self._aborted.pop(st.room.key, None)
            if ab is not None:
                st.abort_req = st.abort_req or ab[1]
        if st.abort_req and not st.failing:
            self._fail_sender(st, st.abort_req)
        for x in st.inflight:
            b.poll(x)
        for d, x in st.meta_x.items():
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
                                self.name, st.room)
                self._retire_sender(st, KVPoll.FAILED)
                for d, (_, _, ep) in st.dst.items():
                    self._send(ep, {"t": "QUIESCED", "room": st.room.id,
                                    "gen": st.room.generation, "pp": self.pp_rank,
                                    "tp": self.tp_rank})
            return
        errs = [x for x in st.inflight + list(st.meta_x.values()) if x.state == ERR]
        if errs:
            self._fail_sender(st, f"transfer error: {errs[0].error}")
            return
        st.inflight = [x for x in st.inflight if x.state == PROC]
        if st.state == KVPoll.BOOTSTRAPPING:
            if st.dtp and len(st.dst) == st.dtp:
                st.state = KVPoll.WAITING_FOR_INPUT
                st.deadline = now + self.cfg.transfer_timeout_s
            elif now > st.deadline:
                self._fail_sender(st, f"bootstrap timeout: destination info from "
                                  f"{len(st.dst)}/{st.dtp or '?'} decode ranks")
                return
            else:
                return
        if now > st.deadline:
            self._fail_sender(st, "transfer timeout")
            return
        recv = self._my_receivers(st)
        for c in st.chunks:
            for d in recv:
                if d in c.posted:
                    continue
                if not self._post_chunk(st, c, d):
                    return
                c.posted.add(d)
        if not st.finishing or st.inflight:
            return
        for d in recv:
            if d in st.fin_sent:
                continue
            peer = self._dpeers[(st.dinst, d)]
            if peer.writer:
                x = st.meta_x.get(d)
                if x is None:
                    if st.row is None:
                        self._fail_sender(st, "this rank writes the metadata row: finish(row) "
                                          "needs the row")
                        return
                    self._post_meta(st, d, peer)
                elif x.state == DONE:
                    st.fin_sent.add(d)
            else:
                msg = _notif("F", st.room, self.pp_rank, self.tp_rank, st.sent[d], 0)
                if not b.send_notif(peer.agent, msg):
                    self._fail_sender(st, f"completion to decode rank {d} failed")
                    return
                st.fin_sent.add(d)
        if all(d in st.fin_sent for d in recv):
            self._retire_sender(st, KVPoll.SUCCESS)

    def _post_chunk(self, st: _SenderSt, c: _Chunk, d: int) -> bool:
        pages, _, _ = st.dst[d]
        n = c.src.size
        if c.start + n > pages.size:
            self._fail_sender(st, f"chunk [{c.start}, {c.start + n}) beyond the {pages.size} "
                              "destination pages")
            return False
        peer = self._dpeers[(st.dinst, d)]
        if not peer.routes or n == 0:
            return True
        runs = page_runs(c.src, pages[c.start:c.start + n])
        groups: dict[tuple, list] = {}
        for seg in peer.routes:
            _, lreg = self._pools[seg.buffer]
            raddr, _, _, rmem, rdev = peer.regions[seg.buffer]
            sa, da, ln = segment_descs(seg, runs, lreg.addr, raddr)
            groups.setdefault((lreg.mem, lreg.device, rmem, rdev), []).append((sa, da, ln))
        for (lmem, ldev, rmem, rdev), parts in groups.items():
            sa = np.concatenate([p[0] for p in parts])
            da = np.concatenate([p[1] for p in parts])
            ln = np.concatenate([p[2] for p in parts])
            src = np.stack([sa, ln, np.full_like(ln, ldev)], axis=1)
            dst = np.stack([da, ln, np.full_like(ln, rdev)], axis=1)
            st.sent[d] += 1
            x = self._backend.post_write(peer.agent, src, lmem, dst, rmem,
                                         _notif("D", st.room, self.pp_rank, self.tp_rank,
                                                st.sent[d]))
            st.stats["xfers"] += 1
            st.stats["descs"] += int(src.shape[0])
            st.stats["bytes"] += int(ln.sum())
            st.inflight.append(x)
            if x.state == ERR:
                self._fail_sender(st, f"transfer error: {x.error}")
                return False
        if st.state == KVPoll.WAITING_FOR_INPUT:
            st.state = KVPoll.TRANSFERRING
        return True

    def _post_meta(self, st: _SenderSt, d: int, peer: _DPeer) -> None:
        S = self.cfg.meta_slot_bytes
        if st.staging < 0:
            if not self._free_slots:
                return  # retry next iteration; bounded by the transfer deadline
            st.staging = self._free_slots.pop()
        raw = st.row.encode(S, st.room.id, st.room.generation)
        ln = min(S, peer.meta[1], (len(raw) + 63) // 64 * 64)
        off = st.staging * S
        self._meta_arr[off:off + S] = 0
        self._meta_arr[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        _, slot, _ = st.dst[d]
        maddr, mslot_bytes, nslots, mmem, mdev = peer.meta
        if not 0 <= slot < nslots:
            self._fail_sender(st, f"metadata slot {slot} out of range")
            return
        src = np.array([[self._meta_arr.ctypes.data + off, ln, 0]], dtype=np.uint64)
        dst = np.array([[maddr + slot * mslot_bytes, ln, mdev]], dtype=np.uint64)
        x = self._backend.post_write(peer.agent, src, "DRAM", dst, mmem,
                                     _notif("F", st.room, self.pp_rank, self.tp_rank,
                                            st.sent[d], 1))
        st.meta_x[d] = x
        st.stats["xfers"] += 1

    def _fail_sender(self, st: _SenderSt, reason: str) -> None:
        if st.failing or st.state in TERMINAL:
            return
        st.failing, st.error = True, reason
        st.quiesce_deadline = time.monotonic() + self.cfg.quiesce_timeout_s
        log.info("%s: room %s failed: %s", self.name, st.room, reason)
        busy = any(x.handle is not None for x in st.inflight + list(st.meta_x.values()))
        for d, (_, _, ep) in st.dst.items():
            self._send(ep, self._fail_msg(st.room, reason, not busy))

    def _retire_sender(self, st: _SenderSt, state: KVPoll) -> None:
        if st.staging >= 0:
            self._free_slots.append(st.staging)
            st.staging = -1
        self._senders.pop(st.room.key, None)
        self._done[st.room.key] = (state, st.error)
        while len(self._done) > 100000:
            self._done.popitem(last=False)
        st.state = state

    # decode side -------------------------------------------------------------------------
    def _poll_boot_decode(self, now: float) -> None:
        for addr in list(self._want):
            inst = self._pinsts.get(addr)
            if inst is None or (inst.state == "failed" and not inst.error_field):
                inst = self._new_pinst(addr)
            inst.want_until = max(inst.want_until, self._want_until.pop(addr, 0.0))
            self._want.discard(addr)
        waiting = {rt.addr for rt in self._receivers.values()
                   if rt.state == KVPoll.BOOTSTRAPPING and not rt.failing}
        for addr, inst in self._pinsts.items():
            while True:
                try:
                    m = unpack(inst.sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if m.get("t") == "TOPOLOGY" and inst.state == "query" and m.get("complete"):
                    self._on_topology(inst, m)
            if inst.state == "query" and (addr in waiting or now < inst.want_until) and \
                    now - inst.last_query > self.cfg.query_retry_s:
                inst.last_query = now
                try:
                    inst.sock.send(pack({"t": "QUERY"}), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _on_topology(self, inst: _PInst, m: dict) -> None:
        try:
            if m.get("v") != PROTOCOL_VERSION:
                raise TableMismatch("version", f"protocol {m.get('v')} != {PROTOCOL_VERSION}")
            pp, tp = m["pp_size"], m["tp_size"]
            ranks = {(r["pp"], r["tp"]): r for r in m["ranks"]}
            stages = []
            for s in range(pp):
                t0 = BufferTable.from_wire(ranks[(s, 0)]["table"])
                for t in range(1, tp):
                    if BufferTable.from_wire(ranks[(s, t)]["table"]) != t0:
                        raise TableMismatch("tp", f"stage {s}: TP ranks 0 and {t} differ")
                stages.append(t0)
            plan = plan_transfers(stages, tp, self.table, self.tp_size)
        except TableMismatch as e:
            inst.state, inst.error, inst.error_field = "failed", str(e), e.field
            return
        inst.instance, inst.pp_size, inst.tp_size, inst.plan = m["instance"], pp, tp, plan
        inst.ranks = {k: _PRank(k[0], k[1], r["ep"], r["agent"]) for k, r in ranks.items()}
        inst.state = "ready"
        regions = {n: (reg.addr, spec.item_bytes, self.num_pages(n), reg.mem, reg.device)
                   for n, (spec, reg) in self._pools.items()}
        S = self.cfg.meta_slot_bytes
        for (s, t), r in inst.ranks.items():
            r.hello = "sent"
            self._send(r.ep, {
                "t": "HELLO", "v": PROTOCOL_VERSION, "inst": self.instance, "addr": inst.addr,
                "dtp": self.tp_size, "drank": self.tp_rank, "agent": self._backend.name,
                "agent_md": self._backend.metadata(), "table": self.table.to_wire(),
                "regions": regions,
                "meta": (int(self._meta_arr.ctypes.data), S, self.cfg.meta_slots, "DRAM", 0),
                "routes": [g.to_wire() for g in plan.segments(s, t, self.tp_rank)],
                "writer": plan.meta_writer[self.tp_rank] == (s, t)})

    def _on_hello_ack(self, m: dict) -> None:
        inst = self._pinsts.get(m.get("addr"))
        if inst is None or inst.state != "ready":
            return
        r = inst.ranks.get((m["pp"], m["tp"]))
        if r is None:
            return
        if m["ok"]:
            r.hello = "ok"
        else:
            r.hello = "failed"
            inst.state, inst.error, inst.error_field = "failed", m["error"], m.get("field", "")

    def _set_destination(self, rt: _ReceiverSt, pages, meta_slot: Optional[int]) -> None:
        p = np.asarray(pages, dtype=np.int64).reshape(-1).copy()
        with self._lock:
            if rt.pages is not None:
                raise TransferError(f"room {rt.room}: destination already set")
            if rt.failing or rt.state in TERMINAL:
                raise TransferError(f"room {rt.room}: receiver already failed")
            for n, (spec, _) in self._pools.items():
                if spec.item_bytes and p.size and (p.min() < 0 or p.max() >= self.num_pages(n)):
                    raise ValueError(f"destination page out of range for pool '{n}'")
            if meta_slot is None:
                if not self._free_slots:
                    raise TransferError("no free metadata slot")
                rt.slot, rt.own_slot = self._free_slots.pop(), True
            else:
                if not 0 <= meta_slot < self.cfg.meta_slots:
                    raise ValueError("metadata slot out of range")
                rt.slot = int(meta_slot)
            S = self.cfg.meta_slot_bytes
            self._meta_arr[rt.slot * S:(rt.slot + 1) * S] = 0  # no stale row can match
            rt.pages = p
        self._wake()

    def _step_receiver(self, rt: _ReceiverSt, now: float) -> None:
        if rt.abort_req and not rt.failing:
            self._fail_receiver(rt, rt.abort_req)
        if rt.failing:
            need = {k for k in rt.room_sent if k in rt.expected} - rt.quiesced
            if not need or now > rt.quiesce_deadline:
                if need:
                    log.warning("%s: room %s: no quiesce ack from %s; freeing after timeout",
                                self.name, rt.room, sorted(need))
                self._retire_receiver(rt, KVPoll.FAILED)
            return
        inst = self._pinsts.get(rt.addr)
        if rt.state == KVPoll.BOOTSTRAPPING:
            if inst is None:
                inst = self._new_pinst(rt.addr)
            if inst.state == "failed":
                rt.error_field = inst.error_field
                self._fail_receiver(rt, inst.error)
                return
            if not inst.connected():
                if now > rt.deadline:
                    self._fail_receiver(rt, f"bootstrap timeout: prefill instance at {rt.addr} "
                                        "not connected")
                return
            if rt.pages is None:
                return  # the caller has not allocated yet: its wait, not ours
            rt.expected = inst.plan.senders_for(self.tp_rank)
            msg = {"t": "ROOM", "room": rt.room.id, "gen": rt.room.generation,
                   "inst": self.instance, "dtp": self.tp_size, "drank": self.tp_rank,
                   "pages": rt.pages.tobytes(), "slot": rt.slot}
            for k, r in inst.ranks.items():
                self._send(r.ep, msg)
                rt.room_sent[k] = r.ep
            rt.state = KVPoll.WAITING_FOR_INPUT
            rt.deadline = now + self.cfg.transfer_timeout_s
            return
        if now > rt.deadline:
            self._fail_receiver(rt, "transfer timeout: completion not received from "
                                f"{sorted(set(rt.expected) - set(rt.fin))}")
            return
        self._check_done(rt)

    def _on_notif(self, raw: bytes) -> None:
        try:
            tag, kind, rid, gen, pp, tp, n, meta = msgpack.unpackb(raw)
            assert tag == "g53"
        except Exception:
            log.warning("%s: unknown notification %r", self.name, raw[:64])
            return
        rt = self._receivers.get((rid, gen))
        if rt is None or rt.failing or rt.state in TERMINAL or (pp, tp) not in rt.expected:
            self.stale_notifs += 1
            return
        if kind == "D":
            rt.ndata[(pp, tp)] += 1
            if rt.state == KVPoll.WAITING_FOR_INPUT:
                rt.state = KVPoll.TRANSFERRING
        elif kind == "F":
            rt.fin[(pp, tp)] = (n, meta)
            self._check_done(rt)

    def _check_done(self, rt: _ReceiverSt) -> None:
        if rt.failing or rt.state in TERMINAL:
            return
        for k in rt.expected:
            if k not in rt.fin:
                return
            n, _ = rt.fin[k]
            if rt.ndata[k] < n:
                return
            if rt.ndata[k] > n:
                self._fail_receiver(rt, f"sender {k} announced {n} transfers, {rt.ndata[k]} seen")
                return
        inst = self._pinsts.get(rt.addr)
        writer = inst.plan.meta_writer[self.tp_rank] if inst and inst.plan else None
        if writer is None or not rt.fin.get(writer, (0, 0))[1]:
            self._fail_receiver(rt, "metadata row not written by its writer")
            return
        S = self.cfg.meta_slot_bytes
        try:
            rt.row = MetadataRow.decode(self._meta_arr[rt.slot * S:(rt.slot + 1) * S],
                                        rt.room.id, rt.room.generation)
        except ValueError as e:
            self._fail_receiver(rt, f"metadata check failed: {e}")
            return
        rt.quiesced |= set(rt.expected)
        self._retire_receiver(rt, KVPoll.SUCCESS)

    def _on_fail(self, m: dict) -> None:
        rt = self._receivers.get((m["room"], m["gen"]))
        if rt is None:
            return
        k = (m["pp"], m["tp"])
        if m["t"] == "QUIESCED" or m.get("quiesced"):
            rt.quiesced.add(k)
        if m["t"] == "FAIL":
            self._fail_receiver(rt, f"prefill rank pp={k[0]} tp={k[1]}: {m.get('reason')}")

    def _fail_receiver(self, rt: _ReceiverSt, reason: str) -> None:
        if rt.failing or rt.state in TERMINAL:
            return
        rt.failing, rt.error = True, reason
        rt.quiesce_deadline = time.monotonic() + self.cfg.quiesce_timeout_s
        log.info("%s: room %s failed: %s", self.name, rt.room, reason)
        msg = {"t": "ABORT", "room": rt.room.id, "gen": rt.room.generation,
               "drank": self.tp_rank, "reason": reason}
        for k, ep in rt.room_sent.items():
            if k not in rt.quiesced:
                self._send(ep, msg)
        if not rt.room_sent:
            # Nothing was told where to write, so nothing can land; still tell the prefill
            # ranks (if known) so that their sender fails now rather than at its timeout.
            inst = self._pinsts.get(rt.addr)
            if inst is not None and inst.state == "ready":
                for r in inst.ranks.values():
                    self._send(r.ep, msg)
            self._retire_receiver(rt, KVPoll.FAILED)

    def _retire_receiver(self, rt: _ReceiverSt, state: KVPoll) -> None:
        if rt.own_slot and rt.slot >= 0:
            self._free_slots.append(rt.slot)
            rt.own_slot = False
        self._receivers.pop(rt.room.key, None)
        rt.state = state

    # -- liveness -------------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        if now - self._last_hb < min(self.cfg.heartbeat_interval_s, self.cfg.peer_timeout_s / 3):
            return
        self._last_hb = now
        watched: dict[str, list] = {}
        if self.role == "prefill":
            for st in self._senders.values():
                if st.state != KVPoll.BOOTSTRAPPING or st.dst:
                    for d, (_, _, ep) in st.dst.items():
                        watched.setdefault(ep, []).append(st)
        else:
            for rt in self._receivers.values():
                for k, ep in rt.room_sent.items():
                    if k not in rt.quiesced:
                        watched.setdefault(ep, []).append(rt)
        for ep in list(self._watch):
            if ep not in watched:
                del self._watch[ep]
        for ep, rooms in watched.items():
            if ep not in self._watch:
                self._watch[ep] = now
                self._seen[ep] = max(self._seen.get(ep, 0.0), now)
            self._send(ep, {"t": "PING"})
            if now - self._seen[ep] > self.cfg.peer_timeout_s:
                self._peer_dead(ep, rooms)

    def _peer_dead(self, ep: str, rooms: list) -> None:
        log.warning("%s: peer %s unresponsive for %.1fs", self.name, ep, self.cfg.peer_timeout_s)
        del self._watch[ep]
        # Its control socket would keep reconnecting to a dead endpoint: close it (a peer that
        # comes back is reached through a fresh one).
        sock = self._dealers.pop(ep, None)
        if sock is not None:
            sock.close(0)
        self._seen.pop(ep, None)
        if self.role == "prefill":
            for key, p in list(self._dpeers.items()):
                if p.ep == ep:
                    for st in rooms:
                        self._fail_sender(st, f"decode rank {p.drank} at {ep} unresponsive")
                    for st in rooms:  # a dead target cannot take writes: stop waiting on them
                        for x in st.inflight + list(st.meta_x.values()):
                            if x.peer == p.agent:
                                self._backend.abort(x)
                    del self._dpeers[key]
                    self._backend.remove_peer(p.agent)
        else:
            for rt in rooms:
                for k, e in rt.room_sent.items():
                    if e == ep:
                        rt.quiesced.add(k)  # a dead process writes nothing more
                self._fail_receiver(rt, f"prefill rank at {ep} unresponsive")
            for addr, inst in list(self._pinsts.items()):
                if any(r.ep == ep for r in inst.ranks.values()):
                    self._new_pinst(addr)  # re-query: the rank may come back elsewhere
