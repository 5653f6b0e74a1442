"""Process entry points for the multi-process transfer tests (spawned; one process may host
several ranks, each with its own engine and NIXL agent)."""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

SENTINEL = 0xA5


# -- GLM-5-shaped geometry (small layer counts / page size, real per-token sizes) -------------
def geometry(n_layers=4, full=(0, 1, 3), draft_layers=(100,), draft_heads=8, head_bytes=256,
             page_size=4, latent_bpt=1152, index_bpt=132):
    return dict(n_layers=n_layers, full=tuple(full), draft_layers=tuple(draft_layers),
                draft_heads=draft_heads, head_bytes=head_bytes, page_size=page_size,
                latent_bpt=latent_bpt, index_bpt=index_bpt)


def stage_layers(g, pp, s):
    return tuple(int(x) for x in np.array_split(np.arange(g["n_layers"]), pp)[s])


def rank_buffers(g, role, tp, tp_rank, pp, pp_rank, draft=True):
    """[(name, layers, unit_bytes, heads (global ids) or None)] for one rank."""
    from glm53.transport import Heads
    layers = stage_layers(g, pp, pp_rank) if role == "prefill" else tuple(range(g["n_layers"]))
    out = [("latent", layers, g["latent_bpt"], None),
           ("index_k", tuple(l for l in layers if l in g["full"]), g["index_bpt"], None)]
    if draft and (role == "decode" or pp_rank == pp - 1):
        total = g["draft_heads"]
        pr = max(1, total // tp)
        h0, h1 = Heads(total, pr, g["head_bytes"]).head_range(tp, tp_rank)
        for name in ("draft_k", "draft_v"):
            out.append((name, g["draft_layers"], g["head_bytes"], tuple(range(h0, h1))))
    return [b for b in out if b[1]]


def make_pool(num_pages, layers, unit, heads, page_size):
    if heads is None:
        return np.full((num_pages, len(layers), page_size, unit), SENTINEL, dtype=np.uint8)
    return np.full((num_pages, len(heads), len(layers), page_size, unit), SENTINEL, np.uint8)


def content(name, logical_pages, layers, unit, heads, page_size, salt=0):
    """Deterministic bytes for request pages ``logical_pages`` (independent of TP / PP)."""
    bid = {"latent": 1, "index_k": 2, "draft_k": 3, "draft_v": 4}[name]
    hs = np.array(heads if heads is not None else [0], dtype=np.uint64)
    i = np.asarray(logical_pages, dtype=np.uint64)[:, None, None, None, None]
    h = hs[None, :, None, None, None]
    l = np.array(layers, dtype=np.uint64)[None, None, :, None, None]
    t = np.arange(page_size, dtype=np.uint64)[None, None, None, :, None]
    b = np.arange(unit, dtype=np.uint64)[None, None, None, None, :]
    v = (((i * 1000003 + h * 10007 + l * 1009 + t * 101 + b + bid * 7919 + salt)
          * np.uint64(2654435761)) >> np.uint64(13)) & np.uint64(0xFF)
    v = v.astype(np.uint8)
    if heads is None:
        v = v[:, 0]
    return v


class Alloc:
    def __init__(self, n):
        self.n, self.free = n, set(range(n))

    def take(self, pages):
        for p in pages:
            self.free.remove(int(p))

    def give(self, pages):
        for p in pages:
            assert int(p) not in self.free
            self.free.add(int(p))


def _env(tls):
    os.environ["UCX_NET_DEVICES"] = "lo"
    os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_LOG_LEVEL", "error")


def _cfg(c):
    from glm53.transport import TransportConfig
    return TransportConfig(**c)


def prefill_main(conn, ranks, tp, pp, g, tls, cfg, plan, addr):
    """Host prefill ranks ``ranks`` = [(pp_rank, tp_rank)]. ``plan``: dict with rooms:
    [{id, gen, src_pages, chunks: [n,...], row, finish: bool, hang_after: int|None}]."""
    try:
        _env(tls)
        from glm53.transport import MetadataRow, Room, TransferEngine
        draft = plan.get("draft", True)
        num_pages = plan["num_pages"]
        engines, allocs = {}, {}
        for (s, t) in ranks:
            e = TransferEngine("prefill", "p0", tp, t, pp, s, config=_cfg(cfg))
            for name, layers, unit, heads in rank_buffers(g, "prefill", tp, t, pp, s, draft):
                pool = make_pool(num_pages, layers, unit, heads, g["page_size"])
                for room in plan["rooms"]:
                    src = np.asarray(room["src_pages"])
                    pool[src] = content(name, np.arange(src.size), layers, unit, heads,
                                        g["page_size"], room.get("salt", 0))
                e.register_pool(name, pool, layers,
                                total_heads=g["draft_heads"] if heads is not None else None)
                e._keep = getattr(e, "_keep", []) + [pool]
            e.start(addr, timeout=20)
            engines[(s, t)] = e
            allocs[(s, t)] = Alloc(num_pages)
        conn.send(("ready", None))
        senders = {}
        for room in plan["rooms"]:
            for k, e in engines.items():
                allocs[k].take(room["src_pages"])
                senders[(room["id"], room["gen"], k)] = (e.create_sender(Room(room["id"], room["gen"])), room)
        for room in plan["rooms"]:
            src = list(room["src_pages"])
            pos = 0
            for ci, n in enumerate(room["chunks"]):
                if room.get("hang_after") is not None and ci == room["hang_after"]:
                    for (tx, r) in senders.values():  # earlier rooms complete first
                        if r["id"] != room["id"]:
                            tx.wait(30)
                    conn.send(("mid", None))
                    time.sleep(3600)
                for k in engines:
                    senders[(room["id"], room["gen"], k)][0].send_pages(src[pos:pos + n])
                pos += n
                if room.get("chunk_sleep"):
                    time.sleep(room["chunk_sleep"])
            if room.get("finish", True):
                for (s, t), e in engines.items():
                    row = MetadataRow(tuple(room["row"]), (len(src),), b"p" * 10) \
                        if s == pp - 1 else None
                    senders[(room["id"], room["gen"], (s, t))][0].finish(row)
        t0 = time.monotonic()
        res = {}
        for key, (tx, room) in senders.items():
            st = tx.wait(plan.get("wait", 60))
            allocs[key[2]].give(room["src_pages"])  # terminal => safe to free
            res[str(key)] = (st.name, tx.error, tx.stats)
        out = {"senders": res, "elapsed": time.monotonic() - t0,
               "pools_full": all(len(a.free) == a.n for a in allocs.values())}
        conn.send(("done", out))
        conn.recv()  # parent says close
        for e in engines.values():
            e.close()
        conn.send(("closed", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def decode_main(conn, ranks, tp, g, tls, cfg, plan, addr):
    """Host decode ranks ``ranks`` = [tp_rank]. ``plan['rooms']``: [{id, gen, dst_pages, row,
    ...}] — verifies byte-exact placement and untouched other pages."""
    try:
        _env(tls)
        from glm53.transport import KVPoll, Room, TransferEngine
        draft = plan.get("draft", True)
        num_pages = plan["num_pages"]
        engines, pools, allocs = {}, {}, {}
        for t in ranks:
            e = TransferEngine("decode", "d0", tp, t, config=_cfg(cfg))
            pools[t] = {}
            for name, layers, unit, heads in rank_buffers(g, "decode", tp, t, 1, 0, draft):
                pool = make_pool(num_pages, layers, unit, heads, g["page_size"])
                e.register_pool(name, pool, layers,
                                total_heads=g["draft_heads"] if heads is not None else None)
                pools[t][name] = (pool, layers, unit, heads)
            e.start()
            engines[t] = e
            allocs[t] = Alloc(num_pages)
        if plan.get("connect", True):
            for e in engines.values():
                e.connect(addr, timeout=20)
        rx = {}
        for room in plan["rooms"]:
            for t, e in engines.items():
                allocs[t].take(room["dst_pages"])
                rx[(room["id"], room["gen"], t)] = (
                    e.create_receiver(Room(room["id"], room["gen"]), addr, room["dst_pages"]), room)
        conn.send(("ready", None))
        if plan.get("die_when_transferring"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    r.poll() == KVPoll.TRANSFERRING for r, _ in rx.values()):
                time.sleep(0.005)
            conn.send(("mid", None))
            time.sleep(3600)
        t0 = time.monotonic()
        res = {}
        for key, (r, room) in rx.items():
            st = r.wait(plan.get("wait", 60))
            t = key[2]
            info = {"state": st.name, "error": r.error, "t": time.monotonic() - t0,
                    "code": r.error_code.value if r.error_code else None}
            if st == KVPoll.SUCCESS:
                md = r.metadata()
                info["row"] = list(md.first_token_ids)
                info["counts0"] = md.counts[0]
                dst = np.asarray(room["dst_pages"])
                bad = []
                for name, (pool, layers, unit, heads) in pools[t].items():
                    want = content(name, np.arange(dst.size), layers, unit, heads,
                                   g["page_size"], room.get("salt", 0))
                    if not np.array_equal(pool[dst], want):
                        nb = int((pool[dst] != want).sum())
                        bad.append(f"{name}: {nb} bytes differ")
                info["bad"] = bad
            if st in (KVPoll.SUCCESS, KVPoll.FAILED):
                allocs[t].give(room["dst_pages"])
            res[str(key)] = info
        # pages never allocated must be untouched
        used = set()
        for room in plan["rooms"]:
            used |= set(int(p) for p in room["dst_pages"])
        other = np.array(sorted(set(range(num_pages)) - used), dtype=np.int64)
        untouched = all(bool((pool[other] == SENTINEL).all())
                        for t in pools for (pool, *_r) in pools[t].values()) if other.size else True
        out = {"receivers": res, "untouched": untouched,
               "pools_full": all(len(a.free) == a.n for a in allocs.values()),
               "stale": sum(e.stale_notifs for e in engines.values())}
        conn.send(("done", out))
        conn.recv()
        for e in engines.values():
            e.close()
        conn.send(("closed", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
