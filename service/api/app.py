"""create_app(settings): the FastAPI app. The lifespan starts the engine worker and drains it;
`Controller` holds what routes share (worker, tokenizer, limits, draining flag, live requests)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.metrics import Metrics
from service.api.protocol import APIError, error_body
from service.settings import Settings

log = logging.getLogger("dsv4.api")


WorkerBuilder = Callable[[Settings, "Controller"], Any]


def default_worker(settings: Settings, ctl: Controller) -> Any:
    """The real EngineWorker; the engine and tokenizer are built on the engine thread."""
    from service.engine.engine import build_engine
    from service.engine.worker import EngineWorker

    def factory() -> tuple[Any, Any]:
        engine, tokenizer = build_engine(
            settings.model,
            max_rows=settings.max_rows,
            max_model_len=settings.max_model_len,
            state_budget_bytes=settings.state_budget_bytes,
            group=_group() if settings.distributed else None,
            dequantize=settings.dequantize,
        )
        ctl.engine = engine  # for bytes_in_use() at scrape time (plain Python accounting)
        return engine, tokenizer

    return EngineWorker(
        factory,
        max_rows=settings.max_rows,
        max_queue=settings.max_queue,
        # Prompt tokens per step through the parallel prefill (token-serial engines: prefilling rows).
        prefill_chunk=settings.prefill_chunk,
        serial_prefill=settings.serial_prefill,
        pipeline=not settings.no_pipeline,
        on_step_metrics=ctl.metrics.observe_step,  # engine thread; prometheus objects are thread-safe
    )


def _group() -> Any:
    """This process' mx.distributed group (rank 0 of `serve --distributed`); called on the engine thread."""
    import mlx.core as mx

    return mx.distributed.init()


@dataclass
class Controller:
    settings: Settings
    metrics: Metrics
    worker: Any = None
    engine: Any = None
    draining: bool = False
    active: dict[str, None] = field(default_factory=dict)  # live request ids (insertion order)
    loop: asyncio.AbstractEventLoop | None = None
    _drain_task: asyncio.Task[None] | None = None

    # Engine facts the worker publishes before `ready` (plain ints / the tokenizer).
    @property
    def tokenizer(self) -> Any:
        return getattr(self.worker, "tokenizer", None)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.worker, "max_model_len", 0) or 0)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.worker, "vocab_size", 0) or 0)

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.worker, "eos_token_id", None)

    @property
    def ready(self) -> bool:
        return bool(self.worker is not None and getattr(self.worker, "ready", False)) and not self.draining

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down", code="draining", headers={"Retry-After": "5"})
        if not self.ready:
            err = getattr(self.worker, "start_error", None)
            msg = f"The engine failed to start: {err!r}" if err else "The model is still loading"
            raise APIError(503, msg, code="not_ready", headers={"Retry-After": "1"})

    def stats(self) -> dict[str, Any] | None:
        if self.worker is None:
            return None
        s = dict(self.worker.stats())
        if self.engine is not None:
            s["bytes_in_use"] = self.engine.bytes_in_use()
            s["bytes_budget"] = self.engine.bytes_budget()
        return s

    def abort(self, request_id: str) -> None:
        if self.worker is not None:
            self.worker.abort(request_id)

    # ---- drain: stop admission, let streams finish within drain_timeout, then abort them -------
    def begin_drain_threadsafe(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        if self._drain_task is None:
            self.draining = True
            n, t = len(self.active), self.settings.drain_timeout
            log.info("draining: %d request(s) in flight, up to %.0fs to finish", n, t)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop, timeout = asyncio.get_running_loop(), self.settings.drain_timeout
        deadline = loop.time() + timeout
        drain = getattr(self.worker, "drain", None)
        if drain is not None:  # the worker stops admitting, runs accepted requests, then aborts the rest
            try:
                await asyncio.wait_for(_call(drain, timeout), timeout + 10)
            except Exception:  # noqa: BLE001 - fall through to aborting each stream
                log.exception("worker drain failed")
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):  # each stream then ends with finish_reason "abort"
            self.abort(rid)
        while self.active and loop.time() < deadline + 5:
            await asyncio.sleep(0.05)

    async def wait_drained(self) -> None:
        self.begin_drain()
        assert self._drain_task is not None
        await self._drain_task


async def _call(fn: Callable[..., Any] | None, *args: Any) -> None:
    if fn is None:
        return
    if inspect.iscoroutinefunction(fn):
        await fn(*args)
    else:
        await asyncio.to_thread(fn, *args)


def create_app(settings: Settings, *, worker_builder: WorkerBuilder | None = None) -> FastAPI:
    ctl = Controller(settings, Metrics(lambda: ctl.stats(), settings.max_rows))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctl.loop = asyncio.get_running_loop()
        ctl.worker = (worker_builder or default_worker)(settings, ctl)
        ctl.worker.start()  # returns at once; /ready flips when the model is loaded and warm
        log.info("serving %r on http://%s:%d", settings.served_name, settings.host, settings.port)
        try:
            yield
        finally:
            await ctl.wait_drained()
            await _call(getattr(ctl.worker, "stop", None))

    app = FastAPI(title="dsv4-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctl = ctl

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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        ctl.metrics.outcome("error")
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}", "internal_error"), status_code=500
        )

    from service.api.routes import router

    app.include_router(router)
    return app
