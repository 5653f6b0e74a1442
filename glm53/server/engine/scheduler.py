"""What prefill and decode schedulers share: the control channel, page allocation, admission,
the step loop with fault containment and its throughput log, and the process entry.

An instance is one scheduler driving the rank workers of a `WorkerGroup` (group.py). The
scheduler decides everything per request — admission, batching, pages, finishing — and the
ranks only run what it hands them, so every rank sees the same batch and the same page ids.
"""

from __future__ import annotations

import abc
import cProfile
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from glm53.models import GlmConfig, OutOfPages, PageAllocator
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.model_fit import check_model_fit
from glm53.server import heap
from glm53.server.engine.group import LocalWorkers, WorkerGroup
from glm53.server.engine.node_ranks import NodeRendezvous, Rejoin, group_timeout
from glm53.server.engine.processes import ProcessWorkers, RanksLost
from glm53.server.engine.worker import rank_specs
from glm53.server.protocol import Abort, GenerateRequest, InstanceChannel, LoadStats, TokenEvent
from glm53.server.sampling import SamplingParams
from glm53.transport import TransferErrorCode

log = logging.getLogger(__name__)

# Transport failure causes the router tells apart (protocol.ERROR_CODES); the rest are "transfer_failed".
# A room that waited out the queue bound (transport's backstop: prefill never admitted it, or
# decode never sent its destination) is "overloaded", like one the scheduler's queue expired.
_TIMEOUT_CODES = {TransferErrorCode.BOOTSTRAP_TIMEOUT: "bootstrap_timeout",
                  TransferErrorCode.TRANSFER_TIMEOUT: "transfer_timeout",
                  TransferErrorCode.QUEUE_TIMEOUT: "overloaded"}


def protocol_error_code(code: TransferErrorCode | None) -> str:
    """The protocol error code (protocol.ERROR_CODES) for a transport failure."""
    return _TIMEOUT_CODES.get(code, "transfer_failed")


def instance_by_index(cluster: ClusterConfig, role: str, index: int) -> InstanceConfig:
    pool = cluster.pool(role)
    if not 0 <= index < len(pool):
        raise SystemExit(f"{cluster.source}: no {role} instance with index {index} (there are {len(pool)})")
    return pool[index]


def build_workers(cluster: ClusterConfig, inst: InstanceConfig, weights_from: WorkerGroup | None = None,
                  stop: threading.Event | None = None, rendezvous: NodeRendezvous | None = None) -> WorkerGroup:
    """The instance's ranks, built and started (a prefill rank needs its bootstrap server up).
    `weights_from`: a single-rank instance in this process whose weights a single rank shares.
    An instance across nodes meets the other nodes' ranks on `rendezvous` (one for the life of
    the scheduler) and waits for them: at start-up until router.startup_timeout_s (what `up`
    waits for it), when rebuilt (`stop` given) until `stop`."""
    from glm53.server.embedded_model import resolve_paths

    path, cluster = resolve_paths(cluster)
    check_model_fit(cluster, path)
    specs = rank_specs(cluster, inst, str(path), GlmConfig.from_dir(path).num_hidden_layers)
    if len(specs) == 1:
        return LocalWorkers(specs, weights_from if isinstance(weights_from, LocalWorkers) else None)
    timeout = group_timeout(cluster)
    if len(inst.node_list) > 1:
        deadline = None if stop is not None else time.monotonic() + cluster.router.startup_timeout_s
        return (rendezvous or NodeRendezvous(inst, timeout)).form(specs, timeout, deadline, stop)
    host, port = inst.rendezvous
    return ProcessWorkers(specs, timeout_s=timeout, host=host, port=port)


@dataclass
class TrackedRequest:
    """A router request as an instance holds it: the request spec and its KV pages. `deadline`
    (monotonic): when it must have been admitted (its queue budget); 0 until `on_request` sets it."""

    req: GenerateRequest
    arrived: float
    pages: list[int] = field(default_factory=list)
    deadline: float = 0.0

    @property
    def key(self) -> tuple[int, int]:
        return (self.req.room, self.req.generation)

    @property
    def params(self) -> SamplingParams:
        return self.req.spec.params

    @property
    def prompt_len(self) -> int:
        return len(self.req.spec.input_ids)


