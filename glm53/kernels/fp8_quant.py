"""Block-FP8 formats (DESIGN §4.8) and per-token-group dynamic activation quantization.

Weights (GLM-5-FP8, DeepSeek-V3 style): `w` [..., N, K] float8_e4m3fn with an fp32
`weight_scale_inv` [..., ceil(N/128), ceil(K/128)], one scale per 128×128 block (edge blocks
partial, e.g. kv_a's 576 rows: 4 full row blocks and one of 64); dequantized
`w[n, k] = q[n, k] · s[n // 128, k // 128]` (`dequantize_fp8_blocks`). `quantize_fp8_blocks` writes
that format from a float tensor (tests, benchmarks, tiny checkpoints).

Activations (`quantize_fp8_groups`, the op; torch reference and Triton kernel): x [M, K] is cut
into 1×G groups along K (G = 128; the last group of a row may be partial) and each group gets

    scale = max(amax, 1e-10) / 448          (fp32, one IEEE division, round to nearest)
    inv   = 1 / scale                       (fp32, one IEEE division, round to nearest)
    q     = rne(clamp(x · inv, -448, 448))  (fp32 multiplication, then e4m3 round to nearest even)

so the group's largest value lands on ±448 (up to the rounding of the divisions) and
`x ≈ q · scale` with a relative error of at most 2^-4 (plus 2^-23 from `inv`'s rounding) per
element (e4m3 keeps 3 mantissa bits) for elements in e4m3's normal range (|x · inv| ≥ 2^-6);
smaller ones are subnormal, with an absolute error of at most 2^-10 · scale. A group of zeros
gets scale 1e-10 / 448 and q = 0 (no NaN or inf); the clamp keeps the result finite whatever the
rounding. Why a multiplication by the group's reciprocal and not a division per element: every
backend rounds an fp32 product the same way, and an IEEE division per element made a quantizing
RMSNorm cost twice the plain one on the H200 (51 vs 24 µs at 4096 × 6144). Scales
are [M, ceil(K/G)] fp32, row-major.

A second term (decode sizes, `fp8_act.two_terms`): the residual r = x - q · scale (fp32) quantized
by the same rule into its own codes and scales (`quantize_residual_reference`), so that
x ≈ q · scale + q_lo · scale_lo with a relative error of about 2^-8, bf16's, where one term keeps
2^-4. A w8a8 product then multiplies the same FP8 weight tile by both codes: more tensor-core
work (idle at decode sizes), the same weight bytes. On a GPU the kernels compute r with a fused
multiply-add, which may round it differently from the reference's separate product and
difference: the second scale may then differ in the last place and a second-term code by one
step, an error of 2^-4 of a residual that is itself 2^-4 of x (the GPU tests bound it so; under
the interpreter the codes are bit-identical).

The Triton kernel computes the same two divisions with IEEE rounding (`tl.math.div_rn`), the same
product and the same e4m3 conversion, so its q and scales are bit-identical to the reference. (Under
TRITON_INTERPRET=1 the interpreter's fp32 → e4m3 cast mis-rounds a value whose rounding carries
into the next binade (125.75 → 64); there the kernel rounds in fp32 first, exactly, so only
representable values are cast.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting, use_triton
from glm53.kernels.launch_early import early_args, wait_then_release

FP8_MAX = 448.0
GROUP = 128  # activation group width and weight block edge (quantization_config.weight_block_size)
AMAX_EPS = 1e-10
FP8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the weight format (torch; what the checkpoint holds) ------------------------------------
def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = GROUP,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] e4m3, scale [..., ceil(N/block), ceil(K/block)] fp32 -> q · s[block] in fp32
    (then `dtype`). Leading dims (experts) are batch dims."""
    N, K = q.shape[-2:]
    assert scale.shape[-2:] == (_cdiv(N, block), _cdiv(K, block)), (q.shape, scale.shape)
    s = scale.float().repeat_interleave(block, dim=-2)[..., :N, :].repeat_interleave(block, dim=-1)[..., :K]
    return (q.float() * s).to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q e4m3 [..., N, K], scale fp32 [..., ceil(N/block), ceil(K/block)]),
    scale = max(amax, 1e-10) / 448 per block (the checkpoint's `weight_scale_inv`)."""
    *lead, N, K = w.shape
    nb, kb = _cdiv(N, block), _cdiv(K, block)
    wp = torch.nn.functional.pad(w.float(), (0, kb * block - K, 0, nb * block - N))
    tiles = wp.reshape(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = amax.clamp_min(AMAX_EPS) / torch.full_like(amax, FP8_MAX)  # IEEE division on CUDA too
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(*lead, nb * block, kb * block)
    return q[..., :N, :K].to(FP8).contiguous(), scale


# ---- activations: 1×G groups (the op) ---------------------------------------------------------
def quantize_fp8_groups_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] e4m3, scale [M, ceil(K/group)] fp32); the rule in the
    module docstring."""
    M, K = x.shape
    kb = _cdiv(K, group)
    xp = torch.nn.functional.pad(x.float(), (0, kb * group - K)).view(M, kb, group)
    amax = xp.abs().amax(dim=-1).clamp_min(AMAX_EPS)
    # A tensor divisor: CUDA divides a tensor by a Python scalar as a multiplication by its
    # reciprocal (1 ulp off the IEEE quotient the kernel computes); by a tensor it divides.
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.ones_like(scale) / scale
    q = (xp * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).view(M, kb * group)[:, :K].to(FP8)
    return q.contiguous(), scale


def quantize_residual_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                                group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The second term: r = x - dequant(q, scale) in fp32, quantized by the same rule."""
    return quantize_fp8_groups_reference(x.float() - dequantize_fp8_groups(q, scale, group), group)


