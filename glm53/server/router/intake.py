"""What every handler does with a request before it generates: check the model name and the
fields clients may not send or that are not supported yet, render chat messages, turn prompts
into checked token ids, name the request, and build the one RequestSpec both instances receive
(each API family maps its body to SamplingParams + RequestFields in one function and passes them on).

Each check raises APIError with the status, message and param the client sees. The prompt
functions (`chat_prompt_ids`, `text_prompt_ids`, `ids_prompt`) do the heavy work and run in the
router's worker threads (offload.py), never on the event loop.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from fastapi import Depends, Request

from glm53.server.protocol import MAX_CHOICES, MAX_TOP_LOGPROBS, RequestSpec
from glm53.server.router.generation import RouterState
from glm53.server.router.parsers.chat import template_messages, template_tools, thinking_kwargs
from glm53.server.router.schemas import APIError, ChatCompletionRequest, TokenizeRequest, _Sampling
from glm53.server.sampling import SamplingError, SamplingParams
from glm53.server.tokenizer import ChatTemplateError, NoTokenizer


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


# vLLM/SGLang extensions that ask for more output than this server returns: unknown fields are
# otherwise ignored (as vLLM does), but these would then silently be missing from the answer.
ASKS_FOR_MORE = ("prompt_logprobs", "return_hidden_states", "return_prompt_token_ids")
# vLLM extensions that would change what is generated (or from which prompt): ignored, they would
# silently give another answer than the one asked for. A field at its default value passes.
CHANGES_THE_ANSWER = {"allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None,
                      "use_beam_search": False, "length_penalty": 1.0, "guided_json": None, "guided_regex": None,
                      "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
                      "prompt_embeds": None, "spaces_between_special_tokens": True,
                      "echo": False}  # chat's echo (completions declare theirs)


def check_unsupported(body: _Sampling) -> None:
    """OpenAI fields whose values glm53-serve cannot honour: a 400 naming the field rather than a
    silently different result."""
    if body.n > MAX_CHOICES:
        raise APIError(400, f"n must be at most {MAX_CHOICES}, got {body.n}", "n")
    extra = body.model_extra or {}
    for k in ASKS_FOR_MORE:
        if extra.get(k) not in (None, False, 0):
            raise APIError(400, f"{k} is not supported (use echo with logprobs for prompt logprobs on "
                           "/v1/completions, or return_logprob on /generate)" if k == "prompt_logprobs"
                           else f"{k} is not supported", k)
    for k, default in CHANGES_THE_ANSWER.items():
        if k in extra and extra[k] is not None and extra[k] != default:
            hint = " (use response_format)" if k.startswith("guided_") or k == "structured_outputs" else ""
            raise APIError(400, f"{k} is not supported{hint}", k)


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


@dataclass
class RequestFields:
    """What a request asks for beside its SamplingParams (protocol.RequestSpec's other fields),
    and the names its client knows the fields by (SamplingParams / RequestSpec name -> the
    client's, e.g. min_new_tokens -> min_tokens) for error params."""

    n: int = 1
    logprobs: int = -1  # top logprobs per output token; -1: none
    prompt_logprobs_start: int = -1
    cache_salt: str = ""
    default_max: int | None = None  # max_new_tokens when the client set none (None: the rest of the context)
    prompt_param: str = "messages"  # the field the prompt came in (the context-length error names it)
    names: dict[str, str] = field(default_factory=dict)

    def name(self, key: str) -> str:
        return self.names.get(key, key)


def sampling_params(state: RouterState, names: dict[str, str], **given: Any) -> SamplingParams:
    """SamplingParams from the fields a client set (None: not set; the model's generation config
    supplies temperature, top_p, top_k and min_p, SamplingParams the rest; max_new_tokens stays
    None until request_spec knows the prompt). A bad value is a 400 naming the client's field."""
    d = state.tokenizer.defaults
    defaults = {"temperature": d.temperature if d.temperature is not None else 1.0,
                "top_p": d.top_p if d.top_p is not None else 1.0,
                "top_k": d.top_k if d.top_k not in (None, 0) else -1,
                "min_p": d.min_p or 0.0, "max_new_tokens": None}
    try:
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})
    except SamplingError as e:
        raise APIError(400, str(e), names.get(e.param, e.param)) from None


def request_spec(state: RouterState, rid: str, input_ids: list[int], params: SamplingParams,
                 fields: RequestFields) -> RequestSpec:
    """The one request object both instances receive: the checks that need the prompt and the
    model (context length, vocabulary), max_new_tokens resolved and capped by the context, the
    model's eos ids."""
    prompt_len = len(input_ids)
    ctx = state.context_length
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty (it has no tokens).", fields.prompt_param)
    if prompt_len >= ctx:
        raise too_long(ctx, str(prompt_len), fields.prompt_param)
    room = ctx - prompt_len
    max_tokens = params.max_new_tokens
    if max_tokens is None:
        max_tokens = room if fields.default_max is None else min(fields.default_max, room)
    elif prompt_len + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                       "completion). Please reduce the length of the input or the completion.",
                       fields.name("max_new_tokens"))
    params = replace(params, max_new_tokens=max_tokens)
    if params.stop and not state.tokenizer.has_text:
        raise APIError(400, str(NoTokenizer("stop strings")), fields.name("stop"))
    vocab = state.tokenizer.vocab_size
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported; got "
                       f"{len(params.stop_token_ids)}", "stop_token_ids")
    for t in params.stop_token_ids:
        if not 0 <= t < vocab:
            raise APIError(400, f"stop_token_ids: token id {t} is outside the vocabulary (0..{vocab - 1})",
                           "stop_token_ids")
    if not 1 <= fields.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {fields.n}", fields.name("n"))
    if fields.logprobs > MAX_TOP_LOGPROBS:
        raise APIError(400, f"at most {MAX_TOP_LOGPROBS} top logprobs are supported, got {fields.logprobs}",
                       fields.names.get("logprobs", "top_logprobs"))
    if len(params.logit_bias) > vocab:
        raise APIError(400, "logit_bias has more entries than the vocabulary", fields.name("logit_bias"))
    for t in params.logit_bias:
        if t >= vocab:
            raise APIError(400, f"logit_bias: token id {t} is outside the vocabulary (0..{vocab - 1})",
                           fields.name("logit_bias"))
    if params.min_new_tokens > params.max_new_tokens:
        raise APIError(400, f"min_new_tokens ({params.min_new_tokens}) is more than the {params.max_new_tokens} "
                       "tokens this request may generate", fields.name("min_new_tokens"))
    if fields.prompt_logprobs_start >= prompt_len:
        raise APIError(400, f"logprob_start_len ({fields.prompt_logprobs_start}) must be less than the prompt's "
                       f"{prompt_len} tokens", "logprob_start_len")
    return RequestSpec(rid, input_ids, params, list(state.tokenizer.eos_token_ids), n=fields.n,
                       logprobs=fields.logprobs, prompt_logprobs_start=fields.prompt_logprobs_start,
                       cache_salt=fields.cache_salt)


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
    for k in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(k, None)
    add_prompt = body.add_generation_prompt
    if body.continue_final_message:
        if "add_generation_prompt" in body.model_fields_set and add_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           "continue_final_message")
        add_prompt = False
    if isinstance(body, ChatCompletionRequest) and body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    msgs, tools = template_messages(msgs), template_tools(body)
    try:
        return state.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_prompt,
                                                   continue_final_message=body.continue_final_message, **kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages") from None


def request_id(request: Request, prefix: str) -> str:
    """The client's x-request-id, else a fresh `<prefix>-<hex>`."""
    return request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
