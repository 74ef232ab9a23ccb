"""The vision path: finding a projector (mmproj) for a model, the route decision, and
llama.cpp's multimodal path end to end with a tiny random-weight text model and projector."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from image_fixtures import TinyProjector, write_tiny_projector
from PIL import Image
from tiny_gguf import LLAMA, write_tiny_model

from miniapp.engine.chat.conversation import Conversation
from miniapp.engine.chat.generation import GenerationRequest
from miniapp.engine.errors import ContextFullError, ModelFileError
from miniapp.engine.images import (
    ImagePath,
    attach_image,
    build_user_message,
    choose_route,
    find_mmproj,
    load_image,
    vision_images,
)
from miniapp.engine.modelfile.template import Message
from miniapp.engine.runtimes.llamacpp_vision import MARKER, LlamaCppVisionRuntime
from miniapp.engine.tokens.events import Finished, FinishReason, TextDelta
from miniapp.engine.tokens.sampling import GREEDY

PROJECTOR = TinyProjector(text_dim=LLAMA.dim)
GREEDY_8 = GenerationRequest(max_tokens=8, sampling=GREEDY)


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision")
    write_tiny_model(folder / "tiny.gguf", LLAMA)
    write_tiny_projector(folder / "mmproj-tiny-f16.gguf", PROJECTOR)
    return folder


@pytest.fixture(scope="module")
def vision(vision_dir):
    runtime = LlamaCppVisionRuntime(
        vision_dir / "tiny.gguf", vision_dir / "mmproj-tiny-f16.gguf", n_ctx=512, threads=2
    )
    yield runtime
    runtime.close()


@pytest.fixture
def chat(vision):
    return Conversation(vision, request=GREEDY_8)


def _picture(colour, size=(96, 80)):
    """A PNG as a vision model is sent it (through our image loader)."""
    return load_image(_png(Image.new("RGB", size, colour)), name=f"{colour}.png").png_bytes()


def _png(image):
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _run(chat, text, images=(), request=GREEDY_8, **kwargs):
    chat.reset()
    events = list(chat.send(text, images, request, **kwargs))
    assert isinstance(events[-1], Finished)
    assert all(isinstance(e, TextDelta) for e in events[:-1])
    return events[-1]


def _next_token_logits(chat, text, pictures=()):
    """Evaluate the conversation plus this message (not kept) and return the logits of the
    answer's first token: shows whether the pictures reach the model."""
    runtime = chat.runtime
    messages = [*chat.messages, Message("user", text, tuple(pictures))]
    runtime.prefill(chat.render(messages), [p for m in messages for p in m.pictures])
    return runtime.prefill_logits()


# -- finding the projector -------------------------------------------------------------------


def test_projector_beside_the_model_is_found(vision_dir):
    search = find_mmproj(vision_dir / "tiny.gguf")
    assert search.path == vision_dir / "mmproj-tiny-f16.gguf"
    assert search.reason == "projector mmproj-tiny-f16.gguf beside the model"


def test_no_projector_means_ocr(tmp_path):
    write_tiny_model(tmp_path / "plain.gguf", LLAMA)
    route = choose_route(tmp_path / "plain.gguf", "torch")
    assert route.path == ImagePath.OCR_FALLBACK
    assert route.summary() == (
        "images: read as text by OCR, with size, colours and EXIF (no mmproj GGUF beside the model)"
    )


def test_projector_of_another_model_is_not_used(tmp_path, vision_dir):
    shutil.copy(vision_dir / "tiny.gguf", tmp_path / "tiny.gguf")
    write_tiny_projector(tmp_path / "mmproj-tiny.gguf", TinyProjector(text_dim=96))
    search = find_mmproj(tmp_path / "tiny.gguf")
    assert search.path is None
    assert "outputs 96-wide embeddings, the model takes 64" in search.reason


def test_projector_name_must_match_when_models_share_a_folder(tmp_path, vision_dir):
    for name in ("tiny.gguf", "other.gguf"):
        shutil.copy(vision_dir / "tiny.gguf", tmp_path / name)
    shutil.copy(vision_dir / "mmproj-tiny-f16.gguf", tmp_path / "mmproj-tiny-f16.gguf")
    assert find_mmproj(tmp_path / "tiny.gguf").path == tmp_path / "mmproj-tiny-f16.gguf"
    other = find_mmproj(tmp_path / "other.gguf")
    assert other.path is None and "may belong to another model; pass --mmproj" in other.reason
    explicit = find_mmproj(tmp_path / "other.gguf", tmp_path / "mmproj-tiny-f16.gguf")
    assert explicit.path == tmp_path / "mmproj-tiny-f16.gguf"


