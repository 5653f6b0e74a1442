"""The Triton kernels on a CUDA device at GLM-5 shapes (skipped, visibly, without one)."""

from __future__ import annotations

import zlib

import pytest
import torch

from . import cases, draft_cases, fp8_cases, spec_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the H200 device tool)"),
]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _seed(request):
    # a per-test seed that is the same in every process (str hash() is salted per process)
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("L", [8192, 32768, 131072])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_glm5(L, dtype):
    lens = [L, L - 1, 2048, 2047, 0, L // 2 + 3, 2049, 100]
    cases.check_topk(8, L, 2048, lens, dtype=dtype, device=DEV)


@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
@pytest.mark.parametrize("L,k", [(48, 64), (320, 64), (1024, 64), (2064, 2048), (4096, 256)])
def test_topk_short_rows(L, k, kind):
    # widths under the sample take a smaller tile, the whole row (topk_triton.row_sample); 2,064 and
    # 4,096 sit just past SHORT_SAMPLE (sampled, no longer whole): exact either way
    lens = [L, L - 1, min(k, L), max(k - 1, 0), 0, 1, L // 2 + 3, L - 7]
    cases.check_topk(8, L, k, lens, kind=kind, device=DEV)


@pytest.mark.parametrize("L,k", [(320, 64), (1024, 64), (2048, 64), (4096, 256), (4096, 2048), (5000, 64),
                                 (32768, 2048), (131072, 2048)])
def test_topk_brackets_hold(L, k):
    # random rows take the usual path, and rows sampled whole get an exact bracket: with the
    # approximate fp32 division the K-th score's sample rank came out as 63.99999 and about half of
    # such rows took the streaming fallback
    cases.check_brackets(L, k, device=DEV, rows=64)


@pytest.mark.parametrize("kind", ["ties", "coarse", "special"])
def test_topk_ties_and_specials(kind):
    cases.check_topk(8, 65536, 2048, [65536, 65535, 40000, 3000, 2048, 0, 1, 10000], kind=kind, device=DEV)


@pytest.mark.parametrize("kind", ["trend", "falling"])
def test_topk_skewed_rows(kind):
    # position-trending scores: the sample must see the row's ends; chunks overflow their tiles
    cases.check_topk(8, 131072, 2048, [131072, 131071, 70000, 9000, 4097, 2049, 2048, 0], kind=kind, device=DEV)


def test_topk_forced_fallbacks():
    # bracket misses (tiny sample, no margin) and candidate overflow take the exact fallback
    cases.check_topk(8, 65536, 2048, [65536, 60000, 40000, 3000, 2049, 65535, 9000, 30000], device=DEV,
                     sample=512, margin=0.0, margin_lo=0.0)
    cases.check_topk(8, 131072, 2048, [131072, 100000, 65536, 5000, 2049, 131071, 9000, 30000], device=DEV,
                     margin=-1.0, margin_lo=8.0)
    cases.check_topk(4, 32768, 2048, [32768, 30000, 5000, 2049], device=DEV, cand_total=256)


@pytest.mark.parametrize("select_tile", [16, 256])
@pytest.mark.parametrize("kind", ["randn", "coarse"])
def test_topk_select_tile(kind, select_tile):
    # the finish's pairwise ranking skipped (16: radix rounds to the end) or taking large bins
    cases.check_topk(8, 131072, 2048, [131072, 131071, 70000, 9000, 4097, 2049, 2048, 0], kind=kind, device=DEV,
                     select_tile=select_tile)


def test_topk_batch64_paged():
    lens = torch.randint(0, 131072, (64,)).tolist()
    cases.check_topk(64, 131072, 2048, lens, device=DEV, paged=True, page_size=64)


@pytest.mark.parametrize("kind", ["randn", "ties", "special", "trend"])
@pytest.mark.parametrize("B,L", [(1, 4224), (4, 8192), (3, 2112), (2, 700)])
def test_rank_topk_decode_rows(B, L, kind):
    # the one-launch rank top-k at decode rows (GLM-5's k = 2,048), the reference exactly (order too)
    lens = [L, L - 1, 2048, 2047][:B]
    cases.check_rank_topk(B, L, 2048, lens, kind=kind, device=DEV, paged=True, page_size=64)
    cases.check_rank_topk(B, L, 2048, lens[::-1], kind=kind, device=DEV, dtype=torch.bfloat16)


@pytest.mark.parametrize("tile,block,warps,prefetch", [(32, 128, 4, 1), (16, 256, 4, 2), (64, 256, 8, 2), (32, 512, 8, 2)])
def test_rank_topk_knobs(tile, block, warps, prefetch):
    # the variants benchmarks/topk_rank.py times
    knobs = dict(tile=tile, block=block, num_warps=warps, prefetch=prefetch)
    cases.check_rank_topk(4, 4224, 2048, [4224, 4223, 3000, 2048], device=DEV, paged=True, page_size=64, **knobs)
    cases.check_rank_topk(2, 6000, 2048, [6000, 100], kind="ties", device=DEV, **knobs)


def test_indexer_bf16_glm5():
    lens = [32768, 32767, 32766, 20000, 5000, 0]  # verify-like causal + ragged
    cases.check_indexer_bf16(6, 32, 128, 32768, lens, page_size=64, device=DEV)


@pytest.mark.parametrize("interleave", [True, False])
def test_indexer_rotates_q_gpu(interleave):
    # GLM-5's indexer: 32 heads of 128, the first 64 rotated
    cases.check_indexer_rope(4, 32, 128, 5000, 64, interleave, page_size=64, device=DEV)


@pytest.mark.parametrize("fp8_q", [False, True])
def test_indexer_fp8_overlap_glm5(fp8_q):
    # q and k both quantized (fp8 x fp8) adds the query's rounding: ~96.7% on i.i.d. Gaussian data
    cases.check_indexer_fp8(8, 32, 128, 32768, 2048, page_size=64, device=DEV, fp8_q=fp8_q,
                            min_overlap=0.96 if fp8_q else 0.97)


@pytest.mark.parametrize("H", [64, 128])
def test_sparse_mla_glm5(H):
    cases.check_sparse_mla(4, H, 512, 64, 2048, page_size=64, device=DEV, n_ctx=8192)


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_sparse_mla_tiny(num_splits):
    cases.check_sparse_mla(3, 4, 32, 16, 40, page_size=4, device=DEV, num_splits=num_splits)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("kw", [
    dict(kernel="tl"),
    dict(kernel="tl", col_halves=False, num_warps=8, num_stages=3),
    dict(kernel="tl", block_n=32, num_warps=4, num_stages=5),
    dict(kernel="tl", num_warps=4, num_stages=3, num_splits=4),
    dict(kernel="tl", col_halves=False, num_warps=8, num_stages=2, num_splits=3),
    dict(kernel="hopper", num_splits=1),
    dict(kernel="hopper", num_splits=3),
    dict(kernel="hopper", block_n=32),
    dict(kernel="hopper", block_n=32, num_splits=5),
    dict(kernel="hopper", block_n=32, num_splits=1),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_sparse_mla_variants_glm5(H, kw):
    cases.check_sparse_mla(4, H, 512, 64, 2048, page_size=64, device=DEV, n_ctx=8192, **kw)


@pytest.mark.parametrize("kw", [dict(num_splits=None), dict(num_splits=1), dict(num_splits=4, block_n=32),
                                dict(num_splits=40)])
def test_sparse_mla_hopper_ragged(kw):
    # K not a multiple of the slot block, a small page size, several head tiles
    cases.check_sparse_mla(5, 128, 512, 64, 1000, page_size=16, device=DEV, n_ctx=4096, kernel="hopper", **kw)


@pytest.mark.parametrize("T", [1, 4, 64])
def test_sparse_mla_fp8_glm5(T):
    # the FP8 latent cache (656 B/token): the portable Triton kernel (called directly: on sm_90 the
    # public op takes the Gluon one), against the fp32 reference
    cases.check_sparse_mla_fp8(T, 64, 512, 64, 2048, page_size=64, device=DEV, n_ctx=8192, num_splits=None)


def _needs_sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon FP8 sparse-MLA kernel is built for sm_90 (Hopper)")


@pytest.mark.parametrize("T,H,K,page_size,kw", [
    (1, 64, 2048, 64, {}),
    (64, 64, 2048, 64, {}),
    (4, 8, 2048, 64, {}),  # GLM-5's heads per rank at tp=8: one 64-row tile, 56 rows masked
    (64, 8, 2048, 64, dict(num_splits=1)),
    (5, 128, 1000, 16, dict(num_splits=40)),  # K not a multiple of the slot block, two head tiles
    (3, 1, 777, 16, dict(block_n=32)),
    (6, 64, 1000, 16, dict(block_n=32, num_splits=3)),
    # the staging producer (32-slot blocks, 2 or 3 staging slots)
    (64, 64, 2048, 64, dict(block_n=32, stages=3)),
    (4, 8, 2048, 64, dict(block_n=32, stages=3)),
    (5, 128, 1000, 16, dict(block_n=32, stages=3, num_splits=40)),
    (3, 1, 777, 16, dict(block_n=32, stages=2)),
    (6, 64, 1000, 16, dict(block_n=32, stages=2, num_splits=1)),
    # two 2-warp producer partitions taking alternate blocks: an odd partition with no block
    # (K 20: one block), an odd block count, splits, two head tiles, a masked head tail
    (64, 64, 2048, 64, dict(producers=2)),
    (4, 8, 2048, 64, dict(producers=2)),
    (3, 1, 20, 16, dict(producers=2, num_splits=1)),
    (6, 64, 100, 16, dict(producers=2, num_splits=1)),
    (5, 128, 1000, 16, dict(producers=2, num_splits=40)),
    (6, 64, 1000, 16, dict(producers=2, num_splits=3)),
], ids=lambda v: str(v).replace(" ", ""))
def test_sparse_mla_fp8_hopper(T, H, K, page_size, kw):
    # the Gluon FP8 kernel (dequantizing producer + the bf16 kernel's wgmma consumers) against the
    # fp32 reference over the dequantized cache: holes, a short row and an empty row (T >= 3)
    _needs_sm90()
    cases.check_sparse_mla_fp8(T, H, 512, 64, K, page_size=page_size, device=DEV, n_ctx=8192, kernel="hopper", **kw)


@pytest.mark.parametrize("H", [1, 8, 64, 128])
def test_sparse_mla_fp8_dispatch_hopper(H):
    # the public op on an FP8 cache takes the Gluon kernel on sm_90 at GLM-5's row, any head count
    _needs_sm90()
    from glm53.kernels.sparse_mla_fp8_hopper import fp8_hopper_supports

    cache, _ = cases.fp8_latent_pool(4, 64, 512, 64, DEV)
    assert fp8_hopper_supports(torch.zeros(1, H, 576, dtype=torch.bfloat16, device=DEV), cache, 512)
    cases.check_sparse_mla_fp8(3, H, 512, 64, 2048, page_size=64, device=DEV, n_ctx=8192)


@pytest.mark.parametrize("kw", [dict(col_halves=False), dict(col_halves=False, num_splits=1), dict(block_n=32)])
def test_sparse_mla_variants_tiny(kw):
    cases.check_sparse_mla(3, 4, 32, 16, 40, page_size=4, device=DEV, **kw)


# ---- fused MoE at GLM-5 widths (H 6144, I 2048, top-8): decode, small and prefill batches ----
@pytest.mark.parametrize("N", [1, 64, 4096])
@pytest.mark.parametrize("E", [16, 32])
def test_moe_glm5(N, E):
    cases.check_moe(N, 6144, 2048, E, 8, dtype=torch.bfloat16, device=DEV, n_empty=2 if N > 1 else 0)


@pytest.mark.parametrize("n", [1, 3, 16])
def test_absorbed_query_glm5(n):  # GLM-5's heads (64: one GPU) and widths, and the tiny model's
    cases.check_absorbed_query(n, 64, 192, 64, 512, True, torch.bfloat16, device=DEV)
    cases.check_absorbed_query(n, 4, 32, 16, 96, True, torch.bfloat16, device=DEV)


@pytest.mark.parametrize("N", [1, 7, 64])
def test_step_inputs_glm5(N):  # GLM-5's rope (64: 32 frequencies), 64-token pages, up to 202K positions
    cases.check_step_inputs(N, 64, 3168, 32, device=DEV, max_pos=202752)
    cases.check_step_inputs(N, 64, 64, 32, device=DEV)


@pytest.mark.parametrize("N", [1, 64, 4096])
@pytest.mark.parametrize("interleave", [True, False])
def test_store_rows_glm5(N, interleave):  # the latent (512 + 64) and the indexer key (128, rope 64)
    cases.check_store_rows(N, 576, 512, 64, 512, False, interleave, torch.bfloat16, device=DEV, page_size=64)
    cases.check_store_rows(N, 128, 128, 64, 0, True, interleave, torch.bfloat16, device=DEV, page_size=64)


@pytest.mark.parametrize("N,parts", [(1, 3), (64, 1), (300, 1)])
def test_store_row_pair_gpu(N, parts):  # a layer's two cache rows in one launch equal two launches
    cases.check_store_row_pair(N, torch.bfloat16, device=DEV, page_size=64, parts=parts)


@pytest.mark.parametrize("N,k,E", [(1, 9, 17), (64, 9, 17), (64, 9, 257), (4096, 9, 257), (4096, 8, 16)])
def test_moe_routing_plan_gpu(N, k, E):
    cases.check_routing_plan(N, k, E, device=DEV, n_empty=2, strays=3, shared=True)


def test_moe_fp32_and_odd_shapes():
    cases.check_moe(200, 320, 96, 12, 6, dtype=torch.float32, device=DEV, n_empty=3)
    cases.check_moe(33, 6144, 2048, 16, 8, dtype=torch.bfloat16, device=DEV, ids_dtype=torch.int32)


# ---- RMSNorm and RoPE at GLM-5 widths ---------------------------------------------------------
@pytest.mark.parametrize("N", [1, 64, 4096])
def test_rms_norm_glm5(N):
    cases.check_rms_norm(N, 6144, torch.bfloat16, device=DEV)
    cases.check_rms_norm(N, 512, torch.bfloat16, device=DEV, col0=0)  # the latent slice of [c | k_pe]
    cases.check_rms_norm(N, 2048, torch.float32, device=DEV)


@pytest.mark.parametrize("N", [1, 64, 4096])
def test_rope_glm5(N):
    cases.check_rope(N, 64, 64, torch.bfloat16, True, device=DEV, lead=192)  # MLA q_pe
    cases.check_rope(N, 1, 64, torch.bfloat16, True, device=DEV, lead=512)  # MLA k_pe
    cases.check_rope(N, 32, 64, torch.float32, False, device=DEV)  # indexer-like, NeoX


@pytest.mark.parametrize("N", [1, 64, 4096])
@pytest.mark.parametrize("E", [16, 256])
def test_route_glm5(N, E):
    cases.check_route(N, 6144, E, 8, device=DEV)


@pytest.mark.parametrize("R, V, r", [(1, 4160, 64), (16, 4160, 64), (4, 154880, 64)])
def test_markov_chain(R, V, r):  # the embedded DSpark draft's heads; GLM-5's vocabulary
    cases.check_markov_chain(R, 15, V, r, device=DEV)


@pytest.mark.parametrize("R, n, H, V, r", [(16, 15, 256, 4160, 64), (64, 15, 256, 4160, 64), (16, 15, 6144, 154880, 64)])
def test_confidence_keep(R, n, H, V, r):  # the embedded DSpark draft's heads; GLM-5's widths
    cases.check_confidence_keep(R, n, H, V, r, 0.5, device=DEV)


@pytest.mark.parametrize("R, n, H, V, r", [(1, 15, 256, 4160, 64), (16, 15, 256, 4160, 64), (4, 15, 6144, 154880, 64)])
def test_markov_chain_keep(R, n, H, V, r):  # the cut in the chain's last launch: bit for bit the two ops
    cases.check_markov_chain_keep(R, n, H, V, r, 0.5, device=DEV)


# ---- paged DFlash draft attention at the slice's draft widths (48 query / 8 KV heads of 128) ---
@pytest.mark.parametrize("R", [1, 64])
@pytest.mark.parametrize("B", [4, 16])
def test_draft_attention_slice_widths(R, B):
    # 4K contexts on 64-token pages (plus a partly hidden last page and a fully hidden one, as a
    # graph's width bucket has), one row with no context, one that starts late; batch 1 splits
    g = torch.Generator().manual_seed(R * 100 + B)
    ends = torch.randint(3968, 4096, (R,), generator=g).tolist()
    spans = [(0, e) for e in ends]
    if R > 1:
        spans[1], spans[2] = (300, 300), (1000, ends[2])
    ns = torch.randint(1, B + 1, (R,), generator=g).tolist()
    draft_cases.check_draft_attention(spans, ns, kv=8, group=6, block=B, hd=128, page_size=64, width=65,
                                      dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize("R", [1, 64])
def test_draft_attention_into_rows(R):
    # group 1 (the shipped draft's 4 + 4 heads of 64): the output written into o_proj's rows
    spans = [(0, 1000 + 37 * i) for i in range(R)]
    draft_cases.check_draft_attention(spans, [16] * R, kv=4, group=1, block=16, hd=64, page_size=64, width=17,
                                      dtype=torch.bfloat16, device=DEV, into_rows=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(r=1, block=16, hq=6, hk=1, hd=128), dict(r=64, block=16, hq=48, hk=8, hd=128),
                                   dict(r=16, block=16, hq=4, hk=4, hd=64)], ids=lambda s: "-".join(map(str, s.values())))
def test_qk_heads_slice_widths(dtype, shape):
    # bit for bit the norm and rope kernels in turn, on the device that serves them
    for fused in (True, False):
        draft_cases.check_qk_heads(**shape, dtype=dtype, device=DEV, fused=fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, nl, kv, hd", [(16, 3, 4, 64), (1024, 3, 1, 128), (64, 5, 8, 128)])
def test_context_kv_rows(n, nl, kv, hd, dtype):
    draft_cases.check_context_kv(n, nl, kv, hd, 64, dtype, device=DEV)


@pytest.mark.parametrize("P, N, D, with_acc", [(3, 16, 256, False), (3, 1024, 6144, False), (2, 64, 6144, True)])
def test_sum_rms_norm(P, N, D, with_acc):
    for dtype in (torch.float32, torch.bfloat16):
        draft_cases.check_sum_rms_norm(P, N, D, with_acc, dtype, device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [2, 4])
def test_draft_forward_equals_its_ops(tmp_path, monkeypatch, kv, dtype):
    draft_cases.check_draft_forward(tmp_path, kv, dtype, monkeypatch, device=DEV)


# ---- the speculative step's derivations: bit for bit the ops, cos/sin included -------------------
@pytest.mark.parametrize("bs", [1, 64])
def test_spec_inputs(bs):
    # the tiny pair's graphs (block 16, 64-token pages, draft RoPE of 64, target's of 32) and
    # GLM-5's RoPE of 64 at positions up to ~200K (width 3200 pages of 64)
    for width, ps, k in ((17, 64, 16), (3200, 64, 16), (65, 64, 4)):
        spec_cases.check_draft_inputs(bs, k, width, ps, 64, device=DEV, seed=bs + width)
        for split_first, rope_dim in ((True, 32), (True, 64), (False, None)):
            spec_cases.check_padded_batch(bs, k, width, ps, rope_dim, split_first, device=DEV, seed=bs * width)
        spec_cases.check_advance(max(bs, 2), k, device=DEV, seed=bs + k)


# ---- block-FP8 (GLM-5-FP8) at GLM-5's tp = 8 per-rank shapes -----------------------------------
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_fp8_quant_groups_glm5(M):
    # bit-identical to the torch reference (IEEE reciprocal, one product, RNE cast) at the hidden and q_lora widths
    fp8_cases.check_quant(M, 6144, torch.bfloat16, device=DEV)
    fp8_cases.check_quant(M, 2048, torch.float32, device=DEV, kind="normal")


@pytest.mark.parametrize("variant", ["w8a16", "w8a8", "cublas", "dispatch"])
@pytest.mark.parametrize("M", [1, 17, 64, 4096])
@pytest.mark.parametrize("name", list(fp8_cases.GLM5_TP8_LINEARS))
def test_fp8_gemm_glm5(name, M, variant):
    from glm53.kernels import fp8_gemm_cublas

    N, K = fp8_cases.GLM5_TP8_LINEARS[name]
    if variant == "cublas" and not (fp8_gemm_cublas.supports(N, K) and fp8_gemm_cublas.available(0)):
        pytest.skip(f"cuBLAS blockwise FP8 does not take ({N}, {K}) or this GPU")
    fp8_cases.check_gemm(M, N, K, torch.bfloat16, variant, device=DEV)


@pytest.mark.parametrize("M", [128, 130, 1000, 4103])
def test_fp8_gemm_cublas_ragged_rows_and_fp32(M):
    # rows padded to 16 inside (cuBLAS refuses M = 130); fp32 activations and outputs
    from glm53.kernels import fp8_gemm_cublas

    if not fp8_gemm_cublas.available(0):
        pytest.skip("no cuBLAS blockwise FP8 scaling on this GPU / CUDA")
    fp8_cases.check_gemm(M, 576, 6144, torch.bfloat16, "cublas", "mixed", "ranges", device=DEV)
    fp8_cases.check_gemm(M, 512, 1024, torch.float32, "cublas", "tiny", "normal", device=DEV)


@pytest.mark.parametrize("M", [1, 16, 300])
def test_silu_mul(M):  # the embedded draft's and the dense layer's widths, and GLM-5's dense one
    for inter in (768, 12288):
        cases.check_silu_mul(M, inter, torch.bfloat16, device=DEV)
    cases.check_silu_mul(M, 768, torch.float32, device=DEV)


@pytest.mark.parametrize("M", [1, 33, 4096])
def test_fp8_producers_glm5(M):
    # RMSNorm over the hidden and q_lora widths, SwiGLU over the dense and shared intermediates
    fp8_cases.check_rms_norm_fp8(M, 6144, torch.bfloat16, device=DEV, dense=True)
    fp8_cases.check_rms_norm_fp8(M, 2048, torch.bfloat16, device=DEV, dense=False)
    fp8_cases.check_silu_mul_fp8(M, 1536, torch.bfloat16, device=DEV)
    fp8_cases.check_silu_mul_fp8(M, 256, torch.bfloat16, device=DEV)
    fp8_cases.check_add_norms(M, 6144, torch.bfloat16, device=DEV)
    fp8_cases.check_uv_product_fp8(M, 64, 256, 512, torch.bfloat16, device=DEV)  # the slice's heads
    fp8_cases.check_uv_product_fp8(M, 8, 256, 512, torch.bfloat16, device=DEV)  # GLM-5 tp = 8


@pytest.mark.parametrize("M", [33, 130, 4096])  # Triton w8a8, then cuBLAS where the shape allows
@pytest.mark.parametrize("N,K", [(2816, 6144), (6144, 2048), (6144, 256)])
def test_fp8_gemm_rows_glm5(M, N, K):
    fp8_cases.check_gemm_rows(M, N, K, device=DEV)


@pytest.mark.parametrize("N", [8, 65, 4096])  # the routed experts' w8a8 sizes (8: two terms)
def test_moe_fp8_reads_norm_rows_glm5(N):
    c = fp8_cases.GLM5_TP8_EXPERTS
    fp8_cases.check_moe_rows(N, c["H"], c["I"], c["E"], c["k"], device=DEV)


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
@pytest.mark.parametrize("M", [3, 130])
@pytest.mark.parametrize("w_kind,x_kind", [("tiny", "ranges"), ("large", "ranges"), ("mixed", "normal")])
def test_fp8_gemm_scales_and_ragged(variant, M, w_kind, x_kind):
    # kv_a's partial row block, a K with a partial block, fp32 activations (IEEE products)
    fp8_cases.check_gemm(M, 576, 6144, torch.bfloat16, variant, w_kind, x_kind, device=DEV)
    fp8_cases.check_gemm(M, 200, 300, torch.float32, variant, w_kind, x_kind, device=DEV)


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
def test_fp8_gemm_tilings_glm5(variant):
    # the benchmark's sweep candidates: split-K, narrow and wide tiles, K steps of 64
    from glm53.kernels.fp8_gemm_triton import GemmConfig

    for cfg in (GemmConfig(16, 32, 128, SPLIT_K=8, num_stages=4), GemmConfig(16, 128, 128, SPLIT_K=2, num_stages=4),
                GemmConfig(64, 64, 128, SPLIT_K=4, num_stages=4), GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
                GemmConfig(128, 128, 64, num_warps=8, num_stages=4)):
        fp8_cases.check_gemm(64 if cfg.BM < 128 else 1000, 576, 6144, torch.bfloat16, variant, device=DEV, config=cfg)


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
def test_fp8_gemm_swapped_tiles_glm5(variant):
    # the weight tile as the left operand (decode tiles): one and two terms, split-K, kv_a's partial
    # row block, 64- and 128-wide tiles
    from glm53.kernels.fp8_gemm_triton import GemmConfig

    for M, bt, bn, split, stages in ((1, 16, 64, 6, 4), (8, 16, 128, 3, 3), (16, 32, 64, 1, 6), (33, 64, 128, 2, 4)):
        cfg = GemmConfig(bt, bn, 128, SPLIT_K=split, num_stages=stages, SWAP=True)
        fp8_cases.check_gemm(M, 576, 6144, torch.bfloat16, variant, "mixed", device=DEV, config=cfg)
        fp8_cases.check_gemm(M, 6144, 2048, torch.bfloat16, variant, device=DEV, config=cfg, lo=False)


@pytest.mark.parametrize("N,E_R,k,shared", [(1, 16, 8, 16), (4, 64, 8, 64), (1, 256, 8, 256), (4, 256, 8, 256)])
def test_route_plan_one_launch_gpu(N, E_R, k, shared):
    # the slice's 16 experts and GLM-5's 256 at tp = 8 (the shared expert stacked): the bits of
    # the two launches
    cases.check_route_plan(N, E_R, k, shared, True, device=DEV, BM=8)


@pytest.mark.parametrize("M", [1, 4, 16])
def test_readers_take_row_parts_gpu(M):
    cases.check_readers_take_row_parts(M, device=DEV)


@pytest.mark.parametrize("M", [1, 64])
def test_norms_take_row_parts_gpu(M):  # and a stage's last residual add (`row_parts.add_rows`)
    cases.check_norms_take_row_parts(M, 6144, device=DEV)


def check_launched_early(step, xs, early: list, plain) -> None:
    """`step(x, cfg)` with each config of `early` (a kernel launched while the one before it runs,
    prefetching what does not depend on it) gives the bits of `step(x, plain)`, eager and replayed
    in a CUDA graph on new inputs `xs[1:]` copied into the captured one."""
    def flat(out):
        return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if t is not None]

    want = [flat(step(x, plain)) for x in xs]
    for cfg in early:
        assert all(torch.equal(a, b) for a, b in zip(flat(step(xs[0], cfg)), want[0], strict=True)), cfg
        static = xs[0].clone()
        step(static, cfg)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = flat(step(static, cfg))
        for x, y in zip(xs[1:], want[1:]):
            static.copy_(x)
            g.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(out, y, strict=True)), cfg


@pytest.mark.parametrize("M,N,K,split", [(1, 2752, 6144, 3), (1, 6144, 16384, 3), (16, 384, 200, 2), (3, 576, 2048, 1)])
def test_fp8_gemm_launched_early_matches(M, N, K, split):
    # the decode product launched while its producer (the quantizing norm) runs, prefetching its
    # weight rows (none, 256 bytes, the whole split; a K that is no multiple of 16 starts rows
    # unaligned): the bits of the product launched the usual way. Without the wait it reads the
    # producer's rows before they are written
    import dataclasses

    from glm53.kernels.fp8_act import rms_norm_fp8
    from glm53.kernels.fp8_gemm_triton import GemmConfig, fp8_gemm_w8a8_quantized
    from glm53.kernels.fp8_quant import FP8

    w = (torch.randn(N, K, device=DEV) * 0.5).to(FP8)
    ws = torch.rand((N + 127) // 128, (K + 127) // 128, device=DEV) * 0.01 + 1e-3
    nw = torch.rand(K, device=DEV, dtype=torch.bfloat16) + 0.5
    plain = GemmConfig(16 if M <= 8 else 32, 64, 128, SPLIT_K=split, num_stages=4, SWAP=True)

    def step(x, cfg):
        _, rows = rms_norm_fp8(x, nw, 1e-6)
        q, s = rows.rows()
        return fp8_gemm_w8a8_quantized(q, s, w, ws, torch.bfloat16, config=cfg, lo=rows.lo_rows())

    xs = [torch.randn(M, K, device=DEV, dtype=torch.bfloat16) * 3 for _ in range(3)]
    check_launched_early(step, xs, [dataclasses.replace(plain, PDL=True, PREFETCH=pf) for pf in (0, 256, 1 << 20)],
                         plain)


@pytest.mark.parametrize("T,H,fp8_cache", [(1, 64, False), (1, 64, True), (4, 8, False), (16, 8, True)])
def test_uv_product_takes_the_splits(T, H, fp8_cache):
    # the slice's 64 heads and GLM-5 tp = 8's 8 at decode sizes, top-2048 (32 splits at one token):
    # the W_UV product combining the splits gives the bits of the combine launch then the product
    fp8_cases.check_uv_takes_splits(T, H, 512, 64, 2048, 256, fp8_cache=fp8_cache, device=DEV)


@pytest.mark.parametrize("H,fp8_cache", [(64, False), (64, True), (8, True)])
def test_uv_row_kernel(H, fp8_cache):
    # one token's row kernel (fp8_act.UV_ROW) at the slice's 64 heads and tp = 8's 8, top-2048:
    # given the splits and given o_lat, against the batched product
    fp8_cases.check_uv_row_takes_splits(H, 512, 64, 2048, 256, num_splits=32, fp8_cache=fp8_cache, device=DEV)
    fp8_cases.check_uv_product_fp8(1, H, 256, 512, torch.bfloat16, device=DEV, row=True)


@pytest.mark.parametrize("T,H", [(1, 64), (3, 8), (16, 64)])
def test_uv_product_launched_early_matches(T, H):
    # the W_UV product launched while the split combine before it runs (which lets it launch as
    # the combine starts), prefetching none, some or all of each W_UV row: the bits of the product
    # launched the usual way. Without its wait it reads o_lat before the combine writes it
    from glm53.kernels.fp8_act import uv_product_fp8_triton
    from glm53.kernels.sparse_mla_triton import combine_splits

    R, V, splits = 512, 256, 8
    w_uv = torch.randn(H, V, R, device=DEV, dtype=torch.bfloat16) * 0.05

    def step(part, cfg):
        lse = part[..., 0] * 4  # the log-sum-exps ride along in the same input
        o_lat = torch.empty(T, H, R, device=DEV, dtype=torch.bfloat16)
        combine_splits(part, lse, o_lat, splits, R, R)
        rows = uv_product_fp8_triton(o_lat, w_uv, pdl=cfg[0], prefetch=cfg[1], row=cfg[2])
        return (*rows.rows(), *(rows.lo_rows() or ()))

    xs = [torch.randn(T, H, splits, R, device=DEV) for _ in range(3)]
    for row in (False, True) if T == 1 else (False,):  # one token: the row kernel launched early too
        check_launched_early(step, xs, [(True, 0, row), (True, 256, row), (True, 1024, row)], (False, 0, row))


@pytest.mark.parametrize("N", [1, 3, 8])
def test_moe_fp8_down_launched_early_matches(N):
    # the decode down kernel launched while gate+up runs (which lets it launch as it starts),
    # reading the routing plan and prefetching none, some or all of each weight row before it
    # waits: the bits of the usual launch, w8a8 (two terms) and w8a16, split K and not. Without
    # its wait it reads h before gate+up writes it
    import dataclasses

    from glm53.kernels.moe_fp8_triton import moe_experts_fp8_triton
    from glm53.kernels.moe_triton import MoEConfig

    c = fp8_cases.GLM5_TP8_EXPERTS
    _, weights, ids, *experts = fp8_cases.moe_fp8_inputs(N, c["H"], c["I"], c["E"] + 1, c["k"] + 1, torch.bfloat16,
                                                          device=DEV, fused=True)
    for variant, split in (("w8a8", 4), ("w8a16", 1)):
        plain = MoEConfig(BM=16, BN1=128, BN2=64, BK=128, num_warps=4, num_stages=3, SPLIT_K=split, SWAP=True)

        def step(x, cfg):
            return moe_experts_fp8_triton(x, weights, ids, *experts, variant=variant, config=cfg)

        xs = [torch.randn(N, c["H"], device=DEV, dtype=torch.bfloat16) for _ in range(3)]
        check_launched_early(step, xs, [dataclasses.replace(plain, PDL=True, PREFETCH=pf) for pf in (0, 256, 1 << 20)],
                             plain)


@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("bn2,split,stages", [(64, 1, 3), (128, 4, 2)])
def test_moe_fp8_swapped_tiles_glm5(N, bn2, split, stages):
    # GLM-5's stacks at tp = 8 with the shared expert as one more, the weight tiles as the left
    # operands, w8a8 (two terms at these sizes) and w8a16
    from glm53.kernels.moe_triton import MoEConfig

    c = fp8_cases.GLM5_TP8_EXPERTS
    for variant in ("w8a8", "w8a16"):
        cfg = MoEConfig(BM=16, BN1=128, BN2=bn2, BK=128, num_warps=4, num_stages=stages, SPLIT_K=split, SWAP=True)
        fp8_cases.check_moe_fp8(N, c["H"], c["I"], c["E"] + 1, c["k"] + 1, torch.bfloat16, variant, device=DEV,
                                config=cfg)


@pytest.mark.parametrize("variant", ["w8a16", "w8a8", "dispatch"])
@pytest.mark.parametrize("N", [1, 16, 64, 4096])
def test_moe_fp8_glm5(N, variant):
    # GLM-5's routed experts per rank at tp = 8 (E 256, H 6144, I 256, top-8); fused gate_up at 64
    c = fp8_cases.GLM5_TP8_EXPERTS
    fp8_cases.check_moe_fp8(N, c["H"], c["I"], c["E"], c["k"], torch.bfloat16, variant, device=DEV,
                            n_empty=8 if N > 1 else 0, fused=N == 64)


@pytest.mark.parametrize("split", [2, 5, 12, 16])
@pytest.mark.parametrize("stages", [2, 4])
def test_moe_fp8_split_k_glm5(split, stages):
    # GLM-5's stacks at tp = 8 with the shared expert as one more (257 experts, 9 slots), decode
    # tiles, the gate+up kernel's K cut in `split` slices (5: uneven, 12: 4 blocks each)
    from glm53.kernels.moe_triton import MoEConfig

    c = fp8_cases.GLM5_TP8_EXPERTS
    cfg = MoEConfig(BM=16, BN1=128, BN2=64, BK=128, num_warps=4, num_stages=stages, SPLIT_K=split)
    for N in (1, 3):
        fp8_cases.check_moe_fp8(N, c["H"], c["I"], c["E"] + 1, c["k"] + 1, torch.bfloat16, "w8a8", device=DEV,
                                config=cfg)


@pytest.mark.parametrize("split", [1, 4, 5, 16])
def test_moe_fp8_gemv_glm5(split):
    # the per-pair GEMVs (w8a16 at a few tokens) on GLM-5's stacks at tp = 8 with the shared expert
    # as one more (257 experts, 9 slots), H in `split` slices (5: uneven), and the rule's own config
    from glm53.kernels.moe_fp8_gemv_triton import MoEGemvConfig

    c = fp8_cases.GLM5_TP8_EXPERTS
    for N in (1, 4):
        for cfg in (MoEGemvConfig(BN1=16, BN2=128, SPLIT=split), None):
            if cfg is None and split != 1:
                continue
            fp8_cases.check_moe_fp8(N, c["H"], c["I"], c["E"] + 1, c["k"] + 1, torch.bfloat16, "w8a16",
                                    device=DEV, config=cfg, fused=N == 4)


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
def test_moe_fp8_odd_shapes(variant):
    # I not a multiple of 128 in the fused layout, partial K blocks, fp32, mixed scales, int32 ids
    fp8_cases.check_moe_fp8(200, 320, 160, 12, 6, torch.float32, variant, device=DEV, n_empty=3, fused=True,
                            kind="mixed", ids_dtype=torch.int32)
    fp8_cases.check_moe_fp8(33, 6144, 256, 16, 8, torch.bfloat16, variant, device=DEV, kind="tiny")


# ---- fp32 small-N linear (router logits, indexer head gates: kernels/linear_f32) ----------------
def test_linear_f32_gpu(monkeypatch):
    from glm53.kernels import linear_f32_triton as lft
    from glm53.kernels.linear_f32 import TRITON_MAX_ROWS, linear_f32

    def check(y, x, w, scale):
        want = x.double() @ w.double().T * scale
        # fp64 differs from an IEEE fp32 product only by fp32 rounding of the sum: bound it by
        # the dot product's own scale, |x_m| |w_n| (a dropped or tf32-rounded term is far above)
        tol = 1e-5 * abs(scale) * x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)
        assert y.dtype == torch.float32 and y.shape == want.shape
        assert ((y.double() - want).abs() <= tol).all(), ((y.double() - want).abs() / tol).max()

    K = 6144
    for M in (1, 8, 64):
        for N in (16, 32, 256):
            x = torch.randn(M, K + 128, device=DEV).bfloat16()[:, 64:64 + K]  # rows strided
            w = torch.randn(N, K, device=DEV)
            check(lft.linear_f32_triton(x, w, 0.0625), x, w, 0.0625)
            check(lft.linear_f32_triton(x.float(), w), x.float(), w, 1.0)
    x, w = torch.randn(TRITON_MAX_ROWS + 1, K, device=DEV).bfloat16(), torch.randn(256, K, device=DEV)
    monkeypatch.setattr(lft, "linear_f32_triton", None)  # past TRITON_MAX_ROWS: the torch path
    check(linear_f32(x, w, 0.5), x, w, 0.5)

