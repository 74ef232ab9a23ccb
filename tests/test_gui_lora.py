"""LoRA adapters in the GUI (issue 51), without the browser: the launch's --lora adapters load
with its model, the picker's choice goes into each answer (the answer the engine gives with
that adapter), the Load box loads one from the adapters folder, and llama.cpp, which applies
its one adapter to every answer, cannot. A tiny random model and adapters, the real engine."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import LLAMA, write_tiny_adapter, write_tiny_model

from miniapp.app.cli import build_parser
from miniapp.app.gui.controller import (
    ChatSettings,
    ModelHost,
    Transcriber,
    adapter_choices,
    adapter_note,
    load_adapter,
    stream_answer,
)
from miniapp.app.gui.history import ChatStore, SavedChat, SavedMessage
from miniapp.app.gui.server import settings_from_args
from miniapp.app.gui.ui import (
    GuiContext,
    build_ui,
    load_adapter_from_box,
    refresh_adapters,
    settings_from,
)
from miniapp.app.host.settings import apply
from miniapp.engine.api import (
    GREEDY,
    Conversation,
    GenerationRequest,
    LoraChoice,
    LoraSpec,
    MiniappError,
    RuntimeConfig,
    TextDelta,
    open_runtime,
)

MESSAGE = "Hello there"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gui_lora")
    spec = dataclasses.replace(LLAMA, weight_type=Q.F32, embed_type=Q.F32)
    base = write_tiny_model(folder / "tiny.gguf", spec)
    adapters = folder / "adapters"
    adapters.mkdir()
    a = write_tiny_adapter(adapters / "a.gguf", base, rank=4, alpha=8.0, seed=1)
    b = write_tiny_adapter(adapters / "b.gguf", base, rank=8, alpha=4.0, seed=2)
    outside = write_tiny_adapter(folder / "outside.gguf", base, seed=3)
    return base, a, b, outside


@pytest.fixture(scope="module")
def expected(tiny):
    """The engine's own greedy answers: base, with a, with b."""
    base, a, b, _ = tiny
    config = RuntimeConfig(
        model=str(base), backend="torch", ctx=256, lora=(LoraSpec("a", a), LoraSpec("b", b))
    )
    runtime = open_runtime(config)

    def answer(*names):
        sampling = dataclasses.replace(GREEDY, lora=tuple(LoraChoice(n) for n in names))
        conversation = Conversation(runtime, None, GenerationRequest(MAX_TOKENS, sampling))
        return "".join(e.text for e in conversation.send(MESSAGE) if isinstance(e, TextDelta))

    return {(): answer(), ("a",): answer("a"), ("b",): answer("b"), ("a", "b"): answer("a", "b")}


def _settings(tiny, backend="torch", **changes) -> ChatSettings:
    base, a, _, _ = tiny
    return ChatSettings(
        model=str(base),
        backend=backend,
        ctx=256,
        threads=2,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        lora=(LoraSpec("a", a),),
        **changes,
    )


def _answer(host: ModelHost, settings: ChatSettings) -> str:
    conversation = SavedChat.new()
    conversation.messages.append(SavedMessage("user", MESSAGE))
    updates = list(stream_answer(host, conversation, settings, lambda: False))
    assert updates[-1].finished
    return updates[-1].text


def _panel(settings: ChatSettings, model: str, adapters: list[str]) -> list:
    """The settings panel's widget values, in settings_inputs' order."""
    s = settings
    return [model, "", s.backend, s.device, s.spec, s.ctx, "", "", "", 0.0, 1.0, 12, adapters]


def test_picking_an_adapter_changes_the_answer_to_the_engines_with_it(tiny, expected):
    host = ModelHost()
    launched = _settings(tiny)
    # The panel: no adapter by default (the base model), then a, then a and b.
    plain = settings_from(_panel(launched, launched.model, []), launched)
    assert plain.lora == launched.lora and plain.adapters == ()
    assert _answer(host, plain) == expected[()]
    runtime = host.runtime
    assert adapter_choices(runtime) == [("a (rank 4, scale 1)", "a")]
    assert adapter_note(runtime) == ""
    picked = settings_from(_panel(launched, launched.model, ["a"]), launched)
    assert _answer(host, picked) == expected[("a",)] != expected[()]
    assert host.runtime is runtime  # a pick is per answer: the model was not loaded again
    # Loading b from the adapters folder by its name offers it and picks it.
    info = load_adapter(runtime, "b.gguf", tiny[2].parent)
    assert (info.name, info.rank) == ("b", 8)
    assert [name for _, name in adapter_choices(runtime)] == ["a", "b"]
    both = dataclasses.replace(picked, adapters=("a", "b"))
    assert _answer(host, both) == expected[("a", "b")]
    assert _answer(host, dataclasses.replace(picked, adapters=("b",))) == expected[("b",)]
    # One that is not loaded (unloaded in another session) is one line, nothing else breaks.
    runtime.lora.unload("b")
    with pytest.raises(MiniappError, match="no adapter named 'b' is loaded"):
        _answer(host, both)
    assert _answer(host, picked) == expected[("a",)]


