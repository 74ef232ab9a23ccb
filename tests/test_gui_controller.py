"""The GUI's controller without the browser: the vision path for pictures (a tiny random
vision model and projector, written with gguf's writer), and bad uploads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from image_fixtures import TinyProjector, encode, text_image, write_tiny_projector
from tiny_gguf import LLAMA, write_tiny_model

from miniapp.app.cli import build_parser
from miniapp.app.gui.controller import (
    ChatSettings,
    ModelHost,
    Transcriber,
    UnsupportedUploadError,
    figures_line,
    prepare_user_message,
    stream_answer,
)
from miniapp.app.gui.history import SavedChat
from miniapp.app.gui.server import settings_from_args
from miniapp.app.host.settings import apply
from miniapp.engine.errors import MiniappError
from miniapp.engine.platform.devices import DevicePlan
from miniapp.engine.runtimes.base import RuntimeInfo
from miniapp.engine.tokens.events import GenerationStats


@pytest.fixture
def vision_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIAPP_DATA_DIR", str(tmp_path / "data"))
    write_tiny_projector(tmp_path / "mmproj-tiny-f16.gguf", TinyProjector(text_dim=LLAMA.dim))
    return write_tiny_model(tmp_path / "tiny.gguf", LLAMA)


def _picture(tmp_path):
    path = tmp_path / "sign.png"
    path.write_bytes(encode(text_image(["OPEN"], size=(200, 120)), "PNG"))
    return path


def test_pictures_reach_the_vision_model_on_the_llamacpp_backend(vision_model, tmp_path):
    settings = ChatSettings(
        model=str(vision_model),
        backend="llamacpp",
        ctx=512,
        threads=2,
        max_tokens=6,
        temperature=0.0,
    )
    user = prepare_user_message("What does it say?", [_picture(tmp_path)], settings, Transcriber())
    assert "shown to the vision model" in user.notes[0]
    assert user.images and all(p.startswith(str(tmp_path / "data")) for p in user.images)
    conversation = SavedChat.new()
    conversation.messages.append(user)
    updates = list(stream_answer(ModelHost(), conversation, settings, lambda: False))
    assert updates[-1].finished and conversation.messages[-1].role == "assistant"
    assert "context" in updates[-1].figures


def test_a_follow_up_still_sees_the_picture_and_reuses_the_context(vision_model, tmp_path):
    from miniapp.app.gui.history import SavedMessage
    from miniapp.engine.runtimes.llamacpp_vision import MARKER

    settings = ChatSettings(
        model=str(vision_model),
        backend="llamacpp",
        ctx=512,
        threads=2,
        max_tokens=6,
        temperature=0.0,
    )
    host = ModelHost()
    conversation = SavedChat.new()
    conversation.messages.append(
        prepare_user_message("What does it say?", [_picture(tmp_path)], settings, Transcriber())
    )
    list(stream_answer(host, conversation, settings, lambda: False))
    vision = host._vision
    first_prompt = vision.held_positions
    conversation.messages.append(SavedMessage("user", "Are you sure?"))
    updates = list(stream_answer(host, conversation, settings, lambda: False))
    assert updates[-1].finished and conversation.messages[-1].role == "assistant"
    assert vision.last_prefill.text.count(MARKER) == 1  # the picture is still shown
    assert vision.last_prefill.reused >= first_prompt - 8  # and was not evaluated again


def test_the_torch_backend_reads_pictures_by_ocr_and_says_why(vision_model, tmp_path):
    settings = ChatSettings(model=str(vision_model), backend="torch")
    user = prepare_user_message("", [_picture(tmp_path)], settings, Transcriber())
    assert "read by OCR" in user.notes[0] and "llamacpp" in user.notes[0]
    assert user.images is None and "OPEN" in user.content


def test_an_unsupported_file_is_one_line_and_nothing_is_sent(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(UnsupportedUploadError, match="notes.txt: unsupported file type"):
        prepare_user_message("hi", [other], ChatSettings(), Transcriber())
    with pytest.raises(MiniappError, match="nothing to send"):
        prepare_user_message("  ", [], ChatSettings(), Transcriber())


def _runtime_saying(info: RuntimeInfo, n_ctx: int = 4096):
    return SimpleNamespace(info=lambda: info, n_ctx=n_ctx)


def test_the_figures_line_shows_the_kv_cache_after_the_placement():
    stats = GenerationStats("torch", 200, 0, 100, 0.25, 800.0, 20.0)
    plan = DevicePlan("cpu", "int4", 0, "no GPU visible to torch")
    ours = RuntimeInfo("torch", Path("m.gguf"), plan, kv_type="q8", kv_bytes_per_token=12288)
    line = figures_line(stats, _runtime_saying(ours))
    assert line.endswith("cpu (int4) · KV q8, 12.0 KiB/token · context 300/4096"), line
    theirs = RuntimeInfo("llamacpp", Path("m.gguf"), kv_type="f16")
    assert "llamacpp · KV f16 · context" in figures_line(stats, _runtime_saying(theirs))
    unknown = RuntimeInfo("torch", Path("m.gguf"), plan)  # a runtime that does not say
    assert "cpu (int4) · context 300/4096" in figures_line(stats, _runtime_saying(unknown))


@pytest.mark.parametrize(
    ("flags", "wanted"), [([], None), (["--kv-type", "q4"], "q4"), (["--kv-type", "F32"], "f32")]
)
def test_the_launch_kv_type_reaches_the_model_load(flags, wanted):
    """Left at its default, the GUI asks for none (each backend keeps its own, llama.cpp's
    f16, also after a backend change in the panel); given, it loads with it."""
    args = build_parser().parse_args(["gui", *flags])
    apply(args, "gui")
    settings = settings_from_args(args)
    assert settings.kv_type == wanted and settings.runtime_config.kv_type == wanted
    assert ChatSettings().runtime_config.kv_type is None


def test_the_model_host_opens_the_runtime_with_the_kv_type(tmp_path):
    opened = {}

    def opener(config):
        opened["kv"] = config.kv_type
        info = RuntimeInfo(config.backend, Path(config.model), kv_type=config.kv_type)
        return SimpleNamespace(run_steps_on=lambda compute: None, info=lambda: info)

    model = write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    ModelHost(opener).wait_for(ChatSettings(model=str(model), kv_type="q4").runtime_config, 60)
    assert opened["kv"] == "q4"


def test_the_microphone_handler_queues_audio_and_returns_while_recognition_runs():
    """Gradio drops the chunks that arrive while a stream's handler is still running, so the
    handler must never wait for the recogniser. The real recogniser is slowed to 1.2 s a pass
    (what a loaded 2-core CPU gives): every chunk still returns at once, words appear while the
    audio is still coming, and the whole sentence is heard at the end."""
    import time

    from speech_synth import CLEAN_SENTENCES, require_tools, synthesize

    from miniapp.app.gui.voice import LiveTranscripts
    from miniapp.engine.voice.metrics import word_error_rate

    require_tools()
    transcriber = Transcriber(threads=2)
    asr = transcriber.asr()
    real_transcribe = asr.transcribe

    def slow_transcribe(*args, **kwargs):
        time.sleep(1.2)
        return real_transcribe(*args, **kwargs)

    asr.transcribe = slow_transcribe
    sentence = CLEAN_SENTENCES[1]
    speech = synthesize(sentence, seed=2)
    live = LiveTranscripts(transcriber)
    live.start("session")
    rate, step = 48_000, 24_000  # the browser's 0.5 s chunks at 48 kHz, int16
    at_48k = np.arange(0, len(speech.audio), 16_000 / rate)
    resampled = np.interp(at_48k, np.arange(len(speech.audio)), speech.audio)
    browser_audio = (resampled * 32767).astype(np.int16)
    handler_s, shown = [], []
    for at in range(0, len(browser_audio), step):
        began = time.monotonic()
        shown.append(live.chunk((rate, browser_audio[at : at + step]), "session"))
        handler_s.append(time.monotonic() - began)
        time.sleep(0.5)
    for _ in range(6):  # the speaker pauses; the GUI keeps sending chunks of silence
        shown.append(live.chunk((rate, np.zeros(step, dtype=np.int16)), "session"))
        time.sleep(0.5)
    transcript, box = live.finish("session")
    assert max(handler_s) < 0.1, handler_s
    assert any("`" in text for text in shown), "no word was shown before the recording ended"
    assert word_error_rate(sentence, box["text"]) <= 0.15, box["text"]
    assert "`" in transcript
