"""Shared checks for the DSA kernels, run on CPU under TRITON_INTERPRET=1 (small shapes) and on a
CUDA device (GLM-5 shapes). Every check draws fresh random inputs (never zeros) and compares the
public op (which dispatches to Triton there) with the torch reference in fp32."""

from __future__ import annotations

import torch

from glm53.kernels import index_cache_fp8, latent_cache_fp8
from glm53.kernels.moe import moe_experts, moe_experts_reference, route, route_reference
from glm53.kernels.norm import rms_norm, rms_norm_reference
from glm53.kernels.rope import apply_rope, apply_rope_reference, rope_cos_sin, rope_inv_freq
from glm53.kernels.indexer_logits import (
    indexer_logits,
    indexer_logits_fp8,
    indexer_logits_fp8_reference,
    indexer_logits_reference,
)
from glm53.kernels.sparse_mla import sparse_mla, sparse_mla_reference
from glm53.kernels.topk import dsa_topk, dsa_topk_paged, dsa_topk_reference, positions_to_slots


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ over the finite entries; the -inf pattern must match exactly."""
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin), "the -inf mask differs"
    assert not torch.isnan(out).any()
    return ((out[fin].double() - ref[fin].double()).norm() / ref[fin].double().norm().clamp_min(1e-30)).item()


def _rows_equal_as_sets(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.int32
    o = out.sort(dim=1).values
    r = ref.sort(dim=1).values
    bad = (o != r).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ from the reference set"


def make_logits(B: int, L: int, kind: str, dtype, device, row_stride_pad: int = 0) -> torch.Tensor:
    x = torch.randn(B, L + row_stride_pad, device=device)
    if kind == "ties":  # few distinct values: huge threshold bins, position tie-break decides
        x = torch.randint(0, 3, (B, L + row_stride_pad), device=device).float() - 1.0
    elif kind == "coarse":  # moderate ties inside the threshold bin
        x = (x * 4).round() / 4
    elif kind == "trend":  # scores rising with position: the best ones all sit at the row's end
        x = torch.arange(L + row_stride_pad, device=device).float()[None, :] * 0.01 + x
    elif kind == "falling":  # the best ones all sit at the start, ties on a coarse grid
        x = (-torch.arange(L + row_stride_pad, device=device).float()[None, :] * 0.01 + x).round()
    elif kind == "special":  # -inf, +-0.0 mixed in
        x = (x * 2).round() / 2
        x[:, ::7] = float("-inf")
        x[:, 1::11] = -0.0
    x = x.to(dtype)
    return x[:, :L] if row_stride_pad else x


def _page_table(B: int, L: int, page_size: int, device) -> torch.Tensor:
    """Each row's pages for L positions: distinct, shuffled, drawn from four times as many."""
    n_pages = (L + page_size - 1) // page_size
    return torch.stack([torch.randperm(4 * n_pages, device=device)[:n_pages] for _ in range(B)]).int()


def check_topk(B, L, k, lengths, kind="randn", dtype=torch.float32, device="cpu", paged=False, page_size=16,
               **knobs):
    """`knobs` go to the Triton kernel itself (tuning/test arguments of `topk_triton`; the three
    launches unless `rank=True` is among them)."""
    x = make_logits(B, L, kind, dtype, device, row_stride_pad=5)  # non-contiguous rows
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if knobs:
        from glm53.kernels.topk_triton import topk_triton

        knobs.setdefault("rank", False)

        pt = _page_table(B, L, page_size, device) if paged else None
        out = topk_triton(x, lens, k, page_table=pt, page_size=page_size, **knobs)
        ref = dsa_topk_reference(x, lens, k)
        _rows_equal_as_sets(out, positions_to_slots(ref, pt, page_size) if paged else ref)
        return
    if paged:
        pt = _page_table(B, L, page_size, device)
        out = dsa_topk_paged(x, lens, k, pt, page_size)
        ref = positions_to_slots(dsa_topk_reference(x, lens, k), pt, page_size)
    else:
        out = dsa_topk(x, lens, k)
        ref = dsa_topk_reference(x, lens, k)
    _rows_equal_as_sets(out, ref)
    # rows with length < k: all positions then -1
    for b, n in enumerate(lengths):
        n = max(0, min(n, L))
        assert int((out[b] >= 0).sum()) == min(n, k)


def check_rank_topk(B, L, k, lengths, kind="randn", dtype=torch.float32, device="cpu", paged=False, page_size=16,
                    **knobs):
    """The one-launch rank top-k (`topk_triton.run_rank`, `knobs` its tile, block and warps):
    the reference's output exactly, its order too (each position lands in its rank's slot)."""
    from glm53.kernels.topk_triton import run_rank

    x = make_logits(B, L, kind, dtype, device, row_stride_pad=5)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    pt = _page_table(B, L, page_size, device) if paged else None
    out = torch.full((B, k), -7, dtype=torch.int32, device=device)  # every slot must be written
    run_rank(x, lens, out, pt, page_size, **knobs)
    ref = dsa_topk_reference(x, lens, k)
    ref = positions_to_slots(ref, pt, page_size) if paged else ref
    assert torch.equal(out, ref), (kind, B, L, k, lengths, (out != ref).nonzero()[:8].tolist())


def key32(x: torch.Tensor) -> torch.Tensor:
    """The top-k kernels' exact keys as unsigned 32-bit values (int64): float order, -0.0 == +0.0,
    NaN the largest."""
    bits = x.float().view(torch.int32)
    bits = torch.where(bits == -(2**31), torch.zeros_like(bits), bits)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(torch.isnan(x.float()), torch.full_like(key, 0x7FFFFFFF), key)
    return (key ^ -(2**31)).long() & 0xFFFFFFFF


def key16(x: torch.Tensor) -> torch.Tensor:
    return key32(x) >> 16


