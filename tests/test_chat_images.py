"""`miniapp chat` with images, run as a user would: OCR for the bundled model (no projector),
llama.cpp's vision path for a tiny random-weight model with a projector beside it."""

from __future__ import annotations

import re
import subprocess

import pexpect
import pytest
from image_fixtures import (
    TinyProjector,
    normalised,
    png_bomb,
    text_image,
    write_tiny_projector,
)
from PIL import Image
from tiny_gguf import LLAMA, write_tiny_model

from miniapp.engine.chat.conversation import Conversation
from miniapp.engine.chat.generation import GenerationRequest
from miniapp.engine.runtimes.llamacpp_vision import MARKER
from miniapp.engine.tokens.sampling import GREEDY

PROMPT = ">>> "
PROMPT_START, PROMPT_END = "--- prompt ---", "--- end of prompt ---"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-images")
    text_image(["TOTAL 42.50"]).save(folder / "receipt.png")
    Image.new("RGB", (96, 80), "orange").save(folder / "pic.png")
    (folder / "notes.txt").write_text("this is not an image\n")
    (folder / "cut.png").write_bytes((folder / "receipt.png").read_bytes()[:300])
    (folder / "bomb.png").write_bytes(png_bomb())
    return folder


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision")
    write_tiny_projector(folder / "mmproj-tiny-f16.gguf", TinyProjector(text_dim=LLAMA.dim))
    return write_tiny_model(folder / "tiny.gguf", LLAMA)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny model alone in its folder: the OCR route, and nothing slow to load."""
    path = tmp_path_factory.mktemp("text") / "tiny.gguf"
    write_tiny_model(path, LLAMA)
    return path


def _chat(exe, *args, stdin: str):
    return subprocess.run(
        [exe, "chat", "--temperature", "0", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _shown_prompt(output: str) -> str:
    return output.split(PROMPT_START, 1)[1].split(PROMPT_END, 1)[0]


def test_ocr_text_and_label_reach_the_prompt(miniapp_exe, files):
    done = _chat(
        miniapp_exe,
        "--image",
        files / "receipt.png",
        "--show-prompt",
        "--max-tokens",
        16,
        stdin="What is the total?\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and PROMPT_START not in done.stdout
    notice = done.stderr.splitlines()[0]
    assert notice.startswith("receipt.png (900x320 PNG): read by OCR, 1 line of text ("), notice
    prompt = _shown_prompt(done.stderr)
    assert "[image: receipt.png, 900x320 PNG" in prompt
    assert "total42.50" in normalised(prompt)
    # The model's own template around it, the label before the question.
    assert "<|im_start|>user\n" in prompt
    assert prompt.index("[image:") < prompt.index("What is the total?")


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("notes.txt", "a text file, not an image"),
        ("cut.png", "corrupt or truncated image"),
        ("bomb.png", "over the 60 MP limit"),
    ],
)
def test_bad_image_is_one_line_and_exit_2(miniapp_exe, files, text_model, name, cause):
    done = _chat(miniapp_exe, "--model", text_model, "--image", files / name, stdin="Hi\n")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and cause in lines[0], done.stderr


def test_bad_projector_is_one_line_and_exit_2(miniapp_exe, files, text_model):
    done = _chat(miniapp_exe, "--model", text_model, "--mmproj", files / "notes.txt", stdin="Hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "notes.txt: not a GGUF file" in lines[0], done.stderr


def _ask(child, text: str) -> str:
    child.sendline(text)
    child.expect_exact(PROMPT)
    return child.before


def _spawn(exe, *args):
    child = pexpect.spawn(
        exe,
        ["chat", "--temperature", "0", "--show-prompt", *map(str, args)],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def _exit(child) -> None:
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_image_command_in_an_interactive_chat(miniapp_exe, files):
    chat = _spawn(miniapp_exe, "--backend", "llamacpp", "--max-tokens", 16)
    try:
        refused = _ask(chat, f"/image {files / 'notes.txt'}")
        errors = [line for line in refused.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "not an image" in errors[0], refused
        assert "read by OCR" in _ask(chat, f"/image {files / 'receipt.png'}")
        assert "attached: receipt.png (900x320 PNG): read by OCR" in _ask(chat, "/image")
        answered = _ask(chat, "What is the total?")
        assert "total42.50" in normalised(_shown_prompt(answered))
        assert answered.split(PROMPT_END, 1)[1].strip()  # an answer
        # The image went with that message only.
        assert "(no images attached)" in _ask(chat, "/image")
        later = _shown_prompt(_ask(chat, "Thanks."))
        assert later.count("[image: receipt.png") == 1  # in the history, not sent again
        _exit(chat)
    finally:
        chat.terminate(force=True)


def test_piped_image_goes_to_the_vision_model(miniapp_exe, files, vision_model):
    done = _chat(
        miniapp_exe,
        "--model",
        vision_model,
        "--image",
        files / "pic.png",
        "--show-prompt",
        "--max-tokens",
        4,
        stdin="What is it?\n",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "pic.png (96x80 PNG): shown to the vision model "
        "(projector mmproj-tiny-f16.gguf beside the model)"
    )
    assert lines[1] == (
        "images: sent to the vision model (projector mmproj-tiny-f16.gguf beside the model); "
        "the rest of this conversation runs on llama.cpp"
    )
    assert f"{MARKER}\nWhat is it?" in _shown_prompt(done.stderr)


def test_follow_ups_stay_with_the_pictures_until_a_reset(miniapp_exe, files, vision_model):
    """An image turn moves the conversation to the vision chat: a follow-up still sees the
    picture, and only what it adds is evaluated; /reset brings text back to the torch engine."""
    chat = _spawn(miniapp_exe, "--model", vision_model, "--max-tokens", 4)
    try:
        _ask(chat, "Hello.")  # a text turn on the torch engine first: the history carries
        _ask(chat, f"/image {files / 'pic.png'}")
        first = _ask(chat, "Describe the picture.")
        assert "the rest of this conversation runs on llama.cpp" in first
        assert _shown_prompt(first).count(MARKER) == 1
        assert "llamacpp: prompt" in _ask(chat, "/stats")
        second = _ask(chat, "And the colour?")
        assert "runs on llama.cpp" not in second  # said once
        history = _shown_prompt(second)
        assert history.count(MARKER) == 1  # the picture is still in the conversation
        assert history.index("Hello.") < history.index("Describe the picture.")
        assert history.index("Describe the picture.") < history.index("And the colour?")
        stats = _ask(chat, "/stats")
        cached = int(re.search(r"\((\d+) cached\)", stats).group(1))
        assert "llamacpp: prompt" in stats and cached > 20  # the picture was not run again
        _ask(chat, "/reset")
        third = _ask(chat, "Hi again.")
        assert MARKER not in _shown_prompt(third) and "Describe" not in _shown_prompt(third)
        assert "torch: prompt" in _ask(chat, "/stats")
        _exit(chat)
    finally:
        chat.terminate(force=True)


def test_session_preview_is_the_prompt_it_sends(text_model):
    from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime

    runtime = LlamaCppRuntime(text_model, n_ctx=256)
    session = Conversation(runtime, "Be brief.", GenerationRequest(max_tokens=4, sampling=GREEDY))
    list(session.send("Hello."))
    preview = session.preview("Again?")
    list(session.send("Again?"))
    assert session.render(session.messages[:-1]) == preview
    assert preview.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert preview.count("Hello.") == 1 and preview.rstrip().endswith("assistant")
