"""Bootstrap over ZMQ (msgpack): a registry of one prefill instance's ranks.

Prefill ranks REGISTER ``(instance, pp rank, tp rank, control endpoint, agent name, agent
metadata, buffer table)``; decode ranks QUERY it once per prefill instance and then talk to the
prefill ranks directly (HELLO once per peer, ROOM per request, ABORT / FAIL / QUIESCED notices,
PING / PONG). The server carries addresses and tables only, never data.

Run one ``BootstrapServer`` per prefill instance (in the process of its pp0/tp0 rank or in the
launcher). It binds its address and keeps it: ``tcp://host:port`` (a pinned port), an ``ipc://``
name (one host), or with neither a port the kernel picks on ``host`` (``address`` says which).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from .messages import (PROTOCOL_VERSION, Message, Query, RankInfo, Register, Registered,
                       Topology, Unregister, decode_message, unpack)

log = logging.getLogger("glm53.transport")


class BootstrapServer:
    """Registry for one prefill instance of ``pp_size x tp_size`` ranks. A QUERY is answered
    with ``complete=False`` until every rank registered. Runs its own thread; ``close()`` stops
    it within one poll interval."""

    def __init__(self, instance: str, pp_size: int, tp_size: int, host: str = "127.0.0.1",
                 port: int | None = None, ctx: zmq.Context | None = None, address: str | None = None):
        self.instance, self.pp_size, self.tp_size = instance, pp_size, tp_size
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if address:
            self._sock.bind(address)
        elif port:
            self._sock.bind(address := f"tcp://{host}:{port}")
        else:  # a port the kernel picks, bound here and kept (never probed and released)
            address = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self.address = address
        self._ranks: dict[tuple[int, int], RankInfo] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bootstrap-{instance}",
                                        daemon=True)
        self._thread.start()

    @property
    def complete(self) -> bool:
        return len(self._ranks) == self.pp_size * self.tp_size

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(50)):
                    continue
                while True:
                    try:
                        ident, raw = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(ident, unpack(raw))
            except zmq.ZMQError as e:  # socket closed under us
                if not self._stop.is_set():
                    log.error("bootstrap server: %s", e)
                break
            except Exception as e:  # never die silently: log and serve the next message
                log.exception("bootstrap server: bad message: %s", e)
        self._sock.close(0)

    def _reply(self, ident: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([ident, msg.encode()], zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover
            pass

    def _handle(self, ident: bytes, m: dict) -> None:
        msg = decode_message(m)
        if isinstance(msg, Register):
            err = ""
            r = msg.rank
            if msg.version != PROTOCOL_VERSION:
                err = f"protocol version {msg.version} != {PROTOCOL_VERSION}"
            elif msg.instance != self.instance:
                err = f"instance {msg.instance!r} registered at bootstrap of {self.instance!r}"
            elif (msg.pp_size, msg.tp_size) != (self.pp_size, self.tp_size):
                err = (f"rank reports pp={msg.pp_size} tp={msg.tp_size}, instance has "
                       f"pp={self.pp_size} tp={self.tp_size}")
            elif not (0 <= r.pp < self.pp_size and 0 <= r.tp < self.tp_size):
                err = f"rank (pp={r.pp}, tp={r.tp}) out of range"
            if not err:
                # Re-registration (a restarted rank) replaces the old entry.
                self._ranks[(r.pp, r.tp)] = r
            self._reply(ident, Registered(not err, err))
        elif isinstance(msg, Query):
            ranks = tuple(self._ranks[k] for k in sorted(self._ranks)) if self.complete else ()
            self._reply(ident, Topology(PROTOCOL_VERSION, self.complete, self.instance,
                                        self.pp_size, self.tp_size, ranks))
        elif isinstance(msg, Unregister):
            self._ranks.pop((msg.pp, msg.tp), None)
        else:
            log.warning("bootstrap server: unknown message %r", m.get("t"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def query_topology(address: str, timeout: float = 5.0, ctx: zmq.Context | None = None) -> dict:
    """Blocking helper (tools, tests): ask a bootstrap server for its complete topology,
    retrying until ``timeout``. Raises TimeoutError."""
    ctx = ctx or zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            s.send(Query().encode())
            if s.poll(int(min(200, max(1, (deadline - time.monotonic()) * 1000)))):
                m = unpack(s.recv())
                if m.get("complete"):
                    return m
                time.sleep(0.05)
        raise TimeoutError(f"bootstrap {address}: topology not complete after {timeout}s")
    finally:
        s.close(0)

