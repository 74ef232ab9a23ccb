"""Streaming recognition: words while the speaker talks, on one stream clock.

`StreamingTranscriber` is fed audio as it arrives (`insert_audio_chunk`), and on each
`process_iter` (every `chunk_s` of new audio) re-transcribes its buffer (the audio since the
last trim) with the committed text as the prompt. LocalAgreement-2 commits the words two
hypotheses in a row agree on, once a little audio follows them; a word Whisper is unsure of
also waits for speech after it. On a CPU where a hypothesis costs more than a chunk,
hypotheses come further apart (`max_busy`) instead of back to back.
Everything not yet committed is shown as partial text. Silero VAD skips the work while nobody
speaks and ends an utterance after a long pause. The buffer is cut in a pause between
committed words once it grows long, so its cost stays bounded.

Where a word's commit latency goes (`miniapp eval asr --set wide`): waiting for the audio
after it (half a chunk), the decoding that first hears it, and the agreement of the next
hypothesis (a chunk, or more for unsure words). The numbers chose the policy: shorter
chunks, beam search, and a wait for following speech instead of a fixed 2 s hold.

Every time is seconds from the start of the stream: the buffer's position is kept as an
integer sample count, so trims and joins add no rounding drift.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .agreement import LocalAgreement, after_committed
from .asr import WhisperASR
from .audio import SAMPLE_RATE
from .boundaries import refine_words
from .events import EndOfUtterance, PartialText, VoiceEvent, Word, WordsCommitted, words_text
from .vad import Span, speech_spans

CHUNK_S = 0.3  # how much new audio each iteration waits for
SENTENCE_END = (".", "?", "!")


@dataclass(frozen=True)
class StreamingConfig:
    # Beam search as offline: greedy hypotheses flip more, so agreeing ones are wrong more
    # often (on the wide set's clean connected speech, streamed WER 0.18 greedy and 0.16
    # with 5 beams, for 17% more compute).
    beam_size: int = 5
    chunk_s: float = CHUNK_S
    refine_boundaries: bool = True
    # Whisper is unsure of a word (mean token probability below `sure_probability`) mostly
    # when the audio after it is too short to tell ("the" heard as "her" until the next word
    # is clear): such a word also waits until `unsure_speech_after_s` of speech follows it,
    # or `unsure_wait_s` of audio of any kind (the speaker may have paused).
    sure_probability: float = 0.7
    unsure_speech_after_s: float = 0.8
    unsure_wait_s: float = 1.3
    # Any word also waits until this much audio follows it: a word that ends where the audio
    # ends may be cut off mid-way ("the" heard as "me." twice in a row, as the last word).
    audio_after_s: float = 0.15
    utterance_end_s: float = 1.0  # this much silence after speech ends an utterance
    trim_after_s: float = 10.0  # a longer buffer is cut in a pause between committed words
    max_buffer_s: float = 25.0  # past this, everything pending is committed and cut
    min_cut_gap_s: float = 0.15  # a pause at least this long is a place to cut
    idle_keep_s: float = 0.5  # while nobody speaks, keep this much (a word may be starting)
    prompt_chars: int = 200  # committed text before the buffer, given as Whisper's prompt
    # At most this share of the stream's time goes to hypotheses: where one takes longer
    # than a chunk (a slow CPU), the next waits for enough new audio instead of starting at
    # once, so the stream keeps up, and the chat model keeps part of the CPU.
    max_busy: float = 0.9


class WallClock:
    """Seconds since the stream started (live input)."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._start


class ReplayClock:
    """Stream time for audio replayed as if it arrived live, without waiting for it: time runs
    with the real clock while work is done, and jumps ahead to when the next audio would have
    arrived instead of sleeping. Latencies measured on it are those of a live stream."""

    def __init__(self) -> None:
        self._shift = -time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() + self._shift

    def wait_until(self, stream_time: float) -> None:
        lag = stream_time - self()
        if lag > 0:
            self._shift += lag


