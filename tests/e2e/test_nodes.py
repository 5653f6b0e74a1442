"""An instance across two nodes, through two real `glm53-serve up --node-rank K` processes on one
machine: node 0 on 127.0.0.1 (router, decode, prefill's scheduler and stage 0), node 1 on
127.0.0.2 (prefill's stage 1 with the DFlash draft), the ranks meeting at `dist_init_addr`.
Greedy output equals the one-process `generate`; node 1's `up` killed with SIGKILL while a
request sits in its stage fails that request with an error naming the lost node, returns every
page on node 0 and reports the prefill instance down; node 1 started again rejoins and serves."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest
import yaml

from glm53.models import write_random_draft
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.cluster import Cluster, NodeUp
from glm53.support.ports import free_ports
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, served_greedy, wait_pages_free

NEW_TOKENS = 12
NODE1 = "127.0.0.2"  # the whole 127.0.0.0/8 is loopback on Linux: a second address, a second "node"


def _bindable(host: str) -> bool:
    try:
        with socket.create_server((host, 0)):
            return True
    except OSError:
        return False


# macOS, for one, routes only 127.0.0.1 to loopback unless told otherwise.
pytestmark = pytest.mark.skipif(not _bindable(NODE1), reason=f"{NODE1} is not a local address here")


@pytest.fixture(scope="module")
def target_dir(model_cache):
    return ensure_embedded_model(model_cache)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    # Feature layers 1 and 3 of 6: stage 0 (layers 0-2, node 0) and stage 1 (3-5, node 1) each
    # project their own part of the draft's context.
    return write_random_draft(tmp_path_factory.mktemp("draft"), target_dir, seed=9, n_layers=2, block_size=4)


def two_node_cluster(workdir, cache, draft_dir) -> Cluster:
    c = Cluster(workdir, cache, transfer_timeout_s=10.0, prefill_pp=2, up_args=("--node-rank", "0"),
                speculative={"algorithm": "DFLASH", "draft_model_path": str(draft_dir)},
                router={"health_timeout_s": 5.0, "max_retries": 0, "startup_timeout_s": 150.0})
    (dist_port,) = free_ports(1)
    p0 = c.cfg["prefill"][0]
    del p0["host"]  # node 0's host
    p0.update(nodes=[{"host": "127.0.0.1"}, {"host": NODE1}], dist_init_addr=f"127.0.0.1:{dist_port}")
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    return c


def test_pp_stages_on_two_nodes_serve_fail_and_rejoin(tmp_path_factory, model_cache, target_dir, draft_dir):
    workdir = tmp_path_factory.mktemp("nodes")
    c = two_node_cluster(workdir, model_cache, draft_dir)
    node1 = NodeUp(c, 1, workdir / "node1.log").launch()
    try:
        c.start()  # ready once p0's group, node 1's stage included, is whole
        node1.wait_ready()
        expected = offline_greedy(target_dir, GREEDY_PROMPTS, NEW_TOKENS)
        assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == expected

        # Hold a request inside node 1's stage, then lose node 1 with it.
        stage1 = node1.rank_pids()
        assert stage1, "node 1 runs prefill's stage 1"
        for pid in stage1:
            os.kill(pid, signal.SIGSTOP)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(f"{c.url}/generate", timeout=60, json={
            "input_ids": GREEDY_PROMPTS[2], "sampling_params": {"max_new_tokens": 4}})))
        t.start()
        time.sleep(1.0)
        t_kill = time.monotonic()
        node1.kill()
        t.join(30)
        r = result["r"]
        assert r.status_code >= 500, r.text
        msg = r.json()["error"]["message"]
        assert "lost a rank" in msg and f"node 1 at {NODE1}" in msg, msg
        assert time.monotonic() - t_kill < 10
        # The router reports prefill down, and prefill's pools on node 0 are whole at once.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and httpx.get(f"{c.url}/health", timeout=10).status_code != 503:
            time.sleep(0.2)
        health = httpx.get(f"{c.url}/health", timeout=10)
        assert health.status_code == 503 and "prefill" in health.json()["error"]["message"], health.text
        refused = httpx.post(f"{c.url}/generate", timeout=30, json={
            "input_ids": GREEDY_PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
        assert refused.status_code == 503, refused.text
        deadline = time.monotonic() + 3  # a few pongs
        while time.monotonic() < deadline and c.kv_tokens_in_use()["p0"] != 0:
            time.sleep(0.2)
        assert c.kv_tokens_in_use()["p0"] == 0

        # Node 1 comes back (booting while decode's room waits out its dead peer: then every
        # pool is whole); its stage joins a new group and the instance serves again.
        node1 = NodeUp(c, 1, workdir / "node1.log").launch()
        wait_pages_free(c)
        node1.wait_ready()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and httpx.get(f"{c.url}/health", timeout=10).status_code != 200:
            time.sleep(0.2)
        assert served_greedy(c, GREEDY_PROMPTS[:2], NEW_TOKENS) == expected[:2]
        wait_pages_free(c)
    finally:
        node1.stop()
        c.stop()
