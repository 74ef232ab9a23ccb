"""The Gradio layout and its events. Each handler turns widget values into controller calls
(`controller.py`) and the results back into widget values; nothing here talks to the engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import gradio as gr

from miniapp.engine.api import BACKENDS, DEFAULT_SINKS, DEVICE_CHOICES, SPEC_MODES, MiniappError

from ..host.model_host import ModelHost, ModelLoadError
from .controller import (
    AUDIO_SUFFIXES,
    IMAGE_SUFFIXES,
    ChatSettings,
    Transcriber,
    adapter_choices,
    adapter_folder,
    adapter_loaded,
    adapter_note,
    load_adapter,
    model_choices,
    prepare_user_message,
    stream_answer,
)
from .history import ChatStore, SavedChat

GENERATION_QUEUE = "generation"  # every event that generates shares one queue
STATUS_POLL_S = 1.0
UPLOAD_TYPES = sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES)
EMPTY_BOX = {"text": "", "files": []}


@dataclass
class GuiContext:
    """What every browser session shares."""

    host: ModelHost
    store: ChatStore
    transcriber: Transcriber
    defaults: ChatSettings
    stops: dict[str, threading.Event] = field(default_factory=dict)
    adapter_dir: Path = field(default_factory=adapter_folder)  # where the GUI loads adapters

    def __post_init__(self):
        self.adapter_dir = Path(self.adapter_dir)

    def stop_flag(self, conversation_id: str) -> threading.Event:
        return self.stops.setdefault(conversation_id, threading.Event())


# ------------------------------------------------------------------ conversions


def chat_messages(conversation: SavedChat) -> list[dict]:
    """The conversation as Gradio's chatbot shows it (notes under the message)."""
    shown = []
    for message in conversation.messages:
        text = message.display
        if message.notes:
            text += "\n\n" + "\n".join(f"> {note}" for note in message.notes)
        if message.words:
            text += "\n\n" + _word_times(message.words)
        shown.append({"role": message.role, "content": text})
    return shown


def _word_times(words: list[dict]) -> str:
    timed = " ".join(f"{w['word']}`[{w['start']:.2f}–{w['end']:.2f}]`" for w in words)
    return f"<details><summary>word times</summary>\n\n{timed}\n\n</details>"


def history_choices(store: ChatStore) -> list[tuple[str, str]]:
    return [(c.title, c.id) for c in store.list()]


def settings_from(values: list, launched: ChatSettings) -> ChatSettings:
    """Settings from the panel's widgets (ValueError, one line, for a value out of range);
    what the panel does not show (threads, answers at once, KV cache type) stays as
    `launched`. The launch's --lora adapters are for its model: another model loads
    without them."""
    (
        model,
        custom,
        backend,
        device,
        spec,
        ctx,
        window,
        sinks,
        system,
        temperature,
        top_p,
        max_tokens,
        adapters,
    ) = values
    chosen = (custom or "").strip() or model or ""
    return replace(
        launched,
        model=chosen,
        backend=backend,
        device=device,
        spec=spec,
        ctx=_count("context", ctx, 64),
        window=_optional_count("window", window, 1),
        sinks=_optional_count("sinks", sinks, 0),
        system_prompt=system or "",
        temperature=float(temperature),
        top_p=float(top_p),
        max_tokens=_count("max tokens", max_tokens, 1),
        lora=launched.lora if chosen == launched.model else (),
        adapters=tuple(adapters or ()),
    )


def _with_launch_model(choices: list[tuple[str, str]], model: str) -> list[tuple[str, str]]:
    """The picker's choices with the launch's --model among them (a GGUF outside the models
    folder): a value the picker does not offer is refused by Gradio on every message."""
    if model and model not in {value for _, value in choices}:
        return [*choices, (Path(model).name, model)]
    return choices


def _blank(value: int | None) -> str:
    return "" if value is None else str(value)


def _count(name: str, value, minimum: int) -> int:
    try:
        number = int(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a whole number, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name}: must be at least {minimum}, got {number}")
    return number


def _optional_count(name: str, value, minimum: int) -> int | None:
    text = "" if value is None else str(value).strip()
    return None if not text else _count(name, text, minimum)


