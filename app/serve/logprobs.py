"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` (one object per
token, with its bytes and top alternatives) and the legacy completions' parallel lists."""

from __future__ import annotations

from collections.abc import Sequence

from miniapp.engine.api import TokenLogprob


def _token(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer) -> dict:
    def one(token: int, logprob: float) -> dict:
        text, raw = _token(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], tokenizer, offset: int) -> dict:
    """`offset`: characters of the choice's text before the first of these tokens."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        text = _token(tokenizer, entry.token)[0]
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token(tokenizer, t)[0]: lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
