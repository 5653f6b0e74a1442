"""The variant enumeration (kernels/variants.py) on the CPU: every count maps into the enumerated
keys, the warm-up shapes reach every key, and counts with one key launch the same compiled
variant (the launchers' real arguments, recorded instead of run, through Triton's own view of
which arguments specialize)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("records real JIT launches (not the interpreter's)", allow_module_level=True)

from glm53.kernels import fp8_gemm_triton, fp8_quant, moe_triton, sparse_mla_fp8_triton, sparse_mla_triton, topk_triton  # noqa: E402
from glm53.kernels import draft_attention_triton, fp8_act, moe_fp8_gemv_triton, moe_fp8_triton, row_parts  # noqa: E402
from glm53.kernels import variants as v  # noqa: E402
from glm53.kernels.fp8_quant import quantize_fp8_blocks  # noqa: E402
from glm53.kernels.latent_cache_fp8 import LatentLayout  # noqa: E402

BF16_HOPPER = v.ServeShape(max_tokens=300, max_context=20000, num_sms=132, heads=64, kv_lora_rank=512,
                           qk_rope_head_dim=64, index_topk=2048, dtype=torch.bfloat16, n_experts=16,
                           experts_per_token=8, hopper=True)
FP8_ALL = v.ServeShape(max_tokens=300, max_context=20000, num_sms=132, heads=8, kv_lora_rank=512,
                       qk_rope_head_dim=64, index_topk=2048, dtype=torch.bfloat16, n_experts=257,
                       experts_per_token=9, expert_inter=256, hidden=6144, fp8_linear=True, fp8_experts=True, fp8_kv=True, hopper=True,
                       cublas_fp8=True)


def test_logits_width():
    for n in range(1, 200):
        w = v.logits_width(n)
        assert w % v.LOGITS_ALIGN == 0 and n <= w < n + v.LOGITS_ALIGN


@pytest.mark.parametrize("shape", [BF16_HOPPER, FP8_ALL], ids=["bf16", "fp8"])
def test_every_token_count_is_enumerated(shape):
    want = v.reachable(shape)
    for name, key in v.TOKEN_FAMILIES.items():
        for n in range(1, shape.max_tokens + 1):
            assert key(n, shape) in want[name], (name, n)
        # the representative of each key reaches it
        assert all(key(n, shape) == k for k, (n, _) in want[name].items())


@pytest.mark.parametrize("rank_width,rank_pairs", [(0, 1 << 27), (8192, 1 << 27), (5000, 1 << 27), (8192, 10**8)])
def test_every_topk_count_is_enumerated(monkeypatch, rank_width, rank_pairs):
    # with the rank kernel off, and on up to a width at a block edge and off one, its compares
    # bound giving each row count its own widest row
    monkeypatch.setattr(topk_triton, "RANK_MAX_WIDTH", rank_width)
    monkeypatch.setattr(topk_triton, "RANK_MAX_PAIRS", rank_pairs)
    s = BF16_HOPPER
    want = v.reachable(s)["topk"]
    assert all(v.topk_key(B, L, s) == k for k, (B, L) in want.items())
    widths = range(v.LOGITS_ALIGN, s.max_width + 1, v.LOGITS_ALIGN)
    rng = random.Random(0)
    for L in [16, 2048, 2064, 4096, 4112, s.max_width] + rng.sample(list(widths), 6):
        for B in range(1, s.max_tokens + 1):
            assert v.topk_key(B, L, s) in want, (B, L)
    for B in (1, 2, 3, 66, 67, 133, 264, 300):
        for L in widths:
            assert v.topk_key(B, L, s) in want, (B, L)
    for _ in range(300):
        B, L = rng.randint(1, s.max_tokens), rng.choice(widths)
        assert v.topk_key(B, L, s) in want, (B, L)


def test_topk_sample_step_is_enumerated():
    # past SHORT_SAMPLE_MAX_WIDTH the bracket samples SAMPLE scores, not SHORT_SAMPLE: a step in
    # the plan the width enumeration must see from both sides
    from glm53.kernels import topk_triton as tt

    s = dataclasses.replace(BF16_HOPPER, max_context=140000)
    edge = tt.SHORT_SAMPLE_MAX_WIDTH
    assert tt.row_sample(edge) == tt.SHORT_SAMPLE < tt.row_sample(edge + v.LOGITS_ALIGN) == tt.SAMPLE
    assert {edge, edge + v.LOGITS_ALIGN} <= set(v.topk_widths(s))
    want = v.reachable(s)["topk"]
    for L in [edge - 16, edge, edge + 16, edge + 32, 98304, s.max_width]:
        for B in (1, 8, 66, 300):
            assert v.topk_key(B, L, s) in want, (B, L)


@pytest.mark.parametrize("rank_width", [0, 8192])
@pytest.mark.parametrize("shape", [BF16_HOPPER, FP8_ALL], ids=["bf16", "fp8"])
def test_warmup_shapes_reach_every_key(shape, rank_width, monkeypatch):
    monkeypatch.setattr(topk_triton, "RANK_MAX_WIDTH", rank_width)
    want = v.reachable(shape)
    shapes = v.warmup_shapes(shape, want)
    assert all(1 <= n <= shape.max_tokens and 16 <= L <= shape.max_width and L % 16 == 0 for n, L in shapes)
    got: dict[str, set] = {}
    for n, L in shapes:
        for name, k in v.shape_keys(n, L, shape).items():
            got.setdefault(name, set()).add(k)
    for name, keys in want.items():
        assert set(keys) <= got[name], (name, set(keys) - got[name])
    assert len(shapes) < 40  # a few forwards, not one per count


# ---- the launchers' real launches, recorded --------------------------------------------------


def _signature(fn, args, kwargs) -> tuple:
    """What Triton compiles a variant for: constexpr values, int classes (unless not
    specialized), dtypes and alignment of tensors, and the launch options."""
    names = [p.name for p in fn.params]
    bound = dict(zip(names, args))
    bound.update({k: x for k, x in kwargs.items() if k in names})
    sig = []
    for p in fn.params:
        x = bound[p.name]
        if p.is_constexpr:
            sig.append((p.name, x))
        elif isinstance(x, bool):
            sig.append((p.name, "u1"))
        elif isinstance(x, int):
            sig.append((p.name, "int" if p.do_not_specialize else v.spec_class(x)))
        elif isinstance(x, float):
            sig.append((p.name, "fp32"))
        else:
            sig.append((p.name, str(x.dtype), x.data_ptr() % 16 == 0))
    opts = tuple(sorted((k, x) for k, x in kwargs.items() if k not in names))
    return fn.fn.__name__, tuple(sig), opts


@pytest.fixture
def recorded(monkeypatch):
    """Replace every kernel's launch with a recorder: {kernel name: signatures} of the launches."""
    log: list[tuple] = []
    kernels = [sparse_mla_triton._sparse_mla_kernel, sparse_mla_triton._combine_kernel,
               sparse_mla_fp8_triton._sparse_mla_fp8_kernel, fp8_gemm_triton._block_fp8_gemm_kernel,
               row_parts._sum_parts_kernel,
               fp8_quant._quant_groups_kernel, moe_triton._plan_kernel, moe_triton._gate_up_kernel,
               moe_triton._down_kernel, moe_fp8_triton._gate_up_fp8_kernel,
               moe_fp8_triton._down_fp8_kernel, moe_fp8_gemv_triton._gate_up_gemv_kernel,
               moe_fp8_gemv_triton._down_gemv_kernel, topk_triton._bracket_kernel,
               topk_triton._scan_kernel, topk_triton._finish_kernel, topk_triton._rank_kernel,
               draft_attention_triton._draft_attn_kernel,
               draft_attention_triton._combine_kernel, fp8_act._uv_fp8_kernel, fp8_act._uv_row_kernel]
    for fn in kernels:
        def run(*args, grid, warmup, _fn=fn, **kwargs):
            log.append(_signature(_fn, args, kwargs))
        monkeypatch.setattr(fn, "run", run)
    return log


