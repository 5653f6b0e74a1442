"""DSA kernel benchmark (issue 3): our Triton kernels vs torch references on a CUDA device.

For every shape: our time, the torch reference's time, and the share of HBM bandwidth reached
(minimal bytes moved over time, against a device-to-device copy measured in the same run). Each
shape is also checked against its reference before it is timed.

Timing: CUDA events around CUDA-graph replays (decode runs under graphs, and Triton's Python
launch cost would otherwise dominate small shapes); each graph runs the op over several input
sets in turn (>= ~4x the L2 in total where memory allows) so repeated runs do not read a warm
L2. `eager` columns time plain launches of one input set (L2 may be warm) for comparison.

    python benchmarks/kernels.py [--only topk,indexer,mla] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
import triton

from glm53.kernels.indexer_logits import indexer_logits_reference
from glm53.kernels import index_cache_fp8
from glm53.kernels.indexer_logits_triton import indexer_logits_triton
from glm53.kernels.sparse_mla import sparse_mla_reference
from glm53.kernels.sparse_mla_triton import sparse_mla_triton
from glm53.kernels.topk import dsa_topk, dsa_topk_reference
from glm53.kernels.topk_triton import topk_triton
from glm53.support.cuda_timing import graph_ms

L2_BYTES = 60 << 20
ROWS: list[dict] = []


def _graph_time(fns, reps: int = 30) -> float:
    """Median µs per call of a CUDA graph that runs every fn in `fns` once."""
    return graph_ms(fns, reps) * 1e3


def _eager_time(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of a few timed copies."""
    n = 1 << 29  # 2 GiB of fp32
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    del a, b
    return 2 * n * 4 / min(ts)


def graph_floor() -> float:
    """µs of a graph replay holding one trivial kernel: the timing method's floor."""
    x = torch.zeros(1, device="cuda")
    return _graph_time([lambda: x.add_(1)])


def probe_topk() -> None:
    """Where top-k's time goes (cumulative prefixes of its launches) and a sweep of its knobs,
    each timed as CUDA-graph replays rotating over input sets, each config checked first."""
    from glm53.kernels import topk_triton as tt

    k = 2048
    for B, L in ((1, 32768), (1, 131072), (8, 131072), (64, 32768), (64, 131072)):
        ns = n_sets(B * L * 4)
        xs = [torch.randn(B, L, device="cuda") for _ in range(ns)]
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        ref = dsa_topk_reference(xs[0], lens, k).sort(dim=1).values
        for cfg in (dict(), dict(margin=-1.0, margin_lo=8.0), dict(sample=512, margin=0.0, margin_lo=0.0),
                    dict(margin=8.0, margin_lo=-1.0),
                    # PDL off; scan shape (V = block / (32 * warps) scores per thread); the finish's
                    # pairwise tile (16: radix rounds to the end) and warps; a smaller sample
                    dict(pdl=False), dict(block=4096), dict(select_tile=16), dict(select_tile=128),
                    dict(finish_warps=16), dict(sample=2048)):
            try:
                ok = torch.equal(tt.topk_triton(xs[0], lens, k, **cfg).sort(dim=1).values, ref)
                t = _graph_time([lambda x=x: tt.topk_triton(x, lens, k, **cfg) for x in xs])
            except Exception as e:  # e.g. out of resources for one config
                ok, t = False, float("nan")
                print("probe err", cfg, type(e).__name__, str(e)[:200], flush=True)
            print(json.dumps({"probe": "topk_cfg", "B": B, "L": L, **cfg, "us": round(t, 2), "exact": ok}), flush=True)
        # stage prefixes with the default config: bracket, + scan, + finish
        plan = tt.plan_topk(B, L, k, xs[0].device)
        out = torch.empty((B, k), dtype=torch.int32, device=xs[0].device)

        def stage(n, x):
            tt.run_topk(plan, x, lens, out, stages=n)

        ts = [_graph_time([lambda n=n, x=x: stage(n, x) for x in xs]) for n in range(1, 4)]
        rd = _graph_time([lambda x=x: x.sum(dim=1) for x in xs])
        st = plan.stat.cpu()
        print(json.dumps({"probe": "topk", "B": B, "L": L, "C": plan.C, "bracket": round(ts[0], 2),
                          "scan": round(ts[1] - ts[0], 2), "finish": round(ts[2] - ts[1], 2),
                          "total": round(ts[2], 2), "row_sum_read": round(rd, 2),
                          "above_max": int(st[..., 0].sum(1).max()), "cand_max": int(st[..., 1].sum(1).max()),
                          "cand_chunk_max": int(st[..., 1].max()), "TC": plan.TC}), flush=True)
        del xs


