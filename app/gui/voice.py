"""The GUI microphone: Gradio streams browser audio in chunks; each browser session gets its
own streaming transcriber, and the live transcript shows every committed word with its times
on the stream clock."""

from __future__ import annotations

import threading

import numpy as np

from miniapp.engine.voice.audio import SAMPLE_RATE
from miniapp.engine.voice.events import EndOfUtterance, PartialText, Word, WordsCommitted

from .controller import Transcriber

INT16_SCALE = 32768.0
# The browser sends short chunks (0.1 s); recognising after each would fall behind, so the
# transcriber runs once this much new audio has arrived.
PROCESS_EVERY_S = 0.5


class LiveTranscripts:
    """One stream per browser session (Gradio's session hash). Chunks may arrive before the
    start event has finished (loading the recogniser takes seconds), so a chunk opens the
    stream itself rather than being dropped."""

    def __init__(self, transcriber: Transcriber):
        self.transcriber = transcriber
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, key: str, fresh: bool = False) -> _Stream:
        from miniapp.engine.voice.streaming import StreamingTranscriber

        with self._lock:
            if fresh or key not in self._streams:
                self._streams[key] = _Stream(StreamingTranscriber(self.transcriber.asr()))
            return self._streams[key]

    def start(self, key: str) -> str:
        self._stream(key, fresh=True)
        return "*listening…*"

    def chunk(self, audio: tuple[int, np.ndarray] | None, key: str) -> str:
        if audio is None:
            return ""
        stream = self._stream(key)
        rate, samples = audio
        chunk = to_16k_mono(rate, samples)
        stream.transcriber.insert_audio_chunk(chunk)
        stream.unprocessed_s += len(chunk) / SAMPLE_RATE
        if stream.unprocessed_s >= PROCESS_EVERY_S:
            stream.unprocessed_s = 0.0
            stream.apply(stream.transcriber.process_iter())
        return stream.render()

    def finish(self, key: str):
        """(transcript shown, the message box filled with what was said)."""
        with self._lock:
            stream = self._streams.pop(key, None)
        if stream is None:
            return "", {"text": "", "files": []}
        stream.apply(stream.transcriber.finish())
        return stream.render(), {"text": " ".join(w.word for w in stream.words), "files": []}


class _Stream:
    def __init__(self, transcriber):
        self.transcriber = transcriber
        self.words: list[Word] = []
        self.partial = ""
        self.unprocessed_s = 0.0  # audio received since the transcriber last ran

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, WordsCommitted):
                self.words += event.words
            elif isinstance(event, PartialText):
                self.partial = event.text
            elif isinstance(event, EndOfUtterance):
                self.partial = ""

    def render(self) -> str:
        timed = " ".join(f"{w.word} `{w.start:.2f}–{w.end:.2f}`" for w in self.words)
        tail = f" *{self.partial}*" if self.partial else ""
        return (timed + tail).strip() or "*listening…*"


def to_16k_mono(rate: int, samples: np.ndarray) -> np.ndarray:
    """Browser audio (int16 or float, mono or stereo, any rate) as Whisper's input."""
    audio = np.asarray(samples)
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if np.issubdtype(audio.dtype, np.integer):
        audio = audio.astype(np.float32) / INT16_SCALE
    audio = audio.astype(np.float32)
    if rate == SAMPLE_RATE or len(audio) == 0:
        return audio
    # Linear interpolation is enough for speech recognition at these rates.
    positions = np.arange(0, len(audio), rate / SAMPLE_RATE)
    return np.interp(positions, np.arange(len(audio)), audio).astype(np.float32)
