"""Checks for the block-FP8 kernels (activation quantizer, FP8 GEMM, FP8 fused MoE), run on CPU
under TRITON_INTERPRET=1 (small shapes) and on a CUDA device (GLM-5 tp = 8 shapes). Every check
draws fresh random inputs (never zeros, except the zero groups a case asks for) and compares the
Triton kernel with a torch reference in float64 (float32 on a GPU, no tf32), ‖out − ref‖ / ‖ref‖
per 128-column output block (so a block with tiny scales is checked as closely as one with
large ones), and runs each kernel twice (the results must be bit-identical).

Tolerances. fp32 activations: 1e-5 (fp32 accumulation; measured ~3e-7). bf16 outputs: 8e-3 (one
bf16 rounding of the output, ~1.6e-3 rms; the interpreter truncates fp32 -> bf16, which doubles
it). w8a8 rounds the activations to e4m3 on purpose, so it is checked against the reference run
on the same quantized activations (`quantize_fp8_groups_reference`, bit-identical to the kernel's
quantizer) at the tolerances above, and against the exact reference at 6e-2 (3 mantissa bits:
measured ~2.5e-2). At decode sizes (`fp8_act.two_terms`) the activations carry a second e4m3 term,
emulated the same way (`emulate_groups`), and the exact reference must then hold to 1e-2.

On a GPU the FP8 tensor cores accumulate a product's partial sums with fewer bits than fp32 (about
14: DeepSeek-V3 §3.3.2, why each 128-wide K block is promoted to fp32 CUDA-core sums). Measured
on the H200: fp32-output w8a8 differs from the same-rounding fp32 emulation by 1.27-1.30e-4 on
every shape and activation kind, for our Triton kernel and cuBLAS's blockwise GEMM alike, so
`FP8_MMA_TOL` (2.5e-4) replaces 1e-5 there. In the MoE, those differences move some h elements
across an e4m3 rounding boundary before the down projection (one e4m3 step is 6-12% of the
element), so the GPU's w8a8 MoE is held to the bf16 tolerance against its emulation."""

from __future__ import annotations

import math

import torch

from glm53.kernels.fp8_quant import (
    AMAX_EPS,
    FP8_MAX,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    quantize_residual_reference,
)

FP8_MMA_TOL = 2.5e-4  # fp32-output w8a8 on a GPU against its fp32 emulation (docstring)