def check_brackets(L: int, k: int, device: str = "cpu", rows: int = 32) -> None:
    """The top-k's brackets on random rows of lengths in (k, L]: every row takes the usual path
    (`_finish_kernel`'s test): at most k scores above the bracket, at least k with its candidates,
    and the candidates fit the finish's tile (a miss still selects exactly, by the slow fallback,
    so set equality alone cannot see one). A row no longer than its sample tile is sampled whole,
    so its bracket is exact: hi == lo == the k-th key16 (no such row when the tile is at most k)."""
    from glm53.kernels import topk_triton as tt

    x = make_logits(rows, L, "randn", torch.float32, device)
    tile = tt.row_sample(L)
    lens = torch.randint(k + 1, L + 1, (rows,), device=device, dtype=torch.int32)
    lens[0], lens[1], lens[-1] = k + 1, max(k + 1, min(L, tile)), L
    plan = tt.plan_topk(rows, L, k, x.device)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    tt.run_topk(plan, x, lens, out, stages=2)
    k16 = key16(x.cpu())
    br, stat = plan.br.cpu(), plan.stat.cpu().sum(dim=1)
    for b in range(rows):
        n = int(lens[b])
        above, cand = stat[b].tolist()
        assert above <= k <= above + cand and cand <= plan.CB * plan.TC, (b, n, above, cand, br[b].tolist())
        if n <= tile:
            kth = int(k16[b, :n].sort(descending=True).values[k - 1])
            assert br[b].tolist() == [kth, kth], (b, n, br[b].tolist(), kth)


def check_norms_take_row_parts(M: int, D: int, device: str = "cpu") -> None:
    """The residual add + norm (plain and quantizing) given the add as a sum not taken yet
    (`row_parts.RowParts`: a split-K product's fp32 partials, an MoE's bf16 slot rows) equals the
    same norm given the sum taken by its own launch, bit for bit, and `rows()` equals the adds; so
    does the residual add with no norm after it (`add_rows`: a stage's last layer)."""
    from glm53.kernels.dispatch import triton_interpreting
    from glm53.kernels.fp8_act import add_rms_norm_fp8
    from glm53.kernels.moe_triton import slot_parts
    from glm53.kernels.norm import add_rms_norm
    from glm53.kernels.row_parts import RowParts, add_rows

    x = torch.randn(M, D, device=device).bfloat16() * 4
    w = torch.rand(D, device=device).bfloat16() + 0.5
    splits = RowParts(torch.randn(3, M, D, device=device) * 2, torch.bfloat16)
    slots = slot_parts(torch.randn(M * 4, D, device=device).bfloat16(), M, 4)
    for lazy in (splits, slots):
        acc = lazy.parts[0].float()
        for p in lazy.parts[1:]:
            acc = acc + p.float()
        taken = lazy.rows()
        assert torch.equal(taken, acc.to(torch.bfloat16))
        if triton_interpreting():  # the interpreter's in-kernel fp32 -> bf16 cast truncates
            taken = (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert torch.equal(add_rows(x, lazy), x + taken)
        s0, y0 = add_rms_norm(x, taken, w, 1e-6)
        s1, y1 = add_rms_norm(x, lazy, w, 1e-6)
        assert torch.equal(s0, s1) and torch.equal(y0, y1)
        r0, d0, q0 = add_rms_norm_fp8(x, taken, w, 1e-6, dense=True)
        r1, d1, q1 = add_rms_norm_fp8(x, lazy, w, 1e-6, dense=True)
        assert torch.equal(r0, r1) and torch.equal(d0, d1)
        assert torch.equal(q0.dequantize(), q1.dequantize())


def check_readers_take_row_parts(M: int, device: str = "cpu") -> None:
    """The readers of the fused q_a | kv_a | index-key product, given its split-K sum not taken
    yet as column slices of the parts (`FusedLinear(keep_parts=True)`): the q_a norm (plain and
    quantizing) and the two cache-row stores (RMSNorm + rope, LayerNorm + rope) equal the same
    readers given the sum taken by its own launch, bit for bit."""
    from glm53.kernels.dispatch import triton_interpreting
    from glm53.kernels.fp8_act import rms_norm_fp8
    from glm53.kernels.kv_rows import CacheRow, store_rows
    from glm53.kernels.norm import rms_norm
    from glm53.kernels.rope import rope_cos_sin, rope_inv_freq
    from glm53.kernels.row_parts import RowParts

    widths = (256, 576, 128)  # q_a, the latent row [512 | 64 rope], the index key [64 rope | 64]
    parts = RowParts(torch.randn(3, M, sum(widths) + 32, device=device) * 2, torch.bfloat16)
    acc = parts.parts[0].float() + parts.parts[1].float() + parts.parts[2].float()
    taken = parts.rows()
    assert torch.equal(taken, acc.to(torch.bfloat16))
    if triton_interpreting():  # the interpreter's in-kernel fp32 -> bf16 cast truncates
        taken = (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    cols = [sum(widths[:i]) for i in range(3)]
    lazy = [RowParts(parts.parts[..., a : a + n], torch.bfloat16) for a, n in zip(cols, widths)]
    dense = [taken[:, a : a + n] for a, n in zip(cols, widths)]
    w = (torch.rand(widths[0], device=device) + 0.5).bfloat16()
    assert torch.equal(rms_norm(lazy[0], w, 1e-6), rms_norm(dense[0], w, 1e-6))
    d0, q0 = rms_norm_fp8(dense[0], w, 1e-6, dense=True)
    d1, q1 = rms_norm_fp8(lazy[0], w, 1e-6, dense=True)
    assert torch.equal(d0, d1) and torch.equal(q0.dequantize(), q1.dequantize())
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (M,), device=device), rope_inv_freq(64, 10000.0, device))
    coords = (torch.randperm(M, device=device), torch.randint(0, 4, (M,), device=device))
    for rows, norm_d, rope_lo, bias in ((1, 512, 512, None), (2, 128, 0, torch.randn(128, device=device).bfloat16())):
        width = widths[rows]
        nw = (1 + 0.3 * torch.randn(norm_d, device=device)).bfloat16()
        fill = torch.randn(M, 4, width, device=device).bfloat16()
        got, want = fill.clone(), fill.clone()
        store_rows([CacheRow(lazy[rows], got, nw, 1e-6, norm_d, rope_lo, True, bias)], coords, cos, sin)
        store_rows([CacheRow(dense[rows].clone(), want, nw, 1e-6, norm_d, rope_lo, True, bias)], coords, cos, sin)
        assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max())


