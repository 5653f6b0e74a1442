"""RMSNorm as one Triton kernel: one program per row, the row in registers.

The torch reference (`norm.rms_norm`) is seven or eight elementwise and reduction kernels; a
decode step runs ~17 norms, so on a launch-bound step this is ~120 launches fewer. The kernel
keeps the reference's order of operations and roundings: normalise in fp32, round to x's dtype,
then multiply by the weight in the promoted dtype (round(float(w) * float(n)))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.grid_sync import count_in_and_wait, count_out, polls
from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.row_parts import RowParts, row_source

# Rows up to which a norm given a sync buffer (`Norm.sync`) spreads each row over programs of
# SPLIT_COLUMNS columns (0: never; `split_row_sum_sq`). One program a row loads a decode row's
# parts (an MoE's slot rows, a split-K product's partials: 6,144 wide, up to ten of them) through
# one SM: 5.5 µs a norm on the H100 where one with nothing to sum takes ~2-3. Off: timed on an
# H100 (2026-12-07), alone only the norm after o_proj's 4 fp32 partials gains (4.7 -> 4.0 µs; q_a's
# 2.1 -> 3.5, the final norm's 2.9 -> 3.7), and the batch-1 step takes 1.009x as long with it on.
SPLIT_MAX_ROWS = 0
SPLIT_COLUMNS = 512  # a power of two, a multiple of fp8_quant.GROUP: a program quantizes whole groups
SPLIT_SPIN = 1 << 16  # polls before a program computes the row's sum alone


def split_chunks(m: int, D: int, sync: torch.Tensor | None) -> int:
    """The programs each of a norm's m rows of D spreads over (`SPLIT_MAX_ROWS`); 1 without `sync`."""
    if sync is None or not 0 < m <= SPLIT_MAX_ROWS or D <= SPLIT_COLUMNS:
        return 1
    return triton.cdiv(D, SPLIT_COLUMNS)


def split_spin() -> int:
    """A split norm's polls (`grid_sync.polls`)."""
    return polls(SPLIT_SPIN)


def added(add: torch.Tensor | RowParts | None, x: torch.Tensor) -> tuple[int, int]:
    """(parts, the stride between them) of a norm's `add`: a tensor is one part, none is (0, 0);
    asserting either one's shape, dtype and unit last stride against x's."""
    if add is None:
        return 0, 0
    assert add.shape == x.shape and add.dtype == x.dtype, (add.shape, add.dtype, x.shape, x.dtype)
    if isinstance(add, RowParts):
        return add.parts.shape[0], add.parts.stride(0)
    assert add.stride(-1) == 1, add.stride()
    return 1, 0


@triton.jit
def load_row(x_ptr, off, mask, stride_xp, XPARTS: tl.constexpr, DT: tl.constexpr):
    """Rows' values at `off` in DT: a tensor's (XPARTS 1: as loaded), or the sum of XPARTS parts
    `stride_xp` apart (`row_parts.row_source`), summed as the parts' own launch would sum them:
    fp32, part 0 first, rounded to DT once."""
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    if XPARTS > 1:
        x = x.to(tl.float32)
        for p in tl.static_range(1, XPARTS):
            x += tl.load(x_ptr + p * stride_xp + off, mask=mask, other=0.0).to(tl.float32)
    return x.to(DT)


@triton.jit
def load_sum(x_ptr, a_ptr, x_off, a_off, mask, ADD: tl.constexpr, stride_ap, PARTS: tl.constexpr, stride_xp,
             XPARTS: tl.constexpr, DT: tl.constexpr):
    """x at `x_off` (`load_row`: XPARTS parts `stride_xp` apart, in the rows' dtype DT); with ADD
    the residual sum x + a instead, rounded to DT as torch's add rounds it. a is PARTS parts
    `stride_ap` apart (`added`: one for a tensor, more for a `row_parts.RowParts`)."""
    x = load_row(x_ptr, x_off, mask, stride_xp, XPARTS, DT)
    if ADD:
        a = load_row(a_ptr, a_off, mask, stride_ap, PARTS, DT)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(DT)
    return x


@triton.jit
def load_residual_sum(x_ptr, a_ptr, s_ptr, x_off, a_off, s_off, mask, ADD: tl.constexpr, stride_ap,
                      PARTS: tl.constexpr, stride_xp, XPARTS: tl.constexpr, DT: tl.constexpr):
    """`load_sum`, the residual sum (with ADD) also written to s: the norms that take the add
    before them (here and `fp8_act`)."""
    x = load_sum(x_ptr, a_ptr, x_off, a_off, mask, ADD, stride_ap, PARTS, stride_xp, XPARTS, DT)
    if ADD:
        tl.store(s_ptr + s_off, x, mask=mask)
    return x