# GLM-5 linear layers per tensor-parallel rank at tp = 8, (N, K) of W [N, K] (widths from
# tools/make_slice.py: hidden 6144, q_lora 2048, kv_lora 512 + rope 64, 64 heads of qk 192 + 64 and
# v 256, indexer 32 heads x 128, dense intermediate 12288, expert intermediate 2048, one shared
# expert). Heads and intermediate widths split by 8; the latent projections and indexer are
# replicated.
GLM5_TP8_LINEARS = {
    "q_a_proj": (2048, 6144),
    "kv_a_proj_with_mqa": (576, 6144),  # 4.5 blocks: a partial row block
    "q_b_proj": (8 * 256, 2048),
    "kv_b_proj": (8 * (192 + 256), 512),
    "o_proj": (6144, 8 * 256),
    "indexer.wq_b": (32 * 128, 2048),
    "indexer.wk": (128, 6144),
    "mlp.gate_up (dense)": (2 * 12288 // 8, 6144),
    "mlp.down (dense)": (6144, 12288 // 8),
    "shared_experts.gate_up": (2 * 2048 // 8, 6144),
    "shared_experts.down": (6144, 2048 // 8),
}
GLM5_TP8_EXPERTS = dict(E=256, H=6144, I=2048 // 8, k=8)


def _ref_dtype(device) -> torch.dtype:
    return torch.float32 if torch.device(device).type == "cuda" else torch.float64


def block_rel_errs(out: torch.Tensor, ref: torch.Tensor, block: int = 128) -> list[float]:
    """‖out − ref‖ / ‖ref‖ of every 128-column block of the output (finite, no NaN)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    o, r = out.to(ref.dtype), ref
    errs = []
    for c in range(0, ref.shape[-1], block):
        rb = r[..., c : c + block]
        errs.append(((o[..., c : c + block] - rb).norm() / rb.norm().clamp_min(1e-300)).item())
    return errs


def scale_factors(shape, kind: str, device) -> torch.Tensor:
    """Multipliers for a weight's block scales: "normal" 1; "tiny" ~1e-6 and "large" ~1e3 (times
    U(0.5, 2)); "mixed" log-uniform over [1e-6, 1e3] per block."""
    if kind == "normal":
        return torch.ones(shape, device=device)
    if kind == "mixed":
        return torch.exp(torch.empty(shape, device=device).uniform_(math.log(1e-6), math.log(1e3)))
    base = {"tiny": 1e-6, "large": 1e3}[kind]
    return base * torch.exp(torch.empty(shape, device=device).uniform_(math.log(0.5), math.log(2.0)))


def block_weight(N: int, K: int, kind: str = "normal", device="cpu", lead: tuple = ()):
    """Random block-FP8 weight (q [*lead, N, K] e4m3, scale [*lead, ceil(N/128), ceil(K/128)] fp32):
    a fan-in-scaled Gaussian quantized, its scales multiplied by `scale_factors(kind)`."""
    q, s = quantize_fp8_blocks(torch.randn(*lead, N, K, device=device) * K**-0.5)
    return q, (s * scale_factors(s.shape, kind, device)).contiguous()


def activations(M: int, K: int, dtype, kind: str = "normal", device="cpu") -> torch.Tensor:
    """x [M, K]: Gaussian ("normal"), or ("ranges") every 1×128 group at its own magnitude,
    log-uniform over [1e-6, 1e3], with one group of zeros (of several)."""
    x = torch.randn(M, K, device=device)
    if kind == "ranges":
        g = -(-K // 128)
        mag = torch.exp(torch.empty(M, g, device=device).uniform_(math.log(1e-6), math.log(1e3)))
        x = x * mag.repeat_interleave(128, dim=1)[:, :K]
        assert M * g > 1, "one group only: it would be all zeros"
        x[M // 2, 128 * (g // 2) : 128 * (g // 2 + 1)] = 0.0
    return x.to(dtype)


def emulate_groups(x: torch.Tensor, lo: bool) -> torch.Tensor:
    """x [M, K] as a w8a8 product reads it: its 1×128 groups dequantized (fp32), plus the second
    term's when `lo`."""
    q, s = quantize_fp8_groups_reference(x)
    y = dequantize_fp8_groups(q, s)
    return y + dequantize_fp8_groups(*quantize_residual_reference(x, q, s)) if lo else y


def check_second_term(rows, dense: torch.Tensor, rounding: float | None = None) -> None:
    """An `Fp8Rows` that must carry the second term (m <= TWO_TERM_MAX_M): its codes as
    `quantize_residual_reference` writes them from `dense` (on a GPU, whose multiply-add may round
    the residual differently, within one code step), and both terms within 2^-7 of each dense
    element (one term: 2^-4) plus the subnormal floors. `rounding`: `dense` is the torch
    reference's value, up to that relative rounding from what the kernel quantized (codes not
    compared)."""
    assert rows.q_lo is not None and rows.scale_lo.stride() == rows.scale.stride(), "no second term"
    q, s = rows.rows()
    ql, sl = rows.lo_rows()
    qr, sr = quantize_residual_reference(dense, q, s)
    k = dense.shape[1]
    if rounding is None and q.device.type == "cuda":
        lo, lo_ref = dequantize_fp8_groups(ql, sl), dequantize_fp8_groups(qr, sr)
        # codes one e4m3 step apart at most (the largest step: 32 codes), under scales that may
        # differ in the last place: |ql·sl - qr·sr| <= 32·sl + 448·|sl - sr|
        bound = (sl * 32 + (sl - sr).abs() * 448) * (1 + 2.0**-20)
        step = bound.repeat_interleave(128, dim=1)[:, :k]
        assert torch.all((lo - lo_ref).abs() <= step), ((lo - lo_ref).abs() - step).max()
    elif rounding is None:
        assert torch.equal(sl, sr), "second-term scales differ from the reference"
        assert torch.equal(ql.view(torch.uint8), qr.view(torch.uint8)), \
            f"{(ql.view(torch.uint8) != qr.view(torch.uint8)).sum().item()} second-term codes differ"
    y = dense.float()
    se = s.repeat_interleave(128, dim=1)[:, :k]
    err = (rows.dequantize() - y).abs()
    assert torch.all(err <= y.abs() * (2.0**-7 + (rounding or 0.0)) + se * 2.0**-12), \
        (err / y.abs().clamp_min(1e-30)).max()


# ---- activation quantization ------------------------------------------------------------------
def check_quant(M: int, K: int, dtype, device="cpu", kind="ranges", group=128) -> None:
    """The dispatched quantizer (Triton here) bit-identical to the reference; the round-trip bound
    of fp8_quant's docstring; each nonzero group's largest element at ±448; zero groups -> q = 0
    with the floor scale, nothing NaN."""
    x = activations(M, K, dtype, kind, device)
    q, s = quantize_fp8_groups(x, group)
    qr, sr = quantize_fp8_groups_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (M, K) and s.shape == (M, -(-K // group))
    assert torch.equal(s, sr), "scales differ from the reference"
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), \
        f"{(q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()} e4m3 codes differ from the reference"
    xf = x.float()
    deq = dequantize_fp8_groups(q, s, group)
    s_el = s.repeat_interleave(group, dim=1)[:, :K]
    bound = xf.abs() * 2.0**-4 + s_el * 2.0**-10 + xf.abs() * 1e-6
    assert torch.all((deq - xf).abs() <= bound), (deq - xf).abs().max()
    amax = torch.nn.functional.pad(q.float().abs(), (0, s.shape[1] * group - K)).view(M, -1, group).amax(-1)
    zero = torch.nn.functional.pad(xf.abs(), (0, s.shape[1] * group - K)).view(M, -1, group).amax(-1) == 0
    assert torch.all(amax[~zero] == FP8_MAX), "a group's largest element must map to ±448"
    assert torch.all(amax[zero] == 0) and torch.all(s[zero] == torch.tensor(AMAX_EPS) / FP8_MAX)
    if kind == "ranges":
        assert zero.any(), "the case must hold a zero group"
    assert not torch.isnan(deq).any()


# ---- GEMM -------------------------------------------------------------------------------------
def check_gemm(M, N, K, dtype, variant, w_kind="normal", x_kind="normal", device="cpu", config=None,
               out_dtype=None, lo: bool | None = None) -> float:
    """The Triton variant ("w8a16" / "w8a8", or "dispatch": the public `fp8_gemm`) against the
    dequantized reference; returns the largest per-block error. `lo`: w8a8's second term (default
    the dispatcher's rule, `two_terms(M)`)."""
    from glm53.kernels.fp8_act import two_terms
    from glm53.kernels.fp8_gemm import fp8_gemm, fp8_variant
    from glm53.kernels.fp8_gemm_cublas import fp8_gemm_cublas
    from glm53.kernels.fp8_gemm_triton import fp8_gemm_w8a8, fp8_gemm_w8a16

    q, s = block_weight(N, K, w_kind, device)
    x = activations(M, K, dtype, x_kind, device)
    out_dtype = out_dtype or dtype
    if variant == "dispatch":
        run = lambda: fp8_gemm(x, q, s, out_dtype)  # noqa: E731
        variant = fp8_variant(M, N, K, x.device)
    elif variant == "cublas":
        run = lambda: fp8_gemm_cublas(x, q, s, out_dtype)  # noqa: E731
    elif variant == "w8a16":
        run = lambda: fp8_gemm_w8a16(x, q, s, out_dtype, config=config)  # noqa: E731
    else:
        run = lambda: fp8_gemm_w8a8(x, q, s, out_dtype, config=config, lo=lo)  # noqa: E731
    lo = variant == "w8a8" and (two_terms(M) if lo is None else lo)
    y = run()
    assert y.shape == (M, N) and y.dtype == out_dtype
    rd = _ref_dtype(device)
    w = dequantize_fp8_blocks(q, s, dtype=rd)
    exact = x.to(rd) @ w.t()
    tol = 1e-5 if out_dtype == torch.float32 and dtype == torch.float32 else 8e-3
    if variant in ("w8a8", "cublas"):
        emulated = emulate_groups(x, lo).to(rd) @ w.t()
        errs = block_rel_errs(y, emulated)
        if torch.device(device).type == "cuda":  # the FP8 tensor cores' accumulation (docstring)
            tol = max(tol, FP8_MMA_TOL)
        assert max(errs) <= tol, f"{variant} against the same quantized activations (lo={lo}): {errs}"
        if x_kind == "normal":  # the price of e4m3 activations (with "ranges", group-dependent)
            loose = block_rel_errs(y, exact)
            assert max(loose) <= (1e-2 if lo else 6e-2), (lo, loose)
    else:
        errs = block_rel_errs(y, exact)
        assert max(errs) <= tol, f"{variant}: {errs}"
    if torch.device(device).type == "cuda":  # (the interpreter runs programs one by one)
        assert torch.equal(run(), y), "two runs differ: the result must be deterministic"
    return max(errs)


# ---- fused MoE --------------------------------------------------------------------------------
def moe_fp8_inputs(N, H, I, E, k, dtype, device="cpu", n_empty=0, fused=False, kind="normal", ids_dtype=torch.int64):
    """Fresh random routed-expert inputs with block-FP8 experts: (x, weights, ids, gate, gate_scale,
    up, up_scale, down, down_scale); fused -> gate is [E, 2I, H] and up/up_scale are None."""
    from .cases import moe_inputs

    x, weights, ids, _, _, _ = moe_inputs(N, 8, 8, E, k, torch.float32, device, n_empty, ids_dtype)
    x = torch.randn(N, H, device=device).to(dtype)
    if fused:
        gate, gs = block_weight(2 * I, H, kind, device, lead=(E,))
        up = us = None
    else:
        gate, gs = block_weight(I, H, kind, device, lead=(E,))
        up, us = block_weight(I, H, kind, device, lead=(E,))
    down, ds = block_weight(H, I, kind, device, lead=(E,))
    return x, weights, ids, gate, gs, up, us, down, ds


def _moe_emulated(inputs, quant: bool, rd, lo: bool = False) -> torch.Tensor:
    """Per-expert loop in `rd`: the exact dequantized reference (quant=False), or with x and h
    rounded per 1×128 group as the w8a8 kernels round them (quant=True; two terms where `lo`)."""
    x, weights, ids, gate, gs, up, us, down, ds = inputs
    if up is None:
        I = gate.shape[1] // 2
        gu = dequantize_fp8_blocks(gate, gs, dtype=rd)
        g, u = gu[:, :I], gu[:, I:]
    else:
        g, u = dequantize_fp8_blocks(gate, gs, dtype=rd), dequantize_fp8_blocks(up, us, dtype=rd)
    d = dequantize_fp8_blocks(down, ds, dtype=rd)

    def q(t):
        return emulate_groups(t.float(), lo).to(rd) if quant else t.to(rd)

    xr = q(x)
    out = torch.zeros(x.shape, dtype=rd, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = torch.nn.functional.silu(xr[tok] @ g[e].t()) * (xr[tok] @ u[e].t())
        out.index_add_(0, tok, weights[tok, j, None].to(rd) * (q(h) @ d[e].t()))
    return out


def check_moe_fp8(N, H, I, E, k, dtype, variant, device="cpu", n_empty=0, fused=False, kind="normal",
                  config=None, ids_dtype=torch.int64, lo: bool | None = None) -> float:
    """The fused FP8 MoE (variant "w8a16" / "w8a8", or "dispatch": the public `moe_experts_fp8`)
    against the dequantized reference (w8a8: against the same rounding of x and h, and loosely
    against the exact one); the public reference against the same loop; bit-identical reruns.
    `lo`: w8a8's second term (default the rule, `two_terms(N)`)."""
    from glm53.kernels.fp8_act import two_terms
    from glm53.kernels.moe_fp8 import moe_experts_fp8, moe_experts_fp8_reference, moe_fp8_variant
    from glm53.kernels.moe_fp8_triton import moe_experts_fp8_triton

    inputs = moe_fp8_inputs(N, H, I, E, k, dtype, device, n_empty, fused, kind, ids_dtype)
    if variant == "dispatch":
        run = lambda: moe_experts_fp8(*inputs)  # noqa: E731
        variant = moe_fp8_variant(N, I)
    else:
        run = lambda: moe_experts_fp8_triton(*inputs, variant=variant, config=config, lo=lo)  # noqa: E731
    lo = variant == "w8a8" and (two_terms(N) if lo is None else lo)
    out = run()
    assert out.shape == (N, H) and out.dtype == dtype
    rd = _ref_dtype(device)
    exact = _moe_emulated(inputs, False, rd)
    ref32 = moe_experts_fp8_reference(*(t.float() if t is inputs[0] else t for t in inputs))
    assert max(block_rel_errs(ref32, exact)) <= 1e-5, "the public reference disagrees with the loop"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if variant == "w8a8":
        errs = block_rel_errs(out, _moe_emulated(inputs, True, rd, lo))
        # an h element at an e4m3 rounding tie may round the other way after fp32 sums in another
        # order; on a GPU the tensor cores' accumulation moves more of them (docstring)
        bound = 1e-2 if torch.device(device).type == "cuda" else max(tol, 1e-4)
        assert max(errs) <= bound, f"w8a8 against the same rounding of x and h (lo={lo}): {errs}"
        if kind == "normal":
            loose = block_rel_errs(out, exact)
            assert max(loose) <= (2e-2 if lo else 8e-2), (lo, loose)
    else:
        errs = block_rel_errs(out, exact)
        assert max(errs) <= tol, f"{variant}: {errs}"
    if torch.device(device).type == "cuda":  # (the interpreter runs programs one by one)
        assert torch.equal(run(), out), "two runs differ: the result must be deterministic"
    return max(errs)


# ---- producers that quantize (kernels/fp8_act) ------------------------------------------------
def check_rms_norm_fp8(M: int, D: int, dtype, device="cpu", col0: int = 3, dense: bool = True) -> None:
    """RMSNorm quantized in one pass: its codes and scales bit-identical to `quantize_fp8_groups` of
    its own dense output (the same kernel with dense=True), that output within two roundings of
    `rms_norm`'s (the sums of squares run in another order), and the dequantized rows within
    e4m3's bound of the torch reference's. Rows are a column slice (strided, as q_a's output in the
    fused product); the weight spans groups from 1e-6 to 1e3 with one group of zeros."""
    from glm53.kernels.fp8_act import rms_norm_fp8, rms_norm_fp8_reference, two_terms
    from glm53.kernels.norm import rms_norm

    base = (torch.randn(M, col0 + D + 5, device=device) * 3).to(dtype)
    x = base[:, col0 : col0 + D]
    w = activations(1, D, torch.float32, "ranges", device)[0].abs().to(dtype) if D > 128 else \
        (torch.rand(D, device=device) + 0.5).to(dtype)
    y, rows = rms_norm_fp8(x, w, 1e-6, dense=dense)
    assert (y is not None) == dense and rows.m == M and rows.k == D and rows.q.shape[0] % 16 == 0
    if two_terms(M):  # read by the Triton kernels only: row-major
        assert rows.scale.stride(1) == 1 and rows.scale_lo.stride(1) == 1, "two-term scales row-major"
    else:
        assert rows.scale.stride(0) == 1, "scales column-major (cuBLAS's layout)"
    if y is None:
        y = rms_norm_fp8(x, w, 1e-6, dense=True)[0]
    tol = 1e-6 if dtype == torch.float32 else 2.0**-6  # n's rounding and y's (the interpreter truncates)
    ref_y = rms_norm(x, w, 1e-6)
    assert y.dtype == ref_y.dtype and torch.all((y.float() - ref_y.float()).abs() <= ref_y.float().abs() * tol), \
        ((y.float() - ref_y.float()).abs() / ref_y.float().abs().clamp_min(1e-30)).max()
    q_own, s_own = quantize_fp8_groups(y)
    q, s = rows.rows()
    assert torch.equal(s, s_own), "scales differ from quantize_fp8_groups of the kernel's own norm"
    assert torch.equal(q.view(torch.uint8), q_own.view(torch.uint8)), \
        f"{(q.view(torch.uint8) != q_own.view(torch.uint8)).sum().item()} codes differ"
    _, exact = rms_norm_fp8_reference(x, w, 1e-6)
    xs = exact.scale[:M].repeat_interleave(128, dim=1)[:, :D]
    deq, deq_ref = rows.dequantize(), exact.dequantize()
    assert torch.all((deq - deq_ref).abs() <= deq_ref.abs() * (2 * tol + 2.0**-3) + xs * 2.0**-9), \
        (deq - deq_ref).abs().max()
    assert (rows.q_lo is not None) == two_terms(M) == (exact.q_lo is not None)
    if rows.q_lo is not None:
        check_second_term(rows, y)


def check_silu_mul_fp8(M: int, inter: int, dtype, device="cpu") -> None:
    """SwiGLU quantized in one pass against the torch reference (silu(gate) · up, then the groups):
    scales within two roundings of the dtype, values within e4m3's bound; gate and up are the two
    halves of one fused product's output (strided rows)."""
    from glm53.kernels.fp8_act import silu_mul_fp8, silu_mul_fp8_reference, two_terms

    pad = -inter % 128 + 128  # up starts at a whole 128-row block, as FusedLinear pads members
    gu = activations(M, inter + pad + inter, torch.float32, "normal", device) * 4
    gu[:, inter + pad :] *= torch.exp(torch.empty(M, 1, device=device).uniform_(math.log(1e-4), math.log(1e2)))
    gu = gu.to(dtype)
    gate, up = gu[:, :inter], gu[:, inter + pad :]
    rows = silu_mul_fp8(gate, up)
    ref = silu_mul_fp8_reference(gate, up)
    assert rows.m == M and rows.k == inter and rows.dtype == dtype
    s, s_ref = rows.rows()[1], ref.rows()[1]
    # bf16: two roundings (silu, the product), each up to 2^-7 where the interpreter truncates
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6
    assert torch.all((s - s_ref).abs() <= s_ref * tol + 1e-30), ((s - s_ref).abs() / s_ref).max()
    h = (torch.nn.functional.silu(gate) * up).float()
    deq = rows.dequantize()
    se = s_ref.repeat_interleave(128, dim=1)[:, :inter]
    assert torch.all((deq - h).abs() <= h.abs() * (2.0**-4 + 2 * tol) + se * 2.0**-9), (deq - h).abs().max()
    if torch.device(device).type == "cuda":
        assert torch.equal(silu_mul_fp8(gate, up).q.view(torch.uint8)[:M], rows.q.view(torch.uint8)[:M])
    assert (rows.q_lo is not None) == two_terms(M)
    if rows.q_lo is not None:  # against the first term's input: h as the kernel rounded it
        check_second_term(rows, h, rounding=2 * tol)


def check_uv_product_fp8(M: int, H: int, V: int, R: int, dtype, device="cpu", **config) -> None:
    """The absorbed attention's output product quantized in its own pass (`uv_product_fp8`)
    against the batched product then its groups: scales within two roundings of the dtype (the
    product's sum runs in another order), values within e4m3's bound, the second term where
    `two_terms`; W_UV is a strided slice of a kv_b-shaped weight, heads of unequal scale."""
    from glm53.kernels.fp8_act import uv_product_fp8, uv_product_fp8_triton

    nope = 48
    o_lat = (torch.randn(M, H, R, device=device) * 2).to(dtype)
    w = torch.randn(H, nope + V, R, device=device) * R**-0.5
    w *= torch.exp(torch.empty(H, 1, 1, device=device).uniform_(math.log(1e-3), math.log(1e2)))
    w_uv = w.to(dtype)[:, nope:]
    rows = uv_product_fp8_triton(o_lat, w_uv, **config) if config else uv_product_fp8(o_lat, w_uv)
    check_uv_rows(rows, o_lat, w_uv)
    if torch.device(device).type == "cuda" and not config.get("row"):  # the row kernel sums in another order
        assert torch.equal(uv_product_fp8(o_lat, w_uv).q.view(torch.uint8)[:M], rows.q.view(torch.uint8)[:M])


def check_uv_rows(rows, o_lat: torch.Tensor, w_uv: torch.Tensor) -> None:
    """A W_UV product's quantized rows against the batched product of o_lat, then its groups."""
    from glm53.kernels.fp8_act import _pack, two_terms, uv_product_reference

    M, H, _ = o_lat.shape
    V, dtype = w_uv.shape[1], o_lat.dtype
    y = uv_product_reference(o_lat, w_uv)
    ref = _pack(y)
    assert rows.m == M and rows.k == H * V and rows.dtype == dtype
    s, s_ref = rows.rows()[1], ref.rows()[1]
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6
    assert torch.all((s - s_ref).abs() <= s_ref * tol + 1e-30), ((s - s_ref).abs() / s_ref).max()
    yf = y.float()
    deq = rows.dequantize()
    se = s_ref.repeat_interleave(128, dim=1)
    assert torch.all((deq - yf).abs() <= yf.abs() * (2.0**-4 + 2 * tol) + se * 2.0**-9), (deq - yf).abs().max()
    assert (rows.q_lo is not None) == two_terms(M)
    if rows.q_lo is not None:
        check_second_term(rows, yf, rounding=2 * tol)


def check_uv_takes_splits(T: int, H: int, R: int, P: int, K: int, V: int, num_splits: int | None = None,
                          fp8_cache: bool = False, device="cpu") -> None:
    """The W_UV product given the attention's splits uncombined (`Splits`, `fp8_act.UV_SPLITS_MAX_ROWS`)
    against the attention combined by its own launch, then the product: o_lat's rows, the codes and
    the scales equal bit for bit (the two sum the splits in one code, `combine_row`). Rows as
    `cases.selected_slots` makes them (holes, fewer than K, none from three rows on); the splits'
    output buffer starts as NaN, so a row the product did not combine shows. `fp8_cache`: the
    attention over an FP8 latent cache."""
    from glm53.kernels.fp8_act import uv_product_fp8_triton
    from glm53.kernels.sparse_mla import sparse_mla
    from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton
    from glm53.kernels.sparse_mla_triton import Splits, sparse_mla_triton
    from tests.kernels.cases import _paged_pool, fp8_latent_pool, selected_slots

    page_size = 16
    num_pages = (2 * K + page_size - 1) // page_size * T + 1
    if fp8_cache:
        kv = fp8_latent_pool(num_pages, page_size, R, P, device=device)[0]
    else:
        kv = _paged_pool(num_pages, 2, page_size, R + P, torch.bfloat16, device)
    # the given split count on the portable kernels, else the public op (the Hopper kernels on sm_90)
    attend = sparse_mla if num_splits is None else sparse_mla_fp8_triton if fp8_cache else sparse_mla_triton
    q = torch.randn(T, H, R + P, device=device).bfloat16()
    idx = selected_slots(T, K, num_pages * page_size, device)
    w = torch.randn(H, 48 + V, R, device=device) * R**-0.5
    w_uv = w.bfloat16()[:, 48:]
    kw = {} if num_splits is None else {"num_splits": num_splits}
    splits = attend(q, kv, idx, (R + P) ** -0.5, R, keep_splits=True, **kw)
    assert isinstance(splits, Splits) and splits.num_splits > 1, type(splits)
    splits.out.fill_(float("nan"))
    fused = uv_product_fp8_triton(splits, w_uv)
    dense = attend(q, kv, idx, (R + P) ** -0.5, R, **kw)
    assert torch.equal(splits.out, dense)
    ref = uv_product_fp8_triton(dense, w_uv)
    assert (fused.lo_rows() is None) == (ref.lo_rows() is None)
    for got, want in ((fused.rows(), ref.rows()), (fused.lo_rows() or (), ref.lo_rows() or ())):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # codes and fp32 scales, bit for bit


def check_uv_row_takes_splits(H: int, R: int, P: int, K: int, V: int, num_splits: int, fp8_cache: bool = False,
                              device="cpu") -> None:
    """One token's row kernel (`fp8_act._uv_row_kernel`) given the attention's splits uncombined:
    its rows against the batched product of the attention combined by its own launch (the row
    kernel combines chunk by chunk, so o_lat may differ from the combine's by a rounding of the
    sum: the product's tolerance covers it), and given that combined o_lat the same check."""
    from glm53.kernels.fp8_act import uv_product_fp8_triton
    from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton
    from glm53.kernels.sparse_mla_triton import Splits, sparse_mla_triton
    from tests.kernels.cases import _paged_pool, fp8_latent_pool, selected_slots

    page_size = 16
    num_pages = (2 * K + page_size - 1) // page_size + 1
    if fp8_cache:
        kv = fp8_latent_pool(num_pages, page_size, R, P, device=device)[0]
    else:
        kv = _paged_pool(num_pages, 2, page_size, R + P, torch.bfloat16, device)
    attend = sparse_mla_fp8_triton if fp8_cache else sparse_mla_triton
    q = torch.randn(1, H, R + P, device=device).bfloat16()
    idx = selected_slots(1, K, num_pages * page_size, device)
    w = torch.randn(H, 48 + V, R, device=device) * R**-0.5
    w *= torch.exp(torch.empty(H, 1, 1, device=device).uniform_(math.log(1e-3), math.log(1e2)))
    w_uv = w.bfloat16()[:, 48:]
    splits = attend(q, kv, idx, (R + P) ** -0.5, R, keep_splits=True, num_splits=num_splits)
    assert isinstance(splits, Splits) and splits.num_splits > 1, type(splits)
    dense = attend(q, kv, idx, (R + P) ** -0.5, R, num_splits=num_splits)
    check_uv_rows(uv_product_fp8_triton(splits, w_uv, row=True), dense, w_uv)
    check_uv_rows(uv_product_fp8_triton(dense, w_uv, row=True, block_r=32, num_warps=2), dense, w_uv)


def check_gemm_rows(M: int, N: int, K: int, device="cpu") -> None:
    """A product of rows a producer quantized (`fp8_gemm_rows`: a padded buffer, scales
    column-major, or row-major with the second term) against the same product quantizing the producer's dense output itself (`fp8_gemm`):
    bit-identical, the variant either way being the dispatcher's."""
    from glm53.kernels.fp8_act import rms_norm_fp8
    from glm53.kernels.fp8_gemm import fp8_gemm, fp8_gemm_rows

    q, s = block_weight(N, K, "mixed", device)
    x = activations(M, K, torch.bfloat16, "normal", device)
    w = torch.rand(K, device=device).to(torch.bfloat16) + 0.5
    y, rows = rms_norm_fp8(x, w, 1e-6, dense=True)
    out = fp8_gemm_rows(rows, q, s, torch.bfloat16)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_gemm(y, q, s, torch.bfloat16))


def check_moe_rows(N: int, H: int, I: int, E: int, k: int, device="cpu") -> None:
    """The routed experts' w8a8 kernel reading x as its norm quantized it (`Fp8Rows`: a padded
    buffer, its scales in `empty_rows`' layout) against the same kernel quantizing x itself: bit-identical."""
    from glm53.kernels.fp8_act import rms_norm_fp8
    from glm53.kernels.moe_fp8_triton import moe_experts_fp8_triton

    inputs = list(moe_fp8_inputs(N, H, I, E, k, torch.bfloat16, device))
    w = (torch.rand(H, device=device) + 0.5).to(torch.bfloat16)
    y, rows = rms_norm_fp8(inputs[0], w, 1e-6, dense=True)
    inputs[0] = y
    out = moe_experts_fp8_triton(*inputs, variant="w8a8", x_fp8=rows.rows(), x_lo=rows.lo_rows())
    assert torch.equal(out, moe_experts_fp8_triton(*inputs, variant="w8a8"))


def check_add_norms(M: int, D: int, dtype, device="cpu") -> None:
    """The residual add fused into the norm after it (`add_rms_norm`, `add_rms_norm_fp8`) against
    the add and the norm run apart: the sum as torch's add rounds it, and the norm, codes and
    scales bit-identical to the norms of that sum run alone."""
    from glm53.kernels.fp8_act import add_rms_norm_fp8, rms_norm_fp8
    from glm53.kernels.norm import add_rms_norm, rms_norm

    base = (torch.randn(M, D + 7, device=device) * 3).to(dtype)
    x = base[:, 2 : 2 + D]  # strided rows
    a = (torch.randn(M, D, device=device) * 2).to(dtype)
    w = (torch.rand(D, device=device) + 0.5).to(dtype)
    s_ref = x + a
    s, y = add_rms_norm(x, a, w, 1e-6)
    # the sum: as torch's add (the interpreter's fp32 -> bf16 cast truncates: one unit there)
    ulp = 0.0 if dtype == torch.float32 or torch.device(device).type == "cuda" else 2.0**-7
    assert torch.all((s.float() - s_ref.float()).abs() <= s_ref.float().abs() * ulp), "the residual sum"
    assert torch.equal(y, rms_norm(s, w, 1e-6)), "the norm of the sum"
    s8, y8, rows = add_rms_norm_fp8(x, a, w, 1e-6, dense=True)
    y_ref, rows_ref = rms_norm_fp8(s, w, 1e-6, dense=True)
    assert torch.equal(s8, s) and torch.equal(y8, y_ref)
    assert torch.equal(rows.rows()[1], rows_ref.rows()[1])
    assert torch.equal(rows.rows()[0].view(torch.uint8), rows_ref.rows()[0].view(torch.uint8))


def split_fp8_checkpoint(path, monkeypatch, seed: int, widths: dict | None = None):
    """A tiny block-FP8 checkpoint at `path` (`widths`, default the oracle's FP8 widths), with
    split-K forced on the Triton GEMM's products (at these widths the decode products would not
    split): for the checks of the sums `row_parts` leaves to the norms."""
    import dataclasses

    import glm53.kernels.fp8_gemm_triton as gemm_mod
    from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_

    make_checkpoint(path, seed=seed, **(widths or FP8_WIDTHS))
    quantise_fp8_(path, block=128)
    split = gemm_mod.default_config
    monkeypatch.setattr(gemm_mod, "default_config", lambda *a, **kw: dataclasses.replace(split(*a, **kw), SPLIT_K=2))


def take_sums_eagerly(monkeypatch) -> None:
    """Each split-K and slot sum taken by its own launch, as before `row_parts`."""
    import glm53.kernels.fp8_gemm_triton as gemm_mod
    import glm53.kernels.moe_fp8_gemv_triton as gemv_mod
    import glm53.kernels.moe_fp8_triton as moe_fp8_mod
    from glm53.kernels.moe_triton import sum_slots
    from glm53.kernels.row_parts import sum_parts_triton

    monkeypatch.setattr(gemm_mod, "RowParts", sum_parts_triton)
    for mod in (moe_fp8_mod, gemv_mod):  # the tile kernels' and the per-pair GEMVs'
        monkeypatch.setattr(mod, "slot_parts", lambda y, n, k: sum_slots(y, n, k))
