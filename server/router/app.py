"""The router: the OpenAI-compatible HTTP API in front of the prefill/decode instances.

It tokenizes (GLM chat template), picks a (prefill, decode) pair, sends both the request over
ZMQ (protocol.py), turns decode's token events into text (incremental detokenization, stop
strings applied here, then the room is aborted), and writes JSON or OpenAI-exact SSE. It never
answers client input with a 5xx: bad input is a 400 in vLLM's error shape, an unknown model a
404, no healthy instance / at capacity a 503, a timed-out room a 504 (in a stream: an error event
then [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm53.server.config import ClusterConfig
from glm53.server.protocol import RequestSpec
from glm53.server.router.generation import Delta, Generation, Outcome, RouterState
from glm53.server.router.instance_pool import InstancePool
from glm53.server.router.intake import (check_ids, check_internal, check_model, check_unsupported, render_chat,
                                        request_id, request_spec, stop_list)
from glm53.server.router.metrics import RouterMetrics
from glm53.server.router.schemas import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         GenerateRequestBody, TokenizeRequest, error_body)
from glm53.server.router.sse import SSE_HEADERS, collect, event_stream, sse, until_disconnect
from glm53.server.sampling import SamplingParams
from glm53.server.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


def create_app(cfg: ClusterConfig, model_dir: Path, pool: InstancePool | None = None) -> FastAPI:
    tokenizer = Tokenizer.from_dir(model_dir, cfg.model.chat_template)
    served = list(cfg.model.served_model_name) or [Path(model_dir).name]
    metrics = RouterMetrics(served[0])
    pool = pool or InstancePool(cfg, metrics)
    pool.metrics = metrics
    ctx = cfg.model.context_length or tokenizer.max_position_embeddings or 4096
    state = RouterState(cfg=cfg, tokenizer=tokenizer, pool=pool, metrics=metrics, served_names=served,
                        model_root=str(model_dir), context_length=int(ctx))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()

    app = FastAPI(title="glm53-serve", version="0.1.0", lifespan=lifespan)
    app.state.router = state
    _install_error_handlers(app)

    # ---- OpenAI ----
    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(state, n) for n in served]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id not in served:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return _model_card(state, model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_internal(body)
        model = check_model(state, body.model)
        check_unsupported(body)
        if body.top_logprobs:
            raise APIError(400, "top_logprobs is not supported yet", "top_logprobs")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than text is not supported yet", "response_format")
        ids = state.tokenizer.encode(render_chat(state, body))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        rid = request_id(request, "chatcmpl")
        spec = request_spec(state, rid, ids, max_tokens=max_tokens, default_max=None, temperature=body.temperature,
                             top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                             stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids,
                             ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens)
        gen = Generation(state, spec)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        if not body.stream:
            res = await until_disconnect(request, collect(gen))
            if res is None:
                return Response(status_code=499)
            text, _, out = res
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                             "logprobs": None, "finish_reason": out.finish_reason,
                             "matched_stop": out.matched_stop, "stop_reason": out.matched_stop}],
                "usage": out.usage(),
            }, headers={"x-request-id": rid})
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        counted = {"n": 0}
        plen = len(ids)

        def with_usage(obj: dict, n: int | None) -> dict:
            if include_usage:
                obj["usage"] = ({"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                                if continuous and n is not None else None)
            return obj

        def chunk(d: Delta) -> str | None:
            counted["n"] += len(d.token_ids)
            if not d.text:
                return None
            return sse(with_usage({**base, "choices": [{"index": 0, "delta": {"content": d.text},
                                                        "logprobs": None, "finish_reason": None}]},
                                  counted["n"]))

        def finish(o: Outcome) -> list[str]:
            return [sse(with_usage({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                         "finish_reason": o.finish_reason,
                                                         "matched_stop": o.matched_stop}]},
                                   o.completion_tokens))]

        usage = (lambda o: sse({**base, "choices": [], "usage": o.usage()})) if include_usage else None
        head = [sse(with_usage({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]}, 0))]
        return StreamingResponse(event_stream(gen, head, chunk, finish, usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "x-request-id": rid})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_internal(body)
        model = check_model(state, body.model)
        check_unsupported(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported yet", "best_of")
        prompts = _completion_prompts(state, body.prompt)
        if body.stream and len(prompts) > 1:
            raise APIError(400, "streaming several prompts in one request is not supported yet", "prompt")
        rid = request_id(request, "cmpl")
        created = int(time.time())
        gens, echoes = [], []
        for i, ids in enumerate(prompts):
            gens.append(request_spec(
                state, f"{rid}-{i}" if len(prompts) > 1 else rid, ids, max_tokens=body.max_tokens, default_max=16,
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens))
            echoes.append(state.tokenizer.decode(ids, body.skip_special_tokens) if body.echo else "")
        if not body.stream:
            started: list[Generation] = []
            try:
                for g in gens:
                    started.append(Generation(state, g))
            except APIError:
                for g in started:
                    g.cancel()
                raise

            async def run_all():
                try:
                    return await asyncio.gather(*(collect(g) for g in started))
                finally:
                    for g in started:
                        g.cancel()

            res = await until_disconnect(request, run_all())
            if res is None:
                return Response(status_code=499)
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
            for i, (text, _, out) in enumerate(res):
                choices.append({"index": i, "text": echoes[i] + text, "logprobs": None,
                                "finish_reason": out.finish_reason, "matched_stop": out.matched_stop,
                                "stop_reason": out.matched_stop})
                usage["prompt_tokens"] += out.prompt_tokens
                usage["completion_tokens"] += out.completion_tokens
                usage["cached"] += out.cached_tokens
            total = Outcome("stop", None, usage["prompt_tokens"], usage["completion_tokens"], usage["cached"])
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": total.usage()}, headers={"x-request-id": rid})
        gen = Generation(state, gens[0])
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)

        def tc(text: str, finish_reason: str | None, **extra: Any) -> str:
            obj = {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                                        **extra}]}
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        head = [tc(echoes[0], None)] if echoes[0] else []
        return StreamingResponse(
            event_stream(gen, head, lambda d: tc(d.text, None) if d.text else None,
                    lambda o: [tc("", o.finish_reason, matched_stop=o.matched_stop)],
                    (lambda o: sse({**base, "choices": [], "usage": o.usage()})) if include_usage else None),
            media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})

    # ---- SGLang native ----
    @app.post("/generate")
    async def generate_native(body: GenerateRequestBody, request: Request):
        check_internal(body)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "exactly one of text and input_ids must be given", "text")
        ids = (check_ids(state, list(body.input_ids), "input_ids") if body.input_ids is not None
               else state.tokenizer.encode(body.text or ""))
        sp = body.sampling_params or _default_generate_params()
        rid = body.rid or request_id(request, "gen")
        spec = request_spec(state, rid, ids, max_tokens=sp.max_new_tokens, default_max=128,
                             temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                             seed=sp.sampling_seed, stop=stop_list(sp.stop), stop_token_ids=sp.stop_token_ids,
                             ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
                             no_stop_trim=sp.no_stop_trim)
        gen = Generation(state, spec)
        t0 = time.monotonic()

        def meta(o: Outcome | None, n: int) -> dict:
            fr = None
            if o is not None:
                fr = {"type": o.finish_reason}
                if o.finish_reason == "stop":
                    fr["matched"] = o.matched_stop
                elif o.finish_reason == "length":
                    fr["length"] = o.completion_tokens
            return {"id": rid, "finish_reason": fr, "prompt_tokens": len(ids),
                    "completion_tokens": o.completion_tokens if o else n,
                    "cached_tokens": o.cached_tokens if o else 0, "e2e_latency": time.monotonic() - t0}

        if not body.stream:
            res = await until_disconnect(request, collect(gen))
            if res is None:
                return Response(status_code=499)
            text, out_ids, out = res
            return JSONResponse({"text": text, "output_ids": out_ids, "meta_info": meta(out, len(out_ids))})
        acc = {"text": "", "ids": []}

        def chunk(d: Delta) -> str:
            acc["text"] += d.text
            acc["ids"].extend(d.token_ids)
            return sse({"text": acc["text"], "output_ids": list(acc["ids"]), "meta_info": meta(None, len(acc["ids"]))})

        def finish(o: Outcome) -> list[str]:
            return [sse({"text": acc["text"], "output_ids": list(acc["ids"]), "meta_info": meta(o, len(acc["ids"]))})]

        return StreamingResponse(event_stream(gen, [], chunk, finish, None), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    # ---- tokenizer endpoints (vLLM shape; with and without /v1) ----
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "exactly one of prompt and messages must be given", "prompt")
        text = body.prompt if body.prompt is not None else render_chat(state, body)
        ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context_length}

    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(state, body.model)
        return {"prompt": state.tokenizer.decode(check_ids(state, body.tokens, "tokens"), False)}

    for prefix in ("", "/v1"):
        app.post(prefix + "/tokenize")(tokenize)
        app.post(prefix + "/detokenize")(detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        t = state.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": t.eos_token, "bos_token": t.bos_token,
                "pad_token": t.pad_token, "chat_template": t.chat_template, "model_max_length": state.context_length,
                "vocab_size": t.vocab_size, "eos_token_ids": t.eos_token_ids}

    # ---- health, info, metrics ----
    @app.get("/health")
    async def health():
        missing = [r for r in ("prefill", "decode") if not pool.healthy(r)]
        if missing:
            return JSONResponse(error_body(503, f"no healthy {' or '.join(missing)} instance"), status_code=503)
        return {"status": "ok"}

    app.get("/ready")(health)

    @app.get("/health_generate")
    async def health_generate():
        ids = state.tokenizer.encode("ping") or [0]
        spec = RequestSpec(f"health-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0.0, max_new_tokens=1,
                                                                             ignore_eos=True), [])
        try:
            _, out_ids, _ = await collect(Generation(state, spec))
        except APIError as e:
            return JSONResponse(error_body(503, f"health generation failed: {e.message}"), status_code=503)
        return {"status": "ok", "output_ids": out_ids}

    @app.get("/server_info")
    async def server_info() -> dict:
        return {"model_path": state.model_root, "served_model_name": served, "context_length": state.context_length,
                "router": {"host": cfg.router.host, "port": cfg.router.port, "policy": cfg.router.policy,
                           "running_requests": len(pool.rooms)},
                **pool.status(), "internal_states": [{}], "version": "0.1.0"}

    app.get("/get_server_info")(server_info)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _default_generate_params():
    from glm53.server.router.schemas import GenerateSamplingParams

    return GenerateSamplingParams()


def _completion_prompts(state: RouterState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [state.tokenizer.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [check_ids(state, list(prompt), "prompt")]
    out = []
    for p in prompt:
        out.append(state.tokenizer.encode(p) if isinstance(p, str) else check_ids(state, list(p), "prompt"))
    return out


def _model_card(state: RouterState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "glm53-serve",
            "root": state.model_root, "parent": None, "max_model_len": state.context_length, "permission": []}


_TYPE_NAMES = {"int", "str", "float", "bool", "list", "dict", "function-after", "constrained-int"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        log.exception("router: unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


def main(cfg: ClusterConfig, model_dir: Path | None = None) -> int:
    """Run the router in this process until SIGINT/SIGTERM (uvicorn handles both)."""
    import uvicorn

    from glm53.server.embedded_model import resolve_model_path

    model_dir = model_dir or resolve_model_path(cfg.model.path)
    app = create_app(cfg, model_dir)
    uvicorn.run(app, host=cfg.router.host, port=cfg.router.port, log_level=cfg.router.log_level,
                timeout_graceful_shutdown=5)
    return 0
