"""What the GUI does, without the GUI: settings, answers and attachments (the loaded model is
the shared `ModelHost` of app/host/model_host.py).

The Gradio layer (`ui.py`) only turns widget values into calls here and results back into
widget values, so everything below can be reasoned about (and tested) as plain Python.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from miniapp.engine.api import (
    BUNDLED,
    REMOTE_BACKEND,
    WINDOW_POLICY,
    AdapterInfo,
    Conversation,
    Finished,
    GenerationRequest,
    GenerationStats,
    LoraChoice,
    LoraSpec,
    Message,
    MessageRuntime,
    MiniappError,
    ReasoningDelta,
    Runtime,
    RuntimeConfig,
    SamplingParams,
    TextDelta,
    list_server_models,
    models_dir,
    parse_lora_flag,
    resolve_model,
)

from ..host.files import write_atomically_bytes
from ..host.model_host import ModelHost
from ..host.settings import Settings
from .history import SavedChat, SavedMessage, data_dir

QUEUED_SHOWN_S = 0.05  # a wait for a slot of the batching engine worth showing
THINKING_SHOWN = 400  # characters of a reasoning model's thinking shown while it thinks
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".flac", ".ogg", ".m4a", ".webm", ".opus"}


@dataclass(frozen=True)
class ChatSettings:
    """Everything the settings panel controls. A change applies to the next message; the
    fields in `runtime_config` need the model loaded again."""

    model: str = Settings.model_fields["model"].default
    backend: str = Settings.model_fields["backend"].default
    device: str = Settings.model_fields["device"].default
    spec: str = Settings.model_fields["spec"].default
    ctx: int = Settings.model_fields["ctx"].default
    window: int | None = None
    sinks: int | None = None
    kv_policy: str = WINDOW_POLICY
    threads: int | None = None
    parallel: int = Settings.model_fields["parallel"].default
    # The launch's --kv-type (None: each backend's own default; the panel does not change it).
    kv_type: str | None = None
    system_prompt: str = ""
    temperature: float = Settings.model_fields["temperature"].default
    top_p: float = Settings.model_fields["top_p"].default
    max_tokens: int = Settings.model_fields["max_tokens"].default
    # --backend openai: the server's address and key (`model` is the server's name for it).
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    # LoRA: the launch's --lora adapters, loaded with the launch's model (the torch engine
    # keeps them by name; llama.cpp applies its one to every answer), and the loaded ones
    # each answer runs with (torch engine; none: the base model).
    lora: tuple[LoraSpec, ...] = ()
    lora_budget_mb: int | None = None
    adapters: tuple[str, ...] = ()

    @property
    def runtime_config(self) -> RuntimeConfig:
        if self.backend == REMOTE_BACKEND:
            # The GUI's panel sets these two; the rest are the server's own defaults.
            return RuntimeConfig(
                model=self.model,
                backend=self.backend,
                ctx=self.ctx,
                base_url=self.base_url,
                api_key=self.api_key,
                send_sampling=("temperature", "top_p"),
            )
        parallel = self.parallel if self.backend == "torch" else 1  # llama.cpp: one at a time
        return RuntimeConfig(
            model=self.model,
            backend=self.backend,
            device=self.device,
            spec=self.spec,
            ctx=self.ctx,
            window=self.window,
            sinks=self.sinks,
            kv_policy=self.kv_policy,
            threads=self.threads,
            parallel=parallel,
            kv_type=self.kv_type,
            lora=self.lora,
            lora_budget_mb=self.lora_budget_mb,
        )

    def request(self, runtime: Runtime | MessageRuntime | None = None) -> GenerationRequest:
        """The answer's settings; the picked adapters go only to a runtime that picks them
        per answer (the torch engine's `lora`)."""
        picks = self.adapters if runtime is None or _registry(runtime) is not None else ()
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            lora=tuple(LoraChoice(name) for name in picks),
        )
        return GenerationRequest(max_tokens=self.max_tokens, sampling=sampling)


def model_choices(settings: ChatSettings | None = None) -> list[tuple[str, str]]:
    """(label, value) for the model picker: the bundled models, then GGUFs in the models
    folder that are not bundled ones; on a server (--backend openai), the server's models
    (none when it cannot be asked: the status line says why)."""
    if settings is not None and settings.backend == REMOTE_BACKEND and settings.base_url:
        try:
            listed = list_server_models(settings.base_url, settings.api_key)
        except MiniappError:
            return []
        return [(model.id, model.id) for model in listed]
    folder = models_dir()
    # An optional bundled model is offered once installed (set-up does not fetch it).
    choices = [
        (f"{name} (bundled)", name)
        for name, model in BUNDLED.items()
        if not model.optional or (folder / model.filename).exists()
    ]
    bundled_files = {m.filename for m in BUNDLED.values()}
    if folder.is_dir():
        for path in sorted(folder.glob("*.gguf")):
            if path.name not in bundled_files and "mmproj" not in path.name.lower():
                choices.append((path.name, str(path)))
    return choices