def _paged_pool(num_pages, n_layers, page_size, dim, dtype, device, layer=1):
    pool = torch.randn(num_pages, n_layers, page_size, dim, device=device).to(dtype)
    return pool[:, layer]  # strided view of a page-major pool


def check_indexer_bf16(T, H, D, max_len, lengths, page_size=16, device="cpu", tol=1e-2):
    n_pages = (max_len + page_size - 1) // page_size
    kc = _paged_pool(3 * n_pages + 2, 3, page_size, D, torch.bfloat16, device)
    pt = torch.stack([torch.randperm(3 * n_pages + 2, device=device)[:n_pages] for _ in range(T)]).int()
    q = torch.randn(T, H, D, device=device).bfloat16()
    w = torch.randn(T, H, device=device) * (H * D) ** -0.5
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = indexer_logits(q, w, kc, pt, lens, max_len)
    ref = indexer_logits_reference(q.float(), w, kc.float(), pt, lens, max_len)
    err = rel_err(out, ref)
    assert err <= tol, err
    return err


def check_indexer_rope(T, H, D, max_len, rope, interleave, page_size=16, device="cpu"):
    """The logits reading q's first `rope` columns rotated (`rope=`: the kernel rotates them as it
    loads q) equal the logits of q rotated first by `apply_rope`, bit for bit, and q is left as
    it was; q a strided view (a fused product's columns), as the indexer passes it."""
    from glm53.kernels.dispatch import triton_interpreting

    n_pages = (max_len + page_size - 1) // page_size
    kc = _paged_pool(3 * n_pages + 2, 3, page_size, D, torch.bfloat16, device)
    pt = torch.stack([torch.randperm(3 * n_pages + 2, device=device)[:n_pages] for _ in range(T)]).int()
    wide = torch.randn(T, H * D + 48, device=device).bfloat16() * 2
    q = wide[:, 16 : 16 + H * D].view(T, H, D)
    w = torch.randn(T, H, device=device) * (H * D) ** -0.5
    lens = torch.randint(1, max_len + 1, (T,), dtype=torch.int32, device=device)
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (T,), device=device), rope_inv_freq(rope, 10000.0, device))
    before = q.clone()
    got = indexer_logits(q, w, kc, pt, lens, max_len, rope=(cos, sin, interleave))
    if torch.device(device).type != "cpu" or triton_interpreting():  # the kernel leaves q as it was
        assert torch.equal(q, before)
    rotated = before.clone()
    apply_rope(rotated[..., :rope], cos, sin, interleave, out=rotated[..., :rope])
    want = indexer_logits(rotated, w, kc, pt, lens, max_len)
    assert torch.equal(got, want), (got - want).abs().max()


def check_indexer_fp8(T, H, D, max_len, topk, page_size=64, device="cpu", min_overlap=0.97, fp8_q=False):
    """FP8 keys (132 B/token layout in a strided page-major pool): the kernel adds no error of its
    own (vs the reference on the same dequantized keys), and its top-k set overlaps the fp32
    oracle's (unquantized keys) by >= min_overlap on average over the rows. (With i.i.d. Gaussian
    data the quantization alone gives ~97.6% at 2048 of 32K; per-row spread grows as k shrinks.)"""
    n_pages = (max_len + page_size - 1) // page_size
    num_pages = 2 * n_pages + 3
    pool = index_cache_fp8.alloc_pool(num_pages, 2, page_size, D, device=device)
    view = pool[:, 1]
    k32 = torch.randn(num_pages * page_size, D, device=device)
    index_cache_fp8.store(view, torch.arange(num_pages * page_size, device=device), k32)
    pt = torch.stack([torch.randperm(num_pages, device=device)[:n_pages] for _ in range(T)]).int()
    q = torch.randn(T, H, D, device=device)
    w = torch.randn(T, H, device=device) * (H * D) ** -0.5
    lens = torch.full((T,), max_len, dtype=torch.int32, device=device)
    lens[-1] = max_len - 3  # ragged
    if fp8_q:
        qs = q.abs().amax(dim=-1, keepdim=True) / 448.0
        q_in = (q / qs).to(torch.float8_e4m3fn)
        w_in = w * qs.squeeze(-1)
    else:
        q_in, w_in = q.bfloat16(), w
    out = indexer_logits_fp8(q_in, w_in, view, pt, lens, max_len)
    ref_q = indexer_logits_fp8_reference(q_in, w_in, view, pt, lens, max_len)
    # fp8 x fp8 products accumulate in reduced precision on Hopper's tensor cores
    err = rel_err(out, ref_q)
    assert err <= (2e-3 if fp8_q else 1e-4), err
    oracle = indexer_logits_reference(q, w, k32.view(num_pages, page_size, D), pt, lens, max_len)
    a = dsa_topk_reference(out, lens, topk)
    b = dsa_topk_reference(oracle, lens, topk)
    overlaps = [len(set(a[i].tolist()) & set(b[i].tolist())) / topk for i in range(T)]
    assert sum(overlaps) / T >= min_overlap, overlaps
    return overlaps


