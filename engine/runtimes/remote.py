"""A model served elsewhere: any OpenAI-compatible server (vLLM, llama-server, `miniapp serve`)
answers the conversation, through the official `openai` client.

The server holds the model, its template and its context, so this runtime takes messages, not
tokens, and yields the same typed events as the local runtimes: TextDelta, ReasoningDelta (a
reasoning model's thinking, kept apart from the answer) and Finished with stats taken from
the stream (TTFT and tok/s as the chunks arrive, token counts from the usage chunk).

Each answer is one streamed request, read on a thread of its own, so that Stop works at any
moment (waiting for the first byte included): stopping shuts the connection down, and the
server sees its client go.
"""

from __future__ import annotations

import base64
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import openai

from ..errors import MiniappError
from ..modelfile.template import Message
from ..tokens.constraints import ConstraintKind, OutputConstraint
from ..tokens.events import (
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationStats,
    ReasoningDelta,
    TextDelta,
)
from ..tokens.sampling import GenerationRequest
from .base import EXTRA_SAMPLING, SAMPLING_FIELDS, MessageRuntime, RuntimeInfo

REMOTE_BACKEND = "openai"
CONNECT_TIMEOUT_S = 10.0
# Between two chunks: a long prompt on a busy cluster may take minutes before its first one.
READ_TIMEOUT_S = 600.0
STOP_POLL_S = 0.05  # how often a waiting answer checks whether it should stop
REMOTE_PARALLEL = 64  # answers one interface streams at once; the server queues the rest
_FINISH_REASONS = {
    "length": FinishReason.MAX_TOKENS,
    "cancelled": FinishReason.CANCELLED,
}


class RemoteError(MiniappError):
    """The server could not be reached, refused the request or broke off its answer."""


@dataclass(frozen=True)
class RemoteEndpoint:
    """Where the server is, and the key it wants (None: no key)."""

    base_url: str
    api_key: str | None = None

    @property
    def root(self) -> str:
        """The server's address without its `/v1`: where llama-server's /props lives."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def client(self) -> openai.OpenAI:
        # No retries: an unreachable server or a refused key is said at once, not after
        # several silent attempts.
        timeout = openai.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, timeout=timeout
        )


@dataclass(frozen=True)
class RemoteModel:
    """One entry of the server's /v1/models."""

    id: str
    owned_by: str | None
    context: int | None  # its context length, where the server says it


def list_models(endpoint: RemoteEndpoint, client: openai.OpenAI | None = None) -> list[RemoteModel]:
    """The server's models (asked through `client`, if one is open already); RemoteError,
    one line, when it cannot be asked."""
    try:
        page = (client or endpoint.client()).models.list()
        return [_remote_model(entry) for entry in page.data]
    except openai.OpenAIError as exc:
        raise remote_error(exc, endpoint) from None


def _remote_model(entry) -> RemoteModel:
    extra = entry.model_extra or {}
    meta = extra.get("meta") if isinstance(extra.get("meta"), dict) else {}
    # vLLM says max_model_len, `miniapp serve` context_length, llama-server meta.n_ctx_train.
    context = extra.get("max_model_len") or extra.get("context_length") or meta.get("n_ctx_train")
    return RemoteModel(
        entry.id, getattr(entry, "owned_by", None), context if isinstance(context, int) else None
    )


