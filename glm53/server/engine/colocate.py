"""Prefill and decode in one process on one GPU (`prefill[i].colocate: <decode name>`), the GPU's
SMs split between them while both have work.

Why one process: two processes on one GPU time-slice it, so a decode step that meets a prefill
chunk waits for its slice (measured on an H200: 2.7 ms alone, 7.2 ms beside 4K-token chunks at
batch 64; `benchmarks/shared_gpu.py`). In one CUDA context both run at once, but decode's kernels
then queue behind the chunk's blocks (15-17 ms, whatever the stream priorities). A green context
confines prefill's kernels to `colocate_sms` SMs; decode's run on the others without waiting
(3.4 ms beside prefill on 32 SMs). Prefill gets the whole GPU whenever decode has nothing running.

On a CPU a colocated pair shares the process and nothing more (there are no SMs to split).

Each instance keeps everything it has alone (router channel, scheduler loop, rank, KV pools,
transfer engine: the KV still moves through NIXL, within the GPU) and runs its loop in a thread
of its own, on its own CUDA streams.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Callable

import torch

from glm53.server import heap
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.prefill import PrefillScheduler
from glm53.server.engine.scheduler import Scheduler, setup_process

log = logging.getLogger(__name__)

# The loops take turns on the GIL; a long turn would hold a decode step behind prefill's kernel
# launches (the default 5 ms is longer than a step).
GIL_SWITCH_S = 5e-4


class GpuShare:
    """The CUDA streams of a colocated pair on `device`: decode's (high priority, all SMs), and
    prefill's two (a green context of `prefill_sms` SMs, and all SMs)."""

    def __init__(self, device: torch.device, prefill_sms: int, decode_busy: Callable[[], bool]):
        from torch.cuda import green_contexts

        total = torch.cuda.get_device_properties(device).multi_processor_count
        if not green_contexts.SUPPORTED:
            raise SystemExit("colocate: this torch build has no CUDA green contexts (needs CUDA 12.8+)")
        if prefill_sms >= total:
            raise SystemExit(f"colocate_sms={prefill_sms}: the GPU has {total} SMs; leave decode some")
        self._green = green_contexts.GreenContext.create(num_sms=prefill_sms, device_id=device.index)
        self.narrow = self._green.Stream()
        self.full = torch.cuda.Stream(device)
        self.decode = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])
        self.decode_busy = decode_busy
        self.current: torch.cuda.Stream | None = None
        self._last: torch.cuda.Event | None = None  # the end of the step before the last one
        self.steps = {"narrow": 0, "full": 0}

    def prefill_step(self) -> None:
        """Before each prefill step, on prefill's thread: the green context's stream while decode
        is busy (`decode_busy`: it runs requests or has one on its way from prefill), else the
        whole GPU. A switch orders the new stream after the old one, so a prompt's chunks (and
        the transfer events recorded after them) stay in order.

        Prefill's host runs at most one step ahead of its GPU work: a stream's launch queue is
        finite, and a launch into a full one blocks holding the GIL, which would stall the decode
        loop for as long as the queued chunks take on their few SMs (a GLM-5 chunk is thousands of
        launches; the 4-layer slice's fit the queue, and its ITL p99 did not change). Waiting on
        an event releases the GIL."""
        if self.current is not None:
            end = torch.cuda.Event()
            end.record(self.current)
            if self._last is not None:
                self._last.synchronize()
            self._last = end
        narrow = self.decode_busy()
        s = self.narrow if narrow else self.full
        if s is not self.current:
            if self.current is not None:
                s.wait_stream(self.current)
            torch.cuda.set_stream(s)
            self.current = s
        self.steps["narrow" if narrow else "full"] += 1


def decode_busy(decode: DecodeScheduler, prefill: PrefillScheduler) -> bool:
    """Whether prefill's next step keeps to its SMs: decode runs requests, or prefill has one on
    its way to it (first token sampled, KV in flight). A chunk queued on the whole GPU would hold
    that request's first decode steps (~15 ms each on the slice, beside a 4K chunk) until it ends.
    Prefill reaps a sent request only at the end of a later step, by when decode has adopted it."""
    return decode.last_load.num_running > 0 or bool(prefill.sending)


def run_colocated(cluster: ClusterConfig, dec: InstanceConfig, pre: InstanceConfig) -> int:
    """Process entry of a colocated pair: build both instances, run each loop in its thread until
    SIGTERM/SIGINT or until either loop dies (then both stop and the exit code says so).
    `glm53-serve decode` (cli.py) runs it for a decode instance a prefill instance colocates with."""
    setup_process(cluster, dec, f"{dec.name}+{pre.name}")
    gpu = dec.engine.device == "cuda"
    device = torch.device(f"cuda:{dec.devices[0]}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    sys.setswitchinterval(GIL_SWITCH_S)
    decode = DecodeScheduler(cluster, dec)
    try:
        prefill = PrefillScheduler(cluster, pre, weights_from=decode.workers)
    except BaseException:
        decode.close()
        raise
    log.info("%s shares %s's weights: %s", pre.name, dec.name, "yes" if prefill.workers.rank.shares_weights
             else "no (their model, dtype or draft differ): two copies")
    share = None
    if gpu:  # on a CPU the pair shares the process only: there are no SMs to split
        share = GpuShare(device, pre.colocate_sms, lambda: decode_busy(decode, prefill))
        prefill.before_step = share.prefill_step
        torch.cuda.synchronize(device)  # the builds' work is done before the loops' streams start
    failed: list[str] = []

    def stop(*_args) -> None:
        decode.stop()
        prefill.stop()

    def loop(sched: Scheduler, stream: torch.cuda.Stream | None) -> None:
        # Grad mode, the current device and the current stream are per thread.
        torch.set_grad_enabled(False)
        if gpu:
            torch.cuda.set_device(device)
        if stream is not None:
            torch.cuda.set_stream(stream)
        try:
            sched.serve_forever()
        except BaseException:
            log.exception("%s: the loop died; stopping the pair", sched.inst.name)
            failed.append(sched.inst.name)
            stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    heap.settle()  # one process, two loops: a full collection would stop both
    threads = [threading.Thread(target=loop, args=(decode, share.decode if share else None), name=dec.name),
               threading.Thread(target=loop, args=(prefill, None), name=pre.name)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):  # joins with a timeout keep signals deliverable
            for t in threads:
                t.join(0.2)
    finally:
        stop()
        for t in threads:
            t.join(30)
        prefill.close()
        decode.close()
        how = ""
        if share:
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            how = (f" (prefill loop turns on {pre.colocate_sms} SMs: {share.steps['narrow']}, on all: "
                   f"{share.steps['full']}; allocator retries: {retries})")
        log.info("%s and %s stopped after %.1f s%s", dec.name, pre.name, time.monotonic() - t0, how)
    return 1 if failed else 0
