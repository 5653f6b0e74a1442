"""The per-rank engine core. See the package docstring for the whole picture.

One ``TransferEngine`` per rank owns the NIXL agent, the registered pools, the metadata-slot
array, the ZMQ control sockets and one progress thread. All NIXL and ZMQ calls happen on that
thread; handles only record intent under the engine lock and wake it, so they never block.
Every wait the thread performs is bounded by a configured timeout (bootstrap, transfer, peer
liveness, quiesce).

The role's state machine is a collaborator the engine owns: ``SenderSide`` (prefill, in
``sender``) or ``ReceiverSide`` (decode, in ``receiver``). The core runs the loop, decodes
control messages and notifications and hands them to it, pings the endpoints it watches and
tells it which died. Members with a leading underscore are the core's interface to the role
objects and the handles of this package, not to users.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import zmq

from .backend import MemRegion, NixlBackend, TransferBackend
from .buffers import BufferSpec, BufferTable
from .handles import (TERMINAL, Failure, KVPoll, KVReceiver, KVSender, Room, TransferError,
                      TransferErrorCode, TransportConfig)
from .messages import (PROTOCOL_VERSION, Message, MetaSlotRegion, Notif, Ping, Pong, RankInfo,
                       Register, Registered, Unregister, decode_message, unpack)
from .receiver import ReceiverSide
from .sender import SenderSide

# The engine and the types its API takes and returns (callers import them from here too).
__all__ = ["TransferEngine", "KVPoll", "TERMINAL", "KVSender", "KVReceiver", "Room",
           "TransferError", "TransferErrorCode", "TransportConfig"]

log = logging.getLogger("glm53.transport")

Code = TransferErrorCode


@dataclass(frozen=True)
class Pool:
    """One registered page-major pool."""

    spec: BufferSpec
    region: MemRegion

    @property
    def num_pages(self) -> int:
        return self.region.nbytes // self.spec.item_bytes if self.spec.item_bytes else 0


class MetaSlots:
    """This rank's metadata slots: one registered host array of ``n`` slots of ``slot_bytes``.
    A decode rank hands one slot per room to prefill (the row lands there); a prefill rank
    stages the row it writes in one of its own."""

    def __init__(self, n: int, slot_bytes: int):
        self.n, self.slot_bytes = n, slot_bytes
        self.arr = np.zeros(n * slot_bytes, dtype=np.uint8)
        self._free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def view(self, slot: int) -> np.ndarray:
        return self.arr[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def addr(self, slot: int) -> int:
        return int(self.arr.ctypes.data) + slot * self.slot_bytes

    def region(self) -> MetaSlotRegion:
        return MetaSlotRegion(self.addr(0), self.slot_bytes, self.n, "DRAM", 0)


class _Side(Protocol):
    """What the core needs from a role's state machine."""

    def active(self) -> bool: ...  # work to progress: the loop polls every 1 ms
    def has_rooms(self) -> bool: ...  # live rooms: close() waits for them to fail
    def on_message(self, ep: str, msg: Message, now: float) -> bool: ...  # False: not ours
    def on_notif(self, n: Notif) -> bool: ...  # False: stale (another room or generation)
    def step(self, now: float) -> None: ...
    def watched(self) -> dict[str, list]: ...  # peer endpoint -> rooms that need it alive
    def peer_dead(self, ep: str, rooms: list) -> None: ...
    def fail_all(self, failure: Failure) -> None: ...
    def abort_all(self, failure: Failure) -> None: ...


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
        self._pools: dict[str, Pool] = {}
        self._slots: Optional[MetaSlots] = None  # allocated and registered by start()
        self._gpu: Optional[int] = None  # the GPU of this rank's pools (start()); None: host pools
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
        self._seen: dict[str, float] = {}  # ep -> last message from it
        self._watch: dict[str, float] = {}  # ep -> when watching it began
        self._last_hb = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.started = False
        self.stale_notifs = 0
        self.error = ""
        # registration with the bootstrap server (prefill)
        self._boot_sock = None
        self._register_msg: Optional[Register] = None
        self._registered = False
        self._reg_error = ""
        self._reg_t = 0.0
        self._tx: Optional[SenderSide] = SenderSide(self) if role == "prefill" else None
        self._rx: Optional[ReceiverSide] = ReceiverSide(self) if role == "decode" else None
        self._side: _Side = self._tx or self._rx

    # -- setup ----------------------------------------------------------------------------
    def register_pool(self, name: str, pool: Any, layers, total_heads: Optional[int] = None,
                      spec: Optional[BufferSpec] = None) -> BufferSpec:
        """Register one page-major pool (torch tensor on CPU/GPU, numpy array, or MemRegion
        with an explicit ``spec``). Replicated pools are ``[num_pages, n_layers, page_size,
        ...]``; head-sharded ones ``[num_pages, heads_local, n_layers, page_size, head_dim]``
        with ``total_heads``. Returns the derived ``BufferSpec``."""
        if self.started:
            raise TransferError("register pools before start()", Code.INVALID)
        if spec is None:
            spec = BufferSpec.for_tensor(name, pool, layers, total_heads=total_heads)
        reg = MemRegion.of(pool)
        if spec.item_bytes and reg.nbytes % spec.item_bytes:
            raise ValueError(f"pool {name}: {reg.nbytes} B is not a whole number of "
                             f"{spec.item_bytes} B page items")
        self._pools[name] = Pool(spec, reg)
        return spec

    def stream_marker(self) -> Any:
        """For pools on a GPU, a CUDA event recorded on the caller's current stream of that GPU:
        what it has queued so far (the forward that wrote a chunk's pages) is done once the event
        is. None for host pools, whose writers are synchronous."""
        if self._gpu is None:
            return None
        import torch  # only GPU pools get here, and they are torch tensors

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._gpu))
        return ev

    @property
    def table(self) -> BufferTable:
        return BufferTable(tuple(p.spec for p in self._pools.values()))

    def num_pages(self, name: str) -> int:
        return self._pools[name].num_pages

    def start(self, bootstrap_addr: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Register memory and start the progress thread. A prefill rank registers with the
        bootstrap server at ``bootstrap_addr`` and waits (bounded by ``timeout``, default the
        bootstrap timeout) for the acknowledgement."""
        if self.started:
            return
        if self._backend is None:
            self._backend = NixlBackend(self.name, self.cfg.num_threads, self.cfg.progress_thread)
        self._slots = MetaSlots(self.cfg.meta_slots, self.cfg.meta_slot_bytes)
        regions = [p.region for p in self._pools.values() if p.region.nbytes]
        gpus = {r.device for r in regions if r.mem == "VRAM"}
        if len(gpus) > 1:
            raise TransferError(f"pools on GPUs {sorted(gpus)}: one rank's pools live on one GPU", Code.INVALID)
        self._gpu = gpus.pop() if gpus else None
        self._backend.register(regions + [MemRegion.of(self._slots.arr)])
        self.started = True
        if self.role == "prefill":
            if not bootstrap_addr:
                raise ValueError("a prefill rank needs the bootstrap server address")
            self._boot_sock = self._dealer_to(bootstrap_addr, register=True)
            self._register_msg = Register(
                PROTOCOL_VERSION, self.instance, self.pp_size, self.tp_size,
                RankInfo(self.pp_rank, self.tp_rank, self.endpoint, self._backend.name,
                         self._backend.metadata(), self.table.to_wire()))
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-{self.name}", daemon=True)
        self._thread.start()
        if self.role == "prefill":
            deadline = time.monotonic() + (timeout or self.cfg.bootstrap_timeout_s)
            while not self._registered and time.monotonic() < deadline and not self._reg_error:
                time.sleep(0.005)
            if self._reg_error:
                raise TransferError(f"bootstrap registration refused: {self._reg_error}",
                                    Code.INVALID)
            if not self._registered:
                raise TimeoutError(f"bootstrap server {bootstrap_addr} did not answer")

    def close(self) -> None:
        """Fail live rooms (notifying peers), stop the thread, deregister memory."""
        if not self.started:
            self._ctx.destroy(0)
            return
        with self._lock:
            self._side.abort_all(Failure(Code.CLOSED, "engine closed"))
        self._wake()
        deadline = time.monotonic() + min(self.cfg.quiesce_timeout_s, 2.0)
        while time.monotonic() < deadline and self._side.has_rooms():
            time.sleep(0.005)
        self._stop.set()
        self._wake()
        if self._thread:
            self._thread.join(timeout=5)
        if self._boot_sock is not None:
            try:
                self._boot_sock.send(Unregister(self.pp_rank, self.tp_rank).encode(),
                                     zmq.NOBLOCK)
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
        return self._rx.create(room, bootstrap_addr, dst_pages, meta_slot)

    def connect(self, bootstrap_addr: str, timeout: Optional[float] = None) -> None:
        """Decode: connect to a prefill instance ahead of the first request (topology, table
        check, HELLO to every rank). Raises ``TableMismatch`` naming the field, or
        ``TimeoutError``."""
        self._need("decode")
        self._rx.connect(bootstrap_addr, timeout)

    # -- prefill API ----------------------------------------------------------------------
    def create_sender(self, room: Room, decode_instance: Optional[str] = None) -> KVSender:
        """Prefill: a sender for ``room``. The decode ranks tell it where to write (their ROOM
        messages may arrive before or after this call). ``decode_instance``, if given, is
        checked against the decode ranks that show up."""
        self._need("prefill")
        return self._tx.create(room, decode_instance)

    # -- for the role objects and handles -------------------------------------------------
    def _need(self, role: str) -> None:
        if self.role != role:
            raise TransferError(f"this is a {self.role} engine", Code.INVALID)
        if not self.started:
            raise TransferError("engine not started", Code.INVALID)

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _dealer_to(self, ep: str, register: bool = False):
        """A DEALER to ``ep``. ``register``: a socket to a bootstrap server, read by the loop
        (replies come back on it); otherwise a control socket to a peer, which answers on our
        ROUTER and so must know our identity (the endpoint)."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10000)
        if not register:
            s.setsockopt(zmq.IDENTITY, self.endpoint.encode())
        s.connect(ep)
        if register:
            self._poller.register(s, zmq.POLLIN)
        return s

    def _close_polled(self, sock) -> None:
        self._poller.unregister(sock)
        sock.close(0)

    def _send(self, ep: str, msg: Message) -> None:
        s = self._dealers.get(ep)
        if s is None:
            s = self._dealers[ep] = self._dealer_to(ep)
        try:
            s.send(msg.encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            log.debug("%s: drop %s to %s", self.name, msg.T, ep)

    # -- the progress thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready = dict(self._poller.poll(1 if self._side.active() else 20))
            except zmq.ZMQError:
                break
            try:
                with self._lock:
                    self._step(ready)
            except Exception as e:  # never die silently: fail what is live and keep serving
                log.exception("%s: progress loop error", self.name)
                self.error = f"{type(e).__name__}: {e}"
                with self._lock:
                    self._side.fail_all(Failure(Code.INTERNAL, f"internal error: {self.error}"))

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
        if self._boot_sock is not None:
            self._poll_registration(now)
        if self._rx is not None:
            self._rx.poll_bootstrap(now)
        for agent, msgs in self._backend.notifications().items():
            for raw in msgs:
                self._on_notif(raw)
        self._side.step(now)
        self._heartbeat(now)

    def _on_msg(self, ep: str, m: dict, now: float) -> None:
        msg = decode_message(m)
        if isinstance(msg, Ping):
            self._send(ep, Pong())
        elif isinstance(msg, Pong):
            pass
        elif msg is None or not self._side.on_message(ep, msg, now):
            log.warning("%s: unknown message %r from %s", self.name, m.get("t"), ep)

    def _on_notif(self, raw: bytes) -> None:
        try:
            n = Notif.decode(raw)
        except ValueError:
            log.warning("%s: unknown notification %r", self.name, raw[:64])
            return
        if not self._side.on_notif(n):
            self.stale_notifs += 1

    def _poll_registration(self, now: float) -> None:
        s = self._boot_sock
        while True:
            try:
                msg = decode_message(unpack(s.recv(zmq.NOBLOCK)))
            except zmq.Again:
                break
            if isinstance(msg, Registered):
                if msg.ok:
                    self._registered = True
                else:
                    self._reg_error = msg.error
        if not self._registered and not self._reg_error and now - self._reg_t > 0.2:
            self._reg_t = now
            s.send(self._register_msg.encode(), zmq.NOBLOCK)

    # -- liveness -------------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        if now - self._last_hb < min(self.cfg.heartbeat_interval_s, self.cfg.peer_timeout_s / 3):
            return
        self._last_hb = now
        watched = self._side.watched()
        for ep in list(self._watch):
            if ep not in watched:
                del self._watch[ep]
        for ep, rooms in watched.items():
            if ep not in self._watch:
                self._watch[ep] = now
                self._seen[ep] = max(self._seen.get(ep, 0.0), now)
            self._send(ep, Ping())
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
        self._side.peer_dead(ep, rooms)
