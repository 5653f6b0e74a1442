"""Model loading: peak host RSS and wall time of loading a checkpoint, each loader in a fresh process.

    PYTHONPATH=. python benchmarks/load.py DIR [--loader stream host] [--dtype auto] [--device cpu]

Loaders (the child process imports only `glm53.models`, so `--loader host` also runs against an
older checkout: `PYTHONPATH=OLD_TREE python benchmarks/load.py DIR --loader host`):

- `stream`: `weights.load_model` — the stage built on the meta device, allocated on `--device`,
  each tensor read (this rank's slice) straight into its parameter there, one file open at a time;
  `--dtype auto` keeps a block-FP8 checkpoint's FP8 weights e4m3 (the rest in the checkpoint's
  dtype), an explicit dtype dequantizes them (`--dtype bfloat16`).
- `host`: the loader before it (`server/engine/worker.py` until 2026-12-02): the stage built in host
  memory in the model dtype (`auto`: the checkpoint's), `load_weights` into it (block-FP8
  dequantized), then `.to(device)`.

Each child prints one JSON line: peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, the whole
process: imports, the model on a CPU target, the safetensors pages mapped while read; /proc's
VmHWM beside it, which agrees here because the parent holds no weights), the RSS before loading
(after imports), wall time of the load alone, and the bytes of the parameters it built. The parent prints one table row per loader and the ratios of the first loader to the second.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _status_kib(key: str) -> int:
    """/proc/self/status `key` in KiB (VmRSS: now; VmHWM: this process image's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def child(model_dir: str, loader: str, dtype_name: str, device: str) -> None:
    import torch

    from glm53.models import GlmConfig

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = GlmConfig.from_dir(model_dir)
    name = cfg.torch_dtype if dtype_name == "auto" else dtype_name
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if loader == "stream":
        from glm53.models.weights import load_model

        model = load_model(model_dir, dtype=dtype, device=device, fp8=dtype_name == "auto", progress=False)
    else:
        from glm53.models import GlmForCausalLM, load_weights

        model = GlmForCausalLM(cfg, dtype=dtype)
        load_weights(model, model_dir, progress=False)
        model.to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    # KiB on Linux. ru_maxrss carries the parent's peak over exec; the parent here holds no weights.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm = _status_kib("VmHWM")
    params = list(model.parameters())
    fp8 = sum(p.numel() * p.element_size() for p in params if p.dtype == torch.float8_e4m3fn)
    print(json.dumps({
        "loader": loader, "dtype": dtype_name, "device": device, "wall_s": round(wall, 2),
        "peak_rss_gib": round(peak / 2**20, 3), "vm_hwm_gib": round(hwm / 2**20, 3),
        "rss_before_gib": round(before / 2**20, 3),
        "param_gib": round(sum(p.numel() * p.element_size() for p in params) / 2**30, 3),
        "fp8_param_gib": round(fp8 / 2**30, 3),
    }), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--loader", nargs="+", choices=["stream", "host"], default=["stream", "host"])
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="auto: the checkpoint's (block-FP8 kept FP8 by the stream loader); bfloat16: dequantized")
    ap.add_argument("--device", default="cpu", help="cpu, cuda:N, or meta (no parameter memory anywhere)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.model_dir, a.loader[0], a.dtype, a.device)
        return
    size = sum(os.path.getsize(os.path.join(a.model_dir, f)) for f in os.listdir(a.model_dir) if f.endswith(".safetensors"))
    print(f"{a.model_dir}: {size / 2**30:.2f} GiB of safetensors; device {a.device}, dtype {a.dtype}")
    rows = []
    for loader in a.loader:
        cmd = [sys.executable, os.path.abspath(__file__), a.model_dir, "--loader", loader, "--dtype", a.dtype,
               "--device", a.device, "--child"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{loader:>6}: peak RSS {row['peak_rss_gib']:.2f} GiB (before load {row['rss_before_gib']:.2f}), "
              f"load {row['wall_s']:.1f} s, parameters {row['param_gib']:.2f} GiB ({row['fp8_param_gib']:.2f} GiB e4m3)",
              flush=True)
    if len(rows) == 2:
        a0, a1 = rows
        print(f"{a0['loader']}/{a1['loader']}: peak RSS {a0['peak_rss_gib'] / a1['peak_rss_gib']:.2f}x, "
              f"RSS added by the load {(a0['peak_rss_gib'] - a0['rss_before_gib']) / max(1e-9, a1['peak_rss_gib'] - a1['rss_before_gib']):.2f}x, "
              f"time {a0['wall_s'] / a1['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
