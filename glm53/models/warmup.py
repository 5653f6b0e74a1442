"""Start-up warm-up: compile and load every Triton variant a rank can reach before it serves.

A first launch of a new Triton variant (or of a torch kernel under lazy module loading) holds
every stream of the process; in a colocated pair that stalls decode behind a queued prefill
chunk (kernels/variants.py). So before the instance reports ready, each rank runs its model on
the few forward shapes `variants.warmup_shapes` lists (tokens x logits width), eagerly (never
through a CUDA graph): together they launch every key `variants.reachable` enumerates for the
rank's `ServeShape`, prefill sizes and decode/verify sizes alike, with the FP8 paths where the
model and cache use them. Each shape is a batch of synthetic requests on pages 0.. of the pools
(nothing is cached or transferred yet at start-up, so their contents do not matter).

A rank holding a DFlash or DSpark draft then runs one drafting forward per draft-attention key
`variants.reachable_draft` lists (synthetic blocks over pages 0..: the drafting forward only
reads the draft pool), and one with the MTP draft runs top-k unpaged on every top-k key too (its
catch-up selects over positions from ctx_start, models/model.py `_topk_from`, when prefill sent
no MTP KV). CUDA graph capture (models/graph.py) counts as warm-up as well.

Afterwards `compile_watch.WATCH` stays installed: any later compile is logged as a warning.
On CPU the kernels are the torch references: nothing to compile, and the warm-up says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from glm53.kernels import variants
from glm53.kernels.compile_watch import WATCH
from glm53.kernels.topk import dsa_topk
from glm53.models.draft import DraftBlock
from glm53.models.kv_cache import LATENT
from glm53.models.model import StageInput
from glm53.models.runner import ModelRunner, SeqChunk

log = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    variants: int  # keys enumerated over every family
    shapes: int  # forwards run
    compiled: int  # Triton compiles or loads during the warm-up
    seconds: float


def serve_shape(runner: ModelRunner, max_tokens: int, max_context: int) -> variants.ServeShape:
    """The rank's `ServeShape`: its model dims, dtypes and device, and the counts' bounds."""
    cfg, model, dev = runner.cfg, runner.model, runner.device
    attn = next((layer.self_attn for layer in model.model.layers.values()), None)
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    e = experts[0] if experts else None
    # the fused kernel's stacks and slots: the shared expert among them where it was absorbed
    n_experts = e.kernel_experts if e is not None else 0
    slots = cfg.num_experts_per_tok + (e.shared_id is not None) if n_experts else 1
    fp8_linear = any(getattr(m, "weight_scale_inv", None) is not None for m in model.modules()
                     if type(m).__name__ not in ("Experts",))
    fp8_experts = e is not None and e.gate_proj.dtype == torch.float8_e4m3fn
    cublas = False
    if dev.type == "cuda" and fp8_linear:
        from glm53.kernels import fp8_gemm_cublas

        cublas = fp8_gemm_cublas.available(dev.index if dev.index is not None else torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
    latent = runner.pools.view(LATENT, model.layer_range.start) if attn is not None else None
    return variants.ServeShape(
        max_tokens=max_tokens, max_context=max_context, num_sms=props.multi_processor_count if props else 4,
        heads=attn.n_heads if attn is not None else cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, index_topk=cfg.index_topk, dtype=model.dtype,
        n_experts=n_experts, experts_per_token=slots, expert_inter=e.gate_proj.shape[1] if n_experts else 0,
        hidden=cfg.hidden_size,
        fp8_linear=fp8_linear, v_head_dim=cfg.v_head_dim, fp8_experts=fp8_experts,
        fp8_kv=latent is not None and latent.dtype == torch.uint8,
        router_experts=cfg.n_routed_experts if fp8_experts and e.placement.ep == 1 and cfg.n_group <= 1 else 0,
        hopper=props is not None and props.major == 9, cublas_fp8=cublas)


def draft_shape(runner: ModelRunner, max_rows: int, max_context: int) -> variants.DraftShape | None:
    """The rank's `DraftShape` (None without a DFlash/DSpark draft): `max_rows` requests a drafting
    forward holds, contexts up to `max_context` tokens."""
    draft = runner.draft
    if draft is None:
        return None
    attn = draft.layers[0].self_attn
    dev = runner.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return variants.DraftShape(max_rows=max_rows, max_block=draft.cfg.block_size,
                               max_pages=-(-max_context // runner.page_size), kv_heads=attn.n_kv,
                               group=attn.n_heads // attn.n_kv, head_dim=draft.cfg.head_dim,
                               page_size=runner.page_size, num_sms=sms)


def synthetic_blocks(R: int, B: int, W: int, page_size: int) -> list[DraftBlock]:
    """R requests drafting blocks of B positions over W context pages (pages 0 .. W − 1)."""
    return [DraftBlock(last_token=1, start_pos=W * page_size, page_table=list(range(W)), block_size=B)
            for _ in range(R)]


def synthetic_chunks(n_tokens: int, width: int, max_context: int, page_size: int, vocab: int,
                     gen: torch.Generator) -> list[SeqChunk]:
    """A batch of n_tokens whose longest context makes the logits `width` wide: requests of at
    most min(width, max_context) tokens of context each, ending there, all on pages 0.. ."""
    ctx = min(width, max_context)
    pages = list(range(-(-ctx // page_size)))
    chunks, left = [], n_tokens
    while left:
        n = min(left, ctx)
        ids = torch.randint(1, vocab, (n,), generator=gen).tolist()
        chunks.append(SeqChunk(ids, ctx - n, pages))
        left -= n
    return chunks


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_tokens: int, max_context: int, force: bool = False) -> WarmupReport | None:
    """Run the rank's warm-up shapes (module docstring); None on CPU unless `force` (tests: the
    shapes run through the model there too). Every rank of a stage runs the same shapes in the
    same order (their collectives pair up)."""
    if runner.device.type != "cuda" and not force:
        log.info("warm-up: CPU serving runs the torch references, nothing to compile")
        return None
    WATCH.install()
    t0 = time.perf_counter()
    shape = serve_shape(runner, max_tokens, max_context)
    want = variants.reachable(shape)
    count = variants.count_variants(want)
    shapes = variants.warmup_shapes(shape, want)
    drafts = []  # (requests, block, pages) per draft-attention key
    if runner.draft is not None and runner.model.is_first and runner.model.is_last:
        # a decode rank's max_tokens is its requests times the draft's block (engine/worker.py)
        dshape = draft_shape(runner, max(1, max_tokens // runner.draft.cfg.block_size), max_context)
        drafts = sorted(variants.reachable_draft(dshape).values())
    unpaged = sorted(want["topk"].values()) if runner.mtp is not None and runner.model.is_last else []
    count += len(drafts) + len(unpaged)
    before = WATCH.count(warming=True)
    model, cfg = runner.model, runner.cfg
    gen = torch.Generator().manual_seed(0)
    with WATCH.warming():
        for n, width in shapes:
            chunks = synthetic_chunks(n, width, max_context, runner.page_size, cfg.vocab_size, gen)
            inputs = None
            if not model.is_first:
                dev = runner.device
                inputs = StageInput(torch.randn(n, cfg.hidden_size, device=dev).to(model.dtype),
                                    torch.full((n, cfg.index_topk), -1, dtype=torch.int32, device=dev),
                                    torch.zeros(n, cfg.hidden_size, dtype=torch.float32, device=dev)
                                    if runner.upstream_ids else None)
            out = runner.forward_stage(chunks, inputs)
            if model.is_last:  # the sampled rows' logits, as serving computes them
                rows = runner._device_rows(runner.logit_rows(chunks))
                model.head(model.normed_hidden(out, rows))
        for r, b, w in drafts:
            runner.draft_block(synthetic_blocks(r, b, w, runner.page_size))
        for b, width in unpaged:
            dsa_topk(torch.randn(b, width, device=runner.device),
                     torch.full((b,), width, dtype=torch.int32, device=runner.device), cfg.index_topk)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    report = WarmupReport(count, len(shapes) + len(drafts) + len(unpaged), WATCH.count(warming=True) - before,
                          time.perf_counter() - t0)
    log.info("warm-up: %d kernel variants reachable (tokens <= %d, context <= %d) launched by %d forwards in "
             "%.1f s (%d Triton compiles or loads)", report.variants, max_tokens, max_context, report.shapes,
             report.seconds, report.compiled)
    return report
