"""Triton fused MoE: routed experts as two grouped GEMMs over expert-sorted (token, slot) pairs.

    out[t] = Σ_j w[t, j] · down[e] · (silu(gate[e] · x[t]) ⊙ (up[e] · x[t])),   e = ids[t, j]

Layout, all of it computed on the device (no host sync, so the op can sit in a CUDA graph):

- The N·k (token, slot) pairs are sorted by expert, stably: `seg[e] .. seg[e+1]` are expert
  e's pairs in sorted order. An expert's segment is cut into row blocks of BM pairs; block b of
  the launch belongs to the expert whose cumulative block count first exceeds b. One launch
  (`_plan_kernel`, a program per expert: a counting sort) writes the order, the segments and
  those cumulative counts; `sort_pairs` (`torch.sort` + `searchsorted`) is its reference. Each
  GEMM program finds its expert with one comparison over the E counts, so there is no padded
  index array to build (and no nested jit helpers beyond `block_tile`, once per program). The grid is sized by the bound
  Σ_e ⌈c_e / BM⌉ ≤ ⌈N·k / BM⌉ + min(E, N·k); programs past the real count return at once.
  `plan_routing` builds this plan (`RoutingPlan`) and `block_tile` reads it inside a kernel: the
  block-FP8 kernels (`moe_fp8_triton.py`) run on the same two.
- Kernel 1 (gate+up): a program computes a [BM, BN] tile of gate·x and of up·x over the same
  gathered x rows (one A tile feeds two products), applies silu(g)·u in fp32 and stores it in
  the input dtype at the pairs' sorted positions: h [N·k, I].
- Kernel 2 (down): h rows of one block (contiguous) times down[e]^T, scaled by the pairs'
  routing weights in fp32, stored at the pair's own index (t·k + j): y [N·k, H].
- The k rows of each token are summed in fp32 in slot order (`sum_slots`, one launch): a second
  pass instead of atomics, so the result is deterministic (bit-identical from run to run).

Weights are read K-contiguous ([E, I, H] and [E, H, I] as stored), the B tile loaded as its
transpose. Out-of-range columns are read modulo the width (always in bounds, never stored) so
the weight loads need no mask; K is masked only when it is not a multiple of BK.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting
from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.row_parts import RowParts, sum_parts_triton


@dataclass(frozen=True)
class MoEConfig:
    """Tile shapes and schedule: BM pairs per row block; BN1/BN2 output columns of the gate+up
    and the down kernel; BK the K step; GROUP_M row blocks swept per column tile before moving on
    (keeps the weight tiles of one column stripe hot in L2 while the row blocks stream past);
    SPLIT_K slices of the gate+up kernel's K (block-FP8 kernel only: decode, few tiles for the SMs)."""

    BM: int
    BN1: int
    BN2: int
    BK: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1
    SWAP: bool = False  # block-FP8 kernels: the weight tile as the product's left operand
    # block-FP8 kernels: the down kernel launched while gate+up runs (programmatic dependent
    # launch), the first PREFETCH bytes of each of its weight rows put into L2 before it waits
    PDL: bool = False
    PREFETCH: int = 0


