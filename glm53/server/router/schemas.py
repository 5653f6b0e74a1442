"""Request bodies of the HTTP API (pydantic) and the error envelope, shared by every API family.

Field names follow OpenAI, with vLLM/SGLang extensions (top_k, min_p, ignore_eos,
stop_token_ids, skip_special_tokens, chat_template_kwargs). Errors are vLLM's nested OpenAI
shape: {"error": {"message", "type", "param", "code"}} with `type` vLLM's name for the status
(`BadRequestError`, `NotFoundError`, ...: ERROR_TYPES) and `code` the status. Unknown fields are
ignored (as vLLM does), except the router's internal PD fields, which clients may not set.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INTERNAL_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# vLLM's error `type` per status (its create_error_response: BadRequestError, NotFoundError,
# UnprocessableEntityError, InternalServerError, NotImplementedError); the other statuses this
# server answers follow the same pattern, with the OpenAI SDK's class names where it has one.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               409: "ConflictError", 413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               501: "NotImplementedError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}


def error_type(status: int) -> str:
    """vLLM's `type` for an error status (a status not listed: its reason phrase in CamelCase + Error)."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"
    return "".join(w[:1].upper() + w[1:] for w in phrase.replace("-", " ").split()) + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _text(message), "type": error_type(status),
                      "param": None if param is None else _text(param), "code": status}}


def _text(s: str) -> str:
    # An error may quote client input; a lone surrogate in it must not break the response.
    return s.encode("utf-8", "replace").decode("utf-8")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    def internal_fields(self) -> list[str]:
        # A null one asks for nothing (SGLang clients may send every field with its default).
        extra = self.model_extra or {}
        return [k for k in INTERNAL_FIELDS if extra.get(k) is not None]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url"]


class FunctionCall(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class _Sampling(_Body):
    """Fields shared by chat and completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    logprobs: Union[bool, int, None] = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM: reuse only prefix-cache entries made with the same salt
    # vLLM: the prompt's and each choice's token ids beside the text (`prompt_token_ids`,
    # `token_ids`; streamed: the prompt's with a choice's first chunk, each chunk its own ids)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:N"
    include_stop_str_in_output: bool = False  # vLLM: keep the matched stop string (SGLang's no_stop_trim)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    # vLLM / Hugging Face: the answer continues the last message (an assistant turn the client
    # began) instead of opening a new turn; the template's end-of-turn markup after it is cut.
    continue_final_message: bool = False


class CompletionRequest(_Sampling):
    # Tried in order, with strict ints so that ["1"] stays text: pydantic's default (smart)
    # union tries every member on every element, 12x slower on a long id list.
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]] = Field(union_mode="left_to_right")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateSamplingParams(BaseModel):
    """SGLang's `sampling_params`: every field SGLang defines is accepted (an unknown one is a
    400); the ones glm53-serve does not implement are a 400 naming them when they ask for
    something (native.check_generate), never ignored."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    sampling_seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1)
    # Accepted only at their "nothing asked" values (None / True for spaces_between_special_tokens):
    stop_regex: Union[str, list[str], None] = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    spaces_between_special_tokens: bool | None = True
    # A streaming hint: the instances' stream_interval applies.
    stream_interval: int | None = None


IntOrList = Union[int, list[int], None]


class GenerateRequestBody(_Body):
    """SGLang's GenerateReqInput: single or batch (`text: [...]`, `input_ids: [[...], ...]`, and
    the per-item fields as lists). Fields beyond those typed here are SGLang's own, checked by
    native.check_generate (accepted at their defaults, else a 400 naming them)."""

    text: Union[str, list[str], None] = None
    input_ids: Union[list[StrictInt], list[list[StrictInt]], None] = Field(default=None, union_mode="left_to_right")
    sampling_params: Union[GenerateSamplingParams, list[GenerateSamplingParams], None] = None
    stream: bool = False
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: IntOrList = None
    top_logprobs_num: IntOrList = None
    return_text_in_logprobs: bool = False
    # Prefix-cache isolation: requests reuse only KV cached under the same (cache_salt, extra_key).
    cache_salt: Union[str, list[str], None] = None
    extra_key: Union[str, list[str], None] = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
