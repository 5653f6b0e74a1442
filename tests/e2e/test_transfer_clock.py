"""A long prefill queue is not a transfer failure (docs/ARCHITECTURE.md, "Transfer lifecycle"):
with one prefill slot, requests wait in prefill's queue far longer than the transfer timeout,
and every one completes, because decode's transfer clock starts at prefill's admission."""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from glm53.support import chaos

TRANSFER_TIMEOUT = 3.0


def test_long_prefill_queue_is_not_a_transfer_timeout(tmp_path_factory, model_cache):
    c = chaos.start_cluster(tmp_path_factory.mktemp("clock"), model_cache, transfer_timeout_s=TRANSFER_TIMEOUT,
                            bootstrap_timeout_s=60.0, prefill={"max_running_requests": 1})
    try:
        def prompt(k: int) -> list[int]:
            return [(i * 131 + k * 7) % 3900 + 10 for i in range(500)]

        # Enough prompts that the queue outlasts the transfer timeout about 4 times over, timed
        # after a warm-up (the first request also connects decode to prefill). Queued prefills
        # run faster than the timed one (warm caches): CI once saw 24 of them last 3.6 s only.
        httpx.post(c.url + "/v1/completions", timeout=60, json={"model": chaos.MODEL, "prompt": "hi", "max_tokens": 1})
        t0 = time.monotonic()
        assert httpx.post(c.url + "/v1/completions", timeout=60, json={
            "model": chaos.MODEL, "prompt": prompt(99), "max_tokens": 4}).status_code == 200
        alone = time.monotonic() - t0
        prompts = [prompt(k) for k in range(min(48, max(6, math.ceil(4 * TRANSFER_TIMEOUT / alone) + 1)))]

        async def one(http: httpx.AsyncClient, p: list[int]) -> tuple[int, str, float]:
            t0 = time.monotonic()
            r = await http.post(c.url + "/v1/completions", json={"model": chaos.MODEL, "prompt": p, "max_tokens": 4,
                                                                 "ignore_eos": True})
            return r.status_code, r.text[:300], time.monotonic() - t0

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        results = asyncio.run(run())
    finally:
        c.stop()
    assert all(status == 200 for status, _, _ in results), results
    # The last ones queued behind the others for longer than the transfer timeout (with decode's
    # old clock, from its ROOM message, they failed as 504 "transfer timeout").
    assert max(t for _, _, t in results) > 1.2 * TRANSFER_TIMEOUT, (alone, results)
