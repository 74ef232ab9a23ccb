"""The wide evaluation set: speech the streaming policy was never tuned on.

Sentences of 4 to 40 words with numbers and names, spoken by several espeak-ng voices at
several speeds, either as one connected utterance or in phrases with pauses between them,
clean and under pink noise at a few signal-to-noise ratios (mixed with sox). Every word's true
start and end come from libespeak-ng's word events (see `espeak`), so boundary errors and
latencies are measured against the truth. Everything is generated on demand and seeded.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .audio import SAMPLE_RATE, read_audio
from .espeak import speak
from .events import Word
from .synthetic import SpeechSynthesisError, silence, write_wav

SOX = "sox"
WIDE_SENTENCES = (
    "Call Priya at 7.",
    "Kevin scored 2 goals in the second half.",
    "Can you turn the music down a little?",
    "Daniel parked the blue van behind the old bakery.",
    "The museum opens at 9 and closes at 5 on Sundays.",
    "The recipe needs 3 eggs, 200 grams of flour and a little milk.",
    "Amelia asked whether the 3 new printers had arrived from Berlin yet.",
    "Please remind Oliver that the dentist moved his appointment to Monday afternoon.",
    "We need 24 chairs, 6 tables and a projector for the workshop on Thursday.",
    "Our neighbor Hannah grows tomatoes, beans and strawberries in a small garden behind "
    "her house.",
    "Jonathan said the ferry to Dublin was cancelled because of the storm, so we drove to "
    "the coast instead.",
    "The flight from Madrid landed 40 minutes late, and most of the passengers missed their "
    "trains to Paris.",
    "After lunch, Sofia and Marcus checked the 15 boxes in the warehouse and found that two "
    "of them were damaged during shipping.",
    "If the weather stays clear this weekend, my brother Thomas wants to climb the hill near "
    "the lake, but I would rather stay at home and finish my book.",
    "When the students from the village school visited the science museum in Edinburgh last "
    "spring, they watched a film about volcanoes, built small robots with the engineers, and "
    "came home tired but happy after a long journey back by train.",
    "Maria told me that her grandfather Peter still rides his bicycle to the market every "
    "morning, even though he turned 80 in November.",
)
VOICES = ("en-us", "en", "en-us+f3", "en-gb-x-rp")
SPEEDS_WPM = (150, 175, 200)
PHRASE_WORDS = (3, 6)  # a paused sentence is spoken in phrases of this many words
PAUSE_RANGE_S = (0.3, 0.8)
EDGE_SILENCE_S = 0.4
NOISE_SEED_STEP_S = 0.37
SPEECH_PEAK = 0.5  # speech is scaled to this peak before noise is added (no clipping)
# (pauses, SNR in dB or None for clean): the conditions every sentence is heard in.
CONDITIONS = (("connected", None), ("paused", None), ("connected", 20), ("connected", 10))


@dataclass(frozen=True)
class Clip:
    text: str
    audio: np.ndarray  # 16 kHz mono float32
    words: tuple[Word, ...]  # the true boundaries
    exact: tuple[bool, ...]  # per word: whether its true times are exact (see `espeak`)
    voice: str
    wpm: int
    pauses: str  # "connected" or "paused"
    snr_db: int | None  # None: clean

    @property
    def noise(self) -> str:
        return "clean" if self.snr_db is None else f"snr{self.snr_db}"

    @property
    def condition(self) -> str:
        return f"{self.noise} {self.pauses}"

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def wide_set(limit: int | None = None, conditions=CONDITIONS) -> list[Clip]:
    """Each of the first `limit` sentences in every condition; voice and speed rotate over
    the sentences, so each condition hears every voice and speed."""
    clips = []
    for i, text in enumerate(WIDE_SENTENCES[:limit]):
        voice, wpm = VOICES[i % len(VOICES)], SPEEDS_WPM[i % len(SPEEDS_WPM)]
        spoken = {pauses: _spoken(text, voice, wpm, pauses, seed=i) for pauses, _ in conditions}
        for pauses, snr in conditions:
            audio, words, exact = spoken[pauses]
            if snr is not None:
                audio = add_noise(audio, snr, seed=i)
            clips.append(Clip(text, audio, words, exact, voice, wpm, pauses, snr))
    return clips


def _spoken(text: str, voice: str, wpm: int, pauses: str, seed: int):
    """The sentence's audio (peak SPEECH_PEAK, silence at both ends), its true words and
    which of their times are exact."""
    rng = np.random.default_rng(seed)
    words = text.split()
    if pauses == "connected":
        phrases = [words]
    else:
        phrases, at = [], 0
        while at < len(words):
            size = int(rng.integers(PHRASE_WORDS[0], PHRASE_WORDS[1] + 1))
            phrases.append(words[at : at + size])
            at += size
    parts, truth, exact = [silence(EDGE_SILENCE_S)], [], []
    cursor = len(parts[0]) / SAMPLE_RATE
    for i, phrase in enumerate(phrases):
        spoken = speak(" ".join(phrase), voice, wpm)
        truth += [replace(w, start=w.start + cursor, end=w.end + cursor) for w in spoken.words]
        exact += spoken.exact
        pause = rng.uniform(*PAUSE_RANGE_S) if i + 1 < len(phrases) else EDGE_SILENCE_S
        parts += [spoken.audio, silence(pause)]
        cursor += (len(spoken.audio) + len(parts[-1])) / SAMPLE_RATE
    audio = np.concatenate(parts)
    peak = max(1e-9, float(np.abs(audio).max()))
    return audio * (SPEECH_PEAK / peak), tuple(truth), tuple(exact)


def add_noise(audio: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """`audio` with pink noise mixed in by sox, `snr_db` below the speech's level (the power
    of its loud frames, so silences between words do not lower the reference)."""
    if shutil.which(SOX) is None:
        raise SpeechSynthesisError(
            f"{SOX} not found: noisy speech needs it (Debian: apt-get install sox)"
        )
    # -R makes sox's noise repeatable; a longer run, of which only the tail is used, gives
    # each seed its own stretch of it.
    duration = f"{len(audio) / SAMPLE_RATE + NOISE_SEED_STEP_S * seed:.4f}"
    with tempfile.TemporaryDirectory(prefix="miniapp-noise-") as tmp:
        speech, noise, mixed = (Path(tmp) / n for n in ("speech.wav", "noise.wav", "mixed.wav"))
        write_wav(speech, audio)
        _sox(
            "-R",
            "-n",
            "-r",
            str(SAMPLE_RATE),
            "-c",
            "1",
            "-b",
            "16",
            str(noise),
            "synth",
            duration,
            "pinknoise",
        )
        noise_audio = read_audio(noise)[-len(audio) :]
        write_wav(noise, noise_audio)
        gain = _speech_level(audio) / (_rms(noise_audio) * 10 ** (snr_db / 20))
        _sox("-m", "-v", "1", str(speech), "-v", f"{gain:.6f}", str(noise), str(mixed))
        return read_audio(mixed)[: len(audio)]


def _sox(*args: str) -> None:
    # -D: no dither, whose noise would differ from run to run (-R does not cover it).
    done = subprocess.run([SOX, "-D", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SpeechSynthesisError(f"{SOX} failed: {done.stderr.strip()}")


def _speech_level(audio: np.ndarray) -> float:
    frame = int(0.02 * SAMPLE_RATE)
    count = len(audio) // frame
    power = np.mean(np.square(audio[: count * frame].reshape(count, frame)), axis=1)
    loud = power[power >= power.max() * 1e-3]  # within 30 dB of the loudest frame
    return float(np.sqrt(np.mean(loud)))


def _rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio))))
