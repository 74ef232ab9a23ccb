"""`POST /v1/audio/transcriptions` of `miniapp serve`, through real clients (the official
`openai` package, and httpx for the raw event stream and error bodies) against a real server
process on a loopback port, transcribing espeak-ng speech whose word boundaries are known."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from speech_synth import CLEAN_SENTENCES, require_tools, synthesize, wav
from test_serve import running_server, wait_ready

from miniapp.engine.voice.metrics import normalized_words, word_error_rate

# test_voice.py's tolerances: each word's edges, and their mean error.
WORD_EDGE_TOLERANCE_S = 0.1
BOUNDARY_MAE_TARGET_S = 0.080
SEGMENT_FIELDS = {
    "id",
    "seek",
    "start",
    "end",
    "text",
    "tokens",
    "temperature",
    "avg_logprob",
    "compression_ratio",
    "no_speech_prob",
}
SRT_CUE = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})\n(.+)")
VTT_CUE = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d{3}) --> (\d\d):(\d\d):(\d\d)\.(\d{3})\n(.+)")


@pytest.fixture(scope="module")
def sentence(tmp_path_factory):
    """(the speech with its true word boundaries, its WAV file's bytes)."""
    require_tools()
    speech = synthesize(CLEAN_SENTENCES[6], seed=6)
    path = wav(tmp_path_factory.mktemp("serve-audio") / "sentence.wav", speech)
    return speech, path.read_bytes()


@pytest.fixture(scope="module")
def server(miniapp_exe):
    # Transcription does not use the chat model; llama.cpp only makes it ready sooner.
    with running_server(miniapp_exe, "--backend", "llamacpp") as (proc, base):
        wait_ready(base)
        yield proc, base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def transcribe(client, sentence, model: str = "whisper-1", **options):
    _, audio = sentence
    return client.audio.transcriptions.create(
        model=model, file=("sentence.wav", audio, "audio/wav"), **options
    )


def post(base: str, files, **fields) -> httpx.Response:
    return httpx.post(base + "/v1/audio/transcriptions", files=files, data=fields, timeout=60)


def assert_on_the_true_boundaries(words: list[dict], speech) -> None:
    spoken = [normalized_words(w["word"])[0] for w in words]
    assert spoken == normalized_words(speech.text), spoken
    errors = []
    for word, truth in zip(words, speech.words, strict=True):
        for got, true in ((word["start"], truth.start), (word["end"], truth.end)):
            assert abs(got - true) < WORD_EDGE_TOLERANCE_S, (word, truth)
            errors.append(abs(got - true))
    assert np.mean(errors) <= BOUNDARY_MAE_TARGET_S, errors


def assert_error(response: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code, error
    assert error["message"] and "\n" not in error["message"]


# ------------------------------------------------------------------ formats


def test_json_and_plain_text(client, sentence):
    speech, _ = sentence
    result = transcribe(client, sentence, language="en", temperature=0)
    assert word_error_rate(speech.text, result.text) == 0, result.text
    assert result.usage.type == "duration" and result.usage.seconds == np.ceil(speech.duration)
    # Two at once: the server runs them one after the other, each gets its own transcript.
    with ThreadPoolExecutor(2) as pool:
        plain = list(
            pool.map(lambda _: transcribe(client, sentence, response_format="text"), range(2))
        )
    for text in plain:
        assert isinstance(text, str) and text.endswith("\n") and not text.startswith("{")
        assert text.strip() == result.text
    # The recogniser's own name works as well as whisper-1; a prompt is taken.
    prompted = transcribe(client, sentence, model="whisper-tiny.en", prompt="Keys, a table.")
    assert word_error_rate(speech.text, prompted.text) == 0, prompted.text


def test_verbose_json_words_on_the_true_boundaries_and_segments(client, sentence):
    speech, _ = sentence
    both = transcribe(
        client,
        sentence,
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert both.task == "transcribe" and both.language == "english"
    assert abs(both.duration - speech.duration) < 0.01
    assert word_error_rate(speech.text, both.text) == 0, both.text
    assert_on_the_true_boundaries([w.model_dump() for w in both.words], speech)
    segments = [s.model_dump() for s in both.segments]
    assert segments and all(set(s) == SEGMENT_FIELDS for s in segments), segments
    assert "".join(s["text"] for s in segments).strip() == both.text
    assert segments[0]["start"] == both.words[0].start
    assert segments[-1]["end"] == both.words[-1].end
    for segment in segments:
        assert segment["tokens"] and segment["temperature"] == 0.0
        assert segment["avg_logprob"] < 0 and 0 <= segment["no_speech_prob"] <= 1

    by_default = transcribe(client, sentence, response_format="verbose_json")
    assert by_default.segments and by_default.words is None
    words_only = transcribe(
        client, sentence, response_format="verbose_json", timestamp_granularities=["word"]
    )
    assert words_only.words and words_only.segments is None


def test_srt_and_vtt_parse(client, sentence):
    speech, _ = sentence
    for form, pattern, header in (("srt", SRT_CUE, ""), ("vtt", VTT_CUE, "WEBVTT\n\n")):
        subtitles = transcribe(client, sentence, response_format=form)
        assert subtitles.startswith(header), subtitles
        blocks = subtitles.removeprefix(header).strip().split("\n\n")
        cues = [pattern.fullmatch(block) for block in blocks]
        assert all(cues), subtitles
        if form == "srt":
            assert [int(c.group(1)) for c in cues] == list(range(1, len(cues) + 1))
        times = [_seconds(c.groups()[-9:-1]) for c in cues]
        assert abs(times[0][0] - speech.words[0].start) < WORD_EDGE_TOLERANCE_S
        assert abs(times[-1][1] - speech.words[-1].end) < WORD_EDGE_TOLERANCE_S
        text = " ".join(c.group(c.lastindex) for c in cues)
        assert word_error_rate(speech.text, text) == 0, text


def _seconds(fields: tuple[str, ...]) -> tuple[float, float]:
    h, m, s, ms, h2, m2, s2, ms2 = (int(f) for f in fields)
    return h * 3600 + m * 60 + s + ms / 1000, h2 * 3600 + m2 * 60 + s2 + ms2 / 1000


# ------------------------------------------------------------------ streaming


def test_stream_sends_committed_words_as_openai_events(server, client, sentence):
    _, base = server
    speech, audio = sentence
    files = {"file": ("sentence.wav", audio, "audio/wav")}
    fields = {"model": "whisper-1", "stream": "true"}
    url = base + "/v1/audio/transcriptions"
    with httpx.stream("POST", url, files=files, data=fields, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    *deltas, done = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(deltas) > 1 and all(e["type"] == "transcript.text.delta" for e in deltas)
    assert done["type"] == "transcript.text.done"
    assert "".join(e["delta"] for e in deltas) == done["text"]
    assert word_error_rate(speech.text, done["text"]) == 0, done["text"]
    # The words and their times come from the streaming path's stream clock.
    assert_on_the_true_boundaries([w for e in deltas for w in e["words"]], speech)

    events = list(transcribe(client, sentence, stream=True))
    assert [type(e).__name__ for e in events[-2:]] == [
        "TranscriptionTextDeltaEvent",
        "TranscriptionTextDoneEvent",
    ]
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == done["text"]


def test_a_stream_can_ask_for_partial_text(server, client, sentence):
    _, base = server
    speech, audio = sentence
    files = {"file": ("sentence.wav", audio, "audio/wav")}
    fields = {"model": "whisper-1", "stream": "true", "include[]": "partials"}
    url = base + "/v1/audio/transcriptions"
    with httpx.stream("POST", url, files=files, data=fields, timeout=60) as response:
        assert response.status_code == 200
        events = [
            json.loads(line.removeprefix("data: "))
            for line in response.iter_lines()
            if line and line != "data: [DONE]"
        ]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "transcript.text.done" and "transcript.text.partial" in kinds
    # A word shows as partial text before it is committed: the first partial comes before
    # the first delta, and every committed word was shown in some partial first.
    assert kinds.index("transcript.text.partial") < kinds.index("transcript.text.delta")
    partial_words = {
        normalized_words(w["word"])[0]
        for e in events
        if e["type"] == "transcript.text.partial"
        for w in e["words"]
    }
    committed = normalized_words(events[-1]["text"])
    assert sum(w in partial_words for w in committed) >= 0.8 * len(committed), partial_words
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert "".join(deltas) == events[-1]["text"]
    assert word_error_rate(speech.text, events[-1]["text"]) == 0

    # The official client passes the extension through and still ends on the done event.
    streamed = list(transcribe(client, sentence, stream=True, include=["partials"]))
    assert streamed[-1].type == "transcript.text.done"
    assert any(e.type == "transcript.text.partial" for e in streamed)
    # Partial text is a streaming feature; OpenAI's own include (logprobs) is not done here.
    for extra, param in (
        ({"include[]": "partials"}, "include[]"),
        ({"include[]": "logprobs", "stream": "true"}, "include[]"),
    ):
        response = post(base, {"file": ("sentence.wav", audio)}, model="whisper-1", **extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


# ------------------------------------------------------------------ bad requests


def test_bad_audio_is_a_400_and_the_server_goes_on(server, tmp_path):
    proc, base = server
    silent = wav(tmp_path / "silent.wav", np.zeros(32000, dtype=np.float32)).read_bytes()
    for name, content, code in (
        ("notes.wav", b"this is not audio\n" * 50, "invalid_file"),
        ("empty.mp3", b"", "invalid_file"),
        ("silent.wav", silent, "no_speech"),
    ):
        for stream in ("false", "true"):
            response = post(base, {"file": (name, content)}, model="whisper-1", stream=stream)
            assert_error(response, 400, "file", code)
            assert response.json()["error"]["message"].startswith(name)
    no_file = post(base, [("model", (None, "whisper-1"))])  # multipart, without a file
    assert_error(no_file, 400, "file", "missing_required_parameter")
    assert proc.poll() is None and httpx.get(base + "/health").status_code == 200


def test_unknown_model_is_404_and_unsupported_options_are_400(server, client, sentence):
    _, base = server
    with pytest.raises(openai.NotFoundError) as not_found:
        client.audio.transcriptions.create(model="whisper-9", file=("a.wav", sentence[1]))
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    files = {"file": ("sentence.wav", sentence[1])}
    assert_error(post(base, files, model="whisper-9"), 404, "model", "model_not_found")
    for fields, param in (
        ({"temperature": "0.4"}, "temperature"),
        ({"language": "fr"}, "language"),
        ({"response_format": "srt", "stream": "true"}, "response_format"),
        (
            {"response_format": "json", "timestamp_granularities[]": "word"},
            "timestamp_granularities[]",
        ),
        ({"chunking_strategy": "auto"}, "chunking_strategy"),
    ):
        response = post(base, files, model="whisper-1", **fields)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
