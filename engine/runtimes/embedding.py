"""Text embeddings from a decoder model: its final-normed hidden states (what llama.cpp calls
the model's embeddings), pooled over a text's tokens and scaled to unit length.

How a text's rows are pooled follows the GGUF's `<arch>.pooling_type` where the file says
(embedding models such as Qwen3-Embedding write "last"), else mean pooling, which suits a
chat model's states best; a caller may choose instead. A text's vector depends on that text
alone: its rows are computed as a lone sequence's would be, whatever else is in the batch.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import numpy as np

from ..errors import MiniappError
from ..modelfile.gguf_file import read_scalar


class Pooling(StrEnum):
    MEAN = "mean"  # the average of every token's state
    LAST = "last"  # the last token's (it has seen the whole text)


# No "cls" (the first token's state): in a causal model the first token sees only itself, so
# every text would get the same vector. Encoders pool that way; we run decoders only.


POOLING_CHOICES = tuple(p.value for p in Pooling)
# llama.cpp's enum llama_pooling_type, as GGUF files store it.
_GGUF_POOLING = {1: Pooling.MEAN, 3: Pooling.LAST}


def model_pooling(path: Path | str, architecture: str) -> Pooling | None:
    """The pooling the GGUF asks for, or None where it names none (or none we do)."""
    try:
        value = read_scalar(path, f"{architecture}.pooling_type")
    except MiniappError:
        return None
    return _GGUF_POOLING.get(value) if isinstance(value, int) else None


class PooledRows:
    """One text's pooled state, fed its rows chunk by chunk (in float64, in row order, so
    the sum does not depend on how the text was chunked into passes with others)."""

    def __init__(self, pooling: Pooling, dim: int):
        self.pooling = pooling
        self.total = np.zeros(dim, dtype=np.float64)
        self.rows = 0

    def add(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        if self.pooling is Pooling.MEAN:
            for row in rows.astype(np.float64):  # one row at a time: a fixed order of sums
                self.total += row
        else:
            self.total = rows[-1].astype(np.float64)
        self.rows += len(rows)

    def vector(self) -> np.ndarray:
        """The pooled state at unit length (L2), fp32."""
        pooled = self.total / self.rows if self.pooling is Pooling.MEAN else self.total
        norm = np.linalg.norm(pooled)
        return (pooled / norm if norm > 0 else pooled).astype(np.float32)
