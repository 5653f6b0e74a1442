"""The router's admission queue: a burst waits instead of failing, up to bounds the operator sets.

A request is dispatched to an instance pair (`InstancePool.submit`) only while a healthy decode
instance holds fewer rooms than its `max_running_requests` (and the router fewer than
`router.max_running_requests`); otherwise it waits here, first come first served. Rooms freeing
(`InstancePool.release`) and instances coming back dispatch the next ones. Dispatched, a room
still waits in the instances' own queues (prefill admits only what its next step computes;
decode waits for KV pages) until both report it admitted (`TokenEvent.admitted`), and only then
do the transfer clocks run. The whole wait, here and there, is bounded by
`router.max_queue_wait_s`: the request carries what is left of it to the instances
(`GenerateRequest.queue_budget_s`), which fail it as "overloaded" at that deadline. At most
`router.max_queued_requests` wait here. Beyond either bound the client gets a 503 with an
OpenAI-style error body and a `Retry-After` header (seconds, estimated from the recent dispatch
rate), never a transfer-timeout error.

Metrics: the queue's depth as `sglang:num_queue_reqs{engine_type="router"}` (the instances'
queues are the same gauge with their names), the wait until admission as the histogram
`sglang:queue_time_seconds`, refusals as `glm53:queue_rejected_requests{reason}`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

from glm53.server.config import RouterConfig
from glm53.server.protocol import RequestSpec
from glm53.server.router.instance_pool import InstancePool, Placement, Unavailable
from glm53.server.router.metrics import RouterMetrics
from glm53.server.router.schemas import APIError

# Retry-After is clamped to this range (seconds).
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60


class QueueRefused(APIError):
    """A 503 from the admission queue (full, waited too long, shutting down), with Retry-After."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(503, message)
        self.headers = {"Retry-After": str(int(retry_after_s))}


class ClientGone(Exception):
    """The client went away while its request was queued (the app answers 499 to nobody)."""


@dataclass(eq=False)
class _Waiter:
    spec: RequestSpec
    arrived: float  # monotonic
    deadline: float  # monotonic: arrived + router.max_queue_wait_s
    future: asyncio.Future


class AdmissionQueue:
    def __init__(self, pool: InstancePool, cfg: RouterConfig, metrics: RouterMetrics):
        self.pool, self.cfg, self.metrics = pool, cfg, metrics
        self.waiters: deque[_Waiter] = deque()
        self._dispatched: deque[float] = deque(maxlen=256)  # monotonic times of recent dispatches
        self.closing = ""  # why new requests are refused (shutdown); "" while serving
        pool.on_capacity = self.pump

    @property
    def depth(self) -> int:
        return len(self.waiters)

    def retry_after(self, ahead: int | None = None) -> int:
        """Seconds a refused client should wait: the requests ahead of it over the recent
        dispatch rate, clamped to [1, 60]."""
        ahead = len(self.waiters) if ahead is None else ahead
        d = self._dispatched
        rate = (len(d) - 1) / (d[-1] - d[0]) if len(d) >= 2 and d[-1] > d[0] else 0.0
        est = ahead / rate if rate > 0 else RETRY_AFTER_MAX_S
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(est)))

    async def place(self, spec: RequestSpec,
                    disconnected: Callable[[], Awaitable[bool]] | None = None) -> Placement:
        """A room for `spec` on an instance pair, after waiting in line if need be. Raises
        QueueRefused (503 + Retry-After), Unavailable (no healthy pair), or ClientGone."""
        if self.closing:
            raise QueueRefused(self.closing, RETRY_AFTER_MIN_S)
        now = time.monotonic()
        deadline = now + self.cfg.max_queue_wait_s
        if not self.waiters and self.pool.can_place():
            return self._submit(spec, deadline)
        if not self.pool.has_pair():  # nothing to wait for: answer now, as without a queue
            raise Unavailable(self.pool.unavailable())
        if len(self.waiters) >= self.cfg.max_queued_requests:
            self._refused("full")
            raise QueueRefused(f"the server is busy: {len(self.waiters)} requests are queued (router."
                               f"max_queued_requests = {self.cfg.max_queued_requests}); retry later",
                               self.retry_after())
        w = _Waiter(spec, now, deadline, asyncio.get_running_loop().create_future())
        self.waiters.append(w)
        self.pump()  # capacity may have freed since the last release (the line moves on its own)
        try:
            while True:
                left = w.deadline - time.monotonic()
                if left <= 0:
                    self._refused("timeout")
                    raise QueueRefused(f"the server is busy: the request waited {self.cfg.max_queue_wait_s:g} s "
                                       f"in the queue (router.max_queue_wait_s) without being admitted; retry later",
                                       self.retry_after())
                done, _ = await asyncio.wait({w.future}, timeout=min(left, 0.5) if disconnected else left)
                if done:
                    return w.future.result()  # a Placement, or raises Unavailable / QueueRefused
                if disconnected is not None and await disconnected():
                    raise ClientGone()
        except BaseException:
            self._drop(w)
            raise
        finally:
            self._gauge()

    def pump(self) -> None:
        """Dispatch queued requests while an instance pair has room (the pool calls this when a
        room is released or an instance comes back)."""
        while self.waiters and self.pool.can_place():
            w = self.waiters.popleft()
            if w.future.done():
                continue
            try:
                w.future.set_result(self._submit(w.spec, w.deadline))
            except Unavailable as e:
                w.future.set_exception(e)
        self._gauge()

    def close(self, reason: str) -> None:
        """Refuse every queued and every new request (shutdown)."""
        self.closing = reason
        while self.waiters:
            w = self.waiters.popleft()
            if not w.future.done():
                w.future.set_exception(QueueRefused(reason, RETRY_AFTER_MIN_S))
        self._gauge()

    # ---- internals ----
    def _submit(self, spec: RequestSpec, deadline: float) -> Placement:
        room = self.pool.submit(spec, queue_deadline=deadline)
        self._dispatched.append(time.monotonic())
        return room

    def _drop(self, w: _Waiter) -> None:
        """A waiter leaves (refused, client gone, cancelled): out of the line, and a room placed
        for it in the meantime is released on both instances."""
        try:
            self.waiters.remove(w)
        except ValueError:
            pass
        if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            self.pool.release(w.future.result(), abort=True)
        elif not w.future.done():
            w.future.cancel()

    def _refused(self, reason: str) -> None:
        m = self.metrics
        m.queue_rejected.labels(m.model_name, reason).inc()

    def _gauge(self) -> None:
        self.metrics.set_router_queue(len(self.waiters))
