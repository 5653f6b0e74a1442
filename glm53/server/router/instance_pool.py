"""The router's view of the prefill and decode instances: sockets, health, pairing and rooms.

One asyncio task receives every instance event on the router's PULL socket and routes it to the
room it belongs to; another pings every instance and fails the rooms of one that stops
answering. `submit()` picks a (prefill, decode) pair, registers a room and sends the same
GenerateRequest to both; `next_event()` waits, bounded, for the room's next event; `release()`
forgets the room and, when asked, sends Abort to both instances. What decides *when* a request is
submitted is the admission queue (admission.py): `can_place` / `has_room`, and `on_capacity`,
called when a room is released or an instance comes back. Each instance's pongs carry its
process's incarnation; a new one means a restart, and the rooms the old process held fail at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.router.metrics import RouterMetrics
from glm53.server.router.prefix_routing import PrefixTree, pick_cache_aware
from glm53.server.protocol import (Abort, GenerateRequest, HealthPing, HealthPong, LoadStats, Message, PeerInfo,
                                   ProtocolError, RequestSpec, TokenEvent, decode_all, encode)

log = logging.getLogger(__name__)


# The router waits this much past a room's queue deadline for the instance that expires it to
# say so, before it fails the room itself.
QUEUE_SLACK_S = 5.0
# Put into a room's event queue when both instances admitted it: next_event re-arms its timer.
_WAKE = object()


class Unavailable(Exception):
    """No healthy instance pair, or the router is at capacity (HTTP 503)."""


class RoomFailed(Exception):
    """A room ended without a normal finish: instance error, dead instance or timeout."""

    def __init__(self, message: str, code: str = "internal", side: str | None = None):
        super().__init__(message)
        self.code = code
        self.side = side  # "prefill" when the prefill side failed (a retry may help)


@dataclass
class InstanceState:
    cfg: InstanceConfig
    sock: zmq.Socket
    ready: bool = False
    last_pong: float = 0.0  # monotonic
    load: LoadStats = field(default_factory=LoadStats)
    in_flight: int = 0  # rooms this router has on the instance
    healthy: bool = False
    cached: PrefixTree | None = None  # prefill, cache_aware policy: what its prefix cache likely holds
    incarnation: int = 0  # its process's id from its pongs (HealthPong.incarnation); 0: none seen

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def peer(self) -> PeerInfo:
        c = self.cfg
        return PeerInfo(name=c.name, role=c.role, host=c.host, port=c.port, bootstrap_port=c.bootstrap_port)


@dataclass
class Placement:
    """A request placed on a prefill/decode pair under one room (id, generation), and its token events."""

    room: int
    generation: int
    spec: RequestSpec
    prefill: InstanceState
    decode: InstanceState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.monotonic)
    got_first_token: bool = False
    done: bool = False
    # The admission queue (router/admission.py): by when both instances must have admitted it
    # (monotonic), which of them did (TokenEvent.admitted), and when both had.
    queue_deadline: float = 0.0
    admitted: set[str] = field(default_factory=set)
    admitted_at: float = 0.0
    # The instances' incarnations it was sent to: a restart loses it (InstancePool._restarted).
    incarnations: tuple[int, int] = (0, 0)
    arrived: float = 0.0  # monotonic: the request's arrival at the router (queue-time metric)


class InstancePool:
    def __init__(self, cfg: ClusterConfig, metrics: RouterMetrics | None = None, seed: int | None = None):
        self.cfg = cfg
        self.metrics = metrics
        self._rng = random.Random(seed)
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self.instances: dict[str, list[InstanceState]] = {"prefill": [], "decode": []}
        self.rooms: dict[int, Placement] = {}
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._ping_seq = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._pull: zmq.asyncio.Socket | None = None
        # Called when capacity may have freed (a room released, an instance back): the admission
        # queue dispatches what waits (router/admission.py).
        self.on_capacity: Callable[[], None] | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        r = self.cfg.router
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(r.result_bind_address)
        for inst in self.cfg.instances:
            s = self._sync_ctx.socket(zmq.PUSH)
            # IMMEDIATE: queue only to a live connection, so a send to a dead or not yet started
            # instance fails at once (EAGAIN) instead of piling up in a buffer.
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10_000)
            s.connect(inst.address)
            cached = (PrefixTree(inst.engine.page_size, self.cfg.router.cache_max_pages)
                      if inst.role == "prefill" and self.cfg.router.policy == "cache_aware" else None)
            self.instances[inst.role].append(InstanceState(cfg=inst, sock=s, cached=cached))
        self._tasks = [asyncio.create_task(self._receive_loop(), name="router-recv"),
                       asyncio.create_task(self._health_loop(), name="router-health")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for room in list(self.rooms.values()):
            self.release(room, abort=True)
        for pool in self.instances.values():
            for i in pool:
                i.sock.close(0)
        if self._pull is not None:
            self._pull.close(0)
        self._sync_ctx.term()
        self._async_ctx.term()

    # ---- state ----
    def all_instances(self) -> list[InstanceState]:
        return [*self.instances["prefill"], *self.instances["decode"]]

    def healthy(self, role: str) -> list[InstanceState]:
        return [i for i in self.instances[role] if i.healthy]

    def has_capacity(self) -> bool:
        return len(self.rooms) < self.cfg.router.max_running_requests

    @staticmethod
    def has_room(inst: InstanceState) -> bool:
        """Whether the admission queue may send `inst` another room: a decode instance holds at
        most its max_running_requests (each room's KV pages and batch slot are reserved there
        from dispatch on); a prefill instance queues what it gets and admits by its token budget."""
        return inst.cfg.role != "decode" or inst.in_flight < inst.cfg.engine.max_running_requests

    def has_pair(self) -> bool:
        """A healthy prefill and a healthy decode instance exist (full or not)."""
        return bool(self.healthy("prefill")) and bool(self.healthy("decode"))

    def can_place(self) -> bool:
        """Whether a new request can be dispatched now (admission queue): room at the router and
        a healthy prefill with a healthy decode instance that has room."""
        return (self.has_capacity() and bool(self.healthy("prefill"))
                and any(self.has_room(d) for d in self.healthy("decode")))

    def unavailable(self) -> str:
        """Why no pair can be placed on at all (for the 503)."""
        missing = [r for r in ("prefill", "decode") if not self.healthy(r)]
        return f"no healthy {' or '.join(missing)} instance" if missing else "no instance pair has room"

    def shutdown(self, reason: str) -> None:
        """Fail every room in flight at once (the router is stopping): each stream ends with an
        error event and [DONE], each whole request with a 503."""
        for room in list(self.rooms.values()):
            room.queue.put_nowait(RoomFailed(reason, "shutdown"))

    def status(self) -> dict:
        now = time.monotonic()
        return {
            role: [{"name": i.name, "address": i.cfg.address, "bootstrap_port": i.cfg.bootstrap_port,
                    "healthy": i.healthy, "ready": i.ready, "in_flight": i.in_flight,
                    "last_pong_s_ago": round(now - i.last_pong, 3) if i.last_pong else None,
                    "load": i.load.__dict__}
                   for i in self.instances[role]]
            for role in ("prefill", "decode")
        }

    # ---- requests ----
    def submit(self, spec: RequestSpec, exclude_prefill: frozenset[str] = frozenset(), generation: int = 0,
               queue_deadline: float = 0.0, gated: bool = False) -> Placement:
        """Send `spec` to a fresh (prefill, decode) pair. `exclude_prefill` and `generation` are
        for retries: a retried request gets a new room id (the transfer layer retires old ones)
        and the next generation number. `queue_deadline` (monotonic; 0: now + max_queue_wait_s):
        by when both instances must have admitted it. `gated` (the admission queue): only decode
        instances with room (`has_room`)."""
        # A retry (generation > 0) replaces a room that still counts until it is released.
        if generation == 0 and not self.has_capacity():
            raise Unavailable(f"the server is at capacity ({self.cfg.router.max_running_requests} requests in "
                              "flight); retry later")
        pairs_tried: set[tuple[str, str]] = set()
        # A send that fails means the instance vanished since its last pong: try another pair.
        for _ in range(len(self.instances["prefill"]) * len(self.instances["decode"])):
            p, d = self._pick("prefill", exclude_prefill, spec), self._pick("decode", gated=gated)
            if (p.name, d.name) in pairs_tried:
                continue
            pairs_tried.add((p.name, d.name))
            room_id = self._new_room_id()
            now = time.monotonic()
            deadline = queue_deadline or now + self.cfg.router.max_queue_wait_s
            room = Placement(room=room_id, generation=generation, spec=spec, prefill=p, decode=d,
                             queue_deadline=deadline, incarnations=(p.incarnation, d.incarnation),
                             arrived=deadline - self.cfg.router.max_queue_wait_s)
            req = GenerateRequest(spec=spec, room=room_id, generation=generation, prefill=p.peer, decode=d.peer,
                                  reply_to=self.cfg.router.result_address, sent_at=time.time(),
                                  queue_budget_s=max(0.001, deadline - now))
            data = encode(req)
            # Decode first: it must preallocate pages before prefill's writes can land.
            if not self._send(d, data):
                self._set_healthy(d, False)  # no live connection: back when it pongs again
                continue
            if not self._send(p, data):
                self._set_healthy(p, False)
                self._send(d, encode(Abort(room=room_id, generation=generation, reason="prefill unreachable")))
                continue
            self.rooms[room_id] = room
            p.in_flight += 1
            d.in_flight += 1
            return room
        raise Unavailable("no healthy prefill/decode instance pair is available")

    def _event_timeout(self, room: Placement) -> tuple[float, bool]:
        """How long to wait for the room's next event, and whether it is still queued. Until
        both instances admitted it, the wait is the queue's (to its deadline, plus a moment for
        the instance that expires it to say so); from admission on, the transfer clocks'."""
        t, r = self.cfg.transfer, self.cfg.router
        if room.got_first_token:
            return r.stream_idle_timeout_s or t.transfer_timeout_s, False
        if len(room.admitted) < 2 and room.queue_deadline:
            return max(0.0, room.queue_deadline + QUEUE_SLACK_S - time.monotonic()), True
        return r.first_token_timeout_s or (t.bootstrap_timeout_s + t.transfer_timeout_s), False

    async def next_event(self, room: Placement) -> TokenEvent:
        """The room's next event; RoomFailed when an instance fails it, dies, restarts, or it
        waits too long (queued: "overloaded"; admitted: "timeout")."""
        while True:
            timeout, queued = self._event_timeout(room)
            try:
                if not room.queue.empty():  # already here: no timer (wait_for costs a task per call, per token)
                    item = room.queue.get_nowait()
                else:
                    item = await asyncio.wait_for(room.queue.get(), timeout)
            except asyncio.TimeoutError:
                if queued:
                    if self.metrics:
                        m = self.metrics
                        m.queue_rejected.labels(m.model_name, "timeout").inc()
                    raise RoomFailed(f"not admitted within router.max_queue_wait_s ({self.cfg.router.max_queue_wait_s:g} "
                                     f"s): queued on prefill instance {room.prefill.name} / decode instance "
                                     f"{room.decode.name}; retry later", "overloaded") from None
                what = "the first token" if not room.got_first_token else "the next token"
                if self.metrics:
                    self.metrics.transfer_failed.labels(self.metrics.model_name).inc()
                raise RoomFailed(f"timed out after {timeout:g} s waiting for {what} from decode instance "
                                 f"{room.decode.name} (prefill {room.prefill.name})", "timeout") from None
            if item is _WAKE:
                continue  # admitted: wait again, on the transfer clock
            if isinstance(item, RoomFailed):
                raise item
            if item.token_ids and not room.got_first_token:
                room.got_first_token = True
                self._queue_time(room)  # instances that do not report admission: it ended by now
            return item

    def release(self, room: Placement, abort: bool) -> None:
        """Forget the room (idempotent); with abort, tell both instances to drop it."""
        if room.done:
            return
        room.done = True
        self.rooms.pop(room.room, None)
        room.prefill.in_flight -= 1
        room.decode.in_flight -= 1
        if abort:
            msg = encode(Abort(room=room.room, generation=room.generation))
            self._send(room.decode, msg)
            self._send(room.prefill, msg)
        self._capacity_freed()

    def _capacity_freed(self) -> None:
        if self.on_capacity is not None:
            try:
                self.on_capacity()
            except Exception:  # the queue's problem must not break a release
                log.exception("router: admission queue")

    # ---- internals ----
    def _pick(self, role: str, exclude: frozenset[str] = frozenset(), spec: RequestSpec | None = None,
              gated: bool = False) -> InstanceState:
        cands = [i for i in self.healthy(role) if i.name not in exclude and (not gated or self.has_room(i))]
        if not cands:
            raise Unavailable(f"no healthy {role} instance (configured: "
                              f"{', '.join(i.name for i in self.instances[role])})")
        policy = self.cfg.router.policy
        if policy == "random":
            return self._rng.choice(cands)
        if policy == "round_robin":
            return cands[next(self._rr[role]) % len(cands)]
        if policy == "cache_aware" and spec is not None and role == "prefill":
            return self._pick_cached(cands, spec)
        return self._least_loaded(role, cands)

    def _least_loaded(self, role: str, cands: list[InstanceState]) -> InstanceState:
        # The router's own in-flight count is exact and fresh; the instance's queue from its last
        # pong breaks ties; round robin among equals spreads bursts.
        start = next(self._rr[role])
        order = cands[start % len(cands):] + cands[:start % len(cands)]
        return min(order, key=lambda i: (i.in_flight, i.load.num_waiting))

    def _pick_cached(self, cands: list[InstanceState], spec: RequestSpec) -> InstanceState:
        """cache_aware (router/prefix_routing.py): the instance likely to hold the prompt's
        longest prefix while the load is balanced, else the least loaded; the prompt's full
        pages are then recorded as cached there."""
        r, ids = self.cfg.router, spec.input_ids
        best = pick_cache_aware([i.in_flight for i in cands], [i.cached.match(ids, spec.cache_salt) for i in cands],
                                len(ids), r.cache_threshold, r.balance_abs_threshold, r.balance_rel_threshold)
        inst = self._least_loaded("prefill", cands) if best is None else cands[best]
        inst.cached.insert(ids, spec.cache_salt)
        if self.metrics:
            self.metrics.routed_by_cache(best is not None)
        return inst

    def _new_room_id(self) -> int:
        while True:
            rid = self._rng.getrandbits(63)
            if rid not in self.rooms:
                return rid

    def _send(self, inst: InstanceState, data: bytes) -> bool:
        try:
            inst.sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        # The same socket without asyncio: what is already queued is read without a future per
        # frame (at tens of thousands of tokens a second the futures cost more than the events).
        now = zmq.Socket.shadow(self._pull.underlying)
        while True:
            frames = [await self._pull.recv()]
            while len(frames) < 256:  # then back to the loop: the streams must get to run
                try:
                    frames.append(now.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            for data in frames:
                try:
                    msgs = decode_all(data)
                except ProtocolError as e:
                    log.error("router: dropped an invalid instance message: %s", e)
                    continue
                for msg in msgs:
                    try:
                        self._dispatch(msg)
                    except Exception:  # one bad event must not stop the receive loop
                        log.exception("router: error handling %s", type(msg).__name__)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, HealthPong):
            inst = self._by_name(msg.instance)
            if inst is None:
                return
            inst.last_pong = time.monotonic()
            inst.ready = msg.ready
            inst.load = msg.load
            if msg.incarnation and msg.incarnation != inst.incarnation:
                if inst.incarnation:
                    self._restarted(inst, inst.incarnation)
                inst.incarnation = msg.incarnation
            self._set_healthy(inst, msg.ready)
            if self.metrics:
                self.metrics.observe_load(inst.cfg.role, inst.name, msg.load, inst.healthy)
            return
        if not isinstance(msg, TokenEvent):
            return
        if msg.transfer is not None and self.metrics:
            self.metrics.observe_transfer(msg.transfer)
        room = self.rooms.get(msg.room)
        if room is None or room.generation != msg.generation:
            return  # finished, aborted or superseded: late events are expected
        if msg.admitted:
            self._admitted(room, msg.instance)
            if not msg.cached_tokens:
                return
        if msg.instance == room.prefill.name and msg.instance != room.decode.name:
            # Prefill reports only failures, prompt logprobs and the prompt tokens its prefix
            # cache held; after the first token the decode side owns the room.
            if msg.finish_reason == "error" and not room.got_first_token:
                if self.metrics and msg.error_code in ("bootstrap_timeout", "transfer_timeout", "transfer_failed"):
                    self.metrics.transfer_failed.labels(self.metrics.model_name).inc()
                room.queue.put_nowait(RoomFailed(
                    f"prefill instance {msg.instance} failed the request: {msg.error or 'unknown error'}",
                    msg.error_code or "internal", side="prefill"))
            elif (msg.prompt_logprobs is not None or msg.cached_tokens) and msg.finish_reason is None:
                room.queue.put_nowait(msg)  # the prompt logprobs the request asked for, cached tokens
            return
        if msg.instance != room.decode.name:
            return
        if msg.finish_reason == "error":
            if self.metrics and msg.error_code in ("bootstrap_timeout", "transfer_timeout", "transfer_failed"):
                self.metrics.transfer_failed.labels(self.metrics.model_name).inc()
            room.queue.put_nowait(RoomFailed(
                f"decode instance {msg.instance} failed the request: {msg.error or 'unknown error'}",
                msg.error_code or "internal"))
            return
        room.queue.put_nowait(msg)

    def _admitted(self, room: Placement, instance: str) -> None:
        """An instance admitted the room (left its queue). Once both have, its queue wait is
        over: the wait for its events runs on the transfer clock from here."""
        role = "prefill" if instance == room.prefill.name else "decode" if instance == room.decode.name else ""
        if not role or role in room.admitted:
            return
        room.admitted.add(role)
        if len(room.admitted) == 2:
            self._queue_time(room)
            room.queue.put_nowait(_WAKE)  # next_event waits again, with the transfer clock's bound

    def _queue_time(self, room: Placement) -> None:
        """Record the room's queue wait once: arrival until both instances admitted it (or, with
        instances that do not report admission, its first token)."""
        if room.admitted_at:
            return
        room.admitted_at = time.monotonic()
        if self.metrics and room.generation == 0 and room.arrived:
            m = self.metrics
            m.queue_time.labels(m.model_name).observe(room.admitted_at - room.arrived)

    def _restarted(self, inst: InstanceState, old: int) -> None:
        """`inst` answers as a new process (its incarnation changed): the rooms sent to the old one
        are lost with it, even when the restart was quicker than health_timeout_s. Fail them now
        (a prefill-side failure before the first token is retried, on this instance too)."""
        lost = [room for room in self.rooms.values()
                if (inst is room.prefill and room.incarnations[0] == old and not room.got_first_token)
                or (inst is room.decode and room.incarnations[1] == old)]
        log.warning("router: %s instance %s restarted (a new process); failing the %d request(s) the old one held",
                    inst.cfg.role, inst.name, len(lost))
        if self.metrics:
            self.metrics.restarts.labels(self.metrics.model_name, inst.cfg.role, inst.name).inc()
        if inst.cached is not None:
            inst.cached.clear()  # the new process's prefix cache starts empty
        for room in lost:
            room.queue.put_nowait(RoomFailed(
                f"{inst.cfg.role} instance {inst.name} restarted; the request was lost with its old process",
                "instance_restarted", side=inst.cfg.role))

    def _by_name(self, name: str) -> InstanceState | None:
        for i in self.all_instances():
            if i.name == name:
                return i
        return None

    def _set_healthy(self, inst: InstanceState, healthy: bool) -> None:
        if inst.healthy == healthy:
            return
        inst.healthy = healthy
        log.log(logging.INFO if healthy else logging.WARNING, "router: %s instance %s is %s", inst.cfg.role,
                inst.name, "healthy" if healthy else "UNHEALTHY")
        if self.metrics:
            self.metrics.set_health(inst.cfg.role, inst.name, healthy)
        if not healthy and inst.cached is not None:
            inst.cached.clear()  # a restarted instance's cache starts empty
        if healthy:
            self._capacity_freed()  # the admission queue may dispatch to it
        if not healthy:
            # Fail its rooms now (bounded by health_timeout_s) rather than at their own timeouts.
            for room in list(self.rooms.values()):
                if inst is room.prefill and room.got_first_token:
                    continue  # prefill's work for this room is done
                if inst is room.prefill or inst is room.decode:
                    room.queue.put_nowait(RoomFailed(
                        f"{inst.cfg.role} instance {inst.name} stopped responding", "instance_down",
                        side=inst.cfg.role))

    async def _health_loop(self) -> None:
        r = self.cfg.router
        while True:
            now = time.monotonic()
            for inst in self.all_instances():
                if inst.healthy and now - inst.last_pong > r.health_timeout_s:
                    self._set_healthy(inst, False)
                ping = HealthPing(seq=next(self._ping_seq), reply_to=r.result_address, sent_at=time.time())
                self._send(inst, encode(ping))
            await asyncio.sleep(r.health_check_interval_s)
