"""Which compiled Triton/Gluon variants a serving instance can reach: pure functions of its shape.

Triton compiles a kernel once per *variant*: its constexpr arguments, its launch options
(num_warps, num_stages) and the specialization of its other arguments (an int equal to 1 or
divisible by 16, a pointer 16-byte aligned). The first launch of a new variant compiles or loads
a module, and that holds every stream of the process for as long as the work already queued
(~100 ms behind a prefill chunk on the H200, benchmarks/implicit_sync.py): in a colocated pair
every running request's next token waits. So no launch may pick its variant from a count that
varies at run time, except through a small set that start-up compiles (models/warmup.py):

- counts that only bound loops, masks or grids are not specialized (`do_not_specialize`): the
  indexer's logits width and page-table stride, MoE's row-block bound, the FP8 GEMM's and the
  quantizer's rows, sparse MLA's split count in the combine; an eager batch's page table is
  padded to a multiple of 16 columns (ModelRunner.build_batch), which fixes top-k's page-table
  stride class;
- the logits width (top-k's row length) is a multiple of LOGITS_ALIGN (`logits_width`), so its
  divisibility class never changes, and the 16-byte loads of top-k's scan stay vectorized;
- tile configs and plans picked from counts come from the launchers' own planning functions,
  which the `*_key` functions here call: a key is everything a count decides about a launch.

`reachable(shape)` enumerates, per kernel family, every key over every count a `ServeShape`
allows (tokens in one forward 1..max_tokens; widths 16..max_width in steps of 16), each with the
smallest (tokens, width) that reaches it; `warmup_shapes` turns them into the few forward shapes
the warm-up runs. The DFlash/DSpark draft's paged attention has its own bounds (`DraftShape`:
requests, block positions, context pages; `reachable_draft`): its loop counts and the mask and
table row strides are not specialized, so only the block (tiles, warps) and split-or-not pick
its variants. Families whose launches no count decides (norms, RoPE, routing, the indexer
logits, the absorbed query: its rows only bound the grid; the step's inputs, built inside the
decode graphs) have one key each: any forward (or graph capture) compiles them. (The q_a norm and
the cache-row stores take the fused q_a | kv_a | index-key product's split-K sum where it splits:
their parts count is that product's split, which `fp8_gemm_key` decides, so the forward that
compiles its key compiles theirs.) The W_UV product that writes o_proj's rows has a family of its
own (`uv_product_key`): its row tile and, where it combines sparse MLA's splits, their tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOGITS_ALIGN = 16  # the logits width is a multiple of this (top-k's row length and row stride)
TORCH_LADDER = 2  # warm-up also runs every power of this many tokens (cuBLAS picks kernels by M)


def logits_width(max_context: int) -> int:
    """The indexer logits' width for a batch whose longest context is `max_context` tokens:
    rounded up to LOGITS_ALIGN. Positions past each token's length are -inf, so the selection is
    the same; the kernels see one divisibility class of the width."""
    return -(-max(max_context, 1) // LOGITS_ALIGN) * LOGITS_ALIGN


def spec_class(v: int) -> str:
    """Triton's specialization of an int argument: '1', 'D' (divisible by 16) or ''."""
    return "1" if v == 1 else ("D" if v % 16 == 0 else "")


@dataclass(frozen=True)
class ServeShape:
    """What decides the reachable variants of one rank: counts' bounds, model dims on this rank,
    dtypes and the device."""

    max_tokens: int  # tokens one forward holds (prefill: the chunk budget; decode: rows x verify width)
    max_context: int  # the longest context, tokens
    num_sms: int
    heads: int  # attention heads on this rank
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_topk: int
    dtype: torch.dtype  # the model's activations
    n_experts: int = 0  # experts the fused MoE kernel's stacks hold on this rank (0: no MoE layer)
    experts_per_token: int = 1  # slots a token takes in it (the shared expert's included where stacked)
    expert_inter: int = 0  # an expert's width on this rank
    hidden: int = 0
    fp8_linear: bool = False  # block-FP8 linear layers
    v_head_dim: int = 0  # the attention's value head width (the W_UV product writes o_proj's rows where % 128 == 0)
    fp8_experts: bool = False  # block-FP8 routed experts
    router_experts: int = 0  # the router's experts where the FP8 experts' launch routes (`moe.MoE.forward`), else 0
    fp8_kv: bool = False  # the FP8 latent cache
    hopper: bool = False  # sm_90: the Gluon sparse-MLA kernel
    cublas_fp8: bool = False  # cuBLAS's blockwise FP8 GEMM is available

    @property
    def max_width(self) -> int:
        return logits_width(self.max_context)


