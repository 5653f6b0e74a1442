"""SGLang's native /generate: text or input_ids in, `{"text", "output_ids", "meta_info"}` out.

Single or batch: `text: ["a", "b"]` / `input_ids: [[...], [...]]` (with `sampling_params`,
`rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num` either shared or one per
prompt) answers a list. `sampling_params.n > 1` answers n items per prompt, ordered as SGLang
orders them (choice-major: all prompts' choice 0, then choice 1, ...), each prompt prefilled once.

Streamed, every event carries the whole text and ids so far (SGLang's cumulative shape), not a
delta; `meta_info.finish_reason` is null until the last one, while `completion_tokens`,
`cached_tokens` and `spec_verify_ct` are the running counts on every event; a batch's events
carry `index`.

Every field of SGLang's GenerateReqInput and SamplingParams is accepted. The ones implemented
here work; the rest are accepted at their "nothing asked" values (null, false, empty) and are a
400 naming the field otherwise, never silently ignored (check_generate).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm53.server.router import structured
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Delta, Generation, Outcome, RouterState, start_all
from glm53.server.sampling import SamplingParams
from glm53.server.router.intake import (RequestFields, State, check_internal, ids_prompt, request_id,
                                        request_spec, sampling_params, stop_list, text_prompt_ids)
from glm53.server.router.logprobs import Texts, sglang_tokens, sglang_tops
from glm53.server.router.schemas import APIError, GenerateRequestBody, GenerateSamplingParams
from glm53.server.router.sse import (SSE_DONE, SSE_HEADERS, Collected, collect_all, event_stream, sse,
                                     until_disconnect)

router = APIRouter(route_class=BodyRoute)

# SGLang's names for SamplingParams / RequestSpec fields, for error params.
_NAMES = {"max_new_tokens": "sampling_params.max_new_tokens", "logprobs": "top_logprobs_num",
          "min_new_tokens": "sampling_params.min_new_tokens", "n": "sampling_params.n",
          "logit_bias": "sampling_params.logit_bias", "seed": "sampling_params.sampling_seed",
          **{k: f"sampling_params.{k}" for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                  "frequency_penalty", "repetition_penalty")}}


def generate_params(state: RouterState, sp: GenerateSamplingParams, grammar: str | None) -> SamplingParams:
    """SGLang's `sampling_params` (one prompt's) as SamplingParams."""
    return sampling_params(
        state, _NAMES, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.sampling_seed, max_new_tokens=sp.max_new_tokens, stop=stop_list(sp.stop),
        stop_token_ids=sp.stop_token_ids, ignore_eos=bool(sp.ignore_eos), grammar=grammar,
        skip_special_tokens=sp.skip_special_tokens is not False, no_stop_trim=bool(sp.no_stop_trim),
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias, min_new_tokens=sp.min_new_tokens)

# GenerateReqInput fields that change nothing here whatever their value (metadata and routing
# hints: there is no data-parallel rank to pick).
_METADATA = {"session_id", "log_metrics", "routing_key", "conversation_id", "no_logs",
             "custom_labels", "external_trace_header", "received_time", "routed_dp_rank", "data_parallel_rank"}
# The rest of GenerateReqInput: accepted only at null / false / 0 / empty; else 400 naming it.
_NOT_IMPLEMENTED = {
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
    "video_config", "token_ids_logprob", "return_sampling_mask", "return_flat_raw_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
    "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "disagg_prefill_dp_rank",
    "kv_router_hint", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority",
    "return_bytes", "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs", "num_items_assigned",
    "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
    "images_config", "multi_item_delimiter_indices",
}
# sampling_params fields accepted only at these values.
# json_schema, regex and ebnf are implemented (router/structured.py).
_SAMPLING_DEFAULTS = {"stop_regex": None, "structural_tag": None, "custom_params": None,
                      "spaces_between_special_tokens": (True, None)}


def _asks(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def check_generate(body: GenerateRequestBody) -> None:
    """The 400 for a field SGLang defines that glm53-serve does not implement (when it asks for
    something) or a field SGLang does not define."""
    for k, v in (body.model_extra or {}).items():
        if k in _METADATA:
            continue
        if k not in _NOT_IMPLEMENTED:
            raise APIError(400, f"{k}: unknown field (not one of SGLang's GenerateReqInput fields)", k)
        if _asks(v):
            raise APIError(400, f"{k} is not supported by glm53-serve", k)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    for sp in sps:
        if sp is None:
            continue
        for k, ok in _SAMPLING_DEFAULTS.items():
            v = getattr(sp, k)
            if v not in (ok if isinstance(ok, tuple) else (ok,)):
                raise APIError(400, f"sampling_params.{k} is not supported by glm53-serve", f"sampling_params.{k}")


def _per_item(value: Any, i: int, count: int, name: str) -> Any:
    """Item i of a field that is either shared by the batch or a list with one per prompt."""
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise APIError(400, f"{name} has {len(value)} entries for {count} prompts", name)
    return value[i]


@router.post("/generate")
async def generate_native(body: GenerateRequestBody, request: Request, state: State):
    check_internal(body)
    check_generate(body)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "exactly one of text and input_ids must be given", "text")
    field = "text" if body.text is not None else "input_ids"
    single = isinstance(body.text, str) or (body.input_ids is not None and (not body.input_ids
                                                                            or isinstance(body.input_ids[0], int)))
    prompts = [body.text if body.text is not None else body.input_ids] if single else list(body.text or
                                                                                           body.input_ids or [])
    if not prompts:
        raise APIError(400, f"{field} must not be an empty list", field)
    cap = state.cfg.router.max_running_requests
    if len(prompts) > cap:
        raise APIError(400, f"this server runs at most {cap} generations at once; got {len(prompts)} prompts", field)
    ids_list = await state.offload.run(_prompt_ids, state, prompts, field)
    count = len(prompts)
    base_rid = body.rid if isinstance(body.rid, str) else request_id(request, "gen")
    specs, with_text = [], body.return_text_in_logprobs
    for i, ids in enumerate(ids_list):
        sp = _per_item(body.sampling_params, i, count, "sampling_params") or GenerateSamplingParams()
        rid = (_per_item(body.rid, i, count, "rid") if isinstance(body.rid, list)
               else base_rid if single else f"{base_rid}_{i}")
        want = bool(_per_item(body.return_logprob, i, count, "return_logprob"))
        top = _per_item(body.top_logprobs_num, i, count, "top_logprobs_num") or 0
        start = _per_item(body.logprob_start_len, i, count, "logprob_start_len")
        start = -1 if start is None else start
        if start < -1:
            raise APIError(400, f"logprob_start_len must be >= -1, got {start}", "logprob_start_len")
        if top < 0:
            raise APIError(400, f"top_logprobs_num must be >= 0, got {top}", "top_logprobs_num")
        grammar = await structured.grammar(state, structured.from_sampling_params(sp))
        n = sp.n or 1
        # SGLang keys its prefix cache on both: either isolates (cache_salt alone as vLLM's does).
        salt = str(_per_item(body.cache_salt, i, count, "cache_salt") or "")
        extra = _per_item(body.extra_key, i, count, "extra_key")
        salt = f"{salt}\x00{extra}" if extra else salt
        if i and n != specs[0].n:
            raise APIError(400, "sampling_params.n must be the same for every prompt", "sampling_params.n")
        params = generate_params(state, sp, grammar)
        specs.append(request_spec(state, rid, ids, params, RequestFields(
            n=n, logprobs=top if want else -1, prompt_logprobs_start=start if want else -1, cache_salt=salt,
            default_max=128, prompt_param=field, names=_NAMES)))
    is_list = not single or specs[0].n > 1
    t0 = time.monotonic()
    gens = await start_all(state, specs, request)
    texts = Texts(state.tokenizer) if with_text else None
    if body.stream:
        if len(gens) == 1:
            return StreamingResponse(_events(gens[0], texts, t0, is_list, 0, count), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return StreamingResponse(_merged_events(gens, texts, t0, count), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    res = await until_disconnect(request, collect_all(gens))
    if res is None:
        return Response(status_code=499)
    items = []
    for j in range(specs[0].n):  # SGLang's order: choice-major
        for g, per_prompt in zip(gens, res):
            c = per_prompt[j]
            items.append(_item(g, c.text, c.ids, c, c.outcome, texts, t0, j))
    return JSONResponse(items if is_list else items[0])


def _prompt_ids(state: RouterState, prompts: list[Any], field: str) -> list[list[int]]:
    return [text_prompt_ids(state, p, field) if isinstance(p, str) else ids_prompt(state, list(p), field)
            for p in prompts]



def _item(gen: Generation, text: str, ids: list[int], lp: Collected | None, o: Outcome | None,
          texts: Texts | None, t0: float, choice: int, running: Delta | None = None) -> dict:
    spec = gen.spec
    meta = _meta_info(spec.rid if spec.n == 1 else f"{spec.rid}_{choice}", len(spec.input_ids), t0, o, len(ids),
                      running)
    if spec.logprobs >= 0:
        start = spec.prompt_logprobs_start
        meta["input_token_logprobs"] = (sglang_tokens(texts, spec.input_ids[start:], gen.prompt_logprobs or [])
                                        if start >= 0 else [])
        meta["output_token_logprobs"] = sglang_tokens(texts, ids, lp.logprobs if lp else [])
        if spec.logprobs > 0:
            meta["input_top_logprobs"] = sglang_tops(texts, gen.prompt_top_logprobs or [])
            meta["output_top_logprobs"] = sglang_tops(texts, lp.top_logprobs if lp else [])
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _meta_info(rid: str, prompt_tokens: int, t0: float, o: Outcome | None, n: int,
               running: Delta | None = None) -> dict:
    """SGLang's meta_info; `o` is None before the end (n: completion tokens so far, `running`:
    the last Delta, with the request's running cached-token and verify counts)."""
    fr = None
    if o is not None:
        fr = {"type": o.finish_reason}
        if o.finish_reason == "stop":
            fr["matched"] = o.matched_stop
        elif o.finish_reason == "length":
            fr["length"] = o.completion_tokens
    return {"id": rid, "finish_reason": fr, "prompt_tokens": prompt_tokens,
            "completion_tokens": o.completion_tokens if o else n,
            "cached_tokens": o.cached_tokens if o else running.cached_tokens if running else 0,
            "spec_verify_ct": o.spec_verify_ct if o else running.spec_verify_ct if running else 0,
            "e2e_latency": time.monotonic() - t0}


