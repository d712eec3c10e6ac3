"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model names, as OpenAI lists them
(authenticated like every API route)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from prefixcache.api.engine import EngineAPI
from prefixcache.server.base.serving import Serving

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    serving: Serving = request.app.state.serving
    serving.tenants.authenticate(request.headers.get("authorization"))
    return {"object": "list", "data": [_model_card(serving.engine, n) for n in serving.model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    serving: Serving = request.app.state.serving
    serving.tenants.authenticate(request.headers.get("authorization"))
    serving.check_model(model_id)
    return _model_card(serving.engine, model_id)


def _model_card(engine: EngineAPI, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "prefixcache",
        "root": engine.model_name,
        "max_model_len": engine.max_model_len,
    }