# ------------------------------------------------------------------ layout


def build_ui(ctx: GuiContext) -> gr.Blocks:
    d = ctx.defaults
    with gr.Blocks(title="miniapp") as demo:
        conversation_id = gr.State("")
        with gr.Row():
            with gr.Column(scale=1, min_width=220):
                new_chat = gr.Button("New chat", variant="primary", elem_id="new-chat")
                saved = gr.Dropdown(
                    label="Saved chats", choices=history_choices(ctx.store), elem_id="saved-chats"
                )
                with gr.Row():
                    open_saved = gr.Button("Open", size="sm", elem_id="open-chat")
                    delete_saved = gr.Button("Delete", size="sm", elem_id="delete-chat")
                with gr.Row():
                    export_md = gr.Button("Export .md", size="sm")
                    export_json = gr.Button("Export .json", size="sm")
                exported = gr.File(label="Export", visible=True, interactive=False)
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="miniapp", height=520, elem_id="chatbot")
                box = gr.MultimodalTextbox(
                    placeholder="Message, or attach images and audio files…",
                    file_types=UPLOAD_TYPES,
                    file_count="multiple",
                    sources=["upload"],
                    elem_id="message-box",
                    show_label=False,
                )
                with gr.Row():
                    stop = gr.Button("Stop", elem_id="stop")
                    regenerate = gr.Button("Regenerate", elem_id="regenerate")
                    edit_last = gr.Button("Edit last message", elem_id="edit-last")
                figures = gr.Markdown("", elem_id="figures")
                notice = gr.Markdown("", elem_id="notice")
                with gr.Accordion("Camera", open=False):
                    camera = gr.Image(sources=["webcam"], type="filepath", label="Webcam")
                    attach_photo = gr.Button("Attach photo to the message", size="sm")
                # Open from the start: Gradio 6 sends a microphone mounted later (as in a
                # closed accordion) in 0.1 s chunks instead of 0.5 s, five times the requests,
                # and a busy server loses chunks (it keeps only a stream's newest).
                with gr.Accordion("Speak", open=True):
                    microphone = gr.Audio(
                        sources=["microphone"], streaming=True, type="numpy", label="Microphone"
                    )
                    transcript = gr.Markdown("", elem_id="live-transcript")
            with gr.Column(scale=1, min_width=260):
                status = gr.Markdown(ctx.host.status.message, elem_id="model-status")
                with gr.Accordion("Settings", open=True):
                    model = gr.Dropdown(
                        label="Model",
                        choices=_with_launch_model(model_choices(d), d.model),
                        value=d.model or None,
                        elem_id="model",
                    )
                    custom = gr.Textbox(label="…or a GGUF path", elem_id="model-path")
                    backend = gr.Radio(list(BACKENDS), value=d.backend, label="Backend")
                    device = gr.Dropdown(list(DEVICE_CHOICES), value=d.device, label="Device")
                    spec = gr.Dropdown(list(SPEC_MODES), value=d.spec, label="Speculative")
                    adapters = gr.Dropdown(
                        label="LoRA adapters",
                        info="none: the base model",
                        choices=adapter_choices(ctx.host.runtime),
                        value=[],
                        multiselect=True,
                        elem_id="adapters",
                    )
                    adapter_notice = gr.Markdown(
                        adapter_note(ctx.host.runtime), elem_id="adapter-note"
                    )
                    with gr.Row():
                        adapter_path = gr.Textbox(
                            label="Load an adapter",
                            placeholder=f"a LoRA GGUF in {ctx.adapter_dir}",
                            elem_id="adapter-path",
                            scale=3,
                        )
                        load_adapter_button = gr.Button(
                            "Load", size="sm", elem_id="load-adapter", scale=1
                        )
                    system = gr.Textbox(
                        label="System prompt",
                        value=d.system_prompt,
                        lines=2,
                        elem_id="system-prompt",
                    )
                    temperature = gr.Slider(
                        0,
                        2,
                        value=d.temperature,
                        step=0.05,
                        label="Temperature",
                        elem_id="temperature",
                    )
                    top_p = gr.Slider(0.05, 1, value=d.top_p, step=0.05, label="Top-p")
                    max_tokens = gr.Number(
                        value=d.max_tokens,
                        precision=0,
                        minimum=1,
                        label="Max tokens",
                        elem_id="max-tokens",
                    )
                    ctx_size = gr.Number(value=d.ctx, precision=0, minimum=64, label="Context")
                    window = gr.Textbox(value=_blank(d.window), label="Window (blank: auto)")
                    sinks = gr.Textbox(
                        value=_blank(d.sinks), label=f"Sinks (blank: {DEFAULT_SINKS})"
                    )
        settings_inputs = [
            model,
            custom,
            backend,
            device,
            spec,
            ctx_size,
            window,
            sinks,
            system,
            temperature,
            top_p,
            max_tokens,
            adapters,
        ]
        _wire(ctx, locals())
    return demo


