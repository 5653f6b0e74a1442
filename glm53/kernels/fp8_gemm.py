"""Block-FP8 linear layer: y = x @ dequant(W)^T, W [N, K] e4m3 with fp32 scales per 128×128 block
(DESIGN §4.8; the format in `fp8_quant`).

`fp8_gemm` dispatches by `dispatch.use_triton`: on CPU the torch reference (`fp8_gemm_reference`:
W dequantized in fp32, an fp32 matmul; exact up to fp32 rounding, and what CPU serving runs); on a
GPU by the rows M = x.numel() / K (`fp8_variant`):

    M <= W8A16_MAX_M   ->  w8a16: the FP8 weights dequantized in the kernel against x as is
    M >= CUBLAS_MIN_M  ->  cublas: x quantized per 1×128 group, cuBLAS's blockwise-scaled FP8
                           GEMM (`fp8_gemm_cublas.py`), where the GPU and the shape allow it
    otherwise          ->  w8a8: x quantized per 1×128 group, the block-scaled Triton FP8 GEMM
                           (at decode sizes with a second e4m3 term, `fp8_act.two_terms`)

Decode reads the weights and little else, so the variant that wastes no launch and no rounding
on the activations should win there, and the FP8 tensor cores (twice the bf16 rate) win once the
product is compute-bound. An input a producer already quantized (`fp8_act.Fp8Rows`: RMSNorm or SwiGLU wrote the e4m3
codes in its own pass) goes to `fp8_gemm_rows`, which runs the w8a8 or cuBLAS variant on it.
`W8A16_MAX_M` is that crossover: module state read at every call, so
`benchmarks/fp8_gemm.py` can set it and prints the value it measured (both variants at M = 1..64,
per GLM-5 tp = 8 shape); the default below is a guess until that run.
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import triton_interpreting, use_triton
from glm53.kernels.fp8_act import Fp8Rows
from glm53.kernels.fp8_quant import dequantize_fp8_blocks
from glm53.kernels.row_parts import RowParts

# Rows up to which the w8a16 (dequantize-in-kernel) variant runs; above it, w8a8: none, w8a8 at
# every size. Measured on the H200 (benchmarks/fp8_gemm.py): GLM-5's tp = 8 shapes summed within
# 5 % of each other up to M = 16, w8a16 10 % faster at M = 32, w8a8 7 % faster at M = 64
# (2026-12-02); the slice's one-GPU products (17-101 MB each, `--decode-table slice`), w8a8
# 1.28 / 1.42 / 1.41x faster at M = 1 / 4 / 16, on every shape (2026-12-03): widening e4m3 to
# bf16 in registers costs more than the activation's 1x128 quantization, which the producers
# (norms, SwiGLU) then do in their own pass. Rounding the activations at decode costs greedy
# agreement on the tiny model (benchmarks/RESULTS.md); SGLang and vLLM serve these checkpoints so.
# (f16 products in the w8a16 kernel, each row's K step scaled into f16 by a power of two, were
# tried on 2026-12-04 and backed out: the slice's decode step ran 1,078.9 / 1,573.1 / 2,857.2 µs
# of kernels at batch 1 / 16 / 64 with w8a16 linears against 963.2 / 1,549.5 / 2,050.6.)
W8A16_MAX_M = 0
# Rows from which cuBLAS's blockwise FP8 GEMM runs (quantization included), where it can. Measured
# on the H200 (2026-12-02, GLM-5 tp = 8 shapes summed): 216 µs against the Triton w8a8's 267 at
# M = 128, 215 against 187 at M = 64.
CUBLAS_MIN_M = 128


def fp8_gemm_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] float; w [N, K] e4m3; w_scale [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in
    out_dtype (default x's dtype): x in fp32 times W dequantized in fp32."""
    y = torch.matmul(x.float(), dequantize_fp8_blocks(w, w_scale).t())
    return y.to(out_dtype or x.dtype)


