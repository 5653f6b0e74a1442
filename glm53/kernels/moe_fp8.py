"""Routed experts over block-FP8 weights (GLM-5-FP8: e4m3 with fp32 scales per 128×128 block).

`moe_experts_fp8` dispatches by `dispatch.use_triton`: on CPU the torch reference
(`moe_experts_fp8_reference`: the experts a batch hits dequantized in fp32, then `moe.py`'s
per-expert loop in fp32; what CPU serving runs), on a GPU the fused kernels of `moe_fp8_triton.py`
on the bf16 kernel's routing plan, in one of two variants by one rule on the token count N and
the experts' width I on this rank:

    N <= MOE_GEMV_MAX_TOKENS and I <= MOE_GEMV_MAX_INTER  ->  "w8a16" as per-pair GEMVs
                                                          (`moe_fp8_gemv_triton`)
    N <= MOE_W8A16_MAX_TOKENS                             ->  "w8a16": weights dequantized in the
                                                              kernel against x as is
    otherwise                                             ->  "w8a8": x and h quantized per 1×128
                                                              group, FP8 × FP8 products

The thresholds are module state read at every call (benchmarks/fp8_gemm.py measures the variants
at decode sizes, prints the crossover, and can set MOE_W8A16_MAX_TOKENS; its `moe_gemv` section
times the GEMVs); measured, the tile kernels' w8a16 never wins (0), the GEMVs do on narrow experts.
Weight layouts (separate gate/up, or one fused gate_up with `up=None`) as in `moe_fp8_triton`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.fp8_act import Fp8Rows
from glm53.kernels.fp8_quant import dequantize_fp8_blocks
from glm53.kernels.moe import moe_experts_reference
from glm53.kernels.row_parts import RowParts

if TYPE_CHECKING:
    from glm53.kernels.route_triton import RouterLogits

# Tokens up to which the w8a16 variant runs; above it, w8a8: none, w8a8 at every size. On the H200
# (2026-12-03, `.probe` in the history) w8a8 took 68.0 / 116.1 / 342.5 µs against w8a16's 81.6 /
# 146.2 / 434.4 at GLM-5's tp = 8 experts for N = 1 / 8 / 64, and 111.1 / 242.8 against 141.2 /
# 440.3 on the slice's (16 experts of 2048) at N = 1 / 64. Rounding x and h at decode costs no
# greedy agreement that 1,024 decode positions can see (the trained tiny target, CPU emulation:
# 99.41 % against 98.83 % with w8a16 experts at decode, fp32), as SGLang and vLLM serve these
# checkpoints. (The GPU check of w8a8 against its emulation holds at the bf16 tolerance: the
# tensor cores' accumulation moves some h elements across an e4m3 step; tests/kernels/fp8_cases.)
MOE_W8A16_MAX_TOKENS = 0


def moe_fp8_variant(n_tokens: int, inter: int = 0) -> str:
    """The dispatcher's rule: "w8a16" where the per-pair GEMVs take the call
    (`moe_fp8_gemv_triton.gemv_takes`: a few tokens on experts `inter` wide) or for n_tokens <=
    MOE_W8A16_MAX_TOKENS, else "w8a8"."""
    from glm53.kernels.moe_fp8_gemv_triton import gemv_takes

    if gemv_takes(n_tokens, inter):
        return "w8a16"
    return "w8a16" if n_tokens <= MOE_W8A16_MAX_TOKENS else "w8a8"


def moe_experts_fp8_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    gate_scale: torch.Tensor,
    up: torch.Tensor | None,
    up_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor,
) -> torch.Tensor:
    """The experts hit dequantized in fp32 (only those: a host sync, as the loop has anyway), then
    `moe_experts_reference` in fp32 on x in fp32; returns [N, H] in x's dtype."""
    hit = torch.unique(ids)
    remap = torch.full((gate.shape[0],), -1, dtype=torch.long, device=ids.device)
    remap[hit] = torch.arange(hit.numel(), device=ids.device)
    g = dequantize_fp8_blocks(gate[hit], gate_scale[hit])
    if up is None:  # fused [E, 2I, H]: dequantized whole (the scale grid spans both halves)
        I = gate.shape[1] // 2
        g, u = g[:, :I], g[:, I:]
    else:
        u = dequantize_fp8_blocks(up[hit], up_scale[hit])
    d = dequantize_fp8_blocks(down[hit], down_scale[hit])
    out = moe_experts_reference(x.float(), weights.float(), remap[ids.long()], g, u, d)
    return out.to(x.dtype)


def moe_experts_fp8(
    x: torch.Tensor,
    weights: torch.Tensor | RouterLogits,
    ids: torch.Tensor | None,
    gate: torch.Tensor,
    gate_scale: torch.Tensor,
    up: torch.Tensor | None,
    up_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    x_rows: Fp8Rows | None = None,
    keep_parts: bool = False,
) -> torch.Tensor | RowParts:
    """Routed experts over block-FP8 weights, summed over each token's k experts with its routing
    weights: x [N, H]; weights/ids [N, k]; gate/up [E, I, H] e4m3 + scales [E, ceil(I/128),
    ceil(H/128)] (or gate = fused [E, 2I, H] with up = up_scale = None); down [E, H, I] + scales
    [E, ceil(H/128), ceil(I/128)]. Returns [N, H] in x's dtype. `x_rows`: x as the norm before it
    quantized it (`fp8_act`), read instead of quantizing x again where the variant is w8a8.
    `keep_parts`: the tile kernels may return the slots' sum not taken yet (`row_parts`). `weights`
    may be the router's scores not routed yet (`route_triton.RouterLogits`, `ids` None; the Triton
    launcher routes them, with the plan where its tile kernels run)."""
    assert use_triton(x) or isinstance(weights, torch.Tensor), "router scores are routed by the Triton launcher only"
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    if use_triton(x):
        from glm53.kernels.moe_fp8_triton import moe_experts_fp8_triton

        variant = moe_fp8_variant(x.shape[0], down.shape[2])
        if x_rows is None or variant != "w8a8":
            return moe_experts_fp8_triton(*args, variant=variant, keep_parts=keep_parts)
        return moe_experts_fp8_triton(*args, variant=variant, x_fp8=x_rows.rows(), x_lo=x_rows.lo_rows(),
                                      keep_parts=keep_parts)
    return moe_experts_fp8_reference(*args)
