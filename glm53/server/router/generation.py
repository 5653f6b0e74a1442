"""One generation: a RequestSpec in, text deltas and one outcome out (no HTTP here).

`Generation` submits the spec to an instance pair, retries on another prefill instance while no
token has come back, turns decode's token events into text (incremental detokenization; a
matched stop string cut from the text, or kept with no_stop_trim), records the request's metrics
and aborts the room on both instances when it ends early (the client went away, a failure).
Failures surface as APIError with the status the client sees.

Decode alone decides that a choice is over (stop token, eos, stop string, length): the router
never ends one and never sees a token after the one that ended it. Its stop-string matcher,
the same class decode matches with, only formats: it holds back text that may begin a stop
string and cuts the text where the match begins.

A spec with n > 1 is one room with n choices (one prefill, n decode sequences): each choice has
its own detokenizer, stop-string formatting, Deltas and Outcome (`index`), and the room ends when
every choice has. Logprobs ride on the Deltas with the token ids they belong to; prompt logprobs
(from prefill) are on the Generation before its first Delta is yielded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from glm53.server.config import ClusterConfig
from glm53.server.protocol import RequestSpec
from glm53.server.router.admission import AdmissionQueue, QueueRefused
from glm53.server.router.instance_pool import InstancePool, Placement, RoomFailed, Unavailable
from glm53.server.router.metrics import RouterMetrics
from glm53.server.router.offload import Offload
from glm53.server.router.schemas import APIError
from glm53.server.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

log = logging.getLogger(__name__)

# Error codes from instances / the pool -> HTTP status of the error body.
_STATUS_FOR_CODE = {"context_length": 400, "bad_request": 400, "timeout": 504, "bootstrap_timeout": 504,
                    "transfer_timeout": 504}
# Failures a retry on another prefill instance cannot help: the queue bound is spent, or the
# router is stopping.
_NO_RETRY = ("overloaded", "shutdown")


@dataclass
class Delta:
    """New text and the token ids it came from (a stop token is among the ids, not the text:
    `shown` counts the ids the text shows), for choice `index`; with logprobs asked for, one
    logprob and one list of top [id, logprob] pairs per id."""

    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list] | None = None
    shown: int | None = None  # None: all of token_ids
    # The request's running counts when this Delta went out (SGLang's streamed meta_info).
    cached_tokens: int = 0
    spec_verify_ct: int = 0

    @property
    def shown_ids(self) -> list[int]:
        return self.token_ids if self.shown is None else self.token_ids[: self.shown]


@dataclass
class Outcome:
    """How a generation ended, with its token counts."""

    finish_reason: str
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # speculative verify forwards the request took (0: none)
    index: int = 0  # the choice

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": 0}}


def total_usage(outcomes: list[Outcome], prompt_tokens: int) -> dict[str, Any]:
    """Usage of several choices (and prompts): `prompt_tokens` once, completions summed."""
    done = sum(o.completion_tokens for o in outcomes)
    return Outcome("stop", None, prompt_tokens, done, max((o.cached_tokens for o in outcomes), default=0)).usage()


@dataclass
class RouterState:
    """What every handler needs, built once by create_app and kept on `app.state.router`."""

    cfg: ClusterConfig
    tokenizer: Tokenizer
    pool: InstancePool
    metrics: RouterMetrics
    served_names: list[str]
    model_root: str
    context_length: int
    offload: Offload  # worker threads for parsing, templating and (de)tokenizing
    grammars: Any = None  # structured output: the compiled-grammar cache, built on first use (structured.py)
    created: int = field(default_factory=lambda: int(time.time()))
    admission: AdmissionQueue = field(init=False)  # the admission queue in front of the pool

    def __post_init__(self) -> None:
        self.admission = AdmissionQueue(self.pool, self.cfg.router, self.metrics)

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Stop serving at once (SIGTERM/SIGINT): queued requests get a 503, every room in flight
        fails, so streams end with an error event and [DONE] instead of being cut."""
        self.admission.close(reason)
        self.pool.shutdown(reason)