def selected_slots(T: int, K: int, n_slots: int, device) -> torch.Tensor:
    """Sparse MLA's slots [T, K] int32, K distinct random slots of n_slots a row; from two rows on,
    row 0 has holes (-1) and row 1 fewer than K; from three on, row 2 none (its output is zeros)."""
    idx = torch.stack([torch.randperm(n_slots, device=device)[:K] for _ in range(T)]).int()
    if T >= 2:
        idx[1, K // 3 :] = -1  # fewer selected than K
        idx[0, ::5] = -1  # holes
    if T >= 3:
        idx[2] = -1  # nothing selected -> zeros
    return idx


def check_sparse_mla(T, H, R, P, K, page_size=16, device="cpu", tol=1e-2, n_ctx=None, **kernel_kw):
    """`kernel_kw` (num_splits, col_halves, block_n, num_stages, ...) call the Triton kernel
    directly with those schedule options; without them the public op runs."""
    n_ctx = n_ctx or 2 * K
    num_pages = (n_ctx + page_size - 1) // page_size * T + 1
    kv = _paged_pool(num_pages, 2, page_size, R + P, torch.bfloat16, device)
    q = torch.randn(T, H, R + P, device=device).bfloat16()
    idx = selected_slots(T, K, num_pages * page_size, device)
    sm_scale = (R + P) ** -0.5
    if not kernel_kw:
        out = sparse_mla(q, kv, idx, sm_scale, R)
    else:
        from glm53.kernels.sparse_mla_triton import sparse_mla_triton

        out = sparse_mla_triton(q, kv, idx, sm_scale, R, **kernel_kw)
    ref = sparse_mla_reference(q.float(), kv.float(), idx, sm_scale, R)
    assert out.shape == (T, H, R) and out.dtype == q.dtype
    if T >= 3:
        assert torch.all(out[2] == 0)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tol, err
    return err


def fp8_latent_pool(num_pages, page_size, R, P, device="cpu"):
    """A strided layer view of a 2-layer page-major FP8 latent pool filled with random rows (per-row
    magnitudes spread over two decades, so the tile scales differ), and the same cache dequantized
    to fp32 [num_pages, page_size, R + P]."""
    lay = latent_cache_fp8.LatentLayout(R, P)
    pool = torch.zeros(num_pages, 2, page_size, lay.bytes_per_token, dtype=torch.uint8, device=device)
    view = pool[:, 1]
    n = num_pages * page_size
    latent = torch.randn(n, R + P, device=device) * 10 ** (2 * torch.rand(n, 1, device=device) - 1)
    slots = torch.arange(n, device=device)
    latent_cache_fp8.store(view, slots, latent, lay)
    return view, latent_cache_fp8.gather(view, slots, lay).view(num_pages, page_size, R + P)


def check_sparse_mla_fp8(T, H, R, P, K, page_size=16, device="cpu", tol=1e-2, n_ctx=None, **kernel_kw):
    """Sparse MLA over the FP8 latent cache against the fp32 reference over the dequantized cache
    (contexts of n_ctx > K slots, holes, short and empty rows). `kernel_kw` calls the FP8 Triton
    kernel directly with those schedule options (with kernel="hopper": the Gluon sm_90 kernel
    `sparse_mla_fp8_hopper` and its options); without them the public op runs."""
    n_ctx = n_ctx or 2 * K
    num_pages = (n_ctx + page_size - 1) // page_size + 1
    cache, dense = fp8_latent_pool(num_pages, page_size, R, P, device)
    q = torch.randn(T, H, R + P, device=device).bfloat16()
    idx = selected_slots(T, K, num_pages * page_size, device)
    sm_scale = (R + P) ** -0.5
    if not kernel_kw:
        out = sparse_mla(q, cache, idx, sm_scale, R)
    elif kernel_kw.get("kernel") == "hopper":
        from glm53.kernels.sparse_mla_fp8_hopper import sparse_mla_fp8_hopper

        out = sparse_mla_fp8_hopper(q, cache, idx, sm_scale, R, **{k: v for k, v in kernel_kw.items() if k != "kernel"})
    else:
        from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton

        out = sparse_mla_fp8_triton(q, cache, idx, sm_scale, R, **kernel_kw)
    ref = sparse_mla_reference(q.float(), dense, idx, sm_scale, R)
    assert out.shape == (T, H, R) and out.dtype == q.dtype
    if T >= 3:
        assert torch.all(out[2] == 0)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tol, err
    return err


def moe_inputs(N, H, I, E, k, dtype, device="cpu", n_empty=0, ids_dtype=torch.int64):
    """Fresh random MoE inputs: each token picks k distinct experts among E - n_empty live ones
    (a random subset, so some experts get no token at all); positive routing weights in fp32;
    weights scaled by fan-in so every stage's outputs stay O(1)."""
    live = torch.randperm(E, device=device)[: E - n_empty]
    assert live.numel() >= k
    ids = live[torch.rand(N, live.numel(), device=device).argsort(dim=1)[:, :k]].to(ids_dtype)
    x = torch.randn(N, H, device=device).to(dtype)
    weights = torch.rand(N, k, device=device) + 0.05
    gate = (torch.randn(E, I, H, device=device) * H**-0.5).to(dtype)
    up = (torch.randn(E, I, H, device=device) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    return x, weights, ids, gate, up, down


def check_moe(N, H, I, E, k, dtype=torch.bfloat16, device="cpu", n_empty=0, ids_dtype=torch.int64,
              config=None, tol=None):
    """The public op (Triton here) against the per-expert reference in float64 (float32 on a GPU:
    full-precision products, no tf32), by ‖out − ref‖ / ‖ref‖. Tolerances: bf16 1e-2 (the bf16
    reference itself lands near 6e-3: h, each expert's output and the sum are rounded to bf16);
    fp32 1e-5 (IEEE products; measured ~3e-7). Bit-identical across two runs (no atomics).
    `config` (a `MoEConfig`) calls the Triton kernel directly with those tiles."""
    inputs = moe_inputs(N, H, I, E, k, dtype, device, n_empty, ids_dtype)
    if config is None:
        run = lambda: moe_experts(*inputs)  # noqa: E731
    else:
        from glm53.kernels.moe_triton import moe_experts_triton

        run = lambda: moe_experts_triton(*inputs, config=config)  # noqa: E731
    out = run()
    ref_dtype = torch.float32 if torch.device(device).type == "cuda" else torch.float64
    x, weights, ids, gate, up, down = (t if t is inputs[2] else t.to(ref_dtype) for t in inputs)
    ref = moe_experts_reference(x, weights, ids, gate, up, down)
    assert out.shape == (N, H) and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = ((out.to(ref_dtype) - ref).norm() / ref.norm()).item()
    assert err <= (tol or (1e-2 if dtype == torch.bfloat16 else 1e-5)), err
    assert torch.equal(run(), out), "two runs differ: the result must be deterministic"
    return err


def check_store_rows(N, W, norm_d, rope, rope_lo, layer, interleave, dtype, device="cpu", page_size=16):
    """`kv_rows.store_rows` (one kernel) against its reference (norm, rope, indexed store): rows
    that are a column slice of a wider tensor, slots scattered over the pages, the other slots
    untouched. Under the interpreter RMSNorm rows are bit-identical (the norm and rope kernels'
    roundings, the same sums); on a GPU the fused row's sum of squares runs in another order, and
    LayerNorm (torch's in the reference) differs anyway: there each element within a rounding of
    the dtype carried through the rotation (the interpreter's bf16 casts truncate where torch's
    round to nearest), and RMSNorm rows with only a few elements off at all."""
    from glm53.kernels.kv_rows import CacheRow, store_rows, store_rows_reference
    from glm53.kernels.rope import rope_cos_sin, rope_inv_freq

    wide = torch.randn(N, W + 7, device=device).to(dtype) * 2
    x = wide[:, 5:5 + W]
    w = (1 + 0.3 * torch.randn(norm_d, device=device)).to(dtype)
    b = (0.2 * torch.randn(norm_d, device=device)).to(dtype) if layer else None
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (N,), device=device), rope_inv_freq(rope, 10000.0, device))
    pages = -(-2 * N // page_size) + 1
    slots = torch.randperm(pages * page_size, device=device)[:N]
    coords = (slots // page_size, slots % page_size)
    fill = torch.randn(pages, page_size, W, device=device).to(dtype)
    got, want = fill.clone(), fill.clone()
    store_rows([CacheRow(x.clone(), got, w, 1e-6, norm_d, rope_lo, interleave, b)], coords, cos, sin)
    store_rows_reference(x.clone(), want, coords, w, 1e-6, cos, sin, norm_d=norm_d, rope_lo=rope_lo,
                         interleave=interleave, bias=b)
    kept = torch.ones(pages * page_size, dtype=torch.bool, device=device)
    kept[slots] = False
    assert torch.equal(got.view(-1, W)[kept], fill.view(-1, W)[kept]), "a slot outside the batch was written"
    if not layer and torch.device(device).type == "cpu":
        assert torch.equal(got, want), (got - want).abs().max()
        return
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 if bf16 else 1e-5, atol=0.05 if bf16 else 1e-5)
    if not layer:  # the same ops, only the sum's order differs: a rounding here and there
        off = (got != want).sum().item()
        assert off <= 0.05 * N * W, f"{off} of {N * W} elements differ"


def check_store_row_pair(N, dtype, device="cpu", page_size=16, parts=1):
    """A layer's two cache rows in one launch (`store_rows` of [latent, key]: RMSNorm with rope
    after it, LayerNorm with rope first, the two rope forms) equal each stored by its own launch,
    bit for bit, on the GPU too (the same code a program); the rows are column slices of one
    product's output (with `parts` > 1 its split-K sum not taken yet), the caches other pools."""
    from glm53.kernels.kv_rows import CacheRow, store_rows
    from glm53.kernels.rope import rope_cos_sin, rope_inv_freq
    from glm53.kernels.row_parts import RowParts

    widths, rope = (40, 96 + 32, 64), 32  # [q_a | latent | key], as the fused product writes them
    raw = torch.randn(parts, N, sum(widths) + 3, device=device) * 2
    dense = raw[0].to(dtype)
    cols = (slice(40, 168), slice(168, 232))
    xs = [RowParts(raw[..., c], dtype) if parts > 1 else dense[:, c] for c in cols]
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (N,), device=device), rope_inv_freq(rope, 10000.0, device))
    pages = -(-2 * N // page_size) + 1
    slots = torch.randperm(pages * page_size, device=device)[:N]
    coords = (slots // page_size, slots % page_size)

    w1, w2 = ((1 + 0.3 * torch.randn(d, device=device)).to(dtype) for d in (96, 64))
    b2 = (0.2 * torch.randn(64, device=device)).to(dtype)

    def rows(caches):
        return [CacheRow(xs[0], caches[0], w1, 1e-6, 96, 96, True),
                CacheRow(xs[1], caches[1], w2, 1e-5, 64, 0, False, b2)]

    fills = [torch.randn(pages, 2, page_size, w, device=device).to(dtype)[:, 1] for w in (128, 64)]
    one = [f.clone() for f in fills]
    two = [f.clone() for f in fills]
    for row in rows(one):
        store_rows([row], coords, cos, sin)
    store_rows(rows(two), coords, cos, sin)
    for f, a, b in zip(fills, one, two):
        assert not torch.equal(a, f), "nothing stored"
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


def check_step_inputs(N, page_size, width, half, device="cpu", max_pos=None):
    """`step_inputs` (one kernel) against its torch reference: rows on scattered pages of a
    strided page-table slice, positions anywhere in their rows' pages (GLM-5's 202K included).
    Integers equal; cos/sin equal on a GPU (the same CUDA math functions), within an fp32 rounding
    or two on the interpreter (numpy's cos/sin)."""
    from glm53.kernels.rope import rope_inv_freq
    from glm53.kernels.step_inputs import step_inputs, step_inputs_reference

    table = torch.randperm(4 * N * width, device=device)[: N * (width + 3)].view(N, width + 3).to(torch.int32)
    table = table[:, :width]  # a slice, as the decode state's batch is
    limit = min(width * page_size, max_pos or width * page_size)
    pos = torch.randint(0, limit, (N,), device=device)
    pos[0] = limit - 1
    inv = rope_inv_freq(2 * half, 1e6, device)
    got, want = step_inputs(pos, table, page_size, inv), step_inputs_reference(pos, table, page_size, inv)
    for name in ("out_slots", "context_lens", "page", "offset"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("cos", "sin"):
        a, b = getattr(got, name), getattr(want, name)
        if torch.device(device).type == "cuda":
            assert torch.equal(a, b), (name, (a - b).abs().max())
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def check_absorbed_query(n, h, nope, rope, r, interleave, dtype, device="cpu"):
    """`absorb.absorbed_query` (one kernel) against the batched matmul and the rope kernel it
    replaces: q read from a strided slice of a wider projection output, W_UK sliced from kv_b_proj
    as the model slices it. The rotated columns equal the rope kernel's bit for bit where the
    dtype rounds alike (GPU; fp32 under the interpreter); the product within a rounding of the
    dtype (another order of the same fp32 sums)."""
    from glm53.kernels.absorb import absorbed_query, absorbed_query_reference
    from glm53.kernels.rope import rope_cos_sin, rope_inv_freq

    wide = torch.randn(n, h * (nope + rope) + 40, device=device).to(dtype)
    q = wide[:, 8:8 + h * (nope + rope)].view(n, h, nope + rope)
    kv_b = (torch.randn(h, nope + 2 * r, r, device=device) * r ** -0.5).to(dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 200000, (n,), device=device), rope_inv_freq(rope, 1e6, device))
    got = absorbed_query(q, kv_b[:, :nope], cos, sin, interleave)
    want = absorbed_query_reference(q, kv_b[:, :nope], cos, sin, interleave)
    assert got.shape == want.shape == (n, h, r + rope) and got.dtype == dtype
    if dtype == torch.float32 or torch.device(device).type == "cuda":
        assert torch.equal(got[..., r:], want[..., r:]), "the rotated q_pe differs from the rope kernel's"
    tol = dict(rtol=2 ** -7, atol=2 ** -7) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def check_routing_plan(N, k, E, device="cpu", n_empty=0, strays=0, shared=False, ids_dtype=torch.int64):
    """`plan_routing` (one Triton launch) against `sort_pairs` + `plan_cum_reference` (torch.sort):
    the same order (stable: tokens ascending within an expert), segments and row-block counts for
    several BM. `n_empty` experts get no pair; `strays` ids fall outside [0, E) (they join no
    segment: compared on the pairs inside); `shared`: the last column is expert E - 1 for every
    token (the absorbed shared expert)."""
    from glm53.kernels.moe_triton import plan_cum_reference, plan_routing, sort_pairs

    live = torch.randperm(E)[: E - n_empty]
    ids = live[torch.randint(0, live.numel(), (N, k))]
    if shared:
        ids[:, -1] = E - 1
    if strays:
        flat = ids.view(-1)
        at = torch.randperm(flat.numel())[:strays]
        flat[at] = torch.where(torch.rand(strays) < 0.5, -1, E + 3)
    ids = ids.to(device=device, dtype=ids_dtype)
    for BM in (1, 8, 16, 64):
        # the launch also zeroes a buffer (a split-K kernel's counters), here of 0 to 3 blocks
        zeros = torch.randint(1, 99, (int(torch.randint(0, 3000, ())),), dtype=torch.int32, device=device)
        plan = plan_routing(ids, E, BM, zeros=zeros)
        assert not zeros.any(), zeros.nonzero()[:8]
        inside = ((ids >= 0) & (ids < E)).view(-1)
        order, seg = sort_pairs(torch.where(ids < 0, E + 1, ids), E)  # strays sort past seg[E]
        assert plan.order.dtype == plan.seg.dtype == plan.cum.dtype == torch.int32
        assert torch.equal(plan.seg.cpu(), seg.cpu()), (plan.seg, seg)
        live_n = int(inside.sum())
        assert int(seg[E]) == live_n
        assert torch.equal(plan.order[:live_n].cpu(), order[:live_n].cpu())
        assert torch.equal(plan.cum.cpu(), plan_cum_reference(seg, BM).cpu())
        assert plan.n_blocks >= int(plan.cum[-1])


def check_route_plan(N, E_R, k, shared, norm, device="cpu", BM=8):
    """The routing and its plan in one launch (`route_plan_triton`) give the two launches' values
    (`route_triton`, then `plan_routing`), bit for bit: weights, ids, the sorted pairs, segments,
    block counts, and the buffer both zero (of random size)."""
    from glm53.kernels.moe_triton import plan_routing
    from glm53.kernels.route_triton import route_plan_triton, route_triton

    logits = torch.randn(N, E_R, device=device) * 2
    bias = torch.randn(E_R, device=device) * 0.1
    E = E_R + (shared is not None)
    nz = int(torch.randint(0, 2500, ()))
    z1, z2 = (torch.randint(1, 99, (nz,), dtype=torch.int32, device=device) for _ in range(2))
    w1, ids1 = route_triton(logits, bias, k, norm, 2.5, shared)
    plan1 = plan_routing(ids1, E, BM, zeros=z1)
    w2, ids2, plan2 = route_plan_triton(logits, bias, k, norm, 2.5, shared, E, BM, zeros=z2)
    assert torch.equal(w1, w2) and torch.equal(ids1, ids2)
    for f in ("order", "seg", "cum"):
        assert torch.equal(getattr(plan1, f), getattr(plan2, f)), f
    assert (plan1.n_blocks, plan1.BM, plan1.n_experts) == (plan2.n_blocks, plan2.BM, plan2.n_experts)
    assert not z1.any() and not z2.any()


def check_rms_norm(N, D, dtype, device="cpu", w_dtype=None, col0=0):
    """The public op (Triton here) on rows that are a column slice of a wider tensor (strided
    rows, as the MLA latent's norm runs), new and in place, against the reference: equal up to
    one rounding of the output dtype (the fp32 sum runs in another order)."""
    base = torch.randn(N, col0 + D + 3, device=device).to(dtype) * 3
    x = base[:, col0 : col0 + D]
    w = (torch.rand(D, device=device) + 0.5).to(w_dtype or dtype)
    ref = rms_norm_reference(x.clone(), w, 1e-6)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one or two units in the last place
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol), (out.float() - ref.float()).abs().max()
    if out.dtype != dtype:
        return
    untouched = base.clone()
    rms_norm(x, w, 1e-6, out=x)
    assert torch.equal(x, out.to(dtype)), "in place differs from out of place"
    assert torch.equal(base[:, :col0], untouched[:, :col0]) and torch.equal(base[:, col0 + D:], untouched[:, col0 + D:])


def check_rope(N, H, R, dtype, interleave, device="cpu", lead=0):
    """Rotation of a slice [lead, lead + R) of each head (strided, as MLA's q_pe) into a new
    tensor, into a slice of another buffer and in place, against the reference: in bf16 within
    one unit in the last place on a GPU (the kernel rounds each product like torch, but the
    compiler may contract a product and a difference), two under the interpreter (which
    truncates fp32 -> bf16 casts instead of rounding them); in fp32 within fp32 rounding."""
    x_full = torch.randn(N, H, lead + R, device=device).to(dtype)
    x = x_full[..., lead:] if H > 1 else x_full[:, 0, lead:]
    pos = torch.randint(0, 100000, (N,), device=device)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(R, 1e6, device))
    ref = apply_rope_reference(x, cos, sin, interleave)
    out = apply_rope(x, cos, sin, interleave)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp = 2**-7 if torch.device(device).type == "cuda" else 2**-6
        assert torch.allclose(out.float(), ref.float(), rtol=ulp, atol=ulp), (out.float() - ref.float()).abs().max()
    dst = torch.randn(N, H, R + 5, device=device).to(dtype)
    apply_rope(x, cos, sin, interleave, out=dst[..., 5:] if H > 1 else dst[:, 0, 5:])
    assert torch.equal((dst[..., 5:] if H > 1 else dst[:, 0, 5:]), out)
    keep = x_full[..., :lead].clone()
    apply_rope(x, cos, sin, interleave, out=x)
    assert torch.equal(x, out) and torch.equal(x_full[..., :lead], keep)


