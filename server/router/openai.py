"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}.

Responses follow OpenAI's shapes with vLLM/SGLang's extras (`matched_stop`, `stop_reason`,
`continuous_usage_stats`). A non-streamed request whose client goes away ends with a 499 (for the
access log) and its room is aborted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm53.server.protocol import RequestSpec
from glm53.server.router import structured
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Delta, Generation, Outcome, RouterState
from glm53.server.router.intake import (State, chat_prompt_ids, check_internal, check_model, check_unsupported,
                                        ids_prompt, request_id, request_spec, stop_list, text_prompt_ids)
from glm53.server.router.parsers.chat import ChatParsing, check_tool_choice
from glm53.server.router.parsers.reasoning import THINK_END
from glm53.server.router.schemas import APIError, ChatCompletionRequest, CompletionRequest, StreamOptions
from glm53.server.router.sse import SSE_HEADERS, collect, event_stream, sse, until_disconnect

router = APIRouter(route_class=BodyRoute)


@router.get("/v1/models")
async def list_models(state: State) -> dict:
    return {"object": "list", "data": [_model_card(state, n) for n in state.served_names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State) -> dict:
    if model_id not in state.served_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")
    return _model_card(state, model_id)


def _model_card(state: RouterState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "glm53-serve",
            "root": state.model_root, "parent": None, "max_model_len": state.context_length, "permission": []}


# ---- chat ----


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_internal(body)
    model = check_model(state, body.model)
    check_unsupported(body)
    if body.top_logprobs:
        raise APIError(400, "top_logprobs is not supported yet", "top_logprobs")
    ask = structured.from_response_format(body.response_format)
    check_tool_choice(body, state.cfg.router.tool_call_parser)
    ids = await state.offload.run(chat_prompt_ids, state, body)
    parsing = ChatParsing.for_request(state.cfg.router, body, state.tokenizer.decode_one(ids[-4:], False))
    forced = parsing.forced_calls(body, state.tokenizer.token_to_id)
    if forced is not None:
        if ask is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with a "
                           "response_format: both constrain the answer", "tool_choice")
        ask = structured.Ask("lark", forced, "tool_choice")
    grammar = await structured.grammar(state, ask)
    # A thinking model thinks freely; the grammar holds for the answer after </think>.
    after = state.tokenizer.token_to_id(THINK_END) if grammar and parsing.in_reasoning else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = request_id(request, "chatcmpl")
    spec = request_spec(state, rid, ids, max_tokens=max_tokens, default_max=None, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                        stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids,
                        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
                        grammar=grammar, grammar_after=after)
    gen = Generation(state, spec)
    created = int(time.time())
    if body.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return StreamingResponse(_chat_events(gen, base, body.stream_options, len(ids), parsing, state),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})
    res = await until_disconnect(request, collect(gen))
    if res is None:
        return Response(status_code=499)
    text, out_ids, out = res
    message, called = parsing.message(text)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": None, "finish_reason": _finish_reason(out, called),
                     "matched_stop": out.matched_stop, "stop_reason": out.matched_stop}],
        "usage": _chat_usage(out, parsing, out_ids, state),
    }, headers={"x-request-id": rid})


def _finish_reason(out: Outcome, called: bool) -> str:
    # "tool_calls" only when a call was completed and the model ended its turn itself.
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


def _chat_usage(out: Outcome, parsing: ChatParsing, ids: list[int], state: RouterState) -> dict:
    usage = out.usage()
    usage["completion_tokens_details"]["reasoning_tokens"] = parsing.reasoning_tokens(ids, state.tokenizer.token_to_id)
    return usage


