"""Word edges snapped to where the sound starts and stops.

Whisper's word times come from cross-attention alignment, which smears a word's edges into
the pauses around it and often shifts them late by most of a pause (on tiny.en, ~0.2 s on
average). The signal itself knows better: in a pause the energy drops to the noise floor.
The audio is cut into speech regions at pauses; each word is assigned to one region, in order,
so that the words overlap their regions as much as possible (a small dynamic programme, on
times less Whisper's lag: without it, a short word that ends a phrase and that Whisper smeared
over the pause went to the next phrase, a second late). The first word of a region then
starts where the region starts and the last one ends where it ends. Words spoken without a
pause between them share a region: the edges between them have no pause to snap to and keep
Whisper's estimate, less its measured lag (kept in order and inside the region); where the
sound dips near that estimate (a stop's closure, a weak consonant), the edge moves to the dip.
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
# Whisper's alignment places the edges between words spoken without a pause off by each
# model's own lag, which such edges are moved back by: tiny.en's are late by 85 ms (median,
# both starts and ends) on the clean tuning sentences spoken as connected speech with their
# espeak-ng word events as the truth, base's early by 55 ms (`model_store`'s figures, carried
# by `WhisperASR.alignment_lag_s`).
# An edge between connected words moves to the quietest frame within DIP_SEARCH_S of it
# (and at least DIP_MARGIN_S inside both words) when that frame is DIP_DEPTH_DB below the
# loudest one around. On the clean tuning sentences spoken connected by espeak-ng, this took
# the offline boundary error from 39 / 42 ms to 34 / 37 ms (starts / ends).
DIP_SEARCH_S = 0.05
DIP_MARGIN_S = 0.02
DIP_DEPTH_DB = 10.0
DIP_AROUND_FRAMES = 10  # "around": this many frames either side of the search
CONNECTED_WITHIN_S = 0.01  # words this close are spoken connected


@dataclass(frozen=True)
class Region:
    start: float
    end: float


def speech_regions(audio: np.ndarray, offset: float = 0.0) -> list[Region]:
    """Stretches of `audio` above the energy threshold, pauses shorter than MIN_PAUSE_S closed."""
    return _regions(frame_levels_db(audio), offset)


def _regions(levels: np.ndarray, offset: float) -> list[Region]:
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


def refine_words(
    words: list[Word], audio: np.ndarray, offset: float = 0.0, *, lag: float
) -> list[Word]:
    """`words` (times on the clock where `audio` starts at `offset`, from a model whose inner
    edges run `lag` seconds late) with edges snapped to the speech regions of `audio`; the
    result stays in order and never overlaps."""
    if not words:
        return []
    levels = frame_levels_db(audio)
    regions = _regions(levels, offset)
    owners = _assign(words, regions, lag) if regions else [None] * len(words)
    refined: list[Word] = []
    previous_end = -np.inf
    for i, word in enumerate(words):
        start, end = word.start, word.end
        region = regions[owners[i]] if owners[i] is not None else None
        if region is not None:
            first = i == 0 or owners[i - 1] != owners[i]
            last = i + 1 == len(words) or owners[i + 1] != owners[i]
            start = region.start if first else _inside(start - lag, region)
            end = region.end if last else _inside(end - lag, region)
        start = max(start, previous_end)
        end = max(end, start)
        refined.append(replace(word, start=start, end=end))
        previous_end = end
    return _edges_at_dips(refined, owners, levels, offset)


def _edges_at_dips(
    words: list[Word], owners: list[int | None], levels: np.ndarray, offset: float
) -> list[Word]:
    """Edges between connected words (same region, no gap) moved to a nearby dip."""
    words = list(words)
    for i in range(len(words) - 1):
        before, after = words[i], words[i + 1]
        if owners[i] is None or owners[i] != owners[i + 1]:
            continue
        if abs(after.start - before.end) > CONNECTED_WITHIN_S:
            continue
        edge = _dip_near(before.end, before.start, after.end, levels, offset)
        words[i] = replace(before, end=edge)
        words[i + 1] = replace(after, start=edge)
    return words


def _dip_near(
    edge: float, earliest: float, latest: float, levels: np.ndarray, offset: float
) -> float:
    """The quietest moment within DIP_SEARCH_S of `edge` and DIP_MARGIN_S inside
    (`earliest`, `latest`), if it is deep enough; else `edge`."""

    def frame(t: float) -> int:
        return int((t - offset) / FRAME_S)

    low = max(frame(edge - DIP_SEARCH_S), frame(earliest + DIP_MARGIN_S), 0)
    high = min(frame(edge + DIP_SEARCH_S), frame(latest - DIP_MARGIN_S), len(levels))
    if high - low < 2:
        return edge
    quietest = low + int(np.argmin(levels[low:high]))
    around = levels[max(0, low - DIP_AROUND_FRAMES) : high + DIP_AROUND_FRAMES]
    if around.max() - levels[quietest] < DIP_DEPTH_DB:
        return edge
    return offset + (quietest + 0.5) * FRAME_S


def _inside(time: float, region: Region) -> float:
    return min(max(time, region.start), region.end)


def _assign(words: list[Word], regions: list[Region], lag: float) -> list[int | None]:
    """For each word, the region it belongs to: region indices never decrease along the words,
    and the summed overlap of words with their regions is the largest possible. A word that
    overlaps no region at all (its region is None) is left as Whisper placed it. Overlaps are
    measured on the words' times less the model's `lag`."""
    overlap = np.array(
        [
            [max(0.0, min(w.end - lag, r.end) - max(w.start - lag, r.start)) for r in regions]
            for w in words
        ]
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


def frame_levels_db(audio: np.ndarray) -> np.ndarray:
    """The level of each FRAME_S frame of `audio`, in dB (full scale 0), at least SILENCE_DB."""
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