def check_route(N, H, E, k, norm=True, device="cpu"):
    """Routing (Triton here) against the torch reference on random tokens, router and bias:
    the same experts in the same order, weights within fp32 rounding."""
    x = torch.randn(N, H, device=device).to(torch.bfloat16)
    gate = torch.randn(E, H, device=device) * H**-0.5
    bias = torch.randn(E, device=device) * 0.1
    args = (x, gate, bias, k, 1, 1, norm, 2.5)
    w, ids = route(*args)
    w_ref, ids_ref = route_reference(*args)
    assert ids.dtype == ids_ref.dtype and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-6), (w - w_ref).abs().max()
    # the shared expert as slot k (id E, weight 1), the k routed slots unchanged
    ws, ids_s = route(*args, shared=E)
    assert ids_s.shape == (N, k + 1) and torch.equal(ids_s[:, :k], ids) and torch.equal(ws[:, :k], w)
    assert (ids_s[:, k] == E).all() and (ws[:, k] == 1).all(), (ids_s[:, k], ws[:, k])


def check_markov_chain(R, n, V, r, device="cpu", scale=1.0):
    """DSpark's greedy Markov chain (Triton here) against the torch reference on random logits
    and heads (V not a multiple of the kernel's slice): the same tokens, and each token the best
    score of its position in float64 given the kernel's own token before it (so a near-tie flip,
    were one to happen, would still be caught only if it is not a tie)."""
    from glm53.kernels.markov_chain import markov_chain, markov_chain_reference

    base = torch.randn(R, n, V, device=device) * 3 * scale
    w1 = (torch.randn(V, r, device=device) * 0.5).to(torch.bfloat16)
    w2 = (torch.randn(V, r, device=device) * 0.5).to(torch.bfloat16)
    anchor = torch.randint(0, V, (R,), device=device)
    got = markov_chain(base, anchor, w1, w2)
    want = markov_chain_reference(base, anchor, w1, w2)
    assert got.dtype == torch.long and got.shape == (R, n)
    assert torch.equal(got, want)
    prev = torch.cat([anchor[:, None], got[:, :-1]], dim=1)
    score = base.double() + torch.einsum("rnk,vk->rnv", w1.double()[prev], w2.double())
    chosen = score.gather(2, got[..., None]).squeeze(2)
    assert torch.all(chosen >= score.amax(dim=2) - 1e-4)
    # a base of one value everywhere but the heads: ties in the base, the heads decide
    flat = torch.zeros(R, n, V, device=device)
    assert torch.equal(markov_chain(flat, anchor, w1, w2), markov_chain_reference(flat, anchor, w1, w2))
    # the lm_head's bf16 logits read as they are: the tokens of their fp32 cast
    b16 = base.to(torch.bfloat16)
    assert torch.equal(markov_chain(b16, anchor, w1, w2), markov_chain_reference(b16.float(), anchor, w1, w2))


