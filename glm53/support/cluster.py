"""Start a real `glm53-serve up` deployment (router + prefill + decode processes, NIXL over
loopback) for end-to-end tests and benchmarks, on free ports, with the embedded tiny model."""

from __future__ import annotations

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
import yaml

from glm53.support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]


def cluster_yaml(ports: list[int], transfer_timeout_s: float = 20.0, stream_interval: int = 1,
                 prefill_tp: int = 1, decode_tp: int = 1, speculative: dict | None = None,
                 prefill_pp: int = 1, prefill_ep: int = 1, decode_ep: int = 1) -> dict:
    http, result, p_port, p_boot, d_port = ports
    return {
        **({"speculative": speculative} if speculative else {}),
        "name": "e2e",
        "model": {"path": "embedded:tiny-glm5", "served_model_name": ["glm-5-tiny"], "context_length": 2048},
        "router": {"host": "127.0.0.1", "port": http, "result_port": result, "health_check_interval_s": 0.5},
        "transfer": {"backend": "nixl", "bootstrap_timeout_s": transfer_timeout_s, "transfer_timeout_s": transfer_timeout_s},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "max_running_requests": 64,
                     "chunked_prefill_size": 64, "num_pages": 2048},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": p_port, "bootstrap_port": p_boot, "tp": prefill_tp,
                     "pp": prefill_pp, "ep": prefill_ep}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": d_port, "stream_interval": stream_interval,
                    "tp": decode_tp, "ep": decode_ep}],
    }


class Cluster:
    def __init__(self, workdir: Path, cache: Path, transfer_timeout_s: float = 20.0, stream_interval: int = 1,
                 prefill_tp: int = 1, decode_tp: int = 1, speculative: dict | None = None, prefill_pp: int = 1,
                 router: dict | None = None, up_args: tuple[str, ...] = (), prefill_ep: int = 1,
                 decode_ep: int = 1):
        self.up_args = list(up_args)  # e.g. ("--node-rank", "0") for node 0 of a config across nodes
        self.cfg = cluster_yaml(free_ports(5), transfer_timeout_s, stream_interval, prefill_tp, decode_tp,
                                speculative, prefill_pp, prefill_ep, decode_ep)
        self.cfg["router"].update(router or {})
        self.config_path = workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(self.cfg))
        self.url = f"http://127.0.0.1:{self.cfg['router']['port']}"
        self.env = {**os.environ, "GLM53_CACHE": str(cache), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        self.log = open(workdir / "cluster.log", "w+")
        self.proc: subprocess.Popen | None = None

    def add_prefill(self, name: str) -> "Cluster":
        """One more prefill instance like the first (call before start)."""
        named = [self.cfg["router"]["port"], self.cfg["router"]["result_port"]] + [
            inst[k] for pool in ("prefill", "decode") for inst in self.cfg[pool]
            for k in ("port", "bootstrap_port") if k in inst]
        port, boot = free_ports(2, exclude=named)
        self.cfg["prefill"].append({**self.cfg["prefill"][0], "name": name, "port": port, "bootstrap_port": boot})
        self.config_path.write_text(yaml.safe_dump(self.cfg))
        return self

    def start(self, timeout: float = 240.0) -> "Cluster":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glm53.server.cli", "up", "--config", str(self.config_path), *self.up_args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env, cwd=ROOT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "ready" in line:
                return self
            if not line and self.proc.poll() is not None:
                break
        logs = self.logs()
        self.stop()
        raise RuntimeError(f"cluster did not become ready:\n{logs}")

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-8000:]

    def instance_pid(self, role: str) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", f"glm53.server.cli {role} "],
                             capture_output=True, text=True).stdout.split()
        assert out, f"no {role} process found"
        return int(out[0])

    def kv_tokens_in_use(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^sglang:num_used_tokens\{[^}]*instance="([^"]+)"[^}]*\} (\S+)$', text, re.M)}

    def stop(self) -> None:
        stop_session(self.proc)
        self.log.close()


def stop_session(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the process group an `up` started with `start_new_session`, SIGKILL after 30 s."""
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class NodeUp:
    """Another node's `glm53-serve up --config X --node-rank K` for a `Cluster`'s config (an
    instance across nodes): `launch` starts it, `wait_ready` reads its ready line, `kill` sends
    SIGKILL to the `up` process alone (its children get SIGTERM from the kernel, as when a node's
    supervisor dies), `stop` ends it and everything it started."""

    def __init__(self, cluster: Cluster, node_rank: int, log_path: Path):
        self.cluster, self.node_rank = cluster, node_rank
        self.log = open(log_path, "a+")
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "NodeUp":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glm53.server.cli", "up", "--config", str(self.cluster.config_path),
             "--node-rank", str(self.node_rank)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.cluster.env, cwd=ROOT,
            start_new_session=True)
        # Its stdout is read on a thread, so waiting for the ready line is bounded.
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        return self

    def wait_ready(self, timeout: float = 240.0) -> "NodeUp":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if "ready" in self.lines.get(timeout=0.5):
                    return self
            except queue.Empty:
                pass
        raise RuntimeError(f"node {self.node_rank} did not become ready:\n{self.logs()}")

    def rank_pids(self) -> list[int]:
        """The rank processes this node runs (children of its instance processes)."""
        parents = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = []
        for parent in parents:
            pids += subprocess.run(["pgrep", "-P", parent, "-f", "spawn_main"], capture_output=True,
                                   text=True).stdout.split()
        return [int(p) for p in pids]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-8000:]

    def stop(self) -> None:
        stop_session(self.proc)
