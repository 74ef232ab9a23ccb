"""The GUI's controller without the browser: the vision path for pictures (a tiny random
vision model and projector, written with gguf's writer), and bad uploads."""

from __future__ import annotations

import pytest
from image_fixtures import TinyProjector, encode, text_image, write_tiny_projector
from tiny_gguf import LLAMA, write_tiny_model

from miniapp.app.gui.controller import (
    ChatSettings,
    ModelHost,
    Transcriber,
    UnsupportedUploadError,
    prepare_user_message,
    stream_answer,
)
from miniapp.app.gui.history import SavedChat
from miniapp.engine.errors import MiniappError


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
    settings = ChatSettings(model=str(vision_model), backend="llamacpp", ctx=512, threads=2,
                            max_tokens=6, temperature=0.0)  # fmt: skip
    user = prepare_user_message("What does it say?", [_picture(tmp_path)], settings,
                                Transcriber())  # fmt: skip
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

    settings = ChatSettings(model=str(vision_model), backend="llamacpp", ctx=512, threads=2,
                            max_tokens=6, temperature=0.0)  # fmt: skip
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
