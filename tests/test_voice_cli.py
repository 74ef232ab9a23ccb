"""`miniapp transcribe` and the chat's voice input, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pexpect
import pytest
from speech_synth import CLEAN_SENTENCES, long_recording, require_tools, synthesize, wav

from miniapp.engine.voice.metrics import word_error_rate

PROMPT = ">>> "
LONG_SILENCE_S = 3600  # an hour: decoded whole, it alone would take 230 MB as float32
# Peak memory may grow this much over a short file's: a window and a block, not the file.
BOUNDED_GROWTH_MB = 100


@pytest.fixture(scope="module")
def sentence_wav(tmp_path_factory):
    require_tools()
    speech = synthesize(CLEAN_SENTENCES[6], seed=6)
    return speech, wav(tmp_path_factory.mktemp("voice") / "sentence.wav", speech)


def _run(exe, *args, stdin: str = "", timeout: int = 180):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize("stream", [False, True])
def test_transcribe_json(miniapp_exe, sentence_wav, stream):
    speech, path = sentence_wav
    done = _run(miniapp_exe, "transcribe", str(path), "--json", *(["--stream"] if stream else []))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert word_error_rate(speech.text, result["text"]) == 0, result["text"]
    words = result["words"]
    assert set(words[0]) == {"word", "start", "end", "committed_at"}
    assert abs(words[0]["start"] - speech.words[0].start) < 0.08
    for word in words:
        if stream:
            assert word["committed_at"] > word["end"]
        else:
            assert word["committed_at"] is None


def test_transcribe_subtitles_and_plain_text(miniapp_exe, sentence_wav):
    speech, path = sentence_wav
    srt = _run(miniapp_exe, "transcribe", str(path), "--srt")
    assert srt.returncode == 0 and srt.stdout.startswith("1\n00:00:00,400 --> ")
    vtt = _run(miniapp_exe, "transcribe", str(path), "--vtt", "--stream")
    assert vtt.returncode == 0 and vtt.stdout.startswith("WEBVTT\n\n00:00:00.400 --> ")
    plain = _run(miniapp_exe, "transcribe", str(path))
    assert word_error_rate(speech.text, plain.stdout) == 0, plain.stdout


def test_bad_audio_files_are_one_line_errors(miniapp_exe, tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio\n")
    empty = tmp_path / "empty.mp3"
    empty.write_bytes(b"")
    for path, cause in (
        (tmp_path / "absent.wav", "file not found"),
        (text, "not an audio file"),
        (empty, "not an audio file"),
        (tmp_path, "is a folder"),
    ):
        done = _run(miniapp_exe, "transcribe", str(path))
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and cause in lines[0], done.stderr
    bad_model = _run(miniapp_exe, "transcribe", str(text), "--asr-model", str(tmp_path))
    assert bad_model.returncode == 2


def test_long_file_in_bounded_memory(miniapp_exe, sentence_wav, tmp_path):
    speech, path = sentence_wav
    _, short = _transcribe_measured(miniapp_exe, path)
    recording = long_recording(tmp_path / "long.flac", speech, LONG_SILENCE_S, tmp_path)
    output, long = _transcribe_measured(miniapp_exe, recording)
    assert long - short < BOUNDED_GROWTH_MB, (short, long)
    words = json.loads(output)["words"]
    # The sentence, an hour of silence (no words), the sentence again an hour later.
    n = len(speech.words)
    assert len(words) == 2 * n, [w["word"] for w in words]
    second_start = speech.duration + LONG_SILENCE_S + speech.words[0].start
    assert abs(words[n]["start"] - second_start) < 0.08


def _transcribe_measured(exe, path) -> tuple[str, float]:
    """`miniapp transcribe PATH --json`'s output and peak RSS in MB, run from a fresh child
    so that no other process's peak is counted (ru_maxrss is in KiB on Linux)."""
    code = (
        "import json, resource, subprocess, sys; "
        "done = subprocess.run(sys.argv[1:], check=True, capture_output=True, text=True); "
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
        "print(json.dumps({'out': done.stdout, 'peak_kib': peak}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, exe, "transcribe", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    return result["out"], result["peak_kib"] / 1024


def test_chat_audio_sends_the_transcript(miniapp_exe, sentence_wav):
    speech, path = sentence_wav
    done = _run(
        miniapp_exe, "chat", "--audio", str(path), "--temperature", "0", "--max-tokens", "16"
    )
    assert done.returncode == 0, done.stderr
    first, _, answer = done.stdout.partition("\n")
    assert first.startswith("you said: ")
    assert word_error_rate(speech.text, first.removeprefix("you said: ")) == 0
    assert answer.strip()


def test_chat_audio_with_silence_or_a_bad_file_is_an_error(miniapp_exe, tmp_path):
    silent = wav(tmp_path / "silent.wav", __import__("numpy").zeros(32000, "float32"))
    done = _run(miniapp_exe, "chat", "--audio", str(silent))
    assert done.returncode == 2 and "no speech found" in done.stderr
    done = _run(miniapp_exe, "chat", "--audio", str(tmp_path / "absent.ogg"))
    assert done.returncode == 2 and "file not found" in done.stderr


def test_chat_voice_without_a_microphone_goes_on_by_text(miniapp_exe):
    # This machine has no microphone; the env var makes sure of it on any machine.
    env = {**os.environ, "MINIAPP_AUDIO_INPUT": "none"}
    child = pexpect.spawn(
        miniapp_exe,
        ["chat", "--voice", "--temperature", "0", "--max-tokens", "12"],
        encoding="utf-8",
        timeout=120,
        env=env,
    )
    try:
        child.expect_exact(PROMPT)
        assert "no audio input device" in child.before
        assert "Type your messages instead" in child.before
        child.sendline("")  # Enter would start recording; without a device it does nothing
        child.expect_exact(PROMPT)
        child.sendline("Say hello.")
        child.expect_exact(PROMPT)
        assert len(child.before.strip()) > len("Say hello.")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_eval_asr_reports_every_measure(miniapp_exe):
    require_tools()
    done = _run(miniapp_exe, "eval", "asr", "--sentences", "1", "--no-answer", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for mode in ("offline", "stream"):
        scores = result[mode]
        assert scores["wer"] == 0
        assert scores["start_mae_s"] < scores["raw_start_mae_s"]
        assert 0 < scores["rtf"] < 1
    assert result["stream"]["median_commit_latency_s"] > 0
