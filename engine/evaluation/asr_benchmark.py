"""`miniapp eval asr`: recognition measured on synthetic speech with known word boundaries.

Every clip is recognised offline (windows, beam search) and streamed (live-sized chunks on a
replay clock, so its times are those of a live stream). Scores are per group of clips (a
sentence set, or one condition of the wide set): WER, word-boundary errors, the real-time
factor, and for the stream how late words appear: the time from a word's true end to its
commit and to its first showing as partial text, and where the commit latency goes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from ..voice.agreement import same_word
from ..voice.asr import WhisperASR
from ..voice.audio import SAMPLE_RATE
from ..voice.events import (
    EndOfUtterance,
    PartialText,
    SpokenMessage,
    Word,
    WordsCommitted,
    words_text,
)
from ..voice.metrics import matched_words, mean_or_none, word_error_rate
from ..voice.offline import transcribe_blocks
from ..voice.streaming import ReplayClock, StreamingConfig, StreamingTranscriber, replay
from ..voice.synthetic import SENTENCE_SETS, synthesize
from ..voice.wide_set import wide_set


@dataclass(frozen=True)
class Clip:
    """What the benchmark needs of a recording: the audio, and the truth."""

    text: str
    audio: np.ndarray
    words: tuple[Word, ...]
    exact: tuple[bool, ...]  # whose true times are exact
    group: str

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE


@dataclass(frozen=True)
class _Call:
    """One recogniser call while streaming, on the stream clock."""

    started: float
    finished: float
    heard_to: float  # stream time of the end of the audio it was given
    words: tuple[Word, ...]


@dataclass
class Recognised:
    clip: Clip
    words: list[Word]
    compute_s: float
    shown: list[tuple[float, tuple[Word, ...]]] = field(default_factory=list)  # stream only
    calls: list[_Call] = field(default_factory=list)  # stream only


class _TimedASR:
    """The recogniser, with each call's stream times kept for the latency breakdown."""

    def __init__(self, asr: WhisperASR, clock: Callable[[], float]) -> None:
        self.asr = asr
        self.clock = clock
        self.calls: list[_Call] = []

    @property
    def alignment_lag_s(self) -> float:
        return self.asr.alignment_lag_s

    def transcribe(self, audio, prompt: str = "", offset: float = 0.0, beam_size: int = 1):
        started = self.clock()
        words = self.asr.transcribe(audio, prompt=prompt, offset=offset, beam_size=beam_size)
        heard_to = offset + len(audio) / SAMPLE_RATE
        self.calls.append(_Call(started, self.clock(), heard_to, tuple(words)))
        return words


def load_clips(sentence_set: str, limit: int | None = None) -> list[Clip]:
    if sentence_set == "wide":
        return [Clip(c.text, c.audio, c.words, c.exact, c.condition) for c in wide_set(limit)]
    texts = SENTENCE_SETS[sentence_set][:limit]
    spoken = [synthesize(text, seed=i) for i, text in enumerate(texts)]
    return [Clip(s.text, s.audio, s.words, (True,) * len(s.words), sentence_set) for s in spoken]


