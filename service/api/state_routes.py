"""Moving a conversation's cached decode state between servers: GET /v1/state/{id} exports the state a
finished request left in the prefix cache (its prompt + generated tokens), POST /v1/state imports one
(application/octet-stream, the bytes GET returned); the next request whose prompt starts with those
tokens then prefills only the rest. The format and its checks: service/engine/state_io.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dsv4_serve.service.api.controller import Controller
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.engine.request import StateError, StateNotFound
from dsv4_serve.service.engine.worker import EngineNotReady

router = APIRouter()
MAX_STATE_BYTES = 8 << 30  # a body larger than this is refused before it is read whole


def _ctl(request: Request) -> Controller:
    return request.app.state.ctl


async def _on_engine(ctl: Controller, fn: Any) -> Any:
    try:
        return await ctl.worker.call(fn)
    except EngineNotReady as e:
        raise APIError(503, f"Not accepting requests: {e}", code="not_ready", headers={"Retry-After": "1"}) from None
    except StateNotFound as e:
        raise APIError(404, str(e), param="id", code="state_not_found") from None
    except StateError as e:
        raise APIError(400, str(e), code="invalid_state") from None


@router.get("/v1/state/{state_id}")
async def export_state(state_id: str, request: Request) -> Response:
    ctl = _ctl(request)
    await ctl.wait_ready()

    def run(engine: Any) -> bytes:
        from dsv4_serve.service.engine.state_io import export_for

        return export_for(engine, state_id)

    data = await _on_engine(ctl, run)
    return Response(content=data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{state_id}.dsv4state"'})  # fmt: skip


@router.post("/v1/state")
async def import_state(request: Request) -> Response:
    ctl = _ctl(request)
    await ctl.wait_ready()
    if int(request.headers.get("content-length") or 0) > MAX_STATE_BYTES:
        raise APIError(413, f"a state is at most {MAX_STATE_BYTES} bytes", code="state_too_large")
    data = await request.body()
    if not data:
        raise APIError(400, "the body must be a state exported by GET /v1/state/{id}", code="invalid_state")

    def run(engine: Any) -> tuple[str, int]:
        from dsv4_serve.service.engine.state_io import import_for

        return import_for(engine, data)

    rid, n = await _on_engine(ctl, run)
    return JSONResponse({"id": rid, "object": "state", "tokens": n})
