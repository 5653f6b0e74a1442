"""cache_aware routing with two real prefill instances: every later turn of a conversation goes
to the prefill instance that holds its earlier turns, so its prompt's cached pages are reused
(usage.prompt_tokens_details.cached_tokens); first turns go by load."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from glm53.support.cluster import Cluster
from tests.e2e.served import wait_pages_free

PAGE = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("cache-routing"), model_cache, router={"policy": "cache_aware"})
    c.add_prefill("p1").start()
    yield c
    c.stop()


def turn(cluster, ids: list[int]) -> tuple[list[int], int]:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": "glm-5-tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_later_turns_reuse_their_conversations_prefill_cache(cluster):
    # 6 conversations of 3 turns, the conversations side by side (two at a time), each turn the
    # previous prompt plus new tokens: without cache-aware routing half the later turns would
    # land on the instance that never saw the conversation.
    convs = [[(c * 131 + i * 7) % 3000 + 20 for i in range(70)] for c in range(6)]

    def run(c: int) -> list[int]:
        ids, cached = list(convs[c]), []
        for t in range(3):
            _, hit = turn(cluster, ids)
            cached.append(hit)
            ids = ids + [(c * 17 + t * 5 + j) % 3000 + 20 for j in range(40)]
        return cached

    with cf.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(run, range(6)))
    for c, cached in enumerate(results):
        plen = len(convs[c])
        # turn t's prompt starts with turn t-1's whole prompt: its full pages are cached
        assert cached[1] >= plen // PAGE * PAGE and cached[2] >= (plen + 40) // PAGE * PAGE, (c, cached)
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    by = {ln.split('by="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
          if ln.startswith("glm53:cache_aware_routed_total")}
    assert by.get("cache", 0) >= 12 and by.get("load", 0) >= 6  # first turns by load, the rest by cache
    wait_pages_free(cluster)
