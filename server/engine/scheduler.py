"""What prefill and decode instances share: building the model runner and transfer engine from
the cluster config, the control channel, and the step loop with signal handling.

An instance is one process (TP/PP ranks arrive with their own issues). Its loop takes router
messages, runs one engine step, and idles briefly on the channel when there is nothing to do.
"""

from __future__ import annotations

import abc
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

from glm53.models import GlmConfig, ModelRunner, OutOfPages, load_weights
from glm53.models.model import GlmForCausalLM
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.protocol import Abort, GenerateRequest, InstanceChannel, LoadStats, TokenEvent
from glm53.server.sampling import SamplingParams
from glm53.transport.engine import TransferEngine, TransportConfig

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def instance_by_index(cluster: ClusterConfig, role: str, index: int) -> InstanceConfig:
    pool = cluster.prefill if role == "prefill" else cluster.decode
    if not 0 <= index < len(pool):
        raise SystemExit(f"{cluster.source}: no {role} instance with index {index} (there are {len(pool)})")
    return pool[index]


def transfer_error_code(error: str) -> str:
    """The protocol error code (protocol.ERROR_CODES) for a transport failure message."""
    if error.startswith("bootstrap timeout"):
        return "bootstrap_timeout"
    if error.startswith("transfer timeout"):
        return "transfer_timeout"
    return "transfer_failed"


