"""Where there is speech: Silero VAD, the ONNX model that faster-whisper ships."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .audio import SAMPLE_RATE

SPEECH_THRESHOLD = 0.5  # Silero's speech probability
MIN_SPEECH_MS = 60  # shorter bursts (clicks) are not speech
# Pauses inside a sentence are kept inside one span; the utterance logic looks at the gaps
# between spans, so this is the shortest pause it can see.
MIN_SILENCE_MS = 150
SPEECH_PAD_MS = 30  # Silero's spans start and end a little late/early; pad them a bit


@dataclass(frozen=True)
class Span:
    start: float  # seconds, on the caller's clock
    end: float


def speech_spans(audio: np.ndarray, offset: float = 0.0) -> list[Span]:
    """Speech in `audio` (16 kHz mono), as spans in seconds shifted by `offset`."""
    if len(audio) == 0:
        return []
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    options = VadOptions(
        threshold=SPEECH_THRESHOLD,
        min_speech_duration_ms=MIN_SPEECH_MS,
        min_silence_duration_ms=MIN_SILENCE_MS,
        speech_pad_ms=SPEECH_PAD_MS,
    )
    found = get_speech_timestamps(audio, options, sampling_rate=SAMPLE_RATE)
    return [Span(offset + s["start"] / SAMPLE_RATE, offset + s["end"] / SAMPLE_RATE) for s in found]
