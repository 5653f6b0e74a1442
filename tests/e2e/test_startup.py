"""`glm53-serve up` on the shipped config as a new user runs it (issue 32): two servers that differ
only in their HTTP port run side by side (every internal endpoint is an ipc name the owning
process binds, derived from the HTTP address); a second `up` on a port in use is refused in one
line without a "ready" line; `--speculative-algorithm none` on the shipped config starts and
serves, and `glm53-serve config` accepts the same flags and prints what `up` runs.

The three servers start together (`--port 0`: `up` binds a free HTTP port and prints it), so the
module costs about one start-up."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "local.yaml"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "glm53.server.cli", *args]


class Up:
    """One `glm53-serve up --config configs/local.yaml --port 0 <flags>`, its stdout read by a thread."""

    def __init__(self, workdir: Path, name: str, env: dict, *flags: str):
        self.log = open(workdir / f"up-{name}.log", "w+")
        self.proc = subprocess.Popen(cli("up", "--config", str(SHIPPED), "--port", "0", *flags), cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.url = ""

    def wait_ready(self, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                m = re.search(r"glm53-serve ready: (http://\S+)", self.lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if m:
                self.url = m.group(1)
                return self.url
        self.log.flush()
        self.log.seek(0)
        raise AssertionError(f"up {self.proc.args[5:]} not ready (rc {self.proc.poll()}):\n{self.log.read()[-6000:]}")

    def complete(self, max_tokens: int = 12) -> str:
        r = httpx.post(f"{self.url}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def env(model_cache):
    return {**os.environ, "GLM53_CACHE": str(model_cache), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, env):
    """a, b: the shipped config as is (only the HTTP ports differ); off: with speculation off."""
    work = tmp_path_factory.mktemp("startup")
    ups = {"a": Up(work, "a", env), "b": Up(work, "b", env), "off": Up(work, "off", env, "--speculative-algorithm", "none")}
    try:
        for u in ups.values():
            u.wait_ready()
        yield ups
    finally:
        for u in ups.values():
            u.stop()


def test_two_default_servers_side_by_side(servers):
    a, b = servers["a"], servers["b"]
    assert a.url != b.url
    # Each answers through its own router and instances: same config, same greedy text.
    assert a.complete() == b.complete()
    for u in (a, b):
        info = httpx.get(f"{u.url}/get_server_info", timeout=10).json()
        assert info["speculative_algorithm"] == "DSPARK"
        assert all(i["healthy"] for role in ("prefill", "decode") for i in info[role])


def test_second_up_on_a_port_in_use_is_refused_in_one_line(servers, env):
    a = servers["a"]
    port = a.url.rsplit(":", 1)[1]
    t0 = time.monotonic()
    r = subprocess.run(cli("up", "--config", str(SHIPPED), "--port", port), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ready" not in r.stdout, (r.returncode, r.stdout)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "router.port" in lines[0] and f":{port} is already in use" in lines[0], r.stderr
    assert str(SHIPPED.relative_to(ROOT)) in lines[0] or str(SHIPPED) in lines[0]
    assert time.monotonic() - t0 < 60  # refused before anything started, not after restarts
    a.complete(max_tokens=2)  # and the running server was not disturbed


def test_speculation_off_on_the_shipped_config(servers, env):
    off, a = servers["off"], servers["a"]
    info = httpx.get(f"{off.url}/get_server_info", timeout=10).json()
    assert info["speculative_algorithm"] is None
    # DFlash changes the speed, not the greedy text.
    assert off.complete() == a.complete()
    # `config` validates the same resolved config `up` runs and prints it.
    r = subprocess.run(cli("config", "--config", str(SHIPPED), "--speculative-algorithm", "none"), cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    assert resolved["speculative"]["algorithm"] == "none"
    assert (Path(resolved["model"]["path"]) / "config.json").is_file()
    # Unpinned internal ports stay unpinned: every process binds its own endpoint.
    assert resolved["router"]["result_port"] is None
    assert all(i["port"] is None for role in ("prefill", "decode") for i in resolved[role])


def test_the_serving_benchmark_counts_tokens_not_chunks(servers):
    # benchmarks/serving.py's client against the shipped (DSpark) server: a verify step streams
    # every token it commits in one chunk, so tokens come from the usage chunk, not the chunk count
    from glm53.support.serving_sweep import one

    a = servers["a"]
    ids = httpx.post(f"{a.url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]

    async def request() -> dict:
        async with httpx.AsyncClient(timeout=120) as http:
            return await one(http, a.url, "glm-5-tiny", ids, 48)

    r = asyncio.run(request())
    assert r["ok"] and r["tokens"] == 48 and r["chunks"] < 48, {k: r.get(k) for k in ("ok", "tokens", "chunks")}
    assert 0 < r["tpot"] < r["e2e"], r["tpot"]
