"""Decode scheduler: page preallocation, adoption on commit, continuous-batching decode, token
streaming to the router.

Per request: allocate pages for prompt + max_new_tokens (few contiguous runs) -> open the room's
KV receivers on every rank, pointing prefill's ranks at the prompt pages -> when every rank
succeeded, read the checked metadata row (first token), stream it, join the running batch ->
one decode forward per step for the whole batch -> finish on a stop token / eos / stop string /
length.

A request with n > 1 choices shares the prompt's full pages among its choices (decode writes
only from the prompt's end on, so nothing writes them) and gets, per choice, the pages from the
prompt's last (possibly partial) page to max_new_tokens. The prompt's KV lands in the shared
pages and the first choice's; on adoption each other choice gets a copy of the partial page
(inside this instance's pools) and its own first token from prefill: one prefill, n sequences
decoding side by side, each finishing on its own (its events carry its `index`). The shared
pages are freed with the last choice (`decode_request.SharedPages`).

One place decides a request is over (`_commit`: stop token, eos, stop string, length, and
max_new_tokens == 0 too) and one frees its pages (`_release`). Nothing after the token that ends
a request is committed, streamed or counted, however many tokens a speculative step accepted. A room
whose transfer is in flight is released only from `_poll_transfers`, once every rank's receiver
is terminal, so no write can land in reused pages.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque

import torch

from glm53.models import SeqChunk
from glm53.models.runner import DeviceTokens
from glm53.models.draft import DraftBlock
from glm53.models.readback import readback
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.constraints import Constraints, mask_block, masks
from glm53.server.engine.group import WorkerGroup
from glm53.server.engine.decode_request import DecodeRequest, SharedPages
from glm53.server.engine.scheduler import Scheduler, instance_by_index, protocol_error_code, run_instance
from glm53.server.protocol import Abort, GenerateRequest, TokenEvent, TransferStats
from glm53.server.engine.logprobs import rows_logprobs, unpack_first
from glm53.server.engine.mtp_seed import split_payload
from glm53.server.engine.overlap import InflightSpec, InflightStep, overlappable, spec_overlappable
from glm53.server.engine.spec import accept, draft_sampling, greedy_prefix, plain_greedy
from glm53.server.engine.stops import StopStrings
from glm53.server.sampling import sample, step_generator
from glm53.transport import TERMINAL, KVPoll, Room, TransferError

log = logging.getLogger(__name__)


class DecodeScheduler(Scheduler):
    role = "decode"

    def __init__(self, cluster: ClusterConfig, inst: InstanceConfig, workers: WorkerGroup | None = None):
        super().__init__(cluster, inst, workers)
        self.stream_interval = inst.engine.stream_interval
        # Tokens a speculative step verifies (the bonus slot included); None: plain decoding.
        self.block_size = self.workers.block_size
        asked = cluster.speculative.verify_width
        if self.block_size and asked:
            if asked > self.block_size:
                key = "num_draft_tokens" if cluster.speculative.num_draft_tokens else "dspark_block_size"
                raise SystemExit(f"{cluster.source}: speculative.{key}={asked} is larger than the "
                                 f"draft's block size {self.block_size}")
            self.block_size = asked
        # Batches larger than this verify one token a request, undrafted (None: never)
        self.spec_off_above = cluster.speculative.disable_by_batch_size
        # Seeds of unseeded sampled requests' drafted blocks (spec.draft_sampling).
        self.draft_rng = random.Random()
        self.spec_keys = itertools.count()
        # Sampled requests draft by sampling the draft's q (lossless and more accepted than its
        # argmax); False proposes the argmax instead (benchmarks/sampled_drafting.py compares them).
        self.sampled_drafting = True
        self.waiting: deque[DecodeRequest] = deque()  # no pages yet
        self.receiving: list[DecodeRequest] = []  # pages held, KV in flight
        self.running: list[DecodeRequest] = []  # adopted, decoding
        self.constraints = Constraints(cluster)
        self.stop_strings = StopStrings(cluster)
        # Overlapped plain decoding (engine/overlap.py): the step launched and not yet read back.
        self.overlap = self.workers.device_tokens and not self.block_size and not inst.engine.disable_overlap_schedule
        # Overlapped speculative decoding for greedy rows (engine/overlap.py): from graphs only.
        self.spec_overlap = bool(self.block_size) and self.workers.spec_overlap and \
            not inst.engine.disable_overlap_schedule
        self.inflight: InflightStep | InflightSpec | None = None

    # -- intake ------------------------------------------------------------------------------
    def on_request(self, req: GenerateRequest) -> None:
        if self.accept(req, len(req.spec.input_ids) + req.spec.params.max_new_tokens, pages=self._request_pages(req)):
            self.waiting.append(self.track(DecodeRequest(req, time.monotonic())))

    def _page_split(self, req: GenerateRequest) -> tuple[int, int]:
        """(the prompt's full pages, shared by the choices; each choice's own pages, from the
        prompt's partial last page to max_new_tokens)."""
        s = req.spec
        full = len(s.input_ids) // self.workers.page_size
        return full, self.workers.pages_needed(len(s.input_ids) + s.params.max_new_tokens) - full

    def _request_pages(self, req: GenerateRequest) -> int:
        """Pages a request takes: the prompt's full pages once, the rest per choice."""
        full, own = self._page_split(req)
        return full + req.spec.n * own

    def on_abort(self, msg: Abort) -> None:
        key = (msg.room, msg.generation)
        for r in list(self.waiting):
            if r.key == key:
                self.waiting.remove(r)
        for r in list(self.running):
            if r.key == key:
                self._release(r)
        for r in self.receiving:
            if r.key == key:
                self._abort_transfer(r, f"aborted by router: {msg.reason}")

    # -- one engine step ---------------------------------------------------------------------
    def step(self) -> bool:
        self._admit()
        adopted = self._poll_transfers()
        if adopted:
            # The adopted requests' first tokens leave now, not after this step's decode (with a
            # draft, a whole verify of the block): that step's time is no part of their TTFT.
            self.channel.flush()
        decoded = self._decode()
        return adopted or decoded

    def _admit(self) -> None:
        self.expire_queued(self.waiting, "decode's batch or KV pool is full")
        while len(self.receiving) + len(self.running) < self.max_running:
            # Every choice's pages, allocated together: the prompt's full pages, then each choice's
            # own (the first choice's own pages receive the prompt's partial last page).
            r = self.admit_next(self.waiting, lambda r: self._request_pages(r.req) * self.workers.page_size)
            if r is None:
                return
            boot = self.cluster.bootstrap_address_of(r.req.prefill)
            r.transfer_started = time.monotonic()
            try:
                r.receiver = self.workers.create_receivers(
                    Room(r.req.room, r.req.generation), boot, r.pages[: self.workers.pages_needed(r.prompt_len)])
            except TransferError as e:  # e.g. a duplicate room: this request only, never the loop
                self._release(r, error=(f"cannot receive KV: {e}", "overloaded"))
                continue
            self.receiving.append(r)
            self.admitted(r)

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
                self._release(r)
            elif state == KVPoll.FAILED:
                self._release(r, error=(f"KV transfer failed: {r.receiver.error}",
                                        protocol_error_code(r.receiver.error_code)))
            else:
                self._adopt(r)
        return did

    def _adopt(self, r: DecodeRequest) -> None:
        row = r.receiver.metadata()
        # The draft's context for the prompt came with the KV (counts[1] = positions sent), or
        # decode builds it from its own verify steps, starting after the prompt.
        draft_sent = len(row.counts) >= 2 and row.counts[1] >= r.prompt_len
        if not draft_sent:
            r.ctx_start = r.prompt_len
        per_page = self.workers.bytes_per_page - (0 if draft_sent else self.workers.draft_bytes_per_page)
        stats = TransferStats(
            seconds=time.monotonic() - r.bootstrapped,
            bytes=self.workers.pages_needed(r.prompt_len) * per_page,
            bootstrap_seconds=r.bootstrapped - r.transfer_started,
        )
        n = r.req.spec.n
        if len(row.first_token_ids) != n:
            self._release(r, error=(f"prefill sent {len(row.first_token_ids)} first tokens for n={n}", "internal"))
            return
        # NEXTN with the draft KV sent: the prompt's last hidden row heads the payload (the MTP's
        # seed: the first step drafts from it, every choice from the same row).
        seed, rest = split_payload(row.counts, bytes(row.payload))
        r.seed_hidden = seed if r.ctx_start == 0 else None
        lps, tops = unpack_first(rest) if r.req.spec.logprobs >= 0 else (None, None)
        seqs = [r]
        if n > 1:
            full, own = self._page_split(r.req)
            shared = SharedPages(r.pages[:full], users=n)
            pages = r.pages
            r.pages, r.shared = pages[: full + own], shared
            for i in range(1, n):
                c = DecodeRequest(r.req, r.arrived, pages=shared.pages + pages[full + i * own: full + (i + 1) * own],
                                  ctx_start=r.ctx_start, index=i, shared=shared, seed_hidden=r.seed_hidden)
                # Each choice writes its own pages from the prompt's end on: a copy of the
                # prompt's partial last page gives it the rest of the prefill's context.
                if r.prompt_len % self.workers.page_size:
                    self.workers.copy_pages(r.pages[full:full + 1], c.pages[full:full + 1])
                seqs.append(c)
        for c in seqs:
            c.constraint = self.constraints.new(c.params)
            c.stops = self.stop_strings.new(c.params)
            tok = [int(row.first_token_ids[c.index])]
            if lps is None:
                self._commit(c, tok, transfer=stats if c.index == 0 else None, first=True)
            else:
                self._commit(c, tok, [lps[c.index]], [tops[c.index]], transfer=stats if c.index == 0 else None,
                             first=True)

    def _batch_logprobs(self, batch: list[DecodeRequest], rows: torch.Tensor,
                        toks: list[int]) -> list[tuple[list[float], list[list]] | None]:
        """A plain decode step's logprobs: one log_softmax over the rows of the requests that
        asked (each keeps its own number of top logprobs); None for the others."""
        want = [i for i, r in enumerate(batch) if r.req.spec.logprobs >= 0]
        out: list[tuple[list[float], list[list]] | None] = [None] * len(batch)
        if not want:
            return out
        top = max(batch[i].req.spec.logprobs for i in want)
        lps, tops = rows_logprobs(rows[torch.tensor(want, device=rows.device)], [toks[i] for i in want], top)
        for i, lp, tp in zip(want, lps, tops):
            out[i] = ([lp], [tp[: batch[i].req.spec.logprobs]])
        return out

    def _decode(self) -> bool:
        if self.block_size:
            return self._decode_speculative()
        if self.overlap and self.running and all(overlappable(r) for r in self.running):
            return self._decode_overlapped()
        drained = self._drain()
        if not self.running:
            return drained
        batch = list(self.running)
        chunks = [SeqChunk([r.output[-1]], r.prompt_len + len(r.output) - 1, r.pages) for r in batch]
        logits = self.workers.forward(chunks)
        rows = torch.cat([lg[-1:] for lg in logits])
        params = [r.params for r in batch]
        gens = [step_generator(r.params.seed, len(r.output), choice=r.index) if r.params.seed is not None else None
                for r in batch]
        toks = readback(sample(rows, params, gens, [r.history(rows.device) for r in batch],
                               allowed=masks([r.constraint for r in batch], rows.shape[-1]))).tolist()
        lps = self._batch_logprobs(batch, rows, toks)
        for r, tok, lp in zip(batch, toks, lps):
            self._commit(r, [int(tok)], *(lp or (None, None)))
        self.count_tokens(len(batch))
        return True

    def _decode_overlapped(self) -> bool:
        """Launch the next plain step, then read back and commit the one before it."""
        prev, self.inflight = self.inflight, None
        # A row whose launched steps already reach max_new_tokens needs no more.
        batch = [r for r in self.running if len(r.output) + r.pending < r.params.max_new_tokens]
        if batch:
            rows = prev.row_of() if prev is not None else {}
            chunks, src, dst = [], [], []
            for i, r in enumerate(batch):
                if r.pending:  # its input is prev's sample for it, still on the device
                    src.append(rows[id(r)])
                    dst.append(i)
                chunks.append(SeqChunk([0 if r.pending else r.output[-1]], r.prompt_len + len(r.output) + r.pending - 1,
                                       r.pages))
            tokens = DeviceTokens(prev.tokens, src, dst) if src else None
            # the samples are queued at once: the rows may be the graph's output, which the
            # next step's replay overwrites
            self.inflight = InflightStep.launch(batch, self.workers.forward_decode(chunks, tokens))
            for r in batch:
                r.pending += 1
        if prev is not None:
            self._resolve(prev)
        return True

    def _drain(self) -> bool:
        """Read back and commit the in-flight step, if any (before a synchronous step)."""
        step, self.inflight = self.inflight, None
        if step is None:
            return False
        if isinstance(step, InflightSpec):
            self._resolve_spec(step)
        else:
            self._resolve(step)
        return True

    def _resolve(self, step: InflightStep) -> None:
        """Commit an overlapped step's tokens (rows released since it launched drop theirs);
        then free the pages of released rows that no step in flight still writes."""
        toks = step.result()
        n = 0
        for r, tok in zip(step.batch, toks):
            r.pending -= 1
            if not r.finished:
                self._commit(r, [tok])
                n += 1
        self._free_after(step)
        self.count_tokens(n)

    def _free_after(self, step: InflightStep | InflightSpec) -> None:
        """Free the pages of `step`'s released rows that no step in flight still writes."""
        for r in step.batch:
            if r.free_after_step and not (self.inflight is not None and self.inflight.holds(r)):
                r.free_after_step = False
                self._free_pages(r)

    def _decode_speculative(self) -> bool:
        """One DFlash step for the whole batch: the draft proposes, the target verifies every
        request's block in one forward, each request commits its accepted prefix + one token.
        Overlapped when the graphs hold the batch and every row is plain greedy."""
        if self.spec_overlap and self.running and all(spec_overlappable(r) for r in self.running):
            if self._speculate_overlapped():
                return True
        drained = self._drain()
        if not self.running:
            return drained
        batch = list(self.running)
        blocks = self._blocks(batch)
        out = self.workers.spec_step(blocks)
        greedy = out.greedy or [None] * len(batch)
        probs = out.probs or [None] * len(batch)
        n_out = 0
        for r, d, lg, am, q in zip(batch, out.drafts, out.logits, greedy, probs):
            if am is not None and plain_greedy(r):
                toks = greedy_prefix(d, am)  # what `accept` returns for it, without its checks
            else:
                # Structured output masks the verify rows; logprobs stay those of the raw logits.
                masked = mask_block(r.constraint, d, lg) if r.constraint is not None else lg
                toks = accept(d, masked, r.params, first_step=len(r.output), history=r.history(lg.device),
                              choice=r.index, argmax=am if r.constraint is None else None, q=q)
            # The target's logprobs of the accepted tokens: verify row i produced token i.
            k = r.req.spec.logprobs
            lp = rows_logprobs(lg[: len(toks)], toks, k) if k >= 0 else None
            n_out += self._commit(r, toks, *(lp or (None, None)), verified=True)
        self.count_tokens(n_out)
        return True

    def _blocks(self, batch: list[DecodeRequest]) -> list[DraftBlock]:
        """Each request's next draft block, from what it has committed; blocks of one (no drafting,
        the verify still writes the draft's context) when the batch is above `disable_by_batch_size`."""
        blocks = []
        width = 1 if self.spec_off_above is not None and len(batch) > self.spec_off_above else self.block_size
        for r in batch:
            out_len = len(r.output)
            params = r.params
            # Never verify past max_new_tokens: a block of n commits at most n tokens, so its
            # positions stay inside the pages allocated for prompt + max_new_tokens.
            n = min(width, params.max_new_tokens - out_len)
            if r.spec_key < 0:
                r.spec_key = next(self.spec_keys)
            # The MTP's seed drives the request's first step only (position prompt_len − 1).
            seed = r.seed_hidden if out_len == 1 else None
            r.seed_hidden = None
            blocks.append(DraftBlock(last_token=r.output[-1], start_pos=r.prompt_len + out_len - 1, page_table=r.pages,
                                     ctx_start=r.ctx_start, block_size=n, key=r.spec_key, seed_hidden=seed,
                                     sampling=draft_sampling(params, out_len, r.index, self.draft_rng)
                                     if self.sampled_drafting and not params.greedy else None,
                                     end_pos=r.prompt_len + params.max_new_tokens))
        return blocks

    def _speculate_overlapped(self) -> bool:
        """Launch the next speculative step, then read back and commit the one before it. The
        next step runs on the rows the last one left on the device when the batch is the same
        (a join, a finish or an abort changes it: drain, then launch from the host's rows).
        False: no graph holds the batch (nothing launched; the caller runs the step)."""
        prev = self.inflight
        batch = list(self.running)
        # Chain only while some row surely outlives `prev` (it commits at most k tokens): a row
        # that prev may end by length would spend a whole step whose result is dropped.
        if isinstance(prev, InflightSpec) and prev.same_batch(batch) and \
                any(len(r.output) + prev.k < r.params.max_new_tokens for r in batch):
            k = prev.k
            ends = [r.prompt_len + r.params.max_new_tokens for r in batch]
            starts = [min(s + k, e - 1) for s, e in zip(prev.starts, ends)]
            tokens = self.workers.spec_relaunch(len(batch), max(min(s + k, e) for s, e in zip(starts, ends)))
            if tokens is not None:
                self.inflight = InflightSpec.launch(batch, tokens, starts)
                self._resolve_spec(prev)
                return True
        self._drain()
        batch = list(self.running)
        if not batch:
            return True
        blocks = self._blocks(batch)
        tokens = self.workers.spec_launch(blocks)
        if tokens is None:
            return False
        self.inflight = InflightSpec.launch(batch, tokens, [b.start_pos for b in blocks])
        return True

    def _resolve_spec(self, step: InflightSpec) -> None:
        """Commit an overlapped speculative step's accepted tokens (rows released since it
        launched drop theirs), then free what no step in flight still writes."""
        n_out = 0
        for r, toks in zip(step.batch, step.result()):
            if not r.finished:
                n_out += self._commit(r, toks, verified=True)
        self._free_after(step)
        self.count_tokens(n_out)

    # -- the one place a request finishes, the one place it is released -------------------
    def _commit(self, r: DecodeRequest, toks: list[int], lps: list[float] | None = None,
                tops: list[list] | None = None, transfer: TransferStats | None = None, first: bool = False,
                verified: bool = False) -> int:
        """Commit generated tokens in order, stopping at the first that ends the request (nothing
        past it is committed, streamed or counted); stream them (token events go out every
        `stream_interval` tokens, with the first token, and always with the last). `verified`:
        the tokens are one speculative step's accepted run (its committed count is reported).
        Returns how many were committed."""
        reason, matched, n = None, None, 0
        rest = toks  # committed one at a time below
        if len(r.output) >= r.params.max_new_tokens:  # max_new_tokens == 0: prefill's token is not output
            reason, rest = "length", ()
        elif r.stops is None and lps is None:
            # No stop strings, no logprobs: the same decision as `_finish` token by token, by
            # slices (a verify commits several tokens; this is the common case).
            n, reason, matched = self._ending(r, toks)
            r.output.extend(toks[:n])
            r.unsent.extend(toks[:n])
            rest = ()
        for j, tok in enumerate(rest):
            r.output.append(tok)
            r.unsent.append(tok)
            if lps is not None:
                r.unsent_lp.append(lps[j])
                r.unsent_top.append(tops[j])
            n += 1
            reason, matched = self._finish(r, tok)
            if reason is not None:
                break
        if r.constraint is not None:
            r.constraint.advance(toks[:n])
        if verified:
            r.accepts.append(n)
        if first or reason is not None or len(r.unsent) >= self.stream_interval:
            self._emit(r, r.unsent, reason, matched, transfer=transfer)
            r.unsent, r.unsent_lp, r.unsent_top = [], [], []
        if reason is not None:
            self._release(r)
        elif first:
            self.running.append(r)
        return n

    @staticmethod
    def _ending(r: DecodeRequest, toks: list[int]) -> tuple[int, str | None, int | None]:
        """For a request without stop strings: how many of `toks` it commits and why it ends
        there ((n, None, None): it goes on), as `_finish` decides after each token."""
        room = r.params.max_new_tokens - len(r.output)
        head = toks[:room]
        stops = r.stop_set
        if not stops.isdisjoint(head):
            for j, tok in enumerate(head):
                if tok in stops:
                    return j + 1, "stop", tok
        n = len(head)
        return n, ("length" if n == room else None), None

    @staticmethod
    def _finish(r: DecodeRequest, tok: int) -> tuple[str | None, int | str | None]:
        """Whether the just-committed `tok` ends the request: (finish reason, what matched)."""
        if tok in r.stop_set:  # a stop token or eos; its text is never shown, so never matched
            return "stop", tok
        if r.stops is not None and (s := r.stops.add(tok)) is not None:
            return "stop", s
        if len(r.output) >= r.params.max_new_tokens:
            if r.stops is not None and (s := r.stops.end()) is not None:
                return "stop", s
            return "length", None
        return None, None

    def _release(self, r: DecodeRequest, error: tuple[str, str] | None = None) -> None:
        """End a request whose pages no transfer can still write: out of the batch, pages freed,
        and for a failure the router told (`error` = (message, protocol error code))."""
        if r in self.running:
            self.running.remove(r)
        r.finished = True
        if self.inflight is not None and self.inflight.holds(r):
            r.free_after_step = True  # the step in flight still writes them (engine/overlap.py)
        else:
            self._free_pages(r)
        if error is not None:
            self.send_error(r.req, *error)

    def _free_pages(self, r: DecodeRequest) -> None:
        if r.shared is None:
            self.allocator.free(r.pages)
        else:  # its own pages now; the shared ones with the last choice
            self.allocator.free(r.pages[len(r.shared.pages):])
            r.shared.users -= 1
            if r.shared.users == 0:
                self.allocator.free(r.shared.pages)
            r.shared = None
        r.pages = []

    def _abort_transfer(self, r: DecodeRequest, reason: str) -> None:
        if not r.aborted:
            r.aborted = True  # pages are freed once every rank's receiver is terminal
            r.receiver.abort(reason)

    def _emit(self, r: DecodeRequest, toks: list[int], reason: str | None, matched: int | str | None = None,
              transfer: TransferStats | None = None) -> None:
        self.channel.send(r.req.reply_to, TokenEvent(
            room=r.req.room, generation=r.req.generation, instance=self.inst.name, token_ids=toks,
            finish_reason=reason, matched_stop=matched, prompt_tokens=r.prompt_len,
            completion_tokens=len(r.output), transfer=transfer, spec_accept=r.accepts, index=r.index,
            logprobs=list(r.unsent_lp), top_logprobs=list(r.unsent_top)))
        r.accepts = []

    def queue_sizes(self) -> tuple[int, int, int]:
        return len(self.running), len(self.waiting), len(self.receiving)

    def fail_all(self, message: str) -> None:
        step, self.inflight = self.inflight, None
        if step is not None:  # its rows' pages are freed below, once nothing writes them
            try:
                step.result()
            except Exception:  # the step itself failed: nothing of it is read
                log.exception("%s: the in-flight decode step failed", self.inst.name)
            for r in step.batch:
                if r.free_after_step:
                    r.free_after_step = False
                    self._free_pages(r)
        for r in self.waiting:
            self.send_error(r.req, message, "internal")
        self.waiting.clear()
        for r in self.receiving:
            if not r.aborted:
                self.send_error(r.req, message, "internal")
            self._abort_transfer(r, message)
        for r in list(self.running):
            self._release(r, error=(message, "internal"))

    def abandon(self) -> None:
        self.inflight = None
        self.waiting.clear()
        self.receiving.clear()
        self.running.clear()


def main(cluster: ClusterConfig, instance_index: int = 0) -> int:
    """A decode instance alone in its process. `glm53-serve decode` (cli.py) runs one that a prefill
    instance colocates with as the pair instead (engine/colocate.py, which imports this module)."""
    inst = instance_by_index(cluster, "decode", instance_index)
    partner = cluster.colocated_prefill(inst)
    if partner is not None:
        raise SystemExit(f"decode instance {inst.name} shares its process with prefill instance {partner.name} "
                         f"(colocate): start the pair with run_colocated (engine/colocate.py)")
    return run_instance(DecodeScheduler, cluster, "decode", instance_index)
