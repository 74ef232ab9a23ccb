"""What the API's handlers ask of the engine: the loaded model, prompts as tokens, and answers
as typed events relayed from generation threads into the event loop.

On the batching engine (`--parallel` above 1) every answer runs on its own thread and its
sequence joins the running batch; the steps themselves run on the host's compute thread
(the process's main thread). Otherwise answers take turns under the host's generation lock,
produced on the compute thread as the GUI's are.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from miniapp.engine.api import (
    ChatTemplate,
    ContextFullError,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    Message,
    MiniappError,
    QueueFullError,
    Runtime,
    RuntimeConfig,
    TokenStream,
    UnknownAdapterError,
    generate,
    resolve_model,
)

from ..host.model_host import (
    LoadState,
    ModelHost,
    ModelLoadError,
    ModelLoading,
    installed_model_spec,
    model_name,
)
from .breaker import Verdict
from .errors import ApiError, bad_request
from .quotas import KeyUse, settle

log = logging.getLogger("miniapp.serve")
RETRY_AFTER_S = 1  # what a client told "busy" (503) should wait before trying again


@dataclass
class Lease:
    """A model held for one request: never let go while leased (see ModelHost.acquire)."""

    runtime: Runtime
    model_id: str  # what the answers call it
    default: bool  # the server's own model (its adapters and pictures apply)
    release: Callable[[], None] = field(repr=False)
    verdict: Verdict = field(default_factory=lambda: Verdict(None, False), repr=False)
    _done: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def end(self) -> None:
        """Release once, however often called."""
        if self._done.acquire(blocking=False):
            self.release()


@dataclass(frozen=True)
class Job:
    """One answer to produce: a choice of a request."""

    index: int  # the choice's index in the response
    prompt: list[int]
    request: GenerationRequest
    # Instead of generating from `prompt` on the relay's runtime: this function's events
    # (given should_stop), taking turns with other answers (the vision model's chats).
    produce: Callable[[Callable[[], bool]], Iterator[GenerationEvent]] | None = None


class ServedModel:
    """The models this server answers with, loaded by the shared ModelHost: its default,
    the model asked for at start (or, beside the GUI, whichever model the GUI loaded since),
    and any other installed model a request names, loaded on demand with the same settings
    (`acquire`)."""

    def __init__(self, host: ModelHost, spec: RuntimeConfig, template_source: str | None = None):
        self.host, self._asked = host, spec
        self._template_source = template_source  # instead of the default model's template
        self._templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def spec(self) -> RuntimeConfig:
        return self.host.loaded_spec or self._asked

    @property
    def model_id(self) -> str:
        """What /v1/models calls it: a bundled model's name, or the GGUF's file name."""
        return model_name(self.spec)

    @property
    def model_path(self) -> Path:
        return resolve_model(self.spec.model)

    @property
    def aliases(self) -> set[str]:
        """Names a request may give for this model: its id, its file's name and stem."""
        path = Path(self.spec.model)
        return {self.model_id, self.spec.model, path.name, path.stem}

    def spec_for(self, name: str | None) -> RuntimeConfig | None:
        """The model a request names: the default (by any of its names, or no name), or
        another installed model opened with the default's settings; None for neither."""
        if name is None or name in self.aliases:
            return self.spec
        spec = installed_model_spec(self.spec, name)
        if spec is not None and resolve_model(spec.model).resolve() == self.model_path.resolve():
            return self.spec  # the default's file by another of its names: not a second copy
        return spec

    def acquire(self, name: str | None) -> Lease:
        """The named model (an adapter's name: the default), leased for one request: 503
        with Retry-After while it loads or cannot load beside the models answering now."""
        spec = self.spec_for(name)
        if spec is None:  # an adapter's name, or a 404 before anything loads
            self.check_model(name, self._adapter_names())
            spec = self.spec
        try:
            runtime = self.host.acquire(spec)
        except ModelLoading as exc:
            raise ApiError(
                503,
                f"the model is not ready: {exc}",
                kind="server_error",
                code="model_loading",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        except ModelLoadError as exc:
            raise bad_request(str(exc), "model") from None
        default = spec == self.spec
        return Lease(runtime, model_name(spec), default, lambda: self.host.release(runtime))

    def _adapter_names(self) -> set[str]:
        """Adapters a request may name for the default model: those it was started with,
        and, while it is loaded, those loaded since."""
        names = {spec.name for spec in self.spec.lora}
        registry = getattr(self.host.runtime, "lora", None)
        if registry is not None:
            names |= {adapter.name for adapter in registry.list()}
        return names

    @contextmanager
    def using(self, name: str | None) -> Iterator[Lease]:
        """The named model, leased for the length of a `with` block."""
        lease = self.acquire(name)
        try:
            yield lease
        finally:
            lease.end()

    def check_model(self, name: str, adapters: Sequence[str] = ()) -> None:
        """404 for a name that is neither an installed model's nor one of `adapters`'
        (loaded LoRA adapters, which a request may name instead, see lora.py)."""
        if self.spec_for(name) is None and name not in adapters:
            also = f" and the adapters {', '.join(adapters)}" if adapters else ""
            raise ApiError(
                404,
                f"The model '{name}' does not exist (this server runs '{self.model_id}'"
                f"{also}, and the installed models /v1/models lists)",
                code="model_not_found",
                param="model",
            )

    def runtime(self) -> Runtime:
        """The default model's runtime, not leased (its adapters' endpoints); 503 while it
        loads (or if it failed to, or was unloaded)."""
        status = self.host.status
        runtime = self.host.runtime
        if runtime is None or status.state is LoadState.LOADING:
            raise ApiError(
                503,
                f"the model is not ready: {status.message}",
                kind="server_error",
                code="model_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return runtime

    def template(self, runtime: Runtime) -> ChatTemplate:
        """The runtime's chat template: for the default model `--chat-template-file` if
        given, else the model's own (kept while the runtime lives)."""
        template = self._templates.get(runtime)
        if template is None:
            source = runtime.chat_template
            if self._template_source and Path(runtime.model_path) == self.model_path:
                source = self._template_source
            template = ChatTemplate.for_model(source, runtime.tokenizer, runtime.architecture)
            self._templates[runtime] = template
        return template

    def chat_prompt(
        self, runtime: Runtime, messages: list[Message], tools: list[dict] | None = None
    ) -> list[int]:
        try:
            rendered = self.template(runtime).render(messages, tools=tools)
        except MiniappError as exc:
            raise bad_request(
                f"the chat template refused these messages: {exc}", "messages"
            ) from None
        return runtime.tokenizer.encode_chat(rendered)

    def text_prompt(self, runtime: Runtime, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            tokens = runtime.tokenizer.encode(prompt)
        else:
            tokens = list(prompt)
            vocab = runtime.tokenizer.n_vocab
            if any(not 0 <= t < vocab for t in tokens):
                raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        if not tokens:
            raise bad_request("the prompt is empty", "prompt")
        return tokens


def check_fits(runtime: Runtime, prompt: list[int], param: str) -> None:
    """A prompt the context cannot hold is a 400 with the counts, before anything runs."""
    if len(prompt) >= runtime.n_ctx:
        raise bad_request(
            f"This model's maximum context length is {runtime.n_ctx} tokens. However, your "
            f"{param} resulted in {len(prompt)} tokens.",
            param,
            code="context_length_exceeded",
        )


def token_limit(runtime: Runtime, prompt: list[int], asked: int | None) -> int:
    """max_tokens as asked; unset, what the context has left (a sliding window keeps going
    past it only when asked for more)."""
    if asked is not None:
        return asked
    return max(1, runtime.n_ctx - len(prompt))


def seeded(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of a seeded request draws from its own seed (seed + index), so choices
    differ and each is reproducible."""
    seed = request.sampling.seed
    if seed is None or index == 0:
        return request
    return replace(request, sampling=replace(request.sampling, seed=seed + index))


class RelayObserver:
    """What a relay reports of its jobs as they run (the server's metrics). The hooks are
    called on generation threads and the compute thread, so they must be quick and
    thread-safe; these do nothing."""

    def opened(self, index: int) -> None:
        """Job `index` has its token stream: it runs, or waits for a batch slot."""

    def token(self, index: int) -> None:
        """Job `index` got one more token from the engine."""

    def ended(self, index: int) -> None:
        """Job `index`'s token stream closed: it finished, failed or was cancelled."""

    def finished(self, index: int, finished: Finished) -> None:
        """Job `index`'s answer is complete (called before the client can see it)."""

    def closed(self) -> None:
        """The relay was closed (maybe more than once): jobs not opened yet never run."""


class Relay:
    """Runs the jobs' generations on threads; `events()` yields (index, event) in the event
    loop. `close()` (the client went away) cancels every job at once."""

    _DONE = object()
    _OPENED = object()  # a job's generation was accepted (it runs, or waits for a slot)

    def __init__(
        self,
        host: ModelHost,
        runtime: Runtime,
        jobs: list[Job],
        observer: RelayObserver | None = None,
        lease: Lease | None = None,
        key_use: KeyUse | None = None,
    ):
        self.host, self.runtime, self.jobs = host, runtime, jobs
        self.observer = observer or RelayObserver()
        self.lease = lease  # ended when the relay closes
        self.key_use = key_use  # its key's quota, settled when the relay closes
        self.tokens_used = 0  # prompts and answers, as the finished answers count them
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._streams: list[TokenStream] = []
        self._lock = threading.Lock()
        self._early: list = []  # events that arrived while `accepted` waited

    def start(self) -> Relay:
        if self.batched:
            for job in self.jobs:
                threading.Thread(target=self._run, args=([job],), daemon=True).start()
        else:
            threading.Thread(target=self._run_in_turn, daemon=True).start()
        return self

    async def accepted(self) -> None:
        """Wait until the engine has taken the request (its answers run or wait for a slot):
        what refuses it (a full queue, a prompt the runtime will not take) surfaces here,
        before any response is sent. Answers that take turns are taken one at a time."""
        needed = len(self.jobs) if self.batched else 1
        taken: set[int] = set()  # jobs that opened a stream or already produced something
        while len(taken) < needed:
            item = await self._queue.get()
            _raise_if_error(item)
            index, event = item
            if event is not self._OPENED:
                self._early.append(item)
            taken.add(index)

    @property
    def batched(self) -> bool:
        """Whether the jobs run at once (the batching engine), rather than in turn."""
        return self.runtime.parallel > 1 and not any(job.produce for job in self.jobs)

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        remaining = len(self.jobs)
        try:
            while remaining:
                item = self._early.pop(0) if self._early else await self._queue.get()
                _raise_if_error(item)
                index, event = item
                if event is self._OPENED:
                    continue
                if event is self._DONE:
                    remaining -= 1
                    continue
                yield index, event
        finally:
            self.close()

    def close(self) -> None:
        self._cancel.set()
        self.observer.closed()
        if self.lease is not None:
            self.lease.verdict.abandoned()  # unless the engine already gave one
            self.lease.end()
        settle(self.key_use, self.tokens_used)
        with self._lock:
            streams = list(self._streams)
        for stream in streams:  # a batched sequence is dropped at the next step
            stream.close()

    # -- the generation threads

    def _put(self, item) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _opened(self, index: int, stream: TokenStream) -> None:
        if self.runtime.parallel > 1:  # a batched stream may be closed from any thread
            with self._lock:
                self._streams.append(stream)
            if self._cancel.is_set():
                stream.close()
        self._put((index, self._OPENED))

    def _run(self, jobs: list[Job], relay=lambda events: events) -> None:
        try:
            for job in jobs:
                if self._cancel.is_set():
                    break
                opened = functools.partial(self._opened, job.index)
                if job.produce is not None:
                    events = job.produce(self._cancel.is_set)
                else:
                    runtime = _ObservedRuntime(self.runtime, self.observer, job.index)
                    events = generate(
                        runtime, job.prompt, job.request, self._cancel.is_set, on_tokens=opened
                    )
                for event in relay(events):
                    if isinstance(event, Finished):
                        self._verdict().succeeded()
                        self.observer.finished(job.index, event)
                        with self._lock:
                            self.tokens_used += len(job.prompt) + event.stats.generated_tokens
                    self._put((job.index, event))
                self._put((job.index, self._DONE))
        except BaseException as exc:  # noqa: BLE001 - raised in the event loop instead
            if engine_failure(exc):
                self._verdict().failed(f"{type(exc).__name__}: {exc}")
            self._put(exc)

    def _verdict(self) -> Verdict:
        return self.lease.verdict if self.lease is not None else Verdict(None, False)

    def _run_in_turn(self) -> None:
        """One answer at a time on a runtime that does not batch, on the compute thread."""
        try:
            with self.host.generation_lock:
                self._run(self.jobs, self.host.compute.iterate)
        except BaseException as exc:  # noqa: BLE001
            self._put(exc)


class _ObservedRuntime:
    """The runtime as `generate` sees it for one job: the observer hears of every token (the
    events carry text, which holds any number of tokens) and of the stream's opening and
    closing. Everything else is the runtime's own."""

    def __init__(self, runtime: Runtime, observer: RelayObserver, index: int):
        self._runtime, self._observer, self._index = runtime, observer, index

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    def generate_tokens(self, *args, **kwargs) -> _ObservedTokens:
        tokens = self._runtime.generate_tokens(*args, **kwargs)
        self._observer.opened(self._index)
        return _ObservedTokens(tokens, self._observer, self._index)


class _ObservedTokens:
    """A token stream that tells the observer of each token as it arrives and of its closing;
    its figures (cached_prompt_tokens, queued_s, ...) are read from the stream itself."""

    def __init__(self, tokens: TokenStream, observer: RelayObserver, index: int):
        self._tokens, self._observer, self._index = tokens, observer, index
        self._unclosed = threading.Lock()  # taken by the first close

    def __getattr__(self, name: str):
        return getattr(self._tokens, name)

    def __iter__(self) -> _ObservedTokens:
        return self

    def __next__(self) -> int:
        token = next(self._tokens)
        self._observer.token(self._index)
        return token

    def close(self) -> None:
        self._tokens.close()
        # A client that leaves has the relay close the stream while `generate` closes it too.
        if self._unclosed.acquire(blocking=False):
            self._observer.ended(self._index)


def engine_failure(exc: BaseException) -> bool:
    """Whether an error raised while generating is the engine's own (out of memory, a native
    fault), rather than the request's (a bad constraint, a full queue) or a stop."""
    if isinstance(exc, (ApiError, MiniappError)):
        return False
    return isinstance(exc, Exception)


def _raise_if_error(item) -> None:
    if isinstance(item, BaseException):
        raise api_error_for(item) from item


def api_error_for(exc: BaseException) -> ApiError | BaseException:
    """The HTTP answer to an error raised while generating."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return ApiError(
            503,
            str(exc),
            kind="server_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, ModelLoadError):
        return ApiError(
            503,
            str(exc),
            kind="server_error",
            code="model_loading",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, UnknownAdapterError):  # unloaded after the request was checked
        return ApiError(404, str(exc), code="model_not_found")
    if isinstance(exc, ContextFullError):
        return bad_request(str(exc), code="context_length_exceeded")
    if isinstance(exc, MiniappError):
        return bad_request(str(exc))
    if engine_failure(exc):  # answered in the API's shape, the connection kept
        log.error("the engine failed", exc_info=exc)
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", kind="server_error")
    return exc


def finish_reason(finished: Finished) -> str:
    """OpenAI's finish_reason: the model ended or hit a stop string, or ran out of tokens."""
    if finished.reason in (FinishReason.END_OF_TURN, FinishReason.STOP_STRING):
        return "stop"
    return "length"
