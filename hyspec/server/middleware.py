"""ASGI middleware in front of the app: the request-body size limit and the API key."""

from __future__ import annotations

import hmac

from hyspec.server.errors import send_error
from hyspec.server.metrics import Metrics
from hyspec.server.params import APIError, bad


class BodyLimit:
    """Read the whole request body, refusing it with 413 past `limit` bytes (by
    Content-Length when given, else by counting), then replay it to the app."""

    def __init__(self, app, limit: int, metrics: Metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def _refuse(self, send, err: APIError) -> None:
        await send_error(send, err, self.metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body larger than {self.limit} bytes", code="request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._refuse(send, bad("invalid Content-Length header"))
                if declared > self.limit:
                    return await self._refuse(send, too_big)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._refuse(send, too_big)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class ApiKey:
    """With --api-key, /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY`
    (/health and /metrics stay open)."""

    def __init__(self, app, key: str, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.want = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope.get("path", "")
            if path.startswith("/v1") or path in ("/tokenize", "/detokenize"):
                got = dict(scope.get("headers", [])).get(b"authorization", b"")
                scheme, _, token = got.strip().partition(b" ")  # the scheme is case-insensitive (RFC 9110)
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.want):
                    err = APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                   code="invalid_api_key")
                    return await send_error(send, err, self.metrics)
        return await self.app(scope, receive, send)
