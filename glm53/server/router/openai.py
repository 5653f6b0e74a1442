"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}.

Responses follow OpenAI's shapes with vLLM/SGLang's extras (`matched_stop`, `stop_reason`,
`continuous_usage_stats`). A non-streamed request whose client goes away ends with a 499 (for the
access log) and its room is aborted. `n` choices share one prefill (one room, n decode
sequences); logprobs are log_softmax of the model's raw logits (logprobs.py).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm53.server.protocol import MAX_CHOICES
from glm53.server.router import structured
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Delta, Generation, Outcome, RouterState, admit, start_all, total_usage
from glm53.server.router.intake import (RequestFields, State, chat_prompt_ids, check_internal, check_model,
                                        check_unsupported, ids_prompt, request_id, request_spec, sampling_params,
                                        stop_list, text_prompt_ids)
from glm53.server.router.logprobs import Texts, chat_content, completion_logprobs, merge_completion
from glm53.server.router.parsers.chat import ChatParsing, check_tool_choice
from glm53.server.router.parsers.reasoning import THINK_END
from glm53.server.router.schemas import APIError, ChatCompletionRequest, CompletionRequest, StreamOptions, _Sampling
from glm53.server.sampling import SamplingParams
from glm53.server.router.sse import (SSE_HEADERS, Collected, collect, collect_all, event_stream, sse,
                                     until_disconnect)

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


def openai_params(state: RouterState, body: _Sampling, names: dict[str, str], max_tokens: int | None,
                  grammar: str | None, grammar_after: int | None = None) -> SamplingParams:
    """The SamplingParams of a chat or completions body (their shared fields)."""
    return sampling_params(
        state, names, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, max_new_tokens=max_tokens, stop=stop_list(body.stop), stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, grammar=grammar,
        grammar_after=grammar_after, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias, min_new_tokens=body.min_tokens, no_stop_trim=body.include_stop_str_in_output)


def chat_request(state: RouterState, body: ChatCompletionRequest, grammar: str | None,
                 grammar_after: int | None) -> tuple[SamplingParams, RequestFields]:
    """A chat body in engine terms."""
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    names = {**_NAMES, "logprobs": "top_logprobs", "max_new_tokens": max_field}
    params = openai_params(state, body, names, getattr(body, max_field), grammar, grammar_after)
    return params, RequestFields(n=body.n, logprobs=(body.top_logprobs or 0) if body.logprobs else -1,
                                 cache_salt=body.cache_salt or "", prompt_param="messages", names=names)


def completion_request(state: RouterState, body: CompletionRequest, grammar: str | None, best_of: int,
                       lp_num: int) -> tuple[SamplingParams, RequestFields]:
    """A completions body in engine terms (the same for each of its prompts)."""
    names = {**_NAMES, "logprobs": "logprobs"}
    params = openai_params(state, body, names, body.max_tokens, grammar)
    # best_of ranks the choices by their tokens' summed logprobs: it needs them.
    return params, RequestFields(n=best_of, logprobs=max(lp_num, 0) if best_of > body.n else lp_num,
                                 prompt_logprobs_start=0 if body.echo and lp_num >= 0 else -1,
                                 cache_salt=body.cache_salt or "", default_max=16, prompt_param="prompt",
                                 names=names)


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
    rid = request_id(request, "chatcmpl")
    spec = request_spec(state, rid, ids, *chat_request(state, body, grammar, after))
    _check_capacity(state, body.n, 1)
    gen = await admit(state, spec, request)
    created = int(time.time())
    if body.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return StreamingResponse(_chat_events(state, gen, base, body.stream_options, parsing, body),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})
    res = await until_disconnect(request, collect(gen))
    if res is None:
        return Response(status_code=499)
    texts = Texts(state.tokenizer, body.return_tokens_as_token_ids)
    choices = []
    for i, c in enumerate(res):
        out = c.outcome
        lp = None
        if spec.logprobs >= 0:
            lp = {"content": chat_content(texts, c.ids[: c.shown], c.logprobs, c.top_logprobs)}
        message, called = parsing.message(c.text)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": _finish_reason(out, called),
                        "matched_stop": out.matched_stop, "stop_reason": out.matched_stop,
                        **({"token_ids": c.ids} if body.return_token_ids else {})})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": _chat_usage(state, parsing, [c.outcome for c in res], [c.ids for c in res],
                                                 len(ids)),
        **({"prompt_token_ids": ids} if body.return_token_ids else {}),
    }, headers={"x-request-id": rid})


