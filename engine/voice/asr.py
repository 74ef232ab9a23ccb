"""Whisper speech recognition with word times (faster-whisper's CTranslate2 model).

`WhisperASR.transcribe` decodes one window of audio (at most 30 s) and returns its words with
start and end times on the caller's clock (`offset` + seconds into the window). It runs the
encoder on a context only as long as the window needs, in steps of `CONTEXT_STEP_S`, instead
of always padding to 30 s: on a few seconds of audio that makes the encoder ~8x cheaper, which
is what lets streaming re-transcribe its buffer several times a second. Word times come from
the model's cross-attention alignment heads (DTW), as in faster-whisper.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFileError
from .audio import SAMPLE_RATE
from .events import Word

log = logging.getLogger(__name__)

MAX_WINDOW_S = 30.0  # Whisper's encoder sees at most 30 s
CONTEXT_STEP_S = 5.0  # the encoder's context grows in these steps
MIN_CONTEXT_S = 10.0  # shorter contexts start to cost accuracy on tiny.en
CONTEXT_MARGIN_S = 1.0  # silence after the audio, so the last word is not at the very edge
FRAMES_PER_SECOND = 100  # mel frames (hop of 160 samples)
SAMPLES_PER_FRAME = SAMPLE_RATE // FRAMES_PER_SECOND
MAX_PROMPT_TOKENS = 223  # half of Whisper's 448-token window, less the <|startofprev|> token
MAX_NEW_TOKENS = 200
# faster-whisper's hallucination checks: a too repetitive text, or "no speech" with low
# confidence, is not a transcript.
COMPRESSION_RATIO_LIMIT = 2.4
NO_SPEECH_LIMIT = 0.6
LOG_PROB_LIMIT = -1.0
RETRY_BEAM_SIZE = 5
RETRY_NO_REPEAT_NGRAM = 3
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
DEFAULT_THREADS = min(4, os.cpu_count() or 1)
LANGUAGE = "en"


@dataclass(frozen=True)
class _Decoded:
    tokens: list[int]
    avg_log_prob: float
    no_speech_prob: float
    compression_ratio: float

    def is_hallucination(self) -> bool:
        silent = self.no_speech_prob > NO_SPEECH_LIMIT and self.avg_log_prob < LOG_PROB_LIMIT
        return silent or self.compression_ratio > COMPRESSION_RATIO_LIMIT


class WhisperASR:
    """A loaded faster-whisper model. Not thread-safe: use one per thread.

    `alignment_lag_s` is how late the model's alignment places the edges between connected
    words (it differs from model to model; see `boundaries`); 0 leaves them where they are."""

    def __init__(
        self,
        model_dir: Path,
        threads: int | None = None,
        compute_type: str = "int8",
        alignment_lag_s: float = 0.0,
    ) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        self.model_dir = Path(model_dir)
        self.threads = threads or DEFAULT_THREADS
        self.alignment_lag_s = alignment_lag_s
        try:
            self._whisper = WhisperModel(
                str(self.model_dir),
                device="cpu",
                compute_type=compute_type,
                cpu_threads=self.threads,
                local_files_only=True,
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise ModelFileError(self.model_dir, f"cannot load the speech model ({exc})") from None
        self._tokenizer = Tokenizer(
            self._whisper.hf_tokenizer,
            self._whisper.model.is_multilingual,
            task="transcribe",
            language=LANGUAGE,
        )
        from faster_whisper.transcribe import get_suppressed_tokens

        self._suppressed = get_suppressed_tokens(self._tokenizer, [-1])
        # The latest window's decoding (its tokens and confidence figures), for callers that
        # report them (the API's verbose_json); None when that window gave no words.
        self.last_decode: _Decoded | None = None

    def transcribe(
        self, audio: np.ndarray, prompt: str = "", offset: float = 0.0, beam_size: int = 1
    ) -> list[Word]:
        """Words in `audio` (16 kHz mono float32, at most 30 s), times shifted by `offset`."""
        if len(audio) > MAX_WINDOW_S * SAMPLE_RATE:
            raise ValueError(f"a window is at most {MAX_WINDOW_S} s")
        self.last_decode = None
        content_frames = len(audio) // SAMPLES_PER_FRAME
        if content_frames == 0:
            return []
        encoder_output = self._encode(audio)
        prompt_tokens = self._prompt_tokens(prompt)
        decoded = self._decode(encoder_output, prompt_tokens, beam_size)
        if decoded.is_hallucination():
            decoded = self._decode(
                encoder_output, prompt_tokens, RETRY_BEAM_SIZE, RETRY_NO_REPEAT_NGRAM
            )
            if decoded.is_hallucination():
                log.debug("dropped a transcript that looks hallucinated")
                return []
        self.last_decode = decoded
        return self._words(decoded.tokens, encoder_output, content_frames, offset)

    def text_tokens(self, text: str) -> list[int]:
        """The token ids Whisper writes `text` with (after a space, as within a transcript)."""
        return self._tokenizer.encode(" " + text.strip())

    def _encode(self, audio: np.ndarray):
        context_s = _context_seconds(len(audio) / SAMPLE_RATE)
        context_samples = int(context_s * SAMPLE_RATE)
        padded = np.zeros(context_samples, dtype=np.float32)
        padded[: len(audio)] = audio
        features = self._whisper.feature_extractor(padded)[:, : int(context_s * FRAMES_PER_SECOND)]
        return self._whisper.encode(np.ascontiguousarray(features))

    def _prompt_tokens(self, prompt: str) -> list[int]:
        tokens: list[int] = []
        prompt = prompt.strip()
        if prompt:
            previous = self._tokenizer.encode(" " + prompt)[-MAX_PROMPT_TOKENS:]
            tokens = [self._tokenizer.sot_prev, *previous]
        return [*tokens, *self._tokenizer.sot_sequence, self._tokenizer.no_timestamps]

    def _decode(
        self, encoder_output, prompt: list[int], beam_size: int, no_repeat_ngram: int = 0
    ) -> _Decoded:
        from faster_whisper.transcribe import get_compression_ratio

        result = self._whisper.model.generate(
            encoder_output,
            [prompt],
            beam_size=beam_size,
            max_length=len(prompt) + MAX_NEW_TOKENS,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=self._suppressed,
            no_repeat_ngram_size=no_repeat_ngram,
        )[0]
        tokens = [t for t in result.sequences_ids[0] if t < self._tokenizer.eot]
        # The score is the length-normalised log probability (length penalty 1).
        avg_log_prob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        text = self._tokenizer.decode(tokens).strip()
        return _Decoded(
            tokens, avg_log_prob, result.no_speech_prob, get_compression_ratio(text) if text else 0
        )

    def _words(self, tokens: list[int], encoder_output, frames: int, offset: float) -> list[Word]:
        if not tokens:
            return []
        from faster_whisper.transcribe import merge_punctuations

        alignment = self._whisper.find_alignment(self._tokenizer, [tokens], encoder_output, frames)
        timings = alignment[0] if alignment else []
        merge_punctuations(timings, PREPEND_PUNCTUATION, APPEND_PUNCTUATION)
        window_end = frames / FRAMES_PER_SECOND
        words = []
        for timing in timings:
            text = timing["word"].strip()
            if not text:
                continue
            start = min(float(timing["start"]), window_end)
            end = min(max(float(timing["end"]), start), window_end)
            probability = float(timing["probability"])
            words.append(Word(text, offset + start, offset + end, probability=probability))
        return words


def load_asr(model: str | None = None, threads: int | None = None) -> WhisperASR:
    """The bundled tiny.en (model None), another bundled speech model by name, or a
    faster-whisper model folder."""
    from ..modelfile.store import asr_alignment_lag, resolve_asr_model

    path = resolve_asr_model(model)
    return WhisperASR(path, threads=threads, alignment_lag_s=asr_alignment_lag(path))


def _context_seconds(audio_seconds: float) -> float:
    steps = math.ceil((audio_seconds + CONTEXT_MARGIN_S) / CONTEXT_STEP_S)
    return min(MAX_WINDOW_S, max(MIN_CONTEXT_S, steps * CONTEXT_STEP_S))
