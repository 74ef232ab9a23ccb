"""`POST /v1/audio/transcriptions`: OpenAI's transcription API on our speech recogniser.

The request is OpenAI's multipart form: `file`, `model`, and optionally `language`, `prompt`,
`temperature`, `response_format` (json, text, srt, vtt, verbose_json),
`timestamp_granularities[]` and `stream`. Without `stream` the file takes the path
`miniapp transcribe` takes (windows of up to 30 s, beam search, refined word edges); with
`stream=true` it takes `transcribe --stream`'s (live-sized chunks through the streaming
transcriber on a replay clock), and each batch of committed words is sent as a
`transcript.text.delta` event as soon as it is committed, with its words' times on the stream
clock. A stream that asks for `include[]=partials` (our extension) also gets a
`transcript.text.partial` event whenever the uncommitted tail changes: the words heard but
not yet final, which a later partial replaces and a delta makes final.

There is one recogniser per server, loaded by the first request and kept. It is not
thread-safe, so one worker thread runs every transcription, one at a time; the event loop only
waits for what that thread sends it.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from miniapp.engine.api import DEFAULT_ASR_MODEL, MiniappError
from miniapp.engine.voice.asr import FRAMES_PER_SECOND, LANGUAGE, WhisperASR, load_asr
from miniapp.engine.voice.audio import SAMPLE_RATE, AudioFileError, iter_audio
from miniapp.engine.voice.events import PartialText, Word, WordsCommitted, words_text
from miniapp.engine.voice.export import cues, to_srt, to_vtt
from miniapp.engine.voice.offline import transcribe_blocks
from miniapp.engine.voice.streaming import ReplayClock, StreamingTranscriber, replay

from .errors import ApiError, bad_request

log = logging.getLogger("miniapp.serve")

OPENAI_MODEL = "whisper-1"  # what OpenAI clients send: it names this server's recogniser
LANGUAGE_NAME = "english"  # verbose_json names the language, as OpenAI does (asr.LANGUAGE)
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
STREAM_FORMATS = ("json", "text")  # a stream is events of text, whatever the format
GRANULARITIES = ("word", "segment")
FIELDS = frozenset(
    {
        "file",
        "model",
        "language",
        "prompt",
        "temperature",
        "response_format",
        "timestamp_granularities",
        "stream",
        "include",
    }
)
# What `include[]` may ask for: OpenAI's is "logprobs" (not done here); "partials" is ours.
INCLUDES = ("partials",)
# OpenAI's fields that this server does not do: a request that sets one gets a 400 naming it.
NOT_SUPPORTED = frozenset(
    {
        "chunking_strategy",
        "keywords",
        "known_speaker_names",
        "known_speaker_references",
        "languages",
    }
)
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


def audio_router(served, options) -> APIRouter:
    router = APIRouter()
    recognizer = Recognizer(options.asr_model, options.threads)

    @router.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        async with _form(request) as form:
            asked, upload = parse_request(form)
            recognizer.check_model(asked.model)
            path = await _saved(upload, asked.file_name)
        job = recognizer.submit(asked, path)
        first = await job.next(request)
        if first is _GONE:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(first, ApiError):
            raise first
        if asked.stream:
            return StreamingResponse(
                _events(first, job),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return _response(asked, first)

    return router


# ------------------------------------------------------------------ the request


@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    file_name: str
    response_format: str = "json"
    granularities: frozenset[str] = frozenset()
    stream: bool = False
    prompt: str = ""
    partials: bool = False  # a stream that also sends the uncommitted tail as it changes

    @property
    def wants_segments(self) -> bool:
        """OpenAI's rule: segments unless only words were asked for."""
        return not self.granularities or "segment" in self.granularities

    @property
    def wants_words(self) -> bool:
        return "word" in self.granularities


