"""Activations handed to block-FP8 products already quantized, by the kernel that produces them.

A w8a8 product (cuBLAS blockwise or the Triton w8a8 GEMM, `fp8_gemm`) reads its input quantized
per 1×128 group (`fp8_quant`). Quantizing in a launch of its own reads the whole activation back
and writes it again: at prefill sizes 6-24 µs a product on the H200 (GLM-5 tp = 8, M = 4096),
a sixth of the FP8 GEMM's time. Here the producers write the e4m3 codes and scales in their own
pass instead:

- `rms_norm_fp8`: RMSNorm, then the groups of its (rounded) output; optionally the dense output
  too, for consumers that read it as is (the router, the indexer's head gates, the MoE);
- `silu_mul_fp8`: SwiGLU's h = silu(gate) · up, quantized for the down projection.

Both quantize what the two-step path quantizes: the producer's output rounded to its dtype first
(RMSNorm sums each row's squares in another order, so its norm may differ from `rms_norm`'s by a
unit in the last place, and a code by one e4m3 step where that unit crosses a rounding boundary).
The result is an `Fp8Rows`, laid out as cuBLAS reads it (rows padded to 16, scales column-major;
with the second term, which only the Triton kernels read, row-major); the Triton w8a8 GEMM reads
the same buffers (`fp8_gemm.fp8_gemm_rows`).

Which producer quantizes is decided by the consumer's variant (`fp8_gemm.takes_fp8_rows`): only
where the product would quantize anyway (w8a8 or cuBLAS rows, on a GPU). At decode sizes
(`two_terms`: m <= TWO_TERM_MAX_M rows) the producers also write a second term, the residual's own
e4m3 codes and scales (`fp8_quant`), which the Triton w8a8 GEMM and MoE multiply by the same
weight tile: about as accurate as bf16 activations, for no extra weight bytes (on the H200 the
products cost nothing more at 1-4 rows, 16-26 % more at 16-64). CPU serving multiplies
the dense activation by the dequantized weight (the reference) and never builds an `Fp8Rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting, use_triton
from glm53.kernels.fp8_quant import (FP8, GROUP, dequantize_fp8_groups, quantize_fp8_groups_reference,
                                     quantize_residual_reference, quantize_residual_tile, quantize_tile)
from glm53.kernels.launch_early import early_args, pdl_option, prefetch_rows_l2, wait_then_release
from glm53.kernels.norm import rms_norm_reference
from glm53.kernels.norm_triton import added, load_residual_sum
from glm53.kernels.row_parts import RowParts, row_source, take
from glm53.kernels.sparse_mla_triton import COMBINE_WARPS, Splits, combine_row

M_ALIGN = 16  # cuBLAS's blockwise FP8 GEMM takes M in multiples of 8; 16 as fp8_gemm_cublas pads
# Rows up to which w8a8 activations carry a second e4m3 term (`two_terms`). Greedy agreement with
# the fp32 dequantized reference at decode steps (the trained tiny target in the GLM-5-FP8 layout,
# 16 third-party files): as served on the H200 99.22 % against 96.39 % with one term (weights
# dequantized in the kernels: 100 %); the CPU emulation (benchmarks/fp8_act_emulation.py) 98.8 %
# (fp32) / 99.5 % (bf16) against 95.3 % / 97.2 %. The cost (H200, the slice's decode products a
# layer): none at M <= 4, +16 % at 16, +26 % at 64; the routed experts +3-5 %. Prefill sizes keep
# one term: there the FP8 products are compute-bound and cuBLAS reads one (so this stays below
# fp8_gemm.CUBLAS_MIN_M).
TWO_TERM_MAX_M = 64


def trigger_dependents() -> bool:
    """Whether the producers let the next kernel launch as they start (griddepcontrol, inline
    PTX: not under the interpreter). The w8a8 GEMM after them is launched that way at decode
    sizes (`fp8_gemm_triton.GemmConfig.PDL`) and prefetches its weight while they run; a kernel
    launched the usual way after them waits for their end as always."""
    return not triton_interpreting()


def two_terms(m: int) -> bool:
    """Whether m rows quantized for a w8a8 product carry the second term (decode sizes)."""
    return 0 < m <= TWO_TERM_MAX_M


@dataclass(frozen=True)
class Fp8Rows:
    """x [m, K] quantized per 1×128 group: `q` [Mp, K] e4m3 and `scale` [Mp, ceil(K/128)] fp32
    (column-major; row-major with the second term: `empty_rows`), Mp = m rounded up to M_ALIGN
    (rows from m on are unwritten padding; a product's padding rows are computed and dropped, one
    row never mixes with another). `dtype` is the dense activation's: a product's output dtype
    when none is given. `q_lo`, `scale_lo` (same layouts): the second term (`two_terms`), or None."""

    q: torch.Tensor
    scale: torch.Tensor
    m: int
    dtype: torch.dtype
    q_lo: torch.Tensor | None = None
    scale_lo: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The m real rows (q, scale): what a product reads."""
        return self.q[: self.m], self.scale[: self.m]

    def lo_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The second term's m real rows (q_lo, scale_lo), or None."""
        return None if self.q_lo is None else (self.q_lo[: self.m], self.scale_lo[: self.m])

    def dequantize(self) -> torch.Tensor:
        """fp32 [m, K] (tests; the reference of a product that reads these rows): both terms."""
        y = dequantize_fp8_groups(*self.rows())
        lo = self.lo_rows()
        return y if lo is None else y + dequantize_fp8_groups(*lo)


