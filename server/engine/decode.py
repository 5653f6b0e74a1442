"""Decode instance: page preallocation, adoption on commit, continuous-batching decode, token
streaming to the router (DESIGN §3 steps 2, 4).

Per request: allocate pages for prompt + max_new_tokens (few contiguous runs) -> create the KV
receiver for the room, pointing prefill's ranks at the prompt pages -> on SUCCESS read the
checked metadata row (first token), stream it, join the running batch -> one decode forward per
step for the whole batch -> finish on eos / stop token / length, free the pages. A failed or
timed-out transfer frees the pages (only once the transport says nothing can still land) and
sends the router an error event.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from glm53.models import ModelRunner, SeqChunk
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.scheduler import InstanceLoop, TrackedRequest, run_instance, transfer_error_code
from glm53.server.protocol import Abort, GenerateRequest, TokenEvent, TransferStats
from glm53.server.sampling import sample, step_generator
from glm53.transport.engine import TERMINAL, KVPoll, KVReceiver, Room, TransferError

log = logging.getLogger(__name__)


@dataclass
class DecodeRequest(TrackedRequest):
    receiver: KVReceiver | None = None
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # generated, not yet streamed
    aborted: bool = False
    transfer_started: float = 0.0  # receiver created
    bootstrapped: float = 0.0  # receiver left BOOTSTRAPPING: prefill reached, destination sent


class DecodeLoop(InstanceLoop):
    role = "decode"

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, runner: ModelRunner | None = None):
        super().__init__(cluster, inst, runner)
        self.stream_interval = inst.engine.stream_interval
        self.transfer.start()
        self.waiting: deque[DecodeRequest] = deque()  # no pages yet
        self.receiving: list[DecodeRequest] = []  # pages held, KV in flight
        self.running: list[DecodeRequest] = []  # adopted, decoding

    # -- intake ------------------------------------------------------------------------------
    def on_request(self, req: GenerateRequest) -> None:
        if self.accept(req, len(req.spec.input_ids) + req.spec.params.max_new_tokens):
            self.waiting.append(DecodeRequest(req, time.monotonic()))

    def on_abort(self, msg: Abort) -> None:
        key = (msg.room, msg.generation)
        for r in list(self.waiting):
            if r.key == key:
                self.waiting.remove(r)
        for r in list(self.running):
            if r.key == key:
                self.running.remove(r)
                self.runner.allocator.free(r.pages)
        for r in self.receiving:
            if r.key == key and not r.aborted:
                r.aborted = True  # pages are freed once the receiver reports a terminal state
                r.receiver.abort(f"aborted by router: {msg.reason}")

    # -- one engine step ---------------------------------------------------------------------
    def step(self) -> bool:
        self._admit()
        adopted = self._poll_transfers()
        decoded = self._decode()
        return adopted or decoded

    def _admit(self) -> None:
        while len(self.receiving) + len(self.running) < self.max_running:
            r = self.admit_next(self.waiting, lambda r: r.prompt_len + r.params.max_new_tokens)
            if r is None:
                return
            boot = f"tcp://{r.req.prefill.host}:{r.req.prefill.bootstrap_port}"
            r.transfer_started = time.monotonic()
            try:
                r.receiver = self.transfer.create_receiver(
                    Room(r.req.room, r.req.generation), boot, dst_pages=r.pages[: self.runner.pages_needed(r.prompt_len)]
                )
            except TransferError as e:  # e.g. a duplicate room: this request only, never the loop
                self.runner.allocator.free(r.pages)
                self.send_error(r.req, f"cannot receive KV: {e}", "overloaded")
                continue
            self.receiving.append(r)

    def _poll_transfers(self) -> bool:
        did = False
        for r in list(self.receiving):
            state = r.receiver.poll()
            if not r.bootstrapped and state != KVPoll.BOOTSTRAPPING:
                r.bootstrapped = time.monotonic()
            if state not in TERMINAL:
                continue
            did = True
            self.receiving.remove(r)
            if r.aborted:
                self.runner.allocator.free(r.pages)
            elif state == KVPoll.FAILED:
                self.runner.allocator.free(r.pages)
                self.send_error(r.req, f"KV transfer failed: {r.receiver.error}", transfer_error_code(r.receiver.error))
            else:
                self._adopt(r)
        return did

    def _adopt(self, r: DecodeRequest) -> None:
        row = r.receiver.metadata()
        stats = TransferStats(
            seconds=time.monotonic() - r.bootstrapped,
            bytes=self.runner.pages_needed(r.prompt_len) * self._bytes_per_page(),
            bootstrap_seconds=r.bootstrapped - r.transfer_started,
        )
        if r.params.max_new_tokens == 0:
            self._emit(r, [], "length", transfer=stats)
            self.runner.allocator.free(r.pages)
            return
        tok = int(row.first_token_ids[0])
        r.output.append(tok)
        reason = self._finish_reason(r, tok)
        self._emit(r, [tok], reason, transfer=stats)
        if reason is None:
            self.running.append(r)
        else:
            self.runner.allocator.free(r.pages)

    def _decode(self) -> bool:
        if not self.running:
            return False
        batch = self.running
        chunks = [SeqChunk([r.output[-1]], r.prompt_len + len(r.output) - 1, r.pages) for r in batch]
        logits = self.runner.forward(chunks)
        rows = torch.cat([lg[-1:] for lg in logits])
        params = [r.params for r in batch]
        gens = [step_generator(r.params.seed, len(r.output)) if r.params.seed is not None else None for r in batch]
        toks = sample(rows, params, gens).tolist()
        still = []
        for r, tok in zip(batch, toks):
            r.output.append(int(tok))
            r.unsent.append(int(tok))
            reason = self._finish_reason(r, int(tok))
            # Token events go out every `stream_interval` tokens (and always with the last one).
            if reason is not None or len(r.unsent) >= self.stream_interval:
                self._emit(r, r.unsent, reason)
                r.unsent = []
            if reason is None:
                still.append(r)
            else:
                self.runner.allocator.free(r.pages)
        self.running = still
        self.count_tokens(len(batch))
        return True

    def _finish_reason(self, r: DecodeRequest, tok: int) -> str | None:
        if tok in r.req.spec.stop_ids:
            return "stop"
        if len(r.output) >= r.params.max_new_tokens:
            return "length"
        return None

    def _emit(self, r: DecodeRequest, toks: list[int], reason: str | None, transfer: TransferStats | None = None) -> None:
        matched = toks[-1] if reason == "stop" and toks else None
        self.channel.send(r.req.reply_to, TokenEvent(
            room=r.req.room, generation=r.req.generation, instance=self.inst.name, token_ids=toks,
            finish_reason=reason, matched_stop=matched, prompt_tokens=r.prompt_len,
            completion_tokens=len(r.output), transfer=transfer))

    def _bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.runner.kv.buffers().values())

    def queue_sizes(self) -> tuple[int, int, int]:
        return len(self.running), len(self.waiting), len(self.receiving)

    def fail_all(self, message: str) -> None:
        for r in self.waiting:
            self.send_error(r.req, message, "internal")
        self.waiting.clear()
        for r in self.receiving:  # pages go back once the receiver is terminal
            if not r.aborted:
                r.aborted = True
                r.receiver.abort(message)
                self.send_error(r.req, message, "internal")
        for r in self.running:
            self.runner.allocator.free(r.pages)
            self.send_error(r.req, message, "internal")
        self.running = []


def main(cluster: ClusterConfig, instance_index: int = 0) -> int:
    return run_instance(DecodeLoop, cluster, "decode", instance_index)
