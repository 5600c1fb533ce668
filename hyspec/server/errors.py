"""Errors as OpenAI-shaped JSON: the app's exception handlers, the ASGI-level error reply
(used by the middleware, before FastAPI runs), and request-body parsing into a schema
(a malformed body is a 400 naming the field)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyspec.server.metrics import Metrics
from hyspec.server.params import APIError

log = logging.getLogger("hyspec.server")


def error_response(err: APIError, metrics: Metrics | None = None, headers: dict | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_errors.labels(status=str(err.status)).inc()
    headers = dict(headers or {})
    if err.status == 429:  # a full queue: clients that retry (the openai client does) wait a second first
        headers["Retry-After"] = "1"
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


async def send_error(send, err: APIError, metrics: Metrics) -> None:
    """Reply with `err` straight through ASGI `send` (middleware: no FastAPI response yet)."""
    metrics.http_errors.labels(status=str(err.status)).inc()
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """APIError -> its status and body; unknown paths -> 404 unknown_url; anything else -> a
    500 without a traceback (logged)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = APIError(404, f"no such path: {request.method} {request.url.path}", code="unknown_url")
        else:
            err = APIError(exc.status_code, str(exc.detail), code=None)
        # (the exception's headers kept: a 405 must name the allowed methods in Allow, RFC 9110 15.5.6)
        return error_response(err, metrics, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"), metrics)


async def parse_body(request: Request, schema):
    """The request body validated into `schema` (a pydantic model); a 400 otherwise."""
    body = await request.body()
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0] if errors else {}
        field = str(first["loc"][0]) if first.get("loc") else None  # the request field at fault
        if first.get("type") == "json_invalid":  # (the parser's why: "lone leading surrogate in hex escape at...")
            why = str(first.get("msg") or "").removeprefix("Invalid JSON: ")[:200]
            raise APIError(400, "the request body is not valid JSON" + (f" ({why})" if why else ""),
                           code="invalid_json") from None
        if first.get("type") == "model_type" and not first.get("loc"):
            raise APIError(400, "the request body must be a JSON object", code="invalid_type") from None
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}"
                            for err in errors[:5])
        raise APIError(400, f"invalid request: {message}", param=field, code="invalid_type") from None
