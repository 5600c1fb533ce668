"""The HTTP app: create_app wires the pieces below into one FastAPI application.

All model work goes through hyspec.server.worker.EngineWorker; the HTTP side only turns
requests into Jobs and Job events into responses. Where each concern lives:

    state.py        ServerConfig, ServerState (engine, worker, limits, chat template, metrics)
    routes/         one module per endpoint family (completions, chat, tokenize, models, monitoring)
    generation.py   what completions and chat share: constraint, Run of n sequences
    choices.py      Run (one request in flight) and Choice (one output sequence)
    streaming.py    SSE stream, waiting, cancel on disconnect
    logprobs.py     chat / completions logprobs shapes
    errors.py       error responses, exception handlers, body parsing
    middleware.py   body-size limit, API key
    params.py       request validation against the model's limits
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from hyspec.server.choices import Choice, Run  # noqa: F401  (re-exported: the old home of these names)
from hyspec.server.errors import add_error_handlers
from hyspec.server.generation import CONSTRAINT_ARGS  # noqa: F401
from hyspec.server.middleware import ApiKey, BodyLimit
from hyspec.server.routes import register_routes
from hyspec.server.state import ServerConfig, ServerState
from hyspec.server.streaming import SSE  # noqa: F401


def create_app(engine, cfg: ServerConfig | None = None) -> FastAPI:
    cfg = cfg or ServerConfig()
    state = ServerState(engine, cfg)

    @asynccontextmanager
    async def lifespan(app):
        state.worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.worker.stop()

    app = FastAPI(title="hyspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hyspec = state
    add_error_handlers(app, state.metrics)
    register_routes(app, state)
    if cfg.api_key:
        app.add_middleware(ApiKey, key=cfg.api_key, metrics=state.metrics)
    if cfg.max_body_bytes:
        app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, metrics=state.metrics)
    return app


__all__ = ["ServerConfig", "ServerState", "create_app", "ApiKey", "BodyLimit"]
