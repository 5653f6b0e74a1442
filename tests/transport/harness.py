"""Parent-side orchestration of multi-process transfer scenarios."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time


from . import worker

CTX = mp.get_context("spawn")
# Healthy scenarios: no peer dies, so liveness only has to outlast scheduling stalls of a loaded
# 2-core CI machine (1.5 s flagged live peers there as unresponsive). Fault tests pass their own.
FAST = dict(bootstrap_timeout_s=10.0, transfer_timeout_s=20.0, heartbeat_interval_s=0.2,
            peer_timeout_s=8.0, quiesce_timeout_s=3.0)


def scattered_pages(rng, n, num_pages, max_run=7):
    """n distinct destination pages as a mix of short contiguous runs, shuffled."""
    perm = rng.permutation(num_pages)
    out, used = [], set()
    for start in perm:
        run = int(rng.integers(1, max_run + 1))
        cand = [p for p in range(start, min(start + run, num_pages)) if p not in used]
        if len(cand) < run:
            cand = cand[:1] if cand else []
        for p in cand:
            if len(out) < n:
                out.append(int(p))
                used.add(int(p))
        if len(out) == n:
            break
    assert len(out) == n
    return out


def _recv(conn, what, timeout, procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            tag, val = conn.recv()
            if tag == "error":
                raise AssertionError(f"worker failed:\n{val}")
            assert tag == what, (tag, what, val)
            return val
        for p in procs:
            if p.exitcode not in (None, 0) and p.exitcode != -9:
                raise AssertionError(f"worker {p.name} exited with {p.exitcode}")
    raise AssertionError(f"timed out waiting for {what!r}")


class Scenario:
    """Prefill processes (each a list of (pp, tp) ranks; the first hosts the bootstrap server)
    and decode processes (each a list of tp ranks)."""

    def __init__(self, ptp, pp, dtp, tls, rooms_p, rooms_d, g=None, cfg=None,
                 prefill_groups=None, decode_groups=None, num_pages=64, draft=True, wait=60,
                 dplan_extra=None):
        self.g = g or worker.geometry()
        self.cfg = dict(FAST, **(cfg or {}))
        self.ptp, self.pp, self.dtp, self.tls = ptp, pp, dtp, tls
        self.pg = prefill_groups or [[(s, t) for s in range(pp) for t in range(ptp)]]
        self.dg = decode_groups or [list(range(dtp))]
        self.pplan = dict(rooms=rooms_p, num_pages=num_pages, draft=draft, wait=wait)
        self.dplan = dict(rooms=rooms_d, num_pages=num_pages, draft=draft, wait=wait,
                          **(dplan_extra or {}))
        self.pconns, self.dconns, self.pprocs, self.dprocs = [], [], [], []

    def start(self):
        from glm53.transport import BootstrapServer
        self.srv = BootstrapServer("p0", self.pp, self.ptp)
        self.addr = self.srv.address
        for i, ranks in enumerate(self.pg):
            a, b = CTX.Pipe()
            p = CTX.Process(target=worker.prefill_main, name=f"prefill{i}",
                            args=(b, ranks, self.ptp, self.pp, self.g, self.tls, self.cfg,
                                  self.pplan, self.addr), daemon=True)
            p.start()
            self.pconns.append(a)
            self.pprocs.append(p)
        for i, ranks in enumerate(self.dg):
            a, b = CTX.Pipe()
            p = CTX.Process(target=worker.decode_main, name=f"decode{i}",
                            args=(b, ranks, self.dtp, self.g, self.tls, self.cfg, self.dplan,
                                  self.addr), daemon=True)
            p.start()
            self.dconns.append(a)
            self.dprocs.append(p)
        procs = self.pprocs + self.dprocs
        for c in self.pconns + self.dconns:
            _recv(c, "ready", 60, procs)
        return self

    def results(self, conns, timeout=90):
        procs = self.pprocs + self.dprocs
        return [_recv(c, "done", timeout, procs) for c in conns]

    def finish(self, conns=None):
        conns = conns if conns is not None else self.pconns + self.dconns
        procs = self.pprocs + self.dprocs
        for c in conns:
            c.send("close")
        for c in conns:
            _recv(c, "closed", 30, procs)
        self.stop()

    def stop(self):
        if getattr(self, "srv", None) is not None:
            self.srv.close()
            self.srv = None
        for p in self.pprocs + self.dprocs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)

    def kill(self, proc):
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def make_rooms(rng, n_rooms, n_pages, num_pages, chunks=None, start_id=1, **extra):
    rooms_p, rooms_d = [], []
    src_all = rng.permutation(num_pages)
    dst_all = scattered_pages(rng, n_rooms * n_pages, num_pages)
    for r in range(n_rooms):
        src = [int(x) for x in src_all[r * n_pages:(r + 1) * n_pages]]
        dst = dst_all[r * n_pages:(r + 1) * n_pages]
        rid = (start_id + r) | (1 << 63)  # u64 ids above 2^63 too
        ch = chunks or [n_pages]
        rooms_p.append(dict(id=rid, gen=3, src_pages=src, chunks=ch, row=[1000 + r, 7], salt=r,
                            **extra))
        rooms_d.append(dict(id=rid, gen=3, dst_pages=dst, row=[1000 + r, 7], salt=r))
    return rooms_p, rooms_d
