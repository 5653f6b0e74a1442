"""A long prefill queue is not a transfer failure (docs/ARCHITECTURE.md, "Transfer lifecycle"):
with one prefill slot, requests wait in prefill's queue far longer than the transfer timeout,
and every one completes, because decode's transfer clock starts at prefill's admission."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.e2e import chaos

TRANSFER_TIMEOUT = 3.0


def test_long_prefill_queue_is_not_a_transfer_timeout(tmp_path_factory, model_cache):
    c = chaos.start_cluster(tmp_path_factory.mktemp("clock"), model_cache, transfer_timeout_s=TRANSFER_TIMEOUT,
                            bootstrap_timeout_s=60.0, prefill={"max_running_requests": 1})
    try:
        prompts = [[(i * 131 + k * 7) % 3900 + 10 for i in range(500)] for k in range(6)]

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
    # The last ones queued behind the others for well over the transfer timeout.
    assert max(t for _, _, t in results) > 1.5 * TRANSFER_TIMEOUT, results