def kv_pages(inst: InstanceConfig, cfg: GlmConfig, dtype: torch.dtype, device: torch.device) -> int:
    """KV capacity in pages: `num_pages`, else `max_total_tokens`, else (GPU) what fits in
    `mem_fraction_static` of the device once the weights are loaded, else (CPU) 64K tokens."""
    eng = inst.engine
    if eng.num_pages is not None:
        return eng.num_pages
    tokens = eng.max_total_tokens
    if tokens is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * eng.mem_fraction_static - (total - free)
        tokens = int(budget // ModelRunner.kv_bytes_per_token(cfg, dtype))
        if tokens < eng.page_size:
            raise SystemExit(f"{inst.name}: mem_fraction_static={eng.mem_fraction_static} leaves no room for the "
                             f"KV cache after the weights ({(total - free) / 2**30:.1f} GiB used of {total / 2**30:.1f})")
    return -(-(tokens or 65536) // eng.page_size)


def build_runner(cluster: ClusterConfig, inst: InstanceConfig) -> ModelRunner:
    from glm53.server.embedded_model import resolve_model_path

    eng = inst.engine
    path = resolve_model_path(cluster.model.path)
    cfg = GlmConfig.from_dir(path)
    device = torch.device("cpu")
    if eng.device == "cuda":
        device = torch.device("cuda", inst.devices[0] if inst.devices else 0)
    name = cfg.torch_dtype if eng.dtype == "auto" else eng.dtype
    dtype = _DTYPES.get(name, torch.bfloat16)
    model = GlmForCausalLM(cfg, dtype=dtype)
    load_weights(model, path, progress=False)
    model.to(device)
    return ModelRunner(model, num_pages=kv_pages(inst, cfg, dtype, device), page_size=eng.page_size, device=device)


def transport_config(cluster: ClusterConfig, inst: InstanceConfig) -> TransportConfig:
    t = cluster.transfer
    if t.backend != "nixl":
        raise SystemExit(f"{cluster.source}: transfer.backend {t.backend!r} is not available; use 'nixl'")
    return TransportConfig(
        bootstrap_timeout_s=t.bootstrap_timeout_s,
        transfer_timeout_s=t.transfer_timeout_s,
        peer_timeout_s=min(10.0, t.transfer_timeout_s),
        host=inst.host,
        # One metadata slot per receiving request: never fewer than the decode batch can hold.
        meta_slots=max(1024, inst.engine.max_running_requests),
    )


def register_pools(transfer, runner: ModelRunner) -> None:
    kv = runner.kv
    transfer.register_pool("latent", kv.latent, layers=kv.spec.layers)
    if kv.index_k is not None:
        transfer.register_pool("index_k", kv.index_k, layers=kv.spec.indexer_layers)


@dataclass
class TrackedRequest:
    """A router request as an instance holds it: parsed sampling params and its KV pages."""

    req: GenerateRequest
    arrived: float
    pages: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return (self.req.room, self.req.generation)

    @property
    def params(self) -> SamplingParams:
        return self.req.spec.params

    @property
    def prompt_len(self) -> int:
        return len(self.req.spec.input_ids)


class InstanceLoop(abc.ABC):
    """The step loop of one instance: model runner, transfer engine, control channel.
    Subclasses implement `on_request`, `on_abort`, `step` (one engine step; True when it did
    work) and `queue_sizes` (running, waiting, transferring)."""

    role = ""

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, runner: ModelRunner | None = None):
        self.cluster, self.inst = cluster, inst
        self.runner = runner or build_runner(cluster, inst)
        self.max_running = inst.engine.max_running_requests
        # A request that cannot get pages for this long fails as "overloaded" rather than waiting forever.
        self.admit_timeout = cluster.transfer.bootstrap_timeout_s
        self.transfer = TransferEngine(self.role, inst.name, config=transport_config(cluster, inst))
        register_pools(self.transfer, self.runner)
        self._stop = threading.Event()
        self._load = LoadStats()
        self._log_every = inst.engine.log_interval_s
        self._log_t = time.monotonic()
        self._log_tokens = 0
        self._throughput = 0.0
        self.channel = InstanceChannel(inst.address, inst.name, self.role, load_fn=lambda: self._load)

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

    def accept(self, req: GenerateRequest, max_tokens: int) -> bool:
        """Whether this instance can run the request; False after answering the router with an error."""
        ids = req.spec.input_ids
        vocab = self.runner.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            self.send_error(req, f"token ids must be in [0, {vocab})", "bad_request")
            return False
        if not ids or max_tokens > self.runner.cfg.max_position_embeddings:
            self.send_error(req, "prompt is empty or longer than the model's context", "context_length")
            return False
        if self.runner.pages_needed(max_tokens) > self.runner.allocator.num_pages:
            self.send_error(req, f"request needs more KV pages than the {self.role} pool holds", "context_length")
            return False
        return True

    def admit_next(self, queue: deque, tokens: Callable[[TrackedRequest], int]) -> TrackedRequest | None:
        """Pop the head of `queue` with pages for `tokens(r)` tokens allocated, or None while it
        must wait for pages. One that waited longer than admit_timeout fails as "overloaded"
        and the next is tried."""
        while queue:
            r = queue[0]
            try:
                r.pages = self.runner.allocator.alloc(self.runner.pages_needed(tokens(r)))
            except OutOfPages:
                if time.monotonic() - r.arrived <= self.admit_timeout:
                    return None
                queue.popleft()
                self.send_error(r.req, f"{self.role} KV pool exhausted", "overloaded")
                continue
            return queue.popleft()
        return None

    def send_error(self, req: GenerateRequest, message: str, code: str) -> None:
        self.channel.send(req.reply_to, TokenEvent(
            room=req.room, generation=req.generation, instance=self.inst.name, finish_reason="error",
            error=message, error_code=code, prompt_tokens=len(req.spec.input_ids)))

    def load(self) -> LoadStats:
        running, waiting, transferring = self.queue_sizes()
        a = self.runner.allocator
        return LoadStats(num_running=running, num_waiting=waiting, num_transferring=transferring,
                         kv_pages_used=a.num_pages - a.num_free, kv_pages_total=a.num_pages,
                         page_size=self.runner.page_size, gen_throughput=self._throughput)

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
            self.poll_channel(timeout=0.0)
            try:
                busy = self.step()
            except Exception as e:  # contain it: this step's requests fail, the instance lives
                log.exception("%s: engine step failed", self.inst.name)
                self.fail_all(f"internal error: {type(e).__name__}: {e}")
                busy = True
            self._load = self.load()
            self._maybe_log()
            if not busy:
                # A router message ends the wait at once; only transfer completions are polled,
                # so wait briefly while any are in flight and longer when fully idle.
                self.poll_channel(timeout=0.002 if self._load.num_transferring else 0.05)

    def poll_channel(self, timeout: float) -> None:
        msg = self.channel.get(timeout=timeout) if timeout > 0 else None
        msgs = ([msg] if msg is not None else []) + self.channel.drain()
        for m in msgs:
            if isinstance(m, GenerateRequest):
                self.on_request(m)
            elif isinstance(m, Abort):
                self.on_abort(m)

    def close(self) -> None:
        self.channel.close()
        self.transfer.close()


def run_instance(loop_factory, cluster: ClusterConfig, role: str, index: int) -> int:
    """Process entry: logging, signals, build, serve until SIGTERM/SIGINT, clean shutdown."""
    inst = instance_by_index(cluster, role, index)
    logging.basicConfig(
        level=getattr(logging, cluster.router.log_level.upper(), logging.INFO), stream=sys.stderr,
        format=f"%(asctime)s {inst.name} %(levelname)s %(name)s: %(message)s",
        force=True,  # the CLI configured logging before it knew which instance this is
    )
    torch.set_grad_enabled(False)
    if inst.engine.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Several instances share the host's cores: one intra-op thread each avoids OpenMP
        # oversubscription, which measured 7x slower decode steps on a 2-core machine.
        torch.set_num_threads(1)
    loop = loop_factory(cluster, inst)
    signal.signal(signal.SIGTERM, loop.stop)
    signal.signal(signal.SIGINT, loop.stop)
    t0 = time.monotonic()
    try:
        loop.serve_forever()
    finally:
        loop.close()
        log.info("%s stopped after %.1f s", inst.name, time.monotonic() - t0)
    return 0