def n_sets(bytes_per_set: int, cap: int = 8) -> int:
    return max(1, min(cap, math.ceil(4 * L2_BYTES / max(bytes_per_set, 1))))


def record(op, shape, ours_us, ref_us, nbytes, bw, check, extra=None):
    row = dict(op=op, shape=shape, ours_us=round(ours_us, 2), ref_us=round(ref_us, 2) if ref_us else None,
               speedup=round(ref_us / ours_us, 2) if ref_us else None,
               hbm_pct=round(100 * nbytes / (ours_us * 1e-6) / bw, 1), check=check)
    if extra:
        row.update(extra)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------- top-k
def bench_topk(bw: float, sweep: bool) -> None:
    k = 2048
    for B in (1, 8, 64):
        for L in (8192, 32768, 131072):
            ns = n_sets(B * L * 4)
            xs = [torch.randn(B, L, device="cuda") for _ in range(ns)]
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            # check: exact set equality with the stable-sort reference (one set + ragged lengths)
            rl = torch.randint(1, L + 1, (B,), device="cuda", dtype=torch.int32)
            rl[0] = L
            got = dsa_topk(xs[0], rl, k).sort(dim=1).values
            ref = dsa_topk_reference(xs[0], rl, k).sort(dim=1).values
            ok = bool(torch.equal(got, ref))
            ours = _graph_time([lambda x=x: topk_triton(x, lens, k) for x in xs])
            eager = _eager_time(lambda: topk_triton(xs[0], lens, k))
            ref_t = _graph_time([lambda x=x: torch.topk(x, k, dim=-1) for x in xs])
            record("topk", f"B={B} L={L // 1024}K k={k}", ours, ref_t, B * L * 4 + B * k * 4, bw,
                   "exact" if ok else "MISMATCH", {"eager_us": round(eager, 2), "sets": ns})
            del xs


# ---------------------------------------------------------------- indexer
def _index_setup(B, L, page_size=64, n_layers=2, fp8=False):
    D, H = 128, 32
    pages_per = L // page_size
    num_pages = B * pages_per + 8
    perm = torch.randperm(num_pages - 8, device="cuda").int() + 8
    pt = perm.view(B, pages_per)
    q = torch.randn(B, H, D, device="cuda").bfloat16()
    w = torch.randn(B, H, device="cuda") * H**-0.5 * D**-0.5
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    if fp8:
        pool = index_cache_fp8.alloc_pool(num_pages, n_layers, page_size, D, device="cuda")
        view = pool[:, 1]
        kf = torch.randn(num_pages * page_size, D, device="cuda")
        index_cache_fp8.store(view, torch.arange(num_pages * page_size, device="cuda"), kf)
        return q, w, view, pt, lens, kf.view(num_pages, page_size, D)
    pool = torch.randn(num_pages, n_layers, page_size, D, device="cuda").bfloat16()
    return q, w, pool[:, 1], pt, lens, None


def _torch_indexer_bf16(q, w, kc, pt, lens, max_len):
    """A plain torch bf16 indexer (gather pages, bf16 einsum): the speed reference."""
    keys = kc[pt.long()].flatten(1, 2)[:, :max_len]  # [T, L, D]
    dots = torch.einsum("thd,tsd->ths", q, keys).relu_()
    logit = torch.einsum("th,ths->ts", w, dots.float())
    pos = torch.arange(max_len, device=q.device)
    return logit.masked_fill(pos[None] >= lens[:, None], float("-inf"))


