"""The router's worker threads for the CPU work a request brings: parsing and validating its body,
rendering the chat template, tokenizing, detokenizing whole lists, rendering large responses.

None of it runs on the event loop, which must keep answering /health, moving instance events and
feeding other streams whatever one client sends. The pool is bounded (router.tokenizer_pool_size);
further jobs wait in its queue. Tokenization releases the GIL (`Tokenizer.encode`), so it runs
beside the loop; JSON parsing and pydantic validation hold it, so their cost is bounded by the
body limit instead (router.max_request_bytes).

glibc keeps freed heap instead of returning it to the system, so once a large request has been
answered (`TrimAfterLargeRequests`) the heap is trimmed: the router's RSS returns near its
baseline.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

T = TypeVar("T")

# A request body at least this large is followed by a heap trim once it has been answered.
LARGE_REQUEST_BYTES = 1 << 20


class Offload:
    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="router-work")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def release_memory_soon(self) -> None:
        try:
            self._pool.submit(release_memory)
        except RuntimeError:  # shut down
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TrimAfterLargeRequests:
    """ASGI middleware: after a request with a large body has been answered — the response sent,
    any exception and its traceback gone, so its objects are freed — trim the heap in a worker
    thread."""

    def __init__(self, app: ASGIApp, offload: Offload):
        self.app, self.offload = app, offload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = 0

        async def counting_receive() -> Message:
            nonlocal size
            msg = await receive()
            size += len(msg.get("body", b""))
            return msg

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if size >= LARGE_REQUEST_BYTES:
                self.offload.release_memory_soon()


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Return freed heap pages of every malloc arena to the system (glibc's malloc_trim)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
