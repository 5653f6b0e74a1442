"""`glm53-serve` start-up faults that must be one line, not a traceback (issue 32): a CUDA config
on a host without CUDA, a pinned port another process holds, `generate` with an embedded model
name (accepted, as `up` accepts it) and with a path that is no model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], cache: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm53.server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "GLM53_CACHE": str(cache)})


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_config_without_cuda_is_a_config_error(tmp_path, model_dir, glm53_cache):
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir)}, "router": {"port": 0},
        "defaults": {"device": "cuda", "dtype": "bfloat16"},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "devices": [0]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "devices": [1]}]}))
    r = run(["up", "--config", str(cfg)], glm53_cache)
    line = one_line(r)
    assert r.returncode == 2 and "ready" not in r.stdout
    assert line.startswith(f"glm53-serve: config error: {cfg}: defaults.device: 'cuda'") and "CUDA" in line


def test_pinned_port_in_use_is_refused_before_anything_starts(tmp_path, model_dir, glm53_cache):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        cfg = tmp_path / "pinned.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": {"path": str(model_dir)}, "router": {"port": 0},
            "prefill": [{"name": "p0", "host": "127.0.0.1", "port": port}],
            "decode": [{"name": "d0", "host": "127.0.0.1"}]}))
        r = run(["up", "--config", str(cfg)], glm53_cache)
    line = one_line(r)
    assert r.returncode == 1 and "ready" not in r.stdout
    assert line == f"glm53-serve: cannot start: {cfg}: prefill[0].port: 127.0.0.1:{port} is already in use (another server?)"


def generate(capsys, *args: str) -> tuple[int, str, str]:
    """`glm53-serve generate` in this process (torch is loaded already: a second instead of ten)."""
    from glm53.server.cli import main

    rc = main(["generate", "--input-ids", "1,2,3", "--max-new-tokens", "4", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_takes_the_embedded_name(capsys, monkeypatch, glm53_cache):
    monkeypatch.setenv("GLM53_CACHE", str(glm53_cache))
    rc, out, err = generate(capsys, "--model", "embedded:tiny-glm5")
    assert rc == 0, err
    row = json.loads(out)
    assert row["input_ids"] == [1, 2, 3] and len(row["output_ids"]) == 4


def test_generate_with_a_bad_model_path_is_one_line(capsys, tmp_path, model_dir):
    rc, out, err = generate(capsys, "--model", str(tmp_path / "nope"))
    assert rc == 2 and out == ""
    assert err.strip() == f"error: --model {tmp_path / 'nope'}: model path '{tmp_path / 'nope'}' is not a model " \
        "directory (no config.json)"
    # a config.json without weights
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text((model_dir / "config.json").read_text())
    rc, out, err = generate(capsys, "--model", str(tmp_path / "weightless"))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --model {tmp_path / 'weightless'}: ") and "safetensors" in err


def test_the_router_entry_loads_no_torch():
    """`glm53-serve router` runs through this CLI module into the router app; neither may import
    torch (the memory plan `up` runs does, lazily): the router never touches a tensor, and torch
    would add ~240 MB to its RSS and ~1 s to its start-up (a regression once: plan imported at
    the CLI's top)."""
    code = "import sys, glm53.server.cli, glm53.server.router.app; sys.exit('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "the router's entry imports torch\n" + r.stderr[-2000:]
