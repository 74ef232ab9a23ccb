"""`--backend openai`: the terminal chat and the models list on a real `miniapp serve` (and on
llama.cpp's own server), through the official `openai` client, loopback only. What other
servers do differently comes from a scripted loopback server (scripted_server.py)."""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import openai
import pexpect
import pytest
from image_fixtures import text_image
from PIL import Image
from scripted_server import MODEL as SCRIPTED_MODEL
from scripted_server import ScriptedServer, chunk
from speech_synth import CLEAN_SENTENCES, require_tools, synthesize, wav
from test_serve import KEY, MODEL, running_server, wait_ready

QUESTION = "What is the capital of France?"
PROMPT = ">>> "


@pytest.fixture(scope="module")
def server(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "1", "--temperature", "0") as (_, base):
        wait_ready(base)
        yield base


def remote_chat(exe: str, base: str, *flags: str, text: str = QUESTION, timeout: float = 120):
    return subprocess.run(
        [exe, "chat", "--backend", "openai", "--base-url", base + "/v1", *flags],
        input=text + "\n",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The process failed with exit 2 and one line on stderr, which is returned."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miniapp: error: "), done.stderr
    return lines[0]


# ------------------------------------------------------------------ on `miniapp serve`


def test_a_piped_chat_on_the_server_answers_as_the_local_engine(miniapp_exe, server):
    flags = ("--temperature", "0", "--max-tokens", "24", "--system", "Answer briefly.")
    remote = remote_chat(miniapp_exe, server, *flags, "--stats")
    assert remote.returncode == 0, remote.stderr
    local = subprocess.run(
        [miniapp_exe, "chat", "--backend", "torch", "--ctx", "1024", "--spec", "off", *flags],
        input=QUESTION + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert local.returncode == 0, local.stderr
    # Greedy on the same engine and model: the messages reached the server intact.
    assert remote.stdout.strip() and remote.stdout == local.stdout
    stats = re.search(
        r"openai: prompt (\d+) tok .* generated (\d+) tok at ([\d.]+) tok/s", remote.stderr
    )
    assert stats, remote.stderr
    assert int(stats[1]) > 10 and 0 < int(stats[2]) <= 24 and float(stats[3]) > 0


def test_the_models_list_is_the_servers(miniapp_exe, server):
    done = subprocess.run(
        [miniapp_exe, "models", "list", "--base-url", server],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"server: {server}/v1" in done.stdout
    assert re.search(rf"^{MODEL}\s+1024\s+miniapp", done.stdout, re.M), done.stdout


def _spawn(exe: str, base: str, *flags: str) -> pexpect.spawn:
    child = pexpect.spawn(
        exe,
        [
            "chat",
            "--backend",
            "openai",
            "--base-url",
            base,
            "--stats",
            "--temperature",
            "0",
            *flags,
        ],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def _prompt_tokens(child: pexpect.spawn) -> int:
    child.expect(r"openai: prompt (\d+) tok")
    tokens = int(child.match[1])
    child.expect_exact(PROMPT)
    return tokens


def test_a_multi_turn_terminal_chat_sends_the_history(miniapp_exe, server):
    chat = _spawn(miniapp_exe, server, "--max-tokens", "16")
    try:
        chat.sendline("My name is Ada.")
        first = _prompt_tokens(chat)
        chat.sendline("What is my name?")
        second = _prompt_tokens(chat)
        assert second > first + 8  # the first turn and its answer went along
        chat.sendline("/reset")
        chat.expect_exact("(new conversation)")
        chat.sendline("What is my name?")
        assert _prompt_tokens(chat) < second  # history gone
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0


def _cancelled(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    found = re.search(
        r'^miniapp_requests_finished_total\{finish_reason="cancelled"\} (\S+)', text, re.M
    )
    return float(found[1])


def test_ctrl_c_stops_the_answer_and_the_server_sees_the_client_go(miniapp_exe, server):
    before = _cancelled(server)
    chat = _spawn(miniapp_exe, server, "--max-tokens", "300")
    try:
        chat.sendline("Write a very long story about a dragon, with many chapters.")
        chat.expect_exact("many chapters.")
        chat.expect(r"\w+ \w+ \w+")  # streaming
        chat.kill(signal.SIGINT)
        chat.expect_exact("(stopped)")
        chat.expect_exact(PROMPT)
        deadline = time.monotonic() + 10
        while _cancelled(server) <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cancelled(server) == before + 1
        chat.sendline("Say yes.")  # the chat goes on
        chat.expect(r"openai: prompt \d+ tok")
        chat.expect_exact(PROMPT)
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)


# ------------------------------------------------------------------ failures, one line each


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_is_one_line(miniapp_exe):
    line = one_error_line(remote_chat(miniapp_exe, f"http://127.0.0.1:{_closed_port()}"))
    assert "cannot reach the server" in line and "refused" in line.lower()


@pytest.fixture(scope="module")
def keyed(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "1", "--api-key", KEY) as (_, base):
        wait_ready(base)
        yield base


def test_a_wrong_key_is_one_line_and_the_right_one_answers(miniapp_exe, keyed):
    line = one_error_line(remote_chat(miniapp_exe, keyed, "--api-key", "wrong"))
    assert "refused the API key (401" in line
    done = remote_chat(miniapp_exe, keyed, "--api-key", KEY, "--max-tokens", "4")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_an_unknown_model_is_one_line(miniapp_exe, server):
    line = one_error_line(remote_chat(miniapp_exe, server, "--remote-model", "no-such-model"))
    assert "has no model 'no-such-model'" in line and MODEL in line


def test_local_only_options_are_refused_in_one_line(miniapp_exe, server):
    asked = ["--window", "64", "--spec", "lookup", "--device", "cpu", "--kv-type", "q8"]
    line = one_error_line(remote_chat(miniapp_exe, server, *asked))
    assert "local backends only" in line
    assert all(flag in line for flag in ("--window", "--spec lookup", "--device cpu", "--kv-type"))
    line = one_error_line(
        subprocess.run(
            [miniapp_exe, "chat", "--backend", "openai"],
            input="hi\n",
            capture_output=True,
            text=True,
        )
    )
    assert "needs --base-url" in line


def test_a_stream_cut_off_midway_is_one_line_and_the_text_so_far_is_printed(miniapp_exe):
    script = [chunk("The answer "), chunk("begins")]
    with ScriptedServer(script, drop=True) as scripted:
        done = remote_chat(miniapp_exe, scripted.root)
    line = one_error_line(done)
    assert "broke off the answer midway" in line
    assert done.stdout.startswith("The answer begins")


# ------------------------------------------------------------------ what servers do differently


def test_what_other_servers_send_is_read_and_only_set_fields_are_sent(miniapp_exe):
    script = [
        chunk(choices=False),  # a keep-alive with no choices
        chunk(reasoning="The user wants "),
        chunk(reasoning="a greeting."),
        chunk(content=""),
        chunk("Hello"),
        chunk(", world"),
        # A call the server's model streams unasked: not part of the text, and no failure.
        chunk(
            tool_call={
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": ""},
            }
        ),
        chunk(tool_call={"index": 0, "function": {"arguments": "{}"}}),
        chunk(finish="tool_calls"),
    ]
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    with ScriptedServer(script, usage=usage) as scripted:
        done = remote_chat(
            miniapp_exe, scripted.root, "--stats", "--max-tokens", "30", "--top-k", "5"
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "Hello, world\n"  # the thinking is not part of the answer
        assert "(thinking) The user wants a greeting." in done.stderr
        assert "prompt 12 tok" in done.stderr and "generated 3 tok" in done.stderr
        sent = scripted.requests[0]
    assert sent["model"] == SCRIPTED_MODEL and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": QUESTION}]
    assert sent["max_tokens"] == 30 and sent["top_k"] == 5
    # Settings left at their defaults are the server's to choose: not sent.
    assert not {"temperature", "top_p", "min_p", "seed", "repeat_penalty"} & set(sent)


def test_done_before_a_finish_reason_ends_the_answer_normally(miniapp_exe):
    with ScriptedServer([chunk("Short.")]) as scripted:
        done = remote_chat(miniapp_exe, scripted.root)
    assert done.returncode == 0 and done.stdout == "Short.\n", done.stderr
    with ScriptedServer([chunk('{"a": 1}')]) as scripted:
        done = remote_chat(miniapp_exe, scripted.root, "--json")
        sent = scripted.requests[0]
    assert done.returncode == 0 and done.stdout == '{"a": 1}\n', done.stderr
    assert sent["response_format"] == {"type": "json_object"}


# ------------------------------------------------------------------ llama.cpp's own server


def _free_port() -> int:
    return _closed_port()


@contextmanager
def llama_cpp_server(model_path, log_path):
    """llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`); its
    verbose log goes to a file (a pipe nobody reads would fill and stop it)."""
    port = _free_port()
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "1024",
            "--model_alias",
            MODEL,
        ],
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                if httpx.get(base + "/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server never answered"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def test_a_piped_chat_on_llama_cpps_own_server(miniapp_exe, default_model, tmp_path):
    with llama_cpp_server(default_model, tmp_path / "server.log") as base:
        done = remote_chat(miniapp_exe, base, "--temperature", "0", "--max-tokens", "24", "--stats")
        # The same request straight from the official client: greedy on the same server, so
        # the same answer. (Its wording differs between CPUs: on one it never says "Paris"
        # within 24 tokens.)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        direct = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=24,
        )
    assert done.returncode == 0, done.stderr
    answer = direct.choices[0].message.content.strip()
    assert answer and done.stdout.strip() == answer, (done.stdout, answer)
    # It sends no usage chunk: the pieces streamed are counted instead.
    assert re.search(r"generated (\d+) tok at [\d.]+ tok/s", done.stderr), done.stderr


# ------------------------------------------------------------------ bench


def test_bench_compares_the_server_with_the_engine_in_process(miniapp_exe, server):
    done = subprocess.run(
        [
            miniapp_exe,
            "bench",
            "--backend",
            "openai",
            "--base-url",
            server,
            "--tokens",
            "12",
            "--repeat",
            "1",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["remote_model"] == MODEL and report["answers"] == 8
    for side in ("local", "remote"):
        assert report[side]["decode_tok_s"] > 0 and report[side]["ttft_ms"] > 0
    assert 0 < report["decode_ratio"] < 10 and report["identical_answers"] >= 1


# ------------------------------------------------------------------ images


@pytest.fixture(scope="module")
def receipt(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote-images") / "receipt.png"
    text_image(["TOTAL 42.50"]).save(path)
    return path


def test_an_image_goes_as_a_picture_where_the_servers_model_takes_them(miniapp_exe, receipt):
    with ScriptedServer([chunk("A receipt."), chunk(finish="stop")], vision=True) as scripted:
        done = remote_chat(miniapp_exe, scripted.root, "--image", str(receipt))
        sent = scripted.requests[0]
    assert done.returncode == 0 and done.stdout == "A receipt.\n", done.stderr
    picture, text = sent["messages"][0]["content"]
    assert picture["type"] == "image_url"
    assert picture["image_url"]["url"].startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(picture["image_url"]["url"].split(",")[1])))
    assert text == {"type": "text", "text": QUESTION}


def test_an_image_is_read_here_by_ocr_where_the_server_does_not_say(miniapp_exe, receipt):
    with ScriptedServer([chunk("42.50"), chunk(finish="stop")]) as scripted:
        done = remote_chat(miniapp_exe, scripted.root, "--image", str(receipt))
        sent = scripted.requests[0]
    assert done.returncode == 0, done.stderr
    assert "read by OCR" in done.stderr
    content = sent["messages"][0]["content"]
    assert isinstance(content, str) and "TOTAL 42.50" in content and QUESTION in content


# ------------------------------------------------------------------ voice


def test_voice_is_transcribed_here_and_its_text_goes_to_the_server(miniapp_exe, tmp_path):
    require_tools()
    sentence = CLEAN_SENTENCES[6]
    path = wav(tmp_path / "question.wav", synthesize(sentence, seed=6))
    with ScriptedServer([chunk("Heard."), chunk(finish="stop")]) as scripted:
        done = subprocess.run(
            [
                miniapp_exe,
                "chat",
                "--backend",
                "openai",
                "--base-url",
                scripted.root,
                "--audio",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )
        sent = scripted.requests[0]
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("you said: ") and done.stdout.endswith("Heard.\n")
    spoken = done.stdout.splitlines()[0].removeprefix("you said: ")
    assert sent["messages"] == [{"role": "user", "content": spoken}]
    said = set(_words(sentence))
    assert len(set(_words(spoken)) & said) >= 0.8 * len(said), (spoken, sentence)
