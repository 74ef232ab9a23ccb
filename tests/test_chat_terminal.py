"""`miniapp chat` driven through a real pseudo-terminal and through a pipe."""

from __future__ import annotations

import signal
import subprocess
import time

import pexpect
import pytest

PROMPT = ">>> "


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_piped_input_prints_one_answer_and_exits_zero(miniapp_exe, backend):
    done = subprocess.run(
        [miniapp_exe, "chat", "--backend", backend, "--temperature", "0", "--max-tokens", "24"],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer = done.stdout.strip()
    assert answer and PROMPT not in done.stdout
    assert "Traceback" not in done.stderr


def test_empty_pipe_is_an_error(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "chat"], input="", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "no input" in done.stderr


def _spawn_chat(miniapp_exe, max_tokens: int):
    child = pexpect.spawn(
        miniapp_exe,
        ["chat", "--temperature", "0", "--max-tokens", str(max_tokens)],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def _running_chat(miniapp_exe, max_tokens: int):
    child = _spawn_chat(miniapp_exe, max_tokens=max_tokens)
    yield child
    if child.isalive():
        child.terminate(force=True)


@pytest.fixture
def chat(miniapp_exe):
    yield from _running_chat(miniapp_exe, max_tokens=48)  # short answers keep the test quick


@pytest.fixture
def long_chat(miniapp_exe):
    yield from _running_chat(miniapp_exe, max_tokens=2000)  # long enough to interrupt


def _ask(child, text: str) -> str:
    child.sendline(text)
    child.expect_exact(PROMPT)
    return child.before


def test_multi_turn_stats_reset_and_exit(chat):
    first = _ask(chat, "My name is Ada. Say hello to me.")
    assert len(first.strip()) > len("My name is Ada. Say hello to me.")
    stats = _ask(chat, "/stats")
    assert "tok/s" in stats and "prompt" in stats
    # Second turn: the first turn's tokens are reused from the cache.
    _ask(chat, "What is my name?")
    stats = _ask(chat, "/stats")
    cached = int(stats.split("(")[1].split(" cached")[0])
    assert cached > 20, stats
    assert "new conversation" in _ask(chat, "/reset")
    _ask(chat, "Hi")
    stats = _ask(chat, "/stats")
    assert "(0 cached)" in stats or int(stats.split("(")[1].split(" cached")[0]) < cached
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_model_lists_the_installed_models_and_switches_as_the_gui_picker_does(chat, miniapp_exe):
    listing = _ask(chat, "/model")
    assert "* smollm2-135m-instruct" in listing and "  gemma3-270m" in listing
    assert "error: no installed model is named 'nope'" in _ask(chat, "/model nope")
    assert "now answering with gemma3-270m" in _ask(chat, "/model gemma3-270m")
    question = "What is the capital of France?"
    answered = _ask(chat, question).replace("\r", "").split("\n", 1)[1].strip()
    alone = subprocess.run(
        [miniapp_exe, "chat", "--model", "gemma3-270m", "--temperature", "0"]
        + ["--max-tokens", "48"],
        input=question + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0, alone.stderr
    assert answered == alone.stdout.strip()
    assert "* gemma3-270m" in _ask(chat, "/model")


def test_ctrl_c_stops_the_answer_not_the_app(long_chat):
    chat = long_chat
    chat.sendline("Write a very long story about a dragon, with many chapters.")
    chat.expect_exact("many chapters.")  # the terminal's echo of the question
    chat.expect(r"\w+ \w+ \w+")  # the answer is streaming
    time.sleep(0.3)
    chat.kill(signal.SIGINT)
    chat.expect_exact("(stopped)")
    chat.expect_exact(PROMPT)
    # The app is still alive: it answers a command about the answer it just cut short.
    stats = _ask(chat, "/stats")
    assert "generated" in stats and "tok/s" in stats
    generated = int(stats.split("generated ")[1].split(" tok")[0])
    assert 3 <= generated < 2000
    # Ctrl-C at an empty prompt does not quit either (given a moment to be at the prompt).
    time.sleep(0.5)
    chat.kill(signal.SIGINT)
    chat.expect_exact("/exit")
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


LOCATION = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


def _piped_chat(miniapp_exe, *flags: str, asked: str = "Where is the Eiffel Tower?\n"):
    return subprocess.run(
        [miniapp_exe, "chat", "--temperature", "0", *flags],
        input=asked,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_json_schema_prints_exactly_the_value_for_scripts(miniapp_exe, tmp_path):
    import json

    import jsonschema

    schema = tmp_path / "location.json"
    schema.write_text(json.dumps(LOCATION))
    done = _piped_chat(miniapp_exe, "--json-schema", str(schema))
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), LOCATION)  # nothing but the value
    assert done.stdout == done.stdout.strip() + "\n"


@pytest.mark.parametrize(
    ("schema_text", "named"),
    [(None, "cannot read the schema"), ("{oops", "not JSON"), ('{"type": "strng"}', "strng")],
)
def test_a_bad_schema_file_is_one_line_and_exit_2(miniapp_exe, tmp_path, schema_text, named):
    path = tmp_path / "schema.json"
    if schema_text is not None:
        path.write_text(schema_text)
    done = _piped_chat(miniapp_exe, "--json-schema", str(path))
    assert done.returncode == 2 and named in done.stderr and str(path) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


def test_json_cut_short_by_max_tokens_is_an_error_not_half_a_value(miniapp_exe, tmp_path):
    import json

    # Steering near the budget cannot fit both required keys into 4 tokens.
    schema = tmp_path / "location.json"
    schema.write_text(json.dumps(LOCATION))
    done = _piped_chat(miniapp_exe, "--json-schema", str(schema), "--max-tokens", "4")
    assert done.returncode == 2 and "--max-tokens" in done.stderr and not done.stdout
