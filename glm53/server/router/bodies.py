"""Request bodies, read within a size limit and parsed off the event loop.

`BodyRoute` is the route class of every API router. For an endpoint with a pydantic body it hands
FastAPI a request whose body is
- refused with 413 when larger than router.max_request_bytes, before any of it is parsed (at once
  when Content-Length says so, else as soon as the bytes read pass the limit);
- decoded, parsed, checked for text that is not valid Unicode and validated by pydantic in the
  router's worker threads (offload.py), so FastAPI's own validation receives a finished model
  (pydantic returns a model instance as is) and the event loop only awaits.

The body is read as JSON whatever its Content-Type says (as SGLang's /generate reads it): `curl -d`
sends application/x-www-form-urlencoded, which FastAPI would otherwise hand pydantic as raw bytes
("Input should be a valid dictionary"); a body that is not JSON is a 400 saying so.

A lone UTF-16 surrogate (JSON "\\ud800" without its pair) is valid JSON but not text: it is a 400
naming the field where it sits, never a 500 from whatever later encodes it. Errors are raised as
HTTPException subclasses because FastAPI passes those through its body reading unchanged.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from glm53.server.router.offload import Offload


class InputError(HTTPException):
    """A client error found while reading the body; `param` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


class BodyInvalid(HTTPException):
    """pydantic's errors for a body validated off the loop (rendered like FastAPI's own)."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(400, "invalid request body")
        self.errors = errors


# A lone surrogate can only come from a \u escape: raw UTF-8 surrogates fail decoding.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def find_lone_surrogate(obj: Any) -> str | None:
    """The path (`messages[0].content`) of the first string or key in `obj` that holds a lone
    surrogate, or None."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                if _has_surrogate(k):
                    return path or "body"
                stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes -> validated model (worker thread). JSONDecodeError propagates: FastAPI turns it
    into its json_invalid error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(400, f"The request body is not valid UTF-8 (byte {e.start}).", "body") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InputError(400, "The request body is nested too deeply.", "body") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = find_lone_surrogate(obj)
        if where is not None:
            raise InputError(400, f"{where}: contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                             "without its pair), which is not valid Unicode text", where)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise BodyInvalid(e.errors(include_url=False, include_input=False, include_context=False)) from None


class _LimitedRequest(Request):
    def __init__(self, request: Request, model: type[BaseModel], limit: int, offload: Offload):
        super().__init__(request.scope, request.receive)
        self._model, self._limit, self._offload = model, limit, offload
        self.size = 0

    def _too_large(self, size: str) -> InputError:
        return InputError(413, f"The request body is {size} bytes; this server accepts at most {self._limit} "
                          "bytes (router.max_request_bytes).", "body")

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self._limit:
                raise self._too_large(declared)
            chunks = []
            async for chunk in self.stream():
                self.size += len(chunk)
                if self.size > self._limit:
                    raise self._too_large(f"more than {self._limit}")
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await self._offload.run(parse_body, await self.body(), self._model)
        return self._json


def _body_model(endpoint: Any) -> type[BaseModel] | None:
    for hint in typing.get_type_hints(endpoint).values():
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            return hint
    return None


def _as_json(request: Request) -> Request:
    """`request` with Content-Type application/json, so that FastAPI parses its body as JSON."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        return request
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
    return Request({**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}, request.receive)


class BodyRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()
        model = _body_model(self.endpoint)
        if model is None:
            return handler

        async def route(request: Request) -> Response:
            state = request.app.state.router
            return await handler(_LimitedRequest(_as_json(request), model, state.cfg.router.max_request_bytes,
                                                 state.offload))

        return route
