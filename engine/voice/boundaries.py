"""Word edges snapped to where the sound starts and stops.

Whisper's word times come from cross-attention alignment, which smears a word's edges into
the pauses around it and often shifts them late by most of a pause (on tiny.en, ~0.2 s on
average). The signal itself knows better: in a pause the energy drops to the noise floor.
The audio is cut into speech regions at pauses; each word is assigned to one region, in order,
so that the words overlap their regions as much as possible (a small dynamic programme); the
first word of a region then starts where the region starts and the last one ends where it
ends. Words spoken without a pause between them share a region: the edges between them have
nothing to snap to and keep Whisper's estimate, less its measured lag (kept in order and
inside the region).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .audio import SAMPLE_RATE
from .events import Word

FRAME_S = 0.005  # energy resolution
FRAME_SAMPLES = int(FRAME_S * SAMPLE_RATE)
# Speech is louder than DYNAMIC_RANGE_DB below the window's loud frames, and louder than the
# noise floor by FLOOR_MARGIN_DB (the floor matters on real microphones; synthetic silence has
# none).
DYNAMIC_RANGE_DB = 40.0
FLOOR_MARGIN_DB = 12.0
LOUD_PERCENTILE = 99
FLOOR_PERCENTILE = 10
SILENCE_DB = -100.0
# Gaps shorter than this are inside words (stop consonants close for up to ~0.1 s).
MIN_PAUSE_S = 0.12
MIN_REGION_S = 0.03  # shorter bursts are clicks
# Whisper's alignment places the edges between words spoken without a pause late: by 85 ms
# (median, both starts and ends) on the clean tuning sentences spoken as connected speech
# with their espeak-ng word events as the truth. Such edges are moved back by that much.
ALIGNMENT_LAG_S = 0.085


@dataclass(frozen=True)
class Region:
    start: float
    end: float


def speech_regions(audio: np.ndarray, offset: float = 0.0) -> list[Region]:
    """Stretches of `audio` above the energy threshold, pauses shorter than MIN_PAUSE_S closed."""
    levels = _frame_levels_db(audio)
    if len(levels) == 0:
        return []
    loud = levels >= _threshold_db(levels)
    regions = _runs(loud)
    regions = _close_short_gaps(regions, round(MIN_PAUSE_S / FRAME_S))
    min_frames = round(MIN_REGION_S / FRAME_S)
    return [
        Region(offset + a * FRAME_S, offset + b * FRAME_S)
        for a, b in regions
        if b - a >= min_frames
    ]


def refine_words(words: list[Word], audio: np.ndarray, offset: float = 0.0) -> list[Word]:
    """`words` (times on the clock where `audio` starts at `offset`) with edges snapped to the
    speech regions of `audio`; the result stays in order and never overlaps."""
    if not words:
        return []
    regions = speech_regions(audio, offset)
    owners = _assign(words, regions) if regions else [None] * len(words)
    refined: list[Word] = []
    previous_end = -np.inf
    for i, word in enumerate(words):
        start, end = word.start, word.end
        region = regions[owners[i]] if owners[i] is not None else None
        if region is not None:
            first = i == 0 or owners[i - 1] != owners[i]
            last = i + 1 == len(words) or owners[i + 1] != owners[i]
            start = region.start if first else _inside(start - ALIGNMENT_LAG_S, region)
            end = region.end if last else _inside(end - ALIGNMENT_LAG_S, region)
        start = max(start, previous_end)
        end = max(end, start)
        refined.append(replace(word, start=start, end=end))
        previous_end = end
    return refined


def _inside(time: float, region: Region) -> float:
    return min(max(time, region.start), region.end)


def _assign(words: list[Word], regions: list[Region]) -> list[int | None]:
    """For each word, the region it belongs to: region indices never decrease along the words,
    and the summed overlap of words with their regions is the largest possible. A word that
    overlaps no region at all (its region is None) is left as Whisper placed it."""
    overlap = np.array(
        [[max(0.0, min(w.end, r.end) - max(w.start, r.start)) for r in regions] for w in words]
    )
    best = np.zeros_like(overlap)  # best total for words[:i+1] with word i in region j
    came_from = np.zeros(overlap.shape, dtype=np.int64)
    best[0] = overlap[0]
    for i in range(1, len(words)):
        running = np.maximum.accumulate(best[i - 1])  # best over regions j' <= j
        where = _running_argmax(best[i - 1])
        best[i] = overlap[i] + running
        came_from[i] = where
    owners: list[int | None] = [0] * len(words)
    owners[-1] = int(np.argmax(best[-1]))
    for i in range(len(words) - 1, 0, -1):
        owners[i - 1] = int(came_from[i][owners[i]])
    return [j if overlap[i][j] > 0 else None for i, j in enumerate(owners)]


def _running_argmax(values: np.ndarray) -> np.ndarray:
    """For each j, the index of the largest of values[:j+1] (the first one on ties)."""
    where = np.zeros(len(values), dtype=np.int64)
    for j in range(1, len(values)):
        where[j] = j if values[j] > values[where[j - 1]] else where[j - 1]
    return where


def _frame_levels_db(audio: np.ndarray) -> np.ndarray:
    frames = len(audio) // FRAME_SAMPLES
    if frames == 0:
        return np.zeros(0)
    power = np.mean(np.square(audio[: frames * FRAME_SAMPLES].reshape(frames, -1)), axis=1)
    return np.maximum(10 * np.log10(power + 1e-12), SILENCE_DB)


def _threshold_db(levels: np.ndarray) -> float:
    loud = np.percentile(levels, LOUD_PERCENTILE)
    floor = np.percentile(levels, FLOOR_PERCENTILE)
    return max(loud - DYNAMIC_RANGE_DB, floor + FLOOR_MARGIN_DB)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) frame index pairs of the True runs."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    changes = np.flatnonzero(np.diff(padded))
    return list(zip(changes[0::2].tolist(), changes[1::2].tolist(), strict=True))


def _close_short_gaps(runs: list[tuple[int, int]], min_gap: int) -> list[tuple[int, int]]:
    closed: list[tuple[int, int]] = []
    for start, end in runs:
        if closed and start - closed[-1][1] < min_gap:
            closed[-1] = (closed[-1][0], end)
        else:
            closed.append((start, end))
    return closed
