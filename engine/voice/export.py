"""Transcripts as JSON, SRT and VTT.

Subtitle cues are built from the words: a cue ends at a sentence end, at a pause, or when it
grows too long to read at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from .events import Word, words_text

CUE_MAX_CHARS = 42  # one subtitle line, as broadcasters use
CUE_MAX_SECONDS = 6.0
CUE_PAUSE_S = 1.0  # a pause at least this long starts a new cue
SENTENCE_END = (".", "?", "!")


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str


def to_json(words: Sequence[Word]) -> str:
    return json.dumps({"words": [w.to_dict() for w in words], "text": words_text(words)})


def to_srt(words: Sequence[Word]) -> str:
    blocks = [
        f"{i}\n{_timestamp(c.start, ',')} --> {_timestamp(c.end, ',')}\n{c.text}\n"
        for i, c in enumerate(cues(words), start=1)
    ]
    return "\n".join(blocks)


def to_vtt(words: Sequence[Word]) -> str:
    blocks = [
        f"{_timestamp(c.start, '.')} --> {_timestamp(c.end, '.')}\n{c.text}\n" for c in cues(words)
    ]
    return "\n".join(["WEBVTT\n", *blocks])


def cues(words: Sequence[Word]) -> list[Cue]:
    groups: list[list[Word]] = []
    for word in words:
        if not groups or _starts_new_cue(groups[-1], word):
            groups.append([word])
        else:
            groups[-1].append(word)
    return [Cue(g[0].start, g[-1].end, words_text(g)) for g in groups]


def _starts_new_cue(cue: list[Word], word: Word) -> bool:
    last = cue[-1]
    return (
        last.word.endswith(SENTENCE_END)
        or word.start - last.end >= CUE_PAUSE_S
        or len(words_text(cue)) + 1 + len(word.word) > CUE_MAX_CHARS
        or word.end - cue[0].start > CUE_MAX_SECONDS
    )


def _timestamp(seconds: float, decimal_mark: str) -> str:
    millis = max(0, int(round(seconds * 1000)))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_mark}{millis:03d}"
