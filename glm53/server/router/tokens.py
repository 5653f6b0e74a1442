"""The tokenizer endpoints in vLLM's shape: /tokenize and /detokenize, each with and without the
/v1 prefix, and /tokenizer_info. (The module is not called tokenize.py: that is a stdlib name.)

Like vLLM, /tokenize has no context limit: any body within router.max_request_bytes is
tokenized whole, in a worker thread, which also renders the JSON answer (a list of millions of
ids would otherwise be serialized on the event loop).
"""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi.responses import Response

from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import RouterState
from glm53.server.router.intake import State, check_ids, check_model, render_chat
from glm53.server.router.schemas import APIError, DetokenizeRequest, TokenizeRequest
from glm53.server.tokenizer import NoTokenizer

router = APIRouter(route_class=BodyRoute)
_SLICE = 65536


async def tokenize(body: TokenizeRequest, state: State) -> Response:
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "exactly one of prompt and messages must be given", "prompt")
    return Response(await state.offload.run(_tokenize, state, body), media_type="application/json")


def _tokenize(state: RouterState, body: TokenizeRequest) -> bytes:
    text = body.prompt if body.prompt is not None else render_chat(state, body)
    ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    # The id list in slices: json.dumps holds the GIL for the whole list it is given, and the
    # event loop needs it back every few milliseconds.
    tokens = ",".join(json.dumps(ids[i:i + _SLICE])[1:-1] for i in range(0, len(ids), _SLICE))
    return (f'{{"tokens":[{tokens}],"count":{len(ids)},"max_model_len":{state.context_length}}}').encode()


async def detokenize(body: DetokenizeRequest, state: State) -> Response:
    check_model(state, body.model)
    return Response(await state.offload.run(_detokenize, state, body), media_type="application/json")


def _detokenize(state: RouterState, body: DetokenizeRequest) -> bytes:
    if not state.tokenizer.has_text:
        raise NoTokenizer("/detokenize")
    return _json({"prompt": state.tokenizer.decode(check_ids(state, body.tokens, "tokens"), False)})


def _json(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


for _prefix in ("", "/v1"):
    router.post(_prefix + "/tokenize")(tokenize)
    router.post(_prefix + "/detokenize")(detokenize)


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict:
    t = state.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": t.eos_token, "bos_token": t.bos_token,
            "pad_token": t.pad_token, "chat_template": t.chat_template, "model_max_length": state.context_length,
            "vocab_size": t.vocab_size, "eos_token_ids": t.eos_token_ids}
