"""Speech with known word boundaries, for tests and `miniapp eval asr`.

Each word is spoken on its own by espeak-ng, trimmed to where its sound starts and stops, and
the words are joined with silences of known, seeded-random length. The true start and end of
every word are then exact, which is what word-time errors are measured against.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MiniappError
from .audio import SAMPLE_RATE, read_audio
from .events import Word

ESPEAK = "espeak-ng"
VOICE = "en"  # espeak-ng's British English; tiny.en hears its isolated words best
WORDS_PER_MINUTE = 160
GAP_RANGE_S = (0.2, 0.6)  # silence between words
EDGE_SILENCE_S = 0.4  # before the first word and after the last
TRIM_FRAME_S = 0.005
TRIM_BELOW_PEAK_DB = 45.0  # a word's sound: frames within this of its loudest frame

# Clean sentences: every word is intelligible when spoken on its own.
CLEAN_SENTENCES = (
    "a quick brown fox jumps over the lazy dog",
    "please open the window before the meeting starts",
    "my sister bought a new car last summer",
    "we walked along the river until it got dark",
    "children were singing songs in school",
    "can you send me the report by friday",
    "he forgot his keys on the kitchen table",
    "our train to london leaves at noon",
    "she likes to read books about history",
    "turn off the lights when you leave the room",
    "tomorrow will be cold and windy",
    "our team finished the project early",
    "i would like a cup of green tea",
    "your doctor told him to eat more fruit",
    "people are building a new bridge across the river",
)
# The first set written: isolated function words ("the" or "they" opening a sentence, spoken
# stressed on their own) and a few words tiny.en mishears in espeak's voice. Kept as a harder
# benchmark.
HARD_SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "the children are playing in the garden",
    "the train to london leaves at noon",
    "the weather will be cold and windy tomorrow",
    "i would like a cup of hot tea",
    "the doctor told him to drink more water",
    "they are building a new bridge across the river",
)
SENTENCE_SETS = {"clean": CLEAN_SENTENCES, "hard": HARD_SENTENCES}


class SpeechSynthesisError(MiniappError):
    """espeak-ng is missing or failed."""


@dataclass(frozen=True)
class SyntheticSpeech:
    text: str
    audio: np.ndarray  # 16 kHz mono float32
    words: tuple[Word, ...]  # the true boundaries

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def synthesize(
    text: str,
    seed: int = 0,
    gap_range: tuple[float, float] = GAP_RANGE_S,
    edge_silence: float = EDGE_SILENCE_S,
) -> SyntheticSpeech:
    """`text` spoken word by word, with silences drawn from `gap_range` between words."""
    rng = np.random.default_rng(seed)
    parts = [silence(edge_silence)]
    cursor = len(parts[0])
    truth = []
    names = text.split()
    for i, name in enumerate(names):
        sound = spoken_word(name)
        truth.append(Word(name, cursor / SAMPLE_RATE, (cursor + len(sound)) / SAMPLE_RATE))
        parts.append(sound)
        cursor += len(sound)
        gap = silence(rng.uniform(*gap_range) if i + 1 < len(names) else edge_silence)
        parts.append(gap)
        cursor += len(gap)
    return SyntheticSpeech(text, np.concatenate(parts), tuple(truth))


@functools.lru_cache(maxsize=512)
def spoken_word(word: str) -> np.ndarray:
    """One word from espeak-ng at 16 kHz, trimmed to its sound."""
    sound = _espeak(word)
    return _trim(sound)


def write_wav(path: Path | str, audio: np.ndarray) -> None:
    """16-bit PCM mono WAV at 16 kHz."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())


def silence(seconds: float) -> np.ndarray:
    """`seconds` of digital silence (float32 samples at SAMPLE_RATE)."""
    return np.zeros(int(round(seconds * SAMPLE_RATE)), dtype=np.float32)


def _espeak(word: str) -> np.ndarray:
    if shutil.which(ESPEAK) is None:
        raise SpeechSynthesisError(
            f"{ESPEAK} not found: synthetic speech needs it (Debian: apt-get install espeak-ng; "
            "`make setup` installs it when run as root)"
        )
    with tempfile.TemporaryDirectory(prefix="miniapp-espeak-") as tmp:
        path = Path(tmp) / "word.wav"
        done = subprocess.run(
            [ESPEAK, "-v", VOICE, "-s", str(WORDS_PER_MINUTE), "-w", str(path), word],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not path.exists():
            raise SpeechSynthesisError(f"{ESPEAK} failed on {word!r}: {done.stderr.strip()}")
        return read_audio(path)


def _trim(sound: np.ndarray) -> np.ndarray:
    frame = int(TRIM_FRAME_S * SAMPLE_RATE)
    frames = len(sound) // frame
    power = np.mean(np.square(sound[: frames * frame].reshape(frames, frame)), axis=1)
    levels = 10 * np.log10(power + 1e-12)
    loud = np.flatnonzero(levels >= levels.max() - TRIM_BELOW_PEAK_DB)
    return sound[loud[0] * frame : (loud[-1] + 1) * frame].copy()
