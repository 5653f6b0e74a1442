"""The HBM floor of a decode step: the device copy bandwidth, measured now (`copy_bandwidth`), and
the bytes a decode step must read at a batch size and context (`step_bytes`: the weights it
touches + the KV its attention reads). Used by benchmarks/gpu_e2e.py and benchmarks/shared_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import torch


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Device copy bandwidth, bytes read + written per second (a 2 GiB copy)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (s.elapsed_time(e) / 1e3)


def step_bytes(model_dir: Path, bs: int, ctx: int, fp8: bool = False) -> dict:
    """Bytes a decode step of `bs` requests at context `ctx` must read: every weight except the
    routed experts and the embedding, the routed experts a batch hits (expected distinct experts
    under uniform routing, which random weights give), `bs` embedding rows; per request and layer
    the top-k latent rows sparse MLA reads, and on full layers every indexer key. `fp8`: the
    checkpoint's block-FP8 weights counted as held, one byte each plus their fp32 scales."""
    from glm53.models import GlmConfig
    from glm53.models.model import GlmForCausalLM
    from glm53.models.weights import checkpoint_files, fp8_param_names

    cfg = GlmConfig.from_dir(model_dir)
    names = fp8_param_names(cfg, checkpoint_files(Path(model_dir))) if fp8 else frozenset()
    with torch.device("meta"):
        m = GlmForCausalLM(cfg, dtype=torch.bfloat16, fp8=names)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** bs) if e else 0
    w = 0.0
    for name, p in m.named_parameters():
        n = p.numel() * p.element_size()
        if ".experts." in name:
            w += n * hit / e
        elif "embed_tokens" in name:
            w += bs * p.shape[1] * p.element_size()
        else:
            w += n
    per_req = cfg.num_hidden_layers * min(ctx, cfg.index_topk) * cfg.latent_dim * 2
    per_req += len(cfg.full_layers) * ctx * cfg.index_head_dim * 2
    return {"weights": w, "kv": bs * per_req, "total": w + bs * per_req}
