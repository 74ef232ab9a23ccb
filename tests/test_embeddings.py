"""Embeddings from the torch engine: pooled final-normed hidden states at unit length, the
same for a text alone or in a batch, and close to llama.cpp's (llama-cpp-python with
`embedding=True`) on the same GGUF."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from gguf import GGUFValueType
from tiny_gguf import QWEN3, write_tiny_model

from miniapp.engine.api import MiniappError, Pooling, resolve_model
from miniapp.engine.runtimes.embedding import model_pooling
from miniapp.engine.runtimes.torch_runtime import TorchRuntime

TEXTS = (
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "def add(a, b):\n    return a + b",
    "A quick brown fox jumps over the lazy dog. " * 30,  # longer than one exact chunk
    "hello",
    "Embeddings map text to vectors.",
    "Ünïcödé text ✓ and emoji 🙂",
    "x",
)
LLAMA_POOLING = {Pooling.MEAN: 1, Pooling.LAST: 3}


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def model(request):
    path = resolve_model(request.param)
    return path, TorchRuntime(path, n_ctx=1024, spec="off")


@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.LAST])
def test_a_text_gets_the_same_vector_alone_and_in_a_batch_of_eight(model, pooling):
    _, runtime = model
    prompts = [runtime.tokenizer.encode(t) for t in TEXTS]
    batch = runtime.embed(prompts, pooling)
    alone = np.stack([runtime.embed([p], pooling)[0] for p in prompts])
    assert batch.shape == (len(TEXTS), runtime.model.config.dim)
    assert np.array_equal(batch, alone)
    reordered = runtime.embed(prompts[::-1], pooling)[::-1]
    assert np.array_equal(batch, reordered)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.LAST])
def test_vectors_are_within_cosine_0_99_of_llama_cpps(model, pooling):
    path, runtime = model
    ours = runtime.embed([runtime.tokenizer.encode(t) for t in TEXTS], pooling)
    llm = llama_cpp.Llama(
        str(path),
        embedding=True,
        pooling_type=LLAMA_POOLING[pooling],
        n_ctx=1024,
        n_batch=1024,
        n_ubatch=1024,
        verbose=False,
    )
    try:
        theirs = np.array([llm.embed(t, normalize=True) for t in TEXTS])
    finally:
        llm.close()
    cosine = (ours * theirs).sum(axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.99, cosine
    # Different texts are told apart: not one vector for everything.
    assert (ours[0] @ ours[2]) < 0.99


def test_pooling_follows_the_gguf_and_defaults_to_mean(tmp_path):
    plain = write_tiny_model(tmp_path / "plain.gguf", QWEN3)
    last = write_tiny_model(
        tmp_path / "last.gguf", QWEN3, metadata={"qwen3.pooling_type": (3, GGUFValueType.UINT32)}
    )
    assert model_pooling(plain, "qwen3") is None
    assert model_pooling(last, "qwen3") is Pooling.LAST
    assert TorchRuntime(plain, n_ctx=64, spec="off").default_pooling() is Pooling.MEAN
    assert TorchRuntime(last, n_ctx=64, spec="off").default_pooling() is Pooling.LAST


def test_an_empty_text_has_no_embedding(model):
    _, runtime = model
    with pytest.raises(MiniappError, match="empty text"):
        runtime.embed([[]], Pooling.MEAN)


def test_relevance_is_the_probability_of_yes_against_no_at_the_answers_first_token(model):
    from miniapp.engine.api import ChatTemplate, judgement_prompt, relevance

    _, runtime = model
    template = ChatTemplate.for_model(
        runtime.chat_template, runtime.tokenizer, runtime.architecture
    )
    documents = ["Paris is the capital of France.", "Bananas are yellow."]
    prompts = [
        judgement_prompt(runtime, template, "What is France's capital?", d) for d in documents
    ]
    scores = relevance(runtime, prompts)
    encode = runtime.tokenizer.encode
    for prompt, score in zip(prompts, scores, strict=True):
        row = runtime.logits(prompt)[-1].astype(np.float64)
        yes = {encode(w, add_bos=False)[0] for w in ("yes", "Yes")}
        no = {encode(w, add_bos=False)[0] for w in ("no", "No")}
        mass = {t: np.exp(row[t] - row.max()) for t in yes | no}
        expected = sum(mass[t] for t in yes) / sum(mass.values())
        assert abs(score - expected) < 1e-9 and 0 < score < 1
    assert scores[0] != scores[1]
