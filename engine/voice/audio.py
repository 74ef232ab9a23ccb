"""Audio files in, 16 kHz mono float32 out, decoded as a stream of blocks.

PyAV (FFmpeg's libraries, bundled in its wheel) reads any format FFmpeg reads. Files are never
decoded whole: `iter_audio` yields fixed-size blocks, so an hours-long file costs the memory
of one block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

from ..errors import InputFileError

SAMPLE_RATE = 16_000  # what Whisper and Silero VAD expect
BLOCK_SECONDS = 30.0
# FFmpeg hands out frames of arbitrary sizes; asking the resampler for packed float32 mono
# keeps the conversion in FFmpeg rather than in numpy.
_RESAMPLER_FORMAT = "flt"


class AudioFileError(InputFileError):
    """An audio file that is missing, unreadable, or in a format FFmpeg does not decode."""


def iter_audio(path: Path | str, block_seconds: float = BLOCK_SECONDS) -> Iterator[np.ndarray]:
    """The file's audio as 16 kHz mono float32 blocks of `block_seconds` (the last shorter)."""
    path = Path(path)
    block_samples = max(1, int(block_seconds * SAMPLE_RATE))
    pending: list[np.ndarray] = []
    pending_samples = 0
    for samples in _decoded_frames(path):
        pending.append(samples)
        pending_samples += len(samples)
        while pending_samples >= block_samples:
            joined = np.concatenate(pending)
            yield joined[:block_samples]
            rest = joined[block_samples:]
            pending, pending_samples = [rest], len(rest)
    if pending_samples:
        yield np.concatenate(pending)


def read_audio(path: Path | str) -> np.ndarray:
    """A whole (short) file; long files should go through `iter_audio`."""
    blocks = list(iter_audio(path))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)


def duration_of(samples: np.ndarray | int) -> float:
    count = samples if isinstance(samples, int) else len(samples)
    return count / SAMPLE_RATE


def _decoded_frames(path: Path) -> Iterator[np.ndarray]:
    if not path.exists():
        raise AudioFileError(f"{path}: file not found")
    if path.is_dir():
        raise AudioFileError(f"{path}: is a folder, not an audio file")
    try:
        container = av.open(str(path), mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        reason = _reason(exc)
        raise AudioFileError(f"{path}: not an audio file FFmpeg can read ({reason})") from None
    with container:
        if not container.streams.audio:
            raise AudioFileError(f"{path}: has no audio stream")
        resampler = av.AudioResampler(format=_RESAMPLER_FORMAT, layout="mono", rate=SAMPLE_RATE)
        try:
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    yield out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
            for out in resampler.resample(None):  # what the resampler still holds
                yield out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
        except av.error.FFmpegError as exc:
            raise AudioFileError(f"{path}: cannot decode ({_reason(exc)})") from None


def _reason(exc: av.error.FFmpegError) -> str:
    return getattr(exc, "strerror", None) or str(exc)
