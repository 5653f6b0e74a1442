"""What every handler does with a request before it generates: check the model name and the
fields clients may not send or that are not supported yet, render chat messages, turn prompts
into checked token ids, name the request, and build the one RequestSpec both instances receive.

Each check raises APIError with the status, message and param the client sees. The prompt
functions (`chat_prompt_ids`, `text_prompt_ids`, `ids_prompt`) do the heavy work and run in the
router's worker threads (offload.py), never on the event loop.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import Depends, Request

from glm53.server.protocol import RequestSpec
from glm53.server.router.generation import RouterState
from glm53.server.router.parsers.chat import template_messages, template_tools, thinking_kwargs
from glm53.server.router.schemas import APIError, ChatCompletionRequest, TokenizeRequest, _Sampling
from glm53.server.sampling import SamplingError, SamplingParams
from glm53.server.tokenizer import ChatTemplateError


async def router_state(request: Request) -> RouterState:
    # Async so that FastAPI calls it inline rather than in its thread pool.
    return request.app.state.router


# A handler parameter `state: State` receives the app's RouterState.
State = Annotated[RouterState, Depends(router_state)]


def check_model(state: RouterState, model: str | None) -> str:
    """The served name to answer with: no model or the model path means the first served name."""
    if model is None or model in state.served_names or model == state.model_root:
        return state.served_names[0] if model is None or model == state.model_root else model
    raise APIError(404, f"The model `{model}` does not exist. Valid names: {', '.join(state.served_names)}.",
                   "model")


def check_internal(body: Any) -> None:
    bad = body.internal_fields()
    if bad:
        raise APIError(400, f"{bad[0]} is set by the router and may not be sent by clients", bad[0])


def check_unsupported(body: _Sampling) -> None:
    """OpenAI sampling fields that glm53-serve does not implement: a 400 naming the field rather
    than a silently different result."""
    if body.n != 1:
        raise APIError(400, "n > 1 is not supported yet", "n")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported yet", "logprobs")
    for k in ("presence_penalty", "frequency_penalty"):
        if getattr(body, k) not in (None, 0, 0.0):
            raise APIError(400, f"{k} is not supported yet", k)
    if body.repetition_penalty not in (None, 1, 1.0):
        raise APIError(400, "repetition_penalty is not supported yet", "repetition_penalty")


# Stop strings are matched on the event loop for every streamed token, each costing ~3 us
# (measured): 64 keep that under 0.2 ms a token; 100K would stall every stream 0.1 s a token.
MAX_STOP_STRINGS = 64
# Checked here on the event loop and carried to both instances with every request.
MAX_STOP_TOKEN_IDS = 1024


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported; got {len(stops)}", "stop")
    return stops


def request_spec(state: RouterState, rid: str, input_ids: list[int], *, max_tokens: int | None,
                 default_max: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
                 min_p: float | None, seed: int | None, stop: list[str], stop_token_ids: list[int] | None,
                 ignore_eos: bool, skip_special_tokens: bool = True, no_stop_trim: bool = False,
                 grammar: str | None = None, grammar_after: int | None = None) -> RequestSpec:
    """The one request object both instances receive: validated params, context-capped
    max_new_tokens, the model's eos ids."""
    prompt_len = len(input_ids)
    ctx = state.context_length
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty (it has no tokens).", "prompt")
    if prompt_len >= ctx:
        raise too_long(ctx, str(prompt_len), "messages")
    room = ctx - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif prompt_len + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                       "completion). Please reduce the length of the input or the completion.", "max_tokens")
    d = state.tokenizer.defaults
    vocab = state.tokenizer.vocab_size
    if len(stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported; got {len(stop_token_ids)}",
                       "stop_token_ids")
    for t in stop_token_ids or []:
        if not 0 <= t < vocab:
            raise APIError(400, f"stop_token_ids: token id {t} is outside the vocabulary (0..{vocab - 1})",
                           "stop_token_ids")
    try:
        params = SamplingParams(
            temperature=temperature if temperature is not None else (d.temperature if d.temperature is not None else 1.0),
            top_p=top_p if top_p is not None else (d.top_p if d.top_p is not None else 1.0),
            top_k=top_k if top_k is not None else (d.top_k if d.top_k not in (None, 0) else -1),
            min_p=min_p if min_p is not None else (d.min_p or 0.0),
            seed=seed, max_new_tokens=max_tokens, stop=stop, stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos, skip_special_tokens=skip_special_tokens, no_stop_trim=no_stop_trim,
            grammar=grammar, grammar_after=grammar_after,
        )
    except SamplingError as e:
        raise APIError(400, str(e), e.param) from None
    return RequestSpec(rid, input_ids, params, list(state.tokenizer.eos_token_ids))


def too_long(ctx: int, n: str, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {ctx} tokens. However, your request has "
                    f"{n} input tokens. Please reduce the length of the input.", param)


def text_prompt_ids(state: RouterState, text: str, param: str) -> list[int]:
    """The token ids of a text prompt. One that certainly cannot fit the context (more bytes than
    context_length tokens can cover) is refused without tokenizing it."""
    at_least = state.tokenizer.min_tokens(text)
    if at_least >= state.context_length:
        raise too_long(state.context_length, f"at least {at_least}", param)
    return state.tokenizer.encode(text)


def chat_prompt_ids(state: RouterState, body: ChatCompletionRequest) -> list[int]:
    return text_prompt_ids(state, render_chat(state, body), "messages")


def ids_prompt(state: RouterState, ids: list[int], param: str) -> list[int]:
    """A token-id prompt: its length against the context first (cheap), then the vocabulary."""
    if len(ids) >= state.context_length:
        raise too_long(state.context_length, str(len(ids)), param)
    return check_ids(state, ids, param)


def check_ids(state: RouterState, ids: list[int], param: str) -> list[int]:
    vocab = state.tokenizer.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise APIError(400, f"token id {t} is outside the vocabulary (0..{vocab - 1})", param)
    return ids


def render_chat(state: RouterState, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The prompt text of chat messages (the model's chat template); text content parts only."""
    msgs = [m.model_dump(exclude_none=True) for m in body.messages or []]
    for i, m in enumerate(msgs):
        if isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"]):
            raise APIError(400, "only text content parts are supported", f"messages[{i}].content")
    kwargs = {**thinking_kwargs(body), **(body.chat_template_kwargs or {})}
    for k in ("messages", "tools", "add_generation_prompt"):
        kwargs.pop(k, None)
    if isinstance(body, ChatCompletionRequest) and body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    msgs, tools = template_messages(msgs), template_tools(body)
    try:
        return state.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=body.add_generation_prompt,
                                                   **kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages") from None


def request_id(request: Request, prefix: str) -> str:
    """The client's x-request-id, else a fresh `<prefix>-<hex>`."""
    return request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
