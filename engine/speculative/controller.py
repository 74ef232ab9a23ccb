"""When to draft, and how many tokens: a cost model measured while generating.

Verifying k drafted tokens runs the full model over k + 1 rows, which on a CPU costs far more
than one decode step (and each early-exit draft costs a fraction of a step too). So the
controller keeps two things up to date: each drafter's per-token acceptance rate (a decayed
count) and the measured seconds of plain steps, verifications by row count and drafts.
With acceptance a, k drafts yield 1 + a + ... + a^k tokens per verification; it picks the k
with the best tokens per second, and a plain step when no k beats plain decoding by
`MIN_GAIN`. While drafting is off it still probes now and then, so it notices when
drafting starts paying again (a quote after chit-chat) at a bounded cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY = 0.85  # weight of the past in acceptance counts and timings, per observation
MIN_GAIN = 1.05  # a draft must promise this speed-up over a plain step
PROBE_EVERY = 24  # plain steps before the first probe while drafting does not pay
MAX_PROBE_EVERY = 384  # each probe that finds nothing doubles the wait, up to this
MAX_PROBE_OVERHEAD = 0.05  # probes may cost at most this share of the decoding time
PRIOR_ROW_COST = 0.35  # before any measurement: each extra verified row costs this many steps
PRIOR_ACCEPTANCE = 0.5
# A timing this many times the cost the averages predict is a one-off, not the price of the
# steps to come: a step compiled or captured as a graph (tens of seconds on a GPU, once a
# row count), a page-in. Averaged in, one such verification made its draft length look
# thousands of steps dear, and the probe spacing it implies then kept drafting off for good.
ONE_OFF_RATIO = 50.0


@dataclass
class _Rate:
    """A decayed ratio of successes to trials."""

    successes: float = PRIOR_ACCEPTANCE
    trials: float = 1.0
    decay: float = DECAY

    def add(self, successes: int, trials: int) -> None:
        self.successes = self.successes * self.decay + successes
        self.trials = self.trials * self.decay + trials

    @property
    def value(self) -> float:
        return self.successes / self.trials if self.trials else 0.0


@dataclass
class _Average:
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value * DECAY + sample * (1 - DECAY)


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens one verification yields: kept drafts plus the target's own token."""
    return sum(acceptance**i for i in range(drafts + 1))


