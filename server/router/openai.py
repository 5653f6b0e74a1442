"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}.

Responses follow OpenAI's shapes with vLLM/SGLang's extras (`matched_stop`, `stop_reason`,
`continuous_usage_stats`). A non-streamed request whose client goes away ends with a 499 (for the
access log) and its room is aborted. `n` choices share one prefill (one room, n decode
sequences); logprobs are log_softmax of the model's raw logits (logprobs.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm53.server.protocol import MAX_CHOICES, RequestSpec
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Delta, Generation, Outcome, RouterState, total_usage
from glm53.server.router.intake import (Penalties, State, chat_prompt_ids, check_internal, check_model,
                                        check_unsupported, ids_prompt, request_id, request_spec, stop_list,
                                        text_prompt_ids)
from glm53.server.router.logprobs import Texts, chat_content, completion_logprobs, merge_completion
from glm53.server.router.schemas import APIError, ChatCompletionRequest, CompletionRequest, StreamOptions, _Sampling
from glm53.server.router.sse import SSE_HEADERS, Collected, collect, event_stream, sse, until_disconnect

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


# ---- shared ----

# OpenAI's names for SamplingParams fields, for error params.
_NAMES = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens", "seed": "seed"}


def _penalties(body: _Sampling) -> Penalties:
    return Penalties(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                     repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias,
                     min_new_tokens=body.min_tokens)


# ---- chat ----


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_internal(body)
    model = check_model(state, body.model)
    check_unsupported(body)
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", "top_logprobs")
        if not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "response_format other than text is not supported yet", "response_format")
    ids = await state.offload.run(chat_prompt_ids, state, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    names = {**_NAMES, "logprobs": "top_logprobs",
             "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"}
    rid = request_id(request, "chatcmpl")
    spec = request_spec(state, rid, ids, max_tokens=max_tokens, default_max=None, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                        stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids,
                        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
                        penalties=_penalties(body), n=body.n,
                        logprobs=(body.top_logprobs or 0) if body.logprobs else -1, prompt_param="messages",
                        names=names)
    _check_capacity(state, body.n, 1)
    gen = Generation(state, spec)
    created = int(time.time())
    if body.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return StreamingResponse(_chat_events(state, gen, base, body.stream_options, len(ids)),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})
    res = await until_disconnect(request, collect(gen))
    if res is None:
        return Response(status_code=499)
    texts = Texts(state.tokenizer)
    choices = []
    for i, c in enumerate(res):
        out = c.outcome
        lp = None
        if spec.logprobs >= 0:
            lp = {"content": chat_content(texts, c.ids[: c.shown], c.logprobs, c.top_logprobs)}
        choices.append({"index": i, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                        "logprobs": lp, "finish_reason": out.finish_reason,
                        "matched_stop": out.matched_stop, "stop_reason": out.matched_stop})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": total_usage([c.outcome for c in res], len(ids)),
    }, headers={"x-request-id": rid})


def _check_capacity(state: RouterState, n: int, prompts: int) -> None:
    # More generations than the router ever runs at once can never be admitted: a 400, where a
    # 503 ("retry later") would be a promise no retry keeps. A room of n choices counts once.
    cap = state.cfg.router.max_running_requests
    if prompts > cap:
        raise APIError(400, f"This request asks for {prompts} generations, but this server runs at most {cap} at "
                       f"once (router.max_running_requests). Send at most {cap} per request.", "prompt")