def _wire(ctx: GuiContext, w: dict) -> None:
    """Connect the events (w: the widgets built in build_ui, by name)."""
    settings_inputs = w["settings_inputs"]
    answer_outputs = [w["chatbot"], w["figures"], w["notice"], w["saved"], w["conversation_id"]]

    def send(message: dict, conversation_id: str, *values):
        try:
            settings = settings_from(list(values), ctx.defaults)
        except ValueError as exc:
            yield gr.update(), gr.update(), f"⚠️ {exc}", gr.update(), conversation_id, gr.update()
            return
        conversation = _conversation(ctx, conversation_id, settings)
        files = [Path(f) for f in (message or {}).get("files", [])]
        try:
            user = prepare_user_message(
                (message or {}).get("text", ""), files, settings, ctx.transcriber, ctx.host.runtime
            )
        except MiniappError as exc:
            yield *_view(ctx, conversation, notice=f"⚠️ {exc}"), gr.update()
            return
        conversation.messages.append(user)
        conversation.retitle()
        saved = _save(ctx, conversation)  # the question is saved before the answer starts
        yield *_view(ctx, conversation, notice=_joined(*user.notes, saved)), EMPTY_BOX
        for view in _answer(ctx, conversation, settings, notes=user.notes):
            yield *view, gr.update()

    def regenerate(conversation_id: str, *values):
        try:
            settings = settings_from(list(values), ctx.defaults)
        except ValueError as exc:
            yield gr.update(), gr.update(), f"⚠️ {exc}", gr.update(), conversation_id
            return
        conversation = _conversation(ctx, conversation_id, settings)
        while conversation.messages and conversation.messages[-1].role == "assistant":
            conversation.messages.pop()
        if not conversation.messages:
            yield _view(ctx, conversation, notice="nothing to regenerate")
            return
        yield from _answer(ctx, conversation, settings)

    def edit_last(conversation_id: str):
        conversation = _conversation(ctx, conversation_id, ctx.defaults)
        users = [i for i, m in enumerate(conversation.messages) if m.role == "user"]
        if not users:
            return gr.update(), gr.update(), gr.update()
        last = conversation.messages[users[-1]]
        del conversation.messages[users[-1] :]
        saved = _save(ctx, conversation)
        return chat_messages(conversation), {"text": last.display, "files": []}, saved

    def stop_answer(conversation_id: str):
        if conversation_id:
            ctx.stop_flag(conversation_id).set()

    def new_chat():
        return [], "", "", ""

    def open_chat(chosen: str | None):
        if not chosen:
            return gr.update(), gr.update(), "choose a saved chat first"
        try:
            conversation = ctx.store.load(chosen)
        except (MiniappError, ValueError) as exc:
            return gr.update(), gr.update(), f"⚠️ cannot open that chat: {exc}"
        return chat_messages(conversation), conversation.id, f"opened “{conversation.title}”"

    def delete_chat(chosen: str | None, conversation_id: str):
        if chosen:
            try:
                ctx.store.delete(chosen)
            except MiniappError as exc:
                gr.Warning(str(exc))
        cleared = chosen == conversation_id
        choices = gr.update(choices=history_choices(ctx.store), value=None)
        return choices, ([] if cleared else gr.update()), ("" if cleared else conversation_id)

    def export(chosen: str | None, conversation_id: str, kind: str):
        target = chosen or conversation_id
        if not target:
            return None
        folder = ctx.store.folder.parent / "exports"
        try:
            conversation = ctx.store.load(target)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{conversation.id}.{kind}"
            text = conversation.to_markdown() if kind == "md" else conversation.to_json()
            path.write_text(text, encoding="utf-8")
        except (MiniappError, ValueError, OSError) as exc:
            gr.Warning(f"could not export that chat: {exc}")
            return None
        return str(path)

    def settings_changed(*values):
        try:
            ctx.host.request(settings_from(list(values), ctx.defaults).runtime_config)
        except (MiniappError, ValueError) as exc:
            return f"⚠️ {exc}"
        return ctx.host.status.message

    box, cid = w["box"], w["conversation_id"]
    # As many answers at once as the engine batches; Gradio queues the rest (and shows the
    # position). Settings changed in the page keep this limit: it is the launch's.
    answers_at_once = ctx.defaults.runtime_config.parallel
    box.submit(
        send,
        [box, cid, *settings_inputs],
        [*answer_outputs, box],
        concurrency_id=GENERATION_QUEUE,
        concurrency_limit=answers_at_once,
    )
    w["regenerate"].click(
        regenerate,
        [cid, *settings_inputs],
        answer_outputs,
        concurrency_id=GENERATION_QUEUE,
        concurrency_limit=answers_at_once,
    )
    w["edit_last"].click(edit_last, cid, [w["chatbot"], box, w["figures"]])
    w["stop"].click(stop_answer, cid, None, queue=False)
    w["attach_photo"].click(_attach_photo, [w["camera"], box], box)
    w["new_chat"].click(new_chat, None, [w["chatbot"], cid, w["figures"], w["notice"]])
    w["open_saved"].click(open_chat, w["saved"], [w["chatbot"], cid, w["notice"]])
    w["delete_saved"].click(delete_chat, [w["saved"], cid], [w["saved"], w["chatbot"], cid])
    w["export_md"].click(lambda s, c: export(s, c, "md"), [w["saved"], cid], w["exported"])
    w["export_json"].click(lambda s, c: export(s, c, "json"), [w["saved"], cid], w["exported"])
    for widget in (
        w["model"],
        w["custom"],
        w["backend"],
        w["device"],
        w["spec"],
        w["ctx_size"],
        w["window"],
        w["sinks"],
    ):
        widget.change(settings_changed, settings_inputs, w["status"])
    # The list built with the page is the server's at start-up: each visit reads it afresh.
    w["demo"].load(_on_page_load(ctx), None, [w["saved"], w["notice"]])
    timer = gr.Timer(STATUS_POLL_S)
    timer.tick(lambda: ctx.host.status.message, None, w["status"], queue=False)
    _wire_adapters(ctx, w, timer)
    _wire_microphone(ctx, w)