def test_the_load_box_reads_only_the_adapters_folder_and_says_why_in_one_line(tiny):
    base, a, b, outside = tiny
    shutil.copy(base, a.parent / "model.gguf")  # a model where an adapter should be
    host = ModelHost()
    host.wait_for(_settings(tiny).runtime_config, 60)
    ctx = GuiContext(host, ChatStore(base.parent / "chats"), Transcriber(), _settings(tiny))
    ctx.adapter_dir = a.parent
    picker, note, box, known = load_adapter_from_box(ctx, str(b), ["a"])
    assert picker["value"] == ["a", "b"] and picker["choices"][1][1] == "b"
    assert note.startswith("loaded b: rank 8, scale 1, ") and box == ""
    for text, says in [
        (str(outside), f"{outside}: adapters load from {a.parent} only"),
        ("../outside.gguf", "adapters load from"),
        ("missing.gguf", "missing.gguf: no such adapter file"),
        ("b.gguf", "an adapter named 'b' is already loaded"),
        ("c=model.gguf", "model.gguf: not a LoRA adapter"),
        ("  ", "give an adapter file"),
    ]:
        _, note, _, _ = load_adapter_from_box(ctx, text, ["a"])
        assert note.startswith("⚠️ ") and says in note and "\n" not in note, note
    # The picker follows the model's adapters: unchanged, nothing is sent to the page.
    picker, note, again = refresh_adapters(ctx, ["a", "b"], known)
    assert picker == {"__type__": "update"} and again == known
    host.runtime.lora.unload("b")
    picker, note, now = refresh_adapters(ctx, ["a", "b"], known)
    assert picker["value"] == ["a"] and [c[1] for c in picker["choices"]] == ["a"]
    assert now != known


def test_llama_cpp_applies_the_launch_adapter_and_cannot_load_more(tiny, expected):
    host = ModelHost()
    settings = _settings(tiny, backend="llamacpp", adapters=("a",))
    # On a float model llama.cpp's greedy answer with the adapter is the torch engine's.
    assert _answer(host, settings) == expected[("a",)]
    runtime = host.runtime
    assert adapter_choices(runtime) == []
    assert adapter_note(runtime) == "llamacpp applies a to every answer"
    with pytest.raises(MiniappError, match="llamacpp backend cannot load adapters"):
        load_adapter(runtime, "b.gguf", tiny[2].parent)


def test_the_launch_adapters_stay_with_the_launch_model(tiny):
    launched = _settings(tiny)
    other = settings_from(_panel(launched, "smollm2-135m-instruct", []), launched)
    assert other.lora == () and other.runtime_config.lora == ()
    same = settings_from(_panel(launched, launched.model, ["a"]), launched)
    assert same.runtime_config == launched.runtime_config  # no reload for a pick


def test_gui_flags_reach_the_model_load(tiny, tmp_path):
    base, a, _, _ = tiny
    flags = ["gui", "--model", str(base), "--lora", f"x={a}:0.5", "--lora-budget-mb", "8"]
    args = build_parser().parse_args(flags)
    apply(args, "gui")
    settings = settings_from_args(args)
    assert settings.runtime_config.lora == (LoraSpec("x", a, 0.5),)
    assert settings.runtime_config.lora_budget_mb == 8 and settings.adapters == ()
    context = GuiContext(ModelHost(), ChatStore(tmp_path), Transcriber(), settings)
    assert context.adapter_dir.name == "adapters"  # the models folder's, without --lora-dir
    build_ui(context)  # the page builds with the picker and the Load box


def test_the_page_picks_and_loads_adapters(tiny, expected, miniapp_exe, tmp_path):
    """In the browser: the picker offers the launch's adapter, the Load box loads another
    and picks it too; the saved answers are the engine's with those adapters."""
    from playwright.sync_api import sync_playwright
    from test_gui import CHROMIUM, CHROMIUM_ARGS, GuiServer, _send, _wait_for_text

    base, a, _, _ = tiny
    flags = ["--model", str(base), "--ctx", "256", "--max-tokens", str(MAX_TOKENS)]
    flags += ["--lora", f"a={a}", "--lora-dir", str(a.parent)]
    server = GuiServer(miniapp_exe, tmp_path / "data", *flags).start()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(server.url)
            _wait_for_text(page, "#model-status", "tiny.gguf on torch")
            page.click("#adapters input")
            page.get_by_role("option", name="a (rank 4, scale 1)").click(timeout=10_000)
            page.keyboard.press("Escape")
            _send(page, MESSAGE)
            _wait_for_text(page, "#figures", "tok/s")
            page.fill("#adapter-path textarea", "b.gguf")
            page.click("#load-adapter")
            _wait_for_text(page, "#adapter-note", "loaded b: rank 8")
            page.click("#new-chat")
            _send(page, MESSAGE)
            _wait_for_text(page, "#figures", "tok/s")
            page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
            browser.close()
    finally:
        server.stop()
    saved = [json.loads(p.read_text()) for p in (tmp_path / "data" / "conversations").glob("*")]
    answers = {m["content"] for chat in saved for m in chat["messages"] if m["role"] != "user"}
    assert answers == {expected[("a",)], expected[("a", "b")]}
