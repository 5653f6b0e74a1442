"""Fixtures for the server tests: the embedded model in a per-session cache, and a cluster of
real processes (router + test-double instances) started with `glm53-serve up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.ports import free_ports

FAKE_INSTANCE = str(Path(__file__).with_name("fake_instance.py"))


@pytest.fixture(scope="session")
def glm53_cache(tmp_path_factory) -> Path:
    # Reuse the user's cache when it already holds the embedded model; else a private one.
    return tmp_path_factory.mktemp("glm53-cache")


@pytest.fixture(scope="session")
def model_dir(glm53_cache) -> Path:
    return ensure_embedded_model(glm53_cache)


@dataclass
class Cluster:
    url: str
    proc: subprocess.Popen
    pid_dir: Path
    config: dict
    log_path: Path

    def pid(self, name: str) -> int:
        return int((self.pid_dir / f"{name}.pid").read_text())

    def server_info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=5).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_cluster(tmp: Path, model_dir: Path, cache: Path, *, n_prefill: int = 1, n_decode: int = 1,
                  router: dict | None = None, model: dict | None = None, env: dict | None = None,
                  timeout: float = 60) -> Cluster:
    ports = free_ports(2 + 2 * (n_prefill + n_decode))
    cfg = {
        "model": {"path": str(model_dir), "served_model_name": ["glm-5-tiny"], "context_length": 512,
                  **(model or {})},
        "router": {"host": "127.0.0.1", "port": ports[0], "result_port": ports[1],
                   "health_check_interval_s": 0.2, "health_timeout_s": 1.5, **(router or {})},
        "transfer": {"backend": "nixl", "bootstrap_timeout_s": 5, "transfer_timeout_s": 5},
        "defaults": {"device": "cpu", "page_size": 16, "num_pages": 256},
        "prefill": [], "decode": [],
    }
    k = 2
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        for i in range(n):
            inst = {"name": f"{role[0]}{i}", "host": "127.0.0.1", "port": ports[k]}
            if role == "prefill":
                inst["bootstrap_port"] = ports[k + 1]
            cfg[role].append(inst)
            k += 2
    tmp.mkdir(parents=True, exist_ok=True)
    cfg_path = tmp / "cluster.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    pid_dir = tmp / "pids"
    pid_dir.mkdir(exist_ok=True)
    log_path = tmp / "up.log"
    full_env = {**os.environ, "GLM53_CACHE": str(cache), "GLM53_INSTANCE_IMPL": FAKE_INSTANCE,
                "FAKE_PID_DIR": str(pid_dir), **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "glm53.server.cli", "up", "--config", str(cfg_path),
                                 "--log-level", "warning"],
                                stdout=subprocess.PIPE, stderr=log, env=full_env, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line or proc.poll() is not None:
            break
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"cluster did not start: {line!r}\n{log_path.read_text()[-3000:]}")
    return Cluster(url=f"http://127.0.0.1:{ports[0]}", proc=proc, pid_dir=pid_dir, config=cfg, log_path=log_path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, glm53_cache):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), model_dir, glm53_cache, n_prefill=1, n_decode=2)
    yield c
    c.stop()
