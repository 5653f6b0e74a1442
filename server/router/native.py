"""SGLang's native /generate: text or input_ids in, `{"text", "output_ids", "meta_info"}` out.

Streamed, every event carries the whole text and ids so far (SGLang's cumulative shape), not a
delta; `meta_info.finish_reason` is null until the last one.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm53.server.router import structured
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Delta, Generation, Outcome
from glm53.server.router.intake import (State, check_internal, ids_prompt, request_id, request_spec, stop_list,
                                        text_prompt_ids)
from glm53.server.router.schemas import APIError, GenerateRequestBody, GenerateSamplingParams
from glm53.server.router.sse import SSE_HEADERS, collect, event_stream, sse, until_disconnect

router = APIRouter(route_class=BodyRoute)


@router.post("/generate")
async def generate_native(body: GenerateRequestBody, request: Request, state: State):
    check_internal(body)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "exactly one of text and input_ids must be given", "text")
    ids = await (state.offload.run(ids_prompt, state, list(body.input_ids), "input_ids") if body.input_ids is not None
                 else state.offload.run(text_prompt_ids, state, body.text or "", "text"))
    sp = body.sampling_params or GenerateSamplingParams()
    grammar = await structured.grammar(state, structured.from_sampling_params(sp))
    rid = body.rid or request_id(request, "gen")
    spec = request_spec(state, rid, ids, max_tokens=sp.max_new_tokens, default_max=128,
                        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                        seed=sp.sampling_seed, stop=stop_list(sp.stop), stop_token_ids=sp.stop_token_ids,
                        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
                        no_stop_trim=sp.no_stop_trim, grammar=grammar)
    gen = Generation(state, spec)
    t0 = time.monotonic()
    if body.stream:
        return StreamingResponse(_events(gen, rid, len(ids), t0), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    res = await until_disconnect(request, collect(gen))
    if res is None:
        return Response(status_code=499)
    text, out_ids, out = res
    return JSONResponse({"text": text, "output_ids": out_ids,
                         "meta_info": _meta_info(rid, len(ids), t0, out, len(out_ids))})


def _meta_info(rid: str, prompt_tokens: int, t0: float, o: Outcome | None, n: int) -> dict:
    """SGLang's meta_info; `o` is None before the end (n: completion tokens so far)."""
    fr = None
    if o is not None:
        fr = {"type": o.finish_reason}
        if o.finish_reason == "stop":
            fr["matched"] = o.matched_stop
        elif o.finish_reason == "length":
            fr["length"] = o.completion_tokens
    return {"id": rid, "finish_reason": fr, "prompt_tokens": prompt_tokens,
            "completion_tokens": o.completion_tokens if o else n,
            "cached_tokens": o.cached_tokens if o else 0, "spec_verify_ct": o.spec_verify_ct if o else 0,
            "e2e_latency": time.monotonic() - t0}


def _events(gen: Generation, rid: str, prompt_tokens: int, t0: float) -> AsyncIterator[str]:
    """Cumulative events: each one holds all the text and ids so far."""
    text, ids = "", []

    def event(o: Outcome | None) -> str:
        return sse({"text": text, "output_ids": list(ids),
                    "meta_info": _meta_info(rid, prompt_tokens, t0, o, len(ids))})

    def chunk(d: Delta) -> str:
        nonlocal text
        text += d.text
        ids.extend(d.token_ids)
        return event(None)

    return event_stream(gen, [], chunk, lambda o: [event(o)], None)
