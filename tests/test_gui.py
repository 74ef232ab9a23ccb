"""The GUI end to end: a real `miniapp gui` server on loopback, driven by headless Chromium
(Debian's, through Playwright). Each test saves a screenshot in its output folder."""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest
from image_fixtures import encode, text_image
from speech_synth import CLEAN_SENTENCES, require_tools, synthesize, wav

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]
STARTUP_S = 120
ANSWER_S = 120
MESSAGE = "Name three colours."
MAX_TOKENS = 24
READY = ".gguf on torch"  # the status line of a loaded model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GuiServer:
    """`miniapp gui` in a subprocess, on its own data folder (kept across restarts)."""

    def __init__(self, exe: str, data_dir: Path, *extra_args: str, file_size_limit: int = 0):
        self.exe, self.data_dir, self.extra_args = exe, data_dir, list(extra_args)
        self.file_size_limit = file_size_limit  # bytes a written file may reach (0: no limit)
        self.process: subprocess.Popen | None = None
        self.url = ""

    def _limits(self) -> None:
        if self.file_size_limit:  # writes past it fail with EFBIG, as on a full disk
            resource.setrlimit(
                resource.RLIMIT_FSIZE, (self.file_size_limit, resource.RLIM_INFINITY)
            )

    def start(self) -> GuiServer:
        port = _free_port()
        env = {**os.environ, "MINIAPP_DATA_DIR": str(self.data_dir), "MINIAPP_MAX_UPLOAD": "2mb"}
        env.pop("DISPLAY", None)
        self.process = subprocess.Popen(
            [
                self.exe,
                "gui",
                "--port",
                str(port),
                "--no-browser",
                "--threads",
                "2",
                "--temperature",
                "0",
                "--max-tokens",
                str(MAX_TOKENS),
                *self.extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=self._limits,
        )
        deadline = time.monotonic() + STARTUP_S
        for line in self.process.stdout:
            if line.startswith("miniapp GUI: "):
                self.url = line.split(": ", 1)[1].strip()
                return self
            assert time.monotonic() < deadline, "the GUI did not start"
        raise AssertionError(f"the GUI exited with {self.process.wait()}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gui-data")


@pytest.fixture(scope="module")
def server(miniapp_exe, data_dir):
    # The default slots (--parallel 4) against the terminal's one: one engine, the same rows
    # through the same kernels, so the two must agree word for word.
    running = GuiServer(miniapp_exe, data_dir).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser, server, tmp_path):
    opened = browser.new_page(viewport={"width": 1280, "height": 1100})
    opened.goto(server.url)
    opened.wait_for_selector("#message-box textarea", timeout=STARTUP_S * 1000)
    _wait_for_text(opened, "#model-status", READY)
    yield opened
    opened.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
    opened.close()


