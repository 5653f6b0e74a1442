"""Block-FP8 GEMM through cuBLAS's blockwise-scaled FP8 matmul (`torch._scaled_mm` with 1×128
activation scales and 128×128 weight scales: DeepSeek-V3's recipe, cuBLAS ≥ 12.9 on sm90+).

The prefill path: on the H200 at M = 4096 it runs GLM-5's tp = 8 projections at 1.40-1.51× the
bf16 matmul (the Triton w8a8 kernel: 0.93-0.97×), and from M = 128 it beats the Triton w8a8
kernel with the activation quantization included (benchmarks/fp8_gemm.py, RESULTS "Kernels").

What cuBLAS takes, measured on the H200 (torch 2.11, CUDA 13): N a multiple of 16, ceil(K/128)
a multiple of 4 (K = 256, 384, 640, 1152 are refused), and M a multiple of 8 (129 and 130 are
refused). `supports` states the N and K rule; M is padded here to a multiple of 16: the quantizer
writes the real rows into a padded buffer (the pad rows' products are computed and dropped, one
row never mixes with another). Activation scales are written column-major, as cuBLAS reads them;
the weight scales [ceil(N/128), ceil(K/128)] transposed are already the layout it wants.
"""

from __future__ import annotations

import functools

import torch

from glm53.kernels.fp8_act import Fp8Rows, empty_rows
from glm53.kernels.fp8_quant import GROUP, quantize_fp8_groups_triton

@functools.lru_cache(maxsize=None)
def available(index: int) -> bool:
    """Whether GPU `index` and this torch have cuBLAS's blockwise FP8 scaling (sm90+, CUDA 12.9+)."""
    if torch.version.cuda is None:
        return False
    major, minor = (int(p) for p in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability(index) >= (9, 0) and (major, minor) >= (12, 9)


def supports(n: int, k: int) -> bool:
    """The weight shapes cuBLAS's blockwise FP8 GEMM accepts (module docstring)."""
    return n % 16 == 0 and k % GROUP == 0 and (k // GROUP) % 4 == 0


def quantize_rows(x2: torch.Tensor) -> Fp8Rows:
    """x2 [M, K] -> its rows quantized into the padded, column-major-scale layout cuBLAS reads
    (`fp8_act.Fp8Rows`; rows from M on are left unwritten, their products dropped)."""
    rows = empty_rows(x2.shape[0], x2.shape[1], x2.dtype, x2.device)
    quantize_fp8_groups_triton(x2, GROUP, out=rows.rows())
    return rows


def scaled_mm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's product of an `Fp8Rows`' padded (q, scale) with the block-FP8 weight: [Mp, N]."""
    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=w_scale.t(), out_dtype=out_dtype)


def fp8_gemm_cublas(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ dequant(w, w_scale)^T with x quantized per 1×128 group (as the w8a8 Triton
    variant): x [..., K] bf16/fp16/fp32; w [N, K] e4m3; w_scale [ceil(N/128), K/128] fp32,
    contiguous (its transpose is the layout cuBLAS reads)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    rows = quantize_rows(x2)
    y = scaled_mm(rows.q, rows.scale, w, w_scale, out_dtype or x.dtype)
    return y[: x2.shape[0]].reshape(*x.shape[:-1], w.shape[0])
