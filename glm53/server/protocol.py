"""The control-plane contract between the router and the prefill/decode instances (ZMQ + msgpack).

Sockets (one msgpack map per single-frame message, key "type" selects the message); an address
is TCP where the YAML pins the port, else an ipc name in the server's namespace
(config.server_namespace, one host):

    router   binds   PULL  router.result_bind_address                  <- every instance's events
    router   connects PUSH inst.address  (one per instance, IMMEDIATE, LINGER 0)
    instance binds   PULL  inst.address                                <- router messages
    instance connects PUSH to each message's `reply_to` (the router's result address)

No socket ever blocks without a bound: the router sends with NOBLOCK (a full or unconnected pipe
means "instance unreachable" -> 503 or another instance); instances answer pings from an IO
thread (`InstanceChannel`) so a long forward pass does not look like a dead peer.

Router -> instance
    GenerateRequest  sent to BOTH the chosen prefill and decode instance, same room/generation.
    Abort            sent to both on client disconnect, stop-string match, or router-side failure;
                     to decode alone, for one choice of an n > 1 room that a stop string ended.
    HealthPing       every router.health_check_interval_s to every instance.

Instance -> router
    TokenEvent       decode: the first token (sampled by prefill, arrives with the KV) and every
                     later token, in order, per choice (`index`; a request with n > 1 has n);
                     a choice's last event has finish_reason set. With logprobs asked for, each
                     token's logprob (and top logprobs) rides with it. The first event carries
                     the room's transfer stats (measured by decode).
                     prefill: on failure (finish_reason "error"), and, when the request asks for
                     prompt logprobs, one event with them (no tokens) before the KV is committed.
    HealthPong       reply to each ping, with load numbers for pairing and /metrics, and the
                     process's incarnation (a restarted instance is a new one: its old rooms are lost).
                     Both instances also send a TokenEvent with `admitted` when they admit a room
                     (the end of its queue wait; the router's transfer clock starts there).

A room is (room: u64, generation: u32). Events whose (room, generation) the router does not know
(finished, aborted, retried) are dropped, so an instance may send late events safely.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Union

import msgpack
import zmq

from glm53.server.sampling import SamplingParams

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
# The most choices (n) and top logprobs a request may carry: the router refuses more, and the
# first tokens' logprobs of that many fit the transport's metadata slot (engine/logprobs.py).
MAX_CHOICES = 64
MAX_TOP_LOGPROBS = 20
FINISH_REASONS = ("stop", "length", "abort", "error")
# Error codes an instance puts in TokenEvent.error_code; the router maps them to messages/metrics.
ERROR_CODES = ("bootstrap_timeout", "transfer_timeout", "transfer_failed", "overloaded", "context_length",
               "bad_request", "internal")


class ProtocolError(ValueError):
    """A message that is not valid under this protocol version."""


_FIELDS: dict[type, tuple[str, ...]] = {}
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def plain(v: Any) -> Any:
    """Dataclasses to dicts, recursively, without copying lists of scalars: what msgpack needs.
    `dataclasses.asdict` deep-copies everything, ~2x slower for a one-token TokenEvent, and
    decode sends one event per request per step."""
    t = type(v)
    if t in _SCALARS:
        return v
    names = _FIELDS.get(t)
    if names is None and is_dataclass(v):
        names = _field_names(t)
    if names is not None:
        return {k: plain(getattr(v, k)) for k in names}
    if t is list or t is tuple:
        for x in v:
            if type(x) not in _SCALARS:
                return [plain(x) for x in v]
        return v
    if t is dict:
        return {k: plain(x) for k, x in v.items()}
    return v


_DEFAULTS: dict[type, dict[str, Any]] = {}  # per message class: field -> its default value


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:  # once per class (plain() and from_dict run per message)
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
        _DEFAULTS[cls] = {f.name: f.default if f.default is not MISSING else f.default_factory()
                          for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}
    return names


@dataclass
class _Message:
    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        # Fields at their default are left out: a one-token TokenEvent is 6 keys instead of 18,
        # which the router unpacks tens of thousands of times a second.
        names = _field_names(type(self))
        defaults = _DEFAULTS[type(self)]
        d = {}
        for k in names:
            v = getattr(self, k)
            if k not in defaults or v != defaults[k]:
                d[k] = plain(v)
        d["type"] = self.TYPE
        d["v"] = PROTOCOL_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        # Unknown keys are ignored so that a newer peer may add optional fields; a field left
        # out (to_dict leaves out defaults) takes its default.
        kwargs = {k: d[k] for k in _field_names(cls) if k in d}
        try:
            obj = cls(**kwargs)
        except TypeError as e:
            raise ProtocolError(f"{cls.TYPE}: {e}") from None
        obj._from_wire()
        return obj

    def _from_wire(self) -> None:
        """Rebuild nested dataclasses after msgpack decoding."""


@dataclass
class PeerInfo:
    """Where an instance is: its control port and its transfer bootstrap port."""

    name: str
    role: str
    host: str
    port: int
    bootstrap_port: int | None  # prefill: its transfer bootstrap server; decode: None


@dataclass
class RequestSpec:
    """What to generate, built once by the router and carried whole to both instances: the
    prompt, the validated `SamplingParams` (max_new_tokens, stop ids, ignore_eos, seed, ...) and
    the model's eos ids. Decode alone decides every finish from it (stop token, eos, stop
    string, length); the router only formats the text."""

    rid: str  # the client-visible request id (logs, x-request-id)
    input_ids: list[int]
    params: SamplingParams  # max_new_tokens already capped so that prompt + completion <= context
    eos_token_ids: list[int]  # the model's eos ids; finish "stop" unless params.ignore_eos
    n: int = 1  # choices sharing the prompt's prefill (and, on decode, its full KV pages)
    # -1: no logprobs; 0: each output token's logprob; k > 0: also its k most likely tokens.
    logprobs: int = -1
    # -1: no prompt logprobs; p >= 0: the logprobs of prompt positions p.. (prefill computes them).
    prompt_logprobs_start: int = -1
    # Prefix-cache isolation (vLLM's cache_salt, SGLang's cache_salt / extra_key): a request reuses
    # only KV cached by requests with the same salt.
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.params.max_new_tokens is None:
            raise ValueError("a RequestSpec's max_new_tokens is resolved (router/intake.request_spec)")

    @property
    def stop_ids(self) -> frozenset[int]:
        """The token ids whose sampling ends the request with finish_reason "stop"."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return frozenset(self.params.stop_token_ids) | frozenset(eos)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "RequestSpec":
        try:
            return cls(rid=d["rid"], input_ids=list(d["input_ids"]), params=SamplingParams.from_dict(d["params"]),
                       eos_token_ids=list(d["eos_token_ids"]), n=int(d.get("n", 1)),
                       logprobs=int(d.get("logprobs", -1)),
                       prompt_logprobs_start=int(d.get("prompt_logprobs_start", -1)),
                       cache_salt=str(d.get("cache_salt", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"generate: bad request spec: {e}") from None


@dataclass
class GenerateRequest(_Message):
    """A RequestSpec on its way to one instance, with where it runs and where to answer."""

    TYPE: ClassVar[str] = "generate"
    spec: RequestSpec
    room: int  # u64, random per request
    generation: int  # u32: a retry on another prefill gets a new room id and the next generation
    prefill: PeerInfo
    decode: PeerInfo
    reply_to: str  # the router's result address (tcp://host:port)
    sent_at: float = 0.0  # router's time.time() when sent (queue-time metrics)
    # Seconds the request may still wait on the instance to be admitted (what is left of
    # router.max_queue_wait_s after the router's queue); past it the instance fails it as
    # "overloaded". 0: router.max_queue_wait_s.
    queue_budget_s: float = 0.0

    def _from_wire(self) -> None:
        if isinstance(self.spec, dict):
            self.spec = RequestSpec.from_wire(self.spec)
        if isinstance(self.prefill, dict):
            self.prefill = PeerInfo(**self.prefill)
        if isinstance(self.decode, dict):
            self.decode = PeerInfo(**self.decode)


@dataclass
class Abort(_Message):
    TYPE: ClassVar[str] = "abort"
    room: int
    generation: int
    reason: str = "abort"


@dataclass
class HealthPing(_Message):
    TYPE: ClassVar[str] = "ping"
    seq: int
    reply_to: str
    sent_at: float = 0.0


@dataclass
class TransferStats:
    """One room's KV transfer, as measured by the instance that reports it."""

    seconds: float = 0.0  # decode: destination sent to prefill -> commit seen (covers prefill compute)
    bytes: int = 0
    bootstrap_seconds: float = 0.0


@dataclass
class TokenEvent(_Message):
    TYPE: ClassVar[str] = "tokens"
    room: int
    generation: int
    instance: str  # the sender's name
    token_ids: list[int] = field(default_factory=list)
    # None while running; "stop" (eos, stop token or stop string, see matched_stop), "length"
    # (max_new_tokens), "abort", "error" (see error / error_code). Decode alone decides.
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # the stop/eos token id or the stop string that ended it
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total generated so far, including token_ids
    cached_tokens: int = 0
    transfer: TransferStats | None = None
    # Speculative decoding: tokens committed by each verify step since the previous event.
    spec_accept: list[int] = field(default_factory=list)
    index: int = 0  # the choice these tokens belong to (0..n-1)
    # Requests asking for logprobs: per token of token_ids, its logprob under log_softmax of the
    # raw logits, and its top-k [[id, logprob], ...] (most likely first; empty lists for k = 0).
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    # prefill, requests asking for prompt logprobs: one entry per prompt position from
    # spec.prompt_logprobs_start (None for position 0, which has no context).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list]] | None = None
    # The instance admitted the room (prefill: pages and senders, it computes next; decode: pages
    # and receivers): its queue wait is over, the transfer clock runs from here.
    admitted: bool = False

    def _from_wire(self) -> None:
        if isinstance(self.transfer, dict):
            self.transfer = TransferStats(**self.transfer)
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"tokens: finish_reason must be one of {FINISH_REASONS} or null, got {self.finish_reason!r}")


@dataclass
class LoadStats:
    """Instance load, snapshotted by the engine once per step (cheap to read from another thread)."""

    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # queued (prefill: not yet scheduled; decode: waiting for KV / pages)
    num_transferring: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    page_size: int = 0
    gen_throughput: float = 0.0  # tokens/s over the last log interval


@dataclass
class HealthPong(_Message):
    TYPE: ClassVar[str] = "pong"
    seq: int
    instance: str
    role: str
    ready: bool  # False while loading weights / warming up
    load: LoadStats = field(default_factory=LoadStats)
    sent_at: float = 0.0  # echoed from the ping (round-trip time)
    # Random per instance process: a new value is a restart, whose rooms the old process held
    # are lost (the router fails them at once, even if it never saw the instance go silent).
    incarnation: int = 0

    def _from_wire(self) -> None:
        if isinstance(self.load, dict):
            self.load = LoadStats(**self.load)


Message = Union[GenerateRequest, Abort, HealthPing, TokenEvent, HealthPong]
_TYPES: dict[str, type] = {c.TYPE: c for c in (GenerateRequest, Abort, HealthPing, TokenEvent, HealthPong)}


# One frame holding several messages for one destination, in order: a decode step's token events
# for all its requests go to the router as one frame instead of one frame per request.
BATCH = "batch"


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_dict(), use_bin_type=True)


