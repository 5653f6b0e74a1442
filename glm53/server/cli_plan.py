"""`glm53-serve plan`: the memory plan (server/plan.py) of one layout given by flags, or of every
GPU instance of a config, printed for a person, with one JSON object as the last line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from glm53.models.config import ConfigError as ModelConfigError
from glm53.server.config import ConfigError
from glm53.server.plan import GB, H200_BYTES, Layout, gpu_bytes_here, plan_cluster, plan_instance, render


def cmd_plan(args: argparse.Namespace, resolve: Callable[..., Any]) -> int:
    """`plan`: with --config, every GPU instance of the YAML (flags override it as for `up`;
    `resolve` is the CLI's, which applies them), else one instance of the --model with the flags'
    layout. The last line is one JSON object; exit 0 when everything fits, 1 otherwise (after one
    sentence naming the numbers)."""
    gpu = int(args.gpu_memory_gb * GB) if args.gpu_memory_gb else None
    if args.config:
        res = resolve(args, check_fit=False, check_tokenizer=False)
        plans = plan_cluster(res.cfg, res.model_dir, gpu)
        if not plans:
            raise ConfigError(res.cfg.source, "defaults.device", "no instance runs on a GPU: nothing to plan")
        for key, plan in plans.items():
            print(f"{key}:")
            print("\n".join("  " + line for line in plan.lines()))
        summary = {"fits": all(p.fits for p in plans.values()),
                   "weight_bytes_per_gpu": max(p.weight_bytes_per_gpu for p in plans.values()),
                   "kv_bytes_per_token": max(p.kv_bytes_per_token for p in plans.values()),
                   "max_kv_tokens": min(p.max_kv_tokens for p in plans.values()),
                   "instances": {k: p.summary() for k, p in plans.items()}}
        bad = [f"{k}: {p.reason()}" for k, p in plans.items() if not p.fits]
        if bad:
            print(f"glm53-serve plan: does not fit: {'; '.join(bad)}", file=sys.stderr)
        print(json.dumps(summary))
        return 0 if summary["fits"] else 1
    if not args.model:
        raise ConfigError("<command line>", "--model", "plan needs --model DIR (a directory with config.json) or --config")
    get = lambda k, d: getattr(args, k, None) if getattr(args, k, None) is not None else d  # noqa: E731
    lay = Layout(tp=get("tp", 1), pp=get("pp", 1), ep=get("ep", 1), dtype=get("dtype", "auto"), kv_cache_dtype=get("kv_cache_dtype", "auto"),
                 gpu_bytes=gpu or gpu_bytes_here() or H200_BYTES, mem_fraction_static=get("mem_fraction_static", 0.85),
                 context_length=get("context_length", None), chunked_prefill_size=get("chunked_prefill_size", 8192),
                 max_running_requests=get("max_running_requests", 64),
                 draft_path=get("speculative_draft_model_path", None),
                 nextn=get("speculative_algorithm", "NONE") in ("NEXTN", "EAGLE"))
    try:
        plan = plan_instance(Path(args.model).expanduser(), lay)
    except ModelConfigError as e:  # a tp that does not split the model, a missing config.json
        key = "--tp" if "tensor_parallel_size" in str(e) else "--model"
        raise ConfigError("<command line>", key, f"{args.model}: {e}") from None
    print(render(plan))
    if not plan.fits:
        print(f"glm53-serve plan: does not fit: {plan.reason()}", file=sys.stderr)
    return 0 if plan.fits else 1