class RemoteRuntime(MessageRuntime):
    """One model on an OpenAI-compatible server. Opening it asks the server for its models,
    so an unreachable server, a refused key or an unknown model is found before the first
    message."""

    backend = REMOTE_BACKEND
    parallel = REMOTE_PARALLEL

    def __init__(
        self,
        endpoint: RemoteEndpoint,
        model: str | None = None,
        send_sampling: Sequence[str] = SAMPLING_FIELDS,
    ):
        """`model`: the server's name for it (None: its first model). `send_sampling`: the
        sampling settings the user chose; the others are left to the server's defaults."""
        self.endpoint = endpoint
        self._client = endpoint.client()
        self._send = frozenset(send_sampling)
        listed = list_models(endpoint, self._client)
        if not listed:
            raise RemoteError(f"the server at {endpoint.base_url} lists no models")
        chosen = listed[0] if model is None else next((m for m in listed if m.id == model), None)
        if chosen is None:
            names = ", ".join(m.id for m in listed[:8])
            raise RemoteError(
                f"the server at {endpoint.base_url} has no model '{model}' (it has: {names})"
            )
        self.model = chosen.id
        self.n_ctx = chosen.context

    @cached_property
    def accepts_images(self) -> bool:
        """Whether the server says its model sees pictures (llama-server's /props); asked on
        first use. Servers that do not say get the text of pictures instead (OCR)."""
        try:
            props = self._client.get(self.endpoint.root + "/props", cast_to=object)
        except openai.OpenAIError:
            return False
        modalities = props.get("modalities") if isinstance(props, dict) else None
        return isinstance(modalities, dict) and bool(modalities.get("vision"))

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            self.backend, Path(self.model), model_name=self.model, endpoint=self.endpoint.base_url
        )

    def close(self) -> None:
        self._client.close()

    # -- answers -----------------------------------------------------------------------------

    def chat(
        self,
        messages: Sequence[Message],
        request: GenerationRequest,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[GenerationEvent]:
        """Stream the server's answer to `messages` as events. A failure is a RemoteError:
        before any text, nothing was answered; midway, the text so far has been yielded."""
        body = self._body(messages, request)
        clock = _AnswerClock()
        call = _StreamedCall(self._client, body)
        finish: str | None = None
        usage = None
        yielded_text = False
        try:
            for kind, value, arrived in call.items(should_stop):
                if kind == "error":
                    raise remote_error(value, self.endpoint, self.model, midway=yielded_text)
                if kind == "usage":
                    usage = value
                elif kind == "finish":
                    finish = value
                elif kind in ("text", "reasoning"):
                    clock.piece(arrived)
                    yielded_text = yielded_text or kind == "text"
                    yield TextDelta(value) if kind == "text" else ReasoningDelta(value)
        finally:
            call.cancel()
        reason = (
            FinishReason.CANCELLED
            if call.cancelled
            else _FINISH_REASONS.get(finish or "", FinishReason.END_OF_TURN)
        )
        yield Finished(reason, clock.stats(usage))

    def _body(self, messages: Sequence[Message], request: GenerationRequest) -> dict:
        """The chat request: only fields that were set, so that strict servers take it."""
        if any(m.pictures for m in messages) and not self.accepts_images:
            raise RemoteError(
                f"the server's model {self.model} does not say it takes pictures "
                "(they go to it as text, by OCR)"
            )
        body: dict = {
            "model": self.model,
            "messages": [_wire_message(m) for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": request.max_tokens,
        }
        sampling = request.sampling
        extra = {}
        for name in self._send:
            value = getattr(sampling, name)
            if value is None:
                continue
            if name in EXTRA_SAMPLING:
                extra[name] = value
            else:
                body[name] = value
        if "repeat_penalty" in extra:
            extra["repetition_penalty"] = extra["repeat_penalty"]
        if extra:
            body["extra_body"] = extra  # the client merges it into the request's JSON
        if request.stop:
            body["stop"] = list(request.stop)
        if sampling.constraint is not None:
            body["response_format"] = _response_format(sampling.constraint)
        return body


def _response_format(constraint: OutputConstraint) -> dict:
    """The constraint as the chat API's response_format (JSON only: the API has no other)."""
    if constraint.kind is ConstraintKind.JSON:
        return {"type": "json_object"}
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        schema = {"name": "answer", "schema": json.loads(constraint.source), "strict": True}
        return {"type": "json_schema", "json_schema": schema}
    raise RemoteError(
        f"a {constraint.kind.value} constraint cannot be sent to a server (the "
        "chat API takes JSON schemas only)"
    )


def _wire_message(message: Message) -> dict:
    """A message in the chat API's shape; pictures as base64 PNG parts before the text."""
    if not message.pictures:
        return {"role": message.role, "content": message.content}
    parts: list[dict] = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
        }
        for png in message.pictures
    ]
    parts.append({"type": "text", "text": message.content})
    return {"role": message.role, "content": parts}