@asynccontextmanager
async def _form(request: Request) -> AsyncIterator[FormData]:
    """The multipart form, its uploads closed afterwards. A body over the size limit stays a
    413 (the middleware's); an unreadable one is a 400."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise bad_request(
            "send the audio as multipart/form-data, with the fields 'file' and 'model'",
            "file",
            code="invalid_content_type",
        )
    try:
        form = await request.form()
    except StarletteHTTPException as exc:
        if exc.status_code != 400:
            raise
        raise bad_request(
            f"the multipart body could not be read: {exc.detail}", code="invalid_multipart"
        ) from None
    try:
        yield form
    finally:
        await form.close()


def parse_request(form: FormData) -> tuple[TranscriptionRequest, UploadFile]:
    """The form's fields, checked; a field that is missing, wrong or not supported here is a
    400 naming it (nothing is ignored silently)."""
    _refuse_other_fields(form)
    model = _text(form, "model")
    if model is None:
        raise _missing("model")
    upload = _upload(form)
    response_format = _text(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise _invalid("response_format", response_format, FORMATS)
    stream = _flag(form, "stream")
    if stream and response_format not in STREAM_FORMATS:
        raise bad_request(
            f"stream=true sends transcript.text events: response_format must be "
            f"json or text, not '{response_format}'",
            "response_format",
            code="unsupported_value",
        )
    _check_language(_text(form, "language"))
    _check_temperature(_text(form, "temperature"))
    asked = TranscriptionRequest(
        model,
        upload.filename or "file",
        response_format,
        _granularities(form, response_format),
        stream,
        _text(form, "prompt") or "",
        "partials" in _includes(form, stream),
    )
    return asked, upload


def _refuse_other_fields(form: FormData) -> None:
    for key in form.keys():
        name = key.split("[", 1)[0]  # arrays come as `name[]`, objects as `name[key]`
        if name in NOT_SUPPORTED:
            raise bad_request(
                f"'{name}' is not supported by this server", key, code="unsupported_parameter"
            )
        if name not in FIELDS:
            raise bad_request(
                f"Unrecognized request argument supplied: {key}", key, code="unknown_parameter"
            )


def _text(form: FormData, name: str) -> str | None:
    """A text field's value; None when absent or empty."""
    value = form.get(name)
    if isinstance(value, UploadFile):
        raise bad_request(f"'{name}' must be a text field, not a file", name, code="invalid_type")
    return value or None


def _upload(form: FormData) -> UploadFile:
    value = form.get("file")
    if value is None or value == "":
        raise _missing("file")
    if not isinstance(value, UploadFile):
        raise bad_request(
            "'file' must be an uploaded file (the audio), not a text field",
            "file",
            code="invalid_type",
        )
    return value


def _flag(form: FormData, name: str) -> bool:
    value = (_text(form, name) or "false").lower()
    if value not in ("true", "false"):
        raise _invalid(name, value, ("true", "false"))
    return value == "true"


def _granularities(form: FormData, response_format: str) -> frozenset[str]:
    key = "timestamp_granularities[]"
    values = [*form.getlist(key), *form.getlist("timestamp_granularities")]
    for value in values:
        if value not in GRANULARITIES:
            raise _invalid(key, str(value), GRANULARITIES)
    if values and response_format != "verbose_json":
        raise bad_request(
            f"'{key}' needs response_format verbose_json (it is '{response_format}')",
            key,
            code="invalid_value",
        )
    return frozenset(values)


def _includes(form: FormData, stream: bool) -> frozenset[str]:
    key = "include[]"
    values = [*form.getlist(key), *form.getlist("include")]
    for value in values:
        if value not in INCLUDES:
            raise _invalid(key, str(value), INCLUDES)
    if values and not stream:
        raise bad_request(
            f"'{key}=partials' needs stream=true (partial text is only sent while streaming)",
            key,
            code="invalid_value",
        )
    return frozenset(values)


def _check_language(language: str | None) -> None:
    if language is not None and language.lower() != LANGUAGE:
        raise bad_request(
            f"language '{language}' is not supported: this server's recogniser "
            f"transcribes English only ('{LANGUAGE}')",
            "language",
            code="unsupported_value",
        )


