"""Tiny random llama-architecture GGUFs: our logits against llama.cpp's on the same file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q
from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from tiny_gguf import TinyLlama, write_tiny_llama

TOKENS = [1, *np.random.default_rng(0).integers(3, 259, 127).tolist()]

# (weights, embedding, tied head, min top-1 agreement, max |logit diff| / max |logit|)
# Float files: both engines compute in fp32 (llama.cpp keeps an f16 KV cache), so they agree
# closely. Quantized files: llama.cpp rounds activations to 8 bits per block of 32 and we
# round them to bf16, so each side carries ~0.5% noise per matmul.
CASES = [
    (Q.F32, Q.F32, True, 1.0, 0.002),
    (Q.F16, Q.F16, False, 1.0, 0.002),
    (Q.Q4_1, Q.Q8_0, True, 0.99, 0.03),
    (Q.Q4_0, Q.Q4_0, True, 0.99, 0.03),
    (Q.Q8_0, Q.Q8_0, True, 0.99, 0.03),
]


@pytest.mark.parametrize(
    "weights,embed,tied,min_agree,max_rel_diff", CASES, ids=lambda v: getattr(v, "name", str(v))
)
def test_tiny_llama_matches_llama_cpp(tmp_path, weights, embed, tied, min_agree, max_rel_diff):
    spec = TinyLlama(weight_type=weights, embed_type=embed, tied_output=tied)
    path = write_tiny_llama(tmp_path / "tiny.gguf", spec)
    ours = TorchRuntime(path, n_ctx=256).logits(TOKENS)
    oracle = LlamaCppRuntime(path, n_ctx=256, logits_all=True).logits(TOKENS)
    agreement = (ours.argmax(-1) == oracle.argmax(-1)).mean()
    rel_diff = np.abs(ours - oracle).max() / np.abs(oracle).max()
    assert agreement >= min_agree, agreement
    assert rel_diff <= max_rel_diff, rel_diff


def test_tiny_llama_untied_quantized_head(tmp_path):
    """A separate Q4_1 output head (its own tensor, 259 rows: padded in our packing)."""
    spec = TinyLlama(weight_type=Q.Q4_1, embed_type=Q.Q4_1, tied_output=False)
    path = write_tiny_llama(tmp_path / "tiny.gguf", spec)
    ours = TorchRuntime(path, n_ctx=256).logits(TOKENS)
    oracle = LlamaCppRuntime(path, n_ctx=256, logits_all=True).logits(TOKENS)
    # An untied random head has many near-tied logits, so top-1 is judged only where the
    # oracle's top two differ by more than the noise bound below.
    bound = 0.03 * np.abs(oracle).max()
    top2 = np.sort(oracle, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > bound
    assert clear.mean() > 0.5
    assert (ours.argmax(-1) == oracle.argmax(-1))[clear].all()
    assert np.abs(ours - oracle).max() <= bound
