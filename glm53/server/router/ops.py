"""Operations endpoints: /health (also as /ready), /health_generate, /server_info (also as
/get_server_info) and the Prometheus /metrics."""

from __future__ import annotations

import uuid

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
    ids = state.tokenizer.encode("ping") or [0]
    spec = RequestSpec(f"health-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0.0, max_new_tokens=1,
                                                                         ignore_eos=True), [])
    try:
        out_ids = (await collect(Generation(state, spec)))[0].ids
    except APIError as e:
        return JSONResponse(error_body(503, f"health generation failed: {e.message}"), status_code=503)
    return {"status": "ok", "output_ids": out_ids}


@router.get("/server_info")
async def server_info(state: State) -> dict:
    cfg, pool = state.cfg, state.pool
    return {"model_path": state.model_root, "served_model_name": state.served_names,
            "context_length": state.context_length,
            "router": {"host": cfg.router.host, "port": cfg.router.port, "policy": cfg.router.policy,
                       "running_requests": len(pool.rooms)},
            **pool.status(), "internal_states": [{}], "version": "0.1.0"}


router.get("/get_server_info")(server_info)


@router.get("/metrics")
async def metrics_endpoint(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
