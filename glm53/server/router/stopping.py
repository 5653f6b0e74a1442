"""Stopping the router without cutting its clients off.

uvicorn, on SIGTERM/SIGINT, stops accepting, then waits for the open responses to finish (up to
its graceful timeout, then cancels them: a stream cut mid-way, an incomplete chunked read for the
client). A generation never finishes on its own while the instances are being stopped too, so
`Server` first tells the router state to stop (`RouterState.shutdown`, scheduled on the event
loop from the signal): queued requests get a 503, every room in flight fails, each stream ends
with an error event and `data: [DONE]` and each whole request with a 503 body, and the
connections close at once instead of after the graceful timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import uvicorn

log = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """A uvicorn server that calls `on_stop` (on its event loop) when a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]):
        super().__init__(config)
        self._on_stop = on_stop
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit and self._loop is not None:
            # A signal handler interrupts whatever the loop was doing: schedule, do not call.
            self._loop.call_soon_threadsafe(self._stop_app)
        super().handle_exit(sig, frame)

    def _stop_app(self) -> None:
        try:
            self._on_stop()
        except Exception:
            log.exception("router: failing requests at shutdown")