class Generation:
    """One request in flight, on `room` (placed by the admission queue: `admit`); `deferred`, the
    queue places it when `events()` starts (the rest of a batch: `start_all`); with neither,
    construction submits it at once, past the queue (health checks; APIError 503 if no instance
    pair can take it). `events()` yields Deltas then one Outcome, or raises APIError mid-way.
    `cancel()` (also run when `events()` is closed early, e.g. the client went away) aborts the
    room on both instances; it is idempotent."""

    def __init__(self, state: RouterState, spec: RequestSpec, room: Placement | None = None,
                 deferred: bool = False):
        self.state, self.spec = state, spec
        self.t0 = time.monotonic()
        self.room: Placement | None = None
        self._open = False
        self.failed_prefills: set[str] = set()
        # Prompt logprobs (spec.prompt_logprobs_start >= 0), from prefill's event.
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list] | None = None
        self._deferred = deferred  # placed by the admission queue when `events()` starts
        if room is not None or deferred:
            self.room = room
            if room is None:
                return
        else:
            try:
                self.room = state.pool.submit(spec)
            except Unavailable as e:
                raise APIError(503, str(e)) from None
        self._open = True
        state.metrics.router_running.labels(state.metrics.model_name).inc()

    async def _next_event(self):
        """The room's next event; before the first token, a prefill-side failure is retried on
        another prefill instance (router.max_retries times)."""
        assert self.room is not None
        while True:
            try:
                return await self.state.pool.next_event(self.room)
            except RoomFailed as e:
                room = self.room
                if (e.side != "prefill" or room.got_first_token or e.code in _NO_RETRY
                        or room.generation >= self.state.cfg.router.max_retries):
                    raise
                if e.code != "instance_restarted":  # a restarted one is a new process: it may take it
                    self.failed_prefills.add(room.prefill.name)
                try:
                    new = self.state.pool.submit(self.spec, frozenset(self.failed_prefills), room.generation + 1)
                except Unavailable:
                    log.warning("router: %s: %s; no other prefill instance to retry on", self.spec.rid, e)
                    raise e from None
                log.warning("router: %s: %s; retrying on another prefill instance (%s)", self.spec.rid, e,
                            new.prefill.name)
                self.state.pool.release(room, abort=True)
                self.room = new

    def _close(self, abort: bool) -> None:
        if not self._open:
            return
        self._open = False
        m = self.state.metrics
        m.router_running.labels(m.model_name).dec()
        assert self.room is not None
        self.state.pool.release(self.room, abort=abort)
        if abort:
            m.aborted.labels(m.model_name).inc()

    def cancel(self) -> None:
        self._close(abort=True)

    def ready(self) -> bool:
        """Whether the room's next event is already queued (a stream holds its output until it is
        not, and then writes it at once: one write per burst instead of one per token)."""
        return self.room is not None and not self.room.queue.empty()

    def __del__(self) -> None:
        # A response whose body never started (client gone before the first byte) never runs
        # events(); do not leave its room running on the instances.
        try:
            self._close(abort=True)
        except Exception:
            pass

    async def _place(self) -> None:
        """A deferred generation waits for its room in the admission queue."""
        try:
            room = await self.state.admission.place(self.spec)
        except Unavailable as e:
            raise APIError(503, str(e)) from None
        self.room, self._open = room, True
        self.state.metrics.router_running.labels(self.state.metrics.model_name).inc()

    async def events(self) -> AsyncIterator[Delta | Outcome]:
        if self.room is None and self._deferred:
            await self._place()
        spec, p, state = self.spec, self.spec.params, self.state
        m, name = state.metrics, state.metrics.model_name
        choices = [_Choice(i, IncrementalDetokenizer(state.tokenizer, p.skip_special_tokens),
                           StopStringMatcher(p.stop, include_stop=p.no_stop_trim)) for i in range(spec.n)]
        want_prompt = spec.prompt_logprobs_start >= 0
        want_lp = spec.logprobs >= 0
        pending: list[Delta | Outcome] = []  # held until the prompt logprobs are here
        cached, last_t, first_t, verify_ct, n_total = 0, self.t0, None, 0, 0
        itl, accepts = m.itl.labels(name), m.spec_accept.labels(name)  # looked up once, observed per token
        try:
            while True:
                try:
                    ev = await self._next_event()
                except RoomFailed as e:
                    if e.code == "overloaded":  # queued past the bound on an instance: 503 + Retry-After
                        raise QueueRefused(str(e), state.admission.retry_after()) from None
                    raise APIError(_STATUS_FOR_CODE.get(e.code, 503), str(e)) from None
                now = time.monotonic()
                if ev.prompt_logprobs is not None:
                    self.prompt_logprobs = list(ev.prompt_logprobs)
                    self.prompt_top_logprobs = list(ev.prompt_top_logprobs or [])
                cached = max(cached, ev.cached_tokens)
                verify_ct += len(ev.spec_accept)
                for n in ev.spec_accept:
                    accepts.observe(n)
                ids = list(ev.token_ids)
                if ids:
                    k = len(ids)
                    if first_t is None:
                        first_t = now
                        m.ttft.labels(name).observe(now - self.t0)
                        k -= 1
                    for _ in range(k):
                        itl.observe((now - last_t) / k)
                    last_t = now
                    n_total += len(ids)
                if not 0 <= ev.index < spec.n:
                    continue
                c = choices[ev.index]
                if (ids or ev.finish_reason is not None) and not c.done:
                    pending.extend(c.feed(ev, want_lp, len(spec.input_ids)))
                if want_prompt and self.prompt_logprobs is None:
                    continue  # hold everything until the prompt logprobs are here
                for item in pending:
                    item.cached_tokens, item.spec_verify_ct = cached, verify_ct
                    if isinstance(item, Outcome):
                        m.requests.labels(name, item.finish_reason).inc()
                    yield item
                pending = []
                if all(ch.done for ch in choices):
                    self._close(abort=False)  # decode ended every choice itself
                    m.e2e.labels(name).observe(now - self.t0)
                    longest = max(ch.n_out for ch in choices)  # choices decode side by side
                    if first_t is not None and longest > 1:
                        m.tpot.labels(name).observe((now - first_t) / (longest - 1))
                    m.prompt_tokens.labels(name).inc(len(spec.input_ids))
                    m.cached_tokens.labels(name).inc(cached)
                    m.generation_tokens.labels(name).inc(n_total)
                    return
        finally:
            # Client gone, room failed or timed out: free both sides.
            self.cancel()


