"""LocalAgreement-2: commit the words that two consecutive hypotheses agree on.

Re-transcribing a growing buffer gives a new hypothesis each time; its last words are often
wrong because the speaker is still in the middle of them. A word is committed once two
hypotheses in a row contain it, after the same committed words (as in whisper_streaming).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from .events import Word

# A re-transcribed buffer still holds words that were committed before; words that end this
# close to the committed end, or before it, are those old words.
COMMITTED_OVERLAP_S = 0.1
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
        """Take a new hypothesis (words with stream times) and return the newly committed
        words, stamped with `now`. Only words that are `ready` can be committed."""
        fresh = self._beyond_committed(hypothesis)
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

    def _beyond_committed(self, hypothesis: list[Word]) -> list[Word]:
        end = self.committed_end
        fresh = [w for w in hypothesis if not self.committed or w.end > end + COMMITTED_OVERLAP_S]
        return self._drop_repeat(fresh)

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
            start = max(word.start, self.committed_end)
            end = max(word.end, start)
            committed = replace(word, start=start, end=end, committed_at=now)
            self.committed.append(committed)
            newly.append(committed)
        return newly