class AsrBenchmark:
    def __init__(
        self, asr: WhisperASR, clips: list[Clip], config: StreamingConfig | None = None
    ) -> None:
        self.asr = asr
        self.clips = clips
        self.count = len({c.text for c in self.clips})
        self.config = config or StreamingConfig()

    def run(self, mode: str, raw: bool = True) -> dict:
        """Scores over every clip (and per group when there are several); with `raw`, the
        boundary errors without refinement too."""
        refined = [self.recognise(c, mode, refine=True) for c in self.clips]
        result = _scores(refined, mode)
        if raw:
            unrefined = [self.recognise(c, mode, refine=False) for c in self.clips]
            scores = _scores(unrefined, mode)
            result |= {f"raw_{k}": scores[k] for k in ("start_mae_s", "end_mae_s")}
        groups = sorted({c.group for c in self.clips}, key=[c.group for c in self.clips].index)
        if len(groups) > 1:
            result["groups"] = {
                g: _scores([r for r in refined if r.clip.group == g], mode) for g in groups
            }
        return result

    def answer_latency(self, runtime) -> dict:
        """Each sentence streamed, then sent to a chat: the time from the end of the audio to
        the first answer token, on the stream's clock."""
        from ..chat.conversation import Conversation
        from ..chat.generation import GenerationRequest
        from ..tokens.events import TextDelta

        totals, finishes, ttfts = [], [], []
        for clip in self.clips:
            clock = ReplayClock()
            transcriber = StreamingTranscriber(self.asr, self.config, clock)
            words: list[Word] = []
            for event in replay(transcriber, clock, [clip.audio]):
                if isinstance(event, EndOfUtterance):
                    words = list(event.words)
            finished = clock()
            conversation = Conversation(runtime, request=GenerationRequest(max_tokens=8))
            sent = time.perf_counter()
            first_token = None
            spoken = SpokenMessage.from_words(words)
            for event in conversation.send(spoken, should_stop=_never):
                if isinstance(event, TextDelta) and first_token is None:
                    first_token = clock()
                    ttfts.append(time.perf_counter() - sent)
            if first_token is None:
                continue
            totals.append(first_token - clip.duration)
            finishes.append(finished - clip.duration)
        return {
            "median_speech_end_to_first_token_s": median(totals),
            "median_finish_s": median(finishes),
            "median_ttft_s": median(ttfts),
        }

    def recognise(self, clip: Clip, mode: str, refine: bool = True) -> Recognised:
        """The clip's words offline or streamed (with what the stream showed, and when)."""
        if mode == "offline":
            started = time.perf_counter()
            words = list(transcribe_blocks(self.asr, [clip.audio], refine_boundaries=refine))
            return Recognised(clip, words, time.perf_counter() - started)
        clock = ReplayClock()
        timed = _TimedASR(self.asr, clock)
        config = dataclasses.replace(self.config, refine_boundaries=refine)
        transcriber = StreamingTranscriber(timed, config, clock)
        recognised = Recognised(clip, [], 0.0, calls=timed.calls)
        for event in replay(transcriber, clock, [clip.audio]):
            if isinstance(event, WordsCommitted):
                recognised.words += event.words
                recognised.shown.append((clock(), event.words))
            elif isinstance(event, PartialText):
                recognised.shown.append((clock(), event.words))
        recognised.compute_s = transcriber.compute_s
        return recognised


def _scores(recognised: Sequence[Recognised], mode: str) -> dict:
    starts, ends, timings = [], [], []
    errors = 0.0
    for r in recognised:
        errors += word_error_rate(r.clip.text, words_text(r.words)) * len(r.clip.words)
        for word, index in matched_words(r.words, r.clip.words):
            truth = r.clip.words[index]
            if r.clip.exact[index]:
                starts.append(abs(word.start - truth.start))
                ends.append(abs(word.end - truth.end))
            if mode == "stream":
                timings.append(_timing(r, word, truth.end))
    words = sum(len(r.clip.words) for r in recognised)
    result = {
        "wer": errors / words,
        "words": words,
        "start_mae_s": mean_or_none(starts),
        "end_mae_s": mean_or_none(ends),
        "timed_words": len(starts),
        "rtf": sum(r.compute_s for r in recognised) / sum(r.clip.duration for r in recognised),
    }
    if mode == "stream":
        result |= _latencies(timings)
    return result


@dataclass(frozen=True)
class _Timing:
    """How late one correctly recognised word was, each part from its true end."""

    audio_wait: float  # until the first recogniser call that was given all of it started
    decode: float  # that call's own time
    shown: float  # until it first showed (as partial text or committed)
    committed: float


def _timing(r: Recognised, word: Word, true_end: float) -> _Timing:
    covering = next((c for c in r.calls if c.heard_to >= true_end), r.calls[-1])
    shown = next(
        (at for at, words in r.shown if any(_same_place(word, w) for w in words)),
        word.committed_at,
    )
    return _Timing(
        covering.started - true_end,
        covering.finished - covering.started,
        shown - true_end,
        word.committed_at - true_end,
    )


def _same_place(word: Word, other: Word) -> bool:
    return same_word(word, other) and other.start < word.end and other.end > word.start


def _latencies(timings: list[_Timing]) -> dict:
    def p(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    committed = [t.committed for t in timings]
    shown = [t.shown for t in timings]
    return {
        "median_commit_latency_s": p(committed, 50),
        "p90_commit_latency_s": p(committed, 90),
        "median_partial_latency_s": p(shown, 50),
        "p90_partial_latency_s": p(shown, 90),
        # Where the commit latency goes (medians over words): waiting for the audio to be
        # given to the recogniser, that call's decoding, and from first showing to commit.
        "median_audio_wait_s": p([t.audio_wait for t in timings], 50),
        "median_decode_s": p([t.decode for t in timings], 50),
        "median_shown_to_commit_s": p([t.committed - t.shown for t in timings], 50),
    }


def _never() -> bool:
    return False