def test_explicit_projector_must_be_a_projector(vision_dir, tmp_path):
    with pytest.raises(ModelFileError, match="not a multimodal projector"):
        find_mmproj(vision_dir / "tiny.gguf", vision_dir / "tiny.gguf")
    with pytest.raises(ModelFileError, match="file not found"):
        find_mmproj(vision_dir / "tiny.gguf", tmp_path / "missing-mmproj.gguf")


def test_route_switches_from_torch_to_llamacpp(vision_dir):
    route = choose_route(vision_dir / "tiny.gguf", "torch")
    assert route.path == ImagePath.VISION_MODEL and route.switches_backend
    assert route.mmproj == vision_dir / "mmproj-tiny-f16.gguf"
    assert "image turns run on llama.cpp" in route.summary()
    assert not choose_route(vision_dir / "tiny.gguf", "llamacpp").switches_backend
    kept = choose_route(vision_dir / "tiny.gguf", "torch", allow_backend_switch=False)
    assert kept.path == ImagePath.OCR_FALLBACK and "use --backend llamacpp" in kept.reason


def test_vision_attachment_is_sent_as_a_picture(vision_dir, tmp_path):
    route = choose_route(vision_dir / "tiny.gguf", "llamacpp")
    path = tmp_path / "cat.png"
    path.write_bytes(_png(Image.new("RGB", (40, 30), "orange")))
    attachment = attach_image(path, route)
    assert attachment.description is None  # no OCR: the model sees the pixels
    assert build_user_message("What is it?", [attachment]) == "What is it?"
    assert vision_images([attachment]) == [attachment.image]
    assert attachment.notice() == (
        "cat.png (40x30 PNG): shown to the vision model "
        "(projector mmproj-tiny-f16.gguf beside the model)"
    )


# -- llama.cpp's multimodal path --------------------------------------------------------------


def test_image_is_embedded_and_answered(chat, vision):
    finished = _run(chat, "What is in the picture?", [_picture("red")])
    assert finished.reason in (FinishReason.MAX_TOKENS, FinishReason.END_OF_TURN)
    assert finished.stats.generated_tokens >= 1
    held = vision.held_positions
    assert finished.stats.prompt_tokens == held - finished.stats.generated_tokens + 1
    assert vision.last_prefill.text.count(MARKER) == 1
    assert [m.role for m in chat.messages] == ["user", "assistant"]


def test_each_image_adds_its_tokens(chat):
    counts = [_run(chat, "Describe.", [_picture("red")] * n).stats.prompt_tokens for n in range(3)]
    per_image = counts[1] - counts[0]
    assert counts[2] - counts[1] == per_image
    # The projector's tokens, plus the few text tokens that frame an image.
    assert PROJECTOR.image_tokens <= per_image <= PROJECTOR.image_tokens + 48


def test_the_pixels_reach_the_model(chat, vision):
    chat.reset()
    red = _next_token_logits(chat, "Which colour?", [_picture("red")])
    red_again = _next_token_logits(chat, "Which colour?", [_picture("red")])
    blue = _next_token_logits(chat, "Which colour?", [_picture("blue")])
    assert red.shape == (vision.tokenizer.n_vocab,)
    np.testing.assert_allclose(red, red_again, rtol=0, atol=1e-4)
    assert np.abs(red - blue).max() > 1e-3
    assert chat.messages == []  # a probe, not a turn


def test_the_shown_prompt_is_the_evaluated_prompt(chat, vision):
    chat.reset()
    preview = chat.preview("Look at these.", pictures=2)
    list(chat.send("Look at these.", [_picture("red"), _picture("green")]))
    assert vision.last_prefill.text == preview
    assert preview.index(MARKER) < preview.index("Look at these.")  # images come first


def test_later_turns_keep_earlier_images(chat, vision):
    first = _run(chat, "First.", [_picture("red")])
    second = list(chat.send("And now?", [], GREEDY_8))[-1]
    assert vision.last_prefill.text.count(MARKER) == 1
    assert second.stats.prompt_tokens > first.stats.prompt_tokens


def test_typed_marker_is_not_an_image(chat, vision):
    chat.reset()
    preview = chat.preview(f"Is {MARKER} a picture?")
    finished = _run(chat, f"Is {MARKER} a picture?")
    shown = vision.last_prefill.text
    assert shown.count(MARKER) == 0 and shown == preview
    assert finished.stats.prompt_tokens > 0


def test_stop_and_cancel(chat):
    cancelled = _run(chat, "Go on.", [_picture("red")], should_stop=lambda: True)
    assert cancelled.reason == FinishReason.CANCELLED
    assert cancelled.stats.generated_tokens == 1


