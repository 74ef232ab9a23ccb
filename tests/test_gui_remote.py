"""The GUI on a server's model (--backend openai): a real `miniapp serve` on loopback, the GUI
pointed at it, driven by headless Chromium."""

# The tests take test_gui's `browser` fixture, imported below, as their argument.
# ruff: noqa: F811

from __future__ import annotations

import re
import subprocess
import time

import pytest
from scripted_server import ScriptedServer, chunk
from test_gui import (
    ANSWER_S,
    MAX_TOKENS,
    MESSAGE,
    GuiServer,
    _send,
    _wait_for_text,
    _words,
    answer_lengths,
    browser,  # noqa: F401 - the shared Chromium fixture
)
from test_remote_backend import _cancelled
from test_serve import MODEL, running_server, wait_ready


@pytest.fixture(scope="module")
def api(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2") as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def remote_gui(miniapp_exe, api, tmp_path_factory):
    data = tmp_path_factory.mktemp("gui-remote")
    gui = GuiServer(miniapp_exe, data, "--backend", "openai", "--base-url", api + "/v1").start()
    yield gui
    gui.stop()


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#message-box textarea", timeout=ANSWER_S * 1000)
    return page


def test_the_gui_streams_a_servers_answer(browser, remote_gui, api, miniapp_exe, tmp_path):
    page = _open(browser, remote_gui.url)
    try:
        _wait_for_text(page, "#model-status", f"{MODEL} on openai at {api}/v1")
        _send(page, MESSAGE)
        lengths = answer_lengths(page)
        figures = page.inner_text("#figures")
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", figures) and f"{api}/v1" in figures
        assert len(lengths - {0}) >= 2, "the answer arrived in one piece, not streamed"
        answer = page.locator("#chatbot .bot").last.inner_text().strip()
        terminal = subprocess.run(
            [
                miniapp_exe,
                "chat",
                "--backend",
                "openai",
                "--base-url",
                api,
                "--temperature",
                "0",
                "--max-tokens",
                str(MAX_TOKENS),
            ],
            input=MESSAGE,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert terminal.returncode == 0, terminal.stderr
        assert _words(answer) == _words(terminal.stdout)  # the same server, greedy
    finally:
        page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        page.close()


def test_an_unreachable_server_is_said_in_the_status_line(browser, miniapp_exe, tmp_path):
    gui = GuiServer(
        miniapp_exe, tmp_path, "--backend", "openai", "--base-url", "http://127.0.0.1:9/v1"
    ).start()
    try:
        page = _open(browser, gui.url)
        _wait_for_text(page, "#model-status", "cannot reach the server at http://127.0.0.1:9/v1")
        _send(page, MESSAGE)
        _wait_for_text(page, "#notice", "cannot reach the server")
        page.close()
    finally:
        gui.stop()


def test_stop_hangs_up_and_the_server_cancels_the_answer(browser, api, miniapp_exe, tmp_path):
    before = _cancelled(api)
    gui = GuiServer(
        miniapp_exe, tmp_path, "--backend", "openai", "--base-url", api, "--max-tokens", "900"
    ).start()
    try:
        page = _open(browser, gui.url)
        _wait_for_text(page, "#model-status", "on openai at")
        _send(page, "Write a very long story about a dragon, with many chapters.")
        deadline = time.monotonic() + ANSWER_S
        bubbles = page.locator("#chatbot .bot")
        while not (bubbles.count() and len(bubbles.last.inner_text()) > 40):
            assert time.monotonic() < deadline, "the answer never started"
            time.sleep(0.05)
        page.click("#stop")
        _wait_for_text(page, "#figures", "stopped")
        deadline = time.monotonic() + 10
        while _cancelled(api) <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cancelled(api) == before + 1
        page.close()
    finally:
        gui.stop()


def test_an_answer_broken_off_midway_is_said_and_kept(browser, miniapp_exe, tmp_path):
    with ScriptedServer([chunk("The answer "), chunk("begins")], drop=True) as scripted:
        gui = GuiServer(
            miniapp_exe, tmp_path, "--backend", "openai", "--base-url", scripted.root
        ).start()
        try:
            page = _open(browser, gui.url)
            _wait_for_text(page, "#model-status", "on openai at")
            _send(page, MESSAGE)
            _wait_for_text(page, "#notice", "broke off the answer midway")
            assert page.locator("#chatbot .bot").last.inner_text().strip() == "The answer begins"
            page.close()
        finally:
            gui.stop()


def test_a_servers_thinking_shows_in_the_figures_and_is_not_kept():
    from miniapp.app.gui.controller import ChatSettings, stream_answer
    from miniapp.app.gui.history import SavedChat, SavedMessage
    from miniapp.app.host.model_host import ModelHost

    script = [
        chunk(reasoning="Colours: "),
        chunk(reasoning="red, blue."),
        chunk("Red, blue."),
        chunk(finish="stop"),
    ]
    with ScriptedServer(script) as scripted:
        settings = ChatSettings(model="", backend="openai", base_url=scripted.root + "/v1")
        chat = SavedChat.new()
        chat.messages.append(SavedMessage("user", MESSAGE))
        updates = list(stream_answer(ModelHost(), chat, settings, lambda: False))
    thinking = [u.figures for u in updates if u.figures.startswith("thinking… ")]
    assert thinking[-1] == "thinking… Colours: red, blue."
    assert updates[-1].finished and updates[-1].text == "Red, blue."
    assert [m.content for m in chat.messages] == [MESSAGE, "Red, blue."]
    # The server says no context length: the figures give what was used, and where.
    figures = updates[-1].figures
    assert f"{scripted.root}/v1 · context " in figures and "/" not in figures.split("context")[1]
