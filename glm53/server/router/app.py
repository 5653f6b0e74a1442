"""The router: the OpenAI-compatible HTTP API in front of the prefill/decode instances.

It tokenizes (GLM chat template), picks a (prefill, decode) pair, sends both the request over
ZMQ (protocol.py), turns decode's token events into text (incremental detokenization, stop
strings applied here, then the room is aborted), and writes JSON or OpenAI-exact SSE. It never
answers client input with a 5xx: bad input is a 400 in vLLM's error shape, an unknown model a
404, no healthy instance / at capacity a 503, a timed-out room a 504 (in a stream: an error event
then [DONE]).

This module builds the app; the rest of the router is split by job:
- generation.py: one request in flight (submit, retry, detokenize, stop strings, metrics, abort)
- intake.py: the checks and RequestSpec building every handler starts with
- sse.py: SSE events, streaming and collecting a generation
- openai.py, native.py, tokens.py, ops.py: the handlers, one APIRouter per API family
- schemas.py: request bodies and the error envelope
- bodies.py: the body size limit, and parsing/validation off the event loop
- offload.py: the worker threads for parsing, templating and (de)tokenizing
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm53.server import heap
from glm53.server.config import ClusterConfig
from glm53.server.router import native, openai, ops, tokens
from glm53.server.router.admission import ClientGone
from glm53.server.router.bodies import BodyInvalid
from glm53.server.router.generation import RouterState
from glm53.server.router.instance_pool import InstancePool
from glm53.server.router.metrics import RouterMetrics
from glm53.server.router.offload import Offload, TrimAfterLargeRequests
from glm53.server.router.schemas import APIError, error_body
from glm53.server.tokenizer import NoTokenizer, Tokenizer

log = logging.getLogger(__name__)


def create_app(cfg: ClusterConfig, model_dir: Path, pool: InstancePool | None = None) -> FastAPI:
    tokenizer = (Tokenizer.ids_only(model_dir) if cfg.model.skip_tokenizer_init
                 else Tokenizer.from_dir(model_dir, cfg.model.chat_template))
    served = list(cfg.model.served_model_name) or [Path(model_dir).name]
    metrics = RouterMetrics(served[0])
    pool = pool or InstancePool(cfg, metrics)
    pool.metrics = metrics
    ctx = cfg.model.context_length or tokenizer.max_position_embeddings or 4096
    offload = Offload(cfg.router.tokenizer_pool_size)
    state = RouterState(cfg=cfg, tokenizer=tokenizer, pool=pool, metrics=metrics, served_names=served,
                        model_root=str(model_dir), context_length=int(ctx), offload=offload)
    app = FastAPI(title="glm53-serve", version="0.1.0", lifespan=_lifespan)
    app.state.router = state
    app.add_middleware(TrimAfterLargeRequests, offload=offload)
    _install_error_handlers(app)
    # The route table's order (and /openapi.json's) is the order of these includes.
    for family in (openai, native, tokens, ops):
        app.include_router(family.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state.router
    await state.pool.start()
    try:
        yield
    finally:
        await state.pool.stop()
        state.offload.close()


_TYPE_NAMES = {"int", "str", "float", "bool", "list", "dict", "function-after", "constrained-int"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status,
                            headers=getattr(e, "headers", None))  # a queue's 503: Retry-After

    @app.exception_handler(NoTokenizer)
    async def no_tokenizer(_: Request, e: NoTokenizer):
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone):
        return Response(status_code=499)  # left while queued: for the access log only

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        return _validation_response(e.errors())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        if isinstance(e, BodyInvalid):
            return _validation_response(e.errors)
        return JSONResponse(error_body(e.status_code, str(e.detail), getattr(e, "param", None)),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        log.exception("router: unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


def _validation_response(errs: list) -> JSONResponse:
    """One 400 for pydantic's errors, naming the first field (FastAPI's own and bodies.py's)."""
    lines, param = [], None
    for err in errs[:5]:
        # OpenAI names the field itself ("max_tokens"), without FastAPI's "body." prefix.
        parts = [str(x) for x in err.get("loc", ())]
        if parts and parts[0] in ("body", "query", "path"):
            parts = parts[1:]
        # pydantic adds the union member it tried ("int", "list[str]") to the location.
        loc = ".".join(x for x in parts if not (x[:1].islower() and ("[" in x or x in _TYPE_NAMES)))
        param = param or loc or None
        lines.append(f"  {loc}: {err.get('msg', 'invalid value')}")
    msg = f"{len(errs)} validation error{'s' if len(errs) != 1 else ''}:\n" + "\n".join(lines)
    if any(err.get("type") == "json_invalid" for err in errs):
        msg, param = "The request body is not valid JSON.", "body"
    return JSONResponse(error_body(400, msg, param), status_code=400)


def main(cfg: ClusterConfig, model_dir: Path | None = None, listen_fd: int | None = None) -> int:
    """Run the router in this process until SIGINT/SIGTERM (uvicorn handles both). `listen_fd`:
    a listening HTTP socket to serve on (`up` binds the port and keeps it); else uvicorn binds
    router.host:router.port."""
    import socket

    import uvicorn

    from glm53.server.embedded_model import resolve_model_path
    from glm53.server.router import stopping

    model_dir = model_dir or resolve_model_path(cfg.model.path)
    app = create_app(cfg, model_dir)
    # On SIGTERM/SIGINT the router's requests fail at once (error event + [DONE] for streams), so
    # the graceful timeout is a backstop, not a wait (router/stopping.py).
    server = stopping.Server(uvicorn.Config(app, host=cfg.router.host, port=cfg.router.port,
                                            log_level=cfg.router.log_level, timeout_graceful_shutdown=5),
                             on_stop=app.state.router.shutdown)
    heap.settle()  # the app and tokenizer are built: a full collection would hold every stream
    server.run(sockets=None if listen_fd is None else [socket.socket(fileno=listen_fd)])
    return 0 if server.started else 3  # uvicorn's start-up failure code