@dataclass
class DraftController:
    max_draft: int = 8
    min_gain: float = MIN_GAIN
    probe_every: int = PROBE_EVERY
    _acceptance: dict[str, _Rate] = field(default_factory=dict)
    _plain_s: _Average = field(default_factory=_Average)
    # Verifying r rows costs a plain step times (1 + c (r - 1)); c per drafter (early exit
    # verifies only the upper layers).
    _row_cost: dict[str, _Average] = field(default_factory=dict)
    # Verifying k drafts, in plain steps, per (drafter family, k) as measured: the cost per
    # row grows past a few rows on a CPU (8 rows cost about 3.9 steps, 4 rows 1.7), so a
    # measured length replaces the straight line above.
    _verify_cost: dict[tuple[str, int], _Average] = field(default_factory=dict)
    _draft_s: dict[str, _Average] = field(default_factory=dict)  # per drafted token
    # Steps taken (plain or verified), and the step each drafter family last drafted at: a
    # drafter waits for its probe by its own family's silence, so another drafter's drafts
    # (the head's, on chat) do not starve prompt lookup of its probes.
    _steps: int = 0
    _last_draft: dict[str, int] = field(default_factory=dict)
    _probe_every: dict[str, int] = field(default_factory=dict)
    _probing: str | None = None

    def set_prior(self, drafter: str, acceptance: float, decay: float = DECAY) -> None:
        """Start from a measured acceptance (calibration) instead of the generic guess. A
        `decay` nearer 1 remembers longer, and the prior then weighs as much as a full
        memory of trials: for a drafter whose own gate already picks the steps it drafts
        on (the head's confidence), so that a few rejections in a row do not switch it off
        for a probe interval, while a lasting drop still does."""
        weight = 1.0 if decay == DECAY else 1.0 / (1.0 - decay)
        self._acceptance[drafter] = _Rate(acceptance * weight, weight, decay)

    def acceptance(self, drafter: str) -> float:
        return self._acceptance.setdefault(drafter, _Rate()).value

    def draft_length(self, drafter: str, available: int | None = None) -> int:
        """How many tokens `drafter` should draft now (0: take a plain step instead).
        `available` caps it for drafters that can offer only so many (prompt lookup)."""
        limit = self.max_draft if available is None else min(available, self.max_draft)
        if limit <= 0:
            return 0
        best, best_rate = 0, self.min_gain / self._plain_cost()
        a = self.acceptance(drafter)
        for k in range(1, limit + 1):
            rate = expected_tokens(a, k) / self._step_cost(drafter, k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and self._probe_due(drafter):
            self._probing = drafter
            return 1  # a cheap probe: is acceptance back up?
        return best

    def _probe_due(self, drafter: str) -> bool:
        """Whether `drafter`, not paying now, has been silent long enough for a probe."""
        # One probe clock per family, and one back-off: prompt lookup's match lengths would
        # each probe apart, and each back off only from its own failures.
        family = _family(drafter)
        wait = max(self._probe_every.get(family, self.probe_every), self._probe_spacing(drafter))
        return self._steps - self._last_draft.get(family, 0) >= wait

    def _probe_spacing(self, drafter: str) -> int:
        """Plain steps between probes that keep their cost to `MAX_PROBE_OVERHEAD` of the
        time: on a GPU, where plain steps replay a graph and a verification runs op by op,
        verifying one draft costs about 8 plain steps, and a probe every 24 steps made
        decoding a quarter to a third slower than with drafting off."""
        extra_steps = self._step_cost(drafter, 1) / self._plain_cost() - 1.0
        return math.ceil(extra_steps / MAX_PROBE_OVERHEAD)

    def predicted_gain(self, drafter: str, drafts: int) -> float:
        """Predicted speed-up over plain decoding of drafting `drafts` tokens now."""
        rate = expected_tokens(self.acceptance(drafter), drafts) / self._step_cost(drafter, drafts)
        return rate * self._plain_cost()

    def record_plain(self, seconds: float) -> None:
        plain = self._plain_s.value
        if plain is None or seconds <= ONE_OFF_RATIO * plain:
            self._plain_s.add(seconds)
        self._steps += 1

    def record_draft(
        self, drafter: str, drafted: int, accepted: int, draft_s: float, verify_s: float
    ) -> None:
        if self._probing == drafter:  # back off while the family's probes keep failing
            family = _family(drafter)
            wait = self._probe_every.get(family, self.probe_every)
            self._probe_every[family] = (
                min(2 * wait, MAX_PROBE_EVERY) if accepted == 0 else self.probe_every
            )
        self._probing = None
        trials = accepted + (1 if accepted < drafted else 0)
        self._acceptance.setdefault(drafter, _Rate()).add(accepted, trials)
        predicted = self._verifying_cost(drafter, drafted)
        if self._plain_s.value and verify_s <= ONE_OFF_RATIO * predicted:
            steps = verify_s / self._plain_s.value
            family = _family(drafter)
            self._row_cost.setdefault(family, _Average()).add(max((steps - 1) / drafted, 0.0))
            self._verify_cost.setdefault((family, drafted), _Average()).add(steps)
        if draft_s > 0:
            self._draft_s.setdefault(drafter, _Average()).add(draft_s / drafted)
        self._steps += 1
        self._last_draft[_family(drafter)] = self._steps

    def _plain_cost(self) -> float:
        return self._plain_s.value or 1.0

    def _step_cost(self, drafter: str, drafts: int) -> float:
        return self._verifying_cost(drafter, drafts) + self._drafting_cost(drafter, drafts)

    def _verifying_cost(self, drafter: str, drafts: int) -> float:
        verified = self._verify_cost.get((_family(drafter), drafts))
        if verified is not None and verified.value is not None:
            return self._plain_cost() * verified.value
        measured = self._row_cost.get(_family(drafter))
        row_cost = measured.value if measured and measured.value is not None else PRIOR_ROW_COST
        return self._plain_cost() * (1 + row_cost * drafts)

    def _drafting_cost(self, drafter: str, drafts: int) -> float:
        per_draft = self._draft_s.get(drafter)
        return per_draft.value * drafts if per_draft and per_draft.value else 0.0


def _family(drafter: str) -> str:
    """Drafters named "kind:variant" (prompt lookup per match length) share their costs."""
    return drafter.split(":", 1)[0]