# ---- per-family keys: everything a count decides about a launch ------------------------------


def topk_plan(B: int, L: int, k: int, sms: int) -> dict:
    """topk_triton.plan_topk's sizes for B rows of width L on `sms` SMs, without its buffers (the
    same formulas, on its constants; tests/kernels/test_variants.py checks them against
    plan_topk)."""
    import triton
    from triton import cdiv, next_power_of_2 as np2

    from glm53.kernels import topk_triton as tt

    blocks = cdiv(max(L, 1), tt.BLOCK)
    c = max(1, min(blocks, tt.MAX_CHUNKS, np2(cdiv(2 * sms, max(B, 1)))))
    chunk = cdiv(blocks, c) * tt.BLOCK
    C = cdiv(max(L, 1), chunk)
    CB = triton.next_power_of_2(C)
    cand = np2(max(tt._cand_tile(L, k, tt.row_sample(L), tt.MARGIN), CB))
    TA = max(2 * np2(k) // CB, 16)
    return dict(C=C, chunk=chunk, CB=CB, TA=TA, TC=cand // CB, CAPA=min(k, chunk), CAPG=min(cand, chunk),
                SCR=max(cand, CB * TA))


def topk_key(B: int, L: int, s: ServeShape) -> tuple:
    """DSA top-k over B rows of width L (topk_triton.run_topk's launches): the plan's constexprs
    and int classes, the finish split, the class of the width (= the row stride) and the bracket's
    sample tile (`row_sample`); or, for rows the one-launch rank kernel takes, the width's class.
    The page table's row stride is a multiple of 16 (ModelRunner.build_batch pads it; a graph's
    is fixed)."""
    from glm53.kernels.topk_triton import rank_takes, row_sample

    if rank_takes(B, L):  # one launch (`_rank_kernel`): the rows count only in its grid
        return ("rank", spec_class(L))
    p = topk_plan(B, L, s.index_topk, s.num_sms)
    return (p["CB"], p["TA"], p["TC"], p["CAPA"], p["CAPG"], p["SCR"], spec_class(p["C"]), spec_class(p["chunk"]),
            2 * B <= s.num_sms, spec_class(L), row_sample(L))


def sparse_mla_key(T: int, s: ServeShape) -> tuple:
    """Sparse MLA over T query tokens (index_topk slots each): kernel, slot block, split or not
    and the combine's split tile (sparse_mla_triton / _fp8_triton / _hopper launchers)."""
    import triton

    from glm53.kernels.sparse_mla_fp8_hopper import DEFAULT_BLOCK_N, fp8_hopper_shape_ok
    from glm53.kernels.sparse_mla_hopper import BLOCK_H as HOPPER_BLOCK_H, hopper_shape_ok
    from glm53.kernels.sparse_mla_triton import default_tiles, split_count

    R, H = s.kv_lora_rank, s.heads
    tl_block_h = default_tiles(H, R, s.qk_rope_head_dim, None, False)[2]  # the tl kernels' head tile
    if s.fp8_kv and s.hopper and fp8_hopper_shape_ok(s.dtype, R, R + s.qk_rope_head_dim):
        kernel, block_n, block_h = "fp8-hopper", DEFAULT_BLOCK_N, HOPPER_BLOCK_H
    elif s.fp8_kv:
        from glm53.kernels.sparse_mla_fp8_triton import default_block_n

        kernel, block_n, block_h = "fp8", default_block_n(T), tl_block_h
    elif s.hopper and hopper_shape_ok(s.dtype, H, R, R + s.qk_rope_head_dim):
        kernel, block_n, block_h = "hopper", 64, HOPPER_BLOCK_H
    else:
        kernel, block_n, block_h = "tl", 64, tl_block_h
    ns, _ = split_count(T, s.index_topk, triton.cdiv(H, block_h), block_n, s.num_sms, H * R * 4)
    return kernel, block_n, ns > 1, triton.next_power_of_2(ns) if ns > 1 else 0


def uv_product_key(T: int, s: ServeShape) -> tuple:
    """The absorbed attention's W_UV product where it writes o_proj's quantized rows (block-FP8
    linear layers, o_proj reading quantized two-term rows, v_head_dim a multiple of 128; models/
    model.py): its row tile and, where it combines sparse MLA's splits (`fp8_act.takes_splits`),
    their tile, and whether one token takes the row kernel (`fp8_act.takes_row`). () where the
    batched product runs instead."""
    from glm53.kernels.fp8_act import takes_row, takes_splits, uv_block_m, uv_writes_rows
    from glm53.kernels.fp8_gemm import fp8_variant

    if not (s.v_head_dim and uv_writes_rows(T, s.v_head_dim, s.fp8_linear and fp8_variant(T) != "w8a16")):
        return ()
    _, _, split, tile = sparse_mla_key(T, s)
    return uv_block_m(T), tile if split and takes_splits(T) else 0, takes_row(T)


def moe_key(N: int, s: ServeShape) -> tuple:
    """Routed experts over N tokens: the variant (FP8) and tile config from the token count
    (moe_triton.default_config / moe_fp8_triton.default_fp8_config, or the per-pair GEMVs'
    `moe_gemv_config` where `gemv_takes`), the x quantizer's row tile, and for the tile kernels
    whether their launch routes the router's scores with the plan (`route_triton.route_plan_takes`)."""
    if not s.n_experts:
        return ()
    pairs = N * s.experts_per_token
    if s.fp8_experts:
        from glm53.kernels.moe_fp8 import moe_fp8_variant
        from glm53.kernels.moe_fp8_gemv_triton import gemv_takes, moe_gemv_config
        from glm53.kernels.moe_fp8_triton import default_fp8_config

        variant = moe_fp8_variant(N, s.expert_inter)
        if variant == "w8a16" and gemv_takes(N, s.expert_inter):  # the per-pair GEMVs
            return variant, moe_gemv_config(pairs, s.expert_inter, s.hidden, s.num_sms), 0
        from glm53.kernels.route_triton import route_plan_takes

        quant = quant_block_m(N) if variant == "w8a8" else 0
        cfg = default_fp8_config(pairs, s.n_experts, variant, s.expert_inter, s.hidden, s.num_sms)
        # routed and planned in one launch, or the routing's and the plan's own
        return variant, cfg, quant, bool(s.router_experts) and route_plan_takes(N, s.router_experts)
    from glm53.kernels.moe_triton import default_config

    return ("bf16", default_config(pairs, s.n_experts, s.dtype))


def quant_block_m(M: int) -> int:
    """fp8_quant.quantize_fp8_groups_triton's row tile for M rows (on a GPU)."""
    import triton

    from glm53.kernels.fp8_quant import GROUP

    return max(1, min(4096 // triton.next_power_of_2(GROUP), triton.next_power_of_2(M)))


def fp8_gemm_key(M: int, s: ServeShape) -> tuple:
    """A block-FP8 linear over M rows: the variant (fp8_gemm.fp8_variant) and its tile config by
    M (fp8_gemm_triton.default_config; split-K depends on the weight alone at decode sizes)."""
    if not s.fp8_linear:
        return ()
    from glm53.kernels.fp8_gemm import CUBLAS_MIN_M, fp8_variant
    from glm53.kernels.fp8_gemm_triton import default_config

    variant = fp8_variant(M)
    if variant == "w8a8" and M >= CUBLAS_MIN_M and s.cublas_fp8:
        # cuBLAS where the weight allows it, the Triton w8a8 kernel (same class) where not
        variant = "cublas"
    cfg = default_config(M, 128, 128, a_fp8=variant != "w8a16", device=torch.device("cpu"))
    return variant, cfg, quant_block_m(M) if variant != "w8a16" else 0


TOKEN_FAMILIES: dict[str, Callable[[int, ServeShape], tuple]] = {
    "sparse_mla": sparse_mla_key,
    "moe": moe_key,
    "fp8_gemm": fp8_gemm_key,
    "uv_product": uv_product_key,
}
# Launches no count decides: one variant each, compiled by any forward.
FIXED_FAMILIES = ("indexer_logits", "rms_norm", "rope", "route", "quant_groups")


# ---- enumeration ------------------------------------------------------------------------------


def topk_row_classes(s: ServeShape) -> dict[tuple, int]:
    """The classes of top-k's row count B that its plan depends on (the chunks per row, the
    finish split, and, up to RANK_MAX_ROWS, B itself: the rank kernel's widest row depends on it),
    each with its smallest B."""
    import triton

    from glm53.kernels.topk_triton import MAX_CHUNKS, RANK_MAX_ROWS

    out: dict[tuple, int] = {}
    for B in range(1, s.max_tokens + 1):
        c = min(MAX_CHUNKS, triton.next_power_of_2(triton.cdiv(2 * s.num_sms, B)))
        out.setdefault((c, 2 * B <= s.num_sms, B if B <= RANK_MAX_ROWS else 0), B)
    return out


def topk_widths(s: ServeShape) -> list[int]:
    """Widths (multiples of LOGITS_ALIGN up to max_width) at which top-k's plan may change: its
    plan depends on the width through the blocks of the scan (`BLOCK`), the bracket's sample tile
    (`row_sample`: monotone, a step at each power of two and one at `SHORT_SAMPLE_MAX_WIDTH`) and
    the candidate tile (`_cand_tile`, monotone in the width at one sample tile), so each value of
    the pair (candidate tile, sample tile) holds over one range of widths: the ends of every
    block's range and both sides of each step of the pair, found by bisection, cover every plan;
    and both sides of the rank kernel's widest row at each row count it takes (`rank_takes`)."""
    from math import isqrt

    from glm53.kernels.topk_triton import (BLOCK, MARGIN, RANK_MAX_PAIRS, RANK_MAX_ROWS, RANK_MAX_WIDTH, _cand_tile,
                                           row_sample)

    def tile(L: int) -> tuple[int, int]:
        sample = row_sample(L)
        return _cand_tile(L, s.index_topk, sample, MARGIN), sample

    a, top = LOGITS_ALIGN, s.max_width
    pts = {a, top}
    lo = a
    while lo <= top:
        hi = min(top, (lo // BLOCK + 1) * BLOCK)  # the last width with lo's block count
        pts |= {lo, hi}
        while tile(lo) != tile(hi):  # bisect to the first width of each higher tile
            x, y = lo, hi
            while y - x > a:
                m = (x + y) // (2 * a) * a
                x, y = (m, y) if tile(m) == tile(lo) else (x, m)
            pts |= {x, y}
            lo = y
        lo = hi + a
    for b in range(1, RANK_MAX_ROWS + 1):
        widest = min(RANK_MAX_WIDTH, isqrt(RANK_MAX_PAIRS // b)) // a * a
        pts |= {w for w in (widest, widest + a) if a <= w <= top}
    return sorted(pts)


def reachable(s: ServeShape) -> dict[str, dict[tuple, tuple[int, int]]]:
    """Per family, every key the shape can reach, each with the smallest (tokens, width) that
    reaches it (width 0: any; the family does not depend on it)."""
    out: dict[str, dict[tuple, tuple[int, int]]] = {f: {(): (1, 0)} for f in FIXED_FAMILIES}
    for name, key in TOKEN_FAMILIES.items():
        keys: dict[tuple, tuple[int, int]] = {}
        for n in range(1, s.max_tokens + 1):
            keys.setdefault(key(n, s), (n, 0))
        out[name] = keys
    tk: dict[tuple, tuple[int, int]] = {}
    for B in sorted(topk_row_classes(s).values()):
        for L in topk_widths(s):
            k = topk_key(B, L, s)
            if k not in tk or (B, L) < tk[k]:
                tk[k] = (B, L)
    out["topk"] = tk
    return out


def shape_keys(N: int, L: int, s: ServeShape) -> dict[str, tuple]:
    """The key of every family that a forward of N tokens at logits width L launches."""
    keys = {f: () for f in FIXED_FAMILIES}
    keys.update({name: key(N, s) for name, key in TOKEN_FAMILIES.items()})
    keys["topk"] = topk_key(N, L, s)
    return keys


def warmup_shapes(s: ServeShape, want: dict[str, dict[tuple, tuple[int, int]]] | None = None) -> list[tuple[int, int]]:
    """Forward shapes (tokens, logits width) whose launches together reach every key of
    `reachable(s)` (`want`, if computed already): top-k's (rows, width) representatives, then
    one shape per token-family key none of those reached, then the powers of TORCH_LADDER tokens
    and max_tokens (torch's own kernels, cuBLAS's by M, load lazily on first use too)."""
    want = want if want is not None else reachable(s)
    shapes = sorted(set(want["topk"].values()))
    have = {name: {shape_keys(n, L, s)[name] for n, L in shapes} for name in TOKEN_FAMILIES}
    for name in TOKEN_FAMILIES:
        for k, (n, _) in sorted(want[name].items(), key=lambda kv: kv[1]):
            if k not in have[name]:
                shapes.append((n, min(s.max_width, logits_width(n))))
                for f in TOKEN_FAMILIES:
                    have[f].add(TOKEN_FAMILIES[f](n, s))
    n = 1
    while n < s.max_tokens:
        shapes.append((n, min(s.max_width, logits_width(n))))
        n *= TORCH_LADDER
    shapes.append((s.max_tokens, min(s.max_width, logits_width(s.max_tokens))))
    return sorted(set(shapes))


# ---- the DFlash / DSpark draft's paged attention -----------------------------------------------


@dataclass(frozen=True)
class DraftShape:
    """What decides the reachable draft-attention variants of a rank holding a DFlash or DSpark
    draft: its attention dims on this rank, the page size, the SMs and the counts' bounds."""

    max_rows: int  # requests in one drafting forward (the decode batch)
    max_block: int  # block positions (the draft's block size; an eager step may draft fewer, >= 2)
    max_pages: int  # context pages of the longest request
    kv_heads: int  # the draft's KV heads on this rank
    group: int  # query heads per KV head
    head_dim: int
    page_size: int
    num_sms: int


def draft_attention_key(R: int, B: int, W: int, d: DraftShape) -> tuple:
    """A drafting forward of R requests, blocks of B positions and W context pages
    (draft_attention_triton's launches): the tiles and warps (from the query rows G·B and the
    block), split or not (the combine runs only then), and the classes of the strides that stay
    specialized (the queries', block keys' and output's, multiples of head_dim that follow B).
    W, R and the split plan's counts only bound loops and grids (not specialized)."""
    from glm53.kernels.draft_attention_triton import launch_constants, split_plan

    m, hd, kv = d.group * B, d.head_dim, d.kv_heads
    c = launch_constants(m, hd, d.page_size, B)
    splits, _ = split_plan(R * kv, W, d.num_sms)
    strides = (kv * m * hd, m * hd, d.group * hd, B * kv * hd, kv * hd, hd)
    return tuple(sorted(c.items())), splits > 1, tuple(spec_class(x) for x in strides)


def reachable_draft(d: DraftShape) -> dict[tuple, tuple[int, int, int]]:
    """Every draft-attention key a drafting forward can reach, each with the smallest (R, B, W)
    reaching it. Blocks of 2 .. max_block (an eager step drafts the positions a request has left;
    a graph, its verify width); the split plan depends on W only through W > 1 (split_plan: one
    page never splits, more split whenever the requests' programs leave SMs idle), so W in {1, 2}."""
    out: dict[tuple, tuple[int, int, int]] = {}
    for B in range(2, d.max_block + 1):
        for R in range(1, d.max_rows + 1):
            for W in sorted({1, min(2, d.max_pages)}):
                out.setdefault(draft_attention_key(R, B, W, d), (R, B, W))
    return out


def count_variants(want: dict[str, dict[tuple, tuple[int, int]]]) -> int:
    """Keys over every family of a `reachable` result."""
    return sum(len(v) for v in want.values())