class StreamingTranscriber:
    def __init__(
        self,
        asr: WhisperASR,
        config: StreamingConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.asr = asr
        self.config = config or StreamingConfig()
        self.clock = clock or WallClock()
        self.compute_s = 0.0  # time spent in process_iter and finish (for the real-time factor)
        self._buffer = np.zeros(0, dtype=np.float32)
        self._buffer_start = 0  # samples from the start of the stream
        self._decoded_to = 0  # stream sample up to which the last hypothesis heard
        self._agreement = LocalAgreement()
        self._in_buffer: list[Word] = []  # committed words whose audio is still buffered
        self._utterance: list[Word] = []
        self._prompt: deque[str] = deque()
        self._partial = ""
        self._spans: list[Span] = []  # speech in the buffer, as of the last iteration
        self._speech_end = 0.0  # stream time at which the latest speech heard ended
        # Seconds each recent hypothesis took (the pacing reads the latest).
        self.hypothesis_costs: deque[float] = deque(maxlen=1000)

    @property
    def received_s(self) -> float:
        """Stream time of the end of the audio received so far."""
        return (self._buffer_start + len(self._buffer)) / SAMPLE_RATE

    def insert_audio_chunk(self, samples: np.ndarray) -> None:
        """Append 16 kHz mono float32 samples."""
        self._buffer = np.concatenate([self._buffer, np.asarray(samples, dtype=np.float32)])

    def process_iter(self) -> list[VoiceEvent]:
        """Re-transcribe the buffer; the events of what changed."""
        started = time.perf_counter()
        try:
            return self._process()
        finally:
            self.compute_s += time.perf_counter() - started

    def finish(self) -> list[VoiceEvent]:
        """The stream ended: transcribe what is left and commit everything."""
        started = time.perf_counter()
        try:
            events: list[VoiceEvent] = []
            unheard = self._buffer_start + len(self._buffer) > self._decoded_to
            if unheard and self._has_new_speech(speech_spans(self._buffer, self._offset)):
                events += self._transcribe_and_agree()
            events += self._end_utterance()
            self._cut(self._buffer_start + len(self._buffer))
            return events
        finally:
            self.compute_s += time.perf_counter() - started

    def _process(self) -> list[VoiceEvent]:
        spans = self._spans = speech_spans(self._buffer, self._offset)
        if spans:
            # Remembered, not read off the buffer each time: a trim in the pause after the
            # last word leaves a buffer with no speech, and the pause must still count.
            self._speech_end = spans[-1].end
        silent_for = self.received_s - self._speech_end
        active = bool(self._utterance or self._agreement.pending)
        if active and silent_for >= self.config.utterance_end_s:
            events: list[VoiceEvent] = []
            if self._sample(self._speech_end) > self._decoded_to:
                # Hypotheses spaced out on a slow CPU: the last one may not have heard the
                # speech's end, and ending the utterance would drop its last words. That
                # hypothesis is paced like the others (or the pause would add one beyond
                # `max_busy`): the utterance ends a little later on such a CPU.
                if self._too_soon():
                    return []
                events += self._transcribe_and_agree()
            events += self._end_utterance()
            self._cut(self._sample(self._speech_end))
            return events
        if not spans:
            self._drop_idle_audio()
            return []
        if not self._has_new_speech(spans):
            return []  # no speech since everything heard was committed: nothing can change
        if self._too_soon():
            return []
        events = self._transcribe_and_agree()
        self._trim()
        return events

    @property
    def _offset(self) -> float:
        return self._buffer_start / SAMPLE_RATE

    def _sample(self, stream_time: float) -> int:
        return int(round(stream_time * SAMPLE_RATE))

    def _has_new_speech(self, spans: list[Span]) -> bool:
        """Whether a hypothesis may differ from the last: words wait for agreement, or there
        is speech the recogniser has not heard."""
        if self._agreement.pending:
            return True
        return bool(spans) and self._sample(spans[-1].end) > self._decoded_to

    def _too_soon(self) -> bool:
        """Whether a hypothesis now would take more than `max_busy` of the stream's time:
        it costs about what the latest did, and what it adds is the audio since then. The
        whole stream's work so far counts too, so that a hypothesis that cost more than the
        one before it, and the work between hypotheses, are paid back by waiting longer."""
        new_audio_s = self.received_s - self._decoded_to / SAMPLE_RATE
        latest = self.hypothesis_costs[-1] if self.hypothesis_costs else 0.0
        if new_audio_s * self.config.max_busy < latest:
            return True
        return self.compute_s + latest > self.config.max_busy * self.received_s

    def _transcribe_and_agree(self) -> list[VoiceEvent]:
        started = time.perf_counter()
        try:
            return self._hypothesis()
        finally:
            self.hypothesis_costs.append(time.perf_counter() - started)

    def _hypothesis(self) -> list[VoiceEvent]:
        prompt = " ".join(self._prompt)
        words = self.asr.transcribe(
            self._buffer, prompt=prompt, offset=self._offset, beam_size=self.config.beam_size
        )
        if self.config.refine_boundaries:
            words = refine_words(words, self._buffer, self._offset, lag=self.asr.alignment_lag_s)
        words = after_committed(words, self._in_buffer)
        self._decoded_to = self._buffer_start + len(self._buffer)
        return self._committed_events(self._agreement.update(words, self.clock(), self._ready))

    def _ready(self, word: Word) -> bool:
        """Whether agreeing hypotheses may commit `word` yet."""
        c = self.config
        heard_after = self.received_s - word.end
        if heard_after < c.audio_after_s:
            return False
        if word.probability is None or word.probability >= c.sure_probability:
            return True
        return (
            heard_after >= c.unsure_wait_s
            or self._speech_after(word.end) >= c.unsure_speech_after_s
        )

    def _speech_after(self, stream_time: float) -> float:
        """Seconds of speech (by VAD) heard after `stream_time` in the buffer."""
        return sum(max(0.0, s.end - max(s.start, stream_time)) for s in self._spans)

    def _committed_events(self, newly: list[Word]) -> list[VoiceEvent]:
        events: list[VoiceEvent] = []
        if newly:
            self._in_buffer += newly
            self._utterance += newly
            events.append(WordsCommitted(tuple(newly)))
        partial = words_text(self._agreement.pending)
        if partial != self._partial:
            self._partial = partial
            events.append(PartialText(partial, tuple(self._agreement.pending)))
        return events

    def _end_utterance(self) -> list[VoiceEvent]:
        events = self._committed_events(self._agreement.flush(now=self.clock()))
        if self._utterance:
            events.append(EndOfUtterance(tuple(self._utterance)))
            self._utterance = []
        return events

    def _drop_idle_audio(self) -> None:
        keep = self._sample(self.config.idle_keep_s)
        self._cut(max(self._buffer_start, self._buffer_start + len(self._buffer) - keep))

    def _trim(self) -> None:
        """Cut a long buffer in the latest pause between committed words."""
        if len(self._buffer) <= self.config.trim_after_s * SAMPLE_RATE:
            return
        cut = self._cut_point()
        if cut is None and len(self._buffer) > self.config.max_buffer_s * SAMPLE_RATE:
            # No pause to cut in for far too long: stop waiting for agreement.
            self._committed_events(self._agreement.flush(now=self.clock()))
            cut = self._in_buffer[-1].end if self._in_buffer else self.received_s
        if cut is not None:
            self._cut(self._sample(cut))

    def _cut_point(self) -> float | None:
        """The middle of the latest pause after a committed word (or after a committed
        sentence end) that no uncommitted word reaches into."""
        following = [*self._in_buffer[1:], *self._agreement.pending[:1]]
        for word, after in zip(reversed(self._in_buffer), reversed(following), strict=False):
            gap = after.start - word.end
            if gap >= self.config.min_cut_gap_s or word.word.endswith(SENTENCE_END):
                return word.end + max(gap, 0.0) / 2
        return None

    def _cut(self, sample: int) -> None:
        """Drop buffered audio before stream sample `sample`; committed words that end before
        it become prompt text."""
        sample = min(max(sample, self._buffer_start), self._buffer_start + len(self._buffer))
        self._buffer = self._buffer[sample - self._buffer_start :].copy()
        self._buffer_start = sample
        cut_time = sample / SAMPLE_RATE
        while self._in_buffer and self._in_buffer[0].end <= cut_time + 1e-9:
            self._remember(self._in_buffer.pop(0).word)

    def _remember(self, word: str) -> None:
        self._prompt.append(word)
        while sum(len(w) + 1 for w in self._prompt) > self.config.prompt_chars:
            self._prompt.popleft()


def replay(
    transcriber: StreamingTranscriber,
    clock: ReplayClock,
    blocks: Iterable[np.ndarray],
    chunk_s: float | None = None,
) -> Iterator[VoiceEvent]:
    """Feed a recording to `transcriber` (built on `clock`) in live-sized chunks (of its
    config's `chunk_s` unless given): the events, and their times, are those a live stream
    would give, but nothing waits."""
    chunk_s = chunk_s or transcriber.config.chunk_s
    chunks = _rechunk(blocks, int(chunk_s * SAMPLE_RATE))
    chunk = next(chunks, None)
    while chunk is not None:
        transcriber.insert_audio_chunk(chunk)
        clock.wait_until(transcriber.received_s)
        chunk = next(chunks, None)
        # If work fell behind, the audio that arrived meanwhile joins this iteration.
        while chunk is not None and transcriber.received_s + len(chunk) / SAMPLE_RATE <= clock():
            transcriber.insert_audio_chunk(chunk)
            chunk = next(chunks, None)
        yield from transcriber.process_iter()
    yield from transcriber.finish()


def _rechunk(blocks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    pending = np.zeros(0, dtype=np.float32)
    for block in blocks:
        pending = np.concatenate([pending, block])
        while len(pending) >= size:
            yield pending[:size]
            pending = pending[size:]
    if len(pending):
        yield pending
