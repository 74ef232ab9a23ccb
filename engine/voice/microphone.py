"""The microphone, through sounddevice (PortAudio): 16 kHz mono float32 chunks on a queue."""

from __future__ import annotations

import os
import queue

import numpy as np

from ..errors import MiniappError
from .audio import SAMPLE_RATE

# Set to "none" to act as if there were no input device (tests, or to force text input).
DEVICES_ENV = "MINIAPP_AUDIO_INPUT"
BLOCK_S = 0.1  # PortAudio callback size: small, so stopping is immediate


class NoAudioDevice(MiniappError):
    """No microphone (or no PortAudio) on this machine."""


def check_input_device() -> str:
    """The default input device's name; NoAudioDevice when there is none."""
    if os.environ.get(DEVICES_ENV, "").lower() == "none":
        raise NoAudioDevice(f"no audio input device ({DEVICES_ENV}=none)")
    sd = _sounddevice()
    try:
        device = sd.query_devices(kind="input")
    except (sd.PortAudioError, ValueError):
        raise NoAudioDevice("no audio input device found") from None
    if not device or device.get("max_input_channels", 0) < 1:
        raise NoAudioDevice("no audio input device found")
    return str(device["name"])


class Microphone:
    """Records while open: `with Microphone() as mic: chunk = mic.read(timeout)`."""

    def __init__(self, block_s: float = BLOCK_S) -> None:
        self._block = int(block_s * SAMPLE_RATE)
        self._chunks: queue.Queue[np.ndarray] = queue.Queue()
        self._stream = None

    def __enter__(self) -> Microphone:
        check_input_device()
        sd = _sounddevice()
        try:
            self._stream = sd.InputStream(
                samplerate=SAMPLE_RATE,
                channels=1,
                dtype="float32",
                blocksize=self._block,
                callback=self._on_audio,
            )
            self._stream.start()
        except sd.PortAudioError as exc:
            raise NoAudioDevice(f"cannot open the audio input device ({exc})") from None
        return self

    def __exit__(self, *exc_info) -> None:
        if self._stream is not None:
            self._stream.stop()
            self._stream.close()
            self._stream = None

    def read(self, timeout: float | None = None) -> np.ndarray | None:
        """The next recorded chunk, or None if none arrived within `timeout`."""
        try:
            return self._chunks.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> np.ndarray:
        """Everything recorded and not yet read."""
        parts = []
        while True:
            try:
                parts.append(self._chunks.get_nowait())
            except queue.Empty:
                break
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def _on_audio(self, data, frames, time_info, status) -> None:
        # Runs on PortAudio's thread: copy (the buffer is reused) and hand over.
        self._chunks.put(data[:, 0].copy())


def _sounddevice():
    try:
        import sounddevice
    except OSError:  # the Python package is there, the PortAudio library is not
        raise NoAudioDevice(
            "no audio input: the PortAudio library is missing (Debian: apt-get install "
            "libportaudio2)"
        ) from None
    return sounddevice
