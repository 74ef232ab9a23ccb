"""Typed events of speech recognition; the terminal chat (and later the GUI) consume these."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..modelfile.template import Message


@dataclass(frozen=True)
class Word:
    """One recognised word. Times are seconds from the start of the stream (one clock for the
    whole stream); `committed_at` is the stream time at which streaming committed the word
    (None for offline transcription, where nothing is committed early). `probability` is the
    recogniser's mean token probability for the word, where known."""

    word: str
    start: float
    end: float
    committed_at: float | None = None
    probability: float | None = field(default=None, compare=False)  # the recogniser's

    def to_dict(self) -> dict:
        return {
            "word": self.word,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "committed_at": None if self.committed_at is None else round(self.committed_at, 3),
        }


def words_text(words: list[Word] | tuple[Word, ...]) -> str:
    return " ".join(w.word for w in words)


@dataclass(frozen=True)
class PartialText:
    """The not yet committed tail of the hypothesis; it may still change."""

    text: str
    words: tuple[Word, ...] = ()  # the same tail as words with their (provisional) times


@dataclass(frozen=True)
class WordsCommitted:
    """Words that will not change any more, in order."""

    words: tuple[Word, ...]


@dataclass(frozen=True)
class EndOfUtterance:
    """The speaker stopped (a long pause, or the end of the stream): all of the utterance's
    words, committed."""

    words: tuple[Word, ...]

    @property
    def text(self) -> str:
        return words_text(self.words)


VoiceEvent = PartialText | WordsCommitted | EndOfUtterance


@dataclass(frozen=True)
class SpokenMessage(Message):
    """A user message that was spoken: its text, plus the words with their times."""

    words: tuple[Word, ...] = field(default=())

    @classmethod
    def from_words(cls, words: list[Word] | tuple[Word, ...]) -> SpokenMessage:
        return cls("user", words_text(words), words=tuple(words))