def _same_key_same_launch(log, keyed_calls):
    """keyed_calls: [(key, call)]: counts with one key must launch exactly the same variants."""
    by_key: dict = {}
    for key, call in keyed_calls:
        log.clear()
        call()
        sigs = tuple(sorted(set(log)))
        assert sigs, "nothing launched"
        by_key.setdefault(key, set()).add(sigs)
    for key, sigs in by_key.items():
        assert len(sigs) == 1, f"key {key} launched {len(sigs)} different variant sets"
    return by_key


def _cpu_shape(**kw) -> v.ServeShape:
    # the launchers plan for the CPU's 4 "SMs" (topk_triton/_sparse_mla _num_sms) when not on a GPU
    base = dict(max_tokens=64, max_context=20000, num_sms=4, heads=16, kv_lora_rank=64, qk_rope_head_dim=16,
                index_topk=64, dtype=torch.bfloat16)
    return v.ServeShape(**{**base, **kw})


def test_sparse_mla_same_key_same_launch(recorded):
    s = _cpu_shape(index_topk=256)  # 256 slots: up to 4 splits at 64-slot blocks
    pool = torch.randn(8, 16, 80, dtype=torch.bfloat16)
    bf16 = [(v.sparse_mla_key(T, s), lambda T=T: sparse_mla_triton.sparse_mla_triton(
        torch.randn(T, 16, 80, dtype=torch.bfloat16), pool, torch.randint(0, 128, (T, 256)), 0.1, 64))
        for T in range(1, 20)]
    by_key = _same_key_same_launch(recorded, bf16)
    assert len(by_key) >= 2  # split and unsplit both reached
    s8 = _cpu_shape(index_topk=256, fp8_kv=True)
    cache = torch.zeros(8, 16, LatentLayout(64, 16).bytes_per_token, dtype=torch.uint8)
    fp8 = [(v.sparse_mla_key(T, s8), lambda T=T: sparse_mla_fp8_triton.sparse_mla_fp8_triton(
        torch.randn(T, 16, 80, dtype=torch.bfloat16), cache, torch.randint(0, 128, (T, 256)), 0.1, 64))
        for T in range(1, 20)]
    assert len(_same_key_same_launch(recorded, fp8)) >= 2


