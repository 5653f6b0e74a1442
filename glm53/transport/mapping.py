"""TP/PP shard mapping and descriptor building. Pure functions, no I/O.

``plan_transfers`` takes a prefill instance (one ``BufferTable`` per PP stage, TP size) and a
decode instance (one table, TP size; decode runs PP 1) and lists, for every
(prefill stage, prefill TP rank, decode TP rank), the byte segments to copy inside one page
item: ``Segment(buffer, src_off, dst_off, length)``. Applied to every page of a request (src page
``p`` of the prefill pool -> dst page ``q`` of the decode pool) they place every byte of every
decode rank's items exactly once.

Source choice: each piece a destination needs is sent by exactly one source rank. Replicated
buffers are a single piece held by every TP rank of the owning stage; head-sharded buffers are
split into source head groups (held by ``tp // total`` replicas when TP exceeds the head count).
Among the candidate holders the choice rotates with the destination and with the buffer/stage,
so the work spreads over the sources (never all from one, never duplicated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .buffers import BufferSpec, BufferTable, Heads, check_tables


@dataclass(frozen=True)
class Segment:
    """Copy ``length`` bytes at ``src_off`` of a source page item to ``dst_off`` of the
    destination page item, for every transferred page of buffer ``buffer``."""

    buffer: str
    src_off: int
    dst_off: int
    length: int
    src_item: int
    dst_item: int

    @property
    def whole(self) -> bool:
        """The whole item on both sides: contiguous page runs coalesce into one descriptor."""
        return (self.src_off == 0 and self.dst_off == 0 and self.length == self.src_item
                == self.dst_item)

    def to_wire(self) -> list:
        return [self.buffer, self.src_off, self.dst_off, self.length, self.src_item, self.dst_item]

    @staticmethod
    def from_wire(w) -> "Segment":
        return Segment(str(w[0]), int(w[1]), int(w[2]), int(w[3]), int(w[4]), int(w[5]))


Route = tuple  # (pp, src_tp, dst_tp)


@dataclass(frozen=True)
class TransferPlan:
    prefill_tp: int
    prefill_pp: int
    decode_tp: int
    routes: dict  # (pp, src_tp, dst_tp) -> tuple[Segment, ...]; only non-empty routes
    meta_writer: dict  # dst_tp -> (pp, src_tp): writes that rank's metadata row (last stage)

    def segments(self, pp: int, src_tp: int, dst_tp: int) -> tuple:
        return self.routes.get((pp, src_tp, dst_tp), ())

    def senders_for(self, dst_tp: int) -> list:
        """(pp, tp) of every prefill rank that writes into decode rank ``dst_tp`` (data or the
        metadata row): the completions the receiver must see."""
        s = {(pp, tp) for (pp, tp, d) in self.routes if d == dst_tp}
        s.add(self.meta_writer[dst_tp])
        return sorted(s)

    def receivers_for(self, pp: int, src_tp: int) -> list:
        d = {dd for (p, t, dd) in self.routes if (p, t) == (pp, src_tp)}
        d |= {dd for dd, w in self.meta_writer.items() if w == (pp, src_tp)}
        return sorted(d)


def _layer_runs(src: BufferSpec, dst: BufferSpec) -> list[tuple[int, int, int]]:
    """(src_pos, dst_pos, n): maximal runs of common layers consecutive on both sides."""
    dpos = dst.layer_pos()
    out: list[list[int]] = []
    for sp, l in enumerate(src.layers):
        dp = dpos.get(l)
        if dp is None:
            continue
        if out and out[-1][0] + out[-1][2] == sp and out[-1][1] + out[-1][2] == dp:
            out[-1][2] += 1
        else:
            out.append([sp, dp, 1])
    return [tuple(r) for r in out]  # type: ignore


def _merge(segs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    segs = sorted(segs)
    out: list[list[int]] = []
    for so, do, n in segs:
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1][2] += n
        else:
            out.append([so, do, n])
    return [tuple(s) for s in out]  # type: ignore


def plan_transfers(prefill_stages: Sequence[BufferTable], prefill_tp: int,
                   decode: BufferTable, decode_tp: int, check: bool = True) -> TransferPlan:
    """The whole mapping for one (prefill instance, decode instance) pair. Raises
    ``TableMismatch`` (naming the field) when the tables disagree."""
    if check:
        check_tables(prefill_stages, prefill_tp, decode, decode_tp)
    pp = len(prefill_stages)
    ptp, dtp = prefill_tp, decode_tp
    acc: dict[tuple, dict[str, list]] = {}
    for k, name in enumerate(decode.names()):
        dspec = decode[name]
        for s, table in enumerate(prefill_stages):
            if name not in table:
                continue
            sspec = table[name]
            runs = _layer_runs(sspec, dspec)
            if not runs:
                continue
            c = k + s  # rotation so buffers and stages use different replicas
            P = sspec.page_size
            if isinstance(sspec.shard, Heads):
                sh, dsh = sspec.shard, dspec.shard
                assert isinstance(dsh, Heads)
                total, spr, bph = sh.total, sh.per_rank, sh.bytes_per_head
                rep_p = sh.replicas(ptp)
                dst_range = lambda d: dsh.head_range(dtp, d)  # noqa: E731
                src_h0 = lambda t: sh.head_range(ptp, t)[0]  # noqa: E731
            else:
                total, spr, bph, rep_p = 1, 1, sspec.bytes_per_token, ptp
                dst_range = lambda d: (0, 1)  # noqa: E731
                src_h0 = lambda t: 0  # noqa: E731
            ngroups = total // spr
            nls, nld = sspec.n_layers, dspec.n_layers
            need: dict[int, list[int]] = {g: [] for g in range(ngroups)}
            for d in range(dtp):
                d0, d1 = dst_range(d)
                for g in range(d0 // spr, (d1 - 1) // spr + 1):
                    need[g].append(d)
            for g, dsts in need.items():
                for idx, d in enumerate(dsts):
                    src = g * rep_p + (idx + c * len(dsts)) % rep_p
                    d0, d1 = dst_range(d)
                    h0, h1 = max(d0, g * spr), min(d1, (g + 1) * spr)
                    s0 = src_h0(src)
                    segs = []
                    for h in range(h0, h1):
                        for sp, dp, n in runs:
                            segs.append((((h - s0) * nls + sp) * P * bph,
                                         ((h - d0) * nld + dp) * P * bph, n * P * bph))
                    acc.setdefault((s, src, d), {}).setdefault(name, []).extend(segs)
    routes = {}
    for key, per_buf in acc.items():
        s = key[0]
        out = []
        for name in sorted(per_buf):
            si, di = prefill_stages[s][name].item_bytes, decode[name].item_bytes
            out.extend(Segment(name, so, do, n, si, di) for so, do, n in _merge(per_buf[name]))
        routes[key] = tuple(out)
    meta_writer = {d: (pp - 1, d % ptp) for d in range(dtp)}
    return TransferPlan(ptp, pp, dtp, routes, meta_writer)


# ------------------------------------------------------------------------------------------
# Descriptors
# ------------------------------------------------------------------------------------------

def page_runs(src_pages, dst_pages) -> np.ndarray:
    """Split a (src page, dst page) pairing into runs contiguous on both sides.
    Returns int64 array [R, 3] of (src_start, dst_start, n)."""
    s = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source pages vs {d.size} destination pages")
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [s.size]))
    return np.stack([s[starts], d[starts], ends - starts], axis=1)


def segment_descs(seg: Segment, runs: np.ndarray, src_base: int, dst_base: int,
                  coalesce: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_addr, dst_addr, length) arrays for one segment over page runs. A whole-item segment
    gives one descriptor per run (``coalesce``); otherwise one per page."""
    if runs.shape[0] == 0:
        z = np.zeros(0, dtype=np.uint64)
        return z, z, z
    if seg.whole and coalesce:
        sa = src_base + runs[:, 0] * seg.src_item
        da = dst_base + runs[:, 1] * seg.dst_item
        ln = runs[:, 2] * seg.length
    else:
        n = runs[:, 2]
        rep = np.repeat(np.arange(runs.shape[0]), n)
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        sp = runs[rep, 0] + within
        dp = runs[rep, 1] + within
        sa = src_base + sp * seg.src_item + seg.src_off
        da = dst_base + dp * seg.dst_item + seg.dst_off
        ln = np.full(sp.shape, seg.length, dtype=np.int64)
    return sa.astype(np.uint64), da.astype(np.uint64), ln.astype(np.uint64)


def count_descriptors(segments: Sequence[Segment], src_pages, dst_pages,
                      coalesce: bool = True) -> int:
    runs = page_runs(src_pages, dst_pages)
    n_pages = int(runs[:, 2].sum()) if runs.size else 0
    return sum(runs.shape[0] if (s.whole and coalesce) else n_pages for s in segments)