@dataclass
class _Choice:
    """The router's state of one choice: its text pipeline and whether decode ended it."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    n_out: int = 0
    done: bool = False

    def feed(self, ev: Any, want_lp: bool, prompt_tokens: int) -> list[Delta | Outcome]:
        """This choice's Delta (and Outcome, at its end) for one of its token events."""
        ids = list(ev.token_ids)
        lps = list(ev.logprobs) if want_lp else None
        tops = list(ev.top_logprobs) if want_lp else None
        finish, matched = ev.finish_reason, ev.matched_stop
        # A stop token (or eos) is counted but not shown; a stop string is cut from the text.
        visible = ids[:-1] if finish == "stop" and ids and matched == ids[-1] else ids
        self.n_out += len(ids)
        text = self.stops.feed(self.detok.add(visible)) if visible else ""
        if finish is None:
            return [Delta(text, ids, self.index, lps, tops)] if text or ids else []
        # The end: what the detokenizer and the matcher still hold (decode matched the same text).
        text += self.stops.feed(self.detok.flush())
        text += self.stops.flush()
        self.done = True
        out: list[Delta | Outcome] = []
        if text or ids:
            out.append(Delta(text, ids, self.index, lps, tops, shown=len(visible)))
        out.append(Outcome(finish, matched, prompt_tokens, self.n_out, index=self.index))
        return out


async def admit(state: RouterState, spec: RequestSpec, request: Any = None) -> Generation:
    """A Generation for `spec` once the admission queue placed it (router/admission.py): raises
    APIError 503 (with Retry-After when queued past the bounds), or ClientGone when `request`'s
    client goes away while it waits."""
    try:
        room = await state.admission.place(spec, request.is_disconnected if request is not None else None)
    except Unavailable as e:
        raise APIError(503, str(e)) from None
    return Generation(state, spec, room)


async def start_all(state: RouterState, specs: list[RequestSpec], request: Any = None) -> list[Generation]:
    """The generations of a batch: the first admitted now (a 503 or the wait in line comes before
    any response), the others placed by the admission queue as they are consumed (side by side:
    sse.collect_all, a merged stream), so a batch larger than what the instances hold at once
    moves through as rooms free instead of waiting for itself. A refusal on the way fails the
    whole batch (its consumer cancels the rest)."""
    first = await admit(state, specs[0], request)
    return [first, *(Generation(state, spec, deferred=True) for spec in specs[1:])]
