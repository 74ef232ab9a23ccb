"""The OpenAI-compatible HTTP API (FastAPI), a thin layer over `service.py`.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET /metrics; LoRA adapters' POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter and
GET /lora-adapters (lora.py); POST /tokenize and POST /detokenize (tokens.py).
OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (responses.py).
Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens (anthropic.py).
Streams are server-sent events in OpenAI's chunk shape, ending with `data: [DONE]`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from miniapp.engine.api import SamplingParams

from ..host.model_host import LoadState
from .answers import AnswerService, reply
from .anthropic import anthropic_router
from .audio import audio_router
from .breaker import BreakerState, CircuitBreaker
from .embeddings import embeddings_router
from .errors import ApiError, bad_request, error_response, shaped_response
from .images import ServedImages
from .lora import adapters_folder, lora_router
from .metrics import ServeMetrics, metrics_router
from .middleware import (
    REQUEST_ID,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    DeadlineMiddleware,
    RequestIdMiddleware,
)
from .models import anthropic_listing, model_listing, warm_listing
from .protocol import ChatCompletionRequest, CompletionRequest
from .quotas import KeyTable
from .records import CURRENT_RECORD
from .responses import responses_router
from .service import ServedModel
from .tokens import tokens_router
from .tracing import request_sinks

log = logging.getLogger("miniapp.serve")
DEFAULT_BODY_LIMIT = 50 * 1024 * 1024  # bytes (--max-body-mb): a few large images as base64


@dataclass(frozen=True)
class ServeOptions:
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    body_limit: int = DEFAULT_BODY_LIMIT
    defaults: SamplingParams = SamplingParams()  # the settings' sampling, for unset fields
    asr_model: str | None = None  # transcriptions: a faster-whisper folder (None: bundled)
    threads: int | None = None  # CPU threads for transcription (None: all)
    lora_dir: str | None = None  # where run-time adapter loads may read (None: models/adapters)
    pooling: str | None = None  # /v1/embeddings' pooling (None: as the model's file says)
    keys: KeyTable | None = None  # --api-key-file: named keys, each with its quota
    request_timeout: float | None = None  # seconds a request may run (None: no limit)
    stall_timeout: float = 30.0  # seconds a client may leave its stream unread
    breaker_threshold: int = 5  # engine failures in a row that open the circuit breaker
    breaker_pause: float = 10.0  # seconds an open breaker refuses before a probe
    otlp_endpoint: str | None = None  # where spans go (None: no tracing)
    log_format: str = "text"  # "json": one line per request


def create_app(served: ServedModel, options: ServeOptions) -> FastAPI:
    # The OpenAPI schema is published (/openapi.json) for clients' generators and fuzzers.
    app = FastAPI(title="miniapp", docs_url=None, redoc_url=None)
    app.add_middleware(ApiKeyMiddleware, api_key=options.api_key, keys=options.keys)
    app.add_middleware(BodyLimitMiddleware, limit=options.body_limit)
    app.add_middleware(
        DeadlineMiddleware,
        request_timeout=options.request_timeout,
        stall_timeout=options.stall_timeout,
    )
    # Outside the key check: a 401 carries the id too, and is traced and logged.
    app.add_middleware(
        RequestIdMiddleware, sinks=request_sinks(options.otlp_endpoint, options.log_format)
    )
    if options.cors_origins:  # added last, so outermost: a 401 or 413 carries its headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    _add_error_handlers(app)
    breaker = CircuitBreaker(options.breaker_threshold, options.breaker_pause)
    metrics = ServeMetrics(served, breaker)
    answers = AnswerService(served, ServedImages(served), metrics, options.defaults, breaker)
    app.include_router(audio_router(served, options))
    app.include_router(metrics_router(metrics))
    app.include_router(lora_router(served, adapters_folder(options.lora_dir)))
    app.include_router(tokens_router(served))
    app.include_router(responses_router(answers))
    app.include_router(anthropic_router(answers))
    app.include_router(embeddings_router(served, options.pooling))

    @app.get("/health")
    async def health() -> JSONResponse:
        status = served.host.status
        # Unloaded after idling is healthy: the next request loads the model again.
        starting = status.state is LoadState.FAILED and served.host.runtime is None
        if status.state is LoadState.LOADING or starting:
            return error_response(
                503, status.message, kind="unavailable_error", code="model_loading"
            )
        if breaker.state is not BreakerState.CLOSED:  # load balancers send work elsewhere
            refusal = breaker.refusal()
            return error_response(
                503,
                refusal.message,
                kind="unavailable_error",
                code=refusal.code,
                headers=refusal.headers,
            )
        return JSONResponse({"status": "ok"})

    warm_listing()

    # A plain function: FastAPI runs it on a worker thread (a GGUF's metadata may be read).
    @app.get("/v1/models")
    def models(request: Request) -> JSONResponse:
        listed = model_listing(served)
        if "anthropic-version" in request.headers:  # Anthropic's clients ask in their shape
            return JSONResponse(anthropic_listing(listed))
        return JSONResponse({"object": "list", "data": listed})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        relay, answer = await answers.start_chat(body)
        return await reply(relay, answer, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        relay, answer = await answers.start_completion(body)
        return await reply(relay, answer, request)

    return app


# ------------------------------------------------------------------ errors


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        _record_error(exc.message)
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        _record_error(error.message)
        return error.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = {404: "no such endpoint", 405: "method not allowed"}.get(status, exc.detail)
        code = {413: "request_too_large"}.get(status, str(status))
        _record_error(str(message))
        return shaped_response(  # a 405's Allow header kept
            request.url.path, status, str(message), code=code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s failed", REQUEST_ID.get())
        message = f"internal error: {type(exc).__name__}: {exc}"
        _record_error(message)
        return shaped_response(request.url.path, 500, message, kind="server_error")


def _record_error(message: str) -> None:
    """The request's record (its trace and log line) says why it failed."""
    record = CURRENT_RECORD.get()
    if record is not None:
        record.error = message


def _validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint, as one line naming the field."""
    error = exc.errors()[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(location) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request: "
            f"{error.get('ctx', {}).get('error', 'invalid JSON')}",
            code="invalid_json",
        )
    if kind == "extra_forbidden":
        return bad_request(
            f"Unrecognized request argument supplied: {field}", field, code="unknown_parameter"
        )
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{field}'", field, code="missing_required_parameter"
        )
    if kind == "model_attributes_type" or not field:
        return bad_request("the request body must be a JSON object", code="invalid_type")
    return bad_request(
        f"Invalid value for '{field}': {error.get('msg')}", field, code="invalid_value"
    )
