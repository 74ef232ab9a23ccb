"""The GUI on a server's model (--backend openai): a real `miniapp serve` on loopback, the GUI
pointed at it, driven by headless Chromium."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from test_gui import (
    ANSWER_S,
    MAX_TOKENS,
    MESSAGE,
    GuiServer,
    _send,
    _wait_for_text,
    _words,
    browser,  # noqa: F401 - the shared Chromium fixture
)
from test_serve import MODEL, running_server, wait_ready


@pytest.fixture(scope="module")
def api(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2") as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def remote_gui(miniapp_exe, api, tmp_path_factory):
    data = tmp_path_factory.mktemp("gui-remote")
    gui = GuiServer(miniapp_exe, data, "--backend", "openai", "--base-url", api + "/v1",
                    local=False).start()  # fmt: skip
    yield gui
    gui.stop()


def _open(browser, url: str, tmp_path):  # noqa: F811 - the fixture, passed in
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#message-box textarea", timeout=ANSWER_S * 1000)
    return page


def test_the_gui_streams_a_servers_answer(browser, remote_gui, api, miniapp_exe, tmp_path):  # noqa: F811
    page = _open(browser, remote_gui.url, tmp_path)
    try:
        _wait_for_text(page, "#model-status", f"{MODEL} on openai at {api}/v1")
        _send(page, MESSAGE)
        lengths = set()
        deadline = time.monotonic() + ANSWER_S
        while "tok/s" not in page.inner_text("#figures") and time.monotonic() < deadline:
            bubbles = page.locator("#chatbot .bot")
            if bubbles.count():
                lengths.add(len(bubbles.last.inner_text()))
            time.sleep(0.02)
        figures = page.inner_text("#figures")
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", figures) and f"{api}/v1" in figures
        assert len(lengths - {0}) >= 2, "the answer arrived in one piece, not streamed"
        answer = page.locator("#chatbot .bot").last.inner_text().strip()
        terminal = subprocess.run(
            [miniapp_exe, "chat", "--backend", "openai", "--base-url", api, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS)],
            input=MESSAGE, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert terminal.returncode == 0, terminal.stderr
        assert _words(answer) == _words(terminal.stdout)  # the same server, greedy
    finally:
        page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        page.close()


def test_an_unreachable_server_is_said_in_the_status_line(browser, miniapp_exe, tmp_path):  # noqa: F811
    gui = GuiServer(miniapp_exe, tmp_path, "--backend", "openai", "--base-url",
                    "http://127.0.0.1:9/v1", local=False).start()  # fmt: skip
    try:
        page = _open(browser, gui.url, tmp_path)
        _wait_for_text(page, "#model-status", "cannot reach the server at http://127.0.0.1:9/v1")
        _send(page, MESSAGE)
        _wait_for_text(page, "#notice", "cannot reach the server")
        page.close()
    finally:
        gui.stop()
