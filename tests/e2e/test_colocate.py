"""A colocated pair (`prefill[0].colocate: d0`) through `glm53-serve up` on the CPU: prefill and
decode run as two loops of one process, and serve exactly as two processes do. (On a GPU the pair
also splits the SMs: tests/server/test_gpu_colocate.py and benchmarks/gpu_e2e.py --colocate.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
import yaml

from glm53.server.embedded_model import EMBEDDED_DIRNAME
from glm53.support.cluster import Cluster
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, served_greedy


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("colocated"), model_cache, router={"restart_backoff_s": 0.5})
    c.cfg["prefill"][0]["colocate"] = "d0"
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    c.start()
    yield c
    c.stop()


def _children(c: Cluster, role: str) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(c.proc.pid), "-f", f"glm53.server.cli {role} "],
                          capture_output=True, text=True).stdout.split()


def test_one_process_serves_both_and_matches_offline(pair, model_cache):
    assert len(_children(pair, "decode")) == 1 and _children(pair, "prefill") == []
    new = 16
    assert served_greedy(pair, GREEDY_PROMPTS, new) == offline_greedy(model_cache / EMBEDDED_DIRNAME, GREEDY_PROMPTS, new)
    assert "d0+p0" in pair.logs()  # one log prefix for the pair's process


def test_killed_pair_is_restarted_as_one_process(pair):
    """`up` supervises the pair as one process: SIGKILL brings back both instances together."""
    (old,) = _children(pair, "decode")
    os.kill(int(old), signal.SIGKILL)
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        try:
            status = httpx.post(f"{pair.url}/generate", timeout=30, json={
                "input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).status_code
        except httpx.HTTPError:
            status = None
        if status == 200:
            break
        time.sleep(0.5)
    assert status == 200, pair.logs()
    new = _children(pair, "decode")
    assert len(new) == 1 and new[0] != old and _children(pair, "prefill") == []
