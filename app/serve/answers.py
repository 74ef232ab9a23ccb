"""What OpenAI's chat and completion endpoints run, shared by the other chat-shaped APIs
(Anthropic's messages, OpenAI's responses): a request in OpenAI's chat shape becomes jobs on
the served model, started on a relay, with the `Answer` that says how to present them.

`AnswerService.start_chat(body)` returns the started relay and its Answer; the OpenAI routes
send the events on as chunks (`reply`), the other APIs translate them into their own events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from miniapp.engine.api import (
    ConstraintError,
    Finished,
    GenerationRequest,
    LoraChoice,
    Message,
    OutputConstraint,
    SamplingParams,
    TextDelta,
    Tokenizer,
    TokenLogprob,
)

from .breaker import CircuitBreaker, Verdict
from .errors import ApiError, bad_request
from .images import ServedImages, vision_producer
from .logprobs import chat_logprobs, completion_logprobs
from .lora import Picked, pick_adapters
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, Sampling
from .quotas import admit_current, current_key_name
from .records import CURRENT_RECORD, Observers
from .service import (
    Job,
    Lease,
    Relay,
    ServedModel,
    check_fits,
    finish_reason,
    seeded,
    token_limit,
)
from .tools import CallStream, ToolPlan, messages_for

FINGERPRINT = "miniapp"


@dataclass
class _ChatPlan:
    """What a chat request's answers run with, before they are started."""

    picked: Picked
    tools: ToolPlan | None
    constraint: OutputConstraint | None
    messages: list[Message]
    prompt: list[int] | None = None  # None: pictures, for the vision model


