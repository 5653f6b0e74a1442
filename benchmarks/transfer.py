"""KV-transfer benchmark: NIXL (UCX) WRITE between two processes vs a copy of the same bytes.

GLM-5 per-token sizes per layer: MLA latent 1152 B (bf16) or 656 B (fp8), DSA indexer keys
132 B (fp8 layout); page size 64; pools page-major ``[num_pages, L, 64, bytes]`` as in
``glm53.models.kv_cache``. For prompts of 4K, 32K and 128K tokens it writes the request's pages
of both pools from the "prefill" process into the "decode" process's pools, with the
destination laid out as one extent, as runs of 8 pages, or as scattered single pages, and with
two descriptor strategies:

* ``coalesced`` — what the engine does: one descriptor per contiguous page run per pool
  (``page_runs`` + ``segment_descs``), posted as a one-shot transfer (descriptor build timed);
* ``prepped`` — per-page descriptor lists prepared once for the whole pools
  (``prep_xfer_dlist``), a transfer made per request from page indices (``make_prepped_xfer``).

Each time is post -> DONE at the initiator (the notification is attached, so DONE means the data
reached the target), median of ``--reps``. The baseline is a copy of the same number of bytes in
the same run: ``numpy.copyto`` between two host arrays, or a device-to-device ``torch`` copy.
A sweep of fixed descriptor sizes (64 KiB, 1 MiB, 16 MiB; non-adjacent so nothing merges) gives
the per-descriptor cost.

  PYTHONPATH=. python benchmarks/transfer.py         # host memory, UCX_TLS=cma,tcp, 8 layers
  PYTHONPATH=. python benchmarks/transfer.py --device cuda --layers 78 --json out.json   # H200, one GPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

PAGE = 64
INDEX_BPT = 132


def _tr():
    from glm53.transport import backend as B, mapping as M

    return B, M


def _alloc(device, shape):
    if device == "cuda":
        import torch
        return torch.zeros(shape, dtype=torch.uint8, device="cuda")
    return np.zeros(shape, dtype=np.uint8)


def _pools(device, num_pages, layers, latent_bpt):
    return {"latent": _alloc(device, (num_pages, layers, PAGE, latent_bpt)),
            "index_k": _alloc(device, (num_pages, layers, PAGE, INDEX_BPT))}


def target_main(conn, args):
    os.environ.setdefault("UCX_NET_DEVICES", args.net_devices)
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    B, _ = _tr()
    if args.device == "cuda":
        import torch
        torch.cuda.set_device(args.target_gpu)
    be = B.NixlBackend(f"bench-target-{os.getpid()}", progress_thread=True)  # target progresses tcp
    pools = _pools(args.device, args.dst_pages, args.layers, args.latent_bpt)
    sweep = _alloc(args.device, (args.sweep_bytes,))
    regs = [B.MemRegion.of(p) for p in pools.values()] + [B.MemRegion.of(sweep)]
    be.register(regs)
    conn.send((be.metadata(), {n: (r.addr, r.mem, r.device) for n, r in zip(pools, regs)},
               (regs[-1].addr, regs[-1].mem, regs[-1].device)))
    got = 0
    while True:
        for _, msgs in be.notifications().items():
            got += len(msgs)
        if conn.poll(0.005):
            cmd = conn.recv()
            if cmd == "count":
                conn.send(got)
            elif cmd == "checksum":
                conn.send({n: _checksum(p, args.device) for n, p in pools.items()})
            elif cmd == "stop":
                be.close()
                conn.send("bye")
                return


def _checksum(a, device):
    if device == "cuda":
        import torch
        return int(a.view(-1).sum(dtype=torch.int64).item())
    return int(a.reshape(-1).astype(np.int64).sum())


def _wait(be, x, timeout=120.0):
    t_end = time.perf_counter() + timeout
    while be.poll(x) == "PROC":
        if time.perf_counter() > t_end:
            raise TimeoutError("transfer did not finish")
    if x.state != "DONE":
        raise RuntimeError(f"transfer failed: {x.error}")


def _layouts(rng, n_pages, dst_pages):
    out = {"extent": np.arange(n_pages) + 3}
    starts = rng.permutation(dst_pages // 8)[: n_pages // 8] * 8
    out["runs8"] = (starts[:, None] + np.arange(8)[None, :]).reshape(-1)
    out["scattered"] = rng.permutation(dst_pages)[:n_pages]
    return out


def _copy_gbps(device, nbytes, reps, dst_gpu=0):
    if device == "cuda":
        import torch
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_gpu}")  # peer copy across GPUs
        ts = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return nbytes / statistics.median(ts[1:]) / 1e9
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return nbytes / statistics.median(ts[1:]) / 1e9


def initiator(args):
    os.environ.setdefault("UCX_NET_DEVICES", args.net_devices)
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    B, M = _tr()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target_main, args=(b, args), daemon=True)
    p.start()
    if args.device == "cuda":
        import torch
        torch.cuda.set_device(0)
    be = B.NixlBackend(f"bench-init-{os.getpid()}", progress_thread=True)
    src_pages = max(args.tokens) // PAGE
    pools = _pools(args.device, src_pages, args.layers, args.latent_bpt)
    for pl in pools.values():
        if args.device == "cuda":
            pl.random_(0, 255)
        else:
            pl[:] = np.random.default_rng(0).integers(0, 255, pl.shape, dtype=np.uint8)
    sweep = _alloc(args.device, (args.sweep_bytes,))
    regs = {n: B.MemRegion.of(pl) for n, pl in pools.items()}
    sreg = B.MemRegion.of(sweep)
    be.register(list(regs.values()) + [sreg])
    md, dregs, dsweep = a.recv()
    peer = be.add_peer(md)
    item = {n: args.layers * PAGE * bpt for n, bpt in
            (("latent", args.latent_bpt), ("index_k", INDEX_BPT))}
    segs = [M.Segment(n, 0, 0, item[n], item[n], item[n]) for n in ("latent", "index_k")]
    rng = np.random.default_rng(1)
    results = {"config": vars(args).copy(), "transfers": [], "sweep": []}
    n_notifs = 0

    # prepared per-page lists over the whole pools (outside the timed region)
    prepped = None
    if "prepped" in args.modes:
        loc, rem = [], []
        for n in ("latent", "index_k"):
            s_addr = regs[n].addr + np.arange(src_pages, dtype=np.uint64) * item[n]
            d_addr = dregs[n][0] + np.arange(args.dst_pages, dtype=np.uint64) * item[n]
            loc.append(np.stack([s_addr, np.full(src_pages, item[n], np.uint64),
                                 np.full(src_pages, regs[n].device, np.uint64)], 1))
            rem.append(np.stack([d_addr, np.full(args.dst_pages, item[n], np.uint64),
                                 np.full(args.dst_pages, dregs[n][2], np.uint64)], 1))
        t = time.perf_counter()
        lh = be.prep_descs(None, np.concatenate(loc), regs["latent"].mem)
        rh = be.prep_descs(peer, np.concatenate(rem), dregs["latent"][1])
        results["prep_s"] = time.perf_counter() - t
        prepped = (lh, rh)

    for tokens in args.tokens:
        n_pages = tokens // PAGE
        nbytes = n_pages * sum(item.values())
        copy = _copy_gbps(args.device, nbytes, args.reps, args.target_gpu)
        src = np.arange(n_pages)
        for lname, dst in _layouts(rng, n_pages, args.dst_pages).items():
            runs = M.page_runs(src, dst)
            for mode in args.modes:
                ts, ndesc = [], 0
                for _ in range(args.reps + 1):
                    t = time.perf_counter()
                    if mode == "coalesced":
                        parts = [M.segment_descs(s, runs, regs[s.buffer].addr, dregs[s.buffer][0])
                                 for s in segs]
                        sa = np.concatenate([q[0] for q in parts])
                        da = np.concatenate([q[1] for q in parts])
                        ln = np.concatenate([q[2] for q in parts])
                        dev = np.full_like(ln, regs["latent"].device)
                        ddev = np.full_like(ln, dregs["latent"][2])
                        x = be.post_write(peer, np.stack([sa, ln, dev], 1), regs["latent"].mem,
                                          np.stack([da, ln, ddev], 1), dregs["latent"][1],
                                          b"bench")
                        ndesc = sa.size
                    else:
                        li = np.concatenate([src, src + src_pages]).astype(np.int32)
                        ri = np.concatenate([dst, dst + args.dst_pages]).astype(np.int32)
                        x = be.post_prepped(peer, prepped[0], li, prepped[1], ri, b"bench")
                        ndesc = li.size
                    _wait(be, x)
                    ts.append(time.perf_counter() - t)
                    n_notifs += 1
                med = statistics.median(ts[1:])
                r = dict(tokens=tokens, layout=lname, mode=mode, runs=int(runs.shape[0]),
                         descriptors=int(ndesc), bytes=int(nbytes), seconds=med,
                         gbps=nbytes / med / 1e9, copy_gbps=copy,
                         ratio=nbytes / med / 1e9 / copy,
                         us_per_desc=med / max(ndesc, 1) * 1e6)
                results["transfers"].append(r)
                print(f"{tokens:>7} tok {lname:>9} {mode:>9}: {ndesc:>6} desc "
                      f"{nbytes / 2**20:9.1f} MiB {r['gbps']:8.2f} GB/s  copy {copy:8.2f} GB/s "
                      f"ratio {r['ratio']:.2f}", flush=True)

    # per-descriptor cost: fixed sizes, non-adjacent (stride 2x) so nothing merges
    for size in args.sweep_sizes:
        n = max(1, args.sweep_bytes // (2 * size))
        off = np.arange(n, dtype=np.uint64) * (2 * size)
        ln = np.full(n, size, np.uint64)
        s = np.stack([sreg.addr + off, ln, np.full(n, sreg.device, np.uint64)], 1)
        d = np.stack([dsweep[0] + off, ln, np.full(n, dsweep[2], np.uint64)], 1)
        ts = []
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            x = be.post_write(peer, s, sreg.mem, d, dsweep[1], b"sweep")
            _wait(be, x)
            ts.append(time.perf_counter() - t)
            n_notifs += 1
        med = statistics.median(ts[1:])
        copy = _copy_gbps(args.device, n * size, args.reps, args.target_gpu)
        r = dict(desc_bytes=size, descriptors=n, seconds=med, gbps=n * size / med / 1e9,
                 copy_gbps=copy, us_per_desc=med / n * 1e6)
        results["sweep"].append(r)
        print(f"sweep {size / 2**10:>8.0f} KiB x {n:>5}: {r['gbps']:8.2f} GB/s "
              f"{r['us_per_desc']:8.2f} us/desc (copy {copy:.2f} GB/s)", flush=True)

    time.sleep(0.2)
    a.send("count")
    got = a.recv()
    results["notifications"] = {"sent": n_notifs, "received": got}
    print(f"notifications: {got}/{n_notifs} received", flush=True)
    if args.verify:
        a.send("checksum")
        results["dst_checksums"] = a.recv()
    a.send("stop")
    a.recv()
    p.join(10)
    be.close()
    results["nixl_module"] = be.module
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers per pool (GLM-5: 78); default 78 on cuda, 8 on cpu")
    ap.add_argument("--latent-bpt", type=int, default=1152, help="1152 bf16, 656 fp8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--modes", nargs="+", default=["coalesced", "prepped"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tls", default=None, help="UCX_TLS (default: cma,tcp on cpu, UCX's own "
                    "choice on cuda)")
    ap.add_argument("--net-devices", default="lo")
    ap.add_argument("--target-gpu", type=int, default=0,
                    help="the decode-side process's GPU (1 on a two-GPU machine: GPU to GPU over NVLink)")
    ap.add_argument("--sweep-sizes", type=int, nargs="+", default=[64 << 10, 1 << 20, 16 << 20])
    ap.add_argument("--sweep-bytes", type=int, default=None)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.layers is None:
        args.layers = 78 if args.device == "cuda" else 8
    if args.tls is None and args.device == "cpu":
        args.tls = "cma,tcp"
    if args.sweep_bytes is None:
        args.sweep_bytes = (512 << 20) if args.device == "cuda" else (128 << 20)
    args.dst_pages = 2 * max(args.tokens) // PAGE
    res = initiator(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