def default_config(n_pairs: int, n_experts: int, dtype: torch.dtype) -> MoEConfig:
    """Tiles by the expected rows per expert: few rows (decode) -> small BM (the wasted padded
    rows are free, the weights are what is read) and long K steps for wide weight streams; many
    rows (prefill) -> 128-row tiles that make the products compute-bound."""
    if triton_interpreting():
        # the interpreter's cost is per program and per K step: few, large tiles
        return MoEConfig(BM=64, BN1=64, BN2=64, BK=64, GROUP_M=4, num_warps=1, num_stages=1)
    rows = n_pairs / max(1, n_experts)
    # shared memory per pipeline stage (bf16), gate+up kernel: BM·BK·2 + 2·BK·BN1·2 bytes;
    # fp32 operands take twice as much, so they halve the K step
    half = 2 if dtype == torch.float32 else 1
    if rows <= 16:  # 36 KB a stage
        return MoEConfig(BM=16, BN1=64, BN2=64, BK=128 // half, num_warps=4, num_stages=4)
    if rows <= 64:  # 40 KB a stage; 0.348 ms against 0.380 with 64x64x128 tiles (H200, N=64, E=16)
        return MoEConfig(BM=64, BN1=128, BN2=128, BK=64 // half, num_warps=4, num_stages=4)
    # 48 KB a stage; two 128x128 fp32 accumulators over 8 warps (128 registers a thread)
    return MoEConfig(BM=128, BN1=128, BN2=128, BK=64 // half, num_warps=8, num_stages=3)


@triton.jit
def zero_blocks(z_ptr, NZ, e, E: tl.constexpr, BLOCK: tl.constexpr):
    """Program e of E zeroes every E-th block of BLOCK of the NZ int32s at z (a plan launch's
    `zeros`)."""
    for z0 in range(e * BLOCK, NZ, E * BLOCK):
        z = z0 + tl.arange(0, BLOCK)
        tl.store(z_ptr + z, tl.zeros([BLOCK], dtype=tl.int32), mask=z < NZ)


@triton.jit
def store_segments(counts, below, e, seg_ptr, cum_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr):
    """Expert e's part of the plan from every expert's pair `counts` [BLOCK_E] (bin E: padding and
    strays) and the pairs of lower experts (`below`): seg[e] (and seg[E] from the last), and
    cum[e] = Σ_{e' <= e} ⌈c_e' / BM⌉."""
    ev = tl.arange(0, BLOCK_E)
    blocks = tl.where(ev < E, (counts + BM - 1) // BM, 0)
    tl.store(cum_ptr + e, tl.sum(tl.where(ev <= e, blocks, 0), 0))
    tl.store(seg_ptr + e, below)
    if e == E - 1:
        tl.store(seg_ptr + E, below + tl.sum(tl.where(ev == e, counts, 0), 0))


# P (the pairs) varies with every batch: not specialized, and the step is fixed, so the config's
# BM alone picks the compiled variant (kernels/variants.py)
@triton.jit(do_not_specialize=["P", "NZ"])
def _plan_kernel(ids_ptr, order_ptr, seg_ptr, cum_ptr, z_ptr, P, NZ, E: tl.constexpr, BLOCK_E: tl.constexpr,
                 BM: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """Program e: expert e's part of the routing plan from the P = N·k ids (a counting sort, in
    one launch where a radix sort, a searchsorted and the casts took six). Pass 1 counts the
    pairs of lower experts (seg[e]) and every expert's pairs (for cum[e] = Σ_{e' <= e}
    ⌈c_e' / BM⌉, the row blocks of experts 0..e); pass 2 writes e's pair indices in ascending
    order from seg[e] (a stable sort). An id outside [0, E) joins no segment. The programs also
    zero the NZ int32s at z (`plan_routing`'s `zeros`), every E-th block of BLOCK_P each."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    e = tl.program_id(0)
    zero_blocks(z_ptr, NZ, e, E, BLOCK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    below = 0
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(ids_ptr + p, mask=p < P, other=E).to(tl.int32)
        v = tl.where((v >= 0) & (v < E), v, E)  # bin E (BLOCK_E > E) holds padding and strays
        below += tl.sum((v < e).to(tl.int32), 0)
        counts += tl.histogram(v, BLOCK_E)
    store_segments(counts, below, e, seg_ptr, cum_ptr, E, BLOCK_E, BM)
    at = below
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        hit = (tl.load(ids_ptr + p, mask=p < P, other=E).to(tl.int32) == e) & (p < P)
        rank = tl.cumsum(hit.to(tl.int32), 0)
        tl.store(order_ptr + at + rank - 1, p, mask=hit)
        at += tl.sum(hit.to(tl.int32), 0)


@triton.jit
def block_tile(pid, n_blocks, n_cols, seg_ptr, cum_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr,
               BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid` of a grouped GEMM over the plan's row blocks -> (e, nt, pos, valid): its
    expert (E for a program past the last block: the caller returns), its column tile, the sorted
    positions of its BM rows and which of them lie inside the expert's segment.

    Grouped order: GROUP_M row blocks walk one column tile, then the next tile, ... so that
    programs running together share the weight tiles they read. Row block b belongs to the first
    expert whose cumulative block count exceeds it."""
    width = GROUP_M * n_cols
    first_b = pid // width * GROUP_M
    local = pid % width
    rows_here = tl.minimum(n_blocks - first_b, GROUP_M)
    b = first_b + local % rows_here
    nt = local // rows_here
    ev = tl.arange(0, BLOCK_E)
    cum = tl.load(cum_ptr + ev, mask=ev < E, other=2147483647)
    e = tl.sum((cum <= b).to(tl.int32), 0)
    ec = tl.minimum(e, E - 1)  # in bounds for a program past the last block (it returns)
    seg_lo = tl.load(seg_ptr + ec)
    seg_hi = tl.load(seg_ptr + ec + 1)
    first = tl.load(cum_ptr + ec) - (seg_hi - seg_lo + BM - 1) // BM
    pos = seg_lo + (b - first) * BM + tl.arange(0, BM)  # sorted positions of the block's rows
    return e, nt, pos, pos < seg_hi


@triton.jit(do_not_specialize=["n_blocks"])  # follows the token count
def _gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, h_ptr, order_ptr, seg_ptr, cum_ptr,
    n_blocks, H, I, TOPK,
    stride_xn, stride_we, stride_wi, stride_hm,
    E: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    e, nt, pos, valid = block_tile(tl.program_id(0), n_blocks, (I + BN - 1) // BN, seg_ptr, cum_ptr,
                                   E, BLOCK_E, BM, GROUP_M)
    if e >= E:  # past the last block (the grid is an upper bound)
        return
    # rows past the expert's segment read pair 0's token (in bounds) and are never stored
    pair = tl.load(order_ptr + pos, mask=valid, other=0)
    tok = (pair // TOPK).to(tl.int64)
    n = nt * BN + tl.arange(0, BN)
    n_in = n % I  # columns past I re-read real rows (no mask); they are not stored
    k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xn + k[None, :]
    w_off = e.to(tl.int64) * stride_we + n_in[None, :].to(tl.int64) * stride_wi + k[:, None]
    g_ptrs = wg_ptr + w_off
    u_ptrs = wu_ptr + w_off
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            kin = (k0 + k) < H
            a = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=kin[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=kin[:, None], other=0.0)
        if DOT_F32:  # the interpreter multiplies bf16 as raw uint16: widen first (exact)
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_ptrs = h_ptr + pos[:, None].to(tl.int64) * stride_hm + n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (n < I)[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(
    h_ptr, wd_ptr, y_ptr, rw_ptr, order_ptr, seg_ptr, cum_ptr,
    n_blocks, H, I,
    stride_hm, stride_we, stride_wh, stride_ym,
    E: tl.constexpr, BLOCK_E: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    e, nt, pos, valid = block_tile(tl.program_id(0), n_blocks, (H + BN - 1) // BN, seg_ptr, cum_ptr,
                                   E, BLOCK_E, BM, GROUP_M)
    if e >= E:  # past the last block (the grid is an upper bound)
        return
    n = nt * BN + tl.arange(0, BN)
    n_in = n % H
    k = tl.arange(0, BK)
    # a last block's rows past the segment (and past N·k) are masked: never read, never stored
    a_ptrs = h_ptr + pos[:, None].to(tl.int64) * stride_hm + k[None, :]
    w_ptrs = wd_ptr + e.to(tl.int64) * stride_we + n_in[None, :].to(tl.int64) * stride_wh + k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            kin = (k0 + k) < I
            a = tl.load(a_ptrs, mask=valid[:, None] & kin[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kin[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BK
        w_ptrs += BK
    pair = tl.load(order_ptr + pos, mask=valid, other=0)
    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
    y = acc * rw[:, None]
    y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (n < H)[None, :])


def slot_parts(y: torch.Tensor, N: int, k: int) -> RowParts:
    """y [N·k, H] (contiguous) as the sum each token's k slot rows make, not taken yet (`row_parts`)."""
    assert y.shape[0] == N * k and y.is_contiguous(), (y.shape, N, k)
    return RowParts(y.view(N, k, y.shape[1]).transpose(0, 1), y.dtype)


def sum_slots(y: torch.Tensor, N: int, k: int) -> torch.Tensor:
    """y [N·k, H] (contiguous) -> [N, H]: each token's k slot rows summed in fp32, slot 0 first,
    rounded once to y's dtype (one launch where torch's sum and cast took two)."""
    return sum_parts_triton(slot_parts(y, N, k).parts, y.dtype)


def sort_pairs(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, seg): `order[p]` is the pair index (t·k + j) at sorted position p (experts
    ascending, tokens ascending within an expert); expert e owns positions seg[e] .. seg[e+1].
    The reference `_plan_kernel` is checked against (torch.sort + searchsorted, on the device)."""
    flat = ids.reshape(-1).to(torch.int32)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    seg = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return order.to(torch.int32), seg


def plan_cum_reference(seg: torch.Tensor, BM: int) -> torch.Tensor:
    """cum[e] = Σ_{e' <= e} ⌈(seg[e'+1] - seg[e']) / BM⌉ (the reference of `_plan_kernel`'s)."""
    return torch.cumsum((seg[1:] - seg[:-1] + BM - 1) // BM, 0).to(torch.int32)


@dataclass(frozen=True)
class RoutingPlan:
    """The device-side routing plan every fused MoE kernel runs on (bf16 here, block-FP8 in
    `moe_fp8_triton`): `order`/`seg` from `sort_pairs`, `cum` the cumulative row blocks of BM
    pairs per expert (`_plan_kernel`), `n_blocks` the grid's bound on Σ_e ⌈c_e / BM⌉."""

    order: torch.Tensor  # [N·k] int32
    seg: torch.Tensor  # [E + 1] int32
    cum: torch.Tensor  # [E] int32
    n_blocks: int
    n_experts: int
    BM: int

    @property
    def block_e(self) -> int:
        return triton.next_power_of_2(self.n_experts)


def block_bound(n_pairs: int, n_experts: int, BM: int) -> int:
    """The grid's bound on Σ_e ⌈c_e / BM⌉ row blocks for n_pairs pairs over n_experts (module docstring)."""
    return triton.cdiv(n_pairs, BM) + min(n_experts, n_pairs)


# pairs a program reads per step: a decode step's (N·k <= 64 × 9) in one
PLAN_BLOCK_P = 1024


def plan_routing(ids: torch.Tensor, n_experts: int, BM: int, zeros: torch.Tensor | None = None) -> RoutingPlan:
    """Sort the (token, slot) pairs of `ids` [N, k] by expert and count BM-row blocks, on the
    device in one launch (`_plan_kernel`; no host sync). `zeros`: a contiguous int32 buffer the
    same launch sets to 0 (the split-K tile counters of the kernel that reads the plan: one fill
    launch fewer)."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    P = flat.numel()
    order = torch.empty(P, dtype=torch.int32, device=ids.device)
    seg = torch.empty(n_experts + 1, dtype=torch.int32, device=ids.device)
    cum = torch.empty(n_experts, dtype=torch.int32, device=ids.device)
    assert zeros is None or (zeros.dtype == torch.int32 and zeros.is_contiguous()), zeros
    _plan_kernel[(n_experts,)](flat, order, seg, cum, seg if zeros is None else zeros, P,
                               0 if zeros is None else zeros.numel(), E=n_experts,
                               BLOCK_E=triton.next_power_of_2(n_experts + 1),
                               BM=BM, BLOCK_P=PLAN_BLOCK_P, num_warps=4, **early_args())
    return RoutingPlan(order, seg, cum, block_bound(P, n_experts, BM), n_experts, BM)


def moe_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """x [N, H]; weights [N, k] (fp32); ids [N, k] (int32/int64, values in [0, E));
    gate/up [E, I, H]; down [E, H, I]; bf16/fp16/fp32 with x's dtype. Returns [N, H] in x's dtype.
    Ids out of range are not checked (that would need a host sync)."""
    N, H = x.shape
    E, I, Hg = gate.shape
    k = ids.shape[1]
    assert Hg == H and up.shape == gate.shape and down.shape == (E, H, I), (x.shape, gate.shape, up.shape, down.shape)
    assert weights.shape == ids.shape == (N, k)
    assert gate.dtype == up.dtype == down.dtype == x.dtype, "x and the expert weights must share a dtype"
    if N == 0:
        return torch.zeros_like(x)
    for w in (gate, up, down):
        assert w.stride(2) == 1 and w.stride(1) == w.shape[2], "expert weights must be contiguous per expert"
    assert gate.stride() == up.stride(), "gate and up must share a layout"
    if x.stride(1) != 1:
        x = x.contiguous()
    M = N * k
    cfg = config or default_config(M, E, x.dtype)
    plan = plan_routing(ids, E, cfg.BM)
    order, seg, cum, n_blocks = plan.order, plan.seg, plan.cum, plan.n_blocks
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((M, I), dtype=x.dtype, device=x.device)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    interp = triton_interpreting()
    common = dict(E=E, BLOCK_E=plan.block_e, BM=cfg.BM, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                  DOT_F32=interp, PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    _gate_up_kernel[(n_blocks * triton.cdiv(I, cfg.BN1),)](
        x, gate, up, h, order, seg, cum, n_blocks, H, I, k,
        x.stride(0), gate.stride(0), gate.stride(1), h.stride(0),
        BN=cfg.BN1, EVEN_K=H % cfg.BK == 0, **common,
    )
    _down_kernel[(n_blocks * triton.cdiv(H, cfg.BN2),)](
        h, down, y, rw, order, seg, cum, n_blocks, H, I,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BN=cfg.BN2, EVEN_K=I % cfg.BK == 0, **common,
    )
    return sum_slots(y, N, k)  # in a fixed order: deterministic
