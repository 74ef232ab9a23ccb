"""Offline recognition of a whole recording, in windows, in bounded memory.

The audio arrives as blocks (see `audio.iter_audio`) and is transcribed in windows of at most
30 s, Whisper's span, each cut in a pause so that no word is split; each window gets the text
before it as its prompt. Only one window and one block are ever held.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .asr import MAX_WINDOW_S, WhisperASR
from .audio import SAMPLE_RATE
from .boundaries import refine_words
from .events import Word
from .vad import speech_spans

OFFLINE_BEAM_SIZE = 5
PROMPT_WORDS = 40  # the previous window's last words, as the next window's prompt
# A window is cut in the longest pause found in its second half, so windows stay long (fewer
# encoder runs, more context) without ever cutting through a word.
CUT_SEARCH_FROM = 0.5


def transcribe_blocks(
    asr: WhisperASR,
    blocks: Iterable[np.ndarray],
    beam_size: int = OFFLINE_BEAM_SIZE,
    refine_boundaries: bool = True,
) -> Iterator[Word]:
    """Words of the whole recording, in order, times in seconds from its start."""
    windows = _Windows(asr, beam_size, refine_boundaries)
    window = np.zeros(0, dtype=np.float32)
    window_start = 0  # samples
    max_samples = int(MAX_WINDOW_S * SAMPLE_RATE)
    for block in blocks:
        window = np.concatenate([window, block])
        while len(window) >= max_samples:
            cut = _cut_sample(window)
            yield from windows.words(window[:cut], window_start)
            window = window[cut:].copy()
            window_start += cut
    if len(window):
        yield from windows.words(window, window_start)


class _Windows:
    """Transcribes consecutive windows, carrying the prompt and the clock between them."""

    def __init__(self, asr: WhisperASR, beam_size: int, refine_boundaries: bool) -> None:
        self.asr = asr
        self.beam_size = beam_size
        self.refine_boundaries = refine_boundaries
        self.prompt: list[str] = []
        self.last_end = 0.0

    def words(self, audio: np.ndarray, start_sample: int) -> list[Word]:
        offset = start_sample / SAMPLE_RATE
        if not speech_spans(audio, offset):
            return []  # silence: no words (and no hallucinated ones)
        words = self.asr.transcribe(
            audio, prompt=" ".join(self.prompt), offset=offset, beam_size=self.beam_size
        )
        if self.refine_boundaries:
            words = refine_words(words, audio, offset, lag=self.asr.alignment_lag_s)
        placed = []
        for word in words:
            start = max(word.start, self.last_end)  # windows never overlap on the clock
            placed.append(Word(word.word, start, max(word.end, start)))
            self.last_end = placed[-1].end
        self.prompt = (self.prompt + [w.word for w in placed])[-PROMPT_WORDS:]
        return placed


def _cut_sample(window: np.ndarray) -> int:
    """Where to end this window: the middle of the longest pause in its second half."""
    spans = speech_spans(window)
    search_from = CUT_SEARCH_FROM * len(window) / SAMPLE_RATE
    best_gap, best_cut = 0.0, len(window)
    for before, after in zip(spans, spans[1:], strict=False):
        if after.start < search_from:
            continue
        gap = after.start - max(before.end, search_from)
        if gap > best_gap:
            best_gap = gap
            best_cut = int((max(before.end, search_from) + gap / 2) * SAMPLE_RATE)
    if spans and spans[-1].end < len(window) / SAMPLE_RATE and best_gap == 0.0:
        best_cut = int(spans[-1].end * SAMPLE_RATE)  # speech stops before the window's end
    if not spans:
        best_cut = len(window)
    return max(1, min(best_cut, len(window)))
