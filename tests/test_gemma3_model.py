"""The bundled Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors, sliding-window
layers) on our engine, with llama.cpp as the oracle."""

from __future__ import annotations

import pytest

from miniapp.assets import sample_texts
from miniapp.engine.chat.generation import GenerationRequest, generate
from miniapp.engine.evaluation.perplexity import perplexity
from miniapp.engine.modelfile.store import resolve_model
from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.events import Finished, TextDelta
from miniapp.engine.tokens.sampling import GREEDY

# Chunks of 1024 with their second halves scored: every scored token is past the local
# layers' 512-token window, so the window shapes the result. (The benchmark notes also give
# --ctx 2048, as the issue asks; that takes about a minute a backend.)
CTX = 1024
GEMMA_TEXT_CHARS = 16_500


@pytest.fixture(scope="module")
def gemma_path():
    return resolve_model("gemma3-270m")


def test_gemma3_perplexity_within_one_percent_of_llama_cpp(gemma_path):
    # Three chunks of 1024 (about 3300 of the sample texts' 5200 tokens): each chunk runs
    # past the local layers' 512-token window, and a 262k-token head over 1500 scored rows
    # is most of this test's time in both engines.
    text = "\n\n".join(sample_texts())[:GEMMA_TEXT_CHARS]
    ours = perplexity(TorchRuntime(gemma_path, n_ctx=CTX), text, CTX)
    oracle = perplexity(LlamaCppRuntime(gemma_path, n_ctx=CTX, logits_all=True), text, CTX)
    assert ours.chunks == 3 and ours.tokens == oracle.tokens
    assert abs(ours.ppl - oracle.ppl) / oracle.ppl <= 0.01, (ours.ppl, oracle.ppl)
    assert 5 < ours.ppl < 100


def test_gemma3_generates(gemma_path):
    runtime = TorchRuntime(gemma_path, n_ctx=256)
    assert runtime.model.config.sliding_window == 512
    assert sum(runtime.model.config.local_layers) == 15  # 5 local to 1 global, 18 layers
    prompt = runtime.tokenizer.encode("The capital of France is")
    events = list(generate(runtime, prompt, GenerationRequest(max_tokens=8, sampling=GREEDY)))
    assert isinstance(events[-1], Finished)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    # A base model: llama.cpp's greedy continuation here is " the capital of the country of
    # France." and so is ours; a broken layer gives noise.
    assert "capital of the country of France" in text, text