class AnswerService:
    """Chat and completion requests, from a checked body to a started relay."""

    def __init__(
        self,
        served: ServedModel,
        images: ServedImages,
        metrics: ServeMetrics,
        defaults: SamplingParams,
        breaker: CircuitBreaker | None = None,
    ):
        self.served, self.images, self.metrics = served, images, metrics
        self.defaults = defaults  # the settings' sampling, for what a request leaves unset
        self.breaker = breaker  # refuses at once while the engine keeps failing

    async def start_chat(self, body: ChatCompletionRequest) -> tuple[Relay, Answer]:
        """The chat's answers, accepted by the engine (what refuses them raises here)."""
        _refuse(body.refused())
        return await self._leased(body.model, lambda lease: self._start_chat(body, lease))

    async def count_chat_tokens(self, body: ChatCompletionRequest) -> int:
        """The prompt's tokens as start_chat would build them (the same checks, template
        and tools' description), for token-counting endpoints."""
        _refuse(body.refused())
        with self.served.using(body.model) as lease:
            plan = await self._plan_chat(body, lease)
        if plan.prompt is None:
            raise bad_request(
                "counting the tokens of pictures is not supported: this model reads them with "
                "its vision projector, whose prompt is built as it answers",
                "messages",
            )
        return len(plan.prompt)

    async def _plan_chat(self, body: ChatCompletionRequest, lease: Lease) -> _ChatPlan:
        served, runtime = self.served, lease.runtime
        picked = pick_adapters(served, runtime, body.model, body.lora)
        tools = ToolPlan.of(body)
        template = served.template(runtime)
        if tools is not None:
            tools = tools.for_template(template)
        constraint = tools.constraint() if tools else _output_constraint(body)
        messages = messages_for(tools, template, await self.images.messages(body.messages))
        plan = _ChatPlan(picked, tools, constraint, messages)
        if any(m.pictures for m in messages):
            if not lease.default:
                raise bad_request(
                    f"pictures go to the server's own model ({served.model_id}), not to "
                    "models loaded on demand",
                    "model",
                    code="unsupported_parameter",
                )
            return plan  # the vision model builds its prompt as it answers
        plan.prompt = served.chat_prompt(
            runtime, messages, tools.template_tools() if tools else None
        )
        check_fits(runtime, plan.prompt, "messages")
        return plan

    async def _start_chat(self, body: ChatCompletionRequest, lease: Lease) -> tuple[Relay, Answer]:
        served, runtime = self.served, lease.runtime
        plan = await self._plan_chat(body, lease)
        picked, tools, prompt = plan.picked, plan.tools, plan.prompt
        if prompt is None:
            pictured = _jobs_with_pictures(
                served, self.images, body, plan.messages, self.defaults, plan.constraint, picked
            )
            answer = Answer("chatcmpl", lease.model_id, body, None, runtime.tokenizer, tools=tools)
            return await self._started(lease, pictured, answer), answer
        limit = token_limit(runtime, prompt, body.token_limit())
        base = _generation_request(body, self.defaults, limit, plan.constraint, picked.choices)
        jobs = [Job(i, prompt, seeded(base, i)) for i in range(body.n)]
        answer = Answer(
            "chatcmpl",
            picked.model or lease.model_id,
            body,
            len(prompt),
            runtime.tokenizer,
            tools=tools,
            adapters=picked.names,
        )
        return await self._started(lease, jobs, answer), answer

    async def start_completion(self, body: CompletionRequest) -> tuple[Relay, Answer]:
        _refuse(body.refused())
        return await self._leased(body.model, lambda lease: self._start_completion(body, lease))

    async def _leased(self, model: str, start) -> tuple[Relay, Answer]:
        """`start(lease)` on the named model, once the circuit breaker lets it through;
        the relay it starts ends the lease when it closes, and a request refused before
        that ends it here."""
        verdict = Verdict(self.breaker, self.breaker.admit() if self.breaker else False)
        try:
            lease = self.served.acquire(model)
        except BaseException:
            verdict.abandoned()
            raise
        lease.verdict = verdict
        try:
            return await start(lease)
        except BaseException:
            verdict.abandoned()
            lease.end()
            raise

    async def _start_completion(
        self, body: CompletionRequest, lease: Lease
    ) -> tuple[Relay, Answer]:
        served, runtime = self.served, lease.runtime
        picked = pick_adapters(served, runtime, body.model, body.lora)
        constraint = _output_constraint(body)
        jobs, prompt_tokens, echoes = [], 0, {}
        for p, given in enumerate(body.prompts()):
            prompt = served.text_prompt(runtime, given)
            check_fits(runtime, prompt, "prompt")
            prompt_tokens += len(prompt)
            limit = token_limit(runtime, prompt, body.token_limit())
            base = _generation_request(body, self.defaults, limit, constraint, picked.choices)
            for j in range(body.n):
                index = p * body.n + j
                jobs.append(Job(index, prompt, seeded(base, j)))
                if body.echo:
                    echoes[index] = (
                        given if isinstance(given, str) else runtime.tokenizer.decode(list(given))
                    )
        answer = Answer(
            "cmpl",
            picked.model or lease.model_id,
            body,
            prompt_tokens,
            runtime.tokenizer,
            echoes,
            adapters=picked.names,
        )
        return await self._started(lease, jobs, answer), answer

    async def _started(self, lease: Lease, jobs: list[Job], answer: Answer) -> Relay:
        """The relay, started and accepted once the key's quota admits it (a 429 if not);
        it ends the lease and settles the quota when it closes."""
        reserved = sum(len(job.prompt) + job.request.max_tokens for job in jobs)
        use = admit_current(reserved)
        observer = self.metrics.observer(len(jobs), answer.adapters)
        record = CURRENT_RECORD.get()
        if record is not None:
            record.model, record.adapters = answer.model, answer.adapters
            record.stream, record.priority = bool(answer.body.stream), answer.body.priority
            observer = Observers(observer, record.timings([len(job.prompt) for job in jobs]))
        relay = Relay(self.served.host, lease.runtime, jobs, observer, lease, use)
        if record is not None:
            record.on_stop(relay.close)
        relay.start()
        try:
            await relay.accepted()
        except BaseException:
            relay.close()
            raise
        return relay


