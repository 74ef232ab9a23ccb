"""LoRA adapter files (issue 51, first step): what llama.cpp's converter writes is read and
checked against its base model; anything else is one line naming the file and the cause."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import LLAMA, QWEN2, write_tiny_adapter, write_tiny_model

from miniapp.engine.errors import ModelFileError
from miniapp.engine.lora.adapter import AdapterError, read_adapter
from miniapp.engine.modelfile.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("lora") / "base.gguf", LLAMA)
    model = GGUFFile(path)
    yield model
    model.close()


def test_an_adapter_is_read_with_every_pair_in_the_bases_shapes(base, tmp_path):
    path = write_tiny_adapter(tmp_path / "a.gguf", base.path, rank=4, alpha=8.0)
    adapter = read_adapter(path, base)
    layers = base.arch_value("block_count")
    assert len(adapter.pairs) == 7 * layers and adapter.rank == 4
    for name, pair in adapter.pairs.items():
        outputs, inputs = base.tensors[name].shape
        assert pair.a.shape == (4, inputs) and pair.b.shape == (outputs, 4)
        assert pair.a.dtype == torch.float32
    pair = adapter.pairs["blk.0.attn_q.weight"]
    assert adapter.scaling(pair) == 2.0 and adapter.scaling(pair, 0.5) == 1.0
    assert adapter.nbytes == sum(p.a.numel() * 4 + p.b.numel() * 4 for p in adapter.pairs.values())


def test_the_values_are_the_files(base, tmp_path):
    a = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 100
    path = write_tiny_adapter(
        tmp_path / "a.gguf",
        base.path,
        targets=("attn_q",),
        tensors={"blk.1.attn_q.weight.lora_a": a},
    )
    pair = read_adapter(path, base).pairs["blk.1.attn_q.weight"]
    assert torch.equal(pair.a, torch.from_numpy(a))


def test_no_alpha_means_the_scale_alone(base, tmp_path):
    path = write_tiny_adapter(tmp_path / "a.gguf", base.path, metadata={"adapter.lora.alpha": None})
    adapter = read_adapter(path, base)
    assert adapter.alpha == 0.0
    assert adapter.scaling(next(iter(adapter.pairs.values())), 0.75) == 0.75


def test_f16_is_kept_and_f64_becomes_f32(base, tmp_path):
    half = read_adapter(write_tiny_adapter(tmp_path / "h.gguf", base.path, dtype=np.float16), base)
    assert next(iter(half.pairs.values())).a.dtype == torch.float16
    # llama.cpp crashes on f64 adapter tensors; we read them as f32.
    double = read_adapter(
        write_tiny_adapter(tmp_path / "d.gguf", base.path, dtype=np.float64), base
    )
    assert next(iter(double.pairs.values())).b.dtype == torch.float32


@pytest.mark.parametrize(
    "case, expected",
    [
        ("model", r"base\.gguf: not a LoRA adapter \(general\.type is 'model'"),
        ("no type", r"not a LoRA adapter \(it has no general\.type"),
        ("not lora", r"adapter\.type is 'control_vector', not 'lora'"),
        ("other base", r"an adapter for 'qwen2', but the model \(base\.gguf\) is 'llama'"),
        ("ranks differ", r"blk\.0\.attn_q\.weight: lora_a has rank 4, lora_b rank 3"),
        ("wrong shape", r"blk\.0\.attn_q\.weight: lora_a \[4, 32\] and lora_b .* do not fit"),
        ("half missing", r"blk\.0\.attn_k\.weight\.lora_b is missing"),
        ("unknown weight", r"blk\.9\.attn_q\.weight: the model has no such weight"),
        ("stray tensor", r"tensor blk\.0\.attn_q\.weight is not a LoRA tensor"),
        ("embedding", r"token_embd\.weight: adapters on the token embedding are not read"),
        ("not finite", r"blk\.0\.attn_v\.weight\.lora_a holds values that are not finite"),
        ("negative alpha", r"adapter\.lora\.alpha is -1\.0"),
        ("missing", r"missing\.gguf: no such adapter file"),
    ],
)
def test_a_bad_adapter_is_one_line_naming_the_file_and_the_cause(base, tmp_path, case, expected):
    path = tmp_path / ("missing.gguf" if case == "missing" else "adapter.gguf")
    q = "blk.0.attn_q.weight"
    kinds = {
        "no type": {"metadata": {"general.type": None}},
        "not lora": {"metadata": {"adapter.type": ("control_vector", GGUFValueType.STRING)}},
        "ranks differ": {"tensors": {q + ".lora_b": np.ones((64, 3), np.float32)}},
        "wrong shape": {"tensors": {q + ".lora_a": np.ones((4, 32), np.float32)}},
        "half missing": {"tensors": {"blk.0.attn_k.weight.lora_b": None}},
        "unknown weight": {
            "tensors": {
                "blk.9.attn_q.weight.lora_a": np.ones((4, 64), np.float32),
                "blk.9.attn_q.weight.lora_b": np.ones((64, 4), np.float32),
            }
        },
        "stray tensor": {"tensors": {q: np.ones((64, 64), np.float32)}},
        "embedding": {
            "tensors": {
                "token_embd.weight.lora_a": np.ones((4, 64), np.float32),
                "token_embd.weight.lora_b": np.ones((len(LLAMA.vocab), 4), np.float32),
            }
        },
        "not finite": {
            "tensors": {"blk.0.attn_v.weight.lora_a": np.full((4, 64), np.nan, np.float32)}
        },
        "negative alpha": {"alpha": -1.0},
    }
    if case == "model":  # a model (a merged one, say) handed over as an adapter
        model_type = {"general.type": ("model", GGUFValueType.STRING)}
        path = write_tiny_model(tmp_path / "base.gguf", LLAMA, metadata=model_type)
    elif case == "other base":
        other = write_tiny_model(tmp_path / "qwen.gguf", QWEN2)
        write_tiny_adapter(path, other)
    elif case != "missing":
        write_tiny_adapter(path, base.path, **kinds[case])
    with pytest.raises(AdapterError, match=expected) as raised:
        read_adapter(path, base)
    assert "\n" not in str(raised.value)


def test_a_corrupt_adapter_is_the_readers_one_line(base, tmp_path):
    path = write_tiny_adapter(tmp_path / "a.gguf", base.path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError, match=r"a\.gguf: ") as raised:
        read_adapter(path, base)
    assert "\n" not in str(raised.value)


def _llama_cpp_logits(model, tokens, lora=None):
    from miniapp.engine.llamacpp.library import llama_cpp

    options = {} if lora is None else {"lora_path": str(lora), "lora_scale": 1.0}
    llm = llama_cpp.Llama(str(model), n_ctx=64, logits_all=True, verbose=False, **options)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])
    finally:
        llm.close()


def test_llama_cpp_applies_an_adapter_as_its_merged_weights(tmp_path):
    """The oracle agrees with what we read: base + adapter in llama.cpp computes what a model
    whose weights are W + s B A computes, s = alpha / rank (and a zero B changes nothing)."""
    spec = dataclasses.replace(LLAMA, weight_type=Q.F32)
    base_path = write_tiny_model(tmp_path / "base.gguf", spec)
    base = GGUFFile(base_path)
    adapter_path = write_tiny_adapter(tmp_path / "a.gguf", base_path, rank=4, alpha=2.0)
    adapter = read_adapter(adapter_path, base)
    merged = {}
    for name, pair in adapter.pairs.items():
        info = base.tensors[name]
        weight = base.raw(info).view(torch.float32).reshape(info.shape).double()
        delta = adapter.scaling(pair) * (pair.b.double() @ pair.a.double())
        merged[name] = (weight + delta).numpy()
    base.close()
    merged_path = write_tiny_model(tmp_path / "merged.gguf", spec, weights=merged)
    zero = write_tiny_adapter(tmp_path / "zero.gguf", base_path, zero_b=True)
    tokens = list(range(5, 37))
    plain = _llama_cpp_logits(base_path, tokens)
    adapted = _llama_cpp_logits(base_path, tokens, adapter_path)
    assert np.abs(adapted - plain).max() > 0.1  # the adapter changes the answer
    np.testing.assert_allclose(adapted, _llama_cpp_logits(merged_path, tokens), atol=2e-3)
    np.testing.assert_array_equal(_llama_cpp_logits(base_path, tokens, zero), plain)


def test_a_q8_0_adapter_is_read_as_its_dequantized_values(base, tmp_path):
    """llama.cpp's converter writes Q8_0 adapters too (--outtype q8_0)."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    source = read_adapter(write_tiny_adapter(tmp_path / "f.gguf", base.path), base)
    writer = GGUFWriter(str(tmp_path / "q8.gguf"), base.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", source.alpha)
    for name, pair in source.pairs.items():
        for suffix, values in ((".lora_a", pair.a), (".lora_b", pair.b)):
            if values.shape[1] % 32:  # Q8_0 blocks are 32 values of a row
                writer.add_tensor(name + suffix, values.numpy())
                continue
            blocks = quantize(values.numpy(), Q.Q8_0)
            writer.add_tensor(name + suffix, blocks, raw_shape=blocks.shape, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_adapter(tmp_path / "q8.gguf", base)
    assert read.pairs.keys() == source.pairs.keys()
    pair, original = read.pairs["blk.0.attn_q.weight"], source.pairs["blk.0.attn_q.weight"]
    assert pair.a.dtype == torch.float16
    torch.testing.assert_close(pair.a.float(), original.a, atol=0.02, rtol=0.02)
    assert not torch.equal(pair.a.float(), original.a)  # quantized, then read back
