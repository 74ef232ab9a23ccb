"""The wide evaluation set (issue 26): connected speech from libespeak-ng with its word
events as the truth, phrases with pauses, pink noise mixed by sox, scores that spell numbers
out, and the streaming policy measured on it with the real tiny.en."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from latency_budget import COMMIT_HYPOTHESES, PARTIAL_HYPOTHESES, latency_budget
from speech_synth import require_tools

from miniapp.engine.evaluation.asr_benchmark import AsrBenchmark, load_clips
from miniapp.engine.voice.asr import load_asr
from miniapp.engine.voice.audio import SAMPLE_RATE
from miniapp.engine.voice.boundaries import speech_regions
from miniapp.engine.voice.espeak import speak
from miniapp.engine.voice.events import Word
from miniapp.engine.voice.metrics import matched_words, normalized_words, word_error_rate
from miniapp.engine.voice.wide_set import WIDE_SENTENCES, add_noise, wide_set


@pytest.fixture(scope="module")
def asr():
    require_tools()
    return load_asr(threads=2)


def test_numbers_are_compared_as_words():
    assert normalized_words("At 12:30, 42 bags and 3.5 kg.") == [
        "at",
        "twelve",
        "thirty",
        "forty",
        "two",
        "bags",
        "and",
        "three",
        "point",
        "five",
        "kg",
    ]
    assert (
        word_error_rate("We need 24 chairs, 6 tables.", "we need twenty-four chairs six tables")
        == 0
    )
    assert word_error_rate("Call Priya at 7.", "Call 3 at 7") == 0.25


def test_words_are_matched_by_the_alignment_of_least_edits():
    def words(text: str) -> list[Word]:
        return [Word(w, i, i + 0.5) for i, w in enumerate(text.split())]

    truth = words("a cat sat on the mat today")
    pairs = matched_words(words("the cat sat on a mat"), truth)
    assert [(w.word, i) for w, i in pairs] == [("cat", 1), ("sat", 2), ("on", 3), ("mat", 5)]
    assert matched_words(words("forty-two"), words("42")) == [(Word("forty-two", 0, 0.5), 0)]


def test_connected_speech_has_a_time_for_every_word():
    text = "Stop. Go now, said Maria, with 42 bags in the car."
    spoken = speak(text, "en-us", 175)
    assert [w.word for w in spoken.words] == text.split()
    for before, after in zip(spoken.words, spoken.words[1:], strict=False):
        assert before.start < before.end <= after.start < after.end, (before, after)
    # espeak says "42" as two words and "in the" as one: the first stays one exact word, the
    # second two inexact ones.
    exact = dict(zip(text.split(), spoken.exact, strict=True))
    assert exact["42"] and exact["Maria,"] and not exact["in"] and not exact["the"]
    # Where espeak pauses (after "Stop."), the words end and start at the sound's edges.
    regions = speech_regions(spoken.audio)
    stop, go = spoken.words[0], spoken.words[1]
    assert any(abs(r.end - stop.end) < 0.02 for r in regions), (stop, regions)
    assert any(abs(r.start - go.start) < 0.02 for r in regions), (go, regions)
    assert go.start - stop.end > 0.1


def test_the_set_covers_its_conditions():
    lengths = [len(t.split()) for t in WIDE_SENTENCES]
    assert min(lengths) == 4 and max(lengths) == 40
    assert any(ch.isdigit() for t in WIDE_SENTENCES for ch in t)
    clips = wide_set(limit=5)
    assert {c.condition for c in clips} == {
        "clean connected",
        "clean paused",
        "snr20 connected",
        "snr10 connected",
    }
    assert len({c.voice for c in clips}) == 4 and len({c.wpm for c in clips}) == 3
    paused = next(c for c in clips if c.pauses == "paused" and len(c.words) > 6)
    gaps = [b.start - a.end for a, b in zip(paused.words, paused.words[1:], strict=False)]
    assert max(gaps) >= 0.3  # a pause between phrases
    for clip in clips:
        assert clip.words[0].start >= 0.3 and clip.words[-1].end <= clip.duration - 0.3


def test_noise_is_mixed_at_the_asked_level():
    spoken = speak("Our neighbor Hannah grows tomatoes behind her house.", "en", 175)
    speech = spoken.audio / np.abs(spoken.audio).max() * 0.5
    for snr in (20, 10):
        noisy = add_noise(speech, snr, seed=3)
        assert len(noisy) == len(speech)
        noise = noisy - speech
        loud = _frame_power(speech)
        level = np.sqrt(np.mean(loud[loud >= loud.max() * 1e-3]))
        measured = 20 * np.log10(level / np.sqrt(np.mean(noise**2)))
        assert abs(measured - snr) < 1.0, measured
    # Another seed is another stretch of noise; the same seed the same one.
    assert not np.allclose(add_noise(speech, 10, seed=1), add_noise(speech, 10, seed=2))
    assert np.array_equal(add_noise(speech, 10, seed=1), add_noise(speech, 10, seed=1))


def _frame_power(audio: np.ndarray) -> np.ndarray:
    frame = int(0.02 * SAMPLE_RATE)
    count = len(audio) // frame
    return np.mean(np.square(audio[: count * frame].reshape(count, frame)), axis=1)


def test_the_truth_agrees_with_the_recogniser(asr):
    """The espeak times are the truth the boundary errors are measured against: on clean
    connected speech the recogniser's refined edges must land near them."""
    clips = [c for c in load_clips("wide", limit=8) if c.group == "clean connected"]
    bench = AsrBenchmark(asr, clips)
    errors = []
    for clip in clips:
        recognised = bench.recognise(clip, "offline").words
        for word, i in matched_words(recognised, clip.words):
            if clip.exact[i]:
                errors += [abs(word.start - clip.words[i].start), abs(word.end - clip.words[i].end)]
    assert len(errors) > 60 and np.mean(errors) < 0.15, np.mean(errors)