def _chat_events(state: RouterState, gen: Generation, base: dict, opts: StreamOptions | None,
                 plen: int) -> AsyncIterator[str]:
    """chat.completion.chunk events: the assistant role per choice, a content delta per piece of
    text (with its tokens' logprobs when asked for), each choice's finish chunk, then
    (include_usage) a usage-only chunk. With continuous_usage_stats every chunk carries the
    running usage; with include_usage alone, `"usage": null`."""
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
    want_lp = gen.spec.logprobs >= 0
    texts = Texts(state.tokenizer)
    counted = 0  # completion tokens so far (all choices), stop tokens included

    def with_usage(obj: dict, n: int | None) -> dict:
        if include_usage:
            obj["usage"] = ({"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                            if continuous and n is not None else None)
        return obj

    def chunk(d: Delta) -> str | None:
        nonlocal counted
        counted += len(d.token_ids)
        shown = d.shown_ids
        if not d.text and not (want_lp and shown):
            return None
        lp = ({"content": chat_content(texts, shown, d.logprobs or [], d.top_logprobs or [])} if want_lp else None)
        return sse(with_usage({**base, "choices": [{"index": d.index, "delta": {"content": d.text},
                                                    "logprobs": lp, "finish_reason": None}]}, counted))

    def finish(o: Outcome) -> list[str]:
        return [sse(with_usage({**base, "choices": [{"index": o.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": o.finish_reason,
                                                     "matched_stop": o.matched_stop}]},
                               counted))]

    usage = (lambda outs: sse({**base, "choices": [], "usage": total_usage(outs, plen)})) if include_usage else None
    head = [sse(with_usage({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}, 0))
            for i in range(gen.spec.n)]
    return event_stream(gen, head, chunk, finish, usage)


# ---- completions ----


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    check_internal(body)
    model = check_model(state, body.model)
    check_unsupported(body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    best_of = body.n if body.best_of is None else body.best_of
    if not body.n <= best_of <= MAX_CHOICES:
        raise APIError(400, f"best_of must be in [n, {MAX_CHOICES}], got {best_of} (n={body.n})", "best_of")
    if best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed", "best_of")
    lp_num = -1
    if body.logprobs is not None and body.logprobs is not False:
        lp_num = int(body.logprobs)
        if not 0 <= lp_num <= 5:
            raise APIError(400, f"logprobs must be in [0, 5], got {body.logprobs}", "logprobs")
    n_prompts = _count_prompts(body.prompt)
    if body.stream and n_prompts > 1:
        raise APIError(400, "streaming several prompts in one request is not supported yet", "prompt")
    _check_capacity(state, best_of, n_prompts)
    prompts, echoes = await state.offload.run(_completion_prompts, state, body)
    rid = request_id(request, "cmpl")
    created = int(time.time())
    # Every prompt is checked (and echoed text decoded) before any is submitted.
    specs = []
    for i, ids in enumerate(prompts):
        specs.append(request_spec(
            state, f"{rid}-{i}" if len(prompts) > 1 else rid, ids, max_tokens=body.max_tokens, default_max=16,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens, penalties=_penalties(body), n=best_of,
            # best_of ranks the choices by their tokens' summed logprobs: it needs them.
            logprobs=max(lp_num, 0) if best_of > body.n else lp_num,
            prompt_logprobs_start=0 if body.echo and lp_num >= 0 else -1, prompt_param="prompt",
            names={**_NAMES, "logprobs": "logprobs"}))
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if body.stream:
        gen = Generation(state, specs[0])
        return StreamingResponse(_completion_events(state, gen, base, body.stream_options, echoes[0]),
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
    texts = Texts(state.tokenizer)
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
    for p, (gen, per_prompt) in enumerate(zip(gens, res)):
        usage["completion_tokens"] += sum(c.outcome.completion_tokens for c in per_prompt)  # best_of: all
        kept = per_prompt
        if best_of > body.n:  # the n most likely (summed logprobs), most likely first, as vLLM ranks them
            kept = sorted(per_prompt, key=lambda c: -sum(c.logprobs))[: body.n]
        for j, c in enumerate(kept):
            out = c.outcome
            lp = _completion_lp(texts, gen, echoes[p], c) if lp_num >= 0 else None
            choices.append({"index": p * body.n + j, "text": echoes[p] + c.text, "logprobs": lp,
                            "finish_reason": out.finish_reason, "matched_stop": out.matched_stop,
                            "stop_reason": out.matched_stop})
        usage["prompt_tokens"] += per_prompt[0].outcome.prompt_tokens
        usage["cached"] += max(c.outcome.cached_tokens for c in per_prompt)
    total = Outcome("stop", None, usage["prompt_tokens"], usage["completion_tokens"], usage["cached"])
    return JSONResponse({**base, "choices": choices, "usage": total.usage()}, headers={"x-request-id": rid})


def _completion_lp(texts: Texts, gen: Generation, echo: str, c: Collected) -> dict:
    """A completion choice's logprobs: with echo, the prompt's tokens first."""
    head = None
    if echo:
        head = _prompt_lp(texts, gen)
    out = completion_logprobs(texts, c.ids[: c.shown], c.logprobs, c.top_logprobs, offset=len(echo))
    return merge_completion(head, out)


def _prompt_lp(texts: Texts, gen: Generation) -> dict:
    tops = [t if i else None for i, t in enumerate(gen.prompt_top_logprobs or [])]
    return completion_logprobs(texts, gen.spec.input_ids, gen.prompt_logprobs or [], tops)


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


def _completion_events(state: RouterState, gen: Generation, base: dict, opts: StreamOptions | None,
                       echo: str) -> AsyncIterator[str]:
    """text_completion events: the echoed prompt per choice (if any, with the prompt's logprobs),
    a chunk per piece of text (with its tokens' logprobs when asked for), each choice's finish
    chunk, then (include_usage) a usage-only chunk; with include_usage the others carry
    `"usage": null`."""
    include_usage = bool(opts and opts.include_usage)
    want_lp = gen.spec.logprobs >= 0
    texts = Texts(state.tokenizer)
    offsets = [len(echo)] * gen.spec.n
    plen = len(gen.spec.input_ids)
    echoed = [False] * gen.spec.n

    def tc(index: int, text: str, finish_reason: str | None, lp: dict | None = None, **extra: Any) -> str:
        obj = {**base, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                                    **extra}]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    def echo_head(i: int) -> str:
        # Sent with the choice's first event: the prompt's logprobs are known by then.
        echoed[i] = True
        return tc(i, echo, None, _prompt_lp(texts, gen) if want_lp else None)

    def chunk(d: Delta) -> str | None:
        pre = echo_head(d.index) if echo and not echoed[d.index] else ""
        shown = d.shown_ids
        if not d.text and not (want_lp and shown):
            return pre or None
        lp = None
        if want_lp:
            lp = completion_logprobs(texts, shown, d.logprobs or [], d.top_logprobs or [], offset=offsets[d.index])
        offsets[d.index] += len(d.text)
        return pre + tc(d.index, d.text, None, lp)

    def finish(o: Outcome) -> list[str]:
        pre = [echo_head(o.index)] if echo and not echoed[o.index] else []
        return pre + [tc(o.index, "", o.finish_reason, matched_stop=o.matched_stop)]

    usage = (lambda outs: sse({**base, "choices": [], "usage": total_usage(outs, plen)})) if include_usage else None
    return event_stream(gen, [], chunk, finish, usage)