class Scheduler(abc.ABC):
    """The step loop of one instance. Subclasses implement `on_request`, `on_abort`, `step`
    (one engine step; True when it did work), `queue_sizes` (running, waiting, transferring)
    and `fail_all`."""

    role = ""

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, workers: WorkerGroup | None = None,
                 weights_from: WorkerGroup | None = None):
        self.cluster, self.inst = cluster, inst
        # An instance across nodes keeps its rendezvous store for every group it forms.
        self._rendezvous = (NodeRendezvous(inst, group_timeout(cluster))
                            if workers is None and len(inst.node_list) > 1 else None)
        self.workers = workers or build_workers(cluster, inst, weights_from, rendezvous=self._rendezvous)
        self.cfg = self.workers.cfg
        self.allocator = PageAllocator(self.workers.num_pages)
        self.max_running = inst.engine.max_running_requests
        # How long a request may wait to be admitted when the router does not say
        # (GenerateRequest.queue_budget_s); past its deadline it fails as "overloaded" (a 503 with
        # Retry-After at the router), never as a transfer fault.
        self.max_queue_wait = cluster.router.max_queue_wait_s
        self._expire_t = 0.0
        self._stop = threading.Event()
        self._load = LoadStats()
        self._log_every = inst.engine.log_interval_s
        self._log_t = time.monotonic()
        self._log_tokens = 0
        self._throughput = 0.0
        self.broken = ""  # why this instance can no longer run (a rank was lost); "" while healthy
        # An instance across nodes rebuilds its group after losing a node (engine/node_ranks.py).
        self._rejoin: Rejoin | None = None
        self.channel = InstanceChannel(inst.address, inst.name, self.role, load_fn=lambda: self._load)
        # Called before every step on the loop's thread: a colocated prefill picks its CUDA
        # stream there (engine/colocate.py).
        self.before_step: Callable[[], None] | None = None

    @property
    def last_load(self) -> LoadStats:
        """The load as of the last step (a snapshot: safe to read from another thread)."""
        return self._load

    @abc.abstractmethod
    def on_request(self, req: GenerateRequest) -> None: ...

    @abc.abstractmethod
    def on_abort(self, msg: Abort) -> None: ...

    @abc.abstractmethod
    def step(self) -> bool: ...

    @abc.abstractmethod
    def queue_sizes(self) -> tuple[int, int, int]: ...

    @abc.abstractmethod
    def fail_all(self, message: str) -> None:
        """Fail every request this instance holds (the router gets an error event for each);
        pages are freed as soon as no transfer can still write them."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Forget every request (after `fail_all` told the router): the instance lost a rank and
        will run nothing again, so its pages can never be written or reused."""

    def accept(self, req: GenerateRequest, max_tokens: int, pages: int | None = None) -> bool:
        """Whether this instance can run the request (sequences of `max_tokens` tokens taking
        `pages` pages in all; None: one sequence); False after answering the router with an error."""
        ids = req.spec.input_ids
        vocab = self.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            self.send_error(req, f"token ids must be in [0, {vocab})", "bad_request")
            return False
        if not ids or max_tokens > self.cfg.max_position_embeddings:
            self.send_error(req, "prompt is empty or longer than the model's context", "context_length")
            return False
        if (pages if pages is not None else self.workers.pages_needed(max_tokens)) > self.allocator.num_pages:
            self.send_error(req, f"request needs more KV pages than the {self.role} pool holds", "context_length")
            return False
        return True

    def track(self, r: TrackedRequest) -> TrackedRequest:
        """Set a new request's admission deadline: its queue budget from the router, else
        router.max_queue_wait_s."""
        r.deadline = r.arrived + (r.req.queue_budget_s or self.max_queue_wait)
        return r

    def admit_next(self, queue: deque, tokens: Callable[[TrackedRequest], int]) -> TrackedRequest | None:
        """Pop the head of `queue` with pages for `tokens(r)` tokens allocated, or None while it
        must wait for pages (FIFO: the head waits, nobody overtakes it). The caller reports the
        admission (`admitted`)."""
        if not queue:
            return None
        try:
            queue[0].pages = self.allocate(queue[0], tokens(queue[0]))
        except OutOfPages:
            return None
        return queue.popleft()

    def expire_queued(self, queue: deque, why: str) -> None:
        """Fail the queued requests whose admission deadline passed, as "overloaded" (checked at
        most every 50 ms: a queue may be long)."""
        now = time.monotonic()
        if now - self._expire_t < 0.05 or not queue:
            return
        self._expire_t = now
        for r in [r for r in queue if r.deadline and now > r.deadline]:
            queue.remove(r)
            self.send_error(r.req, f"not admitted within the queue bound (router.max_queue_wait_s; waited "
                            f"{now - r.arrived:.1f} s on this instance): {why}", "overloaded")

    def admitted(self, r: TrackedRequest, cached_tokens: int = 0) -> None:
        """Tell the router that the room left this instance's queue (its transfer clock starts)."""
        self.channel.send(r.req.reply_to, TokenEvent(room=r.req.room, generation=r.req.generation,
                                                     instance=self.inst.name, prompt_tokens=r.prompt_len,
                                                     cached_tokens=cached_tokens, admitted=True))

    def allocate(self, r: TrackedRequest, tokens: int) -> list[int]:
        """The pages of an admitted request holding `tokens` tokens; raises OutOfPages."""
        return self.allocator.alloc(self.workers.pages_needed(tokens))

    def free_pages(self) -> int:
        """Pages a new request could get now."""
        return self.allocator.num_free

    def send_error(self, req: GenerateRequest, message: str, code: str) -> None:
        self.channel.send(req.reply_to, TokenEvent(
            room=req.room, generation=req.generation, instance=self.inst.name, finish_reason="error",
            error=message, error_code=code, prompt_tokens=len(req.spec.input_ids)))

    def load(self) -> LoadStats:
        running, waiting, transferring = self.queue_sizes()
        a = self.allocator
        return LoadStats(num_running=running, num_waiting=waiting, num_transferring=transferring,
                         kv_pages_used=a.num_pages - self.free_pages(), kv_pages_total=a.num_pages,
                         page_size=self.workers.page_size, gen_throughput=self._throughput)

    def count_tokens(self, n: int) -> None:
        """Tokens a step processed (prefill: prompt tokens; decode: generated tokens)."""
        self._log_tokens += n

    def _maybe_log(self) -> None:
        """Every `log_interval_s`: throughput since the last line and the queues, SGLang style."""
        now = time.monotonic()
        if now - self._log_t < self._log_every:
            return
        self._throughput = self._log_tokens / (now - self._log_t)
        load = self._load
        if self._log_tokens or load.num_running or load.num_waiting or load.num_transferring:
            log.info("%s batch, #running-req: %d, #queue-req: %d, #transfer-req: %d, token usage: %.2f, "
                     "throughput (token/s): %.1f", self.role.capitalize(), load.num_running, load.num_waiting,
                     load.num_transferring, load.kv_pages_used / max(1, load.kv_pages_total), self._throughput)
        self._log_t, self._log_tokens = now, 0

    def stop(self, *_args) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        self.channel.ready = True
        log.info("%s %s ready on %s", self.role, self.inst.name, self.inst.address)
        while not self._stop.is_set():
            if self.broken:
                self._take_rejoined()
                self.poll_channel(timeout=0.05)
                continue
            # A step's events (every request's tokens) leave together, one frame per router.
            with self.channel.batched():
                busy = self._step_contained()
            if busy is None:
                continue
            self._load = self.load()
            self._maybe_log()
            if not busy:
                # A router message ends the wait at once; only transfer completions are polled,
                # so wait briefly while any are in flight and longer when fully idle.
                self.poll_channel(timeout=0.002 if self._load.num_transferring else 0.05)

    def _step_contained(self) -> bool | None:
        """Router messages, then one step; whether it did work (None: a rank was lost)."""
        self.poll_channel(timeout=0.0)
        try:
            self.workers.sync()
            if self.before_step is not None:
                self.before_step()
            return self.step()
        except RanksLost as e:
            self._break(str(e))
            return None
        except Exception as e:  # contain it: this step's requests fail, the instance lives
            log.exception("%s: engine step failed", self.inst.name)
            self.fail_all(f"internal error: {type(e).__name__}: {e}")
            return True

    def _break(self, why: str) -> None:
        """A lost rank ends this instance's service: every request fails with the reason, pings
        report not ready (the router routes around it), and new requests are refused."""
        log.error("%s: %s; the instance stops serving", self.inst.name, why)
        self.broken = f"{self.role} instance {self.inst.name} lost a rank: {why}"
        self.fail_all(self.broken)
        # The IO thread answers pings on its own, and a not-ready pong fails the instance's rooms
        # at the router as "stopped responding": the failures (held by the step's `batched`)
        # leave first, so each request fails with the reason.
        self.channel.flush()
        self.channel.ready = False
        # The lost rank's transfer handles will never report again; nothing runs here any more,
        # so the pages they guarded are reported free rather than held forever.
        self.abandon()
        self.allocator = PageAllocator(self.workers.num_pages)
        self._load = self.load()  # the pongs report the pages free from now on, not the last step's
        if getattr(self.workers, "spans_nodes", False):
            # The lost node's ranks come back when its `up` restarts: a new group forms in the
            # background; until then this instance answers not ready.
            log.warning("%s: waiting for the lost node's ranks to rejoin at %s", self.inst.name,
                        self.inst.dist_init_addr)
            self._rejoin = Rejoin(self.workers, lambda stop: build_workers(self.cluster, self.inst, stop=stop,
                                                                           rendezvous=self._rendezvous),
                                  self.inst.name)

    def _take_rejoined(self) -> None:
        """Serve again once a rebuilt group is whole: fresh pools, every page free."""
        workers = self._rejoin.result() if self._rejoin is not None else None
        if workers is None:
            return
        self._rejoin = None
        self.workers = workers
        self.allocator = PageAllocator(workers.num_pages)
        self.broken = ""
        self.channel.ready = True
        heap.freeze()  # the rebuilt group's model and pools, as at start-up
        log.info("%s ready again (%d KV pages)", self.inst.name, workers.num_pages)

    def poll_channel(self, timeout: float) -> None:
        msg = self.channel.get(timeout=timeout) if timeout > 0 else None
        msgs = ([msg] if msg is not None else []) + self.channel.drain()
        for m in msgs:
            if isinstance(m, GenerateRequest) and self.broken:
                self.send_error(m, self.broken, "internal")
            elif isinstance(m, GenerateRequest):
                self.on_request(m)
            elif isinstance(m, Abort):
                self.on_abort(m)

    def close(self) -> None:
        self.channel.close()
        if self._rejoin is not None:  # the broken group is the rejoin's to close
            rebuilt = self._rejoin.stop(timeout=10.0)
            if rebuilt is not None:
                rebuilt.close()
            return
        self.workers.close()