def check_confidence_keep(R, n, H, V, r, threshold, device="cpu"):
    """DSpark's confidence cut (Triton here) against the torch reference: the confidences first
    (the reference's, recomputed here in float64), then the keeps, which must be equal wherever no
    confidence lies within 1e-5 of the threshold (the kernel sums in another order)."""
    from glm53.kernels.markov_chain import confidence_keep, confidence_keep_reference

    g = torch.Generator().manual_seed(R * 1000 + n)
    # logits ~ 2.5 + N(0, 1.5²), half of the variance from the Markov embedding: a few positions a
    # block fall below one half, so blocks are cut at every depth
    hidden = torch.randn(R, n, H + 8, generator=g).to(torch.bfloat16).to(device)[..., :H]  # strided rows
    w1 = torch.randn(V, r, generator=g).to(torch.bfloat16).to(device)
    scale = torch.cat([torch.full((H,), 1.06 / H**0.5), torch.full((r,), 1.06 / r**0.5)])
    proj_w = (torch.randn(1, H + r, generator=g) * scale).to(torch.bfloat16).to(device)
    proj_b = torch.tensor([2.5], dtype=torch.bfloat16, device=device)
    anchor = torch.randint(0, V, (R,), generator=g).to(device)
    tokens = torch.randint(0, V, (R, n), generator=g).to(device)
    got = confidence_keep(hidden, anchor, tokens, w1, proj_w, proj_b, threshold)
    want = confidence_keep_reference(hidden, anchor, tokens, w1, proj_w, proj_b, threshold)
    assert got.dtype == torch.long and got.shape == (R,)
    before = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    x = torch.cat([hidden.double(), w1.double()[before]], dim=-1)
    conf = torch.sigmoid(x @ proj_w.double().T + proj_b.double()).squeeze(-1)
    clear = ((conf - threshold).abs() > 1e-5).all(dim=1)
    assert clear.sum() >= R // 2, "too many confidences at the threshold: the case tests little"
    assert torch.equal(got[clear], want[clear]), (got, want)
    assert len(set(want.tolist())) >= 3, f"keeps {want.tolist()}: too few depths for the case to test much"


