"""The fused native decode layer (`native/decode_layer.py`): a one-token step through a whole
layer in one call must give bit for bit what the layer-by-layer path gives, for every KV
type, with a ring that wraps and sinks that move; and only layers of the shape it takes get
one."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import GEMMA3, QWEN2, write_tiny_model

from miniapp.engine.kv.types import kv_type
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.modelfile.store import DEFAULT_MODEL, bundled_path
from miniapp.engine.models import CachePolicy, build_model
from miniapp.engine.platform.kernels import FUSED_ENV

PROMPT = [300 + i for i in range(40)]
# 100 tokens through 4 sinks and a window of 16 (a ring of 16 + 64 slack): the ring wraps,
# and the sinks' frame moves every step. q4 keys' ring is whole tiles of 32 tokens, an even
# number of them (128): 170 tokens wrap it.
STEPS = 60
TILED_STEPS = 130


@pytest.fixture(scope="module")
def smollm2():
    return build_model(GGUFFile(bundled_path(DEFAULT_MODEL)))


def _decode(model, policy: CachePolicy, fused: bool, prompt=PROMPT, steps=STEPS):
    """Greedy steps after a prompt, with the fused layers on or off: logits of every step,
    and the caches afterwards."""
    layers = [block.fused for block in model.layers]
    try:
        for block, layer in zip(model.layers, layers, strict=True):
            block.fused = layer if fused else None
        caches = model.make_caches(policy)
        logits, token = [], 5
        with torch.inference_mode():
            model(torch.tensor(prompt), caches)
            for _ in range(steps):
                step = model(torch.tensor([token]), caches)
                logits.append(step)
                token = int(step.argmax())
        return torch.cat(logits), caches
    finally:
        for block, layer in zip(model.layers, layers, strict=True):
            block.fused = layer


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8", "q4"])
def test_a_fused_step_is_bit_identical_to_the_layer_by_layer_step(smollm2, kind):
    assert all(block.fused is not None for block in smollm2.layers)
    policy = CachePolicy(ctx=512, sinks=4, window=16, kv_type=kv_type(kind))
    steps = TILED_STEPS if kind == "q4" else STEPS
    fused_logits, fused_caches = _decode(smollm2, policy, fused=True, steps=steps)
    plain_logits, plain_caches = _decode(smollm2, policy, fused=False, steps=steps)
    assert fused_caches[0].wrapped and fused_caches[0].frame > 0
    assert torch.equal(fused_logits, plain_logits)
    for fused, plain in zip(fused_caches, plain_caches, strict=True):
        assert torch.equal(fused.keys, plain.keys) and torch.equal(fused.values, plain.values)
        assert torch.equal(fused.ring_pos, plain.ring_pos)


def test_a_fixed_context_cache_fuses_too_and_grows_through_the_ordinary_path(smollm2):
    # A fixed context's storage starts at 256 tokens and doubles: the step that needs more
    # room goes through update_and_fetch, the others through the fused layer.
    policy = CachePolicy(ctx=1024, streaming=False, kv_type=kv_type("q8"))
    prompt = [300 + i for i in range(250)]
    fused_logits, fused_caches = _decode(smollm2, policy, True, prompt, steps=12)
    plain_logits, plain_caches = _decode(smollm2, policy, False, prompt, steps=12)
    assert fused_caches[0].capacity == plain_caches[0].capacity == 512
    assert torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_caches[-1].keys, plain_caches[-1].keys)


def test_only_layers_of_the_shape_it_takes_are_fused(tmp_path, monkeypatch):
    llama = build_model(GGUFFile(write_tiny_model(tmp_path / "llama.gguf")))
    assert all(block.fused is not None for block in llama.layers)
    for spec in (GEMMA3, QWEN2):  # Q/K norms and post-norms; Q/K/V biases
        model = build_model(
            GGUFFile(write_tiny_model(tmp_path / f"{spec.architecture}.gguf", spec))
        )
        assert all(block.fused is None for block in model.layers), spec.architecture
    monkeypatch.setenv(FUSED_ENV, "0")
    off = build_model(GGUFFile(write_tiny_model(tmp_path / "off.gguf")))
    assert all(block.fused is None for block in off.layers)


def _fused_rows_counted(model, monkeypatch, call: str = "step") -> list[int]:
    """Records the row count of every fused call (`step`, or `step_sequences` for batched
    steps) from now on."""
    counted: list[int] = []
    for block in model.layers:
        step = getattr(block.fused, call)

        def counting(x, *args, _step=step, **kwargs):
            counted.append(x.shape[0])
            return _step(x, *args, **kwargs)

        monkeypatch.setattr(block.fused, call, counting)
    return counted


@pytest.mark.parametrize("kind", ["f32", "f16", "q8", "q4"])
@pytest.mark.parametrize("window", [200, 16], ids=["window-open", "ring-wrapped"])
@torch.inference_mode()
def test_verification_rows_run_fused_and_equal_decode_steps(smollm2, monkeypatch, kind, window):
    # Five rows of an exact-rows pass through one fused call a layer, where each row's decode
    # step would see a prefix of one storage; else (a wrapped ring, keys in q4 tiles) the
    # layer-by-layer path. Either way every row equals its own decode step bit for bit.
    policy = CachePolicy(ctx=512, sinks=4, window=window, kv_type=kv_type(kind))
    caches = smollm2.make_caches(policy)
    smollm2.hidden_states(torch.tensor(PROMPT), caches)
    rows = torch.tensor([500, 501, 502, 503, 504])
    one_by_one = torch.cat([smollm2.hidden_states(rows[i : i + 1], caches) for i in range(5)])
    keys_after_steps = caches[-1].keys.clone()
    for cache in caches:
        cache.trim(5)
    counted = _fused_rows_counted(smollm2, monkeypatch)
    verified = smollm2.hidden_states(rows, caches, exact_rows=True)
    assert torch.equal(verified, one_by_one)
    assert torch.equal(caches[-1].keys, keys_after_steps)
    fused = window > len(PROMPT) + 5 and kind != "q4"
    assert counted == ([5] * len(smollm2.layers) if fused else [])


def _batched_pass(model, kind: str, fused: bool, monkeypatch):
    """Three sequences at different lengths (one past its ring's wrap), then steps that
    batch their decode rows, and a step with a fourth sequence's prompt chunk beside them.
    Returns every step's hidden rows and the caches, with the fused layers on or off."""
    layers = [block.fused for block in model.layers]
    try:
        for block, layer in zip(model.layers, layers, strict=True):
            block.fused = layer if fused else None
        counted = _fused_rows_counted(model, monkeypatch, "step_sequences") if fused else []
        policy = CachePolicy(ctx=512, sinks=4, window=16, kv_type=kv_type(kind))
        prompts = [PROMPT[:7], PROMPT, PROMPT[:30], PROMPT[:25]]
        caches = [model.make_caches(policy) for _ in prompts]
        with torch.inference_mode():
            for prompt, sequence in zip(prompts[:3], caches, strict=False):
                model.hidden_states(torch.tensor(prompt), sequence)
            outputs = []
            for step in range(4):
                rows = [([600 + step + i], sequence) for i, sequence in enumerate(caches[:3])]
                if step == 2:  # a fresh cache's first prompt chunk beside the decode rows
                    rows.append((prompts[3][:12], caches[3]))
                if step == 3:  # and its next one
                    rows.append((prompts[3][12:20], caches[3]))
                outputs.append(model.hidden_segments(rows))
        return torch.cat(outputs), caches, counted
    finally:
        for block, layer in zip(model.layers, layers, strict=True):
            block.fused = layer


@pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
def test_batched_decode_rows_run_fused_and_equal_the_layer_by_layer_pass(
    smollm2, monkeypatch, kind
):
    # Several sequences' decode rows take one fused call a layer (continuous batching); a
    # prompt chunk a fused call cannot take goes beside them layer by layer. Rows and caches
    # come out bit for bit as without the fused layer.
    fused_rows, fused_caches, counted = _batched_pass(smollm2, kind, True, monkeypatch)
    plain_rows, plain_caches, _ = _batched_pass(smollm2, kind, False, monkeypatch)
    assert torch.equal(fused_rows, plain_rows)
    for fused, plain in zip(fused_caches, plain_caches, strict=True):
        assert torch.equal(fused[-1].keys, plain[-1].keys)
        assert torch.equal(fused[-1].values, plain[-1].values)
    # Three decode rows a call; the fresh cache's first chunk (its sinks fill first) goes
    # layer by layer beside them; its next chunk is exact rows of one storage, fused too
    # where the keys are not tiles.
    calls = counted[:: len(smollm2.layers)]
    assert calls == [3, 3, 3, 3 if kind == "q4" else 11]