def test_too_many_images_for_the_context(vision_dir):
    small = LlamaCppVisionRuntime(
        vision_dir / "tiny.gguf", vision_dir / "mmproj-tiny-f16.gguf", n_ctx=200, threads=2
    )
    assert small.n_ctx == 256  # llama.cpp's own rounding, taken up front
    chat = Conversation(small)
    try:
        with pytest.raises(ContextFullError, match="do not fit the context of 256"):
            list(chat.send("Compare.", [_picture("red")] * 6, GREEDY_8))
        assert chat.messages == []  # the chat goes on
        finished = list(chat.send("Hi.", [], GREEDY_8))[-1]
        assert isinstance(finished, Finished)
    finally:
        small.close()


def test_old_turns_make_room_for_new_images(vision_dir):
    small = LlamaCppVisionRuntime(
        vision_dir / "tiny.gguf", vision_dir / "mmproj-tiny-f16.gguf", n_ctx=256, threads=2
    )
    chat = Conversation(small)
    try:
        for turn in range(3):
            finished = list(chat.send(f"Turn {turn}.", [_picture("red")] * 2, GREEDY_8))[-1]
            assert finished.stats.prompt_tokens + 8 <= small.n_ctx
        assert chat.dropped_turns >= 1
        assert chat.messages[0].content != "Turn 0."
        shown = small.last_prefill.text
        assert shown.count(MARKER) == sum(len(m.pictures) for m in chat.messages)
    finally:
        small.close()


def test_bundled_model_template_with_a_projector(default_model, tmp_path):
    """The real chat template (SmolLM2's, with a system prompt) around an image marker."""
    projector = write_tiny_projector(tmp_path / "mmproj-smol.gguf", TinyProjector(text_dim=576))
    real = LlamaCppVisionRuntime(default_model, projector, n_ctx=512, threads=2)
    try:
        events = list(
            Conversation(real, "Hi.").send("What do you see?", [_picture("red")], GREEDY_8)
        )
        assert "".join(e.text for e in events[:-1])
        shown = real.last_prefill.text
        assert shown.startswith("<|im_start|>system\nHi.<|im_end|>\n")
        assert f"<|im_start|>user\n{MARKER}\nWhat do you see?<|im_end|>" in shown
    finally:
        real.close()


def test_projector_llamacpp_refuses_is_one_line(vision_dir, tmp_path):
    broken = tmp_path / "mmproj-broken.gguf"
    write_tiny_projector(
        broken, TinyProjector(text_dim=LLAMA.dim, skip_tensor="v.blk.0.ffn_up.weight")
    )
    with pytest.raises(ModelFileError) as caught:
        LlamaCppVisionRuntime(vision_dir / "tiny.gguf", broken, n_ctx=256, threads=2)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{broken}: llama.cpp could not load this projector")
    assert message.endswith("(unable to find tensor v.blk.0.ffn_up.weight)")


def test_projector_for_another_model_is_refused_before_loading(vision_dir, tmp_path):
    wrong = write_tiny_projector(tmp_path / "mmproj-wide.gguf", TinyProjector(text_dim=128))
    with pytest.raises(ModelFileError, match="outputs 128-wide embeddings, the model takes 64"):
        LlamaCppVisionRuntime(vision_dir / "tiny.gguf", wrong, n_ctx=256, threads=2)


def test_a_follow_up_reuses_the_context_and_answers_as_a_fresh_evaluation(chat, vision):
    first = _run(chat, "What is this?", [_picture("red"), _picture("green")])
    assert first.stats.cached_prompt_tokens == 0
    held = vision.held_positions
    follow_up = _next_token_logits(chat, "And the second one?")
    # Everything up to the first answer stayed in the context, the images included.
    assert vision.last_prefill.reused >= first.stats.prompt_tokens
    assert vision.last_prefill.reused <= held
    vision.reset()
    again = Conversation(vision, request=GREEDY_8, history=chat.messages)
    fresh = _next_token_logits(again, "And the second one?")
    assert vision.last_prefill.reused == 0
    np.testing.assert_allclose(follow_up, fresh, rtol=0, atol=1e-3)
    assert follow_up.argmax() == fresh.argmax()


def test_a_changed_picture_is_evaluated_again(chat, vision):
    chat.reset()
    red = _next_token_logits(chat, "Which colour?", [_picture("red")])
    _next_token_logits(chat, "Which shape?", [_picture("red")])
    same_picture = vision.last_prefill.reused  # the text before the picture, and the picture
    blue = _next_token_logits(chat, "Which shape?", [_picture("blue")])
    other_picture = vision.last_prefill.reused  # only the text before it
    assert 0 < other_picture and same_picture >= other_picture + PROJECTOR.image_tokens
    assert np.abs(red - blue).max() > 1e-3