async def reply(relay: Relay, answer: Answer, request: Request):
    """OpenAI's response to a started relay: a stream of chunks, or one body."""
    if answer.body.stream:
        return StreamingResponse(
            _stream(relay, answer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _complete(relay, answer, request)


# ------------------------------------------------------------------ requests


def _refuse(refusal: tuple[str, str] | None) -> None:
    if refusal is not None:
        field, why = refusal
        raise bad_request(why, field, code="unsupported_parameter")


def _output_constraint(body: Sampling) -> OutputConstraint | None:
    """The answer's constraint; a schema that does not compile is a 400 naming why."""
    try:
        return body.output_constraint()
    except ConstraintError as exc:
        raise bad_request(str(exc), body.constraint_field(), code="invalid_schema") from None


def _generation_request(
    body: Sampling,
    defaults: SamplingParams,
    max_tokens: int,
    constraint: OutputConstraint | None = None,
    lora: tuple[LoraChoice, ...] = (),
):
    fields = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "seed",
            "top_k",
            "min_p",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
    }
    sampling = replace(
        defaults,
        **{k: v for k, v in fields.items() if v is not None},
        logprobs=body.logprob_count(),
        constraint=constraint,
        lora=lora,
        priority=body.priority,
        client=current_key_name(),
        kv_policy=body.kv_policy,
    )
    return GenerationRequest(
        max_tokens=max_tokens,
        sampling=sampling,
        stop=body.stops(),
        ignore_end_of_turn=body.ignore_eos,
    )


# ------------------------------------------------------------------ responses


@dataclass
class Answer:
    """The response being built: one id and creation time for every chunk."""

    prefix: str  # "chatcmpl" or "cmpl"
    model: str
    body: Sampling
    prompt_tokens: int | None  # None: as the answers' figures say (the vision path)
    tokenizer: Tokenizer
    echoes: dict[int, str] | None = None
    tools: ToolPlan | None = None  # the answers may be tool calls
    adapters: tuple[str, ...] = ()  # the LoRA adapters the answers run with (metrics)

    def __post_init__(self):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.chat = self.prefix == "chatcmpl"

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        }

    def usage(self, finished: dict[int, Finished]) -> dict:
        completion = sum(f.stats.generated_tokens for f in finished.values())
        cached = max((f.stats.cached_prompt_tokens for f in finished.values()), default=0)
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = max((f.stats.prompt_tokens for f in finished.values()), default=0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def choice(
        self, index: int, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]
    ) -> dict:
        reason = finish_reason(finished)
        echo = (self.echoes or {}).get(index, "")
        shown = self._logprobs(logprobs, len(echo))
        calls = self.tools.calls_in(text) if self.tools else None
        if calls:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [call.as_openai() for call in calls],
            }
            return {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": shown,
                "finish_reason": reason,
            }
        return {"index": index, "text": echo + text, "logprobs": shown, "finish_reason": reason}

    def call_delta(self, index: int, part: dict) -> dict:
        """A streamed piece of a tool call (see tools.CallStream)."""
        return {
            "index": index,
            "delta": {"tool_calls": [part]},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta(
        self,
        index: int,
        text: str | None = None,
        role: bool = False,
        reason: str | None = None,
        logprobs: Sequence[TokenLogprob] = (),
        offset: int = 0,
    ) -> dict:
        shown = self._logprobs(logprobs, offset) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": shown, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": shown, "finish_reason": reason}

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> dict | None:
        if self.body.logprob_count() is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.tokenizer)
        return completion_logprobs(entries, self.tokenizer, offset)


def _jobs_with_pictures(
    served: ServedModel,
    images: ServedImages,
    body: ChatCompletionRequest,
    messages: list[Message],
    defaults: SamplingParams,
    constraint: OutputConstraint | None,
    picked: Picked,
) -> list[Job]:
    """A chat with pictures goes to the model's vision projector: its answers take turns on
    the vision runtime, which evaluates the pictures (OCR'd images never come here)."""
    if picked.asked:
        raise bad_request(
            "LoRA adapters are not applied to answers about pictures (the vision model's path)",
            "lora" if picked.model is None else "model",
            code="unsupported_parameter",
        )
    if body.logprob_count() is not None:
        raise bad_request(
            "logprobs are not reported for answers about pictures (the vision model's path)",
            "logprobs",
            code="unsupported_parameter",
        )
    limit = body.token_limit() or served.runtime().n_ctx
    base = _generation_request(body, defaults, limit, constraint)
    requests = [seeded(base, i) for i in range(body.n)]
    return [
        Job(i, [], r, produce=vision_producer(served, images.route, messages, r))
        for i, r in enumerate(requests)
    ]


