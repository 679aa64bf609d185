"""Moving a conversation's cached decode state between servers: GET /v1/state/{id} exports the state a
finished request left in the prefix cache (its prompt + generated tokens), POST /v1/state imports one
(application/octet-stream, the bytes GET returned); the next request of the same API key (and cache_salt)
whose prompt starts with those tokens then prefills only the rest.

A state belongs to the key that made it: another key gets 404 for its export, and its import is refused as a
forged state is (400, the same message). Exports are sealed with the server's state secret (HMAC); an import's
body is read in a stream under a cap of its own (the largest state the model can hold at max_model_len; the
generic --max-body-mb does not apply) and under limits.BodyPace (a trickled body: 408), then checked off the
engine thread (service/engine/state_format.py), one at a time per API key (`KeyImports`: no key waits for
another's). Installing it (service/engine/state_io.py) is the engine thread's only part. An export is imported
once per process: the nonces of imported exports are remembered in memory (the last 65,536), so another server
sharing the secret, or this one after a restart, takes the same export again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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
MAX_BODIES_PER_KEY = 2  # state bodies one API key may hold in memory at once


def _ctl(request: Request) -> Controller:
    return request.app.state.ctl


async def _checked(coro: Any) -> Any:
    try:
        return await coro
    except EngineNotReady as e:
        raise APIError(503, f"Not accepting requests: {e}", code="not_ready", headers={"Retry-After": "1"}) from None
    except StateNotFound as e:  # an export of an id this key does not own
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


class KeyImports:
    """Each API key's imports, apart from every other key's: at most MAX_BODIES_PER_KEY state bodies held at once
    (read, waiting or checked: up to GiBs each; more get 429 before a byte is read), and one check + install at
    a time, its slot taken only once the body is in. One key's slow body never holds another key's import."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.slots: dict[str, asyncio.Lock] = {}

    @asynccontextmanager
    async def body(self, tenant: str) -> AsyncIterator[None]:
        if self.held.get(tenant, 0) >= MAX_BODIES_PER_KEY:
            raise APIError(429, f"this API key has {MAX_BODIES_PER_KEY} state imports in flight; retry when one has "
                           "ended", code="imports_busy", headers={"Retry-After": "1"})  # fmt: skip
        self.held[tenant] = self.held.get(tenant, 0) + 1
        try:
            yield
        finally:
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]
                self.slots.pop(tenant, None)  # no import of this key is left to hold or wait for it

    def slot(self, tenant: str) -> asyncio.Lock:
        return self.slots.setdefault(tenant, asyncio.Lock())


@router.post("/v1/state")
async def import_state(request: Request) -> Response:
    ctl, tenant = _ctl(request), tenant_of(request)
    await ctl.wait_ready()
    lay = await _checked(ctl.worker.call(_layout))
    state = request.app.state
    if getattr(state, "state_imports", None) is None:
        state.state_imports = KeyImports()
    imports: KeyImports = state.state_imports
    async with imports.body(tenant):
        data = await _read(request, lay.max_bytes())  # under limits.BodyPace: a trickled body ends in 408
        if not data:
            raise APIError(400, "the body must be a state exported by GET /v1/state/{id}", code="invalid_state")
        async with imports.slot(tenant):  # the key's own imports one at a time (a replay is refused in order)
            opened = await _checked(asyncio.to_thread(open_state, data, state.state_secret, lay, tenant))

            def run(engine: Any) -> tuple[str, int]:
                from dsv4_serve.service.engine.state_io import import_for

                return import_for(engine, opened)

            rid, n = await _checked(ctl.worker.call(run))
    return JSONResponse({"id": rid, "object": "state", "tokens": n})
