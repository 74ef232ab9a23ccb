"""ASGI middleware: the API key (401) and the request-body limit (413), both answered in
the path's API's error shape (OpenAI's, or Anthropic's) before a handler runs; and each
request's id (`X-Request-Id`)."""

from __future__ import annotations

import hmac
import re
import uuid
from contextvars import ContextVar

from starlette.exceptions import HTTPException

from .errors import shaped_response
from .quotas import CURRENT_USE, KeyQuota, KeyTable, KeyUse

OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers probe it)


class ApiKeyMiddleware:
    """With a key, or a key file (quotas.py), every request but the open paths needs
    `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it. A key
    from the file puts its quota in reach of the request's handlers (quotas.CURRENT_USE)
    and its `x-ratelimit-*` figures in the response's headers."""

    def __init__(self, app, api_key: str | None, keys: KeyTable | None = None):
        self.app, self.api_key, self.keys = app, api_key, keys

    async def __call__(self, scope, receive, send):
        guarded = self.api_key is not None or self.keys is not None
        if not guarded or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope.get("method") == "OPTIONS":  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        presented = _presented_key(dict(scope.get("headers") or []))
        if presented and self.api_key and hmac.compare_digest(presented, self.api_key):
            return await self.app(scope, receive, send)
        quota = self.keys.find(presented) if (presented and self.keys) else None
        if quota is not None:
            return await self._with_quota(quota, scope, receive, send)
        message = (
            "Incorrect API key provided."
            if presented
            else "You didn't provide an API key: send Authorization: Bearer KEY."
        )
        response = shaped_response(scope["path"], 401, message, code="invalid_api_key")
        await response(scope, receive, send)

    async def _with_quota(self, quota: KeyQuota, scope, receive, send):
        use = KeyUse(quota)
        token = CURRENT_USE.set(use)

        # A 429's own figures (set where it was refused) stand; others get the key's now.
        send_with_figures = _adding_headers(send, quota.headers, replace=False)
        try:
            await self.app(scope, receive, send_with_figures)
        finally:
            CURRENT_USE.reset(token)


def _adding_headers(send, extra, replace: bool):
    """`send` with the headers `extra()` gives added to the response's start; `replace`:
    instead of any the app set under those names (else the app's stand)."""

    async def sending(message):
        if message["type"] == "http.response.start":
            added = {name.lower().encode(): value.encode() for name, value in extra().items()}
            headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in headers}
            if replace:
                headers = [(name, value) for name, value in headers if name.lower() not in added]
            headers += [(n, v) for n, v in added.items() if replace or n not in present]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _presented_key(headers: dict[bytes, bytes]) -> str:
    """The key a request sends: as a bearer token, or in x-api-key."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


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


REQUEST_ID: ContextVar[str | None] = ContextVar("miniapp_request_id", default=None)
_CLIENT_ID = re.compile(r"^[\w.:/+=-]{1,128}$")  # what a client's own id may look like


class RequestIdMiddleware:
    """Every request has an id: the client's `X-Request-Id` (as vLLM takes it), or one made
    here. The response carries it back, and the request's log lines and traces name it
    (REQUEST_ID)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)

        send_with_id = _adding_headers(send, lambda: {"x-request-id": request_id}, replace=True)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