# ------------------------------------------------------------------ answers


@dataclass(frozen=True)
class AnswerUpdate:
    text: str  # the answer so far
    figures: str  # live figures for this answer (a reasoning model's thinking, while it thinks)
    finished: bool = False


def figures_line(stats: GenerationStats, runtime: Runtime, elapsed_s: float | None = None) -> str:
    """TTFT, tok/s, draft acceptance, device path, KV cache type and fill, in one line."""
    parts = [f"TTFT {stats.ttft_s * 1000:.0f} ms", f"{stats.decode_tok_s:.1f} tok/s"]
    if stats.speculation is not None and stats.speculation.drafted:
        spec = stats.speculation
        parts.append(f"drafts accepted {spec.acceptance_rate:.0%} ({spec.mode})")
    if stats.queued_s > QUEUED_SHOWN_S:
        parts.append(f"queued {stats.queued_s:.1f} s")
    info = runtime.info()
    parts.append(info.placement)
    if info.kv_summary:
        parts.append(info.kv_summary)
    held = stats.prompt_tokens + stats.generated_tokens
    if runtime.n_ctx:  # a server may not say its context
        parts.append(f"context {min(held, runtime.n_ctx)}/{runtime.n_ctx}")
    else:
        parts.append(f"context {held}")
    return " · ".join(parts)


def stream_answer(
    host: ModelHost,
    saved: SavedChat,
    settings: ChatSettings,
    should_stop: Callable[[], bool],
) -> Iterator[AnswerUpdate]:
    """Answer the saved chat's last message (a user message), appending the answer to it.
    The model sees the messages' `content`s and their pictures; old turns it cannot fit are
    dropped for the model only, the saved chat keeps them."""
    runtime = host.wait_for(settings.runtime_config)
    *earlier, last = saved.messages
    pictures = last.images or any(m.images for m in earlier)
    if isinstance(runtime, MessageRuntime):
        # A server: answers of several sessions stream at once, each on its own connection.
        conversation = _conversation(runtime, saved, settings, runtime.accepts_images)
        yield from _answer_updates(saved, conversation, should_stop)
        return
    if runtime.parallel > 1 and not pictures:
        # The batching engine: answers of several sessions advance together, its steps on
        # the host's compute thread; this thread only reads its own answer's stream.
        conversation = _conversation(runtime, saved, settings, pictures=False)
        yield from _answer_updates(saved, conversation, should_stop)
        return
    with host.generation_lock:
        vision = _vision_opener(host, settings, pictures=bool(last.images)) if pictures else None
        conversation = _conversation(runtime, saved, settings, vision is not None, vision)
        # The answer is produced on the host's compute thread (the GUI's main thread).
        yield from _answer_updates(saved, conversation, should_stop, host.compute.iterate)


def _conversation(
    runtime: Runtime | MessageRuntime,
    saved: SavedChat,
    settings: ChatSettings,
    pictures: bool,
    vision=None,
) -> Conversation:
    """The saved chat before its last message, as the model will see it (with the earlier
    messages' pictures when it sees `pictures`)."""
    history = [
        Message(m.role, m.content, _saved_pictures(m) if pictures else ())
        for m in saved.messages[:-1]
    ]
    request = settings.request(runtime)
    return Conversation(
        runtime, settings.system_prompt or None, request, vision=vision, history=history
    )


def _answer_updates(
    saved: SavedChat,
    conversation: Conversation,
    should_stop: Callable[[], bool],
    relay: Callable[[Iterator], Iterator] = lambda events: events,
) -> Iterator[AnswerUpdate]:
    """The answer to the chat's last message as it grows, then saved with its figures."""
    last = saved.messages[-1]
    pictures = [image.png_bytes() for image in _load_pictures(last)]
    events = relay(conversation.send(last.content, pictures, should_stop=should_stop))
    answer, thinking, figures = [], "", ""
    started = time.monotonic()
    try:
        for event in events:
            if isinstance(event, TextDelta):
                answer.append(event.text)
                rate = len(answer) / max(time.monotonic() - started, 1e-3)
                yield AnswerUpdate("".join(answer), f"generating… {rate:.0f} pieces/s")
            elif isinstance(event, ReasoningDelta):  # apart from the answer, and not kept
                thinking += event.text
                yield AnswerUpdate("".join(answer), "thinking… " + thinking[-THINKING_SHOWN:])
            elif isinstance(event, Finished):
                figures = figures_line(event.stats, conversation.runtime)
                if event.reason.value == "cancelled":
                    figures = "stopped · " + figures
    except MiniappError:  # a server that broke off: what it sent is kept
        if answer:
            saved.messages.append(SavedMessage("assistant", "".join(answer), stats="broken off"))
        raise
    text = "".join(answer)
    saved.messages.append(SavedMessage("assistant", text, stats=figures))
    yield AnswerUpdate(text, figures, finished=True)