async def _complete(relay: Relay, answer: Answer, request: Request) -> JSONResponse:
    texts: dict[int, list[str]] = {job.index: [] for job in relay.jobs}
    logprobs: dict[int, list[TokenLogprob]] = {job.index: [] for job in relay.jobs}
    finished: dict[int, Finished] = {}
    async for index, event in until_disconnected(relay, request):
        if isinstance(event, TextDelta):
            texts[index].append(event.text)
            logprobs[index].extend(event.logprobs)
        elif isinstance(event, Finished):
            finished[index] = event
    choices = [
        answer.choice(i, "".join(texts[i]), finished[i], logprobs[i]) for i in sorted(finished)
    ]
    body = answer.envelope(choices, chunk=False)
    body["usage"] = answer.usage(finished)
    return JSONResponse(body)


async def until_disconnected(relay: Relay, request: Request) -> AsyncIterator:
    """The relay's events; a client that hangs up on a plain response cancels it too."""
    checked = time.monotonic()
    async for item in relay.events():
        yield item
        if time.monotonic() - checked > 0.25:
            checked = time.monotonic()
            if await request.is_disconnected():
                relay.close()
                return


async def _stream(relay: Relay, answer: Answer) -> AsyncIterator[str]:
    """Server-sent events. Cancelled (the client went away), the relay's `finally` stops
    every generation. An error once streaming (the engine failed) is the last event, in
    the error shape, as OpenAI's streams end on one."""
    try:
        async for chunk in _chunks(relay, answer):
            yield chunk
    except ApiError as exc:
        _record_stream_error(exc.message)
        yield sse(exc.body())


def _record_stream_error(message: str) -> None:
    record = CURRENT_RECORD.get()
    if record is not None:
        record.error = message


async def _chunks(relay: Relay, answer: Answer) -> AsyncIterator[str]:
    finished: dict[int, Finished] = {}
    usage_field = {"usage": None} if answer.body.include_usage else {}
    offsets = dict.fromkeys((job.index for job in relay.jobs), 0)  # characters sent, per choice
    # With tools, an answer's text is held until it is known not to be a call; a call is sent
    # as tool_calls deltas while the model writes it.
    held = dict.fromkeys((job.index for job in relay.jobs), "") if answer.tools else {}
    calls: dict[int, CallStream] = {}
    for job in relay.jobs:
        if answer.chat:
            yield sse(answer.envelope([answer.delta(job.index, role=True)], True) | usage_field)
        elif answer.echoes and job.index in answer.echoes:
            echo = answer.echoes[job.index]
            offsets[job.index] = len(echo)
            yield sse(answer.envelope([answer.delta(job.index, echo)], True) | usage_field)
    async for index, event in relay.events():
        if isinstance(event, TextDelta):
            text = event.text
            if index in held:
                held[index] += text
                start, opener = held[index].lstrip(), answer.tools.opener
                if len(start) < len(opener) and opener.startswith(start):
                    continue  # blank, or may still become a call
                text = held.pop(index)  # what was held goes first
                if start.startswith(opener):
                    calls[index] = answer.tools.call_stream()
            if index in calls:
                for part in calls[index].feed(text):
                    yield sse(answer.envelope([answer.call_delta(index, part)], True) | usage_field)
                continue
            delta = answer.delta(index, text, logprobs=event.logprobs, offset=offsets[index])
            offsets[index] += len(text)
            yield sse(answer.envelope([delta], True) | usage_field)
        elif isinstance(event, Finished):
            finished[index] = event
            reason = finish_reason(event)
            text = held.pop(index, "")  # blank, or the start of an unfinished call
            stream = calls.pop(index, None)
            if stream is not None and answer.tools.calls_in(stream.text):
                reason = "tool_calls"
            elif stream is not None and not stream.opened:
                text = stream.text  # cut off by max_tokens before a call opened: its text
            if text:
                yield sse(answer.envelope([answer.delta(index, text)], True) | usage_field)
            last = answer.delta(index, reason=reason)
            yield sse(answer.envelope([last], True) | usage_field)
    if answer.body.include_usage:
        yield sse(answer.envelope([], True) | {"usage": answer.usage(finished)})
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
