"""Hostile chat templates inside model files, through the terminal chat and the server: the
template's failure is one line for that turn or request, and the app goes on serving.
(tests/test_template_sandbox.py checks the sandbox itself, template by template.)"""

from __future__ import annotations

import time

import httpx
import openai
import pexpect
import pytest
from gguf import GGUFValueType
from test_bad_input import _assert_one_line_error, _run
from test_chat_terminal import PROMPT
from test_serve import running_server, wait_ready
from tiny_gguf import write_tiny_model

HOSTILE = {
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "is not allowed in a template"),
    "endless loop": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "it ran longer than 2 s",
    ),
    "huge string": ("{{ 'x' * 1000000000 }}", "built more than"),
}


def _hostile_model(tmp_path, kind: str):
    source = HOSTILE[kind][0]
    metadata = {"tokenizer.chat_template": (source, GGUFValueType.STRING)}
    return write_tiny_model(tmp_path / f"{kind.replace(' ', '-')}.gguf", metadata=metadata)


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_one_shot_chat_says_one_line_and_exits_2(miniapp_exe, tmp_path, kind):
    path = _hostile_model(tmp_path, kind)
    started = time.monotonic()
    done = _run(miniapp_exe, "chat", "--model", str(path), "--spec", "off", stdin="hello\n")
    assert time.monotonic() - started < 110  # a process start and a refusal, not a hang
    _assert_one_line_error(done, "chat template", HOSTILE[kind][1])


def test_the_terminal_chat_reports_each_turn_and_goes_on(miniapp_exe, tmp_path):
    path = _hostile_model(tmp_path, "endless loop")
    chat = pexpect.spawn(
        miniapp_exe,
        ["chat", "--model", str(path), "--spec", "off"],
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    try:
        chat.expect_exact(PROMPT)
        for text in ("hello", "hello again"):  # each turn is refused; the chat is still there
            chat.sendline(text)
            chat.expect(r"error: the model's chat template was stopped: it ran longer than 2 s")
            chat.expect_exact(PROMPT)
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0


@pytest.mark.parametrize("kind", ["escape", "endless loop"])
def test_the_server_answers_400_and_goes_on_serving(miniapp_exe, tmp_path, kind):
    path = _hostile_model(tmp_path, kind)
    with running_server(miniapp_exe, "--model", str(path), "--parallel", "2") as (proc, base):
        wait_ready(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert time.monotonic() - started < 30
        assert HOSTILE[kind][1] in refused.value.body["message"]
        # A raw completion needs no template: the same model still answers.
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert answer.choices[0].finish_reason == "length"
        assert httpx.get(base + "/health").status_code == 200
        assert proc.poll() is None