def empty_rows(m: int, k: int, dtype: torch.dtype, device: torch.device, lo: bool = False) -> Fp8Rows:
    """Rows for a producer to fill. Scales column-major as cuBLAS reads them, except with the
    second term (`lo`, decode sizes, which never reach cuBLAS): there row-major, each row's scales
    side by side as the Triton GEMM's K loop reads them (H200, FP8 slice, batch 1: the four
    o_proj products took 19 µs more a decode step on column-major scales)."""
    mp = -(-m // M_ALIGN) * M_ALIGN
    groups = -(-k // GROUP)

    def buffers():
        scale = torch.empty((mp, groups), dtype=torch.float32, device=device) if lo else \
            torch.empty((groups, mp), dtype=torch.float32, device=device).t()
        return torch.empty((mp, k), dtype=FP8, device=device), scale

    return Fp8Rows(*buffers(), m, dtype, *(buffers() if lo else (None, None)))


def _pack(y: torch.Tensor) -> Fp8Rows:
    """Reference: y [m, K] quantized (`quantize_fp8_groups_reference`, and the second term where
    `two_terms`) into the padded layout."""
    m, k = y.shape
    rows = empty_rows(m, k, y.dtype, y.device, lo=two_terms(m))
    q, s = quantize_fp8_groups_reference(y)
    rows.q[:m].copy_(q)
    rows.scale[:m].copy_(s)
    if rows.q_lo is not None:
        ql, sl = quantize_residual_reference(y, q, s)
        rows.q_lo[:m].copy_(ql)
        rows.scale_lo[:m].copy_(sl)
    return rows


def _lo_args(rows: Fp8Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The second term's buffers for a kernel (the first term's when there is none: unread)."""
    return (rows.q, rows.scale) if rows.q_lo is None else (rows.q_lo, rows.scale_lo)


# ---- RMSNorm, quantized ------------------------------------------------------------------------
def rms_norm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           dense: bool = False) -> tuple[torch.Tensor | None, Fp8Rows]:
    """`rms_norm_reference` then `quantize_fp8_groups_reference`: (y or None, its rows)."""
    y = rms_norm_reference(x, weight, eps)
    return (y if dense else None), _pack(y.reshape(-1, y.shape[-1]))


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, ql_ptr, sl_ptr, a_ptr, r_ptr, D, stride_x, stride_y, stride_q, stride_sm,
    stride_sg, stride_a, stride_r, stride_ap, eps, stride_xp,
    G: tl.constexpr, NG: tl.constexpr, DENSE: tl.constexpr, ADD: tl.constexpr, LO: tl.constexpr,
    EXACT_RNE: tl.constexpr, TRIGGER: tl.constexpr, PARTS: tl.constexpr, XPARTS: tl.constexpr, DT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per row, the row loaded straight into a [NG, G] tile (group g = columns
    [g·G, (g+1)·G)), so each group's amax is a reduction along the tile's second axis: a row
    loaded flat and reshaped into groups costs a layout shuffle (measured: twice the plain norm).
    The norm is rounded to y's dtype as `rms_norm` rounds it (its sum of squares in another order),
    then each group's scale and codes as `fp8_quant` computes them. ADD: the residual sum
    x + a, rounded to x's dtype DT, is written to r and normalised. XPARTS > 1: x is a sum not taken
    yet (`norm_triton.load_row`). LO: the second term into ql/sl."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    if TRIGGER:  # the product after it may launch now (`trigger_dependents`)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]
    mask = col < D
    x = load_residual_sum(x_ptr, a_ptr, r_ptr, row * stride_x + col, row * stride_a + col, row * stride_r + col,
                          mask, ADD, stride_ap, PARTS, stride_xp, XPARTS, DT)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xf * xf, 1), 0) / D + eps)
    n = (xf * rstd).to(DT).to(tl.float32)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    y = (w * n).to(y_ptr.dtype.element_ty)
    if DENSE:
        tl.store(y_ptr + row * stride_y + col, y, mask=mask)
    yf = y.to(tl.float32)
    codes, scale = quantize_tile(yf, EXACT_RNE)  # masked columns are 0
    tl.store(q_ptr + row * stride_q + col, codes, mask=mask)
    g = tl.arange(0, NG)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * G < D)
    if LO:
        codes, scale = quantize_residual_tile(yf, codes, scale, EXACT_RNE)
        tl.store(ql_ptr + row * stride_q + col, codes, mask=mask)
        tl.store(sl_ptr + row * stride_sm + g * stride_sg, scale, mask=g * G < D)


def norm_warps(tile: int, reads: int) -> int:
    """A one-row norm's warps: one per 512 values it loads (its tile times the row tensors summed
    into it, x's parts and the add's), a power of two from 1 to 16. One program holds the row, so
    more warps keep more of a split product's parts in flight (H100, one row, graphs of 8 launches:
    2,048 wide over 7 fp32 parts 2.5 µs at 16 warps against 3.8 at the 4 a plain 2,048-wide row
    takes; that row alone 2.0 at 4, 2.2 at 16)."""
    n = tile * reads // 512
    return 1 if n < 2 else min(16, 1 << (n.bit_length() - 1))


def rms_norm_fp8_triton(x: torch.Tensor | RowParts, weight: torch.Tensor, eps: float, dense: bool = False,
                        num_warps: int | None = None, add: torch.Tensor | RowParts | None = None):
    """x [m, D] (unit last stride; rows may be strided, e.g. a column slice of a fused product, or a
    `RowParts` whose sum is taken here), weight [D] -> (the norm [m, D] in torch's promoted dtype
    when `dense`, else None; its rows). With `add` (x's shape and dtype, or a `RowParts` of them):
    (s = x + add, then the same two) for the norm of s."""
    m, D = x.shape
    src, x_parts, stride_xp, dt = row_source(x)
    dev = src.device
    assert weight.shape == (D,) and src.stride(1) == 1, (x.shape, src.stride(), weight.shape)
    dtype = torch.promote_types(x.dtype, weight.dtype)
    rows = empty_rows(m, D, dtype, dev, lo=two_terms(m))
    y = torch.empty((m, D) if dense else (1, 1), dtype=dtype, device=dev)
    a = r = y  # unused without `add`
    n_parts, stride_ap = added(add, x)
    if add is not None:
        a, r = add.parts[0] if isinstance(add, RowParts) else add, torch.empty((m, D), dtype=x.dtype, device=dev)
    if m:
        ng = triton.next_power_of_2(triton.cdiv(D, GROUP))
        _rms_norm_fp8_kernel[(m,)](
            src, weight, y, rows.q, rows.scale, *_lo_args(rows), a, r, D, src.stride(0), y.stride(0),
            rows.q.stride(0), rows.scale.stride(0), rows.scale.stride(1), a.stride(0), r.stride(0), stride_ap, eps,
            stride_xp, G=GROUP, NG=ng, DENSE=dense, ADD=add is not None, LO=rows.q_lo is not None,
            EXACT_RNE=triton_interpreting(), TRIGGER=trigger_dependents(), PARTS=n_parts, XPARTS=x_parts, DT=dt,
            num_warps=num_warps or norm_warps(ng * GROUP, x_parts + n_parts), **early_args(),
        )
    out = (y if dense else None), rows
    return out if add is None else (r, *out)


def rms_norm_fp8(x: torch.Tensor | RowParts, weight: torch.Tensor, eps: float,
                 dense: bool = False) -> tuple[torch.Tensor | None, Fp8Rows]:
    """RMSNorm of x [m, D] quantized for a w8a8 product: (the dense norm when `dense`, else None;
    the quantized rows). Triton where `dispatch.use_triton` says so, else the reference. x may be
    a sum not taken yet (`row_parts`): the kernel takes it."""
    rows = x.parts if isinstance(x, RowParts) else x
    if use_triton(rows, weight) and rows.stride(-1) == 1:
        return rms_norm_fp8_triton(x, weight, eps, dense)
    return rms_norm_fp8_reference(take(x), weight, eps, dense)


def add_rms_norm_fp8(x: torch.Tensor, add: torch.Tensor | RowParts, weight: torch.Tensor, eps: float,
                     dense: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, Fp8Rows]:
    """The residual add before the norm in the same pass: (s = x + add, then `rms_norm_fp8(s)`'s
    two results). `add` may be a sum not taken yet (`row_parts`): the kernel takes it."""
    a = add.parts if isinstance(add, RowParts) else add
    if use_triton(x, a, weight) and x.stride(1) == 1 and a.stride(-1) == 1 and add.dtype == x.dtype:
        return rms_norm_fp8_triton(x, weight, eps, dense, add=add)
    s = x + take(add)
    return (s, *rms_norm_fp8(s, weight, eps, dense))


# ---- SwiGLU, quantized -------------------------------------------------------------------------
def silu_mul_fp8_reference(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """h = silu(gate) · up in the inputs' dtype (as `MLP.forward` computes it), quantized."""
    return _pack(F.silu(gate) * up)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_fp8_kernel(
    g_ptr, u_ptr, q_ptr, s_ptr, ql_ptr, sl_ptr, M, I, stride_g, stride_u, stride_q, stride_sm, stride_sg,
    G: tl.constexpr, BLOCK_M: tl.constexpr, LO: tl.constexpr, EXACT_RNE: tl.constexpr, TRIGGER: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: BLOCK_M rows × one group of G columns of h. silu rounds to the dtype before
    the product, and the product rounds again, as torch's two bf16 ops do. LO: the second term
    into ql/sl."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1)
    cols = grp * G + tl.arange(0, G)
    rm = rows < M
    m = rm[:, None] & (cols < I)[None, :]
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=m, other=0.0)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = tl.math.div_rn(gf, 1.0 + tl.exp(-gf)).to(g_ptr.dtype.element_ty).to(tl.float32)
    h = (s * u).to(g_ptr.dtype.element_ty).to(tl.float32)
    codes, scale = quantize_tile(h, EXACT_RNE)
    tl.store(q_ptr + r64 * stride_q + cols[None, :], codes, mask=m)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + grp * stride_sg, scale, mask=rm)
    if LO:
        codes, scale = quantize_residual_tile(h, codes, scale, EXACT_RNE)
        tl.store(ql_ptr + r64 * stride_q + cols[None, :], codes, mask=m)
        tl.store(sl_ptr + rows.to(tl.int64) * stride_sm + grp * stride_sg, scale, mask=rm)