def _check_temperature(given: str | None) -> None:
    """Only 0: the recogniser decodes without sampling (beam search, streamed or not), so any
    other temperature would be ignored, which is refused instead."""
    if given is None:
        return
    try:
        temperature = float(given)
    except ValueError:
        raise bad_request(
            f"Invalid value for 'temperature': '{given}' is not a number",
            "temperature",
            code="invalid_value",
        ) from None
    if not 0 <= temperature <= 1:
        raise bad_request(
            "Invalid value for 'temperature': it must be between 0 and 1",
            "temperature",
            code="invalid_value",
        )
    if temperature != 0:
        raise bad_request(
            "temperature must be 0 here: this server's recogniser decodes without sampling",
            "temperature",
            code="unsupported_value",
        )


def _missing(name: str) -> ApiError:
    return bad_request(
        f"Missing required parameter: '{name}'", name, code="missing_required_parameter"
    )


def _invalid(name: str, value: str, choices: tuple[str, ...]) -> ApiError:
    return bad_request(
        f"Invalid value for '{name}': '{value}' (expected one of {', '.join(choices)})",
        name,
        code="invalid_value",
    )


async def _saved(upload: UploadFile, name: str) -> Path:
    """The upload copied to a file of our own (PyAV reads files by path; the form's spooled
    file closes with the request), off the event loop. The worker removes it when done."""
    suffix = Path(name).suffix[:16]  # FFmpeg guesses a raw format from it
    handle, path = tempfile.mkstemp(prefix="miniapp-upload-", suffix=suffix)
    try:
        with os.fdopen(handle, "wb") as out:
            await upload.seek(0)
            await asyncio.to_thread(shutil.copyfileobj, upload.file, out)
            size = out.tell()
    except BaseException:
        os.unlink(path)
        raise
    if size == 0:
        os.unlink(path)
        raise bad_request(f"{name}: the file is empty", "file", code="invalid_file")
    return Path(path)


# ------------------------------------------------------------------ the recogniser


_END = object()  # the job is over (sent last, after its result or error)
_GONE = object()  # the client hung up while its request waited


class _ClientGone(Exception):
    pass