def encode_batch(msgs: list[Message]) -> bytes:
    return msgpack.packb({"type": BATCH, "v": PROTOCOL_VERSION, "msgs": [m.to_dict() for m in msgs]},
                         use_bin_type=True)


def _unpack(data: bytes) -> dict:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"not a msgpack message: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"expected a msgpack map, got {type(d).__name__}")
    return d


def _from_map(d: Any) -> Message:
    if not isinstance(d, dict):
        raise ProtocolError(f"expected a msgpack map, got {type(d).__name__}")
    if d.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {d.get('v')!r}, expected {PROTOCOL_VERSION}")
    cls = _TYPES.get(d.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message type {d.get('type')!r}")
    return cls.from_dict(d)


def decode(data: bytes) -> Message:
    """One message (a batch frame is a ProtocolError here: see `decode_all`)."""
    return _from_map(_unpack(data))


def decode_all(data: bytes) -> list[Message]:
    """The messages of one frame: a single message or a batch (`encode_batch`)."""
    d = _unpack(data)
    if d.get("type") != BATCH:
        return [_from_map(d)]
    if d.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {d.get('v')!r}, expected {PROTOCOL_VERSION}")
    msgs = d.get("msgs")
    if not isinstance(msgs, list):
        raise ProtocolError("a batch frame needs a list of messages")
    return [_from_map(m) for m in msgs]


# --------------------------------------------------------------------------------------------
# Instance side: the socket pair an engine uses
# --------------------------------------------------------------------------------------------


class InstanceChannel:
    """An instance's end of the protocol.

    An IO thread owns the PULL socket: it answers HealthPing itself (from `load_fn()` and
    `ready`), and queues GenerateRequest/Abort for the engine, which takes them with `get()` /
    `drain()`. `send()` may be called from any thread (a lock serializes the PUSH sockets);
    inside `batched()` the calling thread's sends are held and leave as one frame per destination.
    """

    def __init__(self, bind_address: str, name: str, role: str,
                 load_fn: Callable[[], LoadStats] | None = None, ctx: zmq.Context | None = None):
        self.name, self.role = name, role
        self.ready = False
        # This process's identity in its pongs (HealthPong.incarnation): never 0, new on a restart.
        self.incarnation = random.getrandbits(63) | 1
        self._load_fn = load_fn or LoadStats
        self._ctx = ctx or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(bind_address)
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._held: dict[str, list[Message]] | None = None  # batched() sends, per destination
        self._held_by: int | None = None  # the thread batching (the IO thread's pongs never wait)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-zmq-io", daemon=True)
        self._thread.start()

    def get(self, timeout: float | None = None) -> GenerateRequest | Abort | None:
        """The next router message, or None after `timeout` seconds."""
        try:
            return self._inbox.get(timeout=timeout)  # type: ignore[return-value]
        except queue.Empty:
            return None

    def drain(self) -> list[GenerateRequest | Abort]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Hold this thread's sends until the block ends, then send each destination's messages
        in order as one frame (one message: a plain frame). The engine wraps each step in it, so
        the router gets one frame per step rather than one per request and token."""
        if self._held_by == threading.get_ident():
            yield  # nested: the outer block sends
            return
        held: dict[str, list[Message]] = {}
        self._held, self._held_by = held, threading.get_ident()
        try:
            yield
        finally:
            self._held, self._held_by = None, None
            self._send_held(held)

    def flush(self) -> None:
        """Inside `batched()`: send what this thread holds now (the block goes on holding later
        sends); elsewhere nothing is held."""
        held = self._held
        if held is not None and self._held_by == threading.get_ident():
            self._send_held(held)
            held.clear()

    def _send_held(self, held: dict[str, list[Message]]) -> None:
        for reply_to, msgs in held.items():
            self._send_frame(reply_to, encode(msgs[0]) if len(msgs) == 1 else encode_batch(msgs),
                             msgs[0].TYPE if len(msgs) == 1 else f"batch of {len(msgs)}")

    def send(self, reply_to: str, msg: Message) -> None:
        held = self._held
        if held is not None and self._held_by == threading.get_ident():
            held.setdefault(reply_to, []).append(msg)
            return
        self._send_frame(reply_to, encode(msg), msg.TYPE)

    def _send_frame(self, reply_to: str, data: bytes, what: str) -> None:
        with self._lock:
            sock = self._push.get(reply_to)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                # Bounded everywhere: a vanished router never blocks the engine or its exit.
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.setsockopt(zmq.SNDTIMEO, 1000)
                sock.connect(reply_to)
                self._push[reply_to] = sock
            try:
                sock.send(data)
            except zmq.Again:
                log.warning("%s: router %s is not draining events; dropped a %s", self.name, reply_to, what)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            for s in self._push.values():
                s.close()
            self._push.clear()
        self._pull.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                msg = decode(self._pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except ProtocolError as e:
                log.error("%s: dropped an invalid message: %s", self.name, e)
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if isinstance(msg, HealthPing):
                try:
                    load = self._load_fn()
                except Exception:  # never let a stats bug kill the IO thread
                    log.exception("%s: load_fn failed", self.name)
                    load = LoadStats()
                self.send(msg.reply_to, HealthPong(seq=msg.seq, instance=self.name, role=self.role,
                                                   ready=self.ready, load=load, sent_at=msg.sent_at,
                                                   incarnation=self.incarnation))
            else:
                self._inbox.put(msg)


def probe(targets: dict[str, str], timeout: float, ctx: zmq.Context | None = None) -> set[str]:
    """Ping instances (name -> control address) once; the names that answered ready within
    `timeout` seconds. Used by `glm53-serve up` to wait for its local instances."""
    ctx = ctx or zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    reply_to = f"tcp://127.0.0.1:{port}"
    pushes = []
    try:
        for addr in targets.values():
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.connect(addr)
            pushes.append(s)
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        sent = [False] * len(pushes)
        while time.monotonic() < deadline and len(ready) < len(targets):
            for k, s in enumerate(pushes):
                if not sent[k]:
                    try:
                        s.send(encode(HealthPing(seq=k, reply_to=reply_to, sent_at=time.time())), zmq.NOBLOCK)
                        sent[k] = True
                    except zmq.Again:
                        pass  # not connected yet
            if pull.poll(20):
                try:
                    msg = decode(pull.recv(zmq.NOBLOCK))
                except (zmq.Again, ProtocolError):
                    continue
                if isinstance(msg, HealthPong) and msg.ready:
                    ready.add(msg.instance)
        return ready & set(targets)
    finally:
        for s in pushes:
            s.close(0)
        pull.close(0)