def _wait_for_text(page, selector: str, text: str, timeout_s: float = ANSWER_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = page.inner_text(selector)
        if text in found:
            return found
        time.sleep(0.1)
    shown = page.inner_text(selector)
    raise AssertionError(f"{selector} never showed {text!r}; it shows {shown!r}")


def _send(page, text: str, files: list[Path] = ()) -> None:
    if files:
        page.set_input_files("#message-box input[type=file]", [str(f) for f in files])
        thumbnails = page.locator('#message-box [aria-label="File thumbnail"]')
        deadline = time.monotonic() + 30
        while thumbnails.count() < len(files):  # uploaded to the server
            assert time.monotonic() < deadline, "the upload did not finish"
            time.sleep(0.1)
    page.fill("#message-box textarea", text)
    page.press("#message-box textarea", "Enter")


def answer_lengths(page) -> set[int]:
    """The lengths the last answer showed as it streamed, until its figures came."""
    lengths = set()
    deadline = time.monotonic() + ANSWER_S
    while "tok/s" not in page.inner_text("#figures") and time.monotonic() < deadline:
        bubbles = page.locator("#chatbot .bot")
        if bubbles.count():
            lengths.add(len(bubbles.last.inner_text()))
        time.sleep(0.02)
    return lengths


def _answer(page) -> str:
    """The last answer, once its figures are shown."""
    _wait_for_text(page, "#figures", "tok/s")
    return page.locator("#chatbot .bot").last.inner_text().strip()


def _words(text: str) -> list[str]:
    """The words of a text, as rendered Markdown keeps them (list numbers become layout)."""
    return re.findall(r"[A-Za-z']+", text)


def _terminal_answer(exe: str, text: str, max_tokens: int) -> str:
    done = subprocess.run(
        [exe, "chat", "--threads", "2", "--temperature", "0", "--max-tokens", str(max_tokens)],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_message_streams_its_answer(page, miniapp_exe):
    _send(page, MESSAGE)
    lengths = answer_lengths(page)
    answer = _answer(page)
    assert len(lengths - {0}) >= 2, "the answer arrived in one piece, not streamed"
    # Same model, same greedy settings: the GUI answers exactly as the terminal does.
    assert _words(answer) == _words(_terminal_answer(miniapp_exe, MESSAGE, MAX_TOKENS))
    figures = page.inner_text("#figures")
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", figures) and "context" in figures


def test_a_settings_change_applies_to_the_next_message(page, miniapp_exe):
    page.fill("#max-tokens input", "5")
    page.press("#max-tokens input", "Tab")
    _send(page, MESSAGE)
    answer = _answer(page)
    assert _words(answer) == _words(_terminal_answer(miniapp_exe, MESSAGE, 5))
    assert "context" in page.inner_text("#figures")


def _set_max_tokens(page, n: int) -> None:
    page.fill("#max-tokens input", str(n))
    page.press("#max-tokens input", "Tab")


def test_regenerate_replaces_the_answer_and_edit_takes_the_message_back(page, miniapp_exe):
    _set_max_tokens(page, 3)
    _send(page, MESSAGE)
    short = _words(_answer(page))
    # Regenerate with new settings: greedy again, so the longer answer starts as the short one.
    _set_max_tokens(page, 8)
    before = page.inner_text("#figures")  # the short answer's, until the new one finishes
    page.click("#regenerate")
    bubbles = page.locator("#chatbot .bot")
    deadline = time.monotonic() + ANSWER_S
    while time.monotonic() < deadline:
        figures = page.inner_text("#figures")
        done = "tok/s" in figures and figures != before and bubbles.count() == 1
        if done and len(_words(bubbles.last.inner_text())) > len(short):
            break
        time.sleep(0.1)
    longer = _words(bubbles.last.inner_text())
    assert bubbles.count() == 1, "the regenerated answer was added, not put in place"
    assert longer == _words(_terminal_answer(miniapp_exe, MESSAGE, 8))
    assert longer[: len(short)] == short and len(longer) > len(short)
    page.click("#edit-last")
    deadline = time.monotonic() + 30
    while bubbles.count() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bubbles.count() == 0
    assert page.input_value("#message-box textarea") == MESSAGE


def _file_containing(folder: Path, pattern: str, text: str) -> Path:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for path in folder.glob(pattern) if folder.is_dir() else []:
            if text in path.read_text(encoding="utf-8"):
                return path
        time.sleep(0.1)
    raise AssertionError(f"no {pattern} in {folder} holds {text!r}")


def test_a_chat_exports_to_markdown_and_json_and_is_deleted(page, data_dir):
    message = "Say the word apricot."
    _set_max_tokens(page, 4)
    _send(page, message)
    answer = _answer(page)
    page.get_by_role("button", name="Export .md").click()
    markdown = _file_containing(data_dir / "exports", "*.md", message)
    assert _words(answer)[0] in markdown.read_text(encoding="utf-8")
    page.get_by_role("button", name="Export .json").click()
    exported = json.loads(_file_containing(data_dir / "exports", "*.json", message).read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    saved = data_dir / "conversations" / f"{markdown.stem}.json"
    assert saved.exists()
    page.reload()  # a new visit lists the chats saved since the server started
    page.wait_for_selector("#saved-chats input", timeout=STARTUP_S * 1000)
    page.click("#saved-chats input")
    page.get_by_role("option", name=message).click()
    page.click("#delete-chat")
    deadline = time.monotonic() + 30
    while saved.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not saved.exists()


def test_an_image_goes_through_ocr_and_says_so(page, tmp_path):
    image = tmp_path / "receipt.png"
    image.write_bytes(encode(text_image(["CAFE LUNA", "TOTAL 42.50"]), "PNG"))
    _send(page, "What is the total?", [image])
    _answer(page)
    user = page.locator("#chatbot .user").last.inner_text()
    assert "receipt.png" in user and "read by OCR" in user
    assert "read by OCR" in page.inner_text("#notice")


def test_an_audio_file_becomes_its_transcript(page, tmp_path):
    require_tools()
    sentence = CLEAN_SENTENCES[0]
    audio = wav(tmp_path / "question.wav", synthesize(sentence, seed=3))
    _send(page, "", [audio])
    _answer(page)
    user = page.locator("#chatbot .user").last.inner_text()
    said = user.split("question.wav:")[0]
    assert _words(said.lower()) == _words(sentence.lower())
    assert f"question.wav: transcribed, {len(sentence.split())} words" in user
    assert "word times" in user


def test_a_corrupt_upload_is_an_error_and_the_chat_goes_on(page, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)
    _send(page, "Look at this", [broken])
    notice = _wait_for_text(page, "#notice", "⚠️")
    assert "broken.png" in notice and "\n" not in notice.strip()
    page.click('#message-box [aria-label="Remove file"]')  # the input was kept to fix
    _send(page, MESSAGE)
    assert _answer(page)


def test_an_oversized_upload_is_refused(page, tmp_path):
    big = tmp_path / "huge.png"
    big.write_bytes(os.urandom(3 * 2**20))  # the test server's limit is 2 MB
    page.set_input_files("#message-box input[type=file]", [str(big)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = page.inner_text("body").lower()
        if "too large" in body or "exceed" in body or "maximum" in body:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("no message refused the oversized upload")


def test_a_model_that_fails_to_load_is_shown_and_the_old_one_stays(page):
    page.fill("#model-path textarea, #model-path input", "/nonexistent/model.gguf")
    page.press("#model-path textarea, #model-path input", "Tab")
    _wait_for_text(page, "#model-status", "failed to load")
    assert "previous model stays loaded" in page.inner_text("#model-status")
    page.fill("#model-path textarea, #model-path input", "")
    page.press("#model-path textarea, #model-path input", "Tab")
    _wait_for_text(page, "#model-status", READY)
    _send(page, MESSAGE)
    assert _answer(page)


def test_history_survives_a_restart(browser, miniapp_exe, data_dir, tmp_path):
    first = GuiServer(miniapp_exe, data_dir).start()
    try:
        page = browser.new_page()
        page.goto(first.url)
        page.wait_for_selector("#message-box textarea", timeout=STARTUP_S * 1000)
        _send(page, "Remember the word lighthouse.")
        answer = _answer(page)
        page.close()
    finally:
        first.stop()
    second = GuiServer(miniapp_exe, data_dir).start()
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(second.url)
        page.wait_for_selector("#saved-chats", timeout=STARTUP_S * 1000)
        page.click("#saved-chats input")
        page.get_by_role("option", name=re.compile("Remember the word lighthouse")).click()
        page.click("#open-chat")
        text = _wait_for_text(page, "#chatbot", "Remember the word lighthouse.")
        assert answer[:40] in text
        page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        page.close()
    finally:
        second.stop()


def test_a_chat_that_cannot_be_saved_goes_on_and_a_corrupt_one_is_named(
    browser, miniapp_exe, tmp_path
):
    """A full disk (a file-size limit on the GUI process) and a corrupt saved chat: one line
    each in the notice; the answer streams, the next turn sees the first, nothing is lost."""
    conversations = tmp_path / "data" / "conversations"
    conversations.mkdir(parents=True)
    corrupt = conversations / ("c" * 32 + ".json")
    corrupt.write_text('{"id": "cut off')
    gui = GuiServer(miniapp_exe, tmp_path / "data", "--parallel", "1", file_size_limit=2000)
    gui.start()
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(gui.url)
        page.wait_for_selector("#message-box textarea", timeout=STARTUP_S * 1000)
        _wait_for_text(page, "#notice", f"{corrupt.name} could not be read")
        _send(page, "Remember the word lighthouse. " + "Background: " + "calm sea. " * 250)
        notice = _wait_for_text(page, "#notice", "could not save this chat")
        assert "File too large" in notice and "\n" not in notice.strip()
        assert _answer(page)
        _send(page, "What word?")
        _wait_for_text(page, "#chatbot", "What word?")
        assert _answer(page) and "Remember the word lighthouse" in page.inner_text("#chatbot")
        page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        page.close()
    finally:
        gui.stop()
    assert corrupt.read_text() == '{"id": "cut off'
    assert gui.process.returncode in (0, -15)  # stopped by us, not crashed


def _open_pages(browser, server, count: int) -> list:
    pages = [browser.new_page(viewport={"width": 1280, "height": 1100}) for _ in range(count)]
    for opened in pages:
        opened.goto(server.url)
        opened.wait_for_selector("#message-box textarea", timeout=STARTUP_S * 1000)
        _wait_for_text(opened, "#model-status", READY)
    return pages


STORY = "Write a long story about a dragon."
# Greedy, the story runs past 400 tokens without an end. 160 were done in 2.2 s on a Zen 5
# CPU with drafting, before the second session's short answer had finished.
STORY_TOKENS = 400


def test_two_sessions_stream_their_answers_at_the_same_time(browser, miniapp_exe, tmp_path):
    """The batching engine (--parallel 4 by default): a second session's answer streams
    while the first one's is still growing, and each equals the answer it gets alone."""
    batching = GuiServer(miniapp_exe, tmp_path / "data").start()
    try:
        first, second = _open_pages(browser, batching, 2)
        _set_max_tokens(first, STORY_TOKENS)
        _send(first, STORY)
        _wait_for_text(first, "#figures", "generating")
        _send(second, MESSAGE)
        first_lengths = set()
        while "tok/s" not in second.inner_text("#figures"):
            first_lengths.add(len(first.locator("#chatbot .bot").last.inner_text()))
            assert "tok/s" not in first.inner_text("#figures"), "the first answer ended first"
            time.sleep(0.05)
        assert len(first_lengths) >= 2, "the first answer stood still while the second streamed"
        together = [_words(_answer(opened)) for opened in (first, second)]
        for opened in (first, second):
            opened.close()
        # Each again in a session of its own with nothing beside it (its prompt's caches
        # are taken over from the pool: the same rows, bit for bit).
        for text, tokens, words in zip(
            (STORY, MESSAGE), (STORY_TOKENS, MAX_TOKENS), together, strict=True
        ):
            (alone,) = _open_pages(browser, batching, 1)
            _set_max_tokens(alone, tokens)
            _send(alone, text)
            assert _words(_answer(alone)) == words
            alone.close()
    finally:
        batching.stop()


def test_a_request_past_the_free_slots_queues_and_sees_its_position(browser, miniapp_exe, tmp_path):
    single = GuiServer(miniapp_exe, tmp_path / "data", "--parallel", "1").start()
    try:
        first, second = _open_pages(browser, single, 2)
        _set_max_tokens(first, 400)
        _send(first, STORY)
        _wait_for_text(first, "#figures", "generating")
        _send(second, MESSAGE)
        queued = _wait_for_text(second, "#chatbot", "queue: 1/1", timeout_s=30)
        second.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        assert "queue" in queued
        first.click("#stop")  # the stopped answer ends early; then the queued one runs
        _wait_for_text(first, "#figures", "stopped")
        assert _answer(second)
        for opened in (first, second):
            opened.close()
    finally:
        single.stop()


def test_the_microphone_streams_a_live_transcript_with_word_times(browser, server, tmp_path):
    """Chromium's fake capture device plays a synthetic sentence (in a loop) as the
    microphone; the transcript grows while it plays, each word with its stream times."""
    import numpy as np

    require_tools()
    sentence = CLEAN_SENTENCES[1]
    speech = synthesize(sentence, seed=2)
    pause = np.zeros(2 * 16_000, dtype=np.float32)  # between the loops of the fake device
    played = wav(tmp_path / "microphone.wav", np.concatenate([speech.audio, pause]))
    fake_microphone = [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={played}",
    ]
    # A second Chromium from the same Playwright: the capture device is a launch option.
    listening = browser.browser_type.launch(
        executable_path=CHROMIUM, args=CHROMIUM_ARGS + fake_microphone
    )
    try:
        page = listening.new_context(permissions=["microphone"]).new_page()
        page.goto(server.url)
        page.wait_for_selector("#message-box textarea", timeout=STARTUP_S * 1000)
        record = page.get_by_role("button", name="Record")
        record.wait_for(state="visible")
        time.sleep(1)  # the recorder sets itself up after the page loads
        record.click()
        recording_began = time.monotonic()
        growing = set()
        deadline = time.monotonic() + 2.2 * speech.duration + 4
        while time.monotonic() < deadline:
            growing.add(len(_words(page.inner_text("#live-transcript"))))
            time.sleep(0.5)
        recorded_s = time.monotonic() - recording_began
        page.get_by_role("button", name="Stop").last.click()
        box = page.locator("#message-box textarea")
        deadline = time.monotonic() + 30
        while not box.input_value() and time.monotonic() < deadline:
            time.sleep(0.2)
        transcript = page.inner_text("#live-transcript")
        page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        said = box.input_value()
    finally:
        listening.close()
    assert len(growing) >= 3, "the transcript did not grow while the speech played"
    # No audio was lost on the way. Gradio keeps only the newest chunk of a stream whose
    # handler is busy; with 0.1 s chunks (what Gradio 6 sends from a microphone mounted after
    # the page loaded, e.g. in a closed accordion) and the recogniser on both cores, about a
    # tenth of the audio was lost here (1.9 s of 19). The recorder's start and the last
    # chunk before Stop lose about a second.
    heard_s = float(re.search(r"🎙 (\d+\.\d) s heard", transcript).group(1))
    assert heard_s >= recorded_s - 1.5, (heard_s, recorded_s)
    # Every chunk reaches the recogniser (the GUI's handler only queues it), so the sentence
    # is heard. Chromium's fake device loops the file: the sentence may come more than once.
    heard = set(_words(said.lower()))
    assert len(heard & set(_words(sentence.lower()))) >= 6, said
    times = [float(t) for t in re.findall(r"(\d+\.\d\d)–\d+\.\d\d", transcript)]
    assert len(times) >= len(sentence.split()) and times == sorted(times)