def dequantize_fp8_groups(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(q [M, K] e4m3, scale [M, ceil(K/group)]) -> fp32 [M, K]."""
    K = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :K]


@triton.jit
def _to_e4m3(v, EXACT_RNE: tl.constexpr):
    """v (fp32, |v| <= 448) -> e4m3, rounded to nearest even. EXACT_RNE (the interpreter) rounds
    in fp32 first: adding and subtracting c = 1.5·2^23·ulp rounds |v| to a multiple of ulp, e4m3's
    spacing at v's binade (2^(E-3); 2^-9 below the smallest normal 2^-6), so the cast that
    follows only sees representable values."""
    if EXACT_RNE:
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum((bits >> 23) & 0xFF, 121)  # biased exponent, at least 2^-6's
        c = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = (tl.abs(v) + c) - c
        v = tl.where(bits < 0, -r, r)  # the sign bit kept (-0.0 and values that round to zero)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_tile(x, EXACT_RNE: tl.constexpr):
    """x [R, G] fp32, each row one group -> (e4m3 codes [R, G], scales [R]) by the module
    docstring's rule (two IEEE divisions per group, one product per element, clamp, round to
    nearest even); masked-off elements must be 0."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), 448.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    v = x * inv[:, None]
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    return _to_e4m3(v, EXACT_RNE), scale


@triton.jit
def quantize_residual_tile(x, codes, scale, EXACT_RNE: tl.constexpr):
    """The second term of x [R, G] fp32 after `quantize_tile` gave (codes, scale): the residual
    x - codes · scale quantized by the same rule -> (codes [R, G], scales [R])."""
    return quantize_tile(x - codes.to(tl.float32) * scale[:, None], EXACT_RNE)


@triton.jit(do_not_specialize=["M"])  # the rows follow the token count
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, ql_ptr, sl_ptr, M, K,
    stride_xm, stride_qm, stride_sm, stride_sg,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, LO: tl.constexpr, EXACT_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: BLOCK_M rows × one group of G columns (BLOCK_G = next_pow2(G)). LO: the second
    term too, into ql/sl (the strides of q/s)."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    pm = tl.program_id(0)
    g = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * G + tl.arange(0, BLOCK_G)
    rm = rows < M
    cm = (tl.arange(0, BLOCK_G) < G) & (cols < K)
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    codes, scale = quantize_tile(x, EXACT_RNE)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], codes, mask=m)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=rm)
    if LO:
        codes, scale = quantize_residual_tile(x, codes, scale, EXACT_RNE)
        tl.store(ql_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], codes, mask=m)
        tl.store(sl_ptr + rows.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=rm)


def quantize_fp8_groups_triton(
    x: torch.Tensor, group: int = GROUP, out: tuple[torch.Tensor, torch.Tensor] | None = None,
    lo: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: same contract and bits as `quantize_fp8_groups_reference`. `out` = (q, scale)
    preallocated (q [M, K] e4m3 with unit column stride, scale [M, ceil(K/group)] fp32, any strides:
    cuBLAS's blockwise FP8 GEMM wants the scales column-major, `fp8_gemm_cublas`). `lo` = buffers
    of q's and scale's shapes and strides for the second term (`quantize_residual_reference`),
    written in the same pass."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    kb = _cdiv(K, group)
    if out is None:
        q = torch.empty((M, K), dtype=FP8, device=x.device)
        s = torch.empty((M, kb), dtype=torch.float32, device=x.device)
    else:
        q, s = out
        assert q.shape == (M, K) and q.dtype == FP8 and q.stride(1) == 1, (q.shape, q.dtype, q.stride())
        assert s.shape == (M, kb) and s.dtype == torch.float32, (s.shape, s.dtype)
    if lo is not None:
        assert lo[0].shape == q.shape and lo[0].stride() == q.stride() and lo[0].dtype == FP8, "lo codes: q's layout"
        assert lo[1].shape == s.shape and lo[1].stride() == s.stride(), "lo scales: scale's layout"
    ql, sl = lo if lo is not None else (q, s)
    if M == 0 or K == 0:
        return q, s
    block_g = triton.next_power_of_2(group)
    # the interpreter pays per program: one row tile of up to 256 rows there
    block_m = max(1, min(256 if triton_interpreting() else 4096 // block_g, triton.next_power_of_2(M)))
    _quant_groups_kernel[(triton.cdiv(M, block_m), kb)](
        x, q, s, ql, sl, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        G=group, BLOCK_M=block_m, BLOCK_G=block_g, LO=lo is not None, EXACT_RNE=triton_interpreting(), num_warps=4,
        **early_args(),
    )
    return q, s


def quantize_fp8_terms_triton(x: torch.Tensor, two: bool, group: int = GROUP
                              ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """x [M, K] -> (q, scale, the second term (q_lo, scale_lo) where `two`, else None), fresh
    buffers, one launch of `quantize_fp8_groups_triton`."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    s = torch.empty((M, _cdiv(K, group)), dtype=torch.float32, device=x.device)
    lo = (torch.empty_like(q), torch.empty_like(s)) if two else None
    quantize_fp8_groups_triton(x, group, out=(q, s), lo=lo)
    return q, s, lo


def quantize_fp8_groups(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, ceil(K/group)] fp32), 1×group dynamic quantization
    (module docstring); Triton where `dispatch.use_triton` says so, else the torch reference."""
    if use_triton(x):
        return quantize_fp8_groups_triton(x, group)
    return quantize_fp8_groups_reference(x, group)
