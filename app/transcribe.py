"""`miniapp transcribe FILE`: a recording's words with their times.

Offline by default (windows of up to 30 s, beam search); with --stream the file goes through
the streaming path in live-sized chunks, on a replay clock, so `committed_at` says when a live
stream would have committed each word.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from miniapp.engine.voice.asr import load_asr
from miniapp.engine.voice.audio import iter_audio
from miniapp.engine.voice.events import EndOfUtterance, Word, WordsCommitted
from miniapp.engine.voice.export import to_json, to_srt, to_vtt
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
