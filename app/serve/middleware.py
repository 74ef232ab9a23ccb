"""ASGI middleware: the API key (401) and the request-body limit (413), both answered in
the path's API's error shape (OpenAI's, or Anthropic's) before a handler runs."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException

from .errors import shaped_response

OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers probe it)


class ApiKeyMiddleware:
    """With a key, every request but the open paths needs `Authorization: Bearer KEY`, or
    `x-api-key: KEY` as Anthropic's clients send it."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope.get("method") == "OPTIONS":  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return await self.app(scope, receive, send)
        header_key = headers.get(b"x-api-key")
        if header_key is not None:
            given = header_key.decode("latin-1")
            if hmac.compare_digest(given.strip(), self.api_key):
                return await self.app(scope, receive, send)
        message = (
            "Incorrect API key provided."
            if given
            else "You didn't provide an API key: send Authorization: Bearer KEY."
        )
        response = shaped_response(scope["path"], 401, message, code="invalid_api_key")
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """Bodies over `limit` bytes get 413: by their Content-Length at once, or as soon as a
    chunked body passes the limit (an HTTPException from the body's reader, which FastAPI
    passes on to the error handlers)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self) -> str:
        return f"the request body is over the limit of {self.limit} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = shaped_response(scope["path"], 413, self.message(), code="request_too_large")
            return await response(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self.message())
            return message

        await self.app(scope, counted_receive, send)