@triton.jit
def sum_sq(x):
    """A [rows, cols] tile's sum of squares in fp32 (the split norm's partials and its own)."""
    xf = x.to(tl.float32)
    return tl.sum(tl.sum(xf * xf, 1), 0)


@triton.jit
def split_row_sum_sq(own, part_ptr, sync_ptr, spin, row, chunk, rel, D, x_ptr, a_ptr, x_base, a_base,
                     ADD: tl.constexpr, stride_ap, PARTS: tl.constexpr, stride_xp, XPARTS: tl.constexpr,
                     DT: tl.constexpr, CHUNK: tl.constexpr, NCP: tl.constexpr):
    """A row's sum of squares where each of its chunks of CHUNK columns is one program's (grid
    [rows, chunks]): `own` (`sum_sq` of this program's chunk) goes to the row's slot `chunk` in
    part_ptr [rows, NCP]; the grid waits for all of them (`grid_sync`, on `Norm.sync`, at most
    `spin` polls); the row's slots are then summed in one order, the same bits in every program
    of the row. A program that waited in vain computes the row's partials itself, for itself only
    (on a GPU, where all of a decode grid's programs run at once, that path is not taken; its sum
    may differ from the slots' in the last place)."""
    n_chunks = tl.cdiv(D, CHUNK)
    total = tl.num_programs(0) * n_chunks
    slots = part_ptr + row * NCP
    tl.store(slots + chunk, own)
    arrived = count_in_and_wait(sync_ptr, total, spin)
    k = tl.arange(0, NCP)
    if arrived < total:
        parts = tl.zeros((NCP,), dtype=tl.float32)
        for j in range(0, n_chunks):
            col = j * CHUNK + rel
            x = load_sum(x_ptr, a_ptr, x_base + col, a_base + col, col < D, ADD, stride_ap, PARTS, stride_xp,
                         XPARTS, DT)
            parts = tl.where(k == j, sum_sq(x), parts)
    else:
        parts = tl.load(slots + k, mask=k < n_chunks, other=0.0, volatile=True)
    ss = tl.sum(parts, 0)
    count_out(sync_ptr, total)
    return ss


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, a_ptr, s_ptr, part_ptr, sync_ptr, D, stride_x, stride_o, stride_a,
                     stride_s, stride_ap, eps, stride_xp, spin, BLOCK_D: tl.constexpr, ADD: tl.constexpr,
                     PARTS: tl.constexpr, XPARTS: tl.constexpr, DT: tl.constexpr, SPLIT: tl.constexpr = False,
                     NCP: tl.constexpr = 1, PDL: tl.constexpr = False):
    """ADD: the residual sum s = x + a (rounded to x's dtype DT, as torch's add) is written to s and
    normalised: one pass where an add and a norm read the sum twice. XPARTS > 1: x is a sum not
    taken yet (`load_row`). SPLIT: BLOCK_D columns a program over a grid [rows, chunks], the row's
    sum of squares gathered through part_ptr and sync_ptr (`split_row_sum_sq`)."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    row = tl.program_id(0).to(tl.int64)
    if SPLIT:
        chunk = tl.program_id(1)
        rel = tl.arange(0, BLOCK_D)[None, :]
        d = chunk * BLOCK_D + rel
    else:
        d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = load_residual_sum(x_ptr, a_ptr, s_ptr, row * stride_x + d, row * stride_a + d, row * stride_s + d, mask, ADD,
                          stride_ap, PARTS, stride_xp, XPARTS, DT)
    xf = x.to(tl.float32)
    if SPLIT:
        ss = split_row_sum_sq(sum_sq(x), part_ptr, sync_ptr, spin, row, chunk, rel, D, x_ptr, a_ptr, row * stride_x,
                              row * stride_a, ADD, stride_ap, PARTS, stride_xp, XPARTS, DT, BLOCK_D, NCP)
    else:
        ss = tl.sum(xf * xf, 0)
    rstd = 1.0 / tl.sqrt(ss / D + eps)
    n = (xf * rstd).to(DT).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def norm_warps(tile: int, reads: int) -> int:
    """A one-row norm's warps: one per 512 values it loads (its tile times the row tensors summed
    into it, x's parts and the add's), a power of two from 1 to 16. One program holds the row, so
    more warps keep more of a split product's parts in flight (H100, one row, graphs of 8 launches:
    2,048 wide over 7 fp32 parts 2.5 µs at 16 warps against 3.8 at the 4 a plain 2,048-wide row
    takes; that row alone 2.0 at 4, 2.2 at 16)."""
    n = tile * reads // 512
    return 1 if n < 2 else min(16, 1 << (n.bit_length() - 1))


def rms_norm_triton(x: torch.Tensor | RowParts, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    add: torch.Tensor | RowParts | None = None, sync: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] with a unit last stride (rows may be strided, e.g. a column slice), or a 2-d
    `RowParts` (its sum taken here); weight [D]. Returns (or writes `out`, which may be x itself)
    in the dtype torch's promotion gives. With `add` (x's shape and dtype, or a `RowParts` of them
    for 2-d x): (s = x + add, the norm of s). `sync` (int32 [2], zero; `Norm.sync`): at decode
    sizes each row is spread over programs of SPLIT_COLUMNS columns (`split_chunks`); not where
    the norm writes x itself (a program would overwrite columns another's fallback reads)."""
    D = x.shape[-1]
    src, x_parts, stride_xp, dt = row_source(x)
    assert weight.shape == (D,) and src.stride(-1) == 1, (x.shape, src.stride(), weight.shape)
    rows = src.view(-1, D) if src.dim() != 2 else src
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=src.device)
    assert out.shape == x.shape and out.dtype == dtype and out.stride(-1) == 1
    o = out.view(-1, D) if out.dim() != 2 else out
    a = s = o  # unused without `add`
    n_parts, stride_ap = added(add, x)
    if add is not None:
        a = add.parts[0] if isinstance(add, RowParts) else add.reshape(-1, D)
        s = torch.empty(rows.shape, dtype=x.dtype, device=src.device)
    if m := rows.shape[0]:
        chunks = split_chunks(m, D, None if o.data_ptr() == rows.data_ptr() else sync)
        BLOCK_D = SPLIT_COLUMNS if chunks > 1 else triton.next_power_of_2(D)
        ncp = triton.next_power_of_2(chunks)
        parts = torch.empty((m, ncp), dtype=torch.float32, device=src.device) if chunks > 1 else o
        _rms_norm_kernel[(m, chunks)](
            rows, weight, o, a, s, parts, o if sync is None else sync, D, rows.stride(0), o.stride(0), a.stride(0),
            s.stride(0), stride_ap, eps, stride_xp, split_spin(), BLOCK_D=BLOCK_D, ADD=add is not None,
            PARTS=n_parts, XPARTS=x_parts, DT=dt, SPLIT=chunks > 1, NCP=ncp,
            num_warps=norm_warps(BLOCK_D, x_parts + n_parts) if chunks > 1 else max(1, min(16, BLOCK_D // 256)),
            **early_args())
    return out if add is None else (s.view(x.shape), out)


@triton.jit
def _sum_rms_norm_kernel(parts_ptr, acc_ptr, w_ptr, out_ptr, P, D, stride_pp, stride_pn, stride_a, stride_o, eps,
                         BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """One row: s = acc + parts[0] + … + parts[P − 1] in fp32, in that order (each addend widened
    exactly), then `_rms_norm_kernel`'s arithmetic on the fp32 row."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    if ACC:
        s = tl.load(acc_ptr + row * stride_a + d, mask=mask, other=0.0).to(tl.float32)
        first = 0
    else:
        s = tl.load(parts_ptr + row * stride_pn + d, mask=mask, other=0.0).to(tl.float32)
        first = 1
    for p in range(first, P):
        s += tl.load(parts_ptr + p * stride_pp + row * stride_pn + d, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (w * (s * rstd)).to(out_ptr.dtype.element_ty), mask=mask)


def sum_rms_norm_triton(parts: torch.Tensor, acc: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        dtype: torch.dtype) -> torch.Tensor:
    P, N, D = parts.shape
    assert parts.stride(2) == 1 and weight.shape == (D,) and (acc is None or (acc.shape == (N, D) and acc.stride(1) == 1))
    out = torch.empty(N, D, dtype=dtype, device=parts.device)
    if N:
        BLOCK_D = triton.next_power_of_2(D)
        _sum_rms_norm_kernel[(N,)](parts, parts if acc is None else acc, weight, out, P, D, parts.stride(0),
                                   parts.stride(1), 0 if acc is None else acc.stride(0), out.stride(0), eps,
                                   BLOCK_D=BLOCK_D, ACC=acc is not None, num_warps=max(1, min(16, BLOCK_D // 256)))
    return out
