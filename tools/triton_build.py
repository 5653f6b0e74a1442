"""Build Triton kernels for sm_90 without a GPU, as their launchers launch them: registers, spills.

    PYTHONPATH=.[:TRITON36] python tools/triton_build.py [--only topk,fp8_gemm,moe_fp8,attention,norms,moe,draft] [--sms 132]

Why: the interpreter runs a kernel's arithmetic, not its compilation (a loop-carried value whose
type changes, a layout the lowering rejects, a register file overrun), and the GPU is scarce.
Each case below runs the real launchers on CPU tensors at GLM-5's shapes, with every kernel's
`run` replaced by a recorder and the SM count a GPU's (so the launchers pick the tiles, splits
and warps they pick on the H200); each recorded launch is compiled by `triton.compile` for the
target (TTIR -> PTX -> cubin) with Triton's own specialization of its arguments (ints equal to 1
or divisible by 16, 16-byte-aligned pointers), and the cubin's resource usage (`cuobjdump
-res-usage`) gives registers and local memory (spills).
With the GPU image's Triton first on PYTHONPATH (`pip install --no-deps --target DIR
triton==3.6.0`) it builds what the device builds. `tools/gluon_build.py` does the same for the
Gluon kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv"}


@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: dict  # argument name -> value, as launched
    options: dict  # num_warps, num_stages, maxnreg, ...


@dataclass
class Built:
    name: str
    constexprs: dict
    options: dict
    registers: int
    local_bytes: int  # stack + local memory a thread: spills (0 when everything fits registers)
    shared: int
    seconds: float


def glm53_kernels() -> list:
    """Every Triton kernel (JITFunction) of the glm53.kernels modules."""
    import importlib
    import pkgutil

    import glm53.kernels as pkg
    from triton.runtime.jit import JITFunction

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"glm53.kernels.{info.name}")
        out += [v for k, v in vars(mod).items() if isinstance(v, JITFunction) and v.__module__ == mod.__name__
                and v.fn.__name__.endswith("_kernel")]
    return out


@contextlib.contextmanager
def recording(sms: int) -> Iterator[list[Launch]]:
    """Record the launches of every glm53 Triton kernel instead of running them (a launcher's
    later kernels then read unwritten buffers: only the launches matter here); every launcher's
    SM count reads `sms`, so it sizes grids, splits and tiles as on a GPU."""
    from glm53.kernels import (dispatch, draft_attention_triton, fp8_gemm_triton, moe_fp8_triton, sparse_mla_triton,
                               topk_triton)

    log: list[Launch] = []
    kernels = glm53_kernels()
    saved = [(fn, fn.run) for fn in kernels]
    # every SM count a launcher reads (sparse MLA's and the draft attention's say 4 for a CPU tensor)
    counts = ((dispatch, "sm_count"), (fp8_gemm_triton, "sm_count"), (moe_fp8_triton, "sm_count"),
              (topk_triton, "_num_sms"), (sparse_mla_triton, "_num_sms"), (draft_attention_triton, "_num_sms"))
    patched = [(m, name, getattr(m, name)) for m, name in counts]
    for fn in kernels:
        def run(*args, grid, warmup, _fn=fn, **kwargs):
            names = [p.name for p in _fn.params]
            bound = {p.name: p.default for p in _fn.params if p.has_default}  # (a constexpr left out)
            bound.update(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            log.append(Launch(_fn, bound, {k: v for k, v in kwargs.items() if k not in names}))
        fn.run = run
    for m, name, _ in patched:
        setattr(m, name, lambda device, _s=sms: _s)
    try:
        yield log
    finally:
        for fn, run in saved:
            fn.run = run
        for m, name, old in patched:
            setattr(m, name, old)


def source(launch: Launch) -> tuple[ASTSource, dict]:
    """The ASTSource Triton would compile for this launch, and its compile options."""
    fn = launch.kernel
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        x = launch.args[p.name]
        if p.is_constexpr or x is None:
            sig[p.name], const[p.name] = "constexpr", x
        elif isinstance(x, bool):
            sig[p.name] = "i1"
        elif isinstance(x, int):
            if x == 1 and not p.do_not_specialize:
                sig[p.name], const[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i32" if -(2**31) <= x < 2**31 else "i64"
            if x % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(x, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "*" + DTYPES[x.dtype]
            if x.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, const, attrs), dict(launch.options)


def build(launch: Launch, arch: int = 90) -> Built:
    """Compile the launch for sm_`arch` and read the cubin's resource usage (`cuobjdump`)."""
    src, options = source(launch)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    secs = time.time() - t0
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    const = {n: v for n, v in launch.args.items() if src.signature.get(n) == "constexpr"}
    return Built(launch.kernel.fn.__name__, const, options, int(res["REG"]), int(res["STACK"]) + int(res["LOCAL"]),
                 k.metadata.shared, secs)