@pytest.mark.parametrize("row", [False, True])
def test_uv_product_same_key_same_launch(recorded, monkeypatch, row):
    # the W_UV product after sparse MLA, the splits left to it where it takes them: counts with
    # one key launch one variant of the product, and both forms are reached (one token's row
    # kernel where `UV_ROW` is on)
    monkeypatch.setattr(fp8_act, "UV_ROW", row)
    s = _cpu_shape(index_topk=256, fp8_linear=True, v_head_dim=128)
    pool = torch.randn(8, 16, 80, dtype=torch.bfloat16)
    w_uv = torch.randn(16, 128, 64, dtype=torch.bfloat16)

    def product(T):
        o = sparse_mla_triton.sparse_mla_triton(torch.randn(T, 16, 80, dtype=torch.bfloat16), pool,
                                                torch.randint(0, 128, (T, 256)), 0.1, 64,
                                                keep_splits=fp8_act.takes_splits(T))
        recorded.clear()  # the product's launch only
        fp8_act.uv_product_fp8_triton(o, w_uv)

    calls = [(v.uv_product_key(T, s), lambda T=T: product(T)) for T in range(1, 40)]
    by_key = _same_key_same_launch(recorded, calls)
    assert {bool(k[1]) for k in by_key} == {True, False} and {k[0] for k in by_key} == {16, 32, 64}, by_key.keys()
    assert {k[2] for k in by_key} == ({False, True} if row else {False}), by_key.keys()
    assert v.uv_product_key(1, _cpu_shape(index_topk=256, fp8_linear=True, v_head_dim=64)) == ()


@pytest.mark.parametrize("w8a16_max_m", [0, 24])
def test_fp8_gemm_same_key_same_launch(recorded, monkeypatch, w8a16_max_m):
    # 24: the w8a16 tile kernel, then w8a8 (not served until benchmarks/fp8_gemm.py measures a
    # crossover, but the keys must hold for any)
    from glm53.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "W8A16_MAX_M", w8a16_max_m)
    s = _cpu_shape(fp8_linear=True)
    w, ws = quantize_fp8_blocks(torch.randn(192, 256))
    calls = []
    for M in range(1, 140):
        x = torch.randn(M, 256, dtype=torch.bfloat16)
        variant = v.fp8_gemm_key(M, s)[0]
        run = fp8_gemm_triton.fp8_gemm_w8a16 if variant == "w8a16" else fp8_gemm_triton.fp8_gemm_w8a8
        calls.append((v.fp8_gemm_key(M, s), lambda x=x, run=run: run(x, w, ws)))
    assert len(_same_key_same_launch(recorded, calls)) >= 4


def test_moe_same_key_same_launch(recorded):
    s = _cpu_shape(n_experts=4, experts_per_token=2)
    gate, up, down = (torch.randn(4, 32, 64, dtype=torch.bfloat16), torch.randn(4, 32, 64, dtype=torch.bfloat16),
                      torch.randn(4, 64, 32, dtype=torch.bfloat16))
    calls = []
    for N in range(1, 200, 3):
        x = torch.randn(N, 64, dtype=torch.bfloat16)
        ids = torch.randint(0, 4, (N, 2))
        calls.append((v.moe_key(N, s), lambda x=x, ids=ids: moe_triton.moe_experts_triton(
            x, torch.rand(ids.shape), ids, gate, up, down)))
    assert len(_same_key_same_launch(recorded, calls)) == 3


