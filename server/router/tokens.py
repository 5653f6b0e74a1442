"""The tokenizer endpoints in vLLM's shape: /tokenize and /detokenize, each with and without the
/v1 prefix, and /tokenizer_info. (The module is not called tokenize.py: that is a stdlib name.)
"""

from __future__ import annotations

from fastapi import APIRouter

from glm53.server.router.intake import State, check_ids, check_model, render_chat
from glm53.server.router.schemas import APIError, DetokenizeRequest, TokenizeRequest

router = APIRouter()


async def tokenize(body: TokenizeRequest, state: State) -> dict:
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "exactly one of prompt and messages must be given", "prompt")
    text = body.prompt if body.prompt is not None else render_chat(state, body)
    ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.context_length}


async def detokenize(body: DetokenizeRequest, state: State) -> dict:
    check_model(state, body.model)
    return {"prompt": state.tokenizer.decode(check_ids(state, body.tokens, "tokens"), False)}


for _prefix in ("", "/v1"):
    router.post(_prefix + "/tokenize")(tokenize)
    router.post(_prefix + "/detokenize")(detokenize)


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict:
    t = state.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": t.eos_token, "bos_token": t.bos_token,
            "pad_token": t.pad_token, "chat_template": t.chat_template, "model_max_length": state.context_length,
            "vocab_size": t.vocab_size, "eos_token_ids": t.eos_token_ids}
