"""create_app(settings): the FastAPI app. The lifespan starts the engine worker and drains it; the
`Controller` (service/api/controller.py) holds what routes share."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsv4_serve.service.api.auth import guard
from dsv4_serve.service.api.connections import quiet_accept_errors
from dsv4_serve.service.api.controller import Controller, call
from dsv4_serve.service.api.grammar_pool import GrammarPool
from dsv4_serve.service.api.metrics import Metrics
from dsv4_serve.service.api.protocol import APIError, error_body
from dsv4_serve.service.api.request_id import RequestId, current_id
from dsv4_serve.service.api.responses import router as responses_router
from dsv4_serve.service.api.routes import router
from dsv4_serve.service.api.state_routes import router as state_router
from dsv4_serve.service.api.tokenize_routes import router as tokenize_router
from dsv4_serve.service.settings import Settings

log = logging.getLogger("dsv4.api")


WorkerBuilder = Callable[[Settings, Controller], Any]


def default_worker(settings: Settings, ctl: Controller) -> Any:
    """The real EngineWorker; the engine and tokenizer are built on the engine thread (which imports mlx:
    this module does not)."""
    from dsv4_serve.service.engine.worker import EngineWorker

    def factory() -> tuple[Any, Any]:
        from dsv4_serve.service.engine.build import build_engine, distributed_group

        engine, tokenizer = build_engine(
            settings.model, group=distributed_group() if settings.distributed else None, **settings.engine_options()
        )
        ctl.engine = engine  # for bytes_in_use() at scrape time (plain Python accounting)
        from dsv4_serve.service.engine.grammar import Guides  # numpy only: no mlx on this side

        engine.guides = Guides(engine.vocab_size, engine.eos_token_id, settings.grammar_mask_budget)
        return engine, tokenizer

    return EngineWorker(
        factory,
        max_rows=settings.max_rows,
        max_queue=settings.max_queue,
        # Prompt tokens per step through the parallel prefill (token-serial engines: prefilling rows).
        prefill_chunk=settings.prefill_chunk,
        prefill_slice_ms=settings.prefill_slice_ms,
        prefill_whole_tokens=settings.prefill_whole_tokens,
        itl_target_ms=None if settings.itl_target_ms == "auto" else settings.itl_target_ms,
        serial_prefill=settings.serial_prefill,
        pipeline=not settings.no_pipeline,
        stream_queue=settings.stream_queue,
        on_step_metrics=ctl.metrics.observe_step,  # engine thread; prometheus objects are thread-safe
        on_phase_metrics=ctl.metrics.observe_phases,  # engine thread, once an iteration that did work
        on_failure=ctl.fail_threadsafe,  # engine thread: an engine that cannot serve stops the server
        canary_interval=settings.canary_interval,  # a canary mismatch also reports through on_failure
        canary_action=settings.canary_action,
    )


def create_app(settings: Settings, *, worker_builder: WorkerBuilder | None = None) -> FastAPI:
    ctl = Controller(settings, Metrics(lambda: ctl.stats(), settings.max_rows))
    ctl.grammars = GrammarPool(settings.grammar_timeout, workers=settings.grammar_workers,
                               per_key=settings.grammar_per_key, memory_bytes=settings.grammar_memory_mb * 2**20)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctl.loop = asyncio.get_running_loop()
        quiet_accept_errors(ctl.loop)  # EMFILE on accept: one log line per 10 s, not one a loop turn
        ctl.worker = (worker_builder or default_worker)(settings, ctl)
        ctl.worker.start()  # returns at once; /ready flips when the model is loaded and warm
        log.info("serving %r on http://%s:%d", settings.served_name, settings.host, settings.port)
        try:
            yield
        finally:
            await ctl.wait_drained()
            await ctl.grammars.close()
            await call(getattr(ctl.worker, "stop", None))

    app = FastAPI(title="dsv4-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctl = ctl
    # The HMAC key of exported states: the operator's file, else random (exports then die with the process).
    app.state.state_secret = settings.state_secret() or secrets.token_bytes(32)
    guard(app, ctl)  # API keys and the body cap, before routing
    app.add_middleware(RequestId)  # outermost: every response carries X-Request-Id (a 401 too)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        loc = [str(x) for x in errs[0].get("loc", ())] if errs else []
        param = loc[1] if len(loc) > 1 and loc[0] == "body" else (loc[-1] if loc else None)
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        t = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), t), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, _: ClientDisconnect) -> JSONResponse:
        # A client that left before its body was in: nothing failed here, and nobody reads the answer.
        log.info("%s %s: the client left before its request body was in", request.method, request.url.path)
        ctl.metrics.outcome("rejected_4xx")
        return JSONResponse(error_body("the client disconnected", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error (request %s)", current_id())
        ctl.metrics.outcome("error")
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}", "internal_error"), status_code=500
        )

    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(state_router)
    app.include_router(tokenize_router)
    return app
