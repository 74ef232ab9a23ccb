"""Tiny random-weight GGUFs for every supported architecture: our logits against llama.cpp's
on the same file. Architectures with no real weights on this machine are still checked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import GEMMA3, LLAMA, PHI3, QWEN2, QWEN3, TinyModel, write_tiny_model

from miniapp.engine.ops import layers
from miniapp.engine.ops.layers import Int4Linear
from miniapp.engine.ops.quant import layout_for
from miniapp.engine.platform.kernels import GGML_ENV
from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
from miniapp.engine.runtimes.torch_runtime import TorchRuntime

# 128 tokens: past Gemma's 8-token test window many times over.
TOKENS = [1, *np.random.default_rng(0).integers(3, 259, 127).tolist()]
ARCHITECTURES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "phi3": PHI3, "gemma3": GEMMA3}

# Bounds. Float files: both engines compute in fp32 (llama.cpp keeps an f16 KV cache), so
# logits differ by well under 1% of their range. Quantized files: llama.cpp rounds
# activations to 8 bits per block of 32 and we round them (and the group scales) to bf16,
# each side ~0.5% per matmul, so up to 3% of the logit range. Top-1 must agree on >= 99%.
FLOAT_BOUND, QUANT_BOUND, MIN_AGREEMENT = 0.005, 0.03, 0.99
WEIGHT_TYPES = {
    "f32": (Q.F32, Q.F32, None),
    "f16": (Q.F16, Q.F16, None),
    "bf16": (Q.BF16, Q.BF16, None),
    "q4_0": (Q.Q4_0, Q.Q4_0, None),
    "q4_1+q8_0": (Q.Q4_1, Q.Q8_0, None),
    "q5_0": (Q.Q5_0, Q.Q8_0, None),
    "q5_1": (Q.Q5_1, Q.Q5_1, None),
    "q8_0": (Q.Q8_0, Q.Q8_0, None),
}
# K-quants come in blocks of 256 columns: wider tiny models, K-quant FFN down projections.
K_QUANT_TYPES = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}


def _compare(path):
    ours = TorchRuntime(path, n_ctx=256).logits(TOKENS)
    oracle = LlamaCppRuntime(path, n_ctx=256, logits_all=True).logits(TOKENS)
    agreement = (ours.argmax(-1) == oracle.argmax(-1)).mean()
    relative = np.abs(ours - oracle).max() / np.abs(oracle).max()
    return agreement, relative


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("types", WEIGHT_TYPES)
def test_tiny_model_matches_llama_cpp(tmp_path, arch, types):
    weights, embed, _ = WEIGHT_TYPES[types]
    spec = dataclasses.replace(ARCHITECTURES[arch], weight_type=weights, embed_type=embed)
    agreement, relative = _compare(write_tiny_model(tmp_path / "tiny.gguf", spec))
    bound = FLOAT_BOUND if weights in (Q.F32, Q.F16) else QUANT_BOUND
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= bound, relative


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("k_type", K_QUANT_TYPES)
def test_tiny_model_with_k_quants_matches_llama_cpp(tmp_path, arch, k_type):
    spec = dataclasses.replace(
        ARCHITECTURES[arch],
        dim=256,
        ffn_dim=256,
        head_dim=64,  # 4 heads x 64 = 256 columns: a whole K-quant block
        weight_type=Q.Q4_K,
        down_type=K_QUANT_TYPES[k_type],
    )
    agreement, relative = _compare(write_tiny_model(tmp_path / "tiny.gguf", spec))
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= QUANT_BOUND, relative


# The type mixes of the files people download, as llama-quantize writes them: Q4_K_M (Q4_K
# with Q6_K values, down projections and embedding), Q5_K_M (Q5_K with the same Q6_K ones)
# and Q8_0. Their weights are read from the file's own blocks (the GGML kernel).
FILE_MIXES = {
    "q4_k_m": dict(weight_type=Q.Q4_K, value_type=Q.Q6_K, down_type=Q.Q6_K, embed_type=Q.Q6_K),
    "q5_k_m": dict(weight_type=Q.Q5_K, value_type=Q.Q6_K, down_type=Q.Q6_K, embed_type=Q.Q6_K),
    "q8_0": dict(weight_type=Q.Q8_0, embed_type=Q.Q8_0),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mix", FILE_MIXES)
def test_the_type_mixes_of_downloaded_files_match_llama_cpp(tmp_path, arch, mix):
    spec = dataclasses.replace(
        ARCHITECTURES[arch], dim=256, ffn_dim=256, head_dim=64, n_kv_heads=4, **FILE_MIXES[mix]
    )
    agreement, relative = _compare(write_tiny_model(tmp_path / "tiny.gguf", spec))
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= QUANT_BOUND, relative


def test_a_gpus_one_product_for_mixed_layouts_matches_llama_cpp(tmp_path, monkeypatch):
    """A GPU's weights for a Q4_K_M file: torch's int4 layout, Q|K (Q4_K) widened into V's
    Q6_K layout so that Q|K|V is one product (computed here on the CPU), with Qwen's bias."""
    monkeypatch.setenv(GGML_ENV, "0")  # every type through the int4 layout, as on a GPU
    monkeypatch.setattr(layers, "one_product_across_layouts", lambda target: True)
    spec = dataclasses.replace(
        QWEN2, dim=256, ffn_dim=256, head_dim=64, n_kv_heads=4, **FILE_MIXES["q4_k_m"]
    )
    path = write_tiny_model(tmp_path / "tiny.gguf", spec)
    block = TorchRuntime(path, n_ctx=256).model.layers[0]
    assert isinstance(block.attention.wqkv, Int4Linear)
    assert block.attention.wqkv.layout == layout_for(Q.Q6_K)
    agreement, relative = _compare(path)
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= QUANT_BOUND, relative


def test_sliding_window_is_what_llama_cpp_computes(tmp_path):
    """The same Gemma file with the window widened past the sequence gives different logits,
    so the 8-token window really shapes the result that matched llama.cpp above."""
    narrow = write_tiny_model(
        tmp_path / "narrow.gguf", dataclasses.replace(GEMMA3, weight_type=Q.F32)
    )
    wide_spec = dataclasses.replace(GEMMA3, weight_type=Q.F32, sliding_window=1024)
    wide = write_tiny_model(tmp_path / "wide.gguf", wide_spec)
    ours_narrow = TorchRuntime(narrow, n_ctx=256).logits(TOKENS)
    ours_wide = TorchRuntime(wide, n_ctx=256).logits(TOKENS)
    assert np.abs(ours_narrow[:8] - ours_wide[:8]).max() < 1e-4  # within the window: same
    assert np.abs(ours_narrow[20:] - ours_wide[20:]).max() > 0.1


def test_untied_quantized_head(tmp_path):
    """A separate Q4_1 output head (its own tensor, 259 rows: padded in our packing)."""
    spec = TinyModel(weight_type=Q.Q4_1, embed_type=Q.Q4_1, tied_output=False)
    agreement, relative = _compare(write_tiny_model(tmp_path / "tiny.gguf", spec))
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= QUANT_BOUND, relative