def fp8_variant(m: int, n: int | None = None, k: int | None = None, device: torch.device | None = None) -> str:
    """The dispatcher's rule: "w8a16" for m <= W8A16_MAX_M rows; "cublas" from CUBLAS_MIN_M rows
    when the weight [n, k] and the GPU `device` allow it; else "w8a8"."""
    if m <= W8A16_MAX_M:
        return "w8a16"
    if m >= CUBLAS_MIN_M and n is not None and k is not None and device is not None and device.type == "cuda":
        from glm53.kernels import fp8_gemm_cublas

        index = device.index if device.index is not None else torch.cuda.current_device()
        if fp8_gemm_cublas.supports(n, k) and fp8_gemm_cublas.available(index):
            return "cublas"
    return "w8a8"


def takes_fp8_rows(m: int, n: int, k: int, device: torch.device, fp8: bool) -> bool:
    """Whether a product of m rows with a [n, k] weight (block-FP8 when `fp8`) on `device` reads
    its input quantized: w8a8 and cuBLAS do (`fp8_variant`), w8a16 (decode sizes), bf16
    weights and the CPU reference do not."""
    if not fp8 or m == 0 or not (device.type == "cuda" or triton_interpreting()):
        return False
    return fp8_variant(m, n, k, device) != "w8a16"


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ dequant(w, w_scale)^T; shapes as `fp8_gemm_reference`. Triton where
    `dispatch.use_triton` says so (variant by `fp8_variant`), else the reference."""
    if not use_triton(x):
        return fp8_gemm_reference(x, w, w_scale, out_dtype)
    from glm53.kernels.fp8_gemm_triton import fp8_gemm_w8a8, fp8_gemm_w8a16

    m = x.numel() // max(1, x.shape[-1])
    variant = fp8_variant(m, w.shape[0], w.shape[1], x.device)
    if variant == "w8a16":
        return fp8_gemm_w8a16(x, w, w_scale, out_dtype)
    if variant == "cublas":
        from glm53.kernels.fp8_gemm_cublas import fp8_gemm_cublas

        return fp8_gemm_cublas(x, w, w_scale, out_dtype)
    return fp8_gemm_w8a8(x, w, w_scale, out_dtype)


def fp8_gemm_rows(x: Fp8Rows, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
                  keep_parts: bool = False) -> torch.Tensor | RowParts:
    """y [m, N] = rows @ dequant(w, w_scale)^T for rows a producer quantized (`fp8_act`; both terms
    where it wrote two, which only the Triton GEMM reads): cuBLAS or the Triton w8a8 GEMM by
    `fp8_variant` (never w8a16: `takes_fp8_rows` quantizes only for the other two); off the GPU,
    the dequantized rows times the dequantized weight. `keep_parts`: a split-K product may return
    its sum not taken yet (`row_parts`), for a norm that adds it."""
    out_dtype = out_dtype or x.dtype
    q, s = x.rows()
    if not use_triton(q):
        return fp8_gemm_reference(x.dequantize(), w, w_scale, out_dtype)
    variant = fp8_variant(x.m, w.shape[0], w.shape[1], x.device)
    assert variant != "w8a16", f"{x.m} rows are multiplied w8a16: the producer should not have quantized them"
    if variant == "cublas":
        from glm53.kernels.fp8_gemm_cublas import scaled_mm

        assert x.q_lo is None, f"{x.m} rows in two terms reach cuBLAS: fp8_act.TWO_TERM_MAX_M must stay below {CUBLAS_MIN_M}"
        return scaled_mm(x.q, x.scale, w, w_scale, out_dtype)[: x.m]
    from glm53.kernels.fp8_gemm_triton import fp8_gemm_w8a8_quantized

    return fp8_gemm_w8a8_quantized(q, s, w, w_scale, out_dtype, lo=x.lo_rows(), keep_parts=keep_parts)