def _chat_events(gen: Generation, base: dict, opts: StreamOptions | None, plen: int, parsing: ChatParsing,
                 state: RouterState) -> AsyncIterator[str]:
    """chat.completion.chunk events: the assistant role, a delta per piece of output (reasoning,
    content or tool-call pieces: parsers/chat.py), the finish chunk, then (include_usage) a
    usage-only chunk. With continuous_usage_stats every chunk carries the running usage; with
    include_usage alone, `"usage": null`."""
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
    counted = 0  # completion tokens so far, stop tokens included
    out_ids: list[int] = []
    stream = parsing.stream()

    def with_usage(obj: dict, n: int | None) -> dict:
        if include_usage:
            obj["usage"] = ({"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                            if continuous and n is not None else None)
        return obj

    def delta_events(deltas: list[dict], n: int | None) -> list[str]:
        return [sse(with_usage({**base, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                                      "finish_reason": None}]}, n)) for d in deltas]

    def chunk(d: Delta) -> str | None:
        nonlocal counted
        counted += len(d.token_ids)
        out_ids.extend(d.token_ids)
        return "".join(delta_events(stream.feed(d.text), counted)) if d.text else None

    def finish(o: Outcome) -> list[str]:
        return [*delta_events(stream.finish(), o.completion_tokens),
                sse(with_usage({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                     "finish_reason": _finish_reason(o, stream.complete_calls > 0),
                                                     "matched_stop": o.matched_stop}]},
                               o.completion_tokens))]

    usage = (lambda o: sse({**base, "choices": [], "usage": _chat_usage(o, parsing, out_ids, state)})) \
        if include_usage else None
    head = [sse(with_usage({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}, 0))]
    return event_stream(gen, head, chunk, finish, usage)


# ---- completions ----


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    check_internal(body)
    model = check_model(state, body.model)
    check_unsupported(body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported yet", "best_of")
    n_prompts = _count_prompts(body.prompt)
    if body.stream and n_prompts > 1:
        raise APIError(400, "streaming several prompts in one request is not supported yet", "prompt")
    # More generations than the router ever runs at once can never be admitted: a 400, where a
    # 503 ("retry later") would be a promise no retry keeps.
    cap = state.cfg.router.max_running_requests
    if n_prompts * body.n > cap:
        raise APIError(400, f"This request asks for {n_prompts * body.n} generations ({n_prompts} prompts x n="
                       f"{body.n}), but this server runs at most {cap} at once (router.max_running_requests). "
                       f"Send at most {cap} per request.", "prompt")
    ask = structured.from_response_format((body.model_extra or {}).get("response_format"))
    prompts, echoes = await state.offload.run(_completion_prompts, state, body)
    grammar = await structured.grammar(state, ask)
    rid = request_id(request, "cmpl")
    created = int(time.time())
    # Every prompt is checked (and echoed text decoded) before any is submitted.
    specs = []
    for i, ids in enumerate(prompts):
        specs.append(request_spec(
            state, f"{rid}-{i}" if len(prompts) > 1 else rid, ids, max_tokens=body.max_tokens, default_max=16,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens, grammar=grammar))
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if body.stream:
        gen = Generation(state, specs[0])
        return StreamingResponse(_completion_events(gen, base, body.stream_options, echoes[0]),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})
    gens = _start_all(state, specs)

    async def run_all():
        try:
            return await asyncio.gather(*(collect(g) for g in gens))
        finally:
            for g in gens:
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
    return JSONResponse({**base, "choices": choices, "usage": total.usage()}, headers={"x-request-id": rid})


def _count_prompts(prompt: Any) -> int:
    # pydantic made the list homogeneous: its first element tells the shape.
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def _completion_prompts(state: RouterState, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """`prompt` in any of its four shapes (text, token ids, or a list of either) as token id lists,
    and the text each echoes (worker thread)."""
    prompt = body.prompt
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    out = [text_prompt_ids(state, p, "prompt") if isinstance(p, str) else ids_prompt(state, list(p), "prompt")
           for p in prompt]
    echoes = [state.tokenizer.decode(ids, body.skip_special_tokens) if body.echo else "" for ids in out]
    return out, echoes


def _start_all(state: RouterState, specs: list[RequestSpec]) -> list[Generation]:
    """Submit every prompt, or none: if one cannot be placed, those already submitted are aborted."""
    started: list[Generation] = []
    try:
        for spec in specs:
            started.append(Generation(state, spec))
    except APIError:
        for g in started:
            g.cancel()
        raise
    return started


def _completion_events(gen: Generation, base: dict, opts: StreamOptions | None, echo: str) -> AsyncIterator[str]:
    """text_completion events: the echoed prompt (if any), a chunk per piece of text, the finish
    chunk, then (include_usage) a usage-only chunk; with include_usage the others carry
    `"usage": null`."""
    include_usage = bool(opts and opts.include_usage)

    def tc(text: str, finish_reason: str | None, **extra: Any) -> str:
        obj = {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                                    **extra}]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    head = [tc(echo, None)] if echo else []
    return event_stream(gen, head, lambda d: tc(d.text, None) if d.text else None,
                        lambda o: [tc("", o.finish_reason, matched_stop=o.matched_stop)],
                        (lambda o: sse({**base, "choices": [], "usage": o.usage()})) if include_usage else None)
