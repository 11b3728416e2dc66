"""GET /v1/models (and /v1/models/{id}), /health and /metrics: what the server says of itself."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from encdec_engine.server import protocol as P
from encdec_engine.server import routes
from encdec_engine.server.state import state_of

router = APIRouter()


@router.get(routes.MODELS, response_model=P.ModelList)
async def list_models(request: Request) -> P.ModelList:
    st = state_of(request)
    root = Path(st.model_path).name or st.model_path  # the folder's name: its path would tell the server's layout
    return P.ModelList(data=[P.ModelCard(id=st.model_name, root=root,
                                         max_model_len=st.engine.engine.max_decoder_len)])


@router.get(routes.MODEL, response_model=P.ModelCard)
async def retrieve_model(model_id: str, request: Request) -> P.ModelCard:
    state_of(request).check_model(model_id)
    return (await list_models(request)).data[0]


@router.get(routes.HEALTH)
async def health(request: Request) -> JSONResponse:
    engine = state_of(request).engine
    if engine.is_running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": engine.dead_reason or "engine not started"}, 503)


@router.get(routes.METRICS)
async def metrics(request: Request) -> PlainTextResponse:
    st = state_of(request)
    realtime = st.realtime if st.is_audio else None
    return PlainTextResponse(st.metrics.render(st.engine, st.admission, st.audio_memory, realtime, st.live_sessions),
                             media_type="text/plain; version=0.0.4; charset=utf-8")