def _wire_adapters(ctx: GuiContext, w: dict, timer: gr.Timer) -> None:
    """The adapter picker follows the loaded model's adapters (a model loaded, an adapter
    loaded in another session); the Load button loads one and picks it."""
    picker, note, path = w["adapters"], w["adapter_notice"], w["adapter_path"]
    shown = gr.State(None)  # what this page's picker shows (_adapter_key)
    timer.tick(
        lambda picked, known: refresh_adapters(ctx, picked, known),
        [picker, shown],
        [picker, note, shown],
        queue=False,
    )
    for event in (w["load_adapter_button"].click, path.submit):
        event(
            lambda text, picked: load_adapter_from_box(ctx, text, picked),
            [path, picker],
            [picker, note, path, shown],
        )


def refresh_adapters(ctx: GuiContext, picked: list | None, known: list | None):
    """(picker, note, known) for the loaded model's adapters; nothing changes while they
    are what the page shows, and picks of adapters no longer loaded are dropped."""
    runtime = ctx.host.runtime
    now = _adapter_key(runtime)
    if now == known:
        return gr.update(), gr.update(), known
    choices = adapter_choices(runtime)
    names = {name for _, name in choices}
    kept = [name for name in picked or () if name in names]
    return gr.update(choices=choices, value=kept), adapter_note(runtime), now


