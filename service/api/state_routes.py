"""Moving a conversation's cached decode state between servers: GET /v1/state/{id} exports the state a
finished request left in the prefix cache (its prompt + generated tokens), POST /v1/state imports one
(application/octet-stream, the bytes GET returned); the next request of the same API key (and cache_salt)
whose prompt starts with those tokens then prefills only the rest.

A state belongs to the key that made it: another key gets 404 for both. Exports are sealed with the
server's state secret (HMAC); an import is checked off the engine thread (service/engine/state_format.py),
one at a time, its body read in a stream under a cap of its own: the largest state the model can hold at
max_model_len (the generic --max-body-mb does not apply). Installing it (service/engine/state_io.py) is
the engine thread's only part."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dsv4_serve.service.api.auth import tenant_of
from dsv4_serve.service.api.controller import Controller
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.engine.request import StateConflict, StateError, StateNotFound
from dsv4_serve.service.engine.state_format import open_state, seal
from dsv4_serve.service.engine.worker import EngineNotReady

router = APIRouter()


def _ctl(request: Request) -> Controller:
    return request.app.state.ctl


async def _checked(coro: Any) -> Any:
    try:
        return await coro
    except EngineNotReady as e:
        raise APIError(503, f"Not accepting requests: {e}", code="not_ready", headers={"Retry-After": "1"}) from None
    except StateNotFound as e:
        raise APIError(404, str(e), param="id", code="state_not_found") from None
    except StateConflict as e:
        raise APIError(409, str(e), code="state_conflict") from None
    except StateError as e:
        raise APIError(400, str(e), code="invalid_state") from None


def _layout(engine: Any) -> Any:
    from dsv4_serve.service.engine.state_io import layout

    return layout(engine)


@router.get("/v1/state/{state_id}")
async def export_state(state_id: str, request: Request) -> Response:
    ctl, tenant = _ctl(request), tenant_of(request)
    await ctl.wait_ready()

    def run(engine: Any) -> tuple[dict[str, Any], list[bytes]]:
        from dsv4_serve.service.engine.state_io import export_for

        return export_for(engine, state_id, tenant)

    header, raws = await _checked(ctl.worker.call(run))
    data = await asyncio.to_thread(seal, request.app.state.state_secret, header, raws)
    return Response(content=data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{state_id}.dsv4state"'})  # fmt: skip


async def _read(request: Request, cap: int) -> bytearray:
    """The body, refused (413) as soon as it is longer than `cap`: from Content-Length, or while it streams."""
    length = request.headers.get("content-length")
    too_large = APIError(413, f"a state for this model is at most {cap} bytes", code="state_too_large")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise too_large
    return body


@router.post("/v1/state")
async def import_state(request: Request) -> Response:
    ctl, tenant = _ctl(request), tenant_of(request)
    await ctl.wait_ready()
    lay = await _checked(ctl.worker.call(_layout))
    state = request.app.state
    if getattr(state, "state_imports", None) is None:  # one state body in memory at a time (up to GiBs)
        state.state_imports = asyncio.Semaphore(1)
    async with state.state_imports:
        data = await _read(request, lay.max_bytes())
        if not data:
            raise APIError(400, "the body must be a state exported by GET /v1/state/{id}", code="invalid_state")
        opened = await _checked(asyncio.to_thread(open_state, data, state.state_secret, lay, tenant))

        def run(engine: Any) -> tuple[str, int]:
            from dsv4_serve.service.engine.state_io import import_for

            return import_for(engine, opened)

        rid, n = await _checked(ctl.worker.call(run))
    return JSONResponse({"id": rid, "object": "state", "tokens": n})