def _vision_opener(host: ModelHost, settings: ChatSettings, pictures: bool):
    """How the conversation opens the vision model, if this model has one. Without one, a
    message with pictures is a one-line error saying why; earlier pictures (the projector
    has gone since) leave their messages as text."""
    from miniapp.engine.images import choose_route

    route = choose_route(
        resolve_model(settings.model), settings.backend, allow_backend_switch=False
    )
    if route.mmproj is None:
        if pictures:
            raise MiniappError(f"this message has pictures for a vision model, but {route.reason}")
        return None
    mmproj = route.mmproj
    return lambda: host.vision_runtime(settings.runtime_config, mmproj)


def _load_pictures(message: SavedMessage) -> list:
    from miniapp.engine.images import load_image

    return [load_image(Path(p)) for p in message.images or ()]


def _saved_pictures(message: SavedMessage) -> tuple[bytes, ...]:
    """An earlier message's pictures as PNG bytes; ones no longer readable are left out
    (the message still goes, as text)."""
    from miniapp.engine.images import load_image

    pictures = []
    for path in message.images or ():
        try:
            pictures.append(load_image(Path(path)).png_bytes())
        except MiniappError:
            continue
    return tuple(pictures)


# ------------------------------------------------------------------ LoRA adapters


def _registry(runtime):
    """The runtime's loaded adapters by name (the torch engine's), or None."""
    return getattr(runtime, "lora", None)


def adapter_choices(runtime: Runtime | MessageRuntime | None) -> list[tuple[str, str]]:
    """(label, name) for the adapter picker: the loaded model's adapters (torch engine)."""
    registry = _registry(runtime)
    if registry is None:
        return []
    return [(f"{a.name} (rank {a.rank}, scale {a.scale:g})", a.name) for a in registry.list()]


def adapter_note(runtime: Runtime | MessageRuntime | None) -> str:
    """One line under the picker where it cannot pick: llama.cpp applies the adapter it was
    opened with to every answer; a server applies its own."""
    if runtime is None or _registry(runtime) is not None:
        return ""
    if isinstance(runtime, MessageRuntime):
        return "a server's model: the server applies its own adapters"
    applied = runtime.info().adapters
    if applied:
        return f"{runtime.backend} applies {', '.join(applied)} to every answer"
    return f"{runtime.backend}: adapters only at start (--lora), one for every answer"


def adapter_folder(folder: str | Path | None = None) -> Path:
    """Where the GUI may load adapters from: --lora-dir, else the models folder's adapters/."""
    return Path(folder).expanduser() if folder else models_dir() / "adapters"


def load_adapter(runtime: Runtime | MessageRuntime | None, text: str, folder: Path) -> AdapterInfo:
    """Load the adapter `text` names (PATH, or NAME=PATH[:SCALE] as --lora takes) into the
    loaded model, by its name. As the server's run-time loads, only from `folder` (a
    relative path is taken inside it). One line (MiniappError) for what cannot be loaded."""
    if runtime is None:
        raise MiniappError("no model is loaded yet")
    registry = _registry(runtime)
    if isinstance(runtime, MessageRuntime):
        raise MiniappError("a server's model: the server loads its own adapters")
    if registry is None:
        raise MiniappError(
            f"the {runtime.backend} backend cannot load adapters while it runs; torch can"
        )
    if not text.strip():
        raise MiniappError("give an adapter file (PATH, or NAME=PATH[:SCALE])")
    spec = parse_lora_flag(text.strip())
    path = spec.path if spec.path.is_absolute() else folder / spec.path
    if not path.resolve().is_relative_to(folder.resolve()):
        raise MiniappError(f"{spec.path}: adapters load from {folder} only (--lora-dir)")
    return registry.load(spec.name, path, spec.scale)


def adapter_loaded(info: AdapterInfo) -> str:
    mib = info.nbytes / (1024 * 1024)
    return (
        f"loaded {info.name}: rank {info.rank}, scale {info.scale:g}, {mib:.1f} MiB, "
        f"in {info.load_seconds * 1000:.0f} ms"
    )


