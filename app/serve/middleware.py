"""ASGI middleware: the API key (401) and the request-body limit (413), both answered in
the path's API's error shape (OpenAI's, or Anthropic's) before a handler runs; and each
request's id (`X-Request-Id`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from contextvars import ContextVar

from starlette.exceptions import HTTPException

from .errors import ANTHROPIC_PATHS, shaped_response
from .quotas import CURRENT_USE, KeyQuota, KeyTable, KeyUse
from .records import CURRENT_RECORD, RequestRecord, now_ns

log = logging.getLogger("miniapp.serve")

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
        record = CURRENT_RECORD.get()
        if record is not None:
            record.key_name = quota.limits.name

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
    (REQUEST_ID). Each request's record (records.py) is made here, filled in by what runs
    inside, and handed to each of `sinks` (its trace, its log line) once the response ends."""

    def __init__(self, app, sinks: Sequence[Callable[[RequestRecord], None]] = ()):
        self.app, self.sinks = app, tuple(sinks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        record = RequestRecord(request_id, scope.get("method", ""), scope["path"])
        tokens = REQUEST_ID.set(request_id), CURRENT_RECORD.set(record)

        async def send_recorded(message):
            if message["type"] == "http.response.start" and record.status is None:
                record.status = message["status"]
                record.response_started_ns = now_ns()
            await send(message)

        send_with_id = _adding_headers(
            send_recorded, lambda: {"x-request-id": request_id}, replace=True
        )
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as exc:
            record.error = record.error or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record.ended_ns = now_ns()
            REQUEST_ID.reset(tokens[0])
            CURRENT_RECORD.reset(tokens[1])
            for sink in self.sinks:
                _told(sink, record)
            record.close()


def _told(sink, record: RequestRecord) -> None:
    """A sink that fails is logged, never the request's failure."""
    try:
        sink(record)
    except Exception:  # noqa: BLE001
        log.exception("recording request %s failed", record.request_id)


class ClientStalled(Exception):
    """The client read none of its response for the stall timeout."""


class DeadlineMiddleware:
    """`--request-timeout`: a request still running after it is stopped, its answers with
    it: a 504 in the API's shape if nothing was sent yet, else the stream ends with an error
    event. `--stall-timeout`: a client that leaves its response unread that long (its
    socket's buffers full) is dropped as a disconnect is, so its answers stop and free their
    slots instead of waiting on it. Both stop the answers through the request's record."""

    def __init__(self, app, request_timeout: float | None, stall_timeout: float | None):
        self.app, self.request_timeout, self.stall_timeout = app, request_timeout, stall_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (self.request_timeout or self.stall_timeout):
            return await self.app(scope, receive, send)
        started = False

        async def guarded_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if message["type"] != "http.response.body" or not self.stall_timeout:
                return await send(message)
            try:  # a timer per chunk, not a task: streams send one per token
                async with asyncio.timeout(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        try:
            async with asyncio.timeout(self.request_timeout):
                await self.app(scope, receive, guarded_send)
        except TimeoutError:
            _stop_answers()
            await self._timed_out(scope, receive, send, started)
        except BaseException as exc:  # a task group may wrap the stall in an ExceptionGroup
            if not _is_stall(exc):
                raise
            _stop_answers()
            log.warning("request %s: the client stopped reading; dropped", REQUEST_ID.get())

    async def _timed_out(self, scope, receive, send, started: bool) -> None:
        message = (
            f"the request ran past the server's --request-timeout of {self.request_timeout:g} s "
            "and was stopped"
        )
        log.warning("request %s: %s", REQUEST_ID.get(), message)
        record = CURRENT_RECORD.get()
        if record is not None:
            record.error = message
        if not started:
            response = shaped_response(scope["path"], 504, message, code="request_timeout")
            return await response(scope, receive, send)
        body = shaped_response(scope["path"], 504, message, code="request_timeout").body
        event = b"event: error\n" if scope["path"].startswith(ANTHROPIC_PATHS) else b""
        last = {"type": "http.response.body", "body": event + b"data: " + body + b"\n\n"}
        with contextlib.suppress(Exception):  # the client may be gone, or stalled too
            async with asyncio.timeout(1.0):
                await send(last | {"more_body": False})


def _stop_answers() -> None:
    record = CURRENT_RECORD.get()
    if record is not None:
        record.stop_answers()


def _is_stall(exc: BaseException) -> bool:
    if isinstance(exc, ClientStalled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_stall(inner) for inner in exc.exceptions)
    return False
