"""Operations endpoints: /health (also as /ready), /health_generate, /server_info (also as
/get_server_info), /get_model_info (also as /model_info), /version and the Prometheus /metrics.

The SGLang ones answer in SGLang's shapes: /get_model_info its model fields (`model_path`,
`tokenizer_path`, `is_generation`, `preferred_sampling_params`, `weight_version`, `model_type`,
`architectures`, ...); /get_server_info its ServerArgs names for this deployment (`model_path`,
`served_model_name`, `tp_size`, `page_size`, `disaggregation_mode`, `speculative_algorithm`, ...),
the scheduler's `max_total_num_tokens` and `max_req_input_len`, `internal_states` (one entry, with
`avg_spec_accept_length` once speculative steps were seen) and `version`, plus this router's own
view (`router`, `prefill`, `decode`: every instance and its load); /version `{"version"}`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from glm53.server.protocol import RequestSpec
from glm53.server.router.bodies import BodyRoute
from glm53.server.router.generation import Generation
from glm53.server.router.intake import State
from glm53.server.router.schemas import APIError, error_body
from glm53.server.router.sse import collect
from glm53.server.sampling import SamplingParams

router = APIRouter(route_class=BodyRoute)


# 200 while at least one prefill and one decode instance answer their health checks. (Comments,
# not docstrings, on handlers: a docstring would become the endpoint's OpenAPI description.)
@router.get("/health")
async def health(state: State):
    missing = [r for r in ("prefill", "decode") if not state.pool.healthy(r)]
    if missing:
        return JSONResponse(error_body(503, f"no healthy {' or '.join(missing)} instance"), status_code=503)
    return {"status": "ok"}


router.get("/ready")(health)


# 200 if a one-token greedy generation completes on a prefill/decode pair, else 503.
@router.get("/health_generate")
async def health_generate(state: State):
    ids = (state.tokenizer.encode("ping") if state.tokenizer.has_text else []) or [0]
    spec = RequestSpec(f"health-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0.0, max_new_tokens=1,
                                                                         ignore_eos=True), [])
    try:
        out_ids = (await collect(Generation(state, spec)))[0].ids
    except APIError as e:
        return JSONResponse(error_body(503, f"health generation failed: {e.message}"), status_code=503)
    return {"status": "ok", "output_ids": out_ids}


VERSION = "0.1.0"


def _hf_config(model_root: str) -> dict[str, Any]:
    try:
        cfg = json.loads((Path(model_root) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


# SGLang's /get_model_info (also /model_info).
@router.get("/get_model_info")
async def get_model_info(state: State) -> dict:
    hf = _hf_config(state.model_root)
    return {"model_path": state.model_root, "tokenizer_path": state.model_root, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": hf.get("model_type"),
            "architectures": hf.get("architectures")}


router.get("/model_info")(get_model_info)


def _avg_accept(state: Any) -> float | None:
    """Mean tokens committed per speculative verify step so far (SGLang's avg_spec_accept_length)."""
    total = count = 0.0
    for metric in state.metrics.spec_accept.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total / count if count else None


# SGLang's /get_server_info (also /server_info): its ServerArgs names for this deployment, the
# scheduler's limits, internal_states and version, plus the router's view of every instance.
@router.get("/server_info")
async def server_info(state: State) -> dict:
    cfg, pool = state.cfg, state.pool
    d = cfg.decode[0] if cfg.decode else None
    eng = d.engine if d is not None else cfg.defaults
    spec = cfg.speculative
    spec_on = spec.algorithm != "none"
    accept = _avg_accept(state)
    decodes = pool.instances["decode"]
    tokens = [i.load.kv_pages_total * i.load.page_size for i in decodes]
    internal: dict[str, Any] = {"last_gen_throughput": sum(i.load.gen_throughput for i in decodes)}
    if accept is not None:
        internal["avg_spec_accept_length"] = accept
    return {
        # SGLang's ServerArgs fields
        "model_path": state.model_root, "tokenizer_path": state.model_root,
        "served_model_name": state.served_names[0], "context_length": state.context_length,
        "host": cfg.router.host, "port": cfg.router.port, "device": eng.device, "dtype": eng.dtype,
        "kv_cache_dtype": eng.kv_cache_dtype, "tp_size": d.tp if d is not None else 1,
        "pp_size": d.pp if d is not None else 1, "page_size": eng.page_size,
        "max_running_requests": cfg.router.max_running_requests, "chunked_prefill_size": eng.chunked_prefill_size,
        "mem_fraction_static": eng.mem_fraction_static, "disable_radix_cache": eng.disable_radix_cache,
        "disable_cuda_graph": eng.disable_cuda_graph, "cuda_graph_max_bs": eng.cuda_graph_max_bs,
        "stream_interval": eng.stream_interval, "disaggregation_mode": "pd",
        "disaggregation_transfer_backend": cfg.transfer.backend,
        "speculative_algorithm": spec.algorithm if spec_on else None,
        "speculative_draft_model_path": spec.draft_model_path if spec_on else None,
        "speculative_num_draft_tokens": spec.verify_width if spec_on else None,
        "speculative_num_steps": spec.nextn_steps if spec.nextn else None,
        "speculative_eagle_topk": 1 if spec.nextn else None,
        "speculative_dspark_confidence_threshold":
            spec.dspark_confidence_threshold if spec.algorithm == "DSPARK" else None,
        "reasoning_parser": cfg.router.reasoning_parser, "tool_call_parser": cfg.router.tool_call_parser,
        "load_balance_method": cfg.router.policy, "weight_version": "default",
        # the scheduler's limits (the largest decode instance's KV tokens, the longest prompt)
        "max_total_num_tokens": max(tokens, default=0), "max_req_input_len": state.context_length - 1,
        "internal_states": [internal], "version": VERSION,
        # the router's own view
        "router": {"host": cfg.router.host, "port": cfg.router.port, "policy": cfg.router.policy,
                   "running_requests": len(pool.rooms), "queued_requests": state.admission.depth},
        **pool.status(),
    }


router.get("/get_server_info")(server_info)


# SGLang's /version.
@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@router.get("/metrics")
async def metrics_endpoint(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