# ---- cases: the launchers at GLM-5's shapes (tp = 8 for the products), on CPU tensors ----------


def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An input nothing reads (launches are recorded, not run): only its shape, strides and dtype matter."""
    return torch.empty(shape, dtype=dtype)


F32, I32, FP8 = torch.float32, torch.int32, torch.float8_e4m3fn


def case_topk():
    from glm53.kernels import topk_triton as tt

    def run():
        # decode rows at 4K-128K contexts, top-2048; the finish splits in two programs a row while
        # 2B <= SMs (B = 128: one)
        for B, L in ((1, 4096), (64, 8192), (128, 4096), (8, 65536), (1, 131072)):
            pages = -(-L // 64)
            tt.topk_triton(empty(B, L, dtype=F32), torch.full((B,), L, dtype=I32), 2048,
                           page_table=empty(B, pages + 16, dtype=I32)[:, :pages], page_size=64, pdl=True, rank=False)
        # short decode rows in one launch (`_rank_kernel`)
        for B, L in ((1, 4224), (4, 8192)):
            pages = -(-L // 64)
            tt.topk_triton(empty(B, L, dtype=F32), torch.full((B,), L, dtype=I32), 2048,
                           page_table=empty(B, pages + 16, dtype=I32)[:, :pages], page_size=64, pdl=True, rank=True)

    return run


def case_fp8_gemm():
    from glm53.kernels import fp8_gemm_triton as g

    def run():
        w, ws = empty(2048, 768, dtype=FP8), empty(16, 6, dtype=F32)  # q_b at tp = 8, 128x128 block scales
        for M in (1, 16, 64, 4096):
            g.fp8_gemm_w8a8(empty(M, 768), w, ws, lo=M <= 16)
        g.fp8_gemm_w8a16(empty(1, 768), w, ws)
        # a K of 16 blocks at decode: 6 stages, split in 4 (4,096 rows) or at 8 warps (17,408 rows)
        for n in (4096, 17408):
            w, ws = empty(n, 2048, dtype=FP8), empty(n // 128, 16, dtype=F32)
            for M in (1, 16):
                g.fp8_gemm_w8a8(empty(M, 2048), w, ws, lo=True)

    return run


def case_moe_fp8():
    from glm53.kernels import moe_fp8_triton as m

    def run():
        # GLM-5's tp = 8 expert widths (hidden 6144, 256 columns an expert), fewer experts; the
        # gate and up halves fused, as the loader stacks them
        E, H, inter, topk = 9, 6144, 256, 8
        gate, gs = empty(E, 2 * inter, H, dtype=FP8), empty(E, 4, 48, dtype=F32)
        down, ds = empty(E, H, inter, dtype=FP8), empty(E, 48, 2, dtype=F32)
        for N in (1, 4, 64):
            for variant in ("w8a8", "w8a16"):
                m.moe_experts_fp8_triton(empty(N, H), empty(N, topk, dtype=F32), empty(N, topk, dtype=I32), gate, gs,
                                         None, None, down, ds, variant=variant)
        # the router's scores routed and planned in the experts' launch: GLM-5's 256 experts at tp = 8
        # (the shared one stacked), decode tiles; and the slice's 16 (up to ROUTE_PLAN_MAX_TOKENS)
        from glm53.kernels.route_triton import RouterLogits

        for N, E_R in ((1, 256), (4, 256), (4, 16)):
            router = RouterLogits(empty(N, E_R, dtype=F32), empty(E_R, dtype=F32), topk, True, 2.5, E_R)
            stacks = (empty(E_R + 1, 2 * inter, H, dtype=FP8), empty(E_R + 1, 4, 48, dtype=F32), None, None,
                      empty(E_R + 1, H, inter, dtype=FP8), empty(E_R + 1, 48, 2, dtype=F32))
            m.moe_experts_fp8_triton(empty(N, H), router, None, *stacks, variant="w8a8")

    return run


def case_attention():
    from glm53.kernels import index_cache_fp8
    from glm53.kernels.absorb_triton import absorbed_query_triton
    from glm53.kernels.indexer_logits_triton import indexer_logits_triton
    from glm53.kernels.kv_rows import CacheRow
    from glm53.kernels.kv_rows_triton import store_rows_triton
    from glm53.kernels.linear_f32_triton import linear_f32_triton
    from glm53.kernels.row_parts import RowParts
    from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton
    from glm53.kernels.sparse_mla_triton import sparse_mla_triton

    def run():
        # GLM-5 at tp = 8: 8 heads of 192 nope + 64 rope absorbed into [512 latent | 64 rope], the
        # indexer's 32 heads of 128 (replicated), top-2048 of 4096-token contexts on 64-token pages;
        # a layer's cache is the strided view pool[:, 1] of a page-major pool (KVPools.view)
        pages, cos, coords = 65, empty(1, 32, dtype=F32), (empty(1, dtype=torch.long),) * 2
        latent, index_k = empty(pages, 2, 64, 576)[:, 1], empty(pages, 2, 64, 128)[:, 1]
        latent_fp8 = empty(pages, 2, 64, 656, dtype=torch.uint8)[:, 1]  # latent_cache_fp8's row
        # absorbed query (decode sizes only: absorb.MAX_TOKENS), W_UK the first 192 rows of kv_b_proj's
        absorbed_query_triton(empty(1, 8, 256), empty(8, 192 + 256, 512)[:, :192], cos, cos, interleave=True)
        # the latent row (RMSNorm of 512, rope after it) and the indexer key (LayerNorm, rope first),
        # each alone and both in one launch; decode: the fused q_a | kv_a | index-key product's
        # split-K sum taken by the stores
        fused_a = empty(3, 1, 2048 + 576 + 128, dtype=F32)
        for parts in (False, True):
            x = fused_a if parts else empty(1, 1, 2048 + 576 + 128)
            lat, key = ((RowParts(c, torch.bfloat16) if parts else c[0]) for c in (x[..., 2048:2624], x[..., 2624:]))
            rows = [CacheRow(lat, latent, empty(512), 1e-6, 512, 512, True),
                    CacheRow(key, index_k, empty(128), 1e-6, 128, 0, True, empty(128))]
            for job in ([rows[0]], [rows[1]], rows):
                store_rows_triton(job, coords, cos, cos)
        for M in (1, 64):  # the indexer's fp32 head gates, up to linear_f32.TRITON_MAX_ROWS rows
            linear_f32_triton(empty(M, 6144), empty(32, 6144, dtype=F32), 0.01)
        fp8_keys = index_cache_fp8.split_view(index_cache_fp8.alloc_pool(pages, 2, 64)[:, 1])
        for keys, scales in ((index_k, None), fp8_keys):  # no size picks a variant: one token
            indexer_logits_triton(empty(1, 32, 128), empty(1, 32, dtype=F32), keys, empty(1, 64, dtype=I32),
                                  torch.full((1,), 4096, dtype=I32), 4096, k_scales=scales)
        # bf16 keys: q's first 64 columns rotated as the logits load it (the indexer's path)
        indexer_logits_triton(empty(1, 32, 128), empty(1, 32, dtype=F32), index_k, empty(1, 64, dtype=I32),
                              torch.full((1,), 4096, dtype=I32), 4096, rope=(cos, cos, True))
        for T in (1, 64, 4096):  # 32 (FP8: 64), 2 and no splits of the 2048 slots
            q, idx = empty(T, 8, 576), empty(T, 2048, dtype=I32)
            sparse_mla_triton(q, latent, idx, 0.0625, 512)
            sparse_mla_fp8_triton(q, latent_fp8, idx, 0.0625, 512)

    return run


def case_norms():
    from glm53.kernels.fp8_act import rms_norm_fp8_triton, silu_mul_fp8_triton, uv_product_fp8_triton
    from glm53.kernels.sparse_mla_triton import Splits
    from glm53.kernels.norm_triton import rms_norm_triton, sum_rms_norm_triton
    from glm53.kernels.rope_triton import apply_rope_triton
    from glm53.kernels.row_parts import RowParts, sum_parts_triton
    from glm53.kernels.step_inputs_triton import step_inputs_triton
    from glm53.kernels.swiglu_triton import silu_mul_triton

    def run():
        # hidden 6144 (the residual adds and norms; the final norm), q_lora 2048 (q_a), the latent's
        # 512 (FP8 cache path: a column slice of the 576-wide row), the draft's heads of 128
        rms_norm_triton(empty(1, 6144), empty(6144), 1e-5, add=empty(1, 6144))
        for x in (empty(1, 6144), empty(1, 2048), empty(1, 576)[:, :512], empty(1, 6, 128)):
            rms_norm_triton(x, empty(x.shape[-1]), 1e-6)
        # the draft's context rows: 3 feature products summed and normed (16 verify rows)
        sum_rms_norm_triton(empty(3, 16, 6144), None, empty(6144), 1e-6, torch.bfloat16)
        for m in (1, 4096):  # decode rows carry the second e4m3 term (fp8_act.two_terms)
            # layers.norm_for: layer 0's input norm (no add), the others'; the MoE and the indexer's
            # gates read the dense norm too, a dense MLP or a shared-index layer only the rows
            for add, dense in ((None, True), (empty(m, 6144), True), (empty(m, 6144), False)):
                rms_norm_fp8_triton(empty(m, 6144), empty(6144), 1e-5, dense=dense, add=add)
            rms_norm_fp8_triton(empty(m, 2048), empty(2048), 1e-6)  # q_a, for q_b
        # decode: q_a's norm takes the fused q_a | kv_a | index-key product's split-K sum
        q_a = RowParts(empty(3, 1, 2048 + 576 + 128, dtype=F32)[..., :2048], torch.bfloat16)
        rms_norm_fp8_triton(q_a, empty(2048), 1e-6)
        rms_norm_triton(q_a, empty(2048), 1e-6)
        # a stage's last residual add takes its MoE's 9 slot rows (the shared expert stacked)
        sum_parts_triton(empty(9, 1, 6144), torch.bfloat16, base=empty(1, 6144))  # row_parts.add_rows
        for m in (1, 64, 4096):  # the dense MLP's 12288 / 8 = 1536, halves of the fused gate_up
            gu = empty(m, 2 * 1536)
            silu_mul_fp8_triton(gu[:, :1536], gu[:, 1536:])
        for m in (1, 64):  # o_proj's rows from W_UV at decode sizes: GLM-5 tp = 8's 8 heads of 256 over 512
            uv_product_fp8_triton(empty(m, 8, 512), empty(8, 448, 512)[:, 192:])
        # the same, combining the attention's splits itself at up to fp8_act.UV_SPLITS_MAX_ROWS rows: 32
        # (bf16 cache) or 64 (FP8 cache, 32-slot blocks) at one token, 32 at four
        for m, s in ((1, 32), (1, 64), (4, 32)):
            splits = Splits(empty(m, 8, 512), empty(m, 8, s, 512, dtype=F32), empty(m, 8, s, dtype=F32), s, 512)
            uv_product_fp8_triton(splits, empty(8, 448, 512)[:, 192:])
            if m == 1:  # one token's row kernel (fp8_act.UV_ROW), given the splits and given o_lat
                uv_product_fp8_triton(splits, empty(8, 448, 512)[:, 192:], row=True)
        uv_product_fp8_triton(empty(1, 8, 512), empty(8, 448, 512)[:, 192:], row=True)
        for m in (1, 16):  # bf16 SwiGLU: the draft's 768-wide MLP at decode and verify rows
            gu = empty(m, 2 * 768)
            silu_mul_triton(gu[:, :768], gu[:, 768:])
        # rope: the indexer's q (interleaved, 32 heads), MLA's q_pe past absorb.MAX_TOKENS (8 heads),
        # the 2-D k_pe / indexer key of the FP8 caches, the draft's q and k (NeoX halves of 128)
        cs32, cs64 = empty(1, 32, dtype=F32), empty(1, 64, dtype=F32)
        for x, cs, il in ((empty(1, 32, 128)[..., :64], cs32, True), (empty(1, 8, 256)[..., 192:], cs32, True),
                          (empty(1, 576)[:, 512:], cs32, True), (empty(1, 6, 128), cs64, False),
                          (empty(1, 1, 128), cs64, False)):
            apply_rope_triton(x, cs, cs, il, out=x)
        # a decode step's slots, lengths and cos/sin: a 64-page width bucket of the decode state's
        # page table (3168 pages a row: GLM-5's 202752 positions)
        step_inputs_triton(empty(64, dtype=torch.long), empty(64, 3168, dtype=I32)[:, :64], 64, empty(32, dtype=F32))

    return run


def case_moe():
    from glm53.kernels.linear_f32_triton import linear_f32_triton
    from glm53.kernels.moe_triton import moe_experts_triton
    from glm53.kernels.route_triton import route_triton

    def run():
        # GLM-5 at tp = 8, bf16: 256 routed experts plus the shared one held as expert 256
        # (Experts.absorb_), 9 slots a token, hidden 6144, 256 columns an expert
        E, H, inter = 257, 6144, 256
        gate, up, down = empty(E, inter, H), empty(E, inter, H), empty(E, H, inter)
        for N in (1, 64):  # the fp32 router GEMM up to linear_f32.TRITON_MAX_ROWS rows, then routing
            linear_f32_triton(empty(N, H), empty(E - 1, H, dtype=F32))
        for shared in (E - 1, None):  # without the shared slot under expert parallelism
            route_triton(empty(1, E - 1, dtype=F32), empty(E - 1, dtype=F32), 8, True, 2.5, shared=shared)
        for N in (1, 64, 1024, 4096):  # tiles of 16, 16, 64 and 128 rows (moe_triton.default_config)
            moe_experts_triton(empty(N, H), empty(N, 9, dtype=F32), empty(N, 9, dtype=I32), gate, up, down)

    return run


def case_draft():
    from glm53.kernels.draft_attention_triton import draft_attention_triton
    from glm53.kernels.markov_chain_triton import confidence_keep_triton, markov_chain_keep_triton, markov_chain_triton
    from glm53.kernels.qk_heads_triton import finish_qk_heads_triton, store_context_kv_triton
    from glm53.kernels.spec_inputs_triton import advance_rows_triton, draft_inputs_triton, padded_batch_triton

    def run():
        # the DFlash draft at the slice's widths (48 query / 8 KV heads of 128) at tp = 8: 1 KV head
        # of 6 query heads; blocks of 16 (and 4: an eager step's shorter ones) on 64-token pages
        for R, B, W in ((1, 16, 65), (64, 16, 1), (64, 4, 65)):  # 17 splits, one split, 8 splits
            kb = empty(R, B, 1, 128)
            draft_attention_triton(empty(R, 1, 6 * B, 128), empty(W * R + 1, 2, 2, 64, 128), 1,
                                   torch.zeros(R, W, dtype=I32), kb, kb.clone(),
                                   torch.ones(R, W * 64 + B, dtype=torch.bool))
        # the q/k heads finished from the fused q|k|v product (6 query, 1 KV head of 128), a block of
        # 16; and the shipped tiny draft's 4 + 4 heads of 64
        for hq, hk, hd in ((6, 1, 128), (4, 4, 64)):
            y = empty(16, (hq + 2 * hk) * hd)
            finish_qk_heads_triton(y[:, : hq * hd], y[:, hq * hd : (hq + hk) * hd], empty(hd), empty(hd), 1e-6,
                                   empty(16, hd // 2, dtype=F32), empty(16, hd // 2, dtype=F32), 16, hq, hk)
        # the context rows' K/V into the pool: 3 draft layers of 1 KV head of 128 (the slice's at
        # tp = 8) and the tiny draft's 4 of 64, 16 verify rows
        for kv, hd in ((1, 128), (4, 64)):
            store_context_kv_triton(empty(16, 3, 2, kv, hd), empty(3, hd), 1e-6, torch.zeros(16, dtype=torch.long),
                                    torch.zeros(16, dtype=torch.long), empty(hd // 2, dtype=F32),
                                    empty(9, 2 * kv, 3, 64, hd))
        # a speculative step's derivations: 64 rows of blocks of 16 over 65 pages of 64 (the draft's
        # RoPE of 128, the target's of 64), and a prefill graph's 4,096 tokens of one row
        rows, table = torch.zeros(64, 5, dtype=torch.long), torch.zeros(64, 65, dtype=I32)
        draft_inputs_triton(rows, table, 65, 64, 0, 0, 16, empty(64, dtype=F32))
        ids = torch.zeros(64, 16, dtype=torch.long)
        for keep in (None, rows[:, 2].contiguous()):  # the rows' n, or capped by a DSpark cut
            padded_batch_triton((ids[:, 0], ids[:, 1:]), rows[:, 1], rows[:, 3], table, table[0], 65, 64, 16,
                                empty(32, dtype=F32), keep)
        padded_batch_triton((torch.zeros(1, 4096, dtype=torch.long),), rows[:1, 1], rows[:1, 3], table[:1], table[0],
                            65, 64, 4096, None)
        advance_rows_triton(rows, torch.zeros(64, 32, dtype=torch.long))
        # DSpark's Markov chain: GLM-5's vocabulary, the shipped rank-64 head, 15 block positions
        markov_chain_triton(empty(1, 15, 154880, dtype=F32), torch.zeros(1, dtype=torch.long),
                            empty(154880, 64), empty(154880, 64))
        # and with the cut made by its last launch (GLM-5's hidden 6144)
        markov_chain_keep_triton(empty(1, 15, 154880, dtype=F32), torch.zeros(1, dtype=torch.long),
                                 empty(154880, 64), empty(154880, 64), empty(1, 15, 6144), empty(1, 6144 + 64),
                                 empty(1), 0.5)
        # its confidence cut: the tiny draft's hidden 256 and GLM-5's 6144, 15 positions
        for h in (256, 6144):
            confidence_keep_triton(empty(64, 15, h), torch.zeros(64, dtype=torch.long),
                                   torch.zeros(64, 15, dtype=torch.long), empty(4160, 64), empty(1, h + 64),
                                   empty(1), 0.5)

    return run


CASES = {"topk": case_topk, "fp8_gemm": case_fp8_gemm, "moe_fp8": case_moe_fp8, "attention": case_attention,
         "norms": case_norms, "moe": case_moe, "draft": case_draft}


def launches(name: str, sms: int = 132) -> list[Launch]:
    """The distinct launches (by kernel, constexprs and options) a case makes."""
    with recording(sms) as log:
        CASES[name]()()
    seen, out = set(), []
    for la in log:
        src, opts = source(la)
        key = (la.kernel, tuple(sorted(src.signature.items())), tuple(sorted(map(str, src.constants.items()))),
               tuple(sorted(opts.items())))
        if key not in seen:
            seen.add(key)
            out.append(la)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{a.arch}", flush=True)
    for name in a.only.split(","):
        for la in launches(name, a.sms):
            b = build(la, a.arch)
            short = {k: v for k, v in b.constexprs.items() if not isinstance(v, torch.dtype)}
            print(f"{name}: {b.name} {short} {b.options}: {b.registers} registers, {b.local_bytes} B local, "
                  f"{b.shared} B shared, {b.seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
