"""The generation loop shared by every runtime: text decoding, stops, limits, stats, events."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ..errors import ContextFullError
from ..runtimes.base import Runtime
from ..tokens.events import Finished, FinishReason, GenerationEvent, GenerationStats, TextDelta
from ..tokens.sampling import GenerationRequest, TokenLogprob
from ..tokens.stream import TokenStream
from ..tokens.tokenizer import IncrementalDecoder


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that might start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None  # the stop string found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to show, whether a stop string was hit)."""
        self._pending += text
        for stop in self.stops:
            at = self._pending.find(stop)
            if at >= 0:
                safe, self._pending = self._pending[:at], ""
                self.matched = stop
                return safe, True
        hold = self._longest_partial_stop()
        cut = len(self._pending) - hold
        safe, self._pending = self._pending[:cut], self._pending[cut:]
        return safe, False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _longest_partial_stop(self) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best


def _with_budget(request: GenerationRequest, runtime: Runtime, prompt_tokens: int):
    """The request's sampling settings, its constraint told the answer's token budget."""
    sampling = request.sampling
    if sampling.constraint is None:
        return sampling
    budget = request.max_tokens
    if not runtime.slides_past_ctx:
        budget = min(budget, runtime.n_ctx - prompt_tokens)
    return replace(sampling, constraint=sampling.constraint.within(budget))


def generate(
    runtime: Runtime,
    prompt: Sequence[int],
    request: GenerationRequest,
    should_stop: Callable[[], bool] = lambda: False,
    on_tokens: Callable[[TokenStream], None] | None = None,
) -> Iterator[GenerationEvent]:
    """Stream an answer to `prompt` as TextDelta events, then one Finished event.
    `on_tokens` receives the runtime's token stream as it opens: another thread may close
    it to cancel at once (a batched sequence still waiting for a slot, say)."""
    if not prompt:
        raise ValueError("empty prompt")
    if not runtime.slides_past_ctx and len(prompt) >= runtime.n_ctx:
        raise ContextFullError(
            f"prompt of {len(prompt)} tokens does not fit the context of {runtime.n_ctx}; "
            "raise --ctx or start a new chat"
        )
    start = time.perf_counter()
    decoder = IncrementalDecoder(runtime.tokenizer)
    stops = StopMatcher(request.stop)
    eog = frozenset() if request.ignore_end_of_turn else runtime.tokenizer.eog_ids
    reason = FinishReason.MAX_TOKENS
    generated = 0
    first_at = last_at = start
    tokens = runtime.generate_tokens(prompt, _with_budget(request, runtime, len(prompt)))
    if on_tokens is not None:
        on_tokens(tokens)
    unsent: list[TokenLogprob] = []  # logprobs of tokens whose text is not yielded yet
    try:
        for token in tokens:
            last_at = time.perf_counter()
            generated += 1
            if generated == 1:
                first_at = last_at
            if token in eog:
                reason = FinishReason.END_OF_TURN
                break
            if tokens.logprobs is not None:
                unsent.append(tokens.logprobs[generated - 1])
            text, hit = stops.push(decoder.push(token))
            if text:
                yield TextDelta(text, tuple(unsent))
                unsent.clear()
            if hit:
                reason = FinishReason.STOP_STRING
                break
            if generated >= request.max_tokens:
                break
            if should_stop():
                reason = FinishReason.CANCELLED
                break
            if not runtime.slides_past_ctx and len(prompt) + generated >= runtime.n_ctx:
                reason = FinishReason.CONTEXT_FULL
                break
    finally:
        tokens.close()
    if reason != FinishReason.STOP_STRING:
        tail = stops.push(decoder.flush())[0] + stops.flush()
        if tail:
            yield TextDelta(tail, tuple(unsent))
    evaluated = len(prompt) - tokens.cached_prompt_tokens
    ttft = first_at - start
    prefill_time = ttft - tokens.queued_s
    decode_time = last_at - first_at
    stats = GenerationStats(
        backend=runtime.backend,
        prompt_tokens=len(prompt),
        cached_prompt_tokens=tokens.cached_prompt_tokens,
        generated_tokens=generated,
        ttft_s=ttft,
        prefill_tok_s=evaluated / prefill_time if prefill_time > 0 else 0.0,
        decode_tok_s=(generated - 1) / decode_time if generated > 1 and decode_time > 0 else 0.0,
        speculation=tokens.speculation,
        queued_s=tokens.queued_s,
    )
    yield Finished(reason, stats, stop=stops.matched)