@pytest.mark.parametrize("w8a16_max_tokens", [0, 8])
def test_moe_fp8_same_key_same_launch(recorded, monkeypatch, w8a16_max_tokens):
    # the per-pair GEMVs up to MOE_GEMV_MAX_TOKENS tokens (experts 128 wide), then (8) the w8a16
    # tiles, then w8a8
    from glm53.kernels import moe_fp8

    from . import fp8_cases

    monkeypatch.setattr(moe_fp8, "MOE_W8A16_MAX_TOKENS", w8a16_max_tokens)
    s = _cpu_shape(n_experts=4, experts_per_token=2, expert_inter=128, hidden=256, fp8_experts=True)
    calls = []
    for N in range(1, 40, 3):
        inputs = fp8_cases.moe_fp8_inputs(N, 256, 128, 4, 2, torch.bfloat16)
        variant = moe_fp8.moe_fp8_variant(N, 128)  # the dispatcher's rule (CPU tensors take the reference)
        calls.append((v.moe_key(N, s), lambda a=inputs, var=variant: moe_fp8_triton.moe_experts_fp8_triton(*a, variant=var)))
    assert len(_same_key_same_launch(recorded, calls)) >= (3 if w8a16_max_tokens else 2)


@pytest.mark.parametrize("rank_width", [0, 4096])
def test_topk_same_key_same_launch(recorded, rank_width, monkeypatch):
    # eager page tables are padded to 16 columns (ModelRunner.build_batch), as here; the rank
    # kernel off, and on for the narrower rows
    monkeypatch.setattr(topk_triton, "RANK_MAX_WIDTH", rank_width)
    s = _cpu_shape(index_topk=64)
    rng = random.Random(1)
    calls = []
    for _ in range(60):
        B, L = rng.randint(1, 12), 16 * rng.randint(1, 400)
        logits = torch.randn(B, L)
        lengths = torch.randint(1, L + 1, (B,), dtype=torch.int32)
        table = torch.randint(0, 50, (B, 16 * rng.randint(1, 3)), dtype=torch.int32)
        calls.append((v.topk_key(B, L, s), lambda a=logits, b=lengths, t=table: topk_triton.topk_triton(
            a, b, 64, page_table=t, page_size=64)))
    assert len(_same_key_same_launch(recorded, calls)) >= 3


def test_topk_plan_matches_plan_topk():
    # variants.topk_plan restates plan_topk's sizes for any SM count; on the CPU plan_topk plans
    # for 4 (topk_triton._num_sms), so the two must agree there
    rng = random.Random(2)
    for _ in range(200):
        B, L, k = rng.randint(1, 400), 16 * rng.randint(1, 9000), rng.choice([64, 256, 2048])
        p = topk_triton.plan_topk(B, L, k, torch.device("meta"))
        want = v.topk_plan(B, L, k, 4)
        assert {f: getattr(p, f) for f in want} == want, (B, L, k)


def _draft_call(R, B, W, d, pool):
    """draft_attention_triton's launch as DraftAttention.forward makes it: the queries a view of
    the projection's rows, the block K/V [R, B, kv, hd], a fresh page table and mask."""
    kv, g, hd = d.kv_heads, d.group, d.head_dim
    rows = torch.randn(R * B, kv * g * hd, dtype=torch.bfloat16)
    q = rows.view(R, B, kv, g, hd).permute(0, 2, 3, 1, 4).reshape(R, kv, g * B, hd)
    k = torch.randn(R * B, kv, hd, dtype=torch.bfloat16).view(R, B, kv, hd)
    v_ = torch.randn(R * B, kv, hd, dtype=torch.bfloat16).view(R, B, kv, hd)
    table = torch.randint(0, pool.shape[0], (R, W))
    mask = torch.rand(R, W * d.page_size + B) < 0.5
    return lambda: draft_attention_triton.draft_attention_triton(q, pool, 1, table, k, v_, mask)


def test_draft_attention_same_key_same_launch(recorded):
    # the counts of a drafting forward (requests, block positions, context pages) pick no variant
    # outside the enumerated keys; W and the split plan's counts none at all
    for kv, g in [(2, 2), (4, 1)]:
        d = v.DraftShape(max_rows=12, max_block=16, max_pages=60, kv_heads=kv, group=g, head_dim=64, page_size=16,
                         num_sms=4)  # the launcher plans for the CPU's 4 "SMs"
        want = v.reachable_draft(d)
        assert all(v.draft_attention_key(R, B, W, d) == k for k, (R, B, W) in want.items())
        pool = torch.randn(64, 2 * kv, 2, 16, 64, dtype=torch.bfloat16)
        rng = random.Random(kv)
        calls = []
        for _ in range(80):
            R, B, W = rng.randint(1, 12), rng.randint(2, 16), rng.randint(1, 60)
            key = v.draft_attention_key(R, B, W, d)
            assert key in want, (R, B, W)
            calls.append((key, _draft_call(R, B, W, d, pool)))
        by_key = _same_key_same_launch(recorded, calls)
        assert len(by_key) >= 2 and set(by_key) <= set(want)