def silu_mul_fp8_triton(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """gate, up [m, I] (same dtype; unit last stride, rows may be strided: the halves of a fused
    gate_up product) -> h = silu(gate) · up as `Fp8Rows`."""
    m, inter = gate.shape
    assert up.shape == gate.shape and up.dtype == gate.dtype, (gate.shape, up.shape, gate.dtype, up.dtype)
    assert gate.stride(1) == 1 and up.stride(1) == 1, (gate.stride(), up.stride())
    rows = empty_rows(m, inter, gate.dtype, gate.device, lo=two_terms(m))
    if m:
        block_m = max(1, min(32, triton.next_power_of_2(m)))
        _silu_mul_fp8_kernel[(triton.cdiv(m, block_m), triton.cdiv(inter, GROUP))](
            gate, up, rows.q, rows.scale, *_lo_args(rows), m, inter, gate.stride(0), up.stride(0),
            rows.q.stride(0), rows.scale.stride(0), rows.scale.stride(1),
            G=GROUP, BLOCK_M=block_m, LO=rows.q_lo is not None, EXACT_RNE=triton_interpreting(),
            TRIGGER=trigger_dependents(), num_warps=4, **early_args(),
        )
    return rows


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """silu(gate) · up quantized for a w8a8 product; Triton where `dispatch.use_triton` says so."""
    if use_triton(gate, up) and gate.stride(1) == 1 and up.stride(1) == 1:
        return silu_mul_fp8_triton(gate, up)
    return silu_mul_fp8_reference(gate, up)


# ---- the absorbed attention's output product, quantized ----------------------------------------
# The W_UV product launched early (`_uv_fp8_kernel`'s PDL), each program prefetching the first
# UV_PREFETCH bytes of each of its W_UV rows while the attention's last kernel runs. On since timed
# with the other early launches (launch_early.SMALL_KERNELS: the slice's batch-1 step 1,025.4 µs
# with all of them against 1,039.2 with none, H100).
UV_PDL = True
UV_PREFETCH = 1024
# The attention's splits combined by the W_UV product in its own launch (one launch fewer a layer,
# `uv_product_fp8` given `Splits`) at up to this many rows (0: never). Each program combines its
# rows one after another and the head's V/128 programs each combine them, so it pays only at the
# smallest batches: the slice's step (H100, early_launch.py, 2026-12-06) 987.0 vs 999.6 µs at 1
# row, 1,025.0 vs 1,040.4 at 2, 1,084.2 vs 1,093.5 at 4; 1,173.4 vs 1,168.7 at 8, 1,599.1 vs 1,525.4 at 32.
UV_SPLITS_MAX_ROWS = 4


def uv_product_reference(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o [n, h·V] = each head's o_lat [n, h, R] times its W_UV [h, V, R] transposed, in o_lat's
    dtype (the batched product `Attention.forward` runs when o_proj reads dense rows)."""
    n, h, _ = o_lat.shape
    # o [n, h, V] written by the batched product itself (an einsum's [h, n, V] result is a copy more)
    o = torch.empty(n, h, w_uv.shape[1], dtype=o_lat.dtype, device=o_lat.device)
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
    return o.view(n, -1)


@triton.jit(do_not_specialize=["M", "NSPLIT"])
def _uv_fp8_kernel(
    o_ptr, w_ptr, q_ptr, s_ptr, ql_ptr, sl_ptr, M, R, stride_ot, stride_oh, stride_wh, stride_wv, stride_q,
    stride_sm, stride_sg, part_ptr, lse_ptr, NSPLIT, H,
    V: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BR: tl.constexpr, LO: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EXACT_RNE: tl.constexpr, TRIGGER: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
    COMBINE: tl.constexpr = False, CR: tl.constexpr = 16, CSP: tl.constexpr = 1,
):
    """One program: BLOCK_M rows × one group of G output columns, all of one head (G divides V).
    The head's W_UV rows are read once for all the rows (decode sizes: one row block), the fp32
    product is rounded to o_lat's dtype as the batched product rounds it, then quantized. PDL:
    launched while the attention's last kernel runs; the first PREFETCH bytes of each W_UV row go
    to L2 (the weight does not depend on it), then the program waits for o_lat. COMBINE: the
    attention left its splits (part [M, H, NSPLIT, CR], lse [M, H, NSPLIT]; `sparse_mla_triton.Splits`):
    the program first combines its head's rows into o_lat itself, as the combine launch would (the
    same code, `combine_row`), and reads them back (the head's other programs write the same bytes)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1)
    head = grp // (V // G)
    c0 = (grp % (V // G)) * G
    cols = tl.arange(0, G)
    rm = rows < M
    r64 = rows.to(tl.int64)
    o_rows = o_ptr + r64[:, None] * stride_ot + head * stride_oh
    w_row0 = w_ptr + head.to(tl.int64) * stride_wh + (c0 + cols).to(tl.int64) * stride_wv  # [G]
    w_rows = w_row0[:, None]
    if PDL:
        if PREFETCH > 0:
            prefetch_rows_l2(w_row0, tl.minimum(R * w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH))
        tl.extra.cuda.gdc_wait()  # o_lat is the attention's
    if COMBINE:
        r_all = tl.arange(0, CR)
        for i in range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + i
            if row < M:
                o = combine_row(part_ptr, lse_ptr, row * H + head, NSPLIT, R, CR, CSP)
                tl.store(o_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + r_all,
                         o.to(o_ptr.dtype.element_ty), mask=r_all < R)
        tl.debug_barrier()  # the rows this program wrote, before it reads them
    acc = tl.zeros((BLOCK_M, G), dtype=tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        a = tl.load(o_rows + rr[None, :], mask=rm[:, None] & (rr < R)[None, :], other=0.0)
        w = tl.load(w_rows + rr[None, :], mask=(rr < R)[None, :], other=0.0)
        if DOT_F32:  # the interpreter: widen both (exact) and multiply in fp32
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    y = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
    codes, scale = quantize_tile(y, EXACT_RNE)
    out = grp * G + cols
    tl.store(q_ptr + r64[:, None] * stride_q + out[None, :], codes, mask=rm[:, None])
    tl.store(s_ptr + r64 * stride_sm + grp * stride_sg, scale, mask=rm)
    if LO:
        codes, scale = quantize_residual_tile(y, codes, scale, EXACT_RNE)
        tl.store(ql_ptr + r64[:, None] * stride_q + out[None, :], codes, mask=rm[:, None])
        tl.store(sl_ptr + r64 * stride_sm + grp * stride_sg, scale, mask=rm)


# One token's W_UV product as a row product on the CUDA cores (`_uv_row_kernel`) instead of the
# tile kernel's 16-row MMA: the splits are combined chunk by chunk beside the weight's loads (no
# o_lat written and read back, no barrier between them). Off until timed in the step.
UV_ROW = False


@triton.jit(do_not_specialize=["NSPLIT"])
def _uv_row_kernel(
    o_ptr, w_ptr, q_ptr, s_ptr, ql_ptr, sl_ptr, R, stride_oh, stride_wh, stride_wv, stride_sg,
    part_ptr, lse_ptr, NSPLIT, stride_ps,
    V: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, LO: tl.constexpr, EXACT_RNE: tl.constexpr,
    TRIGGER: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, COMBINE: tl.constexpr, CSP: tl.constexpr,
):
    """One program: G output columns of one head for one token, y = W_UV[cols] · o_lat[head] summed
    BR latent columns at a time in fp32, rounded to o_lat's dtype, then quantized as
    `_uv_fp8_kernel` does. COMBINE: o_lat's chunk is the weighted sum of the splits' chunks (part
    [H, NSPLIT, >= R] with row stride stride_ps, lse [H, NSPLIT]: `combine_row`'s weights),
    rounded as the combine launch rounds it; o_lat itself is not written (nothing reads it after
    this product)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    grp = tl.program_id(0)
    head = grp // (V // G)
    cols = (grp % (V // G)) * G + tl.arange(0, G)
    w_row0 = w_ptr + head.to(tl.int64) * stride_wh + cols.to(tl.int64) * stride_wv  # [G]
    if PDL:
        if PREFETCH > 0:
            prefetch_rows_l2(w_row0, tl.minimum(R * w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH))
        tl.extra.cuda.gdc_wait()  # o_lat (or the splits) is the attention's
    sidx = tl.arange(0, CSP)
    sm = sidx < NSPLIT
    sw = tl.zeros([CSP], dtype=tl.float32)
    if COMBINE:
        lse = tl.load(lse_ptr + head * NSPLIT + sidx, mask=sm, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        sw = tl.exp2(lse - mx)
        sw = sw / tl.maximum(tl.sum(sw, axis=0), 1e-30)
    acc = tl.zeros([G], dtype=tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        rm = rr < R
        w = tl.load(w_row0[:, None] + rr[None, :], mask=rm[None, :], other=0.0)
        if COMBINE:
            part = tl.load(part_ptr + (head * NSPLIT + sidx).to(tl.int64)[:, None] * stride_ps + rr[None, :],
                           mask=sm[:, None] & rm[None, :], other=0.0)
            o = tl.sum(part * sw[:, None], axis=0).to(o_ptr.dtype.element_ty)
        else:
            o = tl.load(o_ptr + head * stride_oh + rr, mask=rm, other=0.0)
        acc += tl.sum(w.to(tl.float32) * o.to(tl.float32)[None, :], axis=1)
    y = acc.to(o_ptr.dtype.element_ty).to(tl.float32)[None, :]
    codes, scale = quantize_tile(y, EXACT_RNE)
    one = tl.zeros([1], dtype=tl.int32)
    tl.store(q_ptr + grp * G + tl.arange(0, G)[None, :], codes)
    tl.store(s_ptr + grp * stride_sg + one, scale)
    if LO:
        codes, scale = quantize_residual_tile(y, codes, scale, EXACT_RNE)
        tl.store(ql_ptr + grp * G + tl.arange(0, G)[None, :], codes)
        tl.store(sl_ptr + grp * stride_sg + one, scale)


def uv_block_m(n: int) -> int:
    """`_uv_fp8_kernel`'s row tile for n rows (decode sizes: one row block)."""
    return max(16, min(64, triton.next_power_of_2(n)))


def uv_writes_rows(n: int, v_head_dim: int, o_proj_takes_rows: bool) -> bool:
    """Whether the W_UV product of n rows writes o_proj's quantized rows itself (`uv_product_fp8`):
    o_proj reads them quantized, at decode sizes (two terms), whole 128-groups in each head."""
    return o_proj_takes_rows and two_terms(n) and v_head_dim % GROUP == 0


def takes_splits(n: int) -> bool:
    """Whether the W_UV product of n rows combines the attention's splits (`UV_SPLITS_MAX_ROWS`)."""
    return n <= UV_SPLITS_MAX_ROWS


def takes_row(n: int) -> bool:
    """Whether the W_UV product of n rows takes `_uv_row_kernel` (one token, `UV_ROW`)."""
    return n == 1 and UV_ROW


def uv_product_fp8_triton(o_lat: torch.Tensor | Splits, w_uv: torch.Tensor, block_r: int = 128,
                          num_warps: int = COMBINE_WARPS, num_stages: int = 3, pdl: bool | None = None,
                          prefetch: int | None = None, row: bool | None = None) -> Fp8Rows:
    """o_lat [n, h, R] (unit last stride), or the attention's splits not combined yet (`Splits`:
    combined in this launch), w_uv [h, V, R] (unit last stride: a slice of kv_b_proj's weight), V
    a multiple of 128 -> `uv_product_reference`'s o as `Fp8Rows`. The default tile is the best of
    24 on the H100 (benchmarks/history/2026-12-05.md, twenty-eighth session): against cuBLAS's
    batched product plus the quantizing launch, 8.5 vs 9.6 µs at the slice's 64 heads and one row,
    11.9 vs 16.5 at 64 rows; 4.9 vs 5.7 at GLM-5 tp = 8's 8 heads. Its 4 warps are also the
    combine launch's (`COMBINE_WARPS`): taking the splits, it then sums them in the same order.
    `row` (default `takes_row`): one token takes `_uv_row_kernel` (the tile and warps then its own)."""
    splits = o_lat if isinstance(o_lat, Splits) else None
    if splits is not None:
        o_lat = splits.out
    n, h, r = o_lat.shape
    v = w_uv.shape[1]
    assert w_uv.shape == (h, v, r) and v % GROUP == 0 and w_uv.dtype == o_lat.dtype, (o_lat.shape, w_uv.shape)
    assert o_lat.stride(2) == 1 and w_uv.stride(2) == 1, (o_lat.stride(), w_uv.stride())
    rows = empty_rows(n, h * v, o_lat.dtype, o_lat.device, lo=two_terms(n))
    interp = triton_interpreting()
    pdl = (UV_PDL if pdl is None else pdl) and not interp  # griddepcontrol: compiled kernels only
    prefetch = (UV_PREFETCH if prefetch is None else prefetch) if pdl else 0
    if takes_row(n) if row is None else (n == 1 and row):
        _uv_row_kernel[(h * v // GROUP,)](
            o_lat, w_uv, rows.q, rows.scale, *_lo_args(rows), r, o_lat.stride(1), w_uv.stride(0), w_uv.stride(1),
            rows.scale.stride(1),
            *((splits.part, splits.lse, splits.num_splits, splits.block_r) if splits is not None else (o_lat, o_lat, 1, 0)),
            V=v, G=GROUP, BR=min(block_r, max(16, triton.next_power_of_2(r))), LO=rows.q_lo is not None,
            EXACT_RNE=interp, TRIGGER=trigger_dependents(), PDL=pdl, PREFETCH=prefetch, COMBINE=splits is not None,
            CSP=triton.next_power_of_2(splits.num_splits) if splits is not None else 1,
            num_warps=num_warps, num_stages=num_stages, **pdl_option(pdl),
        )
        return rows
    if splits is not None:
        assert num_warps == COMBINE_WARPS, "the splits are summed as the combine launch sums them: its warps"
    if n:
        block_m = uv_block_m(n)
        _uv_fp8_kernel[(triton.cdiv(n, block_m), h * v // GROUP)](
            o_lat, w_uv, rows.q, rows.scale, *_lo_args(rows), n, r, o_lat.stride(0), o_lat.stride(1),
            w_uv.stride(0), w_uv.stride(1), rows.q.stride(0), rows.scale.stride(0), rows.scale.stride(1),
            *((splits.part, splits.lse, splits.num_splits) if splits is not None else (o_lat, o_lat, 1)), h,
            COMBINE=splits is not None, CR=splits.block_r if splits is not None else 16,
            CSP=triton.next_power_of_2(splits.num_splits) if splits is not None else 1,
            V=v, G=GROUP, BLOCK_M=block_m, BR=min(block_r, max(16, triton.next_power_of_2(r))),
            LO=rows.q_lo is not None, DOT_F32=interp, PRECISION=dot_precision(torch.float32 if interp else o_lat.dtype),
            EXACT_RNE=interp, TRIGGER=trigger_dependents(), PDL=pdl,
            PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages, **pdl_option(pdl),
        )
    return rows


def uv_product_fp8(o_lat: torch.Tensor | Splits, w_uv: torch.Tensor) -> Fp8Rows:
    """The absorbed attention's output product quantized for o_proj in the same pass: Triton where
    `dispatch.use_triton` says so and whole groups fall in each head (V a multiple of 128), else
    the batched product, then its groups. `o_lat` may be the attention's splits not combined yet
    (`UV_SPLITS_MAX_ROWS`): the Triton launch combines them, the batched product after the combine."""
    dense = o_lat.out if isinstance(o_lat, Splits) else o_lat
    if use_triton(dense, w_uv) and w_uv.shape[1] % GROUP == 0 and dense.stride(2) == 1 and w_uv.stride(2) == 1:
        return uv_product_fp8_triton(o_lat, w_uv)
    return _pack(uv_product_reference(o_lat.combine() if isinstance(o_lat, Splits) else o_lat, w_uv))
