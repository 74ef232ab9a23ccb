"""Synthetic speech for the voice tests: espeak-ng words joined by silences of known length.

The synthesis itself lives in `miniapp.engine.voice.synthetic` (the `eval asr` benchmark uses
it too); this adds what tests need: WAV files on disk and long recordings.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from miniapp.engine.voice.audio import SAMPLE_RATE
from miniapp.engine.voice.events import Word
from miniapp.engine.voice.synthetic import (
    CLEAN_SENTENCES,
    ESPEAK,
    SyntheticSpeech,
    synthesize,
    write_wav,
)

__all__ = [
    "CLEAN_SENTENCES",
    "SyntheticSpeech",
    "joined",
    "long_recording",
    "require_tools",
    "synthesize",
    "wav",
]


def require_tools() -> None:
    """Fail (never skip) with a clear message when the synthesis tools are missing."""
    for tool in (ESPEAK, "sox"):
        assert shutil.which(tool), f"{tool} is missing: run `make setup` (apt-get install {tool})"


def wav(path: Path, speech: SyntheticSpeech | np.ndarray) -> Path:
    write_wav(path, speech.audio if isinstance(speech, SyntheticSpeech) else speech)
    return path


def joined(parts: list[SyntheticSpeech], pause_s: float) -> SyntheticSpeech:
    """Sentences one after another with `pause_s` of silence between them, truth shifted."""
    audio: list[np.ndarray] = []
    words: list[Word] = []
    cursor = 0
    for part in parts:
        shift = cursor / SAMPLE_RATE
        words += [Word(w.word, w.start + shift, w.end + shift) for w in part.words]
        pause = np.zeros(int(pause_s * SAMPLE_RATE), dtype=np.float32)
        audio += [part.audio, pause]
        cursor += len(part.audio) + len(pause)
    text = " ".join(p.text for p in parts)
    return SyntheticSpeech(text, np.concatenate(audio), tuple(words))


def long_recording(path: Path, speech: SyntheticSpeech, silence_s: float, tmp: Path) -> Path:
    """`speech`, then `silence_s` of silence, then `speech` again, as FLAC (silence compresses
    to almost nothing, so an hours-long file stays small on disk)."""
    spoken = wav(tmp / "speech.wav", speech)
    silence = tmp / "silence.flac"
    subprocess.run(
        [
            "sox",
            "-n",
            "-r",
            str(SAMPLE_RATE),
            "-c",
            "1",
            "-b",
            "16",
            str(silence),
            "trim",
            "0",
            str(silence_s),
        ],
        check=True,
    )
    subprocess.run(["sox", str(spoken), str(silence), str(spoken), str(path)], check=True)
    return path
