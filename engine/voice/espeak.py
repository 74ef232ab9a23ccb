"""Whole sentences from libespeak-ng, with the time each word starts.

The espeak-ng program writes audio but not where its words fall. Its library reports a word
event, with the sample it starts at, for every word it speaks; connected speech (no pause
between words) then has known word boundaries too. A word's end is the last loud frame
before the next word starts, so a pause after it is not counted as part of it.

The library keeps global state (one voice, one callback), so calls are serialised by a lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from dataclasses import dataclass

import av
import numpy as np

from .audio import SAMPLE_RATE
from .boundaries import FRAME_S, frame_levels_db
from .events import Word
from .synthetic import SpeechSynthesisError

LIBRARY = "espeak-ng"
_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS: the callback gets audio as it is made
_POS_CHARACTER = 1
_RATE = 1  # espeakRATE: words per minute
_EVENT_END_OF_LIST = 0
_EVENT_WORD = 1
LOUD_WITHIN_DB = 40.0  # a word's sound: frames within this of the utterance's loudest frame

_lock = threading.Lock()


class EspeakUnavailable(SpeechSynthesisError):
    """libespeak-ng is not installed, or refused a voice (one line, as every speech tool)."""


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),  # 1-based character position of the word
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),  # milliseconds
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_Callback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)


@dataclass(frozen=True)
class Spoken:
    audio: np.ndarray  # 16 kHz mono float32
    words: tuple[Word, ...]  # one per whitespace-separated word of the text, true times
    exact: tuple[bool, ...]  # per word: False where espeak spoke it as one with its neighbour


@functools.cache
def _library() -> tuple[ctypes.CDLL, int]:
    name = ctypes.util.find_library(LIBRARY) or "libespeak-ng.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        raise EspeakUnavailable(
            "libespeak-ng not found (Debian: apt-get install espeak-ng; `make setup` installs "
            "it when run as root)"
        ) from None
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetSynthCallback.argtypes = [_Callback]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_Synth.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    rate = lib.espeak_Initialize(_SYNCHRONOUS, 0, None, 0)
    if rate <= 0:
        raise EspeakUnavailable("libespeak-ng failed to start")
    return lib, rate


def speak(text: str, voice: str = "en-us", words_per_minute: int = 175) -> Spoken:
    """`text` as one utterance in `voice`, with each word's true start and end."""
    with _lock:
        samples, starts, native_rate = _synthesize(text, voice, words_per_minute)
    audio = _resample(samples, native_rate)
    return Spoken(audio, *_word_times(text, starts, audio))


def _synthesize(text: str, voice: str, wpm: int) -> tuple[np.ndarray, list[tuple[int, int]], int]:
    """The native-rate samples and (character position, start sample) of each word event."""
    lib, rate = _library()
    chunks: list[np.ndarray] = []
    events: list[tuple[int, int]] = []

    def collect(wav, count, event_list):
        if count > 0:
            chunks.append(np.ctypeslib.as_array(wav, (count,)).copy())
        i = 0
        while event_list[i].type != _EVENT_END_OF_LIST:
            event = event_list[i]
            if event.type == _EVENT_WORD and event.length > 0:
                events.append((event.text_position - 1, event.sample))
            i += 1
        return 0

    callback = _Callback(collect)  # kept alive until synthesis ends
    lib.espeak_SetSynthCallback(callback)
    if lib.espeak_SetVoiceByName(voice.encode()) != 0:
        raise EspeakUnavailable(f"espeak-ng has no voice {voice!r}")
    lib.espeak_SetParameter(_RATE, wpm, 0)
    encoded = text.encode()
    lib.espeak_Synth(encoded, len(encoded) + 1, 0, _POS_CHARACTER, 0, 0, None, None)
    lib.espeak_Synchronize()
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
    return samples.astype(np.float32) / 32768.0, events, rate


def _resample(samples: np.ndarray, rate: int) -> np.ndarray:
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    frames = [*resampler.resample(frame), *resampler.resample(None)]  # None: what it still holds
    out = [f.to_ndarray().reshape(-1) for f in frames]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)


def _word_times(
    text: str, events: list[tuple[int, int]], audio: np.ndarray
) -> tuple[tuple[Word, ...], tuple[bool, ...]]:
    """One Word per whitespace-separated word, and whether its times are exact.

    A word starts at its first event (espeak may speak a written word as several, "42" as
    "forty two") and ends at its last loud frame before the next word starts; after a pause it
    starts at its first loud frame, later than the event. espeak also speaks some short words
    as one with the word before ("in the"): such a group has one event, its edges are exact,
    and the edges inside it are shared out by letters and marked inexact."""
    spans = _word_spans(text)
    _, rate = _library()
    starts: list[float | None] = [None] * len(spans)
    unassigned = 0  # words get their events in order
    for position, sample in events:
        # An event points into its word, or (after a sentence's end) at the space before it.
        i = next((i for i, (_, end) in enumerate(spans) if end > position), len(spans))
        if unassigned <= i < len(spans):
            starts[i] = sample / rate
            unassigned = i + 1
    if not spans or starts[0] is None:
        raise EspeakUnavailable(f"espeak-ng reported no word events for {text!r}")
    groups = [i for i, start in enumerate(starts) if start is not None] + [len(spans)]
    loud = _loud_frames(audio)
    words: list[Word] = []
    exact: list[bool] = []
    for first, after in zip(groups, groups[1:], strict=False):
        limit = starts[after] if after < len(spans) else len(audio) / SAMPLE_RATE
        start, end = _sound_within(loud, starts[first], limit)
        letters = [spans[i][1] - spans[i][0] for i in range(first, after)]
        edges = start + (end - start) * np.cumsum([0, *letters]) / sum(letters)
        for i, (a, b) in zip(range(first, after), zip(edges, edges[1:], strict=False), strict=True):
            words.append(Word(text[spans[i][0] : spans[i][1]], float(a), float(b)))
            exact.append(after - first == 1)
    return tuple(words), tuple(exact)


def _word_spans(text: str) -> list[tuple[int, int]]:
    spans, begin = [], None
    for i, char in enumerate(text + " "):
        if char.isspace():
            if begin is not None:
                spans.append((begin, i))
                begin = None
        elif begin is None:
            begin = i
    return spans


def _loud_frames(audio: np.ndarray) -> np.ndarray:
    levels = frame_levels_db(audio)
    return levels >= levels.max() - LOUD_WITHIN_DB


def _sound_within(loud: np.ndarray, start: float, limit: float) -> tuple[float, float]:
    """The first and last loud moments between `start` and `limit` (the whole span if none)."""
    first, last = int(start / FRAME_S), min(len(loud), int(limit / FRAME_S))
    heard = np.flatnonzero(loud[first:last])
    if not len(heard):
        return start, limit
    return float((first + heard[0]) * FRAME_S), float((first + heard[-1] + 1) * FRAME_S)
