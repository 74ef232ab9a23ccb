"""`miniapp eval asr`: recognition measured on synthetic speech with known word boundaries."""

from __future__ import annotations

import time
from statistics import median

from ..voice.asr import WhisperASR
from ..voice.events import EndOfUtterance, SpokenMessage, Word, WordsCommitted, words_text
from ..voice.metrics import boundary_errors, mean_or_none, word_error_rate
from ..voice.offline import transcribe_blocks
from ..voice.streaming import ReplayClock, StreamingConfig, StreamingTranscriber, replay
from ..voice.synthetic import SENTENCE_SETS, SyntheticSpeech, synthesize


class AsrBenchmark:
    def __init__(self, asr: WhisperASR, sentence_set: str = "clean", limit: int | None = None):
        self.asr = asr
        texts = SENTENCE_SETS[sentence_set][:limit]
        self.speech = [synthesize(text, seed=i) for i, text in enumerate(texts)]
        self.count = len(self.speech)

    def run(self, mode: str) -> dict:
        """Every sentence, refined and raw; WER and times from the refined run."""
        refined = [self._recognise(s, mode, refine=True) for s in self.speech]
        raw = [self._recognise(s, mode, refine=False) for s in self.speech]
        result = _scores(self.speech, [words for words, _ in refined], "")
        result |= _scores(self.speech, [words for words, _ in raw], "raw_")
        result["rtf"] = sum(c for _, c in refined) / sum(s.duration for s in self.speech)
        if mode == "stream":
            latencies = [w.committed_at - w.end for words, _ in refined for w in words]
            result["median_commit_latency_s"] = median(latencies) if latencies else None
        return result

    def answer_latency(self, runtime) -> dict:
        """Each sentence streamed, then sent to a chat: the time from the end of the audio to
        the first answer token, on the stream's clock."""
        from ..conversation import Conversation
        from ..events import TextDelta
        from ..generation import GenerationRequest

        totals, finishes, ttfts = [], [], []
        for speech in self.speech:
            clock = ReplayClock()
            transcriber = StreamingTranscriber(self.asr, StreamingConfig(), clock)
            words: list[Word] = []
            for event in replay(transcriber, clock, [speech.audio]):
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
            totals.append(first_token - speech.duration)
            finishes.append(finished - speech.duration)
        return {
            "median_speech_end_to_first_token_s": median(totals),
            "median_finish_s": median(finishes),
            "median_ttft_s": median(ttfts),
        }

    def _recognise(self, speech: SyntheticSpeech, mode: str, refine: bool):
        """The words, and the compute seconds spent."""
        if mode == "offline":
            started = time.perf_counter()
            words = list(transcribe_blocks(self.asr, [speech.audio], refine_boundaries=refine))
            return words, time.perf_counter() - started
        clock = ReplayClock()
        transcriber = StreamingTranscriber(
            self.asr, StreamingConfig(refine_boundaries=refine), clock
        )
        events = replay(transcriber, clock, [speech.audio])
        words = [w for e in events if isinstance(e, WordsCommitted) for w in e.words]
        return words, transcriber.compute_s


def _scores(speech: list[SyntheticSpeech], recognised: list[list[Word]], prefix: str) -> dict:
    starts, ends = [], []
    errors = 0.0
    for truth, words in zip(speech, recognised, strict=True):
        errors += word_error_rate(truth.text, words_text(words)) * len(truth.words)
        matched = boundary_errors(words, truth.words)
        if matched:
            starts += matched[0]
            ends += matched[1]
    result = {
        f"{prefix}start_mae_s": mean_or_none(starts),
        f"{prefix}end_mae_s": mean_or_none(ends),
    }
    if not prefix:
        result["wer"] = errors / sum(len(t.words) for t in speech)
        result["timed_words"] = len(starts)
    return result


def _never() -> bool:
    return False