def setup_process(cluster: ClusterConfig, inst: InstanceConfig, label: str) -> None:
    """What an instance process sets before it builds: logging lines tagged `label`, no autograd,
    and on CPU one intra-op thread."""
    logging.basicConfig(
        level=getattr(logging, cluster.router.log_level.upper(), logging.INFO), stream=sys.stderr,
        format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s",
        force=True,  # the CLI configured logging before it knew which instance this is
    )
    torch.set_grad_enabled(False)
    if inst.engine.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Several instances share the host's cores: one intra-op thread each avoids OpenMP
        # oversubscription, which measured 7x slower decode steps on a 2-core machine.
        torch.set_num_threads(1)


def run_instance(scheduler_cls: type[Scheduler], cluster: ClusterConfig, role: str, index: int) -> int:
    """Process entry: logging, signals, build, serve until SIGTERM/SIGINT, clean shutdown."""
    inst = instance_by_index(cluster, role, index)
    setup_process(cluster, inst, inst.name)
    sched = scheduler_cls(cluster, inst)
    signal.signal(signal.SIGTERM, sched.stop)
    signal.signal(signal.SIGINT, sched.stop)
    heap.settle()
    t0 = time.monotonic()
    # GLM53_PROFILE_DIR: profile the serving loop (cProfile) into DIR/<instance>.prof, for
    # finding host time (benchmarks/served_gap.py reads it); written at a clean shutdown.
    prof_dir = os.environ.get("GLM53_PROFILE_DIR")
    prof = cProfile.Profile() if prof_dir else None
    try:
        if prof is not None:
            prof.enable()
        sched.serve_forever()
    finally:
        if prof is not None:
            prof.disable()
            os.makedirs(prof_dir, exist_ok=True)
            prof.dump_stats(os.path.join(prof_dir, f"{inst.name}.prof"))
        sched.close()
        log.info("%s stopped after %.1f s", inst.name, time.monotonic() - t0)
    return 0
