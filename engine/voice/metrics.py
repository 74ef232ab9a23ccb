"""Scores for recognised words against the truth: word error rate and boundary error."""

from __future__ import annotations

import re
from collections.abc import Sequence
from statistics import mean

from num2words import num2words

from .agreement import normalize, prefix_edit_distances
from .events import Word

# "42", "12:30", "3.5": numbers are compared as words, however they were written.
_NUMBER = re.compile(r"\d+(?:[.:]\d+)?")
_WORD_SEPARATORS = re.compile(r"[-–—/]")


def normalized_words(text: str) -> list[str]:
    """Lower case, punctuation gone, numbers spelled out ("12:30" as "twelve thirty"): what
    WER compares."""
    words: list[str] = []
    for part in _WORD_SEPARATORS.sub(" ", _NUMBER.sub(_spelled, text)).split():
        if word := normalize(part):
            words.append(word)
    return words


def _spelled(number: re.Match) -> str:
    text = number.group()
    if ":" in text:  # a time: "12:30" is said "twelve thirty"
        return " ".join(num2words(int(part)) for part in text.split(":"))
    return f" {num2words(float(text) if '.' in text else int(text))} "


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, by edit distance."""
    ref, hyp = normalized_words(reference), normalized_words(hypothesis)
    return prefix_edit_distances(ref, hyp)[-1] / max(1, len(ref))


def matched_words(words: Sequence[Word], truth: Sequence[Word]) -> list[tuple[Word, int]]:
    """The recognised words that match a true word, each with that word's index, by an
    alignment of least edit distance (a word matches when both spell the same after
    normalising, numbers included)."""
    said = [" ".join(normalized_words(w.word)) for w in words]
    true = [" ".join(normalized_words(w.word)) for w in truth]
    # cost[i][j]: edit distance between said[i:] and true[j:]
    cost = [[0] * (len(true) + 1) for _ in range(len(said) + 1)]
    for i in range(len(said), -1, -1):
        for j in range(len(true), -1, -1):
            if i == len(said) or j == len(true):
                cost[i][j] = (len(said) - i) + (len(true) - j)
            else:
                cost[i][j] = min(
                    cost[i + 1][j] + 1,
                    cost[i][j + 1] + 1,
                    cost[i + 1][j + 1] + (said[i] != true[j]),
                )
    pairs, i, j = [], 0, 0
    while i < len(said) and j < len(true):
        if said[i] == true[j] and cost[i][j] == cost[i + 1][j + 1]:
            pairs.append((words[i], j))
            i, j = i + 1, j + 1
        elif cost[i][j] == cost[i + 1][j + 1] + 1:
            i, j = i + 1, j + 1
        elif cost[i][j] == cost[i + 1][j] + 1:
            i += 1
        else:
            j += 1
    return pairs


def boundary_errors(words: Sequence[Word], truth: Sequence[Word]) -> tuple[list, list] | None:
    """Absolute start and end errors word by word, or None when the words do not match the
    truth one to one (times of misrecognised words are not comparable)."""
    if normalized_words(" ".join(w.word for w in words)) != normalized_words(
        " ".join(w.word for w in truth)
    ):
        return None
    starts = [abs(w.start - t.start) for w, t in zip(words, truth, strict=True)]
    ends = [abs(w.end - t.end) for w, t in zip(words, truth, strict=True)]
    return starts, ends


def mean_or_none(values: Sequence[float]) -> float | None:
    return mean(values) if values else None
