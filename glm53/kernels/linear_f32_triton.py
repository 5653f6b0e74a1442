"""y = scale * (x @ W^T) in fp32 as one Triton kernel, for a small N (the MoE router, the DSA
indexer's head gates) and a few rows (decode).

torch's form is three launches (x.float(), cuBLAS's gemv as dot + reduce, the scale). Here a
program computes a [BM, BN] tile with its K loop: x read in its own dtype and widened in
registers, W widened likewise (fp32 W as is), IEEE fp32 products summed in fp32 (broadcast
multiply and one sum at the end, not tl.dot: BN < 16, and fp32 tl.dot would round to tf32). No
split of K, so no atomics: the result is deterministic. At one row the cost is reading W, so
columns are spread over programs (BN of 1-2), not rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.launch_early import early_args, wait_then_release

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # either operand, widened in registers



@triton.jit
def _linear_f32_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, scale,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    # one flat grid, column tiles fastest: programs side by side share their x rows in L2
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    rm = (pid // n_tiles) * BM + tl.arange(0, BM)
    rn = (pid % n_tiles) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, mn = rm < M, rn < N
    xp = x_ptr + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
    # per-lane partial sums across the K loop, reduced once at the end (no cross-thread
    # reduction per step)
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        mk = rk < K - k0
        x = tl.load(xp, mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        w = tl.load(wp, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
        xp += BK
        wp += BK
    y = tl.sum(acc, axis=2) * scale
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], y, mask=mm[:, None] & mn[None, :])


def default_tiles(M: int, N: int, K: int, x_size: int = 2, w_size: int = 4,
                  interp: bool | None = None) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for x and w elements of `x_size` and `w_size` bytes;
    `interp` (default: whether Triton interprets) picks the interpreter's tiles."""
    if triton_interpreting() if interp is None else interp:
        # the interpreter pays per program and per loop step, not per lane: few large tiles
        return min(triton.next_power_of_2(M), 64), min(triton.next_power_of_2(N), 32), \
            min(triton.next_power_of_2(K), 512), 4, 1
    # Measured on an H200 at K = 6144 in CUDA graphs, W read from HBM: 2.8 us at M = 1 (torch's
    # three launches: 8.2), 3.5-6 us for M <= 16 (torch 13-24), 19 us at M = 64, N = 256 (22).
    # The K loop is latency-bound: what pays is 3 stages of loads in flight (~25% off), long K
    # steps, and many programs: a column a program (a 16-expert router still spreads its 393 KB
    # over 16 SMs), two once rows repeat, and few rows a program (x re-reads come from L2). BK
    # holds the per-lane accumulator at <= 64 fp32 registers.
    BM = min(triton.next_power_of_2(M), 8 if M >= 8 and N >= 64 else 4)
    BN = 2 if M * N >= 1024 else 1
    warps = 4 if M >= 32 and N >= 64 else 8
    BK = min(triton.next_power_of_2(K), 4096 if BM * BN == 1 else 2048, 64 * 32 * warps // (BM * BN))
    # shared memory for the pipelined loads (fp32 x: up to 48 KB a stage)
    stages = 3 if 3 * BK * (BM * x_size + BN * w_size) <= 160 * 1024 else 2
    return BM, BN, BK, warps, stages


def linear_f32_triton(x: torch.Tensor, w: torch.Tensor, scale: float = 1.0,
                      tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, unit column stride; rows may be strided), w [N, K] (likewise) ->
    scale * (x @ w^T) as a new fp32 [M, N]. `tiles`: (BM, BN, BK, num_warps, num_stages), else
    `default_tiles`."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], f"x {tuple(x.shape)} vs w {tuple(w.shape)}"
    assert x.dtype in DTYPES and w.dtype in DTYPES, f"dtypes x {x.dtype}, w {w.dtype}"
    assert x.stride(1) == 1 and w.stride(1) == 1, f"unit column strides: x {x.stride()}, w {w.stride()}"
    assert x.device == w.device, f"devices x {x.device}, w {w.device}"
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    BM, BN, BK, warps, stages = tiles or default_tiles(M, N, K, x.element_size(), w.element_size())
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _linear_f32_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), float(scale),
                             BM=BM, BN=BN, BK=BK, STAGES=stages, num_warps=warps, **early_args())
    return y