# ------------------------------------------------------------------ attachments


class UnsupportedUploadError(MiniappError):
    pass


class Transcriber:
    """The speech recogniser, loaded on first use and shared by every browser session."""

    def __init__(self, asr_model: str | None = None, threads: int | None = None):
        self.asr_model, self.threads = asr_model, threads
        self._asr = None
        self._lock = threading.Lock()

    def asr(self):
        with self._lock:
            if self._asr is None:
                from miniapp.engine.voice.asr import load_asr

                self._asr = load_asr(self.asr_model, self.threads)
            return self._asr

    def file(self, path: Path):
        """A spoken message from an audio file (AudioFileError, one line, if unusable)."""
        from miniapp.engine.voice.audio import AudioFileError, iter_audio
        from miniapp.engine.voice.events import SpokenMessage
        from miniapp.engine.voice.offline import transcribe_blocks

        words = list(transcribe_blocks(self.asr(), iter_audio(str(path))))
        if not words:
            raise AudioFileError(f"{path.name}: no speech found")
        return SpokenMessage.from_words(words)


def prepare_user_message(
    typed: str,
    files: list[Path],
    settings: ChatSettings,
    transcriber: Transcriber,
    runtime: Runtime | MessageRuntime | None = None,
) -> SavedMessage:
    """The user message for typed text plus uploads: audio files become their transcript
    (word times kept), images their OCR label (or go to a vision model). Raises a one-line
    MiniappError for a file that cannot be used; nothing is sent then."""
    images = [f for f in files if f.suffix.lower() in IMAGE_SUFFIXES]
    audio = [f for f in files if f.suffix.lower() in AUDIO_SUFFIXES]
    for other in set(files) - set(images) - set(audio):
        raise UnsupportedUploadError(
            f"{other.name}: unsupported file type (images: PNG, JPEG, WebP, GIF; audio: "
            "WAV, MP3, FLAC, OGG, M4A, WebM)"
        )
    notes: list[str] = []
    words: list[dict] = []
    spoken_parts = []
    for path in audio:
        spoken = transcriber.file(path)
        spoken_parts.append(spoken.content)
        words += [w.to_dict() for w in spoken.words]
        span = f"{spoken.words[0].start:.2f}-{spoken.words[-1].end:.2f} s"
        notes.append(f"{path.name}: transcribed, {len(spoken.words)} words ({span})")
    text = " ".join([*spoken_parts, typed.strip()]).strip()
    shown = typed.strip() if spoken_parts else None
    pictures = None
    if images:
        route = image_route(settings, runtime)
        text, image_notes = _with_images(text, images, route)
        notes += image_notes
        shown = typed.strip()
        pictures = _pictures_to_keep(images, route)
    if not text and not images:
        raise MiniappError("nothing to send: type a message or attach a file")
    if shown is not None and spoken_parts:
        shown = " ".join([*spoken_parts, shown]).strip()
    return SavedMessage(
        "user", text, shown=shown, notes=notes, words=words or None, images=pictures
    )


def image_route(settings: ChatSettings, runtime: Runtime | MessageRuntime | None = None):
    """Where this chat's images go. The GUI keeps the backend the user picked: images reach
    a vision model only on the llamacpp backend with a projector beside the model, or on a
    server whose model takes them (`runtime`, the loaded one); otherwise OCR, said so."""
    from miniapp.engine.images import choose_route, remote_route

    if settings.backend == REMOTE_BACKEND:
        return remote_route(isinstance(runtime, MessageRuntime) and runtime.accepts_images)
    return choose_route(resolve_model(settings.model), settings.backend, allow_backend_switch=False)


def _with_images(text: str, images: list[Path], route) -> tuple[str, list[str]]:
    from miniapp.engine.images import attach_image, build_user_message

    attachments = [attach_image(path, route, name=path.name) for path in images]
    return build_user_message(text, attachments), [a.notice() for a in attachments]


def _pictures_to_keep(images: list[Path], route) -> list[str] | None:
    """Copies of the pictures a vision model will see, kept beside the saved chats (the
    upload folder is temporary); None on the OCR path, whose text is the message."""
    from miniapp.engine.images import ImagePath

    if route.path is not ImagePath.VISION_MODEL:
        return None
    folder = data_dir() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    kept = []
    for path in images:
        data = path.read_bytes()
        target = folder / (hashlib.sha256(data).hexdigest()[:32] + path.suffix.lower())
        if not target.exists():
            write_atomically_bytes(target, data)
        kept.append(str(target))
    return kept
