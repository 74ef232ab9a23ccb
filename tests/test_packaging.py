"""The PyInstaller build (slow: several minutes). `make test` skips it; run it with
`make package-test`, which builds dist/miniapp/ and then runs this."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILT = REPO / "dist" / "miniapp" / "miniapp"


@pytest.mark.package
def test_the_built_app_reports_its_version_and_chats():
    assert BUILT.exists(), "build it first: make package"
    version = subprocess.run([str(BUILT), "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("miniapp ")
    chat = subprocess.run(
        [str(BUILT), "chat", "--temperature", "0", "--max-tokens", "16", "--threads", "2"],
        input="Name three colours.",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert len(chat.stdout.split()) >= 3


@pytest.mark.package
def test_the_built_app_gives_one_line_errors():
    done = subprocess.run(
        [str(BUILT), "chat", "--model", "/nonexistent.gguf"],
        input="hi",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1


@pytest.mark.package
def test_the_built_app_serves_the_gui(tmp_path):
    import os
    import urllib.request

    env = {**os.environ, "MINIAPP_DATA_DIR": str(tmp_path)}
    command = [str(BUILT), "gui", "--no-browser", "--port", "7871"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("miniapp GUI: "), line
        with urllib.request.urlopen(line.split(": ", 1)[1].strip(), timeout=30) as page:
            assert page.status == 200 and b"miniapp" in page.read()
    finally:
        server.terminate()
        server.wait(timeout=30)
