"""The speculative generation loop: draft, verify in one pass, keep what the target agrees
with, roll the caches back over the rest.

Every token yielded is the one plain decoding would yield (greedy), or is distributed as
plain decoding's (sampling). Verification computes each row exactly as a decode step would
(`exact_rows`), so greedy output matches plain decoding token for token, not merely up to
rounding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ..kv.cache import Cache
from ..models.decoder import DecoderModel
from ..tokens.events import SpeculationStats
from ..tokens.sampler import Sampler
from .acceptance import Verdict, accept_greedy, accept_sampled
from .controller import DraftController
from .drafter import Draft, Drafter, Verified, VerifiedFromTokens

# tokens -> (final-normed states [rows, dim], fp32 logits [rows, vocab]), or None
RowsVerifier = Callable[[Sequence[int]], tuple[torch.Tensor, torch.Tensor] | None]
# (token fed, history) -> the next token, drawn on the device by the sequence's sampler,
# or None where it must be sampled on the host from the logits
PlainDraw = Callable[[int, Sequence[int]], int | None]


class SpeculativeDecoder:
    """One generation's loop. `fed` is the runtime's record of the tokens in the caches; it
    is extended only once the caches hold exactly those tokens, so an interruption at any
    point leaves the runtime able to trim back to a consistent state."""

    def __init__(
        self,
        model: DecoderModel,
        caches: list[Cache],
        fed: list[int],
        sampler: Sampler,
        controller: DraftController,
        drafters: Sequence[Drafter],
        mode: str,
        decode_one: Callable[[int], torch.Tensor] | None = None,
        stats: SpeculationStats | None = None,
        verify_rows: RowsVerifier | None = None,
        draw_one: PlainDraw | None = None,
    ):
        """`decode_one(token) -> logits [vocab]` takes a plain step (the runtime's may replay a
        graph); by default an ordinary pass over `caches`. `verify_rows(tokens)` verifies
        drafts made from tokens alone in one fixed-shape step, returning (states, logits),
        or None where it cannot (the drafter's own verification then runs). `draw_one`
        takes a plain step whose token is drawn on the device, where it can: only the id
        comes back, not the logits (the batching scheduler sets it, as it may queue the
        step ahead). `stats` to
        count into (a batching scheduler keeps one per sequence across the stretches it
        drafts alone)."""
        self.model, self.caches, self.fed = model, caches, fed
        self.decode_one = decode_one or self._ordinary_step
        self.verify_rows = verify_rows
        self.draw_one = draw_one
        self.sampler, self.controller = sampler, controller
        self.drafters = list(drafters)  # asked in order; the first proposal is verified
        self.stats = stats or SpeculationStats(mode)
        # Drafters that draft from the model's last state (the trained head) are told it
        # after every step; plain steps then run the ordinary pass, which yields it.
        self._state_watchers = [d for d in self.drafters if hasattr(d, "observe_state")]
        # Called before a verification (the batching scheduler's: it takes back a plain
        # step it queued ahead, fed the token the verification feeds instead).
        self.before_verify: Callable[[], None] | None = None

    def run(self, logits: torch.Tensor, history: list[int]) -> Iterator[int]:
        """`logits` follow `history` (the prompt, already in the caches); yields tokens."""
        for drafter in self.drafters:
            drafter.observe(history)
        pending = self.sampler(logits, history)
        while True:
            self._accept([pending], history)
            yield pending
            new = self._step(pending, history)
            yield from new[:-1]
            pending = new[-1]

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens of the sequence so far, for drafters that draft from it (prompt lookup)."""
        for drafter in self.drafters:
            drafter.observe(tokens)

    def advance(self, history: list[int]) -> list[int]:
        """One step for a caller that runs its own loop (the batching scheduler): the last
        token of `history` is sampled but not fed yet, and every earlier one was observed.
        Feeds it, and returns the tokens that follow (one, or accepted drafts and one more),
        appended to `history`; the last of them is not fed yet."""
        pending = history[-1]
        self.observe([pending])
        new = self._step(pending, history)
        history.append(new[-1])
        self.stats.emitted += 1  # the kept drafts are counted as accepted, this one here
        return new

    def _accept(self, tokens: Sequence[int], history: list[int]) -> None:
        history.extend(tokens)
        self.stats.emitted += len(tokens)
        for drafter in self.drafters:
            drafter.observe(tokens)

    @property
    def plain_steps_drawn(self) -> bool:
        """Whether its plain steps go through `draw_one` (not where they feed drafters the
        model's state): a step queued ahead is then either one of them, or taken back by
        `before_verify`."""
        return self.draw_one is not None and not self._state_watchers

    @torch.inference_mode()
    def _step(self, pending: int, history: list[int]) -> list[int]:
        """Feed `pending`; returns the tokens that follow it (the last one not fed yet). The
        tokens before the last are already appended to `history`."""
        for drafter in self.drafters:
            draft = drafter.propose(pending, self.controller, self.caches, self.sampler, history)
            if draft is not None:
                return self._verify(drafter, draft, history)
        return [self._plain(pending, history)]

    def _ordinary_step(self, token: int) -> torch.Tensor:
        hidden = self.model.hidden_states(torch.tensor([token]), self.caches)
        return self.model.logits(hidden)[0]

    def _plain(self, pending: int, history: list[int]) -> int:
        start = time.perf_counter()
        if self._state_watchers:
            state = self.model.hidden_states(torch.tensor([pending]), self.caches)
            logits = self.model.logits(state)[0]
            self._tell_state(state)
            self.fed.append(pending)
            token = self.sampler(logits, history)
        else:
            token = self._drawn_plain(pending, history)
        self.controller.record_plain(time.perf_counter() - start)
        self.stats.steps += 1
        return token

    def _drawn_plain(self, pending: int, history: list[int]) -> int:
        """A plain step's token: drawn on the device where it can be, else sampled from the
        step's logits on the host."""
        drawn = None if self.draw_one is None else self.draw_one(pending, history)
        if drawn is not None:
            self.fed.append(pending)
            return drawn
        logits = self.decode_one(pending)
        self.fed.append(pending)
        return self.sampler(logits, history)

    def _verify(self, drafter: Drafter, draft: Draft, history: list[int]) -> list[int]:
        start = time.perf_counter()  # what a step queued ahead and taken back costs, too
        if self.before_verify is not None:
            self.before_verify()
        verified = self._verified(drafter, draft)
        verdict = self._judge(draft.tokens, draft.probs, verified.logits, history)
        self._tell_state(verified.states[verdict.accepted : verdict.accepted + 1])
        verify_s = time.perf_counter() - start
        self._finish(draft.key, draft.pending, draft.tokens, verdict, draft.seconds, verify_s)
        return self._emit(draft.tokens, verdict, history)

    def _verified(self, drafter: Drafter, draft: Draft) -> Verified:
        if self.verify_rows is not None and isinstance(drafter, VerifiedFromTokens):
            rows = self.verify_rows([draft.pending, *draft.tokens])
            if rows is not None:
                return Verified(*rows)
        return drafter.verify(self.caches, draft)

    def _tell_state(self, state: torch.Tensor) -> None:
        """The final-normed state [1, dim] whose logits gave the token to be fed next."""
        for watcher in self._state_watchers:
            watcher.observe_state(state)

    def _judge(
        self,
        drafts: list[int],
        draft_probs: list[torch.Tensor] | None,
        logits: torch.Tensor,
        history: list[int],
    ) -> Verdict:
        sampler = self.sampler
        if sampler.params.greedy:
            return accept_greedy(drafts, lambda j: sampler(logits[j], [*history, *drafts[:j]]))
        return accept_sampled(
            drafts,
            draft_probs or [None] * len(drafts),
            lambda j: sampler.distribution(logits[j], [*history, *drafts[:j]]),
            sampler.uniform,
            sampler.draw,
        )

    def _finish(
        self,
        drafter: str,
        pending: int,
        drafts: list[int],
        verdict: Verdict,
        draft_s: float,
        verify_s: float,
    ) -> None:
        """Roll every cache back to [.., pending, kept drafts] and record the outcome."""
        rejected = len(drafts) - verdict.accepted
        for cache in self.caches:
            cache.trim(rejected)
        self.fed.extend([pending, *drafts[: verdict.accepted]])
        self.controller.record_draft(drafter, len(drafts), verdict.accepted, draft_s, verify_s)
        self.stats.count(drafter, len(drafts), verdict.accepted)

    def _emit(self, drafts: list[int], verdict: Verdict, history: list[int]) -> list[int]:
        kept = drafts[: verdict.accepted]
        self._accept(kept, history)
        return [*kept, verdict.next_token]
