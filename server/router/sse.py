"""Response assembly shared by the handlers: SSE event formatting, the SSE body of a streamed
generation, collecting a whole generation, and awaiting one while watching for the client to go.

`collect` and `event_stream` end with `gen.cancel()` however they end, so a client that leaves or
a failed room never leaves a room running on the instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from glm53.server.router.generation import Delta, Generation, Outcome
from glm53.server.router.schemas import APIError, error_body


def sse(obj: Any) -> str:
    """One SSE event: compact JSON, non-ASCII text as is."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def collect(gen: Generation) -> tuple[str, list[int], Outcome]:
    """The whole generation: its text, its token ids and how it ended."""
    text, ids, outcome = [], [], None
    events = gen.events()
    try:
        async with contextlib.aclosing(events):
            async for item in events:
                if isinstance(item, Delta):
                    text.append(item.text)
                    ids.extend(item.token_ids)
                else:
                    outcome = item
    finally:
        gen.cancel()
    assert outcome is not None
    return "".join(text), ids, outcome


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
                       usage: Callable[[Outcome], str] | None) -> AsyncIterator[str]:
    """SSE body: `head` events, `chunk`'s event per Delta (none when it returns None), `finish`'s
    event(s) and `usage`'s, then [DONE]; an error event and [DONE] if the generation fails
    mid-stream. Closing it (client gone) aborts the room."""
    events = gen.events()
    try:
        async with contextlib.aclosing(events):
            for h in head:
                yield h
            try:
                async for item in events:
                    if isinstance(item, Delta):
                        ev = chunk(item)
                        if ev:
                            yield ev
                    else:
                        for ev in finish(item):
                            yield ev
                        if usage is not None:
                            yield usage(item)
            except APIError as e:
                yield sse(error_body(e.status, e.message, e.param))
            yield SSE_DONE
    finally:
        gen.cancel()