def test_eval_asr_wide_reports_every_condition(miniapp_exe):
    require_tools()
    done = subprocess.run(
        [
            miniapp_exe,
            "eval",
            "asr",
            "--set",
            "wide",
            "--sentences",
            "2",
            "--stream",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["clips"] == 8
    for mode in ("offline", "stream"):
        groups = result[mode]["groups"]
        assert set(groups) == {
            "clean connected",
            "clean paused",
            "snr20 connected",
            "snr10 connected",
        }
        for scores in groups.values():
            assert 0 <= scores["wer"] <= 1 and scores["words"] == 4 + 8
    stream = result["stream"]
    for key in (
        "median_commit_latency_s",
        "p90_commit_latency_s",
        "median_partial_latency_s",
        "median_audio_wait_s",
        "median_decode_s",
        "median_shown_to_commit_s",
    ):
        assert stream[key] is not None and stream[key] > 0, key
    assert stream["median_partial_latency_s"] <= stream["median_commit_latency_s"]


def test_streaming_keeps_up_on_speech_it_was_not_tuned_on(asr):
    """Clean connected sentences of the wide set, streamed live (replay clock): words show as
    partial text soon after they are spoken, commit within the latency budget, are never
    taken back, and are nearly as right as offline recognition of the same audio."""
    clips = [c for c in load_clips("wide", limit=8) if c.group == "clean connected"][3:7]
    bench = AsrBenchmark(asr, clips)
    offline = bench.run("offline", raw=False)
    stream = bench.run("stream", raw=False)
    # Targets: 1.0 s median commit, 0.5 s partial text; the margin is for a loaded machine,
    # the budget for a CPU slower than the one they were set on (tests/latency_budget.py).
    hypothesis_s = stream["median_decode_s"]
    commit_budget = latency_budget(1.3, hypothesis_s, COMMIT_HYPOTHESES)
    assert stream["median_commit_latency_s"] <= commit_budget, stream
    assert stream["median_partial_latency_s"] <= latency_budget(
        0.7, hypothesis_s, PARTIAL_HYPOTHESES
    ), stream
    assert stream["rtf"] < 1, stream
    assert stream["wer"] <= offline["wer"] + 0.08, (stream["wer"], offline["wer"])
    for clip in clips:
        recognised = bench.recognise(clip, "stream")
        committed: list[Word] = []
        for _, shown in recognised.shown:
            # What is shown after a commit ends no earlier than the committed words:
            # nothing is taken back or shown twice.
            if committed and shown:
                assert shown[0].end >= committed[-1].end, (shown, committed[-1])
            if shown and shown[0].committed_at is not None:
                committed += shown
        assert committed == recognised.words
