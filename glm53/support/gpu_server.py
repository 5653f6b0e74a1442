"""A one-prefill, one-decode `glm53-serve up` deployment for the GPU benchmarks: its raw config
(`cluster_config`: on "cuda" both instances on GPU 0, memory shares set; on "cpu", to check a GPU
script here, 16-token pages) and `Server`, which starts it on free ports with its config and log
in a work directory, and stops it. Used by benchmarks/gpu_e2e.py, gpu_checks.py, gpu_pp.py and
prefix_cache.py. (tests' deployment of the embedded model on the CPU: glm53.support.cluster.)

The router needs fastapi, starlette, pydantic (+ pydantic_core, annotated-types,
typing-inspection) and uvicorn, which the device image lacks: carry them as wheels.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from glm53.support.ports import free_ports


def cluster_config(model: str, dtype: str, graphs: bool, ports: list[int], context: int, device: str = "cuda") -> dict:
    """One prefill and one decode instance; on "cuda" both on GPU 0 (one-GPU PD, memory shares
    set), on "cpu" (to check a GPU script here) 16-token pages."""
    http, result, p_port, p_boot, d_port = ports
    cpu = device == "cpu"
    eng = {"device": device, "dtype": dtype, "page_size": 16 if cpu else 64, **({} if cpu else {"devices": [0]})}
    p_share, d_share = ({}, {}) if cpu else ({"mem_fraction_static": 0.4}, {"mem_fraction_static": 0.45})
    return {
        "name": "gpu-e2e",
        "model": {"path": model, "served_model_name": ["m"], "context_length": context},
        "router": {"host": "127.0.0.1", "port": http, "result_port": result, "startup_timeout_s": 900},
        "transfer": {"backend": "nixl", "bootstrap_timeout_s": 60, "transfer_timeout_s": 120},
        "defaults": {"device": device, "dtype": dtype, "page_size": eng["page_size"]},
        "prefill": [{**eng, "name": "p0", "host": "127.0.0.1", "port": p_port, "bootstrap_port": p_boot,
                     **p_share, "max_running_requests": 16, "chunked_prefill_size": 16384}],
        "decode": [{**eng, "name": "d0", "host": "127.0.0.1", "port": d_port, **d_share,
                    "max_running_requests": 64, "disable_cuda_graph": not graphs, "cuda_graph_max_bs": 64}],
    }


class Server:
    def __init__(self, cfg: dict, workdir: Path, tag: str):
        self.cfg = cfg
        http, result, p_port, p_boot, d_port = free_ports(5)
        cfg["router"].update(port=http, result_port=result)
        cfg["prefill"][0].update(port=p_port, bootstrap_port=p_boot)
        cfg["decode"][0].update(port=d_port)
        self.path = workdir / f"{tag}.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{http}"
        self.log = open(workdir / f"{tag}.log", "w+")
        self.proc = None

    def __enter__(self) -> "Server":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "glm53.server.cli", "up", "--config", str(self.path)],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        while time.monotonic() - t0 < 900:
            line = self.proc.stdout.readline()
            if "ready" in line:
                self.startup_s = time.monotonic() - t0
                print(f"  up in {self.startup_s:.0f} s", flush=True)
                return self
            if not line and self.proc.poll() is not None:
                break
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read()[-6000:]
        self.__exit__()
        raise RuntimeError(f"server did not become ready:\n{tail}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()
