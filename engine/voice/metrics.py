"""Scores for recognised words against the truth: word error rate and boundary error."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean

from .agreement import normalize
from .events import Word


def normalized_words(text: str) -> list[str]:
    """Lower case, punctuation gone: what WER compares."""
    return [w for w in (normalize(part) for part in text.split()) if w]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, by edit distance."""
    ref, hyp = normalized_words(reference), normalized_words(hypothesis)
    previous = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, start=1):
        current = [i]
        for j, hyp_word in enumerate(hyp, start=1):
            current.append(
                min(
                    previous[j] + 1,  # deletion
                    current[j - 1] + 1,  # insertion
                    previous[j - 1] + (ref_word != hyp_word),  # substitution or match
                )
            )
        previous = current
    return previous[-1] / max(1, len(ref))


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
