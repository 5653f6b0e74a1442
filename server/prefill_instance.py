"""Prefill instance: intake over ZMQ, chunked-prefill batching, first-token sampling, and KV
transfer of each chunk's completed pages as soon as its forward pass is done (DESIGN §3).

Per request: admit (allocate prompt pages, create the KV sender for its room) -> prefill in
chunks under a per-step token budget -> sample the first token -> `finish` with the metadata
row (the commit record) -> when the sender reports a terminal state, free the pages. A failed
transfer is reported to the router as an error event for the room.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from glm53.models import ModelRunner, OutOfPages, SeqChunk
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.instance import InstanceLoop, build_runner, register_pools, run_instance, transport_config
from glm53.server.protocol import Abort, GenerateRequest, LoadStats, TokenEvent
from glm53.server.sampling import SamplingParams, sample, step_generator
from glm53.transport import BootstrapServer
from glm53.transport.buffers import MetadataRow
from glm53.transport.engine import TERMINAL, KVPoll, KVSender, Room, TransferEngine

log = logging.getLogger(__name__)


@dataclass
class PrefillRequest:
    req: GenerateRequest
    params: SamplingParams
    arrived: float
    pages: list[int] = field(default_factory=list)
    sender: KVSender | None = None
    done_tokens: int = 0  # prompt tokens already in the cache
    sent_pages: int = 0  # pages already handed to the sender

    @property
    def key(self) -> tuple[int, int]:
        return (self.req.room, self.req.generation)

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)


class PrefillLoop(InstanceLoop):
    role = "prefill"

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, runner: ModelRunner | None = None):
        self.runner = runner or build_runner(cluster, inst)
        self.budget = inst.engine.chunked_prefill_size
        self.max_running = inst.engine.max_running_requests
        self.admit_timeout = cluster.transfer.bootstrap_timeout_s
        self.bootstrap = BootstrapServer(inst.name, pp_size=1, tp_size=1, host=inst.host, port=inst.bootstrap_port)
        self.transfer = TransferEngine("prefill", inst.name, config=transport_config(cluster, inst))
        register_pools(self.transfer, self.runner)
        self.transfer.start(self.bootstrap.address)
        self.waiting: deque[PrefillRequest] = deque()
        self.running: list[PrefillRequest] = []  # prefilling, in arrival order
        self.sending: list[PrefillRequest] = []  # prefill done, transfer in flight
        super().__init__(cluster, inst)

    # -- intake ------------------------------------------------------------------------------
    def on_request(self, req: GenerateRequest) -> None:
        try:
            params = SamplingParams.from_dict({**req.sampling, "max_new_tokens": req.max_new_tokens})
        except ValueError as e:
            self._fail(req, f"bad sampling parameters: {e}", "bad_request")
            return
        if not req.input_ids or len(req.input_ids) > self.runner.cfg.max_position_embeddings:
            self._fail(req, "prompt is empty or longer than the model's context", "context_length")
            return
        self.waiting.append(PrefillRequest(req, params, time.monotonic()))

    def on_abort(self, msg: Abort) -> None:
        key = (msg.room, msg.generation)
        for r in list(self.waiting):
            if r.key == key:
                self.waiting.remove(r)
        for r in self.running + self.sending:
            if r.key == key and r.sender is not None:
                r.sender.abort(f"aborted by router: {msg.reason}")
                if r in self.running:
                    self.running.remove(r)
                    self.sending.append(r)  # pages are freed once the sender is terminal

    # -- one engine step ---------------------------------------------------------------------
    def step(self) -> bool:
        self._admit()
        busy = self._prefill_chunk()
        return self._reap() or busy

    def _admit(self) -> None:
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            try:
                r.pages = self.runner.allocator.alloc(self.runner.pages_needed(r.prompt_len))
            except OutOfPages:
                if now - r.arrived > self.admit_timeout:
                    self.waiting.popleft()
                    self._fail(r.req, "prefill KV pool exhausted", "overloaded")
                    continue
                return
            self.waiting.popleft()
            r.sender = self.transfer.create_sender(Room(r.req.room, r.req.generation), r.req.decode.name)
            self.running.append(r)

    def _prefill_chunk(self) -> bool:
        budget, chunks, owners = self.budget, [], []
        for r in self.running:
            if budget <= 0:
                break
            n = min(budget, r.prompt_len - r.done_tokens)
            ids = r.req.input_ids[r.done_tokens : r.done_tokens + n]
            chunks.append(SeqChunk(ids, r.done_tokens, r.pages))
            owners.append(r)
            budget -= n
        if not chunks:
            return False
        logits = self.runner.forward(chunks)
        finished = []
        for r, c, lg in zip(owners, chunks, logits):
            r.done_tokens += len(c.token_ids)
            last = r.done_tokens == r.prompt_len
            # Completed pages travel now; the last (partial) page goes with the last chunk.
            full = len(r.pages) if last else r.done_tokens // self.runner.page_size
            if r.sender.poll() not in TERMINAL and full > r.sent_pages:
                r.sender.send_pages(r.pages[r.sent_pages : full], start=r.sent_pages)
                r.sent_pages = full
            if last:
                finished.append((r, lg[-1]))
        if finished:
            rows = torch.stack([lg for _, lg in finished])
            params = [r.params for r, _ in finished]
            gens = [step_generator(p.seed, 0) if p.seed is not None else None for p in params]
            first = sample(rows, params, gens).tolist()
            for (r, _), tok in zip(finished, first):
                self.running.remove(r)
                self.sending.append(r)
                if r.sender.poll() not in TERMINAL:
                    r.sender.finish(MetadataRow(first_token_ids=(int(tok),), counts=(r.prompt_len,)))
        return True

    def _reap(self) -> bool:
        """Free the pages of requests whose transfer reached a terminal state."""
        did = False
        for r in list(self.sending) + [r for r in self.running if r.sender.poll() in TERMINAL]:
            state = r.sender.poll()
            if state not in TERMINAL:
                continue
            did = True
            (self.sending if r in self.sending else self.running).remove(r)
            self.runner.allocator.free(r.pages)
            if state == KVPoll.FAILED:
                log.warning("room %d: transfer failed: %s", r.req.room, r.sender.error)
                self._fail(r.req, f"KV transfer failed: {r.sender.error}", "transfer_failed")
        return did

    def _fail(self, req: GenerateRequest, message: str, code: str) -> None:
        self.channel.send(req.reply_to, TokenEvent(
            room=req.room, generation=req.generation, instance=self.inst.name, finish_reason="error",
            error=message, error_code=code, prompt_tokens=len(req.input_ids)))

    def load(self) -> LoadStats:
        a = self.runner.allocator
        return LoadStats(num_running=len(self.running), num_waiting=len(self.waiting),
                         num_transferring=len(self.sending), kv_pages_used=a.num_pages - a.num_free,
                         kv_pages_total=a.num_pages, page_size=self.runner.page_size)

    def close(self) -> None:
        super().close()
        self.transfer.close()
        self.bootstrap.close()


def main(cluster: ClusterConfig, instance_index: int = 0) -> int:
    return run_instance(PrefillLoop, cluster, "prefill", instance_index)