def _events(gen: Generation, texts: Texts | None, t0: float, indexed: bool, prompt_i: int,
            count: int) -> AsyncIterator[str]:
    """Cumulative events per choice: each holds all of that choice's text, ids (and logprobs) so
    far; with several items, `index` says which (choice-major, as the non-streamed list)."""
    state = [Collected() for _ in range(gen.spec.n)]
    last: list[Delta | None] = [None] * gen.spec.n  # each choice's latest Delta (running counts)

    def event(i: int, o: Outcome | None) -> str:
        c = state[i]
        obj = _item(gen, c.text, c.ids, c, o, texts, t0, i, last[i])
        if indexed:
            obj["index"] = i * count + prompt_i
        return sse(obj)

    def chunk(d: Delta) -> str:
        c = state[d.index]
        last[d.index] = d
        c.text += d.text
        c.ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.logprobs.extend(d.logprobs)
            c.top_logprobs.extend(d.top_logprobs or [])
        return event(d.index, None)

    return event_stream(gen, [], chunk, lambda o: [event(o.index, o)], None)


async def _merged_events(gens: list[Generation], texts: Texts | None, t0: float, count: int) -> AsyncIterator[str]:
    """A streamed batch: every prompt's events as they come, each with its `index`; one [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for ev in _events(g, texts, t0, True, i, count):
                if ev != SSE_DONE:
                    await queue.put(ev)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            ev = await queue.get()
            if ev is None:
                left -= 1
            else:
                yield ev
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.cancel()
