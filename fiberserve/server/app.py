"""The FastAPI application: lifecycle, routes, error handlers, middleware."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from fiberserve.config import ServerConfig
from fiberserve.engine import LlmService
from fiberserve.server import (
    anthropic_api,
    embeddings_api,
    lora_api,
    native_api,
    openai_api,
    responses_api,
    tokenize_api,
)
from fiberserve.server.errors import (
    ApiError,
    handle_api_error,
    handle_http_error,
    handle_unexpected,
    handle_validation_error,
)
from fiberserve.server.metrics import Metrics
from fiberserve.server.middleware import WEBUI_PATH, GuardMiddleware
from fiberserve.server.state import ServerState
from fiberserve.startup import BackgroundLoad, configure_logging

log = logging.getLogger("fiberserve.server")

#: The built-in chat page: one file, no build step, nothing fetched from elsewhere.
WEBUI_PAGE = Path(__file__).parent / "webui" / "index.html"


def create_app(
    config: ServerConfig,
    service: LlmService | None = None,
    on_load_failure: Callable[[], None] | None = None,
    loading: BackgroundLoad | None = None,
) -> FastAPI:
    """The app; loads the model in the background unless ``service`` is given, or takes it from ``loading`` (a
    load begun earlier, :class:`.startup.BackgroundLoad`); ``/health`` says 503 meanwhile.  A load that fails
    calls ``on_load_failure`` unless ``config.stay_up_on_load_failure``."""
    state = ServerState(config)
    metrics = state.metrics = Metrics(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(_load(state, service, on_load_failure, loading))
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            if state.service is not None:
                await state.service.close()

    app = FastAPI(title="fiberserve", lifespan=lifespan)
    app.state.fiberserve = state
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(lora_api.router)
    # Starlette types a handler's exception as Exception; each of these is only called with its own class.
    app.add_exception_handler(ApiError, handle_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, handle_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, handle_unexpected)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)

    if config.webui:

        @app.get(WEBUI_PATH, include_in_schema=False)
        async def chat_page() -> Response:
            return Response(WEBUI_PAGE.read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/metrics")
    async def serve_metrics(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(GuardMiddleware, state=state)
    return app


async def _load(
    state: ServerState,
    service: LlmService | None,
    on_failure: Callable[[], None] | None,
    loading: BackgroundLoad | None,
) -> None:
    try:
        if service is None:
            service = await (loading or BackgroundLoad(state.config.engine)).service()
        await service.start()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("could not load the model: %s", state.load_error)
        if on_failure is not None and not state.config.stay_up_on_load_failure:
            on_failure()
        return
    if state.metrics is not None:
        service.scheduler.finish_listeners.append(state.metrics.observe_sequence)
    state.service = service
    # What startup built (the model's modules, the tokenizer, imported code: ~200k objects) stays alive for good,
    # yet every full collection would walk it again, holding the GIL while the event loop waits and taking a core
    # from the step's kernels (2 cores here).  Frozen, the collector walks only what serving allocates.
    gc.collect()
    gc.freeze()
    log.info(
        "ready: %s on %s (%s), %d fibers, %d KV pages of %d tokens",
        service.model_name,
        service.config.device,
        str(service.model.dtype).removeprefix("torch."),
        service.config.fibers,
        service.pages.num_pages,
        service.pages.page_size,
    )


def run_server(config: ServerConfig, loading: BackgroundLoad | None = None) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` seconds to finish; returns 0.  A
    model that fails to load stops the server at once and returns 1 (unless ``stay_up_on_load_failure``).
    ``loading``: the model's load, begun before this module was imported (else it begins here)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # uvicorn would re-raise the signal afterwards: exit -15, not 0

    configure_logging(config.log_level)
    failed = False

    def stop_on_failure() -> None:
        nonlocal failed
        failed = server.should_exit = True

    uvicorn_config = uvicorn.Config(
        create_app(config, on_load_failure=stop_on_failure, loading=loading),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        ws="none",  # no route speaks WebSocket: uvicorn need not import a WebSocket implementation at start
        timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type]  # uvicorn takes fractions too
    )
    server = GracefulServer(uvicorn_config)
    server.run()
    return 1 if failed else 0
