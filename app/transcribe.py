"""`miniapp transcribe FILE`, and the voice input of `miniapp chat` (--audio, --voice).

Offline by default (windows of up to 30 s, beam search); with --stream the file goes through
the streaming path in live-sized chunks, on a replay clock, so `committed_at` says when a live
stream would have committed each word.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from miniapp.engine.voice.asr import WhisperASR, load_asr
from miniapp.engine.voice.audio import SAMPLE_RATE, AudioFileError, iter_audio
from miniapp.engine.voice.events import (
    EndOfUtterance,
    PartialText,
    SpokenMessage,
    VoiceEvent,
    Word,
    WordsCommitted,
)
from miniapp.engine.voice.export import to_json, to_srt, to_vtt
from miniapp.engine.voice.microphone import Microphone, NoAudioDevice, check_input_device
from miniapp.engine.voice.offline import transcribe_blocks
from miniapp.engine.voice.streaming import (
    ReplayClock,
    StreamingConfig,
    StreamingTranscriber,
    replay,
)

FORMATS = {"json": to_json, "srt": to_srt, "vtt": to_vtt}


def run_transcribe(args: argparse.Namespace) -> int:
    blocks = iter_audio(args.file)
    first = next(blocks, None)  # a bad file fails here, before the model loads
    asr = load_asr(args.asr_model, args.threads)
    audio = _chain(first, blocks)
    plain = args.format is None
    if args.stream:
        words = _streamed(asr, audio, args, echo=plain)
    else:
        words = list(transcribe_blocks(asr, audio, refine_boundaries=not args.no_refine))
        if plain:
            print(" ".join(w.word for w in words))
    if not plain:
        print(FORMATS[args.format](words))
    return 0


def _streamed(asr, audio, args: argparse.Namespace, echo: bool) -> list[Word]:
    """Committed words; with `echo`, each utterance is printed as its words commit."""
    clock = ReplayClock()
    config = StreamingConfig(refine_boundaries=not args.no_refine)
    transcriber = StreamingTranscriber(asr, config, clock)
    words: list[Word] = []
    line_open = False
    for event in replay(transcriber, clock, audio, args.chunk):
        if isinstance(event, WordsCommitted):
            words += event.words
            if echo:
                sys.stdout.write(("" if not line_open else " ") + _text(event.words))
                sys.stdout.flush()
                line_open = True
        elif isinstance(event, EndOfUtterance) and echo and line_open:
            print()
            line_open = False
    if echo and line_open:
        print()
    return words


def _text(words) -> str:
    return " ".join(w.word for w in words)


def _chain(first, rest) -> Iterator:
    if first is not None:
        yield first
        yield from rest


def spoken_file(path: str, asr_model: str | None, threads: int | None) -> SpokenMessage:
    """`chat --audio FILE`: the file's transcript as a user message with its word times."""
    blocks = iter_audio(path)
    first = next(blocks, None)
    asr = load_asr(asr_model, threads)
    words = list(transcribe_blocks(asr, _chain(first, blocks)))
    if not words:
        raise AudioFileError(f"{path}: no speech found")
    return SpokenMessage.from_words(words)


class VoiceInput:
    """Push-to-talk for the terminal chat: Enter starts recording, Enter stops it."""

    def __init__(self, asr: WhisperASR | None, greeting: str) -> None:
        self.asr = asr
        self.greeting = greeting

    @property
    def available(self) -> bool:
        return self.asr is not None

    @classmethod
    def for_chat(cls, args: argparse.Namespace, interactive: bool) -> VoiceInput | None:
        if not args.voice:
            return None
        if not interactive:
            print(
                "miniapp: --voice needs a terminal; reading the message from stdin", file=sys.stderr
            )
            return None
        try:
            device = check_input_device()
        except NoAudioDevice as exc:
            return cls(None, f"voice input unavailable: {exc}. Type your messages instead.")
        asr = load_asr(args.asr_model, args.threads)
        return cls(asr, f"voice input: {device}. Enter on an empty line talks, Enter stops.")

    def record(self, out: TextIO) -> SpokenMessage | None:
        """One utterance from the microphone, shown while it is recognised."""
        out.write("(listening - Enter stops)\n")
        out.flush()
        transcriber = StreamingTranscriber(self.asr)
        events: list[VoiceEvent] = []
        stop = threading.Event()
        try:
            with Microphone() as mic:
                worker = threading.Thread(
                    target=_listen, args=(mic, transcriber, stop, events, out), daemon=True
                )
                worker.start()
                try:
                    input()
                finally:
                    stop.set()
                    worker.join()
                transcriber.insert_audio_chunk(mic.drain())
        except NoAudioDevice as exc:
            out.write(f"{exc}; type your message instead\n")
            return None
        events += transcriber.finish()
        words = [w for e in events if isinstance(e, WordsCommitted) for w in e.words]
        if not words:
            out.write("(no speech heard)\n")
            return None
        message = SpokenMessage.from_words(words)
        out.write(f"you said: {message.content}\n")
        out.flush()
        return message


def _listen(
    mic: Microphone,
    transcriber: StreamingTranscriber,
    stop: threading.Event,
    events: list[VoiceEvent],
    out: TextIO,
) -> None:
    """Feed the microphone to the transcriber every `chunk_s` of its config, showing the words
    so far (committed, then the partial tail)."""
    step = int(transcriber.config.chunk_s * SAMPLE_RATE)
    waiting = 0
    committed: list[str] = []
    while not stop.is_set():
        chunk = mic.read(timeout=0.05)
        if chunk is None:
            continue
        transcriber.insert_audio_chunk(chunk)
        waiting += len(chunk)
        if waiting < step:
            continue
        waiting = 0
        for event in transcriber.process_iter():
            events.append(event)
            if isinstance(event, WordsCommitted):
                committed += [w.word for w in event.words]
            if isinstance(event, PartialText | WordsCommitted):
                partial = event.text if isinstance(event, PartialText) else ""
                out.write("\r\033[K" + " ".join([*committed, partial]).strip())
                out.flush()
    out.write("\r\033[K")