class Job:
    """One transcription: what the worker thread sends the event loop (results, errors, then
    _END), and a flag the event loop sets when the client is gone, which stops the work."""

    def __init__(self, asked: TranscriptionRequest, path: Path) -> None:
        self.asked, self.path = asked, path
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()

    def send(self, item: object) -> None:
        """From the worker thread."""
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    def check(self) -> None:
        """On the worker thread, between pieces of work: stop if nobody waits any more."""
        if self.cancelled.is_set():
            raise _ClientGone

    async def next(self, request: Request | None = None) -> object:
        """The next item. Given the request, a client that hangs up meanwhile cancels the
        job (_GONE); a stream's client is watched by the streaming response instead."""
        if request is None:
            return await self._items.get()
        while True:
            try:
                return await asyncio.wait_for(self._items.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancelled.set()
                    return _GONE


@dataclass
class Transcript:
    words: list[Word]
    duration: float  # seconds of audio in the file
    segments: list[dict] | None = None  # verbose_json's, when asked for

    @property
    def text(self) -> str:
        return words_text(self.words)


class Recognizer:
    """This server's speech recogniser: the bundled tiny.en or --asr-model's folder."""

    def __init__(self, asr_model: str | None, threads: int | None) -> None:
        self.asr_model, self.threads = asr_model, threads
        self.name = _folder_name(asr_model) if asr_model else DEFAULT_ASR_MODEL
        self.names = {OPENAI_MODEL, self.name, *([asr_model] if asr_model else [])}
        self._asr: WhisperASR | None = None
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(
                404,
                f"The model '{name}' does not exist (this server transcribes "
                f"with '{OPENAI_MODEL}', its {self.name} recogniser)",
                code="model_not_found",
                param="model",
            )

    def submit(self, asked: TranscriptionRequest, path: Path) -> Job:
        job = Job(asked, path)
        if self._worker is None:
            # A daemon thread: a server that stops does not wait for the jobs still queued.
            self._worker = threading.Thread(target=self._work, name="transcription", daemon=True)
            self._worker.start()
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.check()  # its client may have left while it was queued
                self._run(job)
            except _ClientGone:
                pass
            except ApiError as exc:
                job.send(exc)
            except Exception as exc:
                log.exception("transcription failed")
                job.send(
                    ApiError(
                        500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"
                    )
                )
            finally:
                job.path.unlink(missing_ok=True)
                job.send(_END)

    def _run(self, job: Job) -> None:
        audio = UploadedAudio(job.path, job.asked.file_name, job.check)  # bad files fail here
        asr = self._loaded()
        if job.asked.stream:
            _stream_words(asr, audio, job)
        else:
            job.send(_transcribe(asr, audio, job))

    def _loaded(self) -> WhisperASR:
        """Loaded on first use (on the worker thread) and kept."""
        if self._asr is None:
            try:
                self._asr = load_asr(self.asr_model, self.threads)
            except MiniappError as exc:
                raise ApiError(
                    500,
                    f"the speech model could not be loaded: {exc}",
                    kind="server_error",
                    code="model_load_failed",
                ) from None
        return self._asr


def _folder_name(asr_model: str) -> str:
    return Path(asr_model).expanduser().resolve().name


class UploadedAudio:
    """An uploaded file's audio as 16 kHz blocks, counted as they go (for the duration). The
    first block is decoded at once, so a bad file is refused before the model loads."""

    def __init__(self, path: Path, name: str, check: Callable[[], None]) -> None:
        self.path, self.name, self.check = path, name, check
        self.samples = 0
        self._blocks = iter_audio(path)
        self._first = self._next_block()

    @property
    def duration(self) -> float:
        return self.samples / SAMPLE_RATE

    def blocks(self) -> Iterator:
        block = self._first
        while block is not None:
            self.check()
            self.samples += len(block)
            yield block
            block = self._next_block()

    def no_speech(self) -> ApiError:
        return bad_request(f"{self.name}: no speech found", "file", code="no_speech")

    def _next_block(self):
        try:
            return next(self._blocks, None)
        except AudioFileError as exc:
            # The message names our copy; the client knows the file by its own name.
            message = str(exc).replace(str(self.path), self.name)
            raise bad_request(message, "file", code="invalid_file") from None


@dataclass(frozen=True)
class _Window:
    offset: float  # where the window starts, seconds on the stream clock
    decode: object  # WhisperASR.last_decode: tokens, avg_log_prob, no_speech_prob, ...


@dataclass
class _Prompted:
    """The recogniser as the offline and streaming paths call it, plus what a request adds.
    The request's prompt goes before our own context on every window, so the names and
    spellings it gives are known throughout, not only in the first 30 s; offline, each
    window's decoding is kept for verbose_json's segment figures."""

    asr: WhisperASR
    prompt: str
    keep_windows: bool = False
    windows: list[_Window] = field(default_factory=list)

    @property
    def alignment_lag_s(self) -> float:
        return self.asr.alignment_lag_s

    def transcribe(self, audio, prompt: str = "", offset: float = 0.0, beam_size: int = 1):
        context = " ".join(part for part in (self.prompt, prompt) if part)
        words = self.asr.transcribe(audio, prompt=context, offset=offset, beam_size=beam_size)
        if self.keep_windows and self.asr.last_decode is not None:
            self.windows.append(_Window(offset, self.asr.last_decode))
        return words


def _transcribe(asr: WhisperASR, audio: UploadedAudio, job: Job) -> Transcript:
    """`miniapp transcribe`'s path: offline windows, beam search, refined word edges."""
    recogniser = _Prompted(asr, job.asked.prompt, keep_windows=True)
    words = []
    for word in transcribe_blocks(recogniser, audio.blocks()):
        job.check()
        words.append(word)
    if not words:
        raise audio.no_speech()
    transcript = Transcript(words, audio.duration)
    if job.asked.response_format == "verbose_json" and job.asked.wants_segments:
        transcript.segments = _segments(words, recogniser.windows, asr)
    return transcript


def _stream_words(asr: WhisperASR, audio: UploadedAudio, job: Job) -> None:
    """`miniapp transcribe --stream`'s path: each batch of committed words is sent on as it is
    committed, with its times on the stream clock."""
    clock = ReplayClock()
    transcriber = StreamingTranscriber(_Prompted(asr, job.asked.prompt), clock=clock)
    committed = 0
    for event in replay(transcriber, clock, audio.blocks()):
        job.check()
        if isinstance(event, WordsCommitted):
            job.send(event.words)
            committed += len(event.words)
        elif isinstance(event, PartialText) and job.asked.partials:
            job.send(event)
    if not committed:
        raise audio.no_speech()


# ------------------------------------------------------------------ responses


def _response(asked: TranscriptionRequest, transcript: Transcript) -> Response:
    if asked.response_format == "text":
        return PlainTextResponse(transcript.text + "\n")
    if asked.response_format == "srt":
        return PlainTextResponse(to_srt(transcript.words))
    if asked.response_format == "vtt":
        return PlainTextResponse(to_vtt(transcript.words))
    if asked.response_format == "verbose_json":
        return JSONResponse(_verbose(asked, transcript))
    return JSONResponse({"text": transcript.text, "usage": _usage(transcript)})


def _verbose(asked: TranscriptionRequest, transcript: Transcript) -> dict:
    body = {
        "task": "transcribe",
        "language": LANGUAGE_NAME,
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    if transcript.segments is not None:
        body["segments"] = transcript.segments
    if asked.wants_words:
        body["words"] = [_word(w) for w in transcript.words]
    body["usage"] = _usage(transcript)
    return body


def _word(word: Word) -> dict:
    return {"word": word.word, "start": round(word.start, 3), "end": round(word.end, 3)}


def _usage(transcript: Transcript) -> dict:
    """whisper-1's usage: the audio's length in whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(transcript.duration)}


def _segments(words: list[Word], windows: list[_Window], asr: WhisperASR) -> list[dict]:
    """verbose_json's segments: the subtitle cues (so they match srt and vtt), each with the
    figures of the window it was decoded in, as Whisper reports them per window."""
    starts = [window.offset for window in windows]
    segments = []
    for index, cue in enumerate(cues(words)):
        window = windows[max(0, bisect.bisect_right(starts, cue.start + 1e-6) - 1)]
        decode = window.decode
        segments.append(
            {
                "id": index,
                "seek": round(window.offset * FRAMES_PER_SECOND),
                "start": round(cue.start, 3),
                "end": round(cue.end, 3),
                # Whisper's segment texts start with a space, so that joined they read right.
                "text": " " + cue.text,
                "tokens": asr.text_tokens(cue.text),
                "temperature": 0.0,
                "avg_logprob": float(decode.avg_log_prob),
                "compression_ratio": float(decode.compression_ratio),
                "no_speech_prob": float(decode.no_speech_prob),
            }
        )
    return segments


async def _events(first: object, job: Job) -> AsyncIterator[str]:
    """OpenAI's transcription stream: a `transcript.text.delta` per batch of committed words
    (with those words' times, which OpenAI clients ignore), then `transcript.text.done` with
    the whole text, then `data: [DONE]`; partial text, when asked for, comes between them. A
    stream that ends early (the client left) stops the work."""
    words: list[Word] = []
    failed = False
    item = first
    try:
        while item is not _END:
            if isinstance(item, ApiError):  # after the first words: too late for a status
                failed = True
                yield _sse(item.body())
            elif isinstance(item, PartialText):
                yield _sse(
                    {
                        "type": "transcript.text.partial",
                        "text": item.text,
                        "words": [_word(w) for w in item.words],
                    }
                )
            else:
                yield _sse(_delta(item, words))
                words += item
            item = await job.next()
        if not failed:
            yield _sse({"type": "transcript.text.done", "text": words_text(words)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def _delta(batch: tuple[Word, ...], before: list[Word]) -> dict:
    """The deltas joined are the done event's text: words are separated by one space."""
    text = (" " if before else "") + words_text(batch)
    return {"type": "transcript.text.delta", "delta": text, "words": [_word(w) for w in batch]}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
