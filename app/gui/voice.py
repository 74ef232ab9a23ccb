"""The GUI microphone: Gradio streams browser audio in chunks; each browser session gets its
own streaming transcriber, and the live transcript shows every committed word with its times
on the stream clock.

Gradio keeps only the newest chunk of a stream whose handler is still running: a handler that
waited for the recogniser (0.9-1.6 s per pass on a 2-core CPU, against 0.5 s chunks) lost the
chunks that came meanwhile, and the words in them. So the handler only queues the audio and
returns; a worker thread per recording does the recognising."""

from __future__ import annotations

import queue
import threading

import numpy as np

from miniapp.engine.voice.audio import SAMPLE_RATE
from miniapp.engine.voice.events import EndOfUtterance, PartialText, Word, WordsCommitted

from .controller import Transcriber

INT16_SCALE = 32768.0
_END = None  # queued after the last chunk of a recording


class LiveTranscripts:
    """One recording per browser session (Gradio's session hash). A chunk that arrives
    before the start event opens the recording itself rather than being dropped."""

    def __init__(self, transcriber: Transcriber):
        self.transcriber = transcriber
        self._recordings: dict[str, _Recording] = {}
        self._lock = threading.Lock()

    def _recording(self, key: str, fresh: bool = False) -> _Recording:
        with self._lock:
            old = self._recordings.get(key)
            if fresh or old is None:
                if old is not None:
                    old.abandon()
                self._recordings[key] = _Recording(self.transcriber)
            return self._recordings[key]

    def start(self, key: str) -> str:
        self._recording(key, fresh=True)
        return "*listening…*"

    def chunk(self, audio: tuple[int, np.ndarray] | None, key: str) -> str:
        """Queues the chunk and returns the transcript so far, without waiting."""
        if audio is None:
            return ""
        recording = self._recording(key)
        rate, samples = audio
        recording.add(to_16k_mono(rate, samples))
        return recording.render()

    def finish(self, key: str):
        """(transcript shown, the message box filled with what was said), once every queued
        chunk has been recognised."""
        with self._lock:
            recording = self._recordings.pop(key, None)
        if recording is None:
            return "", {"text": "", "files": []}
        recording.close()
        return recording.render(), {"text": recording.text(), "files": []}


class _Recording:
    """The audio queue, the worker thread that recognises it, and the words so far."""

    def __init__(self, transcriber: Transcriber):
        self._audio: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # the words and the partial, read by the handler
        self._words: list[Word] = []
        self._partial = ""
        self._error = ""
        self._heard_s = 0.0  # audio received, shown so a user sees the microphone works
        self._abandoned = False
        self._worker = threading.Thread(
            target=self._recognise, args=(transcriber,), name="live-transcript", daemon=True
        )
        self._worker.start()

    def add(self, samples: np.ndarray) -> None:
        with self._lock:
            self._heard_s += len(samples) / SAMPLE_RATE
        self._audio.put(samples)

    def close(self) -> None:
        """Recognises what is still queued, then the end of the recording."""
        self._audio.put(_END)
        self._worker.join()

    def abandon(self) -> None:
        """A new recording replaced this one: stop without finishing."""
        self._abandoned = True
        self._audio.put(_END)

    def _recognise(self, transcriber: Transcriber) -> None:
        from miniapp.engine.voice.streaming import StreamingTranscriber

        try:
            # Loading the recogniser takes seconds the first time; chunks queue meanwhile.
            stream = StreamingTranscriber(transcriber.asr())
            unprocessed_s = 0.0
            while True:
                chunks, ended = self._take_queued()
                for chunk in chunks:
                    stream.insert_audio_chunk(chunk)
                    unprocessed_s += len(chunk) / SAMPLE_RATE
                if self._abandoned:
                    return
                if ended:
                    self._apply(stream.finish())
                    return
                # Recognising after every browser chunk would fall behind: the transcriber
                # runs once its step of new audio has arrived (what queued meanwhile goes in
                # at once).
                if unprocessed_s >= stream.config.chunk_s:
                    unprocessed_s = 0.0
                    self._apply(stream.process_iter())
        except Exception as exc:  # shown in the transcript; the GUI keeps running
            with self._lock:
                self._error = f"⚠️ speech recognition failed: {exc}"

    def _take_queued(self) -> tuple[list[np.ndarray], bool]:
        """Waits for a chunk, then takes every chunk already queued behind it."""
        chunks: list[np.ndarray] = []
        item = self._audio.get()
        while item is not _END:
            chunks.append(item)
            try:
                item = self._audio.get_nowait()
            except queue.Empty:
                return chunks, False
        return chunks, True

    def _apply(self, events) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, WordsCommitted):
                    self._words += event.words
                elif isinstance(event, PartialText):
                    self._partial = event.text
                elif isinstance(event, EndOfUtterance):
                    self._partial = ""

    def text(self) -> str:
        with self._lock:
            return " ".join(w.word for w in self._words)

    def render(self) -> str:
        with self._lock:
            timed = " ".join(f"{w.word} `{w.start:.2f}–{w.end:.2f}`" for w in self._words)
            tail = f" *{self._partial}*" if self._partial else ""
            lines = [(timed + tail).strip() or "*listening…*", f"🎙 {self._heard_s:.1f} s heard"]
            return "\n\n".join([*lines, self._error] if self._error else lines)


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