def check_markov_chain_keep(R, n, H, V, r, threshold, device="cpu"):
    """The chain with the cut made by its last launch (`markov_chain_keep`) against the two ops in
    turn (`markov_chain`, then `confidence_keep` of its tokens), on random heads whose logits cut
    blocks at several depths: the same tokens and keeps bit for bit (the same code, the same
    warps), and the tokens the reference's."""
    from glm53.kernels.markov_chain import confidence_keep, markov_chain, markov_chain_keep, markov_chain_reference

    g = torch.Generator().manual_seed(R * 1000 + n * 10 + r)
    base = (torch.randn(R, n, V, generator=g) * 3).to(device)
    w1 = (torch.randn(V, r, generator=g) * 0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(V, r, generator=g) * 0.5).to(torch.bfloat16).to(device)
    hidden = torch.randn(R, n, H + 8, generator=g).to(torch.bfloat16).to(device)[..., :H]  # strided rows
    scale = torch.cat([torch.full((H,), 1.06 / H**0.5), torch.full((r,), 0.53 / r**0.5)])
    proj_w = (torch.randn(1, H + r, generator=g) * scale).to(torch.bfloat16).to(device)
    proj_b = torch.tensor([2.5], dtype=torch.bfloat16, device=device)
    anchor = torch.randint(0, V, (R,), generator=g).to(device)
    tokens, keep = markov_chain_keep(base, anchor, w1, w2, hidden, proj_w, proj_b, threshold)
    want = markov_chain(base, anchor, w1, w2)
    assert torch.equal(tokens, want) and torch.equal(want, markov_chain_reference(base, anchor, w1, w2))
    want_keep = confidence_keep(hidden, anchor, want, w1, proj_w, proj_b, threshold)
    assert keep.dtype == torch.long and torch.equal(keep, want_keep), (keep, want_keep)
    if R >= 8:
        assert len(set(keep.tolist())) >= 3, f"keeps {keep.tolist()}: too few depths for the case to test much"


def check_silu_mul(M: int, inter: int, dtype: torch.dtype, device="cpu") -> None:
    """`swiglu.silu_mul` (one launch) against torch's silu and product on the two strided halves of
    one gate_up output, with gates over a wide range (exp's tails): on a GPU bit for bit (libdevice's
    expf and a rounded division, as torch's kernel); under the interpreter fp32 within an ulp or two
    of torch's CPU exp, bf16 within the two roundings the interpreter truncates."""
    import torch.nn.functional as F

    from glm53.kernels.swiglu import silu_mul

    gu = torch.randn(M, 2 * inter + 8, device=device) * 4
    gu[:, :3] = torch.tensor([-90.0, 0.0, 90.0], device=device)  # exp(−g) overflowing and vanishing
    gu = gu.to(dtype)
    gate, up = gu[:, :inter], gu[:, inter + 8 :]
    got, want = silu_mul(gate, up), F.silu(gate) * up
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous() and torch.isfinite(got).all()
    if torch.device(device).type == "cuda":
        assert torch.equal(got, want)
    else:
        tol = 4e-7 if dtype == torch.float32 else 2.0**-6
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-30)