def _finish_reason(out: Outcome, called: bool) -> str:
    # "tool_calls" only when a call was completed and the model ended its turn itself.
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


def _chat_usage(state: RouterState, parsing: ChatParsing, outs: list[Outcome], ids: list[list[int]],
                plen: int) -> dict:
    """Usage of all choices, with their reasoning tokens counted."""
    usage = total_usage(outs, plen)
    usage["completion_tokens_details"]["reasoning_tokens"] = sum(
        parsing.reasoning_tokens(i, state.tokenizer.token_to_id) for i in ids)
    return usage


def _check_capacity(state: RouterState, n: int, prompts: int) -> None:
    # More generations than the router ever runs at once can never be admitted: a 400, where a
    # 503 ("retry later") would be a promise no retry keeps. A room of n choices counts once.
    cap = state.cfg.router.max_running_requests
    if prompts > cap:
        raise APIError(400, f"This request asks for {prompts} generations, but this server runs at most {cap} at "
                       f"once (router.max_running_requests). Send at most {cap} per request.", "prompt")


def _chat_events(state: RouterState, gen: Generation, base: dict, opts: StreamOptions | None, parsing: ChatParsing,
                 body: ChatCompletionRequest) -> AsyncIterator[str]:
    """chat.completion.chunk events: the assistant role per choice, deltas per piece of output
    (reasoning, content or tool-call pieces: parsers/chat.py; the tokens' logprobs and, with
    return_token_ids, their ids ride on the piece that shows them), each choice's finish chunk,
    then (include_usage) a usage-only chunk. With continuous_usage_stats every chunk carries the
    running usage; with include_usage alone, `"usage": null`. With return_token_ids the role
    chunks carry the prompt's ids."""
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
    want_lp = gen.spec.logprobs >= 0
    want_ids = body.return_token_ids
    prompt = gen.spec.input_ids
    plen = len(prompt)
    texts = Texts(state.tokenizer, body.return_tokens_as_token_ids)
    counted = 0  # completion tokens so far (all choices), stop tokens included
    n = gen.spec.n
    streams = [parsing.stream() for _ in range(n)]  # one parser state per choice
    out_ids: list[list[int]] = [[] for _ in range(n)]

    def with_usage(obj: dict, k: int | None) -> dict:
        if include_usage:
            obj["usage"] = ({"prompt_tokens": plen, "completion_tokens": k, "total_tokens": plen + k}
                            if continuous and k is not None else None)
        return obj

    def delta_events(index: int, deltas: list[dict], lp: dict | None, ids: list[int] | None = None) -> list[str]:
        # Logprobs and ids go with the first piece; with no piece (a marker held back, or no
        # text at all), on an empty delta.
        if (lp is not None or ids) and not deltas:
            deltas = [{"content": ""}]
        return [sse(with_usage({**base, "choices": [{"index": index, "delta": d, "logprobs": lp if j == 0 else None,
                                                      "finish_reason": None,
                                                      **({"token_ids": ids if j == 0 else []} if ids else {})}]},
                               counted))
                for j, d in enumerate(deltas)]

    def chunk(d: Delta) -> str | None:
        nonlocal counted
        counted += len(d.token_ids)
        out_ids[d.index].extend(d.token_ids)
        shown = d.shown_ids
        lp = ({"content": chat_content(texts, shown, d.logprobs or [], d.top_logprobs or [])}
              if want_lp and shown else None)
        pieces = streams[d.index].feed(d.text) if d.text else []
        return "".join(delta_events(d.index, pieces, lp, d.token_ids if want_ids else None)) or None

    def finish(o: Outcome) -> list[str]:
        s = streams[o.index]
        return [*delta_events(o.index, s.finish(), None),
                sse(with_usage({**base, "choices": [{"index": o.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": _finish_reason(o, s.complete_calls > 0),
                                                     "matched_stop": o.matched_stop}]},
                               counted))]

    usage = (lambda outs: sse({**base, "choices": [], "usage": _chat_usage(state, parsing, outs, out_ids, plen)})) \
        if include_usage else None
    head = [sse(with_usage({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}],
                            **({"prompt_token_ids": prompt} if want_ids else {})}, 0))
            for i in range(n)]
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
    ask = structured.from_response_format((body.model_extra or {}).get("response_format"))
    prompts, echoes = await state.offload.run(_completion_prompts, state, body)
    grammar = await structured.grammar(state, ask)
    rid = request_id(request, "cmpl")
    created = int(time.time())
    # Every prompt is checked (and echoed text decoded) before any is submitted.
    params, fields = completion_request(state, body, grammar, best_of, lp_num)
    specs = [request_spec(state, f"{rid}-{i}" if len(prompts) > 1 else rid, ids, params, fields)
             for i, ids in enumerate(prompts)]
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if body.stream:
        gen = await admit(state, specs[0], request)
        return StreamingResponse(_completion_events(state, gen, base, body.stream_options, echoes[0], body),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})
    gens = await start_all(state, specs, request)

    res = await until_disconnect(request, collect_all(gens))
    if res is None:
        return Response(status_code=499)
    texts = Texts(state.tokenizer, body.return_tokens_as_token_ids)
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
                            "stop_reason": out.matched_stop,
                            **({"prompt_token_ids": prompts[p], "token_ids": c.ids} if body.return_token_ids else {})})
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



