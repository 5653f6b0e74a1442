"""Response assembly shared by the handlers: SSE event formatting, the SSE body of a streamed
generation, collecting a whole generation, and awaiting one while watching for the client to go.

`collect` and `event_stream` end with `gen.cancel()` however they end, so a client that leaves or
a failed room never leaves a room running on the instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from glm53.server.router.generation import Delta, Generation, Outcome
from glm53.server.router.schemas import APIError, error_body


def sse(obj: Any) -> str:
    """One SSE event: compact JSON, non-ASCII text as is."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Collected:
    """One choice of a whole generation: text, token ids (`shown` of them shown by the text: a
    final stop token is not), how it ended, and the ids' logprobs when asked for."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    outcome: Outcome | None = None
    shown: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)


async def collect(gen: Generation) -> list[Collected]:
    """The whole generation, one entry per choice."""
    out = [Collected() for _ in range(gen.spec.n)]
    events = gen.events()
    try:
        async with contextlib.aclosing(events):
            async for item in events:
                c = out[item.index]
                if isinstance(item, Delta):
                    c.text += item.text
                    c.ids.extend(item.token_ids)
                    c.shown += len(item.shown_ids)
                    if item.logprobs is not None:
                        c.logprobs.extend(item.logprobs)
                        c.top_logprobs.extend(item.top_logprobs or [])
                else:
                    c.outcome = item
    finally:
        gen.cancel()
    assert all(c.outcome is not None for c in out)
    return out


async def collect_all(gens: list[Generation]) -> list[list[Collected]]:
    """Every generation whole, in order; all of them are cancelled if this is (client gone)."""
    try:
        return await asyncio.gather(*(collect(g) for g in gens))
    finally:
        for g in gens:
            g.cancel()


async def until_disconnect(request: Request, coro: Any) -> Any:
    """Await `coro`, cancelling it (which aborts its room) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, APIError):
                    await task
                return None
    finally:
        if not task.done():
            task.cancel()


async def event_stream(gen: Generation, head: list[str], chunk: Callable[[Delta], str | None],
                       finish: Callable[[Outcome], list[str]],
                       usage: Callable[[list[Outcome]], str] | None) -> AsyncIterator[str]:
    """SSE body: `head` events, `chunk`'s event per Delta (none when it returns None), `finish`'s
    event(s) per choice's Outcome, then `usage`'s of all choices' Outcomes, then [DONE]; an error
    event and [DONE] if the generation fails mid-stream. Closing it (client gone) aborts the room."""
    events = gen.events()
    outcomes: list[Outcome] = []
    held: list[str] = []  # events not written yet: while more are queued, they go out as one write
    try:
        async with contextlib.aclosing(events):
            for h in head:
                yield h
            try:
                async for item in events:
                    if isinstance(item, Delta):
                        ev = chunk(item)
                        if ev:
                            held.append(ev)
                    else:
                        outcomes.append(item)
                        held.extend(finish(item))
                    if held and not gen.ready():
                        yield "".join(held)
                        held = []
                if usage is not None and outcomes:
                    held.append(usage(outcomes))
            except APIError as e:
                held.append(sse(error_body(e.status, e.message, e.param)))
            yield "".join(held) + SSE_DONE
    finally:
        gen.cancel()
