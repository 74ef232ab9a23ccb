"""LocalAgreement-2: commit the words that two consecutive hypotheses agree on.

Re-transcribing a growing buffer gives a new hypothesis each time; its last words are often
wrong because the speaker is still in the middle of them. A word is committed once two
hypotheses in a row contain it, after the same committed words (as in whisper_streaming).

The recogniser re-transcribes the whole buffer, committed words included, so each hypothesis
is first split where the committed words end (`after_committed`): by the alignment of least
edit distance between its words and the committed ones. Splitting by time instead lost short
words at the seam: a committed word's end is an estimate, and "the" after it can end within
0.1 s of it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from .events import Word

# At the seam between committed words and the new hypothesis, Whisper may repeat up to this
# many committed words (with slightly different times); such a repeat is dropped.
MAX_REPEATED_WORDS = 5
REPEAT_WITHIN_S = 1.0

_NOT_A_LETTER = re.compile(r"[^\w']+")


def same_word(a: Word, b: Word) -> bool:
    """Words match if they spell the same, ignoring case and punctuation."""
    return normalize(a.word) == normalize(b.word)


def normalize(text: str) -> str:
    return _NOT_A_LETTER.sub("", text.lower())


def prefix_edit_distances(reference: list[str], hypothesis: list[str]) -> list[int]:
    """For each k, the edit distance (in words) between `reference` and hypothesis[:k]."""
    distance = list(range(len(hypothesis) + 1))
    for word in reference:
        previous, distance = distance, [distance[0] + 1]
        for k, other in enumerate(hypothesis, start=1):
            distance.append(
                min(previous[k] + 1, distance[k - 1] + 1, previous[k - 1] + (word != other))
            )
    return distance


def after_committed(hypothesis: list[Word], committed: list[Word]) -> list[Word]:
    """The words of `hypothesis` (a transcript of audio that starts with the `committed`
    words) that follow the committed ones: after its first k words, for the k whose text is
    closest to the committed text; of equally close splits, the one nearest in time.

    Where the split ends on the last committed word itself, everything after it is new, and
    starts no earlier than the committed end: a word committed while it was last in its
    hypothesis can have its end stretched over the audio that followed ("film" to 5.70 s,
    when "about" ends at 5.69 s). Otherwise a word after the split that ends before the
    committed end is a committed word heard again differently, and is dropped."""
    if not committed:
        return hypothesis
    distance = prefix_edit_distances(
        [normalize(w.word) for w in committed], [normalize(w.word) for w in hypothesis]
    )
    end = committed[-1].end

    def mismatch(k: int) -> tuple[int, float]:
        seam = hypothesis[k - 1].end if k else hypothesis[0].start
        return distance[k], abs(seam - end)

    split = min(range(len(distance)), key=mismatch)
    after = hypothesis[split:]
    if split and same_word(hypothesis[split - 1], committed[-1]):
        return [_not_before(word, end) for word in after]
    while after and after[0].end <= end:
        after = after[1:]
    return after


def _not_before(word: Word, time: float) -> Word:
    """`word`, moved to start no earlier than `time` and to end no earlier than it starts."""
    start = max(word.start, time)
    return replace(word, start=start, end=max(word.end, start))


class LocalAgreement:
    def __init__(self) -> None:
        # Only the last few committed words are needed here (callers keep the transcript).
        self.committed: deque[Word] = deque(maxlen=MAX_REPEATED_WORDS)
        self.pending: list[Word] = []  # the last hypothesis, less what was committed

    @property
    def committed_end(self) -> float:
        return self.committed[-1].end if self.committed else 0.0

    def update(
        self, hypothesis: list[Word], now: float, ready: Callable[[Word], bool] = lambda w: True
    ) -> list[Word]:
        """Take a new hypothesis of what follows the committed words (words with stream
        times, see `after_committed`) and return the newly committed words, stamped with
        `now`. Only words that are `ready` can be committed."""
        fresh = self._drop_repeat(hypothesis)
        agreed = 0
        while (
            agreed < len(fresh)
            and agreed < len(self.pending)
            and ready(fresh[agreed])
            and same_word(fresh[agreed], self.pending[agreed])
        ):
            agreed += 1
        newly = self._commit(fresh[:agreed], now)
        self.pending = fresh[agreed:]
        return newly

    def flush(self, now: float) -> list[Word]:
        """Commit everything pending (the speaker stopped: there is no next hypothesis)."""
        newly = self._commit(self.pending, now)
        self.pending = []
        return newly

    def _drop_repeat(self, fresh: list[Word]) -> list[Word]:
        """Drop the first n words of `fresh` if they repeat the last n committed words."""
        if not fresh or not self.committed:
            return fresh
        if fresh[0].start - self.committed_end > REPEAT_WITHIN_S:
            return fresh
        for n in range(min(MAX_REPEATED_WORDS, len(fresh), len(self.committed)), 0, -1):
            tail = list(self.committed)[-n:]
            if all(same_word(a, b) for a, b in zip(tail, fresh[:n], strict=True)):
                return fresh[n:]
        return fresh

    def _commit(self, words: list[Word], now: float) -> list[Word]:
        """Stamp and append `words`, keeping times in order and without overlap."""
        newly = []
        for word in words:
            committed = replace(_not_before(word, self.committed_end), committed_at=now)
            self.committed.append(committed)
            newly.append(committed)
        return newly
