"""Our own engine: a torch model built from the GGUF, with an explicit KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..gguf_file import GGUFFile
from ..memory import limit_heap_fragmentation
from ..models import build_model
from ..sampler import Sampler
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .base import DEFAULT_CTX, LOGIT_BLOCK, Runtime, common_prefix, default_threads

PREFILL_CHUNK = 512  # bounds the attention mask and activations of a long prompt


class TorchRuntime(Runtime):
    backend = "torch"

    def __init__(
        self,
        model_path: Path | str,
        n_ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        gguf: GGUFFile | None = None,
    ):
        self.model_path = Path(model_path)
        limit_heap_fragmentation()
        torch.set_num_threads(threads or default_threads())
        gguf = gguf or GGUFFile(self.model_path)
        self.model = build_model(gguf, n_ctx)
        self.chat_template = gguf.metadata.get("tokenizer.chat_template")
        self.architecture = gguf.architecture
        self.tokenizer = Tokenizer(self.model_path)
        self.n_ctx = n_ctx
        self.caches = self.model.make_caches(n_ctx)
        self._tokens: list[int] = []  # what the caches hold, position by position

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        # At least one prompt token must be evaluated to produce fresh logits.
        return min(common_prefix(self._tokens, prompt), len(prompt) - 1)

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[int]:
        sampler = Sampler(params)
        reuse = self.reusable_prefix(prompt)
        self._truncate(reuse)
        history = list(prompt)
        logits = self._feed(prompt[reuse:])
        while True:
            token = sampler(logits, history)
            yield token
            history.append(token)
            logits = self._feed([token])

    def reset(self) -> None:
        self._truncate(0)

    @torch.inference_mode()
    def logit_blocks(
        self, tokens: Sequence[int], first: int = 0, block: int = LOGIT_BLOCK
    ) -> Iterator[tuple[int, np.ndarray]]:
        caches = self.model.make_caches(len(tokens))
        hidden = torch.cat(
            [
                self.model.hidden_states(torch.tensor(tokens[i : i + PREFILL_CHUNK]), caches)
                for i in range(0, len(tokens), PREFILL_CHUNK)
            ]
        )
        # Only the rows asked for go through the output head, the costliest matmul here.
        for start in range(first, len(tokens), block):
            yield start, self.model.logits(hidden[start : start + block]).numpy()

    @torch.inference_mode()
    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens to the cache; returns fp32 logits [vocab] after the last one."""
        logits = None
        for i in range(0, len(tokens), PREFILL_CHUNK):
            chunk = list(tokens[i : i + PREFILL_CHUNK])
            logits = self.model(torch.tensor(chunk), self.caches)
            self._tokens.extend(chunk)
        assert logits is not None, "nothing to evaluate"
        return logits[0]

    def _truncate(self, n: int) -> None:
        """Keep the first n positions. Each cache is trimmed by its own offset: a step cut
        short (Ctrl-C inside a forward pass) leaves the first layers one token ahead."""
        del self._tokens[n:]
        for cache in self.caches:
            cache.trim(cache.offset - n)
