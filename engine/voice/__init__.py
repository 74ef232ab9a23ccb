"""Voice input: audio decoding, Whisper speech recognition with word times on one stream clock,
streaming with LocalAgreement-2, boundary refinement, microphone capture and export."""

from .events import EndOfUtterance, PartialText, SpokenMessage, VoiceEvent, Word, WordsCommitted

__all__ = [
    "EndOfUtterance",
    "PartialText",
    "SpokenMessage",
    "VoiceEvent",
    "Word",
    "WordsCommitted",
]