def _completion_events(state: RouterState, gen: Generation, base: dict, opts: StreamOptions | None,
                       echo: str, body: CompletionRequest) -> AsyncIterator[str]:
    """text_completion events: the echoed prompt per choice (if any, with the prompt's logprobs),
    a chunk per piece of text (with its tokens' logprobs when asked for, and with
    return_token_ids its ids; a choice's first chunk also the prompt's), each choice's finish
    chunk, then (include_usage) a usage-only chunk. With continuous_usage_stats every chunk
    carries the running usage (as chat's); with include_usage alone, `"usage": null`."""
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
    counted = 0  # completion tokens so far (all choices), stop tokens included
    want_lp = gen.spec.logprobs >= 0
    want_ids = body.return_token_ids
    texts = Texts(state.tokenizer, body.return_tokens_as_token_ids)
    offsets = [len(echo)] * gen.spec.n
    plen = len(gen.spec.input_ids)
    echoed = [False] * gen.spec.n
    prompt_sent = [not want_ids] * gen.spec.n

    def tc(index: int, text: str, finish_reason: str | None, lp: dict | None = None, **extra: Any) -> str:
        if want_ids:
            extra.setdefault("token_ids", [])
            if not prompt_sent[index]:
                prompt_sent[index] = True
                extra["prompt_token_ids"] = gen.spec.input_ids
        obj = {**base, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                                    **extra}]}
        if include_usage:
            obj["usage"] = ({"prompt_tokens": plen, "completion_tokens": counted, "total_tokens": plen + counted}
                            if continuous else None)
        return sse(obj)

    def echo_head(i: int) -> str:
        # Sent with the choice's first event: the prompt's logprobs are known by then.
        echoed[i] = True
        return tc(i, echo, None, _prompt_lp(texts, gen) if want_lp else None)

    def chunk(d: Delta) -> str | None:
        nonlocal counted
        pre = echo_head(d.index) if echo and not echoed[d.index] else ""
        counted += len(d.token_ids)
        shown = d.shown_ids
        if not d.text and not (want_lp and shown) and not (want_ids and d.token_ids):
            return pre or None
        lp = None
        if want_lp:
            lp = completion_logprobs(texts, shown, d.logprobs or [], d.top_logprobs or [], offset=offsets[d.index])
        offsets[d.index] += len(d.text)
        return pre + tc(d.index, d.text, None, lp, **({"token_ids": d.token_ids} if want_ids else {}))

    def finish(o: Outcome) -> list[str]:
        pre = [echo_head(o.index)] if echo and not echoed[o.index] else []
        return pre + [tc(o.index, "", o.finish_reason, matched_stop=o.matched_stop)]

    usage = (lambda outs: sse({**base, "choices": [], "usage": total_usage(outs, plen)})) if include_usage else None
    return event_stream(gen, [], chunk, finish, usage)