def load_adapter_from_box(ctx: GuiContext, text: str | None, picked: list | None):
    """(picker, note, box, known): the adapter loaded into the model and picked, or the
    one-line reason it was not."""
    runtime = ctx.host.runtime
    try:
        info = load_adapter(runtime, text or "", ctx.adapter_dir)
    except MiniappError as exc:
        return gr.update(), f"⚠️ {exc}", gr.update(), gr.update()
    value = [*(name for name in picked or () if name != info.name), info.name]
    picker = gr.update(choices=adapter_choices(runtime), value=value)
    return picker, adapter_loaded(info), "", _adapter_key(runtime)


def _adapter_key(runtime) -> list:
    """What the adapter picker shows for this runtime, to see when it changes."""
    return [[list(choice) for choice in adapter_choices(runtime)], adapter_note(runtime)]


def _wire_microphone(ctx: GuiContext, w: dict) -> None:
    """Live transcript while the user speaks; on stop, the transcript goes into the box."""
    from .voice import LiveTranscripts

    live = LiveTranscripts(ctx.transcriber)
    mic = w["microphone"]

    def start(request: gr.Request):
        return live.start(request.session_hash)

    def chunk(audio, request: gr.Request):
        return live.chunk(audio, request.session_hash)

    def finish(request: gr.Request):
        return live.finish(request.session_hash)

    # Start, chunks and the end share one queue, so they run in order; every chunk is kept
    # ("multiple"): dropping one would cut words out of the audio.
    mic.start_recording(start, None, w["transcript"], concurrency_id="microphone")
    mic.stream(
        chunk,
        mic,
        w["transcript"],
        stream_every=0.5,
        trigger_mode="multiple",
        concurrency_limit=1,
        concurrency_id="microphone",
    )
    mic.stop_recording(finish, None, [w["transcript"], w["box"]], concurrency_id="microphone")


def _attach_photo(photo: str | None, message: dict | None):
    """A webcam snapshot joins the files of the message being written."""
    message = message or {"text": "", "files": []}
    if not photo:
        return message
    return {"text": message.get("text", ""), "files": [*message.get("files", []), photo]}


def _conversation(ctx: GuiContext, conversation_id: str, settings: ChatSettings) -> SavedChat:
    if conversation_id:
        try:
            return ctx.store.load(conversation_id)
        except (MiniappError, ValueError):
            pass  # a new chat, under a new id: the unreadable file is never written over
    return SavedChat.new(Path(settings.model).name)


def _on_page_load(ctx: GuiContext):
    def load():
        choices = gr.update(choices=history_choices(ctx.store))
        problem = ctx.store.notice()  # read after the listing, which finds unreadable files
        return choices, f"⚠️ {problem}" if problem else gr.update()

    return load


def _save(ctx: GuiContext, conversation: SavedChat) -> str:
    """ "" when saved; otherwise the one-line reason (the chat goes on, kept in memory)."""
    try:
        ctx.store.save(conversation)
    except MiniappError as exc:
        return f"⚠️ {exc}"
    return ""


def _joined(*notes: str) -> str:
    return "; ".join(note for note in notes if note)


def _view(ctx: GuiContext, conversation: SavedChat, figures: str = "", notice: str = ""):
    choices = gr.update(choices=history_choices(ctx.store))  # also reads the store's health
    store_notice = ctx.store.notice()
    if store_notice and store_notice not in notice:
        notice = _joined(notice, f"⚠️ {store_notice}")
    return chat_messages(conversation), figures, notice, choices, conversation.id


def _answer(ctx: GuiContext, conversation: SavedChat, settings: ChatSettings, notes=()):
    stop = ctx.stop_flag(conversation.id)
    stop.clear()
    shown = chat_messages(conversation)
    notice = "; ".join(notes)
    try:
        for update in stream_answer(ctx.host, conversation, settings, stop.is_set):
            bubble = {"role": "assistant", "content": update.text}
            if update.finished:
                saved = _save(ctx, conversation)
                yield _view(ctx, conversation, update.figures, _joined(notice, saved))
            else:
                yield shown + [bubble], update.figures, notice, gr.update(), conversation.id
    except (ModelLoadError, MiniappError) as exc:
        saved = _save(ctx, conversation)  # with what a server sent before it broke off
        yield _view(ctx, conversation, notice=_joined(f"⚠️ {exc}", saved))