def bench_indexer(bw: float, sweep: bool) -> None:
    for fp8 in (False, True):
        for B in (1, 64):
            for L in (32768, 131072):
                per_tok = 132 if fp8 else 256
                nbytes = B * L * (per_tok + 4)
                ns = n_sets(nbytes)  # rotate over ns batches of requests (distinct pages)
                q, w, kc, pt, lens, kf = _index_setup(B * ns, L, fp8=fp8)
                sl = [slice(i * B, (i + 1) * B) for i in range(ns)]
                if fp8:
                    keys, scales = index_cache_fp8.split_view(kc)
                    run = lambda i=0, **kw: indexer_logits_triton(q[sl[i]], w[sl[i]], keys, pt[sl[i]], lens[sl[i]], L,
                                                                  k_scales=scales, **kw)
                else:
                    run = lambda i=0, **kw: indexer_logits_triton(q[sl[i]], w[sl[i]], kc, pt[sl[i]], lens[sl[i]], L, **kw)
                out = run()
                # check on a few rows: vs the fp32 reference over the same cache
                rows = slice(0, min(B, 4))
                if fp8:
                    ref = indexer_logits_reference(q[rows].float(), w[rows], kf, pt[rows], lens[rows], L)
                    # overlap of the top-2048 sets with the fp32 oracle (unquantized keys)
                    a = torch.topk(out[rows], 2048, dim=-1).indices
                    bset = torch.topk(ref, 2048, dim=-1).indices
                    ov = [len(set(a[i].tolist()) & set(bset[i].tolist())) / 2048 for i in range(a.shape[0])]
                    check = f"overlap={sum(ov) / len(ov):.4f}"
                else:
                    ref = indexer_logits_reference(q[rows], w[rows], kc, pt[rows], lens[rows], L)
                    check = f"rel={((out[rows] - ref).norm() / ref.norm()).item():.2e}"
                ours = _graph_time([lambda i=i: run(i) for i in range(ns)])
                eager = _eager_time(lambda: run())
                ref_t = None
                if not fp8:
                    ref_t = _graph_time([lambda: _torch_indexer_bf16(q[sl[0]], w[sl[0]], kc, pt[sl[0]], lens[sl[0]], L)], reps=10)
                extra = {"eager_us": round(eager, 2), "sets": ns}
                if sweep:
                    for bs, nw in ((64, 4), (128, 8), (256, 8)):
                        extra[f"bs{bs}w{nw}"] = round(_graph_time([lambda i=i: run(i, block_s=bs, num_warps=nw) for i in range(ns)], reps=10), 2)
                record("indexer_fp8" if fp8 else "indexer_bf16", f"B={B} L={L // 1024}K H=32 D=128", ours, ref_t,
                       nbytes, bw, check, extra)
                if fp8:  # the fp8 x fp8 product (q quantized per (token, head), scale folded into w)
                    qs = q.float().abs().amax(dim=-1, keepdim=True) / 448.0
                    q8 = (q.float() / qs).to(torch.float8_e4m3fn)
                    w8 = w * qs.squeeze(-1)
                    run8 = lambda i=0: indexer_logits_triton(q8[sl[i]], w8[sl[i]], keys, pt[sl[i]], lens[sl[i]], L, k_scales=scales)
                    o8 = run8()
                    a = torch.topk(o8[rows], 2048, dim=-1).indices
                    ov = [len(set(a[i].tolist()) & set(bset[i].tolist())) / 2048 for i in range(a.shape[0])]
                    t8 = _graph_time([lambda i=i: run8(i) for i in range(ns)])
                    record("indexer_fp8_q8", f"B={B} L={L // 1024}K H=32 D=128", t8, None, nbytes, bw,
                           f"overlap={sum(ov) / len(ov):.4f}", {"sets": ns})
                del q, w, kc, pt, lens, kf, out
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- sparse MLA
def _mla_setup(B, H, K=2048, ctx=8192, page_size=64, n_layers=2, R=512, P=64):
    pages_per = ctx // page_size
    num_pages = B * pages_per
    pool = torch.randn(num_pages, n_layers, page_size, R + P, device="cuda").bfloat16()
    kv = pool[:, 1]
    q = torch.randn(B, H, R + P, device="cuda").bfloat16()
    pt = torch.randperm(num_pages, device="cuda").view(B, pages_per)
    pos = torch.rand(B, ctx, device="cuda").argsort(dim=1)[:, :K]
    slots = (pt.gather(1, pos // page_size) * page_size + pos % page_size).int()
    return q, kv, slots


# Schedule variants of sparse_mla_triton timed by --sweep (kwargs of the op) at B=64, per head
# count, around the default (the warp-specialized Hopper kernel: 64-slot blocks, one wave of
# splits; its own row is the plain bench row). The `tl` kernel's own sweeps (BLOCK_N, stages,
# warps, column halves) are in benchmarks/RESULTS.md; its default is kept as the reference row.
# Earlier single-role Hopper versions, measured and dropped (H200, 2026-11-30, against 69-71 us for
# that version's default at H=64): the PV product left running into the next block with the
# gathers issued after the row-max exchange (80 us); gathers issued after the score product (71);
# buffers refilled at the end of their block, two blocks in flight (84); L2 prefetches of the block
# after next (75-85); 32-slot blocks in 3-4 buffers (85-97); the combine done by each token's last
# split instead of a second kernel (75.5; 86 at B=1, where one program reads every split).
MLA_SWEEP: dict[int, list[dict]] = {
    64: [
        dict(kernel="tl"),  # the portable kernel's default, against the Hopper kernel's plain row
        dict(kernel="hopper", num_splits=1),
        dict(kernel="hopper", num_splits=4),
        dict(kernel="hopper", block_n=32),
    ],
    128: [  # the default is one split here (128 programs)
        dict(kernel="tl"),
        dict(kernel="hopper", num_splits=2),
    ],
}


def _mla_cfg_name(cfg: dict) -> str:
    short = dict(block_n="n", block_h="h", num_warps="w", num_stages="s", num_splits="sp", col_halves="halves",
                 kernel="")
    return "".join(short[k] if v is True else ("no" + short[k]) if v is False else f"{short[k]}{v}"
                   for k, v in cfg.items())


def _mla_sweep(shape: str, run, check, ns: int, nbytes: int, flops: float, bw: float, cfgs: list[dict]) -> None:
    """Check then time each variant in `cfgs`; a compile or launch error is reported for that
    config and the sweep goes on."""
    for cfg in cfgs:
        name = _mla_cfg_name(cfg)
        row = {"sweep": "sparse_mla", "shape": shape, "cfg": name}
        try:
            row["rel"] = f"{check(**cfg):.2e}"
            t = _graph_time([lambda k=k: run(k, **cfg) for k in range(ns)], reps=10)
            row.update(us=round(t, 2), hbm_pct=round(100 * nbytes / (t * 1e-6) / bw, 1),
                       tflops=round(flops / (t * 1e-6) / 1e12, 1))
        except Exception as e:  # e.g. out of shared memory, a compile error in one Triton version
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print(json.dumps(row), flush=True)


def bench_mla(bw: float, sweep: bool) -> None:
    R, P, K = 512, 64, 2048
    for H in (64, 128):
        for B in (1, 64):
            if H == 128 and B == 1:
                continue
            nbytes = B * K * (R + P) * 2 + B * K * 4 + B * H * (R + P + R) * 2
            flops = 2.0 * B * H * K * (R + P + R)
            ns = n_sets(nbytes)
            q, kv, idx = _mla_setup(B * ns, H)
            sl = [slice(i * B, (i + 1) * B) for i in range(ns)]
            run = lambda i=0, **kw: sparse_mla_triton(q[sl[i]], kv, idx[sl[i]], 1 / 16, R, **kw)
            nr = min(B, 2)
            ref = sparse_mla_reference(q[:nr].float(), kv.float(), idx[:nr], 1 / 16, R)

            def check(**kw) -> float:
                out = run(**kw)
                return ((out[:nr].float() - ref).norm() / ref.norm()).item()

            check_s = f"rel={check():.2e}"
            ours = _graph_time([lambda i=i: run(i) for i in range(ns)])
            eager = _eager_time(lambda: run())
            ref_t = _graph_time([lambda: sparse_mla_reference(q[sl[0]], kv, idx[sl[0]], 1 / 16, R)], reps=10)
            extra = {"eager_us": round(eager, 2), "sets": ns, "tflops": round(flops / (ours * 1e-6) / 1e12, 1)}
            record("sparse_mla", f"B={B} H={H} K={K} d=576", ours, ref_t, nbytes, bw, check_s, extra)
            if sweep and B == 64:
                _mla_sweep(f"B={B} H={H}", run, check, ns, nbytes, flops, bw, MLA_SWEEP[H])
            del q, kv, idx
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="topk,indexer,mla")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--probe", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "benchmarks/kernels.py needs a CUDA device"
    torch.manual_seed(0)

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.3f} TB/s; graph-replay floor {graph_floor():.2f} µs", flush=True)
    if args.probe:
        probe_topk()
    only = args.only.split(",")
    if "topk" in only:
        bench_topk(bw, args.sweep)
    if "indexer" in only:
        bench_indexer(bw, args.sweep)
    if "mla" in only:
        bench_mla(bw, args.sweep)
    print("\n| op | shape | ours µs | eager µs | torch µs | speedup | % HBM | check |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['op']} | {r['shape']} | {r['ours_us']} | {r.get('eager_us', '')} | {r['ref_us'] or '-'} | "
              f"{r['speedup'] or '-'} | {r['hbm_pct']} | {r['check']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
