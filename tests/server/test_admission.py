"""The router's admission queue (router/admission.py) against a stand-in pool: first come first
served, bounded by router.max_queued_requests and router.max_queue_wait_s with a 503 that
carries Retry-After, dispatch when capacity frees, refusal of everything at shutdown; and its
config keys."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from glm53.server.config import RouterConfig
from glm53.server.config_parse import parse_config
from glm53.server.config_values import ConfigError
from glm53.server.router.admission import AdmissionQueue, QueueRefused
from glm53.server.router.instance_pool import Unavailable
from glm53.server.router.metrics import RouterMetrics


class Pool:
    """What the queue needs of InstancePool: `slots` rooms at once."""

    def __init__(self, slots: int, healthy: bool = True):
        self.slots, self.healthy_pair, self.rooms = slots, healthy, []
        self.on_capacity = None
        self.released = []

    def can_place(self) -> bool:
        return self.healthy_pair and len(self.rooms) < self.slots

    def has_pair(self) -> bool:
        return self.healthy_pair

    def unavailable(self) -> str:
        return "no healthy prefill instance"

    def submit(self, spec, queue_deadline: float = 0.0, gated: bool = False):
        room = SimpleNamespace(spec=spec, queue_deadline=queue_deadline)
        self.rooms.append(room)
        return room

    def release(self, room, abort: bool) -> None:
        self.rooms.remove(room)
        self.released.append((room.spec, abort))
        if self.on_capacity:
            self.on_capacity()


def _queue(slots: int, wait: float = 5.0, queued: int = 10, healthy: bool = True) -> tuple[AdmissionQueue, Pool]:
    pool = Pool(slots, healthy)
    return AdmissionQueue(pool, RouterConfig(max_queue_wait_s=wait, max_queued_requests=queued),
                          RouterMetrics("m")), pool


def test_waits_in_order_and_dispatches_as_rooms_free():
    async def run():
        q, pool = _queue(slots=2)
        order = []

        async def one(k: int):
            room = await q.place(k)
            order.append(k)
            return room

        tasks = [asyncio.create_task(one(k)) for k in range(5)]
        await asyncio.sleep(0.05)
        assert order == [0, 1] and q.depth == 3
        for _ in range(3):
            pool.release(pool.rooms[0], abort=False)
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4] and q.depth == 0
        # The deadline travels with the room: by when both instances must have admitted it.
        assert all(0 < r.queue_deadline - time.monotonic() <= 5.0 for r in pool.rooms)

    asyncio.run(run())


def test_full_queue_and_waiting_too_long_are_503_with_retry_after():
    async def run():
        q, pool = _queue(slots=1, wait=0.3, queued=2)
        await q.place("running")
        waiting = [asyncio.create_task(q.place(k)) for k in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueRefused) as full:
            await q.place("one too many")
        assert full.value.status == 503 and "max_queued_requests" in full.value.message
        assert 1 <= int(full.value.headers["Retry-After"]) <= 60
        t0 = time.monotonic()
        for t in waiting:
            with pytest.raises(QueueRefused) as late:
                await t
            assert "max_queue_wait_s" in late.value.message and int(late.value.headers["Retry-After"]) >= 1
        assert time.monotonic() - t0 < 0.5 and q.depth == 0
        m = q.metrics
        assert m.queue_rejected.labels("m", "full")._value.get() == 1
        assert m.queue_rejected.labels("m", "timeout")._value.get() == 2

    asyncio.run(run())


def test_no_healthy_pair_is_503_at_once_and_shutdown_refuses_the_line():
    async def run():
        q, _ = _queue(slots=1, healthy=False)
        with pytest.raises(Unavailable):
            await q.place("x")
        q, pool = _queue(slots=1)
        await q.place("running")
        waiting = asyncio.create_task(q.place("queued"))
        await asyncio.sleep(0.01)
        q.close("the server is shutting down")
        with pytest.raises(QueueRefused, match="shutting down"):
            await waiting
        with pytest.raises(QueueRefused, match="shutting down"):
            await q.place("new")

    asyncio.run(run())


def test_a_waiter_that_leaves_gives_its_room_back():
    async def run():
        q, pool = _queue(slots=1)
        await q.place("running")
        waiting = asyncio.create_task(q.place("queued"))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client went away
        await asyncio.sleep(0.01)
        assert q.depth == 0
        pool.release(pool.rooms[0], abort=False)
        assert [r.spec for r in pool.rooms] == []  # nothing was placed for the one that left

    asyncio.run(run())


@pytest.mark.parametrize("key,value", [("max_queue_wait_s", 0), ("max_queued_requests", -1),
                                       ("max_queue_wait_s", "long")])
def test_config_errors_name_the_key(key, value):
    raw = {"router": {key: value}, "prefill": [{"host": "127.0.0.1", "port": 1, "bootstrap_port": 2}],
           "decode": [{"host": "127.0.0.1", "port": 3}]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, source="x.yaml")
    assert f"router.{key}" in str(e.value) and "x.yaml" in str(e.value)


def test_config_defaults():
    r = RouterConfig()
    assert r.max_queue_wait_s == 600.0 and r.max_queued_requests == 1024


def test_a_batch_larger_than_decode_holds_moves_through(tmp_path, model_dir, glm53_cache):
    """70 prompts in one request, with decode holding 64 rooms at most (its default
    max_running_requests): the first are placed at once, the rest as rooms free, and every one
    completes (the batch never waits for its own unconsumed rooms). Test-double instances."""
    import httpx

    from tests.server.conftest import start_cluster

    c = start_cluster(tmp_path, model_dir, glm53_cache)
    try:
        prompts = [[300 + i, 301 + i, 302 + i] for i in range(70)]
        r = httpx.post(c.url + "/v1/completions", timeout=60,
                       json={"model": "glm-5-tiny", "prompt": prompts, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 70 and body["usage"]["completion_tokens"] == 210
    finally:
        c.stop()