class _AnswerClock:
    """Times one answer from the request to its last piece."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.pieces = 0

    def piece(self, arrived: float) -> None:
        """A piece that arrived at `arrived` (perf_counter): times are the stream's, not
        those of a consumer that may be slower to take the pieces."""
        self.last = arrived
        self.first = self.first or arrived
        self.pieces += 1

    def stats(self, usage) -> GenerationStats:
        """Token counts from the server's usage chunk when it sent one, else one token per
        streamed piece (what most servers send)."""
        prompt = getattr(usage, "prompt_tokens", None) or 0
        generated = getattr(usage, "completion_tokens", None) or self.pieces
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) or 0
        first = self.first or self.last
        ttft = first - self.start
        decoding = self.last - first
        return GenerationStats(
            backend=REMOTE_BACKEND,
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            generated_tokens=generated,
            ttft_s=ttft,
            prefill_tok_s=(prompt - cached) / ttft if ttft > 0 else 0.0,
            decode_tok_s=(generated - 1) / decoding if generated > 1 and decoding > 0 else 0.0,
        )


class _StreamedCall:
    """One streamed chat request, read on its own thread into a queue of (kind, value, the
    perf_counter time it arrived): text, reasoning, finish, usage, error; None at the end."""

    def __init__(self, client: openai.OpenAI, body: dict):
        self._queue: queue.Queue = queue.Queue()
        self._stream = None
        self._lock = threading.Lock()
        self._done = False
        self.cancelled = False
        threading.Thread(
            target=self._read, args=(client, body), daemon=True, name="remote-answer"
        ).start()

    def items(self, should_stop: Callable[[], bool]) -> Iterator[tuple[str, object, float]]:
        while True:
            if should_stop():
                self.cancel()
                return
            try:
                item = self._queue.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    def cancel(self) -> None:
        """Stop reading and hang up; a no-op once the answer is complete."""
        with self._lock:
            if self._done:
                return
            self.cancelled = True
            stream, self._stream = self._stream, None
        if stream is not None:
            _hang_up(stream)

    def _read(self, client: openai.OpenAI, body: dict) -> None:
        try:
            stream = client.chat.completions.create(**body)
            with self._lock:
                opened = not self.cancelled
                if opened:
                    self._stream = stream
            if not opened:  # stopped while the request was on its way
                _hang_up(stream)
                return
            for chunk in stream:
                self._take(chunk)
        except Exception as exc:  # noqa: BLE001 - the client's errors, or a socket closed under it
            if not self.cancelled:
                self._put("error", exc)
        finally:
            with self._lock:
                self._stream, self._done = None, True
            self._queue.put(None)

    def _take(self, chunk) -> None:
        """One chunk's pieces. Some servers send chunks with no choices (the usage chunk,
        keep-alives): only what is there is taken."""
        if getattr(chunk, "usage", None) is not None:
            self._put("usage", chunk.usage)
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None:
                thinking = getattr(delta, "reasoning_content", None) or getattr(
                    delta, "reasoning", None
                )
                if isinstance(thinking, str) and thinking:
                    self._put("reasoning", thinking)
                if delta.content:
                    self._put("text", delta.content)
            if choice.finish_reason:
                self._put("finish", choice.finish_reason)

    def _put(self, kind: str, value) -> None:
        self._queue.put((kind, value, time.perf_counter()))


def _hang_up(stream) -> None:
    """Close the connection under a stream, waking a read blocked on it: closing alone
    would leave the socket open until the server's next byte."""
    network = stream.response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    try:
        stream.close()
    except Exception:  # noqa: BLE001 - the socket is already gone
        pass


def remote_error(
    exc: BaseException, endpoint: RemoteEndpoint, model: str | None = None, midway: bool = False
) -> RemoteError:
    """The one line for what went wrong talking to the server."""
    where = endpoint.base_url
    if midway:
        return RemoteError(
            f"the server at {where} broke off the answer midway ({_cause(exc)}); "
            "the answer so far is kept"
        )
    if isinstance(exc, openai.APITimeoutError):
        return RemoteError(f"the server at {where} did not answer in time")
    if isinstance(exc, openai.APIConnectionError):
        return RemoteError(f"cannot reach the server at {where} ({_cause(exc)})")
    if isinstance(exc, openai.AuthenticationError):
        return RemoteError(
            f"the server at {where} refused the API key (401: {_message(exc)}); "
            "give --api-key or set OPENAI_API_KEY"
        )
    if isinstance(exc, openai.NotFoundError):
        what = f"no model '{model}'" if model else "no such endpoint"
        return RemoteError(
            f"the server at {where} has {what} (404: {_message(exc)}); "
            "`miniapp models list --base-url URL` lists its models"
        )
    if isinstance(exc, openai.APIStatusError):
        return RemoteError(f"the server at {where} answered {exc.status_code}: {_message(exc)}")
    return RemoteError(f"the server at {where} failed: {_cause(exc)}")


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return " ".join(str(message).split())
    return exc.message


def _cause(exc: BaseException) -> str:
    """The lowest-level reason ('connection refused'), not the client's generic wrapper."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]
