"""Prefill scheduler: intake over ZMQ, chunked-prefill batching, first-token sampling, and KV
transfer of each chunk's completed pages as soon as its forward pass is done.

Per request: admit (the longest cached prefix's pages from the prefix cache, locked, and new
pages for the rest; open the room's KV senders on every rank) -> prefill the rest in chunks under
a per-step token budget -> sample the first token of each of the request's n
choices -> `finish` with the metadata row (the commit record: the n first tokens and, when asked
for, their logprobs) -> when the senders of every rank are terminal, free the pages (only in
`_reap`, which also unlocks its cached prefix; the prompt's full pages, offered to the prefix
cache when its forward is done, stay there if the cache took them). A failed transfer is
reported to the router as an error event for the room. A request asking for prompt logprobs
gets every position's logits, reduced chunk by chunk (logprobs.py), and sends them to the router
before the commit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from glm53.models import OutOfPages, SeqChunk
from glm53.models.readback import readback
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.constraints import Constraints
from glm53.server.engine.group import WorkerGroup
from glm53.server.engine.scheduler import (Scheduler, TrackedRequest, instance_by_index, protocol_error_code,
                                           run_instance)
from glm53.server.engine.logprobs import PromptLogprobs, pack_first, rows_logprobs
from glm53.server.engine.mtp_seed import pack_seed
from glm53.server.engine.prefix_cache import CacheLock, PrefixCache
from glm53.server.protocol import Abort, GenerateRequest, TokenEvent
from glm53.server.sampling import TokenHistory, sample, step_generator
from glm53.transport import TERMINAL, BootstrapServer, KVPoll, MetadataRow, Room, RoomTransfer, TransferError

log = logging.getLogger(__name__)


@dataclass
class PrefillRequest(TrackedRequest):
    sender: RoomTransfer | None = None  # the room's senders on every rank
    done_tokens: int = 0  # prompt tokens already in the cache
    sent_pages: int = 0  # pages already handed to the sender
    prompt_lp: PromptLogprobs | None = field(default=None)  # asked for prompt logprobs
    cached: int = 0  # leading pages of `pages` that are the prefix cache's (locked in `lock`)
    lock: CacheLock | None = None
    taken: set[int] = field(default_factory=set)  # own pages the prefix cache took


class PrefillScheduler(Scheduler):
    role = "prefill"

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, workers: WorkerGroup | None = None,
                 weights_from: WorkerGroup | None = None):
        # Up before the ranks: each registers with it while it starts.
        self.bootstrap = BootstrapServer(inst.name, pp_size=inst.pp, tp_size=inst.tp, address=inst.bootstrap_address)
        super().__init__(cluster, inst, workers, weights_from)
        self.budget = inst.engine.chunked_prefill_size
        self.constraints = Constraints(cluster)  # structured output: the first token's mask
        self.waiting: deque[PrefillRequest] = deque()
        self.running: list[PrefillRequest] = []  # prefilling, in arrival order
        self.sending: list[PrefillRequest] = []  # prefill done, transfer in flight
        self.cache = None if inst.engine.disable_radix_cache else PrefixCache(self.workers.page_size)

    # -- intake ------------------------------------------------------------------------------
    def on_request(self, req: GenerateRequest) -> None:
        if self.accept(req, len(req.spec.input_ids)):
            r = self.track(PrefillRequest(req, time.monotonic()))
            spec = req.spec
            if spec.prompt_logprobs_start >= 0:
                r.prompt_lp = PromptLogprobs(spec.input_ids, spec.prompt_logprobs_start, max(0, spec.logprobs))
            self.waiting.append(r)

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
        """Admit queued requests (pages, senders) only as far as the next step's micro-batches
        will start computing them: an admitted request's transfer clock runs (decode's, from
        ACCEPTED), so waiting behind other prompts must happen here, in the queue, not there."""
        self.expire_queued(self.waiting, "prefill is busy with the requests ahead of it")
        while len(self.running) < self.max_running and self._unstarted() < self.budget * self.workers.pp:
            r = self.admit_next(self.waiting, lambda r: r.prompt_len)
            if r is None:
                return
            try:
                r.sender = self.workers.create_senders(Room(r.req.room, r.req.generation), r.req.decode.name)
            except TransferError as e:  # e.g. a duplicate room: this request only, never the loop
                self._free(r)
                self.send_error(r.req, f"cannot send KV: {e}", "overloaded")
                continue
            self.running.append(r)
            # The router's transfer clock starts here; it also reports the cached prompt tokens
            # (usage.prompt_tokens_details.cached_tokens, meta_info).
            self.admitted(r, cached_tokens=r.done_tokens if r.cached else 0)

    def _unstarted(self) -> int:
        """Prompt tokens of the running requests not computed yet."""
        return sum(r.prompt_len - r.done_tokens for r in self.running)

    def allocate(self, r: PrefillRequest, tokens: int) -> list[int]:
        """The cached prefix's pages (locked), then new pages for the rest of the prompt. At
        least the last prompt token is computed: its logits give the first token. A request
        asking for prompt logprobs needs every position's logits, so it matches nothing."""
        need = self.workers.pages_needed(tokens)
        if self.cache is None:
            return self._alloc(need)
        ids, ps = r.req.spec.input_ids, self.workers.page_size
        cached, lock = self.cache.match(ids, 0 if r.prompt_lp is not None else (len(ids) - 1) // ps,
                                        r.req.spec.cache_salt)
        try:
            own = self._alloc(need - len(cached))
        except OutOfPages:
            self.cache.release(lock)
            raise
        r.cached, r.lock, r.done_tokens = len(cached), lock, len(cached) * ps
        return cached + own

    def _alloc(self, n: int) -> list[int]:
        """n new pages, evicting unlocked cached pages when the free ones do not suffice."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None and short <= self.cache.evictable:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    def _free(self, r: PrefillRequest) -> None:
        """The one place a request's pages go back: its own, less what the cache took; its lock."""
        if r.lock is not None:
            self.cache.release(r.lock)
            r.lock = None
        self.allocator.free([p for p in r.pages[r.cached:] if p not in r.taken])

    def free_pages(self) -> int:
        return self.allocator.num_free + (self.cache.evictable if self.cache is not None else 0)

    def _plan(self) -> tuple[list[list[SeqChunk]], list[list[PrefillRequest]]]:
        """This step's micro-batches, each under the chunked-prefill token budget: one per
        pipeline stage, so that a long prompt's consecutive chunks keep every stage busy (with
        one stage, one micro-batch: plain chunked prefill)."""
        planned = {id(r): r.done_tokens for r in self.running}
        microbatches, owners = [], []
        for _ in range(self.workers.pp):
            budget, chunks, own = self.budget, [], []
            for r in self.running:
                done = planned[id(r)]
                n = min(budget, r.prompt_len - done)
                if n <= 0:
                    continue
                chunks.append(SeqChunk(r.req.spec.input_ids[done : done + n], done, r.pages,
                                       all_logits=r.prompt_lp is not None))
                own.append(r)
                planned[id(r)] = done + n
                budget -= n
                if budget <= 0:
                    break
            if not chunks:
                break
            microbatches.append(chunks)
            owners.append(own)
        return microbatches, owners

    def _prefill_chunk(self) -> bool:
        microbatches, owners = self._plan()
        if not microbatches:
            return False
        logits = self.workers.forward_microbatches(microbatches)
        finished = []
        for chunks, own, lgs in zip(microbatches, owners, logits):
            self.count_tokens(sum(len(c.token_ids) for c in chunks))
            # With NEXTN, each chunk's last final-normed hidden row (runner.ChunkLogits).
            hidden = getattr(lgs, "last_hidden", None) if self.workers.sends_draft_kv else None
            for j, (r, c, lg) in enumerate(zip(own, chunks, lgs)):
                if r.prompt_lp is not None:  # reduced now: no [chunk, V] outlives this loop
                    r.prompt_lp.add_chunk(lg, c.start_pos)
                r.done_tokens += len(c.token_ids)
                last = r.done_tokens == r.prompt_len
                # Completed pages travel now; the last (partial) page goes with the last chunk.
                full = len(r.pages) if last else r.done_tokens // self.workers.page_size
                if r.sender.poll() not in TERMINAL and full > r.sent_pages:
                    r.sender.send_pages(r.pages[r.sent_pages : full], start=r.sent_pages)
                    r.sent_pages = full
                if last:
                    finished.append((r, lg[-1], hidden[j] if hidden is not None else None))
                    if r.lock is not None:  # its full pages now hold the prompt's KV: offer them
                        full_pages = r.prompt_len // self.workers.page_size
                        r.taken = self.cache.insert(r.req.spec.input_ids, r.pages[:full_pages], r.lock,
                                                    r.req.spec.cache_salt)
        if finished:
            self._first_tokens(finished)
        return True

    def _first_tokens(self, finished: list[tuple[PrefillRequest, torch.Tensor, torch.Tensor | None]]) -> None:
        """Sample each finished request's first token for every one of its n choices (choice i
        seeded by step_generator(seed, 0, choice=i)), send prompt logprobs, commit the KV (with
        NEXTN, the MTP's seed: the prompt's last hidden row, engine/mtp_seed.py)."""
        rows, params, gens, hists = [], [], [], []
        for r, lg, _ in finished:
            spec = r.req.spec
            hist = TokenHistory(spec.input_ids, [], sorted(spec.stop_ids)) if r.params.adjusts else None
            for i in range(spec.n):
                rows.append(lg)
                params.append(r.params)
                gens.append(step_generator(r.params.seed, 0, choice=i) if r.params.seed is not None else None)
                hists.append(hist)
        logits = torch.stack(rows)
        allowed = self.constraints.first_masks(params, logits.shape[-1])
        first = readback(sample(logits, params, gens, hists, allowed=allowed)).tolist()
        k = 0
        for r, _, seed in finished:
            spec = r.req.spec
            toks, rows_r = first[k: k + spec.n], logits[k: k + spec.n]
            k += spec.n
            self.running.remove(r)
            self.sending.append(r)
            if r.sender.poll() in TERMINAL:
                continue
            payload = b""
            if spec.logprobs >= 0:
                lps, tops = rows_logprobs(rows_r, toks, spec.logprobs)
                payload = pack_first(lps, [[(i, v) for i, v in t] for t in tops])
            if r.prompt_lp is not None:
                self.channel.send(r.req.reply_to, TokenEvent(
                    room=r.req.room, generation=r.req.generation, instance=self.inst.name,
                    prompt_tokens=r.prompt_len, prompt_logprobs=r.prompt_lp.logprobs,
                    prompt_top_logprobs=r.prompt_lp.tops))
                r.prompt_lp = None
            # counts: prompt tokens, and draft-context positions sent with them.
            draft_ctx = r.prompt_len if self.workers.sends_draft_kv else 0
            counts = (r.prompt_len, draft_ctx)
            if seed is not None:  # the MTP's seed heads the payload (engine/mtp_seed.py)
                raw, code = pack_seed(seed)
                counts, payload = (r.prompt_len, draft_ctx, len(raw), code), raw + payload
            r.sender.finish(MetadataRow(first_token_ids=tuple(int(t) for t in toks), counts=counts, payload=payload))

    def _reap(self) -> bool:
        """Free the pages of requests whose transfer reached a terminal state."""
        did = False
        for r in list(self.sending) + [r for r in self.running if r.sender.poll() in TERMINAL]:
            state = r.sender.poll()
            if state not in TERMINAL:
                continue
            did = True
            (self.sending if r in self.sending else self.running).remove(r)
            self._free(r)
            if state == KVPoll.FAILED:
                log.warning("room %d: transfer failed: %s", r.req.room, r.sender.error)
                self.send_error(r.req, f"KV transfer failed: {r.sender.error}", protocol_error_code(r.sender.error_code))
        return did

    def queue_sizes(self) -> tuple[int, int, int]:
        return len(self.running), len(self.waiting), len(self.sending)

    def fail_all(self, message: str) -> None:
        for r in self.waiting:
            self.send_error(r.req, message, "internal")
        self.waiting.clear()
        for r in self.running:  # their pages go back once the sender is terminal (_reap)
            self.send_error(r.req, message, "internal")
            r.sender.abort(message)
            self.sending.append(r)
        self.running = []

    def abandon(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self.sending.clear()
        if self.cache is not None:  # the allocator starts over: no page is the cache's any more
            self.cache.clear()

    def close(self) -> None:
        super().close()
        self.bootstrap.close()


def main(cluster: ClusterConfig, instance_index: int = 0) -> int:
    inst = instance_by_index(cluster, "prefill", instance_index)
    if inst.colocate is not None:
        raise SystemExit(f"prefill instance {inst.name} runs in decode instance {inst.colocate}'s process "
                         f"(colocate): start that one")
    return run_instance(PrefillScheduler, cluster, "prefill", instance_index)
